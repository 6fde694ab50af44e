"""grpo_fast: a fused GRPO loss from hidden states that never builds full-vocab logits.

loss, metrics = grpo_fast.loss(hidden, weight, targets, advantages, completion_mask, ...)
logp = grpo_fast.logprobs(hidden, weight, targets)        # reference / old policy, no grad
logp, entropy = grpo_fast.logprobs_and_entropy(hidden, weight, targets)   # both differentiable
loss, metrics = grpo_fast.token_loss(logprobs, advantages, completion_mask, ...)  # layer 2 alone
weights = grpo_fast.sampling_importance_weights(old_logprobs, sampling_logprobs, completion_mask)
out = grpo_fast.sampler_logprobs(hidden, weight, targets, top_p=0.9)  # over vLLM's kept set too (processed mode)
options = grpo_fast.LossOptions(loss_type="dapo", beta=0.04)   # TRL's GRPOConfig names; options=options
shard = grpo_fast.VocabShard(group, offset, vocab_size)   # a vocab-parallel head's rows here: vocab_parallel=shard
lora = grpo_fast.HeadLora(a, b, scaling, dropout)         # LoRA on the lm_head (PEFT's lora_A/B weights): lora=lora
div = grpo_fast.divergence(student_hidden, student_weight, teacher_hidden, teacher_weight, completion_mask,
                           beta=0.5)                      # on-policy distillation (TRL's DistillationTrainer)
loss, div, entropy = grpo_fast.distillation_loss(student_hidden, student_weight, teacher_hidden, teacher_weight,
                                                 completion_mask)   # its loss, the gradients formed in the forward
teacher = grpo_fast.ServedTeacher(topk_ids, topk_logprobs)   # a teacher served as top-k log-probs (TRL's async)
loss, div, entropy = grpo_fast.served_distillation_loss(hidden, weight, teacher, completion_mask)
teachers = grpo_fast.Teachers([teacher_a, teacher_b], teacher_index)   # each row's teacher (MOPD)
loss, div, entropy = grpo_fast.multi_teacher_distillation_loss(hidden, weight, teachers, completion_mask)
loss, metrics = grpo_fast.loss(..., teacher=grpo_fast.Teacher(teacher_hidden, teacher_weight),
                               distillation_coef=0.1)     # RL and distillation in one call

The package's parts, one folder each (each imports only the parts below it in kernels < backends < head <
sampler < distillation < served < multi_teacher < grpo_loss < integrations < memory; the spec stands apart):
    head/          layer 1: log-probs and entropies from hidden states, no [tokens, vocab] logits
    sampler/       log-probs over a truncating sampler's kept set (top-k / top-p / min-p, or replayed sets)
    grpo_loss/     layer 2: the GRPO loss, its options and metrics; ``loss`` runs both layers
    distillation/  the student-teacher divergence head; RL with distillation in one call
    served/        distillation from a teacher served as top-k log-probs (TRL's experimental trainers)
    multi_teacher/ several teachers in one call, each row routed to one (MOPD), in-process or served
    backends/      one protocol, two implementations: the Triton kernels and their chunked-torch twins
    kernels/       the Triton kernels, their tile tables and launch configurations (import nothing of the package)
    integrations/  TRL's trainers and verl's backend (public as grpo_fast.trl, grpo_fast.verl)
    memory/        one GRPO step's peak GPU memory, estimated on a CPU (python -m grpo_fast.memory)
    reference.py   the spec: every formula in plain eager PyTorch, independent of the product
"""

from grpo_fast import reference
from grpo_fast.distillation.api import DivergenceKeywords, distillation_loss, divergence, divergence_and_entropy
from grpo_fast.distillation.teacher import Teacher
from grpo_fast.grpo_loss.api import Metrics, SamplingCorrection, loss, sampling_importance_weights, token_loss
from grpo_fast.grpo_loss.options import LOSS_TYPES, NUM_ITEMS_LOSS_TYPES, LossOptionKeywords, LossOptions
from grpo_fast.head.api import logprobs, logprobs_and_entropy
from grpo_fast.head.lora import HeadLora
from grpo_fast.head.shard import VocabShard
from grpo_fast.multi_teacher.api import Teachers, multi_teacher_distillation_loss, teacher_metrics
from grpo_fast.sampler.api import SamplerLogprobs, sampler_logprobs
from grpo_fast.sampler.replay import pack_kept_ids
from grpo_fast.served.api import ServedKeywords, served_distillation_loss, served_divergence_and_entropy
from grpo_fast.served.teacher import ServedTeacher

__all__ = [
    "loss",
    "logprobs",
    "logprobs_and_entropy",
    "token_loss",
    "sampling_importance_weights",
    "sampler_logprobs",
    "SamplerLogprobs",
    "pack_kept_ids",
    "SamplingCorrection",
    "Metrics",
    "LossOptions",
    "LossOptionKeywords",
    "LOSS_TYPES",
    "NUM_ITEMS_LOSS_TYPES",
    "VocabShard",
    "HeadLora",
    "reference",
    "divergence",
    "divergence_and_entropy",
    "distillation_loss",
    "DivergenceKeywords",
    "Teacher",
    "ServedTeacher",
    "served_divergence_and_entropy",
    "served_distillation_loss",
    "ServedKeywords",
    "Teachers",
    "multi_teacher_distillation_loss",
    "teacher_metrics",
]
__version__ = "0.1.0"
