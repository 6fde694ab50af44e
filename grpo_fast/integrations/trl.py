"""grpo_fast inside TRL: TRL's fused LM head computed by grpo_fast, and TRL's trainers using it.

    from grpo_fast.trl import GRPOConfig, GRPOTrainer     # instead of `from trl import GRPOConfig, GRPOTrainer`

``add_fused_lm_head`` is TRL 1.16's fused-head protocol on grpo_fast's kernels; ``GRPOTrainer``, ``RLOOTrainer``
and ``DistillationTrainer`` are TRL's classes with grpo_fast's heads. How the head computes (dtypes, LoRA on the
lm_head, sharded heads) and how the trainers get it: docs/trl.md#the-head.

TRL versions: ``TRL_VERSIONS``, the range the tests run (``pip install "grpo_fast[trl]"``); importing this module
with another TRL raises ``ImportError``.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import inspect
import logging
import sys
import types

from packaging.version import Version

# TRL's version checked first (an ImportError naming the range), then TRL's names
from grpo_fast.integrations.trl_version import TRL_VERSIONS, trl

# isort: split
import torch
import transformers
from torch.distributed.tensor import DTensor
from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled
from trl import DistillationConfig, GRPOConfig, RLOOConfig
from trl.trainer.utils import FusedCausalLMOutput, maybe_gather_lm_head_ctx

import grpo_fast
from grpo_fast.head import shard as head_shard
from grpo_fast.head.lora import lora_hidden
from grpo_fast.head.transform import LogitTransform
from grpo_fast.integrations.hf import (
    autocast_off,
    fsdp_unit_gathered,
    head_precision,
    lm_head_lora,
    lm_head_lora_adapter,
    logit_transform_of,
    with_module_names,
)

__all__ = [
    "add_fused_lm_head",
    "GRPOTrainer",
    "RLOOTrainer",
    "DistillationTrainer",
    "GRPOConfig",
    "RLOOConfig",
    "DistillationConfig",
    "FusedCausalLMOutput",
    "TRL_VERSIONS",
]

_log = logging.getLogger(__name__)

# the per-token fields of FusedCausalLMOutput that a caller can request
OUTPUTS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")
# the no-grad extras' chunked torch pass: at most this many fp32 logits at a time (64 MiB)
EXTRA_OUTPUTS_CHUNK_LOGITS = 1 << 24


# ---------------------------------------------------------------------------------------------- the head
def add_fused_lm_head(
    model,
    temperature: float = 1.0,
    cast_lm_head_to_fp32: bool = False,
    outputs: tuple[str, ...] = ("log_probs",),
    *,
    entropy_grad: bool = False,
) -> None:
    """TRL's ``add_fused_lm_head``, computed by grpo_fast: patches ``model``'s forward in place.

    ``model(..., labels=labels, fused_lm_head=True)`` then returns a ``FusedCausalLMOutput`` without building the
    [tokens, vocab] logits; without ``fused_lm_head=True`` the forward is the model's own. Add the head before
    wrapping the model with PEFT. How it computes (dtypes, LoRA, sharded heads): docs/trl.md#the-head.

    Args:
        model: a transformers causal LM (a text config with an output embedding over its backbone).
        temperature: divides the logits.
        cast_lm_head_to_fp32: score in fp32 with autocast off (TRL's option).
        outputs: the per-token fields to fill, among ``OUTPUTS`` ("log_probs", "entropy", "log_sum_sq_probs",
            "mean_logits", "is_top1"); ``log_probs``, and so ``loss``, always.
        entropy_grad: grpo_fast's, not TRL's: the entropy will be differentiated (an entropy bonus); without it a
            frozen lm_head takes the frozen-head path (two vocabulary sweeps instead of three). Either way every
            gradient is exact.

    Raises:
        TypeError: ``entropy_grad`` not a bool.
        ValueError: an output name TRL's head does not know.
    """
    if not isinstance(entropy_grad, bool):
        raise TypeError(f"add_fused_lm_head: entropy_grad must be a bool, got {entropy_grad!r}")
    unknown = [name for name in outputs if name not in OUTPUTS]
    if unknown:
        raise ValueError(f"add_fused_lm_head: unknown outputs {unknown}; the fused head computes {list(OUTPUTS)}")
    original_forward = model.forward
    text_config = model.config.get_text_config()
    transform = logit_transform_of(text_config)
    # Before transformers 5, vision-language models expose their language backbone as `model`
    backbone_attr = "base_model"
    if text_config is not model.config and Version(transformers.__version__) < Version("5.0.0"):
        backbone_attr = "model"
    extras = tuple(name for name in ("log_sum_sq_probs", "mean_logits", "is_top1") if name in outputs)

    # Keep the original signature: `generate` validates its model kwargs against it
    @functools.wraps(type(model).forward)
    def fused_forward(
        self, *args, fused_lm_head=False, labels=None, shift_labels=None, num_items_in_batch=None, **kwargs
    ):
        if not fused_lm_head:
            for name, value in (
                ("labels", labels),
                ("shift_labels", shift_labels),
                ("num_items_in_batch", num_items_in_batch),
            ):
                if value is not None:
                    kwargs[name] = value
            return original_forward(*args, **kwargs)

        kwargs["use_cache"] = False
        if getattr(text_config, "output_router_logits", False):
            kwargs.setdefault("output_router_logits", True)  # as the model's own forward does
        # The backbone and the head are looked up on each call: FSDP and PEFT replace them after patching
        backbone_outputs = getattr(self, backbone_attr)(*args, **kwargs)
        if shift_labels is None:
            hidden, labels = backbone_outputs.last_hidden_state[:, :-1], labels[:, 1:]
        else:
            hidden, labels = backbone_outputs.last_hidden_state, shift_labels
        lm_head = self.get_output_embeddings()
        with _head_parameters(lm_head) as (weight, bias):
            # with `device_map`, the backbone can end on another device than the head
            hidden, labels = hidden.to(weight.device), labels.to(weight.device)
            mask = labels != -100
            precision = head_precision(hidden, cast_lm_head_to_fp32)
            with (
                autocast_off(hidden),
                maybe_gather_lm_head_ctx(weight, bias),
                lm_head_lora(lm_head, precision.adapter_dtype, maybe_gather_lm_head_ctx) as lora,
                _gathered_again_for_backward(weight, bias),
            ):
                h, w, b = precision.cast(hidden), precision.cast(weight), precision.cast(bias)
                if lora is not None and is_deepspeed_zero3_enabled():  # the backward must not read released params
                    lora = dataclasses.replace(lora, a=lora.a.clone(), b=lora.b.clone())
                task = _HEAD_TASK.get()
                if task is not None:  # a grpo_fast GRPOTrainer's pass (_SamplerSupport, _FusedLoss)
                    log_probs, entropy = task.compute(h, w, b, lora, labels, mask, temperature, transform)
                else:
                    log_probs, entropy = grpo_fast.logprobs_and_entropy(
                        h,
                        w,
                        labels,
                        bias=b,
                        temperature=temperature,
                        **transform,
                        completion_mask=mask,
                        entropy_grad=entropy_grad,
                        lora=lora,
                    )
                if extras and isinstance(w, DTensor):  # the no-grad extras read the whole head
                    w, b = w.full_tensor(), None if b is None else b.full_tensor()
                extra = _extra_outputs(h, w, b, lora, labels, mask, temperature, **transform, names=extras)
        if isinstance(task, _FusedLoss):  # the GRPO loss, its gradients from grpo_fast.loss
            loss = task.head_loss
        else:  # TRL's, from the whole vocabulary's log-probs
            scored = task.logprobs[-1] if isinstance(task, _SamplerSupport) else log_probs
            loss = -scored.sum() / (mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch)

        aux_loss = None
        if kwargs.get("output_router_logits"):
            aux_loss = _load_balancing_loss(self, text_config, backbone_outputs, kwargs.get("attention_mask"))
            loss = loss + getattr(text_config, "router_aux_loss_coef", 0.0) * aux_loss

        return FusedCausalLMOutput(
            loss=loss,
            log_probs=log_probs,
            entropy=entropy if "entropy" in outputs else None,
            label_mask=mask,
            aux_loss=aux_loss,
            **extra,
        )

    model.forward = types.MethodType(fused_forward, model)


@contextlib.contextmanager
def _head_parameters(lm_head):
    """The head's weight and bias as tensors the kernel can read (see the module docstring on distributed)."""
    with fsdp_unit_gathered(lm_head) as (weight, bias):
        # a head split by vocabulary (tensor parallelism: every rank of its group sees the same tokens) stays split:
        # grpo_fast computes on each rank's rows (head.vocab_parallel); any other layout is gathered, as TRL does
        if isinstance(weight, DTensor) and not head_shard.is_vocab_sharded(weight):
            weight = weight.full_tensor()
            bias = None if bias is None else bias.full_tensor()
        yield weight, bias


@contextlib.contextmanager
def _gathered_again_for_backward(*params):
    """ZeRO-3: tensors saved for the backward that are one of ``params`` are gathered again when the backward
    unpacks them (ZeRO-3 releases a gathered parameter when its gather context exits, before the backward)."""
    if not is_deepspeed_zero3_enabled():
        yield
        return
    ids = {id(p) for p in params if p is not None}

    def pack(tensor):
        return tensor, id(tensor) in ids

    def unpack(packed):
        tensor, is_partitioned_param = packed
        if not is_partitioned_param:
            return tensor
        with maybe_gather_lm_head_ctx(tensor):
            return tensor.detach().clone()

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield


@torch.no_grad()
def _extra_outputs(hidden, weight, bias, lora, labels, mask, temperature, *, softcap, logit_scale, names):
    """The requested no-grad extras {name: [B, T]} (zero / False where the label is -100), exactly in fp32 from
    chunks of the scored rows' logits (LogitTransform: the kernels' transform; ``lora``'s term added as PEFT adds
    it, its dropout drawn as PEFT's forward would draw it)."""
    if not names:
        return {}
    rows, targets = hidden[mask], labels[mask]
    V = weight.shape[0]
    values = {name: [] for name in names}
    step = max(1, EXTRA_OUTPUTS_CHUNK_LOGITS // V)
    transform = LogitTransform(temperature, softcap, logit_scale)
    weight32, bias32 = weight.float(), bias.float() if bias is not None else None
    if lora is not None:
        lora_rows, lora_b32 = lora_hidden(lora, hidden, mask.flatten().nonzero().squeeze(1)).float(), lora.b.float()
    for start in range(0, rows.shape[0], step):
        u = rows[start : start + step].float() @ weight32.T
        if lora is not None:
            u = u + lora_rows[start : start + step] @ lora_b32.T
        z = transform.apply(u + bias32 if bias32 is not None else u)
        y = targets[start : start + step]
        if "log_sum_sq_probs" in values:  # log sum_v p_v^2 = logsumexp(2 z) - 2 logsumexp(z)
            values["log_sum_sq_probs"].append(torch.logsumexp(2 * z, -1) - 2 * torch.logsumexp(z, -1))
        if "mean_logits" in values:
            values["mean_logits"].append(z.mean(-1))
        if "is_top1" in values:  # the label is the first maximum, as TRL counts ties
            values["is_top1"].append(z.argmax(-1) == y)
    out = {}
    for name, chunks in values.items():
        if not chunks:  # no label at all
            chunks = [torch.zeros(0, dtype=torch.bool if name == "is_top1" else torch.float32, device=hidden.device)]
        out[name] = chunks[0].new_zeros(mask.shape).masked_scatter(mask, torch.cat(chunks))
    return out


def _load_balancing_loss(model, text_config, backbone_outputs, attention_mask):
    """The MoE load-balancing loss, as TRL's head computes it (Mixtral's function, which every MoE family uses)."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    # transformers 5 configs name the expert counts `num_experts` / `num_experts_per_tok`; earlier models held them
    num_experts = getattr(text_config, "num_experts", None) or model.num_experts
    num_experts_per_tok = getattr(text_config, "num_experts_per_tok", None) or model.num_experts_per_tok
    # padding-free batches pack every token into one row with no attention mask: every token counts
    return load_balancing_loss_func(backbone_outputs.router_logits, num_experts, num_experts_per_tok, attention_mask)


# ---------------------------------------------------------------------------------------------- the trainer's passes
# What the next fused-head call computes instead of its log-probs and entropies: set by grpo_fast's GRPOTrainer around
# one of TRL's scoring passes (``_get_per_token_logps_and_entropies``), None everywhere else (TRL's protocol)
_HEAD_TASK: contextvars.ContextVar = contextvars.ContextVar("grpo_fast_trl_head_task", default=None)


def _completion_columns(tensor, like):
    """``tensor`` [B, T] written into the last T columns of fp32 zeros shaped as ``like`` [B, L]; None for None."""
    if tensor is None:
        return None
    out = torch.zeros(like.shape, dtype=torch.float32, device=tensor.device)
    out[:, like.shape[1] - tensor.shape[1] :] = tensor
    return out


@dataclasses.dataclass
class _SamplerSupport:
    """The old policy's pass under the vLLM importance-sampling correction: each target's log-prob renormalised over
    the sampler's kept set (``grpo_fast.sampler_logprobs``: logits / temperature, then min_p, top_k, top_p as vLLM
    applies them) is the head's ``log_probs``, what TRL's correction subtracts vLLM's ``processed_logprobs`` from; the
    whole vocabulary's log-probs (the loss's old log-probs) are kept in ``logprobs``, one [B, L] tensor a call."""

    top_k: int
    top_p: float
    min_p: float
    logprobs: list = dataclasses.field(default_factory=list)

    def compute(self, h, w, b, lora, labels, mask, temperature, transform):
        out = grpo_fast.sampler_logprobs(
            h,
            w,
            labels,
            mask,
            temperature=temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            min_p=self.min_p,
            bias=b,
            lora=lora,
            **transform,
            check_values=False,  # a target the old policy's kept set lacks: NaN, which TRL's correction counts as 1
        )
        self.logprobs.append(out.logprobs)
        return out.support_logprobs, None

    def finish(self, logits_to_keep):
        """The whole vocabulary's old log-probs [B, logits_to_keep], as TRL slices its own."""
        if not self.logprobs:
            raise RuntimeError("grpo_fast.trl: the old policy's pass did not reach grpo_fast's fused head")
        return torch.cat([chunk[:, -logits_to_keep:] for chunk in self.logprobs], dim=0)


