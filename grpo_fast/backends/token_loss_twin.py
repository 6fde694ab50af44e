"""The token kernel's torch twin: layer 2's algebra on whole [B, T] tensors, for any torch device.

The same contract as the kernel's launcher (``grpo_fast.kernels.token_loss.token_loss``, whose module docstring has
the math) and computed the same way: the rows' sums first (token count, log-ratio sum, phi's log W, the sampler's
KL), then per token the importance ratio, the policy weight (importance weights, off-policy and top-entropy masks),
the family's term with its closed-form derivative (by the record's ``gradient_wrt``), the KL term and the clip
indicators. Autograd never differentiates it: the token-loss op applies dL/dlogp in its backward.

Nothing is read on the host and nothing is selected by a boolean (``torch.where`` over static shapes): it runs under
torch.compile, FakeTensorMode and on meta tensors. Masked tokens contribute exactly zero, whatever their values; NaN
propagates as in the spec (torch's min / max / clamp).
"""

from __future__ import annotations

import math

import torch

from grpo_fast.kernels.loss_statistics import returned_statistics

LOG_W_FLOOR = math.log(1e-8)  # TRL's clamps of VESPO's log W and of each log-ratio in it
LOG_RATIO_CAP = 20.0
# an upper bound of the [B, T] fp32 temporaries alive at once, every option on (ops.workspace_bytes; a test measures
# the peak under it)
TEMPORARIES = 24


def _clipped(r, lp, adv, phi, o):
    """PPO's term, -min(min(r, delta) A, clamp(r, 1 - eps, 1 + eps_high) A), and dpg/dr (torch.min splits a tie in
    half; clamp passes the gradient on its bounds)."""
    low, high = 1.0 - o.epsilon, 1.0 + o.clip_high
    capped, d_capped = r, adv
    if o.delta is not None:
        capped = torch.clamp(r, max=o.delta)
        d_capped = torch.where(r <= o.delta, adv, 0.0)
    a1 = capped * adv
    a2 = torch.clamp(r, low, high) * adv
    d_clamped = torch.where((r >= low) & (r <= high), adv, 0.0)
    pg = -torch.minimum(a1, a2)
    dpg = -torch.where(a1 < a2, d_capped, torch.where(a2 < a1, d_clamped, 0.5 * (d_capped + d_clamped)))
    return pg, dpg


def _cispo(r, lp, adv, phi, o):
    """-stopgrad(min(r, eps_high)) A logp, and dpg/dlogp."""
    coefficient = -torch.clamp(r, max=o.clip_high) * adv
    return coefficient * lp, coefficient


def _sapo(r, lp, adv, phi, o):
    """-sigmoid(tau (r - 1)) 4 / tau A, tau by the sign of A, and dpg/dr."""
    tau = torch.where(adv > 0.0, o.sapo_temperature_pos, o.sapo_temperature_neg)
    gate = torch.sigmoid(tau * (r - 1.0))
    return -gate * 4.0 / tau * adv, -4.0 * gate * (1.0 - gate) * adv


def _vespo(r, lp, adv, phi, o):
    """-stopgrad(phi) A logp, and dpg/dlogp."""
    coefficient = -phi * adv
    return coefficient * lp, coefficient


# the families of per-token term by the record's policy_term.formula: (r, logp, A, phi, options) -> (pg, dpg)
TERM_FORMULAS = {"clipped": _clipped, "cispo": _cispo, "sapo": _sapo, "vespo": _vespo}


def _gamma_weight(log_w, adv, o):
    """VESPO's phi = exp(lam + k log W - lam W), (k, lam) by the sign of A, 0 where it overflows."""
    nonneg = adv >= 0.0
    k = torch.where(nonneg, o.vespo_k_pos, o.vespo_k_neg)
    lam = torch.where(nonneg, o.vespo_lambda_pos, o.vespo_lambda_neg).clamp(min=1e-4)
    phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w))
    return torch.where(phi == math.inf, 0.0, phi)


