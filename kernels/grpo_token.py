"""The per-token GRPO math (TRL 1.16): loss, metrics, c_t = dL/dlogp_t and the entropy mask, one program per sequence.

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
    loss            L = sum_b sum_t s_bt (keep_t e_t w_t pg_t + beta k_t),  s_bt = m_t * scale / (L_b if ROW_MEAN else 1)
                    (w_t is 1 for vespo: its weights enter phi instead)

Outputs: ``coef`` [B, T] fp32 (dL/dlogp, already normalised), ``bonus_mask`` [B, T] fp32 (with ENTROPY_BONUS: the
tokens the entropy bonus averages over, m_t or m_t e_t; the caller scales it by -entropy_coef / their count to get
dL/dentropy) and ``row_stats`` [B, NUM_STATS] fp32: the row's share of the policy loss, its mask sum, masked sums of
kl, entropy, ratio, the clip indicators and phi (for sequence-level clip metrics with per-sequence advantages, and
vespo's per-sequence phi, the row's own value: TRL averages those over sequences), and the bonus tokens' count and
entropy sum. Masked tokens contribute exactly zero, whatever their log-probs (no 0 * inf = NaN).

Memory: the [B, T] fp32 coefficients (and bonus mask) and B x NUM_STATS fp32; everything else stays in registers.
"""

import math

import torch
import triton
import triton.language as tl

LOSS_CLIPPED, LOSS_CISPO, LOSS_SAPO, LOSS_VESPO = 0, 1, 2, 3
(STAT_LOSS, STAT_COUNT, STAT_KL, STAT_ENTROPY, STAT_RATIO, STAT_LOW, STAT_HIGH, STAT_REGION, STAT_CISPO, STAT_PHI,
 STAT_BONUS_COUNT, STAT_BONUS_ENTROPY) = range(12)
NUM_STATS = 12
LOG_RATIO_FLOOR = tl.constexpr(math.log(1e-8))  # VESPO's clamp of log W (TRL's)


