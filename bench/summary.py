"""The README's picture and its table, drawn from committed results files (nothing is measured here).

    python -m bench.summary                  # writes bench/results/summary.png and summary.md
    python -m bench.summary --out runs/bench # elsewhere

Each column of the picture is one point of one results file (a head, N, the dense batch): forward + backward time,
its peak memory above the inputs, and the precision at bf16 against an fp64 truth. Columns come from different runs
on different machines: compare bars within a column, never across. A results file made on a GPU (``meta.device_type``
"cuda") is marked as such; the CPU's are marked CPU. When GPU results are committed, add their points to ``PANELS``.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"

# the implementations in the order they are drawn, and their names in the picture
NAMES = {
    "eager": "eager PyTorch",
    "trl": "TRL 1.16 fused head",
    "liger": "Liger-Kernel 0.8.5",
    "verl_torch": "verl 0.9 torch head",
    "cce": "Cut Cross-Entropy 25.1",
    "trl_frozen": "TRL 1.16 fused head",
    "grpo_fast": "grpo_fast",
    "grpo_fast_frozen": "grpo_fast",
}
COLORS = {
    "eager": "#7f7f7f",
    "trl": "#1f77b4",
    "trl_frozen": "#1f77b4",
    "liger": "#9467bd",
    "verl_torch": "#2ca02c",
    "cce": "#ff7f0e",
    "grpo_fast": "#d62728",
    "grpo_fast_frozen": "#d62728",
}


@dataclass(frozen=True)
class Panel:
    """One column (``title`` unique: the rows are grouped by it): the records of ``impls`` at (shape, N, dense) in
    ``file``; ``error`` names the precision row."""

    title: str
    file: str
    shape: str
    tokens: int
    impls: tuple[str, ...]
    error: str = "logprobs_max_abs_err"  # read from the log-probs mode's record; dH's from the fwd+bwd record


PANELS = (
    Panel(
        "Qwen2.5-1.5B head (GPU)",
        "gpu-h200-2026-11-27/bench/nvidia-h200-2026-11-27.json",
        "qwen2.5-1.5b",
        16384,
        ("eager", "trl", "grpo_fast"),
    ),
    Panel(
        "Qwen2.5-1.5B head, frozen (LoRA) (GPU)",
        "gpu-h200-2026-11-27/bench/nvidia-h200-2026-11-27.json",
        "qwen2.5-1.5b",
        16384,
        ("trl_frozen", "grpo_fast_frozen"),
        error="grad_hidden_rel_err",
    ),
    Panel("Qwen2.5-1.5B head", "cpu-xeon-bf16.json", "qwen2.5-1.5b", 2048, ("eager", "trl", "liger", "grpo_fast")),
    Panel("Qwen2.5-1.5B head, verl", "cpu-verl-bf16.json", "qwen2.5-1.5b", 1024, ("verl_torch", "grpo_fast")),
    Panel(
        "Qwen2.5-1.5B head, frozen (LoRA)",
        "cpu-frozen-bf16.json",
        "qwen2.5-1.5b",
        2048,
        ("trl_frozen", "grpo_fast_frozen"),
        error="grad_hidden_rel_err",
    ),
)
ERROR_LABELS = {
    "logprobs_max_abs_err": "log-prob error vs fp64 (nats)",
    "grad_hidden_rel_err": "dH error vs fp64 (max abs error / max abs dH)",
}


def _ms_format(ms):
    """A time's format: a GPU's tens of ms with a decimal, a CPU's thousands without."""
    return ".1f" if ms is not None and ms < 100 else ".0f"


def _record(doc, panel, impl, mode):
    for r in doc["results"]:
        key = (r["shape"], r["N"], r["scenario"], r["mode"], r["impl"])
        if key == (panel.shape, panel.tokens, "dense", mode, impl) and r["status"] == "ok":
            return r
    return None


