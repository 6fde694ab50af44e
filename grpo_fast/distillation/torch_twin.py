"""The torch twin of the divergence head: the kernels' algorithm in chunked PyTorch (any device), fp32 accumulation.

Per token, each model X (s: student, t: teacher; Y the other model) keeps a mergeable record over the vocabulary
entries seen so far, z_X its transformed logits, g_X = z_X - z_Y:
    max     m     = max_v z_X,v            at the entry a (its argmax: the first one, within a chunk and across them)
    rest    R     = sum_{v != a} exp(z_X,v - m)     (the argmax's own term, exactly 1, kept out: S = 1 + R)
    cross   C     = sum_{v != a} exp(z_X,v - m) (g_X,v - g_X,a)
    other   o     = z_Y,a                  (the other model's logit at X's argmax)
    zsum    Z     = sum_v exp(z_X,v - m) (z_X,v - m)     (the student's, for its entropy)
    inf     the support fails: some entry with p_X > 0 has z_Y = -inf (the KL is then +inf)
(an empty record: m = -inf, sums 0). Two records merge in any order: the one of larger max (on a tie the first)
wins, a = exp(m_loser - m_winner), and the loser's argmax term moves into the rest:
    R = R_w + a (1 + R_l),   C = C_w + a (C_l + (g_l - g_w) (1 + R_l)),   Z = Z_w + a (Z_l + (m_l - m_w) (1 + R_l)).
Finished, with log S = log1p(R) and q = R / S = 1 - p_X,a:
    KL(t || s) = C_t / S_t - log S_t + (m_s - o_t) + log S_s     (forward KL, beta = 0)
    KL(s || t) = C_s / S_s - log S_s + (m_t - o_s) + log S_t     (reverse KL, beta = 1)
    H_s        = log S_s - Z_s / S_s
Every term is a sum of same-signed parts or an exact zero where a token is confident (o = m exactly when both models
share their argmax): no 1 - p and no difference of two logits of size |z| is formed where the result is 1e-6.
The generalized JSD (0 < beta < 1) needs both final normalisers for m = (1 - beta) p_s + beta p_t: a second sweep
sums beta p_t (log p_t - log m) + (1 - beta) p_s (log p_s - log m) (and the backward's sum below), with
log p_X = (z_X - m_X) - log S_X, and at a shared argmax log m = log1p(-((1 - beta) q_s + beta q_t)).

The backward recomputes both tiles and forms the gradient of the divergence with respect to the student's logits,
times dL/d divergence c and the transform's slope dz/du (logit_scale (1 - tanh^2) / temperature):
    beta = 0:  p_s - p_t              (at a shared argmax: q_t - q_s, from the carried rests)
    beta = 1:  p_s (l_v - KL),  l = log p_s - log p_t
    else:      (1 - beta) p_s (r_v - KL(p_s || m)),  r = log p_s - log m
Where the student is confident and the teacher is not, l_a and KL are both O(1) and agree to O(q): their difference
is carried instead, l_v - KL = (l_v - l_a) - (KL - l_a) with KL - l_a = C_s / S_s (l_v - l_a = g_v - g_a: 0 at the
argmax, exactly), and likewise r_v - KL(p_s || m) = (r_v - r_a) - sum_v p_s (r_v - r_a), the sum taken in the JSD's
second sweep with r_a from the first sweep's records.
    dH = g W_s,  dW_s = g^T H_s,  db_s = sum_n g.

Vocabulary sweeps and FLOPs, against TRL 1.16's ChunkedDivergenceFunction (read from trl/kernels/
chunked_divergence.py: its forward projects both models once, twice for the JSD; its backward re-projects both
models once and does dH, and dW where the head trains). A sweep projects both models over the vocabulary, 2 N V
(Ds + Dt) FLOPs; a student GEMM (dH, dW, or one of the frozen head's two sums) is 2 N V Ds:
    beta      student head                    ours                               TRL 1.16
    0 or 1    trainable                       1 + 1 sweeps + dH + dW             the same: 2 N V (4 Ds + 2 Dt)
    JSD       trainable                       2 + 1 sweeps + dH + dW             the same: 2 N V (5 Ds + 3 Dt)
    0 or 1    frozen (only h needs a grad)    1 sweep + 2 GEMMs: 2 N V (3 Ds + Dt)      2 N V (3 Ds + 2 Dt)
    JSD       frozen                          2 sweeps + 2 GEMMs: 2 N V (4 Ds + 2 Dt)   2 N V (4 Ds + 3 Dt)
(the frozen head's backward is dH = c J: no sweep; tests/test_divergence.py counts these with FlopCounterMode).
Where TRL is not beaten: a trainable head takes exactly TRL's count (the backward needs both models' tiles again:
keeping either model's [N, V] logits is what this head avoids), and the JSD's second sweep stays: its mixture
log m_v needs both models' final normalisers at every entry, which no one-sweep fold of mergeable sums gives.
Memory: a few [CHUNK_N, CHUNK_V] fp32 tiles, fp32 dH / dW accumulators (J, N x Ds fp32, on the frozen path),
O(N) per-token values; never N x V.
"""

