"""torch.autograd.Function wrappers: layer 1 (fused linear log-probs and entropy) and layer 2's loss value.

Every layer-1 function takes ``(hidden, weight, targets, bias, transform, ...)`` in that order, as the kernels do.
"""

import torch

from grpo_fast import cpu
from grpo_fast.kernels import backward as kbackward
from grpo_fast.kernels import config as kconfig
from grpo_fast.kernels import forward as kforward
from grpo_fast.kernels import forward_frozen as kfrozen


def forward(hidden, weight, targets, bias, transform, compute_entropy, backend):
    """(logp, entropy, lse, mean logit), fp32 [N], by the chosen backend; entropy and mean None without
    ``compute_entropy``; no autograd."""
    if backend == "triton":
        cfg = kconfig.launch_config(hidden.device, fwd=True, dtype=hidden.dtype)
        return kforward.forward(hidden, weight, targets, bias, transform, compute_entropy, cfg)
    return cpu.forward(hidden, weight, targets, bias, transform, compute_entropy)


def forward_with_grad_hidden(hidden, weight, targets, bias, transform, backend):
    """(logp, entropy, lse, mean logit, J = d logp / d hidden [N, D] fp32) by the chosen backend; no autograd."""
    if backend == "triton":
        return kfrozen.forward_frozen(hidden, weight, targets, bias, transform, True,
                                      kconfig.frozen_launch_config(hidden.device))
    return cpu.forward_with_grad_hidden(hidden, weight, targets, bias, transform, True)


def frozen_path_available(hidden, backend):
    """The frozen-head forward runs here: any torch device; Triton where cuBLAS can return fp32 from bf16 (see
    kernels/forward_frozen.py's ``available``); not with GRPO_FAST_FROZEN=recompute."""
    return kconfig.frozen_mode() == "jacobian" and (backend != "triton" or kfrozen.available(hidden))


def backward(hidden, weight, targets, bias, lse, mean_logit, coef, entropy_coef, transform, grad_hidden,
             grad_weight, grad_bias, backend):
    """Layer 1's backward by the chosen backend (and, for triton, GRPO_FAST_BWD's mode) into the given buffers."""
    args = (hidden, weight, targets, bias, lse, mean_logit, coef, entropy_coef, transform,
            grad_hidden, grad_weight, grad_bias)
    if backend == "torch":
        cpu.backward(*args)
        return
    wide_epilogue = transform.softcap is not None or entropy_coef is not None
    cfg = kconfig.launch_config(hidden.device, fwd=False, dtype=hidden.dtype, wide_epilogue=wide_epilogue)
    if cfg.bwd_mode == "chunked":
        kbackward.backward_chunked(*args, cfg)
    else:
        kbackward.backward_fused(*args, cfg)


def writes_grad_hidden_in_place(hidden, backend):
    """True when the backward writes dH once in the input dtype (chunked Triton), False when it accumulates in fp32."""
    return backend == "triton" and kconfig.launch_config(hidden.device, fwd=False).bwd_mode == "chunked"


def _grad_hidden_buffer(hidden, backend):
    """dH's buffer for ``backward``: written once in the input dtype (chunked Triton), else an fp32 zero accumulator."""
    if writes_grad_hidden_in_place(hidden, backend):
        return torch.empty(hidden.shape, dtype=hidden.dtype, device=hidden.device)
    return torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)


