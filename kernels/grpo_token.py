"""The per-token GRPO math: loss, metrics and the coefficient c_t = dL/dlogp_t, one program per sequence.

For sequence b (r: importance ratio, A: advantage, m: mask, w: importance weights, s: normaliser):
    token level     r_t = exp(logp_t - old_t)                 dr_t/dlogp_t = r_t
    sequence level  r_b = exp(sum_t m_t (logp_t - old_t) / L_b),  L_b = max(sum_t m_t, 1)
                                                              dr_b/dlogp_t = r_b m_t / L_b
    clipped family  pg = -min(a1, a2),  a1 = min(r, delta) A,  a2 = clamp(r, 1 - eps, 1 + eps_high) A
                    dpg/dr = -(da1 if a1 < a2, da2 if a2 < a1, (da1 + da2) / 2 on a tie: torch.min's rule)
                    with da1 = A [r <= delta], da2 = A [1 - eps <= r <= 1 + eps_high] (clamp's inclusive rule)
    cispo           pg = -stopgrad(min(r, eps_high)) A logp_t         dpg/dlogp_t = -min(r, eps_high) A
    sapo            pg = -sigmoid(tau (r - 1)) 4 / tau A               dpg/dr = -4 sig (1 - sig) A
    kl              k_t = exp(ref_t - logp_t) - (ref_t - logp_t) - 1   dk/dlogp_t = 1 - exp(ref_t - logp_t)
    loss            L = sum_b sum_t s_bt (w_t pg_t + beta k_t),  s_bt = m_t * scale / (L_b if ROW_MEAN else 1)

Outputs: ``coef`` [B, T] fp32 (dL/dlogp, already normalised) and ``row_stats`` [B, NUM_STATS] fp32:
the row's share of the loss, its mask sum, and masked sums of kl, entropy, ratio and the clip indicators
(for sequence-level clip metrics with per-sequence advantages, the row's own indicator: TRL averages those
over sequences). Masked tokens contribute exactly zero, whatever their log-probs (no 0 * inf = NaN).

Memory: the [B, T] fp32 coefficients and B x NUM_STATS fp32; everything else stays in registers.
"""

import torch
import triton
import triton.language as tl

LOSS_CLIPPED, LOSS_CISPO, LOSS_SAPO = 0, 1, 2
STAT_LOSS, STAT_COUNT, STAT_KL, STAT_ENTROPY, STAT_RATIO, STAT_LOW, STAT_HIGH, STAT_REGION, STAT_CISPO = range(9)
NUM_STATS = 9


@triton.jit
def _pg_and_grad(r, lp, adv, eps_low, eps_high, delta, sapo_pos, sapo_neg,
                 LOSS_KIND: tl.constexpr, HAS_DELTA: tl.constexpr):
    """Policy-gradient term pg and its derivative: dpg/dr (clipped, sapo) or dpg/dlogp (cispo)."""
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
    else:
        tau = tl.where(adv > 0.0, sapo_pos, sapo_neg)
        sig = tl.sigmoid(tau * (r - 1.0))
        pg = -sig * 4.0 / tau * adv
        dpg = -4.0 * sig * (1.0 - sig) * adv
    return pg, dpg


