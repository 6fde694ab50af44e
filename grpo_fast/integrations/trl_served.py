"""TRL 1.16's experimental served-teacher distillation with grpo_fast's head: ``AsyncDistillationTrainer`` (TRL's,
its ``_chunked_jsd_loss`` computed by ``grpo_fast.served_distillation_loss``) and ``ServerDistillationTrainer``
(TRL's, its ``compute_loss`` taking the student's last hidden states instead of its ``[B, T, V]`` logits), public
as ``grpo_fast.trl``'s and imported on first use (TRL warns on every import of ``trl.experimental``).

    from grpo_fast.trl import AsyncDistillationConfig, AsyncDistillationTrainer
    from grpo_fast.trl import ServerDistillationConfig, ServerDistillationTrainer

TRL's trainer projects its valid positions' hidden states through the lm_head in fp32 chunks of 256 tokens under
activation checkpointing (four vocabulary sweeps, a [256, V] fp32 buffer) and gathers the student's log-probs at the
teacher's candidates; here the same loss, metrics and gradients come from ``served_distillation_loss`` (three sweeps
with a trained head, no [tokens, V] buffer).
"""

from __future__ import annotations

import importlib

import torch

import grpo_fast
from grpo_fast.integrations.hf import logit_transform_of, with_module_names
from grpo_fast.integrations.trl_version import TRL_VERSIONS
from grpo_fast.served import teacher as served_teacher

# after grpo_fast.integrations.trl_version, which checks TRL's version
_trl_async = importlib.import_module("trl.experimental.async_distillation")
AsyncDistillationConfig = _trl_async.AsyncDistillationConfig
TRLAsyncDistillationTrainer = _trl_async.AsyncDistillationTrainer
_trl_server = importlib.import_module("trl.experimental.server_distillation")
ServerDistillationConfig = _trl_server.ServerDistillationConfig
TRLServerDistillationTrainer = _trl_server.ServerDistillationTrainer

__all__ = [
    "AsyncDistillationConfig",
    "AsyncDistillationTrainer",
    "ServerDistillationConfig",
    "ServerDistillationTrainer",
    "served_jsd_loss",
]


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


def server_teacher(teacher_result, labels, beta):
    """TRL 1.16's ``ServerDistillationTrainer`` teacher records as a ``ServedTeacher``'s ids and log-probs [B, T, K]
    (TRL's support then follows from ``served_distillation_loss``' rules): at beta 0 the top-k lists, their -inf
    entries unlisted; at 0 < beta < 1 (TRL's top-1 server path) the teacher's top-1 and the sampled token's log-prob
    (``actual_logprobs``), the sampled token listed where it is not the top-1; at beta 1 the sampled token's alone.
    TRL's errors for a required position the server left without a log-prob.

    Args:
        teacher_result: TRL's ``_get_teacher_token_logprobs_from_server`` dict (``actual_logprobs`` [B, T],
            ``topk_logprobs`` and ``topk_token_ids`` [B, T, K]).
        labels: [B, T] the completion's tokens, -100 where not scored (TRL's trimmed labels).
        beta: TRL's ``beta``.

    Returns:
        (ids [B, T, K'] int64, -1 filling; log-probs [B, T, K'] fp32).

    Raises:
        ValueError: TRL's, a scored position without the sampled token's log-prob (beta != 0) or without the
            teacher's top-1 (0 < beta < 1).
    """
    topk_lps, topk_ids = teacher_result["topk_logprobs"], teacher_result["topk_token_ids"]
    required = labels != -100
    if beta == 0:
        listed = torch.isfinite(topk_lps) & required[..., None]
        return torch.where(listed, topk_ids, -1), torch.where(listed, topk_lps, 0.0).float()
    actual = teacher_result["actual_logprobs"]
    for missing, what, needed in (
        (required & ~torch.isfinite(actual), "actual-token logprobs for required reverse-KL", True),
        (required & ~torch.isfinite(topk_lps[..., 0]), "top-1 logprobs for required forward-KL", beta < 1),
    ):
        if needed and missing.any():  # TRL's messages
            raise ValueError(f"Teacher server is missing {what} positions: {int(missing.sum())}/{int(required.sum())}.")
    sampled = labels.clamp(min=0)
    if beta == 1:  # the sampled token alone (TRL reads no top-1 then)
        ids = torch.where(required, sampled, -1)[..., None]
        return ids, torch.where(ids >= 0, actual[..., None], 0.0).float()
    top1 = torch.where(required & torch.isfinite(topk_lps[..., 0]), topk_ids[..., 0], -1)
    second = torch.where(required & (sampled != top1), sampled, -1)
    ids = torch.stack([top1, second], -1)
    logprobs = torch.stack([topk_lps[..., 0], actual], -1)
    return ids, torch.where(ids >= 0, logprobs, 0.0).float()


class ServerDistillationTrainer(TRLServerDistillationTrainer):
    """TRL's experimental ``ServerDistillationTrainer`` with grpo_fast's served-teacher head.

    Same constructor, ``ServerDistillationConfig``, teacher client and loss; ``compute_loss`` takes the student's
    last hidden states (TRL's ``_get_last_hidden_state``) where TRL takes ``model(...).logits`` (the whole
    ``[B, T, V]`` logits, then a full-vocabulary log-softmax), and computes TRL's sparse divergence over the same
    window with ``served_distillation_loss`` (its batch mean over the scored tokens, divided by the accumulation
    steps as TRL's). ``return_outputs=True`` (the model's outputs asked for) runs TRL's own.
    """

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if return_outputs:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        unwrapped = self.accelerator.unwrap_model(model)
        loss = self._forward_redirection(model, unwrapped, self._served_loss, unwrapped, inputs)
        if self.model.training:
            loss = loss / self.current_gradient_accumulation_steps
        return loss

    def _served_loss(self, unwrapped, inputs):
        """TRL's loss on ``inputs`` from the student's hidden states: TRL's sequence layout, teacher request and
        window, then ``served_distillation_loss``."""
        prompt_ids, prompt_mask = inputs["prompt_ids"], inputs["prompt_mask"]
        completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
        attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
        completion_labels = torch.where(completion_mask.bool(), completion_ids, -100)
        labels = torch.cat([torch.full_like(prompt_ids, -100), completion_labels], dim=1)
        inputs = {
            **inputs,
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "labels": labels,
            "prompt_attention_mask": prompt_mask,
        }
        prompt_length = self._compute_prompt_length(inputs)
        teacher_result = self._get_teacher_token_logprobs_from_server(inputs, prompt_length)
        window = teacher_result["actual_logprobs"].shape[1]
        labels = labels[:, prompt_length : prompt_length + window]
        hidden = self._get_last_hidden_state(unwrapped, input_ids, attention_mask, input_ids.shape[1] - prompt_length)
        lm_head = unwrapped.get_output_embeddings()
        hidden = hidden[:, :window].to(lm_head.weight.device)
        ids, logprobs = server_teacher(teacher_result, labels.to(hidden.device), self.beta)
        transform = logit_transform_of(unwrapped.config.get_text_config())
        weight = lm_head.weight
        if weight.dtype != hidden.dtype:  # the model's own head computes in its weight's dtype
            hidden = hidden.to(weight.dtype)
        loss, _, _ = grpo_fast.served_distillation_loss(
            hidden, weight, grpo_fast.ServedTeacher(ids, logprobs, self.loss_add_tail), labels != -100,
            targets=labels.clamp(min=0), beta=self.beta, temperature=self.temperature,
            student_bias=lm_head.bias, student_softcap=transform["softcap"],
            student_logit_scale=transform["logit_scale"],
        )  # fmt: skip
        return loss
