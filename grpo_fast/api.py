"""The public functions: argument checks with named errors, dtype policy, row selection and dispatch.

Backends: "triton" runs the Triton kernels (CUDA tensors, or CPU tensors under TRITON_INTERPRET=1);
"torch" runs the same algorithm in chunked PyTorch (any device); "auto" picks triton for CUDA tensors and under
the interpreter, torch otherwise.

Only completion tokens are computed: with a ``completion_mask``, the rows with mask 1 are gathered before layer 1
(forward and backward) and the per-token outputs are scattered back, with exact zeros at masked positions.
"""

from __future__ import annotations

import math
import numbers

import torch

from grpo_fast import reference
from grpo_fast.autograd import LinearLogprobs, ScaledByCoefficient, linear_logprobs_forward
from grpo_fast.kernels import config as kconfig
from grpo_fast.kernels import grpo_token as token_kernel
from grpo_fast.kernels.config import LogitTransform

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
BACKENDS = ("auto", "triton", "torch")


class Metrics(dict):
    """Detached fp32 scalar metrics (TRL's names), plus the per-token ``logprobs`` and ``entropies`` [B, T]."""

    logprobs: torch.Tensor
    entropies: torch.Tensor


# ----------------------------------------------------------------------------------------------- checks
def _tensor(name, x):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    return x


def _float_tensor(name, x):
    _tensor(name, x)
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be float32, bfloat16 or float16, got {x.dtype}")
    return x


def _shape(name, x, expected_shapes, descr):
    if tuple(x.shape) not in [tuple(s) for s in expected_shapes]:
        raise ValueError(f"{name} must have shape {descr}, got {tuple(x.shape)}")


def _number(name, x, condition=lambda v: True, expected="a finite number"):
    """x must be a real number (a Python or numpy scalar, not a bool) for which condition holds."""
    if isinstance(x, bool) or not isinstance(x, numbers.Real) or not math.isfinite(x) or not condition(x):
        raise ValueError(f"{name} must be {expected}, got {x!r}")


def _same_device(named, device):
    for name, x in named:
        if x is not None and x.device != device:
            raise ValueError(f"{name} is on {x.device} but hidden is on {device}: all tensors must share a device")


def _check_targets(targets, shape, V, mask):
    _tensor("targets", targets)
    if targets.dtype.is_floating_point or targets.dtype == torch.bool or targets.is_complex():
        raise TypeError(f"targets must be an integer tensor of token ids, got {targets.dtype}")
    _shape("targets", targets, [shape], f"[B, T] = {list(shape)}")
    scored = targets if mask is None else targets[mask.bool()]  # masked positions are never read (-100 is fine)
    if scored.numel() and (int(scored.min()) < 0 or int(scored.max()) >= V):
        where = "" if mask is None else " where completion_mask is 1"
        raise ValueError(f"targets must be token ids in [0, V) = [0, {V}){where}, got values in "
                         f"[{int(scored.min())}, {int(scored.max())}]")


def _check_mask(mask, shape):
    _tensor("completion_mask", mask)
    _shape("completion_mask", mask, [shape], f"[B, T] = {list(shape)}")
    if mask.dtype != torch.bool and mask.numel() and not bool(((mask == 0) | (mask == 1)).all()):
        raise ValueError("completion_mask must be bool or hold only 0 and 1")


def _resolve_backend(backend, device):
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        return "triton" if (device.type == "cuda" or kconfig.interpreting()) else "torch"
    if backend == "triton" and device.type != "cuda" and not kconfig.interpreting():
        raise ValueError("backend='triton' needs CUDA tensors, or TRITON_INTERPRET=1 set before importing grpo_fast")
    return backend


def _logit_transform(temperature, softcap, logit_scale):
    _number("temperature", temperature, lambda v: v > 0, "a positive number")
    if softcap is not None:
        _number("softcap", softcap, lambda v: v > 0, "None or a positive number (Gemma 2: 30.0)")
    _number("logit_scale", logit_scale, lambda v: v != 0, "a finite non-zero number")
    return LogitTransform(float(temperature), None if softcap is None else float(softcap), float(logit_scale))


