"""The loss heads a step is estimated with, and the workspace of grpo_fast's custom ops that the tracker adds.

A head takes the model's last hidden states of the completion tokens and the lm_head's weight, and gives the
micro-batch's GRPO loss. Every head scores its log-probs with the loss the product runs (``grpo_fast.token_loss``,
or ``grpo_fast.loss`` for both layers), so heads differ in their log-probs only. Built in: eager PyTorch's full
logits and grpo_fast's fused head; another head (a peer's) is a ``LossHead`` subclass handed to the estimate.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import torch
from torch import nn

from grpo_fast.grpo_loss import api as loss_api
from grpo_fast.grpo_loss.options import LossOptions
from grpo_fast.memory.recipe import Gpu, Recipe


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
    """

    targets: torch.Tensor
    advantages: torch.Tensor
    mask: torch.Tensor
    ref_logprobs: torch.Tensor | None
    num_items: torch.Tensor
    kept_ids: torch.Tensor | None = None


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


# the heads grpo_fast itself provides, by the name the command line takes
HEADS = {"eager": EagerHead, "grpo_fast": GrpoFastHead}


def weight_cast_bytes(bound) -> int:
    """The copy of a weight that a grpo_fast op casts to its hidden states' dtype for the GEMMs (an fp32 master
    weight over bf16 hidden states: ``kernels.operands.gemm_weight``), held while the op runs: V x D in the hidden
    states' dtype, the policy's and a teacher's; 0 where the dtypes match. ``bound``: the op's arguments by name."""
    total = 0
    for prefix in ("", "teacher_"):
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
    if op in ("sampler_support", "sampler_support_backward"):
        from grpo_fast.memory import support_workspace

        return support_workspace.workspace_of(op, bound)
    if op == "token_loss":
        from grpo_fast.grpo_loss import ops as loss_ops

        return loss_ops.workspace_bytes(tuple(bound["logp"].shape), backend=bound["backend"])
    if op == "trained_head_loss":
        from grpo_fast.grpo_loss import ops as loss_ops

        hidden = bound["hidden"]
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
