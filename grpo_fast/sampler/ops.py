"""The sampler's support as torch.library custom ops: ``grpo_fast::sampler_support`` (the forward: the support's
log-prob, with the sampling parameters the log-prob too, from the same rows of logits) and its backward op, with the
autograd formula registered between them (``head.boundary``: one node under torch.compile, fake implementations for
fake and meta tensors).

The backend computes (``Backend.support_forward`` / ``support_backward``); the ops carry its name, the logit
transform's floats and the sampling parameters. A target outside its kept set has NaN support and NaN gradients:
never a number that hides it.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from grpo_fast.backends.protocol import HeadGrads, HeadOperands, SamplerSupport, SupportRecord, gemm_weight
from grpo_fast.backends.resolver import named
from grpo_fast.head.boundary import custom_op, inline_function, op_schema, runs_inline
from grpo_fast.head.transform import LogitTransform

FP32 = torch.float32
# the forward's outputs: the log-probs, whether each target is in its kept set, then the SupportRecord
_RECORD = len(SupportRecord._fields)


class SamplerOpOperands(NamedTuple):
    """The support ops' operands as their schemas take them (the scored rows of ``sampler_logprobs``).

    Attributes:
        hidden, weight, targets, bias, lora_hidden, lora_weight: layer 1's (``ops.LinearOpOperands``).
        kept_ids: [N, K] int64 replayed kept sets, or None: the sampling parameters.
        temperature, softcap, logit_scale: the logit transform.
        top_k, top_p, min_p: the sampling parameters (``SamplerSupport``).
        differentiable: a backward may follow (``Backend.support_forward``'s).
        trains_head: the weight, bias or LoRA's weight takes a gradient (layer 1's general path, not its frozen head:
            ``Backend.replayed_takes_logprob``).
        backend: a resolved backend's name.
    """

    hidden: torch.Tensor
    weight: torch.Tensor
    targets: torch.Tensor
    bias: torch.Tensor | None
    lora_hidden: torch.Tensor | None
    lora_weight: torch.Tensor | None
    kept_ids: torch.Tensor | None
    temperature: float
    softcap: float | None
    logit_scale: float
    top_k: int
    top_p: float
    min_p: float
    differentiable: bool
    trains_head: bool
    backend: str

    @classmethod
    def of(cls, head: HeadOperands, support: SamplerSupport, backend: str) -> SamplerOpOperands:
        lora = head.lora if head.lora is not None else (None, None)
        transform = head.transform.as_floats()
        tensors = (head.hidden, head.weight, head.bias, *lora)
        grad = torch.is_grad_enabled()
        differentiable = grad and any(x is not None and x.requires_grad for x in tensors)
        trains_head = grad and any(x is not None and x.requires_grad for x in (head.weight, head.bias, lora[1]))
        fields = (support.kept_ids, *transform, *support[:3], differentiable, trains_head, backend)
        return cls(*head[:4], *lora, *fields)

    def head(self) -> HeadOperands:
        lora = (self.lora_hidden, self.lora_weight) if self.lora_hidden is not None else None
        transform = LogitTransform.from_floats(self.temperature, self.softcap, self.logit_scale)
        weight = gemm_weight(self.weight, self.hidden)
        return HeadOperands(self.hidden, weight, self.targets, self.bias, transform, lora)

    def support(self) -> SamplerSupport:
        return SamplerSupport(self.top_k, self.top_p, self.min_p, self.kept_ids)


def drawable_targets(record: SupportRecord, replayed: bool) -> torch.Tensor:
    """[N] bool: the target is in its kept set (a replayed set holds it; its logit is at or above the threshold). A
    NaN logit counts as drawable: its NaN then reaches the outputs as what it is, not as a target outside its set."""
    if replayed:
        return record.target_logit != -math.inf
    return ~(record.target_logit < record.threshold)


def computes_logprob(operands: SamplerOpOperands) -> bool:
    """Whether the forward op computes the log-prob too: with the sampling parameters (the same rows of logits), and
    with replayed sets where the backend's one record sweep gives both (``Backend.replayed_takes_logprob``);
    otherwise replayed sets leave it to layer 1's op (their backward is the support's alone). Operands only: the
    fake decides alike."""
    if operands.kept_ids is None:
        return True
    return named(operands.backend).replayed_takes_logprob(operands.differentiable, operands.trains_head)


def support_outputs(record: SupportRecord, replayed: bool):
    """(logp, support, drawable) [N] of a support's record: support NaN where the target is not drawable; with
    replayed sets logp is the record's (``support_twin.with_logprob``'s), empty where the backend left the log-prob to
    layer 1's op."""
    drawable = drawable_targets(record, replayed)
    support = torch.where(drawable, record.target_logit - record.kept_lse, math.nan)
    logp = record.logprob.clone()
    return logp, support, drawable


def masked_support_gradient(grad_support, drawable):
    """dL/ds as fp32, NaN where the target is not drawable (never a number that hides it); a row whose support gets
    no gradient (masked, padding) stays exactly zero, drawable or not. None stays None."""
    if grad_support is None:
        return None
    return torch.where(drawable | (grad_support == 0), grad_support.float(), math.nan)


def gradient_buffers(sources, needs) -> HeadGrads:
    """The fp32 zero buffers of the operands' gradients ``support_backward`` accumulates into (None where not
    needed or absent)."""
    return HeadGrads(
        *(
            torch.zeros(x.shape, dtype=FP32, device=x.device) if need and x is not None else None
            for x, need in zip(sources, needs)
        )
    )