def _check_linear(hidden, weight, targets, bias, completion_mask):
    """Shared checks of layer 1's inputs; returns (B, T, D, V)."""
    _float_tensor("hidden", hidden)
    if hidden.dim() != 3:
        raise ValueError(f"hidden must have shape [B, T, D], got {tuple(hidden.shape)}")
    B, T, D = hidden.shape
    if B == 0 or T == 0 or D == 0:
        raise ValueError(f"hidden must be non-empty, got shape {tuple(hidden.shape)}")
    _float_tensor("weight", weight)
    if weight.dim() != 2 or weight.shape[1] != D or weight.shape[0] == 0:
        raise ValueError(f"weight must have shape [V, D] with D = {D}, got {tuple(weight.shape)}")
    if weight.dtype != hidden.dtype:
        raise TypeError(f"weight dtype {weight.dtype} differs from hidden dtype {hidden.dtype}: cast one of them")
    V = weight.shape[0]
    if bias is not None:
        _float_tensor("bias", bias)
        _shape("bias", bias, [(V,)], f"[V] = [{V}]")
    if completion_mask is not None:
        _tensor("completion_mask", completion_mask)
    _same_device([("weight", weight), ("targets", targets), ("bias", bias), ("completion_mask", completion_mask)],
                 hidden.device)
    if completion_mask is not None:
        _check_mask(completion_mask, (B, T))
    _check_targets(targets, (B, T), V, completion_mask)
    return B, T, D, V


def _flat_inputs(hidden, weight, targets, bias, completion_mask):
    """[N, D] hidden rows and [N] targets of the scored tokens (all, or those with mask 1), and their row indices
    (None when every row is scored)."""
    D = hidden.shape[-1]
    h = hidden.reshape(-1, D)
    y = targets.reshape(-1)
    rows = None
    if completion_mask is not None:
        active = completion_mask.reshape(-1).bool()
        if not bool(active.all()):
            rows = active.nonzero().squeeze(1)
            h, y = h.index_select(0, rows), y.index_select(0, rows)
    if h.stride(-1) != 1:
        h = h.contiguous()
    w = weight if weight.stride(-1) == 1 else weight.contiguous()
    b = bias.contiguous() if bias is not None else None
    return h, w, y.to(torch.int64).contiguous(), b, rows


def _scatter_rows(values, rows, shape):
    """Per-token values of the scored rows -> [B, T], exact zeros elsewhere (differentiable)."""
    if rows is None:
        return values.view(shape)
    return values.new_zeros(shape[0] * shape[1]).index_copy(0, rows, values).view(shape)


# ----------------------------------------------------------------------------------------------- layer 1
def logprobs(hidden, weight, targets, bias=None, temperature=1.0, *, softcap=None, logit_scale=1.0,
             completion_mask=None, backend="auto"):
    """Per-token log-probs [B, T] (fp32, no grad) of ``targets`` for the reference and old policies.

    The logit is ``softcap * tanh(logit_scale * (hidden @ weight.T + bias) / softcap) / temperature``. No logits of
    size V are built and no autograd graph is kept; with ``completion_mask`` only its tokens are computed.
    """
    B, T, _, _ = _check_linear(hidden, weight, targets, bias, completion_mask)
    transform = _logit_transform(temperature, softcap, logit_scale)
    backend = _resolve_backend(backend, hidden.device)
    with torch.no_grad():
        h, w, y, b, rows = _flat_inputs(hidden, weight, targets, bias, completion_mask)
        if h.shape[0] == 0:
            return torch.zeros(B, T, dtype=torch.float32, device=hidden.device)
        logp = linear_logprobs_forward(h, w, y, b, transform, False, backend)[0]
        return _scatter_rows(logp, rows, (B, T))


