"""The GRPO rollout pieces of the GSM8K recipe: sampling completions with ``model.generate``, the completion mask,
decoding (the group advantages and the completion hidden states are generic GRPO: ``grpo_fast.grpo_loss.advantages``,
``grpo_fast.integrations.hidden_states``).

    from grpo_fast.grpo_loss.advantages import group_advantages
    from grpo_fast.integrations.hidden_states import completion_hidden_states

    batch = generate(model, tokenizer, prompts, num_generations=16, max_completion_length=786)
    texts = decode_completions(tokenizer, batch.completion_ids, batch.completion_mask)
    advantages, std = group_advantages(rewards, num_generations=16, scale_rewards="group")
    hidden = completion_hidden_states(model, batch.prompt_ids, batch.prompt_mask,
                                      batch.completion_ids, batch.completion_mask)   # [B, T, D]
    loss, metrics = grpo_fast.loss(hidden, model.get_output_embeddings().weight, batch.completion_ids,
                                   advantages, batch.completion_mask)

Rows are ordered prompt by prompt: rows ``i * G .. i * G + G - 1`` are the G completions of prompt ``i``.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

import torch

from gsm8k import progress

__all__ = [
    "Rollout",
    "eos_token_ids",
    "tokenize_prompts",
    "generate",
    "completion_mask",
    "decode_completions",
    "GenerationProgress",
    "show_generation_progress",
    "prompt_cache",
    "prime_chat_template",
]


@dataclass
class Rollout:
    """A generation batch: left-padded prompts [B, P] and right-padded completions [B, T] (B = prompts * G)."""

    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    completion_ids: torch.Tensor
    completion_mask: torch.Tensor

    def select(self, rows) -> Rollout:
        """The rows ``rows`` (a slice or index tensor), with completion columns cut after the longest one."""
        mask = self.completion_mask[rows]
        T = max(int(mask.sum(1).max()), 1)
        return Rollout(self.prompt_ids[rows], self.prompt_mask[rows], self.completion_ids[rows][:, :T], mask[:, :T])


def eos_token_ids(model, tokenizer) -> list[int]:
    """Every id that ends a completion: the generation config's EOS id(s) and the tokenizer's."""
    ids = getattr(model.generation_config, "eos_token_id", None)
    ids = [] if ids is None else ([ids] if isinstance(ids, int) else list(ids))
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    return ids


def tokenize_prompts(tokenizer, prompts, max_prompt_length=None, device=None, completion_prefix=""):
    """Chat-templated prompts (lists of messages) -> left-padded ``input_ids``, ``attention_mask`` [N, P].

    Prompts longer than ``max_prompt_length`` tokens keep their last tokens, as TRL does.
    ``completion_prefix``: text appended after the template's generation prompt, the start of the assistant's
    answer that the model then continues ("priming", e.g. ``"<reasoning>\n"``).
    """
    texts = [
        tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True) + completion_prefix
        for p in prompts
    ]
    tokenizer.padding_side = "left"
    tokenizer.truncation_side = "left"
    enc = tokenizer(
        texts,
        return_tensors="pt",
        padding=True,
        add_special_tokens=False,
        truncation=max_prompt_length is not None,
        max_length=max_prompt_length,
    )
    return enc["input_ids"].to(device), enc["attention_mask"].to(device)


def prime_chat_template(tokenizer, completion_prefix: str):
    """Make ``tokenizer``'s chat template end every generation prompt with ``completion_prefix`` (the start of the
    assistant's answer, which the model then continues): ``tokenize_prompts(..., completion_prefix=...)`` for code
    that applies the template itself, such as TRL's trainers."""
    if completion_prefix:
        tokenizer.chat_template = (
            tokenizer.chat_template
            + "{% if add_generation_prompt %}{{ "
            + json.dumps(completion_prefix)
            + " }}{% endif %}"
        )
    return tokenizer


def completion_mask(completion_ids: torch.Tensor, eos_ids) -> torch.Tensor:
    """1 up to and including the first EOS of each row, 0 after it (all ones where no EOS was generated)."""
    is_eos = torch.isin(completion_ids, torch.as_tensor(list(eos_ids), device=completion_ids.device))
    B, T = completion_ids.shape
    first_eos = torch.where(is_eos.any(1), is_eos.int().argmax(1), torch.full((B,), T, device=completion_ids.device))
    positions = torch.arange(T, device=completion_ids.device).expand(B, T)
    return (positions <= first_eos.unsqueeze(1)).long()


class GenerationProgress:
    """A ``model.generate`` streamer that shows a progress bar: sequences finished, tokens so far, tokens/s.

    ``generate`` calls ``put`` with the prompt ids first, then with each step's new token of every row; a row is
    finished at its first ``eos_ids`` token. Rows go on being padded after that; only unfinished rows count as
    tokens. On a terminal the bar is redrawn at least every ``refresh_s`` seconds while tokens come, also when no
    sequence finished (tqdm redraws only on a count that moved); anywhere else (``file``, default stderr, is a file
    or a pipe) one line at the end says the same (``gsm8k.progress.bar``).
    """

    def __init__(
        self, num_sequences, max_new_tokens, eos_ids, desc="generation", leave=False, refresh_s=0.5, file=None
    ):
        self.max_new_tokens, self.eos_ids = max_new_tokens, torch.as_tensor(list(eos_ids))
        self.bar = progress.bar(total=num_sequences, desc=desc, unit="seq", leave=leave, file=file)
        self.prompt_seen, self.done, self.steps, self.tokens = False, None, 0, 0
        self.start = self.drawn = time.perf_counter()
        self.refresh_s = refresh_s

    def put(self, value):
        if not self.prompt_seen:  # the prompt ids
            self.prompt_seen = True
            return
        value = value.reshape(-1).cpu()
        if self.done is None:
            self.done = torch.zeros(value.shape, dtype=torch.bool)
        self.tokens += int((~self.done).sum())
        self.done |= torch.isin(value, self.eos_ids)
        self.steps += 1
        now = time.perf_counter()
        rate = self.tokens / max(now - self.start, 1e-9)
        self.bar.set_postfix_str(f"token {self.steps}/{self.max_new_tokens}, {rate:.0f} tokens/s", refresh=False)
        finished = int(self.done.sum()) - self.bar.n
        if finished:
            self.bar.update(finished)
        if now - self.drawn >= self.refresh_s:
            self.bar.refresh()
            self.drawn = now

    def end(self):
        self.bar.update(self.bar.total - self.bar.n)  # every row is done at the length limit
        self.bar.close()