import math
from typing import NamedTuple

import torch

from grpo_fast.head.torch_twin import CHUNK_N, CHUNK_V, add_tile_gradients

# the per-token values the forward saves for the backward (one [len, N] fp32 tensor, in this order; the last two:
# beta = 1: g_a and C_s / S_s; JSD: r_a and sum_v p_s (r_v - r_a); beta = 0: unused), and the two argmax indices
# (one [2, N] int64 tensor: the student's, the teacher's)
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


class Record(NamedTuple):
    """One model's record (module docstring), [n] each."""

    max: torch.Tensor
    argmax: torch.Tensor  # int64, global vocabulary index
    rest: torch.Tensor
    cross: torch.Tensor
    other: torch.Tensor
    zsum: torch.Tensor
    unsupported: torch.Tensor  # bool


def _pivot(row_max):
    return torch.where(torch.isinf(row_max), torch.zeros_like(row_max), row_max)


def _zero_where(condition, x):
    """x with exact zeros where ``condition`` holds (a NaN elsewhere stays: a scored NaN is never hidden)."""
    return torch.where(condition, torch.zeros_like(x), x)


def tile_record(z, z_other, v0):
    """The record of one tile of model X's logits z [n, c] (fp32, -inf allowed) against the other model's z_other."""
    row_max, local = z.max(dim=1)
    e = torch.exp(z - _pivot(row_max)[:, None])
    unsupported = ((e > 0) & (z_other == float("-inf"))).any(1)
    rows = torch.arange(z.shape[0], device=z.device)
    e[rows, local] = 0.0  # the argmax's own term (1, or 0 in an empty tile) stays out of the sums
    other = z_other[rows, local]
    gap = z - z_other
    gap_at_max = row_max - other
    empty = e == 0  # 0 * (-inf or NaN) must not form a NaN where the entry has no mass
    cross = _zero_where(empty, e * (gap - gap_at_max[:, None])).sum(1)
    zsum = _zero_where(empty, e * (z - _pivot(row_max)[:, None])).sum(1)
    return Record(row_max, local + v0, e.sum(1), cross, other, zsum, unsupported)


def merge(first, second):
    """Fold two records of disjoint entries (module docstring); ``first`` holds the lower indices (it wins ties)."""
    second_wins = second.max > first.max
    win = Record(*(torch.where(second_wins, b, a) for a, b in zip(first, second, strict=True)))
    lose = Record(*(torch.where(second_wins, a, b) for a, b in zip(first, second, strict=True)))
    scale = torch.exp(lose.max - _pivot(win.max))
    lose_sumexp = (lose.max > float("-inf")).float() + lose.rest
    gap_shift = (lose.max - lose.other) - (win.max - win.other)
    max_shift = lose.max - _pivot(win.max)
    nothing = scale == 0  # an empty loser (or one too far below to count) adds nothing, and no inf * 0
    return Record(
        win.max,
        win.argmax,
        win.rest + scale * lose_sumexp,
        win.cross + _zero_where(nothing, scale * (lose.cross + gap_shift * lose_sumexp)),
        win.other,
        win.zsum + _zero_where(nothing, scale * (lose.zsum + max_shift * lose_sumexp)),
        first.unsupported | second.unsupported,
    )


