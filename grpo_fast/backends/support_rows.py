"""The sampling parameters' forward over a chunk's rows of logits by row sweeps: the per-row record with the row's
largest logits as candidates, then the kept set's sums at its threshold (``RowSweeps``: the Triton backend's
``kernels.kept_rows``, the torch backend's torch ops, one contract).

Per chunk: the rows z [n, V] fp32 (``support_twin``'s, cuBLAS), then
1. ``records``: max m, s = sum exp(z - m), its non-target part, z_y, and C candidates (C = 64, or the power of two at
   least top_k): the log-prob's record, merged over a vocab-parallel group as the head's records merge;
2. the threshold from the candidates: min-p's floor m + log(min_p), top-k's k-th candidate, top-p over the surviving
   candidates with the survivors' mass (``kept_sums`` at the floor, or s where nothing is cut before top-p); a row
   whose cut the candidates cannot show (every candidate at or above the shards' last one kept) goes to
   ``support_twin``'s selection on its row, as do top-k's above 64;
3. ``kept_sums`` at the threshold: the kept mass and its non-target part.
Two or three reads of the rows where the twin's torch passes take some ten; the same arithmetic on both backends,
so both give the same kept sets.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch

from grpo_fast.backends import support_twin
from grpo_fast.kernels.operands import HeadOperands, SamplerSupport, SupportRecord

CANDIDATES = 64


class RowSweeps(NamedTuple):
    """``records(z, targets, candidates) -> ([n, 4] max, sum exp(z - max), its non-target part, z_y; [n, C] or
    None)`` and ``kept_sums(z, targets, floor, pivot) -> [n, 2]`` (``kernels.kept_rows``' contract); targets outside
    [0, V) have no entry."""

    records: Callable
    kept_sums: Callable


def _without_target(e, total, targets):
    """[n] the rows' sums of ``e`` [n, V_local] over every entry but the target's (a sum over the others, never
    total - e_y: a confident token's would cancel); ``total`` where this shard does not hold the target."""
    V = e.shape[-1]
    if V == 0:  # a shard without rows
        return total
    owned = (targets >= 0) & (targets < V)
    return torch.where(owned, e.scatter(1, targets.clamp(0, V - 1)[:, None], 0.0).sum(-1), total)


def _torch_records(z, targets, candidates):
    n, V = z.shape
    m = z.amax(dim=-1) if V else z.new_full((n,), -math.inf)
    e = torch.exp(z - torch.where(m == -math.inf, 0.0, m)[:, None])
    s = e.sum(-1)
    owned = (targets >= 0) & (targets < V)
    at = targets.clamp(0, max(V - 1, 0))[:, None]
    target = torch.where(owned, z.gather(-1, at).squeeze(-1), -math.inf) if V else z.new_full((n,), -math.inf)
    top = support_twin._largest(z, candidates) if candidates else None
    return torch.stack([m, s, _without_target(e, s, targets), target], dim=-1), top


def _torch_kept_sums(z, targets, floor, pivot):
    e = torch.where(z >= floor[:, None], torch.exp(z - torch.where(pivot == -math.inf, 0.0, pivot)[:, None]), 0.0)
    total = e.sum(-1)
    return torch.stack([total, _without_target(e, total, targets)], dim=-1)


TORCH_ROW_SWEEPS = RowSweeps(_torch_records, _torch_kept_sums)


def _merged(records, reduce):
    """(top, s, rest, z_y) [n] over every shard: each rank's sums against the global max."""
    m, s, rest, target = records.unbind(-1)
    top = reduce.max(m)
    pivot = torch.where(top == -math.inf, 0.0, top)
    scale = torch.exp(m - pivot)
    s, rest = reduce.sum(torch.stack([s * scale, rest * scale])).unbind(0)
    return top, s, rest, reduce.max(target)


def _sums(sweeps, z, targets, floor, top, reduce):
    return reduce.sum(sweeps.kept_sums(z, targets, floor.contiguous(), top.contiguous()).T.contiguous()).unbind(0)


def _candidate_count(support: SamplerSupport, vocab_size):
    """C: 64 with top-p, at least top_k with top-k (a power of two); 0 where the candidates cannot serve (top_k past
    64: the twin's selection)."""
    k = support.top_k if 0 < support.top_k < vocab_size else 0
    if k > CANDIDATES:
        return None
    if support.top_p < 1:
        return CANDIDATES
    return 1 << max(k - 1, 0).bit_length() if k else 0


def _threshold(z, targets, support, top, s, candidates, vocab_size, reduce, sweeps):
    """tau [n] from the candidates (module docstring); rows they do not resolve: ``support_twin``'s selection."""
    floor = torch.full_like(top, -math.inf)
    if support.min_p > 0:
        floor = top + math.log(support.min_p)
    merged = None
    if candidates is not None:
        merged = reduce.gather(candidates).sort(dim=-1, descending=True).values
    if 0 < support.top_k < vocab_size:
        floor = torch.maximum(floor, merged[:, support.top_k - 1])
    if support.top_p >= 1:
        return floor
    survivors = torch.where(merged >= floor[:, None], merged, -math.inf)
    total = s.double()
    if bool((floor > -math.inf).any()):
        total = torch.where(floor > -math.inf, _sums(sweeps, z, targets, floor, top, reduce)[0].double(), total)
    kept = support_twin._strictly_above(survivors, top) < support.top_p * total[:, None]
    # every entry above the largest shard's last candidate is a candidate; a survivor there that falls out shows the
    # cut, and so does a candidate list that holds every survivor
    last = reduce.max(candidates[:, -1] if z.shape[-1] > candidates.shape[-1] else torch.full_like(top, -math.inf))
    shown = (
        ((~kept) & (survivors >= last[:, None]) & (survivors > -math.inf)).any(-1)
        | (last < floor)
        | (last == -math.inf)
    )
    tau = survivors.gather(-1, kept.sum(-1, keepdim=True).clamp(min=1) - 1).squeeze(-1)
    if not bool(shown.all()):
        pending = (~shown).nonzero().squeeze(-1)
        rows = z[pending].masked_fill(z[pending] < floor[pending, None], -math.inf)
        tau[pending] = support_twin._top_p_threshold(rows, top[pending], support.top_p, reduce)
    return tau


def parameter_forward(head: HeadOperands, support: SamplerSupport, vocab_size, reduce, sweeps: RowSweeps):
    """``support_twin.parameter_forward``'s record by row sweeps (module docstring)."""
    N = head.hidden.shape[0]
    vocab_size = head.weight.shape[0] if vocab_size is None else vocab_size
    count = _candidate_count(support, vocab_size)
    record = SupportRecord.to_fill(N, head.hidden.device)
    for n0, n1 in support_twin._rows(head):
        z = support_twin._row_logits(head, n0, n1).contiguous()
        targets = head.targets[n0:n1].contiguous()
        records, candidates = sweeps.records(z, targets, count or 0)
        top, s, rest, target_logit = _merged(records, reduce)
        if count is None:  # top-k past the candidates
            tau = support_twin.kept_threshold(z, support, top, vocab_size, reduce)
        else:
            tau = _threshold(z, targets, support, top, s, candidates, vocab_size, reduce, sweeps)
        kept, kept_rest = _sums(sweeps, z, targets, tau, top, reduce)
        fill_record(record, slice(n0, n1), target_logit, top, (s, rest), tau, (kept, kept_rest))
    return record


def fill_record(record: SupportRecord, rows, target_logit, top, sums, tau, kept_sums):
    """``record``'s ``rows`` from the rows' max ``top``, their sums against it (``sums``: sum exp(z - top) and its
    non-target part; ``kept_sums``: the same over {z >= tau}), z_y and tau."""
    (s, rest), (kept, kept_rest) = sums, kept_sums
    record.target_logit[rows] = target_logit
    record.lse[rows] = top + torch.log(s)
    record.nontarget_mass[rows] = rest / s
    record.kept_lse[rows] = top + torch.log(kept)
    record.kept_nontarget_mass[rows] = kept_rest / kept
    record.threshold[rows] = tau
    record.logprob[rows] = record.target_logit[rows] - record.lse[rows]