class LinearLogprobs(torch.autograd.Function):
    """(hidden [N, D], weight [V, D], targets [N], bias [V] | None) -> logp [N] fp32, entropy [N] fp32.

    Both outputs carry their exact gradient. Two paths:
    * recompute (the general one): saves the inputs and O(N) fp32 values (lse, and the mean logit for the
      entropy's gradient), nothing of size V; the backward recomputes the logits (an entropy that receives no
      gradient costs it nothing: its term is compiled out). Three vocabulary GEMM sweeps with a frozen weight.
    * frozen head (``allow_frozen_path``, and only hidden needs a gradient: a frozen lm_head, LoRA): the forward also
      builds J = d logp / d hidden [N, D] fp32 (kernels/forward_frozen.py), saved instead of a recompute, and the
      backward is dH = c J: two sweeps. Callers allow it when the entropy will usually get no gradient (``loss``
      without an entropy bonus, ``logprobs_and_entropy``); if one arrives anyway, its term comes from the recompute
      path with its own forward statistics: exact, at three sweeps more (five in all, against three).
    N = 0 (every row masked) gives empty outputs and zero gradients.
    """

    @staticmethod
    def forward(ctx, hidden, weight, targets, bias, transform, backend, allow_frozen_path=False):
        # entropy is usually a metric: without this, autograd would hand the backward a zero gradient for it
        ctx.set_materialize_grads(False)
        need_h, need_w, _, need_b = ctx.needs_input_grad[:4]
        ctx.frozen = (allow_frozen_path and need_h and not need_w and not need_b and hidden.shape[0] > 0
                      and frozen_path_available(hidden, backend))
        jac = None
        if hidden.shape[0] == 0:
            logp = torch.zeros(0, dtype=torch.float32, device=hidden.device)
            lse = mean_logit = entropy = logp
        elif ctx.frozen:
            logp, entropy, lse, mean_logit, jac = forward_with_grad_hidden(hidden, weight, targets, bias, transform,
                                                                           backend)
        else:
            logp, entropy, lse, mean_logit = forward(hidden, weight, targets, bias, transform, True, backend)
        ctx.save_for_backward(hidden, weight, targets, bias, lse, mean_logit, jac)
        ctx.transform = transform
        ctx.backend = backend
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        hidden, weight, targets, bias, lse, mean_logit, jac = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[:2]
        need_b = ctx.needs_input_grad[3]
        dev = hidden.device
        if ctx.frozen:
            grad_hidden = (grad_logp.float()[:, None] * jac if grad_logp is not None
                           else torch.zeros(hidden.shape, dtype=torch.float32, device=dev))
            if grad_entropy is not None:
                # an entropy gradient after all: the recompute path's entropy-only term, with that path's own lse and
                # mean logit (the frozen forward's cuBLAS logits may round differently from the recomputed tiles, and
                # p = exp(z - lse) must see one z: at logits of 1e4 the difference is 1e-3 relative)
                _, _, lse, mean_logit = forward(hidden, weight, targets, bias, ctx.transform, True, ctx.backend)
                entropy_term = _grad_hidden_buffer(hidden, ctx.backend)
                backward(hidden, weight, targets, bias, lse, mean_logit,
                         torch.zeros(hidden.shape[0], dtype=torch.float32, device=dev),
                         grad_entropy.float().contiguous(), ctx.transform, entropy_term, None, None, ctx.backend)
                grad_hidden += entropy_term
            return grad_hidden.to(hidden.dtype), None, None, None, None, None, None
        grad_hidden = _grad_hidden_buffer(hidden, ctx.backend) if need_h else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=dev) if need_w else None
        grad_bias = torch.zeros(weight.shape[0], dtype=torch.float32, device=dev) if need_b else None
        if (need_h or need_w or need_b) and hidden.shape[0] > 0:
            coef = (grad_logp.float().contiguous() if grad_logp is not None
                    else torch.zeros(hidden.shape[0], dtype=torch.float32, device=dev))
            entropy_coef = grad_entropy.float().contiguous() if grad_entropy is not None else None
            backward(hidden, weight, targets, bias, lse, mean_logit, coef, entropy_coef, ctx.transform,
                     grad_hidden, grad_weight, grad_bias, ctx.backend)
        return (
            grad_hidden.to(hidden.dtype) if need_h else None,
            grad_weight.to(weight.dtype) if need_w else None,
            None,
            grad_bias.to(bias.dtype) if need_b else None,
            None, None, None,
        )


class ScaledByCoefficient(torch.autograd.Function):
    """Returns a loss computed outside autograd; its gradients with respect to logp and entropy are the given
    coefficients (dL/dlogp, dL/dentropy; the latter may be None: the entropy then gets no gradient)."""

    @staticmethod
    def forward(ctx, logp, entropy, loss_value, coef, entropy_coef):
        ctx.save_for_backward(coef, entropy_coef)
        return loss_value.clone()

    @staticmethod
    def backward(ctx, grad_loss):
        coef, entropy_coef = ctx.saved_tensors
        grad_entropy = entropy_coef * grad_loss if entropy_coef is not None and ctx.needs_input_grad[1] else None
        return coef * grad_loss, grad_entropy, None, None, None
