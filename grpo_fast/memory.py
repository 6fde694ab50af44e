"""The peak GPU memory of one GRPO training step, estimated on a CPU: ``python -m grpo_fast.memory``.

    python -m grpo_fast.memory                                   # the examples' GPU recipe: Qwen2.5-1.5B, LoRA r 16
    python -m grpo_fast.memory --recipe qwen2.5-0.5b-full --out bench/results/memory-4090-qwen2.5-0.5b-full
    python -m grpo_fast.memory --lora-r 0 --micro-batch-size 2 --heads eager,grpo_fast     # any flag overrides

One micro-batch's forward and backward and the optimizer step run over fake tensors (torch's FakeTensorMode:
shapes, dtypes and devices, no data, no arithmetic) while torch's memory tracker
(torch.distributed._tools.mem_tracker.MemTracker) accounts every tensor the step allocates and frees, by category:
weights, gradients, optimizer state, activations, and the loss head's own tensors. The loss heads compared in the
same step: "eager" (full [tokens, V] logits in the model's dtype, upcast to fp32, log_softmax, gather: a plain
training loop's path), "trl" (TRL 1.16's fused head, trl.kernels.ChunkedLogProbFunction, as
its GRPOTrainer calls it on a GPU) and "grpo_fast" (grpo_fast.loss on its Triton path: the custom ops' fake
implementations allocate their outputs, and the tracker adds each op's workspace from grpo_fast.ops.workspace_bytes).
The generation phase's key / value cache comes from the config (layers x 2 x kv_heads x head_dim x tokens x bytes).

Fake CPU tensors, not fake CUDA ones: a backward over fake CUDA tensors aborts a CPU-only torch (the autograd engine
asks for a CUDA device guard). Where a CPU kernel would allocate differently from the GPU one, the GPU's is what
runs: AdamW and grad clipping take their foreach implementations (the CUDA default), TRL's head takes its Triton
path (its kernels stand-ins that write in place, as the kernels do, and its fp32 accumulation as cuBLAS's addmm with
an fp32 output), grpo_fast's ops take backend "triton". Attention runs torch's fused CPU kernel, which keeps what
the CUDA flash / memory-efficient kernels keep (the output and a log-sum-exp per row and head).

The model is built from its published shape (transformers' config object), never from a hub: on the meta device,
PEFT's LoRA applied there (get_peft_model cannot swap fake tensors into modules), then every parameter and buffer
replaced by a fake CPU tensor of its shape and dtype (tied weights stay one tensor).

What the estimate leaves out (the CUDA context, the caching allocator's fragmentation, cuBLAS workspaces, NCCL, a
rollout engine) is in ``ALLOWANCE``; ``--out`` writes the table (.md), the numbers (.json) and a plot (.png).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from gsm8k import cli
from torch import nn
from torch._subclasses.fake_tensor import is_fake

GIB = 2**30
PROG = "python -m grpo_fast.memory"
# nvidia-smi's total for an RTX 4090 (24 GB): 24564 MiB
RTX_4090_GIB = 24564 / 1024


@dataclass(frozen=True)
class ModelShape:
    """A Qwen2-style decoder's published shape (the config numbers that size its tensors).

    Attributes:
        hidden_size: D, the hidden states' width.
        intermediate_size: the MLP's inner width.
        num_layers: decoder layers.
        num_heads: attention heads.
        num_kv_heads: key / value heads (grouped-query attention).
        vocab_size: V, the lm_head's rows.
        tie_word_embeddings: the lm_head shares the input embedding's weight.
    """

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    vocab_size: int
    tie_word_embeddings: bool = True

    @property
    def head_dim(self) -> int:
        """hidden_size / num_heads."""
        return self.hidden_size // self.num_heads

    def config(self):
        """transformers' Qwen2Config with these numbers (Qwen2.5's rope base, RMS epsilon and context).

        Returns:
            A ``transformers.Qwen2Config`` with SDPA attention and no cache.
        """
        from transformers import Qwen2Config

        config = Qwen2Config(hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
                             num_hidden_layers=self.num_layers, num_attention_heads=self.num_heads,
                             num_key_value_heads=self.num_kv_heads, vocab_size=self.vocab_size,
                             tie_word_embeddings=self.tie_word_embeddings, max_position_embeddings=32768,
                             rope_theta=1e6, rms_norm_eps=1e-6, hidden_act="silu", use_cache=False)  # fmt: skip
        config._attn_implementation = "sdpa"
        return config


# Qwen2.5 instruct models' public configs (hub: Qwen/Qwen2.5-*-Instruct, config.json)
MODELS = {
    "qwen2.5-0.5b": ModelShape(
        hidden_size=896, intermediate_size=4864, num_layers=24, num_heads=14, num_kv_heads=2, vocab_size=151936
    ),
    "qwen2.5-1.5b": ModelShape(
        hidden_size=1536, intermediate_size=8960, num_layers=28, num_heads=12, num_kv_heads=2, vocab_size=151936
    ),
}


@dataclass(frozen=True)
class Recipe:
    """One training step's sizes: the model, what trains, the micro-batch and lengths, the optimizer's settings.

    The rollout generates ``prompts_per_step`` x ``num_generations`` completions; the training step's forward /
    backward takes ``micro_batch_size`` of them, every one at ``prompt_length`` + ``completion_length`` tokens (the
    worst case: the longest prompt the recipe keeps, no completion ending early).

    Attributes:
        model: the shape's name (a ``MODELS`` key, or one marked as overridden).
        shape: the model's [ModelShape][grpo_fast.memory.ModelShape].
        lora_r: the LoRA rank; 0: every parameter trains.
        lora_alpha: LoRA's alpha.
        micro_batch_size: completions per forward / backward.
        prompt_length: prompt tokens per row.
        completion_length: completion tokens per row.
        prompts_per_step: prompts per rollout.
        num_generations: completions per prompt.
        gradient_checkpointing: the model recomputes its layers' activations in the backward.
        beta: the KL coefficient (0: no reference log-probs).
        lr: AdamW's learning rate.
        dtype: the model's dtype.
        temperature: the sampling temperature the logits are divided by.
        epsilon: the clip range.
        weight_decay: AdamW's weight decay.
        betas: AdamW's betas.
        max_grad_norm: the gradient clipping norm.
    """

    model: str
    shape: ModelShape
    lora_r: int
    lora_alpha: int
    micro_batch_size: int
    prompt_length: int
    completion_length: int
    prompts_per_step: int
    num_generations: int
    gradient_checkpointing: bool
    beta: float
    lr: float
    dtype: torch.dtype = torch.bfloat16
    temperature: float = 1.0
    epsilon: float = 0.2
    weight_decay: float = 0.1
    betas: tuple = (0.9, 0.99)
    max_grad_norm: float = 0.1

    @property
    def completion_tokens(self) -> int:
        """The tokens the loss head scores in one micro-batch."""
        return self.micro_batch_size * self.completion_length

    @property
    def reference_copy(self) -> bool:
        """A frozen copy of the weights for the KL term (with LoRA the reference is the base model, no copy)."""
        return self.beta != 0.0 and self.lora_r == 0

    def describe(self) -> str:
        """The recipe in one line of prose.

        Returns:
            The description the report's title and the command's stderr show.
        """
        trains = f"LoRA r {self.lora_r} (alpha {self.lora_alpha})" if self.lora_r else "all parameters"
        return (
            f"{self.model}, {trains}, {str(self.dtype).removeprefix('torch.')}, AdamW, micro-batch "
            f"{self.micro_batch_size} x ({self.prompt_length} prompt + {self.completion_length} completion "
            f"tokens), gradient checkpointing {'on' if self.gradient_checkpointing else 'off'}, beta {self.beta:g}"
            f"{' (a reference copy of the weights)' if self.reference_copy else ''}; rollout "
            f"{self.prompts_per_step} x {self.num_generations} completions"
        )


# examples/train_gsm8k.py's GPU preset (PRESETS["gpu"], its --max-prompt-length default, its optimizer and learning
# rates): LoRA r 16 on Qwen2.5-1.5B-Instruct; and the same run with all parameters of the 0.5B model (--lora-r 0)
_GPU_PRESET = dict(micro_batch_size=4, prompt_length=512, completion_length=786, prompts_per_step=4,
                   num_generations=16, gradient_checkpointing=True, beta=0.04)  # fmt: skip
RECIPES = {
    "qwen2.5-1.5b-lora": Recipe(
        model="qwen2.5-1.5b", shape=MODELS["qwen2.5-1.5b"], lora_r=16, lora_alpha=32, lr=2e-5, **_GPU_PRESET
    ),
    "qwen2.5-0.5b-full": Recipe(
        model="qwen2.5-0.5b", shape=MODELS["qwen2.5-0.5b"], lora_r=0, lora_alpha=32, lr=5e-6, **_GPU_PRESET
    ),
}

# What the tracker cannot see, added to each estimate before it is compared with the card (the .md says why)
ALLOWANCE = {
    "cuda_context_gib": 1.0,  # driver, kernel images, cuBLAS / cuDNN handles: 0.5-1 GiB outside torch's allocator
    "fragmentation_fraction": 0.15,  # reserved over allocated: lengths change every step, segments are reused
}


def allowance_gib(peak_gib: float) -> float:
    """What the tracker cannot see (``ALLOWANCE``), for an estimated peak.

    Args:
        peak_gib: the estimated peak, GiB.

    Returns:
        The CUDA context plus the fragmentation fraction of the peak, GiB.
    """
    return ALLOWANCE["cuda_context_gib"] + ALLOWANCE["fragmentation_fraction"] * peak_gib


def kv_cache_bytes(shape: ModelShape, sequences: int, tokens: int, element_bytes: int) -> int:
    """The generation phase's key / value cache: every layer keeps a key and a value vector per kv head and token.

    Args:
        shape: the model's shape.
        sequences: the sequences generated at once.
        tokens: tokens per sequence.
        element_bytes: bytes per cached value (the model's dtype's).

    Returns:
        The cache's bytes.
    """
    return shape.num_layers * 2 * shape.num_kv_heads * shape.head_dim * sequences * tokens * element_bytes


# ------------------------------------------------------------------------------------------ the model
def _fake_parameters(model: nn.Module, fake_mode) -> None:
    """Each meta parameter and buffer of ``model`` replaced by a fake CPU tensor of its shape, dtype and
    requires_grad; a tensor two modules share (tied embeddings) stays one."""
    replaced = {}
    with fake_mode:
        for module in model.modules():
            for table, make in (
                (
                    module._parameters,
                    lambda p: nn.Parameter(torch.empty(p.shape, dtype=p.dtype), requires_grad=p.requires_grad),
                ),
                (module._buffers, lambda b: torch.empty(b.shape, dtype=b.dtype)),
            ):
                for name, tensor in list(table.items()):
                    if tensor is not None:
                        if id(tensor) not in replaced:
                            replaced[id(tensor)] = make(tensor)
                        table[name] = replaced[id(tensor)]


def build_model(
    recipe: Recipe, fake_mode=None, *, device="cpu", lora: bool = True, checkpointing: bool = True
) -> nn.Module:
    """The recipe's model in train mode, with gradient checkpointing (non-reentrant, as the example enables it) and
    PEFT's LoRA on the example's target modules (``lora`` and a rank > 0; the adapters in fp32, PEFT's default
    autocast of bf16 adapters).

    Args:
        recipe: the step's sizes.
        fake_mode: a ``FakeTensorMode``: the model is built on the meta device, then every tensor a fake CPU one;
            None: randomly initialised on ``device``.
        device: where a real model is built.
        lora: apply LoRA when the recipe's rank is > 0 (False: the base model, the KL term's copy).
        checkpointing: enable the recipe's gradient checkpointing.

    Returns:
        The model, in train mode.
    """
    from transformers import AutoModelForCausalLM

    with torch.device("meta" if fake_mode is not None else device):
        model = AutoModelForCausalLM.from_config(recipe.shape.config(), dtype=recipe.dtype)
    if checkpointing and recipe.gradient_checkpointing:
        kwargs = {"use_reentrant": False}
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    if lora and recipe.lora_r > 0:
        from gsm8k.models import LORA_TARGETS
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(
            model,
            LoraConfig(
                r=recipe.lora_r,
                lora_alpha=recipe.lora_alpha,
                lora_dropout=0.0,
                target_modules=LORA_TARGETS,
                task_type="CAUSAL_LM",
            ),
        )
    if fake_mode is not None:
        _fake_parameters(model, fake_mode)
    return model.train()


def tensor_bytes(tensors) -> int:
    """The bytes of distinct tensors among ``tensors`` (a tied weight counts once).

    Args:
        tensors: an iterable of tensors.

    Returns:
        Their bytes, each tensor once.
    """
    seen = {}
    for t in tensors:
        seen[id(t)] = t.numel() * t.element_size()
    return sum(seen.values())


# ------------------------------------------------------------------------------------------ the loss heads
@dataclass
class Batch:
    """One micro-batch's per-token inputs of the loss, besides hidden states and weight.

    Attributes:
        targets: [B, T] token ids.
        advantages: [B].
        mask: [B, T] completion mask.
        ref_logprobs: [B, T] float32 with a KL term, else None.
        num_items: the rollout's completion tokens (DAPO's normaliser), a 0-dim tensor as the example's.
    """

    targets: torch.Tensor
    advantages: torch.Tensor
    mask: torch.Tensor
    ref_logprobs: torch.Tensor | None
    num_items: torch.Tensor


def grpo_token_loss(logp: torch.Tensor, batch: Batch, recipe: Recipe) -> torch.Tensor:
    """TRL's GRPO per-token loss on [B, T] log-probs for the heads without a layer 2 of their own: one iteration
    (the ratio against logp's detached copy), the clipped surrogate, the KL term, DAPO's sum over num_items. Its
    tensors are [B, T]; what matters here is that they are that size (their values are never computed).

    Args:
        logp: [B, T] float32 log-probs.
        batch: the micro-batch's inputs.
        recipe: the step's epsilon and beta.

    Returns:
        The scalar loss.
    """
    advantages = batch.advantages.float().unsqueeze(1)
    ratio = torch.exp(logp - logp.detach())
    clipped = torch.clamp(ratio, 1 - recipe.epsilon, 1 + recipe.epsilon)
    per_token = -torch.min(ratio * advantages, clipped * advantages)
    if batch.ref_logprobs is not None:
        delta = batch.ref_logprobs - logp
        per_token = per_token + recipe.beta * (torch.exp(delta) - delta - 1)
    return (per_token * batch.mask).sum() / batch.num_items


class LossHead(nn.Module):
    """A loss head: ``forward(hidden, weight)`` gives the micro-batch's loss.

    Args:
        recipe: the step's sizes.
        batch: the micro-batch's inputs.
    """

    def __init__(self, recipe: Recipe, batch: Batch):
        super().__init__()
        self.recipe, self.batch = recipe, batch

    def on_fake_tensors(self):
        """The context the head's forward and backward run in over fake tensors.

        Returns:
            A context manager under which they allocate what they would on a GPU (here: nothing to change).
        """
        return contextlib.nullcontext()

    def forward(self, hidden, weight):
        """The micro-batch's loss.

        Args:
            hidden: [B, T, D] completion hidden states, the model's dtype.
            weight: [V, D] the lm_head's weight.

        Returns:
            The scalar loss.
        """
        raise NotImplementedError


class EagerHead(LossHead):
    """Full logits: ``hidden @ weight.T`` in the model's dtype (its lm_head's product), upcast to fp32 and divided
    by the temperature, log_softmax, gather, as a plain training loop writes it, for the completion positions only
    (a ``logits_to_keep`` of the completion length)."""

    label = "eager PyTorch (full logits)"

    def forward(self, hidden, weight):
        """The micro-batch's loss (LossHead.forward)."""
        logits = (hidden @ weight.T).float() / self.recipe.temperature
        logp = logits.log_softmax(-1).gather(-1, self.batch.targets.unsqueeze(-1)).squeeze(-1)
        return grpo_token_loss(logp, self.batch, self.recipe)


