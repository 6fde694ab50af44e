"""The torch twin of the divergence head: the Triton kernels' algorithm in chunked PyTorch (any device), fp32
accumulation, never an [N, V] tensor.

The forward folds both models' logit chunks [CHUNK_N, CHUNK_V] into the records of
grpo_fast.kernels.divergence_records (which has their algebra) and finishes them there; for a divergence with a
mixture (the generalized JSD) a second sweep sums it. The backward recomputes both models' chunks and forms the
logit gradient of grpo_fast.kernels.divergence_tile's formulas (``logit_grad``), then dH = g W_s, dW_s = g^T H_s,
db_s = sum_n g. A vocab-parallel shard's records (``shard_records``) and the combined GRPO + distillation head
(``combined_forward``, ``combined_backward``: layer 1's record and gradient from the same student tiles) are here
too. With a frozen student head
(only the hidden states need a gradient) the forward also folds J = d divergence / d h_s (``FrozenHead``), so that
the backward is dH = c J with no vocabulary sweep: one sweep of the teacher fewer than a recomputing backward.
"""

from __future__ import annotations

import math

import torch

from grpo_fast.backends import head_twin
from grpo_fast.backends.head_twin import CHUNK_N, CHUNK_V, add_tile_gradients
from grpo_fast.kernels import softmax_stats
from grpo_fast.kernels.divergence_records import (
    FORWARD_KL,
    JSD,
    REVERSE_KL,
    SAVED_FIELDS,
    Finished,
    Record,
    TeacherSegments,
    divergence_of,
    empty_record,
    finish,
    merge,
    model_entropy,
    pivot,
    sumexp,
    tile_record,
    unpack_saved,
    zero_where,
)
from grpo_fast.kernels.softmax_stats import BackwardStats


def logit_tile(model, v0, v1, slope=False):
    """transform(h W[v0:v1]^T + b[v0:v1]) for the model's tokens, [n, v1 - v0] fp32.

    Args:
        model: the model's ModelHead (its tokens' rows).
        v0: the first weight row.
        v1: the row after the last.
        slope: also return dz/du (a tensor of the tile's shape, or a number without a soft-cap).

    Returns:
        z, or (z, dz/du) with ``slope``.
    """
    u = model.hidden.float() @ model.weight[v0:v1].float().T
    if model.bias is not None:
        u += model.bias[v0:v1].float()
    return model.transform.apply(u, slope=slope)


def forward(student, teacher, beta, frozen_head=False):
    """The divergence head's forward, token chunk by token chunk.

    Args:
        student: the student's ModelHead over N >= 0 tokens.
        teacher: the teacher's ModelHead, over the same tokens and vocabulary.
        beta: in [0, 1]: 0 the forward KL, 1 the reverse KL, between the generalized JSD.
        frozen_head: also build J = d divergence / d student.hidden in the last sweep (``FrozenHead``).

    Returns:
        (divergence [N] fp32, the student's entropy [N] fp32, saved [len(SAVED_FIELDS), N] fp32, argmax [2, N]
        int64, J [N, Ds] fp32 with ``frozen_head``, else None).
    """
    return _forward(student, teacher, beta, frozen_head)[0]


def _forward(student, teacher, beta, frozen_head):
    """``forward``'s outputs and the teacher's entropy [N] fp32 (its records' ``model_entropy``)."""
    N = student.hidden.shape[0]
    dev = student.hidden.device
    outputs, teacher_entropy = [], []
    for n0 in range(0, N, CHUNK_N):
        n1 = min(n0 + CHUNK_N, N)
        chunk_s, chunk_t = student.tokens(n0, n1), teacher.tokens(n0, n1)
        frozen = FrozenHead(beta, n1 - n0, student.weight) if frozen_head else None
        run_s, run_t = records(chunk_s, chunk_t, frozen=frozen)

        def chunk_jsd(
            student_finished, teacher_finished, top_log_ratio, chunk_s=chunk_s, chunk_t=chunk_t, frozen=frozen
        ):
            return jsd_sweep(chunk_s, chunk_t, beta, student_finished, teacher_finished, top_log_ratio, frozen=frozen)

        out = finish(run_s, run_t, beta, chunk_jsd)
        outputs.append(out + ((frozen.finish(run_s, run_t, out[2]),) if frozen is not None else ()))
        teacher_entropy.append(model_entropy(run_t))
    if not outputs:
        empty = torch.zeros(0, device=dev)
        return (
            empty,
            empty.clone(),
            torch.zeros((len(SAVED_FIELDS), 0), device=dev),
            torch.zeros((2, 0), dtype=torch.int64, device=dev),
            torch.zeros((0, student.hidden.shape[1]), device=dev) if frozen_head else None,
        ), empty.clone()
    merged = tuple(torch.cat(parts, dim=-1) for parts in zip(*(out[:4] for out in outputs), strict=True))
    return merged + (torch.cat([out[4] for out in outputs]) if frozen_head else None,), torch.cat(teacher_entropy)