def _empty_record(n, device):
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


def logit_tile(hidden, weight, bias, transform, v0, v1, slope=False):
    """transform(h W[v0:v1]^T + b[v0:v1]) for the rows of ``hidden``, fp32 (with ``slope`` also dz/du)."""
    u = hidden.float() @ weight[v0:v1].float().T
    if bias is not None:
        u += bias[v0:v1].float()
    return transform.apply(u, slope=slope)


class Finished(NamedTuple):
    """What the outputs and the backward read per token, [n] fp32 each (argmax int64)."""

    max: torch.Tensor
    log_sumexp: torch.Tensor  # log S = log1p(R): lse = max + log S
    rest_mass: torch.Tensor  # q = R / S = 1 - p at the argmax
    argmax: torch.Tensor


def _finished(record):
    sumexp = (record.max > float("-inf")).float() + record.rest
    return Finished(record.max, torch.log1p(record.rest), record.rest / sumexp, record.argmax), sumexp


def _log_probs(z, model, v0):
    """log p = (z - m) - log S of a tile, and whether each entry is the model's argmax (``v0``: the tile's first
    global vocabulary index)."""
    columns = torch.arange(v0, v0 + z.shape[1], device=z.device)
    top = columns[None, :] == model.argmax[:, None]
    # at the argmax z - m is 0: exactly, whatever the rounding of a recomputed tile
    log_p = torch.where(top, 0.0, z - model.max[:, None]) - model.log_sumexp[:, None]
    return log_p, top


def _log_mixture(log_ps, log_pt, shared_top, student, teacher, beta):
    """log m, m = (1 - beta) p_s + beta p_t; at a shared argmax from the carried rests (m is 1 - 1e-6 there)."""
    log_m = torch.logaddexp(log_ps + math.log1p(-beta), log_pt + math.log(beta))
    at_top = torch.log1p(-((1.0 - beta) * student.rest_mass + beta * teacher.rest_mass))
    return torch.where(shared_top, at_top[:, None], log_m)


def forward(student_hidden, student_weight, student_bias, teacher_hidden, teacher_weight, teacher_bias, beta,
            student_transform, teacher_transform, frozen_head=False):  # fmt: skip
    """(divergence [N], student entropy [N], saved [len(SAVED_FIELDS), N] fp32, argmax [2, N] int64, J): with
    ``frozen_head`` J = d divergence / d student_hidden [N, Ds] fp32 built in the last sweep (FrozenHead), else
    None."""
    N = student_hidden.shape[0]
    dev = student_hidden.device
    outputs = []
    for n0 in range(0, N, CHUNK_N):
        n1 = min(n0 + CHUNK_N, N)
        hs, ht = student_hidden[n0:n1], teacher_hidden[n0:n1]
        frozen = FrozenHead(beta, n1 - n0, student_weight) if frozen_head else None
        run_s, run_t = records(hs, student_weight, student_bias, ht, teacher_weight, teacher_bias,
                               student_transform, teacher_transform, frozen=frozen)  # fmt: skip

        def jsd_sweep(student, teacher, reference, hs=hs, ht=ht, frozen=frozen):
            return _jsd_sweep(hs, ht, student_weight, student_bias, teacher_weight, teacher_bias, beta,
                              student_transform, teacher_transform, student, teacher, reference, frozen)  # fmt: skip

        out = finish(run_s, run_t, beta, jsd_sweep)
        outputs.append(out + ((frozen.finish(run_s, run_t, out[2]),) if frozen is not None else ()))
    if not outputs:
        return (
            torch.zeros(0, device=dev),
            torch.zeros(0, device=dev),
            torch.zeros((len(SAVED_FIELDS), 0), device=dev),
            torch.zeros((2, 0), dtype=torch.int64, device=dev),
            torch.zeros((0, student_hidden.shape[1]), device=dev) if frozen_head else None,
        )
    merged = tuple(torch.cat(parts, dim=-1) for parts in zip(*(out[:4] for out in outputs), strict=True))
    return merged + (torch.cat([out[4] for out in outputs]) if frozen_head else None,)


