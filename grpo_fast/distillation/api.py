"""The student-teacher divergence head of on-policy distillation: ``grpo_fast.divergence`` and
``grpo_fast.divergence_and_entropy``, TRL 1.16's DistillationTrainer semantics without either model's logits.

    div = grpo_fast.divergence(student_hidden, student_weight, teacher_hidden, teacher_weight, completion_mask,
                               beta=0.5, temperature=0.9)          # [B, T] fp32, differentiable (student only)

The math (grpo_fast.reference's divergence section is the spec; grpo_fast/divergence_torch.py has the exact
mergeable records, the formulas and the sweep counts): beta 0 is the forward KL(teacher || student), 1 the reverse
KL(student || teacher) (TRL's default), in between the generalized JSD beta KL(p_t || m) + (1 - beta) KL(p_s || m),
m = (1 - beta) p_s + beta p_t. Each model's logits are transformed as TRL does (its own soft-cap and logit scale,
one temperature for both): config.LogitTransform, one object per model.

The boundary with torch is two custom ops (``grpo_fast::divergence_forward``, ``grpo_fast::divergence_backward``)
with fake implementations and registered autograd: the backward op recomputes both models' tiles and returns the
student's dH, dW, db; the teacher never gets a gradient. The entropy is the student's, detached (TRL's head marks
it non-differentiable: the trainer only logs it).
"""

from __future__ import annotations

import torch

from grpo_fast.distillation import parallel as divergence_parallel
from grpo_fast.distillation import torch_twin as divergence_torch
from grpo_fast.head import ops
from grpo_fast.head.inputs import (
    FLOAT_DTYPES,
    ValueChecks,
    check_head,
    check_mask,
    check_same_device,
    check_tensor,
    resolve_backend,
    row_values,
    scatter_rows,
    scored_rows,
)
from grpo_fast.head.transform import LogitTransform, check_number
from grpo_fast.kernels import divergence as kdivergence
from grpo_fast.kernels.config import HEAD_PATHS


def _transforms(temperature, student_softcap, teacher_softcap, student_logit_scale, teacher_logit_scale):
    """(student's, teacher's) LogitTransform."""
    return (
        LogitTransform(temperature, student_softcap, student_logit_scale),
        LogitTransform(temperature, teacher_softcap, teacher_logit_scale),
    )


