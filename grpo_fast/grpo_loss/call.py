"""``grpo_fast.loss``'s call: its arguments checked into one record (``LossCall``: layer 1's ``HeadCall``, layer 2's
``LossBatch``, the options, a teacher's ``Distillation``, the scored rows; every check made, the values read in one
host synchronisation), then one dispatch (``LossCall.run``) to the path that computes it: the three-sweep trained
head (both layers in one op; a teacher's divergence in the same g), the combined head with a teacher, or layer 1 then
layer 2. ``token_loss`` (layer 2 alone) shares ``LossBatch`` and ``token_loss_metrics``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from grpo_fast.distillation.teacher import Distillation
from grpo_fast.grpo_loss import ops
from grpo_fast.grpo_loss.metrics import Metrics, metric_names
from grpo_fast.grpo_loss.ops import PreparedBatch
from grpo_fast.grpo_loss.options import LossOptions
from grpo_fast.head import paths
from grpo_fast.head.api import logprobs_and_entropy_rows
from grpo_fast.head.inputs import (
    HeadCall,
    Rows,
    check_float_tensor,
    check_same_device,
    check_shape,
    check_tensor,
)
from grpo_fast.head.transform import check_chunk, check_number

# layer 2's per-token log-prob inputs besides the policy's
LOGPROB_INPUTS = ("old_logprobs", "ref_logprobs", "sampling_logprobs")


@dataclass(frozen=True)
class LossBatch:
    """Layer 2's per-batch inputs besides the log-probs, as the caller gave them; checked once (``check``)."""

    advantages: torch.Tensor
    completion_mask: torch.Tensor
    old_logprobs: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    sampling_logprobs: torch.Tensor | None = None
    importance_weights: torch.Tensor | None = None
    num_items_in_batch: float | torch.Tensor | None = None
    entropy_threshold: float | torch.Tensor | None = None

    def check(self, shape, device, device_of, options, checks):
        """Checks of layer 2's per-batch inputs against each other and the options, named after the argument at
        fault (``device`` is the argument ``device_of``'s; value checks to ``checks``); the mask itself is checked by
        the caller (once: it costs a pass over it)."""
        B, T = shape
        check_tensor("advantages", self.advantages)
        check_tensor("completion_mask", self.completion_mask)
        check_same_device(
            [("advantages", self.advantages), ("completion_mask", self.completion_mask)]
            + [(name, getattr(self, name)) for name in LOGPROB_INPUTS + ("importance_weights",)],
            device,
            device_of,
        )
        if options.beta != 0.0 and self.ref_logprobs is None:
            raise ValueError(
                "beta != 0 needs ref_logprobs [B, T] (the reference model's log-probs, e.g. from grpo_fast.logprobs)"
            )
        if self.entropy_threshold is not None:
            check_number("entropy_threshold", self.entropy_threshold)
            if not options.entropy_mask:
                raise ValueError(
                    "entropy_threshold is only used with top_entropy_quantile < 1 (it is the quantile's "
                    "value over every process's masked entropies)"
                )
        check_float_tensor("advantages", self.advantages)
        check_shape("advantages", self.advantages, [(B,), (B, T)], lambda: f"[B] = [{B}] or [B, T] = [{B}, {T}]")
        for name in LOGPROB_INPUTS:
            x = getattr(self, name)
            if x is not None:
                check_float_tensor(name, x)
                check_shape(name, x, [shape], lambda: f"[B, T] = [{B}, {T}]")
        if self.sampling_logprobs is not None and options.off_policy_mask_threshold is None:
            raise ValueError(
                "sampling_logprobs is only used by the off-policy mask: set off_policy_mask_threshold "
                "(for the sampler's importance weights, pass grpo_fast.sampling_importance_weights(...) "
                "as importance_weights)"
            )
        iw = self.importance_weights
        if iw is not None:
            check_float_tensor("importance_weights", iw)
            check_shape(
                "importance_weights", iw, [(B,), (B, 1), (B, T)], lambda: f"[B] = [{B}], [B, 1] or [B, T] = [{B}, {T}]"
            )
            if options.loss_type_record.policy_term.importance_weights_in_term and iw.shape != (B, T):
                raise ValueError(
                    f"loss_type={options.loss_type!r} takes per-token importance_weights [B, T] (TRL's "
                    f"token_truncate or token_mask modes), got shape {tuple(iw.shape)}: TRL rejects VESPO "
                    "with sequence-level importance sampling"
                )
        n_items = self.num_items_in_batch
        if n_items is None:
            return
        if not isinstance(n_items, torch.Tensor):
            check_number("num_items_in_batch", n_items, lambda v: v >= 0, "a number >= 0")
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

    def prepared(self, logprobs, entropy, options):
        """The batch as layer 2 computes on it (an ``PreparedBatch``): detached fp32 contiguous tensors but the
        log-probs and entropy (fp32, their gradient flowing), [B, 1] weights as [B], no reference log-probs without a KL
        term, num_items_in_batch and entropy_threshold fp32 scalar tensors on the log-probs' device (a number is written
        there, not read back)."""
        device = logprobs.device

        def fp32(x):
            return x.detach().float().contiguous() if x is not None else None

        iw = fp32(self.importance_weights)
        if iw is not None and iw.dim() == 2 and iw.shape[1] == 1 and self.completion_mask.shape[1] != 1:
            iw = iw.squeeze(1)  # [B, 1]: one weight per sequence

        def scalar(x):
            if x is None:
                return None
            if isinstance(x, torch.Tensor):
                return x.detach().reshape(()).to(device=device, dtype=torch.float32)
            return torch.full((), float(x), dtype=torch.float32, device=device)

        return PreparedBatch(
            logp=logprobs.float(),
            entropy=entropy.float() if entropy is not None else None,
            advantages=fp32(self.advantages),
            mask=self.completion_mask.to(torch.float32).contiguous(),
            old_logprobs=fp32(self.old_logprobs),
            ref_logprobs=fp32(self.ref_logprobs) if options.beta != 0.0 else None,
            sampling_logprobs=fp32(self.sampling_logprobs),
            importance_weights=iw,
            num_items_in_batch=scalar(self.num_items_in_batch),
            entropy_threshold=scalar(self.entropy_threshold),
        )