def show_generation_progress(model, tokenizer, desc="generation"):
    """Make every later ``model.generate(...)`` call (a trainer's too) show a ``GenerationProgress`` bar."""
    generate_of_class = type(model).generate

    def generate_with_progress(*args, **kwargs):
        if kwargs.get("streamer") is None:
            ids = kwargs.get("input_ids", args[0] if args else None)
            config = kwargs.get("generation_config") or model.generation_config
            num_rows = 0 if ids is None else ids.shape[0] * (getattr(config, "num_return_sequences", 1) or 1)
            kwargs["streamer"] = GenerationProgress(
                num_rows, kwargs.get("max_new_tokens", config.max_new_tokens), eos_token_ids(model, tokenizer), desc
            )
        return generate_of_class(model, *args, **kwargs)

    model.generate = generate_with_progress
    return model


@torch.no_grad()
def generate(
    model,
    tokenizer,
    prompts,
    *,
    num_generations=1,
    max_completion_length=256,
    temperature=1.0,
    top_p=1.0,
    do_sample=True,
    max_prompt_length=None,
    force_full_length=False,
    completion_prefix="",
    progress=None,
    share_prompts=True,
) -> Rollout:
    """``num_generations`` completions of each prompt with ``model.generate``.

    Sampling with ``temperature`` and ``top_p`` (no top-k), or greedy with ``do_sample=False``.
    ``force_full_length`` forbids EOS until ``max_completion_length`` tokens (the worst case for memory).
    ``completion_prefix`` is part of the prompt ids (see ``tokenize_prompts``), not of the completion ids: the
    caller prepends it to the decoded texts when the whole answer is scored. ``progress``: a description to
    show a ``GenerationProgress`` bar under (None: no bar). ``share_prompts``: with ``num_generations`` > 1, run
    each prompt once (a key / value cache, copied to its ``num_generations`` rows) instead of once per row; the
    same completions, for a fraction of the prompt's cost.
    """
    device = next(model.parameters()).device
    prompt_ids, prompt_mask = tokenize_prompts(tokenizer, prompts, max_prompt_length, device, completion_prefix)
    prompt_ids = prompt_ids.repeat_interleave(num_generations, 0)
    prompt_mask = prompt_mask.repeat_interleave(num_generations, 0)
    eos = eos_token_ids(model, tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]
    kwargs = dict(
        max_new_tokens=max_completion_length, do_sample=do_sample, pad_token_id=pad, eos_token_id=eos, use_cache=True
    )
    if do_sample:
        kwargs.update(temperature=temperature, top_p=top_p, top_k=0)
    else:
        kwargs.update(temperature=None, top_p=None, top_k=None)
    if force_full_length:
        kwargs["min_new_tokens"] = max_completion_length
    if progress is not None:
        kwargs["streamer"] = GenerationProgress(prompt_ids.shape[0], max_completion_length, eos, progress)
    was_training = model.training
    model.eval()
    try:
        from grpo_fast.integrations.hidden_states import cache_keyword, decoder_of

        if share_prompts and num_generations > 1 and prompt_ids.shape[1] > 1:
            kwargs[cache_keyword(decoder_of(model))] = prompt_cache(
                model, prompt_ids[::num_generations, :-1], prompt_mask[::num_generations, :-1], num_generations
            )
        out = model.generate(input_ids=prompt_ids, attention_mask=prompt_mask, **kwargs)
    finally:
        model.train(was_training)
    completion_ids = out[:, prompt_ids.shape[1] :]
    return Rollout(prompt_ids, prompt_mask, completion_ids, completion_mask(completion_ids, eos))


def prompt_cache(model, prompt_ids, prompt_mask, repeats):
    """The key / value cache of the (left-padded) prompts, each row repeated ``repeats`` times, for
    ``model.generate(cache=...)`` (or ``past_key_values=``: ``hidden_states.cache_keyword``): generate then runs
    only the tokens after it."""
    from grpo_fast.integrations.hidden_states import decoder_of, output_cache

    out = decoder_of(model)(
        input_ids=prompt_ids,
        attention_mask=prompt_mask,
        position_ids=(prompt_mask.cumsum(-1) - 1).clamp(min=0),
        use_cache=True,
    )
    cache = output_cache(out)
    cache.batch_repeat_interleave(repeats)
    return cache


def decode_completions(tokenizer, completion_ids, mask) -> list[str]:
    """The text of each completion up to its first EOS, special tokens dropped.

    Ids the tokenizer does not know (a model's padded vocabulary, a random model) are dropped too.
    """
    vocab = len(tokenizer)
    texts = []
    for ids, m in zip(completion_ids.tolist(), mask.tolist(), strict=True):
        ids = [i for i, keep in zip(ids, m, strict=True) if keep and i < vocab]
        texts.append(tokenizer.decode(ids, skip_special_tokens=True))
    return texts
