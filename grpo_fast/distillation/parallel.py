"""The divergence head over a vocab-parallel pair of heads: the student's and the teacher's weights split by the same
vocabulary ranges over a process group (grpo_fast.VocabShard, or DTensors sharded on dim 0), never gathered.

Every rank sees the same tokens (both models' hidden states, replicated) and holds rows [offset, offset + V_local)
of both weights (and biases). Each rank returns exactly what the unsharded head returns:

* forward: each rank builds both models' records (divergence_torch.records: max, argmax, rest, cross, other, zsum,
  unsupported) over its rows, the argmax a global index. A divergence has no targets, so every row of a shard is
  scored alike. The records are merged over the group as the log-prob head merges its own (vocab_parallel), with
  all-reduces of [k, N] tensors, the argmax kept out of the sums as divergence_torch.merge keeps it:
    1. MAX of both models' maxima [2, N] fp32;
    2. MIN of the argmax candidates [2, N] int64 (a rank's argmax where its max is the global one, else the
       largest int64): the first global argmax, as one process picks it;
    3. SUM of the other model's logit at that argmax [2, N] fp32 (from its owner; 0 elsewhere);
    4. each rank's record re-expressed against the global (max, argmax, other) by divergence_torch.merge with a
       record holding only those (it wins: the rank's own argmax term moves into the rest, its cross and z-sums are
       shifted, all scaled by exp(m_r - m)); the owner's record is already in that form. Then one SUM of [8, N]
       fp32 (both models' rest, cross, z-sum and unsupported flag): records sharing (max, argmax, other) merge by
       adding their sums, which are sums of same-signed parts (1 - p is carried, as unsharded).
  Why all-reduces and not one all_gather of the records: the bytes do not grow with the number of ranks (an
  all_gather hands every rank world x 56 N bytes), and the order of the ranks does not matter (ties go to the
  lowest global index by the MIN). The merged records are finished by divergence_torch.finish, as one process
  finishes its own. The generalized JSD's second sweep runs over each shard with the global finished records and
  its two per-token sums (JSD, sum_v p_s (r_v - r_a)) are all-reduced: [2, N] fp32.
* backward: each rank runs divergence_torch.backward on its shard with the forward's global saved values (the
  argmax columns exist on their owner only), keeps its dW and db rows, and all-reduces its partial dH (sum over its
  rows of g W_s) in fp32: N x Ds x 4 bytes, the only tensor larger than O(N).
* a frozen student head (only the hidden state needs a gradient; head_path "auto"): each rank folds
  divergence_torch.FrozenHead's sums over its rows with the records, re-expresses them against the merged records
  (``frozen_grad``: as merge re-expresses a losing record) and finishes its part of J = d divergence / d h_s with
  the global normalisers; one all-reduce (sum) of J, N x Ds fp32, in the forward, and the backward is dH = c J with
  no collective and no sweep.

Bytes through collectives per call (N scored tokens): 64 N in the forward (72 N for 0 < beta < 1) and 4 N Ds for dH
(in the backward; in the forward on the frozen-head path), whatever V is and whatever the number of ranks. Each
shard is computed by the chosen backend: the Triton kernels (kernels/divergence.py: ``records``, with its JSD
sweep, and ``backward`` take the shard's vocabulary offset; the merge stays here) or the torch twin (any device); the
frozen-head path is the torch twin's algorithm on every backend, as unsharded.

Requirements (not checked: checking would cost a collective per call): the shards tile [0, V) without overlap, the
student's and teacher's shards are the same ranges, and every rank passes the same hidden states, mask and upstream
gradients. dH is the whole gradient of the replicated hidden state: do not all-reduce it again.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from grpo_fast.distillation import torch_twin as divergence_torch
from grpo_fast.head.torch_twin import CHUNK_N
from grpo_fast.head.vocab_parallel import VocabShard, resolve
from grpo_fast.kernels import divergence as kdivergence

_NO_ARGMAX = torch.iinfo(torch.int64).max


def resolve_pair(
    student_hidden, student_weight, student_bias, teacher_hidden, teacher_weight, teacher_bias, vocab_parallel
):
    """(student_hidden, student_weight, student_bias, teacher_hidden, teacher_weight, teacher_bias, shard) as the
    head computes on them: both weights DTensors sharded on dim 0 (their local rows; the same ranges), or plain
    shards with one ``vocab_parallel=VocabShard(...)`` for both, or plain whole heads (shard None)."""
    dtensors = [type(w).__name__ == "DTensor" for w in (student_weight, teacher_weight)]
    if dtensors[0] != dtensors[1]:
        raise ValueError(
            "one of student_weight and teacher_weight is a DTensor and the other is not: pass both as "
            "DTensors sharded on dim 0 by the same ranges, or both as this rank's rows with "
            "vocab_parallel=VocabShard(...)"
        )
    student_hidden, student_weight, student_bias, shard = resolve(
        student_hidden, student_weight, student_bias, vocab_parallel
    )
    teacher_hidden, teacher_weight, teacher_bias, teacher_shard = resolve(
        teacher_hidden, teacher_weight, teacher_bias, vocab_parallel
    )
    if shard is not None:
        same = (
            teacher_shard.offset == shard.offset
            and teacher_shard.vocab_size == shard.vocab_size
            and teacher_shard.group == shard.group
            and teacher_weight.shape[0] == student_weight.shape[0]
        )
        if not same:
            raise ValueError(
                f"the teacher's head is sharded as rows [{teacher_shard.offset}, "
                f"{teacher_shard.offset + teacher_weight.shape[0]}) of {teacher_shard.vocab_size}, the "
                f"student's as [{shard.offset}, {shard.offset + student_weight.shape[0]}) of "
                f"{shard.vocab_size}: both heads must be split by the same vocabulary ranges"
            )
    return student_hidden, student_weight, student_bias, teacher_hidden, teacher_weight, teacher_bias, shard


def merge_over_group(student, teacher, group):
    """This rank's (student, teacher) divergence_torch.Records [N] -> the whole vocabulary's, on every rank (the
    module docstring's steps 1-4: four all-reduces, 64 N bytes)."""
    records = (student, teacher)
    maxima = torch.stack([r.max for r in records])
    dist.all_reduce(maxima, op=dist.ReduceOp.MAX, group=group)
    at_max = [r.max == m for r, m in zip(records, maxima, strict=True)]
    argmax = torch.stack([torch.where(top, r.argmax, _NO_ARGMAX) for r, top in zip(records, at_max, strict=True)])
    dist.all_reduce(argmax, op=dist.ReduceOp.MIN, group=group)
    owner = [top & (r.argmax == a) for r, top, a in zip(records, at_max, argmax, strict=True)]
    other = torch.stack([torch.where(own, r.other, 0.0) for r, own in zip(records, owner, strict=True)])
    dist.all_reduce(other, op=dist.ReduceOp.SUM, group=group)
    local = []
    for r, m, a, o, own in zip(records, maxima, argmax, other, owner, strict=True):
        nothing = torch.zeros_like(m)
        pivot = divergence_torch.Record(m, a, nothing, nothing, o, nothing, torch.zeros_like(r.unsupported))
        moved = divergence_torch.merge(pivot, r)  # the pivot wins (its max is the global one; on a tie, first)
        local.append(divergence_torch.Record(*(torch.where(own, x, y) for x, y in zip(r, moved, strict=True))))
    sums = torch.stack([x for r in local for x in (r.rest, r.cross, r.zsum, r.unsupported.float())])
    dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
    return tuple(
        divergence_torch.Record(m, a, s[0], s[1], o, s[2], s[3] > 0)
        for m, a, o, s in zip(maxima, argmax, other, sums.view(2, 4, -1), strict=True)
    )


def _rescale(local_max, merged_max):
    """exp(m_r - m): a rank's sums against the merged max (0 for an empty record)."""
    return torch.exp(local_max - divergence_torch._pivot(merged_max))


def _cat_records(parts, n, device):
    if not parts:
        return divergence_torch._empty_record(n, device)
    return divergence_torch.Record(*(torch.cat(fields) for fields in zip(*parts, strict=True)))


def forward(student_hidden, student_weight, student_bias, teacher_hidden, teacher_weight, teacher_bias, beta,
            student_transform, teacher_transform, shard, frozen_head=False, backend="torch"):  # fmt: skip
    """The whole vocabulary's forward, on every rank, from this rank's rows of both heads.

    Args:
        student_hidden, student_weight, student_bias, teacher_hidden, teacher_weight, teacher_bias: the replicated
            hidden states [N, Ds], [N, Dt] (N > 0) and this rank's rows of both heads (and biases).
        beta, student_transform, teacher_transform: as divergence_torch.forward.
        shard: this rank's VocabShard (offset and group).
        frozen_head: also build J = d divergence / d student_hidden (``frozen_grad``; one more all-reduce, N x Ds
            fp32).
        backend: "triton": this rank's records and JSD sums by the Triton kernels (kernels/divergence.py), except
            on the frozen-head path (the torch twin's algorithm on every backend, as unsharded) and on a shard of no
            rows (nothing to compute); "torch": the torch twin.

    Returns:
        divergence_torch.forward's (divergence [N], entropy [N], saved, argmax) and J [N, Ds] fp32 or None.
    """
    args = (student_hidden, student_weight, student_bias, teacher_hidden, teacher_weight, teacher_bias)
    if backend == "triton" and not frozen_head and student_weight.shape[0] > 0:
        *local, local_jsd = kdivergence.records(*args, beta, student_transform, teacher_transform, offset=shard.offset)[
            :3
        ]
        frozen = None
    else:
        local, local_jsd, frozen = _torch_records(*args, beta, student_transform, teacher_transform, shard, frozen_head)
    student, teacher = merge_over_group(*local, shard.group)

    def jsd_sweep(finished_s, finished_t, reference):
        sums = torch.stack(local_jsd(finished_s, finished_t, reference))
        dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=shard.group)
        return sums[0], sums[1]

    out = divergence_torch.finish(student, teacher, beta, jsd_sweep)
    if not frozen_head:
        return (*out, None)
    N = student_hidden.shape[0]
    grad = torch.cat(
        [
            frozen_grad(
                acc,
                tuple(divergence_torch.Record(*(x[n0 : n0 + CHUNK_N] for x in r)) for r in (*local, student, teacher)),
                out[2][:, n0 : n0 + CHUNK_N],
            )
            for n0, acc in zip(range(0, N, CHUNK_N), frozen, strict=True)
        ]
    )
    dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=shard.group)
    return (*out, grad)


