"""The public functions: argument checks with named errors, dtype policy, and dispatch.

Backends: "triton" runs the Triton kernels (CUDA tensors, or CPU tensors under TRITON_INTERPRET=1);
"torch" runs the same algorithm in chunked PyTorch (any device); "auto" picks triton for CUDA tensors and under
the interpreter, torch otherwise.
"""

from __future__ import annotations

import torch

from grpo_fast import reference
from grpo_fast.autograd import LinearLogprobs, ScaledByCoefficient, linear_logprobs_forward
from grpo_fast.kernels import config as kconfig
from grpo_fast.kernels import grpo_token as token_kernel

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


def _same_device(named, device):
    for name, x in named:
        if x is not None and x.device != device:
            raise ValueError(f"{name} is on {x.device} but hidden is on {device}: all tensors must share a device")


def _check_targets(targets, shape, V):
    _tensor("targets", targets)
    if targets.dtype.is_floating_point or targets.dtype == torch.bool or targets.is_complex():
        raise TypeError(f"targets must be an integer tensor of token ids, got {targets.dtype}")
    _shape("targets", targets, [shape], f"[B, T] = {list(shape)}")
    if targets.numel() and (int(targets.min()) < 0 or int(targets.max()) >= V):
        raise ValueError(f"targets must be token ids in [0, V) = [0, {V}), got values in "
                         f"[{int(targets.min())}, {int(targets.max())}]")


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


def _check_linear(hidden, weight, targets, bias, temperature):
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
    _same_device([("weight", weight), ("targets", targets), ("bias", bias)], hidden.device)
    _check_targets(targets, (B, T), V)
    if not (isinstance(temperature, (int, float)) and temperature > 0):
        raise ValueError(f"temperature must be a positive number, got {temperature!r}")
    return B, T, D, V


def _flat_inputs(hidden, weight, targets, bias):
    D = hidden.shape[-1]
    h = hidden.reshape(-1, D)
    if h.stride(-1) != 1:
        h = h.contiguous()
    w = weight if weight.stride(-1) == 1 else weight.contiguous()
    b = bias.contiguous() if bias is not None else None
    return h, w, targets.reshape(-1).to(torch.int64).contiguous(), b


# ----------------------------------------------------------------------------------------------- API
# the keyword arguments of layer 2 (TRL's names and defaults)
_TOKEN_LOSS_DEFAULTS = dict(
    old_logprobs=None, ref_logprobs=None, beta=0.0, epsilon=0.2, epsilon_high=None, delta=None, loss_type="dapo",
    importance_sampling_level="token", max_completion_length=None, num_items_in_batch=None,
    importance_weights=None, sapo_temperature_pos=1.0, sapo_temperature_neg=1.05,
)


def logprobs(hidden, weight, targets, bias=None, temperature=1.0, backend="auto"):
    """Per-token log-probs [B, T] (fp32, no grad) of ``targets`` under ``(hidden @ weight.T + bias) / temperature``.

    For the reference and old policy: no logits of size V are built and no autograd graph is kept.
    """
    B, T, _, _ = _check_linear(hidden, weight, targets, bias, temperature)
    backend = _resolve_backend(backend, hidden.device)
    with torch.no_grad():
        h, w, y, b = _flat_inputs(hidden, weight, targets, bias)
        logp, _, _ = linear_logprobs_forward(h, w, y, b, float(temperature), False, backend)
    return logp.view(B, T)