def logprobs_and_entropy(hidden, weight, targets, *, bias=None, temperature=1.0, softcap=None, logit_scale=1.0,
                         completion_mask=None, backend="auto"):
    """Per-token log-probs of ``targets`` and entropies, [B, T] fp32 each, both differentiable.

    hidden [B, T, D] (hidden[b, t] predicts targets[b, t]), weight [V, D] of hidden's dtype, bias [V] or None. The
    logit is ``softcap * tanh(logit_scale * (hidden @ weight.T + bias) / softcap) / temperature`` (no tanh when
    ``softcap`` is None), TRL 1.16's order. Gradients reach hidden, weight and bias through both outputs (an
    entropy bonus trains through the entropy); no tensor of size V x tokens exists in the forward or the backward.
    With ``completion_mask`` only its tokens are computed; masked positions are exact zeros and their targets are
    not read.
    """
    B, T, _, _ = _check_linear(hidden, weight, targets, bias, completion_mask)
    transform = _logit_transform(temperature, softcap, logit_scale)
    return _logprobs_and_entropy(hidden, weight, targets, bias, completion_mask, transform,
                                 _resolve_backend(backend, hidden.device))


def _logprobs_and_entropy(hidden, weight, targets, bias, completion_mask, transform, backend):
    B, T = targets.shape
    h, w, y, b, rows = _flat_inputs(hidden, weight, targets, bias, completion_mask)
    logp, entropy = LinearLogprobs.apply(h, w, b, y, transform, backend)
    return _scatter_rows(logp, rows, (B, T)), _scatter_rows(entropy, rows, (B, T))


# ----------------------------------------------------------------------------------------------- layer 2
# layer 2's keyword arguments: TRL 1.16.0's GRPOConfig names and defaults (and grpo_fast's per-batch inputs)
_TOKEN_LOSS_DEFAULTS = dict(
    old_logprobs=None, ref_logprobs=None, sampling_logprobs=None, importance_weights=None,
    beta=0.0, epsilon=0.2, epsilon_high=None, delta=None, loss_type="dapo", importance_sampling_level="token",
    max_completion_length=512, num_items_in_batch=None, sapo_temperature_pos=1.0, sapo_temperature_neg=1.05,
    vespo_k_pos=2.0, vespo_lambda_pos=3.0, vespo_k_neg=3.0, vespo_lambda_neg=2.0, use_bias_correction_kl=True,
    off_policy_mask_threshold=None, top_entropy_quantile=1.0, entropy_threshold=None, entropy_coef=0.0,
)


def loss(
    hidden, weight, targets, advantages, completion_mask, *,
    bias=None, old_logprobs=None, ref_logprobs=None, sampling_logprobs=None, importance_weights=None,
    beta=0.0, epsilon=0.2, epsilon_high=None, delta=None, loss_type="dapo", importance_sampling_level="token",
    temperature=1.0, softcap=None, logit_scale=1.0, max_completion_length=512, num_items_in_batch=None,
    sapo_temperature_pos=1.0, sapo_temperature_neg=1.05,
    vespo_k_pos=2.0, vespo_lambda_pos=3.0, vespo_k_neg=3.0, vespo_lambda_neg=2.0,
    use_bias_correction_kl=True, off_policy_mask_threshold=None, top_entropy_quantile=1.0,
    entropy_threshold=None, entropy_coef=0.0, backend="auto",
):
    """The GRPO loss (TRL 1.16 semantics) from the policy's last hidden states, without full-vocab logits.

    hidden [B, T, D] (hidden[b, t] predicts targets[b, t]), weight [V, D], targets [B, T] token ids,
    advantages [B] or [B, T], completion_mask [B, T] bool or 0/1; the keyword arguments are TRL's (README).
    Only tokens with mask 1 are computed. Returns ``(loss, metrics)``: a differentiable fp32 scalar and a
    ``Metrics`` dict.
    """
    arguments = locals()
    loss_kwargs = {name: arguments[name] for name in _TOKEN_LOSS_DEFAULTS}
    B, T, _, _ = _check_linear(hidden, weight, targets, bias, completion_mask)
    transform = _logit_transform(temperature, softcap, logit_scale)
    _check_loss_kwargs(advantages, completion_mask, (B, T), hidden.device, loss_kwargs)
    backend = _resolve_backend(backend, hidden.device)
    logp, entropy = _logprobs_and_entropy(hidden, weight, targets, bias, completion_mask, transform, backend)
    return _token_loss(logp, advantages, completion_mask, entropy, backend, loss_kwargs)


