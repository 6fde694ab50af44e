"""What the framework integrations (grpo_fast.trl, grpo_fast.verl) share: the framework imported at a tested version,
the Hugging Face glue (the logit transform a transformers config declares, the head's compute dtype under autocast
and the casts to it), an lm_head that FSDP2 shards as a unit of its own, gathered for the call, and the PEFT LoRA
adapter on an lm_head (``lm_head_lora``), which the head applies exactly.

Imports neither TRL nor verl: the two cannot share an environment (verl breaks when TRL 1.16 is importable); PEFT is
imported only when a model already did (it may be absent).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import sys
import types

import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from grpo_fast.head.lora import HeadLora


def import_pinned(name: str, low: str, end: str):
    """``import name``, or an ImportError that says the extra to install: when it is missing, and when its version is
    outside [low, end), the range the tests run."""
    from packaging.version import Version

    hint = f'grpo_fast.{name} needs {name}>={low},<{end} (pip install "grpo_fast[{name}]")'
    try:
        module = importlib.import_module(name)
    except ImportError as e:
        raise ImportError(f"{hint}; {name} is not installed") from e
    if not Version(low) <= Version(module.__version__) < Version(end):
        raise ImportError(f"{hint}; found {name} {module.__version__}")
    return module


def logit_scale_of(text_config) -> float:
    """The factor TRL 1.16's fused head multiplies the logits by, read from the config in TRL's order.

    Args:
        text_config: a transformers text config: ``logit_scale``, ``output_multiplier``, ``lm_head_multiplier``,
            then ``logits_scaling`` (Granite and MiniCPM3 divide by it, HyperCLOVA X multiplies) are read.

    Returns:
        The factor; 1.0 when the config has none.
    """
    # None on models that do not scale (MPT): unscaled. Muse Glimmer's `output_multiplier` is the same factor.
    scale = getattr(text_config, "logit_scale", None)
    if scale is None:
        scale = getattr(text_config, "output_multiplier", None)
    if scale is None:
        scale = getattr(text_config, "lm_head_multiplier", None)  # Falcon-H1
    if scale is None and getattr(text_config, "logits_scaling", None) is not None:
        # Granite and MiniCPM3 divide the logits by `logits_scaling`; HyperCLOVA X multiplies them by it
        scaling = text_config.logits_scaling
        scale = scaling if text_config.model_type == "hyperclovax" else 1 / scaling
    return 1.0 if scale is None else scale


def logit_transform_of(text_config) -> dict:
    """grpo_fast's transform keywords (``softcap``, ``logit_scale``) for a model, read from its text config as TRL 1.16
    reads them: ``final_logit_softcapping`` and ``logit_scale_of``."""
    return {
        "softcap": getattr(text_config, "final_logit_softcapping", None),
        "logit_scale": logit_scale_of(text_config),
    }


@dataclasses.dataclass(frozen=True)
class HeadPrecision:
    """Where a Hugging Face model's head computes. ``dtype``: hidden states, weight and bias are cast to it (grpo_fast
    needs them in one dtype; a differentiable ``.to``, free when they already match) and grpo_fast accumulates in fp32
    with autocast off. ``adapter_dtype``: a LoRA adapter's weights' (None: their own, as PEFT computes its branch in
    lora_A's dtype)."""

    dtype: torch.dtype
    adapter_dtype: torch.dtype | None

    def cast(self, tensor):
        return None if tensor is None else tensor.to(self.dtype)


def head_precision(hidden, cast_lm_head_to_fp32: bool = False) -> HeadPrecision:
    """The head's precision as TRL 1.16's heads and verl's backends choose it: fp32 with ``cast_lm_head_to_fp32``
    (autocast ignored), else the autocast dtype while autocast is on for ``hidden``'s device, else ``hidden``'s dtype.
    The adapter follows the compute dtype where the fp32 cast or autocast sets one."""
    device_type = hidden.device.type
    autocast = torch.is_autocast_enabled(device_type)
    if cast_lm_head_to_fp32:
        dtype = torch.float32
    elif autocast:
        dtype = torch.get_autocast_dtype(device_type)
    else:
        dtype = hidden.dtype
    return HeadPrecision(dtype, dtype if cast_lm_head_to_fp32 or autocast else None)


def autocast_off(tensor):
    """A context with autocast off on ``tensor``'s device: grpo_fast computes in its own precision."""
    return torch.autocast(tensor.device.type, enabled=False)


@contextlib.contextmanager
def fsdp_unit_gathered(lm_head):
    """Within: ``(weight, bias)`` of ``lm_head``; an lm_head that is an FSDP2 unit of its own is gathered first.

    Such a head is never called, so FSDP's hooks would neither gather it nor reduce its gradient: it is gathered
    through FSDP (``unshard()``), whose post-backward reduce-scatters the gradient and reshards (a PEFT LoRA layer's
    adapter weights with it: ``lm_head_lora`` reads them within). Without grad no backward will come: it is resharded
    as soon as the block exits. Any other weight is yielded as it is (a DTensor of tensor parallelism included: the
    caller decides). A PEFT LoRA layer's ``weight`` and ``bias`` are its base layer's (PEFT forwards them).
    """
    reshard = False
    if isinstance(lm_head, FSDPModule) and isinstance(lm_head.weight, DTensor):
        lm_head.unshard()
        reshard = not torch.is_grad_enabled()
    try:
        yield lm_head.weight, getattr(lm_head, "bias", None)
    finally:
        if reshard:
            lm_head.reshard()


def _already_whole(*tensors):
    return contextlib.nullcontext()


@contextlib.contextmanager
def lm_head_lora(lm_head, dtype=None, gathered=_already_whole):
    """Within: the ``grpo_fast.HeadLora`` that makes the head ``lm_head`` (``get_output_embeddings()``) exact, or None
    when its ``weight`` and ``bias`` alone are.

    A PEFT ``lora.Linear`` with an active, unmerged adapter: PEFT's forward is ``base_layer(x) + lora_B(lora_A(
    dropout(x))) * scaling``, so the head gets lora_A / lora_B's weights (in ``dtype`` when given, by a
    differentiable cast; else in their own dtype, as PEFT computes the branch), ``scaling`` and the dropout module,
    read at each call (``set_adapter``, ``disable_adapter()`` and ``merge_adapter()`` change them). None: not a PEFT
    layer (``modules_to_save``'s wrapper and ``trainable_token_indices``' forward their trained weight), adapters
    disabled (TRL's reference pass under ``disable_adapter()``) or merged into the base weight, or no active adapter
    on this layer. What the head cannot compute exactly raises ``NotImplementedError`` naming it.
    ``gathered(a, b)``: a context in which the adapter's weights are whole (DeepSpeed ZeRO-3's gather), entered
    before they are read.
    """
    adapter = lm_head_lora_adapter(lm_head)
    if adapter is None:
        yield None
        return
    a, b = lm_head.lora_A[adapter].weight, lm_head.lora_B[adapter].weight
    if isinstance(a, DTensor) or isinstance(b, DTensor):
        raise NotImplementedError(
            f"{_UNSUPPORTED}: the adapter {adapter!r}'s weights are DTensors "
            f"({type(a).__name__}, {type(b).__name__}) outside an FSDP2 unit that grpo_fast "
            "gathers; that layout is untested"
        )
    with gathered(a, b):
        if dtype is not None:
            a, b = a.to(dtype), b.to(dtype)
        yield HeadLora(a, b, lm_head.scaling[adapter], lm_head.lora_dropout[adapter])


_UNSUPPORTED = "grpo_fast's fused lm_head cannot apply this PEFT lm_head exactly"


def lm_head_lora_adapter(lm_head):
    """The name of the LoRA adapter the head must apply, None when the base weight alone is exact, or a
    NotImplementedError for what the head cannot compute (see ``lm_head_lora``)."""
    if "peft" not in sys.modules:  # no PEFT layer can exist
        return None
    from peft.tuners.lora import Linear as LoraLinear
    from peft.tuners.tuners_utils import BaseTunerLayer

    if not isinstance(lm_head, BaseTunerLayer):
        return None
    kind = type(lm_head).__name__
    if not isinstance(lm_head, LoraLinear) or type(lm_head).forward is not LoraLinear.forward:
        raise NotImplementedError(
            f"{_UNSUPPORTED}: the lm_head is a {kind} ({type(lm_head).__module__}); only "
            "peft's lora.Linear over an nn.Linear is supported (use modules_to_save=['lm_head'] "
            "to train the whole head, or leave lm_head out of target_modules)"
        )
    base = lm_head.base_layer
    if not isinstance(base, torch.nn.Linear) or isinstance(base, BaseTunerLayer):
        raise NotImplementedError(f"{_UNSUPPORTED}: the LoRA layer wraps a {type(base).__name__}, not an nn.Linear")
    if lm_head.disable_adapters:
        if lm_head.merged:  # PEFT's forward would unmerge the weight first
            raise NotImplementedError(
                f"{_UNSUPPORTED}: its adapters are disabled but merged into the base weight "
                f"({lm_head.merged_adapters}); call unmerge_adapter() first"
            )
        return None
    if lm_head.merged:  # PEFT's forward: the base layer alone, which holds the merged delta
        return None
    active = [name for name in lm_head.active_adapters if name in lm_head.lora_A]
    if not active:
        return None
    if len(active) > 1:
        raise NotImplementedError(
            f"{_UNSUPPORTED}: {len(active)} active LoRA adapters on the lm_head ({active}); "
            "grpo_fast applies one (set_adapter to one, or merge the others)"
        )
    adapter = active[0]
    if lm_head.use_dora.get(adapter, False) or adapter in lm_head.lora_variant:
        variant = type(lm_head.lora_variant[adapter]).__name__ if adapter in lm_head.lora_variant else "DoRA"
        raise NotImplementedError(
            f"{_UNSUPPORTED}: the adapter {adapter!r} is a LoRA variant ({variant}: DoRA, "
            "aLoRA, ...), whose forward is not base + B A x"
        )
    if lm_head.lora_bias.get(adapter, False):
        raise NotImplementedError(f"{_UNSUPPORTED}: the adapter {adapter!r} has a LoRA bias (lora_bias=True)")
    if lm_head.fan_in_fan_out:
        raise NotImplementedError(f"{_UNSUPPORTED}: fan_in_fan_out=True (a [D, V] base weight)")
    return adapter


def with_module_names(function, release_range: str, **names):
    """``function`` (a trainer's method) as a new function with the same code, defaults and closure, whose global
    ``names`` resolve to the values given and every other global name to its module's value at this call. The
    library's module is left as it is: other callers (its own trainers, other threads) see its names. Each name must
    be one that the code (or a function nested in it) reads, so a release that moves the call fails here, loudly
    (``release_range``: the versions the tests run, for the message)."""
    read = set(function.__code__.co_names)
    for const in function.__code__.co_consts:
        if isinstance(const, types.CodeType):
            read |= set(const.co_names)
    unread = sorted(set(names) - read)
    if unread:
        raise RuntimeError(
            f"grpo_fast: {function.__qualname__} ({function.__module__}) no longer reads {unread}; "
            f"this release is outside {release_range}"
        )
    rebound = types.FunctionType(
        function.__code__,
        {**function.__globals__, **names},
        function.__name__,
        function.__defaults__,
        function.__closure__,
    )
    rebound.__kwdefaults__ = function.__kwdefaults__
    return functools.update_wrapper(rebound, function)
