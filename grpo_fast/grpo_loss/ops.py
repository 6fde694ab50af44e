"""Layer 2's torch.library custom op, ``grpo_fast::token_loss``: the GRPO loss, its metrics, dL/dlogp and dL/dentropy
from prepared per-token inputs, by the backend's token loss (the token kernel or its torch twin), with a fake
implementation and a registered autograd formula; and the trained head's op (both layers, three sweeps). The loss
options travel as their JSON (``options_json``), the backend as its name; nothing is read on the host.
"""

from __future__ import annotations

import dataclasses
import json
from typing import NamedTuple

import torch

from grpo_fast.backends.protocol import HeadGrads, LossLayer1, ModelHead, TokenLossInputs, gemm_weight
from grpo_fast.backends.resolver import named
from grpo_fast.grpo_loss.metrics import RowValues, loss_metrics, metric_names
from grpo_fast.grpo_loss.options import LossOptions
from grpo_fast.head.boundary import custom_op, inline_function, op_schema, runs_inline, scaled_gradient, schema_fields
from grpo_fast.head.ops import LinearOpOperands
from grpo_fast.head.transform import LogitTransform

FP32 = torch.float32


class PreparedBatch(NamedTuple):
    """Layer 2's inputs as the token-loss op takes them, in its schema's order: fp32, contiguous, on one device.

    Attributes:
        logp: the policy's log-probs [B, T] (the op's gradient flows to them).
        entropy: the token entropies [B, T] (the entropy bonus's gradient flows to them), or None.
        advantages: [B] or [B, T].
        mask: the completion mask [B, T], 0 / 1.
        old_logprobs: the old policy's log-probs [B, T], or None (on-policy).
        ref_logprobs: the reference log-probs [B, T], or None without a KL term.
        sampling_logprobs: the sampler's log-probs [B, T] for the off-policy mask, or None.
        importance_weights: [B] or [B, T], or None.
        num_items_in_batch: the "num_items_in_batch" normaliser's count, a scalar tensor, or None (the mask's sum).
        entropy_threshold: the top-entropy mask's threshold, a scalar tensor, or None (this batch's quantile).
    """

    logp: torch.Tensor
    entropy: torch.Tensor | None
    advantages: torch.Tensor
    mask: torch.Tensor
    old_logprobs: torch.Tensor | None
    ref_logprobs: torch.Tensor | None
    sampling_logprobs: torch.Tensor | None
    importance_weights: torch.Tensor | None
    num_items_in_batch: torch.Tensor | None
    entropy_threshold: torch.Tensor | None


def _schema():
    """The op's schema: PreparedBatch's tensors (``Tensor?`` where None is allowed), the options' JSON and the
    backend's name; it returns (loss [], metrics [M], dL/dlogp [B, T], dL/dentropy [B, T] or empty)."""
    return op_schema(PreparedBatch, "", "str options_json, str backend", "(Tensor, Tensor, Tensor, Tensor)")


def options_json(options: LossOptions) -> str:
    """The loss options as the op's ``options_json`` argument (a string: a schema constant).

    Built field by field, not by json.dumps, which torch.compile cannot trace (a float option is then fixed by a
    guard).

    Args:
        options: the loss options.

    Returns:
        Their JSON object, which ``LossOptions(**json.loads(...))`` reads back exactly.
    """
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


def _unpacked(arguments):
    """The op's arguments (PreparedBatch's tensors, ``options_json``, ``backend``) as (batch, options, backend)."""
    *tensors, encoded_options, backend = arguments
    return PreparedBatch(*tensors), LossOptions(**json.loads(encoded_options)), backend


def _token_loss(*arguments):
    """The op's implementation: ``_layer2`` by the named backend's token loss."""
    batch, options, backend = _unpacked(arguments)
    return _layer2(named(backend), batch, options)


_token_loss_op = torch.library.custom_op("grpo_fast::token_loss", _token_loss, mutates_args=(), schema=_schema())


@_token_loss_op.register_fake
def _(*arguments):
    """The outputs' shapes and dtypes (torch calls a fake with the op's arguments by position)."""
    batch, options, _ = _unpacked(arguments)
    logp = batch.logp
    return (
        logp.new_empty((), dtype=FP32),
        logp.new_empty(len(metric_names(options, batch.entropy is not None)), dtype=FP32),
        torch.empty_like(logp, dtype=FP32),
        logp.new_empty(logp.shape if options.entropy_coef != 0.0 else (0,), dtype=FP32),
    )