@triton.jit
def _grpo_token_kernel(
    logp_ptr, old_ptr, ref_ptr, adv_ptr, mask_ptr, iw_ptr, entropy_ptr,
    coef_ptr, stats_ptr,
    T, beta, eps_low, eps_high, delta, sapo_pos, sapo_neg, scale,
    LOSS_KIND: tl.constexpr, SEQUENCE: tl.constexpr, ROW_MEAN: tl.constexpr, HAS_DELTA: tl.constexpr,
    HAS_OLD: tl.constexpr, HAS_KL: tl.constexpr, ADV_PER_TOKEN: tl.constexpr,
    HAS_IW: tl.constexpr, IW_PER_TOKEN: tl.constexpr, HAS_ENTROPY: tl.constexpr,
    SEQ_CLIP_METRICS: tl.constexpr, NUM_STATS: tl.constexpr, BLOCK_T: tl.constexpr,
):
    b = tl.program_id(0)
    row = b * T

    # pass 1: the row's mask sum, and for GSPO its mean log-ratio
    count = 0.0
    log_ratio_sum = 0.0
    for t0 in range(0, T, BLOCK_T):
        offs = t0 + tl.arange(0, BLOCK_T)
        in_row = offs < T
        m = tl.load(mask_ptr + row + offs, mask=in_row, other=0.0)
        count += tl.sum(m, axis=0)
        if SEQUENCE:
            if HAS_OLD:
                lp = tl.load(logp_ptr + row + offs, mask=in_row, other=0.0)
                old = tl.load(old_ptr + row + offs, mask=in_row, other=0.0)
                log_ratio_sum += tl.sum(tl.where(m > 0.0, lp - old, 0.0), axis=0)
    length = tl.maximum(count, 1.0)
    row_scale = scale
    if ROW_MEAN:
        row_scale = scale / length
    seq_ratio = tl.exp(log_ratio_sum / length)

    if ADV_PER_TOKEN:
        adv_row = 0.0
    else:
        adv_row = tl.load(adv_ptr + b)
    if HAS_IW:
        if IW_PER_TOKEN:
            iw_row = 1.0
        else:
            iw_row = tl.load(iw_ptr + b)

    # pass 2: per-token loss, coefficient (token part) and metric sums
    loss_sum = 0.0
    kl_sum = 0.0
    entropy_sum = 0.0
    ratio_sum = 0.0
    low_sum = 0.0
    high_sum = 0.0
    region_sum = 0.0
    cispo_sum = 0.0
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
        if HAS_IW:
            if IW_PER_TOKEN:
                iw = tl.load(iw_ptr + row + offs, mask=in_row, other=0.0)
            else:
                iw = tl.zeros((BLOCK_T,), tl.float32) + iw_row
        else:
            iw = tl.full((BLOCK_T,), 1.0, tl.float32)
        if SEQUENCE:
            r = tl.zeros((BLOCK_T,), tl.float32) + seq_ratio
        else:
            if HAS_OLD:
                old = tl.load(old_ptr + row + offs, mask=in_row, other=0.0)
                r = tl.exp(lp - old)
            else:
                r = tl.full((BLOCK_T,), 1.0, tl.float32)
        pg, dpg = _pg_and_grad(r, lp, adv, eps_low, eps_high, delta, sapo_pos, sapo_neg, LOSS_KIND, HAS_DELTA)
        s = tl.where(active, row_scale, 0.0)
        per_token = iw * pg
        coef = tl.zeros((BLOCK_T,), tl.float32)
        if LOSS_KIND == 1:
            coef += s * iw * dpg
        elif SEQUENCE:
            dl_dratio += tl.sum(tl.where(active, s * iw * dpg, 0.0), axis=0)
        else:
            coef += s * iw * dpg * r
        if HAS_KL:
            ref = tl.load(ref_ptr + row + offs, mask=in_row, other=0.0)
            diff = tl.where(active, ref - lp, 0.0)
            kl = tl.exp(diff) - diff - 1.0
            per_token += beta * kl
            coef += s * beta * (1.0 - tl.exp(diff))
            kl_sum += tl.sum(tl.where(active, kl, 0.0), axis=0)
        loss_sum += tl.sum(tl.where(active, s * per_token, 0.0), axis=0)
        tl.store(coef_ptr + row + offs, coef, mask=in_row)

        if HAS_ENTROPY:
            ent = tl.load(entropy_ptr + row + offs, mask=in_row, other=0.0)
            entropy_sum += tl.sum(tl.where(active, ent, 0.0), axis=0)
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

    # pass 3 (GSPO, clipped and sapo): chain dL/dr_b to every token, dr_b/dlogp_t = r_b m_t / L_b
    if SEQUENCE:
        if LOSS_KIND != 1:
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


def grpo_token(logp, advantages, mask, old, ref, importance_weights, entropy, *, loss_kind, sequence, row_mean,
               scale, beta, eps_low, eps_high, delta, sapo_pos, sapo_neg):
    """Launch one program per sequence. All tensors fp32 contiguous on one device; returns (coef, row_stats)."""
    B, T = logp.shape
    coef = torch.empty_like(logp)
    stats = torch.empty((B, NUM_STATS), dtype=torch.float32, device=logp.device)
    adv_per_token = advantages.dim() == 2
    block_t = min(1024, max(16, triton.next_power_of_2(T)))
    _grpo_token_kernel[(B,)](
        logp, old if old is not None else logp, ref if ref is not None else logp, advantages, mask,
        importance_weights if importance_weights is not None else logp, entropy if entropy is not None else logp,
        coef, stats,
        T, float(beta), float(eps_low), float(eps_high), float(delta if delta is not None else 0.0),
        float(sapo_pos), float(sapo_neg), float(scale),
        LOSS_KIND=loss_kind, SEQUENCE=sequence, ROW_MEAN=row_mean, HAS_DELTA=delta is not None,
        HAS_OLD=old is not None, HAS_KL=ref is not None and beta != 0.0, ADV_PER_TOKEN=adv_per_token,
        HAS_IW=importance_weights is not None,
        IW_PER_TOKEN=importance_weights is not None and importance_weights.dim() == 2,
        HAS_ENTROPY=entropy is not None, SEQ_CLIP_METRICS=sequence and not adv_per_token,
        NUM_STATS=NUM_STATS, BLOCK_T=block_t,
    )
    return coef, stats
