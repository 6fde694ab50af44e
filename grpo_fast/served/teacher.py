"""A teacher served as top-k log-probs (``ServedTeacher``), its support under each divergence, and the sparse
divergence over that support given the student's log-probs there: TRL 1.16's ``trl.experimental`` semantics
(``AsyncDistillationTrainer``; ``ServerDistillationTrainer`` alike), the formulas written once here for both backends
(they act on [N, K + 1] values: no vocabulary in them).

Math. The support of a token: at beta = 0 (forward KL) the teacher's K entries (its top-k, plus the sampled token
where a server reports it outside them); at beta != 0 the teacher's top-1 and the sampled token y, counted once where
they coincide, and at beta = 1 (reverse KL) y alone: the only tokens whose teacher log-prob a top-k server guarantees.
Over the support S, student log-probs s_i = z_i - lse (z: the student's logits over the temperature) and the teacher's
t_i, each side either
* with a tail bucket: S plus one entry holding the rest of the mass, log(1 - sum_S exp(x)) (the sum's log clamped to
  at most -1e-7, TRL's: the bucket's log stays finite), or
* renormalised over S: x_i - log sum_S exp(x) (then the student's lse cancels: the support's logits alone).
Then the divergence sums over the entries e: beta = 0: p_t (log p_t - log p_s); beta = 1: p_s (log p_s - log p_t);
else the generalized JSD beta p_t (log p_t - log m) + (1 - beta) p_s (log p_s - log m), m = (1 - beta) p_s + beta p_t
(log m at least log of fp32's smallest normal). A token without any teacher entry has divergence 0 and no gradient
(TRL drops it from the sum, keeping it in the token count).

Gradient: dD/dz_v = sum_i g_i [v = id_i] - (sum_i g_i) p_v with g_i = dD/ds_i, the sparse part through the gathered
logits and the dense part through lse. Per entry, G_e = dD/d log p_s,e is -p_t (beta 0), p_s (log p_s - log p_t + 1)
(beta 1), (1 - beta) p_s (log p_s - log m) (between; + (1 - beta) p_s where m is clamped); then with the tail bucket
g_i = G_i - G_tail e^L / (1 - e^L) w_i (w = the support's softmax of s; no second term where L is clamped), and
renormalised g_i = G_i - q_i sum_j G_j (q the student's renormalised probabilities: sum_i g_i = 0, lse unused). The
per-token path takes these by autograd through ``divergence``; the fused loss (``served.ops``), inside a custom op
where autograd does not run, from ``divergence_and_gradients``: the same formulas written out.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

# TRL's clamp of the support's summed log-mass, so that the tail bucket log(1 - mass) stays finite
TAIL_LOG_MASS_MAX = -1e-7
# the smallest fp32 normal: the mixture's log is taken of at least this (TRL's clamp)
FP32_TINY = torch.finfo(torch.float32).tiny


class ServedTeacher(NamedTuple):
    """A teacher scored by an inference server: its top-k log-probs at each completion token.

    Attributes:
        ids: [B, T, K] integer token ids, -1 filling; ids[b, t] are the teacher's candidates for the token that
            hidden[b, t] predicts, rank-sorted (the teacher's top-1 first: read at beta != 0), each once. A server's
            ``prompt_logprobs=K`` entry gives the top K plus the sampled token where it ranks lower.
        logprobs: [B, T, K] float32, bfloat16 or float16: the teacher's log-probs at ``ids`` (the server's processed
            log-probs at the divergence's temperature); read only where ids >= 0.
        add_tail_bucket: append the mass outside the support as one more entry on both sides (TRL's
            ``add_tail_bucket``, default True); False: both distributions renormalised over the support.
        temperature: the temperature ``logprobs`` were taken at; None: the divergence's (TRL's assumption). vLLM
            0.32's prompt log-probs are at 1 whatever the request says (they skip its sampling processors): then
            1.0, and without a tail bucket the teacher at the divergence's temperature T over the support follows
            exactly (log-probs times 1 / T, renormalised); a tail bucket needs the whole vocabulary's normaliser at
            T, which a top-k list does not carry (an error).
    """

    ids: torch.Tensor
    logprobs: torch.Tensor
    add_tail_bucket: bool = True
    temperature: float | None = None


class Support(NamedTuple):
    """A divergence's support of each scored row, [N, K'] each: the ids (-1: none), the teacher's log-probs there
    (fp32; 0 where not valid) and which entries count."""

    ids: torch.Tensor
    teacher: torch.Tensor
    valid: torch.Tensor


def support(ids, logprobs, targets, beta) -> Support:
    """The support of rows ``ids`` / ``logprobs`` [N, K] (``ServedTeacher``'s, flattened to the scored rows) under
    ``beta`` (module docstring); ``targets`` [N] int64: the sampled tokens (read at beta != 0)."""
    listed = ids >= 0
    teacher = torch.where(listed, logprobs.float(), 0.0)
    if beta == 0.0:
        return Support(ids, teacher, listed)
    at_target = listed & (ids == targets[:, None])
    has_target = at_target.any(-1)
    target_lp = torch.where(at_target, teacher, -math.inf).amax(-1)
    target_lp = torch.where(has_target, target_lp, 0.0)
    target_ids = torch.where(has_target, targets, -1)
    if beta == 1.0:
        return Support(target_ids[:, None], target_lp[:, None], has_target[:, None])
    top = ids[:, 0]
    second = has_target & (targets != top)
    return Support(
        torch.stack([top, torch.where(second, targets, -1)], -1),
        torch.stack([teacher[:, 0], torch.where(second, target_lp, 0.0)], -1),
        torch.stack([listed[:, 0], second], -1),
    )


def _with_tail(x, valid, signal):
    """Rows of log-probs ``x`` [N, K] (read where ``valid``) with the tail bucket appended: [N, K + 1]. Rows
    without ``signal`` get finite placeholders (their values are dropped; no NaN reaches a gradient)."""
    x = torch.where(valid, x, -math.inf)
    x = torch.where(signal[:, None], x, 0.0)
    log_mass = torch.logsumexp(x, dim=-1, keepdim=True).clamp(max=TAIL_LOG_MASS_MAX)
    return torch.cat([x, torch.log(-torch.expm1(log_mass))], dim=-1)


def _renormalised(x, valid, signal):
    """Rows of values ``x`` [N, K] as log-probs over the ``valid`` entries (x - logsumexp over them)."""
    x = torch.where(valid, x, -math.inf)
    x = torch.where(signal[:, None], x, 0.0)
    return x - torch.logsumexp(x, dim=-1, keepdim=True)


def _masked(log_ps, log_pt, valid):
    """(log_ps, log_pt, p_s, p_t) [N, K'], each 0 where not ``valid`` (no -inf reaches a product)."""
    log_ps = torch.where(valid, log_ps, 0.0)
    log_pt = torch.where(valid, log_pt, 0.0)
    return log_ps, log_pt, torch.where(valid, log_ps.exp(), 0.0), torch.where(valid, log_pt.exp(), 0.0)


def _log_mixture(ps, pt, valid, beta):
    """(log m, m) of the JSD's mixture m = (1 - beta) p_s + beta p_t, log m at least log of fp32's smallest normal."""
    mixture = (1.0 - beta) * ps + beta * pt
    return torch.where(valid, torch.log(mixture.clamp(min=FP32_TINY)), 0.0), mixture


def _entry_terms(log_ps, log_pt, valid, beta):
    """Each entry's divergence term [N, K'] (module docstring), 0 where not ``valid``."""
    log_ps, log_pt, ps, pt = _masked(log_ps, log_pt, valid)
    if beta == 0.0:
        return pt * (log_pt - log_ps)
    if beta == 1.0:
        return ps * (log_ps - log_pt)
    log_m, _ = _log_mixture(ps, pt, valid, beta)
    return beta * pt * (log_pt - log_m) + (1.0 - beta) * ps * (log_ps - log_m)


def _side(x, rows: Support, signal, add_tail_bucket):
    """One side's log-probs over the support's entries [N, K'] (+1 with the tail bucket): ``x`` the side's log-probs
    (the tail bucket) or logits (renormalised)."""
    return _with_tail(x, rows.valid, signal) if add_tail_bucket else _renormalised(x, rows.valid, signal)


def _entries(rows: Support, signal, add_tail_bucket):
    """Which entries of a side count: the support's, and with the tail bucket the bucket wherever a row has one."""
    return torch.cat([rows.valid, signal[:, None]], dim=-1) if add_tail_bucket else rows.valid


def _sides(student_logits, lse, rows: Support, add_tail_bucket):
    """(log_ps, log_pt, valid, signal): both sides over the support (with the tail bucket, or renormalised)."""
    signal = rows.valid.any(-1)
    student = student_logits - lse[:, None] if add_tail_bucket else student_logits
    log_ps = _side(student, rows, signal, add_tail_bucket)
    log_pt = _side(rows.teacher, rows, signal, add_tail_bucket)
    return log_ps, log_pt, _entries(rows, signal, add_tail_bucket), signal


def divergence(student_logits, lse, rows: Support, beta, add_tail_bucket):
    """The per-token divergence [N] fp32 from the student's logits at the support's ids [N, K'] (fp32) and its
    log-sum-exp [N] (read only with the tail bucket; None otherwise), differentiable through both."""
    log_ps, log_pt, valid, signal = _sides(student_logits, lse, rows, add_tail_bucket)
    return torch.where(signal, _entry_terms(log_ps, log_pt, valid, beta).sum(-1), 0.0)


def teacher_entropy(rows: Support, add_tail_bucket):
    """The teacher's entropy over the support (with its tail bucket, or renormalised) [N] fp32: TRL's
    ``teacher_entropy`` metric; 0 for a token without any teacher entry."""
    signal = rows.valid.any(-1)
    valid = _entries(rows, signal, add_tail_bucket)
    log_pt = torch.where(valid, _side(rows.teacher, rows, signal, add_tail_bucket), 0.0)
    return torch.where(signal, -(log_pt.exp() * log_pt).masked_fill(~valid, 0.0).sum(-1), 0.0)


def _entry_gradient(log_ps, log_pt, valid, beta):
    """G = dD / d log p_s of each entry [N, K'] (module docstring), 0 where not ``valid``."""
    log_ps, log_pt, ps, pt = _masked(log_ps, log_pt, valid)
    if beta == 0.0:
        return -pt
    if beta == 1.0:
        return torch.where(valid, ps * (log_ps - log_pt + 1.0), 0.0)
    log_m, mixture = _log_mixture(ps, pt, valid, beta)
    clamped = mixture < FP32_TINY  # log m held at the clamp: no gradient through it
    return (1.0 - beta) * ps * (log_ps - log_m + torch.where(clamped, 1.0, 0.0))


def gradient_factors(student_logits, lse, rows: Support, beta, add_tail_bucket, pivot):
    """(divergence [N], G [N, K'], c [N]): the divergence and its gradient at the support's ids factored as

        dD/dz = G + c exp(z - pivot)   on the support's entries (0 elsewhere; module docstring),

    G the entry gradient dD/d log p_s (at beta 0, -p_t: the teacher's alone, so that the student's rows can be summed
    with it before the student's logits are known, ``served.ops``), c a row's multiple of the student's softmax
    weights over the support (the tail bucket's slope, or the renormalisation), ``pivot`` [N] the largest of a row's
    logits there (0 where it has none: c exp(z - pivot) never overflows). dD/dlse = -sum dD/dz with the tail bucket,
    0 renormalised."""
    signal = rows.valid.any(-1)
    log_ps, log_pt, valid, _ = _sides(student_logits, lse, rows, add_tail_bucket)
    div = torch.where(signal, _entry_terms(log_ps, log_pt, valid, beta).sum(-1), 0.0)
    G = _entry_gradient(log_ps, log_pt, valid, beta)
    if add_tail_bucket:
        s = torch.where(rows.valid, student_logits - lse[:, None], -math.inf)
        s = torch.where(signal[:, None], s, 0.0)
        log_mass = torch.logsumexp(s, dim=-1)
        held = log_mass > TAIL_LOG_MASS_MAX
        L = log_mass.clamp(max=TAIL_LOG_MASS_MAX)
        tail_slope = torch.where(held, 0.0, -torch.exp(L) / -torch.expm1(L))
        # the support's softmax exp(s - log_mass) = exp(z - pivot) exp(pivot - lse - log_mass), the last <= 1
        c = G[:, -1] * tail_slope * torch.exp(pivot - lse - log_mass)
        return div, G[:, :-1], torch.where(signal, c, 0.0)
    z = torch.where(rows.valid & signal[:, None], student_logits, -math.inf)
    # q = exp(z - logsumexp z) over the support = exp(z - pivot) exp(pivot - logsumexp z), the last <= 1
    c = -torch.exp(pivot - torch.logsumexp(z, dim=-1)) * G.sum(-1)
    return div, G, torch.where(signal, c, 0.0)


def support_pivot(student_logits, rows: Support):
    """[N] the largest of each row's logits at its support's entries, 0 where it has none."""
    top = torch.where(rows.valid, student_logits, -math.inf).amax(-1)
    return torch.where(top == -math.inf, 0.0, top)


def gradients_at_pivot(student_logits, lse, rows: Support, beta, add_tail_bucket, pivot):
    """(divergence [N], dD/dz [N, K'], dD/dlse [N], c [N]): ``gradient_factors``' G and c assembled, dD/dz = G +
    c exp(z - pivot) on the entries of rows with any (0 elsewhere), dD/dlse = -sum dD/dz with the tail bucket (zeros
    renormalised); c kept for a caller that sums the rows with G and the softmax weights apart (``served.ops``)."""
    div, G, c = gradient_factors(student_logits, lse, rows, beta, add_tail_bucket, pivot)
    live = rows.valid & rows.valid.any(-1, keepdim=True)
    grad_z = torch.where(live, G + c[:, None] * torch.exp(student_logits - pivot[:, None]), 0.0)
    return div, grad_z, -grad_z.sum(-1) if add_tail_bucket else torch.zeros_like(div), c


def teacher_entry_gradient(rows: Support, add_tail_bucket):
    """G at beta 0 over the support's entries [N, K'] before the student's logits are known: -p_t (the teacher's
    side with its tail bucket or renormalised), 0 where not an entry; ``gradient_factors``' G at beta 0."""
    signal = rows.valid.any(-1)
    log_pt = _side(rows.teacher, rows, signal, add_tail_bucket)[:, : rows.ids.shape[-1]]
    return -torch.where(rows.valid, log_pt.exp(), 0.0)


def divergence_and_gradients(student_logits, lse, rows: Support, beta, add_tail_bucket):
    """``divergence`` [N] and its gradients, dD/dz at the support's ids [N, K'] and dD/dlse [N] (zeros without the
    tail bucket), written out (``gradients_at_pivot``)."""
    pivot = support_pivot(student_logits, rows)
    return gradients_at_pivot(student_logits, lse, rows, beta, add_tail_bucket, pivot)[:3]
