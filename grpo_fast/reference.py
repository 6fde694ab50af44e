"""The spec: every formula of grpo_fast in readable, eager PyTorch that builds the full logits, independent of the
product (it imports the loss options' record, no formula and no reducer).

Every fused path is tested against it (in fp64: a stricter truth), the benchmark runs it as the eager baseline, and
it follows TRL 1.16.0's ``GRPOTrainer._compute_loss`` at one process without gradient accumulation (a test runs it
beside TRL's own), so a TRL user gets the same numbers. No backend of ``grpo_fast.loss`` runs it.

Two layers, as in the product:
    ``logprobs_and_entropy``: hidden states and lm_head -> each target's log-prob and each row's entropy.
    ``token_loss``: per-token log-probs (+ entropy, old / ref / sampler log-probs, advantages, mask) -> loss and
    TRL's metrics; the loss type's record names its family of term, normaliser and metrics, whose formulas,
    reductions and reducers are written here.
And the student-teacher divergence of on-policy distillation (``divergence_and_entropy``, ``loss_with_teacher``).
"""

from __future__ import annotations

import inspect
import math

import torch
import torch.nn.functional as F

from grpo_fast.grpo_loss.options import FIELD_NAMES, LOSS_TYPES, LossOptions  # noqa: F401 (LOSS_TYPES: for readers)


def logits(
    hidden,
    weight,
    bias=None,
    temperature=1.0,
    *,
    softcap=None,
    logit_scale=1.0,
    fp32_matmul=True,
    compute_dtype=torch.float32,
    lora=None,
    transform=None,
):
    """The transformed logits z of every vocabulary entry, in ``compute_dtype``.

    z_v = softcap * tanh(logit_scale * (h . W_v + b_v) / softcap) / temperature (no tanh when softcap is None; TRL
    1.16's fused head applies the transforms in this order). With LoRA on the head (PEFT's lora_A = a [r, D], lora_B
    = b [V, r]), h . W_v gains l . b_v, where l = scaling * dropout(h) a^T [r] is computed in the adapters' dtype (as
    PEFT rounds it) and l . b_v in ``compute_dtype`` with ``fp32_matmul``, else in the adapters' dtype.

    With ``fp32_matmul`` (the spec) the matmul itself runs in ``compute_dtype`` (fp32; the tests use fp64 as a
    stricter truth); without it, the matmul runs in the input dtype (bf16 logits, as a model's lm_head produces them
    in a TRL training step) and is upcast after: the benchmark's eager baseline, on tensor cores.

    Args:
        hidden: [..., D] hidden states.
        weight: the lm_head's [V, D] weight.
        bias: its [V] bias, or None.
        temperature: the sampling temperature.
        softcap: the logit soft-cap, or None.
        logit_scale: the logit scale.
        fp32_matmul: the matmul in ``compute_dtype`` (else in the input dtype, upcast after).
        compute_dtype: the logits' dtype.
        lora: a ``grpo_fast.HeadLora``, or None.
        transform: a ``grpo_fast.head.transform.LogitTransform`` whose three numbers replace temperature, softcap
            and logit_scale; None: theirs.

    Returns:
        The logits [..., V] in ``compute_dtype``.
    """
    if transform is not None:
        temperature, softcap, logit_scale = transform.temperature, transform.softcap, transform.logit_scale
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
    return transformed(z, temperature, softcap, logit_scale)


def transformed(u, temperature=1.0, softcap=None, logit_scale=1.0):
    """softcap * tanh(logit_scale * u / softcap) / temperature from raw logits u (no tanh when softcap is None)."""
    z = u * logit_scale
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    return z / temperature


# logits' keywords besides the head's tensors (the transform, the precision, LoRA): what ``loss`` hands to layer 1
HEAD_KEYWORDS = ("temperature",) + tuple(
    name for name, parameter in inspect.signature(logits).parameters.items() if parameter.kind is parameter.KEYWORD_ONLY
)