@dataclasses.dataclass
class _FusedLoss:
    """The policy's pass of TRL's ``_compute_loss`` with token-local options: the head computes TRL's loss by
    ``grpo_fast.loss`` on the completion's columns (the three-sweep trained head where it runs: the gradients formed
    in the forward) and returns the detached log-probs and entropies, from which TRL's own code then computes its
    metrics (and the loss's value). The loss, TRL's at one process without gradient accumulation (the trainer scales
    it as TRL scales its own), is the head's output's ``loss`` (``head_loss``); the trainer takes it from the output as
    the model's wrappers return it (``loss``): DDP, FSDP2 and DeepSpeed ZeRO-3 prepare the backward (ZeRO-3 gathers
    the parameters there) through hooks on the forward's outputs."""

    completion_mask: torch.Tensor  # [B, T]: TRL's mask (completion_mask x tool_mask)
    advantages: torch.Tensor
    old_logprobs: torch.Tensor | None
    ref_logprobs: torch.Tensor | None
    importance_weights: torch.Tensor | None
    num_items_in_batch: torch.Tensor | None
    options: grpo_fast.LossOptions
    head_loss: torch.Tensor | None = None
    loss: torch.Tensor | None = None

    def compute(self, h, w, b, lora, labels, mask, temperature, transform):
        if self.head_loss is not None:
            raise RuntimeError("grpo_fast.trl: the loss's pass scored more than one batch")
        T = self.completion_mask.shape[1]
        device = h.device

        def here(x):
            return None if x is None else x.to(device)

        self.head_loss, metrics = grpo_fast.loss(
            h[:, -T:],
            w,
            labels[:, -T:],
            here(self.advantages),
            here(self.completion_mask),
            bias=b,
            old_logprobs=here(self.old_logprobs),
            ref_logprobs=here(self.ref_logprobs),
            importance_weights=here(self.importance_weights),
            num_items_in_batch=here(self.num_items_in_batch),
            temperature=temperature,
            options=self.options,
            lora=lora,
            **transform,
        )
        return _completion_columns(metrics.logprobs, labels), _completion_columns(metrics.entropies, labels)


