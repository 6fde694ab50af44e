"""A training run's steps as a table: time by phase, the loss head's share, peak memory beside the estimate.

    python examples/step_report.py RUN_DIR [--memory-report FILE] [--estimate memory-<recipe>.json] [--out FILE]

RUN_DIR is a ``train_gsm8k.py`` output folder (its metrics.jsonl: ``step_time_s``, ``time/<phase>_s`` for
generation, logprobs, policy_fwd_bwd and optimizer, and ``time/head_s``, the loss head's own forward and backward
inside policy_fwd_bwd). ``--memory-report``: the JSON lines ``--memory-report`` appended (the last one is this run's:
peak allocated GiB per phase); ``--estimate``: ``examples/memory_gsm8k.py``'s JSON for the same recipe, whose
grpo_fast head's estimated peak stands beside the measured one. Writes markdown to ``--out`` (default: stdout).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

PHASES = ("generation", "logprobs", "policy_fwd_bwd", "optimizer")


def _rows(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def report(run_dir, memory_report=None, estimate=None) -> str:
    """The markdown report of ``run_dir``'s steps (module docstring)."""
    steps = _rows(Path(run_dir) / "metrics.jsonl")
    lines = [f"# Steps of {run_dir}", ""]
    header = ["step", "step s", *(f"{phase} s" for phase in PHASES), "head s", "head / fwd+bwd", "head / step"]
    lines += ["| " + " | ".join(header) + " |", "|" + " ---: |" * len(header)]
    for row in steps:
        head, fwd_bwd, step = row.get("time/head_s"), row.get("time/policy_fwd_bwd_s"), row["step_time_s"]
        cells = [str(row["step"]), f"{step:.2f}", *(_seconds(row.get(f"time/{phase}_s")) for phase in PHASES)]
        cells += [_seconds(head), _share(head, fwd_bwd), _share(head, step)]
        lines.append("| " + " | ".join(cells) + " |")
    if memory_report:
        measured = _rows(memory_report)[-1]
        lines += ["", f"Peak CUDA memory (allocated, GiB; status {measured['status']}):", ""]
        peaks = measured["peak_allocated_gb"]
        lines += ["| " + " | ".join(peaks) + " |", "|" + " ---: |" * len(peaks)]
        lines.append("| " + " | ".join(f"{v:.2f}" for v in peaks.values()) + " |")
        if estimate:
            head = json.loads(Path(estimate).read_text())["heads"]["grpo_fast"]
            top = max(peaks.values())
            lines += [
                "",
                f"Estimated peak of the training step (grpo_fast.memory, {head['label']}): {head['peak_gib']:.2f} GiB "
                f"({head['with_allowance_gib']:.2f} with the allocator's allowance), in {head['peak_in']}; "
                f"measured: {top:.2f} GiB ({top / head['peak_gib']:.2f}x the estimate).",
            ]
    return "\n".join(lines) + "\n"


def _seconds(value):
    return "" if value is None else f"{value:.2f}"


def _share(part, whole):
    return "" if part is None or not whole else f"{100 * part / whole:.1f} %"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir")
    parser.add_argument("--memory-report", help="train_gsm8k.py's --memory-report file")
    parser.add_argument("--estimate", help="examples/memory_gsm8k.py's JSON for the same recipe")
    parser.add_argument("--out", help="the markdown file (default: stdout)")
    args = parser.parse_args(argv)
    text = report(args.run_dir, args.memory_report, args.estimate)
    if args.out:
        Path(args.out).write_text(text)
    else:
        sys.stdout.write(text)


if __name__ == "__main__":
    main()
