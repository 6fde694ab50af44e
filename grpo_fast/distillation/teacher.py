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
fake implementations and registered autograd, as the other heads'. The teacher never gets a gradient. Backends: the
torch twin (``forward``, ``backward``) and the divergence head's Triton kernels, whose record sweep also gathers the
student's logit at each target (layer 1's record then follows from the student's divergence record:
``layer1_record``) and whose backward adds layer 1's term to g (its softmax is p_s: one normaliser).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from grpo_fast.distillation import torch_twin
from grpo_fast.distillation.ops import (
    OpOperands,
    backward_schema,
    fake_gradients,
    gradient_buffers,
    gradients_out,
)
from grpo_fast.head import ops
from grpo_fast.head import torch_twin as layer1_twin
from grpo_fast.head.torch_twin import CHUNK_N, CHUNK_V, add_tile_gradients
from grpo_fast.kernels import divergence_gradient
from grpo_fast.kernels import divergence_sweep
from grpo_fast.kernels import softmax_stats
from grpo_fast.kernels.divergence_records import (
    SAVED_FIELDS,
    ModelHead,
    empty_record,
    finish,
    layer1_record,
    merge,
    tile_record,
    unpack_saved,
)

# layer 1's per-token values the forward saves for the backward (one [len, N] fp32 tensor, in this order)
LAYER1_FIELDS = softmax_stats.BackwardStats._fields


@dataclass(frozen=True)
class Teacher:
    """A teacher model's last hidden states and head, for ``grpo_fast.loss(..., teacher=...)``.

    Attributes:
        hidden: [B, T, Dt] the teacher's hidden states at the student's positions (Dt may differ from the student's).
        weight: [V, Dt] the teacher's lm_head, of hidden's dtype; V must be the student's.
        bias: [V] or None.
        softcap: the teacher's own logit soft-cap (None: none), as TRL's DistillationTrainer takes it.
        logit_scale: the teacher's own logit scale.
    """

    hidden: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor | None = None
    softcap: float | None = None
    logit_scale: float = 1.0


# ----------------------------------------------------------------------------------------------- the torch twin
def forward(student, targets, teacher, beta):
    """The combined head's forward, token chunk by token chunk.

    Args:
        student: the student's ModelHead over N >= 0 scored tokens.
        targets: [N] int64 target ids.
        teacher: the teacher's ModelHead, over the same tokens and vocabulary.
        beta: the divergence's beta, in [0, 1].

    Returns:
        (logp, entropy, divergence [N] fp32, layer1 [len(LAYER1_FIELDS), N] fp32, saved [len(SAVED_FIELDS), N] fp32,
        argmax [2, N] int64): the last three for ``backward``.
    """
    N = student.hidden.shape[0]
    dev = student.hidden.device
    outputs = []
    for n0 in range(0, N, CHUNK_N):
        n1 = min(n0 + CHUNK_N, N)
        chunk_s, chunk_t, tgt = student.tokens(n0, n1), teacher.tokens(n0, n1), targets[n0:n1]
        nothing = torch.zeros(n1 - n0, device=dev)
        run = softmax_stats.SoftmaxStats(
            torch.full((n1 - n0,), float("-inf"), device=dev), nothing, nothing, nothing, nothing
        )
        run_s = run_t = empty_record(n1 - n0, dev)
        for v0 in range(0, student.weight.shape[0], CHUNK_V):
            v1 = min(v0 + CHUNK_V, student.weight.shape[0])
            zs = torch_twin.logit_tile(chunk_s, v0, v1)  # the student's tile, once for both records
            zt = torch_twin.logit_tile(chunk_t, v0, v1)
            run = softmax_stats.merge(softmax_stats.stack(run, softmax_stats.record(zs, tgt - v0)[0]))
            run_s, run_t = merge(run_s, tile_record(zs, zt, v0)), merge(run_t, tile_record(zt, zs, v0))
        logp, entropy, layer1 = softmax_stats.finish(run, True)

        def jsd_sweep(student_finished, teacher_finished, top_log_ratio, chunk_s=chunk_s, chunk_t=chunk_t):
            return torch_twin.jsd_sweep(chunk_s, chunk_t, beta, student_finished, teacher_finished, top_log_ratio)

        div, _, saved, argmax = finish(run_s, run_t, beta, jsd_sweep)
        outputs.append((logp, entropy, div, torch.stack(tuple(layer1)), saved, argmax))
    if not outputs:
        empty = torch.zeros(0, device=dev)
        return (
            empty,
            empty,
            empty,
            torch.zeros((len(LAYER1_FIELDS), 0), device=dev),
            torch.zeros((len(SAVED_FIELDS), 0), device=dev),
            torch.zeros((2, 0), dtype=torch.int64, device=dev),
        )
    return tuple(torch.cat(parts, dim=-1) for parts in zip(*outputs, strict=True))