class _OutputsKept:
    """``model`` as TRL's scoring pass calls it (TRL 1.16 only calls it), keeping each output as the model's wrappers
    return it."""

    def __init__(self, model):
        self.model, self.outputs = model, []

    def __call__(self, *args, **kwargs):
        out = self.model(*args, **kwargs)
        self.outputs.append(out)
        return out


def _vllm_truncation(trainer) -> dict | None:
    """The sampler's ``top_k``, ``top_p`` and ``min_p`` as TRL hands them to vLLM (the config's, under
    ``generation_kwargs``), when at least one truncates the distribution; None when none does."""
    params = {"top_k": trainer.top_k, "top_p": trainer.top_p, "min_p": trainer.min_p}
    overrides = getattr(trainer.args, "generation_kwargs", None) or {}
    params.update({name: overrides[name] for name in params if overrides.get(name) is not None})
    top_k = int(params["top_k"] or 0)
    params = dict(
        top_k=max(top_k, 0),
        top_p=1.0 if params["top_p"] is None else float(params["top_p"]),
        min_p=float(params["min_p"] or 0.0),
    )
    truncates = params["top_k"] > 0 or params["top_p"] < 1.0 or params["min_p"] > 0.0
    return params if truncates else None


# ---------------------------------------------------------------------------------------------- the trainers
def _lm_head_adapter_check(cast_lm_head_to_fp32: bool):
    """What a grpo_fast trainer's constructor reads as PEFT's ``BaseTunerLayer``, for its isinstance checks on the
    lm_head: TRL refuses a PEFT adapter there (its head would ignore it); an lm_head that grpo_fast's head applies
    exactly is no tuner layer, one it cannot apply raises, naming why (``hf.lm_head_lora_adapter``), and any adapter
    on the lm_head is refused with ``cast_lm_head_to_fp32`` (TRL's cast replaces the head's forward, which generation
    then runs without the adapter)."""

    class AdapterCheck(type):
        def __instancecheck__(cls, lm_head):
            lm_head_lora_adapter(lm_head)
            if cast_lm_head_to_fp32 and "peft" in sys.modules:
                from peft.tuners.tuners_utils import BaseTunerLayer

                if isinstance(lm_head, BaseTunerLayer):
                    raise ValueError(
                        "`cast_lm_head_to_fp32=True` is not supported when the lm_head carries a PEFT "
                        "adapter (`target_modules` includes `lm_head`): TRL's cast replaces the head's "
                        "forward. Remove `lm_head` from the adapter's target modules, or set "
                        "`cast_lm_head_to_fp32=False`."
                    )
            return False

    return AdapterCheck("BaseTunerLayer", (), {})


