"""The spec: an eager, readable PyTorch GRPO loss that builds the full logits.

Every fused path in grpo_fast is tested against this module, and the benchmark uses it as the eager
baseline. It follows TRL's ``GRPOTrainer._compute_loss`` line by line (the per-token log-probs come from
``log_softmax(logits / temperature)`` gathered at the targets), so a TRL user gets the same numbers.

Two layers, the same as the fused paths:
  1. ``logprobs_and_entropy``: hidden states and lm_head -> per-token log-prob of the target and entropy.
  2. ``token_loss``: per-token log-probs (+ old / ref log-probs, advantages, mask) -> loss and metrics.

Formulas (r: importance ratio, A: advantage, m: completion mask, w: importance weights):
  token level     r_t = exp(logp_t - old_t)
  sequence level  r_b = exp(sum_t m_t (logp_t - old_t) / max(sum_t m_t, 1))         (GSPO)
  clipped family  l_t = -min(min(r, delta) * A, clamp(r, 1 - eps, 1 + eps_high) * A)  (grpo bnpo dr_grpo dapo luspo)
  cispo           l_t = -stopgrad(min(r, eps_high)) * A * logp_t
  sapo            l_t = -sigmoid(tau (r - 1)) * 4 / tau * A,  tau = tau_pos if A > 0 else tau_neg
  then            l_t = w_t * l_t + beta * (exp(ref_t - logp_t) - (ref_t - logp_t) - 1)
  normalisation   grpo, sapo: mean_b(sum_t m l / max(sum_t m, 1));  bnpo: sum m l / max(sum m, 1)
                  dr_grpo: sum m l / (B * max_completion_length);  dapo, cispo: sum m l / max(num_items, 1)
                  luspo: mean_b(sum_t m l)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo")
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")
CLIPPED_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")


def logprobs_and_entropy(hidden, weight, targets, bias=None, temperature=1.0, fp32_matmul=True,
                         compute_dtype=torch.float32):
    """Full-logits log-prob of each target and entropy of each row, both fp32 with the shape of ``targets``.

    ``logits = (hidden @ weight.T + bias) / temperature`` [*targets.shape, V], in ``compute_dtype`` (fp32; the
    tests use fp64 as a stricter truth). With ``fp32_matmul`` (the spec) the matmul itself runs in that dtype;
    without it, the matmul runs in the input dtype (bf16 logits, as a model's lm_head produces them in a TRL
    training step) and is upcast after: the benchmark's eager baseline, on tensor cores.
    """
    if fp32_matmul:
        logits = hidden.to(compute_dtype) @ weight.to(compute_dtype).T
    else:
        logits = (hidden @ weight.T).to(compute_dtype)
    if bias is not None:
        logits = logits + bias.to(compute_dtype)
    logits = logits / temperature
    logsoftmax = F.log_softmax(logits, dim=-1)
    logp = logsoftmax.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = -(logsoftmax.exp() * logsoftmax).sum(-1)
    return logp.float(), entropy.float()


def logprobs(hidden, weight, targets, bias=None, temperature=1.0, fp32_matmul=True, compute_dtype=torch.float32):
    """Per-token log-prob of ``targets`` under ``(hidden @ weight.T + bias) / temperature``; no grad."""
    with torch.no_grad():
        return logprobs_and_entropy(hidden, weight, targets, bias, temperature, fp32_matmul, compute_dtype)[0]


def _normalise(per_token_loss, mask, loss_type, max_completion_length, num_items_in_batch):
    """Each loss type's own reduction of the masked per-token loss (TRL's, with no gradient accumulation)."""
    if loss_type in ("grpo", "sapo"):
        return ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    if loss_type == "bnpo":
        return (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0)
    if loss_type == "dr_grpo":
        return (per_token_loss * mask).sum() / (per_token_loss.size(0) * max_completion_length)
    if loss_type in ("dapo", "cispo"):
        return (per_token_loss * mask).sum() / max(float(num_items_in_batch), 1.0)
    if loss_type == "luspo":
        return (per_token_loss * mask).sum(-1).mean()
    raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")


def token_loss(
    logp,
    advantages,
    completion_mask,
    *,
    entropy=None,
    old_logprobs=None,
    ref_logprobs=None,
    beta=0.0,
    epsilon=0.2,
    epsilon_high=None,
    delta=None,
    loss_type="dapo",
    importance_sampling_level="token",
    max_completion_length=None,
    num_items_in_batch=None,
    importance_weights=None,
    sapo_temperature_pos=1.0,
    sapo_temperature_neg=1.05,
):
    """GRPO loss and metrics from per-token log-probs ``logp`` [B, T] (differentiable), as TRL computes them.

    Returns ``(loss, metrics)``: a scalar and a dict of detached fp32 scalars.
    """
    mask = completion_mask.to(torch.float32)
    epsilon_low = epsilon
    epsilon_high = epsilon if epsilon_high is None else epsilon_high
    logp = logp.float()
    old = logp.detach() if old_logprobs is None else old_logprobs.float()
    advantages = advantages.float()
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)

    log_ratio = logp - old
    if importance_sampling_level == "token":
        log_importance_weights = log_ratio
    elif importance_sampling_level == "sequence":
        log_importance_weights = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    else:
        raise ValueError(f"importance_sampling_level must be 'token' or 'sequence', got {importance_sampling_level!r}")
    coef_1 = torch.exp(log_importance_weights)
    ratio = coef_1  # before delta: the metric reports the importance ratio itself

    if beta != 0.0:
        ref = ref_logprobs.float()
        per_token_kl = torch.exp(ref - logp) - (ref - logp) - 1

    if loss_type == "cispo":
        clamped_ratios = torch.clamp(coef_1, max=epsilon_high).detach()
        per_token_loss = -clamped_ratios * advantages * logp
    elif loss_type in CLIPPED_LOSS_TYPES:
        coef_2 = torch.clamp(coef_1, 1 - epsilon_low, 1 + epsilon_high)
        if delta is not None:
            coef_1 = torch.clamp(coef_1, max=delta)
        per_token_loss = -torch.min(coef_1 * advantages, coef_2 * advantages)
    elif loss_type == "sapo":
        temperatures = torch.where(advantages > 0, sapo_temperature_pos, sapo_temperature_neg)
        per_token_loss = -torch.sigmoid(temperatures * (coef_1 - 1)) * 4 / temperatures * advantages
    else:
        raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")

    if importance_weights is not None:
        w = importance_weights.float()
        per_token_loss = per_token_loss * (w.unsqueeze(1) if w.dim() == 1 else w)
    if beta != 0.0:
        per_token_loss = per_token_loss + beta * per_token_kl

    if num_items_in_batch is None:
        num_items_in_batch = mask.sum()
    loss = _normalise(per_token_loss, mask, loss_type, max_completion_length, num_items_in_batch)

    # Metrics: TRL's global masked mean; a [B, 1] value (sequence level) is averaged over sequences.
    def masked_mean(x):
        if x.shape[1] == 1:
            return x.sum() / x.shape[0]
        return (x * mask).sum() / mask.sum().clamp(min=1.0)

    with torch.no_grad():
        metrics = {}
        if beta != 0.0:
            metrics["kl"] = masked_mean(per_token_kl)
        if entropy is not None:
            metrics["entropy"] = masked_mean(entropy.float())
        if loss_type in CLIPPED_LOSS_TYPES:
            is_low = (coef_1 < 1 - epsilon_low) & (advantages < 0)
            is_high = (coef_1 > 1 + epsilon_high) & (advantages > 0)
            metrics["clip_ratio/low_mean"] = masked_mean(is_low.float())
            metrics["clip_ratio/high_mean"] = masked_mean(is_high.float())
            metrics["clip_ratio/region_mean"] = masked_mean((is_low | is_high).float())
        elif loss_type == "cispo":
            metrics["cispo_clip_ratio"] = masked_mean(((coef_1 > epsilon_high) & (advantages > 0)).float())
        metrics["ratio_mean"] = masked_mean(ratio)
        metrics = {k: v.detach().float() for k, v in metrics.items()}
    return loss, metrics


def loss(hidden, weight, targets, advantages, completion_mask, *, bias=None, temperature=1.0, fp32_matmul=True,
         compute_dtype=torch.float32, **kwargs):
    """The eager GRPO loss from hidden states: full logits, then ``token_loss``. Same arguments as grpo_fast.loss."""
    logp, entropy = logprobs_and_entropy(hidden, weight, targets, bias, temperature, fp32_matmul, compute_dtype)
    total, metrics = token_loss(logp, advantages, completion_mask, entropy=entropy, **kwargs)
    return total, metrics
