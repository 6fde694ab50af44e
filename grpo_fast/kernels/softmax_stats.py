"""Layer 1's per-token softmax statistics: one mergeable record, its one merge, and what the outputs and the
backward read from it. Plain torch (no Triton): the torch backend uses it too.

The record of token n over a set A of vocabulary entries (the Triton forward's patch of tiles, a chunk of the torch
twin or of the frozen head, a vocab-parallel rank's shard; ``record`` in torch), z the transformed logits, y the
target:
    max     m  = max_{v in A} z_v                        (-inf when A holds no finite logit)
    sumexp  S  = sum_{v in A} exp(z_v - m)
    rest    R  = sum_{v in A, v != y} exp(z_v - m)      (the target kept out of the sum)
    zsum    Z  = sum_{v in A} exp(z_v - m) (z_v - m)    (relative to m: large logits do not cancel; entropy only)
    target  zy = z_y if y is in A, else 0
(sums relative to 0 instead of m when m = -inf: they are all 0 then). Records of disjoint sets merge, in any order
and grouping, by ``merge``: m = max_k m_k, a_k = exp(m_k - m),
    S = sum_k a_k S_k,  R = sum_k a_k R_k,  Z = sum_k a_k (Z_k + (m_k - m) S_k),  zy = sum_k zy_k.
Its users: the Triton forward's per-patch partials (merged by a second kernel) and the frozen-head kernel's vocabulary
chunks, by these formulas; the torch twin's chunks and a vocab-parallel head's ranks (over two all-reduces), by
``merge``. The frozen head finishes its J with ``finish_frozen_grad``.

``finish`` turns the merged record into the outputs and into what the backward reads (``BackwardStats``), forming
nothing by cancellation where a token is confident (p_y near 1, z_y = m):
    log S = (zy - m) + log1p(R / e_y), e_y = exp(zy - m)   (not log of the rounded S = e_y + R; where zy is near m)
    lse = m + log S
    logp = -log1p(R / e_y)                               (= zy - lse; exact to fp32 rounding when 1 - p_y is tiny)
    H = log S - Z / S                                    (= lse - mean; both terms >= 0 when z_y = m)
    mean = m + Z / S                                     (sum_v p_v z_v: the entropy gradient's non-target columns)
    nontarget_mass = R / S                               (1 - p_y: the target column's dlogp term, c (1 - p_y))
    mean_minus_target = (m - zy) + Z / S                 (sum_{v != y} p_v (z_v - z_y): its entropy term)
A backward that recomputes the logits forms every non-target column from p_v = exp(z_v - lse) (relative precision
kept) and the target column from these two carried values only, never from 1 - p_y or mean - z_y recomputed.
"""

from typing import NamedTuple

import torch


class SoftmaxStats(NamedTuple):
    """The record above: fp32 tensors of one shape (a leading dimension indexes records to ``merge``)."""

    max: torch.Tensor
    sumexp: torch.Tensor
    rest: torch.Tensor
    zsum: torch.Tensor
    target: torch.Tensor


class BackwardStats(NamedTuple):
    """What the general path's backward reads per token ([N] fp32 each; the last two None without the entropy):
    lse, nontarget_mass = 1 - p_y, mean_logit = sum_v p_v z_v, mean_minus_target = mean_logit - z_y."""

    lse: torch.Tensor
    nontarget_mass: torch.Tensor
    mean_logit: "torch.Tensor | None"
    mean_minus_target: "torch.Tensor | None"


def _pivot(row_max):
    """The finite reference the sums are taken against: m, or 0 where m is -inf (no inf - inf)."""
    return torch.where(torch.isinf(row_max), torch.zeros_like(row_max), row_max)


def record(z, local_target, compute_entropy=True):
    """The record of a block of logits z [rows, cols] (fp32; -inf allowed) whose target column is ``local_target``
    [rows] (outside [0, cols): the target is not in this block), and exp(z - m) with the target column zeroed (the
    frozen head's P' before its slope), [rows, cols]."""
    row_max = z.max(dim=1).values
    pivot = _pivot(row_max)
    e = torch.exp(z - pivot[:, None])
    sumexp = e.sum(1)
    # e is 0 where z is -inf: zero those z first so that 0 * -inf never forms a NaN
    zsum = (
        (e * torch.where(torch.isinf(z), 0.0, z - pivot[:, None])).sum(1)
        if compute_entropy
        else torch.zeros_like(sumexp)
    )
    in_block = (local_target >= 0) & (local_target < z.shape[1])
    rows = torch.nonzero(in_block).squeeze(1)
    columns = local_target[rows]
    target = torch.zeros_like(sumexp)
    target[rows] = z[rows, columns]
    e[rows, columns] = 0.0  # e now holds the other entries only
    return SoftmaxStats(row_max, sumexp, e.sum(1), zsum, target), e