# ----------------------------------------------------------------------------------------------- the ops
def _forward(student_hidden: torch.Tensor, student_weight: torch.Tensor, student_bias: torch.Tensor | None,
                teacher_hidden: torch.Tensor, teacher_weight: torch.Tensor, teacher_bias: torch.Tensor | None,
                beta: float, temperature: float, student_softcap: float | None, teacher_softcap: float | None,
                student_logit_scale: float, teacher_logit_scale: float, backend: str, student_gemm_dtype: torch.dtype,
                frozen_head: bool
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """[N, Ds], [V, Ds], [V] | None, [N, Dt], [V, Dt], [V] | None -> (divergence [N] fp32, student entropy [N] fp32,
    saved [len(divergence_torch.SAVED_FIELDS), N] fp32, argmax [2, N] int64, J [N, Ds] fp32): the last three for
    the backward; J = d divergence / d student_hidden with ``frozen_head`` (then the backward is dH = c J, no
    sweep), else empty. The frozen-head forward is the torch twin's algorithm on every backend (cuBLAS GEMMs on a
    GPU): divergence_torch.FrozenHead. The student's hidden states and weight enter the GEMMs rounded to
    ``student_gemm_dtype`` (divergence_and_entropy's)."""
    transforms = _transforms(temperature, student_softcap, teacher_softcap, student_logit_scale, teacher_logit_scale)
    args = (
        student_hidden.to(student_gemm_dtype),
        student_weight.to(student_gemm_dtype),
        student_bias,
        teacher_hidden,
        teacher_weight,
        teacher_bias,
        beta,
        *transforms,
    )
    if frozen_head:
        return divergence_torch.forward(*args, frozen_head=True)
    out = kdivergence.forward(*args) if backend == "triton" else divergence_torch.forward(*args)[:4]
    return (*out, student_hidden.new_empty(0, dtype=torch.float32))


_forward_op = torch.library.custom_op("grpo_fast::divergence_forward", mutates_args=())(_forward)


@_forward_op.register_fake
def _forward_fake(student_hidden, student_weight, student_bias, teacher_hidden, teacher_weight, teacher_bias, beta,
                  temperature, student_softcap, teacher_softcap, student_logit_scale, teacher_logit_scale, backend,
                  student_gemm_dtype, frozen_head):  # fmt: skip
    N = student_hidden.shape[0]
    per_token = student_hidden.new_empty(N, dtype=torch.float32)
    return (
        per_token,
        torch.empty_like(per_token),
        student_hidden.new_empty((len(divergence_torch.SAVED_FIELDS), N), dtype=torch.float32),
        student_hidden.new_empty((2, N), dtype=torch.int64),
        student_hidden.new_empty(student_hidden.shape if frozen_head else (0,), dtype=torch.float32),
    )


def _backward_impl(grad_divergence: torch.Tensor, student_hidden: torch.Tensor, student_weight: torch.Tensor,
                 student_bias: torch.Tensor | None, teacher_hidden: torch.Tensor, teacher_weight: torch.Tensor,
                 teacher_bias: torch.Tensor | None, saved: torch.Tensor, argmax: torch.Tensor, beta: float,
                 temperature: float, student_softcap: float | None, teacher_softcap: float | None,
                 student_logit_scale: float, teacher_logit_scale: float, backend: str, student_gemm_dtype: torch.dtype,
                 need_hidden: bool, need_weight: bool,
                 need_bias: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """(d student_hidden, d student_weight, d student_bias) in the inputs' dtypes (cast once from the fp32
    accumulators, whatever ``student_gemm_dtype`` the GEMMs took), each empty (0 elements) where not needed, from
    dL/d divergence [N]."""
    transforms = _transforms(temperature, student_softcap, teacher_softcap, student_logit_scale, teacher_logit_scale)
    dev = student_hidden.device
    grad_hidden = torch.zeros(student_hidden.shape, dtype=torch.float32, device=dev) if need_hidden else None
    grad_weight = torch.zeros(student_weight.shape, dtype=torch.float32, device=dev) if need_weight else None
    grad_bias = (
        torch.zeros(student_weight.shape[0], dtype=torch.float32, device=dev)
        if need_bias and student_bias is not None
        else None
    )
    args = (grad_divergence.float().contiguous(), student_hidden.to(student_gemm_dtype),
            student_weight.to(student_gemm_dtype), student_bias, teacher_hidden, teacher_weight, teacher_bias, saved,
            argmax, beta, *transforms, grad_hidden, grad_weight, grad_bias)  # fmt: skip
    if student_hidden.shape[0] > 0:
        if backend == "triton":
            kdivergence.backward(*args)
        else:
            divergence_torch.backward(*args)

    def out(grad, like):
        return grad.to(like.dtype) if grad is not None else like.new_empty(0)

    return (
        out(grad_hidden, student_hidden),
        out(grad_weight, student_weight),
        out(grad_bias, student_bias if student_bias is not None else student_weight),
    )


_backward_op = torch.library.custom_op("grpo_fast::divergence_backward", mutates_args=())(_backward_impl)


@_backward_op.register_fake
def _backward_fake(grad_divergence, student_hidden, student_weight, student_bias, teacher_hidden, teacher_weight,
                   teacher_bias, saved, argmax, beta, temperature, student_softcap, teacher_softcap,
                   student_logit_scale, teacher_logit_scale, backend, student_gemm_dtype, need_hidden, need_weight,
                   need_bias):  # fmt: skip
    def out(need, like):
        return torch.empty_like(like) if need and like is not None else student_hidden.new_empty(0)

    return out(need_hidden, student_hidden), out(need_weight, student_weight), out(need_bias, student_bias)


def _setup_context(ctx, inputs, output):
    (student_hidden, student_weight, student_bias, teacher_hidden, teacher_weight, teacher_bias, *scalars,
     frozen_head) = inputs  # fmt: skip
    _, entropy, saved, argmax, frozen_grad = output
    ctx.save_for_backward(student_hidden, student_weight, student_bias, teacher_hidden, teacher_weight,
                          teacher_bias, saved, argmax, frozen_grad)  # fmt: skip
    ctx.scalars = scalars
    ctx.frozen_head = frozen_head
    ctx.mark_non_differentiable(entropy, saved, argmax, frozen_grad)


def _backward(ctx, grad_divergence, _grad_entropy, _grad_saved, _grad_argmax, _grad_frozen):
    student_hidden, student_weight, student_bias, teacher_hidden, teacher_weight, teacher_bias, saved, argmax, \
        frozen_grad = ctx.saved_tensors  # fmt: skip
    need_hidden, need_weight, need_bias = ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2]
    if grad_divergence is None or not (need_hidden or need_weight or need_bias):
        return (None,) * 15
    if ctx.frozen_head:
        if need_weight or need_bias:
            raise RuntimeError(
                "the divergence's frozen-head forward ran (student_weight and student_bias needed no "
                "gradient then), but the backward asks for one: call it again with head_path='general'"
            )
        return ((grad_divergence.float()[:, None] * frozen_grad).to(student_hidden.dtype),) + (None,) * 14
    backward_op = _backward_impl if ops.runs_inline(ctx.saved_tensors) else _backward_op
    grads = backward_op(grad_divergence, student_hidden, student_weight, student_bias, teacher_hidden, teacher_weight,
                        teacher_bias, saved, argmax, *ctx.scalars, need_hidden, need_weight, need_bias)  # fmt: skip
    return (grads[0] if need_hidden else None, grads[1] if need_weight else None, grads[2] if need_bias else None) + (
        None,
    ) * 12


_forward_op.register_autograd(_backward, setup_context=_setup_context)
_FORWARD_INLINE = ops.inline_function(_forward, _setup_context, _backward)


def _divergence_forward(*args):
    """grpo_fast::divergence_forward, differentiable; inline under a dispatch mode over real tensors, as grpo_fast.ops'
    ops (a FLOP, allocation or host-sync counter then sees the kernels' own torch ops)."""
    return _FORWARD_INLINE.apply(*args) if ops.runs_inline(args) else _forward_op(*args)


# ----------------------------------------------------------------------------------------------- checks
def _checked(student_hidden, student_weight, teacher_hidden, teacher_weight, completion_mask, beta, temperature,
             student_bias, teacher_bias, student_softcap, teacher_softcap, student_logit_scale, teacher_logit_scale,
             backend, checks, sharded=False):  # fmt: skip
    """Every check of the public functions, with named errors (those that read values go to ``checks``, read once
    with the scored-row count: inputs.scored_rows); returns the resolved backend's name (``sharded``: the weights are
    this rank's rows of vocab-parallel heads, which may hold none: divergence_parallel)."""
    B, T, _, V = check_head(
        ("student_hidden", "student_weight", "student_bias"), student_hidden, student_weight, student_bias, sharded
    )
    Bt, Tt, _, Vt = check_head(
        ("teacher_hidden", "teacher_weight", "teacher_bias"), teacher_hidden, teacher_weight, teacher_bias, sharded
    )
    if (Bt, Tt) != (B, T):
        raise ValueError(
            f"teacher_hidden's [B, T] = {[Bt, Tt]} differs from student_hidden's {[B, T]}: both score the same tokens"
        )
    if Vt != V:
        raise ValueError(
            f"student_weight has V = {V} rows but teacher_weight has V = {Vt}: the vocabularies must match"
        )
    if completion_mask is not None:
        check_tensor("completion_mask", completion_mask)
    check_same_device(
        [
            (name, x)
            for name, x in (
                ("student_weight", student_weight),
                ("student_bias", student_bias),
                ("teacher_hidden", teacher_hidden),
                ("teacher_weight", teacher_weight),
                ("teacher_bias", teacher_bias),
                ("completion_mask", completion_mask),
            )
        ],
        student_hidden.device,
        "student_hidden",
    )
    if completion_mask is not None:
        check_mask(completion_mask, (B, T), checks)
    check_number(
        "beta",
        beta,
        lambda v: 0.0 <= v <= 1.0,
        "a number in [0, 1] (0: forward KL(teacher || student), 1: reverse KL(student || teacher))",
    )
    check_number("temperature", temperature, lambda v: v > 0, "a positive number")
    for name, softcap in (("student_softcap", student_softcap), ("teacher_softcap", teacher_softcap)):
        if softcap is not None:
            check_number(name, softcap, lambda v: v > 0, "None or a positive number (Gemma 2: 30.0)")
    for name, scale in (("student_logit_scale", student_logit_scale), ("teacher_logit_scale", teacher_logit_scale)):
        check_number(name, scale, lambda v: v != 0, "a finite non-zero number")
    backend = resolve_backend(backend, student_hidden.device)
    backend.check_sizes(B * T, V)  # a vocab-parallel shard: V is its rows, all the kernels index
    return backend.name  # the ops' schema takes the name; the divergence has kernels of its own on each backend


def _rows(hidden, rows):
    """The scored rows [N, D] of hidden [B, T, D] (inputs.Rows), row-contiguous."""
    h = row_values(hidden.reshape(-1, hidden.shape[-1]), rows)
    return h if h.stride(-1) == 1 else h.contiguous()


def _contiguous(x):
    return x.contiguous() if x is not None else None


# ----------------------------------------------------------------------------------------------- public
def divergence_and_entropy(student_hidden, student_weight, teacher_hidden, teacher_weight, completion_mask=None, *,
                           beta=1.0, temperature=1.0, student_bias=None, teacher_bias=None, student_softcap=None,
                           teacher_softcap=None, student_logit_scale=1.0, teacher_logit_scale=1.0, backend="auto",
                           head_path="auto", check_values=True, vocab_parallel=None,
                           student_gemm_dtype=None):  # fmt: skip
    """Per-token divergence between a student and a teacher head, and the student's entropy, without logits.

    TRL 1.16's ``DistillationTrainer`` divergence: each model's logit is ``softcap * tanh(logit_scale * (h . W + b)
    / softcap) / temperature`` with its own soft-cap and scale (TRL's order). Only tokens with completion_mask 1
    are computed; masked positions are exact zeros and their hidden states are never read. The teacher never gets
    a gradient. Vocab-parallel heads: both weights DTensors sharded on dim 0 by the same ranges (biases alike), or
    this rank's rows of both with ``vocab_parallel``; the hidden states replicated. Every rank returns the
    unsharded result; dW and db are this rank's rows; neither weight is gathered.

    Args:
        student_hidden: [B, T, Ds] float32, bfloat16 or float16; position t predicts the next token.
        student_weight: [V, Ds] student lm_head weight, student_hidden's dtype.
        teacher_hidden: [B, T, Dt] float32, bfloat16 or float16.
        teacher_weight: [V, Dt] teacher lm_head weight, teacher_hidden's dtype.
        completion_mask: [B, T] bool or 0/1: the tokens computed; None: every token.
        beta: in [0, 1]: 0 forward KL(teacher || student), 1 reverse KL(student || teacher), between: the
            generalized JSD (TRL's ``DistillationConfig.beta``).
        temperature: divides both models' logits (> 0).
        student_bias: [V] in student_hidden's dtype, or None.
        teacher_bias: [V] in teacher_hidden's dtype, or None.
        student_softcap: the student's soft-cap (> 0), or None: no tanh.
        teacher_softcap: the teacher's soft-cap (> 0), or None: no tanh.
        student_logit_scale: multiplies the student's raw logits (non-zero).
        teacher_logit_scale: multiplies the teacher's raw logits (non-zero).
        backend: "auto", "triton" or "torch", as in ``loss``; with vocab-parallel heads each rank runs its
            kernels on its rows.
        head_path: "auto": with a frozen student head (only student_hidden requires a gradient: LoRA, a frozen
            lm_head) the forward also builds d divergence / d student_hidden, so the backward needs no vocabulary
            sweep; "general": always recompute in the backward.
        check_values: read the mask's 0/1 check with the scored-row count in one host synchronisation; False
            reads nothing on the host (the rows are then a device partition, padding zeroed).
        vocab_parallel: a [VocabShard][grpo_fast.VocabShard] when both weights hold this rank's rows (the same
            ranges); None: whole heads, or DTensor weights.
        student_gemm_dtype: float32, bfloat16 or float16: the student's hidden states and weight are rounded to it
            for the GEMMs (autocast's dtype over an fp32 model, as TRL's head computes) and their gradients still
            come back in their own dtype, from fp32 accumulators, not rounded to it; None: their own dtype.
            Vocab-parallel heads take it as a differentiable cast of both (their gradients rounded to it).

    Returns:
        divergence: [B, T] float32, differentiable with respect to the student's hidden states, weight and bias.
        entropy: [B, T] float32, the student's entropy, detached (as TRL's head gives it).

    Raises:
        TypeError: a tensor argument that is not a tensor, a float argument not float32/bfloat16/float16, or a
            weight whose dtype is not its hidden states'.
        ValueError: a shape that does not match (B, T or V differing between the models), tensors on different
            devices, a mask value other than 0/1 (with ``check_values``), a beta outside [0, 1], a bad
            temperature, soft-cap or logit scale, an unknown ``backend`` or ``head_path``, sizes the Triton
            kernels cannot index, or vocab-parallel heads that are not sharded alike.
        TypeError: a ``student_gemm_dtype`` that is not None, float32, bfloat16 or float16.
    """
    student_hidden, student_weight, student_bias, teacher_hidden, teacher_weight, teacher_bias, shard = (
        divergence_parallel.resolve_pair(
            student_hidden, student_weight, student_bias, teacher_hidden, teacher_weight, teacher_bias, vocab_parallel
        )
    )
    if student_gemm_dtype is not None and student_gemm_dtype not in FLOAT_DTYPES:
        raise TypeError(f"student_gemm_dtype must be None, float32, bfloat16 or float16, got {student_gemm_dtype!r}")
    checks = ValueChecks(check_values, student_hidden, teacher_hidden, completion_mask)
    backend = _checked(
        student_hidden,
        student_weight,
        teacher_hidden,
        teacher_weight,
        completion_mask,
        beta,
        temperature,
        student_bias,
        teacher_bias,
        student_softcap,
        teacher_softcap,
        student_logit_scale,
        teacher_logit_scale,
        backend,
        checks,
        sharded=shard is not None,
    )
    if head_path not in HEAD_PATHS:
        raise ValueError(f"head_path must be one of {HEAD_PATHS}, got {head_path!r}")
    frozen_head = (
        head_path == "auto"
        and torch.is_grad_enabled()
        and student_hidden.requires_grad
        and not student_weight.requires_grad
        and not (student_bias is not None and student_bias.requires_grad)
    )
    B, T = student_hidden.shape[:2]
    rows = scored_rows(completion_mask, checks)
    teacher = [teacher_hidden, teacher_weight, teacher_bias]
    teacher = [x.detach() if x is not None else None for x in teacher]
    if shard is not None:
        if student_gemm_dtype is not None:
            student_hidden, student_weight = (x.to(student_gemm_dtype) for x in (student_hidden, student_weight))
        transforms = _transforms(
            float(temperature),
            None if student_softcap is None else float(student_softcap),
            None if teacher_softcap is None else float(teacher_softcap),
            float(student_logit_scale),
            float(teacher_logit_scale),
        )
        div, entropy = divergence_parallel.VocabParallelDivergence.apply(
            _rows(student_hidden, rows), _contiguous(student_weight), _contiguous(student_bias),
            _rows(teacher[0], rows), _contiguous(teacher[1]), _contiguous(teacher[2]), float(beta), *transforms, shard,
            frozen_head, backend)  # fmt: skip
        return scatter_rows(div, rows, (B, T)), scatter_rows(entropy, rows, (B, T)).detach()
    div, entropy, _, _, _ = _divergence_forward(
        _rows(student_hidden, rows),
        _contiguous(student_weight),
        _contiguous(student_bias),
        _rows(teacher[0], rows),
        _contiguous(teacher[1]),
        _contiguous(teacher[2]),
        float(beta),
        float(temperature),
        None if student_softcap is None else float(student_softcap),
        None if teacher_softcap is None else float(teacher_softcap),
        float(student_logit_scale),
        float(teacher_logit_scale),
        backend,
        student_gemm_dtype or student_hidden.dtype,
        frozen_head,
    )
    return scatter_rows(div, rows, (B, T)), scatter_rows(entropy, rows, (B, T)).detach()


def divergence(student_hidden, student_weight, teacher_hidden, teacher_weight, completion_mask=None, **kwargs):
    """The per-token divergence alone: ``divergence_and_entropy``'s first output.

    Args:
        student_hidden: [B, T, Ds] float32, bfloat16 or float16.
        student_weight: [V, Ds] student lm_head weight, student_hidden's dtype.
        teacher_hidden: [B, T, Dt] float32, bfloat16 or float16.
        teacher_weight: [V, Dt] teacher lm_head weight, teacher_hidden's dtype.
        completion_mask: [B, T] bool or 0/1; None: every token.
        **kwargs: ``divergence_and_entropy``'s keywords.

    Returns:
        [B, T] float32, differentiable with respect to the student's hidden states, weight and bias.

    Raises:
        TypeError: as ``divergence_and_entropy``.
        ValueError: as ``divergence_and_entropy``.
    """
    return divergence_and_entropy(
        student_hidden, student_weight, teacher_hidden, teacher_weight, completion_mask, **kwargs
    )[0]