def _sampler_support(*operands):
    """(logp, support, drawable, *SupportRecord), [N] each (``support_outputs``; the threshold empty with replayed
    sets; logp and the record's lse, nontarget_mass and logprob empty where the op does not compute the log-prob:
    ``computes_logprob``)."""
    operands = SamplerOpOperands(*operands)
    record = named(operands.backend).support_forward(
        operands.head(), operands.support(), differentiable=operands.differentiable, trains_head=operands.trains_head
    )
    return (*support_outputs(record, operands.kept_ids is not None), *record)


_sampler_support_op = custom_op(
    "sampler_support",
    _sampler_support,
    op_schema(SamplerOpOperands, "", "", "(" + ", ".join(["Tensor"] * (3 + _RECORD)) + ")"),
)


@_sampler_support_op.register_fake
def _(*operands):
    operands = SamplerOpOperands(*operands)
    N = operands.hidden.shape[0]
    full, replayed = computes_logprob(operands), operands.kept_ids is not None

    def per_token(computed=True, dtype=FP32):
        return operands.hidden.new_empty((N,) if computed else (0,), dtype=dtype)

    # the record: target_logit, kept_lse, kept_nontarget_mass, threshold (the parameters'), then lse, nontarget_mass
    # and logprob where the op computes the log-prob, then the kept ids where the backend carries them
    record = [per_token() for _ in range(3)] + [per_token(not replayed)] + [per_token(full) for _ in range(3)]
    width = named(operands.backend).carried_kept_width(operands.support(), None, operands.differentiable)
    ids = operands.hidden.new_empty((N, width) if width else (0,), dtype=torch.int64)
    return (per_token(full), per_token(), per_token(dtype=torch.bool), *record, ids)


def _setup_context(ctx, inputs, output):
    ctx.set_materialize_grads(False)
    operands = SamplerOpOperands(*inputs)
    tensors = [x if isinstance(x, torch.Tensor) else None for x in operands]
    ctx.save_for_backward(*tensors, output[2], *output[3:])
    ctx.numbers = [x if not isinstance(x, torch.Tensor) else None for x in operands]


def _backward(ctx, grad_logp, grad_support, *_):
    saved = ctx.saved_tensors
    count = len(SamplerOpOperands._fields)
    operands = SamplerOpOperands(*(t if n is None else n for t, n in zip(saved[:count], ctx.numbers)))
    drawable, record = saved[count], saved[count + 1 :]
    grad_support = masked_support_gradient(grad_support, drawable)
    if grad_logp is not None:
        grad_logp = grad_logp.float()
    needs = tuple(ctx.needs_input_grad[i] for i in (0, 1, 3, 4, 5))
    grads = sampler_support_backward(operands, record, grad_logp, grad_support, needs)
    hidden_grad, weight_grad, bias_grad, lora_hidden_grad, lora_weight_grad = (
        g if g is not None and g.numel() else None for g in grads
    )
    return (hidden_grad, weight_grad, None, bias_grad, lora_hidden_grad, lora_weight_grad) + (None,) * (count - 6)


def _sampler_support_backward(*arguments):
    """(dH, dW, db, d lora_hidden, d lora_weight) in their operands' dtypes (empty where not needed): the support's
    (and with the parameters the log-prob's) gradients from dL/dlogp and dL/ds ([N] fp32, or None)."""
    count = len(SamplerOpOperands._fields)
    operands = SamplerOpOperands(*arguments[:count])
    record = SupportRecord(*arguments[count : count + _RECORD])
    grad_logp, grad_support = arguments[count + _RECORD : count + _RECORD + 2]
    needs = arguments[-5:]
    sources = (operands.hidden, operands.weight, operands.bias, operands.lora_hidden, operands.lora_weight)
    grads = gradient_buffers(sources, needs)
    named(operands.backend).support_backward(
        operands.head(), operands.support(), record, grad_logp, grad_support, grads
    )
    return tuple(g.to(x.dtype) if g is not None else operands.hidden.new_empty(0) for g, x in zip(grads, sources))


_sampler_support_backward_op = custom_op(
    "sampler_support_backward",
    _sampler_support_backward,
    op_schema(
        SamplerOpOperands,
        "",
        ", ".join(f"Tensor {name}" for name in SupportRecord._fields)
        + ", Tensor? grad_logp, Tensor? grad_support, bool need_hidden, bool need_weight, bool need_bias, "
        "bool need_lora_hidden, bool need_lora_weight",
        "(Tensor, Tensor, Tensor, Tensor, Tensor)",
    ),
)


@_sampler_support_backward_op.register_fake
def _(*arguments):
    operands = SamplerOpOperands(*arguments[: len(SamplerOpOperands._fields)])
    needs = arguments[-5:]
    sources = (operands.hidden, operands.weight, operands.bias, operands.lora_hidden, operands.lora_weight)
    return tuple(
        x.new_empty(x.shape) if need and x is not None else operands.hidden.new_empty(0)
        for x, need in zip(sources, needs)
    )


def sampler_support_backward(operands, record, grad_logp, grad_support, needs):
    args = (*operands, *record, grad_logp, grad_support, *needs)
    return _sampler_support_backward(*args) if runs_inline(args) else _sampler_support_backward_op(*args)


_sampler_support_op.register_autograd(_backward, setup_context=_setup_context)
_INLINE = inline_function(_sampler_support, _setup_context, _backward)


def sampler_support(head: HeadOperands, backend: str, support: SamplerSupport):
    """(logp, support, drawable) [N] of ``head``'s rows, logp and support differentiable (logp None where the op
    does not compute it, ``computes_logprob``: layer 1's op does)."""
    operands = SamplerOpOperands.of(head, support, backend)
    args = tuple(operands)
    outputs = _INLINE.apply(*args) if runs_inline(args) else _sampler_support_op(*args)
    return (outputs[0] if computes_logprob(operands) else None, *outputs[1:3])
