"""grpo_fast: a fused GRPO loss from hidden states that never builds full-vocab logits.

loss, metrics = grpo_fast.loss(hidden, weight, targets, advantages, completion_mask, ...)
logp = grpo_fast.logprobs(hidden, weight, targets)        # reference / old policy, no grad
logp, entropy = grpo_fast.logprobs_and_entropy(hidden, weight, targets)   # both differentiable
loss, metrics = grpo_fast.token_loss(logprobs, advantages, completion_mask, ...)  # layer 2 alone
weights = grpo_fast.sampling_importance_weights(old_logprobs, sampling_logprobs, completion_mask)
options = grpo_fast.LossOptions(loss_type="dapo", beta=0.04)   # TRL's GRPOConfig names; options=options
shard = grpo_fast.VocabShard(group, offset, vocab_size)   # a vocab-parallel head's rows here: vocab_parallel=shard
lora = grpo_fast.HeadLora(a, b, scaling, dropout)         # LoRA on the lm_head (PEFT's lora_A/B weights): lora=lora
div = grpo_fast.divergence(student_hidden, student_weight, teacher_hidden, teacher_weight, completion_mask,
                           beta=0.5)                      # on-policy distillation (TRL's DistillationTrainer)
loss, metrics = grpo_fast.loss(..., teacher=grpo_fast.Teacher(teacher_hidden, teacher_weight),
                               distillation_coef=0.1)     # RL and distillation in one call
"""

from grpo_fast import reference
from grpo_fast.api import Metrics, logprobs, logprobs_and_entropy, loss, sampling_importance_weights, token_loss
from grpo_fast.divergence_head import divergence, divergence_and_entropy
from grpo_fast.lora import HeadLora
from grpo_fast.options import LOSS_TYPES, NUM_ITEMS_LOSS_TYPES, LossOptionKeywords, LossOptions
from grpo_fast.teacher_head import Teacher
from grpo_fast.vocab_parallel import VocabShard

__all__ = [
    "loss",
    "logprobs",
    "logprobs_and_entropy",
    "token_loss",
    "sampling_importance_weights",
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
    "Teacher",
]
__version__ = "0.1.0"
