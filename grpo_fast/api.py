"""The public functions: argument checks with named errors, dtype policy, row selection and dispatch.

Backends: "triton" runs the Triton kernels (CUDA tensors, or CPU tensors under TRITON_INTERPRET=1);
"torch" runs the same algorithm in chunked PyTorch (any device); "auto" picks triton for CUDA tensors and under
the interpreter, torch otherwise.

Only completion tokens are computed: with a ``completion_mask``, the rows with mask 1 are gathered before layer 1
(forward and backward) and the per-token outputs are scattered back, with exact zeros at masked positions.

Host synchronisations: the value checks (``check_values=True``, the default: targets in [0, V) where the mask is 1,
the mask 0/1, num_items_in_batch >= 0) are computed on the device as one small tensor of flags, read once (one
host synchronisation per call), and each failed check raises its named error. That read also brings the number of
scored tokens, so the scored rows are gathered exactly (argsort of the mask, cut at that count). With
``check_values=False``, under torch.compile, and for tensors without data (FakeTensorMode, meta), nothing is read:
the rows are a stable partition of all B x T rows by the mask (scored rows first, the others zeroed), the Triton
forward kernel skips the blocks past the scored count (``_Rows.count``, a device value) and the backward kernel the
blocks without a gradient; the cuBLAS GEMMs of the chunked backward and of the frozen-head forward (and the torch
twin) run over all B x T rows (their padding rows are zeros: the results are the same, the cost that of the whole
batch). Layer 2 reads nothing on
the host (grpo_fast.ops.token_loss). The layers run as torch.library custom ops (grpo_fast.ops).

``lora=grpo_fast.HeadLora(a, b, scaling, dropout)`` (or a tuple (a, b, scaling)): LoRA on the lm_head, exact
(grpo_fast/lora.py): its [N, r] operand is built here for the scored rows and layer 1 adds its product with b.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch._subclasses.fake_tensor import is_fake
from typing_extensions import Unpack

from grpo_fast import autograd, ops, reference, teacher_head
from grpo_fast import lora as head_lora
from grpo_fast import vocab_parallel as vocab_parallel_head
from grpo_fast.kernels import config as kconfig
from grpo_fast.lora import HeadLora
from grpo_fast.metrics import metric_names
from grpo_fast.options import IMPORTANCE_SAMPLING_MODES, LossOptionKeywords, LossOptions
from grpo_fast.options import check_number as _number
from grpo_fast.teacher_head import Teacher
from grpo_fast.transform import LogitTransform
from grpo_fast.vocab_parallel import VocabShard

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
BACKENDS = ("auto", "triton", "torch")


class Metrics(dict):
    """The metrics of ``loss`` and ``token_loss``: detached float32 scalars under TRL's names.

    Attributes:
        logprobs: [B, T] float32, detached: the policy's per-token log-probs (zeros where the mask is 0).
        entropies: [B, T] float32, detached, or None when no entropy was computed.
    """

    logprobs: torch.Tensor
    entropies: torch.Tensor


# ----------------------------------------------------------------------------------------------- checks
def _tensor(name, x):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    return x


def _float_tensor(name, x):
    _tensor(name, x)
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be float32, bfloat16 or float16, got {x.dtype}")
    return x


def _shape(name, x, expected_shapes, descr):
    """x's shape is one of ``expected_shapes``, else a ValueError with ``descr()`` (a function: formatting sizes
    would fix them under torch.compile's dynamic shapes, so only an error formats them)."""
    # size by size (not tuple membership): symbolic sizes under torch.compile compare as guards
    if not any(x.dim() == len(s) and all(a == b for a, b in zip(x.shape, s)) for s in expected_shapes):
        raise ValueError(f"{name} must have shape {descr()}, got {tuple(x.shape)}")


def _same_device(named, device, reference_name):
    """Every tensor of ``named`` on ``device``, the device of the argument ``reference_name``; checked before any
    value is read (a tensor on another device, or a meta tensor, gets this error, not torch's)."""
    for name, x in named:
        if x is not None and x.device != device:
            raise ValueError(
                f"{name} is on {x.device} but {reference_name} is on {device}: all tensors must share a device"
            )


def _has_data(*tensors):
    """The tensors' values can be read: not under torch.compile, not fake (FakeTensorMode) nor meta tensors."""
    if torch.compiler.is_compiling():
        return False
    return not any(x is not None and (x.device.type == "meta" or is_fake(x)) for x in tensors)


class _ValueChecks:
    """The checks that read values, computed on the device and read in ONE host synchronisation (``read``): each
    check adds int64 device values (a flag, and what its message shows); ``count`` adds the scored tokens' count.
    Skipped entirely (``run`` False) without ``check_values``, under torch.compile and for tensors without data."""

    def __init__(self, check_values, *tensors):
        if not isinstance(check_values, bool):
            raise TypeError(f"check_values must be a bool, got {check_values!r}")
        self.run = check_values and _has_data(*tensors)
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


def _check_targets(targets, shape, V, mask, checks):
    _tensor("targets", targets)
    if targets.dtype.is_floating_point or targets.dtype == torch.bool or targets.is_complex():
        raise TypeError(f"targets must be an integer tensor of token ids, got {targets.dtype}")
    _shape("targets", targets, [shape], lambda: f"[B, T] = {list(shape)}")
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


def _check_mask(mask, shape, checks):
    _tensor("completion_mask", mask)
    _shape("completion_mask", mask, [shape], lambda: f"[B, T] = {list(shape)}")
    if mask.dtype != torch.bool and mask.numel() and checks.run:
        checks.add(
            [~((mask == 0) | (mask == 1)).all()],
            lambda _: ValueError("completion_mask must be bool or hold only 0 and 1"),
        )


def _resolve_backend(backend, device):
    """The public ``backend=`` string as the backend object (autograd.TRITON or autograd.TORCH), chosen once here."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        return autograd.TRITON if autograd.TRITON.runs_on(device) else autograd.TORCH
    chosen = autograd.BACKENDS[backend]
    if not chosen.runs_on(device):
        raise ValueError("backend='triton' needs CUDA tensors, or TRITON_INTERPRET=1 set before importing grpo_fast")
    return chosen


def _layer1_choices(head_path, backward_mode, backend):
    """The caller's choice of layer-1 path and backward (kernels/config.py lists them); returns the path to take."""
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


