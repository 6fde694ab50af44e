"""The served-teacher loss with a trained student head as one custom op, ``grpo_fast::served_trained_loss``: its
gradients formed in the forward, in the three vocabulary sweeps of layer 1's trained head (``forward_trained_head``:
the logits once, J = d logp / d hidden, dW), against four for the log-prob head with a backward.

Per token chunk, once its log-sum-exp is known (the trained head's record, at an anchor a: lse = z_a - logp_a, z_a
gathered), the chunk's divergence and its gradients with respect to the gathered logits and to logp_a follow from the
[chunk, K + 1] formulas (``served.teacher.divergence_and_gradients``): dL/dlogp_a is the trained head's coefficient (its
dense part -c p and its anchor column), dL/dz at the K ids the sparse part. Its dW and db go into the trained head's own
dW product (``operands.GradientColumns``: the entries folded into P' of the chunk, on every row with a nonzero
coefficient), the rows it leaves and dH's part through the gathered rows (``Backend.gathered_backward``). The op's
backward scales the formed gradients by the loss's.

At beta 0 the sparse part is dD/dz = G + c exp(z - pivot) with G = -p_t, the teacher's alone
(``served.teacher.gradient_factors``): each chunk's kept rows are read once, in the trained head's callback, for both
the logits and dH's sparse part sum_k dD/dz_k dz_k/du_k W_k = T + c P (``Backend.gathered_logits_and_rows``: T the rows
summed with G, P with the student's softmax weights), the anchor's row once more for dL/dlse; the sorted dW pass adds dW
and db of the rows the product left (none but rows without a coefficient). Otherwise G holds the student's log-probs:
the logits' gather (with their slope) before the sweeps, dH's after. Memory: at beta 0 dH's sparse part [N, D] and a
chunk's P and T [chunk, D], the rows left [N, K], fp32.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from grpo_fast.backends.protocol import GradientColumns, HeadGrads, HeadOperands, gemm_weight
from grpo_fast.backends.resolver import named
from grpo_fast.head.boundary import custom_op, inline_function, op_schema, runs_inline, scaled_gradient
from grpo_fast.head.transform import LogitTransform
from grpo_fast.served import teacher as served_teacher

FP32 = torch.float32


class ServedLossOperands(NamedTuple):
    """The op's operands (the scored rows).

    Attributes:
        hidden, weight, bias: the student's head ([N, D], [V, D], [V] or None), bf16 or fp32.
        anchors: [N] int64: each row's anchor id (its support's first valid entry; 0 where it has none).
        temperature, softcap, logit_scale: the student's logit transform.
        ids, teacher, valid: the support (``served.teacher.Support``), [N, K'] each.
        weights: [N] fp32 dL/d divergence of each row.
        beta, add_tail_bucket: the divergence.
        token_chunk: tokens per chunk of the trained head (0: its default).
        need_weight: form dW and db (else dH alone).
        backend: a resolved backend's name (one with ``three_sweep_heads``).
    """

    hidden: torch.Tensor
    weight: torch.Tensor
    anchors: torch.Tensor
    bias: torch.Tensor | None
    temperature: float
    softcap: float | None
    logit_scale: float
    ids: torch.Tensor
    teacher: torch.Tensor
    valid: torch.Tensor
    weights: torch.Tensor
    beta: float
    add_tail_bucket: bool
    token_chunk: int
    need_weight: bool
    backend: str

    def head(self) -> HeadOperands:
        transform = LogitTransform.from_floats(self.temperature, self.softcap, self.logit_scale)
        return HeadOperands(self.hidden, gemm_weight(self.weight, self.hidden), self.anchors, self.bias, transform)


def _served_trained_loss(*operands):
    """(loss [], divergence [N], entropy [N], dH [N, D], dW [V, D] or empty, db [V] or empty), fp32."""
    operands = ServedLossOperands(*operands)
    head = operands.head()
    backend = named(operands.backend)
    hidden, weight, bias = head.hidden, head.weight, head.bias
    dev = hidden.device
    support = served_teacher.Support(operands.ids, operands.teacher, operands.valid)
    first = support.valid.int().argmax(-1, keepdim=True)
    signal = support.valid.any(-1)
    live = support.valid & signal[:, None]
    ids = torch.where(live, support.ids, -1)
    sparse = torch.zeros(ids.shape, dtype=FP32, device=dev)
    divergence = torch.zeros(hidden.shape[0], dtype=FP32, device=dev)
    # at beta 0 the entry gradient is the teacher's alone: each chunk's kept rows are read once, for the logits and
    # the sparse part of dH (``kernels.kept_set.kept_dot_rows``); otherwise the logits now, dH's rows after the sweeps
    rows_once = operands.beta == 0.0
    teacher_gradient = served_teacher.teacher_entry_gradient(support, operands.add_tail_bucket) if rows_once else None
    # otherwise the logits and their slope (dW's entries need dz/du) from one gather
    logits, at_slope = (None, None) if rows_once else backend.gathered_logits(head, ids, slope=True)
    sparse_hidden = torch.zeros(hidden.shape, dtype=FP32, device=dev) if rows_once else None
    # dz/du at the ids, for dW: at beta 0 written by the rows' pass
    slope = torch.empty(ids.shape, dtype=FP32, device=dev) if rows_once else at_slope

    def coefficients(n0, n1, logp, entropy):
        rows = served_teacher.Support(*(x[n0:n1] for x in support))
        weights = operands.weights[n0:n1]
        if rows_once:
            chunk = head._replace(hidden=hidden[n0:n1], targets=head.targets[n0:n1])
            z, slope[n0:n1], pivot, P, T = backend.gathered_logits_and_rows(chunk, ids[n0:n1], teacher_gradient[n0:n1])
        else:
            z = logits[n0:n1]
            pivot = served_teacher.support_pivot(z, rows)
        lse = torch.where(signal[n0:n1], z.gather(-1, first[n0:n1])[:, 0] - logp.float(), 0.0)
        div, grad_z, grad_lse, c = served_teacher.gradients_at_pivot(
            z, lse, rows, operands.beta, operands.add_tail_bucket, pivot
        )
        divergence[n0:n1] = div
        # lse = z_a - logp_a: dL/dlogp_a = -dL/dlse, and z_a's column takes dL/dlse
        anchor = (grad_lse * weights)[:, None]
        sparse[n0:n1] = (grad_z * weights[:, None]).scatter_add_(1, first[n0:n1], anchor)
        if rows_once:  # sum_k dD/dz_k dz_k/du_k W_k = T + c P (G fixed at the teacher's); the anchor's row once more
            sparse_hidden[n0:n1] = T.add_(P.mul_(c[:, None])).mul_(weights[:, None])
            at = first[n0:n1]
            backend.gathered_backward(
                chunk, ids[n0:n1].gather(1, at), anchor, HeadGrads(sparse_hidden[n0:n1]), slope[n0:n1].gather(1, at)
            )
        return -grad_lse * weights

    grads = HeadGrads(
        torch.empty(hidden.shape, dtype=FP32, device=dev),
        torch.zeros(weight.shape, dtype=FP32, device=dev) if operands.need_weight else None,
        torch.zeros(weight.shape[0], dtype=FP32, device=dev) if operands.need_weight and bias is not None else None,
    )
    # dW's and db's sparse part in the trained head's own product (the slope at the ids known by then): no sorted
    # pass over the pairs but for the rows it leaves (``columns.rest``)
    columns = None
    if operands.need_weight:
        columns = GradientColumns(ids, sparse, slope, torch.empty(ids.shape, dtype=FP32, device=dev))
    _, entropy, _ = backend.forward_trained_head(head, coefficients, grads, operands.token_chunk or None, columns)
    if rows_once:
        grads.hidden.add_(sparse_hidden)
    else:  # dH's sparse part
        backend.gathered_backward(head, ids, sparse, HeadGrads(grads.hidden), slope)
    if columns is not None:  # the rows the product left: dW and db alone
        backend.gathered_backward(head, ids, columns.rest, grads._replace(hidden=None), slope)
    loss = (operands.weights * divergence).sum()
    dw, db = (grad if grad is not None else torch.empty(0, dtype=FP32, device=dev) for grad in grads[1:3])
    return loss, divergence, entropy, grads.hidden, dw, db


_served_trained_loss_op = custom_op(
    "served_trained_loss",
    _served_trained_loss,
    op_schema(ServedLossOperands, "", "", "(" + ", ".join(["Tensor"] * 6) + ")"),
)


@_served_trained_loss_op.register_fake
def _(*operands):
    operands = ServedLossOperands(*operands)
    hidden, weight = operands.hidden, operands.weight
    N = hidden.shape[0]
    return (
        hidden.new_empty((), dtype=FP32),
        hidden.new_empty(N, dtype=FP32),
        hidden.new_empty(N, dtype=FP32),
        hidden.new_empty(hidden.shape, dtype=FP32),
        weight.new_empty(weight.shape if operands.need_weight else (0,), dtype=FP32),
        weight.new_empty(weight.shape[0] if operands.need_weight and operands.bias is not None else 0, dtype=FP32),
    )


def _setup_context(ctx, inputs, output):
    operands = ServedLossOperands(*inputs)
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(*output[3:6])
    bias_dtype = operands.bias.dtype if operands.bias is not None else None
    ctx.dtypes = (operands.hidden.dtype, operands.weight.dtype, bias_dtype)


def _backward(ctx, grad_loss, *_):
    """The gradients formed in the forward times the loss's gradient, each in its input's dtype."""
    count = len(ctx.needs_input_grad)
    if grad_loss is None:
        return (None,) * count
    grad_hidden, grad_weight, grad_bias = ctx.saved_tensors
    need_h, need_w, _, need_b = ctx.needs_input_grad[:4]
    hidden_dtype, weight_dtype, bias_dtype = ctx.dtypes

    def scaled(grad, dtype, need):
        return scaled_gradient(grad, grad_loss, dtype) if need and grad.numel() else None

    return (
        scaled(grad_hidden, hidden_dtype, need_h),
        scaled(grad_weight, weight_dtype, need_w),
        None,
        scaled(grad_bias, bias_dtype, need_b),
    ) + (None,) * (count - 4)


_served_trained_loss_op.register_autograd(_backward, setup_context=_setup_context)
_INLINE = inline_function(_served_trained_loss, _setup_context, _backward)


def served_trained_loss(operands: ServedLossOperands):
    """(loss, divergence [N], entropy [N]): the op's, the loss differentiable in hidden, weight and bias."""
    args = tuple(operands)
    out = _INLINE.apply(*args) if runs_inline(args) else _served_trained_loss_op(*args)
    return out[0], out[1].detach(), out[2].detach()
