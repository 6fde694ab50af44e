"""The spec: an eager, readable PyTorch GRPO loss that builds the full logits.

Every fused path in grpo_fast is tested against this module, the benchmark uses it as the eager baseline, and
it is itself tested against TRL 1.16.0's own ``GRPOTrainer._compute_loss`` (tests/test_trl_loss.py). It follows
TRL line by line, at one process and no gradient accumulation, so a TRL user gets the same numbers.

It is only the spec: no backend of ``grpo_fast.loss`` runs it (``grpo_fast.sampling_importance_weights``, TRL's per-
batch sampler correction, is this module's function behind the API's checks). The product's layer 1 is the Triton
kernels or the chunked-torch twin (grpo_fast/torch_backend.py), its layer 2 the token kernel or its torch twin
(grpo_fast/token_loss_torch.py), which never build the full logits nor differentiate layer 2 by autograd. What a
loss type is outside its formula (its normaliser, its family of per-token term, its metrics) is its record in
grpo_fast/options.py; the metrics are reduced from per-sequence sums by grpo_fast/metrics.py, as for the product.

Two layers, the same as the fused paths:
  1. ``logprobs_and_entropy``: hidden states and lm_head -> per-token log-prob of the target and entropy.
  2. ``token_loss``: per-token log-probs (+ entropy, old / ref / sampler log-probs, advantages, mask) -> loss, metrics.

Layer 1, the logit of vocabulary entry v (TRL 1.16's fused head applies the transforms in this order):
    z_v = softcap * tanh(logit_scale * (h . W_v + b_v) / softcap) / temperature     (no tanh when softcap is None)
    with LoRA on the head (PEFT's lora_A = A [r, D], lora_B = B [V, r]): h . W_v + l . B_v inside, where
    l = scaling * dropout(h) A^T [r] is computed in the adapters' dtype (PEFT's lora_A activation, rounded as PEFT
    rounds it) and l . B_v in the logits' dtype
    logp = z_y - logsumexp(z),   entropy = -sum_v p_v log p_v,   p = softmax(z)

Layer 2 (r: importance ratio, A: advantage, m: completion mask, w: importance weights):
  token level     r_t = exp(logp_t - old_t)
  sequence level  r_b = exp(sum_t m_t (logp_t - old_t) / max(sum_t m_t, 1))         (GSPO)
  clipped family  l_t = -min(min(r, delta) * A, clamp(r, 1 - eps, 1 + eps_high) * A)  (grpo bnpo dr_grpo dapo luspo)
  cispo           l_t = -stopgrad(min(r, eps_high)) * A * logp_t
  sapo            l_t = -sigmoid(tau (r - 1)) * 4 / tau * A,  tau = tau_pos if A > 0 else tau_neg
  vespo           l_t = -stopgrad(phi_b) * A * logp_t,  phi = exp(lam + k log W - lam W) (gamma weight, phi(1) = 1),
                  W = exp(clamp(sum_t m_t clamp(logp_t - old_t, -20, 20) + sum_t log w_t, log 1e-8, 20)),
                  (k, lam) = (k_pos, lam_pos) if A >= 0 else (k_neg, lam_neg)
  masks           l_t *= off-policy keep_b (A >= 0 or mean_t KL(sampler || policy) <= threshold), NaN sampler = 0
                  l_t *= 1[entropy_t >= quantile_{1 - top_entropy_quantile}(masked entropies)]
  then            l_t = w_t * l_t (not vespo) + beta * k_t,  k_t = (exp(ref_t - logp_t) - (ref_t - logp_t) - 1) * r
                  (the factor r only with use_bias_correction_kl, its gradient included)
  normalisation   grpo, sapo: mean_b(sum_t m l / max(sum_t m, 1));  bnpo: sum m l / max(sum m, 1)
                  dr_grpo: sum m l / (B * max_completion_length);  dapo, cispo, vespo: sum m l / max(num_items, 1)
                  luspo: mean_b(sum_t m l)
  entropy bonus   loss -= entropy_coef * sum_t e_t H_t / max(sum_t e_t, 1),  e = m * the entropy mask
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from grpo_fast.grpo_loss.metrics import loss_metrics, row_values
from grpo_fast.grpo_loss.options import LOSS_TYPES, LossOptions  # noqa: F401 (LOSS_TYPES: for readers)
from grpo_fast.head.transform import LogitTransform


def logits(hidden, weight, bias=None, temperature=1.0, *, softcap=None, logit_scale=1.0, fp32_matmul=True,
           compute_dtype=torch.float32, lora=None, transform=None):  # fmt: skip
    """``softcap * tanh(logit_scale * (hidden @ weight.T + bias) / softcap) / temperature`` in ``compute_dtype``,
    with ``lora`` (a grpo_fast.HeadLora or None) adding PEFT's ``scaling * (dropout(hidden) @ a.T) @ b.T`` to the
    raw logits: its [.., r] activation in the adapters' dtype (PEFT's), its product with b in ``compute_dtype``
    with ``fp32_matmul``, else in the adapters' dtype.

    With ``fp32_matmul`` (the spec) the matmul itself runs in ``compute_dtype`` (fp32; the tests use fp64 as a
    stricter truth); without it, the matmul runs in the input dtype (bf16 logits, as a model's lm_head produces them
    in a TRL training step) and is upcast after: the benchmark's eager baseline, on tensor cores.
    ``transform`` (a grpo_fast.head.transform.LogitTransform) replaces the three keywords when given.
    """
    transform = transform or LogitTransform(temperature, softcap, logit_scale)
    if fp32_matmul:
        z = hidden.to(compute_dtype) @ weight.to(compute_dtype).T
    else:
        z = (hidden @ weight.T).to(compute_dtype)
    if lora is not None:
        x = hidden.to(lora.a.dtype)
        activation = lora.scaling * ((lora.dropout(x) if lora.dropout is not None else x) @ lora.a.T)
        if fp32_matmul:
            z = z + activation.to(compute_dtype) @ lora.b.to(compute_dtype).T
        else:
            z = z + (activation @ lora.b.T).to(compute_dtype)
    if bias is not None:
        z = z + bias.to(compute_dtype)
    return transform.apply(z)


def logprobs_and_entropy(hidden, weight, targets, bias=None, temperature=1.0, *, softcap=None, logit_scale=1.0,
                         fp32_matmul=True, compute_dtype=torch.float32, lora=None, transform=None):  # fmt: skip
    """Full-logits log-prob of each target and entropy of each row, both fp32 with the shape of ``targets``.

    Both are differentiable (the entropy too: TRL's entropy bonus trains through it). See ``logits``.
    """
    transform = transform or LogitTransform(temperature, softcap, logit_scale)
    z = logits(
        hidden, weight, bias, fp32_matmul=fp32_matmul, compute_dtype=compute_dtype, lora=lora, transform=transform
    )
    logsoftmax = F.log_softmax(z, dim=-1)
    logp = logsoftmax.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    p = logsoftmax.exp()
    # p log p is 0 where p is 0 (a -inf logit), not 0 * -inf, and so is its gradient
    entropy = -(p * logsoftmax.masked_fill(p == 0, 0.0)).sum(-1)
    return logp.float(), entropy.float()


def logprobs(hidden, weight, targets, bias=None, temperature=1.0, *, softcap=None, logit_scale=1.0,
             fp32_matmul=True, compute_dtype=torch.float32, lora=None, transform=None):  # fmt: skip
    """Per-token log-prob of ``targets`` (see ``logits``); no grad."""
    with torch.no_grad():
        return logprobs_and_entropy(
            hidden,
            weight,
            targets,
            bias,
            fp32_matmul=fp32_matmul,
            compute_dtype=compute_dtype,
            lora=lora,
            transform=transform or LogitTransform(temperature, softcap, logit_scale),
        )[0]


def sampling_importance_weights(
    old_logprobs, sampling_logprobs, completion_mask, mode="sequence_mask", clip_max=3.0, clip_min=None
):
    """TRL's importance-sampling correction for a sampler (vLLM) that is not the trained policy.

    ``rho = exp(old - sampling)`` per token (``token_*``: [B, T]) or ``exp(sum_t m_t (old_t - sampling_t))`` per
    sequence (``sequence_*``: [B, 1]); ``*_truncate`` clamps rho to [clip_min, clip_max], ``*_mask`` sets rho outside
    it to 0. A NaN sampler log-prob (a token the sampler could not score) contributes a zero difference (rho 1).
    """
    mask = completion_mask.to(torch.float32)
    diff = torch.nan_to_num((old_logprobs.float() - sampling_logprobs.float()) * mask, nan=0.0)
    if mode.startswith("sequence"):
        diff = diff.sum(-1, keepdim=True)
    rho = torch.exp(diff)
    if mode.endswith("truncate"):
        return torch.clamp(rho, min=clip_min, max=clip_max)
    low = -math.inf if clip_min is None else clip_min
    high = math.inf if clip_max is None else clip_max
    return rho.masked_fill((rho < low) | (rho > high), 0.0)


def entropy_quantile_threshold(entropy, completion_mask, top_entropy_quantile):
    """The entropy at quantile ``1 - top_entropy_quantile`` of the masked entropies (None when no token is masked in).

    One process; TRL gathers the masked entropies of every process first (see grpo_fast.loss's entropy_threshold).
    """
    values = entropy.detach().float()[completion_mask.bool()]
    if values.numel() == 0:
        return None
    return torch.quantile(values, 1.0 - top_entropy_quantile)


def gamma_weights(advantages, log_ratio, mask, importance_weights, k_pos, lambda_pos, k_neg, lambda_neg):
    """VESPO's detached sequence weight phi(W) = exp(lam + k log W - lam W) [B, 1] (or [B, T] for per-token A)."""
    log_floor = math.log(1e-8)
    seq_log_ratio = (torch.clamp(log_ratio, -20.0, 20.0) * mask).sum(-1, keepdim=True)
    if importance_weights is not None:
        # over every position, padding included, as TRL (its sampler ratios are 1 there unless clip_min > 1 or
        # clip_max < 1 clamp or mask them)
        log_iw = torch.clamp(torch.log(importance_weights), log_floor, 20.0)
        seq_log_ratio = seq_log_ratio + log_iw.sum(-1, keepdim=True)
    log_w = torch.clamp(seq_log_ratio, log_floor, 20.0)
    nonneg = advantages >= 0
    k = torch.where(nonneg, k_pos, k_neg)
    lam = torch.where(nonneg, lambda_pos, lambda_neg).clamp(min=1e-4)
    phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w))
    # TRL's nan_to_num(nan=0, posinf=0): an overflow gives 0; a NaN comes only from a NaN input and stays (TRL's 0
    # would hide it from the loss)
    return phi.masked_fill(torch.isinf(phi), 0.0).detach()


