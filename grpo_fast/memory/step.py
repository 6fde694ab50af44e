"""One training step over fake tensors, accounted by torch's memory tracker; and the same step measured on a GPU.

The model is built from its published shape (transformers' config object), never from a hub: on the meta device,
PEFT's LoRA applied there (get_peft_model cannot swap fake tensors into modules), then every parameter and buffer
replaced by a fake CPU tensor of its shape and dtype (tied weights stay one tensor). Fake CPU tensors, not fake CUDA
ones: a backward over fake CUDA tensors aborts a CPU-only torch (the autograd engine asks for a CUDA device guard).
Where a CPU kernel would allocate differently from the GPU one, the GPU's is what runs: AdamW and grad clipping take
their foreach implementations (the CUDA default), grpo_fast's ops take backend "triton" with each op's workspace
added while it runs. Attention runs torch's fused CPU kernel, which keeps what the CUDA flash / memory-efficient
kernels keep (the output and a log-sum-exp per row and head).
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake

from grpo_fast.memory.heads import Batch, LossHead, workspace_bytes
from grpo_fast.memory.recipe import Gpu, Recipe, kv_cache_bytes
from grpo_fast.memory.report import gib


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
    recipe: Recipe, fake_mode=None, *, device="cpu", lora: bool = True, checkpointing: bool = True, shape=None
) -> nn.Module:
    """The recipe's model in train mode, with gradient checkpointing (non-reentrant) and PEFT's LoRA on the recipe's
    target modules (``lora`` and a rank > 0; the adapters in fp32, PEFT's default autocast of bf16 adapters).

    Args:
        recipe: the step's sizes.
        fake_mode: a ``FakeTensorMode``: the model is built on the meta device, then every tensor a fake CPU one;
            None: randomly initialised on ``device``.
        device: where a real model is built.
        lora: apply LoRA when the recipe's rank is > 0 (False: the base model, the KL term's copy).
        checkpointing: enable the recipe's gradient checkpointing.
        shape: the model's ModelShape; None: the recipe's (the teacher's is ``recipe.teacher_shape``).

    Returns:
        The model, in train mode.
    """
    from transformers import AutoModelForCausalLM

    with torch.device("meta" if fake_mode is not None else device):
        model = AutoModelForCausalLM.from_config((shape or recipe.shape).config(), dtype=recipe.dtype)
        if recipe.lm_head_dtype is not None and shape is None:  # the policy's: a parameter of its own (a tied
            # embedding keeps the model's dtype); a teacher keeps its own
            head = model.get_output_embeddings()
            head.weight = nn.Parameter(head.weight.detach().to(recipe.lm_head_dtype))
    if checkpointing and recipe.gradient_checkpointing:
        kwargs = {"use_reentrant": False}
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    if lora and recipe.lora_r > 0:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(
            model,
            LoraConfig(
                r=recipe.lora_r,
                lora_alpha=recipe.lora_alpha,
                lora_dropout=0.0,
                target_modules=list(recipe.lora_targets),
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


class Models:
    """The recipe's models, each built once and shared by every head's step: the policy and its optimizer with the
    state of an earlier update, the KL term's frozen copy (``Recipe.reference_copy``), a distillation teacher. Over
    fake tensors building the policy takes seconds (transformers' modules, PEFT's adapters) and the optimizer's first
    update a few more; a step leaves them as it found them (its gradients and inputs are its own, freed by the update;
    the optimizer's state keeps its tensors), so the heads' estimates do not depend on their order. On a GPU
    (``fake_mode`` None) each step builds its own: a real model's memory is what is measured.

    Args:
        recipe: the step's sizes.
        fake_mode: the ``FakeTensorMode`` every step of the estimate runs under, or None: real tensors on ``device``.
        device: where real tensors are built.
    """

    def __init__(self, recipe: Recipe, fake_mode=None, device="cpu"):
        self.recipe, self.fake_mode, self.device = recipe, fake_mode, device
        self._built = {}

    def _model(self, role: str, make):
        """``make()``'s result, once per role over fake tensors; on a device, a new one each call."""
        if self.fake_mode is None:
            return make()
        if role not in self._built:
            self._built[role] = make()
        return self._built[role]

    def policy(self) -> nn.Module:
        """The policy, in train mode (LoRA, checkpointing)."""
        return self._model("policy", lambda: build_model(self.recipe, self.fake_mode, device=self.device))

    def reference(self) -> nn.Module | None:
        """The KL term's frozen copy, or None (``Recipe.reference_copy``)."""
        if not self.recipe.reference_copy:
            return None
        return self._model(
            "reference",
            lambda: build_model(
                self.recipe, self.fake_mode, device=self.device, lora=False, checkpointing=False
            ).requires_grad_(False),
        )

    def optimizer(self, trainable: list) -> torch.optim.Optimizer:
        """AdamW over the policy's ``trainable`` parameters with the state of an earlier update, no gradients (built
        under the models' fake mode or device, as ``prepare_step`` calls it)."""

        def make():
            # foreach: the CUDA default (a CPU parameter list would take the per-tensor loop, other temporaries)
            optimizer = torch.optim.AdamW(
                trainable,
                lr=self.recipe.lr,
                betas=self.recipe.betas,
                weight_decay=self.recipe.weight_decay,
                foreach=True,
            )
            for p in trainable:
                p.grad = torch.zeros_like(p)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return optimizer

        return self._model("optimizer", make)

    def teacher(self) -> nn.Module:
        """The distillation teacher: ``Recipe.teacher_shape``, frozen, in eval mode (TRL's DistillationTrainer's)."""
        return self._model(
            "teacher",
            lambda: (
                build_model(
                    self.recipe,
                    self.fake_mode,
                    device=self.device,
                    lora=False,
                    checkpointing=False,
                    shape=self.recipe.teacher_shape,
                )
                .requires_grad_(False)
                .eval()
            ),
        )


@dataclass
class Step:
    """One training step's objects: the model (and the KL term's frozen copy), the optimizer, the inputs, the head.

    Attributes:
        recipe: the step's sizes.
        model: the policy, in train mode.
        reference: the KL term's frozen copy, or None (``Recipe.reference_copy``).
        teacher: the distillation teacher model (a head with ``teacher == "model"``), or None.
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
    teacher: nn.Module | None = None

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
        ] + [
            t
            for t in (self.batch.ref_logprobs, self.batch.kept_ids, self.batch.teacher_ids, self.batch.teacher_logprobs)
            if t is not None
        ]

    def forward_backward(self) -> None:
        """One micro-batch: completion_hidden_states (every row its own prompt, as checkpointing requires); with a
        teacher model, its completion hidden states without gradients after the student's (TRL's
        DistillationTrainer's order: the student's activations are held meanwhile); the loss head, backward."""
        from grpo_fast.integrations.hidden_states import completion_hidden_states

        with self.head.on_fake_tensors() if is_fake(self.prompt_ids) else contextlib.nullcontext():
            hidden = completion_hidden_states(
                self.model, self.prompt_ids, self.prompt_mask, self.batch.targets, self.batch.mask, share_prompts=False
            )
            if self.teacher is not None:
                with torch.no_grad():
                    self.batch.teacher_hidden = completion_hidden_states(
                        self.teacher,
                        self.prompt_ids,
                        self.prompt_mask,
                        self.batch.targets,
                        self.batch.mask,
                        share_prompts=False,
                    )
                self.batch.teacher_weight = self.teacher.get_output_embeddings().weight
            try:
                self.head(hidden, self.model.get_output_embeddings().weight).backward()
            finally:  # the teacher's hidden states are this micro-batch's: freed with it
                self.batch.teacher_hidden = self.batch.teacher_weight = None

    def old_policy_pass(self) -> None:
        """The old policy's pass over the micro-batch (TRL's scoring of a rollout, batch by batch, before its
        updates): completion_hidden_states and the head's log-probs without autograd."""
        from grpo_fast.integrations.hidden_states import completion_hidden_states

        self.head.in_old_policy_pass = True
        try:
            with self.head.on_fake_tensors() if is_fake(self.prompt_ids) else contextlib.nullcontext():
                with torch.no_grad():
                    hidden = completion_hidden_states(
                        self.model,
                        self.prompt_ids,
                        self.prompt_mask,
                        self.batch.targets,
                        self.batch.mask,
                        share_prompts=False,
                    )
                    self.head(hidden, self.model.get_output_embeddings().weight)
        finally:
            self.head.in_old_policy_pass = False

    def update(self) -> None:
        """The update: gradient clipping, AdamW, gradients freed."""
        torch.nn.utils.clip_grad_norm_(self.trainable, self.recipe.max_grad_norm, foreach=True)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


