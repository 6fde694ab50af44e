"""The GRPO token kernel: TRL 1.16's per-token math, one program per sequence, nothing read on the host.

For sequence b (r: importance ratio, A: advantage, m: mask, w: importance weights, L_b = max(sum_t m_t, 1)):
    ratio      token level r_t = exp(logp_t - old_t), dr_t/dlogp_t = r_t; sequence level (GSPO)
               r_b = exp(sum_t m_t (logp_t - old_t) / L_b), dr_b/dlogp_t = r_b m_t / L_b
    clipped    pg = -min(a1, a2), a1 = min(r, delta) A, a2 = clamp(r, 1 - eps, 1 + eps_high) A; dpg/dr takes the
               smaller one's derivative, half of each on a tie (torch.min), clamp's is A on its bounds too
    cispo      pg = -stopgrad(min(r, eps_high)) A logp_t            dpg/dlogp_t = -min(r, eps_high) A
    sapo       pg = -sigmoid(tau (r - 1)) 4 / tau A                  dpg/dr = -4 sig (1 - sig) A, tau by A's sign
    vespo      pg = -stopgrad(phi) A logp_t                          dpg/dlogp_t = -phi A
               phi = exp(lam + k log W - lam W), (k, lam) by A's sign, 0 where it overflows;
               log W = clamp(sum_t m_t clamp(logp_t - old_t, -20, 20) + sum_t clamp(log w_t, log 1e-8, 20),
               log 1e-8, 20), the weights summed over padding too (TRL's)
    masks      keep = [A >= 0 or sum_t m_t nan_to_0(sampler_t - logp_t) / L_b <= off_policy_threshold]
               e_t = [entropy_t >= entropy_threshold] (the top-entropy tokens)
    kl         k_t = exp(ref_t - logp_t) - (ref_t - logp_t) - 1, times r with use_bias_correction_kl (its gradient
               flows through r: on-policy r is 1 but dr/dlogp is not 0)
    loss       L = sum_b sum_t s_bt (keep e_t w_t pg_t + beta k_t), s_bt = m_t scale (/ L_b with row_mean);
               w_t is 1 where the weights enter the term (vespo's log W)
The loss type's record (its ``policy_term``) says which family's term (LOSS_KIND), what dpg is taken against, whether
the term has phi, where the weights go and whether delta applies; the launcher reads it from its ``options``.

Masked tokens contribute exactly zero, whatever their values; a NaN at a scored token reaches the loss, as in torch
(``_minimum`` / ``_maximum``: tl.minimum's default, like PTX's min.f32, returns the other operand).
"""

import math

import torch
import triton
import triton.language as tl

from grpo_fast.kernels import launch
from grpo_fast.kernels.loss_statistics import SLOTS, returned_statistics

# Loss kinds: the families of per-token term (``_policy_term``), by the record's ``policy_term.formula``; the launcher
# raises on any other.
LOSS_CLIPPED = tl.constexpr(0)
LOSS_CISPO = tl.constexpr(1)
LOSS_SAPO = tl.constexpr(2)
LOSS_VESPO = tl.constexpr(3)
LOSS_KINDS = {"clipped": LOSS_CLIPPED, "cispo": LOSS_CISPO, "sapo": LOSS_SAPO, "vespo": LOSS_VESPO}

