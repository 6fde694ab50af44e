"""RL and distillation in one call: the student's head computes its log-probs, its entropy and its divergence from a
teacher in the same vocabulary sweeps (``grpo_fast.loss(..., teacher=grpo_fast.Teacher(...))``).

Per vocabulary tile the student's logits are built once and folded into both of its records: layer 1's
(grpo_fast.kernels.softmax_stats: the target's log-prob, the entropy, what layer 1's backward reads) and the
divergence's (grpo_fast.kernels.divergence_records, the teacher's tile beside it). Both are finished by their own
formulas, so the outputs are the separate heads' outputs; the JSD's second sweep is the divergence head's.

The backward recomputes each student tile once (with the teacher's where the divergence has a gradient) and forms
    dL/dz_s = grad_logp (onehot(y) - p_s) + grad_entropy dH/dz_s + grad_div d div / dz_s
(layer 1's target column from the carried 1 - p_y and mean - z_y), times the transform's slope, then one dH, one dW
and one db: against the two separate heads the student's projections fall from 4 to 2 and its gradient GEMMs from 4
to 2.

The boundary with torch is two custom ops (``grpo_fast::loss_head_forward``, ``grpo_fast::loss_head_backward``) with
fake implementations and registered autograd, as the other heads'. The teacher never gets a gradient. The
computation is the backend's ``combined_forward`` and ``combined_backward`` (grpo_fast.backends): the torch twin's,
or the divergence head's Triton kernels, whose record sweep also gathers the student's logit at each target (layer
1's record then follows from the student's divergence record: ``layer1_record``) and whose backward adds layer 1's
term to g (its softmax is p_s: one normaliser).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from grpo_fast.backends.protocol import BackwardStats, ModelHead
from grpo_fast.backends.resolver import named
from grpo_fast.distillation.ops import (
    OpOperands,
    backward_schema,
    fake_gradients,
    gradient_buffers,
    gradients_out,
)
from grpo_fast.head import boundary
from grpo_fast.head.inputs import HeadCall, Rows, check_head, check_same_device, row_values
from grpo_fast.head.transform import LogitTransform, check_number, check_softcap_and_scale
from grpo_fast.kernels.divergence_records import SAVED_FIELDS

# layer 1's per-token values the forward saves for the backward (one [len, N] fp32 tensor, in this order)
LAYER1_FIELDS = BackwardStats._fields


@dataclass(frozen=True)
class Teacher:
    """A teacher model's last hidden states and head, for ``grpo_fast.loss(..., teacher=...)``.

    Attributes:
        hidden: [B, T, Dt] the teacher's hidden states at the student's positions (Dt may differ from the student's).
        weight: [V, Dt] the teacher's lm_head, of hidden's dtype or fp32 over bf16 / fp16 hidden; V must be the
            student's.
        bias: [V] or None.
        softcap: the teacher's own logit soft-cap (None: none), as TRL's DistillationTrainer takes it.
        logit_scale: the teacher's own logit scale.
    """

    hidden: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor | None = None
    softcap: float | None = None
    logit_scale: float = 1.0


def check_coef_and_beta(coef, beta, default_beta, beta_meaning) -> tuple[float, float]:
    """``loss``'s ``distillation_coef`` (required with a teacher) and ``distillation_beta`` (None: ``default_beta``)
    checked, as floats; ``beta_meaning`` says what 0 and 1 are in its error."""
    if coef is None:
        raise ValueError("teacher needs distillation_coef: the weight of the per-token divergence in the loss")
    check_number("distillation_coef", coef)
    beta = default_beta if beta is None else beta
    check_number("distillation_beta", beta, lambda v: 0.0 <= v <= 1.0, f"a number in [0, 1] ({beta_meaning})")
    return float(coef), float(beta)


def check_teacher(
    teacher: Teacher,
    name: str,
    shape: tuple[int, int],
    V: int,
    device: torch.device,
    student: tuple[str, str] = ("hidden", "weight"),
    rows: tuple[str, str] = ("[B, T, Dt] with [B, T]", "hidden's"),
    sharded: bool = False,
) -> None:
    """A Teacher's tensors and numbers against the student's (named errors; ``name``: the teacher's name in them):
    its hidden states [*shape, D], its weight's V rows, the student's device. ``student``: the student's hidden
    states' and weight's names; ``rows``: the shape the teacher's hidden states must have and whose rows they are,
    as the error says them; ``sharded``: the weight is this rank's rows of a vocab-parallel head (which may hold
    none)."""
    names = (f"{name}.hidden", f"{name}.weight", f"{name}.bias")
    Bt, Tt, _, Vt = check_head(names, teacher.hidden, teacher.weight, teacher.bias, sharded)
    if (Bt, Tt) != tuple(shape):
        raise ValueError(
            f"{name}.hidden must have shape {rows[0]} = {list(shape)} ({rows[1]}), got {tuple(teacher.hidden.shape)}"
        )
    if Vt != V:
        raise ValueError(f"{student[1]} has V = {V} rows but {name}.weight has V = {Vt}: the vocabularies must match")
    check_same_device(zip(names, (teacher.hidden, teacher.weight, teacher.bias)), device, student[0])
    check_softcap_and_scale(teacher.softcap, teacher.logit_scale, (f"{name}.softcap", f"{name}.logit_scale"))


def teacher_head(teacher: Teacher, rows: Rows, temperature: float) -> ModelHead:
    """A Teacher's ModelHead over ``rows`` of its flat [B T] rows (row-contiguous, detached), with the student's
    ``temperature``."""
    hidden = row_values(teacher.hidden.reshape(-1, teacher.hidden.shape[-1]), rows).contiguous()
    bias = teacher.bias.detach().contiguous() if teacher.bias is not None else None
    transform = LogitTransform.from_floats(temperature, teacher.softcap, teacher.logit_scale)
    return ModelHead(hidden.detach(), teacher.weight.detach().contiguous(), bias, transform)


@dataclass(frozen=True)
class Distillation:
    """A call's teacher, checked (``grpo_fast.loss(..., teacher=...)``): the Teacher, the divergence's weight in the
    per-token loss and its beta."""

    teacher: Teacher
    coef: float
    beta: float

    @classmethod
    def check(cls, teacher, coef, beta, lora, vocab_parallel) -> Distillation | None:
        """``loss``'s teacher keywords checked: the Distillation, or None without a teacher (then neither
        ``distillation_coef`` nor ``distillation_beta`` may be given)."""
        if teacher is None:
            for name, value in (("distillation_coef", coef), ("distillation_beta", beta)):
                if value is not None:
                    raise ValueError(
                        f"{name} is given but teacher is None: pass teacher=grpo_fast.Teacher(hidden, "
                        "weight, ...) for the divergence it weighs"
                    )
            return None
        if not isinstance(teacher, Teacher):
            raise TypeError(
                f"teacher must be a grpo_fast.Teacher(hidden, weight, bias, softcap, logit_scale), a "
                f"grpo_fast.ServedTeacher(ids, logprobs) or a grpo_fast.Teachers(teachers, teacher_index), got "
                f"{type(teacher).__name__}"
            )
        coef, beta = check_coef_and_beta(
            coef, beta, 1.0, "0: forward KL(teacher || student), 1: reverse KL(student || teacher)"
        )
        if lora is not None:
            raise ValueError(
                "lora with a teacher is not supported: the combined head has no LoRA operand (call "
                "grpo_fast.loss and grpo_fast.divergence separately)"
            )
        if vocab_parallel is not None:
            raise ValueError(
                "vocab_parallel with a teacher is not supported: the combined head runs on one process "
                "(call grpo_fast.loss and grpo_fast.divergence separately)"
            )
        return cls(teacher, coef, beta)

    def check_against(self, head: HeadCall) -> None:
        """The teacher's tensors and numbers against the student's checked call (hidden [B, T, Ds], weight
        [V, Ds]), on a head the combined head supports (not a vocab-parallel one)."""
        if head.shard is not None:
            raise ValueError(
                "a vocab-parallel head (a sharded DTensor weight) with a teacher is not supported: the "
                "combined head runs on one process (call grpo_fast.loss and grpo_fast.divergence separately)"
            )
        check_teacher(self.teacher, "teacher", head.shape, head.weight.shape[0], head.hidden.device)

    def head(self, rows: Rows, temperature: float) -> ModelHead:
        """The teacher's ModelHead over the scored ``rows`` (``teacher_head``)."""
        return teacher_head(self.teacher, rows, temperature)

    def logprobs_entropy_divergence(self, head: HeadCall, rows: Rows):
        """The combined head on a checked call's scored ``rows``: (logp, entropy, divergence) [B, T] fp32, each
        differentiable with respect to the student's hidden states, weight and bias."""
        student = head.operands(rows)
        teacher = self.head(rows, student.transform.temperature)
        out = logprobs_entropy_divergence(
            ModelHead(student.hidden, student.weight, student.bias, student.transform),
            student.targets,
            teacher,
            self.beta,
            head.backend.name,
        )
        return tuple(head.scattered(x, rows) for x in out)


