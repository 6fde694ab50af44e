"""The sampling parameters' log-prob pass from the record sweep's tile candidates: the log-prob's own forward
(``kernels.forward``: one GEMM sweep, no logits in memory) also lists, of each vocabulary tile, a row's 3 largest
logits (ties repeated) and the 4th, which bounds the tile's others; the kept set is chosen from those. The Triton
backend's path (one process, top-k 0 or up to ``LISTED``) for the old and reference policies' support log-probs and,
with the entries' columns, for the trained policy's (gradients: ``carried_backward``).

Math. Per row: the entries (every tile's 3 largest logits: each entry one logit, a tie as often as it lies in its
tile's 3), b_t the largest logit no tile lists (the tiles' 4th), the record's m, s = sum exp(z - m), its non-target
part, z_y; sorted, the ``LISTED`` largest entries and b_l, the larger of b_t and the next entry (every logit above
b_l is listed, once).
* min-p's floor m + log(min_p) (as ``support_rows``); top-k's k-th logit: the k-th listed; top-p over the listed
  survivors' masses exp(v - m), summed in fp64 from the top (a tie group shares the mass strictly above it),
  against their total: s, or after a floor the entries' mass at or above it;
* a row is resolved where no logit outside the sums could change them: tau and a floor before top-p above b_l (with
  min-p above b_t, the sums over every entry: its survivors may outnumber the list); with top-p the first listed
  survivor that falls out at or above b_t (the cut lies in the list), or every survivor listed (b_l below the floor).
Then kept = sum_{v >= tau} exp(v - m) over the listed entries (with min-p every entry) and its non-target part, the
same over the entries off the target's logit plus exp(z_y - m) once for each tie with it beyond the target's own (the
target's logit is bitwise an entry's: the same tile computed both): sums of positive terms, never a difference.

Rows not resolved (a tile holding 4 or more of the kept set: at random placement 3.5e-4 of the rows for top-k = 64
at V = 151936 in 128-column tiles, 2.7e-3 in 256-column ones; ties past a tile's 3 or the list's end at the
threshold; top-p's cut past the list; a NaN or infinite record) go whole to the rows' path (``support_rows``): each
row's record comes from one path, so its log-prob, threshold and sums agree.

With gradients the set must not change between the passes, and a backward's recompute rounds otherwise than the
tile (a logit at tau could leave the set it was counted in): the sweep then also lists where each tile's entries lie
(``kforward._tile_columns``), and the record carries each resolved row's kept ids (``kept_columns``; a tie among a
tile's kept entries or more than ``LISTED`` of them: the rows' path) to a backward of layer 1's for the log-prob and
the ids' gathers for the support. Vocab-parallel heads take the rows' path.

Cost (argued from the compiled code until a GPU times it: ``docs/sampler-support.md``, ``tools/sm_compile.py
--mix``): the log-prob's record sweep with one more row reduction, a top-four network of min / max (~8 SASS
instructions a logit more on sm_90, most on the ALU pipe), 4 fp32 a row and tile written (4 / 128 of the logits'
count in 128-column tiles, within ``kernels.forward.PARTS_BYTES`` a launch), then the selection: on the Triton
backend one kernel a launch (``kernels.tile_selection``: a running top-64 and the 65th over the 3 x tiles entries a
row, reading the 4 x tiles fp32 once, then the rule above in registers), in torch (``_select``, the twin) ~47 small
operations a launch over [rows, 65] (top-p ~95); the record's fields from the sums once a call (~12 operations over
[N]). At the Qwen2.5-1.5B head, N 16384, on an H200: the kernel's selection ~0.15-0.3 ms (the torch one's 0.9-1.6),
the pass ~1.07-1.15x the plain log-prob pass; with gradients the columns' ~8 instructions a logit more, forward and
backward ~1.07-1.12x the plain pass's (argued, not measured).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch

from grpo_fast.backends import support_rows, support_twin
from grpo_fast.kernels import forward as kforward
from grpo_fast.kernels import softmax_stats
from grpo_fast.kernels.operands import HeadGrads, HeadOperands, SamplerSupport, SupportRecord
from grpo_fast.kernels.tile_selection import LISTED


def serves(support: SamplerSupport, reduce) -> bool:
    """Whether this path computes the support: the sampling parameters with top-k 0 or up to ``LISTED``, one
    process's whole head."""
    one_process = reduce is None or reduce is support_twin.ONE_PROCESS
    return support.kept_ids is None and support.top_k <= LISTED and one_process