def token_loss_metrics(prepared: PreparedBatch, options: LossOptions, backend) -> tuple[torch.Tensor, Metrics]:
    """Layer 2 on checked, prepared inputs (``LossBatch.prepared``): the token-loss op by ``backend``'s token loss
    (the token kernel or its torch twin); the metrics a Metrics dict of fp32 device scalars."""
    total, metric_values, _, _ = ops.token_loss(prepared, options, backend.name)
    metrics = Metrics.of(metric_names(options, prepared.entropy is not None), metric_values)
    metrics.logprobs = prepared.logp.detach()
    metrics.entropies = prepared.entropy.detach() if prepared.entropy is not None else None
    return total, metrics


def distillation_metric(metrics: Metrics, div: torch.Tensor, mask: torch.Tensor) -> None:
    """metrics["distillation_loss"]: the mean divergence [B, T] over the scored tokens (``mask``), detached (TRL's
    SDPO trainer logs that mean under this name)."""
    mask = mask.bool()
    with torch.no_grad():
        metrics["distillation_loss"] = torch.where(mask, div, 0.0).sum() / mask.sum().clamp(min=1).float()


@dataclass(frozen=True)
class LossCall:
    """A checked call of ``grpo_fast.loss`` (module docstring)."""

    head: HeadCall
    batch: LossBatch
    options: LossOptions
    trained_head_chunk: int | None
    distillation: Distillation | None
    # the sampler's importance weights of the read rows, computed in the call (grpo_loss.sampling's
    # CheckedCorrection.weights), or None
    importance_weights_of: Callable[[Rows, torch.Tensor], torch.Tensor] | None = None

    @classmethod
    def check(
        cls,
        head: HeadCall,
        batch: LossBatch,
        options: LossOptions,
        trained_head_chunk: int | None,
        distillation: Distillation | None,
        importance_weights_of: Callable[[Rows, torch.Tensor], torch.Tensor] | None = None,
    ) -> LossCall:
        """Every check of a call beyond layer 1's (``head``'s): the batch against the options, the trained head's
        chunk, the teacher against the student (the value checks queued on ``head.checks``)."""
        batch.check(head.shape, head.hidden.device, "hidden", options, head.checks)
        _check_trained_head_chunk(trained_head_chunk, head, options)
        if distillation is not None:
            distillation.check_against(head)
        return cls(head, batch, options, trained_head_chunk, distillation, importance_weights_of)

    def run(self) -> tuple[torch.Tensor, Metrics]:
        """(loss, Metrics): the scored rows, every value check read at once (the call's one host synchronisation),
        then the path the call takes (module docstring)."""
        rows = self.head.rows()
        if self.importance_weights_of is not None:  # the sampler's weights, over its support (grpo_loss.sampling)
            weights = self.importance_weights_of(rows, self.batch.completion_mask)
            batch = replace(self.batch, importance_weights=weights)
            return replace(self, batch=batch, importance_weights_of=None)._run(rows)
        return self._run(rows)

    def _run(self, rows: Rows) -> tuple[torch.Tensor, Metrics]:
        if self.head.shard is None and self.options.token_local:
            fused = self._trained_head(rows)
            if fused is not None:
                return fused
        head, options = self.head, self.options
        if self.distillation is not None:
            logp, entropy, div = self.distillation.logprobs_entropy_divergence(head, rows)
            prepared = self.batch.prepared(logp, entropy, options)
            total, metrics = token_loss_metrics(prepared, options, head.backend)
            # the per-token loss gains coef * divergence before the loss type's reduction (a linear one)
            total = total + self.distillation.coef * options.aggregate(div, prepared.mask, prepared.num_items_in_batch)
            distillation_metric(metrics, div, prepared.mask)
            return total, metrics
        # the entropy trains only through the entropy bonus: without one, a frozen head takes the two-sweep path
        head_path = head.head_path if options.entropy_coef == 0.0 else "general"
        logp, entropy = logprobs_and_entropy_rows(head, rows, head_path)
        return token_loss_metrics(self.batch.prepared(logp, entropy, options), options, head.backend)

    def _trained_head(self, rows: Rows):
        """Both layers in one op with the three-sweep trained head (``ops.trained_head_loss``) where it is taken
        (``paths.takes_trained_head``; the options are token-local), else None: (loss, Metrics). With a teacher: RL
        and distillation in one call (both models' logits of a chunk once, the divergence's gradient in the same
        g)."""
        head, options, teacher = self.head, self.options, self.distillation
        if teacher is not None and not isinstance(teacher, Distillation):
            return None  # a served teacher: its own head beside layer 1's (served.api.ServedDistillation)
        grad = torch.is_grad_enabled()
        needs = [
            grad and x is not None and x.requires_grad for x in (head.hidden, head.weight, head.targets, head.bias)
        ]
        lora, frozen_weight = head.lora is not None, teacher is not None
        if not paths.takes_trained_head(needs, head.hidden, head.backend, head.head_path, lora, frozen_weight):
            return None
        student = head.operands(rows)
        if student.hidden.shape[0] == 0:  # every row masked: the general path's empty case
            return None
        operands = ops.LinearOpOperands.of(student._replace(lora=None), head.backend.name)
        B, T = head.shape
        positions = rows.order if rows.order is not None else torch.arange(B * T, device=head.hidden.device)
        placeholder = torch.zeros(0, dtype=torch.float32, device=head.hidden.device)  # the op makes the log-probs
        prepared = self.batch.prepared(placeholder, None, options)
        teacher_operands = None
        if teacher is not None:
            teacher_head = teacher.head(rows, student.transform.temperature)
            _, softcap, logit_scale = teacher_head.transform.as_floats()
            teacher_operands = ops.TeacherOperands(*teacher_head[:3], softcap, logit_scale, teacher.coef, teacher.beta)
        total, metric_values, logp, entropy, div = ops.trained_head_loss(
            operands,
            positions,
            rows.keep,
            prepared,
            options,
            head.backend.name,
            self.trained_head_chunk,
            teacher_operands,
            needs[1] or needs[3],
        )
        metrics = Metrics.of(metric_names(options, True), metric_values)
        metrics.logprobs, metrics.entropies = logp.detach(), entropy.detach()
        if teacher is not None:
            distillation_metric(metrics, div, prepared.mask)
        return total, metrics


def _check_trained_head_chunk(chunk, head: HeadCall, options: LossOptions):
    """``trained_head_chunk``: None, or a positive int for a call the three-sweep head can run (``loss``; a frozen
    weight or no gradient at all runs no head that forms gradients, and the chunk has nothing to size)."""
    check_chunk("trained_head_chunk", chunk, "tokens per chunk")
    if chunk is None:
        return
    dtype, backend = head.hidden.dtype, head.backend
    conflicts = [
        (not backend.three_sweep_heads, f"the {backend.name} backend"),
        (dtype not in paths.TRAINED_HEAD_DTYPES, f"{str(dtype).removeprefix('torch.')} inputs"),
        (head.head_path == "general", 'head_path="general"'),
        (head.lora is not None, "lora"),
        (head.shard is not None, "vocab_parallel"),
        (not options.token_local, "options that are not token-local (LossOptions.token_local)"),
    ]
    for conflict, name in conflicts:
        if conflict:
            raise ValueError(f"trained_head_chunk sizes the three-sweep trained head, which {name} does not run")