def _check_linear(hidden, weight, targets, bias, completion_mask, checks, shard=None):
    """Shared checks of layer 1's inputs; returns (B, T, D, V). With a vocab-parallel ``shard``, weight and bias are
    this rank's rows (possibly none) and V is the whole head's. The value checks go to ``checks`` (_ValueChecks)."""
    _float_tensor("hidden", hidden)
    if hidden.dim() != 3:
        raise ValueError(f"hidden must have shape [B, T, D], got {tuple(hidden.shape)}")
    B, T, D = hidden.shape
    if B == 0 or T == 0 or D == 0:
        raise ValueError(f"hidden must be non-empty, got shape {tuple(hidden.shape)}")
    _float_tensor("weight", weight)
    if weight.dim() != 2 or weight.shape[1] != D or (weight.shape[0] == 0 and shard is None):
        raise ValueError(f"weight must have shape [V, D] with D = {D}, got {tuple(weight.shape)}")
    if weight.dtype != hidden.dtype:
        raise TypeError(f"weight dtype {weight.dtype} differs from hidden dtype {hidden.dtype}: cast one of them")
    V = weight.shape[0] if shard is None else shard.vocab_size
    if bias is not None:
        _float_tensor("bias", bias)
        _shape(
            "bias",
            bias,
            [(weight.shape[0],)],
            lambda: (
                f"[V] = [{weight.shape[0]}]" if shard is None else f"this rank's rows [V_local] = [{weight.shape[0]}]"
            ),
        )
    if completion_mask is not None:
        _tensor("completion_mask", completion_mask)
    _same_device(
        [("weight", weight), ("targets", targets), ("bias", bias), ("completion_mask", completion_mask)],
        hidden.device,
        "hidden",
    )
    if completion_mask is not None:
        _check_mask(completion_mask, (B, T), checks)
    _check_targets(targets, (B, T), V, completion_mask, checks)
    return B, T, D, V


@dataclass(frozen=True)
class _Rows:
    """The rows layer 1 computes, of the B x T flat ones: ``order`` their flat indices (None: all, in order); with
    ``keep`` (a [n] bool device tensor) the rows are a partition of all B x T rows, scored ones first, and only
    those with keep are scored (``count`` = their number, a [1] int32 device tensor the forward kernel reads)."""

    order: torch.Tensor | None = None
    keep: torch.Tensor | None = None
    count: torch.Tensor | None = None


def _scored_rows(completion_mask, checks):
    """The scored rows (_Rows) and the checks read (their one host synchronisation, ``checks.read``): exactly the
    rows with mask 1 when the checks read the count with their flags, else the device partition (module docstring)."""
    if completion_mask is None:
        checks.read()
        return _Rows()
    active = completion_mask.reshape(-1).bool()
    count = active.sum()
    read = checks.read([count])
    # stable: the scored rows keep their order (the same rows, in the same order, as a selection)
    order = torch.argsort(active.logical_not().to(torch.int8), stable=True)
    if read is not None:
        n = read[0]
        return _Rows() if n == active.numel() else _Rows(order[:n])
    return _Rows(order, torch.arange(active.numel(), device=active.device) < count, count.to(torch.int32).reshape(1))


def _row_values(flat, rows):
    """The rows ``rows`` (_Rows) of ``flat`` [B x T, ...], in their order, padding rows (a device partition's) 0."""
    if rows.order is not None:
        flat = flat.index_select(0, rows.order)
    if rows.keep is not None:
        flat = torch.where(rows.keep.view(-1, *([1] * (flat.dim() - 1))), flat, 0)
    return flat


def _flat_inputs(hidden, weight, targets, bias, rows):
    """[N, D] hidden rows and [N] targets of ``rows`` (_Rows: padding rows zeroed, their targets 0), the weight
    and bias as the kernels read them."""
    h = _row_values(hidden.reshape(-1, hidden.shape[-1]), rows)
    y = _row_values(targets.reshape(-1), rows)
    if h.stride(-1) != 1:
        h = h.contiguous()
    w = weight if weight.stride(-1) == 1 else weight.contiguous()
    b = bias.contiguous() if bias is not None else None
    return h, w, y.to(torch.int64).contiguous(), b


def _checked_lora(lora, hidden, weight, shard):
    """The ``lora=`` argument as a checked HeadLora (or None) for this head."""
    lora = head_lora.as_head_lora(lora)
    if lora is not None:
        head_lora.check_against_head(lora, hidden, weight, shard is not None)
    return lora


def _lora_operands(lora, hidden, rows):
    """Layer 1's LoRA operand pair (lora_hidden [N, r] for ``rows``, padding rows zeroed; b [V, r]), or
    (None, None)."""
    if lora is None:
        return None, None
    b = lora.b if lora.b.stride(-1) == 1 else lora.b.contiguous()
    lora_h = head_lora.lora_hidden(lora, hidden, rows.order)
    if rows.keep is not None:
        lora_h = torch.where(rows.keep[:, None], lora_h, 0.0)
    return lora_h.contiguous(), b


def _scatter_rows(values, rows, shape):
    """Per-token values of ``rows`` -> [B, T], exact zeros elsewhere (differentiable)."""
    if rows.order is None:
        return values.view(shape)
    if rows.keep is not None:
        values = torch.where(rows.keep, values, 0.0)
    return values.new_zeros(shape[0] * shape[1]).index_copy(0, rows.order, values).view(shape)