def _token_loss_setup_context(ctx, inputs, output):
    _, _, grad_logp, grad_entropy = output
    ctx.save_for_backward(grad_logp, grad_entropy)


def _token_loss_backward(ctx, grad_loss, *_):
    """dL/dlogp and dL/dentropy, computed in the forward, times the loss's gradient; None for the other arguments."""
    grad_logp, grad_entropy = ctx.saved_tensors
    others = (None,) * (len(PreparedBatch._fields) - 2 + 2)  # the batch's other tensors, options_json, backend
    if grad_loss is None:
        return (None, None) + others
    grad_entropy = grad_entropy * grad_loss if ctx.needs_input_grad[1] and grad_entropy.numel() else None
    return (grad_logp * grad_loss, grad_entropy) + others


_token_loss_op.register_autograd(_token_loss_backward, setup_context=_token_loss_setup_context)


def device_entropy_quantile(entropy, mask, top_entropy_quantile):
    """torch.quantile(entropy[mask], 1 - top_entropy_quantile), without a boolean selection or a host read.

    Linear interpolation, as the spec's ``entropy_quantile_threshold``: the masked entropies are sorted first and
    their count stays a device value.

    Args:
        entropy: the token entropies [B, T].
        mask: the completion mask [B, T], 0 / 1.
        top_entropy_quantile: the option, in [0, 1].

    Returns:
        The threshold, a float32 scalar tensor on entropy's device: +inf (no token is high-entropy) when no token
        is masked in, NaN when a masked-in entropy is NaN.
    """
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


def _token_inputs(batch: PreparedBatch, options: LossOptions):
    """(TokenLossInputs, the normaliser's reciprocal as a logp-dtype scalar, the entropy threshold or None): what
    the token kernel and its twin take, on the device (no host read)."""
    logp, mask = batch.logp, batch.mask
    denominator = options.denominator(logp.shape[0], mask.sum(), batch.num_items_in_batch)
    # a number is written to the device (torch.full: a fill, not a copy from host memory), never read back
    scale = 1.0 / (
        denominator.double()
        if isinstance(denominator, torch.Tensor)
        else torch.full((), denominator, dtype=torch.float64, device=logp.device)
    )
    threshold = None
    if options.entropy_mask:
        threshold = batch.entropy_threshold
        if threshold is None:
            threshold = device_entropy_quantile(batch.entropy, mask, options.top_entropy_quantile)
    sampler = None
    if options.off_policy_mask_threshold is not None:
        sampler = next(x for x in (batch.sampling_logprobs, batch.old_logprobs, logp) if x is not None).contiguous()
    inputs = TokenLossInputs(
        logp=logp,
        advantages=batch.advantages,
        mask=mask,
        old=batch.old_logprobs,
        ref=batch.ref_logprobs if options.beta != 0.0 else None,
        sampler=sampler,
        importance_weights=batch.importance_weights,
        entropy=batch.entropy,
    )
    return inputs, scale.to(logp.dtype), threshold


def token_gradient(batch: PreparedBatch, options: LossOptions, backend):
    """dL/dlogp [B, T] fp32 of the loss ``token_loss`` computes (the backend's token loss's gradient, without the
    loss's sums or the metrics); no autograd. For a caller that forms a head's gradients while the logits are in hand
    (``LossOptions.token_local``: each token's value reads no other token's log-prob)."""
    inputs, scale, threshold = _token_inputs(batch, options)
    return backend.token_loss(inputs, options, scale=scale, entropy_threshold=threshold)[0]


def _layer2(backend, batch: PreparedBatch, options: LossOptions):
    """The op's outputs by ``backend``'s token loss: the normaliser and the entropy quantile on the device, then the
    loss, the entropy bonus and the metrics from its per-sequence statistics.

    Returns:
        (loss [], metrics [M] in ``metric_names``' order, dL/dlogp [B, T], dL/dentropy [B, T] or empty without an
        entropy bonus), in logp's dtype.
    """
    inputs, scale, threshold = _token_inputs(batch, options)
    grad_logp, bonus_mask, stats = backend.token_loss(inputs, options, scale=scale, entropy_threshold=threshold)
    rows = {name: RowValues(values, per_sequence) for name, (values, per_sequence) in stats.items()}
    policy_loss = rows["loss"].values.sum()
    total, grad_entropy = policy_loss, torch.empty(0, dtype=FP32, device=batch.logp.device)
    if options.entropy_coef != 0.0:
        # loss -= entropy_coef * (mean entropy over the bonus tokens): dL/dentropy = -entropy_coef * e_t / count
        bonus_scale = -options.entropy_coef / rows["bonus_count"].values.sum().clamp(min=1.0)
        total = policy_loss + bonus_scale * rows["bonus_entropy"].values.sum()
        grad_entropy = bonus_mask * bonus_scale
    metrics = loss_metrics(options, rows, rows["count"].values, policy_loss)
    # in metric_names' order: loss_metrics builds them in it
    return total.reshape(()).clone(), torch.stack(list(metrics.values())), grad_logp, grad_entropy