def loss(
    hidden, weight, targets, advantages, completion_mask, *,
    bias=None, old_logprobs=None, ref_logprobs=None, beta=0.0, epsilon=0.2, epsilon_high=None, delta=None,
    loss_type="dapo", importance_sampling_level="token", temperature=1.0, max_completion_length=None,
    num_items_in_batch=None, importance_weights=None, sapo_temperature_pos=1.0, sapo_temperature_neg=1.05,
    backend="auto",
):
    """The GRPO loss (TRL semantics) from the policy's last hidden states, without full-vocab logits.

    hidden [B, T, D] (hidden[b, t] predicts targets[b, t]), weight [V, D], targets [B, T] token ids,
    advantages [B] or [B, T], completion_mask [B, T] bool or 0/1; the keyword arguments are TRL's (README).
    Returns ``(loss, metrics)``: a differentiable fp32 scalar and a ``Metrics`` dict.
    """
    arguments = locals()
    loss_kwargs = {name: arguments[name] for name in _TOKEN_LOSS_DEFAULTS}
    B, T, _, _ = _check_linear(hidden, weight, targets, bias, temperature)
    _check_loss_kwargs(advantages, completion_mask, (B, T), hidden.device, loss_kwargs)
    backend = _resolve_backend(backend, hidden.device)
    h, w, y, b = _flat_inputs(hidden, weight, targets, bias)
    logp_flat, entropy_flat = LinearLogprobs.apply(h, w, b, y, float(temperature), True, backend)
    return _token_loss(logp_flat.view(B, T), advantages, completion_mask, entropy_flat.view(B, T), backend,
                       loss_kwargs)


def _check_loss_kwargs(advantages, completion_mask, shape, device, kw):
    """Checks of layer 2's inputs (kw holds every key of _TOKEN_LOSS_DEFAULTS), named after the argument at fault."""
    B, T = shape
    _tensor("advantages", advantages)
    _tensor("completion_mask", completion_mask)
    _same_device([("advantages", advantages), ("completion_mask", completion_mask)]
                 + [(n, kw[n]) for n in ("old_logprobs", "ref_logprobs", "importance_weights")], device)
    loss_type = kw["loss_type"]
    if loss_type not in reference.LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {reference.LOSS_TYPES}, got {loss_type!r}")
    level = kw["importance_sampling_level"]
    if level not in reference.IMPORTANCE_SAMPLING_LEVELS:
        raise ValueError(f"importance_sampling_level must be 'token' or 'sequence', got {level!r}")
    if kw["beta"] != 0.0 and kw["ref_logprobs"] is None:
        raise ValueError("beta != 0 needs ref_logprobs [B, T] (the reference model's log-probs, e.g. from "
                         "grpo_fast.logprobs)")
    mcl = kw["max_completion_length"]
    if loss_type == "dr_grpo" and not (isinstance(mcl, int) and mcl > 0):
        raise ValueError(f"loss_type='dr_grpo' needs max_completion_length, a positive int, got {mcl!r}")
    eps, eps_high = kw["epsilon"], kw["epsilon_high"]
    if eps < 0 or (eps_high is not None and eps_high < 0):
        raise ValueError(f"epsilon and epsilon_high must be >= 0, got {eps}, {eps_high}")
    _check_mask(completion_mask, shape)
    _float_tensor("advantages", advantages)
    _shape("advantages", advantages, [(B,), (B, T)], f"[B] = [{B}] or [B, T] = [{B}, {T}]")
    for name in ("old_logprobs", "ref_logprobs"):
        x = kw[name]
        if x is not None:
            _float_tensor(name, x)
            _shape(name, x, [shape], f"[B, T] = [{B}, {T}]")
    iw = kw["importance_weights"]
    if iw is not None:
        _float_tensor("importance_weights", iw)
        _shape("importance_weights", iw, [(B,), (B, T)], f"[B] = [{B}] or [B, T] = [{B}, {T}]")
    n_items = kw["num_items_in_batch"]
    if n_items is not None and float(n_items) < 0:
        raise ValueError(f"num_items_in_batch must be >= 0, got {float(n_items)}")


def token_loss(
    logprobs, advantages, completion_mask, *,
    entropy=None, old_logprobs=None, ref_logprobs=None, beta=0.0, epsilon=0.2, epsilon_high=None, delta=None,
    loss_type="dapo", importance_sampling_level="token", max_completion_length=None, num_items_in_batch=None,
    importance_weights=None, sapo_temperature_pos=1.0, sapo_temperature_neg=1.05, backend="auto",
):
    """Layer 2 alone: the GRPO loss and metrics from per-token log-probs [B, T] that carry the gradient.

    For callers that already have the policy's log-probs; ``entropy`` [B, T] is only averaged into the metrics.
    """
    arguments = locals()
    loss_kwargs = {name: arguments[name] for name in _TOKEN_LOSS_DEFAULTS}
    _float_tensor("logprobs", logprobs)
    if logprobs.dim() != 2 or logprobs.numel() == 0:
        raise ValueError(f"logprobs must have shape [B, T] with B, T > 0, got {tuple(logprobs.shape)}")
    B, T = logprobs.shape
    _check_loss_kwargs(advantages, completion_mask, (B, T), logprobs.device, loss_kwargs)
    if entropy is not None:
        _float_tensor("entropy", entropy)
        _shape("entropy", entropy, [(B, T)], f"[B, T] = [{B}, {T}]")
    return _token_loss(logprobs, advantages, completion_mask, entropy, _resolve_backend(backend, logprobs.device),
                       loss_kwargs)