class SelectionKernels(NamedTuple):
    """The kernels a backend passes for the selection's steps (None: their torch forms here, the twins):
    ``select`` for ``_select`` (``kernels.tile_selection.select``), ``kept_columns`` for ``kept_columns``
    (``kernels.tile_selection.kept_columns``); each one launch a launch of the sweep."""

    select: Callable | None = None
    kept_columns: Callable | None = None


TORCH_FORMS = SelectionKernels()


def parameter_forward(
    head: HeadOperands,
    support: SamplerSupport,
    config,
    rows_forward,
    kernels: SelectionKernels = TORCH_FORMS,
    carry=False,
) -> SupportRecord:
    """The SupportRecord of ``head``'s rows (module docstring); ``config``: ``kernels.forward``'s launch;
    ``rows_forward(head, support) -> SupportRecord``: the rows' path, for the rows the candidates do not resolve;
    ``kernels``: the selection's (``SelectionKernels``). ``carry`` (a backward follows): the sweep lists its entries'
    columns too and the record carries each resolved row's kept ids (``kept_columns``), a row of -1 for those the
    rows' path took."""
    N, V = head.hidden.shape[0], head.weight.shape[0]
    device = head.hidden.device
    ids = torch.full((N, LISTED), -1, dtype=torch.int64, device=device) if carry else None
    record = SupportRecord.to_fill(N, device, ids)
    tau, kept, kept_rest = torch.empty((3, N), dtype=torch.float32, device=device)
    resolved = torch.zeros(N, dtype=torch.bool, device=device)

    def select(n0, n1, candidates, stats):
        m, s, _, _, target_logit = stats.unbind(0)
        out = tuple(x[n0:n1] for x in (tau, kept, kept_rest, resolved))
        _select(candidates[: kforward.candidate_fields()], m, s, target_logit, support, V, kernels.select, out)
        if carry:
            kept_columns(candidates, tau[n0:n1], resolved[n0:n1], config.block_v, ids[n0:n1], kernels.kept_columns)

    m, s, rest, _, target_logit = kforward.forward_record(
        head, False, config, tile_candidates=select, candidate_columns=carry
    )
    support_rows.fill_record(record, slice(None), target_logit, m, (s, rest), tau, (kept, kept_rest))
    pending = (~resolved).nonzero().squeeze(-1)
    if pending.numel():
        rows = rows_forward(head.rows(pending), support)
        for field, values in zip(record[:-1], rows[:-1]):  # the rows' path carries no ids: theirs stay -1
            field[pending] = values
    return record


