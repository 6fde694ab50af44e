"""The loss's metrics under TRL 1.16's names, reduced from one value per sequence of each statistic that the token
kernel or its torch twin returns (``grpo_fast.kernels.loss_statistics`` names them).

A statistic's per-sequence value (``RowValues``) is the masked sum of a per-token quantity, or the sequence's own
value of a quantity that has one per sequence (the sequence-level ratio, its clip indicators with per-sequence
advantages, VESPO's phi with per-sequence advantages). A metric's reduction (``Metric.reduce``):
    mean                 TRL's global masked mean: the sum over sequences / the batch's tokens, or / B for values that
                         are one per sequence
    min / max_over_sequences   TRL's nanmin / nanmax over sequences of each sequence's masked mean (the value itself
                         when it is one per sequence); a sequence without tokens has none, and with none at all the
                         metric is NaN
``logged_metrics`` says which metrics a call logs, in order: every loss type's ``kl``, ``entropy``, ``policy_loss``
and ``ratio_mean``, and its record's own.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from grpo_fast.grpo_loss.options import Metric


class Metrics(dict):
    """The metrics of ``loss`` and ``token_loss``: detached float32 scalars under TRL's names.

    Attributes:
        logprobs: [B, T] float32, detached: the policy's per-token log-probs (zeros where the mask is 0).
        entropies: [B, T] float32, detached, or None when no entropy was computed.
    """

    logprobs: torch.Tensor
    entropies: torch.Tensor

    @classmethod
    def of(cls, names, values: torch.Tensor) -> Metrics:
        """The metrics from an op's values.

        Args:
            names: the metrics' names, in ``metric_names``' order.
            values: [M] float32, the op's values in that order.

        Returns:
            The Metrics, each value a detached scalar.
        """
        return cls(zip(names, values.detach().unbind(0)))


@dataclass(frozen=True)
class RowValues:
    """One statistic, one value per sequence [B] fp32: masked sums of a per-token quantity, or (``per_sequence``) the
    sequence's own value of a quantity that has one per sequence."""

    values: torch.Tensor
    per_sequence: bool = False


# the metrics every loss type logs (its record's own come between entropy and policy_loss, in logged_metrics)
KL = Metric("kl", "kl")
ENTROPY = Metric("entropy", "entropy")
POLICY_LOSS = Metric("policy_loss", "loss")  # the loss before the entropy bonus: loss_metrics' policy_loss
RATIO_MEAN = Metric("ratio_mean", "ratio")


def logged_metrics(options, has_entropy: bool) -> tuple[Metric, ...]:
    """Every metric a loss call logs, in the order of the token-loss op's metrics vector.

    Args:
        options: a ``grpo_fast.LossOptions``.
        has_entropy: the token entropies are given.

    Returns:
        ``kl`` (beta != 0), ``entropy`` (with the entropies), the loss type's own (its record's ``metrics``),
        ``policy_loss`` (entropy_coef != 0) and ``ratio_mean``, as ``Metric`` records.
    """
    return (
        ((KL,) if options.beta != 0.0 else ())
        + ((ENTROPY,) if has_entropy else ())
        + options.loss_type_record.metrics
        + ((POLICY_LOSS,) if options.entropy_coef != 0.0 else ())
        + (RATIO_MEAN,)
    )


def metric_names(options, has_entropy: bool) -> list[str]:
    """The names of ``logged_metrics``, in its order."""
    return [metric.name for metric in logged_metrics(options, has_entropy)]


def loss_metrics(options, rows, counts, policy_loss=None):
    """The metrics of ``logged_metrics``, reduced from the per-sequence statistics, without a host read.

    Args:
        options: a ``grpo_fast.LossOptions``.
        rows: ``{statistic: RowValues}``: "ratio", "kl" with beta != 0, "entropy" when given, and those the loss
            type's metrics name.
        counts: each sequence's token count [B].
        policy_loss: the loss before the entropy bonus (a scalar tensor), logged with ``entropy_coef != 0``.

    Returns:
        ``{TRL's metric name: detached fp32 scalar tensor}``, in ``logged_metrics``' order.

    Raises:
        ValueError: a metric of the loss type's record has a reduction this function does not know.
    """
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
    for metric in logged_metrics(options, "entropy" in rows):
        if metric is POLICY_LOSS:
            metrics[metric.name] = policy_loss
        elif metric.reduce == "mean":
            metrics[metric.name] = mean(metric.statistic)
        elif metric.reduce == "min_over_sequences":
            metrics[metric.name] = over_sequences(metric.statistic, torch.min, math.inf)
        elif metric.reduce == "max_over_sequences":
            metrics[metric.name] = over_sequences(metric.statistic, torch.max, -math.inf)
        else:
            raise ValueError(
                f"metric {metric.name!r} of loss type {options.loss_type!r} has an unknown reduction {metric.reduce!r}"
            )
    return {name: value.detach().float().reshape(()) for name, value in metrics.items()}
