"""The GRPO loss's public functions: ``loss`` (layer 1 and layer 2 in one call, optionally with a teacher's
divergence), ``token_loss`` (layer 2 on given log-probs) and ``sampling_importance_weights``.
"""

from __future__ import annotations

import torch
from typing_extensions import Unpack

from grpo_fast.backends.protocol import BackendName
from grpo_fast.backends.resolver import resolve_backend
from grpo_fast.distillation.teacher import Distillation, Teacher
from grpo_fast.grpo_loss import sampling
from grpo_fast.grpo_loss.call import LossBatch, LossCall, token_loss_metrics
from grpo_fast.grpo_loss.metrics import Metrics
from grpo_fast.grpo_loss.options import (
    ImportanceSamplingMode,
    LossOptionKeywords,
    LossOptions,
)
from grpo_fast.grpo_loss.sampling import SamplingCorrection
from grpo_fast.head import inputs
from grpo_fast.head.inputs import HeadCall
from grpo_fast.head.keywords import takes_keywords
from grpo_fast.head.lora import HeadLora
from grpo_fast.head.shard import VocabShard
from grpo_fast.kernels.config import BackwardMode, HeadPath
from grpo_fast.kernels.divergence_records import ModelHead
from grpo_fast.multi_teacher.api import RoutedDistillation, Teachers
from grpo_fast.served.api import ServedDistillation
from grpo_fast.served.teacher import ServedTeacher

__all__ = ["Metrics", "SamplingCorrection", "loss", "sampling_importance_weights", "token_loss"]


