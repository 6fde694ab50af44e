"""An offline byte-level tokenizer with a ChatML chat template, for random-init models and tests.

Every UTF-8 byte is one token (ids 0-255), then ``<|im_end|>`` (EOS, 256), ``<|endoftext|>`` (pad, 257) and
``<|im_start|>`` (258): 259 tokens, no merges, nothing to download. Prompts are about four times longer in tokens than with a
real BPE tokenizer, which only makes a memory measurement more conservative.
"""

from __future__ import annotations

__all__ = ["byte_tokenizer", "CHATML_TEMPLATE"]

CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def byte_tokenizer():
    """A ``PreTrainedTokenizerFast`` over bytes with ChatML special tokens (EOS ``<|im_end|>``)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<|endoftext|>", eos_token="<|im_end|>",
                                   additional_special_tokens=["<|im_start|>"])
    fast.chat_template = CHATML_TEMPLATE
    return fast