_TOKEN_LOSS_INLINE = inline_function(_token_loss, _token_loss_setup_context, _token_loss_backward)


def token_loss(batch: PreparedBatch, options: LossOptions, backend: str):
    """``grpo_fast::token_loss``, differentiable in logp and entropy.

    Args:
        batch: the prepared inputs (PreparedBatch).
        options: the loss options.
        backend: a resolved backend's name ("triton": the token kernel; "torch": its twin).

    Returns:
        (loss [], metrics [M] in ``metric_names``' order, dL/dlogp [B, T], dL/dentropy [B, T] or empty), fp32.
    """
    arguments = (*batch, options_json(options), backend)
    return _TOKEN_LOSS_INLINE.apply(*arguments) if runs_inline(arguments) else _token_loss_op(*arguments)


def workspace_bytes(batch_shape, backend="triton"):
    """The bytes the token loss allocates besides its outputs, for a memory estimate over fake tensors: the named
    backend's ``token_loss_workspace_bytes``.

    Args:
        batch_shape: (B, T).
        backend: a resolved backend's name.
    """
    return named(backend).token_loss_workspace_bytes(tuple(batch_shape))


# ----------------------------------------------------------------------------------------------- the trained head
# grpo_fast::trained_head_loss: both layers in one op for a trained lm_head whose loss is token-local
# (``LossOptions.token_local``): layer 1's three-sweep forward (the backend's ``forward_trained_head``)
# forms dH, dW and db while each token chunk's logits are in hand, from dL/dlogp of the chunk's tokens
# (``token_gradient`` over the batch, the tokens not yet computed at 0: no other token's value enters theirs); then
# layer 2 once over the whole batch for the loss and the metrics. The backward only scales the gradients by the
# loss's gradient. Its inputs: LinearOpOperands' fields (the scored rows), the rows' flat positions in [B x T]
# (``positions``) and which of them are scored (``keep``, None: all), PreparedBatch's tensors but the log-probs and
# the entropy, the options' JSON and the token loss's backend; with a teacher (RL and distillation in one call,
# ``TeacherOperands``) the divergence's gradients join layer 1's in the same g (the backend's ``divergence_loss``:
# both models' logits of a chunk once, the student's three sweeps and the teacher's one).
_BATCH_FIELDS = PreparedBatch._fields[2:]


class TeacherOperands(NamedTuple):
    """The teacher and the divergence's numbers as the trained head op's schema takes them: every tensor None
    without a teacher.

    Attributes:
        teacher_hidden: [N, Dt] the teacher's scored rows.
        teacher_weight: [V, Dt] its head, teacher_hidden's dtype or fp32 (cast to it in the op: ``gemm_weight``).
        teacher_bias: [V] or None.
        teacher_softcap: its soft-cap, or None.
        teacher_logit_scale: its logit scale.
        distillation_coef: the divergence's weight in the per-token loss.
        distillation_beta: the divergence's beta.
    """

    teacher_hidden: torch.Tensor | None = None
    teacher_weight: torch.Tensor | None = None
    teacher_bias: torch.Tensor | None = None
    teacher_softcap: float | None = None
    teacher_logit_scale: float = 1.0
    distillation_coef: float = 0.0
    distillation_beta: float = 1.0


def _trained_head_schema():
    batch = schema_fields(PreparedBatch, _BATCH_FIELDS)
    after = ", ".join(
        [
            "Tensor positions",
            "Tensor? keep",
            batch,
            "str options_json",
            "str token_backend",
            "int token_chunk",
            "bool need_weight",
            schema_fields(TeacherOperands),
        ]
    )
    return op_schema(LinearOpOperands, "", after, "(" + ", ".join(["Tensor"] * 8) + ")")