def logprobs_and_entropy(hidden, weight, targets, bias=None, temperature=1.0, **head):
    """Each target's log-prob and each row's entropy from the full logits (``logits``).

    logp = z_y - logsumexp(z), entropy = -sum_v p_v log p_v with p = softmax(z); both differentiable (the entropy
    too: TRL's entropy bonus trains through it).

    Args:
        hidden: [..., D] hidden states.
        weight: the lm_head's [V, D] weight.
        targets: the target ids [...] (int64).
        bias: the lm_head's [V] bias, or None.
        temperature: the sampling temperature.
        **head: ``logits``' other keywords (softcap, logit_scale, fp32_matmul, compute_dtype, lora, transform).

    Returns:
        (logp, entropy), fp32 with the shape of ``targets``.
    """
    logsoftmax = F.log_softmax(logits(hidden, weight, bias, temperature, **head), dim=-1)
    logp = logsoftmax.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    p = logsoftmax.exp()
    # p log p is 0 where p is 0 (a -inf logit), not 0 * -inf, and so is its gradient
    entropy = -(p * logsoftmax.masked_fill(p == 0, 0.0)).sum(-1)
    return logp.float(), entropy.float()


def logprobs(hidden, weight, targets, bias=None, temperature=1.0, **head):
    """Each target's log-prob, ``logprobs_and_entropy``'s (the same arguments), without a gradient."""
    with torch.no_grad():
        return logprobs_and_entropy(hidden, weight, targets, bias, temperature, **head)[0]


def kept_mask(z, top_k=0, top_p=1.0, min_p=0.0):
    """The entries a sampler with vLLM 0.32's rules may draw from, for logits ``z`` [..., V] already divided by the
    temperature: bool [..., V].

    In vLLM's order: min-p keeps v where p_v >= min_p * max_u p_u (p = softmax(z)); top-k keeps the survivors whose
    logit is at least the k-th largest surviving one (every entry tied with the k-th is kept, as vLLM's CPU path
    does); top-p, over the survivors' renormalised distribution q, keeps v where the mass of the survivors with a
    logit strictly above z_v is below ``top_p`` (the top entry always; entries tied at the threshold all kept, where
    vLLM's sort keeps an order-dependent part of them). Every rule keeps the largest logits, so the kept set is
    {v : z_v >= tau} for one threshold tau a row. ``min_p`` 0, ``top_k`` 0 or -1 and ``top_p`` 1 disable a rule.
    """
    keep = torch.ones_like(z, dtype=torch.bool)
    if min_p > 0:
        p = torch.softmax(z, dim=-1)
        keep &= p >= min_p * p.amax(dim=-1, keepdim=True)
    if 0 < top_k < z.shape[-1]:
        kth = z.masked_fill(~keep, -math.inf).topk(top_k, dim=-1).values[..., -1:]
        keep &= z >= kth
    if top_p < 1:
        q = torch.softmax(z.masked_fill(~keep, -math.inf), dim=-1)
        values, order = z.masked_fill(~keep, -math.inf).sort(dim=-1, descending=True)
        q_sorted = q.gather(-1, order)
        above = q_sorted.cumsum(-1) - q_sorted  # mass ranked above each entry of the sorted row
        # ties: an entry's mass strictly above is the one at the first entry of its tie group
        index = torch.arange(z.shape[-1], device=z.device).expand_as(values)
        first = torch.ones_like(values, dtype=torch.bool)
        first[..., 1:] = values[..., 1:] != values[..., :-1]
        group_start = torch.where(first, index, 0).cummax(dim=-1).values
        strictly_above = above.gather(-1, group_start)
        keep &= torch.zeros_like(keep).scatter(-1, order, strictly_above < top_p)
    return keep


def sampler_logprobs(
    hidden, weight, targets, bias=None, temperature=1.0, *, top_k=0, top_p=1.0, min_p=0.0, kept_ids=None, **head
):
    """Each target's log-prob over the whole vocabulary and over the sampler's kept set, and their difference.

    logp = z_y - logsumexp_v(z_v) (``logprobs``), support_logp = z_y - logsumexp_{v kept}(z_v) (what vLLM's
    ``processed_logprobs`` returns), log_kept_mass = logp - support_logp = log sum_{v kept} p_v <= 0. The kept set is
    ``kept_mask`` of the logits z (temperature included) under the sampling parameters, or the replayed ``kept_ids``
    [..., K] (-1: no entry). A target outside its kept set (the sampler could not have drawn it) gets NaN support.

    Args:
        hidden, weight, targets, bias, temperature, **head: as ``logprobs_and_entropy``.
        top_k, top_p, min_p: the sampling parameters (``kept_mask``).
        kept_ids: [..., K] integer kept sets, -1 filling, or None.

    Returns:
        (logp, support_logp, log_kept_mass), fp32 with the shape of ``targets``; logp and support_logp
        differentiable.
    """
    z = logits(hidden, weight, bias, temperature, **head)
    if kept_ids is None:
        keep = kept_mask(z.detach(), top_k, top_p, min_p)
    else:
        # the filling (-1) goes to a column past the vocabulary, dropped after
        columns = torch.where(kept_ids >= 0, kept_ids, z.shape[-1]).long()
        keep = torch.zeros((*z.shape[:-1], z.shape[-1] + 1), dtype=torch.bool, device=z.device)
        keep = keep.scatter(-1, columns, True)[..., :-1]
    target = z.gather(-1, targets.unsqueeze(-1).long()).squeeze(-1)
    logp = target - torch.logsumexp(z, dim=-1)
    support = target - torch.logsumexp(z.masked_fill(~keep, -math.inf), dim=-1)
    drawable = keep.gather(-1, targets.unsqueeze(-1).long()).squeeze(-1)
    support = torch.where(drawable, support, math.nan)
    return logp.float(), support.float(), (logp - support).float()


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