def records(
    hs,
    student_weight,
    student_bias,
    ht,
    teacher_weight,
    teacher_bias,
    student_transform,
    teacher_transform,
    offset=0,
    frozen=None,
):
    """Both models' records (student's, teacher's) over the rows of the weights, for the tokens of hs / ht [n, D];
    the weights' row v is vocabulary entry offset + v (a vocab-parallel shard: divergence_parallel). With ``frozen``
    (a FrozenHead) its sums are folded chunk by chunk."""
    run_s = run_t = _empty_record(hs.shape[0], hs.device)
    for v0 in range(0, student_weight.shape[0], CHUNK_V):
        v1 = min(v0 + CHUNK_V, student_weight.shape[0])
        # the student's slope dz/du only where the frozen head's sums need it
        zs, slope = (
            logit_tile(hs, student_weight, student_bias, student_transform, v0, v1, slope=True)
            if frozen is not None
            else (logit_tile(hs, student_weight, student_bias, student_transform, v0, v1), 1.0)
        )
        zt = logit_tile(ht, teacher_weight, teacher_bias, teacher_transform, v0, v1)
        tile_s, tile_t = tile_record(zs, zt, offset + v0), tile_record(zt, zs, offset + v0)
        if frozen is not None:
            frozen.fold(run_s, run_t, tile_s, tile_t, zs, zt, slope, v0, v1)
        run_s, run_t = merge(run_s, tile_s), merge(run_t, tile_t)
    return run_s, run_t