def triton_forward(student, targets, teacher, beta):
    """``forward``'s outputs by the divergence head's Triton record sweep, which also gathers the student's logit at
    each target; layer 1's record is then ``layer1_record``. Arguments as ``forward``'s; no scored token runs the
    torch twin (nothing to launch)."""
    if student.hidden.shape[0] == 0:
        return forward(student, targets, teacher, beta)
    sweep = divergence_sweep.records(student, teacher, beta, targets=targets)
    logp, entropy, layer1 = softmax_stats.finish(layer1_record(sweep.student, targets, sweep.target_logit), True)
    div, _, saved, argmax = finish(sweep.student, sweep.teacher, beta, sweep.jsd_sweep)
    return logp, entropy, div, torch.stack(tuple(layer1)), saved, argmax


def backward(grads, student, targets, teacher, layer1, saved, argmax, beta, student_grads):
    """Accumulate the student's gradients, recomputing each student tile once (module docstring).

    Args:
        grads: (dL/dlogp, dL/dentropy, dL/d divergence), [N] fp32 each.
        student: the student's ModelHead over N tokens.
        targets: [N] int64 target ids.
        teacher: the teacher's ModelHead, over the same tokens and vocabulary.
        layer1: [len(LAYER1_FIELDS), N] fp32, the forward's layer-1 values.
        saved: [len(SAVED_FIELDS), N] fp32, the forward's divergence values.
        argmax: [2, N] int64, the forward's argmax indices.
        beta: the divergence's beta.
        student_grads: the fp32 buffers (grad_hidden [N, Ds], grad_weight [V, Ds], grad_bias [V]), zero on entry,
            each None where not wanted.
    """
    grad_logp, grad_entropy, grad_divergence = grads
    N, V = student.hidden.shape[0], student.weight.shape[0]
    stats = softmax_stats.BackwardStats(*layer1)
    for n0 in range(0, N, CHUNK_N):
        n1 = min(n0 + CHUNK_N, N)
        c, e, d = grad_logp[n0:n1], grad_entropy[n0:n1], grad_divergence[n0:n1]
        with_div = bool((d != 0).any())
        if not (with_div or bool((c != 0).any()) or bool((e != 0).any())):
            continue  # rows without a gradient (masked): exactly zero
        chunk_s, chunk_t, tgt = student.tokens(n0, n1), teacher.tokens(n0, n1), targets[n0:n1]
        lse = stats.lse[n0:n1]
        target_dz = c * stats.nontarget_mass[n0:n1]
        student_finished, teacher_finished, reference, excess = unpack_saved(saved[:, n0:n1], argmax[:, n0:n1])
        for v0 in range(0, V, CHUNK_V):
            v1 = min(v0 + CHUNK_V, V)
            zs, slope = torch_twin.logit_tile(chunk_s, v0, v1, slope=True)
            g = layer1_twin.logit_grad(
                zs, tgt - v0, c, e, lse, target_dz, stats.mean_logit[n0:n1], stats.mean_minus_target[n0:n1]
            )
            if with_div:
                zt = torch_twin.logit_tile(chunk_t, v0, v1)
                div_grad = torch_twin.logit_grad(
                    zs, zt, student_finished, teacher_finished, reference, excess, beta, v0
                )
                g += d[:, None] * div_grad
            g.mul_(slope)
            add_tile_gradients(g, chunk_s.hidden, student.weight, slice(n0, n1), slice(v0, v1), *student_grads)


# ----------------------------------------------------------------------------------------------- the ops
def _forward(*arguments):
    """grpo_fast::loss_head_forward: (targets, OpOperands' fields) -> ``forward``'s outputs, by the backend named in
    them: "torch" (the twin, any device) or "triton"."""
    targets, *operands = arguments
    operands = OpOperands(*operands)
    run = triton_forward if operands.backend == "triton" else forward
    student, teacher = operands.model_heads()
    return run(student, targets, teacher, operands.beta)