def aggregate(per_token_loss, completion_mask, options, num_items_in_batch=None):
    """The loss type's reduction of a per-token loss (TRL's, at one process without gradient accumulation).

    By the record's normaliser, with l the per-token loss and m the mask (each sequence's sum first divided by its
    own token count max(sum_t m, 1) with the record's ``row_mean``: grpo, sapo):
        sequences               sum_b (sum_t m l) / B                       (grpo, sapo, luspo)
        tokens                  sum m l / max(sum m, 1)                      (bnpo)
        max_completion_length   sum m l / (B * max_completion_length)        (dr_grpo)
        num_items_in_batch      sum m l / max(num_items_in_batch, 1), by default the mask's sum (dapo, cispo, vespo)
    A masked token adds 0 whatever its value (selected out where TRL multiplies by m: a NaN there changes nothing).

    Args:
        per_token_loss: [B, T].
        completion_mask: [B, T] bool or 0 / 1.
        options: the LossOptions.
        num_items_in_batch: a number or a one-element tensor, or None.

    Returns:
        The loss, a scalar in per_token_loss's dtype.

    Raises:
        ValueError: the record's normaliser is not one of the four.
    """
    mask = completion_mask.to(per_token_loss.dtype)
    record = options.loss_type_record
    per_sequence = torch.where(mask.bool(), per_token_loss, 0.0).sum(-1)
    if record.row_mean:
        per_sequence = per_sequence / mask.sum(-1).clamp(min=1.0)
    total = per_sequence.sum()
    if record.normaliser == "sequences":
        return total / mask.shape[0]
    if record.normaliser == "tokens":
        return total / mask.sum().clamp(min=1.0)
    if record.normaliser == "max_completion_length":
        return total / (mask.shape[0] * options.max_completion_length)
    if record.normaliser == "num_items_in_batch":
        count = mask.sum() if num_items_in_batch is None else torch.as_tensor(num_items_in_batch).to(mask)
        return total / count.clamp(min=1.0)
    raise ValueError(f"loss type {options.loss_type!r} has an unknown normaliser {record.normaliser!r}")


def global_masked_mean(x, mask):
    """TRL's global masked mean: over the mask's tokens for x [B, T], over the sequences for x [B, 1] (one value per
    sequence: TRL's test is the shape, so with T = 1 every quantity counts as one per sequence)."""
    x = x.to(mask.dtype)
    if x.shape[1] == 1:
        return x.sum() / x.shape[0]
    return (x * mask).sum() / mask.sum().clamp(min=1.0)


def sequence_means(x, mask):
    """TRL's masked_seq_mean: each sequence's masked mean [B] (NaN for a sequence without tokens), or for x [B, 1]
    the sequence's own value."""
    x = x.to(mask.dtype)
    if x.shape[1] == 1:
        return x.squeeze(1)
    return (x * mask).sum(-1) / mask.sum(-1)


def nan_reduce(values, reduce):
    """TRL's nanmin / nanmax (``reduce``: torch.min / torch.max) over the values that are not NaN; NaN if none is."""
    kept = values[~values.isnan()]
    return reduce(kept) if kept.numel() else values.new_tensor(math.nan)


