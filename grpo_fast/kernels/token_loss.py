"""Layer 2, the token kernel: the per-token GRPO math (TRL 1.16): loss, metrics, dL/dlogp_t and the entropy bonus's
token mask, one program per sequence.

For sequence b (r: importance ratio, A: advantage, m: mask, w: importance weights, s: normaliser):
    token level     r_t = exp(logp_t - old_t)                 dr_t/dlogp_t = r_t
    sequence level  r_b = exp(sum_t m_t (logp_t - old_t) / L_b),  L_b = max(sum_t m_t, 1)
                                                              dr_b/dlogp_t = r_b m_t / L_b
    clipped family  pg = -min(a1, a2),  a1 = min(r, delta) A,  a2 = clamp(r, 1 - eps, 1 + eps_high) A
                    dpg/dr = -(da1 if a1 < a2, da2 if a2 < a1, (da1 + da2) / 2 on a tie: torch.min's rule)
                    with da1 = A [r <= delta], da2 = A [1 - eps <= r <= 1 + eps_high] (clamp's inclusive rule)
    cispo           pg = -stopgrad(min(r, eps_high)) A logp_t         dpg/dlogp_t = -min(r, eps_high) A
    sapo            pg = -sigmoid(tau (r - 1)) 4 / tau A               dpg/dr = -4 sig (1 - sig) A
    vespo           pg = -stopgrad(phi) A logp_t                       dpg/dlogp_t = -phi A
                    phi = exp(lam + k log W - lam W), log W = clamp(sum_t m_t clamp(logp_t - old_t, -20, 20)
                          + sum_t clamp(log w_t, log 1e-8, 20), log 1e-8, 20), (k, lam) by the sign of A
                          (the weights' sum runs over padding too, as TRL's)
    masks           keep_t = [A_t >= 0 or sum_t m_t nan_to_0(sampler_t - logp_t) / L_b <= off_policy_threshold]
                    e_t = m_t [entropy_t >= entropy_threshold]          (top-entropy tokens)
    kl              k_t = (exp(ref_t - logp_t) - (ref_t - logp_t) - 1) * (r if BIAS_CORRECTION_KL else 1)
                    dk/dlogp_t = (1 - exp(ref_t - logp_t)) * r  +  (k_t / r) dr/dlogp  (the ratio's gradient flows)
    loss            L = sum_b sum_t s_bt (keep_t e_t w_t pg_t + beta k_t), s_bt = m_t * scale / (L_b if ROW_MEAN else 1)
                    (w_t is 1 when the family's importance_weights_in_term: vespo's weights enter phi instead)
    The loss type's record (grpo_fast.grpo_loss.options.LossType), read by the launcher from the ``options`` its caller passes
    (kernels/ imports nothing above it), gives the family's formula (LOSS_KIND), what dpg is taken against
    (GRAD_WRT_LOGP) and how it uses the importance weights (IW_IN_TERM).

Outputs: ``grad_logp`` [B, T] fp32 (dL/dlogp, already normalised), ``bonus_mask`` [B, T] fp32 (with ENTROPY_BONUS:
the tokens the entropy bonus averages over, m_t or m_t e_t; the caller scales it by -entropy_coef / their count to get
dL/dentropy, ``grad_entropy``) and the per-row statistics (grpo_fast.kernels.loss_statistics names them and their slots,
returned by name): the row's share of the policy loss, its mask sum, masked sums of kl, entropy, ratio,
the clip indicators and phi (for sequence-level clip metrics with per-sequence advantages, and vespo's per-sequence
phi, the row's own value: TRL averages those over sequences), and the bonus tokens' count and entropy sum. Masked
tokens contribute exactly zero, whatever their values (no 0 * inf = NaN).

NaN: a NaN at a scored token (or one formed there from an inf) reaches the loss, as in torch: every min / max / clamp
of a value derived from the inputs propagates NaN (``_minimum``, ``_maximum``); tl.minimum's default, like PTX's
min.f32, returns the other operand and would give a finite loss over NaN log-probs.

The kernel is a short sequence of device functions, one concern each: ``_row_sums`` (pass 1: token count and the
row's log-ratio sums), ``_importance_ratio``, ``_policy_weight`` (importance weights and the off-policy / entropy
masks), ``_policy_term`` (the loss type's per-token term and its derivative), ``_kl_term``, ``_clip_indicators``
(metrics); the statistics slots and loss kinds are named ``tl.constexpr`` constants below, shared with the launcher.

Memory: the [B, T] fp32 coefficients (and bonus mask) and B x NUM_STATS fp32; everything else stays in registers.
"""

