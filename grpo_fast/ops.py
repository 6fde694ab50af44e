"""grpo_fast's torch.library custom ops: layer 1's forward (general or frozen-head), its backward, and layer 2's token
loss, each with a fake implementation (what the real one returns: shapes, dtypes, fp32 where fp32) and the two
forwards with a registered autograd formula.

torch.compile traces each op as one node (no graph break, no guard on a value: a step calling grpo_fast.logprobs
and grpo_fast.loss is one graph, forward and backward); FakeTensorMode and meta tensors run the fake
implementations, which read no value. Schemas take tensors and numbers only: the logit transform travels as its
three floats (grpo_fast.transform.LogitTransform.as_floats), the loss options as their JSON (``options_json``),
the backend, head path and backward mode as strings and flags; optional tensors are ``Tensor?``, and an output that
a path does not produce is an empty tensor (shape [0]).

``custom_op``, not ``triton_op``: the real implementations are Python around Triton launches *and* cuBLAS GEMMs
(the chunked backward, the frozen head), whose launch configurations are chosen from sizes at call time, plus a
chunked-torch twin on any device; ``triton_op`` lets Inductor see into functions made of Triton kernels and
traceable torch code, which these are not. An opaque ``custom_op`` is one node that serves both backends, the CPU
interpreter and fake tensors alike.

Workspace: what a real implementation allocates besides its outputs, for a memory estimate over fake tensors:
``workspace_bytes`` (one function per op, in bytes, by the same formulas as the kernels' launchers).
"""

from __future__ import annotations

import dataclasses
import json

import torch

from grpo_fast import autograd, token_loss_torch
from grpo_fast.kernels import config as kconfig
from grpo_fast.kernels import forward as kforward
from grpo_fast.kernels import forward_frozen as kfrozen
from grpo_fast.kernels import gemm
from grpo_fast.kernels.softmax_stats import BackwardStats
from grpo_fast.loss_statistics import SLOTS
from grpo_fast.metrics import RowValues, loss_metrics, metric_names
from grpo_fast.options import LossOptions
from grpo_fast.transform import LogitTransform

FP32 = torch.float32


def _nothing(like):
    """The empty tensor that stands for an output a path does not produce."""
    return torch.empty(0, dtype=FP32, device=like.device)


def _or_nothing(x, like):
    return x if x is not None else _nothing(like)


def _given(x):
    """None for an output that stands for nothing (an empty tensor where a [N, ...] one would be)."""
    return x if x is not None and x.numel() > 0 else None


# ----------------------------------------------------------------------------------------------- layer 1: forward
def _linear_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, bias: torch.Tensor | None,
                    lora_hidden: torch.Tensor | None, lora_weight: torch.Tensor | None, temperature: float,
                    softcap: float | None, logit_scale: float, compute_entropy: bool, frozen_head: bool,
                    backend: str, backward_mode: str,
                    row_count: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                               torch.Tensor, torch.Tensor, torch.Tensor,
                                                               torch.Tensor, torch.Tensor]:  # fmt: skip
    """Layer 1's forward on [N] rows: (logp, entropy, lse, nontarget_mass, mean_logit, mean_minus_target, J, J_lora).

    [N] fp32 each (entropy, mean_logit and mean_minus_target empty without ``compute_entropy``); with
    ``frozen_head`` also J = d logp / d hidden [N, D] fp32 and, with LoRA, J_lora = d logp / d lora_hidden [N, r]
    fp32 (else empty). ``backward_mode`` is not read here: the autograd formula takes it from these arguments.
    ``row_count``: None, or the [1] int32 device count of the scored rows, which come first (autograd.linear_logprobs).
    """
    return _head_forward(autograd.ONE_PROCESS, hidden, weight, targets, bias, lora_hidden, lora_weight, temperature,
                         softcap, logit_scale, compute_entropy, frozen_head, backend, backward_mode,
                         row_count)  # fmt: skip


