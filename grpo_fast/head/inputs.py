"""The argument checks and row selection the public functions share (layer 1's, the loss's, the divergence head's).

Checks raise named errors before any value is read. The value checks (targets in [0, V) where the mask is 1, the mask
0/1, num_items_in_batch >= 0) run on the device as one small tensor of flags, read once (``ValueChecks.read``: one
host synchronisation per call), which also brings the number of scored tokens so that exactly the rows with mask 1
are gathered. With ``check_values=False``, under torch.compile, and for tensors without data (FakeTensorMode, meta)
nothing is read: the rows are a stable partition of all B x T rows by the mask (scored rows first, the others zeroed,
``Rows.count`` a device value the Triton forward reads).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch._subclasses.fake_tensor import is_fake

from grpo_fast.backends.protocol import Backend, HeadOperands
from grpo_fast.backends.resolver import resolve_backend
from grpo_fast.head import lora as head_lora
from grpo_fast.head import shard as head_shard
from grpo_fast.head.lora import HeadLora
from grpo_fast.head.shard import VocabShard
from grpo_fast.head.transform import LogitTransform
from grpo_fast.kernels import config as kconfig
from grpo_fast.kernels.config import FLOAT_DTYPES, BackwardMode, HeadPath

# the hidden states' dtypes under which an fp32 weight is taken (and cast to them for the GEMMs)
LOW_PRECISION_DTYPES = (torch.bfloat16, torch.float16)


def check_tensor(name, x):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    return x


def check_float_tensor(name, x):
    check_tensor(name, x)
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be float32, bfloat16 or float16, got {x.dtype}")
    return x


def check_shape(name, x, expected_shapes, descr):
    """x's shape is one of ``expected_shapes``, else a ValueError with ``descr()`` (a function: formatting sizes
    would fix them under torch.compile's dynamic shapes, so only an error formats them)."""
    # size by size (not tuple membership): symbolic sizes under torch.compile compare as guards
    if not any(x.dim() == len(s) and all(a == b for a, b in zip(x.shape, s)) for s in expected_shapes):
        raise ValueError(f"{name} must have shape {descr()}, got {tuple(x.shape)}")


def check_weight_dtype(weight_name, weight, hidden_name, hidden):
    """The weight's dtype is the hidden states', or fp32 over bf16 / fp16 hidden states (a master weight kept in fp32,
    as under torch.autocast): the GEMMs then take a copy of it in the hidden states' dtype (``gemm_weight``) and its
    gradient comes back in fp32. Any other pair is a TypeError: which side to round is the caller's choice."""
    if weight.dtype == hidden.dtype or (weight.dtype == torch.float32 and hidden.dtype in LOW_PRECISION_DTYPES):
        return
    raise TypeError(
        f"{weight_name} dtype {weight.dtype} differs from {hidden_name} dtype {hidden.dtype}: only an fp32 weight "
        f"over bf16 / fp16 hidden states is cast (to their dtype); cast {hidden_name} to {weight.dtype} or "
        f"{weight_name} to {hidden.dtype}"
    )


def check_same_device(named, device, reference_name):
    """Every tensor of ``named`` on ``device``, the device of the argument ``reference_name``; checked before any
    value is read (a tensor on another device, or a meta tensor, gets this error, not torch's)."""
    for name, x in named:
        if x is not None and x.device != device:
            raise ValueError(
                f"{name} is on {x.device} but {reference_name} is on {device}: all tensors must share a device"
            )


def has_data(*tensors):
    """The tensors' values can be read: not under torch.compile, not fake (FakeTensorMode) nor meta tensors."""
    if torch.compiler.is_compiling():
        return False
    return not any(x is not None and (x.device.type == "meta" or is_fake(x)) for x in tensors)


class ValueChecks:
    """The checks that read values, computed on the device and read in ONE host synchronisation (``read``): each
    check adds int64 device values (a flag, and what its message shows); ``count`` adds the scored tokens' count.
    Skipped entirely (``run`` False) without ``check_values``, under torch.compile and for tensors without data."""

    def __init__(self, check_values, *tensors):
        if not isinstance(check_values, bool):
            raise TypeError(f"check_values must be a bool, got {check_values!r}")
        self.run = check_values and has_data(*tensors)
        self._values, self._errors = [], []

    def add(self, values, error):
        """``values``: int64 device scalars, the first a flag (non-zero: failed); ``error(*values)`` the exception."""
        if self.run:
            self._values.append(torch.stack([v.reshape(()).to(torch.int64) for v in values]))
            self._errors.append(error)

    def read(self, extra=None):
        """Read every check (and ``extra``, int64 device scalars returned as ints) at once; raise the first error."""
        if not self.run:
            return None
        parts = self._values + ([torch.stack([v.reshape(()).to(torch.int64) for v in extra])] if extra else [])
        if not parts:
            return []
        values = torch.cat(parts).tolist()
        at = 0
        for part, error in zip(self._values, self._errors):
            mine = values[at : at + part.numel()]
            at += part.numel()
            if mine[0]:
                raise error(*mine)
        return values[at:]