class FrozenHead:
    """J = d divergence / d h_s = sum_v g_v s'_v W_v (g = d divergence / d z_s, s' the student's slope dz/du),
    accumulated with the records so that the backward is dH = c J: no recompute sweep (a frozen student head:
    LoRA, a frozen lm_head). Per beta (the sums below against each record's running max, rescaled as it moves):
    * 0: A_X = sum_{v != a_X} e_X,v s'_v W_v for X = s and t (the argmax kept out, moved in, W row and slope
      gathered, when a later chunk's max wins), J = A_s / S_s - A_t / S_t plus the argmax columns:
      (q_t - q_s) s'_a W_a at a shared argmax (carried, never 1 - p), else s'_as W_as / S_s - s'_at W_at / S_t.
    * 1: B0 = sum_v e_s,v s'_v W_v, B1 = sum_v e_s,v (g_v - g_a) s'_v W_v (shifted by (g_a,old - g_a,new) B0 when
      the argmax moves), J = (B1 - (C_s / S_s) B0) / S_s.
    * JSD: in the second sweep, where every normaliser is known: J0 = sum_v p_s s'_v W_v, J1 = sum_v p_s (r_v - r_a)
      s'_v W_v, J = (1 - beta) (J1 - excess J0).
    Two student GEMMs (2 N V D_s each) per sweep that folds them, and J: N x D_s fp32."""

    def __init__(self, beta, n, weight, offset=0):
        self.beta, self.weight, self.offset = beta, weight, offset  # the weight's row v: vocabulary entry offset + v
        zeros = torch.zeros((n, weight.shape[1]), dtype=torch.float32, device=weight.device)
        self.first, self.second = zeros, zeros.clone()  # beta 0: A_s, A_t; beta 1: B0, B1; JSD: J0, J1
        self.slope_top = [torch.zeros(n, device=weight.device), torch.zeros(n, device=weight.device)]

    def rows(self, index):
        """W[index] [n, D] fp32 for global vocabulary indices (clamped into the weight: a caller masks the rows of
        indices it does not hold, e.g. an empty record's argmax 0)."""
        if self.weight.shape[0] == 0:
            return torch.zeros((index.shape[0], self.weight.shape[1]), dtype=torch.float32, device=index.device)
        return self.weight[(index - self.offset).clamp(0, self.weight.shape[0] - 1)].float()

    def fold(self, run_s, run_t, tile_s, tile_t, zs, zt, slope, v0, v1):
        """Fold one vocabulary chunk [v0, v1) (the student's tile and slope, the teacher's tile) before the records
        merge it (beta 0 and 1; the JSD accumulates in its second sweep)."""
        w = self.weight[v0:v1].float()
        if self.beta == 0.0:
            for k, (run, tile) in enumerate(((run_s, tile_s), (run_t, tile_t))):
                z = zs if k == 0 else zt
                wins = tile.max > run.max
                pivot = _pivot(torch.maximum(run.max, tile.max))
                rescale = torch.exp(run.max - pivot)
                e = torch.exp(z - pivot[:, None])
                rows = torch.nonzero(wins).squeeze(1)
                local = tile.argmax[rows] - self.offset - v0
                e[rows, local] = 0.0  # the merged argmax stays out of the sum
                slope_at = (
                    slope[torch.arange(z.shape[0], device=z.device), tile.argmax - self.offset - v0]
                    if torch.is_tensor(slope)
                    else torch.full_like(tile.max, slope)
                )
                # the running argmax's own term (1 x its slope) joins the rest where this chunk's max wins
                moved = torch.where(wins & (run.max > float("-inf")), rescale * self.slope_top[k], 0.0)
                acc = self.first if k == 0 else self.second
                acc.mul_(rescale[:, None]).add_(moved[:, None] * self.rows(run.argmax))
                torch.addmm(acc, e * slope, w, out=acc)
                self.slope_top[k] = torch.where(wins, slope_at, self.slope_top[k])
        elif self.beta == 1.0:
            wins = tile_s.max > run_s.max
            pivot = _pivot(torch.maximum(run_s.max, tile_s.max))
            rescale = torch.exp(run_s.max - pivot)
            reference = torch.where(wins, tile_s.max - tile_s.other, run_s.max - run_s.other)
            shift = (run_s.max - run_s.other) - reference
            self.second = _zero_where(
                (rescale == 0)[:, None], rescale[:, None] * (self.second + shift[:, None] * self.first)
            )
            self.first.mul_(rescale[:, None])
            e = torch.exp(zs - pivot[:, None])
            relative = _zero_where(e == 0, e * ((zs - zt) - reference[:, None]))
            torch.addmm(self.first, e * slope, w, out=self.first)
            torch.addmm(self.second, relative * slope, w, out=self.second)

    def fold_jsd(self, ps, relative, slope, v0, v1):
        """The JSD's second sweep: p_s and p_s (r_v - r_a) of one chunk (0 where p_s is 0 or at the argmax)."""
        w = self.weight[v0:v1].float()
        torch.addmm(self.first, ps * slope, w, out=self.first)
        torch.addmm(self.second, relative * slope, w, out=self.second)

    def finish(self, run_s, run_t, saved):
        """J [n, Ds] fp32 from the accumulators and the merged records (FrozenHead's docstring)."""
        if self.beta == 0.0:
            sumexp_s = (run_s.max > float("-inf")).float() + run_s.rest
            sumexp_t = (run_t.max > float("-inf")).float() + run_t.rest
            grad = self.first / sumexp_s[:, None] - self.second / sumexp_t[:, None]
            shared = run_s.argmax == run_t.argmax
            rest_s, rest_t = saved[2], saved[5]
            top_s = torch.where(shared, (rest_t - rest_s) * self.slope_top[0], self.slope_top[0] / sumexp_s)
            top_t = torch.where(shared, 0.0, self.slope_top[1] / sumexp_t)
            return grad + top_s[:, None] * self.rows(run_s.argmax) - top_t[:, None] * self.rows(run_t.argmax)
        excess = saved[7]
        grad = self.second - excess[:, None] * self.first
        if self.beta == 1.0:
            sumexp_s = (run_s.max > float("-inf")).float() + run_s.rest
            return grad / sumexp_s[:, None]
        return (1.0 - self.beta) * grad


