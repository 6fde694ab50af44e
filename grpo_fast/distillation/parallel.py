"""The divergence head over a vocab-parallel pair of heads: the student's and the teacher's weights split by the same
vocabulary ranges over a process group (grpo_fast.VocabShard, or DTensors sharded on dim 0), never gathered.

Every rank sees the same tokens (both models' hidden states, replicated) and holds rows [offset, offset + V_local)
of both weights (and biases); each rank returns exactly what the unsharded head returns. The forward builds both
models' records over this rank's rows (the Triton kernels or the torch twin, argmax indices global), merges them
over the group with four all-reduces of O(N) (``merge_over_group``) and finishes them as one process does; the
JSD's second sweep runs over each shard with the merged records and all-reduces its two sums. The backward runs the
chosen backend's backward over the shard with the merged saved values, keeps its dW and db rows, and all-reduces its
partial dH. A frozen student head folds J = d divergence / d h_s over each shard with the records (the torch twin's
algorithm on every backend, as unsharded), re-expressed against the merged records (``frozen_grad``), and
all-reduces J in the forward: the backward is then dH = c J, with no collective and no sweep.

Bytes through collectives per call (N scored tokens): 64 N in the forward (72 N for 0 < beta < 1) and 4 N Ds for dH,
whatever V and the number of ranks. Requirements (not checked: checking would cost a collective per call): the
shards tile [0, V) without overlap, the student's and teacher's shards are the same ranges, and every rank passes
the same hidden states, mask and upstream gradients. dH is the whole gradient of the replicated hidden states: do
not all-reduce it again.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from grpo_fast.backends.divergence_twin import CHUNK_N, FrozenHead
from grpo_fast.backends.protocol import gemm_weight
from grpo_fast.backends.resolver import named
from grpo_fast.head.boundary import without_autocast
from grpo_fast.head.shard import VocabShard, resolve
from grpo_fast.kernels import divergence_records
from grpo_fast.kernels.divergence_records import FORWARD_KL, JSD, REVERSE_KL, ModelHead, Record, model_entropy

_NO_ARGMAX = torch.iinfo(torch.int64).max


def resolve_pair(
    student: ModelHead, teacher: ModelHead, vocab_parallel: VocabShard | None
) -> tuple[ModelHead, ModelHead, VocabShard | None]:
    """Both models' operands as the head computes on them, and this rank's shard.

    Args:
        student: the student's public arguments (hidden [B, T, Ds], weight, bias, transform).
        teacher: the teacher's.
        vocab_parallel: one VocabShard for both plain weights holding this rank's rows, or None (whole heads, or
            DTensor weights sharded on dim 0).

    Returns:
        (student, teacher, shard): hidden states, weights and biases local (a DTensor's local rows), shard None for
        whole heads.

    Raises:
        ValueError: one weight a DTensor and the other not, or heads not split by the same vocabulary ranges.
    """
    if (type(student.weight).__name__ == "DTensor") != (type(teacher.weight).__name__ == "DTensor"):
        raise ValueError(
            "one of student_weight and teacher_weight is a DTensor and the other is not: pass both as "
            "DTensors sharded on dim 0 by the same ranges, or both as this rank's rows with "
            "vocab_parallel=VocabShard(...)"
        )
    *student_operands, shard = resolve(*student[:3], vocab_parallel)
    *teacher_operands, teacher_shard = resolve(*teacher[:3], vocab_parallel)
    student = ModelHead(*student_operands, student.transform)
    teacher = ModelHead(*teacher_operands, teacher.transform)
    if shard is not None:
        same = (
            teacher_shard.offset == shard.offset
            and teacher_shard.vocab_size == shard.vocab_size
            and teacher_shard.group == shard.group
            and teacher.weight.shape[0] == student.weight.shape[0]
        )
        if not same:
            raise ValueError(
                f"the teacher's head is sharded as rows [{teacher_shard.offset}, "
                f"{teacher_shard.offset + teacher.weight.shape[0]}) of {teacher_shard.vocab_size}, the "
                f"student's as [{shard.offset}, {shard.offset + student.weight.shape[0]}) of "
                f"{shard.vocab_size}: both heads must be split by the same vocabulary ranges"
            )
    return student, teacher, shard


def merge_over_group(student: Record, teacher: Record, group) -> tuple[Record, Record]:
    """This rank's (student, teacher) Records [N] -> the whole vocabulary's, on every rank.

    Four all-reduces, 64 N bytes, whatever the number of ranks (an all_gather of the records would grow with it), in
    any order of the ranks:
    1. MAX of both models' maxima [2, N] fp32;
    2. MIN of the argmax candidates [2, N] int64 (a rank's argmax where its max is the global one, else the largest
       int64): the first global argmax, as one process picks it;
    3. SUM of the other model's logit at that argmax [2, N] fp32 (from its owner; 0 elsewhere);
    4. each rank's record re-expressed against the global (max, argmax, other) by merging it into a record holding
       only those (which wins: the rank's own argmax term moves into the rest), then one SUM of [8, N] fp32 (both
       models' rest, cross, zsum and unsupported flag): records that share (max, argmax, other) merge by adding
       their sums, sums of same-signed parts.

    Args:
        student: this rank's student Record [N] over its rows (argmax global).
        teacher: this rank's teacher Record [N].
        group: the process group.

    Returns:
        The merged (student, teacher) Records [N], equal on every rank.
    """
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
        global_top = Record(m, a, nothing, nothing, o, nothing, torch.zeros_like(r.unsupported))
        # global_top wins the merge (its max is the global one; on a tie, it comes first)
        moved = divergence_records.merge(global_top, r)
        local.append(Record(*(torch.where(own, x, y) for x, y in zip(r, moved, strict=True))))
    sums = torch.stack([x for r in local for x in (r.rest, r.cross, r.zsum, r.unsupported.float())])
    dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
    return tuple(
        Record(m, a, s[0], s[1], o, s[2], s[3] > 0)
        for m, a, o, s in zip(maxima, argmax, other, sums.view(2, 4, -1), strict=True)
    )


def forward(
    student: ModelHead,
    teacher: ModelHead,
    beta: float,
    shard: VocabShard,
    frozen_head: bool = False,
    backend: str = "torch",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The whole vocabulary's forward, on every rank, from this rank's rows of both heads.

    Args:
        student: the student's replicated hidden states [N, Ds] (N > 0) and this rank's weight and bias rows.
        teacher: the teacher's, [N, Dt] and the same rows.
        beta: in [0, 1].
        shard: this rank's VocabShard (offset and group).
        frozen_head: also build J = d divergence / d student.hidden (one more all-reduce, N x Ds fp32).
        backend: the resolved backend's name: its ``divergence_records`` over this rank's rows.

    Returns:
        (divergence [N] fp32, entropy [N] fp32, saved [8, N] fp32, argmax [2, N] int64, J [N, Ds] fp32 or None,
        the teacher's entropy [N] fp32 from its merged record), equal on every rank.
    """
    local, local_jsd, frozen = named(backend).divergence_records(student, teacher, beta, shard.offset, frozen_head)
    merged_s, merged_t = merge_over_group(*local, shard.group)

    def jsd_sweep(student_finished, teacher_finished, top_log_ratio):
        sums = torch.stack(local_jsd(student_finished, teacher_finished, top_log_ratio))
        dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=shard.group)
        return sums[0], sums[1]

    out = divergence_records.finish(merged_s, merged_t, beta, jsd_sweep)
    teacher_entropy = model_entropy(merged_t)
    if not frozen_head:
        return (*out, None, teacher_entropy)
    N = student.hidden.shape[0]
    grad = torch.cat(
        [
            frozen_grad(
                acc,
                tuple(Record(*(x[n0 : n0 + CHUNK_N] for x in r)) for r in (*local, merged_s, merged_t)),
                out[2][:, n0 : n0 + CHUNK_N],
            )
            for n0, acc in zip(range(0, N, CHUNK_N), frozen, strict=True)
        ]
    )
    dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=shard.group)
    return (*out, grad, teacher_entropy)


