"""Multi-teacher on-policy distillation (MOPD, TRL 1.16's ``AsyncDistillationTrainer`` with several teacher servers):
each completion is scored by one teacher, chosen by a per-row index; the teachers may be in-process (``Teacher``:
hidden states and head, each its own width) or served (``ServedTeacher``: top-k log-probs), or both.

    teachers = grpo_fast.Teachers([grpo_fast.Teacher(math_hidden, math_weight), grpo_fast.Teacher(code_hidden,
                                   code_weight)], teacher_index)           # teacher_index [B]: each row's teacher
    loss, div, entropy = grpo_fast.multi_teacher_distillation_loss(hidden, weight, teachers, completion_mask)
    metrics = grpo_fast.teacher_metrics(teachers, div, completion_mask)  # teacher_jsd/<name>, ...

A teacher's tensors hold its own rows only ([B_i, T, ...], B_i its rows' count, in the batch's order), as a
trainer computes them: one forward of each teacher over its completions. The loss is the sum over every scored
token of its divergence from its own teacher, over ``num_items_in_batch`` (or the scored tokens' count): TRL's
reduction, whatever the routing. The in-process teachers share one fused op (``multi_teacher.ops``: the student's
three sweeps over all their rows, each chunk's teacher products a teacher at a time, one dW accumulator); the served
teachers one served loss over their rows (their top-k lists gathered into one [B, T, K_max] record, -1 padded).
Vocab-parallel heads take ``multi_teacher.parallel``'s path (each in-process teacher's rows through the
vocab-parallel divergence head). Each token's teacher entropy (``return_teacher_entropy``, ``teacher_metrics``'
``teacher_entropy/<name>``) comes from what the divergence already holds: an in-process teacher's merged record
(log S - Z / S), a served one's support. Routing reads each teacher's row and token counts on the host: one
synchronisation, with the index's range check (under torch.compile the call runs eagerly: a graph break; fake and
meta tensors get an error).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from grpo_fast.backends.resolver import resolve_backend
from grpo_fast.distillation import ops as divergence_ops
from grpo_fast.distillation.api import check_num_items_in_batch
from grpo_fast.distillation.teacher import Teacher, check_coef_and_beta, check_teacher, teacher_head
from grpo_fast.head.api import logprobs_and_entropy_rows
from grpo_fast.head.inputs import (
    Rows,
    ValueChecks,
    check_float_tensor,
    check_head,
    check_mask,
    check_same_device,
    check_tensor,
    has_data,
)
from grpo_fast.head.keywords import takes_keywords
from grpo_fast.head.shard import VocabShard, resolve
from grpo_fast.head.transform import LogitTransform, check_chunk, check_number, check_softcap_and_scale
from grpo_fast.kernels.divergence_records import ModelHead
from grpo_fast.multi_teacher import ops
from grpo_fast.multi_teacher.parallel import dense_divergences, dense_loss, local_teachers
from grpo_fast.served.api import ServedSupport, served_divergence_rows, served_loss_and_teacher_entropy
from grpo_fast.served.teacher import ServedTeacher


@dataclass(frozen=True)
class Teachers:
    """Several teachers and each row's: MOPD's routing.

    Attributes:
        teachers: the teachers, each a ``Teacher`` (hidden [B_i, T, D_i], weight [V, D_i] (a vocab-parallel head's:
            this rank's rows, as the student's), bias, softcap, logit_scale) or a ``ServedTeacher`` (ids and
            log-probs [B_i, T, K_i]); B_i is the number of rows ``teacher_index`` gives it, its rows in the batch's
            order.
        teacher_index: [B] integer: each row's teacher, an index into ``teachers`` (TRL's ``teacher_id_idx``).
        names: each teacher's name in ``teacher_metrics``' keys (TRL's ``teacher_id``: its server URL); None:
            "0", "1", ...
    """

    teachers: Sequence[Teacher | ServedTeacher]
    teacher_index: torch.Tensor
    names: Sequence[str] | None = None

    def teacher_names(self) -> list[str]:
        """Each teacher's name in the metrics' keys.

        Returns:
            ``names`` as strings, or each teacher's index.
        """
        return [str(i) for i in range(len(self.teachers))] if self.names is None else [str(n) for n in self.names]


def _check_teachers(teachers, B, device):
    """The Teachers record's own checks (no value read): the list, the index's type and shape, the names."""
    if not isinstance(teachers, Teachers):
        raise TypeError(
            f"teachers must be a grpo_fast.Teachers(teachers, teacher_index), got {type(teachers).__name__}"
        )
    listed = teachers.teachers
    if isinstance(listed, (Teacher, ServedTeacher)) or not isinstance(listed, Sequence) or len(listed) == 0:
        raise TypeError("teachers.teachers must be a non-empty list of grpo_fast.Teacher or grpo_fast.ServedTeacher")
    for i, teacher in enumerate(listed):
        if not isinstance(teacher, (Teacher, ServedTeacher)):
            raise TypeError(
                f"teachers.teachers[{i}] must be a grpo_fast.Teacher or a grpo_fast.ServedTeacher, got "
                f"{type(teacher).__name__}"
            )
    index = check_tensor("teachers.teacher_index", teachers.teacher_index)
    if index.dtype.is_floating_point or index.dtype == torch.bool or index.is_complex():
        raise TypeError(f"teachers.teacher_index must be an integer tensor, got {index.dtype}")
    if tuple(index.shape) != (B,):
        raise ValueError(
            f"teachers.teacher_index must have shape [B] = [{B}] (one teacher a row), got {tuple(index.shape)}"
        )
    check_same_device([("teachers.teacher_index", index)], device, "student_hidden")
    if teachers.names is not None:
        names = teachers.names
        if isinstance(names, str) or len(names) != len(listed) or len(set(map(str, names))) != len(names):
            raise ValueError(f"teachers.names must be {len(listed)} distinct names (one a teacher), got {names!r}")


@dataclass(frozen=True)
class _Routing:
    """A batch's rows routed to their teachers: the counts read on the host and the device indices."""

    row_counts: list[int]  # [teachers] rows of each
    token_counts: list[int]  # [teachers] scored tokens of each
    flat_teacher: torch.Tensor  # [B T] each flat row's teacher
    scored: torch.Tensor  # [B T] bool
    local_flat: torch.Tensor  # [B T] each flat row's row in its teacher's own [B_i T] rows
    batch_order: torch.Tensor  # [B] the rows sorted by teacher (stable)

    @classmethod
    def read(cls, index, completion_mask, n, T):
        """The routing of ``index`` [B] over ``n`` teachers, T tokens a row; its value checks (the index's range, the
        mask's 0/1) read with the counts in one host synchronisation (``ValueChecks``)."""
        B = index.shape[0]
        dev = index.device
        checks = ValueChecks(True, index, completion_mask)
        if completion_mask is not None:
            check_mask(completion_mask, (B, T), checks)
        index = index.long()
        checks.add(
            [((index < 0) | (index >= n)).any(), index.min(), index.max()],
            lambda _, lo, hi: ValueError(
                f"teachers.teacher_index must be in [0, {n}) (one of the {n} teachers), got values in [{lo}, {hi}]"
            ),
        )
        scored = (
            completion_mask.reshape(-1).bool()
            if completion_mask is not None
            else torch.ones(B * T, dtype=torch.bool, device=dev)
        )
        safe = index.clamp(0, n - 1)
        flat_teacher = safe.repeat_interleave(T)
        row_counts = torch.bincount(safe, minlength=n)
        token_counts = torch.bincount(flat_teacher, weights=scored.float(), minlength=n).long()
        counts = checks.read([*row_counts.unbind(), *token_counts.unbind()])  # the call's one host synchronisation
        # each row's rank among its teacher's rows: where its teacher's own tensors hold it
        rank = (torch.nn.functional.one_hot(safe, n).cumsum(0) - 1).gather(1, safe[:, None])[:, 0]
        local_flat = rank.repeat_interleave(T) * T + torch.arange(B * T, device=dev) % T
        batch_order = torch.argsort(safe, stable=True)
        return cls(counts[:n], counts[n:], flat_teacher, scored, local_flat, batch_order)

    def scored_mask_of(self, chosen: list[int], n: int) -> torch.Tensor:
        """[B T] bool: the scored flat rows of the teachers ``chosen``."""
        pick = torch.zeros(n, dtype=torch.bool, device=self.scored.device)
        pick[chosen] = True
        return self.scored & pick[self.flat_teacher]

    def scored_rows_of(self, chosen: list[int], n: int) -> torch.Tensor:
        """The scored flat rows of the teachers ``chosen``, grouped by teacher in index order, each group in the
        batch's order."""
        key = torch.where(self.scored_mask_of(chosen, n), self.flat_teacher, n)
        total = sum(self.token_counts[i] for i in chosen)
        return torch.argsort(key, stable=True)[:total]

    def segments(self, chosen: list[int], n: int):
        """(i, flat rows [N_i], the same rows in teacher i's own [B_i T] rows) for each teacher of ``chosen`` with
        scored tokens: ``scored_rows_of(chosen)`` cut by teacher."""
        order, at = self.scored_rows_of(chosen, n), 0
        for i in chosen:
            count = self.token_counts[i]
            if count:
                flat = order[at : at + count]
                at += count
                yield i, flat, self.local_flat.index_select(0, flat)

    def batch_rows_of(self, i: int) -> torch.Tensor:
        """Teacher i's rows of the batch, in its order."""
        start = sum(self.row_counts[:i])
        return self.batch_order[start : start + self.row_counts[i]]


def _check_teacher_shapes(listed, routing, T, V, device, sharded=False):
    """Each teacher of ``listed`` against its row count, the student's T and V (``sharded``: this rank's rows of a
    vocab-parallel head, which may hold none), and device."""
    for i, teacher in enumerate(listed):
        B_i = routing.row_counts[i]
        name = f"teachers.teachers[{i}]"
        if isinstance(teacher, Teacher):
            if teacher.hidden.dim() == 3 and teacher.hidden.shape[0] == 0 and B_i == 0:
                continue  # a teacher with no row this batch: nothing to check against
            rows = ("[B_i, T, D] with [B_i, T]", "its rows by teacher_index, the student's T")
            check_teacher(teacher, name, (B_i, T), V, device, ("student_hidden", "student_weight"), rows, sharded)
        else:
            for field in ("ids", "logprobs"):
                x = check_tensor(f"{name}.{field}", getattr(teacher, field))
                if x.dim() != 3 or tuple(x.shape[:2]) != (B_i, T):
                    raise ValueError(
                        f"{name}.{field} must have shape [B_i, T, K] with [B_i, T] = {[B_i, T]} (its rows by "
                        f"teacher_index, the student's T), got {tuple(x.shape)}"
                    )
                check_same_device([(f"{name}.{field}", x)], device, "student_hidden")
            if teacher.ids.shape != teacher.logprobs.shape:
                raise ValueError(
                    f"{name}.ids and {name}.logprobs must have the same shape, got "
                    f"{tuple(teacher.ids.shape)} and {tuple(teacher.logprobs.shape)}"
                )


def _beta_or_default(listed, beta, name):
    """``beta``, or the teachers' kind's default where None: 1.0 when all are in-process (``distillation_loss``'),
    0.0 when all are served (``served_distillation_loss``'); a ValueError naming ``name`` where they mix."""
    if beta is not None:
        return beta
    served = {isinstance(t, ServedTeacher) for t in listed}
    if served == {True, False}:
        raise ValueError(
            f"{name} is required when in-process and served teachers mix (their defaults differ: 1.0 for a "
            "Teacher, distillation_loss'; 0.0 for a ServedTeacher, served_distillation_loss')"
        )
    return 0.0 if served == {True} else 1.0


def _served_record(listed, served, routing, B, T, device):
    """The served teachers' lists as one ServedTeacher [B, T, K_max] (-1 padded; rows of other teachers empty)."""
    first = listed[served[0]]
    for i in served[1:]:
        other = listed[i]
        if other.add_tail_bucket != first.add_tail_bucket or other.temperature != first.temperature:
            raise ValueError(
                "the served teachers must share add_tail_bucket and temperature (one served divergence for their "
                f"rows): teachers.teachers[{served[0]}] and [{i}] differ"
            )
    K = max(listed[i].ids.shape[-1] for i in served)
    ids = torch.full((B, T, K), -1, dtype=torch.int64, device=device)
    logprobs = torch.zeros((B, T, K), dtype=torch.float32, device=device)
    for i in served:
        teacher, rows = listed[i], routing.batch_rows_of(i)
        K_i = teacher.ids.shape[-1]
        ids[rows, :, :K_i] = teacher.ids.long()
        logprobs[rows, :, :K_i] = teacher.logprobs.float()
    return ServedTeacher(ids, logprobs, first.add_tail_bucket, first.temperature)


# the routing reads counts on the host and sizes tensors by them: under torch.compile the call runs eagerly (a graph
# break), its fused op as everywhere
@takes_keywords()
@torch.compiler.disable
def multi_teacher_distillation_loss(
    student_hidden: torch.Tensor,
    student_weight: torch.Tensor,
    teachers: Teachers,
    completion_mask: torch.Tensor | None = None,
    *,
    num_items_in_batch: float | torch.Tensor | None = None,
    beta: float | None = None,
    temperature: float = 1.0,
    targets: torch.Tensor | None = None,
    student_bias: torch.Tensor | None = None,
    student_softcap: float | None = None,
    student_logit_scale: float = 1.0,
    backend: str = "auto",
    support: ServedSupport = "trl",
    token_chunk: int | None = None,
    vocab_parallel: VocabShard | None = None,
    return_teacher_entropy: bool = False,
) -> tuple[torch.Tensor, ...]:
    """The distillation loss with each row scored by its own teacher (MOPD): the divergence of every scored token
    from its row's teacher, summed, over ``num_items_in_batch`` or the scored tokens' count.

    In-process teachers take ``distillation_loss``' divergence (``beta``: 0 forward KL, 1 reverse KL, between the
    generalized JSD), served ones ``served_distillation_loss``' (TRL's support by beta, the tail bucket). A token's
    divergence and its gradient are those of its teacher's one-teacher call, whatever the other rows' teachers;
    the in-process teachers run in one fused op (the student's three sweeps over their rows, the teachers' products
    a teacher at a time in each chunk), the served ones in one served loss. Vocab-parallel heads (``vocab_parallel``,
    or DTensor weights): the student's and every in-process teacher's weight split by the same vocabulary ranges, the
    hidden states replicated; each in-process teacher's rows then run through ``distillation_loss``' vocab-parallel
    head (a teacher at a time: ``multi_teacher.parallel``), the served rows through the served head's; every rank
    returns what one process returns, dW and db its own rows.

    Args:
        student_hidden: [B, T, D] float32, bfloat16 or float16.
        student_weight: [V, D] the student's lm_head weight, student_hidden's dtype (or fp32 over bf16 / fp16);
            this rank's rows [V_local, D] with ``vocab_parallel``, or a DTensor sharded on dim 0.
        teachers: the ``Teachers`` (the list and each row's index); an in-process teacher's weight (and bias) this
            rank's rows of its head where the student's are (a DTensor where the student's is one).
        completion_mask: [B, T] bool or 0/1: the tokens scored (and counted); None: every token.
        num_items_in_batch: the divisor, a number > 0 or a one-element tensor; None: the scored tokens' count (at
            least 1).
        beta: in [0, 1]; None: 1.0 (``distillation_loss``' default) when every teacher is in-process, 0.0
            (``served_distillation_loss``') when every one is served; required when they mix.
        temperature: divides every model's logits (> 0).
        targets: [B, T] the sampled tokens: read by served teachers at beta != 0 (TRL's support holds them).
        student_bias: [V] in student_hidden's dtype, or None (this rank's rows where the weight's are).
        student_softcap: the student's soft-cap (> 0), or None.
        student_logit_scale: multiplies the student's raw logits (non-zero).
        backend: "auto", "triton" or "torch".
        support: the served teachers' support ("trl" or "listed", as ``served_divergence_and_entropy``'s).
        token_chunk: tokens per gradient GEMM of the in-process teachers' fused loss (None: its default); not with
            vocab-parallel heads (no fused loss there).
        vocab_parallel: a ``grpo_fast.VocabShard`` when the student's and the in-process teachers' weights hold this
            rank's rows (the same ranges); None: whole heads, or DTensor weights.
        return_teacher_entropy: also return each token's teacher's entropy (``teacher_metrics``' third metric).

    Returns:
        loss: the differentiable float32 scalar.
        divergence: [B, T] float32, detached: each token's divergence from its teacher (zeros off the mask).
        entropy: [B, T] float32, detached: the student's entropy.
        teacher_entropy: with ``return_teacher_entropy`` only, [B, T] float32, detached: the entropy of each
            token's teacher as the divergence sees it (zeros off the mask). An in-process teacher's over the whole
            vocabulary at the temperature (its soft-cap and logit scale applied), from the divergence's own records
            of it (log S - Z / S: no sweep of its own, [N] more fp32 values); a served teacher's over the token's
            support, with the tail bucket or renormalised (TRL's ``teacher_entropy``; 0 where it lists nothing).

    Raises:
        TypeError: a ``teachers`` that is not a Teachers of Teacher / ServedTeacher records, an index that is not an
            integer tensor, a tensor argument's dtype, as the one-teacher functions.
        ValueError: an index outside [0, len(teachers)) or not of shape [B], a teacher's tensors not of its rows'
            count or not of the student's T, V or device, no beta where in-process and served teachers mix, served
            teachers with different tail buckets or temperatures, an in-process teacher's head not sharded as the
            student's, ``token_chunk`` with vocab-parallel heads, and the one-teacher functions' errors.
    """
    check_float_tensor("student_hidden", student_hidden)
    if student_hidden.dim() != 3 or 0 in student_hidden.shape:
        raise ValueError(
            f"student_hidden must have shape [B, T, D] with B, T, D > 0, got {tuple(student_hidden.shape)}"
        )
    B, T, _ = student_hidden.shape
    _check_teachers(teachers, B, student_hidden.device)
    hidden, weight, bias, shard = resolve(student_hidden, student_weight, student_bias, vocab_parallel)
    names = ("student_hidden", "student_weight", "student_bias")
    V = check_head(names, hidden, weight, bias, sharded=shard is not None)[3]
    check_chunk("token_chunk", token_chunk, "tokens per gradient GEMM")
    if shard is not None and token_chunk is not None:
        raise ValueError("token_chunk sizes the in-process teachers' fused loss, which vocab-parallel heads do not run")
    check_num_items_in_batch(num_items_in_batch)
    if completion_mask is not None:
        check_tensor("completion_mask", completion_mask)
        check_same_device([("completion_mask", completion_mask)], student_hidden.device, "student_hidden")
    student = ModelHead(hidden, weight, bias, LogitTransform(temperature, student_softcap, student_logit_scale))
    public = student._replace(weight=student_weight, bias=student_bias)  # resolve_pair's: DTensors stay as given
    listed = local_teachers(teachers.teachers, public, vocab_parallel)
    dense = [i for i, t in enumerate(listed) if isinstance(t, Teacher)]
    served = [i for i, t in enumerate(listed) if isinstance(t, ServedTeacher)]
    beta = _beta_or_default(listed, beta, "beta")
    check_number("beta", beta, lambda v: 0.0 <= v <= 1.0, "a number in [0, 1] (0: forward KL, 1: reverse KL)")
    check_number("temperature", temperature, lambda v: v > 0, "a positive number")
    check_softcap_and_scale(student_softcap, student_logit_scale, ("student_softcap", "student_logit_scale"))
    if not has_data(student_hidden, teachers.teacher_index):
        raise ValueError(
            "multi_teacher_distillation_loss routes rows by reading teacher_index on the host: it takes tensors "
            "with data (not fake or meta tensors)"
        )
    routing = _Routing.read(teachers.teacher_index, completion_mask, len(listed), T)
    _check_teacher_shapes(listed, routing, T, V, student_hidden.device, shard is not None)
    total = sum(routing.token_counts)
    if isinstance(num_items_in_batch, torch.Tensor):
        divisor = num_items_in_batch.to(device=student_hidden.device, dtype=torch.float32).reshape(())
    else:
        divisor = float(num_items_in_batch) if num_items_in_batch is not None else float(max(total, 1))
    loss = student_hidden.new_zeros((), dtype=torch.float32)
    per_token = torch.zeros((3, B * T), dtype=torch.float32, device=student_hidden.device)  # div, both entropies
    resolved = resolve_backend(backend, student_hidden.device)
    if sum(routing.token_counts[i] for i in dense):
        segments = list(routing.segments(dense, len(listed)))
        if shard is None:
            part_loss, order, *parts = _dense_loss(student, listed, segments, beta, divisor, resolved, token_chunk)
        else:
            resolved.check_sizes(sum(routing.token_counts[i] for i in dense), V)
            part_loss, order, *parts = dense_loss(student, listed, segments, beta, shard, resolved.name, divisor)
        loss = loss + part_loss
        per_token = per_token.index_copy(1, order, torch.stack(parts))
    elif token_chunk is not None:
        raise ValueError("token_chunk sizes the in-process teachers' fused loss, and no row has one")
    if served and sum(routing.token_counts[i] for i in served):
        record = _served_record(listed, served, routing, B, T, student_hidden.device)
        served_mask = routing.scored_mask_of(served, len(listed)).view(B, T)
        part_loss, *parts = served_loss_and_teacher_entropy(
            student_hidden, student_weight, record, served_mask,
            num_items_in_batch=divisor, targets=targets, beta=beta, temperature=temperature, student_bias=student_bias,
            student_softcap=student_softcap, student_logit_scale=student_logit_scale, backend=backend, support=support,
            vocab_parallel=vocab_parallel,
        )  # fmt: skip
        loss = loss + part_loss
        per_token = per_token + torch.stack(parts).view(3, -1)
    div, entropy, teacher_entropy = per_token.view(3, B, T).unbind()
    return (loss, div, entropy, teacher_entropy) if return_teacher_entropy else (loss, div, entropy)


def _dense_loss(student, teachers, segments, beta, divisor, backend, token_chunk):
    """The in-process teachers' part on one process, one fused op: (loss, the flat rows [N], their divergence [N],
    the student's entropy [N], each row's teacher's entropy [N])."""
    order = torch.cat([flat for _, flat, _ in segments])
    hidden = student.hidden.reshape(-1, student.hidden.shape[-1]).index_select(0, order)
    backend.check_sizes(hidden.shape[0], student.weight.shape[0])
    heads = [teacher_head(teachers[i], Rows(local), student.transform.temperature) for i, _, local in segments]
    starts = list(itertools.accumulate((flat.shape[0] for _, flat, _ in segments), initial=0))
    bias = student.bias.contiguous() if student.bias is not None else None
    operands = ops.RoutedOperands(
        hidden, student.weight.contiguous(), bias, [h.hidden for h in heads], [h.weight for h in heads],
        [h.bias for h in heads], starts, float(beta), *student.transform.as_floats(),
        [h.transform.softcap or 0.0 for h in heads], [h.transform.logit_scale for h in heads], backend.name,
    )  # fmt: skip
    grad = torch.is_grad_enabled()
    needs = tuple(grad and x is not None and x.requires_grad for x in student[:3])
    weights = torch.ones(hidden.shape[0], dtype=torch.float32, device=hidden.device) / divisor
    loss, div, entropy, teacher_entropy = ops.routed_divergence_loss(operands, weights, needs, token_chunk)
    return loss, order, div, entropy, teacher_entropy


@takes_keywords()
def teacher_metrics(
    teachers: Teachers,
    divergence: torch.Tensor,
    completion_mask: torch.Tensor | None = None,
    *,
    teacher_entropy: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """TRL 1.16's per-teacher MOPD metrics of a batch, each a 0-dim fp32 tensor on the divergence's device (no host
    synchronisation), each teacher's tokens being its rows' scored ones:

    * ``teacher_token_frac/<name>``: the teacher's share of the scored tokens (0 without tokens);
    * ``teacher_jsd/<name>``: its tokens' mean divergence (NaN without tokens: TRL's);
    * ``teacher_entropy/<name>``, given ``teacher_entropy``: its tokens' mean teacher entropy (NaN without tokens):
      a served teacher's over each token's support (TRL's formula), an in-process one's over the vocabulary
      (``multi_teacher_distillation_loss``' ``teacher_entropy`` says which). Without it the key is absent (no value
      stands in for it).

    TRL counts only the tokens with a teacher entry; here a scored token whose served teacher lists nothing counts,
    with divergence and teacher entropy 0 (pass a mask without them for TRL's means).

    Args:
        teachers: the call's ``Teachers``.
        divergence: [B, T] the per-token divergence (``multi_teacher_distillation_loss``' second output).
        completion_mask: [B, T] the scored tokens; None: every token.
        teacher_entropy: [B, T] each token's teacher's entropy (``multi_teacher_distillation_loss(...,
            return_teacher_entropy=True)``'s fourth output), or None.

    Returns:
        {name: value}, two entries a teacher, three with ``teacher_entropy``.
    """
    if not isinstance(teachers, Teachers):
        raise TypeError(f"teachers must be a grpo_fast.Teachers, got {type(teachers).__name__}")
    check_tensor("divergence", divergence)
    if divergence.dim() != 2:
        raise ValueError(f"divergence must have shape [B, T], got {tuple(divergence.shape)}")
    B, T = divergence.shape
    _check_teachers(teachers, B, divergence.device)
    n = len(teachers.teachers)
    mask = torch.ones_like(divergence) if completion_mask is None else completion_mask.to(divergence.device).float()
    if tuple(mask.shape) != (B, T):
        raise ValueError(f"completion_mask must have shape [B, T] = {[B, T]}, got {tuple(mask.shape)}")
    per_token = {"jsd": divergence}
    if teacher_entropy is not None:
        check_tensor("teacher_entropy", teacher_entropy)
        if tuple(teacher_entropy.shape) != (B, T):
            raise ValueError(f"teacher_entropy must have shape [B, T] = {[B, T]}, got {tuple(teacher_entropy.shape)}")
        per_token["entropy"] = teacher_entropy.to(divergence.device)
    onehot = torch.nn.functional.one_hot(teachers.teacher_index.long().clamp(0, n - 1), n).float()  # [B, n]
    counts = mask.sum(1) @ onehot
    metrics = {"token_frac": counts / counts.sum().clamp(min=1.0)}
    for metric, values in per_token.items():
        sums = (values.detach().float() * mask).sum(1) @ onehot
        metrics[metric] = torch.where(counts > 0, sums / counts.clamp(min=1.0), float("nan"))
    return {
        f"teacher_{metric}/{name}": values[i]
        for i, name in enumerate(teachers.teacher_names())
        for metric, values in metrics.items()
    }


@dataclass(frozen=True)
class RoutedDistillation:
    """``grpo_fast.loss(..., teacher=grpo_fast.Teachers(...))``'s checked teachers: the per-token loss gains ``coef``
    times each token's divergence from its row's teacher (an in-process teacher's by the divergence head's per-token
    op, a served one's by the served head's; composed beside layer 1's, as ``ServedDistillation``)."""

    teachers: Teachers
    coef: float
    beta: float

    @classmethod
    def check(cls, teachers, coef, beta, lora, student: ModelHead, vocab_parallel) -> RoutedDistillation:
        """``student``: the call's public hidden states, weight and bias (DTensors as given): with a vocab-parallel
        head (``vocab_parallel``, or a DTensor weight) each in-process teacher's weight is taken as this rank's
        rows, checked to be split by the student's ranges (``multi_teacher.parallel.local_teachers``)."""
        listed = teachers.teachers if isinstance(teachers, Teachers) else ()
        beta = _beta_or_default(listed, beta, "distillation_beta")
        coef, beta = check_coef_and_beta(coef, beta, beta, "0: forward KL(teacher || student), 1: reverse KL")
        if lora is not None:
            raise ValueError("lora with several teachers (grpo_fast.Teachers) is not supported yet")
        if listed and (vocab_parallel is not None or type(student.weight).__name__ == "DTensor"):
            teachers = dataclasses.replace(teachers, teachers=local_teachers(listed, student, vocab_parallel))
        return cls(teachers, coef, beta)

    def check_against(self, head) -> None:
        """The Teachers record against the student's checked call (the teachers' shapes follow the routing's read)."""
        if head.shard is not None and head.lora is not None:
            raise ValueError("lora with vocab_parallel is not supported with several teachers")
        _check_teachers(self.teachers, head.shape[0], head.hidden.device)

    def logprobs_entropy_divergence(self, head, rows):
        """(logp, entropy, divergence) [B, T] fp32 of the call's scored ``rows``, differentiable; the routing reads
        its counts on the host (a second synchronisation)."""
        logp, entropy = logprobs_and_entropy_rows(head, rows, head.head_path)
        B, T = head.shape
        listed = list(self.teachers.teachers)
        routing = _Routing.read(self.teachers.teacher_index, head.completion_mask, len(listed), T)
        _check_teacher_shapes(listed, routing, T, head.weight.shape[0], head.hidden.device)
        div = torch.zeros(B * T, dtype=torch.float32, device=head.hidden.device)
        dense = [i for i, t in enumerate(listed) if isinstance(t, Teacher)]
        segments = routing.segments(dense, len(listed))
        if head.shard is not None:  # each in-process teacher's rows through the vocab-parallel divergence head
            student = ModelHead(head.hidden, head.weight, head.bias, head.transform)
            for flat, part, _, _ in dense_divergences(
                student, listed, segments, self.beta, head.shard, head.backend.name
            ):
                div = div.index_copy(0, flat, part)
        else:  # the divergence head's per-token op on each in-process teacher's rows
            for i, flat, local in segments:
                student = head.operands(Rows(flat))
                operands = divergence_ops.OpOperands.from_heads(
                    ModelHead(student.hidden, student.weight, student.bias, student.transform),
                    teacher_head(listed[i], Rows(local), head.transform.temperature),
                    self.beta,
                    head.backend.name,
                    student.hidden.dtype,
                )
                part, _, _, _, _ = divergence_ops.divergence_forward(operands, False)
                div = div.index_copy(0, flat, part)
        served = [i for i, t in enumerate(listed) if isinstance(t, ServedTeacher)]
        if served and sum(routing.token_counts[i] for i in served):
            record = _served_record(listed, served, routing, B, T, head.hidden.device)
            flat = routing.scored_rows_of(served, len(listed))
            part = served_divergence_rows(head, Rows(flat), record, self.beta, checked=False)
            div = div.index_copy(0, flat, part)
        return logp, entropy, div.view(B, T)


__all__ = ["Teachers", "multi_teacher_distillation_loss", "teacher_metrics"]