def token_loss(
    logp,
    advantages,
    completion_mask,
    options=None,
    *,
    entropy=None,
    old_logprobs=None,
    ref_logprobs=None,
    sampling_logprobs=None,
    importance_weights=None,
    num_items_in_batch=None,
    entropy_threshold=None,
    **loss_options,
):
    """GRPO loss and metrics from per-token log-probs ``logp`` [B, T] (differentiable), as TRL 1.16 computes them.

    ``entropy`` [B, T] (differentiable when ``entropy_coef != 0``) feeds the ``entropy`` metric, the top-entropy
    mask and the entropy bonus. Returns ``(loss, metrics)``: a scalar and a dict of detached fp32 scalars. It
    computes in fp32, or in fp64 for fp64 log-probs (a stricter truth for the tests).
    """
    o = LossOptions.resolve(options, loss_options, "token_loss")
    dtype = torch.promote_types(logp.dtype, torch.float32)
    mask = completion_mask.to(dtype)
    epsilon_low, epsilon_high, beta = o.epsilon, o.clip_high, o.beta
    term = o.loss_type_record.policy_term
    policy_term = term.formula  # TRL dispatches on loss_type; its record names the formula
    logp = logp.to(dtype)
    old = logp.detach() if old_logprobs is None else old_logprobs.to(dtype)
    advantages = advantages.to(dtype)
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)
    if importance_weights is not None:
        importance_weights = importance_weights.to(dtype)
        if importance_weights.dim() == 1:
            importance_weights = importance_weights.unsqueeze(1)

    entropy_mask = None
    if o.top_entropy_quantile < 1.0:
        threshold = (
            entropy_quantile_threshold(entropy, mask, o.top_entropy_quantile)
            if entropy_threshold is None
            else torch.as_tensor(entropy_threshold, dtype=torch.float32)
        )
        if threshold is None:
            entropy_mask = torch.zeros_like(mask, dtype=torch.bool)
        else:
            entropy_mask = ((entropy.detach().float() * mask) >= threshold) & mask.bool()

    if o.off_policy_mask_threshold is not None:
        sampler = old if sampling_logprobs is None else sampling_logprobs.to(dtype)
        kl_div = torch.nan_to_num(sampler - logp.detach(), nan=0.0)
        avg_seq_kl = (kl_div * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1.0)
        off_policy_mask = ((advantages >= 0) | (avg_seq_kl <= o.off_policy_mask_threshold)).to(dtype)

    log_ratio = logp - old
    if o.sequence_level:
        log_importance_weights = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    else:
        log_importance_weights = log_ratio
    # TRL's names: coef_1 is the importance ratio r, coef_2 (below) the clipped ratio clamp(r, 1 - eps, 1 + eps_high)
    coef_1 = torch.exp(log_importance_weights)
    ratio = coef_1  # before delta: the ratio_mean metric reports the importance ratio itself

    if beta != 0.0:
        ref = ref_logprobs.to(dtype)
        per_token_kl = torch.exp(ref - logp) - (ref - logp) - 1
        if o.use_bias_correction_kl:
            per_token_kl = per_token_kl * coef_1

    phi_seq = None
    if policy_term == "cispo":
        clamped_ratios = torch.clamp(coef_1, max=epsilon_high).detach()
        per_token_loss = -clamped_ratios * advantages * logp
    elif policy_term == "clipped":
        coef_2 = torch.clamp(coef_1, 1 - epsilon_low, 1 + epsilon_high)
        if o.delta is not None:
            coef_1 = torch.clamp(coef_1, max=o.delta)
        per_token_loss = -torch.min(coef_1 * advantages, coef_2 * advantages)
    elif policy_term == "sapo":
        temperatures = torch.where(advantages > 0, o.sapo_temperature_pos, o.sapo_temperature_neg)
        per_token_loss = -torch.sigmoid(temperatures * (coef_1 - 1)) * 4 / temperatures * advantages
    elif policy_term == "vespo":
        phi_seq = gamma_weights(
            advantages,
            log_ratio,
            mask,
            importance_weights if term.importance_weights_in_term else None,
            o.vespo_k_pos,
            o.vespo_lambda_pos,
            o.vespo_k_neg,
            o.vespo_lambda_neg,
        )
        per_token_loss = -phi_seq * advantages * logp
    else:
        raise ValueError(f"loss type {o.loss_type!r} has an unknown policy term {policy_term!r}")
    if term.importance_weights_in_term and phi_seq is None:
        raise ValueError(
            f"loss type {o.loss_type!r} puts the importance weights in its term, but the "
            f"{policy_term!r} term does not read them (only 'vespo' does)"
        )

    if o.off_policy_mask_threshold is not None:
        per_token_loss = per_token_loss * off_policy_mask
    if entropy_mask is not None:
        per_token_loss = per_token_loss * entropy_mask
    if importance_weights is not None and not term.importance_weights_in_term:
        per_token_loss = per_token_loss * importance_weights
    if beta != 0.0:
        per_token_loss = per_token_loss + beta * per_token_kl

    loss = o.aggregate(per_token_loss, mask, num_items_in_batch)
    policy_loss = loss.detach()
    if o.entropy_coef != 0.0:
        effective_mask = mask if entropy_mask is None else mask * entropy_mask
        loss = loss - o.entropy_coef * (entropy.to(dtype) * effective_mask).sum() / effective_mask.sum().clamp(min=1.0)

    # Log the metrics: TRL's quantities, reduced by grpo_fast.grpo_loss.metrics from per-sequence sums as for the token kernel
    # (each loss type's own metrics are named by its record)
    with torch.no_grad():
        is_low_clipped = (coef_1 < 1 - epsilon_low) & (advantages < 0)
        is_high_clipped = (coef_1 > 1 + epsilon_high) & (advantages > 0)
        quantities = {
            "ratio": ratio,
            "low": is_low_clipped,
            "high": is_high_clipped,
            "region": is_low_clipped | is_high_clipped,
            "cispo": (coef_1 > epsilon_high) & (advantages > 0),
        }
        if beta != 0.0:
            quantities["kl"] = per_token_kl
        if entropy is not None:
            quantities["entropy"] = entropy
        if phi_seq is not None:
            quantities["phi"] = phi_seq
        rows = {name: row_values(x, mask) for name, x in quantities.items()}
        metrics = loss_metrics(o, rows, mask.sum(-1), policy_loss)
    return loss, metrics