def _torch_records(student_hidden, student_weight, student_bias, teacher_hidden, teacher_weight, teacher_bias, beta,
                   student_transform, teacher_transform, shard, frozen_head):  # fmt: skip
    """The torch twin's part of ``forward`` on this rank's rows, by token chunks.

    Returns:
        (local, local_jsd, frozen): this rank's (student, teacher) Records [N]; its JSD sweep, (finished student,
        finished teacher, r_a) -> (JSD, sum_v p_s (r_v - r_a)) [N] over its rows; the chunks' FrozenHead
        accumulators (Nones without ``frozen_head``).
    """
    N, dev = student_hidden.shape[0], student_hidden.device
    starts = range(0, N, CHUNK_N)
    frozen = [
        divergence_torch.FrozenHead(beta, min(CHUNK_N, N - n0), student_weight, shard.offset) if frozen_head else None
        for n0 in starts
    ]
    chunks = [
        divergence_torch.records(
            student_hidden[n0 : n0 + CHUNK_N],
            student_weight,
            student_bias,
            teacher_hidden[n0 : n0 + CHUNK_N],
            teacher_weight,
            teacher_bias,
            student_transform,
            teacher_transform,
            offset=shard.offset,
            frozen=acc,
        )
        for n0, acc in zip(starts, frozen, strict=True)
    ]
    local = tuple(_cat_records([c[k] for c in chunks], N, dev) for k in (0, 1))

    def local_jsd(finished_s, finished_t, reference):
        parts = [divergence_torch._jsd_sweep(
            student_hidden[n0:n0 + CHUNK_N], teacher_hidden[n0:n0 + CHUNK_N], student_weight, student_bias,
            teacher_weight, teacher_bias, beta, student_transform, teacher_transform,
            divergence_torch.Finished(*(x[n0:n0 + CHUNK_N] for x in finished_s)),
            divergence_torch.Finished(*(x[n0:n0 + CHUNK_N] for x in finished_t)),
            reference[n0:n0 + CHUNK_N], acc,
            offset=shard.offset) for n0, acc in zip(starts, frozen, strict=True)]  # fmt: skip
        return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])

    return local, local_jsd, frozen