def _token_loss(logprobs, advantages, completion_mask, entropy, backend, loss_kwargs):
    """Layer 2 on checked inputs: the reference's autograd (torch backend) or the token kernel (triton)."""
    kw = dict(loss_kwargs)
    mask = completion_mask.to(torch.float32).contiguous()
    for name in ("old_logprobs", "ref_logprobs", "importance_weights"):
        if kw[name] is not None:
            kw[name] = kw[name].detach().float().contiguous()
    if kw["beta"] == 0.0:
        kw["ref_logprobs"] = None
    if isinstance(kw["num_items_in_batch"], torch.Tensor):
        kw["num_items_in_batch"] = float(kw["num_items_in_batch"])
    adv = advantages.detach().float().contiguous()
    logp = logprobs.float()
    if backend == "torch":
        total, metrics = reference.token_loss(logp, adv, mask, entropy=entropy, **kw)
        metrics = Metrics(metrics)
    else:
        total, metrics = _token_loss_triton(
            logp, entropy, adv, mask, kw["old_logprobs"], kw["ref_logprobs"], kw["importance_weights"],
            beta=kw["beta"], epsilon=kw["epsilon"], epsilon_high=kw["epsilon_high"], delta=kw["delta"],
            loss_type=kw["loss_type"], sequence=kw["importance_sampling_level"] == "sequence",
            max_completion_length=kw["max_completion_length"], num_items_in_batch=kw["num_items_in_batch"],
            sapo_pos=kw["sapo_temperature_pos"], sapo_neg=kw["sapo_temperature_neg"])
    metrics.logprobs = logp.detach()
    metrics.entropies = entropy.detach().float() if entropy is not None else None
    return total, metrics


def _token_loss_triton(logp, entropy, adv, mask, old, ref, iw, *, beta, epsilon, epsilon_high, delta, loss_type,
                       sequence, max_completion_length, num_items_in_batch, sapo_pos, sapo_neg):
    B = logp.shape[0]
    eps_high = epsilon if epsilon_high is None else epsilon_high
    mask_total = float(mask.sum())
    if loss_type in ("grpo", "sapo", "luspo"):
        scale = 1.0 / B
    elif loss_type == "bnpo":
        scale = 1.0 / max(mask_total, 1.0)
    elif loss_type == "dr_grpo":
        scale = 1.0 / (B * max_completion_length)
    else:  # dapo, cispo
        scale = 1.0 / max(mask_total if num_items_in_batch is None else float(num_items_in_batch), 1.0)
    kind = {"cispo": token_kernel.LOSS_CISPO, "sapo": token_kernel.LOSS_SAPO}.get(loss_type, token_kernel.LOSS_CLIPPED)
    coef, stats = token_kernel.grpo_token(
        logp.detach().contiguous(), adv, mask, old, ref, iw,
        entropy.detach().float().contiguous() if entropy is not None else None,
        loss_kind=kind, sequence=sequence, row_mean=loss_type in ("grpo", "sapo"), scale=scale, beta=beta,
        eps_low=epsilon, eps_high=eps_high, delta=delta, sapo_pos=sapo_pos, sapo_neg=sapo_neg)
    total = ScaledByCoefficient.apply(logp, stats[:, token_kernel.STAT_LOSS].sum(), coef)

    sums = stats.sum(0)
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
    elif loss_type == "cispo":
        metrics["cispo_clip_ratio"] = sums[token_kernel.STAT_CISPO] / clip_denominator
    metrics["ratio_mean"] = sums[token_kernel.STAT_RATIO] / (B if sequence else tokens)
    return total, metrics