def loss(hidden, weight, targets, advantages, completion_mask, options=None, *, bias=None, temperature=1.0,
         softcap=None, logit_scale=1.0, fp32_matmul=True, compute_dtype=torch.float32, lora=None,
         **kwargs):  # fmt: skip
    """The eager GRPO loss from hidden states: full logits, then ``token_loss``. Same arguments as grpo_fast.loss
    (the loss options as ``options`` or keywords)."""
    logp, entropy = logprobs_and_entropy(
        hidden,
        weight,
        targets,
        bias,
        temperature,
        softcap=softcap,
        logit_scale=logit_scale,
        fp32_matmul=fp32_matmul,
        compute_dtype=compute_dtype,
        lora=lora,
    )
    return token_loss(logp, advantages, completion_mask, options, entropy=entropy, **kwargs)


# ----------------------------------------------------------------------------------------------- divergence
# The student-teacher divergence of on-policy distillation (TRL 1.16's DistillationTrainer and its head,
# trl/kernels/chunked_divergence.py), from both models' hidden states and heads, with the full logits. Each model's
# logit is  z = softcap * tanh(logit_scale * (h . W_v + b_v) / softcap) / temperature  (its own soft-cap and scale,
# one temperature for both: TRL's order), p = softmax(z), and per token, with m = (1 - beta) p_s + beta p_t:
#     beta = 0       forward KL   KL(p_t || p_s) = sum_v p_t (log p_t - log p_s)
#     beta = 1       reverse KL   KL(p_s || p_t) = sum_v p_s (log p_s - log p_t)        (TRL's default)
#     0 < beta < 1   generalized JSD   beta KL(p_t || m) + (1 - beta) KL(p_s || m)
# An entry of probability 0 (a -inf logit) adds 0 (0 log 0 = 0), and so does its gradient; the student's entropy
# is -sum_v p_s log p_s. Masked tokens are exact zeros.