def records(student, teacher, offset=0, frozen=None):
    """Both models' records over the rows of their weights, vocabulary chunk by chunk.

    Args:
        student: the student's ModelHead over n tokens.
        teacher: the teacher's ModelHead, over the same tokens and weight rows.
        offset: the weights' row v is vocabulary entry offset + v (a vocab-parallel shard).
        frozen: a FrozenHead whose sums are folded chunk by chunk, or None.

    Returns:
        (the student's Record, the teacher's), [n] each, argmax global.
    """
    run_s = run_t = empty_record(student.hidden.shape[0], student.hidden.device)
    for v0 in range(0, student.weight.shape[0], CHUNK_V):
        v1 = min(v0 + CHUNK_V, student.weight.shape[0])
        # the student's slope dz/du only where the frozen head's sums need it
        zs, slope = (
            logit_tile(student, v0, v1, slope=True) if frozen is not None else (logit_tile(student, v0, v1), 1.0)
        )
        zt = logit_tile(teacher, v0, v1)
        tile_s, tile_t = tile_record(zs, zt, offset + v0), tile_record(zt, zs, offset + v0)
        if frozen is not None:
            frozen.fold(run_s, run_t, tile_s, tile_t, zs, zt, slope, v0, v1)
        run_s, run_t = merge(run_s, tile_s), merge(run_t, tile_t)
    return run_s, run_t


class FrozenHead:
    """The frozen student head's J = d divergence / d h_s, folded with the records so that the backward is dH = c J.

    J = sum_v g_v s'_v W_v, g = d divergence / d z_s, s' the student's slope dz/du. Per beta, the sums are taken
    against each record's running max and rescaled as it moves:
    * 0: A_X = sum_{v != a_X} e_X,v s'_v W_v for X = s and t (the argmax kept out; moved in, W row and slope
      gathered, when a later chunk's max wins), J = A_s / S_s - A_t / S_t plus the argmax columns:
      (q_t - q_s) s'_a W_a at a shared argmax (carried, never 1 - p), else s'_as W_as / S_s - s'_at W_at / S_t.
    * 1: B0 = sum_v e_s,v s'_v W_v, B1 = sum_v e_s,v (g_v - g_a) s'_v W_v (shifted by (g_a,old - g_a,new) B0 when
      the argmax moves), J = (B1 - (C_s / S_s) B0) / S_s.
    * JSD: in the second sweep, where every normaliser is known: J0 = sum_v p_s s'_v W_v, J1 = sum_v p_s (r_v - r_a)
      s'_v W_v, J = (1 - beta) (J1 - excess J0).
    Two student GEMMs (2 N V Ds each) per sweep that folds them; J is N x Ds fp32.

    Args:
        beta: the divergence's beta.
        n: the tokens of the chunk.
        weight: [V, Ds] the student's weight rows.
        offset: the weight's row v is vocabulary entry offset + v (a vocab-parallel shard).
    """

    def __init__(self, beta, n, weight, offset=0):
        self.beta, self.weight, self.offset = beta, weight, offset  # the weight's row v: vocabulary entry offset + v
        self.divergence = divergence_of(beta)
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
        if self.divergence == FORWARD_KL:
            for k, (run, tile) in enumerate(((run_s, tile_s), (run_t, tile_t))):
                z = zs if k == 0 else zt
                wins = tile.max > run.max
                merged_pivot = pivot(torch.maximum(run.max, tile.max))
                rescale = torch.exp(run.max - merged_pivot)
                e = torch.exp(z - merged_pivot[:, None])
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
        elif self.divergence == REVERSE_KL:
            wins = tile_s.max > run_s.max
            merged_pivot = pivot(torch.maximum(run_s.max, tile_s.max))
            rescale = torch.exp(run_s.max - merged_pivot)
            reference = torch.where(wins, tile_s.max - tile_s.other, run_s.max - run_s.other)
            shift = (run_s.max - run_s.other) - reference
            self.second = zero_where(
                (rescale == 0)[:, None], rescale[:, None] * (self.second + shift[:, None] * self.first)
            )
            self.first.mul_(rescale[:, None])
            e = torch.exp(zs - merged_pivot[:, None])
            relative = zero_where(e == 0, e * ((zs - zt) - reference[:, None]))
            torch.addmm(self.first, e * slope, w, out=self.first)
            torch.addmm(self.second, relative * slope, w, out=self.second)

    def fold_jsd(self, ps, relative, slope, v0, v1):
        """The JSD's second sweep: p_s and p_s (r_v - r_a) of one chunk (0 where p_s is 0 or at the argmax)."""
        w = self.weight[v0:v1].float()
        torch.addmm(self.first, ps * slope, w, out=self.first)
        torch.addmm(self.second, relative * slope, w, out=self.second)

    def finish(self, run_s, run_t, saved):
        """J [n, Ds] fp32 from the accumulators and the merged records (FrozenHead's docstring)."""
        if self.divergence == FORWARD_KL:
            sumexp_s, sumexp_t = sumexp(run_s), sumexp(run_t)
            grad = self.first / sumexp_s[:, None] - self.second / sumexp_t[:, None]
            shared = run_s.argmax == run_t.argmax
            rest_s, rest_t = saved[2], saved[5]
            top_s = torch.where(shared, (rest_t - rest_s) * self.slope_top[0], self.slope_top[0] / sumexp_s)
            top_t = torch.where(shared, 0.0, self.slope_top[1] / sumexp_t)
            return grad + top_s[:, None] * self.rows(run_s.argmax) - top_t[:, None] * self.rows(run_t.argmax)
        excess = saved[7]
        grad = self.second - excess[:, None] * self.first
        if self.divergence == REVERSE_KL:
            return grad / sumexp(run_s)[:, None]
        return (1.0 - self.beta) * grad


