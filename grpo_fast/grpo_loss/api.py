"""The GRPO loss's public functions: ``loss`` (layer 1 and layer 2 in one call, optionally with a teacher's
divergence), ``token_loss`` (layer 2 on given log-probs) and ``sampling_importance_weights``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from typing_extensions import Unpack

from grpo_fast.distillation import teacher as teacher_head
from grpo_fast.distillation.teacher import Teacher
from grpo_fast.grpo_loss import ops
from grpo_fast.grpo_loss.metrics import metric_names
from grpo_fast.grpo_loss.options import (
    IMPORTANCE_SAMPLING_MODES,
    ImportanceSamplingMode,
    LossOptionKeywords,
    LossOptions,
)
from grpo_fast.grpo_loss.options import check_number as _number
from grpo_fast.head import backends as head_backends
from grpo_fast.head import inputs
from grpo_fast.head import ops as head_ops
from grpo_fast.head import vocab_parallel as vocab_parallel_head
from grpo_fast.head.api import logprobs_and_entropy_rows
from grpo_fast.head.lora import HeadLora
from grpo_fast.head.transform import LogitTransform, check_chunk
from grpo_fast.head.vocab_parallel import VocabShard
from grpo_fast.kernels.operands import HeadOperands


class Metrics(dict):
    """The metrics of ``loss`` and ``token_loss``: detached float32 scalars under TRL's names.

    Attributes:
        logprobs: [B, T] float32, detached: the policy's per-token log-probs (zeros where the mask is 0).
        entropies: [B, T] float32, detached, or None when no entropy was computed.
    """

    logprobs: torch.Tensor
    entropies: torch.Tensor


# ----------------------------------------------------------------------------------------------- layer 2
@dataclass(frozen=True)
class _LossBatch:
    """Layer 2's per-batch inputs besides the log-probs, as the caller gave them; checked once by _check_batch."""

    advantages: torch.Tensor
    completion_mask: torch.Tensor
    old_logprobs: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    sampling_logprobs: torch.Tensor | None = None
    importance_weights: torch.Tensor | None = None
    num_items_in_batch: float | torch.Tensor | None = None
    entropy_threshold: float | None = None


def loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    advantages: torch.Tensor,
    completion_mask: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    old_logprobs: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
    sampling_logprobs: torch.Tensor | None = None,
    importance_weights: torch.Tensor | None = None,
    num_items_in_batch: float | torch.Tensor | None = None,
    entropy_threshold: float | torch.Tensor | None = None,
    temperature: float = 1.0,
    softcap: float | None = None,
    logit_scale: float = 1.0,
    options: LossOptions | None = None,
    head_path: str = "auto",
    backward_mode: str = "chunked",
    trained_head_chunk: int | None = None,
    lora: HeadLora | tuple | None = None,
    vocab_parallel: VocabShard | None = None,
    backend: str = "auto",
    check_values: bool = True,
    teacher: Teacher | None = None,
    distillation_coef: float | None = None,
    distillation_beta: float | None = None,
    **option_keywords: Unpack[LossOptionKeywords],
) -> tuple[torch.Tensor, Metrics]:
    """The GRPO loss (TRL 1.16 semantics) from the policy's last hidden states, without full-vocab logits.

    Layer 1 (``logprobs_and_entropy``) then layer 2 (``token_loss``) over the tokens with completion_mask 1; a
    vocab-parallel head gives every rank the unsharded loss and metrics. The loss options are TRL's
    ``GRPOConfig`` keywords with its defaults, by name (``**option_keywords``, typed by
    [LossOptionKeywords][grpo_fast.LossOptionKeywords]) or as one object (``options``);
    [LossOptions][grpo_fast.LossOptions] documents each ([loss options](../options.md)). With a ``teacher``: RL and
    distillation in one call; the per-token loss gains ``distillation_coef`` times the divergence from the teacher
    (``grpo_fast.divergence``) before the loss type's reduction, computed from the same student tiles as the
    log-probs, and ``metrics["distillation_loss"]`` is its mean over the scored tokens.

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
        head_path: layer 1's path, as in ``logprobs_and_entropy`` (the entropy bonus takes the general path);
            "auto" with a trained weight and token-local options (``LossOptions.token_local``) on the Triton backend,
            bf16 or fp32, without LoRA: both layers in three vocabulary sweeps (the gradients formed in the forward;
            with a teacher, its logits once per chunk beside the student's: one teacher sweep).
        backward_mode: layer 1's Triton backward, as in ``logprobs_and_entropy``.
        trained_head_chunk: tokens per chunk of the three-sweep trained head (a positive int): its fp32 logits of
            one chunk over the vocabulary, chunk x V x 4 bytes, are its largest buffer. None: the chunk whose logits
            are about the weight's size (768 tokens at Qwen2.5-1.5B's bf16 head, 467 MB). With a teacher: tokens per
            gradient GEMM, chunk x V x (2 + 4) bytes (g in the student's dtype, 4 + 4 from fp32; both models' fp32
            logits of half the chunk; None: half the student's width rounded down to 128). Only where the
            three-sweep head can run: the Triton backend, bf16 or fp32, not with ``head_path="general"``, LoRA,
            ``vocab_parallel`` or options that are not token-local.
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
    checks = inputs.ValueChecks(check_values, hidden, targets, completion_mask)
    B, T, _, _ = inputs.check_linear(hidden, weight, targets, bias, completion_mask, checks, shard)
    lora = inputs.checked_lora(lora, hidden, weight, shard)
    transform = LogitTransform.from_keywords(temperature, softcap, logit_scale)
    batch = _LossBatch(
        advantages,
        completion_mask,
        old_logprobs,
        ref_logprobs,
        sampling_logprobs,
        importance_weights,
        num_items_in_batch,
        entropy_threshold,
    )
    _check_batch(batch, (B, T), hidden.device, "hidden", options, checks)
    backend = inputs.resolve_backend(backend, hidden.device)
    backend.check_sizes(B * T, weight.shape[0])
    head_path = inputs.layer1_choices(head_path, backward_mode, backend)
    _check_trained_head_chunk(trained_head_chunk, hidden.dtype, backend, head_path, lora, shard, options)
    if distillation is not None:
        _check_teacher(teacher, hidden, weight, shard)
    rows = inputs.scored_rows(completion_mask, checks)
    if shard is None and options.token_local:
        fused = _trained_head(
            hidden,
            weight,
            targets,
            bias,
            rows,
            transform,
            backend,
            head_path,
            lora,
            batch,
            options,
            trained_head_chunk,
            (teacher, distillation) if distillation is not None else None,
        )
        if fused is not None:
            return fused
    if distillation is not None:
        logp, entropy, div = _with_teacher(
            hidden, weight, targets, bias, teacher, rows, transform, distillation[1], backend
        )
        prepared = _prepared(logp, entropy, batch, options)
        total, metrics = _token_loss(prepared, options, backend)
        return _add_distillation(total, metrics, div, distillation[0], prepared, options)
    # the entropy trains only through the entropy bonus: without one, a frozen head takes the two-sweep path
    logp, entropy = logprobs_and_entropy_rows(
        hidden,
        weight,
        targets,
        bias,
        rows,
        transform,
        backend,
        head_path if options.entropy_coef == 0.0 else "general",
        backward_mode,
        shard,
        lora,
    )
    return _token_loss(_prepared(logp, entropy, batch, options), options, backend)


def _trained_head(
    hidden, weight, targets, bias, rows, transform, backend, head_path, lora, batch, options, chunk, teacher=None
):
    """Both layers in one op with the three-sweep trained head (``ops.trained_head_loss``) where it is taken
    (``backends.takes_trained_head``; the options are token-local), else None: (loss, Metrics). ``teacher``: (the
    Teacher, (distillation_coef, distillation_beta)) for RL and distillation in one call (both models' logits of a
    chunk once, the divergence's gradient in the same g), or None."""
    B, T = targets.shape
    grad = torch.is_grad_enabled()
    needs = [grad and x is not None and x.requires_grad for x in (hidden, weight, targets, bias)]
    if not head_backends.takes_trained_head(needs, hidden, backend, head_path, lora is not None, teacher is not None):
        return None
    h, w, y, b = inputs.flat_inputs(hidden, weight, targets, bias, rows)
    if h.shape[0] == 0:  # every row masked: the general path's empty case
        return None
    operands = head_ops.LinearOpOperands.of(HeadOperands(h, w, y, b, transform), backend.name)
    positions = rows.order if rows.order is not None else torch.arange(B * T, device=hidden.device)
    placeholder = torch.zeros(0, dtype=torch.float32, device=hidden.device)  # the op makes the [B, T] log-probs
    prepared = _prepared(placeholder, None, batch, options)
    teacher_rows = _teacher_operands(*teacher, rows) if teacher is not None else None
    total, metric_values, logp, entropy, div = ops.trained_head_loss(
        operands, positions, rows.keep, prepared, options, backend.name, chunk, teacher_rows, needs[1] or needs[3]
    )
    metrics = Metrics(zip(metric_names(options, True), metric_values.detach().unbind(0)))
    metrics.logprobs, metrics.entropies = logp.detach(), entropy.detach()
    if teacher is not None:
        _distillation_metric(metrics, div, prepared.mask)
    return total, metrics


def _teacher_operands(teacher, distillation, rows):
    """The trained head op's TeacherOperands: the teacher's scored rows (inputs.Rows) and head, (coef, beta)."""
    hidden = inputs.row_values(teacher.hidden.reshape(-1, teacher.hidden.shape[-1]), rows)
    bias = teacher.bias.contiguous() if teacher.bias is not None else None
    return ops.TeacherOperands(
        hidden.contiguous(),
        teacher.weight.contiguous(),
        bias,
        None if teacher.softcap is None else float(teacher.softcap),
        float(teacher.logit_scale),
        *distillation,
    )


def _check_trained_head_chunk(chunk, dtype, backend, head_path, lora, shard, options):
    """``trained_head_chunk``: None, or a positive int for a call the three-sweep head can run (``loss``; a frozen
    weight or no gradient at all runs no head that forms gradients, and the chunk has nothing to size)."""
    check_chunk("trained_head_chunk", chunk, "tokens per chunk")
    if chunk is None:
        return
    conflicts = [
        (not backend.trained_head, f"the {backend.name} backend"),
        (dtype not in head_backends.TRAINED_HEAD_DTYPES, f"{str(dtype).removeprefix('torch.')} inputs"),
        (head_path == "general", 'head_path="general"'),
        (lora is not None, "lora"),
        (shard is not None, "vocab_parallel"),
        (not options.token_local, "options that are not token-local (LossOptions.token_local)"),
    ]
    for conflict, name in conflicts:
        if conflict:
            raise ValueError(f"trained_head_chunk sizes the three-sweep trained head, which {name} does not run")


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


def _check_teacher(teacher, hidden, weight, shard):
    """The teacher's tensors and numbers against the student's ``hidden`` [B, T, Ds] and ``weight`` [V, Ds], on a
    head (``shard``: vocab-parallel) the combined head supports."""
    if shard is not None:
        raise ValueError(
            "a vocab-parallel head (a sharded DTensor weight) with a teacher is not supported: the "
            "combined head runs on one process (call grpo_fast.loss and grpo_fast.divergence separately)"
        )
    B, T, _ = hidden.shape
    Bt, Tt, _, Vt = inputs.check_head(
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
    inputs.check_same_device(
        [("teacher.hidden", teacher.hidden), ("teacher.weight", teacher.weight), ("teacher.bias", teacher.bias)],
        hidden.device,
        "hidden",
    )
    if teacher.softcap is not None:
        _number("teacher.softcap", teacher.softcap, lambda v: v > 0, "None or a positive number (Gemma 2: 30.0)")
    _number("teacher.logit_scale", teacher.logit_scale, lambda v: v != 0, "a finite non-zero number")


def _with_teacher(hidden, weight, targets, bias, teacher, rows, transform, distillation_beta, backend):
    """Layer 1 with the teacher's divergence: (logp, entropy, divergence) [B, T] fp32."""
    B, T = targets.shape
    h, w, y, b = inputs.flat_inputs(hidden, weight, targets, bias, rows)
    ht = inputs.row_values(teacher.hidden.reshape(-1, teacher.hidden.shape[-1]), rows)
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
    return tuple(inputs.scatter_rows(x, rows, (B, T)) for x in out)


def _add_distillation(total, metrics, div, coef, prepared, options):
    """GRPO's loss and metrics plus the distillation term: loss + coef * aggregate(divergence) (the per-token loss
    gains coef * divergence before the loss type's reduction), metrics["distillation_loss"] the mean divergence over
    the scored tokens (TRL's SDPO trainer logs that mean under this name); ``prepared``: the batch as layer 2 took it
    (``_prepared``)."""
    total = total + coef * options.aggregate(div, prepared.mask, prepared.num_items_in_batch)
    _distillation_metric(metrics, div, prepared.mask)
    return total, metrics


def _distillation_metric(metrics, div, mask):
    """metrics["distillation_loss"]: the mean divergence [B, T] over the scored tokens (``mask``), detached."""
    mask = mask.bool()
    with torch.no_grad():
        metrics["distillation_loss"] = torch.where(mask, div, 0.0).sum() / mask.sum().clamp(min=1).float()


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
        backend: "auto", "triton" (the token kernel) or "torch" (its torch twin).
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
    inputs.check_float_tensor("logprobs", logprobs)
    if logprobs.dim() != 2 or logprobs.numel() == 0:
        raise ValueError(f"logprobs must have shape [B, T] with B, T > 0, got {tuple(logprobs.shape)}")
    B, T = logprobs.shape
    batch = _LossBatch(
        advantages,
        completion_mask,
        old_logprobs,
        ref_logprobs,
        sampling_logprobs,
        importance_weights,
        num_items_in_batch,
        entropy_threshold,
    )
    checks = inputs.ValueChecks(check_values, logprobs, completion_mask)
    _check_batch(batch, (B, T), logprobs.device, "logprobs", options, checks)
    inputs.check_mask(completion_mask, (B, T), checks)
    checks.read()
    if entropy is not None:
        inputs.check_float_tensor("entropy", entropy)
        inputs.check_shape("entropy", entropy, [(B, T)], lambda: f"[B, T] = [{B}, {T}]")
        inputs.check_same_device([("entropy", entropy)], logprobs.device, "logprobs")
    elif options.entropy_mask or options.entropy_coef != 0.0:
        raise ValueError(
            "top_entropy_quantile < 1 and entropy_coef != 0 need the per-token entropy [B, T] "
            "(grpo_fast.logprobs_and_entropy gives it with its gradient)"
        )
    prepared = _prepared(logprobs, entropy, batch, options)
    return _token_loss(prepared, options, inputs.resolve_backend(backend, logprobs.device))


def _check_batch(batch, shape, device, device_of, options, checks):
    """Checks of layer 2's per-batch inputs against each other and the options, named after the argument at fault
    (``device`` is the argument ``device_of``'s; value checks to ``checks``); the mask itself is checked by the caller
    (once: it costs a pass over it)."""
    B, T = shape
    inputs.check_tensor("advantages", batch.advantages)
    inputs.check_tensor("completion_mask", batch.completion_mask)
    inputs.check_same_device(
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
    inputs.check_float_tensor("advantages", batch.advantages)
    inputs.check_shape("advantages", batch.advantages, [(B,), (B, T)], lambda: f"[B] = [{B}] or [B, T] = [{B}, {T}]")
    for name in _LOGPROB_INPUTS:
        x = getattr(batch, name)
        if x is not None:
            inputs.check_float_tensor(name, x)
            inputs.check_shape(name, x, [shape], lambda: f"[B, T] = [{B}, {T}]")
    if batch.sampling_logprobs is not None and options.off_policy_mask_threshold is None:
        raise ValueError(
            "sampling_logprobs is only used by the off-policy mask: set off_policy_mask_threshold "
            "(for the sampler's importance weights, pass grpo_fast.sampling_importance_weights(...) "
            "as importance_weights)"
        )
    iw = batch.importance_weights
    if iw is not None:
        inputs.check_float_tensor("importance_weights", iw)
        inputs.check_shape(
            "importance_weights", iw, [(B,), (B, 1), (B, T)], lambda: f"[B] = [{B}], [B, 1] or [B, T] = [{B}, {T}]"
        )
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


def _prepared(logprobs, entropy, batch, options):
    """The batch as layer 2 computes on it (an ``ops.PreparedBatch``): detached fp32 contiguous tensors but the
    log-probs and entropy (fp32, their gradient flowing), [B, 1] weights as [B], no reference log-probs without a KL
    term, num_items_in_batch and entropy_threshold fp32 scalar tensors on the log-probs' device (a number is written
    there, not read back)."""
    device = logprobs.device

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

    return ops.PreparedBatch(
        logp=logprobs.float(),
        entropy=entropy.float() if entropy is not None else None,
        advantages=fp32(batch.advantages),
        mask=batch.completion_mask.to(torch.float32).contiguous(),
        old_logprobs=fp32(batch.old_logprobs),
        ref_logprobs=fp32(batch.ref_logprobs) if options.beta != 0.0 else None,
        sampling_logprobs=fp32(batch.sampling_logprobs),
        importance_weights=iw,
        num_items_in_batch=scalar(batch.num_items_in_batch),
        entropy_threshold=scalar(batch.entropy_threshold),
    )


def _token_loss(prepared, options, backend):
    """Layer 2 on checked, prepared inputs (``_prepared``): the token-loss op by ``backend``'s token loss (the token
    kernel or its torch twin); the metrics a Metrics dict of fp32 device scalars."""
    total, metric_values, _, _ = ops.token_loss(prepared, options, backend.name)
    metrics = Metrics(zip(metric_names(options, prepared.entropy is not None), metric_values.detach().unbind(0)))
    metrics.logprobs = prepared.logp.detach()
    metrics.entropies = prepared.entropy.detach() if prepared.entropy is not None else None
    return total, metrics


def sampling_importance_weights(
    old_logprobs: torch.Tensor,
    sampling_logprobs: torch.Tensor,
    completion_mask: torch.Tensor,
    mode: ImportanceSamplingMode = "sequence_mask",
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
        inputs.check_float_tensor(name, x)
        if x.dim() != 2:
            raise ValueError(f"{name} must have shape [B, T], got {tuple(x.shape)}")
    inputs.check_shape(
        "sampling_logprobs",
        sampling_logprobs,
        [old_logprobs.shape],
        lambda: f"old_logprobs' {list(old_logprobs.shape)}",
    )
    inputs.check_tensor("completion_mask", completion_mask)
    inputs.check_same_device(
        [("sampling_logprobs", sampling_logprobs), ("completion_mask", completion_mask)],
        old_logprobs.device,
        "old_logprobs",
    )
    checks = inputs.ValueChecks(True, old_logprobs, completion_mask)
    inputs.check_mask(completion_mask, tuple(old_logprobs.shape), checks)
    checks.read()
    for name, x in (("clip_max", clip_max), ("clip_min", clip_min)):
        if x is not None:
            _number(name, x)
    if clip_min is not None and clip_max is not None and clip_min >= clip_max:
        raise ValueError(f"clip_min ({clip_min}) must be less than clip_max ({clip_max})")
    if mode.endswith("truncate") and clip_min is None and clip_max is None:
        raise ValueError(f"mode={mode!r} needs clip_min or clip_max")
    # a token the sampler could not score (NaN) and a masked one carry no correction: a log-ratio of 0 (TRL's
    # nan_to_num of the masked difference)
    log_ratio = old_logprobs.detach().float() - sampling_logprobs.detach().float()
    log_ratio = torch.nan_to_num(torch.where(completion_mask.bool(), log_ratio, 0.0), nan=0.0)
    level, action = mode.split("_")  # TRL's modes: ("token" | "sequence") _ ("truncate" | "mask")
    if level == "sequence":
        log_ratio = log_ratio.sum(-1, keepdim=True)
    ratio = log_ratio.exp()
    if action == "truncate":
        return ratio.clamp(min=clip_min, max=clip_max)
    outside = torch.zeros_like(ratio, dtype=torch.bool)
    if clip_min is not None:
        outside |= ratio < clip_min
    if clip_max is not None:
        outside |= ratio > clip_max
    return torch.where(outside, 0.0, ratio)
