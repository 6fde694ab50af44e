"""Layer 1's torch.library custom ops: the forward (general or frozen-head) with its registered autograd formula,
and the backward; ``linear_logprobs_path`` chooses the path and calls the forward op.

The boundary is ``head.boundary``'s (one node under torch.compile, fake implementations for fake and meta tensors);
the logit transform travels as its three floats (``LogitTransform.as_floats``), the backend, head path and backward
mode as strings and flags.

``custom_op``, not ``triton_op``: the implementations are Python around Triton launches and cuBLAS GEMMs, whose
launch configurations are chosen from sizes at call time, plus a chunked-torch twin on any device; an opaque
``custom_op`` is one node that serves both backends, the CPU interpreter and fake tensors alike.

``workspace_bytes``: what an implementation allocates besides its outputs (a memory estimate over fake tensors).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from grpo_fast.backends.protocol import BackwardStats, HeadGrads, HeadOperands, gemm_weight
from grpo_fast.backends.resolver import named
from grpo_fast.head import paths
from grpo_fast.head.boundary import custom_op, inline_function, op_schema, runs_inline, without_autocast
from grpo_fast.head.paths import ONE_PROCESS
from grpo_fast.head.transform import LogitTransform
from grpo_fast.kernels import config as kconfig
from grpo_fast.kernels.config import BackwardMode, HeadPath

FP32 = torch.float32


class LinearOpOperands(NamedTuple):
    """Layer 1's operands as both custom ops' schemas take them (tensors, numbers, strings), in that order.

    Attributes:
        hidden: [N, D] the scored rows, row-contiguous.
        weight: [V, D] the head's rows, hidden's dtype or fp32 over bf16 / fp16 hidden (``head`` casts it).
        targets: [N] int64.
        bias: [V] or None.
        lora_hidden: [N, r] LoRA's first operand, or None.
        lora_weight: [V, r] LoRA's second operand, or None (both or neither).
        temperature, softcap, logit_scale: the logit transform (``LogitTransform.as_floats``).
        backend: a resolved backend's name (``grpo_fast.backends.resolver.named``).
        backward_mode: one of config.BACKWARD_MODES (the forward op does not read it; the autograd formula does).
    """

    hidden: torch.Tensor
    weight: torch.Tensor
    targets: torch.Tensor
    bias: torch.Tensor | None
    lora_hidden: torch.Tensor | None
    lora_weight: torch.Tensor | None
    temperature: float
    softcap: float | None
    logit_scale: float
    backend: str
    backward_mode: str

    @classmethod
    def of(cls, head: HeadOperands, backend: str, backward_mode: str = "chunked") -> LinearOpOperands:
        """The schema's operands of a HeadOperands, a backend's name and a backward mode."""
        lora = head.lora if head.lora is not None else (None, None)
        return cls(*head[:4], *lora, *head.transform.as_floats(), backend, backward_mode)

    def head(self) -> HeadOperands:
        """The HeadOperands the backends take, the weight in hidden's dtype (``gemm_weight``)."""
        lora = (self.lora_hidden, self.lora_weight) if self.lora_hidden is not None else None
        transform = LogitTransform.from_floats(self.temperature, self.softcap, self.logit_scale)
        weight = gemm_weight(self.weight, self.hidden)
        return HeadOperands(self.hidden, weight, self.targets, self.bias, transform, lora)

    def with_tensors(self, convert) -> LinearOpOperands:
        """The same operands with ``convert`` applied to each tensor (a fake-tensor mode's ``from_tensor``)."""
        return type(self)(*(convert(x) if isinstance(x, torch.Tensor) else x for x in self))


def _nothing(like):
    """The empty tensor that stands for an output a path does not produce."""
    return torch.empty(0, dtype=FP32, device=like.device)


def _or_nothing(x, like):
    return x if x is not None else _nothing(like)


def _given(x):
    """None for an output that stands for nothing (an empty tensor where a [N, ...] one would be)."""
    return x if x is not None and x.numel() > 0 else None


# ----------------------------------------------------------------------------------------------- layer 1: forward
_FORWARD_ARGUMENTS = "bool compute_entropy, bool frozen_head, Tensor? row_count"
_FORWARD_OUTPUTS = 8