def check_targets(targets, shape, V, mask, checks):
    check_tensor("targets", targets)
    if targets.dtype.is_floating_point or targets.dtype == torch.bool or targets.is_complex():
        raise TypeError(f"targets must be an integer tensor of token ids, got {targets.dtype}")
    check_shape("targets", targets, [shape], lambda: f"[B, T] = {list(shape)}")
    if not checks.run:
        return
    # masked positions are never read (-100 is fine): the extremes of the scored targets only
    scored = torch.ones_like(targets, dtype=torch.bool) if mask is None else mask.bool()
    low = torch.where(scored, targets, torch.iinfo(targets.dtype).max).min()
    high = torch.where(scored, targets, torch.iinfo(targets.dtype).min).max()
    where = "" if mask is None else " where completion_mask is 1"
    checks.add(
        [scored.any() & ((low < 0) | (high >= V)), low, high],
        lambda _, lo, hi: ValueError(
            f"targets must be token ids in [0, V) = [0, {V}){where}, got values in [{lo}, {hi}]"
        ),
    )


def check_mask(mask, shape, checks):
    check_tensor("completion_mask", mask)
    check_shape("completion_mask", mask, [shape], lambda: f"[B, T] = {list(shape)}")
    if mask.dtype != torch.bool and mask.numel() and checks.run:
        checks.add(
            [~((mask == 0) | (mask == 1)).all()],
            lambda _: ValueError("completion_mask must be bool or hold only 0 and 1"),
        )


def layer1_choices(head_path, backward_mode, backend):
    """The caller's choice of layer-1 path and backward (``kernels.config`` lists them); returns the path to take."""
    if head_path not in kconfig.HEAD_PATHS:
        raise ValueError(
            f"head_path must be one of {kconfig.HEAD_PATHS} ('auto': the frozen-head path when only "
            f"hidden needs a gradient; 'general': always the recompute path), got {head_path!r}"
        )
    if backward_mode not in kconfig.BACKWARD_MODES:
        raise ValueError(f"backward_mode must be one of {kconfig.BACKWARD_MODES}, got {backward_mode!r}")
    if backward_mode not in backend.backward_modes:
        raise ValueError(
            f"backward_mode={backward_mode!r} is a Triton backward; the torch backend (CPU tensors "
            "without TRITON_INTERPRET=1, or backend='torch') has only 'chunked'"
        )
    return head_path


def check_linear(hidden, weight, targets, bias, completion_mask, checks, shard=None):
    """Shared checks of layer 1's inputs; returns (B, T, D, V). With a vocab-parallel ``shard``, weight and bias are
    this rank's rows (possibly none) and V is the whole head's. The value checks go to ``checks`` (ValueChecks)."""
    check_float_tensor("hidden", hidden)
    if hidden.dim() != 3:
        raise ValueError(f"hidden must have shape [B, T, D], got {tuple(hidden.shape)}")
    B, T, D = hidden.shape
    if B == 0 or T == 0 or D == 0:
        raise ValueError(f"hidden must be non-empty, got shape {tuple(hidden.shape)}")
    check_weight(("hidden", "weight"), hidden, weight, sharded=shard is not None)
    check_weight_dtype("weight", weight, "hidden", hidden)
    V = weight.shape[0] if shard is None else shard.vocab_size
    if bias is not None:
        check_float_tensor("bias", bias)
        check_shape(
            "bias",
            bias,
            [(weight.shape[0],)],
            lambda: (
                f"[V] = [{weight.shape[0]}]" if shard is None else f"this rank's rows [V_local] = [{weight.shape[0]}]"
            ),
        )
    if completion_mask is not None:
        check_tensor("completion_mask", completion_mask)
    check_same_device(
        [("weight", weight), ("targets", targets), ("bias", bias), ("completion_mask", completion_mask)],
        hidden.device,
        "hidden",
    )
    if completion_mask is not None:
        check_mask(completion_mask, (B, T), checks)
    check_targets(targets, (B, T), V, completion_mask, checks)
    return B, T, D, V