def _trained_head_arguments(arguments):
    """(LinearOpOperands, positions, keep, PreparedBatch with empty log-probs and no entropy, options, backend,
    tokens per chunk (0: the default), whether dW and db are formed, TeacherOperands)."""
    count = len(LinearOpOperands._fields)
    operands = LinearOpOperands(*arguments[:count])
    teacher_count = len(TeacherOperands._fields)
    teacher = TeacherOperands(*arguments[len(arguments) - teacher_count :])
    positions, keep, *tensors, encoded_options, token_backend, token_chunk, need_weight = arguments[
        count:-teacher_count
    ]
    mask = tensors[_BATCH_FIELDS.index("mask")]
    logp = torch.zeros(mask.shape, dtype=FP32, device=mask.device)
    batch = PreparedBatch(logp, None, *tensors)
    options = LossOptions(**json.loads(encoded_options))
    return operands, positions, keep, batch, options, token_backend, token_chunk, need_weight, teacher


def _trained_head_loss(*arguments):
    """(loss [], metrics [M], logp [B, T], entropy [B, T], dH [N, D], dW [V, D], db [V] or empty, divergence [B, T]
    or empty), fp32: the loss and metrics of ``token_loss`` on the scored rows' log-probs and entropies (with a
    teacher, plus distillation_coef times the loss type's reduction of the divergence), and its gradients."""
    operands, positions, keep, batch, options, token_backend, token_chunk, need_weight, teacher = (
        _trained_head_arguments(arguments)
    )
    head = operands.head()
    hidden, weight, bias = head.hidden, head.weight, head.bias
    flat_logp = batch.logp.view(-1)

    def scored(values, n0, n1):
        return values if keep is None else torch.where(keep[n0:n1], values, 0.0)

    def coefficients(n0, n1, logp, entropy):
        rows = positions[n0:n1]
        flat_logp.index_copy_(0, rows, scored(logp, n0, n1))
        return token_gradient(batch, options, named(token_backend)).view(-1).index_select(0, rows)

    dev = hidden.device
    grads = HeadGrads(
        torch.empty(hidden.shape, dtype=FP32, device=dev),
        torch.zeros(weight.shape, dtype=FP32, device=dev) if need_weight else None,
        torch.zeros(weight.shape[0], dtype=FP32, device=dev) if need_weight and bias is not None else None,
    )
    N = hidden.shape[0]
    divergence = torch.empty(0, dtype=FP32, device=dev)
    backend = named(operands.backend)
    if teacher.teacher_hidden is None:
        logp, entropy, _ = backend.forward_trained_head(head, coefficients, grads, token_chunk or None)
    else:
        transform = LogitTransform.from_floats(
            head.transform.temperature, teacher.teacher_softcap, teacher.teacher_logit_scale
        )
        teacher_weight = gemm_weight(teacher.teacher_weight, teacher.teacher_hidden)
        teacher_head = ModelHead(teacher.teacher_hidden, teacher_weight, teacher.teacher_bias, transform)
        token_weights = options.aggregate_weights(batch.mask, batch.num_items_in_batch).view(-1)
        div_weights = teacher.distillation_coef * scored(token_weights.index_select(0, positions), 0, N)
        div, entropy, logp, _ = backend.divergence_loss(
            ModelHead(hidden, weight, bias, head.transform),
            teacher_head,
            teacher.distillation_beta,
            div_weights.contiguous(),
            grads[:3],
            token_chunk or None,
            layer1=LossLayer1(head.targets, coefficients),
        )
        flat_div = torch.zeros_like(flat_logp).index_copy_(0, positions, scored(div, 0, N))
        divergence = flat_div.view(batch.logp.shape)
    flat_logp.index_copy_(0, positions, scored(logp, 0, N))
    flat_entropy = torch.zeros_like(flat_logp).index_copy_(0, positions, scored(entropy, 0, N))
    batch = batch._replace(entropy=flat_entropy.view(batch.logp.shape))
    loss, metrics, _, _ = _layer2(named(token_backend), batch, options)
    if teacher.teacher_hidden is not None:
        loss = loss + teacher.distillation_coef * options.aggregate(divergence, batch.mask, batch.num_items_in_batch)
    dw, db = (grad if grad is not None else torch.empty(0, dtype=FP32, device=dev) for grad in grads[1:3])
    return loss, metrics, batch.logp, batch.entropy, grads.hidden, dw, db, divergence


_trained_head_loss_op = custom_op("trained_head_loss", _trained_head_loss, _trained_head_schema())