def frozen_grad(acc, records, saved):
    """This rank's part of J = d divergence / d student_hidden [n, Ds] fp32 (the ranks' parts sum to J) from its
    FrozenHead ``acc`` (sums over its rows against its own records), its (student, teacher) records and the merged
    ones, and the finished saved values (FrozenHead's docstring has the sums). The JSD's sums were taken in the second
    sweep with the global normalisers: its part is FrozenHead.finish as it is. For beta 0 and 1 each rank's sums are
    re-expressed against the global record as divergence_torch.merge re-expresses a losing record: scaled by
    exp(m_r - m); beta 1: B1 shifted by (g_r - g) B0 (g = z_s - z_t at the argmax); beta 0: the rank's own argmax
    term (its slope times its W row) moves into A where that argmax is not the global one, and the global argmax's
    column is added by its owner only."""
    local_s, local_t, student, teacher = records
    if acc.beta not in (0.0, 1.0):
        return acc.finish(student, teacher, saved)
    if acc.beta == 1.0:
        scale = _rescale(local_s.max, student.max)
        shift = (local_s.max - local_s.other) - (student.max - student.other)
        acc.second = divergence_torch._zero_where(
            (scale == 0)[:, None], scale[:, None] * (acc.second + shift[:, None] * acc.first)
        )
        acc.first = acc.first * scale[:, None]
        return acc.finish(student, teacher, saved)
    for k, (mine, merged) in enumerate(((local_s, student), (local_t, teacher))):
        owner = (mine.argmax == merged.argmax) & (mine.max == merged.max)
        moved = torch.where(~owner & (mine.max > float("-inf")), acc.slope_top[k], 0.0)
        scale = _rescale(mine.max, merged.max)
        total = (acc.first, acc.second)[k] + moved[:, None] * acc.rows(mine.argmax)
        total = divergence_torch._zero_where((scale == 0)[:, None], scale[:, None] * total)
        acc.first, acc.second = (total, acc.second) if k == 0 else (acc.first, total)
        acc.slope_top[k] = torch.where(owner, acc.slope_top[k], 0.0)  # the global argmax's column: its owner's
    return acc.finish(student, teacher, saved)