class _GRPOFastHead:
    """What grpo_fast's trainers add to TRL's: TRL's constructor run with grpo_fast's head, and the head's settings,
    from the trainer's config."""

    def _head_entropy_grad(self) -> bool:
        """The entropy is differentiated only through an entropy bonus (GRPOConfig's ``entropy_coef`` or the
        adaptive controller; RLOO has neither)."""
        return getattr(self.args, "entropy_coef", 0.0) != 0.0 or bool(getattr(self.args, "use_adaptive_entropy", False))

    def _trl_init_with_grpo_fast_head(self, trl_class, args, kwargs):
        """``trl_class.__init__`` on this trainer, its calls to ``add_fused_lm_head`` given grpo_fast's head (with this
        trainer's entropy decision) and its ``BaseTunerLayer`` checks ``_lm_head_adapter_check``; a constructor that
        patched no model raises."""
        bound = inspect.signature(trl_class.__init__).bind(self, *args, **kwargs)
        config = bound.arguments.get("args")  # None: TRL's default config, which does not cast the head
        patched = []

        def head(model, *head_args, **head_kwargs):
            add_fused_lm_head(model, *head_args, **head_kwargs, entropy_grad=self._head_entropy_grad())
            patched.append(model)

        trl_init = with_module_names(
            trl_class.__init__,
            TRL_VERSIONS,
            add_fused_lm_head=head,
            BaseTunerLayer=_lm_head_adapter_check(bool(getattr(config, "cast_lm_head_to_fp32", False))),
        )
        trl_init(self, *args, **kwargs)
        if not patched:
            raise RuntimeError(
                f"grpo_fast.trl: {trl_class.__name__}'s constructor patched no model with the fused head"
            )