def rows(results=RESULTS):
    """One dict per (panel, implementation): the numbers drawn, and where they come from."""
    out = []
    for panel in PANELS:
        doc = json.loads((results / panel.file).read_text())
        meta = doc["meta"]
        where = "GPU" if meta["device_type"] == "cuda" else "CPU"
        for impl in panel.impls:
            fwdbwd = _record(doc, panel, impl, "fwdbwd")
            error_mode = "logprobs" if panel.error == "logprobs_max_abs_err" else "fwdbwd"
            checked = _record(doc, panel, impl, error_mode)
            out.append(
                dict(
                    panel=panel.title,
                    impl=impl,
                    name=NAMES[impl],
                    tokens=panel.tokens,
                    ms=fwdbwd["median_ms"] if fwdbwd else None,
                    mib=fwdbwd["peak_mem_bytes"] / 2**20 if fwdbwd else None,
                    error=checked["errors"].get(panel.error) if checked else None,
                    error_kind=panel.error,
                    where=where,
                    device=meta["device_name"],
                    date=meta["date"][:10],
                    commit=meta["commit"][:7],
                    file=f"bench/results/{panel.file}",
                )
            )
    return out


def _cell(v, spec):
    return "" if v is None else format(v, spec)


def markdown(table) -> str:
    lines = [
        "# The README's picture, as numbers",
        "",
        "Written by `python -m bench.summary` from the results files named in each row (dense batch, bf16 inputs, "
        "forward + backward; peak memory above the inputs; error against an fp64 truth). Rows of different files "
        "ran on different machines: compare within a head and file only.",
        "",
        "| head | N | implementation | fwd+bwd ms | fwd+bwd MiB | error | error of | device | date | commit | file |",
        "| --- | ---: | --- | ---: | ---: | ---: | --- | --- | --- | --- | --- |",
    ]
    for r in table:
        lines.append(
            f"| {r['panel']} | {r['tokens']} | {r['name']} (`{r['impl']}`) | {_cell(r['ms'], _ms_format(r['ms']))} | "
            f"{_cell(r['mib'], '.0f')} | {_cell(r['error'], '.1e')} | {ERROR_LABELS[r['error_kind']]} | "
            f"{r['where']}: {r['device'].removeprefix('CPU: ')} | {r['date']} | `{r['commit']}` | `{r['file']}` |"
        )
    return "\n".join(lines) + "\n"


def plot(table, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, len(PANELS), figsize=(4.2 * len(PANELS), 7.4), squeeze=False)
    where = sorted({r["where"] for r in table})
    for col, panel in enumerate(PANELS):
        mine = [r for r in table if r["panel"] == panel.title]
        labels = [r["name"] for r in mine]
        colors = [COLORS[r["impl"]] for r in mine]
        first = mine[0]
        cpu = first["device"].removeprefix("CPU: ")
        axes[0, col].set_title(
            f"{panel.title}, N {panel.tokens}\n{first['where']} ({cpu}), {first['date']}", fontsize=9
        )
        for row, (field, label, log) in enumerate(
            (
                ("ms", "fwd+bwd time (ms)", False),
                ("mib", "fwd+bwd peak memory (MiB)", False),
                ("error", ERROR_LABELS[panel.error], True),
            )
        ):
            ax = axes[row, col]
            values = [r[field] if r[field] is not None else 0.0 for r in mine]
            ax.barh(range(len(mine)), values, color=colors)
            ax.set_yticks(range(len(mine)), labels, fontsize=8)
            ax.invert_yaxis()
            ax.set_xlabel(label, fontsize=8)
            ax.tick_params(axis="x", labelsize=7)
            if log:
                ax.set_xscale("log")
                ax.set_xlim(1e-7, 1.0)  # the same range in every error panel
            for i, v in enumerate(values):
                if v:
                    ax.text(v, i, f" {v:.1e}" if log else f" {v:.0f}", va="center", fontsize=7)
            ax.margins(x=0.25)
    banner = (
        "CPU figures: no GPU has run the benchmark yet (grpo_fast's chunked torch path on a CPU, "
        "not its Triton kernels)"
        if where == ["CPU"]
        else "GPU and CPU figures, each column marked"
    )
    fig.suptitle(f"{banner}. bf16 inputs, dense batch. Compare bars within a column only.", fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench.summary", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(RESULTS), help="folder for summary.png and summary.md (bench/results)")
    p.add_argument("--no-plot", action="store_true", help="the Markdown table only")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    table = rows()
    (out / "summary.md").write_text(markdown(table))
    if not args.no_plot:
        plot(table, out / "summary.png")
    print(f"wrote {out / 'summary.md'}" + ("" if args.no_plot else f" and {out / 'summary.png'}"))


if __name__ == "__main__":
    main()