def token_loss(
    logprobs, advantages, completion_mask, *,
    entropy=None, old_logprobs=None, ref_logprobs=None, sampling_logprobs=None, importance_weights=None,
    beta=0.0, epsilon=0.2, epsilon_high=None, delta=None, loss_type="dapo", importance_sampling_level="token",
    max_completion_length=512, num_items_in_batch=None, sapo_temperature_pos=1.0, sapo_temperature_neg=1.05,
    vespo_k_pos=2.0, vespo_lambda_pos=3.0, vespo_k_neg=3.0, vespo_lambda_neg=2.0,
    use_bias_correction_kl=True, off_policy_mask_threshold=None, top_entropy_quantile=1.0,
    entropy_threshold=None, entropy_coef=0.0, backend="auto",
):
    """Layer 2 alone: the GRPO loss and metrics from per-token log-probs [B, T] that carry the gradient.

    For callers that already have the policy's log-probs. ``entropy`` [B, T] feeds the entropy metric, the
    top-entropy mask and the entropy bonus (which trains through it when it carries a gradient); the last two
    need it.
    """
    arguments = locals()
    loss_kwargs = {name: arguments[name] for name in _TOKEN_LOSS_DEFAULTS}
    _float_tensor("logprobs", logprobs)
    if logprobs.dim() != 2 or logprobs.numel() == 0:
        raise ValueError(f"logprobs must have shape [B, T] with B, T > 0, got {tuple(logprobs.shape)}")
    B, T = logprobs.shape
    _check_loss_kwargs(advantages, completion_mask, (B, T), logprobs.device, loss_kwargs)
    _check_mask(completion_mask, (B, T))
    if entropy is not None:
        _float_tensor("entropy", entropy)
        _shape("entropy", entropy, [(B, T)], f"[B, T] = [{B}, {T}]")
        _same_device([("entropy", entropy)], logprobs.device)
    elif top_entropy_quantile < 1.0 or entropy_coef != 0.0:
        raise ValueError("top_entropy_quantile < 1 and entropy_coef != 0 need the per-token entropy [B, T] "
                         "(grpo_fast.logprobs_and_entropy gives it with its gradient)")
    return _token_loss(logprobs, advantages, completion_mask, entropy, _resolve_backend(backend, logprobs.device),
                       loss_kwargs)