def jsd_sweep(student, teacher, beta, student_finished, teacher_finished, top_log_ratio, frozen=None, offset=0):
    """The generalized JSD's second sweep over the rows of the weights.

    Args:
        student: the student's ModelHead over n tokens.
        teacher: the teacher's ModelHead, over the same tokens and weight rows.
        beta: in (0, 1).
        student_finished: the student's finished record over the whole vocabulary, [n].
        teacher_finished: the teacher's, [n].
        top_log_ratio: [n] fp32 r_a = log p_s - log m at the student's argmax.
        frozen: a FrozenHead that also folds J's two sums, or None.
        offset: the weights' row v is vocabulary entry offset + v (a vocab-parallel shard).

    Returns:
        (JSD, sum_v p_s (r_v - r_a)) [n] fp32, summed over these rows.
    """
    V = student.weight.shape[0]
    jsd = torch.zeros(student.hidden.shape[0], dtype=torch.float32, device=student.hidden.device)
    excess = torch.zeros_like(jsd)
    for v0 in range(0, V, CHUNK_V):
        v1 = min(v0 + CHUNK_V, V)
        zs, slope = logit_tile(student, v0, v1, slope=True)
        log_ps, top_s = _log_probs(zs, student_finished, offset + v0)
        log_pt, top_t = _log_probs(logit_tile(teacher, v0, v1), teacher_finished, offset + v0)
        log_m = _log_mixture(log_ps, log_pt, top_s & top_t, student_finished, teacher_finished, beta)
        ps, pt = log_ps.exp(), log_pt.exp()
        log_ratio = log_ps - log_m
        kl_s = zero_where(ps == 0, ps * log_ratio)
        kl_t = zero_where(pt == 0, pt * (log_pt - log_m))
        jsd += (beta * kl_t + (1.0 - beta) * kl_s).sum(1)
        relative = zero_where((ps == 0) | top_s, ps * (log_ratio - top_log_ratio[:, None]))
        excess += relative.sum(1)
        if frozen is not None:
            frozen.fold_jsd(ps, relative, slope, v0, v1)
    return jsd, excess


