"""The sampler's importance weights (TRL 1.16's vLLM correction), and the correction computed like with like in one
``loss`` call (``SamplingCorrection``).

A sampler that truncates (top-k, top-p, min-p) returns log-probs renormalised over its kept set (vLLM's
``processed_logprobs``); the trainer's full-vocabulary log-probs are lower by the kept mass's log, whatever was
sampled, so exp(old - sampling) is the kept mass S < 1 even when policy and sampler are one model, and TRL 1.16's
correction multiplies each token's loss by it. Over the same support, exp(old_support - sampling) is 1 there. The
clipped ratio and the KL keep the full-vocabulary log-probs: only the sampler's ratio changes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from grpo_fast.grpo_loss.options import IMPORTANCE_SAMPLING_MODES, ImportanceSamplingMode
from grpo_fast.grpo_loss.options import check_number as _number
from grpo_fast.head import inputs
from grpo_fast.head.inputs import HeadCall, Rows
from grpo_fast.sampler.call import SamplerCall


def check_mode(mode, clip_max, clip_min):
    """TRL's ``vllm_importance_sampling_mode`` and its bounds."""
    if mode not in IMPORTANCE_SAMPLING_MODES:
        raise ValueError(f"mode must be one of {IMPORTANCE_SAMPLING_MODES}, got {mode!r}")
    for name, x in (("clip_max", clip_max), ("clip_min", clip_min)):
        if x is not None:
            _number(name, x)
    if clip_min is not None and clip_max is not None and clip_min >= clip_max:
        raise ValueError(f"clip_min ({clip_min}) must be less than clip_max ({clip_max})")
    if mode.endswith("truncate") and clip_min is None and clip_max is None:
        raise ValueError(f"mode={mode!r} needs clip_min or clip_max")


def importance_weights(old_logprobs, sampling_logprobs, completion_mask, mode, clip_max, clip_min):
    """TRL 1.16's weights from checked arguments: float32, detached, [B, T] (token_*) or [B, 1] (sequence_*)."""
    # a token the sampler could not score (NaN) and a masked one carry no correction: a log-ratio of 0 (TRL's
    # nan_to_num of the masked difference)
    log_ratio = old_logprobs.detach().float() - sampling_logprobs.detach().float()
    log_ratio = torch.nan_to_num(torch.where(completion_mask.bool(), log_ratio, 0.0), nan=0.0)
    level, action = mode.split("_")  # TRL's modes: ("token" | "sequence") _ ("truncate" | "mask")
    if level == "sequence":
        log_ratio = log_ratio.sum(-1, keepdim=True)
    ratio = log_ratio.exp()
    if action == "truncate":
        return ratio.clamp(min=clip_min, max=clip_max)
    outside = torch.zeros_like(ratio, dtype=torch.bool)
    if clip_min is not None:
        outside |= ratio < clip_min
    if clip_max is not None:
        outside |= ratio > clip_max
    return torch.where(outside, 0.0, ratio)


@dataclass(frozen=True)
class SamplingCorrection:
    """TRL's vLLM importance-sampling correction over the sampler's support, for ``loss(sampling_correction=...)``:
    the weights exp(old_support - sampling) (``sampling_importance_weights``' modes and bounds), where old_support
    is the policy's log-prob renormalised over the kept set the sampler drew from (``sampler_logprobs``).

    Attributes:
        sampling_logprobs: [B, T] the sampler's log-probs of the sampled tokens (vLLM's ``processed_logprobs``; NaN
            where it gave none: no correction there).
        top_k: the sampler's top-k (vLLM's and TRL's name; 0 or -1: none).
        top_p: its top-p (1.0: none).
        min_p: its min-p (0.0: none).
        kept_ids: [B, T, K] its replayed kept sets (``pack_kept_ids``), instead of the three parameters.
        old_support_logprobs: [B, T] the old policy's support log-probs (``sampler_logprobs(...).support_logprobs``
            at generation); required with ``loss``'s ``old_logprobs``. None and on-policy: the policy's own, computed
            in the call (detached).
        mode: TRL's ``vllm_importance_sampling_mode`` (``sampling_importance_weights``).
        clip_max: the upper bound, or None.
        clip_min: the lower bound, or None.
    """

    sampling_logprobs: torch.Tensor
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    kept_ids: torch.Tensor | None = None
    old_support_logprobs: torch.Tensor | None = None
    mode: ImportanceSamplingMode = "sequence_mask"
    clip_max: float | None = 3.0
    clip_min: float | None = None

    def checked(self, head: HeadCall, old_logprobs, importance_weights, options) -> CheckedCorrection:
        """Every check against ``loss``'s call (the value checks queued on ``head.checks``).

        Args:
            head: the call's checked layer 1.
            old_logprobs: ``loss``'s old_logprobs, or None.
            importance_weights: ``loss``'s importance_weights, or None.
            options: the call's LossOptions.

        Returns:
            The CheckedCorrection, whose ``weights`` the call reads once its rows are read.

        Raises:
            TypeError: not a SamplingCorrection; log-probs that are not float tensors.
            ValueError: with importance_weights; old_logprobs without old_support_logprobs; a bad mode or bound; a
                sequence mode for a loss type that takes per-token weights; shapes; bad sampling parameters.
        """
        if not isinstance(self, SamplingCorrection):
            raise TypeError(f"sampling_correction must be a grpo_fast.SamplingCorrection, got {type(self).__name__}")
        if importance_weights is not None:
            raise ValueError("pass either importance_weights or sampling_correction (which computes them), not both")
        check_mode(self.mode, self.clip_max, self.clip_min)
        B, T = head.shape
        for name in ("sampling_logprobs", "old_support_logprobs"):
            x = getattr(self, name)
            if x is not None:
                inputs.check_float_tensor(name, x)
                inputs.check_shape(name, x, [(B, T)], lambda: f"[B, T] = [{B}, {T}]")
                inputs.check_same_device([(name, x)], head.hidden.device, "hidden")
        if old_logprobs is not None and self.old_support_logprobs is None:
            raise ValueError(
                "sampling_correction with old_logprobs (an old policy) needs old_support_logprobs, the old policy's "
                "support log-probs (grpo_fast.sampler_logprobs(...).support_logprobs where old_logprobs were taken)"
            )
        if options.loss_type_record.policy_term.importance_weights_in_term and not self.mode.startswith("token"):
            raise ValueError(
                f"loss_type={options.loss_type!r} takes per-token importance weights: sampling_correction's mode "
                f"must be token_truncate or token_mask, got {self.mode!r}"
            )
        sampler = None
        if self.old_support_logprobs is None:
            sampler = SamplerCall.check(head, self.top_k, self.top_p, self.min_p, self.kept_ids)
        return CheckedCorrection(self, sampler)


@dataclass(frozen=True)
class CheckedCorrection:
    correction: SamplingCorrection
    sampler: SamplerCall | None  # None: the old policy's support log-probs are given

    def weights(self, rows: Rows, completion_mask: torch.Tensor) -> torch.Tensor:
        """The importance weights of a checked call whose ``rows`` are read."""
        c = self.correction
        old = c.old_support_logprobs
        if old is None:
            with torch.no_grad():
                old = self.sampler.logprobs(rows)[1]
        return importance_weights(old, c.sampling_logprobs, completion_mask, c.mode, c.clip_max, c.clip_min)
