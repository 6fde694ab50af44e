"""``sampler_logprobs``: each target's log-prob over the whole vocabulary and over the sampler's kept set."""

from __future__ import annotations

from typing import NamedTuple

import torch

from grpo_fast.backends.protocol import BackendName
from grpo_fast.head import inputs
from grpo_fast.head.keywords import takes_keywords
from grpo_fast.head.lora import HeadLora
from grpo_fast.head.shard import VocabShard
from grpo_fast.sampler.call import SamplerCall


class SamplerLogprobs(NamedTuple):
    """``sampler_logprobs``' outputs, [B, T] float32 each, exact zeros where completion_mask is 0.

    Attributes:
        logprobs: log softmax(z)_y over the whole vocabulary (z: the logits over the temperature): the trainer's
            log-prob, ``grpo_fast.logprobs``'.
        support_logprobs: the same renormalised over the kept set: z_y - log sum_{v kept} exp(z_v), what vLLM's
            ``processed_logprobs`` returns for a sampled token (NaN where the target is not in its kept set and
            ``check_values`` is False).
        log_kept_mass: logprobs - support_logprobs, the log of the kept set's probability mass (<= 0: clamped at 0
            where the kept set holds all but a rounding error of the mass).
    """

    logprobs: torch.Tensor
    support_logprobs: torch.Tensor
    log_kept_mass: torch.Tensor


@takes_keywords()
def sampler_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    completion_mask: torch.Tensor | None = None,
    *,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
    kept_ids: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    softcap: float | None = None,
    logit_scale: float = 1.0,
    lora: HeadLora | tuple | None = None,
    vocab_parallel: VocabShard | None = None,
    backend: BackendName = "auto",
    check_values: bool = True,
) -> SamplerLogprobs:
    """Log-probs of ``targets`` over the whole vocabulary and over the set a truncating sampler drew them from.

    A sampler with top-k, top-p or min-p draws each token from a kept set and its log-probs (vLLM's
    ``processed_logprobs``) are renormalised over it; a trainer's are over the whole vocabulary. Their difference is
    the kept mass, whatever was sampled, so an importance ratio exp(trainer - sampler) taken across the two is off by
    it: compare ``support_logprobs`` with the sampler's, ``logprobs`` with the trainer's. No [tokens, V] logits are
    built.

    The kept set follows vLLM 0.32's rules in its order, on the logits over the temperature: min-p keeps
    p_v >= min_p * max p; top-k the survivors at or above the k-th largest (every entry tied with it too); top-p,
    over the survivors' renormalised distribution, each entry whose survivors ranked strictly above it hold less
    than top_p (the top entry always; ties at the threshold all kept). Or ``kept_ids`` replays the sets the sampler
    used (vLLM's ``sampling_mask``; ``grpo_fast.pack_kept_ids`` packs them).

    Args:
        hidden: [B, T, D] float32, bfloat16 or float16; hidden[b, t] predicts targets[b, t].
        weight: [V, D] lm_head weight, hidden's dtype (or fp32 over bf16 / fp16 hidden).
        targets: [B, T] integer token ids, the sampled tokens.
        completion_mask: [B, T] bool or 0/1: the tokens computed; None: all.
        temperature: the sampling temperature (divides the logits, > 0).
        top_k: keep the k largest logits; 0 or -1: no top-k.
        top_p: the nucleus mass, in (0, 1]; 1: no top-p.
        min_p: keep p >= min_p * max p, in [0, 1]; 0: no min-p.
        kept_ids: [B, T, K] integer replayed kept sets (-1 filling), instead of top_k / top_p / min_p.
        bias: [V] or None.
        softcap: the logit soft-cap, or None.
        logit_scale: multiplies the raw logits.
        lora: LoRA on the head (a HeadLora or tuple), or None.
        vocab_parallel: this rank's VocabShard, or None (docs/vocab-parallel.md: the kept set
            over every shard, no row of logits gathered).
        backend: "auto", "triton" or "torch".
        check_values: read the value checks on the host: those of ``logprobs``, and for ``kept_ids`` ids in
            [-1, V), no id twice in a set and each target in its set (one synchronisation); with the sampling
            parameters, a target outside its kept set is found after the forward (a second read). False: nothing
            is read, and a target outside its kept set has NaN support_logprobs (and NaN gradients).

    Returns:
        ``SamplerLogprobs`` (logprobs, support_logprobs, log_kept_mass), [B, T] float32; logprobs and
        support_logprobs differentiable (hidden, weight, bias, LoRA). Untruncated (top_k 0, top_p 1, min_p 0, no
        kept_ids): support_logprobs is logprobs and log_kept_mass exact zeros.

    Raises:
        TypeError: as ``logprobs_and_entropy``; top_k not an int, top_p or min_p not a number, kept_ids not an
            integer tensor.
        ValueError: as ``logprobs_and_entropy``; top_k < -1, top_p outside (0, 1], min_p outside [0, 1], both
            kept_ids and the parameters, kept_ids of a shape other than [B, T, K], (with ``check_values``) a kept id
            outside [0, V), an id twice in a set, a target outside its kept set.
    """
    call = SamplerCall.check(
        inputs.HeadCall.check(
            hidden,
            weight,
            targets,
            completion_mask,
            bias=bias,
            temperature=temperature,
            softcap=softcap,
            logit_scale=logit_scale,
            lora=lora,
            vocab_parallel=vocab_parallel,
            backend=backend,
            check_values=check_values,
        ),
        top_k,
        top_p,
        min_p,
        kept_ids,
    )
    logp, support = call.logprobs(call.head.rows())
    if support is logp:  # untruncated
        return SamplerLogprobs(logp, logp, torch.zeros_like(logp))
    # log S <= 0; where S rounds to 1, the two log-probs' own rounding (a few ulp of the logits) must not make it
    # positive
    return SamplerLogprobs(logp, support, torch.clamp(logp - support, max=0.0))