def _rescale(local_max, merged_max):
    """exp(m_r - m): a rank's sums against the merged max (0 for an empty record)."""
    return torch.exp(local_max - divergence_records.pivot(merged_max))


def frozen_grad(acc: FrozenHead, records: tuple[Record, ...], saved: torch.Tensor) -> torch.Tensor:
    """This rank's part of J = d divergence / d student_hidden; the ranks' parts sum to J.

    The JSD's sums were taken in the second sweep with the global normalisers: its part is FrozenHead.finish as it
    is. For beta 0 and 1 each rank's sums are re-expressed against the merged record as merge re-expresses a losing
    record: scaled by exp(m_r - m); beta 1: B1 shifted by (g_r - g) B0 (g = z_s - z_t at the argmax); beta 0: the
    rank's own argmax term (its slope times its W row) moves into A where that argmax is not the global one, and the
    global argmax's column is added by its owner only.

    Args:
        acc: this rank's FrozenHead for n tokens (sums over its rows against its own records); updated.
        records: (this rank's student Record, its teacher Record, the merged student Record, the merged teacher
            Record), [n] each.
        saved: [8, n] fp32, the finished saved values (divergence_records.SAVED_FIELDS).

    Returns:
        [n, Ds] fp32.
    """
    local_s, local_t, student, teacher = records
    if acc.divergence == JSD:
        return acc.finish(student, teacher, saved)
    if acc.divergence == REVERSE_KL:
        scale = _rescale(local_s.max, student.max)
        shift = (local_s.max - local_s.other) - (student.max - student.other)
        acc.second = divergence_records.zero_where(
            (scale == 0)[:, None], scale[:, None] * (acc.second + shift[:, None] * acc.first)
        )
        acc.first = acc.first * scale[:, None]
        return acc.finish(student, teacher, saved)
    if acc.divergence != FORWARD_KL:
        raise ValueError(f"frozen_grad has no re-expression for the divergence {acc.divergence.name!r}")
    for k, (mine, merged) in enumerate(((local_s, student), (local_t, teacher))):
        owner = (mine.argmax == merged.argmax) & (mine.max == merged.max)
        moved = torch.where(~owner & (mine.max > float("-inf")), acc.slope_top[k], 0.0)
        scale = _rescale(mine.max, merged.max)
        total = (acc.first, acc.second)[k] + moved[:, None] * acc.rows(mine.argmax)
        total = divergence_records.zero_where((scale == 0)[:, None], scale[:, None] * total)
        acc.first, acc.second = (total, acc.second) if k == 0 else (acc.first, total)
        acc.slope_top[k] = torch.where(owner, acc.slope_top[k], 0.0)  # the global argmax's column: its owner's
    return acc.finish(student, teacher, saved)