# ----------------------------------------------------------------------------------------------- the ops
def _forward(*arguments):
    """grpo_fast::loss_head_forward: (targets, OpOperands' fields) -> (logp, entropy, divergence [N], layer1
    [len(LAYER1_FIELDS), N], saved [len(SAVED_FIELDS), N], argmax [2, N] int64): the named backend's
    ``combined_forward``."""
    targets, *operands = arguments
    operands = OpOperands(*operands)
    student, teacher = operands.model_heads()
    return named(operands.backend).combined_forward(student, targets, teacher, operands.beta)


_forward_op = boundary.custom_op(
    "loss_head_forward",
    _forward,
    boundary.op_schema(OpOperands, "Tensor targets", "", "(Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)"),
)


@_forward_op.register_fake
def _(*arguments):
    """The outputs' shapes and dtypes (torch calls a fake with the op's arguments by position)."""
    hidden = arguments[1]
    N = hidden.shape[0]
    per_token = hidden.new_empty(N, dtype=torch.float32)
    return (
        per_token,
        torch.empty_like(per_token),
        torch.empty_like(per_token),
        hidden.new_empty((len(LAYER1_FIELDS), N), dtype=torch.float32),
        hidden.new_empty((len(SAVED_FIELDS), N), dtype=torch.float32),
        hidden.new_empty((2, N), dtype=torch.int64),
    )


