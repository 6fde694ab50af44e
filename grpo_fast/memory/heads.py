"""The loss heads a step is estimated with, and the workspace of grpo_fast's custom ops that the tracker adds.

A head takes the model's last hidden states of the completion tokens and the lm_head's weight, and gives the
micro-batch's GRPO loss. Every head scores its log-probs with the loss the product runs (``grpo_fast.token_loss``,
or ``grpo_fast.loss`` for both layers), so heads differ in their log-probs only. Built in: eager PyTorch's full
logits and grpo_fast's fused head (``HEADS``, the default comparison); grpo_fast's distillation heads
(``DISTILLATION_HEADS``: ``distillation_loss`` against a teacher model in the process, RL and distillation in one
``loss`` call, ``served_distillation_loss`` against a served teacher's top-k log-probs), on request; another head (a
peer's) is a ``LossHead`` subclass handed to the estimate.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import torch
from torch import nn

from grpo_fast.distillation import api as distillation_api
from grpo_fast.distillation.teacher import Teacher
from grpo_fast.grpo_loss import api as loss_api
from grpo_fast.grpo_loss.options import LossOptions
from grpo_fast.memory.recipe import Gpu, Recipe
from grpo_fast.served import api as served_api
from grpo_fast.served.teacher import ServedTeacher


@dataclass
class Batch:
    """One micro-batch's per-token inputs of the loss, besides hidden states and weight.

    Attributes:
        targets: [B, T] token ids.
        advantages: [B].
        mask: [B, T] completion mask.
        ref_logprobs: [B, T] float32 with a KL term, else None.
        num_items: the rollout's completion tokens (DAPO's normaliser), a 0-dim tensor.
        kept_ids: [B, T, K] int64 the sampler's replayed kept sets (a head with ``kept_width`` K > 0), else None.
        teacher_ids: [B, T, K] int64 a served teacher's top-k ids (a head with ``teacher == "served"``), else None.
        teacher_logprobs: [B, T, K] float32 their log-probs, else None.
        teacher_hidden: [B, T, Dt] the teacher model's completion hidden states (a head with ``teacher == "model"``),
            set by the step's teacher forward, else None.
        teacher_weight: [V, Dt] the teacher's lm_head weight, set with them, else None.
    """

    targets: torch.Tensor
    advantages: torch.Tensor
    mask: torch.Tensor
    ref_logprobs: torch.Tensor | None
    num_items: torch.Tensor
    kept_ids: torch.Tensor | None = None
    teacher_ids: torch.Tensor | None = None
    teacher_logprobs: torch.Tensor | None = None
    teacher_hidden: torch.Tensor | None = None
    teacher_weight: torch.Tensor | None = None


@contextlib.contextmanager
def environment(**values):
    """Environment variables set (a value) or unset (None) for the block's duration."""
    saved = {name: os.environ.get(name) for name in values}
    for name, value in values.items():
        os.environ.pop(name, None) if value is None else os.environ.__setitem__(name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            os.environ.pop(name, None) if value is None else os.environ.__setitem__(name, value)


class LossHead(nn.Module):
    """A loss head: ``forward(hidden, weight)`` gives the micro-batch's loss.

    A subclass sets ``label`` (the report's column), ``description`` and ``packages``, and computes per-token
    log-probs in ``forward``, then returns ``self.token_loss(logp)``: the loss the product runs.

    Args:
        recipe: the step's sizes.
        batch: the micro-batch's inputs.
    """

    label = "a loss head"
    # what it computes, in the words of the report's "what is estimated"
    description = "a loss head"
    # the packages besides torch it runs on (the report gives their versions)
    packages: tuple[str, ...] = ()
    # the estimate also accounts the old policy's no-grad pass (``forward`` with ``in_old_policy_pass`` set returns
    # its log-probs): grpo_fast.memory.sampler's head
    old_policy_pass = False
    in_old_policy_pass = False
    # K of the replayed kept sets [B, T, K] the batch carries for the head (0: none)
    kept_width = 0
    # the teacher the head distils from: None; "model", a teacher model in the process (the step builds it, runs its
    # forward without gradients and hands its hidden states and lm_head to the head through the batch); "served", a
    # served teacher's top-k log-probs ([B, T, K] rollout inputs, K the recipe's teacher_top_k)
    teacher: str | None = None

    def __init__(self, recipe: Recipe, batch: Batch):
        super().__init__()
        self.recipe, self.batch = recipe, batch

    def options(self):
        """The loss the step trains with: DAPO's normaliser, the recipe's KL coefficient and clip range.

        Returns:
            The ``grpo_fast.LossOptions``.
        """
        return LossOptions(
            loss_type="dapo",
            beta=self.recipe.beta,
            epsilon=self.recipe.epsilon,
            max_completion_length=self.recipe.completion_length,
        )

    def on_fake_tensors(self):
        """The context the head's forward and backward run in over fake tensors.

        The product's loss takes its Triton path, which refuses CPU tensors unless Triton's interpreter is on; over
        fake tensors no kernel runs (the custom ops' fake implementations do), so the interpreter's flag is set.

        Returns:
            A context manager under which the head allocates what it would on a GPU.
        """
        return environment(TRITON_INTERPRET="1")

    def token_loss(self, logp: torch.Tensor) -> torch.Tensor:
        """The GRPO loss of per-token log-probs, by the product's token loss (its Triton path), one iteration.

        Args:
            logp: [B, T] float32 log-probs of the targets, carrying the gradient.

        Returns:
            The scalar loss.
        """
        value, _ = loss_api.token_loss(
            logp,
            self.batch.advantages,
            self.batch.mask,
            ref_logprobs=self.batch.ref_logprobs,
            num_items_in_batch=self.batch.num_items,
            options=self.options(),
            backend="triton",
        )
        return value

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
    (a ``logits_to_keep`` of the completion length).

    Args:
        recipe: the step's sizes.
        batch: the micro-batch's inputs.
    """

    label = "eager PyTorch (full logits)"
    description = (
        "eager PyTorch's full logits of the completion positions as a plain training loop writes them (in bf16, "
        "upcast to fp32, log_softmax, gather; a loop taking model(...).logits of whole sequences pays (prompt + "
        "completion) / completion times more)"
    )

    def forward(self, hidden, weight):
        """The micro-batch's loss (LossHead.forward)."""
        logits = (hidden @ weight.to(hidden.dtype).T).float() / self.recipe.temperature  # autocast's cast
        logp = logits.log_softmax(-1).gather(-1, self.batch.targets.unsqueeze(-1)).squeeze(-1)
        return self.token_loss(logp)


class GrpoFastHead(LossHead):
    """``grpo_fast.loss`` on its Triton path, both layers in one call (a frozen lm_head takes the frozen-head path,
    as "auto" chooses).

    Args:
        recipe: the step's sizes.
        batch: the micro-batch's inputs.
    """

    label = "grpo_fast (Triton path)"
    description = "grpo_fast.loss's Triton path (both layers in one call)"

    def forward(self, hidden, weight):
        """The micro-batch's loss (LossHead.forward)."""
        value, _ = loss_api.loss(
            hidden,
            weight,
            self.batch.targets,
            self.batch.advantages,
            self.batch.mask,
            ref_logprobs=self.batch.ref_logprobs,
            options=self.options(),
            temperature=self.recipe.temperature,
            num_items_in_batch=self.batch.num_items,
            backend="triton",
        )
        return value


# the divergence's weight in RL + distillation's per-token loss: TRL's GRPO has no such coefficient, and its value
# changes no tensor's size (any number > 0 gives the same estimate)
DISTILLATION_COEF = 1.0


class DistillationHead(LossHead):
    """``grpo_fast.distillation_loss`` on its Triton path: the student's divergence from a teacher model run in the
    process (its hidden states and lm_head), TRL's DistillationTrainer's loss (beta 1, its default), the gradients
    formed in the forward. The batch's RL inputs are unused: the loss is the divergence alone.

    Args:
        recipe: the step's sizes.
        batch: the micro-batch's inputs.
    """

    label = "grpo_fast.distillation_loss"
    description = (
        "grpo_fast.distillation_loss's Triton path against a teacher model in the process (its forward without "
        "gradients, then both heads' logits chunk by chunk)"
    )
    teacher = "model"

    def forward(self, hidden, weight):
        """The micro-batch's loss (LossHead.forward)."""
        value, _, _ = distillation_api.distillation_loss(
            hidden,
            weight,
            self.batch.teacher_hidden,
            self.batch.teacher_weight,
            self.batch.mask,
            num_items_in_batch=self.batch.num_items,
            temperature=self.recipe.temperature,
            backend="triton",
        )
        return value


class RlDistillationHead(LossHead):
    """``grpo_fast.loss(..., teacher=grpo_fast.Teacher(hidden, weight))``: RL and distillation in one call on its
    Triton path, the teacher a model in the process (``DISTILLATION_COEF``: its weight).

    Args:
        recipe: the step's sizes.
        batch: the micro-batch's inputs.
    """

    label = "grpo_fast.loss + teacher"
    description = "grpo_fast.loss's Triton path with teacher=grpo_fast.Teacher (RL and distillation in one call)"
    teacher = "model"

    def forward(self, hidden, weight):
        """The micro-batch's loss (LossHead.forward)."""
        value, _ = loss_api.loss(
            hidden,
            weight,
            self.batch.targets,
            self.batch.advantages,
            self.batch.mask,
            ref_logprobs=self.batch.ref_logprobs,
            options=self.options(),
            temperature=self.recipe.temperature,
            num_items_in_batch=self.batch.num_items,
            backend="triton",
            teacher=Teacher(self.batch.teacher_hidden, self.batch.teacher_weight),
            distillation_coef=DISTILLATION_COEF,
        )
        return value


class ServedDistillationHead(LossHead):
    """``grpo_fast.served_distillation_loss`` on its Triton path: the divergence from a served teacher's top-k
    log-probs (``grpo_fast.ServedTeacher``, the recipe's teacher_top_k entries a token; TRL's async trainer's
    forward KL, beta 0), no teacher model in the process.

    Args:
        recipe: the step's sizes.
        batch: the micro-batch's inputs.
    """

    label = "grpo_fast.served_distillation_loss"
    description = (
        "grpo_fast.served_distillation_loss's Triton path against a served teacher's top-k log-probs (no teacher "
        "model in the process)"
    )
    teacher = "served"

    def forward(self, hidden, weight):
        """The micro-batch's loss (LossHead.forward)."""
        value, _, _ = served_api.served_distillation_loss(
            hidden,
            weight,
            ServedTeacher(self.batch.teacher_ids, self.batch.teacher_logprobs),
            self.batch.mask,
            num_items_in_batch=self.batch.num_items,
            targets=self.batch.targets,
            temperature=self.recipe.temperature,
            backend="triton",
        )
        return value


# the heads grpo_fast itself provides, by the name the command line takes: the default comparison, and the
# distillation heads on request (--heads)
HEADS = {"eager": EagerHead, "grpo_fast": GrpoFastHead}
DISTILLATION_HEADS = {
    "distillation": DistillationHead,
    "rl_distillation": RlDistillationHead,
    "served_distillation": ServedDistillationHead,
}


def weight_cast_bytes(bound) -> int:
    """The copy of a weight that a grpo_fast op casts to its hidden states' dtype for the GEMMs (an fp32 master
    weight over bf16 hidden states: ``kernels.operands.gemm_weight``), held while the op runs: V x D in the hidden
    states' dtype, the policy's and a teacher's; 0 where the dtypes match. ``bound``: the op's arguments by name."""
    total = 0
    for prefix in ("", "student_", "teacher_"):
        hidden, weight = bound.get(prefix + "hidden"), bound.get(prefix + "weight")
        if isinstance(hidden, torch.Tensor) and isinstance(weight, torch.Tensor) and weight.dtype != hidden.dtype:
            total += weight.numel() * hidden.element_size()
    return total


def workspace_bytes(func, args, kwargs, gpu: Gpu) -> int:
    """The bytes a grpo_fast custom op's real implementation allocates besides its outputs on ``gpu`` (its fake
    implementation allocates the outputs only), its weight's cast copy included (``weight_cast_bytes``); 0 for any
    other op."""
    schema = getattr(func, "_schema", None)
    if schema is None or not schema.name.startswith("grpo_fast::"):
        return 0
    bound = dict(zip((a.name for a in schema.arguments), args), **kwargs)
    return weight_cast_bytes(bound) + _implementation_bytes(schema.name.split("::", 1)[1], bound, gpu)


def _implementation_bytes(op: str, bound: dict, gpu: Gpu) -> int:
    """``workspace_bytes`` of op ``op`` (its name after ``grpo_fast::``) but the weight's cast copy."""
    if op == "gathered_logits":
        return 0  # K weight rows gathered into [N, K] logits: the output only
    if op == "gathered_logits_backward":  # the gradients scattered back: the sort of dW's pairs (Triton's)
        dw = bound["need_weight"] or bound["need_lora_weight"]
        return _backend(bound["backend"]).gathered_backward_workspace_bytes(tuple(bound["ids"].shape)) if dw else 0
    if op == "divergence_loss":
        return _divergence_loss_workspace(bound, bound["backend"], bound["token_chunk"])
    if op == "served_trained_loss":
        hidden, ids = bound["hidden"], tuple(bound["ids"].shape)
        (N, D), rows_once = tuple(hidden.shape), bound["beta"] == 0.0
        # beta 0 (served.ops: the rows read once a chunk): a chunk's logits, dz/du and row sums P and T beside the
        # head's chunk, then dH's sparse part [N, D] fp32 and the live ids (int64) and teacher's entry gradient
        # (fp32) over [N, K']
        head = _backend(bound["backend"]).trained_head_workspace_bytes(
            (N, D), bound["weight"].shape[0], hidden.dtype, bound["token_chunk"] or None,
            (2 * D + 2 * ids[1]) * 4 if rows_once else 0,
        )  # fmt: skip
        # the gathered logits [N, K'] (at beta 0: dz/du) and their sparse gradient, fp32; then dW's sort
        dw = _backend(bound["backend"]).gathered_backward_workspace_bytes(ids) if bound["need_weight"] else 0
        held = N * D * 4 + bound["ids"].numel() * (8 + 4) if rows_once else 0
        return max(head, dw) + 2 * bound["ids"].numel() * 4 + held
    if op in UNMODELLED_OPS:
        raise NotImplementedError(
            f"grpo_fast::{op} has no workspace model here (the estimate would leave its buffers out): the memory "
            "estimator's heads run the fused distillation paths (grpo_fast::divergence_loss, trained_head_loss)"
        )
    if op in ("sampler_support", "sampler_support_backward"):
        from grpo_fast.memory import support_workspace

        return support_workspace.workspace_of(op, bound)
    if op == "token_loss":
        from grpo_fast.grpo_loss import ops as loss_ops

        return loss_ops.workspace_bytes(tuple(bound["logp"].shape), backend=bound["backend"])
    if op == "trained_head_loss":
        from grpo_fast.grpo_loss import ops as loss_ops

        hidden = bound["hidden"]
        if bound.get("teacher_hidden") is not None:  # RL and distillation in one call: the divergence loss's buffers
            B, T = bound["mask"].shape
            return (
                _divergence_loss_workspace(bound, bound["token_backend"], bound["token_chunk"])
                + loss_ops.workspace_bytes((B, T), backend=bound["token_backend"])
                + B * T * 4
            )
        shape = (tuple(hidden.shape), bound["weight"].shape[0], hidden.dtype, tuple(bound["mask"].shape))
        return loss_ops.trained_head_workspace_bytes(
            *shape, backend=bound["token_backend"], token_chunk=bound["token_chunk"]
        )
    from grpo_fast.head import ops as head_ops

    hidden = bound["hidden"]
    return head_ops.workspace_bytes(
        op,
        tuple(hidden.shape),
        bound["weight"].shape[0],
        hidden.dtype,
        backend=bound["backend"],
        frozen_head=bool(bound.get("frozen_head", False)),
        backward_mode=bound["backward_mode"],
        device_type="cuda",
        compute_capability=gpu.compute_capability,
    )


# grpo_fast's ops whose real implementations' buffers no model here gives (the divergence's general path, the
# combined RL + distillation head's general path, several teachers' loss): an estimate that runs one stops rather
# than leave them out
UNMODELLED_OPS = (
    "divergence_forward",
    "divergence_backward",
    "loss_head_forward",
    "loss_head_backward",
    "routed_divergence_loss",
)


def _backend(name: str):
    from grpo_fast.backends.resolver import named

    return named(name)


def _divergence_loss_workspace(bound: dict, backend: str, token_chunk: int) -> int:
    """The divergence loss's chunk buffers (the backend's ``divergence_loss_workspace_bytes``) for an op's bound
    arguments: the student's rows under ``student_hidden`` or ``hidden``, its head under ``student_weight`` or
    ``weight``; its gradients are always formed here (the step's student trains)."""
    hidden = bound.get("student_hidden", bound.get("hidden"))
    weight = bound.get("student_weight", bound.get("weight"))
    return _backend(backend).divergence_loss_workspace_bytes(
        tuple(hidden.shape), weight.shape[0], hidden.dtype, token_chunk or None
    )