@triton.jit
def _pg_and_grad(r, lp, adv, phi, eps_low, eps_high, delta, sapo_pos, sapo_neg,
                 LOSS_KIND: tl.constexpr, HAS_DELTA: tl.constexpr):
    """Policy-gradient term pg and its derivative: dpg/dr (clipped, sapo) or dpg/dlogp (cispo, vespo)."""
    if LOSS_KIND == 0:
        r1 = r
        d1 = adv
        if HAS_DELTA:
            r1 = tl.minimum(r, delta)
            d1 = tl.where(r <= delta, adv, 0.0)
        r2 = tl.minimum(tl.maximum(r, 1.0 - eps_low), 1.0 + eps_high)
        d2 = tl.where((r >= 1.0 - eps_low) & (r <= 1.0 + eps_high), adv, 0.0)
        a1 = r1 * adv
        a2 = r2 * adv
        pg = -tl.minimum(a1, a2)
        dpg = -tl.where(a1 < a2, d1, tl.where(a2 < a1, d2, 0.5 * (d1 + d2)))
    elif LOSS_KIND == 1:
        clamped = tl.minimum(r, eps_high)
        pg = -clamped * adv * lp
        dpg = -clamped * adv
    elif LOSS_KIND == 2:
        tau = tl.where(adv > 0.0, sapo_pos, sapo_neg)
        sig = tl.sigmoid(tau * (r - 1.0))
        pg = -sig * 4.0 / tau * adv
        dpg = -4.0 * sig * (1.0 - sig) * adv
    else:
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
def _grpo_token_kernel(
    logp_ptr, old_ptr, ref_ptr, sampler_ptr, adv_ptr, mask_ptr, iw_ptr, entropy_ptr,
    coef_ptr, bonus_mask_ptr, stats_ptr,
    T, beta, eps_low, eps_high, delta, sapo_pos, sapo_neg, scale,
    vespo_k_pos, vespo_lam_pos, vespo_k_neg, vespo_lam_neg, off_policy_threshold, entropy_threshold,
    LOSS_KIND: tl.constexpr, SEQUENCE: tl.constexpr, ROW_MEAN: tl.constexpr, HAS_DELTA: tl.constexpr,
    HAS_OLD: tl.constexpr, HAS_KL: tl.constexpr, BIAS_CORRECTION_KL: tl.constexpr, ADV_PER_TOKEN: tl.constexpr,
    HAS_IW: tl.constexpr, IW_PER_TOKEN: tl.constexpr, HAS_ENTROPY: tl.constexpr,
    OFF_POLICY_MASK: tl.constexpr, ENTROPY_MASK: tl.constexpr, ENTROPY_BONUS: tl.constexpr,
    SEQ_CLIP_METRICS: tl.constexpr, NUM_STATS: tl.constexpr, BLOCK_T: tl.constexpr,
):
    b = tl.program_id(0)
    row = b * T
    IS_VESPO: tl.constexpr = LOSS_KIND == 3

    # pass 1: the row's mask sum, and its sums of log-ratios (GSPO ratio, VESPO's W) and of the sampler's KL
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
        if (SEQUENCE and HAS_OLD) or IS_VESPO or OFF_POLICY_MASK:
            lp = tl.where(active, tl.load(logp_ptr + row + offs, mask=in_row, other=0.0), 0.0)
        if HAS_OLD:
            if SEQUENCE or IS_VESPO:
                old = tl.where(active, tl.load(old_ptr + row + offs, mask=in_row, other=0.0), 0.0)
                if SEQUENCE:
                    log_ratio_sum += tl.sum(lp - old, axis=0)
                if IS_VESPO:
                    vespo_log_w += tl.sum(tl.minimum(tl.maximum(lp - old, -20.0), 20.0), axis=0)
        if IS_VESPO:
            if HAS_IW:
                if IW_PER_TOKEN:
                    iw = tl.load(iw_ptr + row + offs, mask=in_row, other=1.0)
                    log_iw = tl.minimum(tl.log(tl.maximum(iw, 1e-8)), 20.0)  # = clamp(log w, log 1e-8, 20)
                    # every position, padding included: TRL's sum (its ratios are 1 there but for odd clips)
                    vespo_log_w += tl.sum(tl.where(in_row, log_iw, 0.0), axis=0)
        if OFF_POLICY_MASK:
            sampler = tl.load(sampler_ptr + row + offs, mask=in_row, other=0.0)
            kl = sampler - lp
            # a token the sampler could not score (NaN) is no evidence: TRL's nan_to_num
            sampler_kl_sum += tl.sum(tl.where(active & (kl == kl), kl, 0.0), axis=0)
    length = tl.maximum(count, 1.0)
    row_scale = scale
    if ROW_MEAN:
        row_scale = scale / length
    seq_ratio = tl.exp(log_ratio_sum / length)
    vespo_log_w = tl.minimum(tl.maximum(vespo_log_w, LOG_RATIO_FLOOR), 20.0)
    sampler_kl = sampler_kl_sum / length

    if ADV_PER_TOKEN:
        adv_row = 0.0
    else:
        adv_row = tl.load(adv_ptr + b)
    if HAS_IW:
        if IW_PER_TOKEN:
            iw_row = 1.0
        else:
            iw_row = tl.load(iw_ptr + b)

    # pass 2: per-token loss, coefficient (token part), bonus mask and metric sums
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
        # the policy term's multiplier: importance weights (not vespo's), off-policy and entropy masks
        weight = tl.full((BLOCK_T,), 1.0, tl.float32)
        if HAS_IW:
            if not IS_VESPO:
                if IW_PER_TOKEN:
                    weight = tl.load(iw_ptr + row + offs, mask=in_row, other=0.0)
                else:
                    weight = weight * iw_row
        if OFF_POLICY_MASK:
            low_kl = (tl.zeros((BLOCK_T,), tl.float32) + sampler_kl) <= off_policy_threshold
            weight = tl.where((adv >= 0.0) | low_kl, weight, 0.0)
        weight = tl.where(active, weight, 0.0)  # padding's weights may be anything
        if HAS_ENTROPY:
            ent = tl.where(active, tl.load(entropy_ptr + row + offs, mask=in_row, other=0.0), 0.0)
            entropy_sum += tl.sum(ent, axis=0)
        bonus = m
        if ENTROPY_MASK:
            high_entropy = active & (ent >= entropy_threshold)
            weight = tl.where(high_entropy, weight, 0.0)
            bonus = tl.where(high_entropy, m, 0.0)
        if ENTROPY_BONUS:
            tl.store(bonus_mask_ptr + row + offs, bonus, mask=in_row)
            bonus_count += tl.sum(bonus, axis=0)
            bonus_entropy += tl.sum(bonus * ent, axis=0)
        if SEQUENCE:
            r = tl.zeros((BLOCK_T,), tl.float32) + seq_ratio
        else:
            if HAS_OLD:
                old = tl.load(old_ptr + row + offs, mask=in_row, other=0.0)
                r = tl.where(active, tl.exp(lp - old), 1.0)
            else:
                r = tl.full((BLOCK_T,), 1.0, tl.float32)
        phi = tl.zeros((BLOCK_T,), tl.float32)
        if IS_VESPO:
            phi = _gamma_weight(vespo_log_w, adv, vespo_k_pos, vespo_lam_pos, vespo_k_neg, vespo_lam_neg)
            phi_sum += tl.sum(tl.where(active, phi, 0.0), axis=0)
        pg, dpg = _pg_and_grad(r, lp, adv, phi, eps_low, eps_high, delta, sapo_pos, sapo_neg, LOSS_KIND, HAS_DELTA)
        s = tl.where(active, row_scale, 0.0)
        per_token = weight * pg
        coef = tl.zeros((BLOCK_T,), tl.float32)
        if LOSS_KIND == 1 or IS_VESPO:
            coef += s * weight * dpg
        elif SEQUENCE:
            dl_dratio += tl.sum(s * weight * dpg, axis=0)
        else:
            coef += s * weight * dpg * r
        if HAS_KL:
            ref = tl.load(ref_ptr + row + offs, mask=in_row, other=0.0)
            diff = tl.where(active, ref - lp, 0.0)
            kl = tl.exp(diff) - diff - 1.0
            dkl = 1.0 - tl.exp(diff)
            if BIAS_CORRECTION_KL:
                # d(k r)/dlogp = dk r + k dr: on-policy r is 1 but its gradient still flows (TRL's unbiased KL)
                if SEQUENCE:
                    dl_dratio += tl.sum(s * beta * kl, axis=0)
                else:
                    dkl += kl
                kl = kl * r
                dkl = dkl * r
            per_token += beta * kl
            coef += s * beta * dkl
            kl_sum += tl.sum(tl.where(active, kl, 0.0), axis=0)
        loss_sum += tl.sum(tl.where(active, s * per_token, 0.0), axis=0)
        tl.store(coef_ptr + row + offs, coef, mask=in_row)

        r_metric = r
        if HAS_DELTA:
            r_metric = tl.minimum(r, delta)  # TRL reports clipping on the delta-capped ratio
        low = (r_metric < 1.0 - eps_low) & (adv < 0.0)
        high = (r_metric > 1.0 + eps_high) & (adv > 0.0)
        cispo = (r > eps_high) & (adv > 0.0)
        ratio_sum += tl.sum(tl.where(active, r, 0.0), axis=0)
        low_sum += tl.sum(tl.where(active & low, 1.0, 0.0), axis=0)
        high_sum += tl.sum(tl.where(active & high, 1.0, 0.0), axis=0)
        region_sum += tl.sum(tl.where(active & (low | high), 1.0, 0.0), axis=0)
        cispo_sum += tl.sum(tl.where(active & cispo, 1.0, 0.0), axis=0)

    # pass 3 (sequence level): chain dL/dr_b to every token, dr_b/dlogp_t = r_b m_t / L_b
    if SEQUENCE:
        if (LOSS_KIND == 0 or LOSS_KIND == 2) or (HAS_KL and BIAS_CORRECTION_KL):
            for t0 in range(0, T, BLOCK_T):
                offs = t0 + tl.arange(0, BLOCK_T)
                in_row = offs < T
                m = tl.load(mask_ptr + row + offs, mask=in_row, other=0.0)
                coef = tl.load(coef_ptr + row + offs, mask=in_row, other=0.0)
                coef += dl_dratio * seq_ratio * m / length
                tl.store(coef_ptr + row + offs, coef, mask=in_row)

    stats = stats_ptr + b * NUM_STATS
    tl.store(stats + 0, loss_sum)
    tl.store(stats + 1, count)
    tl.store(stats + 2, kl_sum)
    tl.store(stats + 3, entropy_sum)
    if SEQUENCE:
        tl.store(stats + 4, seq_ratio)
    else:
        tl.store(stats + 4, ratio_sum)
    if SEQ_CLIP_METRICS:
        # one value per sequence: the row's own indicator, averaged over sequences by the caller
        r_seq = seq_ratio
        if HAS_DELTA:
            r_seq = tl.minimum(seq_ratio, delta)
        low_b = (r_seq < 1.0 - eps_low) & (adv_row < 0.0)
        high_b = (r_seq > 1.0 + eps_high) & (adv_row > 0.0)
        tl.store(stats + 5, tl.where(low_b, 1.0, 0.0))
        tl.store(stats + 6, tl.where(high_b, 1.0, 0.0))
        tl.store(stats + 7, tl.where(low_b | high_b, 1.0, 0.0))
        tl.store(stats + 8, tl.where((seq_ratio > eps_high) & (adv_row > 0.0), 1.0, 0.0))
    else:
        tl.store(stats + 5, low_sum)
        tl.store(stats + 6, high_sum)
        tl.store(stats + 7, region_sum)
        tl.store(stats + 8, cispo_sum)
    if IS_VESPO:
        if ADV_PER_TOKEN:
            tl.store(stats + 9, phi_sum)
        else:  # one weight per sequence, masked tokens or not
            tl.store(stats + 9, _gamma_weight(vespo_log_w, adv_row, vespo_k_pos, vespo_lam_pos, vespo_k_neg,
                                              vespo_lam_neg))
    else:
        tl.store(stats + 9, 0.0)
    tl.store(stats + 10, bonus_count)
    tl.store(stats + 11, bonus_entropy)


