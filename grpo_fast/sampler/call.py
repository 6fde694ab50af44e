"""``sampler_logprobs``' checked call: layer 1's (``head.inputs.HeadCall``) and the sampler's parameters or replayed
kept sets (``SamplerSupport``), with their value checks queued in the call's one host synchronisation."""

from __future__ import annotations

import numbers
from dataclasses import dataclass

import torch

from grpo_fast.backends.protocol import SamplerSupport
from grpo_fast.head import inputs
from grpo_fast.head.api import logprobs_and_entropy_rows
from grpo_fast.head.inputs import HeadCall, Rows
from grpo_fast.sampler import ops, vocab_parallel


def check_sampling_parameters(top_k, top_p, min_p) -> SamplerSupport:
    """vLLM's and TRL's sampling parameters as a SamplerSupport (``top_k`` -1 read as 0: both disable top-k)."""
    if isinstance(top_k, bool) or not isinstance(top_k, numbers.Integral):
        raise TypeError(f"top_k must be an int, got {top_k!r}")
    if top_k < -1:
        raise ValueError(f"top_k must be >= -1 (0 or -1: no top-k), got {top_k}")
    for name, value in (("top_p", top_p), ("min_p", min_p)):
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError(f"{name} must be a float, got {value!r}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1] (1: no top-p), got {top_p}")
    if not 0.0 <= min_p <= 1.0:
        raise ValueError(f"min_p must be in [0, 1] (0: no min-p), got {min_p}")
    return SamplerSupport(max(int(top_k), 0), float(top_p), float(min_p))


def check_kept_ids(kept_ids, call: HeadCall, vocab_size):
    """Named errors for ``kept_ids`` [B, T, K]; its value checks (ids in [-1, V), no id twice in a set, each scored
    target in its set) queued on the call's checks."""
    inputs.check_tensor("kept_ids", kept_ids)
    if kept_ids.dtype.is_floating_point or kept_ids.dtype == torch.bool or kept_ids.is_complex():
        raise TypeError(f"kept_ids must be an integer tensor of token ids (-1: no entry), got {kept_ids.dtype}")
    B, T = call.shape
    if kept_ids.dim() != 3 or tuple(kept_ids.shape[:2]) != (B, T) or kept_ids.shape[2] == 0:
        raise ValueError(f"kept_ids must have shape [B, T, K] = [{B}, {T}, K] with K >= 1, got {tuple(kept_ids.shape)}")
    inputs.check_same_device([("kept_ids", kept_ids)], call.hidden.device, "hidden")
    checks = call.checks
    if not checks.run:
        return
    scored = (
        torch.ones((B, T), dtype=torch.bool, device=kept_ids.device)
        if call.completion_mask is None
        else call.completion_mask.bool()
    )
    ids = kept_ids.to(torch.int64)
    outside = scored[..., None] & ((ids < -1) | (ids >= vocab_size))
    checks.add(
        [outside.any(), torch.where(outside, ids, 0).min(), torch.where(outside, ids, 0).max()],
        lambda _, lo, hi: ValueError(
            f"kept_ids must hold token ids in [0, V) = [0, {vocab_size}) or -1 where completion_mask is 1, "
            f"got values in [{lo}, {hi}]"
        ),
    )
    ordered = ids.sort(dim=-1).values
    repeated = scored & ((ordered[..., 1:] == ordered[..., :-1]) & (ordered[..., 1:] >= 0)).any(-1)
    checks.add([repeated.any()], lambda _: ValueError("kept_ids holds an id twice in one token's kept set"))
    missing = scored & ~(ids == call.targets[..., None].to(torch.int64)).any(-1)
    position = missing.reshape(-1).int().argmax()
    checks.add(
        [missing.any(), position // T, position % T],
        lambda _, b, t: ValueError(
            f"targets[{b}, {t}] is not in its kept set kept_ids[{b}, {t}]: the sampler could not have drawn it"
        ),
    )


@dataclass(frozen=True)
class SamplerCall:
    """A checked ``sampler_logprobs`` call: layer 1's call and the kept set's description."""

    head: HeadCall
    support: SamplerSupport

    @classmethod
    def check(cls, head: HeadCall, top_k, top_p, min_p, kept_ids) -> SamplerCall:
        support = check_sampling_parameters(top_k, top_p, min_p)
        if kept_ids is not None:
            if support.truncates:
                raise ValueError(
                    "pass either kept_ids (replayed kept sets) or top_k / top_p / min_p (the sampler's parameters), "
                    "not both"
                )
            vocab_size = head.weight.shape[0] if head.shard is None else head.shard.vocab_size
            check_kept_ids(kept_ids, head, vocab_size)
            support = support._replace(kept_ids=kept_ids)
        return cls(head, support)

    def logprobs(self, rows: Rows) -> tuple[torch.Tensor, torch.Tensor]:
        """(logp, support) [B, T] fp32 of the scored ``rows`` (read), differentiable, exact zeros elsewhere: with the
        sampling parameters both from one op (the same rows of logits); replayed sets' log-prob from layer 1's op,
        or without gradients from the support's op (``ops.computes_logprob``: one record sweep).
        With the parameters and the checks on, a target outside its kept set raises (the call's second host read)."""
        head = self.head
        if not self.support.truncates:
            logp = logprobs_and_entropy_rows(head, rows, head.head_path)[0]
            return logp, logp
        operands, kept = head.operands(rows), self.rows_support(rows)
        if head.shard is not None:
            logp, support, drawable = vocab_parallel.sampler_support(operands, head.backend, kept, head.shard)
        else:
            logp, support, drawable = ops.sampler_support(operands, head.backend.name, kept)
        if self.support.kept_ids is not None:
            # without gradients the op's one record sweep gave the log-prob (``ops.computes_logprob``); a shard's
            # replayed sets leave it to layer 1
            computed = logp is not None and head.shard is None
            logp = head.scattered(logp, rows) if computed else logprobs_and_entropy_rows(head, rows, head.head_path)[0]
        else:
            logp = head.scattered(logp, rows)
            if head.checks.run:
                if rows.keep is not None:
                    drawable = drawable | ~rows.keep
                if not bool(drawable.all()):
                    raise ValueError(
                        "a target is not in the kept set its sampling parameters give (the sampler could not have "
                        "drawn it): its support log-prob is undefined"
                    )
        return logp, head.scattered(support, rows)

    def rows_support(self, rows: Rows) -> SamplerSupport:
        """The support of the scored ``rows``: replayed sets gathered as [N, K] int64 (padding rows' entries 0)."""
        if self.support.kept_ids is None:
            return self.support
        flat = self.support.kept_ids.reshape(-1, self.support.kept_ids.shape[-1]).to(torch.int64)
        return self.support._replace(kept_ids=inputs.row_values(flat, rows).contiguous())