# Metric.reduce -> the spec's reducer of a quantity [B, T] or [B, 1] and the mask (TRL's)
REDUCERS = {
    "mean": global_masked_mean,
    "min_over_sequences": lambda x, mask: nan_reduce(sequence_means(x, mask), torch.min),
    "max_over_sequences": lambda x, mask: nan_reduce(sequence_means(x, mask), torch.max),
}


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
    """The GRPO loss and TRL's metrics from per-token log-probs, as TRL 1.16 computes them.

    With r the importance ratio, A the advantage, m the mask and w the importance weights:
        token level     r_t = exp(logp_t - old_t)
        sequence level  r_b = exp(sum_t m_t (logp_t - old_t) / max(sum_t m_t, 1))            (GSPO)
        clipped         l_t = -min(min(r, delta) A, clamp(r, 1 - eps, 1 + eps_high) A)
        cispo           l_t = -stopgrad(min(r, eps_high)) A logp_t
        sapo            l_t = -sigmoid(tau (r - 1)) 4 / tau A,  tau = tau_pos if A > 0 else tau_neg
        vespo           l_t = -stopgrad(phi) A logp_t,  phi = ``gamma_weights`` (w inside, not multiplying l)
        masks           l_t *= [A >= 0 or mean_t KL(sampler || policy) <= threshold] (a NaN sampler log-prob: 0)
                        l_t *= [entropy_t >= quantile 1 - top_entropy_quantile of the masked entropies]
        then            l_t = w_t l_t + beta k_t,  k_t = exp(ref_t - logp_t) - (ref_t - logp_t) - 1 (times r, its
                        gradient included, with use_bias_correction_kl)
        loss            ``aggregate``(l), minus entropy_coef sum_t e_t H_t / max(sum_t e_t, 1) (e: m times the
                        entropy mask)
    It computes in fp32, or in fp64 for fp64 log-probs (a stricter truth for the tests).

    Args:
        logp: the policy's log-probs [B, T] (differentiable).
        advantages: [B] or [B, T].
        completion_mask: [B, T] bool or 0 / 1.
        options: a LossOptions, under the keywords; None: TRL's defaults.
        entropy: [B, T] (differentiable with entropy_coef != 0): the entropy metric, the top-entropy mask and the
            entropy bonus; or None.
        old_logprobs: [B, T], or None (on-policy: logp detached).
        ref_logprobs: [B, T], required with beta != 0.
        sampling_logprobs: the off-policy mask's [B, T] (NaN: not scored), or None (the old log-probs).
        importance_weights: [B], [B, 1] or [B, T], or None.
        num_items_in_batch: the "num_items_in_batch" normaliser's count, or None.
        entropy_threshold: the top-entropy quantile's value, or None (this batch's).
        **loss_options: the loss options by name (on top of ``options``).

    Returns:
        (loss, metrics): a scalar, and TRL's metrics as detached fp32 scalars.

    Raises:
        TypeError: an unknown loss option.
        ValueError: a record's family, normaliser or metric reduction the spec does not know, or importance
            weights in a term that does not read them.
    """
    o = LossOptions.resolve(options, loss_options, "token_loss")
    record = o.loss_type_record
    term = record.policy_term
    policy_term = term.formula  # TRL dispatches on loss_type; its record names the formula
    epsilon_low, beta = o.epsilon, o.beta
    epsilon_high = o.epsilon if o.epsilon_high is None else o.epsilon_high  # TRL's default
    if term.importance_weights_in_term and policy_term != "vespo":
        raise ValueError(
            f"loss type {o.loss_type!r} puts the importance weights in its term, but the "
            f"{policy_term!r} term does not read them (only 'vespo' does)"
        )
    dtype = torch.promote_types(logp.dtype, torch.float32)
    mask = completion_mask.to(dtype)
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
    if o.importance_sampling_level == "sequence":
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

    if o.off_policy_mask_threshold is not None:
        per_token_loss = per_token_loss * off_policy_mask
    if entropy_mask is not None:
        per_token_loss = per_token_loss * entropy_mask
    if importance_weights is not None and not term.importance_weights_in_term:
        per_token_loss = per_token_loss * importance_weights
    if beta != 0.0:
        per_token_loss = per_token_loss + beta * per_token_kl

    loss = aggregate(per_token_loss, mask, o, num_items_in_batch)
    policy_loss = loss.detach()
    if o.entropy_coef != 0.0:
        effective_mask = mask if entropy_mask is None else mask * entropy_mask
        loss = loss - o.entropy_coef * (entropy.to(dtype) * effective_mask).sum() / effective_mask.sum().clamp(min=1.0)

    # TRL's metrics: kl, entropy, the loss type's own (its record names them and the quantity each reduces),
    # policy_loss with an entropy bonus, and grpo_fast's ratio_mean
    with torch.no_grad():
        is_low_clipped = (coef_1 < 1 - epsilon_low) & (advantages < 0)
        is_high_clipped = (coef_1 > 1 + epsilon_high) & (advantages > 0)
        quantities = {
            "low": is_low_clipped,
            "high": is_high_clipped,
            "region": is_low_clipped | is_high_clipped,
            "cispo": (coef_1 > epsilon_high) & (advantages > 0),
            "phi": phi_seq,
        }
        metrics = {}
        if beta != 0.0:
            metrics["kl"] = global_masked_mean(per_token_kl, mask)
        if entropy is not None:
            metrics["entropy"] = global_masked_mean(entropy, mask)
        for metric in record.metrics:
            if metric.reduce not in REDUCERS:
                raise ValueError(
                    f"metric {metric.name!r} of loss type {o.loss_type!r} has an unknown reduction {metric.reduce!r}"
                )
            if quantities.get(metric.statistic) is None:
                raise ValueError(f"metric {metric.name!r}: the spec has no quantity {metric.statistic!r} here")
            metrics[metric.name] = REDUCERS[metric.reduce](quantities[metric.statistic], mask)
        if o.entropy_coef != 0.0:
            metrics["policy_loss"] = policy_loss
        metrics["ratio_mean"] = global_masked_mean(ratio, mask)
    return loss, {name: value.detach().float().reshape(()) for name, value in metrics.items()}


