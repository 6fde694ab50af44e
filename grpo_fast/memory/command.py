"""The estimator's command line: its flags, their ranges and checks, and the recipe they describe."""

from __future__ import annotations

import argparse
import dataclasses
import importlib
from collections.abc import Mapping
from pathlib import Path

import torch

from grpo_fast.memory import cli
from grpo_fast.memory.heads import DISTILLATION_HEADS, HEADS, LossHead
from grpo_fast.memory.recipe import DEFAULT_RECIPE, MODELS, RTX_4090, Gpu, ModelShape, Recipe
from grpo_fast.memory.sampler import SamplerHead, SamplerSettings, sampler_head

PROG = "python -m grpo_fast.memory"
RANGES = {
    "hidden_size": cli.Range(1, 65536),
    "intermediate_size": cli.Range(1, 262144),
    "num_layers": cli.Range(1, 256),
    "num_heads": cli.Range(1, 1024),
    "num_kv_heads": cli.Range(1, 1024),
    "vocab_size": cli.Range(2, 2**24),
    "micro_batch_size": cli.Range(1, 1024),
    "prompt_length": cli.Range(1, 131072),
    "completion_length": cli.Range(1, 131072),
    "prompts_per_step": cli.Range(1, 4096),
    "num_generations": cli.Range(2),  # GRPO compares the completions of one prompt: one alone has no advantage
    "lora_r": cli.Range(0, 4096),
    "lora_alpha": cli.Range(1),
    "beta": cli.Range(0.0),
    "gpu_memory_gib": cli.Range(0.0, low_open=True),
    "gpu_compute_capability": cli.Range(30, 999),
    "top_k": cli.Range(1, 2**24),
    "top_p": cli.Range(0.0, 1.0, low_open=True),
    "min_p": cli.Range(0.0, 1.0),
    "kept_k": cli.Range(1, 2**24),
    "teacher_top_k": cli.Range(1, 2**24),
}
# the head --sampler adds (grpo_fast.memory.sampler), after the others
SAMPLER_HEAD = "grpo_fast_sampler"
SAMPLER_FLAGS = ("top_k", "top_p", "min_p", "kept_k")
SHAPE_FLAGS = ("hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "vocab_size")
RECIPE_FLAGS = (
    "micro_batch_size",
    "prompt_length",
    "completion_length",
    "prompts_per_step",
    "num_generations",
    "lora_r",
    "lora_alpha",
    "beta",
    "gradient_checkpointing",
    "lm_head_dtype",
)


def parse_args(
    argv=None,
    *,
    recipes: Mapping[str, Recipe] | None = None,
    heads: Mapping[str, type[LossHead]] | None = None,
    prog: str = PROG,
):
    """The command line's arguments, checked: one line on stderr and exit status 2 for an argument out of range,
    unknown or repeated heads, or ``--measure`` without a CUDA GPU (argparse itself exits on a malformed flag).
    ``recipes``: the ``--recipe`` choices, the first the default (None: no ``--recipe``, DEFAULT_RECIPE);
    ``heads``: the ``--heads`` choices, all of them the default (None: HEADS, the default, and DISTILLATION_HEADS on
    request); ``prog``: how the command is run. ``heads`` in the result is a list of names."""
    heads = dict(HEADS if heads is None else heads)
    if peers := peer_heads(prog, argv):  # between the others and the last, the product's, as the report orders them
        *others, last = heads.items()
        heads = {**dict(others), **peers, last[0]: last[1]}
    if _given(argv, "--sampler"):  # its class, with the sampler's settings, once they are parsed and checked
        heads[SAMPLER_HEAD] = SamplerHead
    default_heads = list(heads)
    heads |= DISTILLATION_HEADS
    p = argparse.ArgumentParser(
        prog=prog,
        description="One GRPO training step's peak GPU memory, estimated on a CPU over fake tensors, for each loss "
        "head, and the generation phase's, against a card's memory (with an allowance for what is not tracked). "
        f"Without flags: {(next(iter(recipes.values())) if recipes else DEFAULT_RECIPE).describe()}.",
    )
    if recipes:
        p.add_argument(
            "--recipe",
            choices=list(recipes),
            default=next(iter(recipes)),
            help="the step to estimate (the flags below override its values)",
        )
    p.add_argument(
        "--model",
        metavar="NAME_OR_PATH",
        default=None,
        help=f"the model: a preset ({', '.join(sorted(MODELS))}), or a local config.json or a folder holding one (its "
        "architecture and sizes; read without reaching a hub)",
    )
    for dest in SHAPE_FLAGS:
        p.add_argument(cli.flag(dest), type=int, default=None, help=f"the model's {dest}")
    p.add_argument("--micro-batch-size", type=int, default=None, help="completions per forward / backward")
    p.add_argument("--prompt-length", type=int, default=None, help="prompt tokens per row")
    p.add_argument("--completion-length", type=int, default=None, help="completion tokens per row")
    p.add_argument("--prompts-per-step", type=int, default=None, help="prompts per rollout")
    p.add_argument("--num-generations", type=int, default=None, help="completions per prompt")
    p.add_argument("--lora-r", type=int, default=None, help="LoRA rank (0: every parameter trains)")
    p.add_argument(
        "--lora-alpha",
        type=int,
        default=None,
        help="LoRA's alpha (the adapters' scale alpha / r; it changes no tensor's size, the report records it)",
    )
    p.add_argument("--beta", type=float, default=None, help="KL coefficient (0: no reference log-probs)")
    p.add_argument(
        "--gradient-checkpointing",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="keep each layer's input only and recompute its activations in the backward",
    )
    p.add_argument(
        "--lm-head-dtype",
        type=lambda name: {"float32": torch.float32}[name],
        metavar="float32",
        default=None,
        help="the lm_head weight kept in float32 over the model's dtype (a master weight, as under torch.autocast): "
        "an fp32 parameter of its own, its gradient and optimizer state fp32, and grpo_fast's ops hold a V x D copy "
        "in the model's dtype while each runs (default: the model's dtype)",
    )
    p.add_argument(
        "--heads",
        default=",".join(default_heads),
        help=f"comma-separated, of {', '.join(heads)} (default: {', '.join(default_heads)})",
    )
    p.add_argument(
        "--peer-heads",
        metavar="MODULE:FUNCTION",
        default=None,
        help="more heads beside these: FUNCTION() of MODULE returns them as {name: LossHead subclass} (from a "
        f"grpo_fast checkout, {TRL_PEER_HEADS} adds TRL's fused head)",
    )
    g = p.add_argument_group(
        f"the card (by default the {RTX_4090.name}): its memory is what must fit, its architecture sizes grpo_fast's "
        "workspaces"
    )
    g.add_argument("--gpu-name", default=None, help="the card's name, as the report gives it")
    g.add_argument("--gpu-memory-gib", type=float, default=None, help=f"its memory, GiB [{RTX_4090.memory_gib:.2f}]")
    g.add_argument(
        "--gpu-compute-capability",
        type=int,
        default=None,
        help=f"10 x major + minor [{RTX_4090.compute_capability}]",
    )
    g = p.add_argument_group(
        f"grpo_fast.sampler_logprobs (issue 45): --sampler adds the head {SAMPLER_HEAD}, grpo_fast with the support's "
        "log-probs of a truncating sampler (its ops' chunk buffers by grpo_fast.memory.sampler's model)"
    )
    g.add_argument(
        "--sampler",
        choices=("old", "train", "both"),
        default=None,
        help="where sampler_logprobs runs: the old policy's no-grad pass (one micro-batch, after the update: the "
        "estimate accounts it beside the step), the training pass (both log-probs differentiated) or both",
    )
    g.add_argument("--top-k", type=int, default=None, help="the sampler's top_k")
    g.add_argument("--top-p", type=float, default=None, help="the sampler's top_p")
    g.add_argument("--min-p", type=float, default=None, help="the sampler's min_p")
    g.add_argument(
        "--kept-k",
        type=int,
        default=None,
        help="replayed kept sets of K entries (kept_ids [B, T, K], a rollout input) instead of the parameters",
    )
    g = p.add_argument_group(
        "the distillation heads (--heads " + ",".join(DISTILLATION_HEADS) + "): distillation_loss and RL with "
        "distillation in one loss call against a teacher model in the process, served_distillation_loss against a "
        "served teacher's top-k log-probs"
    )
    g.add_argument(
        "--teacher-model",
        metavar="NAME_OR_PATH",
        default=None,
        help="the teacher in the process, as --model takes it (default: the student's shape)",
    )
    g.add_argument(
        "--teacher-top-k",
        type=int,
        default=None,
        help=f"K, the served teacher's log-probs a token (TRL's teacher_top_k) [{DEFAULT_RECIPE.teacher_top_k}]",
    )
    p.add_argument("--out", default=None, help="write OUT.json, OUT.md and OUT.png (default: print the table)")
    p.add_argument(
        "--explain",
        action="store_true",
        help="after the table, what each row counts, the versions and what the estimate leaves out (the .md of "
        "--out always holds them)",
    )
    p.add_argument(
        "--measure",
        action="store_true",
        help="also run each step on the CUDA GPU (random weights) and record its real peak beside the "
        "estimate (torch.cuda.max_memory_allocated / max_memory_reserved)",
    )
    p.add_argument("--quiet", action="store_true", help="no per-phase messages on stderr")
    cli.add_ranges_to_help(p, RANGES)
    args = p.parse_args(argv)
    cli.check_numbers(prog, args, RANGES)
    args.heads = [h.strip() for h in args.heads.split(",") if h.strip()]
    unknown = [h for h in args.heads if h not in heads]
    if unknown or not args.heads or len(set(args.heads)) != len(args.heads):
        cli.fail(prog, f"--heads {','.join(args.heads)}: expected distinct names among {', '.join(heads)}")
    if args.measure and not torch.cuda.is_available():
        cli.fail(prog, "--measure runs the step on a CUDA GPU, and torch sees none here; leave it out to estimate")
    if args.sampler is not None:
        heads[SAMPLER_HEAD] = sampler_head(sampler_settings(args, prog))
    else:
        for dest in SAMPLER_FLAGS:
            if getattr(args, dest) is not None:
                cli.fail(prog, f"{cli.flag(dest)} describes the sampler of --sampler's head: give --sampler too")
    args.head_classes = {name: heads[name] for name in args.heads}
    for dest, kind in (("teacher_model", "model"), ("teacher_top_k", "served")):
        if getattr(args, dest) is not None and not any(h.teacher == kind for h in args.head_classes.values()):
            users = ",".join(name for name, h in heads.items() if h.teacher == kind)
            cli.fail(prog, f"{cli.flag(dest)} describes the teacher of --heads {users}: give one of them")
    return args


def _given(argv, flag: str) -> bool:
    """Whether the command line holds ``flag`` (with its value, either form), before it is parsed."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument(flag, default=None)
    return pre.parse_known_args(argv)[0].__dict__[flag.lstrip("-").replace("-", "_")] is not None


def sampler_settings(args, prog: str = PROG) -> SamplerSettings:
    """The sampler of ``--sampler``'s head: its passes, and its sampling parameters or replayed kept sets; one line
    on stderr and exit status 2 for none of them, or both kinds."""
    passes = ("old", "train") if args.sampler == "both" else (args.sampler,)
    parameters = {dest: getattr(args, dest) for dest in ("top_k", "top_p", "min_p") if getattr(args, dest) is not None}
    parameters = {k: v for k, v in parameters.items() if v != {"top_k": 0, "top_p": 1.0, "min_p": 0.0}[k]}
    if args.kept_k is not None and parameters:
        cli.fail(prog, "--kept-k replays kept sets, --top-k / --top-p / --min-p describe the parameters: give one")
    if args.kept_k is None and not parameters:
        cli.fail(
            prog,
            f"--sampler {args.sampler}: the sampler truncates by --top-k, --top-p (< 1) or --min-p (> 0), or replays "
            "sets of --kept-k entries; give one",
        )
    return SamplerSettings(**parameters, kept=args.kept_k or 0, passes=passes)


# the peers' heads of a grpo_fast checkout (bench/memory_peers.py: TRL's fused head as it runs on a GPU)
TRL_PEER_HEADS = "bench.memory_peers:peer_heads"


def peer_heads(prog: str, argv) -> dict[str, type[LossHead]]:
    """The heads ``--peer-heads MODULE:FUNCTION`` names (none without the flag): FUNCTION() of MODULE, a mapping of
    names to LossHead subclasses. One line on stderr and exit status 2 for a malformed value, a module or function
    that is not there, or a result that is not such a mapping."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--peer-heads", default=None)
    spec = pre.parse_known_args(argv)[0].peer_heads
    if spec is None:
        return {}
    module_name, _, function_name = spec.partition(":")
    if not module_name or not function_name:
        cli.fail(prog, f"--peer-heads {spec}: expected MODULE:FUNCTION, e.g. {TRL_PEER_HEADS}")
    try:
        function = getattr(importlib.import_module(module_name), function_name)
    except (ImportError, AttributeError) as e:
        cli.fail(prog, f"--peer-heads {spec}: {e} (run from the checkout that holds {module_name})")
    try:
        found = function() if callable(function) else None
    except Exception as e:  # noqa: BLE001 - a plug-in's failure is the command line's error, in one line
        cli.fail(prog, f"--peer-heads {spec}: {function_name}() raised {type(e).__name__}: {e}")
    if not isinstance(found, Mapping) or not all(
        isinstance(name, str) and isinstance(head, type) and issubclass(head, LossHead) for name, head in found.items()
    ):
        cli.fail(prog, f"--peer-heads {spec}: {function_name}() must return {{name: LossHead subclass}}")
    return dict(found)