def prepare_step(
    recipe: Recipe,
    head: type[LossHead],
    fake_mode=None,
    device="cpu",
    *,
    gradients: bool = True,
    models: Models | None = None,
) -> Step:
    """The steady state of a training loop before a micro-batch: the optimizer state of an earlier update, the
    gradients of an earlier micro-batch of this one (it accumulates into them); the micro-batch's inputs at full
    length.

    Args:
        recipe: the step's sizes.
        head: the loss head's class.
        fake_mode: a ``FakeTensorMode`` to build over; None: real tensors on ``device``.
        device: where real tensors are built.
        gradients: keep an earlier micro-batch's gradients (False: freed, as after an update's zero_grad: the old
            policy's pass).
        models: the models to take (built once for every head of an estimate), of ``fake_mode`` and ``device``;
            None: built for this step.

    Returns:
        The step, ready for ``forward_backward``.
    """
    models = models or Models(recipe, fake_mode, device)
    model, reference = models.policy(), models.reference()
    teacher = models.teacher() if head.teacher == "model" else None
    trainable = [p for p in model.parameters() if p.requires_grad]
    B, P, T = recipe.micro_batch_size, recipe.prompt_length, recipe.completion_length
    V = recipe.shape.vocab_size
    with fake_mode if fake_mode is not None else torch.device(device):
        optimizer = models.optimizer(trainable)
        if gradients:
            for p in trainable:
                p.grad = torch.zeros_like(p)
        batch = Batch(
            targets=torch.randint(0, V, (B, T)),
            advantages=torch.randn(B),
            mask=torch.ones(B, T, dtype=torch.long),
            ref_logprobs=-torch.rand(B, T) if recipe.beta != 0.0 else None,
            num_items=torch.tensor(recipe.prompts_per_step * recipe.num_generations * T),
            kept_ids=torch.randint(0, V, (B, T, head.kept_width)) if head.kept_width else None,
        )
        if head.teacher == "served":  # the served teacher's top-k, rank-sorted: a rollout input beside the ids
            K = recipe.teacher_top_k
            batch.teacher_ids = (torch.randint(0, V, (B, T, 1)) + torch.arange(K)) % V  # K distinct ids a token
            batch.teacher_logprobs = -(torch.rand(B, T, K).sort(-1).values + math.log(2 * K))  # mass <= 1 / 2
        prompt_ids, prompt_mask = torch.randint(0, V, (B, P)), torch.ones(B, P, dtype=torch.long)
    return Step(
        recipe, model, reference, trainable, optimizer, prompt_ids, prompt_mask, batch, head(recipe, batch), teacher
    )


