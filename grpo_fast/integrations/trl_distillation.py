"""TRL's distillation trainer with grpo_fast's divergence head: ``DistillationTrainer`` (TRL's, its
``_chunked_divergence_loss`` computed by ``grpo_fast.distillation_loss``). Public as ``grpo_fast.trl``'s."""

from __future__ import annotations

from torch.distributed.tensor import DTensor

import grpo_fast
from grpo_fast.integrations.hf import autocast_off, head_precision, with_module_names
from grpo_fast.integrations.trl_version import TRL_VERSIONS, trl


def _whole(weight, bias, dtype):
    """A head's weight and bias as TRL 1.16's distillation loss takes them: a DTensor gathered (``full_tensor()``, its
    weight in ``dtype``, the hidden states'), anything else as it is."""
    if isinstance(weight, DTensor):
        weight = weight.full_tensor().to(dtype)
        bias = None if bias is None else bias.full_tensor()
    return weight, bias


def divergence_loss(
    student_hidden_states,
    teacher_hidden_states,
    student_lm_head_weight,
    teacher_lm_head_weight,
    completion_mask,
    beta,
    num_items_in_batch=None,
    student_lm_head_bias=None,
    teacher_lm_head_bias=None,
    student_logit_scale=1.0,
    teacher_logit_scale=1.0,
    student_final_logit_softcapping=None,
    teacher_final_logit_softcapping=None,
    temperature=1.0,
):
    """TRL 1.16's ``_chunked_divergence_loss``, computed by ``grpo_fast.distillation_loss`` (the student's gradients
    formed in the forward).

    Each model computes in its own precision (the autocast dtype, else its hidden states'; the biases as they are:
    TRL adds them in fp32); only the tokens where ``completion_mask`` is nonzero are computed. A DTensor head is
    gathered whole, as TRL gathers it (an lm_head that is an FSDP2 unit of its own then gets each rank's unreduced
    gradient, as in TRL).

    Args:
        student_hidden_states: [B, T, Ds] float: the student's last hidden states.
        teacher_hidden_states: [B, T, Dt] float: the teacher's.
        student_lm_head_weight: [V, Ds] (or a DTensor).
        teacher_lm_head_weight: [V, Dt] (or a DTensor).
        completion_mask: [B, T]: nonzero at the tokens scored.
        beta: in [0, 1]: 0 forward KL, 1 reverse KL, between the generalized JSD.
        num_items_in_batch: the gradient-accumulation window's token count (a number or a scalar tensor); None:
            the scored tokens' count (at least 1).
        student_lm_head_bias: [V] or None.
        teacher_lm_head_bias: [V] or None.
        student_logit_scale: multiplies the student's raw logits.
        teacher_logit_scale: multiplies the teacher's raw logits.
        student_final_logit_softcapping: the student's soft-cap, or None.
        teacher_final_logit_softcapping: the teacher's soft-cap, or None.
        temperature: divides both models' logits.

    Returns:
        loss: the divergence summed over the scored tokens, divided by ``num_items_in_batch`` or their count; a
            differentiable float32 scalar.
        entropy_sum: the student's entropy summed over the scored tokens, detached.
        num_valid: the scored tokens' count, an int64 scalar tensor.

    Raises:
        TypeError: as ``grpo_fast.distillation_loss``.
        ValueError: as ``grpo_fast.distillation_loss``.
    """
    student_weight, student_bias = _whole(student_lm_head_weight, student_lm_head_bias, student_hidden_states.dtype)
    teacher_weight, teacher_bias = _whole(teacher_lm_head_weight, teacher_lm_head_bias, teacher_hidden_states.dtype)
    student, teacher = head_precision(student_hidden_states), head_precision(teacher_hidden_states)
    valid = completion_mask != 0
    # the student's GEMMs in its compute dtype, its gradients in its own (TRL casts its fp32 accumulators to them):
    # the op rounds an autocast student for the GEMMs alone; a weight of another dtype is cast to the hidden states'
    if student_weight.dtype != student_hidden_states.dtype:
        student_hidden_states, student_weight = student.cast(student_hidden_states), student.cast(student_weight)
    with autocast_off(student_hidden_states):
        loss, _, entropy = grpo_fast.distillation_loss(
            student_hidden_states,
            student_weight,
            teacher.cast(teacher_hidden_states),
            teacher.cast(teacher_weight),
            valid,
            num_items_in_batch=num_items_in_batch,
            beta=beta,
            temperature=temperature,
            student_bias=student_bias,
            teacher_bias=teacher_bias,
            student_softcap=student_final_logit_softcapping,
            teacher_softcap=teacher_final_logit_softcapping,
            student_logit_scale=student_logit_scale,
            teacher_logit_scale=teacher_logit_scale,
            student_gemm_dtype=student.dtype,
        )
    return loss, entropy.sum(), valid.sum()


class DistillationTrainer(trl.DistillationTrainer):
    """TRL's ``DistillationTrainer`` with grpo_fast's divergence head.

    Same constructor, same ``DistillationConfig``, same loss, metrics and reductions; only the per-token divergence
    and the student's entropy are computed by grpo_fast (``divergence_loss``, bound as TRL's
    ``_chunked_divergence_loss`` in TRL's ``_compute_loss``). A frozen student head (PEFT with LoRA elsewhere)
    takes grpo_fast's frozen-head path; TRL's constructor refuses a PEFT adapter on the lm_head, as here.
    """

    _compute_loss = with_module_names(
        trl.DistillationTrainer._compute_loss, TRL_VERSIONS, _chunked_divergence_loss=divergence_loss
    )
