"""Several teachers over a vocab-parallel student head (``multi_teacher_distillation_loss(..., vocab_parallel=...)``
or DTensor weights): every rank holds rows [offset, offset + V_local) of the student's head and of each in-process
teacher's (the same ranges: ``distillation.parallel.resolve_pair``), every rank sees every token.

The in-process teachers' rows run a teacher at a time through the vocab-parallel divergence head
(``distillation.parallel.VocabParallelDivergence``: each rank's records over its rows merged over the group, no
[N, V] buffer, neither weight gathered), each teacher's scored rows one call: its collectives (64 N_i bytes in the
forward, 72 N_i for the JSD; 4 N_i Ds for dH) are the one-teacher call's on its rows, so the call's are the one
call over all rows' whatever the routing, plus a latency per teacher present. Not one fused launch as on one process
(``multi_teacher.ops``): the head sweeps each teacher's rows apart. The served teachers' rows take the served head's
vocab-parallel path (``served.vocab_parallel``) as on one process. Every rank returns what one process returns;
dW and db are this rank's rows, dH the whole gradient of the replicated hidden states.
"""

from __future__ import annotations

import torch

from grpo_fast.distillation.parallel import VocabParallelDivergence, resolve_pair
from grpo_fast.distillation.teacher import Teacher, teacher_head
from grpo_fast.head.inputs import Rows
from grpo_fast.head.shard import VocabShard
from grpo_fast.head.transform import LogitTransform
from grpo_fast.kernels.divergence_records import ModelHead
from grpo_fast.served.teacher import ServedTeacher


def local_teachers(listed, student: ModelHead, vocab_parallel: VocabShard | None) -> list[Teacher | ServedTeacher]:
    """The teachers with each in-process one's weight and bias as this rank's rows (a DTensor's local rows; plain
    rows with ``vocab_parallel`` as they are), checked to be sharded as the student's head.

    Args:
        listed: the Teachers' list.
        student: the student's public hidden states, weight and bias (a transform: any).
        vocab_parallel: the call's VocabShard, or None.

    Returns:
        The list, each Teacher's weight and bias local (the served ones as they are).

    Raises:
        ValueError: a teacher's weight a DTensor where the student's is not, or the reverse, or sharded by other
            vocabulary ranges than the student's; the message names the teacher.
    """
    local = []
    for i, teacher in enumerate(listed):
        if isinstance(teacher, Teacher):
            try:
                _, head, _ = resolve_pair(
                    student, ModelHead(teacher.hidden, teacher.weight, teacher.bias, student.transform), vocab_parallel
                )
            except ValueError as error:
                raise ValueError(f"teachers.teachers[{i}] (teacher_weight): {error}") from None
            teacher = Teacher(head.hidden, head.weight, head.bias, teacher.softcap, teacher.logit_scale)
        local.append(teacher)
    return local


def dense_divergences(student: ModelHead, teachers, segments, beta, shard: VocabShard, backend: str):
    """The in-process teachers' per-token divergences on vocab-parallel heads (module docstring), a teacher at a time.

    Args:
        student: the student's hidden states [N, Ds] or [B, T, Ds] (replicated; rows as ``segments`` index them),
            this rank's weight and bias rows, and its LogitTransform.
        teachers: the local teachers (``local_teachers``).
        segments: (i, flat rows [N_i], the same rows in teacher i's own rows) of each in-process teacher with scored
            tokens (``_Routing.segments``).
        beta: the divergence's beta.
        shard: this rank's VocabShard.
        backend: the resolved backend's name (each rank's records over its rows).

    Returns:
        A list of (flat rows [N_i], their divergence [N_i] (differentiable), the student's entropy [N_i], the
        teacher's entropy [N_i]) a teacher, equal on every rank.
    """
    hidden = student.hidden.reshape(-1, student.hidden.shape[-1])
    weight = student.weight.contiguous()
    bias = student.bias.contiguous() if student.bias is not None else None
    # a frozen student head (only the hidden states need a gradient): J in the forward, no collective backward
    frozen_head = (
        torch.is_grad_enabled()
        and hidden.requires_grad
        and not weight.requires_grad
        and not (bias is not None and bias.requires_grad)
    )
    temperature = student.transform.temperature
    parts = []
    for i, flat, local in segments:
        teacher = teacher_head(teachers[i], Rows(local), temperature)
        div, entropy, teacher_entropy = VocabParallelDivergence.apply(
            hidden.index_select(0, flat), weight, bias, *teacher[:3], float(beta),
            LogitTransform.from_floats(*student.transform.as_floats()), teacher.transform, shard, frozen_head, backend,
        )  # fmt: skip
        parts.append((flat, div, entropy, teacher_entropy))
    return parts


def dense_loss(student: ModelHead, teachers, segments, beta, shard: VocabShard, backend: str, divisor):
    """``dense_divergences`` summed into the loss (``divisor``: a number, or a 0-dim fp32 tensor).

    Returns:
        (loss, the flat rows [N], their divergence [N], the student's entropy [N], each row's teacher's entropy [N]),
        equal on every rank; the divergence detached.
    """
    loss = student.hidden.new_zeros((), dtype=torch.float32)
    parts = []
    for flat, div, entropy, teacher_entropy in dense_divergences(student, teachers, segments, beta, shard, backend):
        loss = loss + div.sum() / divisor
        parts.append((flat, div.detach(), entropy, teacher_entropy))
    return (loss, *(torch.cat(x) for x in zip(*parts, strict=True)))


__all__ = ["dense_divergences", "dense_loss", "local_teachers"]