def _check_loss_kwargs(advantages, completion_mask, shape, device, kw):
    """Checks of layer 2's inputs (kw holds every key of _TOKEN_LOSS_DEFAULTS), named after the argument at fault;
    the mask itself is checked by the caller (once: it costs a pass over it)."""
    B, T = shape
    _tensor("advantages", advantages)
    _tensor("completion_mask", completion_mask)
    _same_device([("advantages", advantages), ("completion_mask", completion_mask)]
                 + [(n, kw[n]) for n in ("old_logprobs", "ref_logprobs", "sampling_logprobs", "importance_weights")],
                 device)
    loss_type = kw["loss_type"]
    if loss_type not in reference.LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {reference.LOSS_TYPES}, got {loss_type!r}")
    level = kw["importance_sampling_level"]
    if level not in reference.IMPORTANCE_SAMPLING_LEVELS:
        raise ValueError(f"importance_sampling_level must be 'token' or 'sequence', got {level!r}")
    for name in ("beta", "epsilon", "sapo_temperature_pos", "sapo_temperature_neg", "vespo_k_pos", "vespo_lambda_pos",
                 "vespo_k_neg", "vespo_lambda_neg", "entropy_coef"):
        _number(name, kw[name])
    if kw["beta"] != 0.0 and kw["ref_logprobs"] is None:
        raise ValueError("beta != 0 needs ref_logprobs [B, T] (the reference model's log-probs, e.g. from "
                         "grpo_fast.logprobs)")
    mcl = kw["max_completion_length"]
    if isinstance(mcl, bool) or not isinstance(mcl, numbers.Integral) or mcl <= 0:
        raise ValueError(f"max_completion_length must be a positive int (the dr_grpo normaliser), got {mcl!r}")
    eps, eps_high = kw["epsilon"], kw["epsilon_high"]
    if eps_high is not None:
        _number("epsilon_high", eps_high)
    if eps < 0 or (eps_high is not None and eps_high < 0):
        raise ValueError(f"epsilon and epsilon_high must be >= 0, got {eps}, {eps_high}")
    if kw["delta"] is not None:
        _number("delta", kw["delta"])
    if not isinstance(kw["use_bias_correction_kl"], bool):
        raise ValueError(f"use_bias_correction_kl must be a bool, got {kw['use_bias_correction_kl']!r}")
    if kw["off_policy_mask_threshold"] is not None:
        _number("off_policy_mask_threshold", kw["off_policy_mask_threshold"])
    _number("top_entropy_quantile", kw["top_entropy_quantile"], lambda v: 0.0 <= v <= 1.0, "a number in [0, 1]")
    if kw["entropy_threshold"] is not None:
        _number("entropy_threshold", kw["entropy_threshold"])
        if kw["top_entropy_quantile"] >= 1.0:
            raise ValueError("entropy_threshold is only used with top_entropy_quantile < 1 (it is the quantile's "
                             "value over every process's masked entropies)")
    _float_tensor("advantages", advantages)
    _shape("advantages", advantages, [(B,), (B, T)], f"[B] = [{B}] or [B, T] = [{B}, {T}]")
    for name in ("old_logprobs", "ref_logprobs", "sampling_logprobs"):
        x = kw[name]
        if x is not None:
            _float_tensor(name, x)
            _shape(name, x, [shape], f"[B, T] = [{B}, {T}]")
    if kw["sampling_logprobs"] is not None and kw["off_policy_mask_threshold"] is None:
        raise ValueError("sampling_logprobs is only used by the off-policy mask: set off_policy_mask_threshold "
                         "(for the sampler's importance weights, pass grpo_fast.sampling_importance_weights(...) "
                         "as importance_weights)")
    iw = kw["importance_weights"]
    if iw is not None:
        _float_tensor("importance_weights", iw)
        _shape("importance_weights", iw, [(B,), (B, 1), (B, T)], f"[B] = [{B}], [B, 1] or [B, T] = [{B}, {T}]")
        if loss_type == "vespo" and iw.shape != (B, T):
            raise ValueError("loss_type='vespo' takes per-token importance_weights [B, T] (TRL's token_truncate or "
                             f"token_mask modes), got shape {tuple(iw.shape)}: TRL rejects VESPO with sequence-level "
                             "importance sampling")
    n_items = kw["num_items_in_batch"]
    if n_items is not None and float(n_items) < 0:
        raise ValueError(f"num_items_in_batch must be >= 0, got {float(n_items)}")


def _token_loss(logprobs, advantages, completion_mask, entropy, backend, loss_kwargs):
    """Layer 2 on checked inputs: the reference's autograd (torch backend) or the token kernel (triton)."""
    kw = dict(loss_kwargs)
    mask = completion_mask.to(torch.float32).contiguous()
    for name in ("old_logprobs", "ref_logprobs", "sampling_logprobs", "importance_weights"):
        if kw[name] is not None:
            kw[name] = kw[name].detach().float().contiguous()
    if kw["importance_weights"] is not None and kw["importance_weights"].dim() == 2 \
            and kw["importance_weights"].shape[1] == 1 and mask.shape[1] != 1:
        kw["importance_weights"] = kw["importance_weights"].squeeze(1)  # [B, 1]: one weight per sequence
    if kw["beta"] == 0.0:
        kw["ref_logprobs"] = None
    if isinstance(kw["num_items_in_batch"], torch.Tensor):
        kw["num_items_in_batch"] = float(kw["num_items_in_batch"])
    adv = advantages.detach().float().contiguous()
    logp = logprobs.float()
    if entropy is not None:
        entropy = entropy.float()
    if backend == "torch":
        # the spec multiplies masked values by 0: a -inf or NaN there (a padding id's log-prob) would leak a NaN
        masked = mask == 0
        logp = logp.masked_fill(masked, 0.0)
        entropy = entropy.masked_fill(masked, 0.0) if entropy is not None else None
        # (importance weights stay: vespo reads them at padding too, as TRL; elsewhere they are masked out)
        for name in ("old_logprobs", "ref_logprobs"):
            if kw[name] is not None:
                kw[name] = kw[name].masked_fill(masked, 0.0)
        total, metrics = reference.token_loss(logp, adv, mask, entropy=entropy, **kw)
        metrics = Metrics(metrics)
    else:
        total, metrics = _token_loss_triton(logp, entropy, adv, mask, **kw)
    metrics.logprobs = logp.detach()
    metrics.entropies = entropy.detach() if entropy is not None else None
    return total, metrics