def loss(hidden, weight, targets, advantages, completion_mask, options=None, *, bias=None, **keywords):
    """The eager GRPO loss from hidden states: the full logits' ``logprobs_and_entropy``, then ``token_loss``.

    Args:
        hidden: [B, T, D] hidden states.
        weight: the lm_head's [V, D] weight.
        targets: the sampled token ids [B, T].
        advantages: as ``token_loss``.
        completion_mask: as ``token_loss``.
        options: as ``token_loss``.
        bias: the lm_head's [V] bias, or None.
        **keywords: ``logits``' keywords (temperature, softcap, logit_scale, fp32_matmul, compute_dtype, lora), and
            ``token_loss``'s (the per-batch inputs and the loss options by name).

    Returns:
        (loss, metrics), as ``token_loss``.
    """
    head = {name: keywords.pop(name) for name in HEAD_KEYWORDS if name in keywords}
    logp, entropy = logprobs_and_entropy(hidden, weight, targets, bias, **head)
    return token_loss(logp, advantages, completion_mask, options, entropy=entropy, **keywords)


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


def _transformed_logits(hidden, weight, bias, temperature, softcap, logit_scale, compute_dtype):
    u = hidden.to(compute_dtype) @ weight.to(compute_dtype).T
    if bias is not None:
        u = u + bias.to(compute_dtype)
    return transformed(u, temperature, softcap, logit_scale)


def _expected_log_ratio(p, log_p, log_q):
    """sum_v p_v (log p_v - log q_v), with 0 where p_v is 0 (value and gradient)."""
    return (p * (log_p - log_q).masked_fill(p == 0, 0.0)).sum(-1)


def divergence_and_entropy(
    student_hidden,
    student_weight,
    teacher_hidden,
    teacher_weight,
    completion_mask=None,
    *,
    beta=1.0,
    temperature=1.0,
    student_bias=None,
    teacher_bias=None,
    student_softcap=None,
    teacher_softcap=None,
    student_logit_scale=1.0,
    teacher_logit_scale=1.0,
    compute_dtype=torch.float32,
):
    """Per-token divergence and student entropy [B, T] in ``compute_dtype`` from the full logits of both models
    (the section's comment gives the math); both differentiable (the teacher's tensors too, if they require it:
    the fused op stops there). Hidden sizes may differ; the vocabularies must match."""
    student = (student_bias, temperature, student_softcap, student_logit_scale, compute_dtype)
    teacher = (teacher_bias, temperature, teacher_softcap, teacher_logit_scale, compute_dtype)
    log_ps = F.log_softmax(_transformed_logits(student_hidden, student_weight, *student), dim=-1)
    log_pt = F.log_softmax(_transformed_logits(teacher_hidden, teacher_weight, *teacher), dim=-1)
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
        hidden, weight, teacher_hidden, teacher_weight, completion_mask, beta=distillation_beta,
        temperature=temperature, student_bias=bias, teacher_bias=teacher_bias, student_softcap=softcap,
        teacher_softcap=teacher_softcap, student_logit_scale=logit_scale, teacher_logit_scale=teacher_logit_scale,
        compute_dtype=compute_dtype,
    )  # fmt: skip
    mask = completion_mask.bool()
    total = total + distillation_coef * aggregate(div, completion_mask, options, kwargs.get("num_items_in_batch"))
    metrics["distillation_loss"] = (torch.where(mask, div, 0.0).sum() / mask.sum().clamp(min=1)).detach().float()
    return total, metrics


