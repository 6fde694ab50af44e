"""GRPO's group advantages (TRL's): each reward against its group's, for ``grpo_fast.loss``'s ``advantages``.

    advantages, std = group_advantages(rewards, num_generations=16, scale_rewards="group")

Rows are ordered prompt by prompt: rows ``i * G .. i * G + G - 1`` are the G completions of prompt ``i``
(grpo_fast.integrations.hidden_states has their hidden states).
"""

from __future__ import annotations

from typing import Literal, get_args

import torch

__all__ = ["SCALE_REWARDS", "ScaleRewards", "group_advantages"]

# TRL's GRPOConfig.scale_rewards
ScaleRewards = Literal["group", "batch", "none"]
SCALE_REWARDS: tuple[str, ...] = get_args(ScaleRewards)


def group_advantages(
    rewards: torch.Tensor, num_generations: int, scale_rewards: ScaleRewards = "group", eps: float = 1e-4
) -> tuple[torch.Tensor, torch.Tensor]:
    """TRL's advantages: each reward minus its group's mean, divided by a std (+ eps).

    Args:
        rewards: [B] rewards, prompt by prompt (B a multiple of num_generations).
        num_generations: G, the completions of each prompt (>= 2).
        scale_rewards: "group" divides by each group's std, "batch" by the std of all rewards, "none" does not
            divide (Dr. GRPO).
        eps: added to the std.

    Returns:
        (advantages, std), float32 [B]: std is the group's ("group", "none") or the batch's ("batch"); a group whose
        rewards are all equal gets zero advantages, never a NaN.

    Raises:
        ValueError: an unknown ``scale_rewards``, or num_generations < 2 or not dividing B.
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
