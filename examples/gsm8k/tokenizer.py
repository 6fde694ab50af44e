"""An offline byte-level tokenizer with a ChatML chat template, for random-init models and tests.

Every UTF-8 byte is one token (ids 0-255), then ``<|im_end|>`` (EOS, 256), ``<|endoftext|>`` (pad, 257) and
``<|im_start|>`` (258): 259 tokens, no merges, nothing to download. Prompts are about four times longer in tokens
than with a real BPE tokenizer, which only makes a memory measurement more conservative.

``byte_tokenizer(ascii_only=True)`` is the same over the 128 ASCII bytes (131 tokens: EOS 128, pad 129, im_start
130; other characters are dropped when encoding), for a smaller vocabulary. Both put the special tokens last: EOS,
pad, im_start are the vocabulary's last three ids.
"""

from __future__ import annotations

__all__ = [
    "byte_tokenizer",
    "CHATML_TEMPLATE",
    "BYTE_VOCAB_SIZE",
    "ASCII_VOCAB_SIZE",
    "EOS_TOKEN",
    "PAD_TOKEN",
    "BOS_TOKEN",
]

CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
EOS_TOKEN, PAD_TOKEN, BOS_TOKEN = "<|im_end|>", "<|endoftext|>", "<|im_start|>"
BYTE_VOCAB_SIZE = 259  # 256 bytes, EOS 256, pad 257, im_start 258
ASCII_VOCAB_SIZE = 131  # 128 ASCII bytes, EOS 128, pad 129, im_start 130


def byte_tokenizer(ascii_only: bool = False):
    """A ``PreTrainedTokenizerFast`` over bytes with ChatML special tokens (EOS ``<|im_end|>``, pad
    ``<|endoftext|>``, ``<|im_start|>``): ids 0-255 are the bytes in the order of ByteLevel's printable characters
    for them (``ascii_only``: ids 0-127, the ASCII bytes), then EOS, pad, im_start. Built in memory."""
    from tokenizers import pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if ascii_only:
        # ByteLevel's alphabet maps byte b to one printable character: chr(b) for the printable bytes, chr(256 + i)
        # for the i-th other byte; keep those of bytes 0-127
        printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
        byte_to_char, extra = {b: chr(b) for b in printable}, 0
        for b in range(256):
            if b not in byte_to_char:
                byte_to_char[b], extra = chr(256 + extra), extra + 1
        assert set(byte_to_char.values()) == set(alphabet)
        alphabet = [byte_to_char[b] for b in range(128)]
    fast = _byte_level_tokenizer(sorted(alphabet))
    size = ASCII_VOCAB_SIZE if ascii_only else BYTE_VOCAB_SIZE
    assert len(fast) == size and (fast.eos_token_id, fast.pad_token_id) == (size - 3, size - 2)
    return fast


def _byte_level_tokenizer(alphabet):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=PAD_TOKEN, eos_token=EOS_TOKEN, additional_special_tokens=[BOS_TOKEN]
    )
    fast.chat_template = CHATML_TEMPLATE
    return fast