def gpu_from_args(args) -> Gpu:
    """The card the command line describes: the RTX 4090 with each ``--gpu-*`` flag given applied on top."""
    given = {
        "name": args.gpu_name,
        "memory_gib": args.gpu_memory_gib,
        "compute_capability": args.gpu_compute_capability,
    }
    return dataclasses.replace(RTX_4090, **{field: value for field, value in given.items() if value is not None})


def recipe_from_args(args, recipes: Mapping[str, Recipe] | None = None, prog: str = PROG) -> Recipe:
    """The recipe the command line asks for: ``--recipe`` (DEFAULT_RECIPE without ``recipes``) with every flag given
    applied on top; one line on stderr and exit status 2 for a shape whose heads do not divide the hidden size or
    each other, or an odd head dim."""
    recipe = recipes[args.recipe] if recipes else DEFAULT_RECIPE
    named = model_shape(args.model, prog) if args.model else recipe.shape
    shape = dataclasses.replace(
        named, **{dest: getattr(args, dest) for dest in SHAPE_FLAGS if getattr(args, dest) is not None}
    )
    check_shape(shape, prog)
    name = args.model or recipe.model
    teacher = {}
    if args.teacher_model:
        teacher_shape = check_shape(model_shape(args.teacher_model, prog), prog)
        if teacher_shape.vocab_size != shape.vocab_size:
            cli.fail(
                prog,
                f"--teacher-model {args.teacher_model}: vocabulary {teacher_shape.vocab_size}, the student's is "
                f"{shape.vocab_size} (the divergence compares the two heads' distributions token by token)",
            )
        teacher = dict(teacher=teacher_shape, teacher_model=args.teacher_model)
    if args.teacher_top_k is not None:
        teacher["teacher_top_k"] = args.teacher_top_k
    return dataclasses.replace(
        recipe,
        shape=shape,
        model=name + (" (shape overridden)" if shape != named else ""),
        **teacher,
        **{f: getattr(args, f) for f in RECIPE_FLAGS if getattr(args, f) is not None},
    )