import math

import torch
import triton
import triton.language as tl

from grpo_fast.kernels.launch import on_first_argument_device
from grpo_fast.kernels.loss_statistics import SLOTS, returned_statistics

# Loss kinds: the families of per-token term (``_policy_term``), by the loss type record's ``policy_term.formula``
# (grpo_fast.grpo_loss.options.LOSS_TYPE_RECORDS); the launcher raises on any other.
LOSS_CLIPPED = tl.constexpr(0)
LOSS_CISPO = tl.constexpr(1)
LOSS_SAPO = tl.constexpr(2)
LOSS_VESPO = tl.constexpr(3)
LOSS_KINDS = {"clipped": LOSS_CLIPPED, "cispo": LOSS_CISPO, "sapo": LOSS_SAPO, "vespo": LOSS_VESPO}

# Statistics slots: row_stats[b, slot], as grpo_fast.kernels.loss_statistics names them, in its order (tests/test_loss_types.py
# checks each name against its slot)
(
    STAT_LOSS,
    STAT_COUNT,
    STAT_KL,
    STAT_ENTROPY,
    STAT_RATIO,
    STAT_LOW,
    STAT_HIGH,
    STAT_REGION,
    STAT_CISPO,
    STAT_PHI,
    STAT_BONUS_COUNT,
    STAT_BONUS_ENTROPY,
) = (tl.constexpr(slot) for slot in SLOTS.values())
NUM_STATS = tl.constexpr(len(SLOTS))

# Two warps per sequence: the work is a few [T] vectors, and with 4 warps ptxas gives the vespo variant with every
# option a stack slot on sm_90 (tools/sm_compile.py); with 2 every variant compiles clean on sm_90 / 89 / 80.
NUM_WARPS = 2
LOG_RATIO_FLOOR = tl.constexpr(math.log(1e-8))  # VESPO's clamp of log W (TRL's)
LOG_RATIO_CAP = tl.constexpr(20.0)  # TRL's clamp of each log-ratio and of log W


