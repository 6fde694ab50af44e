"""The command-line pieces the two GSM8K examples share: a recipe per machine (presets), input checks that stop
in one line before anything slow, loading the data with one-line errors, and the priming's description.

    args = parser.parse_args(argv)
    apply_preset(args, PRESETS)          # flags left at None take the machine's recipe (--preset auto: gpu / cpu)
    source, _ = check_inputs("train_gsm8k.py", args.model, args.gguf_file, args.data)   # SystemExit: one line
"""

from __future__ import annotations

from grpo_fast.gsm8k import data, models

__all__ = ["apply_preset", "fail", "check_inputs", "load_split", "priming"]


def apply_preset(args, presets: dict) -> None:
    """``args.preset`` "auto" becomes "gpu" where CUDA is, "cpu" elsewhere; every flag of that preset left at None
    takes its value. ``args.changed``: the preset's flags the user set."""
    if args.preset == "auto":
        import torch

        args.preset = "gpu" if torch.cuda.is_available() else "cpu"
    args.changed = sorted(k for k in presets[args.preset] if getattr(args, k) is not None)
    for key, value in presets[args.preset].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if getattr(args, "completion_prefix", None):
        args.completion_prefix = args.completion_prefix.replace("\\n", "\n")


def fail(prog: str, message) -> None:
    """Stop with one line on stderr that says what to pass instead (no traceback)."""
    raise SystemExit(f"{prog}: error: {message}")


def check_inputs(prog, model, gguf_file=None, data_arg=None, splits=("train",), tokenizer=None):
    """``--model`` / ``--gguf-file`` (and a ``--tokenizer``) resolved and ``--data`` checked, in a second: (model
    source, tokenizer source); None for a name not given. A one-line ``SystemExit`` for anything that cannot work."""
    try:
        source = models.resolve(model, gguf_file) if model is not None else None
        tokenizer_source = models.resolve(tokenizer, flag="--tokenizer") if tokenizer is not None else None
        if data_arg == data.HUB_ID:
            models.check_hub_dataset(data.HUB_ID, instead="leave --data out for the GSM8K copy bundled with grpo_fast")
    except models.ModelError as e:
        fail(prog, e)
    if data_arg not in (None, data.BUNDLED, data.HUB_ID):
        for split in splits:
            if data.find_split(data_arg, split) is None:
                fail(prog, f"--data {data_arg}: no {split}.jsonl (or {split}.jsonl.gz) there; pass a folder with "
                     f"GSM8K's original files, leave --data out for the copy bundled with grpo_fast, or --data "
                     f"{data.HUB_ID}")
    return source, tokenizer_source


def load_split(prog, split, data_arg, one_shot=False):
    """``data.load_gsm8k``, with a one-line error where the hub's copy cannot be had (offline, not cached)."""
    try:
        return data.load_gsm8k(split, data_arg, one_shot=one_shot)
    except (OSError, ConnectionError, ValueError) as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        fail(prog, f"--data {data_arg}: {first}; leave --data out for the GSM8K copy bundled with grpo_fast")


def priming(one_shot, completion_prefix) -> str:
    """The priming in words, for a script's first lines ("" without any)."""
    parts = [p for p in (one_shot and "a worked example before each question",
                         completion_prefix and f"answers start with {completion_prefix!r}") if p]
    return f"; priming: {', '.join(parts)}" if parts else ""