def _token_loss_triton(logp, entropy, adv, mask, *, old_logprobs, ref_logprobs, sampling_logprobs,
                       importance_weights, beta, epsilon, epsilon_high, delta, loss_type, importance_sampling_level,
                       max_completion_length, num_items_in_batch, sapo_temperature_pos, sapo_temperature_neg,
                       vespo_k_pos, vespo_lambda_pos, vespo_k_neg, vespo_lambda_neg, use_bias_correction_kl,
                       off_policy_mask_threshold, top_entropy_quantile, entropy_threshold, entropy_coef):
    B = logp.shape[0]
    sequence = importance_sampling_level == "sequence"
    eps_high = epsilon if epsilon_high is None else epsilon_high
    mask_total = float(mask.sum())
    if loss_type in ("grpo", "sapo", "luspo"):
        scale = 1.0 / B
    elif loss_type == "bnpo":
        scale = 1.0 / max(mask_total, 1.0)
    elif loss_type == "dr_grpo":
        scale = 1.0 / (B * max_completion_length)
    else:  # dapo, cispo, vespo
        scale = 1.0 / max(mask_total if num_items_in_batch is None else float(num_items_in_batch), 1.0)
    if top_entropy_quantile < 1.0 and entropy_threshold is None:
        threshold = reference.entropy_quantile_threshold(entropy, mask, top_entropy_quantile)
        # no completion token anywhere: no token is high-entropy (TRL's all-False mask)
        entropy_threshold = math.inf if threshold is None else float(threshold)
    sampler = None
    if off_policy_mask_threshold is not None:
        sampler = next(x for x in (sampling_logprobs, old_logprobs, logp.detach()) if x is not None).contiguous()
    kind = {"cispo": token_kernel.LOSS_CISPO, "sapo": token_kernel.LOSS_SAPO,
            "vespo": token_kernel.LOSS_VESPO}.get(loss_type, token_kernel.LOSS_CLIPPED)
    coef, bonus_mask, stats = token_kernel.grpo_token(
        logp.detach().contiguous(), adv, mask, old_logprobs, ref_logprobs, sampler, importance_weights,
        entropy.detach().contiguous() if entropy is not None else None,
        loss_kind=kind, sequence=sequence, row_mean=loss_type in ("grpo", "sapo"), scale=scale, beta=beta,
        eps_low=epsilon, eps_high=eps_high, delta=delta, sapo_pos=sapo_temperature_pos,
        sapo_neg=sapo_temperature_neg, vespo=(vespo_k_pos, vespo_lambda_pos, vespo_k_neg, vespo_lambda_neg),
        use_bias_correction_kl=use_bias_correction_kl, off_policy_threshold=off_policy_mask_threshold,
        entropy_threshold=entropy_threshold if top_entropy_quantile < 1.0 else None,
        entropy_bonus=entropy_coef != 0.0)

    sums = stats.sum(0)
    policy_loss = sums[token_kernel.STAT_LOSS]
    entropy_coef_per_token = None
    total_value = policy_loss
    if entropy_coef != 0.0:
        # loss -= entropy_coef * (mean entropy over the bonus tokens): dL/dentropy = -entropy_coef * e_t / count
        bonus_scale = -entropy_coef / float(sums[token_kernel.STAT_BONUS_COUNT].clamp(min=1.0))
        total_value = policy_loss + bonus_scale * sums[token_kernel.STAT_BONUS_ENTROPY]
        entropy_coef_per_token = bonus_mask * bonus_scale
    total = ScaledByCoefficient.apply(logp, entropy, total_value, coef, entropy_coef_per_token)

    tokens = sums[token_kernel.STAT_COUNT].clamp(min=1.0)
    per_seq_clip = sequence and adv.dim() == 1
    metrics = Metrics()
    if beta != 0.0:
        metrics["kl"] = sums[token_kernel.STAT_KL] / tokens
    if entropy is not None:
        metrics["entropy"] = sums[token_kernel.STAT_ENTROPY] / tokens
    clip_denominator = B if per_seq_clip else tokens
    if loss_type in reference.CLIPPED_LOSS_TYPES:
        metrics["clip_ratio/low_mean"] = sums[token_kernel.STAT_LOW] / clip_denominator
        metrics["clip_ratio/high_mean"] = sums[token_kernel.STAT_HIGH] / clip_denominator
        metrics["clip_ratio/region_mean"] = sums[token_kernel.STAT_REGION] / clip_denominator
        # TRL's min / max over sequences of each sequence's clip fraction (sequences without tokens are skipped)
        counts = stats[:, token_kernel.STAT_COUNT]
        for name, stat, reduce in (("clip_ratio/low_min", token_kernel.STAT_LOW, torch.min),
                                   ("clip_ratio/high_max", token_kernel.STAT_HIGH, torch.max)):
            per_sequence = stats[:, stat] if per_seq_clip else (stats[:, stat] / counts)[counts > 0]
            metrics[name] = reduce(per_sequence) if per_sequence.numel() else torch.tensor(math.nan)
    elif loss_type == "cispo":
        metrics["cispo_clip_ratio"] = sums[token_kernel.STAT_CISPO] / clip_denominator
    elif loss_type == "vespo":
        metrics["vespo/phi_seq_mean"] = sums[token_kernel.STAT_PHI] / (tokens if adv.dim() == 2 else B)
    if entropy_coef != 0.0:
        metrics["policy_loss"] = policy_loss
    metrics["ratio_mean"] = sums[token_kernel.STAT_RATIO] / (B if sequence else tokens)
    return total, metrics


