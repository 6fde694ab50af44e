"""``grpo_fast::routed_divergence_loss``: the distillation loss L = sum_n weights_n div_n over several in-process
teachers, each scoring a consecutive range of the student's scored rows (sorted by teacher), with the student's
gradients formed in the forward, as ``grpo_fast::divergence_loss``'s for one teacher.

Math and memory are the one-teacher loss's (``kernels.divergence_loss``): per token chunk the student's fp32 product
once, the teachers' into one fp32 buffer a segment at a time (one cuBLAS call per teacher present in the chunk, its
bias, logit scale and soft-cap applied there: ``kernels.divergence_records.TeacherSegments``), then the record, JSD
and g kernels once per chunk whatever the teachers, and one dW / db accumulator for the call. A chunk never holds
more than one teacher's weight in use, so the memory beyond the teachers' own weights is the one-teacher loss's
(the widest teacher's product buffer is the vocabulary's, [rows / 2, V] fp32, whatever its width). The torch
backend runs its twin a teacher at a time into the same gradient buffers.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from grpo_fast.backends.protocol import gemm_weight
from grpo_fast.backends.resolver import named
from grpo_fast.distillation.ops import LOSS_OUTPUTS, gradient_buffers, loss_backward, loss_fake, loss_setup_context
from grpo_fast.head.boundary import custom_op, inline_function, runs_inline
from grpo_fast.head.transform import LogitTransform
from grpo_fast.kernels.divergence_records import ModelHead, TeacherSegments


class RoutedOperands(NamedTuple):
    """The op's operands, in its schema's order.

    Attributes:
        student_hidden: [N, Ds] the student's scored rows, sorted by teacher, row-contiguous.
        student_weight: [V, Ds]; student_bias: [V] or None.
        teacher_hidden: each teacher's scored rows [N_i, D_i] (sum N_i = N), in the student's row order.
        teacher_weight: each teacher's head [V, D_i], its hidden states' dtype; teacher_bias: [V] or None each.
        starts: len(teachers) + 1 row offsets of the teachers' ranges (0 first, N last).
        beta, temperature: the divergence's; student_softcap (None: none), student_logit_scale.
        teacher_softcap: each teacher's soft-cap, 0.0 for none; teacher_logit_scale: each one's scale.
        backend: "torch" or "triton".
    """

    student_hidden: torch.Tensor
    student_weight: torch.Tensor
    student_bias: torch.Tensor | None
    teacher_hidden: list[torch.Tensor]
    teacher_weight: list[torch.Tensor]
    teacher_bias: list[torch.Tensor | None]
    starts: list[int]
    beta: float
    temperature: float
    student_softcap: float | None
    student_logit_scale: float
    teacher_softcap: list[float]
    teacher_logit_scale: list[float]
    backend: str

    def heads(self) -> tuple[ModelHead, TeacherSegments]:
        """The student's ModelHead and the teachers' TeacherSegments, each weight in its hidden states' dtype
        (``gemm_weight``: an fp32 master weight over bf16 / fp16 hidden states, cast for the GEMMs)."""
        transform = LogitTransform(self.temperature, self.student_softcap, self.student_logit_scale)
        student_weight = gemm_weight(self.student_weight, self.student_hidden)
        student = ModelHead(self.student_hidden, student_weight, self.student_bias, transform)
        teachers = tuple(
            ModelHead(
                hidden, gemm_weight(weight, hidden), bias, LogitTransform(self.temperature, softcap or None, scale)
            )
            for hidden, weight, bias, softcap, scale in zip(
                self.teacher_hidden,
                self.teacher_weight,
                self.teacher_bias,
                self.teacher_softcap,
                self.teacher_logit_scale,
                strict=True,
            )
        )
        return student, TeacherSegments(tuple(self.starts), teachers)


_SCHEMA = (
    "(Tensor student_hidden, Tensor student_weight, Tensor? student_bias, Tensor[] teacher_hidden, "
    "Tensor[] teacher_weight, Tensor?[] teacher_bias, int[] starts, float beta, float temperature, "
    "float? student_softcap, float student_logit_scale, float[] teacher_softcap, float[] teacher_logit_scale, "
    "str backend, Tensor weights, bool need_hidden, bool need_weight, bool need_bias, int token_chunk) -> "
    f"{LOSS_OUTPUTS}"
)


def _impl(*arguments):
    """(RoutedOperands' fields, weights [N], need_hidden, need_weight, need_bias, token_chunk (0: the default)) ->
    (loss [], divergence [N], the student's entropy [N], each row's teacher's entropy [N], dH [N, Ds], dW [V, Ds],
    db [V]) fp32, a gradient not wanted empty: the backend's ``divergence_loss`` over the TeacherSegments."""
    *operands, weights, need_hidden, need_weight, need_bias, token_chunk = arguments
    operands = RoutedOperands(*operands)
    hidden, weight, bias = operands[:3]
    grads = gradient_buffers(hidden, weight, bias, (need_hidden, need_weight, need_bias))
    weights = weights.float().contiguous()
    student, teachers = operands.heads()
    div, entropy, _, teacher_entropy = named(operands.backend).divergence_loss(
        student, teachers, operands.beta, weights, grads, token_chunk or None
    )
    formed = (grad if grad is not None else hidden.new_empty(0, dtype=torch.float32) for grad in grads)
    return ((weights * div).sum(), div, entropy, teacher_entropy, *formed)


_op = custom_op("routed_divergence_loss", _impl, _SCHEMA)


_op.register_fake(loss_fake)


def _backward(ctx, grad_loss, *_):
    """The one-teacher loss op's backward, its Nones shaped as the inputs (torch hands a list of tensors' flags as a
    list, and takes a list of gradients back)."""
    grads = loss_backward(ctx, grad_loss)
    return tuple(
        [None] * len(need) if isinstance(need, (list, tuple)) else grad
        for grad, need in zip(grads, ctx.needs_input_grad, strict=True)
    )


_op.register_autograd(_backward, setup_context=loss_setup_context)
_INLINE = inline_function(_impl, loss_setup_context, loss_backward)


def routed_divergence_loss(operands: RoutedOperands, weights, needs, token_chunk=None):
    """grpo_fast::routed_divergence_loss, differentiable with respect to the student's hidden states, weight and
    bias (through the gradients its forward formed).

    Args:
        operands: the RoutedOperands.
        weights: [N] fp32 dL/d div of each scored row.
        needs: (need_hidden, need_weight, need_bias): the gradients to form.
        token_chunk: tokens per gradient GEMM (None: the backend's default).

    Returns:
        (loss [], divergence [N], the student's entropy [N], each row's teacher's entropy [N]) fp32; the last three
        detached.
    """
    args = (*operands, weights.detach(), *needs, token_chunk or 0)
    return (_INLINE.apply if runs_inline(args) else _op)(*args)[:4]
