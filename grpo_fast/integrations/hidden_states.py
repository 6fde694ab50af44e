"""The hidden states a GRPO loop feeds ``grpo_fast.loss``: those of the positions that predict the completion tokens,
from a causal LM's decoder (no lm_head, no logits), with each group's shared prompt run once.

    hidden = completion_hidden_states(model, prompt_ids, prompt_mask, completion_ids, completion_mask)  # [B, T, D]
    loss, metrics = grpo_fast.loss(hidden, model.get_output_embeddings().weight, completion_ids, advantages,
                                   completion_mask)

Rows are ordered prompt by prompt: rows ``i * G .. i * G + G - 1`` are the G completions of prompt ``i``
(grpo_fast.grpo_loss.advantages has the group advantages).
"""

from __future__ import annotations

import inspect

import torch

__all__ = [
    "decoder_of",
    "cache_keyword",
    "output_cache",
    "completion_hidden_states",
    "prompt_groups",
    "shared_prompt_hidden_states",
]


def decoder_of(model):
    """The transformer body (``model.model`` of a ``*ForCausalLM``, through a peft wrapper): no lm_head."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return getattr(base, base.base_model_prefix)


def cache_keyword(decoder) -> str:
    """The keyword that hands ``decoder`` (and its model's ``generate``) a key / value cache: ``cache`` where its
    forward takes it (newer transformers renamed it; 5.24 warns on the old name), else ``past_key_values``."""
    return "cache" if "cache" in inspect.signature(decoder.forward).parameters else "past_key_values"


def output_cache(out):
    """The key / value cache of a decoder's output (``cache`` or ``past_key_values``, as ``cache_keyword``)."""
    fields = getattr(out, "__dataclass_fields__", {})
    return getattr(out, "cache" if "cache" in fields else "past_key_values")


def completion_hidden_states(model, prompt_ids, prompt_mask, completion_ids, completion_mask, *, share_prompts=False):
    """Last hidden states [B, T, D] of the positions that predict the completion tokens; no logits are built.

    Position ``P - 1 + t`` (the prompt's last token, then each completion token but the last) predicts
    completion token ``t``; position ids skip the left padding, as in ``generate``.

    ``share_prompts``: run each prompt once for the consecutive rows that share it (a GRPO group) and the
    completions on its key / value cache (``shared_prompt_hidden_states``): the same result and gradients for
    a fraction of the prompt's cost. Models that drop the cache (gradient checkpointing in training mode) take
    the plain path.
    """
    if share_prompts:
        hidden = shared_prompt_hidden_states(model, prompt_ids, prompt_mask, completion_ids, completion_mask)
        if hidden is not None:
            return hidden
    input_ids = torch.cat([prompt_ids, completion_ids], 1)
    attention_mask = torch.cat([prompt_mask, completion_mask.to(prompt_mask.dtype)], 1)
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    out = decoder_of(model)(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
    )
    P, T = prompt_ids.shape[1], completion_ids.shape[1]
    return out.last_hidden_state[:, P - 1 : P + T - 1]


def prompt_groups(prompt_ids, prompt_mask):
    """(unique rows, row -> unique index): consecutive rows with the same prompt share one unique row."""
    same = (prompt_ids[1:] == prompt_ids[:-1]).all(1) & (prompt_mask[1:] == prompt_mask[:-1]).all(1)
    starts = torch.cat([torch.ones(1, dtype=torch.bool, device=prompt_ids.device), ~same])
    return starts.nonzero().squeeze(1), starts.cumsum(0) - 1


def shared_prompt_hidden_states(model, prompt_ids, prompt_mask, completion_ids, completion_mask):
    """``completion_hidden_states`` with each distinct prompt computed once, or None when no row shares one or
    the model keeps no cache.

    The distinct prompts run as one batch with a key / value cache; each row's completion then runs on its
    prompt's cache (selected by index, so the gradient of every row flows back into the one prompt pass). The
    hidden states and the gradients equal the plain path's at every completion position (padding columns after a
    row's end differ; they are masked out of the loss).
    """
    unique, group = prompt_groups(prompt_ids, prompt_mask)
    if len(unique) == len(group):
        return None
    decoder = decoder_of(model)
    u_mask = prompt_mask[unique]
    out = decoder(
        input_ids=prompt_ids[unique],
        attention_mask=u_mask,
        position_ids=(u_mask.cumsum(-1) - 1).clamp(min=0),
        use_cache=True,
    )
    cache = output_cache(out)
    if cache is None or cache.get_seq_length() != prompt_ids.shape[1]:  # e.g. gradient checkpointing drops it
        return None
    last = out.last_hidden_state[:, -1:][group]  # the prompt's last position predicts completion token 0
    T = completion_ids.shape[1]
    if T == 1:
        return last
    cache.batch_select_indices(group)
    attention_mask = torch.cat([prompt_mask, completion_mask[:, :-1].to(prompt_mask.dtype)], 1)
    position_ids = u_mask.sum(1)[group, None] + torch.arange(T - 1, device=completion_ids.device)
    rest = decoder(
        input_ids=completion_ids[:, :-1],
        attention_mask=attention_mask,
        position_ids=position_ids,
        use_cache=True,
        **{cache_keyword(decoder): cache},
    )
    return torch.cat([last, rest.last_hidden_state], 1)
