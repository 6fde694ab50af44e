#!/usr/bin/env python
"""The GSM8K example's training step, its peak GPU memory estimated on a CPU (no GPU, no hub; ``--help``).

    python examples/memory_gsm8k.py                                 # train_gsm8k.py's GPU preset: 1.5B, LoRA r 16
    python examples/memory_gsm8k.py --recipe qwen2.5-0.5b-full      # the same run with every parameter of the 0.5B
    python examples/memory_gsm8k.py --micro-batch-size 16 --out /tmp/mb16    # any grpo_fast.memory flag overrides

grpo_fast.memory's estimator with two things the package does not hold: the recipes, which are examples/
train_gsm8k.py's GPU preset (its sizes, optimizer and LoRA targets, read from its own parser) on the models' public
shapes; and TRL 1.16's fused head beside eager PyTorch's and grpo_fast's, where trl imports (bench/memory_peers.py
runs it as on a GPU). Run from the repository root, where ``bench`` imports.
"""

from __future__ import annotations

import sys
from pathlib import Path

# the repository root, for bench's peer heads (this script's folder, examples/, is on the path already)
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))

import train_gsm8k  # noqa: E402 (after the path)
from gsm8k.models import LORA_TARGETS  # noqa: E402

from bench.memory_peers import peer_heads  # noqa: E402
from grpo_fast import memory  # noqa: E402

PROG = "python examples/memory_gsm8k.py"


def gpu_recipe(model: str, lora_r: int) -> memory.Recipe:
    """train_gsm8k.py's GPU preset at LoRA rank ``lora_r`` (0: every parameter) on ``model``'s public shape, as
    that script's parser resolves it (its learning rate follows the rank)."""
    args = train_gsm8k.parse_args(["--preset", "gpu", "--lora-r", str(lora_r)])
    return memory.Recipe(
        model=model,
        shape=memory.MODELS[model],
        lora_r=args.lora_r,
        lora_alpha=args.lora_alpha,
        micro_batch_size=args.micro_batch_size,
        prompt_length=args.max_prompt_length,
        completion_length=args.max_completion_length,
        prompts_per_step=args.prompts_per_step,
        num_generations=args.num_generations,
        gradient_checkpointing=args.gradient_checkpointing,
        beta=args.beta,
        lr=args.lr,
        temperature=args.temperature,
        epsilon=args.epsilon,
        weight_decay=args.weight_decay,
        betas=(0.9, 0.99),  # train_gsm8k.py's AdamW
        max_grad_norm=args.max_grad_norm,
        lora_targets=tuple(LORA_TARGETS),
    )


RECIPES = {
    "qwen2.5-1.5b-lora": gpu_recipe("qwen2.5-1.5b", 16),
    "qwen2.5-0.5b-full": gpu_recipe("qwen2.5-0.5b", 0),
}


def main(argv=None) -> dict:
    """The estimate of ``--recipe`` (the first of RECIPES by default) with every head that runs here; the report."""
    heads = {"eager": memory.EagerHead, **peer_heads(), "grpo_fast": memory.GrpoFastHead}
    return memory.main(argv, recipes=RECIPES, heads=heads, prog=PROG)


if __name__ == "__main__":
    main()