def _head_forward(reduce, hidden, weight, targets, bias, lora_hidden, lora_weight, temperature, softcap, logit_scale,
                  compute_entropy, frozen_head, backend, backward_mode, row_count):  # fmt: skip
    """``_linear_logprobs`` with a reduce step (autograd.OneProcess or vocab_parallel.GroupReduce)."""
    transform = LogitTransform.from_floats(temperature, softcap, logit_scale)
    backend = autograd.BACKENDS[backend]
    lora = (lora_hidden, lora_weight) if lora_hidden is not None else None
    N = hidden.shape[0]
    if N == 0:
        empty = torch.zeros(0, dtype=FP32, device=hidden.device)
        return (
            empty,
            empty.clone(),
            empty.clone(),
            empty.clone(),
            empty.clone(),
            empty.clone(),
            _nothing(hidden),
            _nothing(hidden),
        )
    J = J_lora = None
    if frozen_head:
        logp, entropy, stats, J, J_lora = reduce.frozen_forward(hidden, weight, targets, bias, transform, backend, lora)
    else:
        logp, entropy, stats = reduce.forward(
            hidden, weight, targets, bias, transform, compute_entropy, backend, lora, row_count
        )
    if not compute_entropy:
        entropy = None
        stats = BackwardStats(stats.lse, stats.nontarget_mass, None, None)
    return (
        logp,
        _or_nothing(entropy, hidden),
        stats.lse,
        stats.nontarget_mass,
        _or_nothing(stats.mean_logit, hidden),
        _or_nothing(stats.mean_minus_target, hidden),
        _or_nothing(J, hidden),
        _or_nothing(J_lora, hidden),
    )


_linear_logprobs_op = torch.library.custom_op("grpo_fast::linear_logprobs", mutates_args=())(_linear_logprobs)


@_linear_logprobs_op.register_fake
def _(hidden, weight, targets, bias, lora_hidden, lora_weight, temperature, softcap, logit_scale, compute_entropy,
      frozen_head, backend, backward_mode, row_count):  # fmt: skip
    N = hidden.shape[0]

    def per_token(computed=True):
        return hidden.new_empty((N,) if computed else (0,), dtype=FP32)

    J = hidden.new_empty((N, hidden.shape[1]) if frozen_head and N > 0 else (0,), dtype=FP32)
    J_lora = hidden.new_empty(
        (N, lora_hidden.shape[1]) if frozen_head and N > 0 and lora_hidden is not None else (0,), dtype=FP32
    )
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
    (hidden, weight, targets, bias, lora_hidden, lora_weight, temperature, softcap, logit_scale, compute_entropy,
     frozen_head, backend, backward_mode, _) = inputs  # fmt: skip
    _, _, lse, nontarget_mass, mean_logit, mean_minus_target, J, J_lora = output
    # the entropy is usually a metric: its gradient is then None, not zeros (no entropy term, no fallback)
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(hidden, weight, targets, bias, lora_hidden, lora_weight, lse, nontarget_mass, mean_logit,
                          mean_minus_target, J, J_lora)  # fmt: skip
    ctx.transform_floats = (temperature, softcap, logit_scale)
    ctx.frozen_head, ctx.backend, ctx.backward_mode = frozen_head, backend, backward_mode
    ctx.reduce = autograd.ONE_PROCESS  # a vocab-parallel call sets its group's (_LinearLogprobsWithReduce)


