"""grpo_fast as verl's fused LM head: ``impl_backend=grpo_fast``, no fork of verl.

    pip install "grpo_fast[verl]"
    actor_rollout_ref.model.use_fused_kernels=True
    actor_rollout_ref.model.fused_kernel_options.impl_backend=grpo_fast

verl imports this module at ``import verl`` (an entry point of the group ``verl.plugins``); importing it wraps
verl's ``patch_forward_with_backends`` and ``EngineRegistry.new`` so that ``impl_backend=grpo_fast`` runs
``forward``, below, and an engine that would not is refused. What it does and how: docs/verl.md#how-it-works.

verl versions: ``VERL_VERSIONS`` (the range the tests run); another version raises ``ImportError``. A failure to
load is logged as an error before it is raised: verl itself logs a failing plugin at debug level only.
"""

from __future__ import annotations

import contextlib
import functools
import logging

from grpo_fast.integrations.hf import (
    autocast_off,
    fsdp_unit_gathered,
    head_precision,
    import_pinned,
    lm_head_lora,
    logit_scale_of,
    logit_transform_of,
)

_VERL_LOW, _VERL_END = "0.9.1", "0.10"
VERL_VERSIONS = f">={_VERL_LOW},<{_VERL_END}"
BACKEND = "grpo_fast"
# the engines (verl's `strategy`) whose model build calls apply_monkey_patch, the path tested here
SUPPORTED_STRATEGIES = ("fsdp", "fsdp2")
SUPPORTED_PATH = (
    "verl's FSDP engine (actor_rollout_ref.actor.strategy=fsdp or fsdp2) with a text-only causal LM "
    "(verl's dense_common forward) and ulysses_sequence_parallel_size=1"
)

_log = logging.getLogger(__name__)


@contextlib.contextmanager
def _loud(what):
    """verl swallows a plugin's exception (a debug log line): say it as an error, then raise it."""
    try:
        yield
    except Exception:
        _log.error(
            "grpo_fast's verl backend failed to %s; impl_backend=%s is unavailable", what, BACKEND, exc_info=True
        )
        raise


with _loud("import"):
    # during `import verl` (this module is its plugin) __version__ is already set: verl sets it before plugins load
    verl = import_pinned("verl", _VERL_LOW, _VERL_END)

    import torch
    from torch.distributed.tensor import DTensor
    from verl.models.transformers import monkey_patch as _monkey_patch
    from verl.models.transformers.dense_common import CausalLMOutputForPPO, forward_base_model
    from verl.workers.engine.base import EngineRegistry

    import grpo_fast

__all__ = ["forward", "BACKEND", "VERL_VERSIONS", "SUPPORTED_STRATEGIES", "check_model", "logit_scale_of"]


# ---------------------------------------------------------------------------------------------- the model
def _check_text_only(config) -> None:
    """Raise for a vision-language config (a text sub-config or a vision one): verl has other forwards for them."""
    if config.get_text_config() is not config or getattr(config, "vision_config", None) is not None:
        raise NotImplementedError(
            f"impl_backend={BACKEND}: model_type {config.model_type!r} is a vision-language model, which verl runs "
            f"through forwards of its own; grpo_fast supports {SUPPORTED_PATH}. Use impl_backend=torch or triton "
            "for this model, or use_fused_kernels=False."
        )


def check_model(model) -> None:
    """Check that ``model`` is what ``forward`` serves: a text-only causal LM with an output embedding.

    Args:
        model: a transformers model.

    Raises:
        NotImplementedError: a vision-language model, or a model without an lm_head
            (``get_output_embeddings()``) over a ``model`` backbone.
    """
    _check_text_only(model.config)
    if model.get_output_embeddings() is None or not hasattr(model, "model"):
        raise NotImplementedError(
            f"impl_backend={BACKEND}: {type(model).__name__} has no lm_head (get_output_embeddings()) over a "
            f"`model` backbone; grpo_fast supports {SUPPORTED_PATH}."
        )


