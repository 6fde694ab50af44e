"""RL and distillation in one call: the student's head computes its log-probs, its entropy and its divergence from a
teacher in the same vocabulary sweeps (``grpo_fast.loss(..., teacher=grpo_fast.Teacher(...))``).

Per vocabulary tile the student's logits are built once (one GEMM) and folded into both of its records: layer 1's
(kernels/softmax_stats.py: log-prob of the target, entropy, what layer 1's backward reads) and the divergence's
(divergence_torch.py: both models' mergeable records, the teacher's tile beside it). The finishing formulas are
theirs, unchanged, so the outputs are the separate heads' outputs (the same chunks, the same folds). The JSD's
second sweep is the divergence head's own (it needs both final normalisers).

The backward recomputes each student tile once (with the teacher's where the divergence has a gradient) and forms
    dL/dz_s = layer 1's term (grad_logp (onehot(y) - p_s) + grad_entropy dH/dz, the target column from the carried
              1 - p_y and mean - z_y: torch_backend.logit_grad) + grad_div d div / dz_s (divergence_torch.logit_grad)
times the transform's slope, then one dH, one dW and one db. Against the two separate heads (each: a forward sweep,
a recompute sweep, dH and dW) the student's projections fall from 4 to 2 and its gradient GEMMs from 4 to 2
(tests/test_loss_with_teacher.py counts them).

The boundary with torch is two custom ops (``grpo_fast::loss_head_forward``, ``grpo_fast::loss_head_backward``) with
fake implementations and registered autograd, as the other heads'. The teacher never gets a gradient. Backends:
the torch twin (``forward``, ``backward``: layer 1's record folded beside the divergence's) and the divergence head's
Triton kernels (kernels/divergence.py), whose forward also gathers the student's logit at each target in its sweep
(layer 1's record then follows from the divergence's student record: ``layer1_record``) and whose backward adds
layer 1's term to g (its p is the divergence's p_s: one normaliser) before the same cuBLAS dH and dW.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from grpo_fast.distillation import torch_twin as dt
from grpo_fast.head import ops
from grpo_fast.head import torch_twin as torch_backend
from grpo_fast.head.torch_twin import CHUNK_N, CHUNK_V, add_tile_gradients
from grpo_fast.head.transform import LogitTransform
from grpo_fast.kernels import divergence as kdivergence
from grpo_fast.kernels import softmax_stats

# layer 1's per-token values the forward saves for the backward (one [len, N] fp32 tensor, in this order:
# softmax_stats.BackwardStats' fields)
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
def forward(
    hidden, weight, targets, bias, teacher_hidden, teacher_weight, teacher_bias, beta, transform, teacher_transform
):
    """hidden [N, Ds], weight [V, Ds], targets [N], bias [V] | None, the teacher's [N, Dt], [V, Dt], [V] | None ->
    (logp, entropy, divergence [N] fp32, layer1 [len(LAYER1_FIELDS), N] fp32, saved [len(dt.SAVED_FIELDS), N] fp32,
    argmax [2, N] int64): the last three for ``backward``."""
    N = hidden.shape[0]
    dev = hidden.device
    outputs = []
    for n0 in range(0, N, CHUNK_N):
        n1 = min(n0 + CHUNK_N, N)
        hs, ht, tgt = hidden[n0:n1], teacher_hidden[n0:n1], targets[n0:n1]
        nothing = torch.zeros(n1 - n0, device=dev)
        run = softmax_stats.SoftmaxStats(
            torch.full((n1 - n0,), float("-inf"), device=dev), nothing, nothing, nothing, nothing
        )
        run_s = run_t = dt._empty_record(n1 - n0, dev)
        for v0 in range(0, weight.shape[0], CHUNK_V):
            v1 = min(v0 + CHUNK_V, weight.shape[0])
            zs = dt.logit_tile(hs, weight, bias, transform, v0, v1)  # the student's tile, once for both records
            zt = dt.logit_tile(ht, teacher_weight, teacher_bias, teacher_transform, v0, v1)
            run = softmax_stats.merge(softmax_stats.stack(run, softmax_stats.record(zs, tgt - v0)[0]))
            run_s, run_t = dt.merge(run_s, dt.tile_record(zs, zt, v0)), dt.merge(run_t, dt.tile_record(zt, zs, v0))
        logp, entropy, layer1 = softmax_stats.finish(run, True)

        def jsd_sweep(student, teacher, reference, hs=hs, ht=ht):
            return dt._jsd_sweep(
                hs,
                ht,
                weight,
                bias,
                teacher_weight,
                teacher_bias,
                beta,
                transform,
                teacher_transform,
                student,
                teacher,
                reference,
            )

        div, _, saved, argmax = dt.finish(run_s, run_t, beta, jsd_sweep)
        outputs.append((logp, entropy, div, torch.stack(tuple(layer1)), saved, argmax))
    if not outputs:
        empty = torch.zeros(0, device=dev)
        return (
            empty,
            empty,
            empty,
            torch.zeros((len(LAYER1_FIELDS), 0), device=dev),
            torch.zeros((len(dt.SAVED_FIELDS), 0), device=dev),
            torch.zeros((2, 0), dtype=torch.int64, device=dev),
        )
    return tuple(torch.cat(parts, dim=-1) for parts in zip(*outputs, strict=True))


def layer1_record(student, targets, target_logit):
    """Layer 1's merged record (softmax_stats.SoftmaxStats) from the divergence's student record
    (divergence_torch.Record) and the student's logit at each target: the max, zsum and rest (argmax kept out) are
    the same sums; the rest without the target is the record's rest where the target is the argmax (its logit is then
    the max, exactly), else (1 - e_y) + rest, e_y = exp(z_y - m) <= 1, p_y <= 1/2: no cancellation either way."""
    has_max = (student.max > float("-inf")).float()
    pivot = torch.where(torch.isinf(student.max), 0.0, student.max)
    top = targets == student.argmax
    target_logit = torch.where(top, student.max, target_logit)
    rest = torch.where(top, student.rest, (has_max - torch.exp(target_logit - pivot)) + student.rest)
    return softmax_stats.SoftmaxStats(student.max, has_max + student.rest, rest, student.zsum, target_logit)


def triton_forward(
    hidden, weight, targets, bias, teacher_hidden, teacher_weight, teacher_bias, beta, transform, teacher_transform
):
    """``forward``'s outputs by the divergence head's Triton forward kernel, which also gathers the student's logit
    at each target in its sweep (kernels/divergence.py, WITH_TARGET); layer 1's record is then ``layer1_record``."""
    if hidden.shape[0] == 0:
        return forward(hidden, weight, targets, bias, teacher_hidden, teacher_weight, teacher_bias, beta, transform,
                       teacher_transform)  # fmt: skip
    run_s, run_t, jsd_sweep, target_logit = kdivergence.records(
        hidden, weight, bias, teacher_hidden, teacher_weight, teacher_bias, beta, transform, teacher_transform,
        targets=targets)  # fmt: skip
    logp, entropy, layer1 = softmax_stats.finish(layer1_record(run_s, targets, target_logit), True)
    div, _, saved, argmax = dt.finish(run_s, run_t, beta, jsd_sweep)
    return logp, entropy, div, torch.stack(tuple(layer1)), saved, argmax