# ----------------------------------------------------------------------------------------------- served teachers
# A teacher served as top-k log-probs (TRL 1.16's trl.experimental AsyncDistillationTrainer; ServerDistillationTrainer
# alike): per token its ids (-1: none) and log-probs. The support at beta = 0 is the listed ids; at beta != 0 the
# teacher's top-1 (entry 0) and the sampled token (once where they coincide; the sampled token's teacher log-prob read
# from the list, absent: not in the support); at beta = 1 the sampled token alone. Each side's log-probs over the
# support either get a tail bucket, log(1 - sum exp) with the sum's log clamped to <= -1e-7, or are renormalised over
# it; then forward KL / reverse KL / generalized JSD summed over the entries. A token without any support entry: 0.
def _served_support(ids, logprobs, targets, beta):
    """(ids [..., S], teacher log-probs [..., S], valid [..., S]) of the support (the section's comment)."""
    listed = ids >= 0
    if beta == 0.0:
        return ids, logprobs, listed
    hit = listed & (ids == targets[..., None])
    found = hit.any(-1)
    sampled_lp = torch.where(hit, logprobs, 0.0).sum(-1)  # the one listed entry equal to the sampled token
    if beta == 1.0:
        return targets[..., None], sampled_lp[..., None], found[..., None]
    distinct = found & (targets != ids[..., 0])
    return (
        torch.stack([ids[..., 0], targets], -1),
        torch.stack([logprobs[..., 0], sampled_lp], -1),
        torch.stack([listed[..., 0], distinct], -1),
    )


def _served_side(log_p, valid, add_tail_bucket):
    """One side's log-probs over the support's entries (and the tail bucket), -inf off ``valid``."""
    log_p = log_p.masked_fill(~valid, -math.inf)
    if add_tail_bucket:
        mass_log = torch.logsumexp(log_p, -1, keepdim=True).clamp(max=-1e-7)
        return torch.cat([log_p, torch.log1p(-torch.exp(mass_log))], -1)
    return log_p - torch.logsumexp(log_p, -1, keepdim=True)


def _served_terms(log_ps, log_pt, beta):
    """The divergence summed over the entries (an entry absent on a side adds 0)."""
    ps, pt = log_ps.exp(), log_pt.exp()
    if beta == 0.0:
        return _expected_log_ratio(pt, log_pt, log_ps)
    if beta == 1.0:
        return _expected_log_ratio(ps, log_ps, log_pt)
    log_m = torch.log(((1.0 - beta) * ps + beta * pt).clamp(min=torch.finfo(torch.float32).tiny))
    return beta * _expected_log_ratio(pt, log_pt, log_m) + (1.0 - beta) * _expected_log_ratio(ps, log_ps, log_m)


