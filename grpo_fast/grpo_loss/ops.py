"""Layer 2's torch.library custom op: the GRPO token loss (loss, metrics, dL/dlogp, dL/dentropy) with a fake
implementation and a registered autograd formula, by the token kernel or its torch twin. The loss options travel
as their JSON (``options_json``); nothing is read on the host.
"""

from __future__ import annotations

import dataclasses
import json

import torch

from grpo_fast.grpo_loss import torch_twin
from grpo_fast.grpo_loss.metrics import RowValues, loss_metrics, metric_names
from grpo_fast.grpo_loss.options import LossOptions
from grpo_fast.head.ops import inline_function, runs_inline
from grpo_fast.kernels import token_loss as ktoken_loss
from grpo_fast.kernels.loss_statistics import SLOTS

FP32 = torch.float32
# layer 2 by backend name: the token kernel's launcher, or its torch twin (the same arguments and returns)
TOKEN_LOSS = {"triton": ktoken_loss.token_loss, "torch": torch_twin.token_loss}


def _or_nothing(x, like):
    """x, or the empty tensor that stands for an output a path does not produce."""
    return x if x is not None else torch.empty(0, dtype=FP32, device=like.device)


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
    grpo_fast.grpo_loss.metrics.metric_names' order, dL/dlogp [B, T], dL/dentropy [B, T] or empty without an entropy bonus),
    fp32, by the backend's token loss (the token kernel, or its torch twin grpo_fast/token_loss_torch.py). No
    value is read on the host (the normaliser, the bonus tokens' count and the entropy quantile stay on the device)."""
    options = LossOptions(**json.loads(options_json))
    return _layer2(TOKEN_LOSS[backend], logp, entropy, advantages, mask, old_logprobs, ref_logprobs,
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


def _layer2(token_loss_impl, logp, entropy, adv, mask, old, ref, sampling, iw, num_items, entropy_threshold, options):
    """``_token_loss`` by ``token_loss_impl`` (a TOKEN_LOSS value): the normaliser and the
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
    grad_logp, bonus_mask, stats = token_loss_impl(
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


_TOKEN_LOSS_INLINE = inline_function(_token_loss, _token_loss_setup_context, _token_loss_backward)


def token_loss(*args):
    """grpo_fast::token_loss (``_token_loss``'s arguments and outputs), differentiable in logp and entropy."""
    return _TOKEN_LOSS_INLINE.apply(*args) if runs_inline(args) else _token_loss_op(*args)


def workspace_bytes(batch_shape, backend="triton"):
    """The bytes the token loss allocates besides its outputs, for a memory estimate over fake tensors: the
    kernel's B x len(SLOTS) fp32 statistics and its B x T fp32 bonus mask (an upper bound: it exists only with an
    entropy bonus); the torch twin's torch_twin.TEMPORARIES fp32 [B, T] tensors."""
    B, T = batch_shape
    if backend == "torch":
        return torch_twin.TEMPORARIES * B * T * 4
    return B * len(SLOTS) * 4 + B * T * 4
