"""GRPO's group advantages (TRL's): each reward against its group's, for ``grpo_fast.loss``'s ``advantages``.

    advantages, std = group_advantages(rewards, num_generations=16, scale_rewards="group")

Rows are ordered prompt by prompt: rows ``i * G .. i * G + G - 1`` are the G completions of prompt ``i``
(grpo_fast.integrations.hidden_states has their hidden states).
"""

from __future__ import annotations

import torch

__all__ = ["SCALE_REWARDS", "group_advantages"]

SCALE_REWARDS = ("group", "batch", "none")


def group_advantages(rewards: torch.Tensor, num_generations: int, scale_rewards: str = "group", eps: float = 1e-4):
    """TRL's advantages: reward minus its group's mean, divided by a std (+ eps); returns (advantages, std).

    ``scale_rewards``: "group" divides by each group's std, "batch" by the std of all rewards, "none" does not
    divide (Dr. GRPO). ``std`` [B] is the group std ("group", "none") or the batch std ("batch"); a group
    whose rewards are all equal gets zero advantages, never a NaN.
    """
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"scale_rewards must be one of {SCALE_REWARDS}, got {scale_rewards!r}")
    if num_generations < 2 or rewards.numel() % num_generations:
        raise ValueError(f"need num_generations >= 2 dividing the {rewards.numel()} rewards, got {num_generations}")
    grouped = rewards.float().view(-1, num_generations)
    mean = grouped.mean(1).repeat_interleave(num_generations)
    if scale_rewards == "batch":
        std = rewards.float().std().expand(rewards.numel())
    else:
        std = grouped.std(1).repeat_interleave(num_generations)
    advantages = rewards.float() - mean
    if scale_rewards != "none":
        advantages = advantages / (std + eps)
    return advantages, std