class GRPOTrainer(_GRPOFastHead, trl.GRPOTrainer):
    """TRL's ``GRPOTrainer`` with grpo_fast's fused head on the policy and the reference model.

    Same constructor, same ``GRPOConfig``, same loss, logs and metrics. The per-token log-probs and entropies are
    computed by grpo_fast; with token-local options (``grpo_fast.LossOptions.token_local``: token-level importance
    sampling, no VESPO, no top-entropy mask, off-policy mask or entropy bonus) the loss itself is
    ``grpo_fast.loss`` (the three-sweep trained head: the head's gradients formed in the forward), scaled as TRL
    scales its own, with TRL's metrics; other options keep TRL's loss code over grpo_fast's log-probs. The entropy is
    differentiated only with an entropy bonus (``entropy_coef != 0`` or ``use_adaptive_entropy``); without one a
    frozen lm_head takes the frozen-head path.

    The vLLM importance-sampling correction (``use_vllm`` with ``vllm_importance_sampling_correction``), when the
    config truncates sampling (``top_k``, ``top_p`` or ``min_p``, also through ``generation_kwargs``): vLLM returns
    each token's log-prob renormalised over the tokens it could draw (``processed_logprobs``), and TRL 1.16 divides
    by it the old policy's log-prob over the whole vocabulary, so its ratio carries each token's kept mass (below 1).
    Here the old policy's log-prob in the ratio is renormalised over the same kept set
    (``grpo_fast.sampler_logprobs``), like with like; the loss's old log-probs stay the whole vocabulary's. The
    trainer logs once which correction it applies (docs/trl.md#the-correction-over-the-samplers-support).

    Args:
        *args: TRL's ``GRPOTrainer`` arguments.
        sampler_support: compute the vLLM importance-sampling ratio over the sampler's support when sampling
            truncates (the default); False: TRL 1.16's ratio (old log-probs over the whole vocabulary), for parity
            with TRL. Without truncation the two are the same.
        **kwargs: TRL's ``GRPOTrainer`` keywords.

    Raises:
        TypeError: ``sampler_support`` not a bool.
        RuntimeError: the constructor patched no model with the fused head (a TRL whose constructor no longer
            calls ``add_fused_lm_head``).
    """

    @functools.wraps(trl.GRPOTrainer.__init__)
    def __init__(self, *args, sampler_support: bool = True, **kwargs):
        if not isinstance(sampler_support, bool):
            raise TypeError(f"GRPOTrainer: sampler_support must be a bool, got {sampler_support!r}")
        self.sampler_support = sampler_support
        self._next_head_task = None
        self._importance_sampling_said = False
        self._trl_init_with_grpo_fast_head(trl.GRPOTrainer, args, kwargs)

    # ------------------------------------------------------------------------------ one scoring pass, redirected
    def _get_per_token_logps_and_entropies(self, model, *args, **kwargs):
        """TRL's scoring pass; the first one after a task was set (``_next_head_task``) runs with it in the head."""
        task, self._next_head_task = getattr(self, "_next_head_task", None), None
        if task is None:
            return super()._get_per_token_logps_and_entropies(model, *args, **kwargs)
        kept = _OutputsKept(model)
        token = _HEAD_TASK.set(task)
        try:
            result = super()._get_per_token_logps_and_entropies(kept, *args, **kwargs)
        finally:
            _HEAD_TASK.reset(token)
        if isinstance(task, _FusedLoss):
            if len(kept.outputs) != 1 or task.head_loss is None:
                raise RuntimeError("grpo_fast.trl: the loss's pass did not score its batch in one fused-head call")
            task.loss = kept.outputs[0].loss
        return result

    # ------------------------------------------------------------------------------ the correction's support
    def _generate_and_score_completions(self, inputs):
        """TRL's, with the vLLM correction's old log-probs over the sampler's kept set when sampling truncates
        (``sampler_support``): the old policy's pass (TRL's first scoring pass here) returns them to TRL's ratio code,
        and the whole vocabulary's replace them in the output (the loss's old log-probs)."""
        support = None
        if self.use_vllm and self.vllm_importance_sampling_correction:
            truncation = _vllm_truncation(self)
            over_support = getattr(self, "sampler_support", True) and truncation is not None
            self._say_importance_sampling(truncation, over_support)
            if over_support:
                support = _SamplerSupport(**truncation)
        self._next_head_task = support
        try:
            output = super()._generate_and_score_completions(inputs)
        finally:
            self._next_head_task = None
        if support is not None:
            output["old_per_token_logps"] = support.finish(output["completion_ids"].shape[1])
        return output

    def _say_importance_sampling(self, truncation, over_support):
        """Once per trainer, on the main process: which vLLM importance-sampling correction it applies."""
        if getattr(self, "_importance_sampling_said", False):
            return
        self._importance_sampling_said = True
        if not self.accelerator.is_main_process:
            return
        if truncation is None:
            _log.info(
                "grpo_fast.trl.GRPOTrainer: sampling does not truncate (top_k, top_p, min_p off): the vLLM "
                "importance-sampling correction is TRL 1.16's exp(old - sampling) over the whole vocabulary"
            )
            return
        sampling = ", ".join(f"{name}={value}" for name, value in truncation.items())
        if over_support:
            _log.warning(
                f"grpo_fast.trl.GRPOTrainer: sampling truncates ({sampling}): the vLLM importance-sampling ratio is "
                "computed over the sampler's support (the old log-prob renormalised over the kept set, as vLLM's "
                "processed_logprobs are), where TRL 1.16's is biased by each token's kept mass; "
                "GRPOTrainer(..., sampler_support=False) gives TRL's"
            )
        else:
            _log.warning(
                f"grpo_fast.trl.GRPOTrainer: sampling truncates ({sampling}) and sampler_support=False: the vLLM "
                "importance-sampling ratio is TRL 1.16's, old log-probs over the whole vocabulary against vLLM's "
                "renormalised ones (each token's ratio scaled by its kept mass)"
            )

    # ------------------------------------------------------------------------------ the loss by grpo_fast.loss
    def _compute_loss(self, model, inputs):
        """TRL's ``_compute_loss``; with token-local options, its gradient is ``grpo_fast.loss``'s (the policy's pass
        computes it in the head, ``_FusedLoss``) and TRL's code computes the metrics and the loss's value from the
        detached log-probs and entropies that pass returns."""
        task = self._fused_loss_task(inputs)
        if task is None:
            return super()._compute_loss(model, inputs)
        self._next_head_task = task
        try:
            loss = super()._compute_loss(model, inputs)
        finally:
            self._next_head_task = None
        if task.loss is None:
            raise RuntimeError("grpo_fast.trl: the policy's pass did not reach grpo_fast's fused head")
        fused = task.loss * self._fused_loss_scale()
        return loss + (fused - fused.detach())

    def _fused_loss_task(self, inputs):
        """A ``_FusedLoss`` for TRL's options and this batch, or None where TRL's code keeps the loss: no gradient
        (evaluation), options that are not token-local, or options grpo_fast refuses."""
        if not torch.is_grad_enabled() or self._entropy_bonus_enabled:
            return None
        try:
            options = grpo_fast.LossOptions(
                loss_type=self.loss_type,
                beta=self.beta,
                epsilon=self.epsilon_low,
                epsilon_high=self.epsilon_high,
                delta=self.args.delta,
                importance_sampling_level=self.importance_sampling_level,
                max_completion_length=self.max_completion_length,
                sapo_temperature_pos=self.args.sapo_temperature_pos,
                sapo_temperature_neg=self.args.sapo_temperature_neg,
                use_bias_correction_kl=self.args.use_bias_correction_kl,
                off_policy_mask_threshold=self.off_policy_mask_threshold,
                top_entropy_quantile=self.top_entropy_quantile,
            )
        except (TypeError, ValueError):
            return None
        ref = inputs.get("ref_per_token_logps") if self.beta != 0.0 else None
        if not options.token_local or (self.beta != 0.0 and ref is None):
            return None
        mask = inputs["completion_mask"]
        if "tool_mask" in inputs:
            mask = mask * inputs["tool_mask"]
        correction = self.use_vllm and self.vllm_importance_sampling_correction
        return _FusedLoss(
            completion_mask=mask,
            advantages=inputs["advantages"],
            old_logprobs=inputs.get("old_per_token_logps"),
            ref_logprobs=ref,
            importance_weights=inputs["importance_sampling_ratio"] if correction else None,
            num_items_in_batch=inputs["num_items_in_batch"]
            if self.loss_type in grpo_fast.NUM_ITEMS_LOSS_TYPES
            else None,
            options=options,
        )

    def _fused_loss_scale(self):
        """grpo_fast.loss's value (one process, no accumulation) to TRL's: dapo, cispo and vespo divide by
        ``num_items_in_batch`` / processes x accumulation steps / ``steps_per_generation`` in training (by
        ``num_items_in_batch`` / processes in evaluation), the other types divide by the accumulation steps."""
        train = self.model.training
        if self.loss_type in grpo_fast.NUM_ITEMS_LOSS_TYPES:
            scale = float(self.accelerator.num_processes)
            if train:
                scale = scale * self.args.steps_per_generation / self.current_gradient_accumulation_steps
            return scale
        return 1.0 / self.current_gradient_accumulation_steps if train else 1.0