def finish(run_s, run_t, beta, jsd_sweep):
    """The outputs from both models' merged records (module docstring): (divergence [n], entropy [n], saved
    [len(SAVED_FIELDS), n], argmax [2, n]). ``jsd_sweep(student, teacher, r_a)``: the JSD's second sweep, giving
    (JSD, sum_v p_s (r_v - r_a)) [n] (called for 0 < beta < 1 only)."""
    student, sumexp_s = _finished(run_s)
    teacher, sumexp_t = _finished(run_t)
    entropy = student.log_sumexp - run_s.zsum / sumexp_s
    if beta == 0.0:
        div = (run_t.cross / sumexp_t - teacher.log_sumexp) + (run_s.max - run_t.other) + student.log_sumexp
        div = torch.where(run_t.unsupported, float("inf"), div)
        reference = excess = torch.zeros_like(div)  # the backward reads only the records
    elif beta == 1.0:
        div = (run_s.cross / sumexp_s - student.log_sumexp) + (run_t.max - run_s.other) + teacher.log_sumexp
        div = torch.where(run_s.unsupported, float("inf"), div)
        reference, excess = run_s.max - run_s.other, run_s.cross / sumexp_s
    else:
        reference = _top_log_ratio(student, teacher, run_s.other, beta)
        div, excess = jsd_sweep(student, teacher, reference)
    return (
        div,
        entropy,
        torch.stack([*student[:3], *teacher[:3], reference, excess]),
        torch.stack([student.argmax, teacher.argmax]),
    )


def _top_log_ratio(student, teacher, teacher_at_student_top, beta):
    """r_a = log p_s - log m at the student's argmax a, from the first sweep's records (z_t,a = the student's
    record's ``other``)."""
    log_ps = -student.log_sumexp
    log_pt = (teacher_at_student_top - teacher.max) - teacher.log_sumexp
    log_m = torch.logaddexp(log_ps + math.log1p(-beta), log_pt + math.log(beta))
    shared = student.argmax == teacher.argmax
    log_m = torch.where(shared, torch.log1p(-((1.0 - beta) * student.rest_mass + beta * teacher.rest_mass)), log_m)
    return log_ps - log_m


def _jsd_sweep(
    hs,
    ht,
    student_weight,
    student_bias,
    teacher_weight,
    teacher_bias,
    beta,
    student_transform,
    teacher_transform,
    student,
    teacher,
    top_log_ratio,
    frozen=None,
    offset=0,
):
    """The generalized JSD's second sweep: (JSD, sum_v p_s (r_v - r_a)) [n] from both models' finished records and
    r_a (``_top_log_ratio``), summed over the weights' rows (entries offset + v); with ``frozen`` (a FrozenHead) it
    also folds J's two sums."""
    V = student_weight.shape[0]
    jsd = torch.zeros(hs.shape[0], dtype=torch.float32, device=hs.device)
    excess = torch.zeros_like(jsd)
    for v0 in range(0, V, CHUNK_V):
        v1 = min(v0 + CHUNK_V, V)
        zs, slope = logit_tile(hs, student_weight, student_bias, student_transform, v0, v1, slope=True)
        log_ps, top_s = _log_probs(zs, student, offset + v0)
        log_pt, top_t = _log_probs(
            logit_tile(ht, teacher_weight, teacher_bias, teacher_transform, v0, v1), teacher, offset + v0
        )
        log_m = _log_mixture(log_ps, log_pt, top_s & top_t, student, teacher, beta)
        ps, pt = log_ps.exp(), log_pt.exp()
        log_ratio = log_ps - log_m
        kl_s = _zero_where(ps == 0, ps * log_ratio)
        kl_t = _zero_where(pt == 0, pt * (log_pt - log_m))
        jsd += (beta * kl_t + (1.0 - beta) * kl_s).sum(1)
        relative = _zero_where((ps == 0) | top_s, ps * (log_ratio - top_log_ratio[:, None]))
        excess += relative.sum(1)
        if frozen is not None:
            frozen.fold_jsd(ps, relative, slope, v0, v1)
    return jsd, excess