def _computed(hidden, weight, bias, transform):
    """A model's ModelHead as the kernels take it: its weight rows in hidden's dtype (``gemm_weight``)."""
    return ModelHead(hidden, gemm_weight(weight, hidden), bias, transform)


class VocabParallelDivergence(torch.autograd.Function):
    """The divergence head over this rank's rows of both heads, differentiable.

    Inputs: student_hidden [N, Ds], the student's weight rows [V_local, Ds] and bias rows | None, teacher_hidden
    [N, Dt], the teacher's rows [V_local, Dt] and bias rows | None (the tensors apart, for autograd), beta, both
    LogitTransforms, the VocabShard, frozen_head, the backend's name. Outputs: (divergence, student entropy,
    teacher entropy) [N] fp32, equal on every rank to the unsharded head's (the entropies not differentiable);
    gradients: dH (whole, on every rank), this rank's dW and db
    rows. With ``frozen_head`` (only the hidden states need a gradient) the forward builds J and the backward is
    dH = c J, with no collective. N = 0 on every rank: empty outputs, no collective.
    """

    @staticmethod
    @without_autocast
    def forward(ctx, *inputs):
        *operands, beta, student_transform, teacher_transform, shard, frozen_head, backend = inputs
        student = _computed(*operands[:3], student_transform)
        teacher = _computed(*operands[3:], teacher_transform)
        if student.hidden.shape[0] == 0:
            empty = torch.zeros(0, dtype=torch.float32, device=student.hidden.device)
            saved, argmax = empty.new_zeros((len(divergence_records.SAVED_FIELDS), 0)), empty.new_zeros((2, 0)).long()
            div, entropy, teacher_entropy = empty, empty.clone(), empty.clone()
            grad = empty.new_zeros(student.hidden.shape)
        else:
            div, entropy, saved, argmax, grad, teacher_entropy = forward(
                student, teacher, beta, shard, frozen_head, backend
            )
        ctx.frozen_head = frozen_head
        ctx.save_for_backward(*operands, saved, argmax, grad if frozen_head else None)
        ctx.beta, ctx.transforms, ctx.shard, ctx.backend = beta, (student_transform, teacher_transform), shard, backend
        ctx.mark_non_differentiable(entropy, teacher_entropy)
        return div, entropy, teacher_entropy

    @staticmethod
    @without_autocast
    def backward(ctx, grad_divergence, _grad_entropy, _grad_teacher_entropy):
        *operands, saved, argmax, hidden_grad = ctx.saved_tensors
        student = _computed(*operands[:3], ctx.transforms[0])
        teacher = _computed(*operands[3:], ctx.transforms[1])
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        no_grads = (None,) * len(ctx.needs_input_grad)
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
            return (grad.to(student.hidden.dtype),) + no_grads[1:]
        dev = student.hidden.device
        grad_hidden = torch.zeros(student.hidden.shape, dtype=torch.float32, device=dev) if need_h else None
        grad_weight = torch.zeros(student.weight.shape, dtype=torch.float32, device=dev) if need_w else None
        grad_bias = torch.zeros(student.weight.shape[0], dtype=torch.float32, device=dev) if need_b else None
        if student.hidden.shape[0] > 0 and grad_divergence is not None:
            grads = (grad_hidden, grad_weight, grad_bias)
            c = grad_divergence.float().contiguous()
            named(ctx.backend).divergence_backward(
                c, student, teacher, saved, argmax, ctx.beta, grads, ctx.shard.offset
            )
            if need_h:
                dist.all_reduce(grad_hidden, op=dist.ReduceOp.SUM, group=ctx.shard.group)
        # each in its input's dtype: the weight's own (fp32 over bf16 hidden states), not the GEMMs'
        return (
            grad_hidden.to(student.hidden.dtype) if need_h else None,
            grad_weight.to(operands[1].dtype) if need_w else None,
            grad_bias.to(student.bias.dtype) if need_b else None,
        ) + no_grads[3:]


__all__ = ["VocabShard", "VocabParallelDivergence", "merge_over_group", "resolve_pair"]
