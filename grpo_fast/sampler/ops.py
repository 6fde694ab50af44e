"""The support log-prob's autograd formula around the backend's forward and backward (``Backend.support_forward``,
``support_backward``): s = z_y - log sum_{v kept} exp(z_v), its gradient reaching hidden, weight, bias and LoRA's
operand pair. A target outside its kept set has NaN support, and NaN gradients: never a number that hides it."""

from __future__ import annotations

import math

import torch

from grpo_fast.backends.protocol import Backend, HeadGrads, HeadOperands, SamplerSupport, SupportRecord


class _SupportLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, backend, support, transform, targets, hidden, weight, bias, lora_hidden, lora_weight):
        lora = (lora_hidden, lora_weight) if lora_hidden is not None else None
        head = HeadOperands(hidden, weight, targets, bias, transform, lora)
        record = backend.support_forward(head, support)
        if support.kept_ids is None:
            drawable = record.target_logit >= record.threshold
        else:
            drawable = record.target_logit > -math.inf
        ctx.backend, ctx.support, ctx.transform = backend, support, transform
        ctx.save_for_backward(targets, hidden, weight, bias, lora_hidden, lora_weight, *record, drawable)
        ctx.mark_non_differentiable(drawable)
        return torch.where(drawable, record.target_logit - record.kept_lse, math.nan), drawable

    @staticmethod
    def backward(ctx, grad_support, _):
        targets, hidden, weight, bias, lora_hidden, lora_weight, *fields, drawable = ctx.saved_tensors
        record = SupportRecord(*fields)
        needs = ctx.needs_input_grad[4:9]

        def buffer(x, need):
            return torch.zeros(x.shape, dtype=torch.float32, device=x.device) if need and x is not None else None

        grads = HeadGrads(
            *(buffer(x, need) for x, need in zip((hidden, weight, bias, lora_hidden, lora_weight), needs))
        )
        lora = (lora_hidden, lora_weight) if lora_hidden is not None else None
        head = HeadOperands(hidden, weight, targets, bias, ctx.transform, lora)
        # a row whose support gets no gradient (masked, padding) stays exactly zero, drawable or not
        coefficient = torch.where(drawable | (grad_support == 0), grad_support.float(), math.nan)
        ctx.backend.support_backward(head, ctx.support, record, coefficient, grads)
        out = [
            g.to(x.dtype) if g is not None else None
            for g, x in zip(grads, (hidden, weight, bias, lora_hidden, lora_weight))
        ]
        return (None, None, None, None, *out)


def support_logprobs(head: HeadOperands, backend: Backend, support: SamplerSupport):
    """([N] fp32 support log-probs of ``head``'s rows, differentiable; [N] bool: the target is in its kept set)."""
    lora_hidden, lora_weight = head.lora if head.lora is not None else (None, None)
    return _SupportLogprobs.apply(
        backend, support, head.transform, head.targets, head.hidden, head.weight, head.bias, lora_hidden, lora_weight
    )
