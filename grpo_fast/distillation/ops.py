"""The divergence head's custom ops, ``grpo_fast::divergence_forward`` and ``grpo_fast::divergence_backward``, and
what the combined GRPO + distillation head's ops share with them: the operand record (``OpOperands``), the schema
built from it, the gradient buffers and the backward ops' fake outputs.

The forward op returns the divergence, the student's entropy and what the backward reads (both models' finished
records, the argmax indices; on the frozen-head path J = d divergence / d student_hidden); the backward op recomputes
both models' tiles and returns the student's dH, dW, db. The teacher never gets a gradient; the entropy is detached.
``grpo_fast::divergence_loss`` is the scalar loss sum_n weights_n div_n with its gradients formed in its forward.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from grpo_fast.backends.protocol import gemm_weight
from grpo_fast.backends.resolver import named
from grpo_fast.head.boundary import custom_op, inline_function, op_schema, runs_inline, scaled_gradient
from grpo_fast.head.transform import LogitTransform
from grpo_fast.kernels.divergence_records import SAVED_FIELDS, ModelHead


# ----------------------------------------------------------------------------------------------- shared
class OpOperands(NamedTuple):
    """Both models' operands and the divergence's numbers, in the order the divergence ops' schemas take them (and
    the combined GRPO + distillation head's ops', after the targets): tensors, floats, the backend's name, a dtype.

    Attributes:
        student_hidden: [N, Ds] the student's scored rows, row-contiguous.
        student_weight: [V, Ds] the student's head rows, student_hidden's dtype or fp32.
        student_bias: [V] or None.
        teacher_hidden: [N, Dt] the teacher's scored rows (no gradient).
        teacher_weight: [V, Dt] the teacher's head rows, teacher_hidden's dtype or fp32 (``model_heads`` casts it).
        teacher_bias: [V] or None.
        beta: in [0, 1].
        temperature: both models' temperature.
        student_softcap: the student's soft-cap, or None.
        student_logit_scale: the student's logit scale.
        teacher_softcap: the teacher's soft-cap, or None.
        teacher_logit_scale: the teacher's logit scale.
        backend: "torch" or "triton".
        student_gemm_dtype: the dtype the student's hidden states and weight enter the GEMMs in.
    """

    student_hidden: torch.Tensor
    student_weight: torch.Tensor
    student_bias: torch.Tensor | None
    teacher_hidden: torch.Tensor
    teacher_weight: torch.Tensor
    teacher_bias: torch.Tensor | None
    beta: float
    temperature: float
    student_softcap: float | None
    student_logit_scale: float
    teacher_softcap: float | None
    teacher_logit_scale: float
    backend: str
    student_gemm_dtype: torch.dtype

    @classmethod
    def from_heads(
        cls, student: ModelHead, teacher: ModelHead, beta: float, backend: str, student_gemm_dtype: torch.dtype
    ) -> OpOperands:
        """The operands of both models' ModelHeads (one temperature: the student's)."""
        temperature, student_softcap, student_logit_scale = student.transform.as_floats()
        _, teacher_softcap, teacher_logit_scale = teacher.transform.as_floats()
        return cls(
            *student[:3],
            *teacher[:3],
            float(beta),
            temperature,
            student_softcap,
            student_logit_scale,
            teacher_softcap,
            teacher_logit_scale,
            backend,
            student_gemm_dtype,
        )

    def model_heads(self) -> tuple[ModelHead, ModelHead]:
        """(the student's, the teacher's) ModelHead; the student's hidden states and weight in student_gemm_dtype, the
        teacher's weight in its hidden states' dtype (``gemm_weight``)."""
        dtype = self.student_gemm_dtype
        student_transform = LogitTransform(self.temperature, self.student_softcap, self.student_logit_scale)
        teacher_transform = LogitTransform(self.temperature, self.teacher_softcap, self.teacher_logit_scale)
        return (
            ModelHead(
                self.student_hidden.to(dtype), self.student_weight.to(dtype), self.student_bias, student_transform
            ),
            ModelHead(
                self.teacher_hidden,
                gemm_weight(self.teacher_weight, self.teacher_hidden),
                self.teacher_bias,
                teacher_transform,
            ),
        )


def backward_schema(before: str) -> str:
    """A backward op's schema: ``before`` (schema text), OpOperands' fields and the three flags of the gradients
    wanted (need_hidden, need_weight, need_bias) -> the three gradients."""
    return op_schema(
        OpOperands, before, "bool need_hidden, bool need_weight, bool need_bias", "(Tensor, Tensor, Tensor)"
    )


def gradient_buffers(hidden, weight, bias, needs):
    """The student's fp32 gradient buffers for (hidden, weight, bias), zero; None where ``needs`` (three bools) says
    none is wanted, and for an absent bias."""
    need_hidden, need_weight, need_bias = needs
    dev = hidden.device
    return (
        torch.zeros(hidden.shape, dtype=torch.float32, device=dev) if need_hidden else None,
        torch.zeros(weight.shape, dtype=torch.float32, device=dev) if need_weight else None,
        torch.zeros(weight.shape[0], dtype=torch.float32, device=dev) if need_bias and bias is not None else None,
    )


def gradients_out(buffers, hidden, weight, bias):
    """A backward op's outputs from ``gradient_buffers``: each cast to its input's dtype, empty (0 elements) where it
    was not computed."""
    like = (hidden, weight, bias if bias is not None else weight)
    return tuple(
        grad.to(x.dtype) if grad is not None else x.new_empty(0) for grad, x in zip(buffers, like, strict=True)
    )


def fake_gradients(hidden, weight, bias, needs):
    """A backward op's fake outputs: ``gradients_out``'s shapes and dtypes."""
    wanted = zip(needs, (hidden, weight, bias), strict=True)
    return tuple(torch.empty_like(x) if need and x is not None else hidden.new_empty(0) for need, x in wanted)


# ----------------------------------------------------------------------------------------------- the divergence ops
def _forward(*arguments):
    """grpo_fast::divergence_forward: (OpOperands' fields, frozen_head) -> (divergence [N] fp32, the student's entropy
    [N] fp32, saved [len(SAVED_FIELDS), N] fp32, argmax [2, N] int64, J [N, Ds] fp32): the last three for the
    backward; J = d divergence / d student_hidden with ``frozen_head`` (the backward is then dH = c J, no sweep),
    else empty (the backend's ``divergence_forward``)."""
    *operands, frozen_head = arguments
    operands = OpOperands(*operands)
    student, teacher = operands.model_heads()
    *out, grad = named(operands.backend).divergence_forward(student, teacher, operands.beta, frozen_head)
    return (*out, grad if grad is not None else student.hidden.new_empty(0, dtype=torch.float32))


_forward_op = custom_op(
    "divergence_forward",
    _forward,
    op_schema(OpOperands, "", "bool frozen_head", "(Tensor, Tensor, Tensor, Tensor, Tensor)"),
)


@_forward_op.register_fake
def _(*arguments):
    """The outputs' shapes and dtypes (torch calls a fake with the op's arguments by position)."""
    hidden, frozen_head = arguments[0], arguments[-1]
    N = hidden.shape[0]
    per_token = hidden.new_empty(N, dtype=torch.float32)
    return (
        per_token,
        torch.empty_like(per_token),
        hidden.new_empty((len(SAVED_FIELDS), N), dtype=torch.float32),
        hidden.new_empty((2, N), dtype=torch.int64),
        hidden.new_empty(hidden.shape if frozen_head else (0,), dtype=torch.float32),
    )


def _backward_impl(*arguments):
    """grpo_fast::divergence_backward: (grad_divergence [N], saved, argmax, OpOperands' fields, need_hidden,
    need_weight, need_bias) -> (d student_hidden, d student_weight, d student_bias) in the inputs' dtypes (cast once
    from the fp32 accumulators, whatever dtype the GEMMs took), each empty (0 elements) where not needed."""
    grad_divergence, saved, argmax, *operands = arguments[:-3]
    operands = OpOperands(*operands)
    grads = gradient_buffers(*operands[:3], arguments[-3:])
    if operands.student_hidden.shape[0] > 0:
        student, teacher = operands.model_heads()
        named(operands.backend).divergence_backward(
            grad_divergence.float().contiguous(), student, teacher, saved, argmax, operands.beta, grads
        )
    return gradients_out(grads, *operands[:3])


_backward_op = custom_op(
    "divergence_backward", _backward_impl, backward_schema("Tensor grad_divergence, Tensor saved, Tensor argmax")
)


@_backward_op.register_fake
def _(*arguments):
    """The gradients' shapes and dtypes."""
    return fake_gradients(*arguments[3:6], arguments[-3:])


def _setup_context(ctx, inputs, output):
    *operands, frozen_head = inputs
    _, entropy, saved, argmax, frozen_grad = output
    ctx.save_for_backward(*operands[:6], saved, argmax, frozen_grad)
    ctx.scalars = operands[6:]
    ctx.frozen_head = frozen_head
    ctx.mark_non_differentiable(entropy, saved, argmax, frozen_grad)


def _backward(ctx, grad_divergence, _grad_entropy, _grad_saved, _grad_argmax, _grad_frozen):
    *tensors, saved, argmax, frozen_grad = ctx.saved_tensors
    needs = ctx.needs_input_grad[:3]  # student_hidden, student_weight, student_bias
    no_grads = (None,) * len(ctx.needs_input_grad)
    if grad_divergence is None or not any(needs):
        return no_grads
    if ctx.frozen_head:
        if needs[1] or needs[2]:
            raise RuntimeError(
                "the divergence's frozen-head forward ran (student_weight and student_bias needed no "
                "gradient then), but the backward asks for one: call it again with head_path='general'"
            )
        return ((grad_divergence.float()[:, None] * frozen_grad).to(tensors[0].dtype),) + no_grads[1:]
    backward_op = _backward_impl if runs_inline(ctx.saved_tensors) else _backward_op
    grads = backward_op(grad_divergence, saved, argmax, *tensors, *ctx.scalars, *needs)
    return tuple(grad if need else None for grad, need in zip(grads, needs, strict=True)) + no_grads[3:]


_forward_op.register_autograd(_backward, setup_context=_setup_context)
_FORWARD_INLINE = inline_function(_forward, _setup_context, _backward)


def divergence_forward(operands, frozen_head):
    """grpo_fast::divergence_forward, differentiable with respect to the student's hidden states, weight and bias.

    Inline under a dispatch mode over real tensors, as layer 1's ops (a FLOP, allocation or host-sync counter then
    sees the kernels' own torch ops).

    Args:
        operands: the OpOperands.
        frozen_head: build J in the forward (only the student's hidden states need a gradient); the backward is
            then dH = c J and raises RuntimeError if the weight or bias asks for a gradient.

    Returns:
        The op's (divergence, entropy, saved, argmax, J).
    """
    args = (*operands, frozen_head)
    return _FORWARD_INLINE.apply(*args) if runs_inline(args) else _forward_op(*args)


# ----------------------------------------------------------------------------------------------- the loss op
# grpo_fast::divergence_loss: L = sum_n weights_n div_n (TRL's DistillationTrainer loss: the divergence summed over the
# scored tokens over a normaliser), whose dL/d div (the weights) is known before the forward: the forward forms the
# student's gradients (the backend's divergence_loss: three student sweeps and one teacher sweep, none recomputed)
# and the backward only scales them by the loss's gradient.
_LOSS_ARGUMENTS = "Tensor weights, bool need_hidden, bool need_weight, bool need_bias, int token_chunk"
# the loss ops' outputs (this one's, ``multi_teacher.ops``'): loss, divergence, the student's and the teacher's
# entropy, dH, dW, db
LOSS_OUTPUTS = "(" + ", ".join(["Tensor"] * 7) + ")"


def _loss_impl(*arguments):
    """grpo_fast::divergence_loss: (OpOperands' fields, weights [N], need_hidden, need_weight, need_bias,
    token_chunk (0: the default)) -> (loss [], divergence [N], the student's entropy [N], the teacher's entropy [N],
    dH [N, Ds], dW [V, Ds], db [V]), fp32; a gradient not wanted is empty: the backend's ``divergence_loss``."""
    *operands, weights, need_hidden, need_weight, need_bias, token_chunk = arguments
    operands = OpOperands(*operands)
    hidden, weight, bias = operands[:3]
    grads = gradient_buffers(hidden, weight, bias, (need_hidden, need_weight, need_bias))
    weights = weights.float().contiguous()
    student, teacher = operands.model_heads()
    backend = named(operands.backend)
    div, entropy, _, teacher_entropy = backend.divergence_loss(
        student, teacher, operands.beta, weights, grads, token_chunk or None
    )
    formed = (grad if grad is not None else hidden.new_empty(0, dtype=torch.float32) for grad in grads)
    return ((weights * div).sum(), div, entropy, teacher_entropy, *formed)


_loss_op = custom_op("divergence_loss", _loss_impl, op_schema(OpOperands, "", _LOSS_ARGUMENTS, LOSS_OUTPUTS))


@_loss_op.register_fake
def loss_fake(*arguments):
    """The loss ops' fake outputs (this one's, ``multi_teacher.ops``': their schemas begin with the student's
    hidden, weight, bias and end in weights, need_hidden, need_weight, need_bias, token_chunk)."""
    *operands, _weights, need_hidden, need_weight, need_bias, _token_chunk = arguments
    hidden, weight, bias = operands[:3]
    per_token = hidden.new_empty(hidden.shape[0], dtype=torch.float32)
    return (
        hidden.new_empty((), dtype=torch.float32),
        per_token,
        torch.empty_like(per_token),
        torch.empty_like(per_token),
        hidden.new_empty(hidden.shape if need_hidden else (0,), dtype=torch.float32),
        weight.new_empty(weight.shape if need_weight else (0,), dtype=torch.float32),
        weight.new_empty(weight.shape[0] if need_bias and bias is not None else 0, dtype=torch.float32),
    )


def loss_setup_context(ctx, inputs, output):
    """The loss ops' (this one's, ``multi_teacher.ops``'): the formed gradients saved, the student's dtypes, which
    gradients were formed (the schemas end in need_hidden, need_weight, need_bias, token_chunk)."""
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(*output[4:])
    ctx.dtypes = tuple(x.dtype if x is not None else None for x in inputs[:3])
    need_hidden, need_weight, need_bias = inputs[-4:-1]
    ctx.formed = (need_hidden, need_weight, need_bias and inputs[2] is not None)
    ctx.mark_non_differentiable(*output[1:])


def loss_backward(ctx, grad_loss, *_):
    """The gradients formed in the forward times the loss's gradient, each in its input's dtype."""
    no_grads = (None,) * len(ctx.needs_input_grad)
    if grad_loss is None:
        return no_grads
    wanted = zip(ctx.saved_tensors, ctx.dtypes, ctx.needs_input_grad[:3], ctx.formed, strict=True)
    grads = tuple(
        scaled_gradient(grad, grad_loss, dtype) if need and formed else None for grad, dtype, need, formed in wanted
    )
    return grads + no_grads[3:]


_loss_op.register_autograd(loss_backward, setup_context=loss_setup_context)
_LOSS_INLINE = inline_function(_loss_impl, loss_setup_context, loss_backward)


def divergence_loss(operands, weights, needs, token_chunk=None):
    """grpo_fast::divergence_loss, differentiable with respect to the student's hidden states, weight and bias
    (through the gradients its forward formed).

    Args:
        operands: the OpOperands.
        weights: [N] fp32 dL/d div of each scored row (no gradient flows to them).
        needs: (need_hidden, need_weight, need_bias): the gradients to form.
        token_chunk: tokens per gradient GEMM (None: the backend's default, the Triton backend's
            ``kernels.divergence_loss.loss_chunk_rows``).

    Returns:
        (loss [], divergence [N], entropy [N]) fp32; the last two detached (the op's teacher entropy is not
        returned: the one-teacher functions have no metric of it).
    """
    args = (*operands, weights.detach(), *needs, token_chunk or 0)
    return (_LOSS_INLINE.apply if runs_inline(args) else _loss_op)(*args)[:3]