def logit_grad(zs, zt, student, teacher, reference, excess, beta, v0):
    """d divergence / d z_s of one tile (grpo_fast.kernels.divergence_tile.logit_gradient's formulas), from the
    forward's saved values.

    Args:
        zs: [n, c] fp32 the student's transformed logits.
        zt: [n, c] fp32 the teacher's.
        student: the student's finished values (unpack_saved), [n].
        teacher: the teacher's.
        reference: [n] fp32, the saved reference (beta 1: g_a; JSD: r_a).
        excess: [n] fp32, the saved excess (beta 1: C_s / S_s; JSD: sum_v p_s (r_v - r_a)).
        beta: the forward's beta.
        v0: the global vocabulary index of the tile's first column.

    Returns:
        [n, c] fp32.
    """
    log_ps, top_s = _log_probs(zs, student, v0)
    log_pt, top_t = _log_probs(zt, teacher, v0)
    ps = log_ps.exp()
    divergence = divergence_of(beta)
    if divergence == FORWARD_KL:
        grad = ps - log_pt.exp()
        # p_s - p_t at a shared argmax: q_t - q_s, both carried (1 - p there would cancel)
        return torch.where(top_s & top_t, (teacher.rest_mass - student.rest_mass)[:, None], grad)
    if divergence == REVERSE_KL:
        # l_v - l_a = g_v - g_a, g = z_s - z_t
        relative = (zs - zt) - reference[:, None]
        scale = 1.0
    elif divergence == JSD:
        relative = (log_ps - _log_mixture(log_ps, log_pt, top_s & top_t, student, teacher, beta)) - reference[:, None]
        scale = 1.0 - beta
    else:
        raise ValueError(f"the torch twin has no gradient formula for the divergence {divergence.name!r}")
    relative = torch.where(top_s, 0.0, relative)
    return zero_where(ps == 0, scale * ps * (relative - excess[:, None]))


def backward(grad_divergence, student, teacher, saved, argmax, beta, grads, offset=0):
    """Accumulate the student's gradients, recomputing both models' tiles chunk by chunk.

    Args:
        grad_divergence: [N] fp32 dL/d divergence.
        student: the student's ModelHead over N tokens.
        teacher: the teacher's ModelHead, over the same tokens and weight rows.
        saved: [len(SAVED_FIELDS), N] fp32, the forward's saved values over the whole vocabulary.
        argmax: [2, N] int64, the forward's global argmax indices.
        beta: the forward's beta.
        grads: the fp32 buffers (grad_hidden [N, Ds], grad_weight [V, Ds], grad_bias [V]), zero on entry, each
            None where not wanted.
        offset: the weights' row v is vocabulary entry offset + v (a vocab-parallel shard).
    """
    N, V = student.hidden.shape[0], student.weight.shape[0]
    for n0 in range(0, N, CHUNK_N):
        n1 = min(n0 + CHUNK_N, N)
        c = grad_divergence[n0:n1].float()
        if not bool((c != 0).any()):
            continue  # rows without a gradient: exactly zero
        chunk_s, chunk_t = student.tokens(n0, n1), teacher.tokens(n0, n1)
        student_finished, teacher_finished, reference, excess = unpack_saved(saved[:, n0:n1], argmax[:, n0:n1])
        for v0 in range(0, V, CHUNK_V):
            v1 = min(v0 + CHUNK_V, V)
            zs, slope = logit_tile(chunk_s, v0, v1, slope=True)
            zt = logit_tile(chunk_t, v0, v1)
            g = logit_grad(zs, zt, student_finished, teacher_finished, reference, excess, beta, offset + v0)
            g.mul_(c[:, None]).mul_(slope)
            add_tile_gradients(g, chunk_s.hidden, student.weight, slice(n0, n1), slice(v0, v1), *grads)


def _log_probs(z, model, v0):
    """log p = (z - m) - log S of a tile, and whether each entry is the model's argmax (``model``: its Finished
    values; ``v0``: the tile's first global vocabulary index)."""
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


