"""The loss's metrics, built once for both layer-2 implementations (the token kernel and the torch twin in
grpo_fast.reference) from one number per sequence and statistic, under TRL 1.16's names and reductions.

A statistic's per-sequence value (``RowValues``) is either the masked sum of a per-token quantity over the sequence
(a [B, T] quantity) or the sequence's own value (a [B, 1] quantity: the sequence-level ratio, its clip indicators,
VESPO's phi with per-sequence advantages). TRL's reductions of them:
    mean                  TRL's global masked mean: sum over sequences / the batch's tokens ([B, T] quantities) or
                          / B ([B, 1] quantities)
    min / max_over_sequences   TRL's nanmin / nanmax over sequences of each sequence's masked mean (the value itself
                          for [B, 1] quantities); a sequence without tokens has none (NaN in TRL), and with none at
                          all the metric is NaN
Every loss type logs ``kl`` (beta != 0), ``entropy`` (when the entropy is given), ``policy_loss`` (the loss before
the entropy bonus, when entropy_coef != 0) and grpo_fast's ``ratio_mean``; its own metrics are its record's
(grpo_fast.options.LOSS_TYPE_RECORDS).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RowValues:
    """One statistic, one value per sequence [B] fp32: masked sums of a per-token quantity, or (``per_sequence``) the
    sequence's own value of a quantity that has one per sequence."""

    values: torch.Tensor
    per_sequence: bool = False


def row_values(x, mask):
    """The torch twin's statistic: x [B, T] (masked sum per sequence) or [B, 1] (the sequence's own value; TRL's
    test is the shape, so with T = 1 every quantity counts as one per sequence)."""
    x = x.detach().float()
    if x.shape[1] == 1:
        return RowValues(x.squeeze(1), per_sequence=True)
    return RowValues((x * mask).sum(-1))


def loss_metrics(options, rows, counts, policy_loss=None):
    """{TRL's metric name: detached fp32 scalar} for ``options`` (a LossOptions) from ``rows`` ({statistic:
    RowValues}: "ratio", "kl" with beta != 0, "entropy" when given, and those the loss type's metrics name) and
    ``counts`` [B], each sequence's token count. ``policy_loss``: the loss before the entropy bonus."""
    counts = counts.detach().float()
    tokens = counts.sum().clamp(min=1.0)

    def mean(statistic):
        row = rows[statistic]
        return row.values.sum() / (counts.numel() if row.per_sequence else tokens)

    def over_sequences(statistic, reduce, neutral):
        # sequences without tokens have no mean (TRL's NaN, skipped by nanmin): they take the reduction's neutral
        # value, and with no sequence left the metric is NaN; no boolean selection (no host read, static shapes)
        row = rows[statistic]
        if row.per_sequence:
            return reduce(row.values) if row.values.numel() else torch.tensor(math.nan, device=counts.device)
        has_tokens = counts > 0
        means = torch.where(has_tokens, row.values / counts.clamp(min=1.0), neutral)
        return torch.where(has_tokens.any(), reduce(means), math.nan)

    metrics = {}
    if options.beta != 0.0:
        metrics["kl"] = mean("kl")
    if "entropy" in rows:
        metrics["entropy"] = mean("entropy")
    for metric in options.loss_type_record.metrics:
        if metric.reduce == "mean":
            metrics[metric.name] = mean(metric.statistic)
        elif metric.reduce == "min_over_sequences":
            metrics[metric.name] = over_sequences(metric.statistic, torch.min, math.inf)
        elif metric.reduce == "max_over_sequences":
            metrics[metric.name] = over_sequences(metric.statistic, torch.max, -math.inf)
        else:
            raise ValueError(f"metric {metric.name!r} of loss type {options.loss_type!r} has an unknown reduction "
                             f"{metric.reduce!r}")
    if options.entropy_coef != 0.0:
        metrics["policy_loss"] = policy_loss
    metrics["ratio_mean"] = mean("ratio")
    return {name: value.detach().float().reshape(()) for name, value in metrics.items()}