def _linear_logprobs(*arguments):
    """grpo_fast::linear_logprobs: (LinearOpOperands' fields, compute_entropy, frozen_head, row_count) -> (logp,
    entropy, lse, nontarget_mass, mean_logit, mean_minus_target, J, J_lora): layer 1's forward on [N] rows.

    [N] fp32 each (entropy, mean_logit and mean_minus_target empty without ``compute_entropy``); with
    ``frozen_head`` also J = d logp / d hidden [N, D] fp32 and, with LoRA, J_lora = d logp / d lora_hidden [N, r]
    fp32 (else empty). ``row_count``: None, or the [1] int32 device count of the scored rows, which come first
    (linear_logprobs_path).
    """
    return _head_forward(ONE_PROCESS, *arguments)


def _head_forward(reduce, *arguments):
    """``_linear_logprobs`` with a reduce step (paths.OneProcess or vocab_parallel.GroupReduce)."""
    *operands, compute_entropy, frozen_head, row_count = arguments
    operands = LinearOpOperands(*operands)
    head = operands.head()
    backend = named(operands.backend)
    hidden = head.hidden
    if hidden.shape[0] == 0:
        empty = torch.zeros(0, dtype=FP32, device=hidden.device)
        return (empty, *(empty.clone() for _ in range(5)), _nothing(hidden), _nothing(hidden))
    J = J_lora = None
    if frozen_head:
        logp, entropy, stats, J, J_lora = reduce.frozen_forward(head, backend)
    else:
        logp, entropy, stats = reduce.forward(head, compute_entropy, backend, row_count)
    if not compute_entropy:
        entropy = None
        stats = BackwardStats(stats.lse, stats.nontarget_mass, None, None)
    outputs = (entropy, stats.lse, stats.nontarget_mass, stats.mean_logit, stats.mean_minus_target, J, J_lora)
    return (logp, *(_or_nothing(x, hidden) for x in outputs))


_linear_logprobs_op = custom_op(
    "linear_logprobs",
    _linear_logprobs,
    op_schema(LinearOpOperands, "", _FORWARD_ARGUMENTS, "(" + ", ".join(["Tensor"] * _FORWARD_OUTPUTS) + ")"),
)


@_linear_logprobs_op.register_fake
def _(*arguments):
    """The outputs' shapes and dtypes (torch calls a fake with the op's arguments by position)."""
    *operands, compute_entropy, frozen_head, _ = arguments
    operands = LinearOpOperands(*operands)
    hidden = operands.hidden
    N = hidden.shape[0]

    def per_token(computed=True):
        return hidden.new_empty((N,) if computed else (0,), dtype=FP32)

    J = hidden.new_empty((N, hidden.shape[1]) if frozen_head and N > 0 else (0,), dtype=FP32)
    lora_rows = frozen_head and N > 0 and operands.lora_hidden is not None
    J_lora = hidden.new_empty((N, operands.lora_hidden.shape[1]) if lora_rows else (0,), dtype=FP32)
    entropy = compute_entropy or frozen_head or N == 0
    return (
        per_token(),
        per_token(entropy),
        per_token(),
        per_token(),
        per_token(entropy),
        per_token(entropy),
        J,
        J_lora,
    )


def _linear_setup_context(ctx, inputs, output):
    *operands, _, frozen_head, _ = inputs
    operands = LinearOpOperands(*operands)
    _, _, lse, nontarget_mass, mean_logit, mean_minus_target, J, J_lora = output
    # the entropy is usually a metric: its gradient is then None, not zeros (no entropy term, no fallback)
    ctx.set_materialize_grads(False)
    tensors = (operands.hidden, operands.weight, operands.targets, operands.bias, operands.lora_hidden)
    ctx.save_for_backward(*tensors, operands.lora_weight, lse, nontarget_mass, mean_logit, mean_minus_target, J, J_lora)
    ctx.numbers = operands[len(tensors) + 1 :]  # the transform's floats, the backend's name, the backward mode
    ctx.frozen_head = frozen_head
    ctx.reduce = ONE_PROCESS  # a vocab-parallel call sets its group's (_LinearLogprobsWithReduce)