def unpack(saved, argmax):
    """The backward's (student, teacher) Finished values, reference and excess from the forward's saved tensors."""
    student = Finished(saved[0], saved[1], saved[2], argmax[0])
    teacher = Finished(saved[3], saved[4], saved[5], argmax[1])
    return student, teacher, saved[6], saved[7]


def logit_grad(zs, zt, student, teacher, reference, excess, beta, v0):
    """d divergence / d z_s for one tile [n, c] whose first entry is vocabulary index ``v0`` (module docstring), from
    the forward's saved values."""
    log_ps, top_s = _log_probs(zs, student, v0)
    log_pt, top_t = _log_probs(zt, teacher, v0)
    ps = log_ps.exp()
    if beta == 0.0:
        grad = ps - log_pt.exp()
        # p_s - p_t at a shared argmax: q_t - q_s, both carried (1 - p there would cancel)
        return torch.where(top_s & top_t, (teacher.rest_mass - student.rest_mass)[:, None], grad)
    if beta == 1.0:
        # l_v - l_a = g_v - g_a, g = z_s - z_t
        relative = (zs - zt) - reference[:, None]
        scale = 1.0
    else:
        relative = (log_ps - _log_mixture(log_ps, log_pt, top_s & top_t, student, teacher, beta)) - reference[:, None]
        scale = 1.0 - beta
    relative = torch.where(top_s, 0.0, relative)
    return _zero_where(ps == 0, scale * ps * (relative - excess[:, None]))


def backward(grad_divergence, student_hidden, student_weight, student_bias, teacher_hidden, teacher_weight,
             teacher_bias, saved, argmax, beta, student_transform, teacher_transform, grad_hidden, grad_weight,
             grad_bias, offset=0):  # fmt: skip
    """Accumulate the student's gradients into the fp32 buffers grad_hidden [N, Ds], grad_weight [V, Ds],
    grad_bias [V] (zero on entry; each may be None), recomputing both models' tiles (the weights' row v is
    vocabulary entry offset + v: a vocab-parallel shard, with the whole vocabulary's saved values)."""
    N, V = student_hidden.shape[0], student_weight.shape[0]
    for n0 in range(0, N, CHUNK_N):
        n1 = min(n0 + CHUNK_N, N)
        c = grad_divergence[n0:n1].float()
        if not bool((c != 0).any()):
            continue  # rows without a gradient: exactly zero
        hs, ht = student_hidden[n0:n1], teacher_hidden[n0:n1]
        student, teacher, reference, excess = unpack(saved[:, n0:n1], argmax[:, n0:n1])
        for v0 in range(0, V, CHUNK_V):
            v1 = min(v0 + CHUNK_V, V)
            zs, slope = logit_tile(hs, student_weight, student_bias, student_transform, v0, v1, slope=True)
            zt = logit_tile(ht, teacher_weight, teacher_bias, teacher_transform, v0, v1)
            g = logit_grad(zs, zt, student, teacher, reference, excess, beta, offset + v0)
            g.mul_(c[:, None]).mul_(slope)
            add_tile_gradients(g, hs, student_weight, slice(n0, n1), slice(v0, v1), grad_hidden, grad_weight, grad_bias)