# Statistics slots: row_stats[b, slot], as loss_statistics names them, in its order (a test checks each name's slot)
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
# option a stack slot on sm_90; with 2 every variant compiles clean on sm_90 / 89 / 80.
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
def _row_sums(
    logp_ptr,
    old_ptr,
    sampler_ptr,
    mask_ptr,
    iw_ptr,
    row,
    T,
    SEQUENCE: tl.constexpr,
    HAS_OLD: tl.constexpr,
    GAMMA_WEIGHTED: tl.constexpr,
    TERM_IW: tl.constexpr,
    IW_PER_TOKEN: tl.constexpr,
    OFF_POLICY_MASK: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    """Pass 1 over a row: its token count, the sum of log-ratios (GSPO), phi's log W (unclamped) and the summed
    KL(sampler || policy) for the off-policy mask. TERM_IW: importance weights that enter the term (log W)."""
    count = 0.0
    log_ratio_sum = 0.0
    log_w = 0.0
    sampler_kl_sum = 0.0
    for t0 in range(0, T, BLOCK_T):
        offs = t0 + tl.arange(0, BLOCK_T)
        in_row = offs < T
        m = tl.load(mask_ptr + row + offs, mask=in_row, other=0.0)
        active = m > 0.0
        count += tl.sum(m, axis=0)
        if SEQUENCE or GAMMA_WEIGHTED or OFF_POLICY_MASK:
            lp = tl.where(active, tl.load(logp_ptr + row + offs, mask=in_row, other=0.0), 0.0)
        if SEQUENCE or GAMMA_WEIGHTED:
            # on-policy the old log-prob is logp itself: a log-ratio of exactly 0, or NaN for a non-finite log-prob
            # (torch's logp - logp.detach())
            old = lp
            if HAS_OLD:
                old = tl.where(active, tl.load(old_ptr + row + offs, mask=in_row, other=0.0), 0.0)
            if SEQUENCE:
                log_ratio_sum += tl.sum(lp - old, axis=0)
            if GAMMA_WEIGHTED:
                log_w += tl.sum(_minimum(_maximum(lp - old, -LOG_RATIO_CAP), LOG_RATIO_CAP), axis=0)
        if GAMMA_WEIGHTED:
            if TERM_IW:
                if IW_PER_TOKEN:
                    iw = tl.load(iw_ptr + row + offs, mask=in_row, other=1.0)
                    # clamp(log w, ..); a zero weight (a masked ratio) is the floor itself, without a log of 0
                    log_iw = _minimum(_maximum(tl.log(tl.where(iw == 0.0, 1.0, iw)), LOG_RATIO_FLOOR), LOG_RATIO_CAP)
                    log_iw = tl.where(iw == 0.0, LOG_RATIO_FLOOR, log_iw)
                    # every position, padding included: TRL's sum (its ratios are 1 there but for odd clips)
                    log_w += tl.sum(tl.where(in_row, log_iw, 0.0), axis=0)
        if OFF_POLICY_MASK:
            sampler = tl.load(sampler_ptr + row + offs, mask=in_row, other=0.0)
            kl = sampler - lp
            # a token the sampler could not score (NaN) is no evidence: TRL's nan_to_num
            sampler_kl_sum += tl.sum(tl.where(active & (kl == kl), kl, 0.0), axis=0)
    return count, log_ratio_sum, log_w, sampler_kl_sum


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
def _policy_weight(
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
    IW_IN_TERM: tl.constexpr,
    HAS_IW: tl.constexpr,
    IW_PER_TOKEN: tl.constexpr,
    HAS_ENTROPY: tl.constexpr,
    OFF_POLICY_MASK: tl.constexpr,
    ENTROPY_MASK: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
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
    GAMMA_WEIGHTED: tl.constexpr,
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
    row = b.to(tl.int64) * T  # int64: B x T may pass 2^31 tokens
    TERM_IW: tl.constexpr = HAS_IW and IW_IN_TERM

    count, log_ratio_sum, log_w, sampler_kl_sum = _row_sums(
        logp_ptr,
        old_ptr,
        sampler_ptr,
        mask_ptr,
        iw_ptr,
        row,
        T,
        SEQUENCE,
        HAS_OLD,
        GAMMA_WEIGHTED,
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
    log_w = _minimum(_maximum(log_w, LOG_RATIO_FLOOR), LOG_RATIO_CAP)
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
        if GAMMA_WEIGHTED:
            phi = _gamma_weight(log_w, adv, vespo_k_pos, vespo_lam_pos, vespo_k_neg, vespo_lam_neg)
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
    if GAMMA_WEIGHTED:
        if ADV_PER_TOKEN:
            tl.store(stats + STAT_PHI, phi_sum)
        else:  # one weight per sequence, masked tokens or not
            tl.store(
                stats + STAT_PHI,
                _gamma_weight(log_w, adv_row, vespo_k_pos, vespo_lam_pos, vespo_k_neg, vespo_lam_neg),
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


def token_loss(inputs, options, *, scale, entropy_threshold):
    """Layer 2 on prepared inputs: dL/dlogp, the entropy bonus's token mask and the per-sequence statistics.

    One program per sequence. The torch twin (``grpo_fast.backends.token_loss_twin.token_loss``) takes the same
    arguments and returns the same values.

    Args:
        inputs: a ``TokenLossInputs``.
        options: the loss options (a ``grpo_fast.LossOptions``); its ``loss_type_record`` gives the family of
            per-token term and its facts (kernels import nothing above them: the caller hands the record in).
        scale: 1 / the loss's denominator: a number, or a [1] / [] fp32 device tensor (never read on the host).
        entropy_threshold: the top-entropy mask's threshold (a number or an fp32 device tensor likewise), or None
            without that mask.

    Returns:
        ``(grad_logp, bonus_mask, statistics)``: dL/dlogp [B, T] fp32 (normalised, 0 at masked tokens); the entropy
        bonus's token mask [B, T] fp32 with ``entropy_coef != 0`` (m_t, or m_t e_t with the top-entropy mask), else
        None; ``{statistic: (values [B] fp32, per_sequence)}`` for those of ``returned_statistics``.

    Raises:
        ValueError: the record's policy term is not one of ``LOSS_KINDS``.
    """
    term = options.loss_type_record.policy_term
    if term.formula not in LOSS_KINDS:
        raise ValueError(
            f"loss type {options.loss_type!r} has a policy term the token kernel does not have: "
            f"{term.formula!r} (it has {tuple(LOSS_KINDS)})"
        )
    with launch.on_device(inputs.logp):
        return _launch(inputs, options, term, scale, entropy_threshold)


def _launch(inputs, options, term, scale, entropy_threshold):
    """``token_loss`` on the inputs' device: allocate the outputs, launch, name the statistics."""
    logp, advantages, mask, old, ref, sampler, importance_weights, entropy = inputs
    B, T = logp.shape
    entropy_bonus = options.entropy_coef != 0.0
    has_kl = ref is not None and options.beta != 0.0
    grad_logp = torch.empty_like(logp)
    bonus_mask = torch.empty_like(logp) if entropy_bonus else None
    stats = torch.empty((B, NUM_STATS.value), dtype=torch.float32, device=logp.device)
    adv_per_token = advantages.dim() == 2
    has_delta = "delta" in term.options and options.delta is not None
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
        float(options.delta if has_delta else 0.0),
        float(options.sapo_temperature_pos),
        float(options.sapo_temperature_neg),
        _device_scalar(scale, logp),
        float(options.vespo_k_pos),
        float(options.vespo_lambda_pos),
        float(options.vespo_k_neg),
        float(options.vespo_lambda_neg),
        float(options.off_policy_mask_threshold if sampler is not None else 0.0),
        _device_scalar(entropy_threshold, logp) if entropy_threshold is not None else logp,
        LOSS_KIND=LOSS_KINDS[term.formula],
        GRAD_WRT_LOGP=term.gradient_wrt == "logprob",
        GAMMA_WEIGHTED=term.gamma_weighted,
        IW_IN_TERM=term.importance_weights_in_term,
        SEQUENCE=options.sequence_level,
        ROW_MEAN=options.loss_type_record.row_mean,
        HAS_DELTA=has_delta,
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
        SEQ_CLIP_METRICS=options.sequence_level and not adv_per_token,
        BLOCK_T=min(1024, max(16, triton.next_power_of_2(T))),
        num_warps=NUM_WARPS,
    )
    returned = returned_statistics(
        sequence_level=options.sequence_level,
        advantages_per_token=adv_per_token,
        has_kl=has_kl,
        has_entropy=entropy is not None,
        has_phi=term.gamma_weighted,
    )
    named = {name: (stats[:, SLOTS[name]], per_sequence) for name, per_sequence in returned.items()}
    return grad_logp, bonus_mask, named