@dataclass(frozen=True)
class Rows:
    """The rows layer 1 computes, of the B x T flat ones: ``order`` their flat indices (None: all, in order); with
    ``keep`` (a [n] bool device tensor) the rows are a partition of all B x T rows, scored ones first, and only
    those with keep are scored (``count`` = their number, a [1] int32 device tensor the forward kernel reads)."""

    order: torch.Tensor | None = None
    keep: torch.Tensor | None = None
    count: torch.Tensor | None = None


def scored_rows(completion_mask, checks):
    """The scored rows (Rows) and the checks read (their one host synchronisation, ``checks.read``): exactly the
    rows with mask 1 when the checks read the count with their flags, else the device partition (module docstring)."""
    if completion_mask is None:
        checks.read()
        return Rows()
    active = completion_mask.reshape(-1).bool()
    count = active.sum()
    read = checks.read([count])
    # stable: the scored rows keep their order (the same rows, in the same order, as a selection)
    order = torch.argsort(active.logical_not().to(torch.int8), stable=True)
    if read is not None:
        n = read[0]
        return Rows() if n == active.numel() else Rows(order[:n])
    return Rows(order, torch.arange(active.numel(), device=active.device) < count, count.to(torch.int32).reshape(1))


def row_values(flat, rows):
    """The rows ``rows`` (Rows) of ``flat`` [B x T, ...], in their order, padding rows (a device partition's) 0."""
    if rows.order is not None:
        flat = flat.index_select(0, rows.order)
    if rows.keep is not None:
        flat = torch.where(rows.keep.view(-1, *([1] * (flat.dim() - 1))), flat, 0)
    return flat


def flat_inputs(hidden, weight, targets, bias, rows):
    """[N, D] hidden rows and [N] targets of ``rows`` (Rows: padding rows zeroed, their targets 0), the weight
    and bias as the kernels read them."""
    h = row_values(hidden.reshape(-1, hidden.shape[-1]), rows)
    y = row_values(targets.reshape(-1), rows)
    if h.stride(-1) != 1:
        h = h.contiguous()
    w = weight if weight.stride(-1) == 1 else weight.contiguous()
    b = bias.contiguous() if bias is not None else None
    return h, w, y.to(torch.int64).contiguous(), b


def checked_lora(lora, hidden, weight, shard):
    """The ``lora=`` argument as a checked HeadLora (or None) for this head."""
    lora = head_lora.as_head_lora(lora)
    if lora is not None:
        head_lora.check_against_head(lora, hidden, weight, shard is not None)
    return lora


def lora_operands(lora, hidden, rows):
    """Layer 1's LoRA operand pair (lora_hidden [N, r] for ``rows``, padding rows zeroed; b [V, r]), or None."""
    if lora is None:
        return None
    b = lora.b if lora.b.stride(-1) == 1 else lora.b.contiguous()
    lora_h = head_lora.lora_hidden(lora, hidden, rows.order)
    if rows.keep is not None:
        lora_h = torch.where(rows.keep[:, None], lora_h, 0.0)
    return lora_h.contiguous(), b


def scatter_rows(values, rows, shape):
    """Per-token values of ``rows`` -> [B, T], exact zeros elsewhere (differentiable)."""
    if rows.order is None:
        return values.view(shape)
    if rows.keep is not None:
        values = torch.where(rows.keep, values, 0.0)
    return values.new_zeros(shape[0] * shape[1]).index_copy(0, rows.order, values).view(shape)


def check_weight(names, hidden, weight, sharded):
    """A float ``weight`` [V, D] whose D is the last dimension of ``hidden`` (already checked [B, T, D]) and V > 0 (a
    vocab-parallel shard may hold no row); ``names``: (hidden's, weight's) in the errors, a wrong D named on both."""
    hidden_name, weight_name = names
    check_float_tensor(weight_name, weight)
    if weight.dim() != 2:
        raise ValueError(f"{weight_name} must have shape [V, D] (the lm_head's), got {tuple(weight.shape)}")
    D = hidden.shape[-1]
    if weight.shape[1] != D:
        raise ValueError(
            f"{hidden_name} has D = {D} but {weight_name} has shape {tuple(weight.shape)}: {hidden_name}'s last "
            f"dimension must equal {weight_name}'s second"
        )
    if weight.shape[0] == 0 and not sharded:
        raise ValueError(f"{weight_name} must have V > 0 rows, got shape {tuple(weight.shape)}")


