#!/usr/bin/env python
"""The GRPO demo (willccbb's grpo_demo.py) on TRL's GRPOTrainer with grpo_fast inside: one import changed.

    python examples/trl_gsm8k.py                                    # Qwen/Qwen2.5-1.5B-Instruct on openai/gsm8k
    python examples/trl_gsm8k.py --model /path/to/model --data ../shared/data/gsm8k       # no hub at all
    accelerate launch --num_processes 2 examples/trl_gsm8k.py       # more GPUs: accelerate / torchrun, as with TRL

The demo's script: its system prompt, its five reward functions (grpo_fast.gsm8k.rewards, the same values), its
GRPOConfig and, with ``--lora-r 16``, its LoRA config; TRL's trainer runs the loop, the progress bar and the logs.
The one change for grpo_fast is the import,

    from trl import GRPOConfig, GRPOTrainer    ->    from grpo_fast.trl import GRPOConfig, GRPOTrainer

after which TRL scores every token (policy, old policy, reference) with grpo_fast's kernels, never building the
[tokens, vocab] logits; the loss, the options and the metrics stay TRL's.

Where TRL 1.16 differs from the TRL the demo was written for: GRPOConfig has no ``max_prompt_length`` any more
(prompts are not truncated), and a generation batch must hold whole groups of ``num_generations`` completions, so
the demo's one completion per device batch with 4 accumulation steps gets ``generation_batch_size`` = 16: each
generation samples 16 completions of one question, and the optimizer takes 4 steps of 4 completions on them.
transformers 5 takes the demo's ``warmup_ratio`` as ``warmup_steps=0.1``. ``bf16`` (the demo's True) is used where
CUDA is; reporting goes nowhere unless ``--report-to wandb``.
"""

from __future__ import annotations

import argparse

import torch
from datasets import Dataset
from peft import LoraConfig
from transformers import AutoModelForCausalLM, AutoTokenizer

from grpo_fast.gsm8k import data
from grpo_fast.gsm8k.rewards import (
    correctness_reward, int_reward, soft_format_reward, strict_format_reward, xmlcount_reward,
)
from grpo_fast.trl import GRPOConfig, GRPOTrainer  # was: from trl import GRPOConfig, GRPOTrainer


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="Qwen/Qwen2.5-1.5B-Instruct", help="hub id or local folder")
    p.add_argument("--gguf-file", default=None, help="a .gguf file inside --model (transformers dequantizes it)")
    p.add_argument("--data", default=data.HUB_ID, help="openai/gsm8k, or a folder with GSM8K's train/test.jsonl")
    p.add_argument("--output-dir", default="outputs/Qwen-1.5B-GRPO")
    p.add_argument("--lora-r", type=int, default=0, help="the demo's LoRA (r=16, alpha 64) when > 0; 0: all weights")
    p.add_argument("--attn-implementation", default="sdpa", help="the demo's is flash_attention_2 (if installed)")
    # the demo's values; smaller ones make a quick run
    p.add_argument("--num-generations", type=int, default=16)
    p.add_argument("--max-completion-length", type=int, default=786)
    p.add_argument("--per-device-train-batch-size", type=int, default=1)
    p.add_argument("--gradient-accumulation-steps", type=int, default=4)
    p.add_argument("--generation-batch-size", type=int, default=16)
    p.add_argument("--learning-rate", type=float, default=5e-6)
    p.add_argument("--max-steps", type=int, default=-1, help="optimizer steps (-1: the demo's one epoch)")
    p.add_argument("--save-steps", type=int, default=100)
    p.add_argument("--report-to", default="none", help="the demo's is wandb")
    p.add_argument("--seed", type=int, default=42)
    return p.parse_args(argv)


def main(argv=None):
    """Train; returns the trainer (its ``state.log_history`` holds every logged step)."""
    args = parse_args(argv)
    cuda = torch.cuda.is_available()

    dataset = Dataset.from_list(data.load_gsm8k("train", args.data))  # the demo's system prompt, gold answers

    training_args = GRPOConfig(
        output_dir=args.output_dir,
        run_name="Qwen-1.5B-GRPO-gsm8k",
        learning_rate=args.learning_rate,
        adam_beta1=0.9,
        adam_beta2=0.99,
        weight_decay=0.1,
        warmup_steps=0.1,  # the demo's warmup_ratio=0.1: transformers 5 reads a float < 1 here as the ratio
        lr_scheduler_type="cosine",
        logging_steps=1,
        bf16=cuda,
        per_device_train_batch_size=args.per_device_train_batch_size,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        generation_batch_size=args.generation_batch_size,
        num_generations=args.num_generations,
        max_completion_length=args.max_completion_length,
        num_train_epochs=1,
        max_steps=args.max_steps,
        save_steps=args.save_steps,
        max_grad_norm=0.1,
        report_to=args.report_to,
        log_on_each_node=False,
        seed=args.seed,
    )
    peft_config = LoraConfig(
        r=args.lora_r,
        lora_alpha=64,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj", "gate_proj"],
        task_type="CAUSAL_LM",
        lora_dropout=0.05,
    ) if args.lora_r > 0 else None

    gguf = {"gguf_file": args.gguf_file} if args.gguf_file else {}
    model = AutoModelForCausalLM.from_pretrained(
        args.model, dtype=torch.bfloat16 if cuda else torch.float32, attn_implementation=args.attn_implementation,
        device_map=None, **gguf)
    if gguf:  # GGUF weights are dequantized to plain tensors: drop the marker so checkpoints save normally
        model.hf_quantizer, model.is_quantized = None, False
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
    tokenizer = AutoTokenizer.from_pretrained(args.model, **gguf)
    tokenizer.pad_token = tokenizer.eos_token

    trainer = GRPOTrainer(
        model=model,
        processing_class=tokenizer,
        reward_funcs=[xmlcount_reward, soft_format_reward, strict_format_reward, int_reward, correctness_reward],
        args=training_args,
        train_dataset=dataset,
        peft_config=peft_config,
    )
    trainer.train()
    return trainer


if __name__ == "__main__":
    main()