def _linear_backward(ctx, grad_logp, grad_entropy, *_):
    """The head's one backward: the frozen head's dH = grad_logp J (an entropy gradient after all: plus the general
    path's entropy-only term, from that path's own forward statistics: exact, at three sweeps more), or the general
    path's recompute (linear_logprobs_backward); dH summed by the reduce step (ctx.reduce) where it is partial."""
    *tensors, lse, nontarget_mass, mean_logit, mean_minus_target, J, J_lora = ctx.saved_tensors
    operands = LinearOpOperands(*tensors, *ctx.numbers)
    hidden, weight, _, bias, lora_hidden, lora_weight = tensors
    need_h, need_w, _, need_b, need_lh, need_lw = ctx.needs_input_grad[:6]
    lora = lora_hidden is not None
    need_lh, need_lw = need_lh and lora, need_lw and lora
    N = hidden.shape[0]
    no_grad_rest = (None,) * (len(LinearOpOperands._fields) + 3 - 6)  # the numbers, strings, flags, row_count
    if N == 0:
        return (
            torch.zeros_like(hidden) if need_h else None,
            torch.zeros_like(weight) if need_w else None,
            None,
            torch.zeros_like(bias) if need_b else None,
            torch.zeros_like(lora_hidden) if need_lh else None,
            torch.zeros_like(lora_weight) if need_lw else None,
        ) + no_grad_rest
    if grad_logp is None:
        grad_logp = hidden.new_zeros(N, dtype=FP32)
    grad_logp = grad_logp.float().contiguous()
    if ctx.frozen_head:
        grad_hidden = grad_logp[:, None] * J
        grad_lora_hidden = grad_logp[:, None] * J_lora if need_lh else None
        if grad_entropy is not None:
            # the general path's values: the frozen forward's cuBLAS logits may round differently from the recomputed
            # tiles, and p = exp(z - lse) must see one z (at logits of 1e4 the difference is 1e-3 relative)
            stats = linear_logprobs(operands, True, False, reduce=ctx.reduce)[2:6]
            zero_logp, grad_entropy = torch.zeros_like(grad_logp), grad_entropy.float().contiguous()
            needs = [True, False, False, need_lh, False]
            term, _, _, lora_term, _ = linear_logprobs_backward(*stats, zero_logp, grad_entropy, operands, needs)
            grad_hidden = grad_hidden + ctx.reduce.sum_grad_hidden(term)
            if need_lh:
                grad_lora_hidden = grad_lora_hidden + lora_term
        grad_lora_hidden = grad_lora_hidden.to(lora_hidden.dtype) if need_lh else None
        return (grad_hidden.to(hidden.dtype), None, None, None, grad_lora_hidden, None) + no_grad_rest
    grad_entropy = grad_entropy.float().contiguous() if grad_entropy is not None else None
    needs = [need_h, need_w, need_b, need_lh, need_lw]
    stats = (lse, nontarget_mass, mean_logit, mean_minus_target)
    grads = linear_logprobs_backward(*stats, grad_logp, grad_entropy, operands, needs)
    if need_h:
        grads = (ctx.reduce.sum_grad_hidden(grads[0]),) + grads[1:]
    inputs = (hidden, weight, bias, lora_hidden, lora_weight)
    dH, dW, db, dlh, dlw = (g.to(x.dtype) if need else None for g, x, need in zip(grads, inputs, needs))
    return (dH, dW, None, db, dlh, dlw) + no_grad_rest


_linear_logprobs_op.register_autograd(_linear_backward, setup_context=_linear_setup_context)


# ----------------------------------------------------------------------------------------------- layer 1: backward
_BACKWARD_INPUTS = "Tensor lse, Tensor nontarget_mass, Tensor mean_logit, Tensor mean_minus_target, Tensor grad_logp"