def check_head(names, hidden, weight, bias, sharded=False):
    """One model's hidden [B, T, D], weight [V, D] (``check_weight_dtype``; a vocab-parallel shard may hold no row)
    and bias [V] | None, named ``names`` (hidden's, weight's, bias's) in the errors; returns (B, T, D, V). The
    divergence head's checks of both models, and ``loss``'s of a teacher."""
    hidden_name, weight_name, bias_name = names
    check_float_tensor(hidden_name, hidden)
    if hidden.dim() != 3 or 0 in hidden.shape:
        raise ValueError(f"{hidden_name} must have shape [B, T, D] with B, T, D > 0, got {tuple(hidden.shape)}")
    check_weight((hidden_name, weight_name), hidden, weight, sharded)
    check_weight_dtype(weight_name, weight, hidden_name, hidden)
    if bias is not None:
        check_float_tensor(bias_name, bias)
        if tuple(bias.shape) != (weight.shape[0],):
            raise ValueError(f"{bias_name} must have shape [V] = [{weight.shape[0]}], got {tuple(bias.shape)}")
    return (*hidden.shape, weight.shape[0])


# ----------------------------------------------------------------------------------------------- one checked call
@dataclass(frozen=True)
class HeadCall:
    """A checked call of layer 1 (``logprobs``, ``logprobs_and_entropy``, ``loss``): the tensors as the head computes
    on them (a vocab-parallel head's local rows), the caller's choices resolved, and the value checks, not yet read
    (``rows`` reads them, with whatever a caller added to them, in its one host synchronisation)."""

    hidden: torch.Tensor  # [B, T, D]
    weight: torch.Tensor  # [V, D], or this rank's rows of a vocab-parallel head
    targets: torch.Tensor  # [B, T]
    bias: torch.Tensor | None
    completion_mask: torch.Tensor | None  # [B, T], or None: every token
    transform: LogitTransform
    lora: HeadLora | None
    shard: VocabShard | None
    backend: Backend
    head_path: HeadPath
    backward_mode: BackwardMode
    checks: ValueChecks

    @classmethod
    def check(
        cls,
        hidden,
        weight,
        targets,
        completion_mask,
        *,
        bias,
        temperature,
        softcap,
        logit_scale,
        lora,
        vocab_parallel,
        backend,
        check_values,
        head_path="auto",
        backward_mode="chunked",
    ) -> HeadCall:
        """Every check of layer 1's arguments (named errors before any value is read; the value checks queued),
        its backend resolved."""
        hidden, weight, bias, shard = head_shard.resolve(hidden, weight, bias, vocab_parallel)
        checks = ValueChecks(check_values, hidden, targets, completion_mask)
        B, T, _, _ = check_linear(hidden, weight, targets, bias, completion_mask, checks, shard)
        lora = checked_lora(lora, hidden, weight, shard)
        transform = LogitTransform.from_keywords(temperature, softcap, logit_scale)
        resolved = resolve_backend(backend, hidden.device)
        resolved.check_sizes(B * T, weight.shape[0])
        head_path = layer1_choices(head_path, backward_mode, resolved)
        return cls(
            hidden,
            weight,
            targets,
            bias,
            completion_mask,
            transform,
            lora,
            shard,
            resolved,
            head_path,
            backward_mode,
            checks,
        )

    @property
    def shape(self) -> tuple[int, int]:
        """(B, T)."""
        return tuple(self.targets.shape)

    def rows(self) -> Rows:
        """The scored rows, the value checks read (``scored_rows``: the call's one host synchronisation)."""
        return scored_rows(self.completion_mask, self.checks)

    def operands(self, rows: Rows) -> HeadOperands:
        """Layer 1's operands of the scored ``rows``: [N, D] hidden rows, [N] targets, the weight and bias as the
        kernels read them, the transform and LoRA's operand pair."""
        h, w, y, b = flat_inputs(self.hidden, self.weight, self.targets, self.bias, rows)
        return HeadOperands(h, w, y, b, self.transform, lora_operands(self.lora, self.hidden, rows))

    def scattered(self, values: torch.Tensor, rows: Rows) -> torch.Tensor:
        """Per-token values of ``rows`` as [B, T], exact zeros elsewhere (``scatter_rows``)."""
        return scatter_rows(values, rows, self.shape)