def forward(
    self,
    input_ids=None,
    attention_mask=None,
    position_ids=None,
    past_key_values=None,
    inputs_embeds=None,
    labels=None,
    use_cache=None,
    output_attentions=None,
    output_hidden_states=None,
    return_dict=None,
    cache_position=None,
    logits_to_keep=0,
    temperature=1.0,
    shift_labels=None,
    **loss_kwargs,
):
    """verl's fused-kernel forward (``dense_common``'s contract) with grpo_fast's head, set as the model's forward.

    The backbone runs as verl runs it; every position is scored except, in the padded [B, T] layout, those whose
    attention mask is 0 (their outputs are zeros). docs/verl.md#how-it-works says how.

    Args:
        input_ids: [B, T] or [1, nnz] token ids; rolled by one as the targets when neither ``shift_labels`` nor
            ``labels`` is given.
        attention_mask: [B, T] (padded layout: positions at 0 are padding, not computed), or None.
        position_ids: passed to the backbone.
        past_key_values: passed to the backbone.
        inputs_embeds: passed to the backbone.
        labels: token ids rolled by one as the targets when ``shift_labels`` is None.
        use_cache: passed to the backbone.
        output_attentions: passed to the backbone.
        output_hidden_states: passed to the backbone.
        return_dict: must be true (verl's FSDP engine passes True).
        cache_position: passed to the backbone.
        logits_to_keep: verl's keyword, not read: no logits are built.
        temperature: divides the logits.
        shift_labels: the targets, already rolled (remove-padding: [1, nnz], the engine's globally rolled ids).
        **loss_kwargs: verl's further keywords, not read.

    Returns:
        verl's ``CausalLMOutputForPPO``: ``log_probs`` and ``entropy`` [B, T] (or [1, nnz]) float32, both
            differentiable, and the backbone's ``past_key_values``, ``hidden_states`` and ``attentions``.

    Raises:
        NotImplementedError: ``return_dict`` false, or an lm_head weight that is a DTensor outside FSDP2.
        ValueError: none of ``shift_labels``, ``labels`` and ``input_ids``.
    """
    if not return_dict:
        raise NotImplementedError(
            f"impl_backend={BACKEND}: the forward returns a CausalLMOutputForPPO; pass "
            "return_dict=True (verl's FSDP engine does)"
        )
    outputs = forward_base_model(
        self,
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        past_key_values=past_key_values,
        inputs_embeds=inputs_embeds,
        use_cache=use_cache,
        output_attentions=output_attentions,
        output_hidden_states=output_hidden_states,
        return_dict=return_dict,
        cache_position=cache_position,
    )
    hidden = outputs[0]
    # verl's labels: the engine's pre-rolled ids (remove-padding; rolled over the whole packed sequence), else the
    # ids rolled by one, as verl's own backends roll them
    if shift_labels is not None:
        targets = shift_labels
    elif labels is not None:
        targets = torch.roll(labels, shifts=-1, dims=-1)
    elif input_ids is not None:
        targets = torch.roll(input_ids, shifts=-1, dims=-1)
    else:
        raise ValueError(f"impl_backend={BACKEND}: the forward needs shift_labels, labels or input_ids")
    # padded [B, T] layout: positions outside the attention mask are padding that verl drops
    mask = None
    if attention_mask is not None and attention_mask.shape == targets.shape:
        mask = attention_mask.bool()

    lm_head = self.get_output_embeddings()
    with _head_parameters(lm_head) as (weight, bias):
        precision = head_precision(hidden)
        if mask is not None:
            mask = mask.to(weight.device)
        with autocast_off(hidden), lm_head_lora(lm_head, precision.adapter_dtype) as lora:
            log_probs, entropy = grpo_fast.logprobs_and_entropy(
                precision.cast(hidden.to(weight.device)),
                precision.cast(weight),
                targets.to(weight.device).long(),
                bias=precision.cast(bias),
                temperature=temperature,
                **logit_transform_of(self.config.get_text_config()),
                completion_mask=mask,
                lora=lora,
            )
    return CausalLMOutputForPPO(
        log_probs=log_probs,
        entropy=entropy,
        past_key_values=outputs.past_key_values,
        hidden_states=outputs.hidden_states,
        attentions=outputs.attentions,
    )