def _linear_backward(ctx, grad_logp, grad_entropy, *_):
    """The head's one backward: the frozen head's dH = grad_logp J (an entropy gradient after all: plus the general
    path's entropy-only term, from that path's own forward statistics: exact, at three sweeps more), or the general
    path's recompute (linear_logprobs_backward); dH summed by the reduce step (ctx.reduce) where it is partial."""
    (hidden, weight, targets, bias, lora_hidden, lora_weight, lse, nontarget_mass, mean_logit, mean_minus_target, J,
     J_lora) = ctx.saved_tensors  # fmt: skip
    need_h, need_w, _, need_b, need_lh, need_lw = ctx.needs_input_grad[:6]
    lora = lora_hidden is not None
    need_lh, need_lw = need_lh and lora, need_lw and lora
    N = hidden.shape[0]
    no_grad_rest = (None,) * 8
    if N == 0:
        return (
            torch.zeros_like(hidden) if need_h else None,
            torch.zeros_like(weight) if need_w else None,
            None,
            torch.zeros_like(bias) if need_b else None,
            torch.zeros_like(lora_hidden) if need_lh else None,
            torch.zeros_like(lora_weight) if need_lw else None,
        ) + no_grad_rest
    temperature, softcap, logit_scale = ctx.transform_floats
    if grad_logp is None:
        grad_logp = hidden.new_zeros(N, dtype=FP32)
    grad_logp = grad_logp.float().contiguous()
    if ctx.frozen_head:
        grad_hidden = grad_logp[:, None] * J
        grad_lora_hidden = grad_logp[:, None] * J_lora if need_lh else None
        if grad_entropy is not None:
            # the general path's values: the frozen forward's cuBLAS logits may round differently from the recomputed
            # tiles, and p = exp(z - lse) must see one z (at logits of 1e4 the difference is 1e-3 relative)
            _, _, lse, nontarget_mass, mean_logit, mean_minus_target, _, _ = linear_logprobs(
                hidden, weight, targets, bias, lora_hidden, lora_weight, temperature, softcap, logit_scale, True,
                False, ctx.backend, ctx.backward_mode, None, reduce=ctx.reduce)  # fmt: skip
            term, _, _, lora_term, _ = linear_logprobs_backward(
                hidden, weight, targets, bias, lora_hidden, lora_weight, lse, nontarget_mass, mean_logit,
                mean_minus_target, torch.zeros_like(grad_logp), grad_entropy.float().contiguous(), temperature,
                softcap, logit_scale, [True, False, False, need_lh, False], ctx.backend, ctx.backward_mode)  # fmt: skip
            grad_hidden = grad_hidden + ctx.reduce.sum_grad_hidden(term)
            if need_lh:
                grad_lora_hidden = grad_lora_hidden + lora_term
        return (
            grad_hidden.to(hidden.dtype),
            None,
            None,
            None,
            grad_lora_hidden.to(lora_hidden.dtype) if need_lh else None,
            None,
        ) + no_grad_rest
    grads = linear_logprobs_backward(
        hidden, weight, targets, bias, lora_hidden, lora_weight, lse, nontarget_mass, mean_logit, mean_minus_target,
        grad_logp, grad_entropy.float().contiguous() if grad_entropy is not None else None, temperature, softcap,
        logit_scale, [need_h, need_w, need_b, need_lh, need_lw], ctx.backend, ctx.backward_mode)  # fmt: skip
    if need_h:
        grads = (ctx.reduce.sum_grad_hidden(grads[0]),) + grads[1:]
    inputs = (hidden, weight, bias, lora_hidden, lora_weight)
    dH, dW, db, dlh, dlw = (
        g.to(x.dtype) if need else None for g, x, need in zip(grads, inputs, (need_h, need_w, need_b, need_lh, need_lw))
    )
    return (dH, dW, None, db, dlh, dlw) + no_grad_rest


_linear_logprobs_op.register_autograd(_linear_backward, setup_context=_linear_setup_context)


