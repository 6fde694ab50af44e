"""The divergence head's divergences and per-token records, in plain torch: the ``Divergence`` records (what varies
between the divergences, read by the kernels as a constexpr MODE), one model's mergeable record over a set of
vocabulary entries, its merge, the outputs and saved values finished from both models' merged records, and layer 1's
record taken from the student's (``layer1_record``: the combined GRPO + distillation head). The Triton sweep
kernel builds the same records in registers (its wrapper merges the vocabulary splits here), the torch twin merges
its chunks with them, a vocab-parallel head its ranks.

Per token, model X (s: student, t: teacher; Y the other model), z_X its transformed logits, g_X = z_X - z_Y:
    max     m = max_v z_X,v, at entry a (the argmax: the first one)
    rest    R = sum_{v != a} exp(z_X,v - m)           (the argmax's own term, exactly 1, kept out: S = 1 + R)
    cross   C = sum_{v != a} exp(z_X,v - m) (g_X,v - g_X,a)
    other   o = z_Y,a                                  (the other model's logit at X's argmax)
    zsum    Z = sum_v exp(z_X,v - m) (z_X,v - m)       (for the model's entropy)
    unsupported: some entry with p_X > 0 has z_Y = -inf (the KL is +inf)
An empty record has m = -inf and sums 0. Two records merge in any order: the larger max wins (on a tie the first),
a = exp(m_l - m_w), and the loser's argmax term joins the rest:
    R = R_w + a (1 + R_l),   C = C_w + a (C_l + (g_l - g_w) (1 + R_l)),   Z = Z_w + a (Z_l + (m_l - m_w) (1 + R_l)).
Finished, with log S = log1p(R) and q = R / S = 1 - p_X,a:
    KL(t || s) = C_t / S_t - log S_t + (m_s - o_t) + log S_s     (beta = 0: the forward KL)
    KL(s || t) = C_s / S_s - log S_s + (m_t - o_s) + log S_t     (beta = 1: the reverse KL)
    H_X        = log S_X - Z_X / S_X                     (the student's; the teacher's for its metric)
Each term is a sum of same-signed parts, or an exact zero where a token is confident (o = m when both models share
their argmax): no 1 - p is formed. The generalized JSD (0 < beta < 1) needs both final normalisers for
m = (1 - beta) p_s + beta p_t: a second sweep sums beta p_t (log p_t - log m) + (1 - beta) p_s (log p_s - log m),
log p_X = (z_X - m_X) - log S_X, and log m = log1p(-((1 - beta) q_s + beta q_t)) at a shared argmax.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple, get_args

import torch

from .gemm import mm_fp32
from .softmax_stats import SoftmaxStats

DivergenceName = Literal["forward_kl", "reverse_kl", "jsd"]
DIVERGENCE_NAMES: tuple[str, ...] = get_args(DivergenceName)


@dataclass(frozen=True)
class Divergence:
    """One divergence of the head: its name and the facts its readers need besides its formula. Its formula stands
    once per implementation, each dispatching on the record and raising on one it does not know: ``finish`` (the
    outputs from the records), the Triton g formula (``divergence_tile.logit_gradient``, by ``mode``), the torch
    twin's (``backends.divergence_twin.logit_grad``); the spec's is grpo_fast.reference.divergence_and_entropy's.

    Attributes:
        name: one of DIVERGENCE_NAMES (grpo_fast.reference's terms: KL(p_t || p_s), KL(p_s || p_t), the generalized
            JSD beta KL(p_t || m) + (1 - beta) KL(p_s || m)).
        mode: the kernels' constexpr MODE: which g formula the g kernel compiles.
        mixture: it compares each model with the mixture m = (1 - beta) p_s + beta p_t, which needs both models'
            final normalisers: a second sweep over the vocabulary (the JSD sweep) after the records.
    """

    name: DivergenceName
    mode: int
    mixture: bool = False


FORWARD_KL = Divergence("forward_kl", 0)  # TRL's beta 0: KL(p_t || p_s)
REVERSE_KL = Divergence("reverse_kl", 1)  # TRL's beta 1 (its default): KL(p_s || p_t)
JSD = Divergence("jsd", 2, mixture=True)  # TRL's 0 < beta < 1
DIVERGENCES = {d.name: d for d in (FORWARD_KL, REVERSE_KL, JSD)}


def divergence_of(beta: float) -> Divergence:
    """The divergence TRL's ``beta`` (in [0, 1]) selects: 0 the forward KL, 1 the reverse KL, between the JSD."""
    return FORWARD_KL if beta == 0.0 else REVERSE_KL if beta == 1.0 else JSD