class VocabParallelDivergence(torch.autograd.Function):
    """(student_hidden [N, Ds], student rows [V_local, Ds], bias rows | None, teacher_hidden [N, Dt], teacher rows
    [V_local, Dt], bias rows | None) -> (divergence, student entropy) [N] fp32, equal on every rank to the unsharded
    head's; gradients: dH (whole, on every rank), this rank's dW and db rows. With ``frozen_head`` (only the hidden
    state needs a gradient) the forward builds J and the backward is dH = c J, with no collective. N = 0 on every
    rank: empty outputs, no collective."""

    @staticmethod
    def forward(ctx, student_hidden, student_weight, student_bias, teacher_hidden, teacher_weight, teacher_bias, beta,
                student_transform, teacher_transform, shard, frozen_head, backend):  # fmt: skip
        if student_hidden.shape[0] == 0:
            empty = torch.zeros(0, dtype=torch.float32, device=student_hidden.device)
            saved, argmax = empty.new_zeros((len(divergence_torch.SAVED_FIELDS), 0)), empty.new_zeros((2, 0)).long()
            div, entropy, grad = empty, empty.clone(), empty.new_zeros(student_hidden.shape)
        else:
            div, entropy, saved, argmax, grad = forward(student_hidden, student_weight, student_bias, teacher_hidden,
                                                        teacher_weight, teacher_bias, beta, student_transform,
                                                        teacher_transform, shard, frozen_head, backend)  # fmt: skip
        ctx.frozen_head = frozen_head
        ctx.save_for_backward(student_hidden, student_weight, student_bias, teacher_hidden, teacher_weight,
                              teacher_bias, saved, argmax, grad if frozen_head else None)  # fmt: skip
        ctx.beta, ctx.transforms, ctx.shard, ctx.backend = beta, (student_transform, teacher_transform), shard, backend
        ctx.mark_non_differentiable(entropy)
        return div, entropy

    @staticmethod
    def backward(ctx, grad_divergence, _grad_entropy):
        hs, ws, bs, ht, wt, bt, saved, argmax, hidden_grad = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        if ctx.frozen_head:
            if need_w or need_b:
                raise RuntimeError(
                    "the divergence's frozen-head forward ran (student_weight and student_bias needed "
                    "no gradient then), but the backward asks for one: call it again with "
                    "head_path='general'"
                )
            grad = (
                torch.zeros_like(hidden_grad)
                if grad_divergence is None
                else grad_divergence.float()[:, None] * hidden_grad
            )
            return (grad.to(hs.dtype),) + (None,) * 11
        dev = hs.device
        grad_hidden = torch.zeros(hs.shape, dtype=torch.float32, device=dev) if need_h else None
        grad_weight = torch.zeros(ws.shape, dtype=torch.float32, device=dev) if need_w else None
        grad_bias = torch.zeros(ws.shape[0], dtype=torch.float32, device=dev) if need_b else None
        if hs.shape[0] > 0 and grad_divergence is not None:
            sweep = (
                kdivergence.backward if ctx.backend == "triton" and ws.shape[0] > 0 else divergence_torch.backward
            )  # a shard of no rows: nothing to recompute, dH's part is 0
            sweep(grad_divergence.float().contiguous(), hs, ws, bs, ht, wt, bt, saved, argmax, ctx.beta,
                  *ctx.transforms, grad_hidden, grad_weight, grad_bias, offset=ctx.shard.offset)  # fmt: skip
            if need_h:
                dist.all_reduce(grad_hidden, op=dist.ReduceOp.SUM, group=ctx.shard.group)
        return (
            grad_hidden.to(hs.dtype) if need_h else None,
            grad_weight.to(ws.dtype) if need_w else None,
            grad_bias.to(bs.dtype) if need_b else None,
        ) + (None,) * 9


__all__ = ["VocabShard", "VocabParallelDivergence", "merge_over_group", "resolve_pair"]