def _clip_indicators(r, adv, o, delta):
    """(low, high, cispo): TRL's clip indicators (low and high of the ratio capped at ``delta``, unless None)."""
    capped = torch.clamp(r, max=delta) if delta is not None else r
    return (
        (capped < 1.0 - o.epsilon) & (adv < 0.0),
        (capped > 1.0 + o.clip_high) & (adv > 0.0),
        (r > o.clip_high) & (adv > 0.0),
    )


def _scalar(x):
    """A scale or threshold operand: a device tensor as a 0-d tensor (never read on the host), a number as it is."""
    return x.reshape(()) if isinstance(x, torch.Tensor) else float(x)


def token_loss(inputs, options, *, scale, entropy_threshold):
    """Layer 2 on prepared inputs: the token kernel's launcher's arguments and returns, in torch.

    Args:
        inputs: a ``grpo_fast.kernels.operands.TokenLossInputs`` (fp32 here; any float dtype: it computes in
            logp's).
        options: the loss options (a ``grpo_fast.LossOptions``); its ``loss_type_record`` gives the family of
            per-token term and its facts.
        scale: 1 / the loss's denominator: a number or a one-element device tensor.
        entropy_threshold: the top-entropy mask's threshold (a number or a one-element device tensor), or None
            without that mask.

    Returns:
        ``(grad_logp, bonus_mask, statistics)``: dL/dlogp [B, T] (normalised, 0 at masked tokens); the entropy
        bonus's token mask [B, T] with ``entropy_coef != 0``, else None; ``{statistic: (values [B],
        per_sequence)}`` for those of ``grpo_fast.kernels.loss_statistics.returned_statistics``.

    Raises:
        ValueError: the record's policy term is not one of ``TERM_FORMULAS``.
    """
    logp, advantages, mask, old, ref, sampler, iw, entropy = inputs
    record = options.loss_type_record
    term = record.policy_term
    formula = TERM_FORMULAS.get(term.formula)
    if formula is None:
        raise ValueError(f"loss type {options.loss_type!r} has an unknown policy term {term.formula!r}")
    sequence = options.sequence_level
    has_kl = ref is not None and options.beta != 0.0
    adv = advantages if advantages.dim() == 2 else advantages[:, None]  # [B, T] or [B, 1]

    # the rows' sums (the kernel's pass 1); a masked token's values may be anything: zeroed before any arithmetic
    active = mask > 0
    count = mask.sum(-1)
    length = count.clamp(min=1.0)[:, None]
    lp = torch.where(active, logp, 0.0)
    # on-policy the log-ratio is logp - logp: 0, or NaN at a non-finite log-prob (as torch's logp - logp.detach())
    log_ratio = lp - (torch.where(active, old, 0.0) if old is not None else lp)
    seq_ratio = torch.exp(log_ratio.sum(-1, keepdim=True) / length)  # [B, 1]
    phi = None
    if term.gamma_weighted:
        log_w = torch.clamp(log_ratio, -LOG_RATIO_CAP, LOG_RATIO_CAP).sum(-1, keepdim=True)
        if iw is not None and term.importance_weights_in_term and iw.dim() == 2:
            # every position, padding included: TRL's sum
            log_w = log_w + torch.clamp(torch.log(iw), LOG_W_FLOOR, LOG_RATIO_CAP).sum(-1, keepdim=True)
        phi = _gamma_weight(torch.clamp(log_w, LOG_W_FLOOR, LOG_RATIO_CAP), adv, options)  # [B, 1] or [B, T]

    # per token: the ratio, the policy term's multiplier and the entropy bonus's tokens
    r = seq_ratio.expand_as(lp) if sequence else torch.where(active, torch.exp(log_ratio), 1.0)
    weight = torch.ones_like(lp)
    if iw is not None and not term.importance_weights_in_term:
        weight = weight * (iw if iw.dim() == 2 else iw[:, None])
    if sampler is not None:
        sampler_kl = sampler - lp
        # a token the sampler could not score (NaN) is no evidence: TRL's nan_to_num
        sampler_kl = torch.where(active & ~sampler_kl.isnan(), sampler_kl, 0.0).sum(-1, keepdim=True) / length
        weight = torch.where((adv >= 0.0) | (sampler_kl <= options.off_policy_mask_threshold), weight, 0.0)
    weight = torch.where(active, weight, 0.0)
    ent = torch.where(active, entropy, 0.0) if entropy is not None else torch.zeros_like(lp)
    bonus = mask
    if entropy_threshold is not None:
        high_entropy = active & (ent >= _scalar(entropy_threshold))
        weight = torch.where(high_entropy, weight, 0.0)
        bonus = torch.where(high_entropy, mask, 0.0)

    # the loss and dL/dlogp: s is each token's share of the normaliser
    row_scale = _scalar(scale) / length if record.row_mean else _scalar(scale) + torch.zeros_like(length)
    s = torch.where(active, row_scale, 0.0)
    pg, dpg = formula(r, lp, adv, phi, options)
    per_token = weight * pg
    d_term = s * weight * dpg
    zeros = torch.zeros_like(lp)
    d_ratio = None  # sequence level: dL/dr_b, where r_b carries a gradient; chained to the tokens at the end
    if term.gradient_wrt == "logprob":
        grad_logp = d_term
    elif sequence:
        grad_logp, d_ratio = zeros, torch.where(active, d_term, 0.0).sum(-1, keepdim=True)
    else:
        grad_logp = d_term * r
    kl = zeros
    if has_kl:
        diff = torch.where(active, ref - lp, 0.0)
        kl = torch.exp(diff) - diff - 1.0
        d_kl = 1.0 - torch.exp(diff)
        if options.use_bias_correction_kl:
            # k r: its gradient flows through r (d r / d logp = r per token; the sequence ratio's, chained below)
            if sequence:
                d_kl_ratio = torch.where(active, s * options.beta * kl, 0.0).sum(-1, keepdim=True)
                d_ratio = d_kl_ratio if d_ratio is None else d_ratio + d_kl_ratio
            else:
                d_kl = d_kl + kl
            kl, d_kl = kl * r, d_kl * r
        per_token = per_token + options.beta * kl
        grad_logp = grad_logp + s * options.beta * d_kl
    grad_logp = torch.where(active, grad_logp, 0.0)
    if d_ratio is not None:
        grad_logp = grad_logp + d_ratio * seq_ratio * mask / length  # d r_b / d logp_t = r_b m_t / L_b

    # the statistics: masked sums, or the sequence's own value
    returned = returned_statistics(
        sequence_level=sequence,
        advantages_per_token=advantages.dim() == 2,
        has_kl=has_kl,
        has_entropy=entropy is not None,
        has_phi=term.gamma_weighted,
    )
    # one value per sequence (a sequence ratio with per-sequence advantages): the sequence ratio's own indicators
    clip_ratio = seq_ratio if returned["low"] else r
    delta = options.delta if "delta" in term.options else None  # only a family that reads delta caps the ratio
    low, high, cispo = _clip_indicators(clip_ratio, adv, options, delta)
    indicators = {"low": low, "high": high, "region": low | high, "cispo": cispo}

    def row_sum(x):
        return torch.where(active, x, 0.0).sum(-1)

    def own_or_sum(x, own):
        return x[:, 0].to(lp.dtype) if own else row_sum(x)

    values = {
        "loss": row_sum(s * per_token),
        "count": count,
        "kl": row_sum(kl),
        "entropy": ent.sum(-1),
        "ratio": seq_ratio[:, 0] if sequence else row_sum(r),
        **{name: own_or_sum(x, returned[name]) for name, x in indicators.items()},
        "bonus_count": bonus.sum(-1),
        "bonus_entropy": (bonus * ent).sum(-1),
    }
    if phi is not None:
        values["phi"] = own_or_sum(phi, returned["phi"])
    bonus_mask = bonus if options.entropy_coef != 0.0 else None
    return grad_logp, bonus_mask, {name: (values[name], per_sequence) for name, per_sequence in returned.items()}