def backward(grad_logp, grad_entropy, grad_divergence, hidden, weight, targets, bias, teacher_hidden, teacher_weight,
             teacher_bias, layer1, saved, argmax, beta, transform, teacher_transform, grad_hidden, grad_weight,
             grad_bias):  # fmt: skip
    """Accumulate the student's gradients into the fp32 buffers grad_hidden [N, Ds], grad_weight [V, Ds],
    grad_bias [V] (zero on entry; each may be None) from dL/dlogp, dL/dentropy and dL/d divergence [N] fp32,
    recomputing each student tile once (module docstring)."""
    N, V = hidden.shape[0], weight.shape[0]
    stats = softmax_stats.BackwardStats(*layer1)
    for n0 in range(0, N, CHUNK_N):
        n1 = min(n0 + CHUNK_N, N)
        c, e, d = grad_logp[n0:n1], grad_entropy[n0:n1], grad_divergence[n0:n1]
        with_div = bool((d != 0).any())
        if not (with_div or bool((c != 0).any()) or bool((e != 0).any())):
            continue  # rows without a gradient (masked): exactly zero
        hs, ht, tgt = hidden[n0:n1], teacher_hidden[n0:n1], targets[n0:n1]
        lse = stats.lse[n0:n1]
        target_dz = c * stats.nontarget_mass[n0:n1]
        student, teacher, reference, excess = dt.unpack(saved[:, n0:n1], argmax[:, n0:n1])
        for v0 in range(0, V, CHUNK_V):
            v1 = min(v0 + CHUNK_V, V)
            zs, slope = dt.logit_tile(hs, weight, bias, transform, v0, v1, slope=True)
            g = torch_backend.logit_grad(
                zs, tgt - v0, c, e, lse, target_dz, stats.mean_logit[n0:n1], stats.mean_minus_target[n0:n1]
            )
            if with_div:
                zt = dt.logit_tile(ht, teacher_weight, teacher_bias, teacher_transform, v0, v1)
                g += d[:, None] * dt.logit_grad(zs, zt, student, teacher, reference, excess, beta, v0)
            g.mul_(slope)
            add_tile_gradients(g, hs, weight, slice(n0, n1), slice(v0, v1), grad_hidden, grad_weight, grad_bias)


