"""One GRPO training step's peak GPU memory, estimated on a CPU: ``python -m grpo_fast.memory``.

    python -m grpo_fast.memory              # DEFAULT_RECIPE (Qwen2.5-1.5B-Instruct, LoRA r 16) against a 24 GB card
    python -m grpo_fast.memory --model qwen2.5-0.5b --lora-r 0 --gpu-name L4 --gpu-memory-gib 22.49 --gpu-sms 58
    python -m grpo_fast.memory --sampler both --top-p 0.95     # beside them, grpo_fast with sampler_logprobs
    python -m grpo_fast.memory --model ./Qwen3-4B/config.json  # a local config.json (or its folder), no hub
    python -m grpo_fast.memory --heads distillation,rl_distillation,served_distillation --explain
    result = grpo_fast.memory.estimate(recipe, heads)                  # the same from Python

One micro-batch's forward and backward and the optimizer step run over fake tensors (shapes and dtypes, no data)
while torch's memory tracker accounts every tensor by category: weights, gradients, optimizer state, the model's
activations and the loss head's own buffers. The loss heads are compared in the same step, over models built once
and shared: eager PyTorch's full logits and grpo_fast's fused head by default; grpo_fast's distillation heads
(``DISTILLATION_HEADS``) and grpo_fast with ``sampler_logprobs`` (``sampler_head``: the old policy's pass and / or the
training pass) on request; another (a peer's) is a ``LossHead`` subclass passed in ``heads``. Every GRPO head feeds
its log-probs to grpo_fast's token loss. The generation phase's key / value cache follows from the shape.
What the tracker cannot see (the CUDA context, the allocator's fragmentation) is an allowance added before the
estimate meets the card. Building the model needs transformers (and PEFT for LoRA), imported when an estimate runs.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import json
import shlex
import sys
from collections.abc import Mapping
from pathlib import Path

import torch

from grpo_fast.memory import command, report
from grpo_fast.memory.heads import (
    DISTILLATION_HEADS,
    HEADS,
    Batch,
    DistillationHead,
    EagerHead,
    GrpoFastHead,
    LossHead,
    RlDistillationHead,
    ServedDistillationHead,
)
from grpo_fast.memory.recipe import DEFAULT_RECIPE, MODELS, RTX_4090, Gpu, ModelShape, Recipe, kv_cache_bytes
from grpo_fast.memory.report import ALLOWANCE, CATEGORIES
from grpo_fast.memory.sampler import SamplerHead, SamplerSettings, sampler_head
from grpo_fast.memory.step import estimate_step, fake_models, generation_phase, measure_step

__all__ = [
    "estimate",
    "main",
    "Recipe",
    "ModelShape",
    "Gpu",
    "LossHead",
    "EagerHead",
    "GrpoFastHead",
    "DistillationHead",
    "RlDistillationHead",
    "ServedDistillationHead",
    "SamplerHead",
    "SamplerSettings",
    "sampler_head",
    "Batch",
    "DEFAULT_RECIPE",
    "MODELS",
    "RTX_4090",
    "HEADS",
    "DISTILLATION_HEADS",
    "ALLOWANCE",
    "CATEGORIES",
    "kv_cache_bytes",
]


def estimate(
    recipe: Recipe = DEFAULT_RECIPE,
    heads: Mapping[str, type[LossHead]] | None = None,
    *,
    gpu: Gpu = RTX_4090,
    progress: bool = False,
    measure: bool = False,
) -> dict:
    """Every head's training step on the recipe, over fake tensors, and the generation phase.

    Args:
        recipe: the step's sizes.
        heads: the loss heads to compare, by name (the report's order); None: ``HEADS``, eager PyTorch's and
            grpo_fast's.
        gpu: the card grpo_fast's ops size their workspaces for (the report compares the estimate with its memory).
        progress: print each phase's message on stderr.
        measure: also run each step on the CUDA GPU present (random weights) and record its real peak.

    Returns:
        A dict: ``recipe`` and ``gpu`` as given; ``heads``, per head its peak in bytes by category (``CATEGORIES``)
            and in all, the phase the peak falls in, the loss head's own peak, the parameter counts, the optimizer
            state's bytes, its label and description (and ``measured``: the GPU's numbers); ``generation``, the
            rollout's weights, optimizer state and key / value cache; ``versions``, of torch and the packages the
            step ran on.

    Raises:
        ModuleNotFoundError: transformers is missing (PEFT with LoRA, or a package a head runs on).
        RuntimeError: ``measure`` without a CUDA GPU.
    """
    heads = dict(HEADS if heads is None else heads)
    results = {}
    models = fake_models(recipe)  # built once, on the first head that needs each, and shared by all
    for i, (name, head) in enumerate(heads.items()):

        def log(message, i=i, name=name):
            if progress:
                print(f"memory: [{i + 1}/{len(heads)}] {name}: {message}", file=sys.stderr, flush=True)

        if i == 0:
            log(f"building {recipe.model} ({recipe.shape.num_layers} layers) on the meta device, once for every head")
        results[name] = estimate_step(recipe, head, gpu, log, models)
        if measure:
            results[name]["measured"] = measure_step(recipe, head, log)
        results[name] |= {"label": head.label, "description": head.description}
        if isinstance(getattr(head, "settings", None), SamplerSettings):  # sampler_logprobs' head: its sampler
            results[name]["sampler"] = dataclasses.asdict(head.settings) | {"passes": list(head.settings.passes)}
    packages = ["transformers"] + ["peft"] * (recipe.lora_r > 0) + [p for head in heads.values() for p in head.packages]
    versions = {"torch": torch.__version__}
    versions |= {name: importlib.import_module(name).__version__ for name in dict.fromkeys(packages)}
    # the rollout holds every model the training holds (a distillation head's teacher too): the heads' largest
    weights = ("weights", "reference weights", "teacher weights")
    held = max(results.values(), key=lambda step: sum(step["categories_bytes"][k] for k in weights))
    generation = generation_phase(recipe, held)
    return {"recipe": recipe, "gpu": gpu, "heads": results, "generation": generation, "versions": versions}


def main(
    argv=None,
    *,
    recipes: Mapping[str, Recipe] | None = None,
    heads: Mapping[str, type[LossHead]] | None = None,
    prog: str = command.PROG,
) -> dict:
    """``python -m grpo_fast.memory``: estimate, print the report's table and its verdict (``--explain``: the whole
    report), write ``--out``'s files (.json, .md, .png).

    ``recipes`` and ``heads`` are how a script offers its own: its recipes under ``--recipe``, another head (a
    peer's) beside the built-in ones under ``--heads``.

    Args:
        argv: the arguments; None: ``sys.argv[1:]``.
        recipes: the ``--recipe`` choices by name, the first the default; None: no ``--recipe``, DEFAULT_RECIPE.
        heads: the ``--heads`` choices by name, in the report's order, all of them the default; None: ``HEADS``.
        prog: how the command is run, as its errors and the report's command line give it.

    Returns:
        The report, as the .json file writes it.

    Raises:
        grpo_fast.memory.cli.InputError: a flag out of range, an unknown head, a shape that cannot be built,
            ``--measure`` without a CUDA GPU, or a package the estimate needs that is missing: one line on stderr,
            exit status 2.
    """
    args = command.parse_args(argv, recipes=recipes, heads=heads, prog=prog)
    recipe = command.recipe_from_args(args, recipes, prog)
    chosen = args.head_classes
    command.check_packages(prog, recipe, chosen)
    line = " ".join([prog] + [shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv)])
    if not args.quiet:
        print(f"memory: {recipe.describe()}; heads {', '.join(chosen)}", file=sys.stderr, flush=True)
        if args.peer_heads is None and "trl" not in chosen and _findable("trl"):
            print(
                f"memory: trl imports here; --peer-heads {command.TRL_PEER_HEADS} (from a grpo_fast checkout) puts "
                "TRL's fused head beside these",
                file=sys.stderr,
            )
    result = estimate(recipe, chosen, gpu=command.gpu_from_args(args), progress=not args.quiet, measure=args.measure)
    written = report.to_json(result, line)
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        Path(f"{out}.json").write_text(json.dumps(written, indent=1) + "\n")
        Path(f"{out}.md").write_text(report.markdown(written, explain=True))
        report.plot(written, f"{out}.png")
        print(f"wrote {out}.json, {out}.md, {out}.png", file=sys.stderr)
    print(report.markdown(written, explain=args.explain))
    return written


def _findable(package: str) -> bool:
    """Whether ``package`` could be imported here, without importing it (False where a finder refuses it, e.g. a
    module set to None in sys.modules)."""
    try:
        return importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):
        return False