GRPOTrainer.__init__.__signature__ = inspect.signature(trl.GRPOTrainer.__init__).replace(
    parameters=[
        *inspect.signature(trl.GRPOTrainer.__init__).parameters.values(),
        inspect.Parameter("sampler_support", inspect.Parameter.KEYWORD_ONLY, default=True, annotation=bool),
    ]
)


class RLOOTrainer(_GRPOFastHead, trl.RLOOTrainer):
    """TRL's ``RLOOTrainer`` with grpo_fast's fused head on the policy and the reference model.

    Args:
        *args: TRL's ``RLOOTrainer`` arguments.
        **kwargs: TRL's ``RLOOTrainer`` keywords.

    Raises:
        RuntimeError: the constructor patched no model with the fused head.
    """

    @functools.wraps(trl.RLOOTrainer.__init__)
    def __init__(self, *args, **kwargs):
        self._trl_init_with_grpo_fast_head(trl.RLOOTrainer, args, kwargs)


# ---------------------------------------------------------------------------------------------- distillation
# the distillation trainers (grpo_fast.integrations.trl_distillation); TRL's experimental served-teacher trainer
# (trl_served) is imported on first use: TRL warns on every import of trl.experimental
from grpo_fast.integrations.trl_distillation import DistillationTrainer, divergence_loss  # noqa: E402, F401

_EXPERIMENTAL = (
    "AsyncDistillationTrainer",
    "AsyncDistillationConfig",
    "ServerDistillationTrainer",
    "ServerDistillationConfig",
    "served_jsd_loss",
)


def __getattr__(name):
    if name in _EXPERIMENTAL:
        from grpo_fast.integrations import trl_served

        return getattr(trl_served, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