def _linear_logprobs_backward(*arguments):
    """grpo_fast::linear_logprobs_backward: (lse, nontarget_mass, mean_logit, mean_minus_target, grad_logp,
    grad_entropy, LinearOpOperands' fields, needs) -> the general path's fp32 (dH, dW, db, d lora_hidden,
    d lora_weight), each of its input's shape where ``needs`` (five flags, in that order) asks for it, else empty.
    ``grad_entropy`` None: no entropy term (then mean_logit and mean_minus_target are not read)."""
    lse, nontarget_mass, mean_logit, mean_minus_target, grad_logp, grad_entropy, *operands, needs = arguments
    operands = LinearOpOperands(*operands)
    head = operands.head()
    backend = named(operands.backend)
    hidden, weight = head.hidden, head.weight
    need_h, need_w, need_b, need_lh, need_lw = needs

    def zeros(x, need):
        return torch.zeros(x.shape, dtype=FP32, device=hidden.device) if need and x is not None else None

    grads = HeadGrads(
        backend.grad_hidden_buffer(hidden, operands.backward_mode) if need_h else None,
        zeros(weight, need_w),
        zeros(head.bias, need_b),
        zeros(operands.lora_hidden, need_lh),
        zeros(operands.lora_weight, need_lw),
    )
    if grads.hidden is not None and (hidden.shape[0] == 0 or weight.shape[0] == 0):
        grads.hidden.zero_()  # no tiles to launch (an empty vocab-parallel shard: torch's chunking can leave one)
    elif hidden.shape[0] > 0 and weight.shape[0] > 0 and any(needs):
        stats = BackwardStats(lse, nontarget_mass, _given(mean_logit), _given(mean_minus_target))
        paths.head_backward(head, stats, grad_logp, grad_entropy, grads, backend, operands.backward_mode)
    return tuple(_or_nothing(g, hidden) for g in grads)


_linear_logprobs_backward_op = custom_op(
    "linear_logprobs_backward",
    _linear_logprobs_backward,
    op_schema(
        LinearOpOperands,
        f"{_BACKWARD_INPUTS}, Tensor? grad_entropy",
        "bool[] needs",
        "(" + ", ".join(["Tensor"] * 5) + ")",
    ),
)


@_linear_logprobs_backward_op.register_fake
def _(*arguments):
    """The outputs' shapes and dtypes."""
    *operands, needs = arguments[6:]
    operands = LinearOpOperands(*operands)
    hidden = operands.hidden
    inputs = (hidden, operands.weight, operands.bias, operands.lora_hidden, operands.lora_weight)
    return tuple(
        hidden.new_empty(x.shape if need and x is not None else (0,), dtype=FP32) for x, need in zip(inputs, needs)
    )


# ----------------------------------------------------------------------------------------------- calls
_LINEAR_INLINE = inline_function(_linear_logprobs, _linear_setup_context, _linear_backward)


class _LinearLogprobsWithReduce(torch.autograd.Function):
    """The op's implementation and autograd formula with a vocab-parallel group's reduce step (the last argument).

    Not the op: a process group is no schema type, and the collectives belong between layer 1's per-shard kernels
    (records merged before they are finished, dH summed after the shard's backward op), in the Python of the one
    implementation (``_head_forward``, ``_linear_backward``) rather than hidden inside an opaque node."""

    @staticmethod
    @without_autocast
    def forward(ctx, *args):
        *args, reduce = args
        output = _head_forward(reduce, *args)
        _linear_setup_context(ctx, args, output)
        ctx.reduce = reduce
        return output

    @staticmethod
    @without_autocast
    def backward(ctx, *grads):
        return _linear_backward(ctx, *grads) + (None,)


def linear_logprobs(operands, compute_entropy, frozen_head, row_count=None, *, reduce=None):
    """grpo_fast::linear_logprobs on a LinearOpOperands (``_linear_logprobs``'s outputs), differentiable.
    ``reduce``: a vocab-parallel group's reduce step (vocab_parallel.GroupReduce); None or ONE_PROCESS: the op."""
    args = (*operands, compute_entropy, frozen_head, row_count)
    if reduce is not None and reduce is not ONE_PROCESS:
        return _LinearLogprobsWithReduce.apply(*args, reduce)
    return _LINEAR_INLINE.apply(*args) if runs_inline(args) else _linear_logprobs_op(*args)


def linear_logprobs_backward(
    lse, nontarget_mass, mean_logit, mean_minus_target, grad_logp, grad_entropy, operands, needs
):
    """grpo_fast::linear_logprobs_backward (``_linear_logprobs_backward``'s outputs) on the forward's statistics,
    dL/dlogp, dL/dentropy or None, a LinearOpOperands and the five gradients' flags."""
    args = (lse, nontarget_mass, mean_logit, mean_minus_target, grad_logp, grad_entropy, *operands, needs)
    return _linear_logprobs_backward(*args) if runs_inline(args) else _linear_logprobs_backward_op(*args)