class _InPlaceKernel:
    """A Triton kernel launched as ``kernel[grid](...)``: it writes into the buffers it is given and allocates
    nothing, so over fake tensors (no values to write) the launch is a no-op."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def _addmm_fp32_cuda(acc, a, b):
    """TRL's ``_addmm_fp32`` as it runs on CUDA, over fake tensors: cuBLAS accumulates the product into the fp32
    ``acc`` in place (``out_dtype`` for bf16 / fp16) and allocates nothing, so there is nothing to account and no
    value to write (not the CPU fallback's fp32 copies of both operands). Not run as an op: torch 2.11's fake
    ``addmm`` with ``out_dtype`` fails in its decomposition."""


@contextlib.contextmanager
def trl_gpu_path():
    """trl.kernels.chunked_logprob as it runs on a GPU: its Triton kernels (in-place stand-ins) instead of the torch
    twins a CPU takes, which allocate fp32 copies of every [4096, 32768] logits tile."""
    from trl.kernels import chunked_logprob

    names = ("_use_triton", "_forward_kernel", "_backward_kernel", "_addmm_fp32")
    saved = {name: getattr(chunked_logprob, name) for name in names}
    chunked_logprob._use_triton = lambda device: True
    chunked_logprob._forward_kernel = chunked_logprob._backward_kernel = _InPlaceKernel()
    chunked_logprob._addmm_fp32 = _addmm_fp32_cuda
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(chunked_logprob, name, value)


class TrlHead(LossHead):
    """TRL 1.16's fused head as GRPOTrainer calls it (trl.trainer.utils.add_fused_lm_head's forward with
    ``fused_lm_head=True``): the scored positions' hidden states gathered ([N, D], every completion token valid),
    ``ChunkedLogProbFunction`` with log-probs and entropy in tiles of 32768 vocabulary rows, scattered back to
    [B, T]; then the GRPO loss."""

    label = "TRL 1.16 fused head"

    def on_fake_tensors(self):
        """TRL's GPU path (``trl_gpu_path``)."""
        return trl_gpu_path()

    def forward(self, hidden, weight):
        """The micro-batch's loss (LossHead.forward)."""
        from trl.kernels import ChunkedLogProbFunction
        from trl.trainer.utils import _CHUNKED_LOGPROB_CHUNK_SIZE

        B, T, _ = hidden.shape
        mask = self.batch.mask.bool()
        # hidden_states[mask] with every position valid: one gathered [N, D] copy (a boolean selection's size is a
        # value, which fake tensors do not have; the same positions by index)
        rows = torch.arange(B, device=hidden.device).repeat_interleave(T)
        columns = torch.arange(T, device=hidden.device).repeat(B)
        logp, _entropy_metric, *_ = ChunkedLogProbFunction.apply(
            hidden[rows, columns],
            weight,
            None,
            self.batch.targets[rows, columns],
            self.recipe.temperature,
            _CHUNKED_LOGPROB_CHUNK_SIZE,
            None,
            1.0,
            ("log_probs", "entropy"),
        )
        logp = logp.new_zeros(mask.shape).masked_scatter(mask, logp)
        return grpo_token_loss(logp, self.batch, self.recipe)