def _backward_impl(*arguments):
    """grpo_fast::loss_head_backward: (dL/dlogp, dL/dentropy or None, dL/d divergence [N], targets, layer1, saved,
    argmax, OpOperands' fields, need_hidden, need_weight, need_bias) -> (d hidden, d weight, d bias) in the inputs'
    dtypes, each empty (0 elements) where not needed; ``grad_entropy`` None: the entropy has no gradient (its term is
    compiled out of the Triton backward). The named backend's ``combined_backward``."""
    grad_logp, grad_entropy, grad_divergence, targets, layer1, saved, argmax, *operands = arguments[:-3]
    operands = OpOperands(*operands)
    student_grads = gradient_buffers(*operands[:3], arguments[-3:])
    student, teacher = operands.model_heads()
    grad_logp, grad_divergence = grad_logp.float().contiguous(), grad_divergence.float().contiguous()
    grad_entropy = grad_entropy.float().contiguous() if grad_entropy is not None else None
    if student.hidden.shape[0] > 0:
        grads = (grad_logp, grad_entropy, grad_divergence)
        named(operands.backend).combined_backward(
            grads, student, targets, teacher, layer1, saved, argmax, operands.beta, student_grads
        )
    return gradients_out(student_grads, *operands[:3])


# the op's arguments before OpOperands' fields: the three upstream gradients, then what the forward saved
_BACKWARD_INPUTS = (
    "Tensor grad_logp, Tensor? grad_entropy, Tensor grad_divergence, Tensor targets, Tensor layer1, Tensor saved, "
    "Tensor argmax"
)
_backward_op = boundary.custom_op("loss_head_backward", _backward_impl, backward_schema(_BACKWARD_INPUTS))


@_backward_op.register_fake
def _(*arguments):
    """The gradients' shapes and dtypes."""
    return fake_gradients(*arguments[7:10], arguments[-3:])


def _setup_context(ctx, inputs, output):
    targets, *operands = inputs
    _, _, _, layer1, saved, argmax = output
    ctx.save_for_backward(targets, layer1, saved, argmax, *operands[:6])
    ctx.scalars = operands[6:]
    ctx.mark_non_differentiable(layer1, saved, argmax)


def _backward(ctx, grad_logp, grad_entropy, grad_divergence, _grad_layer1, _grad_saved, _grad_argmax):
    hidden = ctx.saved_tensors[4]
    needs = ctx.needs_input_grad[1:4]  # the student's hidden, weight, bias (after the targets)
    no_grads = (None,) * len(ctx.needs_input_grad)
    if all(g is None for g in (grad_logp, grad_entropy, grad_divergence)) or not any(needs):
        return no_grads

    def zeros_for(grad):  # an output without a gradient contributes nothing
        return grad if grad is not None else torch.zeros(hidden.shape[0], dtype=torch.float32, device=hidden.device)

    backward_op = _backward_impl if boundary.runs_inline(ctx.saved_tensors) else _backward_op
    grads = (zeros_for(grad_logp), grad_entropy, zeros_for(grad_divergence))
    student_grads = backward_op(*grads, *ctx.saved_tensors, *ctx.scalars, *needs)
    grads = tuple(grad if need else None for grad, need in zip(student_grads, needs, strict=True))
    return (None, *grads) + no_grads[4:]


_forward_op.register_autograd(_backward, setup_context=_setup_context)
_FORWARD_INLINE = boundary.inline_function(_forward, _setup_context, _backward)


def logprobs_entropy_divergence(
    student: ModelHead, targets: torch.Tensor, teacher: ModelHead, beta: float, backend: str
):
    """The combined head through grpo_fast::loss_head_forward (inline under a dispatch mode over real tensors, as
    layer 1's ops).

    Args:
        student: the student's ModelHead over its scored rows [N, Ds] (row-contiguous).
        targets: [N] int64 target ids.
        teacher: the teacher's ModelHead over the same rows (no gradient), with the student's temperature.
        beta: the divergence's beta (0 forward KL, 1 reverse KL, between: the generalized JSD).
        backend: the resolved backend's name.

    Returns:
        (logp, entropy, divergence), [N] fp32 each, differentiable with respect to the student's hidden states,
        weight and bias.
    """
    operands = OpOperands.from_heads(student, teacher, beta, backend, student.hidden.dtype)
    args = (targets, *operands)
    out = _FORWARD_INLINE.apply(*args) if boundary.runs_inline(args) else _forward_op(*args)
    return out[0], out[1], out[2]