def _transformed_logits(hidden, weight, bias, transform, compute_dtype):
    u = hidden.to(compute_dtype) @ weight.to(compute_dtype).T
    if bias is not None:
        u = u + bias.to(compute_dtype)
    return transform.apply(u)


def _expected_log_ratio(p, log_p, log_q):
    """sum_v p_v (log p_v - log q_v), with 0 where p_v is 0 (value and gradient)."""
    return (p * (log_p - log_q).masked_fill(p == 0, 0.0)).sum(-1)


def divergence_and_entropy(student_hidden, student_weight, teacher_hidden, teacher_weight, completion_mask=None, *,
                           beta=1.0, temperature=1.0, student_bias=None, teacher_bias=None, student_softcap=None,
                           teacher_softcap=None, student_logit_scale=1.0, teacher_logit_scale=1.0,
                           compute_dtype=torch.float32):  # fmt: skip
    """Per-token divergence and student entropy [B, T] in ``compute_dtype`` from the full logits of both models
    (the section's comment gives the math); both differentiable (the teacher's tensors too, if they require it:
    the fused op stops there). Hidden sizes may differ; the vocabularies must match."""
    student = LogitTransform(temperature, student_softcap, student_logit_scale)
    teacher = LogitTransform(temperature, teacher_softcap, teacher_logit_scale)
    log_ps = F.log_softmax(
        _transformed_logits(student_hidden, student_weight, student_bias, student, compute_dtype), dim=-1
    )
    log_pt = F.log_softmax(
        _transformed_logits(teacher_hidden, teacher_weight, teacher_bias, teacher, compute_dtype), dim=-1
    )
    ps, pt = log_ps.exp(), log_pt.exp()
    if beta == 0.0:
        div = _expected_log_ratio(pt, log_pt, log_ps)
    elif beta == 1.0:
        div = _expected_log_ratio(ps, log_ps, log_pt)
    else:
        log_m = torch.logaddexp(log_ps + math.log(1.0 - beta), log_pt + math.log(beta))
        div = beta * _expected_log_ratio(pt, log_pt, log_m) + (1.0 - beta) * _expected_log_ratio(ps, log_ps, log_m)
    entropy = -_expected_log_ratio(ps, log_ps, torch.zeros_like(log_ps))
    if completion_mask is not None:
        keep = completion_mask.bool()
        div, entropy = div.masked_fill(~keep, 0.0), entropy.masked_fill(~keep, 0.0)
    return div, entropy