def linear_logprobs_path(
    head: HeadOperands,
    backend,
    head_path: HeadPath,
    backward_mode: BackwardMode,
    reduce=ONE_PROCESS,
    row_count: torch.Tensor | None = None,
):
    """A HeadOperands (hidden [N, D], weight [V, D], targets [N], bias [V] | None, transform, LoRA's pair
    (lora_hidden [N, r], lora_weight [V, r]) | None), a backend, head_path and backward_mode -> logp [N] fp32,
    entropy [N] fp32, through the custom op linear_logprobs, whose registered autograd formula is the head's one
    backward.

    With LoRA (``lora.HeadLora``) the raw logits are h W^T + lora_hidden lora_weight^T (+ bias), and gradients reach
    lora_hidden and lora_weight too (each in its own dtype).

    Both outputs carry their exact gradient. Two paths (``head_path``, config.HEAD_PATHS), chosen here from which
    inputs require a gradient (``takes_frozen_head``):
    * general (recompute): saves the inputs and O(N) fp32 values (softmax_stats.BackwardStats: lse, 1 - p_y, the mean
      logit and mean - z_y), nothing of size V; the backward recomputes the logits (an entropy that receives no
      gradient costs it nothing: its term is compiled out). Three vocabulary GEMM sweeps with a frozen weight.
    * frozen head ("auto", and only hidden needs a gradient: a frozen lm_head, LoRA): the forward also builds
      J = d logp / d hidden [N, D] fp32 (``kernels.forward_frozen``), saved instead of a recompute, and the backward
      is dH = grad_logp J: two sweeps. With LoRA it also builds J_l = d logp / d lora_hidden [N, r] fp32; it is
      taken only when lora_weight needs no gradient either (a frozen adapter). Callers pass "auto" when the entropy
      will usually get no gradient; if one arrives anyway, its term comes from the general path with its own forward
      statistics: exact, at three sweeps more (five in all, against three).
    ``backward_mode`` (config.BACKWARD_MODES) picks the Triton backward; the torch backend has one ("chunked").
    N = 0 (every row masked) gives empty outputs and zero gradients. ``reduce``: the reduce step (``OneProcess``,
    or a vocab-parallel group's grpo_fast.head.vocab_parallel.GroupReduce, whose ranks all take the same path).
    ``row_count``: None, or the [1] int32 device count of the scored rows, which come first; the rows after it are
    padding (zeros, no gradient; their outputs are placeholders), whose blocks the Triton forward skips.
    """
    if head_path not in kconfig.HEAD_PATHS:
        raise ValueError(f"head_path must be one of {kconfig.HEAD_PATHS}, got {head_path!r}")
    if backward_mode not in kconfig.BACKWARD_MODES:
        raise ValueError(f"backward_mode must be one of {kconfig.BACKWARD_MODES}, got {backward_mode!r}")
    backend = named(backend)
    grad = torch.is_grad_enabled()
    needs = [grad and x is not None and x.requires_grad for x in head[:4]]
    lora_weight_grad = grad and head.lora is not None and head.lora[1].requires_grad
    frozen_head = paths.takes_frozen_head(needs, head.hidden, backend, head_path, lora_weight_grad)
    operands = LinearOpOperands.of(head, backend.name, backward_mode)
    outputs = linear_logprobs(operands, True, frozen_head, row_count, reduce=reduce)
    return outputs[0], outputs[1]


# ----------------------------------------------------------------------------------------------- workspace
def workspace_bytes(
    op: str,
    hidden_shape: tuple[int, int],
    vocab_size: int,
    dtype: torch.dtype,
    *,
    backend: str = "triton",
    frozen_head: bool = False,
    backward_mode: BackwardMode = "chunked",
    device_type: str = "cuda",
    compute_capability: int | None = None,
) -> int:
    """The bytes a layer-1 op's implementation allocates besides its outputs (its peak extra memory, for a memory
    estimate over fake tensors, whose fake implementations allocate the outputs only): the backend's
    ``workspace_bytes`` (grpo_fast.backends).

    ``op``: "linear_logprobs" (hidden_shape [N, D]) or "linear_logprobs_backward"; ``backend``: a resolved backend's
    name; ``compute_capability`` (10 x major + minor): the card the forward's launch is sized for, one this machine
    need not have; None: the ``device_type`` device's."""
    return named(backend).workspace_bytes(
        op, hidden_shape, vocab_size, dtype, frozen_head, backward_mode, device_type, compute_capability
    )