@takes_keywords(LossOptionKeywords, "the loss options")
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
    sampling_correction: SamplingCorrection | None = None,
    num_items_in_batch: float | torch.Tensor | None = None,
    entropy_threshold: float | torch.Tensor | None = None,
    temperature: float = 1.0,
    softcap: float | None = None,
    logit_scale: float = 1.0,
    options: LossOptions | None = None,
    head_path: HeadPath = "auto",
    backward_mode: BackwardMode = "chunked",
    trained_head_chunk: int | None = None,
    lora: HeadLora | tuple | None = None,
    vocab_parallel: VocabShard | None = None,
    backend: BackendName = "auto",
    check_values: bool = True,
    teacher: Teacher | ServedTeacher | Teachers | None = None,
    distillation_coef: float | None = None,
    distillation_beta: float | None = None,
    **option_keywords: Unpack[LossOptionKeywords],
) -> tuple[torch.Tensor, Metrics]:
    """The GRPO loss (TRL 1.16 semantics) from the policy's last hidden states, without full-vocab logits.

    Layer 1 (``logprobs_and_entropy``) then layer 2 (``token_loss``) over the tokens with completion_mask 1; a
    vocab-parallel head gives every rank the unsharded loss and metrics. The loss options are TRL's
    ``GRPOConfig`` keywords with its defaults, by name (``**option_keywords``, typed by
    ``grpo_fast.LossOptionKeywords``) or as one object (``options``);
    ``grpo_fast.LossOptions`` documents each (docs/options.md). With a ``teacher``: RL and
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
        sampling_correction: a ``grpo_fast.SamplingCorrection`` (the sampler's log-probs and
            its top-k / top-p / min-p or kept sets): the importance weights computed in the call over the sampler's
            support, exp(old_support - sampling), instead of ``importance_weights``; or None.
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
        teacher: a Teacher (its hidden states [B, T, Dt] and head, the student's vocabulary), a ServedTeacher
            (its top-k log-probs at each token: ``served_divergence_and_entropy``'s divergence, ``targets`` the
            sampled tokens; its own vocabulary sweep beside layer 1's), a Teachers (each row's own teacher, MOPD:
            each token's divergence from it, composed beside layer 1's head; a second host read for the routing),
            or None.
        distillation_coef: the divergence's weight in the per-token loss; required with ``teacher``, only with it.
        distillation_beta: the divergence's beta (0: forward KL, 1: reverse KL, between: the generalized JSD;
            TRL's DistillationConfig.beta); None: 1.0 (a ServedTeacher: 0.0, TRL's AsyncDistillationConfig's;
            Teachers: 1.0 if all are Teacher, 0.0 if all are ServedTeacher, required when they mix).
            Only with ``teacher``.
        **option_keywords: the loss options by name, TRL's ``GRPOConfig`` keywords (LossOptionKeywords): they
            apply on top of ``options``.

    Returns:
        loss: the differentiable float32 scalar loss.
        metrics: detached float32 scalars under TRL's names, with the per-token ``logprobs`` and ``entropies``
            [B, T] as attributes (docs/options.md#metrics).

    Raises:
        TypeError: as ``logprobs_and_entropy`` for the arguments both take, ``options`` not a LossOptions, an
            unknown option keyword,
            ``teacher`` not a Teacher, or a teacher's tensors of mismatched dtypes.
        ValueError: as ``logprobs_and_entropy`` for the arguments both take; a bad option; or inputs the options
            do not take: beta != 0 without ref_logprobs, ``sampling_logprobs`` without
            ``off_policy_mask_threshold``, ``entropy_threshold`` without ``top_entropy_quantile < 1``, vespo
            with importance weights that are not [B, T], ``num_items_in_batch`` < 0; ``distillation_coef`` or
            ``distillation_beta`` without a teacher, a teacher without ``distillation_coef``, a teacher whose
            shapes, vocabulary or device differ from the student's, a Teacher or Teachers with ``lora`` or
            ``vocab_parallel``, a ServedTeacher with both;
            ``sampling_correction`` with ``importance_weights``, or with ``old_logprobs`` but no
            ``old_support_logprobs``, or with bad sampling parameters.
    """
    options = LossOptions.resolve(options, option_keywords, "loss")
    if isinstance(teacher, ServedTeacher):
        distillation = ServedDistillation.check(teacher, distillation_coef, distillation_beta)
    elif isinstance(teacher, Teachers):
        distillation = RoutedDistillation.check(
            teacher, distillation_coef, distillation_beta, lora, ModelHead(hidden, weight, bias, None), vocab_parallel
        )
    else:
        distillation = Distillation.check(teacher, distillation_coef, distillation_beta, lora, vocab_parallel)
    head = HeadCall.check(
        hidden,
        weight,
        targets,
        completion_mask,
        bias=bias,
        temperature=temperature,
        softcap=softcap,
        logit_scale=logit_scale,
        lora=lora,
        vocab_parallel=vocab_parallel,
        backend=backend,
        check_values=check_values,
        head_path=head_path,
        backward_mode=backward_mode,
    )
    batch = LossBatch(
        advantages,
        completion_mask,
        old_logprobs,
        ref_logprobs,
        sampling_logprobs,
        importance_weights,
        num_items_in_batch,
        entropy_threshold,
    )
    weights_of = None
    if sampling_correction is not None:
        correction = SamplingCorrection.checked(sampling_correction, head, old_logprobs, importance_weights, options)
        weights_of = correction.weights
    return LossCall.check(head, batch, options, trained_head_chunk, distillation, weights_of).run()


@takes_keywords(LossOptionKeywords, "the loss options")
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
    backend: BackendName = "auto",
    check_values: bool = True,
    **option_keywords: Unpack[LossOptionKeywords],
) -> tuple[torch.Tensor, Metrics]:
    """Layer 2 alone: the GRPO loss and metrics from per-token log-probs that carry the gradient.

    For callers that already have the policy's log-probs; the per-batch inputs are ``loss``'s. The loss options,
    by name or as one object, are ``loss``'s: ``grpo_fast.LossOptions`` documents each
    (docs/options.md).

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
    batch = LossBatch(
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
    batch.check((B, T), logprobs.device, "logprobs", options, checks)
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
    prepared = batch.prepared(logprobs, entropy, options)
    return token_loss_metrics(prepared, options, resolve_backend(backend, logprobs.device))


@takes_keywords()
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
        old_logprobs: [B, T] float: the training policy's log-probs before the update; where the sampler truncates
            (top-k, top-p, min-p) and its log-probs are renormalised over its kept set (vLLM's
            ``processed_logprobs``), the policy's over the same set (``sampler_logprobs(...).support_logprobs``),
            else the ratio is the kept mass even for one model (docs/sampler-support.md).
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
    sampling.check_mode(mode, clip_max, clip_min)
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
    return sampling.importance_weights(old_logprobs, sampling_logprobs, completion_mask, mode, clip_max, clip_min)