def loss(student, teacher, beta, weights, grads):
    """The loss sum_n weights_n div_n's gradients into ``grads`` (as ``backward``'s) by ``forward`` then ``backward``
    with ``weights`` as dL/d div: (divergence [N], the student's entropy [N], the teacher's [N]). ``teacher``: a
    ModelHead, or TeacherSegments (several teachers, each over a range of the tokens: a teacher at a time, dW and db
    accumulated in the same buffers)."""
    if isinstance(teacher, TeacherSegments):
        grad_hidden, grad_weight, grad_bias = grads
        parts = [
            loss(
                student.tokens(a, b),
                head.tokens(first, first + b - a),
                beta,
                weights[a:b],
                (grad_hidden[a:b] if grad_hidden is not None else None, grad_weight, grad_bias),
            )
            for a, b, head, first in teacher.overlapping(0, student.hidden.shape[0])
        ]
        empty = student.hidden.new_zeros(0, dtype=torch.float32)
        return tuple(torch.cat([part[k] for part in parts]) if parts else empty for k in range(3))
    (div, entropy, saved, argmax, _), teacher_entropy = _forward(student, teacher, beta, False)
    if student.hidden.shape[0] > 0 and any(grad is not None for grad in grads):
        backward(weights, student, teacher, saved, argmax, beta, grads)
    return div, entropy, teacher_entropy


# ----------------------------------------------------------------------------------------------- a shard's records
def shard_records(student, teacher, beta, offset, frozen_head=False):
    """Both models' records over a vocab-parallel shard's weight rows (vocabulary entries offset + v), by token
    chunks, and their JSD sweep; with ``frozen_head`` the chunks' FrozenHead accumulators too.

    Returns:
        (local, local_jsd, frozen): this rank's (student, teacher) Records [N]; its JSD sweep, (finished student,
        finished teacher, r_a) -> (JSD, sum_v p_s (r_v - r_a)) [N] over its rows; the chunks' FrozenHead
        accumulators (Nones without ``frozen_head``).
    """
    N, dev = student.hidden.shape[0], student.hidden.device
    starts = range(0, N, CHUNK_N)
    frozen = [FrozenHead(beta, min(CHUNK_N, N - n0), student.weight, offset) if frozen_head else None for n0 in starts]
    chunks = [
        records(student.tokens(n0, n0 + CHUNK_N), teacher.tokens(n0, n0 + CHUNK_N), offset=offset, frozen=acc)
        for n0, acc in zip(starts, frozen, strict=True)
    ]
    local = tuple(_cat_records([c[k] for c in chunks], N, dev) for k in (0, 1))

    def local_jsd(student_finished, teacher_finished, top_log_ratio):
        parts = [
            jsd_sweep(
                student.tokens(n0, n0 + CHUNK_N),
                teacher.tokens(n0, n0 + CHUNK_N),
                beta,
                Finished(*(x[n0 : n0 + CHUNK_N] for x in student_finished)),
                Finished(*(x[n0 : n0 + CHUNK_N] for x in teacher_finished)),
                top_log_ratio[n0 : n0 + CHUNK_N],
                frozen=acc,
                offset=offset,
            )
            for n0, acc in zip(starts, frozen, strict=True)
        ]
        return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])

    return local, local_jsd, frozen


def _cat_records(parts, n, device):
    if not parts:
        return empty_record(n, device)
    return Record(*(torch.cat(fields) for fields in zip(*parts, strict=True)))