def kept_columns(candidates, tau, resolved, block_v, ids, kernel=None):
    """Each resolved row's kept ids from its tiles' candidates with their columns (``candidates`` [5, tiles, n]: the
    entries, the bound, then ``kforward._tile_columns``' int32 in fp32 bits), written into ``ids`` [n, LISTED] (-1
    after them); ``resolved`` [n] cleared in place where the columns cannot name the set: a tie among a tile's kept
    entries (the sums name tied columns together), or more kept entries than ``LISTED`` (min-p's).

    A tile keeping r of its entries (v_1 >= v_2 >= v_3 its 3 largest): r = 1: v_1 > v_2 (v_2 < tau), the column F_1;
    r = 2: v_2 > v_3, the columns F_1 and F_2 - F_1 where v_1 > v_2; r = 3: v_3 above the tile's 4th (it bounds no
    kept logit in a resolved row), F_1, F_2 - F_1, F_3 - F_2 where v_1 > v_2 > v_3. The ids by value descending
    (torch's topk: ties across tiles in its own order). ``kernel``: None (this torch form, the kernel's twin) or the
    kernel (``parameter_forward``), which writes the same."""
    if kernel is not None:
        return kernel(candidates, tau, resolved, block_v, ids)
    C = kforward.TILE_CANDIDATES
    tiles = candidates.shape[1]
    values = candidates[:C].permute(2, 1, 0)  # [n, tiles, C]
    packed = candidates[C + 1].view(torch.int32).T.long()  # [n, tiles]
    bits = kforward.COLUMN_FIELD_BITS
    sums = [(packed >> (k * bits)) & ((1 << bits) - 1) for k in range(C)]  # F_1, F_2, F_3
    columns = torch.stack([sums[0], sums[1] - sums[0], sums[2] - sums[1]], dim=-1)
    kept = values >= tau[:, None, None]
    tied = (kept[..., 1] & (values[..., 0] == values[..., 1])) | (kept[..., 2] & (values[..., 1] == values[..., 2]))
    resolved &= ~tied.any(-1) & (kept.sum((1, 2)) <= LISTED)
    vocab_ids = torch.arange(tiles, device=values.device)[None, :, None] * block_v + columns
    order = torch.where(kept, values, -math.inf).reshape(kept.shape[0], -1)
    top = order.topk(min(LISTED, order.shape[-1]), dim=-1)
    chosen = kept.reshape(kept.shape[0], -1).gather(1, top.indices) & resolved[:, None]
    ids.fill_(-1)
    ids[:, : top.indices.shape[-1]] = torch.where(
        chosen, vocab_ids.reshape(kept.shape[0], -1).gather(1, top.indices), -1
    )
    return ids


def carried_backward(
    head: HeadOperands, record: SupportRecord, grad_logp, grad_support, grads: HeadGrads, layer1, dots
):
    """The gradients of a record that carries its kept ids (``parameter_forward`` with ``carry``) into ``grads``
    (fp32 zeros): the log-prob's by ``layer1(stats, grad_logp, grads)`` (the backend's layer-1 backward, first: it
    may write dH and take dW zero on entry), the support's over each row's carried set by ``dots``' gathers
    (``support_twin.replayed_backward``: the set is the forward's, whatever the gathers' rounding), and the rows the
    rows' path took (no ids: a host read of which) by its own recompute of their rows."""
    if head.hidden.shape[0] == 0:  # no row: nothing to add
        return
    if grad_logp is not None:
        layer1(softmax_stats.BackwardStats(record.lse, record.nontarget_mass, None, None), grad_logp, grads)
    if grad_support is None:
        return
    support_twin.replayed_backward(head, record.carried_ids, record, grad_support, grads, dots)
    rows = (record.carried_ids[:, 0] < 0).nonzero().squeeze(-1)
    if rows.numel() == 0:
        return
    # dH's rows (and LoRA's) into buffers of their own, added back; dW, db and LoRA's weight into the call's
    own = [
        torch.zeros((rows.numel(), g.shape[1]), dtype=g.dtype, device=g.device) if g is not None else None
        for g in (grads.hidden, grads.lora_hidden)
    ]
    rows_grads = grads._replace(hidden=own[0], lora_hidden=own[1])
    rows_record = SupportRecord(*(x[rows] for x in record))
    support_twin.parameter_backward(head.rows(rows), rows_record, None, grad_support[rows], rows_grads)
    for buffer, part in zip((grads.hidden, grads.lora_hidden), own):
        if part is not None:
            buffer.index_add_(0, rows, part)