# ----------------------------------------------------------------------------------------------- layer 1
def logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *, bias: torch.Tensor | None = None,
             temperature: float = 1.0, softcap: float | None = None, logit_scale: float = 1.0,
             completion_mask: torch.Tensor | None = None, lora: HeadLora | tuple | None = None,
             vocab_parallel: VocabShard | None = None, backend: str = "auto",
             check_values: bool = True) -> torch.Tensor:  # fmt: skip
    """Per-token log-probs of ``targets`` for the reference and old policies, without gradients.

    ``logprobs_and_entropy`` without the entropy and without autograd: no [tokens, V] logits are built and no graph
    is kept.

    Args:
        hidden: [B, T, D] float32, bfloat16 or float16; hidden[b, t] predicts targets[b, t].
        weight: [V, D] in hidden's dtype (vocab-parallel: this rank's rows, or a DTensor).
        targets: [B, T] integer token ids.
        bias: [V] or None.
        temperature: divides the logits.
        softcap: soft-cap of the logits, or None.
        logit_scale: multiplies the raw logits.
        completion_mask: [B, T] bool or 0/1: the tokens computed; None: all.
        lora: a HeadLora (or tuple) on the head, or None.
        vocab_parallel: this rank's VocabShard, or None.
        backend: "auto", "triton" or "torch".
        check_values: read the value checks on the host, once.

    Returns:
        [B, T] float32 log-probs, detached; exact zeros where completion_mask is 0.

    Raises:
        TypeError: as ``logprobs_and_entropy``, for the arguments both take.
        ValueError: as ``logprobs_and_entropy``, for the arguments both take.
    """
    hidden, weight, bias, shard = vocab_parallel_head.resolve(hidden, weight, bias, vocab_parallel)
    checks = _ValueChecks(check_values, hidden, targets, completion_mask)
    B, T, _, _ = _check_linear(hidden, weight, targets, bias, completion_mask, checks, shard)
    lora = _checked_lora(lora, hidden, weight, shard)
    transform = LogitTransform.from_keywords(temperature, softcap, logit_scale)
    backend = _resolve_backend(backend, hidden.device)
    backend.check_sizes(B * T, weight.shape[0])
    with torch.no_grad():
        rows = _scored_rows(completion_mask, checks)
        h, w, y, b = _flat_inputs(hidden, weight, targets, bias, rows)
        if shard is not None:
            if h.shape[0] == 0:
                return torch.zeros(B, T, dtype=torch.float32, device=hidden.device)
            logp = vocab_parallel_head.logprobs(h, w, y, b, transform, backend, shard)
        else:
            logp = ops.linear_logprobs(
                h,
                w,
                y,
                b,
                *_lora_operands(lora, hidden, rows),
                *transform.as_floats(),
                False,
                False,
                backend.name,
                "chunked",
                rows.count,
            )[0]
        return _scatter_rows(logp, rows, (B, T))