@_trained_head_loss_op.register_fake
def _(*arguments):
    operands, _, _, batch, options, _, _, need_weight, teacher = _trained_head_arguments(arguments)
    hidden, weight, logp = operands.hidden, operands.weight, batch.logp
    return (
        logp.new_empty((), dtype=FP32),
        logp.new_empty(len(metric_names(options, True)), dtype=FP32),
        torch.empty_like(logp),
        torch.empty_like(logp),
        hidden.new_empty(hidden.shape, dtype=FP32),
        weight.new_empty(weight.shape if need_weight else (0,), dtype=FP32),
        weight.new_empty(weight.shape[0] if need_weight and operands.bias is not None else 0, dtype=FP32),
        logp.new_empty(logp.shape if teacher.teacher_hidden is not None else (0,), dtype=FP32),
    )


def _trained_head_setup_context(ctx, inputs, output):
    operands = LinearOpOperands(*inputs[: len(LinearOpOperands._fields)])
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(*output[4:7])
    ctx.dtypes = (
        operands.hidden.dtype,
        operands.weight.dtype,
        operands.bias.dtype if operands.bias is not None else None,
    )


def _trained_head_backward(ctx, grad_loss, *_):
    """The gradients formed in the forward times the loss's gradient, each in its input's dtype (a row slab at a
    time: the fp32 product never exists whole beside the saved dW)."""
    grad_hidden, grad_weight, grad_bias = ctx.saved_tensors
    others = (None,) * (len(ctx.needs_input_grad) - 4)
    if grad_loss is None:
        return (None,) * len(ctx.needs_input_grad)

    def scaled(grad, dtype, need):
        return scaled_gradient(grad, grad_loss, dtype) if need else None

    need_h, need_w, _, need_b = ctx.needs_input_grad[:4]
    hidden_dtype, weight_dtype, bias_dtype = ctx.dtypes
    return (
        scaled(grad_hidden, hidden_dtype, need_h),
        scaled(grad_weight, weight_dtype, need_w),
        None,
        scaled(grad_bias, bias_dtype, need_b and grad_bias.numel() > 0),
    ) + others


_trained_head_loss_op.register_autograd(_trained_head_backward, setup_context=_trained_head_setup_context)
_TRAINED_HEAD_INLINE = inline_function(_trained_head_loss, _trained_head_setup_context, _trained_head_backward)


def trained_head_loss(
    operands,
    positions,
    keep,
    batch: PreparedBatch,
    options: LossOptions,
    token_backend: str,
    token_chunk: int | None = None,
    teacher: TeacherOperands | None = None,
    need_weight: bool = True,
):
    """``grpo_fast::trained_head_loss`` (loss, metrics [M], logp [B, T], entropy [B, T], divergence [B, T] or
    empty), differentiable in the head's hidden rows, weight and bias (through the gradients it formed).
    ``operands``: a LinearOpOperands of the scored rows; ``positions`` [N] int64 their flat indices in [B x T];
    ``keep`` [N] bool or None (a device partition's scored rows); ``batch``: the prepared batch (its log-probs and
    entropy are not read); ``token_chunk``: tokens per chunk (None: the backend's default); ``teacher``: RL and
    distillation in one call (the divergence detached), or None; ``need_weight``: form dW and db (false: a frozen
    head, dH alone)."""
    teacher = teacher or TeacherOperands()
    arguments = (
        *operands,
        positions,
        keep,
        *batch[2:],
        options_json(options),
        token_backend,
        token_chunk or 0,
        need_weight,
        *teacher,
    )
    run = _TRAINED_HEAD_INLINE.apply if runs_inline(arguments) else _trained_head_loss_op
    out = run(*arguments)
    return (*out[:4], out[7].detach())


def trained_head_workspace_bytes(hidden_shape, vocab_size, dtype, batch_shape, backend="triton", token_chunk=None):
    """The bytes ``grpo_fast::trained_head_loss`` allocates besides its outputs, for a memory estimate: the
    backend's three-sweep head's (``trained_head_workspace_bytes``: one token chunk's fp32 logits over the vocabulary,
    J, its state and one chunk's GEMM operand), and the token loss's own (``workspace_bytes``) with the [B, T]
    dL/dlogp it returns.

    Args:
        hidden_shape: (N, D), the scored rows.
        vocab_size: V.
        dtype: the head's dtype.
        batch_shape: (B, T).
        backend: the op's backend's name (the head's and the token loss's).
        token_chunk: the head's tokens per chunk (None: the default).
    """
    head = named(backend).trained_head_workspace_bytes(tuple(hidden_shape), vocab_size, dtype, token_chunk)
    return head + workspace_bytes(batch_shape, backend) + batch_shape[0] * batch_shape[1] * 4