def _kept_sums(values, e, tau, target_logit, m):
    """(kept, kept_rest) [n]: the sum of ``e`` (each entry's exp(v - m)) over the entries v >= tau, and the same
    with one entry at the target's logit left out (z_y: ties with it stay): sums of positive terms."""
    at = values >= tau[:, None]
    is_target = values == target_logit[:, None]
    kept = torch.where(at, e, 0.0).sum(-1)
    ties = (at & is_target).sum(-1).sub(1).clamp(min=0)
    kept_rest = torch.where(at & ~is_target, e, 0.0).sum(-1) + ties * torch.exp(target_logit - m)
    return kept, kept_rest


def _at(x, index):
    return x.gather(-1, index[:, None]).squeeze(-1)


def _select(candidates, m, s, target_logit, support: SamplerSupport, vocab_size, kernel=None, outputs=None):
    """(tau, kept, kept_rest, resolved) [n] of a launch's rows from its tiles' candidates [fields, tiles, n]; written
    to ``outputs`` (four [n] tensors) when given. ``kernel``: None (this torch form, the kernel's twin), or the kernel
    (``parameter_forward``), which writes ``outputs``."""
    if kernel is not None:
        return kernel(candidates, m, s, target_logit, support, vocab_size, outputs)
    C = kforward.TILE_CANDIDATES
    n = m.shape[0]
    values = candidates[:C].permute(2, 0, 1).reshape(n, -1)  # every tile's entries, a row's
    outside = candidates[C].amax(0)  # the largest logit no tile lists
    top = values.topk(min(LISTED + 1, values.shape[-1]), dim=-1).values
    listed = top[:, :LISTED]
    L = listed.shape[-1]
    # the largest logit the list leaves out: every logit above it is listed, once a logit
    unlisted = torch.maximum(outside, top[:, L]) if top.shape[-1] > L else outside
    # min-p's survivors may outnumber the list: its sums run over every entry (their bound: ``outside``); the other
    # parameters' thresholds lie in the list, and so do their sums (bound: ``unlisted``)
    over, bound = (values, outside) if support.min_p > 0 else (listed, unlisted)
    e = torch.exp(over - m[:, None])
    # a NaN or infinite record (a NaN logit makes m NaN), or a target at -inf: the rows' path (one sum: few kernels)
    resolved = torch.isfinite(m + s + target_logit)
    floor = torch.full_like(m, -math.inf)
    if support.min_p > 0:
        floor = m + math.log(support.min_p)
    if 0 < support.top_k < vocab_size:
        if support.top_k > L:  # fewer entries than k (a small vocabulary)
            resolved = torch.zeros_like(resolved)
        floor = torch.maximum(floor, listed[:, min(support.top_k, L) - 1])
    tau = floor
    if support.top_p < 1:
        cut = floor > -math.inf
        resolved &= ~cut | (bound < floor)
        total = torch.where(cut, torch.where(over >= floor[:, None], e, 0.0).sum(-1).double(), s.double())
        survivors = listed >= floor[:, None]
        mass = torch.where(survivors, torch.exp(listed - m[:, None]).double(), 0.0)
        kept = survivors & (support_twin.mass_strictly_above(listed, mass) < support.top_p * total[:, None])
        j = kept.sum(-1)
        out = j.clamp(max=L - 1)
        # the first listed survivor that falls out: no logit outside the list lies above it (the entries below the
        # list lie below it, the others at most ``outside``), so the cut is the list's; or every survivor is listed
        falls_out = (j < L) & _at(survivors, out) & (outside <= _at(listed, out))
        resolved &= (j >= 1) & (falls_out | (unlisted < floor))
        tau = _at(listed, (j - 1).clamp(min=0))
    resolved &= bound < tau
    kept, kept_rest = _kept_sums(over, e, tau, target_logit, m)
    if outputs is None:
        return tau, kept, kept_rest, resolved
    for x, value in zip(outputs, (tau, kept, kept_rest, resolved)):
        x.copy_(value)
    return outputs