# ----------------------------------------------------------------------------------------------- layer 1: backward
def _linear_logprobs_backward(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    bias: torch.Tensor | None,
    lora_hidden: torch.Tensor | None,
    lora_weight: torch.Tensor | None,
    lse: torch.Tensor,
    nontarget_mass: torch.Tensor,
    mean_logit: torch.Tensor,
    mean_minus_target: torch.Tensor,
    grad_logp: torch.Tensor,
    grad_entropy: torch.Tensor | None,
    temperature: float,
    softcap: float | None,
    logit_scale: float,
    needs: list[bool],
    backend: str,
    backward_mode: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The general path's backward: fp32 (dH, dW, db, d lora_hidden, d lora_weight), each of its input's shape
    where ``needs`` (five flags, in that order) asks for it, else empty. ``grad_entropy`` None: no entropy term
    (then mean_logit and mean_minus_target are not read)."""
    transform = LogitTransform.from_floats(temperature, softcap, logit_scale)
    backend = autograd.BACKENDS[backend]
    need_h, need_w, need_b, need_lh, need_lw = needs
    dev = hidden.device
    lora = (lora_hidden, lora_weight) if lora_hidden is not None else None

    def zeros(x, need):
        return torch.zeros(x.shape, dtype=FP32, device=dev) if need and x is not None else None

    grad_hidden = backend.grad_hidden_buffer(hidden, backward_mode) if need_h else None
    grad_weight, grad_bias = zeros(weight, need_w), zeros(bias, need_b)
    grad_lora = (zeros(lora_hidden, need_lh), zeros(lora_weight, need_lw))
    if grad_hidden is not None and (hidden.shape[0] == 0 or weight.shape[0] == 0):
        grad_hidden.zero_()  # no tiles to launch (an empty vocab-parallel shard: torch's chunking can leave one)
    elif hidden.shape[0] > 0 and weight.shape[0] > 0 and any(needs):
        stats = BackwardStats(lse, nontarget_mass, _given(mean_logit), _given(mean_minus_target))
        autograd.head_backward(hidden, weight, targets, bias, stats, grad_logp, grad_entropy, transform, grad_hidden,
                               grad_weight, grad_bias, backend, backward_mode, lora=lora,
                               grad_lora=grad_lora)  # fmt: skip
    return tuple(_or_nothing(g, hidden) for g in (grad_hidden, grad_weight, grad_bias, *grad_lora))


_linear_logprobs_backward_op = torch.library.custom_op("grpo_fast::linear_logprobs_backward", mutates_args=())(
    _linear_logprobs_backward
)


@_linear_logprobs_backward_op.register_fake
def _(
    hidden,
    weight,
    targets,
    bias,
    lora_hidden,
    lora_weight,
    lse,
    nontarget_mass,
    mean_logit,
    mean_minus_target,
    grad_logp,
    grad_entropy,
    temperature,
    softcap,
    logit_scale,
    needs,
    backend,
    backward_mode,
):
    inputs = (hidden, weight, bias, lora_hidden, lora_weight)
    return tuple(
        hidden.new_empty(x.shape if need and x is not None else (0,), dtype=FP32) for x, need in zip(inputs, needs)
    )


# ----------------------------------------------------------------------------------------------- layer 2
def options_json(options: LossOptions) -> str:
    """The loss options as token_loss's ``options_json`` argument (a string: a schema constant). Built field by
    field, not by json.dumps, which torch.compile cannot trace (a float option is then fixed by a guard)."""
    parts = []
    for field in dataclasses.fields(options):
        value = getattr(options, field.name)
        if value is None:
            text = "null"
        elif isinstance(value, bool):
            text = "true" if value else "false"
        elif isinstance(value, str):
            text = f'"{value}"'  # the option strings are plain names (loss types, levels)
        elif isinstance(value, int):
            text = str(int(value))
        else:
            text = f"{float(value)}"  # (str of a float round-trips exactly)
        parts.append(f'"{field.name}": {text}')
    return "{" + ", ".join(parts) + "}"


def _token_loss(
    logp: torch.Tensor,
    entropy: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    old_logprobs: torch.Tensor | None,
    ref_logprobs: torch.Tensor | None,
    sampling_logprobs: torch.Tensor | None,
    importance_weights: torch.Tensor | None,
    num_items_in_batch: torch.Tensor | None,
    entropy_threshold: torch.Tensor | None,
    options_json: str,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Layer 2 on prepared inputs (fp32 contiguous [B, T]; mask fp32 0/1; advantages [B] or [B, T]; importance
    weights [B] or [B, T]; the two counts fp32 scalar tensors or None): (loss [], metrics [M] in
    grpo_fast.metrics.metric_names' order, dL/dlogp [B, T], dL/dentropy [B, T] or empty without an entropy bonus),
    fp32, by the backend's token loss (the token kernel, or its torch twin grpo_fast/token_loss_torch.py). No
    value is read on the host (the normaliser, the bonus tokens' count and the entropy quantile stay on the device)."""
    options = LossOptions(**json.loads(options_json))
    return _layer2(autograd.BACKENDS[backend], logp, entropy, advantages, mask, old_logprobs, ref_logprobs,
                   sampling_logprobs, importance_weights, num_items_in_batch, entropy_threshold, options)  # fmt: skip


_token_loss_op = torch.library.custom_op("grpo_fast::token_loss", mutates_args=())(_token_loss)


@_token_loss_op.register_fake
def _(
    logp,
    entropy,
    advantages,
    mask,
    old_logprobs,
    ref_logprobs,
    sampling_logprobs,
    importance_weights,
    num_items_in_batch,
    entropy_threshold,
    options_json,
    backend,
):
    options = LossOptions(**json.loads(options_json))
    bonus = options.entropy_coef != 0.0
    return (
        logp.new_empty((), dtype=FP32),
        logp.new_empty(len(metric_names(options, entropy is not None)), dtype=FP32),
        torch.empty_like(logp, dtype=FP32),
        logp.new_empty(logp.shape if bonus else (0,), dtype=FP32),
    )


def _token_loss_setup_context(ctx, inputs, output):
    _, _, grad_logp, grad_entropy = output
    ctx.save_for_backward(grad_logp, grad_entropy)


def _token_loss_backward(ctx, grad_loss, *_):
    grad_logp, grad_entropy = ctx.saved_tensors
    if grad_loss is None:
        return (None,) * 12
    grad_entropy = grad_entropy * grad_loss if ctx.needs_input_grad[1] and grad_entropy.numel() else None
    return (grad_logp * grad_loss, grad_entropy) + (None,) * 10


_token_loss_op.register_autograd(_token_loss_backward, setup_context=_token_loss_setup_context)


def device_entropy_quantile(entropy, mask, top_entropy_quantile):
    """torch.quantile(entropy[mask], 1 - top_entropy_quantile) (linear interpolation, as grpo_fast.reference's
    entropy_quantile_threshold) without a boolean selection or a host read: the masked entropies sorted first, the
    count a device value; +inf (no token is high-entropy) where no token is masked in."""
    active = mask.reshape(-1) > 0
    values = torch.where(active, entropy.detach().float().reshape(-1), torch.inf).sort().values
    count = active.sum()
    q = torch.full((), 1.0 - top_entropy_quantile, dtype=FP32, device=entropy.device)
    rank = q * (count - 1).clamp(min=0).to(FP32)
    below = rank.to(torch.int64)
    above = rank.ceil().to(torch.int64)  # torch.quantile's rule: the same two ranks when rank is integral
    # index_select, not values[below]: a 0-d index tensor would be read on the host
    threshold = (
        values.index_select(0, below.reshape(1))
        .lerp(values.index_select(0, above.reshape(1)), rank - below.to(FP32))
        .reshape(())
    )
    # a NaN entropy among the masked ones makes torch.quantile NaN
    threshold = torch.where((active & entropy.reshape(-1).isnan()).any(), torch.nan, threshold)
    return torch.where(count > 0, threshold, torch.inf)


def _layer2(backend, logp, entropy, adv, mask, old, ref, sampling, iw, num_items, entropy_threshold, options):
    """``_token_loss`` by ``backend``'s token loss (autograd.TRITON or autograd.TORCH): the normaliser and the
    entropy quantile on the device, then the loss, the entropy bonus and the metrics from its statistics."""
    B = logp.shape[0]
    denominator = options.denominator(B, mask.sum(), num_items)
    # a number is written to the device (torch.full: a fill, not a copy from host memory), never read back
    scale = 1.0 / (
        denominator.double()
        if isinstance(denominator, torch.Tensor)
        else torch.full((), denominator, dtype=torch.float64, device=logp.device)
    )
    threshold = None
    if options.entropy_mask:
        threshold = (
            entropy_threshold
            if entropy_threshold is not None
            else device_entropy_quantile(entropy, mask, options.top_entropy_quantile)
        )
    sampler = None
    if options.off_policy_mask_threshold is not None:
        sampler = next(x for x in (sampling, old, logp) if x is not None).contiguous()
    grad_logp, bonus_mask, stats = backend.token_loss(
        logp,
        adv,
        mask,
        old,
        ref if options.beta != 0.0 else None,
        sampler,
        iw,
        entropy,
        options,
        scale=scale.to(logp.dtype),
        entropy_threshold=threshold,
    )
    rows = {name: RowValues(values, per_sequence) for name, (values, per_sequence) in stats.items()}
    policy_loss = rows["loss"].values.sum()
    total, grad_entropy = policy_loss, None
    if options.entropy_coef != 0.0:
        # loss -= entropy_coef * (mean entropy over the bonus tokens): dL/dentropy = -entropy_coef * e_t / count
        bonus_scale = -options.entropy_coef / rows["bonus_count"].values.sum().clamp(min=1.0)
        total = policy_loss + bonus_scale * rows["bonus_entropy"].values.sum()
        grad_entropy = bonus_mask * bonus_scale
    metrics = loss_metrics(options, rows, rows["count"].values, policy_loss)
    # in metric_names' order: loss_metrics builds them in it
    return (total.reshape(()).clone(), torch.stack(list(metrics.values())), grad_logp, _or_nothing(grad_entropy, logp))


# ----------------------------------------------------------------------------------------------- calls
def inline_function(impl, setup_context, backward):
    """The op's implementation and autograd formula as a torch.autograd.Function, for ``runs_inline``."""

    def forward(ctx, *args):
        output = impl(*args)
        setup_context(ctx, args, output)
        return output

    return type(
        f"Inline_{impl.__name__.strip('_')}",
        (torch.autograd.Function,),
        {"forward": staticmethod(forward), "backward": staticmethod(backward)},
    )


_LINEAR_INLINE = inline_function(_linear_logprobs, _linear_setup_context, _linear_backward)
_TOKEN_LOSS_INLINE = inline_function(_token_loss, _token_loss_setup_context, _token_loss_backward)


def runs_inline(args):
    """Run the implementation in Python rather than as the op: a TorchDispatchMode over real tensors (a FLOP or
    allocation counter, a host-sync counter) then sees the kernels' own torch ops, which an op's caller never
    sees (a mode is not active inside the op it intercepts). torch.compile, FakeTensorMode and meta tensors
    always get the op (one node; the fake implementation)."""
    from torch._subclasses.fake_tensor import FakeTensorMode, is_fake
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    if torch.compiler.is_compiling():
        return False
    tensors = [x for x in args if isinstance(x, torch.Tensor)]
    if any(x.device.type == "meta" or is_fake(x) for x in tensors):
        return False
    modes = _get_current_dispatch_mode_stack()
    return bool(modes) and not any(isinstance(mode, FakeTensorMode) for mode in modes)


class _LinearLogprobsWithReduce(torch.autograd.Function):
    """The op's implementation and autograd formula with a vocab-parallel group's reduce step (the last argument).

    Not the op: a process group is no schema type, and the collectives belong between layer 1's per-shard kernels
    (records merged before they are finished, dH summed after the shard's backward op), in the Python of the one
    implementation (``_head_forward``, ``_linear_backward``) rather than hidden inside an opaque node."""

    @staticmethod
    def forward(ctx, *args):
        *args, reduce = args
        output = _head_forward(reduce, *args)
        _linear_setup_context(ctx, args, output)
        ctx.reduce = reduce
        return output

    @staticmethod
    def backward(ctx, *grads):
        return _linear_backward(ctx, *grads) + (None,)


def linear_logprobs(*args, reduce=None):
    """grpo_fast::linear_logprobs (``_linear_logprobs``'s arguments and outputs), differentiable. ``reduce``: a
    vocab-parallel group's reduce step (vocab_parallel.GroupReduce); None or autograd.ONE_PROCESS: the op."""
    if reduce is not None and reduce is not autograd.ONE_PROCESS:
        return _LinearLogprobsWithReduce.apply(*args, reduce)
    return _LINEAR_INLINE.apply(*args) if runs_inline(args) else _linear_logprobs_op(*args)


def linear_logprobs_backward(*args):
    """grpo_fast::linear_logprobs_backward (``_linear_logprobs_backward``'s arguments and outputs)."""
    return _linear_logprobs_backward(*args) if runs_inline(args) else _linear_logprobs_backward_op(*args)


def token_loss(*args):
    """grpo_fast::token_loss (``_token_loss``'s arguments and outputs), differentiable in logp and entropy."""
    return _TOKEN_LOSS_INLINE.apply(*args) if runs_inline(args) else _token_loss_op(*args)


# ----------------------------------------------------------------------------------------------- workspace
def workspace_bytes(
    op,
    hidden_shape,
    vocab_size,
    dtype,
    *,
    backend="triton",
    frozen_head=False,
    backward_mode="chunked",
    batch_shape=None,
    device_type="cuda",
):
    """The bytes a real implementation allocates besides its outputs (its peak extra memory, for a memory estimate
    over fake tensors, whose fake implementations allocate the outputs only), by the launchers' own formulas.

    ``op``: "linear_logprobs" (hidden_shape [N, D]; the forward's 5 x splits x N fp32 records, or the frozen head's
    8 x N fp32 state, fp32 u buffer of one token chunk x vocabulary chunk and its finishing copy of W_y's rows),
    "linear_logprobs_backward" (the chunked backward's g, one token chunk x V in the input dtype, and the dW
    accumulator's fp32 copy is an output; the fused one allocates nothing more) or "token_loss" (batch_shape
    [B, T]: the kernel's B x len(loss_statistics.SLOTS) fp32 statistics and its B x T fp32 bonus mask, which
    exists only with an entropy bonus: an upper bound). The torch backend (an estimate, not a launcher's formula):
    CHUNK_N x CHUNK_V fp32 tiles, about four alive at once; for "token_loss", token_loss_torch.TEMPORARIES fp32
    [B, T] tensors."""
    itemsize = torch.empty(0, dtype=dtype).element_size()
    if op == "token_loss":
        B, T = batch_shape
        if backend == "torch":
            return token_loss_torch.TEMPORARIES * B * T * 4
        return B * len(SLOTS) * 4 + B * T * 4
    N, D = hidden_shape
    V = vocab_size
    if backend == "torch":
        from grpo_fast import torch_backend

        return 4 * min(N, torch_backend.CHUNK_N) * min(V, torch_backend.CHUNK_V) * 4
    if op == "linear_logprobs":
        if frozen_head:
            chunk = gemm.chunk_size(N, D)
            vchunk = kfrozen.vocab_chunk_size(V, D, chunk, itemsize)
            return kfrozen.STATE_ROWS * N * 4 + chunk * vchunk * 4 + min(N, 1024) * D * 4
        splits, _ = kforward.num_vocab_splits(N, V, kconfig.forward_config(torch.device(device_type), dtype))
        return 5 * splits * N * 4
    if op == "linear_logprobs_backward":
        return gemm.chunk_size(N, D) * V * itemsize if backward_mode == "chunked" else 0
    raise ValueError(f"op must be 'linear_logprobs', 'linear_logprobs_backward' or 'token_loss', got {op!r}")
