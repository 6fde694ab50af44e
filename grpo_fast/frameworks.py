"""What the framework integrations (grpo_fast.trl, grpo_fast.verl) share: the framework imported at a tested version,
the logit scale a transformers config declares, and an lm_head that FSDP2 shards as a unit of its own, gathered for
the call.

Imports neither TRL nor verl: the two cannot share an environment (verl breaks when TRL 1.16 is importable).
"""

from __future__ import annotations

import contextlib
import importlib

import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor


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
    """The factor TRL 1.16's fused head multiplies the logits by, read from the config in TRL's order."""
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


@contextlib.contextmanager
def fsdp_unit_gathered(lm_head):
    """Within: ``(weight, bias)`` of ``lm_head``; an lm_head that is an FSDP2 unit of its own is gathered first.

    Such a head is never called, so FSDP's hooks would neither gather it nor reduce its gradient: it is gathered
    through FSDP (``unshard()``), whose post-backward reduce-scatters the gradient and reshards. Without grad no
    backward will come: it is resharded as soon as the block exits. Any other weight is yielded as it is (a
    DTensor of tensor parallelism included: the caller decides).
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
