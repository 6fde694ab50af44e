"""TRL 1.16's experimental served-teacher distillation with grpo_fast's head: ``AsyncDistillationTrainer`` (TRL's,
its ``_chunked_jsd_loss`` computed by ``grpo_fast.served_distillation_loss``), public as ``grpo_fast.trl``'s and
imported on first use (TRL warns on every import of ``trl.experimental``).

    from grpo_fast.trl import AsyncDistillationConfig, AsyncDistillationTrainer

TRL's trainer projects its valid positions' hidden states through the lm_head in fp32 chunks of 256 tokens under
activation checkpointing (four vocabulary sweeps, a [256, V] fp32 buffer) and gathers the student's log-probs at the
teacher's candidates; here the same loss, metrics and gradients come from ``served_distillation_loss`` (three sweeps
with a trained head, no [tokens, V] buffer).
"""

from __future__ import annotations

import importlib

import torch

import grpo_fast
from grpo_fast.integrations.hf import with_module_names
from grpo_fast.integrations.trl_version import TRL_VERSIONS
from grpo_fast.served import teacher as served_teacher

# after grpo_fast.integrations.trl_version, which checks TRL's version
_trl_async = importlib.import_module("trl.experimental.async_distillation")
AsyncDistillationConfig = _trl_async.AsyncDistillationConfig
TRLAsyncDistillationTrainer = _trl_async.AsyncDistillationTrainer

__all__ = ["AsyncDistillationConfig", "AsyncDistillationTrainer", "served_jsd_loss"]


def served_jsd_loss(
    hidden_valid,
    lm_head_weight,
    lm_head_bias,
    logit_scale,
    final_logit_softcapping,
    target_ids,
    teacher_target_logps,
    valid_candidate_mask,
    beta,
    temperature,
    add_tail_bucket,
    teacher_id_idx,
    num_teachers,
    chunk_size,
):
    """TRL 1.16's ``_chunked_jsd_loss`` (``trl.experimental.async_distillation``), computed by
    ``grpo_fast.served_distillation_loss`` over the support TRL hands it (``support="listed"``: TRL has narrowed it
    by beta already).

    TRL projects in fp32 (``hidden.float() @ weight.float().T``): the head computes here in the wider of the two
    dtypes (bf16 products are exact in fp32 either way); the bias in it too.

    Args:
        hidden_valid: [n, H] the student's hidden states at the positions with teacher signal.
        lm_head_weight: [V, H]; lm_head_bias: [V] or None.
        logit_scale: multiplies the raw logits; final_logit_softcapping: the soft-cap, or None.
        target_ids: [n, K] the support's ids; teacher_target_logps: [n, K] the teacher's log-probs there;
            valid_candidate_mask: [n, K] bool, the entries that count.
        beta, temperature, add_tail_bucket: TRL's ``AsyncDistillationConfig``'s.
        teacher_id_idx: [n] int64, each position's teacher (MOPD), or None with one teacher.
        num_teachers: the number of teachers.
        chunk_size: TRL's tokens per chunk (unused: the head chunks by its own sizes).

    Returns:
        (loss, jsd_sum, entropy_sum, teacher_entropy_sum, per_teacher_stats): the divergence summed over the
        positions (differentiable), then detached: its sum, the student's entropy's, the teacher's entropy's over
        the support, and [3 x num_teachers] (positions, divergence sum, teacher entropy sum) per teacher.
    """
    dtype = torch.promote_types(hidden_valid.dtype, lm_head_weight.dtype)
    hidden, weight = hidden_valid.to(dtype), lm_head_weight.to(dtype)
    bias = lm_head_bias.to(dtype) if lm_head_bias is not None else None
    ids = torch.where(valid_candidate_mask, target_ids, -1)
    logprobs = torch.where(valid_candidate_mask, teacher_target_logps, 0.0).float()
    teacher = grpo_fast.ServedTeacher(ids[None], logprobs[None], add_tail_bucket)
    loss, div, entropy = grpo_fast.served_distillation_loss(
        hidden[None],
        weight,
        teacher,
        num_items_in_batch=1,
        beta=beta,
        temperature=temperature,
        student_bias=bias,
        student_softcap=final_logit_softcapping,
        student_logit_scale=logit_scale,
        support="listed",
    )
    with torch.no_grad():
        div, entropy = div[0], entropy[0]
        listed = served_teacher.support(ids, logprobs, None, 0.0)
        teacher_entropy = served_teacher.teacher_entropy(listed, add_tail_bucket)
        per_teacher = div.new_zeros(3 * num_teachers)
        if teacher_id_idx is not None:
            onehot = torch.nn.functional.one_hot(teacher_id_idx, num_teachers).to(div.dtype)  # [n, teachers]
            stats = torch.stack([onehot.sum(0), div @ onehot, teacher_entropy @ onehot], -1)
            per_teacher = stats.reshape(-1)
    return loss, div.sum(), entropy.sum(), teacher_entropy.sum(), per_teacher


class AsyncDistillationTrainer(TRLAsyncDistillationTrainer):
    """TRL's ``AsyncDistillationTrainer`` with grpo_fast's served-teacher head.

    Same constructor, same ``AsyncDistillationConfig``, same loss, metrics (``jsd``, ``entropy``,
    ``teacher_entropy``, MOPD's per-teacher ones) and reductions; only the divergence over the teacher's candidates
    and the student's entropy are computed by grpo_fast (``served_jsd_loss``, bound as TRL's ``_chunked_jsd_loss``
    in TRL's ``_compute_loss``).
    """

    _compute_loss = with_module_names(
        TRLAsyncDistillationTrainer._compute_loss, TRL_VERSIONS, _chunked_jsd_loss=served_jsd_loss
    )