def sampling_importance_weights(old_logprobs, sampling_logprobs, completion_mask, mode="sequence_mask",
                                clip_max=3.0, clip_min=None):
    """TRL 1.16's importance weights for a sampler (vLLM) that is not the trained policy, for ``importance_weights``.

    old_logprobs: the training policy's log-probs before the update, sampling_logprobs: the sampler's, both [B, T]
    (NaN where the sampler could not score a token: no correction there). ``mode`` is TRL's
    ``vllm_importance_sampling_mode``: ``token_*`` give [B, T] per-token ratios, ``sequence_*`` [B, 1] ratios of the
    summed log-ratio; ``*_truncate`` clamps them to [clip_min, clip_max], ``*_mask`` zeroes those outside it.
    Defaults are TRL's (``vllm_importance_sampling_clip_max=3.0``, ``_clip_min=None``).
    """
    if mode not in reference.IMPORTANCE_SAMPLING_MODES:
        raise ValueError(f"mode must be one of {reference.IMPORTANCE_SAMPLING_MODES}, got {mode!r}")
    for name, x in (("old_logprobs", old_logprobs), ("sampling_logprobs", sampling_logprobs)):
        _float_tensor(name, x)
        if x.dim() != 2:
            raise ValueError(f"{name} must have shape [B, T], got {tuple(x.shape)}")
    _shape("sampling_logprobs", sampling_logprobs, [old_logprobs.shape], f"old_logprobs' {list(old_logprobs.shape)}")
    _check_mask(completion_mask, tuple(old_logprobs.shape))
    _same_device([("sampling_logprobs", sampling_logprobs), ("completion_mask", completion_mask)],
                 old_logprobs.device)
    for name, x in (("clip_max", clip_max), ("clip_min", clip_min)):
        if x is not None:
            _number(name, x)
    if clip_min is not None and clip_max is not None and clip_min >= clip_max:
        raise ValueError(f"clip_min ({clip_min}) must be less than clip_max ({clip_max})")
    if mode.endswith("truncate") and clip_min is None and clip_max is None:
        raise ValueError(f"mode={mode!r} needs clip_min or clip_max")
    return reference.sampling_importance_weights(old_logprobs.detach(), sampling_logprobs.detach(), completion_mask,
                                                 mode, clip_max, clip_min)
