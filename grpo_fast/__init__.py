"""grpo_fast: a fused GRPO loss from hidden states that never builds full-vocab logits.

    loss, metrics = grpo_fast.loss(hidden, weight, targets, advantages, completion_mask, ...)
    logp = grpo_fast.logprobs(hidden, weight, targets)        # reference / old policy, no grad
    loss, metrics = grpo_fast.token_loss(logprobs, advantages, completion_mask, ...)  # layer 2 alone
"""

from grpo_fast import reference
from grpo_fast.api import Metrics, logprobs, loss, token_loss

__all__ = ["loss", "logprobs", "token_loss", "Metrics", "reference"]
__version__ = "0.1.0"