def estimate_step(recipe: Recipe, head: type[LossHead], gpu: Gpu, log=None, models: Models | None = None) -> dict:
    """The step's peak over fake tensors with loss head ``head``: bytes by category at the peak, where it is, and
    the loss head's own peak; one micro-batch's forward and backward, then the update. A head with an old policy's
    pass (``old_policy_pass``): that pass too (``estimate_old_policy_pass``, under ``old_policy_pass``), and where its
    peak is the larger, the peak's numbers are its (the training pass's under ``training_pass``); the loss head's
    own peak is the larger of the two passes'.

    Args:
        recipe: the step's sizes.
        head: the loss head's class.
        gpu: the card grpo_fast's ops size their workspaces for.
        log: called with a progress message; None: silent.
        models: the estimate's models over fake tensors (``Models`` with a ``FakeTensorMode``), shared by its
            heads; None: built for this head.

    Returns:
        The peak's bytes, by category (``CATEGORIES``) and in all, the phase it is in, the loss head's own peak,
            the parameter counts, the optimizer state's bytes and the tracker's raw peak.

    Raises:
        RuntimeError: the categories do not sum to the tracker's peak.
    """
    log = log or (lambda message: None)

    def run(step, tracker):
        step.forward_backward()
        tracker.phase = "optimizer step"
        step.update()

    models = models or fake_models(recipe)
    result = _tracked(recipe, head, gpu, log, run, gradients=True, what="step", models=models)
    if head.old_policy_pass:
        old = estimate_old_policy_pass(recipe, head, gpu, log, models)
        result["old_policy_pass"] = old
        if old["peak_bytes"] > result["peak_bytes"]:  # the step's peak is the old policy's pass
            keys = ("peak_bytes", "categories_bytes", "peak_in", "loss_head_peak_bytes", "tracker_raw_peak_bytes")
            result["training_pass"] = {key: result[key] for key in keys}
            result |= {key: old[key] for key in keys}
        result["loss_head_peak_bytes"] = max(result["loss_head_peak_bytes"], old["loss_head_peak_bytes"])
    return result