@contextlib.contextmanager
def _head_parameters(lm_head):
    """The head's weight and bias as whole tensors (see the module docstring on sharded heads)."""
    with fsdp_unit_gathered(lm_head) as (weight, bias):
        if isinstance(weight, DTensor):
            raise NotImplementedError(
                f"impl_backend={BACKEND}: the lm_head's weight is a DTensor outside FSDP2 ({weight.placements}; "
                f"tensor parallelism?), which is untested; grpo_fast supports {SUPPORTED_PATH}."
            )
        yield weight, bias


# ---------------------------------------------------------------------------------------------- verl's hooks
def _patch_forward_with_backends(verl_function):
    """verl's ``patch_forward_with_backends`` that also accepts ``grpo_fast``."""

    @functools.wraps(verl_function)
    def patch_forward_with_backends(model, use_fused_kernels=False, fused_kernels_backend=None):
        if not (use_fused_kernels and fused_kernels_backend == BACKEND):
            return verl_function(
                model, use_fused_kernels=use_fused_kernels, fused_kernels_backend=fused_kernels_backend
            )
        check_model(model)
        # verl patches the class, as for its own backends; the attribute is what verl's forwards read
        model._verl_fused_kernels_backend = BACKEND
        model.__class__.forward = forward
        print(f"Using grpo_fast backend for fused kernels in {model.__class__.__name__}")

    patch_forward_with_backends.grpo_fast_wraps = verl_function
    return patch_forward_with_backends


def _engine_new(verl_new):
    """verl's ``EngineRegistry.new`` that refuses an engine which would not run grpo_fast's forward."""

    @functools.wraps(verl_new)
    def new(cls, model_type, backend, *args, **kwargs):
        model_config, engine_config = kwargs.get("model_config"), kwargs.get("engine_config")
        options = getattr(model_config, "fused_kernel_options", None) or {}
        if getattr(model_config, "use_fused_kernels", False) and options.get("impl_backend") == BACKEND:
            if backend not in SUPPORTED_STRATEGIES:
                raise NotImplementedError(
                    f"impl_backend={BACKEND} with the {backend!r} engine: that engine does not call verl's "
                    f"apply_monkey_patch, so grpo_fast's head would not run; grpo_fast supports {SUPPORTED_PATH}."
                )
            sp_size = getattr(engine_config, "ulysses_sequence_parallel_size", 1) or 1
            if sp_size > 1:
                raise NotImplementedError(
                    f"impl_backend={BACKEND} with ulysses_sequence_parallel_size={sp_size}: sequence parallelism "
                    f"is untested with grpo_fast; grpo_fast supports {SUPPORTED_PATH}."
                )
            if getattr(model_config, "hf_config", None) is not None:
                _check_text_only(model_config.hf_config)
        return verl_new.__func__(cls, model_type, backend, *args, **kwargs)

    new.grpo_fast_wraps = verl_new
    return classmethod(new)


def _install():
    """Wrap verl's two functions once (importing this module twice, or reloading it, wraps nothing twice)."""
    current = _monkey_patch.patch_forward_with_backends
    if not hasattr(current, "grpo_fast_wraps"):
        _monkey_patch.patch_forward_with_backends = _patch_forward_with_backends(current)
    if not hasattr(EngineRegistry.new, "grpo_fast_wraps"):
        EngineRegistry.new = _engine_new(EngineRegistry.new)


with _loud("register"):
    _install()