def model_shape(name_or_path: str, prog: str = PROG):
    """``--model``'s (or ``--teacher-model``'s) shape: a preset's (MODELS), or a local config.json's (a path to it
    or to a folder holding it; never a hub's). One line on stderr and exit status 2 for anything else."""
    if name_or_path in MODELS:
        return MODELS[name_or_path]
    path = Path(name_or_path).expanduser()
    if not path.exists():
        cli.fail(
            prog,
            f"{name_or_path}: not a preset ({', '.join(sorted(MODELS))}) nor a local config.json or folder holding "
            "one (the estimator reads no hub: download the model's config.json and pass its path)",
        )
    try:
        return ModelShape.from_config_file(path)
    except ValueError as e:
        cli.fail(prog, str(e))


def check_shape(shape, prog: str = PROG):
    """``shape``, or one line on stderr and exit status 2 where its heads do not divide the hidden size or each
    other, or its head dim is odd."""
    if shape.explicit_head_dim is None and shape.hidden_size % shape.num_heads:
        cli.fail(prog, f"hidden size {shape.hidden_size} is not a multiple of the {shape.num_heads} attention heads")
    if shape.num_heads % shape.num_kv_heads:
        cli.fail(prog, f"{shape.num_heads} attention heads are not a multiple of the {shape.num_kv_heads} kv heads")
    if shape.head_dim % 2:
        cli.fail(prog, f"head dim {shape.head_dim} (hidden size / heads) is odd: rotary embeddings need it even")
    return shape


def check_packages(prog: str, recipe: Recipe, heads: Mapping[str, type[LossHead]]) -> None:
    """One line on stderr and exit status 2 where a package the estimate needs does not import: transformers (it
    builds the model), PEFT (LoRA), a head's own."""
    needed = {"transformers": "builds the model from its shape"}
    if recipe.lora_r > 0:
        needed["peft"] = "applies LoRA (--lora-r 0 trains every parameter without it)"
    for name, head in heads.items():
        needed |= {package: f"runs the {name} head" for package in head.packages}
    for package, why in needed.items():
        try:
            importlib.import_module(package)
        except ImportError:
            cli.fail(prog, f"{package} {why}, and it does not import here: pip install {package}")