def merge(stats: SoftmaxStats) -> SoftmaxStats:
    """Fold the records along dimension 0 into one (see the module docstring)."""
    row_max = stats.max.max(dim=0).values
    pivot = _pivot(row_max)
    scale = rescale(stats.max, row_max)
    # (m_k - m) S_k: an empty record adds nothing (its S_k is 0, and -inf * 0 must not form a NaN)
    shift = torch.where(scale > 0, (stats.max - pivot) * stats.sumexp, torch.zeros_like(scale))
    return SoftmaxStats(
        row_max,
        (stats.sumexp * scale).sum(0),
        (stats.rest * scale).sum(0),
        ((stats.zsum + shift) * scale).sum(0),
        stats.target.sum(0),
    )


def rescale(row_max, merged_max):
    """a_k = exp(m_k - m): what a record's sums (taken against its own max m_k) are multiplied by to be taken against
    the merged max m (0 for an empty record, m_k = -inf)."""
    return torch.exp(row_max - _pivot(merged_max))


def empty(row_max):
    """The record of no vocabulary entry, taken against ``row_max`` [N]: sums 0 (max -inf: the record of an empty
    vocab-parallel shard; a finite max: what ``merge`` needs to express another record against that max)."""
    nothing = torch.zeros_like(row_max)
    return SoftmaxStats(row_max, nothing, nothing, nothing, nothing)


def stack(*records: SoftmaxStats) -> SoftmaxStats:
    """Records of one shape, stacked for ``merge``."""
    return SoftmaxStats(*(torch.stack(fields) for fields in zip(*records)))


def finish(stats: SoftmaxStats, compute_entropy: bool):
    """(logp, entropy, BackwardStats) from a merged record, [N] fp32 each (entropy None without ``compute_entropy``;
    then the record's zsum is not read)."""
    pivot = _pivot(stats.max)
    target_shift = stats.target - pivot  # z_y - m <= 0
    # log S = (z_y - m) + log1p(R / e_y): S = e_y + R rounded would lose R where the token is confident (S = 1 + 1e-6);
    # far below the max (e_y could underflow) log S itself has no cancellation to fear
    near_max = target_shift > -30.0
    log1p_rest = torch.log1p(stats.rest / torch.exp(target_shift.clamp(min=-30.0)))
    log_sumexp = torch.where(near_max, target_shift + log1p_rest, torch.log(stats.sumexp))
    lse = pivot + log_sumexp
    logp = torch.where(near_max, -log1p_rest, target_shift - log_sumexp)
    nontarget_mass = stats.rest / stats.sumexp
    entropy = mean_logit = mean_minus_target = None
    if compute_entropy:
        relative_mean = stats.zsum / stats.sumexp
        entropy = log_sumexp - relative_mean
        mean_logit = pivot + relative_mean
        mean_minus_target = relative_mean - target_shift
    return logp, entropy, BackwardStats(lse, nontarget_mass, mean_logit, mean_minus_target)


def finish_frozen_grad(acc, stats: SoftmaxStats, target_slope, weight, local_target, row_chunk=1024):
    """The frozen head's J = d logp / d h = (s'_y R W_y - acc) / S, in place of acc [N, D] fp32 (returned).

    acc = sum_{v != y} e_v s'_v W_v over ``weight``'s rows, taken against ``stats.max`` (e_v = exp(z_v - m)); R and S
    the record's rest and sumexp against the same max; target_slope [N] s'_y = dz/du at the target. The target's own
    term is R-weighted (1 - p_y = R / S, a sum of positive terms, never 1 - p_y by cancellation), added only where
    ``local_target`` is a row of ``weight`` (a vocab-parallel head's other ranks pass -1: their acc parts, finished
    with the merged R and S, sum to J). Rows are finished ``row_chunk`` at a time: W_y's fp32 copy stays small."""
    V = weight.shape[0]
    for n0 in range(0, acc.shape[0], row_chunk):
        n1 = min(n0 + row_chunk, acc.shape[0])
        part = acc[n0:n1].neg_()
        if V > 0:  # an empty vocab-parallel shard: no target, no rows to read
            tgt = local_target[n0:n1]
            target_weight = torch.where((tgt >= 0) & (tgt < V), target_slope[n0:n1] * stats.rest[n0:n1], 0.0)
            part.add_(weight[tgt.clamp(0, V - 1)].float().mul_(target_weight[:, None]))
        part.div_(stats.sumexp[n0:n1, None])
    return acc