@triton.jit
def _minimum(x, y):
    """torch.minimum's rule: NaN if either operand is NaN."""
    return tl.minimum(x, y, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _maximum(x, y):
    """torch.maximum's rule: NaN if either operand is NaN."""
    return tl.maximum(x, y, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _row_sums(logp_ptr, old_ptr, sampler_ptr, mask_ptr, iw_ptr, row, T,
              SEQUENCE: tl.constexpr, HAS_OLD: tl.constexpr, IS_VESPO: tl.constexpr, TERM_IW: tl.constexpr,
              IW_PER_TOKEN: tl.constexpr, OFF_POLICY_MASK: tl.constexpr, BLOCK_T: tl.constexpr):  # fmt: skip
    """Pass 1 over a row: its token count, the sum of log-ratios (GSPO), VESPO's log W (unclamped) and the summed
    KL(sampler || policy) for the off-policy mask. TERM_IW: importance weights that enter the term (log W)."""
    count = 0.0
    log_ratio_sum = 0.0
    vespo_log_w = 0.0
    sampler_kl_sum = 0.0
    for t0 in range(0, T, BLOCK_T):
        offs = t0 + tl.arange(0, BLOCK_T)
        in_row = offs < T
        m = tl.load(mask_ptr + row + offs, mask=in_row, other=0.0)
        active = m > 0.0
        count += tl.sum(m, axis=0)
        if SEQUENCE or IS_VESPO or OFF_POLICY_MASK:
            lp = tl.where(active, tl.load(logp_ptr + row + offs, mask=in_row, other=0.0), 0.0)
        if SEQUENCE or IS_VESPO:
            # on-policy the old log-prob is logp itself: a log-ratio of exactly 0, or NaN for a non-finite log-prob
            # (torch's logp - logp.detach())
            old = lp
            if HAS_OLD:
                old = tl.where(active, tl.load(old_ptr + row + offs, mask=in_row, other=0.0), 0.0)
            if SEQUENCE:
                log_ratio_sum += tl.sum(lp - old, axis=0)
            if IS_VESPO:
                vespo_log_w += tl.sum(_minimum(_maximum(lp - old, -LOG_RATIO_CAP), LOG_RATIO_CAP), axis=0)
        if IS_VESPO:
            if TERM_IW:
                if IW_PER_TOKEN:
                    iw = tl.load(iw_ptr + row + offs, mask=in_row, other=1.0)
                    log_iw = _minimum(_maximum(tl.log(iw), LOG_RATIO_FLOOR), LOG_RATIO_CAP)  # clamp(log w, ..)
                    # every position, padding included: TRL's sum (its ratios are 1 there but for odd clips)
                    vespo_log_w += tl.sum(tl.where(in_row, log_iw, 0.0), axis=0)
        if OFF_POLICY_MASK:
            sampler = tl.load(sampler_ptr + row + offs, mask=in_row, other=0.0)
            kl = sampler - lp
            # a token the sampler could not score (NaN) is no evidence: TRL's nan_to_num
            sampler_kl_sum += tl.sum(tl.where(active & (kl == kl), kl, 0.0), axis=0)
    return count, log_ratio_sum, vespo_log_w, sampler_kl_sum


@triton.jit
def _importance_ratio(
    lp,
    old_ptr,
    row,
    offs,
    in_row,
    active,
    seq_ratio,
    SEQUENCE: tl.constexpr,
    HAS_OLD: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    """r per token: the row's sequence ratio (GSPO), exp(logp - old), or on-policy exp(logp - logp): 1 (its gradient
    still flows), or NaN for a non-finite log-prob, as torch's."""
    if SEQUENCE:
        r = tl.zeros((BLOCK_T,), tl.float32) + seq_ratio
    else:
        old = lp
        if HAS_OLD:
            old = tl.load(old_ptr + row + offs, mask=in_row, other=0.0)
        r = tl.where(active, tl.exp(lp - old), 1.0)
    return r


@triton.jit
def _policy_weight(iw_ptr, entropy_ptr, row, offs, in_row, m, active, adv, iw_row, sampler_kl,
                   off_policy_threshold, entropy_threshold,
                   IW_IN_TERM: tl.constexpr, HAS_IW: tl.constexpr, IW_PER_TOKEN: tl.constexpr,
                   HAS_ENTROPY: tl.constexpr, OFF_POLICY_MASK: tl.constexpr, ENTROPY_MASK: tl.constexpr,
                   BLOCK_T: tl.constexpr):  # fmt: skip
    """(weight, bonus, entropy): the policy term's multiplier (importance weights unless IW_IN_TERM, the off-policy and
    top-entropy masks; 0 at padding), the entropy bonus's token mask, and the token entropies (0 at padding)."""
    weight = tl.full((BLOCK_T,), 1.0, tl.float32)
    if HAS_IW:
        if not IW_IN_TERM:
            if IW_PER_TOKEN:
                weight = tl.load(iw_ptr + row + offs, mask=in_row, other=0.0)
            else:
                weight = weight * iw_row
    if OFF_POLICY_MASK:
        low_kl = (tl.zeros((BLOCK_T,), tl.float32) + sampler_kl) <= off_policy_threshold
        weight = tl.where((adv >= 0.0) | low_kl, weight, 0.0)
    weight = tl.where(active, weight, 0.0)  # padding's weights may be anything
    ent = tl.zeros((BLOCK_T,), tl.float32)
    if HAS_ENTROPY:
        ent = tl.where(active, tl.load(entropy_ptr + row + offs, mask=in_row, other=0.0), 0.0)
    bonus = m
    if ENTROPY_MASK:
        high_entropy = active & (ent >= entropy_threshold)
        weight = tl.where(high_entropy, weight, 0.0)
        bonus = tl.where(high_entropy, m, 0.0)
    return weight, bonus, ent


@triton.jit
def _policy_term(
    r, lp, adv, phi, eps_low, eps_high, delta, sapo_pos, sapo_neg, LOSS_KIND: tl.constexpr, HAS_DELTA: tl.constexpr
):
    """The loss type's per-token term pg and its derivative: dpg/dr (clipped, sapo) or dpg/dlogp (cispo, vespo)."""
    if LOSS_KIND == LOSS_CLIPPED:
        r1 = r
        d1 = adv
        if HAS_DELTA:
            r1 = _minimum(r, delta)
            d1 = tl.where(r <= delta, adv, 0.0)
        r2 = _minimum(_maximum(r, 1.0 - eps_low), 1.0 + eps_high)
        d2 = tl.where((r >= 1.0 - eps_low) & (r <= 1.0 + eps_high), adv, 0.0)
        a1 = r1 * adv
        a2 = r2 * adv
        pg = -_minimum(a1, a2)
        dpg = -tl.where(a1 < a2, d1, tl.where(a2 < a1, d2, 0.5 * (d1 + d2)))
    elif LOSS_KIND == LOSS_CISPO:
        clamped = _minimum(r, eps_high)
        pg = -clamped * adv * lp
        dpg = -clamped * adv
    elif LOSS_KIND == LOSS_SAPO:
        tau = tl.where(adv > 0.0, sapo_pos, sapo_neg)
        sig = tl.sigmoid(tau * (r - 1.0))
        pg = -sig * 4.0 / tau * adv
        dpg = -4.0 * sig * (1.0 - sig) * adv
    elif LOSS_KIND == LOSS_VESPO:
        pg = -phi * adv * lp
        dpg = -phi * adv
    return pg, dpg


@triton.jit
def _gamma_weight(log_w, adv, k_pos, lam_pos, k_neg, lam_neg):
    """VESPO's phi(W) = exp(lam + k log W - lam W), 0 where it overflows (TRL's nan_to_num)."""
    nonneg = adv >= 0.0
    k = tl.where(nonneg, k_pos, k_neg)
    lam = tl.maximum(tl.where(nonneg, lam_pos, lam_neg), 1e-4)
    phi = tl.exp(lam + k * log_w - lam * tl.exp(log_w))
    return tl.where(phi == float("inf"), 0.0, phi)


@triton.jit
def _kl_term(ref_ptr, row, offs, in_row, active, lp, r, SEQUENCE: tl.constexpr, BIAS_CORRECTION_KL: tl.constexpr):
    """(k, dk/dlogp, dk/dr_b): the k3 KL k = exp(ref - logp) - (ref - logp) - 1, times r with BIAS_CORRECTION_KL
    (whose gradient flows through r: on-policy r is 1 but d r/dlogp is not 0, TRL's unbiased KL). dk/dr_b is the
    derivative with respect to the sequence ratio (sequence level), chained to the tokens by the caller."""
    ref = tl.load(ref_ptr + row + offs, mask=in_row, other=0.0)
    diff = tl.where(active, ref - lp, 0.0)
    kl = tl.exp(diff) - diff - 1.0
    dkl = 1.0 - tl.exp(diff)
    dkl_dr = tl.zeros_like(kl)
    if BIAS_CORRECTION_KL:
        if SEQUENCE:
            dkl_dr = kl
        else:
            dkl += kl  # dr/dlogp = r, folded in by the multiplication below
        kl = kl * r
        dkl = dkl * r
    return kl, dkl, dkl_dr


@triton.jit
def _clip_indicators(r, adv, eps_low, eps_high, delta, HAS_DELTA: tl.constexpr):
    """(low, high, cispo) clip indicators, TRL's definitions (clipping is reported on the delta-capped ratio)."""
    r_capped = r
    if HAS_DELTA:
        r_capped = _minimum(r, delta)
    low = (r_capped < 1.0 - eps_low) & (adv < 0.0)
    high = (r_capped > 1.0 + eps_high) & (adv > 0.0)
    cispo = (r > eps_high) & (adv > 0.0)
    return low, high, cispo


@triton.jit
def _token_loss_kernel(
    logp_ptr,
    old_ptr,
    ref_ptr,
    sampler_ptr,
    adv_ptr,
    mask_ptr,
    iw_ptr,
    entropy_ptr,
    grad_logp_ptr,
    bonus_mask_ptr,
    stats_ptr,
    T,
    beta,
    eps_low,
    eps_high,
    delta,
    sapo_pos,
    sapo_neg,
    scale_ptr,
    vespo_k_pos,
    vespo_lam_pos,
    vespo_k_neg,
    vespo_lam_neg,
    off_policy_threshold,
    entropy_threshold_ptr,
    LOSS_KIND: tl.constexpr,
    GRAD_WRT_LOGP: tl.constexpr,
    IW_IN_TERM: tl.constexpr,
    SEQUENCE: tl.constexpr,
    ROW_MEAN: tl.constexpr,
    HAS_DELTA: tl.constexpr,
    HAS_OLD: tl.constexpr,
    HAS_KL: tl.constexpr,
    BIAS_CORRECTION_KL: tl.constexpr,
    ADV_PER_TOKEN: tl.constexpr,
    HAS_IW: tl.constexpr,
    IW_PER_TOKEN: tl.constexpr,
    HAS_ENTROPY: tl.constexpr,
    OFF_POLICY_MASK: tl.constexpr,
    ENTROPY_MASK: tl.constexpr,
    ENTROPY_BONUS: tl.constexpr,
    SEQ_CLIP_METRICS: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    b = tl.program_id(0)
    row = b.to(tl.int64) * T  # int64: B x T may pass 2^31 tokens (kernels/tile.py says why)
    IS_VESPO: tl.constexpr = LOSS_KIND == LOSS_VESPO
    TERM_IW: tl.constexpr = HAS_IW and IW_IN_TERM

    count, log_ratio_sum, vespo_log_w, sampler_kl_sum = _row_sums(
        logp_ptr,
        old_ptr,
        sampler_ptr,
        mask_ptr,
        iw_ptr,
        row,
        T,
        SEQUENCE,
        HAS_OLD,
        IS_VESPO,
        TERM_IW,
        IW_PER_TOKEN,
        OFF_POLICY_MASK,
        BLOCK_T,
    )
    length = tl.maximum(count, 1.0)
    # the normaliser and the entropy quantile are device values: the caller never reads them on the host
    scale = tl.load(scale_ptr)
    entropy_threshold = 0.0
    if ENTROPY_MASK:
        entropy_threshold = tl.load(entropy_threshold_ptr)
    row_scale = scale
    if ROW_MEAN:
        row_scale = scale / length
    seq_ratio = tl.exp(log_ratio_sum / length)
    vespo_log_w = _minimum(_maximum(vespo_log_w, LOG_RATIO_FLOOR), LOG_RATIO_CAP)
    sampler_kl = sampler_kl_sum / length
    if ADV_PER_TOKEN:
        adv_row = 0.0
    else:
        adv_row = tl.load(adv_ptr + b)
    iw_row = 1.0
    if HAS_IW:
        if not IW_PER_TOKEN:
            iw_row = tl.load(iw_ptr + b)

    # pass 2: per-token loss, dL/dlogp (its token part), bonus mask and metric sums
    loss_sum = 0.0
    kl_sum = 0.0
    entropy_sum = 0.0
    ratio_sum = 0.0
    low_sum = 0.0
    high_sum = 0.0
    region_sum = 0.0
    cispo_sum = 0.0
    phi_sum = 0.0
    bonus_count = 0.0
    bonus_entropy = 0.0
    dl_dratio = 0.0  # sequence level: dL/dr_b, gathered over the row
    for t0 in range(0, T, BLOCK_T):
        offs = t0 + tl.arange(0, BLOCK_T)
        in_row = offs < T
        m = tl.load(mask_ptr + row + offs, mask=in_row, other=0.0)
        active = m > 0.0
        # a masked token's log-prob may be anything (-inf for a padding id): zero it so no 0 * inf forms
        lp = tl.where(active, tl.load(logp_ptr + row + offs, mask=in_row, other=0.0), 0.0)
        if ADV_PER_TOKEN:
            adv = tl.load(adv_ptr + row + offs, mask=in_row, other=0.0)
        else:
            adv = tl.zeros((BLOCK_T,), tl.float32) + adv_row
        weight, bonus, ent = _policy_weight(
            iw_ptr,
            entropy_ptr,
            row,
            offs,
            in_row,
            m,
            active,
            adv,
            iw_row,
            sampler_kl,
            off_policy_threshold,
            entropy_threshold,
            IW_IN_TERM,
            HAS_IW,
            IW_PER_TOKEN,
            HAS_ENTROPY,
            OFF_POLICY_MASK,
            ENTROPY_MASK,
            BLOCK_T,
        )
        entropy_sum += tl.sum(ent, axis=0)
        if ENTROPY_BONUS:
            tl.store(bonus_mask_ptr + row + offs, bonus, mask=in_row)
            bonus_count += tl.sum(bonus, axis=0)
            bonus_entropy += tl.sum(bonus * ent, axis=0)
        r = _importance_ratio(lp, old_ptr, row, offs, in_row, active, seq_ratio, SEQUENCE, HAS_OLD, BLOCK_T)
        phi = tl.zeros((BLOCK_T,), tl.float32)
        if IS_VESPO:
            phi = _gamma_weight(vespo_log_w, adv, vespo_k_pos, vespo_lam_pos, vespo_k_neg, vespo_lam_neg)
            phi_sum += tl.sum(tl.where(active, phi, 0.0), axis=0)
        pg, dpg = _policy_term(r, lp, adv, phi, eps_low, eps_high, delta, sapo_pos, sapo_neg, LOSS_KIND, HAS_DELTA)
        s = tl.where(active, row_scale, 0.0)
        per_token = weight * pg
        grad_logp = tl.zeros((BLOCK_T,), tl.float32)
        if GRAD_WRT_LOGP:
            grad_logp += s * weight * dpg
        elif SEQUENCE:
            dl_dratio += tl.sum(tl.where(active, s * weight * dpg, 0.0), axis=0)  # padding: 0, even a NaN
        else:
            grad_logp += s * weight * dpg * r
        if HAS_KL:
            kl, dkl, dkl_dr = _kl_term(ref_ptr, row, offs, in_row, active, lp, r, SEQUENCE, BIAS_CORRECTION_KL)
            per_token += beta * kl
            grad_logp += s * beta * dkl
            if SEQUENCE:
                dl_dratio += tl.sum(tl.where(active, s * beta * dkl_dr, 0.0), axis=0)
            kl_sum += tl.sum(tl.where(active, kl, 0.0), axis=0)
        loss_sum += tl.sum(tl.where(active, s * per_token, 0.0), axis=0)
        # exactly 0 at padding, whatever its values (a NaN advantage there times s = 0 would be NaN)
        tl.store(grad_logp_ptr + row + offs, tl.where(active, grad_logp, 0.0), mask=in_row)

        low, high, cispo = _clip_indicators(r, adv, eps_low, eps_high, delta, HAS_DELTA)
        ratio_sum += tl.sum(tl.where(active, r, 0.0), axis=0)
        low_sum += tl.sum(tl.where(active & low, 1.0, 0.0), axis=0)
        high_sum += tl.sum(tl.where(active & high, 1.0, 0.0), axis=0)
        region_sum += tl.sum(tl.where(active & (low | high), 1.0, 0.0), axis=0)
        cispo_sum += tl.sum(tl.where(active & cispo, 1.0, 0.0), axis=0)

    # pass 3 (sequence level): chain dL/dr_b to every token, dr_b/dlogp_t = r_b m_t / L_b
    if SEQUENCE:
        if (not GRAD_WRT_LOGP) or (HAS_KL and BIAS_CORRECTION_KL):
            for t0 in range(0, T, BLOCK_T):
                offs = t0 + tl.arange(0, BLOCK_T)
                in_row = offs < T
                m = tl.load(mask_ptr + row + offs, mask=in_row, other=0.0)
                grad_logp = tl.load(grad_logp_ptr + row + offs, mask=in_row, other=0.0)
                grad_logp += dl_dratio * seq_ratio * m / length
                tl.store(grad_logp_ptr + row + offs, grad_logp, mask=in_row)

    stats = stats_ptr + b * NUM_STATS
    tl.store(stats + STAT_LOSS, loss_sum)
    tl.store(stats + STAT_COUNT, count)
    tl.store(stats + STAT_KL, kl_sum)
    tl.store(stats + STAT_ENTROPY, entropy_sum)
    if SEQUENCE:
        tl.store(stats + STAT_RATIO, seq_ratio)
    else:
        tl.store(stats + STAT_RATIO, ratio_sum)
    if SEQ_CLIP_METRICS:
        # one value per sequence: the row's own indicator, averaged over sequences by the caller
        low_b, high_b, cispo_b = _clip_indicators(seq_ratio, adv_row, eps_low, eps_high, delta, HAS_DELTA)
        tl.store(stats + STAT_LOW, tl.where(low_b, 1.0, 0.0))
        tl.store(stats + STAT_HIGH, tl.where(high_b, 1.0, 0.0))
        tl.store(stats + STAT_REGION, tl.where(low_b | high_b, 1.0, 0.0))
        tl.store(stats + STAT_CISPO, tl.where(cispo_b, 1.0, 0.0))
    else:
        tl.store(stats + STAT_LOW, low_sum)
        tl.store(stats + STAT_HIGH, high_sum)
        tl.store(stats + STAT_REGION, region_sum)
        tl.store(stats + STAT_CISPO, cispo_sum)
    if IS_VESPO:
        if ADV_PER_TOKEN:
            tl.store(stats + STAT_PHI, phi_sum)
        else:  # one weight per sequence, masked tokens or not
            tl.store(
                stats + STAT_PHI,
                _gamma_weight(vespo_log_w, adv_row, vespo_k_pos, vespo_lam_pos, vespo_k_neg, vespo_lam_neg),
            )
    else:
        tl.store(stats + STAT_PHI, 0.0)
    tl.store(stats + STAT_BONUS_COUNT, bonus_count)
    tl.store(stats + STAT_BONUS_ENTROPY, bonus_entropy)


def _device_scalar(x, like):
    """A kernel's scalar operand as a [1] fp32 tensor on ``like``'s device (a device tensor as it is: no host read)."""
    if isinstance(x, torch.Tensor):
        return x.to(device=like.device, dtype=torch.float32).reshape(1)
    return torch.full((1,), float(x), dtype=torch.float32, device=like.device)  # a fill: no copy from host memory


@on_first_argument_device
def token_loss(
    logp, advantages, mask, old, ref, sampler, importance_weights, entropy, options, *, scale, entropy_threshold
):
    """Launch one program per sequence; returns (grad_logp, bonus_mask or None, {statistic name: (values [B],
    per_sequence)}: grpo_fast.kernels.loss_statistics.returned_statistics').
    grpo_fast/token_loss_torch.py is its torch twin, with the same arguments and returns.

    All tensors fp32 contiguous [B, T] on one device (advantages [B] or [B, T], importance_weights [B] or [B, T]);
    ``options`` a ``grpo_fast.LossOptions``; ``scale`` = 1 / the loss's denominator (a number, or a [1] / [] fp32
    device tensor: never read on the host); ``sampler`` (the off-policy mask's log-probs) is None without that mask,
    ``entropy_threshold`` (a number or an fp32 device tensor likewise) None without the top-entropy mask;
    ``ref`` None without a KL term. The statistics: ``returned_statistics``' (no "kl" without a KL term, no "entropy"
    without the entropy, no "phi" but for vespo's term).
    """
    record = options.loss_type_record
    term = record.policy_term
    if term.formula not in LOSS_KINDS:
        raise ValueError(
            f"loss type {options.loss_type!r} has a policy term the token kernel does not have: "
            f"{term.formula!r} (it has {tuple(LOSS_KINDS)})"
        )
    loss_kind = LOSS_KINDS[term.formula]
    if term.importance_weights_in_term and loss_kind != LOSS_VESPO:
        raise ValueError(
            f"loss type {options.loss_type!r} puts the importance weights in its term, but the token "
            f"kernel's {term.formula!r} term does not read them (only 'vespo' does)"
        )
    B, T = logp.shape
    entropy_bonus = options.entropy_coef != 0.0
    has_kl = ref is not None and options.beta != 0.0
    grad_logp = torch.empty_like(logp)
    bonus_mask = torch.empty_like(logp) if entropy_bonus else None
    stats = torch.empty((B, NUM_STATS.value), dtype=torch.float32, device=logp.device)
    adv_per_token = advantages.dim() == 2
    seq_clip_metrics = options.sequence_level and not adv_per_token
    block_t = min(1024, max(16, triton.next_power_of_2(T)))
    _token_loss_kernel[(B,)](
        logp,
        old if old is not None else logp,
        ref if ref is not None else logp,
        sampler if sampler is not None else logp,
        advantages,
        mask,
        importance_weights if importance_weights is not None else logp,
        entropy if entropy is not None else logp,
        grad_logp,
        bonus_mask if bonus_mask is not None else grad_logp,
        stats,
        T,
        float(options.beta),
        float(options.epsilon),
        float(options.clip_high),
        float(options.delta if options.delta is not None else 0.0),
        float(options.sapo_temperature_pos),
        float(options.sapo_temperature_neg),
        _device_scalar(scale, logp),
        float(options.vespo_k_pos),
        float(options.vespo_lambda_pos),
        float(options.vespo_k_neg),
        float(options.vespo_lambda_neg),
        float(options.off_policy_mask_threshold if sampler is not None else 0.0),
        _device_scalar(entropy_threshold, logp) if entropy_threshold is not None else logp,
        LOSS_KIND=loss_kind,
        GRAD_WRT_LOGP=term.gradient_wrt == "logprob",
        IW_IN_TERM=term.importance_weights_in_term,
        SEQUENCE=options.sequence_level,
        ROW_MEAN=record.row_mean,
        HAS_DELTA=options.delta is not None,
        HAS_OLD=old is not None,
        HAS_KL=has_kl,
        BIAS_CORRECTION_KL=options.use_bias_correction_kl,
        ADV_PER_TOKEN=adv_per_token,
        HAS_IW=importance_weights is not None,
        IW_PER_TOKEN=importance_weights is not None and importance_weights.dim() == 2,
        HAS_ENTROPY=entropy is not None,
        OFF_POLICY_MASK=sampler is not None,
        ENTROPY_MASK=entropy_threshold is not None,
        ENTROPY_BONUS=entropy_bonus,
        SEQ_CLIP_METRICS=seq_clip_metrics,
        BLOCK_T=block_t,
        num_warps=NUM_WARPS,
    )
    returned = returned_statistics(
        sequence_level=options.sequence_level,
        advantages_per_token=adv_per_token,
        has_kl=has_kl,
        has_entropy=entropy is not None,
        has_phi=loss_kind == LOSS_VESPO,
    )
    return (
        grad_logp,
        bonus_mask,
        {name: (stats[:, SLOTS[name]], per_sequence) for name, per_sequence in returned.items()},
    )
