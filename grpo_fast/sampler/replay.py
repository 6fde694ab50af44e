"""Replayed kept sets: vLLM's per-token lists packed into the [B, T, K] tensor ``sampler_logprobs`` takes."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

import torch

from grpo_fast.head.keywords import takes_keywords


@takes_keywords()
def pack_kept_ids(
    kept: Iterable[Iterable[Iterable[int] | Mapping]],
    length: int | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Kept sets as ``sampler_logprobs``' ``kept_ids``: [B, T, K] int64, -1 filling.

    Args:
        kept: per sequence, per generated token, the ids the sampler could draw from: vLLM's
            ``CompletionOutput.sampling_mask`` lists (``return_sampling_mask``), or the token's logprobs dict of a
            request with ``logprobs=-1`` in ``processed_logprobs`` mode, whose finite entries are the kept set (a
            dict's values may be floats or vLLM's ``Logprob`` records).
        length: T, the completions' padded length (None: the longest sequence).
        device: where the tensor goes.

    Returns:
        [B, T, K] int64, K the largest set (at least 1); positions past a sequence's end hold -1 only.

    Raises:
        ValueError: a sequence longer than ``length``, or an id that is negative.
    """
    sequences = [[_ids(token) for token in sequence] for sequence in kept]
    T = max((len(s) for s in sequences), default=0) if length is None else length
    K = max((len(ids) for s in sequences for ids in s), default=1) or 1
    packed = torch.full((len(sequences), T, K), -1, dtype=torch.int64)
    for b, sequence in enumerate(sequences):
        if len(sequence) > T:
            raise ValueError(f"sequence {b} has {len(sequence)} tokens, more than length={T}")
        for t, ids in enumerate(sequence):
            if ids:
                row = torch.tensor(ids, dtype=torch.int64)
                if bool((row < 0).any()):
                    raise ValueError(f"kept ids must be >= 0, got {min(ids)} at sequence {b}, token {t}")
                packed[b, t, : len(ids)] = row
    return packed.to(device) if device is not None else packed


def _ids(token):
    if isinstance(token, Mapping):
        return [int(i) for i, value in token.items() if math.isfinite(getattr(value, "logprob", value))]
    return [int(i) for i in token]
