"""The examples' training plot: a 2 x 3 grid of metrics against the step, from the rows of a metrics.jsonl.

    plot_metrics(rows, "metrics.png", [("reward", ["reward", "rewards/"]), ("loss", ["loss"]), ...])

A panel's keys are metric names, or prefixes ending in "/" for every metric under them (TRL's "rewards/<f>/std"
left out); a key no row has is skipped. Both examples call it, so their plots look alike.
"""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["plot_metrics", "read_rows"]


def read_rows(path) -> list[dict]:
    """The rows of a metrics.jsonl that log a training step (a "loss"), in file order."""
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    return [r for r in rows if "loss" in r]


def _keys(rows, wanted):
    present = list(dict.fromkeys(k for r in rows for k in r))
    out = []
    for key in wanted:
        if key.endswith("/"):
            out += [k for k in present if k.startswith(key) and not k.endswith("/std")]
        elif key in present:
            out.append(key)
    return out


def plot_metrics(rows, png_path, panels) -> bool:
    """Write the plot of ``rows`` to ``png_path`` (False, nothing written, when there is no row)."""
    if not rows:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    steps = [r["step"] for r in rows]
    for ax, (title, wanted) in zip(axes.flat, panels, strict=False):  # the grid may hold more axes than panels
        keys = _keys(rows, wanted)
        for key in keys:
            label = key.removeprefix("rewards/").removesuffix("/mean")
            ax.plot(steps, [r.get(key, float("nan")) for r in rows], label=label)
        ax.set_title(title)
        ax.set_xlabel("step")
        if len(keys) > 1:
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png_path, dpi=80)
    plt.close(fig)
    return True