def logprobs_and_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    softcap: float | None = None,
    logit_scale: float = 1.0,
    completion_mask: torch.Tensor | None = None,
    entropy_grad: bool = False,
    head_path: str = "auto",
    backward_mode: str = "chunked",
    lora: HeadLora | tuple | None = None,
    vocab_parallel: VocabShard | None = None,
    backend: str = "auto",
    check_values: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-probs of ``targets`` and entropies, both differentiable, without full-vocab logits.

    The logit is ``softcap * tanh(logit_scale * (hidden @ weight.T + bias) / softcap) / temperature`` (TRL 1.16's
    order). Gradients reach hidden, weight, bias and the LoRA adapters through both outputs; no tensor of size
    V x tokens exists in the forward or the backward, and every gradient is exact whichever path is taken. A
    vocab-parallel head gives every rank the unsharded outputs and gradients, dW and db rows local
    ([vocab-parallel lm_head](../vocab-parallel.md)).

    Args:
        hidden: [B, T, D] float32, bfloat16 or float16: the last hidden states; hidden[b, t] predicts
            targets[b, t].
        weight: [V, D] lm_head weight, hidden's dtype. Vocab-parallel: this rank's rows [V_local, D] (with
            ``vocab_parallel``) or a DTensor sharded on dim 0.
        targets: [B, T] integer token ids in [0, V); positions where completion_mask is 0 are not read.
        bias: [V] lm_head bias in hidden's dtype (this rank's rows when vocab-parallel), or None.
        temperature: divides the logits (> 0).
        softcap: the soft-cap c of ``c * tanh(x / c)`` (Gemma 2: 30.0); None: no tanh.
        logit_scale: multiplies the raw logits (non-zero; Cohere's logit_scale, Granite's 1 / logits_scaling).
        completion_mask: [B, T] bool or 0/1; only tokens with 1 are computed, the others are exact zeros.
            None: every token.
        entropy_grad: the entropy will be differentiated (an entropy bonus): take the general path, which serves
            it in fewer vocabulary sweeps than the frozen-head path.
        head_path: "auto": with a frozen weight and bias the forward also builds d logp / d hidden (two
            vocabulary sweeps in all instead of three); "general": always the recompute path.
        backward_mode: the Triton backward: "chunked" (g per token chunk and two GEMMs) or "fused" (one kernel,
            fp32 atomics); the torch backend has "chunked" only.
        lora: LoRA on the lm_head: a [HeadLora][grpo_fast.HeadLora] or a tuple (a, b, scaling[, dropout]);
            None: none.
        vocab_parallel: a [VocabShard][grpo_fast.VocabShard] when ``weight`` holds this rank's rows of a
            vocab-parallel head; None: a whole head, or a DTensor weight that carries its own sharding.
        backend: "auto" (Triton for CUDA tensors and under TRITON_INTERPRET=1, else torch), "triton" or "torch".
        check_values: read the value checks (targets in range where the mask is 1, the mask 0/1) in one host
            synchronisation; False reads nothing on the host.

    Returns:
        logprobs: [B, T] float32, exact zeros where completion_mask is 0.
        entropy: [B, T] float32, exact zeros where completion_mask is 0.

    Raises:
        TypeError: a tensor argument that is not a tensor, a float argument not float32/bfloat16/float16,
            weight's dtype not hidden's, targets not an integer tensor, or ``lora``, ``vocab_parallel``,
            ``entropy_grad`` or ``check_values`` of the wrong type.
        ValueError: a shape that does not match, tensors on different devices, a targets value outside [0, V) or
            a mask value other than 0/1 (with ``check_values``), a bad temperature, softcap or logit_scale, an
            unknown ``backend``, ``head_path`` or ``backward_mode`` or one that cannot run here, sizes the Triton
            kernels cannot index, or LoRA on a vocab-parallel head.
    """
    hidden, weight, bias, shard = vocab_parallel_head.resolve(hidden, weight, bias, vocab_parallel)
    checks = _ValueChecks(check_values, hidden, targets, completion_mask)
    B, T, _, _ = _check_linear(hidden, weight, targets, bias, completion_mask, checks, shard)
    lora = _checked_lora(lora, hidden, weight, shard)
    transform = LogitTransform.from_keywords(temperature, softcap, logit_scale)
    if not isinstance(entropy_grad, bool):
        raise TypeError(f"entropy_grad must be a bool, got {entropy_grad!r}")
    backend = _resolve_backend(backend, hidden.device)
    backend.check_sizes(B * T, weight.shape[0])
    head_path = _layer1_choices(head_path, backward_mode, backend)
    return _logprobs_and_entropy(hidden, weight, targets, bias, _scored_rows(completion_mask, checks), transform,
                                 backend, "general" if entropy_grad else head_path, backward_mode,
                                 shard, lora)  # fmt: skip


def _logprobs_and_entropy(
    hidden, weight, targets, bias, rows, transform, backend, head_path, backward_mode, shard=None, lora=None
):
    """Layer 1 with autograd. ``head_path`` "auto": with a frozen weight and bias, build d logp / d hidden in the
    forward (two vocabulary sweeps instead of three; autograd.linear_logprobs), for callers whose entropy will
    usually get no gradient; "general": the recompute path."""
    B, T = targets.shape
    h, w, y, b = _flat_inputs(hidden, weight, targets, bias, rows)
    if shard is not None:  # the same choice of path, over the shards (grpo_fast.vocab_parallel)
        logp, entropy = vocab_parallel_head.linear_logprobs(
            h, w, y, b, transform, backend, shard, head_path, backward_mode
        )
    else:
        logp, entropy = autograd.linear_logprobs(
            h,
            w,
            y,
            b,
            transform,
            backend,
            head_path,
            backward_mode,
            *_lora_operands(lora, hidden, rows),
            row_count=rows.count,
        )
    return _scatter_rows(logp, rows, (B, T)), _scatter_rows(entropy, rows, (B, T))


# ----------------------------------------------------------------------------------------------- layer 2
@dataclass(frozen=True)
class _LossBatch:
    """Layer 2's per-batch inputs besides the log-probs (README's keyword table); checked once by _check_batch."""

    advantages: torch.Tensor
    completion_mask: torch.Tensor
    old_logprobs: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    sampling_logprobs: torch.Tensor | None = None
    importance_weights: torch.Tensor | None = None
    num_items_in_batch: float | torch.Tensor | None = None
    entropy_threshold: float | None = None


def loss(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, advantages: torch.Tensor,
         completion_mask: torch.Tensor, *, bias: torch.Tensor | None = None,
         old_logprobs: torch.Tensor | None = None, ref_logprobs: torch.Tensor | None = None,
         sampling_logprobs: torch.Tensor | None = None, importance_weights: torch.Tensor | None = None,
         num_items_in_batch: float | torch.Tensor | None = None, entropy_threshold: float | torch.Tensor | None = None,
         temperature: float = 1.0, softcap: float | None = None, logit_scale: float = 1.0,
         options: LossOptions | None = None, head_path: str = "auto", backward_mode: str = "chunked",
         lora: HeadLora | tuple | None = None, vocab_parallel: VocabShard | None = None, backend: str = "auto",
         check_values: bool = True, teacher: Teacher | None = None, distillation_coef: float | None = None,
         distillation_beta: float | None = None,
         **option_keywords: Unpack[LossOptionKeywords]) -> tuple[torch.Tensor, Metrics]:  # fmt: skip
    """The GRPO loss (TRL 1.16 semantics) from the policy's last hidden states, without full-vocab logits.

    Layer 1 (``logprobs_and_entropy``) then layer 2 (``token_loss``) over the tokens with completion_mask 1; a
    vocab-parallel head gives every rank the unsharded loss and metrics. The loss options are TRL's
    ``GRPOConfig`` keywords with its defaults, by name (``**option_keywords``, typed by
    [LossOptionKeywords][grpo_fast.LossOptionKeywords]) or as one object (``options``);
    [LossOptions][grpo_fast.LossOptions] documents each ([loss options](../options.md)). With a ``teacher``: RL and
    distillation in one call; the per-token loss gains ``distillation_coef`` times the divergence from the teacher
    (``grpo_fast.divergence``) before the loss type's reduction, computed from the same student tiles as the
    log-probs (grpo_fast/teacher_head.py), and ``metrics["distillation_loss"]`` is its mean over the scored tokens.

    Args:
        hidden: the policy's last hidden states [B, T, D] (float32, bfloat16 or float16).
        weight: the lm_head's [V, D] weight.
        targets: the sampled token ids [B, T].
        advantages: [B] or [B, T] float: per-sequence or per-token advantages.
        completion_mask: [B, T] bool or 0/1: the completion tokens, the only ones computed.
        bias: the lm_head's [V] bias, or None.
        old_logprobs: [B, T] float, the sampling policy's log-probs; None: on-policy (ratio exactly 1).
        ref_logprobs: [B, T] float, the reference model's log-probs; required when ``beta != 0``.
        sampling_logprobs: [B, T] float, the sampler's log-probs for the off-policy mask (NaN: no evidence);
            only with ``off_policy_mask_threshold``.
        importance_weights: [B, T], [B, 1] or [B] float, the sampler correction (e.g.
            ``sampling_importance_weights``); vespo takes [B, T] only.
        num_items_in_batch: a number >= 0 or a one-element tensor: the normaliser of dapo, cispo and vespo (the
            token count of the whole gradient-accumulation window); None: the mask's sum.
        entropy_threshold: the entropy at ``top_entropy_quantile``, precomputed over every process; only with
            ``top_entropy_quantile < 1``. None: this batch's own quantile.
        temperature: the sampling temperature (> 0).
        softcap: the model's logit soft-cap, or None.
        logit_scale: the model's logit scale.
        options: the loss options as one LossOptions, under the option keywords; None: TRL's defaults.
        head_path: layer 1's path, as in ``logprobs_and_entropy`` (the entropy bonus takes the general path).
        backward_mode: layer 1's Triton backward, as in ``logprobs_and_entropy``.
        lora: LoRA on the lm_head (HeadLora), or None.
        vocab_parallel: a VocabShard for a weight that holds this rank's rows, or None.
        backend: "auto", "triton" or "torch", for both layers.
        check_values: one host read of the value checks (also num_items_in_batch >= 0); False: none.
        teacher: a Teacher (its hidden states [B, T, Dt] and head, the student's vocabulary), or None.
        distillation_coef: the divergence's weight in the per-token loss; required with ``teacher``, only with it.
        distillation_beta: the divergence's beta (0: forward KL, 1: reverse KL, between: the generalized JSD;
            TRL's DistillationConfig.beta); None: 1.0. Only with ``teacher``.
        **option_keywords: the loss options by name, TRL's ``GRPOConfig`` keywords (LossOptionKeywords): they
            apply on top of ``options``.

    Returns:
        loss: the differentiable float32 scalar loss.
        metrics: detached float32 scalars under TRL's names, with the per-token ``logprobs`` and ``entropies``
            [B, T] as attributes ([metrics](../options.md#metrics)).

    Raises:
        TypeError: as ``logprobs_and_entropy`` for the arguments both take, ``options`` not a LossOptions, an
            unknown option keyword,
            ``teacher`` not a Teacher, or a teacher's tensors of mismatched dtypes.
        ValueError: as ``logprobs_and_entropy`` for the arguments both take; a bad option; or inputs the options
            do not take: beta != 0 without ref_logprobs, ``sampling_logprobs`` without
            ``off_policy_mask_threshold``, ``entropy_threshold`` without ``top_entropy_quantile < 1``, vespo
            with importance weights that are not [B, T], ``num_items_in_batch`` < 0; ``distillation_coef`` or
            ``distillation_beta`` without a teacher, a teacher without ``distillation_coef``, a teacher whose
            shapes, vocabulary or device differ from the student's, or one with ``lora`` or ``vocab_parallel``.
    """
    options = LossOptions.resolve(options, option_keywords, "loss")
    distillation = _checked_distillation(teacher, distillation_coef, distillation_beta, lora, vocab_parallel)
    hidden, weight, bias, shard = vocab_parallel_head.resolve(hidden, weight, bias, vocab_parallel)
    checks = _ValueChecks(check_values, hidden, targets, completion_mask)
    B, T, _, _ = _check_linear(hidden, weight, targets, bias, completion_mask, checks, shard)
    lora = _checked_lora(lora, hidden, weight, shard)
    transform = LogitTransform.from_keywords(temperature, softcap, logit_scale)
    batch = _LossBatch(advantages, completion_mask, old_logprobs, ref_logprobs, sampling_logprobs, importance_weights,
                       num_items_in_batch, entropy_threshold)  # fmt: skip
    _check_batch(batch, (B, T), hidden.device, "hidden", options, checks)
    backend = _resolve_backend(backend, hidden.device)
    backend.check_sizes(B * T, weight.shape[0])
    head_path = _layer1_choices(head_path, backward_mode, backend)
    if distillation is not None:
        _check_teacher(teacher, hidden, weight, shard)
        rows = _scored_rows(completion_mask, checks)
        logp, entropy, div = _with_teacher(
            hidden, weight, targets, bias, teacher, rows, transform, distillation[1], backend
        )
        prepared = _prepared(batch, options, hidden.device)
        total, metrics = _token_loss(logp, entropy, prepared, options, backend)
        return _add_distillation(total, metrics, div, distillation[0], prepared, options)
    # the entropy trains only through the entropy bonus: without one, a frozen head takes the two-sweep path
    logp, entropy = _logprobs_and_entropy(
        hidden,
        weight,
        targets,
        bias,
        _scored_rows(completion_mask, checks),
        transform,
        backend,
        head_path if options.entropy_coef == 0.0 else "general",
        backward_mode,
        shard,
        lora,
    )
    return _token_loss(logp, entropy, _prepared(batch, options, hidden.device), options, backend)


def _checked_distillation(teacher, coef, distillation_beta, lora, vocab_parallel):
    """(coef, beta) of a call with a teacher, checked, or None without one (then neither may be given)."""
    if teacher is None:
        for name, value in (("distillation_coef", coef), ("distillation_beta", distillation_beta)):
            if value is not None:
                raise ValueError(
                    f"{name} is given but teacher is None: pass teacher=grpo_fast.Teacher(hidden, "
                    "weight, ...) for the divergence it weighs"
                )
        return None
    if not isinstance(teacher, Teacher):
        raise TypeError(
            f"teacher must be a grpo_fast.Teacher(hidden, weight, bias, softcap, logit_scale), got "
            f"{type(teacher).__name__}"
        )
    if coef is None:
        raise ValueError("teacher needs distillation_coef: the weight of the per-token divergence in the loss")
    _number("distillation_coef", coef)
    distillation_beta = 1.0 if distillation_beta is None else distillation_beta
    _number(
        "distillation_beta",
        distillation_beta,
        lambda v: 0.0 <= v <= 1.0,
        "a number in [0, 1] (0: forward KL(teacher || student), 1: reverse KL(student || teacher))",
    )
    if lora is not None:
        raise ValueError(
            "lora with a teacher is not supported: the combined head has no LoRA operand (call "
            "grpo_fast.loss and grpo_fast.divergence separately)"
        )
    if vocab_parallel is not None:
        raise ValueError(
            "vocab_parallel with a teacher is not supported: the combined head runs on one process "
            "(call grpo_fast.loss and grpo_fast.divergence separately)"
        )
    return float(coef), float(distillation_beta)


def check_head(names, hidden, weight, bias, sharded=False):
    """One model's hidden [B, T, D], weight [V, D] (hidden's dtype; a vocab-parallel shard may hold no row) and bias
    [V] | None, named ``names`` (hidden's, weight's, bias's) in the errors; returns (B, T, D, V). The divergence
    head's checks of both models, and ``loss``'s of a teacher."""
    hidden_name, weight_name, bias_name = names
    _float_tensor(hidden_name, hidden)
    if hidden.dim() != 3 or 0 in hidden.shape:
        raise ValueError(f"{hidden_name} must have shape [B, T, D] with B, T, D > 0, got {tuple(hidden.shape)}")
    D = hidden.shape[2]
    _float_tensor(weight_name, weight)
    if weight.dim() != 2 or weight.shape[1] != D or (weight.shape[0] == 0 and not sharded):
        raise ValueError(
            f"{weight_name} must have shape [V, D] with D = {D} ({hidden_name}'s) and V > 0, got {tuple(weight.shape)}"
        )
    if weight.dtype != hidden.dtype:
        raise TypeError(
            f"{weight_name} dtype {weight.dtype} differs from {hidden_name} dtype {hidden.dtype}: cast one of them"
        )
    if bias is not None:
        _float_tensor(bias_name, bias)
        if tuple(bias.shape) != (weight.shape[0],):
            raise ValueError(f"{bias_name} must have shape [V] = [{weight.shape[0]}], got {tuple(bias.shape)}")
    return (*hidden.shape, weight.shape[0])


def _check_teacher(teacher, hidden, weight, shard):
    """The teacher's tensors and numbers against the student's ``hidden`` [B, T, Ds] and ``weight`` [V, Ds], on a
    head (``shard``: vocab-parallel) the combined head supports."""
    if shard is not None:
        raise ValueError(
            "a vocab-parallel head (a sharded DTensor weight) with a teacher is not supported: the "
            "combined head runs on one process (call grpo_fast.loss and grpo_fast.divergence separately)"
        )
    B, T, _ = hidden.shape
    Bt, Tt, _, Vt = check_head(
        ("teacher.hidden", "teacher.weight", "teacher.bias"), teacher.hidden, teacher.weight, teacher.bias
    )
    if (Bt, Tt) != (B, T):
        raise ValueError(
            f"teacher.hidden must have shape [B, T, Dt] with [B, T] = {[B, T]} (hidden's), got "
            f"{tuple(teacher.hidden.shape)}"
        )
    if Vt != weight.shape[0]:
        raise ValueError(
            f"weight has V = {weight.shape[0]} rows but teacher.weight has V = {Vt}: the vocabularies must match"
        )
    _same_device(
        [("teacher.hidden", teacher.hidden), ("teacher.weight", teacher.weight), ("teacher.bias", teacher.bias)],
        hidden.device,
        "hidden",
    )
    if teacher.softcap is not None:
        _number("teacher.softcap", teacher.softcap, lambda v: v > 0, "None or a positive number (Gemma 2: 30.0)")
    _number("teacher.logit_scale", teacher.logit_scale, lambda v: v != 0, "a finite non-zero number")


def _with_teacher(hidden, weight, targets, bias, teacher, rows, transform, distillation_beta, backend):
    """Layer 1 with the teacher's divergence (grpo_fast.teacher_head): (logp, entropy, divergence) [B, T] fp32."""
    B, T = targets.shape
    h, w, y, b = _flat_inputs(hidden, weight, targets, bias, rows)
    ht = _row_values(teacher.hidden.reshape(-1, teacher.hidden.shape[-1]), rows)
    wt, bt = teacher.weight, teacher.bias
    teacher_transform = LogitTransform.from_floats(transform.temperature, teacher.softcap, teacher.logit_scale)
    out = teacher_head.logprobs_entropy_divergence(
        h,
        w,
        y,
        b,
        ht.contiguous(),
        wt.contiguous(),
        bt.contiguous() if bt is not None else None,
        distillation_beta,
        transform,
        teacher_transform,
        backend.name,
    )
    return tuple(_scatter_rows(x, rows, (B, T)) for x in out)


def _add_distillation(total, metrics, div, coef, prepared, options):
    """GRPO's loss and metrics plus the distillation term: loss + coef * aggregate(divergence) (the per-token loss
    gains coef * divergence before the loss type's reduction), metrics["distillation_loss"] the mean divergence over
    the scored tokens (TRL's SDPO trainer logs that mean under this name); ``prepared``: the batch as layer 2 took it
    (``_prepared``)."""
    mask = prepared.completion_mask.bool()
    total = total + coef * options.aggregate(div, prepared.completion_mask, prepared.num_items_in_batch)
    with torch.no_grad():
        metrics["distillation_loss"] = torch.where(mask, div, 0.0).sum() / mask.sum().clamp(min=1).float()
    return total, metrics


def token_loss(
    logprobs: torch.Tensor,
    advantages: torch.Tensor,
    completion_mask: torch.Tensor,
    *,
    entropy: torch.Tensor | None = None,
    old_logprobs: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
    sampling_logprobs: torch.Tensor | None = None,
    importance_weights: torch.Tensor | None = None,
    num_items_in_batch: float | torch.Tensor | None = None,
    entropy_threshold: float | torch.Tensor | None = None,
    options: LossOptions | None = None,
    backend: str = "auto",
    check_values: bool = True,
    **option_keywords: Unpack[LossOptionKeywords],
) -> tuple[torch.Tensor, Metrics]:
    """Layer 2 alone: the GRPO loss and metrics from per-token log-probs that carry the gradient.

    For callers that already have the policy's log-probs; the per-batch inputs are ``loss``'s. The loss options,
    by name or as one object, are ``loss``'s: [LossOptions][grpo_fast.LossOptions] documents each
    ([loss options](../options.md)).

    Args:
        logprobs: [B, T] float: the policy's log-probs of the sampled tokens; the loss's gradient flows to them.
        advantages: the advantages, per sequence [B] or per token [B, T].
        completion_mask: the completion tokens [B, T], bool or 0/1.
        entropy: [B, T] float per-token entropies for the entropy metric, the top-entropy mask and the entropy
            bonus (which trains through it when it carries a gradient); required by the last two.
        old_logprobs: the old policy's [B, T] log-probs, or None (on-policy).
        ref_logprobs: the reference model's [B, T] log-probs (for beta != 0), or None.
        sampling_logprobs: the sampler's [B, T] log-probs (the off-policy mask's), or None.
        importance_weights: the sampler correction, [B, T], [B, 1] or [B]; or None.
        num_items_in_batch: dapo / cispo / vespo's normaliser; None: the mask's sum.
        entropy_threshold: the top-entropy quantile's value, precomputed; or None.
        options: the loss options as one LossOptions, under the option keywords; None: TRL's defaults.
        backend: "auto", "triton" (the token kernel) or "torch" (the spec's layer 2 with autograd).
        check_values: read the mask's 0/1 check and num_items_in_batch >= 0 in one host synchronisation; False
            reads nothing on the host.
        **option_keywords: the loss options by name, as ``loss``'s.

    Returns:
        loss: the differentiable float32 scalar loss.
        metrics: as ``loss``'s.

    Raises:
        TypeError: a tensor argument that is not a tensor (float where a float is expected), ``options`` not a
            LossOptions, an unknown option keyword, or ``check_values`` not a bool.
        ValueError: a shape that does not match, tensors on different devices, a bad option, an unknown
            ``backend``, a mask value other than 0/1 (with ``check_values``), ``top_entropy_quantile < 1`` or
            ``entropy_coef != 0`` without ``entropy``, or inputs the options do not take (as ``loss``).
    """
    options = LossOptions.resolve(options, option_keywords, "token_loss")
    _float_tensor("logprobs", logprobs)
    if logprobs.dim() != 2 or logprobs.numel() == 0:
        raise ValueError(f"logprobs must have shape [B, T] with B, T > 0, got {tuple(logprobs.shape)}")
    B, T = logprobs.shape
    batch = _LossBatch(advantages, completion_mask, old_logprobs, ref_logprobs, sampling_logprobs, importance_weights,
                       num_items_in_batch, entropy_threshold)  # fmt: skip
    checks = _ValueChecks(check_values, logprobs, completion_mask)
    _check_batch(batch, (B, T), logprobs.device, "logprobs", options, checks)
    _check_mask(completion_mask, (B, T), checks)
    checks.read()
    if entropy is not None:
        _float_tensor("entropy", entropy)
        _shape("entropy", entropy, [(B, T)], lambda: f"[B, T] = [{B}, {T}]")
        _same_device([("entropy", entropy)], logprobs.device, "logprobs")
    elif options.entropy_mask or options.entropy_coef != 0.0:
        raise ValueError(
            "top_entropy_quantile < 1 and entropy_coef != 0 need the per-token entropy [B, T] "
            "(grpo_fast.logprobs_and_entropy gives it with its gradient)"
        )
    return _token_loss(
        logprobs,
        entropy,
        _prepared(batch, options, logprobs.device),
        options,
        _resolve_backend(backend, logprobs.device),
    )


def _check_batch(batch, shape, device, device_of, options, checks):
    """Checks of layer 2's per-batch inputs against each other and the options, named after the argument at fault
    (``device`` is the argument ``device_of``'s; value checks to ``checks``); the mask itself is checked by the caller
    (once: it costs a pass over it)."""
    B, T = shape
    _tensor("advantages", batch.advantages)
    _tensor("completion_mask", batch.completion_mask)
    _same_device(
        [("advantages", batch.advantages), ("completion_mask", batch.completion_mask)]
        + [(name, getattr(batch, name)) for name in _LOGPROB_INPUTS + ("importance_weights",)],
        device,
        device_of,
    )
    if options.beta != 0.0 and batch.ref_logprobs is None:
        raise ValueError(
            "beta != 0 needs ref_logprobs [B, T] (the reference model's log-probs, e.g. from grpo_fast.logprobs)"
        )
    if batch.entropy_threshold is not None:
        _number("entropy_threshold", batch.entropy_threshold)
        if not options.entropy_mask:
            raise ValueError(
                "entropy_threshold is only used with top_entropy_quantile < 1 (it is the quantile's "
                "value over every process's masked entropies)"
            )
    _float_tensor("advantages", batch.advantages)
    _shape("advantages", batch.advantages, [(B,), (B, T)], lambda: f"[B] = [{B}] or [B, T] = [{B}, {T}]")
    for name in _LOGPROB_INPUTS:
        x = getattr(batch, name)
        if x is not None:
            _float_tensor(name, x)
            _shape(name, x, [shape], lambda: f"[B, T] = [{B}, {T}]")
    if batch.sampling_logprobs is not None and options.off_policy_mask_threshold is None:
        raise ValueError(
            "sampling_logprobs is only used by the off-policy mask: set off_policy_mask_threshold "
            "(for the sampler's importance weights, pass grpo_fast.sampling_importance_weights(...) "
            "as importance_weights)"
        )
    iw = batch.importance_weights
    if iw is not None:
        _float_tensor("importance_weights", iw)
        _shape("importance_weights", iw, [(B,), (B, 1), (B, T)], lambda: f"[B] = [{B}], [B, 1] or [B, T] = [{B}, {T}]")
        if options.loss_type_record.policy_term.importance_weights_in_term and iw.shape != (B, T):
            raise ValueError(
                f"loss_type={options.loss_type!r} takes per-token importance_weights [B, T] (TRL's "
                f"token_truncate or token_mask modes), got shape {tuple(iw.shape)}: TRL rejects VESPO "
                "with sequence-level importance sampling"
            )
    n_items = batch.num_items_in_batch
    if n_items is None:
        return
    if not isinstance(n_items, torch.Tensor):
        _number("num_items_in_batch", n_items, lambda v: v >= 0, "a number >= 0")
    elif n_items.numel() != 1:
        raise ValueError(
            f"num_items_in_batch must be a number or a one-element tensor, got shape {tuple(n_items.shape)}"
        )
    elif checks.run:
        # the count as the check's second value, in micro-units: the message shows it to 1e-6
        checks.add(
            [n_items.reshape(()) < 0, (n_items.reshape(()).double() * 1e6).round()],
            lambda _, micro: ValueError(f"num_items_in_batch must be >= 0, got {micro / 1e6}"),
        )


_LOGPROB_INPUTS = ("old_logprobs", "ref_logprobs", "sampling_logprobs")


def _prepared(batch, options, device):
    """The batch as layer 2 computes on it: detached fp32 contiguous tensors, [B, 1] weights as [B], no reference
    log-probs without a KL term, num_items_in_batch and entropy_threshold fp32 scalar tensors on ``device`` (a
    number is written there, not read back)."""

    def fp32(x):
        return x.detach().float().contiguous() if x is not None else None

    iw = fp32(batch.importance_weights)
    if iw is not None and iw.dim() == 2 and iw.shape[1] == 1 and batch.completion_mask.shape[1] != 1:
        iw = iw.squeeze(1)  # [B, 1]: one weight per sequence

    def scalar(x):
        if x is None:
            return None
        if isinstance(x, torch.Tensor):
            return x.detach().reshape(()).to(device=device, dtype=torch.float32)
        return torch.full((), float(x), dtype=torch.float32, device=device)

    return _LossBatch(
        fp32(batch.advantages),
        batch.completion_mask.to(torch.float32).contiguous(),
        fp32(batch.old_logprobs),
        fp32(batch.ref_logprobs) if options.beta != 0.0 else None,
        fp32(batch.sampling_logprobs),
        iw,
        scalar(batch.num_items_in_batch),
        scalar(batch.entropy_threshold),
    )


def _token_loss(logprobs, entropy, batch, options, backend):
    """Layer 2 on checked inputs: the token-loss op (grpo_fast.ops.token_loss) by ``backend``'s token loss (the
    token kernel, or its torch twin grpo_fast/token_loss_torch.py); the metrics a Metrics dict of fp32 device
    scalars. ``batch``: the per-batch inputs as ``_prepared`` gives them."""
    logp = logprobs.float()
    entropy = entropy.float() if entropy is not None else None
    total, metric_values, _, _ = ops.token_loss(
        logp,
        entropy,
        batch.advantages,
        batch.completion_mask,
        batch.old_logprobs,
        batch.ref_logprobs,
        batch.sampling_logprobs,
        batch.importance_weights,
        batch.num_items_in_batch,
        batch.entropy_threshold,
        ops.options_json(options),
        backend.name,
    )
    metrics = Metrics(zip(metric_names(options, entropy is not None), metric_values.detach().unbind(0)))
    metrics.logprobs = logp.detach()
    metrics.entropies = entropy.detach() if entropy is not None else None
    return total, metrics


def sampling_importance_weights(
    old_logprobs: torch.Tensor,
    sampling_logprobs: torch.Tensor,
    completion_mask: torch.Tensor,
    mode: str = "sequence_mask",
    clip_max: float | None = 3.0,
    clip_min: float | None = None,
) -> torch.Tensor:
    """TRL 1.16's importance weights for a sampler (vLLM) that is not the trained policy.

    The result is ``importance_weights`` for ``loss`` and ``token_loss``. Defaults are TRL's
    (``vllm_importance_sampling_clip_max=3.0``, ``vllm_importance_sampling_clip_min=None``).

    Args:
        old_logprobs: [B, T] float: the training policy's log-probs before the update.
        sampling_logprobs: [B, T] float: the sampler's log-probs; NaN where it could not score a token (no
            correction there).
        completion_mask: [B, T] bool or 0/1.
        mode: TRL's ``vllm_importance_sampling_mode``: "token_truncate", "token_mask", "sequence_truncate" or
            "sequence_mask". ``token_*`` give per-token ratios, ``sequence_*`` ratios of the summed log-ratio;
            ``*_truncate`` clamps them to [clip_min, clip_max], ``*_mask`` zeroes those outside it.
        clip_max: the upper bound, or None.
        clip_min: the lower bound, or None.

    Returns:
        float32 weights, detached: [B, T] for the ``token_*`` modes, [B, 1] for the ``sequence_*`` modes.

    Raises:
        TypeError: a non-tensor, or log-probs that are not float.
        ValueError: an unknown ``mode``, a shape that does not match, tensors on different devices, a mask value
            other than 0/1, a non-finite bound, ``clip_min >= clip_max``, or a ``*_truncate`` mode without a bound.
    """
    if mode not in IMPORTANCE_SAMPLING_MODES:
        raise ValueError(f"mode must be one of {IMPORTANCE_SAMPLING_MODES}, got {mode!r}")
    for name, x in (("old_logprobs", old_logprobs), ("sampling_logprobs", sampling_logprobs)):
        _float_tensor(name, x)
        if x.dim() != 2:
            raise ValueError(f"{name} must have shape [B, T], got {tuple(x.shape)}")
    _shape(
        "sampling_logprobs",
        sampling_logprobs,
        [old_logprobs.shape],
        lambda: f"old_logprobs' {list(old_logprobs.shape)}",
    )
    _tensor("completion_mask", completion_mask)
    _same_device(
        [("sampling_logprobs", sampling_logprobs), ("completion_mask", completion_mask)],
        old_logprobs.device,
        "old_logprobs",
    )
    checks = _ValueChecks(True, old_logprobs, completion_mask)
    _check_mask(completion_mask, tuple(old_logprobs.shape), checks)
    checks.read()
    for name, x in (("clip_max", clip_max), ("clip_min", clip_min)):
        if x is not None:
            _number(name, x)
    if clip_min is not None and clip_max is not None and clip_min >= clip_max:
        raise ValueError(f"clip_min ({clip_min}) must be less than clip_max ({clip_max})")
    if mode.endswith("truncate") and clip_min is None and clip_max is None:
        raise ValueError(f"mode={mode!r} needs clip_min or clip_max")
    return reference.sampling_importance_weights(
        old_logprobs.detach(), sampling_logprobs.detach(), completion_mask, mode, clip_max, clip_min
    )