# ----------------------------------------------------------------------------------------------- the ops
def _transforms(temperature, softcap, logit_scale, teacher_softcap, teacher_logit_scale):
    """(student's, teacher's) LogitTransform: one temperature for both (TRL's)."""
    return (
        LogitTransform.from_floats(temperature, softcap, logit_scale),
        LogitTransform.from_floats(temperature, teacher_softcap, teacher_logit_scale),
    )


def _forward(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, bias: torch.Tensor | None,
             teacher_hidden: torch.Tensor, teacher_weight: torch.Tensor, teacher_bias: torch.Tensor | None,
             beta: float, temperature: float, softcap: float | None, logit_scale: float,
             teacher_softcap: float | None, teacher_logit_scale: float, backend: str
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """The combined head's forward (``forward``'s outputs) by ``backend``: "torch" (the twin, any device) or
    "triton"."""
    run = triton_forward if backend == "triton" else forward
    return run(hidden, weight, targets, bias, teacher_hidden, teacher_weight, teacher_bias, beta,
               *_transforms(temperature, softcap, logit_scale, teacher_softcap, teacher_logit_scale))  # fmt: skip


_forward_op = torch.library.custom_op("grpo_fast::loss_head_forward", mutates_args=())(_forward)


@_forward_op.register_fake
def _forward_fake(hidden, weight, targets, bias, teacher_hidden, teacher_weight, teacher_bias, beta, temperature,
                  softcap, logit_scale, teacher_softcap, teacher_logit_scale, backend):  # fmt: skip
    N = hidden.shape[0]
    per_token = hidden.new_empty(N, dtype=torch.float32)
    return (
        per_token,
        torch.empty_like(per_token),
        torch.empty_like(per_token),
        hidden.new_empty((len(LAYER1_FIELDS), N), dtype=torch.float32),
        hidden.new_empty((len(dt.SAVED_FIELDS), N), dtype=torch.float32),
        hidden.new_empty((2, N), dtype=torch.int64),
    )


def _backward_impl(
    grad_logp: torch.Tensor,
    grad_entropy: torch.Tensor | None,
    grad_divergence: torch.Tensor,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    bias: torch.Tensor | None,
    teacher_hidden: torch.Tensor,
    teacher_weight: torch.Tensor,
    teacher_bias: torch.Tensor | None,
    layer1: torch.Tensor,
    saved: torch.Tensor,
    argmax: torch.Tensor,
    beta: float,
    temperature: float,
    softcap: float | None,
    logit_scale: float,
    teacher_softcap: float | None,
    teacher_logit_scale: float,
    backend: str,
    need_hidden: bool,
    need_weight: bool,
    need_bias: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(d hidden, d weight, d bias) in the inputs' dtypes, each empty (0 elements) where not needed;
    ``grad_entropy`` None: the entropy has no gradient (its term is compiled out of the Triton backward)."""
    dev = hidden.device
    grad_hidden = torch.zeros(hidden.shape, dtype=torch.float32, device=dev) if need_hidden else None
    grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=dev) if need_weight else None
    grad_bias = (
        torch.zeros(weight.shape[0], dtype=torch.float32, device=dev) if need_bias and bias is not None else None
    )
    transforms = _transforms(temperature, softcap, logit_scale, teacher_softcap, teacher_logit_scale)
    grad_logp, grad_divergence = grad_logp.float().contiguous(), grad_divergence.float().contiguous()
    if hidden.shape[0] > 0 and backend == "triton":
        kdivergence.backward(grad_divergence, hidden, weight, bias, teacher_hidden, teacher_weight, teacher_bias,
                             saved, argmax, beta, *transforms, grad_hidden, grad_weight, grad_bias,
                             layer1=(targets, layer1.contiguous(), grad_logp,
                                     grad_entropy.float().contiguous() if grad_entropy is not None
                                     else None))  # fmt: skip
    elif hidden.shape[0] > 0:
        grad_entropy = grad_entropy.float().contiguous() if grad_entropy is not None else torch.zeros_like(grad_logp)
        backward(grad_logp, grad_entropy, grad_divergence, hidden, weight, targets, bias, teacher_hidden,
                 teacher_weight, teacher_bias, layer1, saved, argmax, beta, *transforms, grad_hidden, grad_weight,
                 grad_bias)  # fmt: skip

    def out(grad, like):
        return grad.to(like.dtype) if grad is not None else like.new_empty(0)

    return out(grad_hidden, hidden), out(grad_weight, weight), out(grad_bias, bias if bias is not None else weight)


_backward_op = torch.library.custom_op("grpo_fast::loss_head_backward", mutates_args=())(_backward_impl)


@_backward_op.register_fake
def _backward_fake(grad_logp, grad_entropy, grad_divergence, hidden, weight, targets, bias, teacher_hidden,
                   teacher_weight, teacher_bias, layer1, saved, argmax, beta, temperature, softcap, logit_scale,
                   teacher_softcap, teacher_logit_scale, backend, need_hidden, need_weight, need_bias):  # fmt: skip
    def out(need, like):
        return torch.empty_like(like) if need and like is not None else hidden.new_empty(0)

    return out(need_hidden, hidden), out(need_weight, weight), out(need_bias, bias)


def _setup_context(ctx, inputs, output):
    hidden, weight, targets, bias, teacher_hidden, teacher_weight, teacher_bias, *scalars = inputs
    logp, _, _, layer1, saved, argmax = output
    ctx.save_for_backward(
        hidden, weight, targets, bias, teacher_hidden, teacher_weight, teacher_bias, layer1, saved, argmax
    )
    ctx.scalars = scalars
    ctx.mark_non_differentiable(layer1, saved, argmax)


def _backward(ctx, grad_logp, grad_entropy, grad_divergence, _grad_layer1, _grad_saved, _grad_argmax):
    hidden, weight, targets, bias, teacher_hidden, teacher_weight, teacher_bias, layer1, saved, argmax = (
        ctx.saved_tensors
    )
    need_hidden, need_weight, need_bias = ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[3]
    if all(g is None for g in (grad_logp, grad_entropy, grad_divergence)) or not (
        need_hidden or need_weight or need_bias
    ):
        return (None,) * 14

    def zeros_for(grad):  # an output without a gradient contributes nothing
        return grad if grad is not None else torch.zeros(hidden.shape[0], dtype=torch.float32, device=hidden.device)

    backward_op = _backward_impl if ops.runs_inline(ctx.saved_tensors) else _backward_op
    d_hidden, d_weight, d_bias = backward_op(zeros_for(grad_logp), grad_entropy, zeros_for(grad_divergence),
                                             hidden, weight, targets, bias, teacher_hidden, teacher_weight,
                                             teacher_bias, layer1, saved, argmax, *ctx.scalars, need_hidden,
                                             need_weight, need_bias)  # fmt: skip
    return (
        d_hidden if need_hidden else None,
        d_weight if need_weight else None,
        None,
        d_bias if need_bias else None,
    ) + (None,) * 10


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
    """(logp, entropy, divergence) [N] fp32, differentiable with respect to the student's hidden, weight and bias,
    through grpo_fast::loss_head_forward (inline under a dispatch mode over real tensors, as grpo_fast.ops' ops).

    Args:
        hidden, weight, targets, bias: the student's scored rows [N, Ds], head [V, Ds], targets [N] int64, bias.
        teacher_hidden, teacher_weight, teacher_bias: the teacher's rows [N, Dt], head [V, Dt], bias (no gradient).
        beta: the divergence's beta (0 forward KL, 1 reverse KL, between: the generalized JSD).
        transform, teacher_transform: each model's LogitTransform (one temperature).
        backend: the backend's name ("torch" or "triton").

    Returns:
        (logp, entropy, divergence), [N] fp32 each.
    """
    args = (
        hidden,
        weight,
        targets,
        bias,
        teacher_hidden.detach(),
        teacher_weight.detach(),
        teacher_bias.detach() if teacher_bias is not None else None,
        float(beta),
        *transform.as_floats(),
        *teacher_transform.as_floats()[1:],
        backend,
    )
    out = _FORWARD_INLINE.apply(*args) if ops.runs_inline(args) else _forward_op(*args)
    return out[0], out[1], out[2]
