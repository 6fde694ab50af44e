"""The command-line pieces the two GSM8K examples share: a recipe per machine (presets), input checks that stop
in one line before anything slow (numbers, paths, the output folder), loading the data with one-line errors, the
run's output folder (never another run's), and the priming's description.

    add_ranges_to_help(parser, RANGES)   # each numeric flag's --help says what it accepts
    args = parser.parse_args(argv)
    apply_preset(args, PRESETS)          # flags left at None take the machine's recipe (--preset auto: gpu / cpu)
    check_numbers("train_gsm8k.py", args, RANGES)                                        # InputError: one line
    source, _ = check_inputs("train_gsm8k.py", args.model, args.gguf_file, args.data)   # InputError: one line
    outputs = RunOutputs("train_gsm8k.py", args.output_dir, overwrite=args.overwrite)   # refuses an earlier run's

An ``InputError`` is a ``SystemExit`` with status 2 (argparse's for a usage error) whose one-line message is on
stderr already: no traceback, and nothing slow has run.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

# the generic checks (numeric ranges, one-line errors) are the package's: its memory estimator's command line's
from grpo_fast.memory.cli import InputError, Range, add_ranges_to_help, check_numbers, fail, flag
from gsm8k import data, models

__all__ = [
    "InputError",
    "Range",
    "COMMON_RANGES",
    "add_ranges_to_help",
    "check_numbers",
    "apply_preset",
    "fail",
    "check_inputs",
    "load_split",
    "priming",
    "RunOutputs",
    "folder_size",
    "flag",
]


# the numeric flags both examples have, and the values they accept
COMMON_RANGES = {
    "lora_r": Range(0),
    "temperature": Range(0.0, low_open=True),
    "num_generations": Range(2),  # GRPO compares the completions of one question: one alone has no advantage
    "max_completion_length": Range(1),
    "max_steps": Range(1),
    "seed": Range(0, 2**32 - 1),  # numpy's seeds (transformers' set_seed seeds numpy too)
}


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


def check_inputs(prog, model, gguf_file=None, data_arg=None, splits=("train",), tokenizer=None):
    """``--model`` / ``--gguf-file`` (and a ``--tokenizer``) resolved and ``--data`` checked, in a second: (model
    source, tokenizer source); None for a name not given. A one-line ``SystemExit`` for anything that cannot work."""
    try:
        source = models.resolve(model, gguf_file) if model is not None else None
        tokenizer_source = models.resolve(tokenizer, flag="--tokenizer") if tokenizer is not None else None
        if data_arg == data.HUB_ID:
            models.check_hub_dataset(
                data.HUB_ID, instead="leave --data out for the GSM8K copy bundled with the examples"
            )
    except models.ModelError as e:
        fail(prog, e)
    if data_arg not in (None, data.BUNDLED, data.HUB_ID):
        for split in splits:
            if data.find_split(data_arg, split) is None:
                fail(
                    prog,
                    f"--data {data_arg}: no {split}.jsonl (or {split}.jsonl.gz) there; pass a folder with "
                    f"GSM8K's original files, leave --data out for the copy bundled with the examples, or --data "
                    f"{data.HUB_ID}",
                )
    return source, tokenizer_source


def load_split(prog, split, data_arg, one_shot=False):
    """``data.load_gsm8k``, with a one-line error where the hub's copy cannot be had (offline, not cached)."""
    try:
        return data.load_gsm8k(split, data_arg, one_shot=one_shot)
    except (OSError, ConnectionError, ValueError) as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        fail(prog, f"--data {data_arg}: {first}; leave --data out for the GSM8K copy bundled with the examples")


def priming(one_shot, completion_prefix) -> str:
    """The priming in words, for a script's first lines ("" without any)."""
    parts = [
        p
        for p in (
            one_shot and "a worked example before each question",
            completion_prefix and f"answers start with {completion_prefix!r}",
        )
        if p
    ]
    return f"; priming: {', '.join(parts)}" if parts else ""