def grpo_token(logp, advantages, mask, old, ref, sampler, importance_weights, entropy, *, loss_kind, sequence,
               row_mean, scale, beta, eps_low, eps_high, delta, sapo_pos, sapo_neg, vespo, use_bias_correction_kl,
               off_policy_threshold, entropy_threshold, entropy_bonus):
    """Launch one program per sequence; returns (coef, bonus_mask or None, row_stats).

    All tensors fp32 contiguous [B, T] on one device (advantages [B] or [B, T], importance_weights [B] or [B, T]);
    ``sampler`` (off-policy mask) and ``entropy_threshold`` (top-entropy mask) are None when unused;
    ``vespo`` = (k_pos, lambda_pos, k_neg, lambda_neg).
    """
    B, T = logp.shape
    coef = torch.empty_like(logp)
    bonus_mask = torch.empty_like(logp) if entropy_bonus else None
    stats = torch.empty((B, NUM_STATS), dtype=torch.float32, device=logp.device)
    adv_per_token = advantages.dim() == 2
    block_t = min(1024, max(16, triton.next_power_of_2(T)))
    _grpo_token_kernel[(B,)](
        logp, old if old is not None else logp, ref if ref is not None else logp,
        sampler if sampler is not None else logp, advantages, mask,
        importance_weights if importance_weights is not None else logp, entropy if entropy is not None else logp,
        coef, bonus_mask if bonus_mask is not None else coef, stats,
        T, float(beta), float(eps_low), float(eps_high), float(delta if delta is not None else 0.0),
        float(sapo_pos), float(sapo_neg), float(scale), *(float(x) for x in vespo),
        float(off_policy_threshold if off_policy_threshold is not None else 0.0),
        float(entropy_threshold if entropy_threshold is not None else 0.0),
        LOSS_KIND=loss_kind, SEQUENCE=sequence, ROW_MEAN=row_mean, HAS_DELTA=delta is not None,
        HAS_OLD=old is not None, HAS_KL=ref is not None and beta != 0.0,
        BIAS_CORRECTION_KL=use_bias_correction_kl, ADV_PER_TOKEN=adv_per_token,
        HAS_IW=importance_weights is not None,
        IW_PER_TOKEN=importance_weights is not None and importance_weights.dim() == 2,
        HAS_ENTROPY=entropy is not None, OFF_POLICY_MASK=sampler is not None,
        ENTROPY_MASK=entropy_threshold is not None, ENTROPY_BONUS=entropy_bonus,
        SEQ_CLIP_METRICS=sequence and not adv_per_token, NUM_STATS=NUM_STATS, BLOCK_T=block_t,
    )
    return coef, bonus_mask, stats
