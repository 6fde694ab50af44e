"""Layer 2's torch.library custom op, ``grpo_fast::token_loss``: the GRPO loss, its metrics, dL/dlogp and dL/dentropy
from prepared per-token inputs, by the token kernel or its torch twin, with a fake implementation and a registered
autograd formula. The loss options travel as their JSON (``options_json``); nothing is read on the host.
"""

from __future__ import annotations

import dataclasses
import json
import typing
from typing import NamedTuple

import torch

from grpo_fast.grpo_loss import torch_twin
from grpo_fast.grpo_loss.metrics import RowValues, loss_metrics, metric_names
from grpo_fast.grpo_loss.options import LossOptions
from grpo_fast.head.ops import inline_function, runs_inline
from grpo_fast.kernels import token_loss as token_kernel
from grpo_fast.kernels.loss_statistics import SLOTS
from grpo_fast.kernels.token_loss import TokenLossInputs

FP32 = torch.float32
# layer 2 by backend name: the token kernel's launcher, or its torch twin (the same arguments and returns)
TOKEN_LOSS = {"triton": token_kernel.token_loss, "torch": torch_twin.token_loss}


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
    hints = typing.get_type_hints(PreparedBatch)
    tensors = [f"Tensor{'?' if type(None) in typing.get_args(hints[name]) else ''} {name}" for name in hints]
    return f"({', '.join(tensors)}, str options_json, str backend) -> (Tensor, Tensor, Tensor, Tensor)"


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
    """The op's implementation: ``_layer2`` by the backend's token loss."""
    batch, options, backend = _unpacked(arguments)
    return _layer2(TOKEN_LOSS[backend], batch, options)


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


def _layer2(token_loss_impl, batch: PreparedBatch, options: LossOptions):
    """The op's outputs by ``token_loss_impl`` (a TOKEN_LOSS value): the normaliser and the entropy quantile on the
    device, then the loss, the entropy bonus and the metrics from its per-sequence statistics.

    Returns:
        (loss [], metrics [M] in ``metric_names``' order, dL/dlogp [B, T], dL/dentropy [B, T] or empty without an
        entropy bonus), in logp's dtype.
    """
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
    grad_logp, bonus_mask, stats = token_loss_impl(
        inputs, options, scale=scale.to(logp.dtype), entropy_threshold=threshold
    )
    rows = {name: RowValues(values, per_sequence) for name, (values, per_sequence) in stats.items()}
    policy_loss = rows["loss"].values.sum()
    total, grad_entropy = policy_loss, torch.empty(0, dtype=FP32, device=logp.device)
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
        backend: "triton" (the token kernel) or "torch" (its twin).

    Returns:
        (loss [], metrics [M] in ``metric_names``' order, dL/dlogp [B, T], dL/dentropy [B, T] or empty), fp32.
    """
    arguments = (*batch, options_json(options), backend)
    return _TOKEN_LOSS_INLINE.apply(*arguments) if runs_inline(arguments) else _token_loss_op(*arguments)


def workspace_bytes(batch_shape, backend="triton"):
    """The bytes the token loss allocates besides its outputs, for a memory estimate over fake tensors.

    Args:
        batch_shape: (B, T).
        backend: "triton" or "torch".

    Returns:
        The kernel's B x len(SLOTS) fp32 statistics and its B x T fp32 bonus mask (an upper bound: it exists only
        with an entropy bonus); the torch twin's ``TEMPORARIES`` fp32 [B, T] tensors.
    """
    B, T = batch_shape
    if backend == "torch":
        return torch_twin.TEMPORARIES * B * T * 4
    return B * len(SLOTS) * 4 + B * T * 4