def folder_size(path) -> str:
    """The bytes under ``path``, in words ("538 MB")."""
    path = Path(path)
    total = path.stat().st_size if path.is_file() else sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if total >= scale:
            return f"{total / scale:.{1 if total < 10 * scale else 0}f} {unit}"
    return f"{total} bytes"


class RunOutputs:
    """A run's output folder, which never holds another run's results.

    Created by the run (not before its checks): an existing folder must be empty, unless ``overwrite`` (the
    earlier run's ``results`` and checkpoints are deleted first) or ``resume`` (this run continues that one).
    ``path(name)`` is where the run writes ``name`` (it is then listed as written). ``finish()`` prints the final
    line, what this run wrote; ``failed(reason, steps)`` leaves nothing that looks like a result: what this run
    wrote is deleted (and the folder, if this run made it and it is now empty), except, when ``steps`` finished,
    their logs and checkpoints, kept beside FAILED.txt, which says where and why the run stopped. Files that were
    there before (a resumed run's) are never deleted.
    """

    FAILED = "FAILED.txt"

    def __init__(self, prog, folder, *, results, overwrite=False, resume=False, resumable=False):
        self.prog, self.folder, self.results = prog, Path(folder), tuple(results)
        self.written: dict[str, str] = {}  # name -> what it holds, in writing order
        self.made, self.existed = False, set()
        self.steps = 0  # finished steps whose logs the folder holds (the run counts them)
        earlier = self.earlier_outputs()
        if earlier and not (overwrite or resume):
            shown = ", ".join(earlier[:4]) + (", ..." if len(earlier) > 4 else "")
            fail(
                prog,
                f"--output-dir {folder}: holds an earlier run ({shown}); pass a new --output-dir, or "
                "--overwrite to replace it" + (" (--resume latest continues it)" if resumable else ""),
            )
        self.overwrite, self.resume = overwrite, resume

    def earlier_outputs(self) -> list[str]:
        if not self.folder.is_dir():
            return []
        return sorted(p.name + ("/" if p.is_dir() else "") for p in self.folder.iterdir())

    def create(self) -> Path:
        """Make the folder (after the checks); ``overwrite`` deletes the earlier run's results there first."""
        self.made = not self.folder.exists()
        self.folder.mkdir(parents=True, exist_ok=True)
        if self.overwrite:
            for p in self.folder.iterdir():
                if p.name in self.results or p.name == self.FAILED or p.name.startswith("checkpoint-"):
                    shutil.rmtree(p) if p.is_dir() else p.unlink()
        stale = self.folder / self.FAILED  # a resumed run's earlier stop
        if stale.exists():
            stale.unlink()
        self.existed = {p.name for p in self.folder.iterdir()}
        return self.folder

    def path(self, name: str, holds: str = "") -> Path:
        self.written[name] = holds
        return self.folder / name

    def listing(self) -> str:
        return ", ".join(name + (f" ({holds})" if holds else "") for name, holds in self.written.items())

    def finish(self) -> None:
        print(f"done: this run wrote {self.folder}/: {self.listing()}", flush=True)

    def failed(self, reason, steps: int = 0) -> None:
        """``reason``: a line, or the exception that stopped the run."""
        if isinstance(reason, BaseException):
            first = str(reason).splitlines()[0] if str(reason) else ""
            reason = type(reason).__name__ + (f": {first}" if first else "")
        for name in list(self.written):
            target = self.folder / name
            keep = name in self.existed or (
                steps > 0 and target.exists() and not name.endswith(".png") and name != "summary.json"
            )
            if not keep:
                del self.written[name]
                if target.is_dir():
                    shutil.rmtree(target)
                elif target.exists():
                    target.unlink()
        if self.written:
            self.path(self.FAILED).write_text(f"this run stopped after {steps} finished step(s): {reason}\n")
            print(
                f"failed after {steps} finished step(s): {reason}; {self.folder}/ keeps {self.listing()}",
                file=sys.stderr,
                flush=True,
            )
        else:
            if self.made and self.folder.is_dir() and not any(self.folder.iterdir()):
                self.folder.rmdir()
            print(f"failed: {reason}; this run left nothing in {self.folder}/", file=sys.stderr, flush=True)