def divergence(student_hidden, student_weight, teacher_hidden, teacher_weight, completion_mask=None, **kwargs):
    """The per-token divergence alone (``divergence_and_entropy``)."""
    return divergence_and_entropy(
        student_hidden, student_weight, teacher_hidden, teacher_weight, completion_mask, **kwargs
    )[0]


def loss_with_teacher(
    hidden,
    weight,
    targets,
    advantages,
    completion_mask,
    teacher_hidden,
    teacher_weight,
    options=None,
    *,
    distillation_coef,
    distillation_beta=1.0,
    teacher_bias=None,
    teacher_softcap=None,
    teacher_logit_scale=1.0,
    bias=None,
    temperature=1.0,
    softcap=None,
    logit_scale=1.0,
    compute_dtype=torch.float32,
    **kwargs,
):
    """RL and distillation in one loss (grpo_fast.loss with ``teacher=``): the per-token GRPO loss plus
    ``distillation_coef`` times the divergence (``distillation_beta``), reduced by the loss type's reduction, which
    is linear: ``loss`` + coef * the reduced divergence. Metrics: ``loss``'s plus ``distillation_loss``, the mean
    divergence over the mask's tokens.

    Args:
        hidden, weight, targets, advantages, completion_mask: as ``loss``.
        teacher_hidden, teacher_weight: the teacher's [B, T, Dt] and [V, Dt].
        options: the loss options (or as keywords in ``kwargs``, with ``loss``'s batch inputs).
        distillation_coef: the divergence's weight in the per-token loss.
        distillation_beta: ``divergence_and_entropy``'s beta.
        teacher_bias, teacher_softcap, teacher_logit_scale: the teacher's head (one temperature for both).
        bias, temperature, softcap, logit_scale: the student's head.
        compute_dtype: the logits' dtype (float64: the truth the kernels are tested against).

    Returns:
        (loss, metrics): a scalar and a dict of detached fp32 scalars.
    """
    from grpo_fast.grpo_loss.options import FIELD_NAMES  # here: the module's imports belong to its token-loss part

    options = LossOptions.resolve(
        options, {k: kwargs.pop(k) for k in list(kwargs) if k in FIELD_NAMES}, "loss_with_teacher"
    )
    total, metrics = loss(
        hidden,
        weight,
        targets,
        advantages,
        completion_mask,
        options,
        bias=bias,
        temperature=temperature,
        softcap=softcap,
        logit_scale=logit_scale,
        compute_dtype=compute_dtype,
        **kwargs,
    )
    div = divergence(
        hidden,
        weight,
        teacher_hidden,
        teacher_weight,
        completion_mask,
        beta=distillation_beta,
        temperature=temperature,
        student_bias=bias,
        teacher_bias=teacher_bias,
        student_softcap=softcap,
        teacher_softcap=teacher_softcap,
        student_logit_scale=logit_scale,
        teacher_logit_scale=teacher_logit_scale,
        compute_dtype=compute_dtype,
    )
    mask = completion_mask.bool()
    total = total + distillation_coef * options.aggregate(div, completion_mask, kwargs.get("num_items_in_batch"))
    metrics["distillation_loss"] = (torch.where(mask, div, 0.0).sum() / mask.sum().clamp(min=1)).detach().float()
    return total, metrics