# the per-token values the forward saves for the backward, one [len(SAVED_FIELDS), N] fp32 tensor in this order; the
# last two: beta = 1: g_a and C_s / S_s; the JSD: r_a and sum_v p_s (r_v - r_a); beta = 0: zeros. Beside it, both
# argmax indices as one [2, N] int64 tensor (the student's, the teacher's).
SAVED_FIELDS = (
    "student_max",
    "student_log_sumexp",
    "student_rest_mass",
    "teacher_max",
    "teacher_log_sumexp",
    "teacher_rest_mass",
    "reference",
    "excess",
)


class ModelHead(NamedTuple):
    """One model's operands of the divergence head.

    Attributes:
        hidden: [N, D] the scored tokens' last hidden states, rows contiguous.
        weight: [V, D] the lm_head's rows (a vocab-parallel shard's rows), hidden's dtype.
        bias: [V] or None.
        transform: the model's logit transform (a LogitTransform: ``apply``, ``kernel_scalars``, ``softcap``).
    """

    hidden: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor | None
    transform: Any

    def tokens(self, start: int, stop: int) -> ModelHead:
        """The same head over the tokens [start, stop) only."""
        return self._replace(hidden=self.hidden[start:stop])


class TeacherSegments(NamedTuple):
    """Several teachers over consecutive row ranges of one call's tokens (multi-teacher distillation, rows routed
    by teacher and sorted by it): ``heads[i]`` scores the tokens [starts[i], starts[i + 1]) (its hidden states hold
    exactly those rows), each with its own width, bias, soft-cap and logit scale; one temperature, their transforms'.

    The fused loss forms a chunk's teacher product a segment at a time (one cuBLAS call per teacher in the chunk,
    into the one fp32 buffer) with each teacher's bias, logit scale and soft-cap applied there
    (``products``), so the record, JSD and g kernels run once per chunk as for one teacher, with the temperature
    alone as the teacher's transform.
    """

    starts: tuple[int, ...]  # len(heads) + 1 row offsets, the first 0, the last the token count
    heads: tuple[ModelHead, ...]

    def overlapping(self, n0: int, n1: int):
        """(a, b, head, first) for each teacher scoring tokens of [n0, n1): its tokens [a, b) there, ``first`` the
        row of its hidden states that holds token a."""
        for i, head in enumerate(self.heads):
            a, b = max(n0, self.starts[i]), min(n1, self.starts[i + 1])
            if a < b:
                yield a, b, head, a - self.starts[i]

    def products(self, n0: int, n1: int, out: torch.Tensor) -> None:
        """out[: n1 - n0] = each token's teacher logits before the temperature (fp32: cuBLAS's product, the bias,
        the logit scale and soft-cap as ``LogitTransform.apply``'s)."""
        for a, b, head, first in self.overlapping(n0, n1):
            part = out[a - n0 : b - n0]
            mm_fp32(head.hidden[first : first + b - a], head.weight.T, part, accumulate=False)
            if head.bias is not None:
                part += head.bias.float()
            if head.transform.softcap is not None or float(head.transform.logit_scale) != 1.0:
                part.copy_(dataclasses.replace(head.transform, temperature=1.0).apply(part))

    def kernel_head(self, like: ModelHead) -> ModelHead:
        """The teacher as the kernels see it with its logits in memory: no bias, the temperature alone (``like``:
        any head, for the shapes the kernels' arguments name but never read)."""
        temperature = self.heads[0].transform.temperature  # every teacher's, the student's
        transform = dataclasses.replace(like.transform, temperature=temperature, softcap=None, logit_scale=1.0)
        return ModelHead(like.hidden, like.weight, None, transform)


class Record(NamedTuple):
    """One model's record over a set of vocabulary entries (module docstring), [n] each."""

    max: torch.Tensor  # fp32; -inf for an empty record
    argmax: torch.Tensor  # int64, a global vocabulary index
    rest: torch.Tensor  # fp32
    cross: torch.Tensor  # fp32
    other: torch.Tensor  # fp32
    zsum: torch.Tensor  # fp32
    unsupported: torch.Tensor  # bool