@contextlib.contextmanager
def _environment(**values):
    """Environment variables set (a value) or unset (None) for the block's duration."""
    saved = {name: os.environ.get(name) for name in values}
    for name, value in values.items():
        os.environ.pop(name, None) if value is None else os.environ.__setitem__(name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            os.environ.pop(name, None) if value is None else os.environ.__setitem__(name, value)


def _triton_backend_on_fake_tensors():
    """grpo_fast.loss refuses backend="triton" for CPU tensors unless Triton's interpreter is on; over fake tensors
    no kernel runs (the ops' fake implementations do), so the interpreter's flag is set for the call's duration."""
    return _environment(TRITON_INTERPRET="1")


class GrpoFastHead(LossHead):
    """grpo_fast.loss on its Triton path, as examples/train_gsm8k.py calls it (a frozen lm_head takes the
    frozen-head path, as "auto" chooses)."""

    label = "grpo_fast (Triton path)"

    def on_fake_tensors(self):
        """grpo_fast's Triton backend over fake CPU tensors (the interpreter's flag set; no kernel runs)."""
        return _triton_backend_on_fake_tensors()

    def forward(self, hidden, weight):
        """The micro-batch's loss (LossHead.forward)."""
        import grpo_fast

        options = grpo_fast.LossOptions(
            loss_type="dapo",
            beta=self.recipe.beta,
            epsilon=self.recipe.epsilon,
            max_completion_length=self.recipe.completion_length,
        )
        loss, _ = grpo_fast.loss(
            hidden,
            weight,
            self.batch.targets,
            self.batch.advantages,
            self.batch.mask,
            ref_logprobs=self.batch.ref_logprobs,
            options=options,
            temperature=self.recipe.temperature,
            num_items_in_batch=self.batch.num_items,
            backend="triton",
        )
        return loss


HEADS = {"eager": EagerHead, "trl": TrlHead, "grpo_fast": GrpoFastHead}


# The card the estimate is for, as grpo_fast's launchers read a CUDA device (kernels/config.py's _device_props: SM
# count, shared memory per block, compute capability as 10 x major + minor): an RTX 4090 (sm_89, 128 SMs, 99 KiB)
RTX_4090_PROPS = (128, 101376, 89)


@contextlib.contextmanager
def launchers_sized_for(props):
    """grpo_fast's launchers sizing their kernels for a CUDA card on a machine without one, for the block.

    The interpreter's flag is off (its tiles are the CPU's) and the device properties are the card's.

    Args:
        props: the card as the launchers read it: (SM count, shared memory per block in bytes, compute capability
            as 10 x major + minor), e.g. ``RTX_4090_PROPS``.
    """
    from grpo_fast.kernels import config

    saved = config._device_props
    config._device_props = lambda device: props
    try:
        with _environment(TRITON_INTERPRET=None):
            yield
    finally:
        config._device_props = saved


def grpo_fast_workspace(func, args, kwargs) -> int:
    """The bytes a grpo_fast custom op's real implementation allocates besides its outputs on the card (its fake
    one allocates the outputs only), from grpo_fast.ops.workspace_bytes.

    Args:
        func: the op the tracker sees dispatched.
        args: its positional arguments.
        kwargs: its keyword arguments.

    Returns:
        The workspace bytes on an RTX 4090; 0 for any other op.
    """
    schema = getattr(func, "_schema", None)
    if schema is None or not schema.name.startswith("grpo_fast::"):
        return 0
    from grpo_fast import ops

    bound = dict(zip((a.name for a in schema.arguments), args), **kwargs)
    op = schema.name.split("::", 1)[1]
    if op == "token_loss":
        return ops.workspace_bytes(
            op, None, None, torch.float32, batch_shape=tuple(bound["logp"].shape), backend=bound["backend"]
        )
    hidden = bound["hidden"]
    with launchers_sized_for(RTX_4090_PROPS):
        return ops.workspace_bytes(
            op,
            tuple(hidden.shape),
            bound["weight"].shape[0],
            hidden.dtype,
            backend=bound["backend"],
            frozen_head=bool(bound.get("frozen_head", False)),
            backward_mode=bound["backward_mode"],
            device_type="cuda",
        )


# ------------------------------------------------------------------------------------------ the tracker
def _mem_tracker_class():
    from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType

    class StepTracker(MemTracker):
        """MemTracker with what one step's account needs.

        Gradient hooks only on parameters that train: torch's tracker registers one on every parameter of a module
        it enters, which a frozen parameter (LoRA's base weights) refuses. The loss head's own bytes: what it
        holds above the memory at its entry (its saved tensors, temporaries, the gradient it returns), at its own
        peak and at the step's. Where the step's peak is (``phase``, forward or backward, in the head or not). Each
        custom op's workspace (``workspace``: func, args, kwargs -> bytes), held while the op runs.
        """

        def __init__(self, head: nn.Module, workspace=None):
            super().__init__()
            self.head, self.workspace = head, workspace
            self.phase = "forward / backward"
            self.in_head = False
            self.head_base = self.head_peak = self.head_at_peak = 0
            self.peak_phase = None

        def _track_module_params_and_buffers(self, module, install_grad_hooks=True):
            memory = super()._track_module_params_and_buffers(module, install_grad_hooks=False)
            if install_grad_hooks:
                for param in module.parameters():
                    if param.requires_grad and self._param_to_grad_hook_handles.get(param) is None:
                        self._param_to_grad_hook_handles[param] = (
                            param.register_hook(self._grad_hook),
                            param.register_post_accumulate_grad_hook(lambda p: self._grad_hook(p.grad)),
                        )
            return memory

        def _grad_hook(self, grad):
            self._update_and_maybe_create_winfos(grad, _MemRefType.GRAD)

        def total(self) -> int:
            return sum(snap["Total"] for snap in self._curr_mem_snap.values())

        def _pre_fw_hook(self, module, inputs):
            super()._pre_fw_hook(module, inputs)
            if module is self.head:
                self.in_head, self.head_base = True, self.total()

        def _post_fw_hook(self, module, inputs, outputs):
            super()._post_fw_hook(module, inputs, outputs)
            if module is self.head:
                self.in_head = False

        def _pre_bw_hook(self, module, args):
            super()._pre_bw_hook(module, args)
            if module is self.head:
                self.in_head = True

        def _post_bw_hook(self, module, args):
            super()._post_bw_hook(module, args)
            if module is self.head:
                self.in_head = False

        def where(self) -> str:
            if self.phase != "forward / backward":
                return self.phase
            direction = "backward" if self._mod_tracker.is_bw else "forward"
            return f"loss head {direction}" if self.in_head else f"model {direction}"

        def _update_peak_stats(self, peak_state):
            # the step's peak only: the tracker's per-module peaks walk every tracked module on every op, which
            # grows with depth squared (minutes for 28 layers); the per-module snapshots are not read here
            held = self.total() - self.head_base if self.in_head else 0
            self.head_peak = max(self.head_peak, held)
            for device, snap in self._curr_mem_snap.items():
                if self._peak_mem.get(device, 0) < snap["Total"]:
                    self._peak_mem[device] = snap["Total"]
                    self._peak_mem_snap[device] = dict(snap)
                    self.peak_phase, self.head_at_peak = self.where(), held

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            extra = self.workspace(func, args, kwargs or {}) if self.workspace is not None else 0
            if not extra:
                return super().__torch_dispatch__(func, types, args, kwargs)
            device = next(a.device for a in args if isinstance(a, torch.Tensor))
            scratch = torch.empty(extra, dtype=torch.uint8, device=device)  # the fake mode below makes it
            self._track(_MemRefType.TEMP if self._mod_tracker.is_bw else _MemRefType.ACT, scratch)
            try:
                return super().__torch_dispatch__(func, types, args, kwargs)
            finally:
                del scratch

    return StepTracker, _MemRefType


# ------------------------------------------------------------------------------------------ one step
CATEGORIES = (
    "weights",
    "reference weights",
    "gradients",
    "optimizer state",
    "optimizer step temporaries",
    "activations",
    "loss head",
)


@dataclass
class Step:
    """One training step's objects: the model (and the KL term's frozen copy), the optimizer, the inputs, the head.

    Attributes:
        recipe: the step's sizes.
        model: the policy, in train mode.
        reference: the KL term's frozen copy, or None (``Recipe.reference_copy``).
        trainable: the parameters that train.
        optimizer: AdamW over them, with the state of an earlier update.
        prompt_ids: [B, P] prompt token ids.
        prompt_mask: [B, P] the prompts' attention mask.
        batch: the loss's per-token inputs.
        head: the loss head.
    """

    recipe: Recipe
    model: nn.Module
    reference: nn.Module | None
    trainable: list
    optimizer: torch.optim.Optimizer
    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    batch: Batch
    head: LossHead

    def inputs(self) -> list:
        """The micro-batch's input tensors.

        Returns:
            The prompt ids and mask, and the batch's tensors.
        """
        return [
            self.prompt_ids,
            self.prompt_mask,
            self.batch.targets,
            self.batch.advantages,
            self.batch.mask,
            self.batch.num_items,
        ] + ([self.batch.ref_logprobs] if self.batch.ref_logprobs is not None else [])

    def forward_backward(self) -> None:
        """One micro-batch: completion_hidden_states (every row its own prompt, as checkpointing requires), the
        loss head, backward."""
        from grpo_fast.integrations.hidden_states import completion_hidden_states

        with self.head.on_fake_tensors() if is_fake(self.prompt_ids) else contextlib.nullcontext():
            hidden = completion_hidden_states(
                self.model, self.prompt_ids, self.prompt_mask, self.batch.targets, self.batch.mask, share_prompts=False
            )
            self.head(hidden, self.model.get_output_embeddings().weight).backward()

    def update(self) -> None:
        """The example's update: gradient clipping, AdamW, gradients freed."""
        torch.nn.utils.clip_grad_norm_(self.trainable, self.recipe.max_grad_norm, foreach=True)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


def prepare_step(recipe: Recipe, head: str, fake_mode=None, device="cpu") -> Step:
    """The steady state of examples/train_gsm8k.py's loop before a micro-batch: the optimizer state of an earlier
    update, the gradients of an earlier micro-batch of this one (it accumulates into them); the micro-batch's
    inputs at full length.

    Args:
        recipe: the step's sizes.
        head: the loss head's ``HEADS`` key: "eager", "trl" or "grpo_fast".
        fake_mode: a ``FakeTensorMode`` to build over; None: real tensors on ``device``.
        device: where real tensors are built.

    Returns:
        The step, ready for ``forward_backward``.
    """
    model = build_model(recipe, fake_mode, device=device)
    reference = (
        build_model(recipe, fake_mode, device=device, lora=False, checkpointing=False).requires_grad_(False)
        if recipe.reference_copy
        else None
    )
    trainable = [p for p in model.parameters() if p.requires_grad]
    B, P, T = recipe.micro_batch_size, recipe.prompt_length, recipe.completion_length
    V = recipe.shape.vocab_size
    with fake_mode if fake_mode is not None else torch.device(device):
        # foreach: the CUDA default (a CPU parameter list would take the per-tensor loop, with other temporaries)
        optimizer = torch.optim.AdamW(
            trainable, lr=recipe.lr, betas=recipe.betas, weight_decay=recipe.weight_decay, foreach=True
        )
        for p in trainable:
            p.grad = torch.zeros_like(p)
        optimizer.step()
        batch = Batch(
            targets=torch.randint(0, V, (B, T)),
            advantages=torch.randn(B),
            mask=torch.ones(B, T, dtype=torch.long),
            ref_logprobs=-torch.rand(B, T) if recipe.beta != 0.0 else None,
            num_items=torch.tensor(recipe.prompts_per_step * recipe.num_generations * T),
        )
        prompt_ids, prompt_mask = torch.randint(0, V, (B, P)), torch.ones(B, P, dtype=torch.long)
    return Step(
        recipe, model, reference, trainable, optimizer, prompt_ids, prompt_mask, batch, HEADS[head](recipe, batch)
    )


def estimate_step(recipe: Recipe, head: str, log=None) -> dict:
    """The step's peak over fake tensors with loss head ``head`` (a HEADS key): bytes by category at the peak,
    where it is, and the loss head's own peak; one micro-batch's forward and backward, then the update.

    Args:
        recipe: the step's sizes.
        head: the loss head's ``HEADS`` key.
        log: called with a progress message; None: silent.

    Returns:
        The peak's bytes, by category (``CATEGORIES``) and in all, the phase it is in, the loss head's own peak,
            the parameter counts, the optimizer state's bytes and the tracker's raw peak.

    Raises:
        RuntimeError: the categories do not sum to the tracker's peak.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    log = log or (lambda message: None)
    fake = FakeTensorMode()
    start = time.perf_counter()
    step = prepare_step(recipe, head, fake)
    log(f"built on fake tensors in {time.perf_counter() - start:.0f} s; running the step")
    StepTracker, RefType = _mem_tracker_class()
    tracker = StepTracker(step.head, grpo_fast_workspace if head == "grpo_fast" else None)
    tracker.track_external(
        step.model, step.optimizer, *step.inputs(), *([step.reference] if step.reference is not None else [])
    )
    optimizer_state = tracker.get_tracker_snapshot()[torch.device("cpu")][RefType.OPT]
    start = time.perf_counter()
    with fake, tracker:
        step.forward_backward()
        tracker.phase = "optimizer step"
        step.update()
    log(f"step accounted in {time.perf_counter() - start:.0f} s")
    peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]
    reference_bytes = 0
    if step.reference is not None:
        reference_bytes = tensor_bytes(step.reference.parameters()) + tensor_bytes(step.reference.buffers())
    categories = {
        "weights": peak[RefType.PARAM] + peak[RefType.BUFFER] - reference_bytes,
        "reference weights": reference_bytes,
        "gradients": peak[RefType.GRAD],
        "optimizer state": min(peak[RefType.OPT], optimizer_state),
        "optimizer step temporaries": max(peak[RefType.OPT] - optimizer_state, 0),
        "activations": peak[RefType.ACT] + peak[RefType.TEMP] + peak[RefType.OTH] - tracker.head_at_peak,
        "loss head": tracker.head_at_peak,
    }
    if sum(categories.values()) != peak["Total"]:
        raise RuntimeError(f"the categories sum to {sum(categories.values())} bytes, the peak is {peak['Total']}")
    return {
        "peak_bytes": peak["Total"],
        "categories_bytes": categories,
        "peak_in": tracker.peak_phase,
        "loss_head_peak_bytes": tracker.head_peak,
        "trainable_parameters": sum(p.numel() for p in step.trainable),
        "parameters": sum(p.numel() for p in {id(p): p for p in step.model.parameters()}.values()),
        "optimizer_state_bytes": optimizer_state,
        "tracker_raw_peak_bytes": {ref.value: peak[ref] for ref in RefType},
    }


def measure_step(recipe: Recipe, head: str, log=None) -> dict:
    """The same step on the CUDA GPU, random weights: torch.cuda.max_memory_allocated / max_memory_reserved over
    the micro-batch and the update (the set-up's peak reset first), and the device's used memory (context
    included) at the end.

    Args:
        recipe: the step's sizes.
        head: the loss head's ``HEADS`` key.
        log: called with a progress message; None: silent.

    Returns:
        The measured bytes (max allocated, max reserved, device used) and the device's name.

    Raises:
        RuntimeError: torch sees no CUDA GPU.
    """
    log = log or (lambda message: None)
    if not torch.cuda.is_available():
        raise RuntimeError("measuring the step needs a CUDA GPU")
    device = torch.device("cuda")
    torch.cuda.empty_cache()
    step = prepare_step(recipe, head, device=device)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    step.forward_backward()
    step.update()
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    measured = {
        "max_allocated_bytes": torch.cuda.max_memory_allocated(),
        "max_reserved_bytes": torch.cuda.max_memory_reserved(),
        "device_used_bytes": total - free,
        "device": torch.cuda.get_device_name(device),
    }
    log(
        f"measured: allocated {gib(measured['max_allocated_bytes']):.2f} GiB, reserved "
        f"{gib(measured['max_reserved_bytes']):.2f} GiB"
    )
    del step
    torch.cuda.empty_cache()
    return measured


def generation_phase(recipe: Recipe, step: dict) -> dict:
    """The rollout's memory beside the step: the weights (policy and reference), the optimizer state (it lives
    between updates; the gradients do not: zero_grad frees them) and the key / value cache of every completion at
    full length, in the model's dtype.

    Args:
        recipe: the step's sizes.
        step: one head's ``estimate_step`` result (the weights and optimizer state are the same for every head).

    Returns:
        The sequences, their tokens, the bytes of each part and their total.
    """
    element = torch.empty(0, dtype=recipe.dtype).element_size()
    sequences = recipe.prompts_per_step * recipe.num_generations
    cache = kv_cache_bytes(recipe.shape, sequences, recipe.prompt_length + recipe.completion_length, element)
    c = step["categories_bytes"]
    parts = {
        "weights": c["weights"],
        "reference weights": c["reference weights"],
        "optimizer state": step["optimizer_state_bytes"],
        "kv cache": cache,
    }
    return {
        "sequences": sequences,
        "tokens": recipe.prompt_length + recipe.completion_length,
        "parts_bytes": parts,
        "total_bytes": sum(parts.values()),
    }


def estimate(recipe: Recipe, heads, progress=True, measure=False) -> dict:
    """Every head's step on the recipe, and the generation phase.

    Args:
        recipe: the step's sizes.
        heads: the loss heads' ``HEADS`` keys.
        progress: print each phase's message on stderr.
        measure: also measure each step on the CUDA GPU (``measure_step``).

    Returns:
        The recipe, each head's result (``estimate_step``, with ``measured``) and the generation phase.
    """
    results = {}
    for i, head in enumerate(heads):

        def log(message, i=i, head=head):
            if progress:
                print(f"memory: [{i + 1}/{len(heads)}] {head}: {message}", file=sys.stderr, flush=True)

        log(f"building {recipe.model} ({recipe.shape.num_layers} layers) on the meta device")
        results[head] = estimate_step(recipe, head, log)
        if measure:
            results[head]["measured"] = measure_step(recipe, head, log)
    generation = generation_phase(recipe, next(iter(results.values())))
    return {"recipe": recipe, "heads": results, "generation": generation}


# ------------------------------------------------------------------------------------------ the report
def gib(n_bytes: int) -> float:
    """Bytes in GiB.

    Args:
        n_bytes: a byte count.

    Returns:
        ``n_bytes`` / 2**30.
    """
    return n_bytes / GIB


def verdict(peak_bytes: int, card_gib: float) -> dict:
    """Whether an estimated peak fits the card once the allowance is added.

    Args:
        peak_bytes: the estimated peak.
        card_gib: the card's memory, GiB.

    Returns:
        The peak, the allowance, their sum and the margin left (GiB, to 3 decimals), and ``fits``.
    """
    peak = gib(peak_bytes)
    allowance = allowance_gib(peak)
    return {
        "peak_gib": round(peak, 3),
        "allowance_gib": round(allowance, 3),
        "with_allowance_gib": round(peak + allowance, 3),
        "margin_gib": round(card_gib - peak - allowance, 3),
        "fits": peak + allowance <= card_gib,
    }


def to_json(result: dict, command: str, card_gib: float) -> dict:
    """The report as the .json file writes it.

    Args:
        result: ``estimate``'s result.
        command: the command line that regenerates it.
        card_gib: the card's memory, GiB.

    Returns:
        The command, the recipe, the versions, the card, the allowance, and each head's and the generation
            phase's numbers with their verdicts.
    """
    import transformers
    import trl

    recipe = result["recipe"]
    out = {
        "command": command,
        "recipe": {
            k: (
                str(v).removeprefix("torch.")
                if isinstance(v, torch.dtype)
                else dataclasses.asdict(v)
                if dataclasses.is_dataclass(v)
                else v
            )
            for k, v in dataclasses.asdict(recipe).items()
            if k != "shape"
        }
        | {"shape": dataclasses.asdict(recipe.shape), "description": recipe.describe()},
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__, "trl": trl.__version__},
        "card": {"name": "RTX 4090", "gib": round(card_gib, 3)},
        "allowance": ALLOWANCE,
        "heads": {},
        "generation": result["generation"] | verdict(result["generation"]["total_bytes"], card_gib),
    }
    for head, step in result["heads"].items():
        out["heads"][head] = step | {"label": HEADS[head].label} | verdict(step["peak_bytes"], card_gib)
    return out


def answer(report: dict) -> str:
    """The verdict in one line: each head's step and the generation phase, with the allowance, against the card.

    Args:
        report: ``to_json``'s report.

    Returns:
        One line of Markdown.
    """
    heads = list(report["heads"].values())
    g = report["generation"]
    everything = heads + [g]
    verdict_words = (
        "fits with every head"
        if all(x["fits"] for x in everything)
        else "does not fit with every head"
        if any(x["fits"] for x in everything)
        else "does not fit"
    )
    steps = "; ".join(f"{h['label']} {h['with_allowance_gib']:.2f} (margin {h['margin_gib']:+.2f})" for h in heads)
    return (
        f"**RTX 4090 ({report['card']['gib']:.2f} GiB): {verdict_words}.** Expected on the card (estimate + "
        f"allowance), GiB: the training step with {steps}; the generation phase {g['with_allowance_gib']:.2f} "
        f"(margin {g['margin_gib']:+.2f})."
    )


def markdown(report: dict) -> str:
    """The report as the .md file writes it: the verdict, the table by category and what the estimate leaves out.

    Args:
        report: ``to_json``'s report.

    Returns:
        The Markdown text.
    """
    r = report["recipe"]
    card = report["card"]["gib"]
    lines = [
        f"# Peak GPU memory of one GRPO step: {r['description']}",
        "",
        "Regenerate (CPU, no GPU, no hub; about a minute a head):",
        "",
        "```",
        report["command"],
        "```",
        "",
        (
            f"Estimated with torch {report['versions']['torch']}'s memory tracker over fake tensors "
            f"(transformers {report['versions']['transformers']}, TRL {report['versions']['trl']}); GiB "
            f"(2^30 bytes). The card: RTX 4090, {card:.2f} GiB (24564 MiB)."
        ),
        "",
        answer(report),
        "",
        "| | " + " | ".join(h["label"] for h in report["heads"].values()) + " |",
        "|---|" + "---:|" * len(report["heads"]),
    ]
    heads = list(report["heads"].values())
    for category in CATEGORIES:
        if any(h["categories_bytes"][category] for h in heads):
            lines.append(
                f"| {category} | " + " | ".join(f"{gib(h['categories_bytes'][category]):.2f}" for h in heads) + " |"
            )
    rows = [
        ("**estimated peak**", lambda h: f"**{h['peak_gib']:.2f}**"),
        ("peak during", lambda h: h["peak_in"]),
        ("loss head's own peak", lambda h: f"{gib(h['loss_head_peak_bytes']):.2f}"),
        ("+ allowance (not tracked)", lambda h: f"{h['allowance_gib']:.2f}"),
        ("= expected on the card", lambda h: f"{h['with_allowance_gib']:.2f}"),
        (f"fits {card:.2f} GiB?", lambda h: ("yes" if h["fits"] else "**no**") + f", margin {h['margin_gib']:+.2f}"),
    ]
    if all("measured" in h for h in heads):
        device = heads[0]["measured"]["device"]
        rows += [
            (f"measured on {device}: max allocated", lambda h: f"{gib(h['measured']['max_allocated_bytes']):.2f}"),
            ("measured: max reserved", lambda h: f"{gib(h['measured']['max_reserved_bytes']):.2f}"),
            ("measured: device used (context included)", lambda h: f"{gib(h['measured']['device_used_bytes']):.2f}"),
        ]
    for name, cell in rows:
        lines.append(f"| {name} | " + " | ".join(cell(h) for h in heads) + " |")
    g = report["generation"]
    parts = g["parts_bytes"]
    lines += [
        "",
        (
            f"Generation phase (HF generate, {g['sequences']} sequences x {g['tokens']} tokens, key / value "
            f"cache {gib(parts['kv cache']):.2f} GiB = {r['shape']['num_layers']} layers x 2 x "
            f"{r['shape']['num_kv_heads']} kv heads x {r['shape']['hidden_size'] // r['shape']['num_heads']} x "
            f"{g['sequences']} x {g['tokens']} tokens x {2 if r['dtype'] in ('bfloat16', 'float16') else 4} bytes): "
            f"weights {gib(parts['weights'] + parts['reference weights']):.2f} + optimizer state "
            f"{gib(parts['optimizer state']):.2f} + cache = **{g['peak_gib']:.2f} GiB**, with the allowance "
            f"{g['with_allowance_gib']:.2f}: {'fits' if g['fits'] else 'does not fit'} (margin "
            f"{g['margin_gib']:+.2f}). The step and the generation do not overlap; the run's peak is the larger."
        ),
        "",
    ]
    lines += [
        HOW_TO_READ.format(ctx=ALLOWANCE["cuda_context_gib"], frag=round(100 * ALLOWANCE["fragmentation_fraction"]))
    ]
    return "\n".join(lines) + "\n"


HOW_TO_READ = """## What is estimated, what is not

Estimated: every tensor the step allocates through torch (the tracker sees each op's outputs and frees), in the
steady state of examples/train_gsm8k.py's loop: the optimizer state of an earlier update, the gradients of an
earlier micro-batch, one micro-batch's forward and backward at full length (every prompt at the recipe's longest,
every completion at its maximum: the worst case), then gradient clipping and AdamW's foreach update. Categories at
the step's peak: weights (the policy's parameters and buffers; LoRA adapters in fp32), reference weights (the KL
term's frozen copy, full-parameter runs only), gradients, optimizer state (AdamW's two moments and step counts),
optimizer step temporaries (the foreach update's), activations (the checkpoints, one layer's recomputation, the
backward's temporaries, the inputs) and the loss head (what the head holds above the memory at its entry, when the
peak falls inside it). "Loss head's own peak": the same quantity at the head's own peak. The heads: eager PyTorch's
full logits of the completion positions as a plain training loop writes them (in bf16, upcast to fp32, log_softmax,
gather; a loop taking model(...).logits of whole sequences pays (prompt + completion) / completion times more),
TRL 1.16's fused head as on a GPU (its Triton kernels write in place), grpo_fast.loss's Triton path (the custom ops'
fake implementations allocate the outputs; grpo_fast.ops.workspace_bytes adds each op's workspace, sized for an RTX
4090's 128 SMs, while it runs). The model: no weight is made or downloaded; transformers builds it from its config on
the meta device, PEFT's get_peft_model applies LoRA there (it cannot move fake tensors), then every parameter and buffer
becomes a fake CPU tensor of its shape and dtype (tied weights stay one tensor).

Not tracked, and the allowance added for it: the CUDA context (driver, kernel images, cuBLAS / cuDNN handles, the
Triton kernels' modules): {ctx} GiB, the high end of the 0.5-1 GiB torch 2.x takes on a card; the caching
allocator's fragmentation and rounding (reserved over allocated) and cuBLAS's workspaces (allocated through the
caching allocator, a few MiB to 32 MiB a stream): {frag} % of the estimated peak, since completion lengths change
every step and segments of one size are reused for others (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True narrows
it). Not included at all: NCCL buffers (one GPU, no process group), a separate rollout engine (the recipe samples
with HF generate in the same process: the generation phase above; a colocated vLLM would take its
gpu_memory_utilization share on top), a display's framebuffer on a desktop card (a few hundred MiB), and the
prompt prefill's transients during generation (each distinct prompt runs once: 4 x 512 tokens, tens of MiB).
The estimate is to be checked against torch.cuda.max_memory_allocated / max_memory_reserved on a GPU:
tools/gpu_checklist.sh does it (MEMORY=1).
"""


def plot(report: dict, path) -> None:
    """Stacked bars by category per head, the generation phase beside them, and the card's line, as a PNG.

    Args:
        report: ``to_json``'s report.
        path: the image file to write.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    heads = list(report["heads"].values())
    labels = [h["label"].replace(" (", "\n(") for h in heads] + ["generation\n(KV cache)"]
    colors = dict(
        zip(
            CATEGORIES + ("kv cache", "allowance"),
            ["#4c72b0", "#8172b3", "#dd8452", "#55a868", "#a1c9a4", "#c44e52", "#937860", "#64b5cd", "#dddddd"],
        )
    )
    stacks = [dict(h["categories_bytes"]) | {"allowance": h["allowance_gib"] * GIB} for h in heads]
    g = report["generation"]
    stacks.append(dict(g["parts_bytes"]) | {"allowance": g["allowance_gib"] * GIB})
    fig, ax = plt.subplots(figsize=(2.2 * len(labels) + 2, 5.5))
    for name, color in colors.items():
        values = [gib(s.get(name, 0)) for s in stacks]
        if any(values):
            bottoms = [
                sum(gib(v) for k, v in s.items() if list(colors).index(k) < list(colors).index(name)) for s in stacks
            ]
            ax.bar(
                labels,
                values,
                bottom=bottoms,
                color=color,
                label=name,
                width=0.6,
                hatch="//" if name == "allowance" else None,
                edgecolor="white" if name != "allowance" else "#999",
            )
    card = report["card"]["gib"]
    ax.axhline(card, color="black", linestyle="--", linewidth=1)
    ax.text(len(labels) - 0.5, card, f" RTX 4090: {card:.1f} GiB", va="bottom", ha="right", fontsize=9)
    for i, s in enumerate(stacks):
        total = sum(gib(v) for v in s.values())
        ax.text(i, total, f"{total:.1f}", ha="center", va="bottom", fontsize=9)
    ax.set_ylabel("GiB at the peak (estimated + allowance)")
    ax.set_title(report["recipe"]["description"].split("; rollout")[0], fontsize=9)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.set_ylim(0, max(card, max(sum(gib(v) for v in s.values()) for s in stacks)) * 1.12)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------------------------------ the command line
RANGES = {
    "hidden_size": cli.Range(1, 65536),
    "intermediate_size": cli.Range(1, 262144),
    "num_layers": cli.Range(1, 256),
    "num_heads": cli.Range(1, 1024),
    "num_kv_heads": cli.Range(1, 1024),
    "vocab_size": cli.Range(2, 2**24),
    "micro_batch_size": cli.Range(1, 1024),
    "prompt_length": cli.Range(1, 131072),
    "completion_length": cli.Range(1, 131072),
    "prompts_per_step": cli.Range(1, 4096),
    "num_generations": cli.COMMON_RANGES["num_generations"],
    "lora_r": cli.Range(0, 4096),
    "lora_alpha": cli.Range(1),
    "beta": cli.Range(0.0),
    "card_gib": cli.Range(0.0, low_open=True),
}
SHAPE_FLAGS = {
    "hidden_size": "hidden_size",
    "intermediate_size": "intermediate_size",
    "num_layers": "num_layers",
    "num_heads": "num_heads",
    "num_kv_heads": "num_kv_heads",
    "vocab_size": "vocab_size",
}
RECIPE_FLAGS = (
    "micro_batch_size",
    "prompt_length",
    "completion_length",
    "prompts_per_step",
    "num_generations",
    "lora_r",
    "lora_alpha",
    "beta",
    "gradient_checkpointing",
)


def parse_args(argv=None):
    """The command line's arguments, checked.

    Args:
        argv: the arguments; None: ``sys.argv[1:]``.

    Returns:
        The parsed arguments (``heads`` as a list of ``HEADS`` keys).

    Raises:
        gsm8k.cli.InputError: an argument out of range, unknown or repeated heads, or ``--measure``
            without a CUDA GPU (argparse itself exits on a malformed flag).
    """
    p = argparse.ArgumentParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--recipe",
        choices=sorted(RECIPES),
        default="qwen2.5-1.5b-lora",
        help="the step to estimate (the flags below override its values)",
    )
    p.add_argument("--model", choices=sorted(MODELS), default=None, help="another published shape")
    for dest in SHAPE_FLAGS:
        p.add_argument("--" + dest.replace("_", "-"), type=int, default=None, help=f"the model's {dest}")
    p.add_argument("--micro-batch-size", type=int, default=None, help="completions per forward / backward [4]")
    p.add_argument("--prompt-length", type=int, default=None, help="prompt tokens per row [512]")
    p.add_argument("--completion-length", type=int, default=None, help="completion tokens per row [786]")
    p.add_argument("--prompts-per-step", type=int, default=None, help="prompts per rollout [4]")
    p.add_argument("--num-generations", type=int, default=None, help="completions per prompt [16]")
    p.add_argument("--lora-r", type=int, default=None, help="LoRA rank (0: every parameter trains)")
    p.add_argument("--lora-alpha", type=int, default=None)
    p.add_argument("--beta", type=float, default=None, help="KL coefficient (0: no reference log-probs)")
    p.add_argument("--gradient-checkpointing", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--heads", default=",".join(HEADS), help=f"comma-separated, of {', '.join(HEADS)}")
    p.add_argument("--card-gib", type=float, default=RTX_4090_GIB, help="the card's memory (RTX 4090: 23.99)")
    p.add_argument("--out", default=None, help="write OUT.json, OUT.md and OUT.png (default: print the table)")
    p.add_argument(
        "--measure",
        action="store_true",
        help="also run each step on the CUDA GPU (random weights) and record its real peak beside the "
        "estimate (torch.cuda.max_memory_allocated / max_memory_reserved)",
    )
    p.add_argument("--quiet", action="store_true", help="no per-phase messages on stderr")
    cli.add_ranges_to_help(p, RANGES)
    args = p.parse_args(argv)
    cli.check_numbers(PROG, args, RANGES)
    args.heads = [h.strip() for h in args.heads.split(",") if h.strip()]
    unknown = [h for h in args.heads if h not in HEADS]
    if unknown or not args.heads or len(set(args.heads)) != len(args.heads):
        cli.fail(PROG, f"--heads {','.join(args.heads)}: expected distinct names among {', '.join(HEADS)}")
    if args.measure and not torch.cuda.is_available():
        cli.fail(PROG, "--measure runs the step on a CUDA GPU, and torch sees none here; leave it out to estimate")
    return args


def recipe_from_args(args) -> Recipe:
    """The recipe the command line asks for: ``--recipe`` with every flag given applied on top.

    Args:
        args: ``parse_args``' result.

    Returns:
        The recipe.

    Raises:
        gsm8k.cli.InputError: a shape whose heads do not divide the hidden size or each other, or an
            odd head dim.
    """
    recipe = RECIPES[args.recipe]
    shape = MODELS[args.model] if args.model else recipe.shape
    shape = dataclasses.replace(
        shape, **{field: getattr(args, dest) for dest, field in SHAPE_FLAGS.items() if getattr(args, dest) is not None}
    )
    if shape.hidden_size % shape.num_heads:
        cli.fail(PROG, f"hidden size {shape.hidden_size} is not a multiple of the {shape.num_heads} attention heads")
    if shape.num_heads % shape.num_kv_heads:
        cli.fail(PROG, f"{shape.num_heads} attention heads are not a multiple of the {shape.num_kv_heads} kv heads")
    if shape.head_dim % 2:
        cli.fail(PROG, f"head dim {shape.head_dim} (hidden size / heads) is odd: rotary embeddings need it even")
    changed = shape != (MODELS[args.model] if args.model else recipe.shape)
    name = args.model or recipe.model
    recipe = dataclasses.replace(
        recipe,
        shape=shape,
        model=name + (" (shape overridden)" if changed else ""),
        **{f: getattr(args, f) for f in RECIPE_FLAGS if getattr(args, f) is not None},
    )
    if args.lora_r == 0 and args.recipe.endswith("-lora"):
        recipe = dataclasses.replace(recipe, lr=RECIPES["qwen2.5-0.5b-full"].lr)
    return recipe


def main(argv=None) -> dict:
    """``python -m grpo_fast.memory``: estimate, print the table, write ``--out``'s files.

    Args:
        argv: the arguments; None: ``sys.argv[1:]``.

    Returns:
        The report (``to_json``).
    """
    args = parse_args(argv)
    recipe = recipe_from_args(args)
    command = "python -m grpo_fast.memory " + " ".join(shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))
    if not args.quiet:
        print(f"memory: {recipe.describe()}; heads {', '.join(args.heads)}", file=sys.stderr, flush=True)
    report = to_json(
        estimate(recipe, args.heads, progress=not args.quiet, measure=args.measure), command.strip(), args.card_gib
    )
    text = markdown(report)
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        Path(f"{out}.json").write_text(json.dumps(report, indent=1) + "\n")
        Path(f"{out}.md").write_text(text)
        plot(report, f"{out}.png")
        print(f"wrote {out}.json, {out}.md, {out}.png", file=sys.stderr)
    print(text)
    return report


if __name__ == "__main__":
    main()