def estimate_old_policy_pass(
    recipe: Recipe, head: type[LossHead], gpu: Gpu, log=None, models: Models | None = None
) -> dict:
    """The old policy's pass over one micro-batch, over fake tensors: the model's forward and the head's log-probs
    without autograd, after an update (the optimizer state held, no gradients), by category as ``estimate_step``.

    Args:
        recipe: the step's sizes.
        head: the loss head's class (its ``forward`` with ``in_old_policy_pass`` set).
        gpu: the card grpo_fast's ops size their workspaces for.
        log: called with a progress message; None: silent.
        models: as ``estimate_step``'s.

    Returns:
        The pass's peak by category and in all, where it is, the loss head's own peak and the tracker's raw peak.
    """
    result = _tracked(
        recipe,
        head,
        gpu,
        log or (lambda message: None),
        lambda step, tracker: step.old_policy_pass(),
        False,
        "pass",
        models or fake_models(recipe),
    )
    result["peak_in"] = f"old-policy pass: {result['peak_in'].replace(' forward', '')}"
    keys = ("peak_bytes", "categories_bytes", "peak_in", "loss_head_peak_bytes", "tracker_raw_peak_bytes")
    return {key: result[key] for key in keys}


def fake_models(recipe: Recipe) -> Models:
    """The recipe's models over a new ``FakeTensorMode``, for the heads of one estimate to share."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    return Models(recipe, FakeTensorMode())


def _tracked(recipe, head, gpu, log, run, gradients, what, models: Models) -> dict:
    """``run(step, tracker)`` over ``models``' fake tensors under the step tracker; the peak's bytes by category."""
    fake = models.fake_mode
    start = time.perf_counter()
    step = prepare_step(recipe, head, fake, gradients=gradients, models=models)
    log(f"set up on fake tensors in {time.perf_counter() - start:.0f} s; running the {what}")
    StepTracker, RefType = _mem_tracker_class()
    tracker = StepTracker(step.head, lambda func, args, kwargs: workspace_bytes(func, args, kwargs, gpu))
    frozen = [m for m in (step.reference, step.teacher) if m is not None]
    tracker.track_external(step.model, step.optimizer, *step.inputs(), *frozen)
    optimizer_state = tracker.get_tracker_snapshot()[torch.device("cpu")][RefType.OPT]
    start = time.perf_counter()
    with fake, tracker:
        run(step, tracker)
    log(f"{what} accounted in {time.perf_counter() - start:.0f} s")
    peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]
    reference_bytes, teacher_bytes = (
        tensor_bytes(m.parameters()) + tensor_bytes(m.buffers()) if m is not None else 0
        for m in (step.reference, step.teacher)
    )
    categories = {
        "weights": peak[RefType.PARAM] + peak[RefType.BUFFER] - reference_bytes - teacher_bytes,
        "reference weights": reference_bytes,
        "teacher weights": teacher_bytes,
        "gradients": peak[RefType.GRAD],
        "optimizer state": min(peak[RefType.OPT], optimizer_state),
        "optimizer step temporaries": max(peak[RefType.OPT] - optimizer_state, 0),
        "model activations": peak[RefType.ACT] + peak[RefType.TEMP] + peak[RefType.OTH] - tracker.head_at_peak,
        "loss head buffers": tracker.head_at_peak,
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


def measure_step(recipe: Recipe, head: type[LossHead], log=None) -> dict:
    """The same step on the CUDA GPU, random weights: torch.cuda.max_memory_allocated / max_memory_reserved over
    the micro-batch and the update (the set-up's peak reset first), and the device's used memory (context
    included) at the end.

    Args:
        recipe: the step's sizes.
        head: the loss head's class.
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
    """The rollout's memory beside the step: the weights (policy, reference, teacher), the optimizer state (it lives
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
        "teacher weights": c["teacher weights"],
        "optimizer state": step["optimizer_state_bytes"],
        "kv cache": cache,
    }
    return {
        "sequences": sequences,
        "tokens": recipe.prompt_length + recipe.completion_length,
        "parts_bytes": parts,
        "total_bytes": sum(parts.values()),
    }