def served_divergence_and_entropy(
    student_hidden,
    student_weight,
    teacher_ids,
    teacher_logprobs,
    completion_mask=None,
    *,
    targets=None,
    beta=0.0,
    temperature=1.0,
    add_tail_bucket=True,
    student_bias=None,
    student_softcap=None,
    student_logit_scale=1.0,
    compute_dtype=torch.float32,
):
    """Per-token divergence from a served teacher's top-k ``teacher_ids`` / ``teacher_logprobs`` [B, T, K], and the
    student's entropy, [B, T] in ``compute_dtype`` from the student's full logits (the section's comment); the
    divergence differentiable. ``targets`` [B, T]: the sampled tokens (read at beta != 0)."""
    z = _transformed_logits(
        student_hidden,
        student_weight,
        student_bias,
        temperature,
        student_softcap,
        student_logit_scale,
        compute_dtype,
    )
    log_ps_full = F.log_softmax(z, dim=-1)
    if targets is None:
        targets = torch.zeros(teacher_ids.shape[:2], dtype=torch.int64, device=teacher_ids.device)
    listed_lp = torch.where(teacher_ids >= 0, teacher_logprobs.to(compute_dtype), 0.0)  # read where listed only
    ids, log_pt, valid = _served_support(teacher_ids.long(), listed_lp, targets.long(), beta)
    log_ps = log_ps_full.gather(-1, ids.clamp(min=0))
    any_entry = valid.any(-1)
    keep = valid | ~any_entry[..., None]  # a token without entries: a dummy entry, its result dropped below
    student = _served_side(log_ps, keep, add_tail_bucket)
    teacher = _served_side(log_pt.masked_fill(~valid, 0.0), keep, add_tail_bucket)
    div = _served_terms(student, teacher, beta)
    div = torch.where(any_entry, div, 0.0)
    entropy = -_expected_log_ratio(log_ps_full.exp(), log_ps_full, torch.zeros_like(log_ps_full))
    if completion_mask is not None:
        scored = completion_mask.bool()
        div, entropy = div.masked_fill(~scored, 0.0), entropy.masked_fill(~scored, 0.0)
    return div, entropy


def served_distillation_loss(
    student_hidden, student_weight, teacher_ids, teacher_logprobs, completion_mask=None, num_items_in_batch=None, **kw
):
    """The served divergence summed over the scored tokens over ``num_items_in_batch``, or over their count (at
    least 1): (loss, divergence, entropy)."""
    div, entropy = served_divergence_and_entropy(
        student_hidden, student_weight, teacher_ids, teacher_logprobs, completion_mask, **kw
    )
    if num_items_in_batch is None:
        count = div.numel() if completion_mask is None else completion_mask.bool().sum()
        num_items_in_batch = max(int(count), 1)
    return div.sum() / num_items_in_batch, div.detach(), entropy.detach()


# ----------------------------------------------------------------------------------------------- several teachers
# Multi-teacher on-policy distillation (MOPD): row b's tokens are scored by teachers[teacher_index[b]] alone (the dense
# divergence above for a teacher's hidden states and head, the served one for its top-k lists), the loss their sum
# over every scored token over num_items_in_batch or the scored tokens' count: TRL's reduction, whatever the routing.
def multi_teacher_distillation_loss(student_hidden, student_weight, teachers, teacher_index, completion_mask=None,
                                    num_items_in_batch=None, *, beta, targets=None, **student):  # fmt: skip
    """(loss, divergence [B, T], entropy [B, T]) of MOPD. ``teachers``: dicts, each an in-process teacher's
    ``hidden`` [B_i, T, D_i], ``weight`` and optional ``bias``, ``softcap``, ``logit_scale``, or a served one's
    ``ids``, ``logprobs`` [B_i, T, K_i], optional ``add_tail_bucket``; B_i its rows by ``teacher_index`` [B], in order.
    ``student``: the divergences' temperature, student_bias, student_softcap, student_logit_scale, compute_dtype."""
    dtype = student.get("compute_dtype", torch.float32)
    div = entropy = torch.zeros(student_hidden.shape[:2], dtype=dtype, device=student_hidden.device)
    for i, t in enumerate(teachers):
        rows = (teacher_index == i).nonzero()[:, 0]
        mask = completion_mask[rows] if completion_mask is not None else None
        if rows.numel() and "hidden" in t:
            d, e = divergence_and_entropy(student_hidden[rows], student_weight, t["hidden"], t["weight"], mask,
                                          beta=beta, teacher_bias=t.get("bias"), teacher_softcap=t.get("softcap"),
                                          teacher_logit_scale=t.get("logit_scale", 1.0), **student)  # fmt: skip
        elif rows.numel():
            d, e = served_divergence_and_entropy(student_hidden[rows], student_weight, t["ids"], t["logprobs"], mask,
                                                 targets=targets[rows] if targets is not None else None, beta=beta,
                                                 add_tail_bucket=t.get("add_tail_bucket", True), **student)  # fmt: skip
        if rows.numel():
            div, entropy = div.index_copy(0, rows, d), entropy.index_copy(0, rows, e.detach())
    if num_items_in_batch is None:
        num_items_in_batch = max(int(div.numel() if completion_mask is None else completion_mask.bool().sum()), 1)
    return div.sum() / num_items_in_batch, div.detach(), entropy
