"""torch.autograd.Function wrappers: layer 1 (fused linear log-probs) and layer 2 (GRPO token math)."""

import torch

from grpo_fast import cpu
from grpo_fast.kernels import config as kconfig
from grpo_fast.kernels import linear_logprobs_bwd, linear_logprobs_fwd, logit_grad


def linear_logprobs_forward(hidden, weight, targets, bias, temperature, compute_entropy, backend):
    """(logp, entropy or None, lse), fp32 [N], by the chosen backend; no autograd."""
    if backend == "triton":
        cfg = kconfig.launch_config(hidden.device, fwd=True, dtype=hidden.dtype)
        return linear_logprobs_fwd.linear_logprobs_fwd(hidden, weight, targets, bias, temperature, compute_entropy, cfg)
    return cpu.linear_logprobs_fwd(hidden, weight, targets, bias, temperature, compute_entropy)


class LinearLogprobs(torch.autograd.Function):
    """(hidden [N, D], weight [V, D], bias [V] | None, targets [N]) -> logp [N] fp32, entropy [N] fp32.

    Only logp carries a gradient (the entropy is a metric). Saves the inputs and the [N] lse, nothing of size V.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, compute_entropy, backend):
        logp, entropy, lse = linear_logprobs_forward(hidden, weight, targets, bias, temperature, compute_entropy,
                                                     backend)
        ctx.save_for_backward(hidden, weight, bias, targets, lse)
        ctx.temperature = temperature
        ctx.backend = backend
        if entropy is None:
            entropy = torch.zeros_like(logp)
        ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        hidden, weight, bias, targets, lse = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        coef = grad_logp.float().contiguous()
        dev = hidden.device
        cfg = kconfig.launch_config(dev, fwd=False, dtype=hidden.dtype) if ctx.backend == "triton" else None
        chunked = cfg is not None and cfg.bwd_mode == "chunked"
        # dH: the chunked path writes each row block once in the input dtype; the others accumulate in fp32
        if need_h:
            grad_hidden = (torch.empty(hidden.shape, dtype=hidden.dtype, device=dev) if chunked
                           else torch.zeros(hidden.shape, dtype=torch.float32, device=dev))
        else:
            grad_hidden = None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=dev) if need_w else None
        grad_bias = torch.zeros(weight.shape[0], dtype=torch.float32, device=dev) if need_b else None
        if need_h or need_w or need_b:
            args = (hidden, weight, targets, bias, lse, coef, ctx.temperature, grad_hidden, grad_weight, grad_bias)
            if chunked:
                logit_grad.linear_logprobs_bwd_chunked(*args, cfg)
            elif cfg is not None:
                linear_logprobs_bwd.linear_logprobs_bwd(*args, cfg)
            else:
                cpu.linear_logprobs_bwd(*args)
        return (
            grad_hidden.to(hidden.dtype) if need_h else None,
            grad_weight.to(weight.dtype) if need_w else None,
            grad_bias.to(bias.dtype) if need_b else None,
            None, None, None, None,
        )


class ScaledByCoefficient(torch.autograd.Function):
    """Returns a loss computed outside autograd; its gradient with respect to logp is ``coef`` (dL/dlogp)."""

    @staticmethod
    def forward(ctx, logp, loss_value, coef):
        ctx.save_for_backward(coef)
        return loss_value.clone()

    @staticmethod
    def backward(ctx, grad_loss):
        (coef,) = ctx.saved_tensors
        return coef * grad_loss, None, None