_forward_op = ops.custom_op(
    "loss_head_forward",
    _forward,
    ops.op_schema(OpOperands, "Tensor targets", "", "(Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)"),
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
    compiled out of the Triton backward)."""
    grad_logp, grad_entropy, grad_divergence, targets, layer1, saved, argmax, *operands = arguments[:-3]
    operands = OpOperands(*operands)
    student_grads = gradient_buffers(*operands[:3], arguments[-3:])
    student, teacher = operands.model_heads()
    grad_logp, grad_divergence = grad_logp.float().contiguous(), grad_divergence.float().contiguous()
    grad_entropy = grad_entropy.float().contiguous() if grad_entropy is not None else None
    if student.hidden.shape[0] > 0 and operands.backend == "triton":
        layer1_term = divergence_gradient.Layer1Gradient(targets, layer1.contiguous(), grad_logp, grad_entropy)
        divergence_gradient.backward(
            grad_divergence, student, teacher, saved, argmax, operands.beta, student_grads, layer1=layer1_term
        )
    elif student.hidden.shape[0] > 0:
        grad_entropy = grad_entropy if grad_entropy is not None else torch.zeros_like(grad_logp)
        grads = (grad_logp, grad_entropy, grad_divergence)
        backward(grads, student, targets, teacher, layer1, saved, argmax, operands.beta, student_grads)
    return gradients_out(student_grads, *operands[:3])


# the op's arguments before OpOperands' fields: the three upstream gradients, then what the forward saved
_BACKWARD_INPUTS = (
    "Tensor grad_logp, Tensor? grad_entropy, Tensor grad_divergence, Tensor targets, Tensor layer1, Tensor saved, "
    "Tensor argmax"
)
_backward_op = ops.custom_op("loss_head_backward", _backward_impl, backward_schema(_BACKWARD_INPUTS))


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

    backward_op = _backward_impl if ops.runs_inline(ctx.saved_tensors) else _backward_op
    grads = (zeros_for(grad_logp), grad_entropy, zeros_for(grad_divergence))
    student_grads = backward_op(*grads, *ctx.saved_tensors, *ctx.scalars, *needs)
    grads = tuple(grad if need else None for grad, need in zip(student_grads, needs, strict=True))
    return (None, *grads) + no_grads[4:]


_forward_op.register_autograd(_backward, setup_context=_setup_context)
_FORWARD_INLINE = ops.inline_function(_forward, _setup_context, _backward)


def logprobs_entropy_divergence(
    hidden,
    weight,
    targets,
    bias,
    teacher_hidden,
    teacher_weight,
    teacher_bias,
    beta,
    transform,
    teacher_transform,
    backend,
):
    """The combined head through grpo_fast::loss_head_forward (inline under a dispatch mode over real tensors, as
    layer 1's ops).

    Args:
        hidden: [N, Ds] the student's scored rows, row-contiguous.
        weight: [V, Ds] the student's head, hidden's dtype.
        targets: [N] int64 target ids.
        bias: [V] or None.
        teacher_hidden: [N, Dt] the teacher's rows (no gradient).
        teacher_weight: [V, Dt] the teacher's head, teacher_hidden's dtype.
        teacher_bias: [V] or None.
        beta: the divergence's beta (0 forward KL, 1 reverse KL, between: the generalized JSD).
        transform: the student's LogitTransform.
        teacher_transform: the teacher's (the student's temperature).
        backend: the backend's name ("torch" or "triton").

    Returns:
        (logp, entropy, divergence), [N] fp32 each, differentiable with respect to the student's hidden states,
        weight and bias.
    """
    student = ModelHead(hidden, weight, bias, transform)
    teacher = ModelHead(
        *(x.detach() if x is not None else None for x in (teacher_hidden, teacher_weight, teacher_bias)),
        teacher_transform,
    )
    operands = OpOperands.from_heads(student, teacher, beta, backend, hidden.dtype)
    args = (targets, *operands)
    out = _FORWARD_INLINE.apply(*args) if ops.runs_inline(args) else _forward_op(*args)
    return out[0], out[1], out[2]