# ----------------------------------------------------------------------------------------------- the combined head
def combined_forward(student, targets, teacher, beta):
    """The combined GRPO + distillation head's forward (grpo_fast.distillation.teacher), token chunk by token chunk:
    each student tile once, for layer 1's record and the divergence's.

    Args:
        student: the student's ModelHead over N >= 0 scored tokens.
        targets: [N] int64 target ids.
        teacher: the teacher's ModelHead, over the same tokens and vocabulary.
        beta: the divergence's beta, in [0, 1].

    Returns:
        (logp, entropy, divergence [N] fp32, layer1 [4, N] fp32 (softmax_stats.BackwardStats' rows), saved
        [len(SAVED_FIELDS), N] fp32, argmax [2, N] int64): the last three for ``combined_backward``.
    """
    N = student.hidden.shape[0]
    dev = student.hidden.device
    outputs = []
    for n0 in range(0, N, CHUNK_N):
        n1 = min(n0 + CHUNK_N, N)
        chunk_s, chunk_t, tgt = student.tokens(n0, n1), teacher.tokens(n0, n1), targets[n0:n1]
        nothing = torch.zeros(n1 - n0, device=dev)
        run = softmax_stats.SoftmaxStats(
            torch.full((n1 - n0,), float("-inf"), device=dev), nothing, nothing, nothing, nothing
        )
        run_s = run_t = empty_record(n1 - n0, dev)
        for v0 in range(0, student.weight.shape[0], CHUNK_V):
            v1 = min(v0 + CHUNK_V, student.weight.shape[0])
            zs = logit_tile(chunk_s, v0, v1)  # the student's tile, once for both records
            zt = logit_tile(chunk_t, v0, v1)
            run = softmax_stats.merge(softmax_stats.stack(run, softmax_stats.record(zs, tgt - v0)[0]))
            run_s, run_t = merge(run_s, tile_record(zs, zt, v0)), merge(run_t, tile_record(zt, zs, v0))
        logp, entropy, layer1 = softmax_stats.finish(run, True)

        def chunk_jsd(student_finished, teacher_finished, top_log_ratio, chunk_s=chunk_s, chunk_t=chunk_t):
            return jsd_sweep(chunk_s, chunk_t, beta, student_finished, teacher_finished, top_log_ratio)

        div, _, saved, argmax = finish(run_s, run_t, beta, chunk_jsd)
        outputs.append((logp, entropy, div, torch.stack(tuple(layer1)), saved, argmax))
    if not outputs:
        empty = torch.zeros(0, device=dev)
        return (
            empty,
            empty,
            empty,
            torch.zeros((len(BackwardStats._fields), 0), device=dev),
            torch.zeros((len(SAVED_FIELDS), 0), device=dev),
            torch.zeros((2, 0), dtype=torch.int64, device=dev),
        )
    return tuple(torch.cat(parts, dim=-1) for parts in zip(*outputs, strict=True))


def combined_backward(grads, student, targets, teacher, layer1, saved, argmax, beta, student_grads):
    """The combined head's backward: the student's gradients, recomputing each student tile once (with the teacher's
    where the divergence has a gradient) and forming
        dL/dz_s = grad_logp (onehot(y) - p_s) + grad_entropy dH/dz_s + grad_div d div / dz_s
    (layer 1's target column from the carried 1 - p_y and mean - z_y), times the transform's slope.

    Args:
        grads: (dL/dlogp, dL/dentropy, dL/d divergence), [N] fp32 each.
        student: the student's ModelHead over N tokens.
        targets: [N] int64 target ids.
        teacher: the teacher's ModelHead, over the same tokens and vocabulary.
        layer1: [len(BackwardStats._fields), N] fp32, the forward's layer-1 values.
        saved: [len(SAVED_FIELDS), N] fp32, the forward's divergence values.
        argmax: [2, N] int64, the forward's argmax indices.
        beta: the divergence's beta.
        student_grads: the fp32 buffers (grad_hidden [N, Ds], grad_weight [V, Ds], grad_bias [V]), zero on entry,
            each None where not wanted.
    """
    grad_logp, grad_entropy, grad_divergence = grads
    N, V = student.hidden.shape[0], student.weight.shape[0]
    stats = softmax_stats.BackwardStats(*layer1)
    for n0 in range(0, N, CHUNK_N):
        n1 = min(n0 + CHUNK_N, N)
        c, e, d = grad_logp[n0:n1], grad_entropy[n0:n1], grad_divergence[n0:n1]
        with_div = bool((d != 0).any())
        if not (with_div or bool((c != 0).any()) or bool((e != 0).any())):
            continue  # rows without a gradient (masked): exactly zero
        chunk_s, chunk_t, tgt = student.tokens(n0, n1), teacher.tokens(n0, n1), targets[n0:n1]
        lse = stats.lse[n0:n1]
        target_dz = c * stats.nontarget_mass[n0:n1]
        student_finished, teacher_finished, reference, excess = unpack_saved(saved[:, n0:n1], argmax[:, n0:n1])
        for v0 in range(0, V, CHUNK_V):
            v1 = min(v0 + CHUNK_V, V)
            zs, slope = logit_tile(chunk_s, v0, v1, slope=True)
            g = head_twin.logit_grad(
                zs, tgt - v0, c, e, lse, target_dz, stats.mean_logit[n0:n1], stats.mean_minus_target[n0:n1]
            )
            if with_div:
                zt = logit_tile(chunk_t, v0, v1)
                div_grad = logit_grad(zs, zt, student_finished, teacher_finished, reference, excess, beta, v0)
                g += d[:, None] * div_grad
            g.mul_(slope)
            add_tile_gradients(g, chunk_s.hidden, student.weight, slice(n0, n1), slice(v0, v1), *student_grads)
