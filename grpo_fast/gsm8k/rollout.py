"""The GRPO rollout pieces: sampling completions, the completion mask, group advantages and hidden states.

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

from dataclasses import dataclass

import torch

__all__ = [
    "Rollout", "eos_token_ids", "tokenize_prompts", "generate", "completion_mask", "decode_completions",
    "group_advantages", "decoder_of", "completion_hidden_states",
]

SCALE_REWARDS = ("group", "batch", "none")


@dataclass
class Rollout:
    """A generation batch: left-padded prompts [B, P] and right-padded completions [B, T] (B = prompts * G)."""

    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    completion_ids: torch.Tensor
    completion_mask: torch.Tensor

    def select(self, rows) -> "Rollout":
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
    texts = [tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True) + completion_prefix
             for p in prompts]
    tokenizer.padding_side = "left"
    tokenizer.truncation_side = "left"
    enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False,
                    truncation=max_prompt_length is not None, max_length=max_prompt_length)
    return enc["input_ids"].to(device), enc["attention_mask"].to(device)


def completion_mask(completion_ids: torch.Tensor, eos_ids) -> torch.Tensor:
    """1 up to and including the first EOS of each row, 0 after it (all ones where no EOS was generated)."""
    is_eos = torch.isin(completion_ids, torch.as_tensor(list(eos_ids), device=completion_ids.device))
    B, T = completion_ids.shape
    first_eos = torch.where(is_eos.any(1), is_eos.int().argmax(1), torch.full((B,), T, device=completion_ids.device))
    positions = torch.arange(T, device=completion_ids.device).expand(B, T)
    return (positions <= first_eos.unsqueeze(1)).long()


@torch.no_grad()
def generate(model, tokenizer, prompts, *, num_generations=1, max_completion_length=256, temperature=1.0,
             top_p=1.0, do_sample=True, max_prompt_length=None, force_full_length=False,
             completion_prefix="") -> Rollout:
    """``num_generations`` completions of each prompt with ``model.generate``.

    Sampling with ``temperature`` and ``top_p`` (no top-k), or greedy with ``do_sample=False``.
    ``force_full_length`` forbids EOS until ``max_completion_length`` tokens (the worst case for memory).
    ``completion_prefix`` is part of the prompt ids (see ``tokenize_prompts``), not of the completion ids: the
    caller prepends it to the decoded texts when the whole answer is scored.
    """
    device = next(model.parameters()).device
    prompt_ids, prompt_mask = tokenize_prompts(tokenizer, prompts, max_prompt_length, device, completion_prefix)
    prompt_ids = prompt_ids.repeat_interleave(num_generations, 0)
    prompt_mask = prompt_mask.repeat_interleave(num_generations, 0)
    eos = eos_token_ids(model, tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]
    kwargs = dict(max_new_tokens=max_completion_length, do_sample=do_sample, pad_token_id=pad, eos_token_id=eos,
                  use_cache=True)
    if do_sample:
        kwargs.update(temperature=temperature, top_p=top_p, top_k=0)
    else:
        kwargs.update(temperature=None, top_p=None, top_k=None)
    if force_full_length:
        kwargs["min_new_tokens"] = max_completion_length
    was_training = model.training
    model.eval()
    try:
        out = model.generate(input_ids=prompt_ids, attention_mask=prompt_mask, **kwargs)
    finally:
        model.train(was_training)
    completion_ids = out[:, prompt_ids.shape[1]:]
    return Rollout(prompt_ids, prompt_mask, completion_ids, completion_mask(completion_ids, eos))


def decode_completions(tokenizer, completion_ids, mask) -> list[str]:
    """The text of each completion up to its first EOS, special tokens dropped.

    Ids the tokenizer does not know (a model's padded vocabulary, a random model) are dropped too.
    """
    vocab = len(tokenizer)
    texts = []
    for ids, m in zip(completion_ids.tolist(), mask.tolist()):
        ids = [i for i, keep in zip(ids, m) if keep and i < vocab]
        texts.append(tokenizer.decode(ids, skip_special_tokens=True))
    return texts


def group_advantages(rewards: torch.Tensor, num_generations: int, scale_rewards: str = "group", eps: float = 1e-4):
    """TRL's advantages: reward minus its group's mean, divided by a std (+ eps); returns (advantages, std).

    ``scale_rewards``: "group" divides by each group's std, "batch" by the std of all rewards, "none" does not
    divide (Dr. GRPO). ``std`` [B] is the group std ("group", "none") or the batch std ("batch"); a group
    whose rewards are all equal gets zero advantages, never a NaN.
    """
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"scale_rewards must be one of {SCALE_REWARDS}, got {scale_rewards!r}")
    if num_generations < 2 or rewards.numel() % num_generations:
        raise ValueError(f"need num_generations >= 2 dividing the {rewards.numel()} rewards, got {num_generations}")
    grouped = rewards.float().view(-1, num_generations)
    mean = grouped.mean(1).repeat_interleave(num_generations)
    if scale_rewards == "batch":
        std = rewards.float().std().expand(rewards.numel())
    else:
        std = grouped.std(1).repeat_interleave(num_generations)
    advantages = rewards.float() - mean
    if scale_rewards != "none":
        advantages = advantages / (std + eps)
    return advantages, std


def decoder_of(model):
    """The transformer body (``model.model`` of a ``*ForCausalLM``, through a peft wrapper): no lm_head."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return getattr(base, base.base_model_prefix)


def completion_hidden_states(model, prompt_ids, prompt_mask, completion_ids, completion_mask):
    """Last hidden states [B, T, D] of the positions that predict the completion tokens; no logits are built.

    Position ``P - 1 + t`` (the prompt's last token, then each completion token but the last) predicts
    completion token ``t``; position ids skip the left padding, as in ``generate``.
    """
    input_ids = torch.cat([prompt_ids, completion_ids], 1)
    attention_mask = torch.cat([prompt_mask, completion_mask.to(prompt_mask.dtype)], 1)
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    out = decoder_of(model)(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                            use_cache=False)
    P, T = prompt_ids.shape[1], completion_ids.shape[1]
    return out.last_hidden_state[:, P - 1:P + T - 1]