class Finished(NamedTuple):
    """What the outputs and the backward read of one model's merged record, [n] each."""

    max: torch.Tensor  # fp32
    log_sumexp: torch.Tensor  # fp32: log S = log1p(R), lse = max + log S
    rest_mass: torch.Tensor  # fp32: q = R / S = 1 - p at the argmax
    argmax: torch.Tensor  # int64


# (finished student, finished teacher, r_a [n]) -> (JSD, sum_v p_s (r_v - r_a)) [n] fp32: the JSD's second sweep
JsdSweep = Callable[[Finished, Finished, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def pivot(row_max: torch.Tensor) -> torch.Tensor:
    """The finite value the sums are taken against: the max, or 0 where it is -inf (no inf - inf)."""
    return torch.where(torch.isinf(row_max), torch.zeros_like(row_max), row_max)


def zero_where(condition: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """x with exact zeros where ``condition`` holds (a NaN elsewhere stays: a scored NaN is never hidden)."""
    return torch.where(condition, torch.zeros_like(x), x)


def empty_record(n: int, device: torch.device) -> Record:
    """The record of no vocabulary entry for n tokens: max -inf, argmax 0, sums 0, supported."""
    nothing = torch.zeros(n, dtype=torch.float32, device=device)
    return Record(
        torch.full((n,), float("-inf"), device=device),
        torch.zeros(n, dtype=torch.int64, device=device),
        nothing,
        nothing,
        nothing,
        nothing,
        torch.zeros(n, dtype=torch.bool, device=device),
    )


def tile_record(z: torch.Tensor, z_other: torch.Tensor, v0: int) -> Record:
    """The record of one tile of a model's logits.

    Args:
        z: [n, c] fp32 the model's transformed logits (-inf allowed).
        z_other: [n, c] fp32 the other model's, at the same entries.
        v0: the global vocabulary index of the tile's first column.

    Returns:
        The tile's Record, [n] each (argmax global).
    """
    row_max, local = z.max(dim=1)
    e = torch.exp(z - pivot(row_max)[:, None])
    unsupported = ((e > 0) & (z_other == float("-inf"))).any(1)
    rows = torch.arange(z.shape[0], device=z.device)
    e[rows, local] = 0.0  # the argmax's own term (1, or 0 in an empty tile) stays out of the sums
    other = z_other[rows, local]
    gap_at_max = row_max - other
    no_mass = e == 0  # 0 * (-inf or NaN) must not form a NaN where the entry has no mass
    cross = zero_where(no_mass, e * ((z - z_other) - gap_at_max[:, None])).sum(1)
    zsum = zero_where(no_mass, e * (z - pivot(row_max)[:, None])).sum(1)
    return Record(row_max, local + v0, e.sum(1), cross, other, zsum, unsupported)


def merge(first: Record, second: Record) -> Record:
    """The record of two disjoint sets of entries (module docstring); ``first`` holds the lower indices (it wins
    ties)."""
    second_wins = second.max > first.max
    win = Record(*(torch.where(second_wins, b, a) for a, b in zip(first, second, strict=True)))
    lose = Record(*(torch.where(second_wins, a, b) for a, b in zip(first, second, strict=True)))
    scale = torch.exp(lose.max - pivot(win.max))
    lose_sumexp = (lose.max > float("-inf")).float() + lose.rest
    gap_shift = (lose.max - lose.other) - (win.max - win.other)
    max_shift = lose.max - pivot(win.max)
    nothing = scale == 0  # an empty loser (or one too far below to count) adds nothing, and no inf * 0
    return Record(
        win.max,
        win.argmax,
        win.rest + scale * lose_sumexp,
        win.cross + zero_where(nothing, scale * (lose.cross + gap_shift * lose_sumexp)),
        win.other,
        win.zsum + zero_where(nothing, scale * (lose.zsum + max_shift * lose_sumexp)),
        first.unsupported | second.unsupported,
    )


def sumexp(record: Record) -> torch.Tensor:
    """S = 1 + R (0 for an empty record), [n] fp32."""
    return (record.max > float("-inf")).float() + record.rest


def model_entropy(record: Record) -> torch.Tensor:
    """The model's entropy H = log S - Z / S from its record over the whole vocabulary, [n] fp32: the student's
    (``finish``), or the teacher's from its own record (several teachers' ``teacher_entropy`` metric: no sweep of
    its own)."""
    return torch.log1p(record.rest) - record.zsum / sumexp(record)


def finish(
    student: Record, teacher: Record, beta: float, jsd_sweep: JsdSweep
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The outputs from both models' merged records (module docstring).

    Args:
        student: the student's Record over the whole vocabulary, [n].
        teacher: the teacher's, [n].
        beta: in [0, 1]: 0 the forward KL, 1 the reverse KL, between the generalized JSD.
        jsd_sweep: the JSD's second sweep (called for a divergence with a mixture only).

    Returns:
        (divergence [n] fp32 (+inf where unsupported), the student's entropy [n] fp32, saved
        [len(SAVED_FIELDS), n] fp32, argmax [2, n] int64).
    """
    student_finished, student_sumexp = _finished(student)
    teacher_finished, teacher_sumexp = _finished(teacher)
    entropy = model_entropy(student)
    divergence = divergence_of(beta)
    if divergence == FORWARD_KL:
        div = (teacher.cross / teacher_sumexp - teacher_finished.log_sumexp) + (student.max - teacher.other)
        div = torch.where(teacher.unsupported, float("inf"), div + student_finished.log_sumexp)
        reference = excess = torch.zeros_like(div)  # the backward reads only the records
    elif divergence == REVERSE_KL:
        div = (student.cross / student_sumexp - student_finished.log_sumexp) + (teacher.max - student.other)
        div = torch.where(student.unsupported, float("inf"), div + teacher_finished.log_sumexp)
        reference, excess = student.max - student.other, student.cross / student_sumexp
    elif divergence == JSD:
        reference = _top_log_ratio(student_finished, teacher_finished, student.other, beta)
        div, excess = jsd_sweep(student_finished, teacher_finished, reference)
    else:
        raise ValueError(f"finish has no formula for the divergence {divergence.name!r}")
    return (
        div,
        entropy,
        torch.stack([*student_finished[:3], *teacher_finished[:3], reference, excess]),
        torch.stack([student_finished.argmax, teacher_finished.argmax]),
    )


def unpack_saved(saved: torch.Tensor, argmax: torch.Tensor) -> tuple[Finished, Finished, torch.Tensor, torch.Tensor]:
    """The backward's (student, teacher) Finished values, reference and excess [n] from ``finish``'s saved [8, n]
    fp32 and argmax [2, n] int64."""
    student = Finished(saved[0], saved[1], saved[2], argmax[0])
    teacher = Finished(saved[3], saved[4], saved[5], argmax[1])
    return student, teacher, saved[6], saved[7]


def _finished(record):
    record_sumexp = sumexp(record)
    return Finished(record.max, torch.log1p(record.rest), record.rest / record_sumexp, record.argmax), record_sumexp


def _top_log_ratio(student, teacher, teacher_at_student_top, beta):
    """r_a = log p_s - log m at the student's argmax a, from the records (z_t,a: the student's record's ``other``)."""
    log_ps = -student.log_sumexp
    log_pt = (teacher_at_student_top - teacher.max) - teacher.log_sumexp
    log_m = torch.logaddexp(log_ps + math.log1p(-beta), log_pt + math.log(beta))
    shared = student.argmax == teacher.argmax
    log_m = torch.where(shared, torch.log1p(-((1.0 - beta) * student.rest_mass + beta * teacher.rest_mass)), log_m)
    return log_ps - log_m


def layer1_record(student, targets, target_logit):
    """Layer 1's merged record from the divergence's student record and the student's logit at each target.

    The max, zsum and rest (argmax kept out) are the same sums; the rest without the target is the record's rest
    where the target is the argmax (its logit is then the max, exactly), else (1 - e_y) + rest, e_y = exp(z_y - m)
    <= 1, p_y <= 1/2: no cancellation either way.

    Args:
        student: the student's Record over the whole vocabulary, [N].
        targets: [N] int64 target ids.
        target_logit: [N] fp32 the student's logit at each target.

    Returns:
        The softmax_stats.SoftmaxStats, [N] each.
    """
    has_max = (student.max > float("-inf")).float()
    pivot = torch.where(torch.isinf(student.max), 0.0, student.max)
    top = targets == student.argmax
    target_logit = torch.where(top, student.max, target_logit)
    rest = torch.where(top, student.rest, (has_max - torch.exp(target_logit - pivot)) + student.rest)
    return SoftmaxStats(student.max, has_max + student.rest, rest, student.zsum, target_logit)
