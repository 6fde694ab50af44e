"""The results file (JSON), its Markdown table with the goals, and the plot."""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import re
import signal
import subprocess
import sys
from pathlib import Path

import torch

from bench import sampler
from bench.sampler import SAMPLER_MODES
from bench.shapes import GOAL_SHAPE, GOAL_TOKENS

SCHEMA_VERSION = 2  # 2: scenarios (dense, padded), the fp64 truth, flops on the completion tokens
STATUSES = ("ok", "wrong", "oom", "unavailable", "error", "skipped")
CPU_BANNER = (
    "CPU numbers: not GPU figures. This run had no CUDA device: it times the CPU fallback "
    "(grpo_fast's chunked torch path) against eager PyTorch and the peers' CPU paths."
)


# ----------------------------------------------------------------------------------------------- environment
def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "unknown"


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def device_info(device) -> dict:
    device = torch.device(device)
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        return dict(
            device_type="cuda",
            device_name=torch.cuda.get_device_name(device),
            device_slug=slug(torch.cuda.get_device_name(device)),
            device_memory_bytes=p.total_memory,
            multiprocessors=p.multi_processor_count,
            cuda_version=torch.version.cuda,
        )
    name = cpu_name()
    return dict(
        device_type="cpu",
        device_name=f"CPU: {name}",
        device_slug="cpu-" + slug(name)[:40],
        cpu_threads=torch.get_num_threads(),
    )


def git_commit() -> dict:
    """The commit (BENCH_COMMIT overrides: for a copy of the tree without its .git, e.g. on a GPU machine)."""
    if os.environ.get("BENCH_COMMIT"):
        return dict(commit=os.environ["BENCH_COMMIT"], commit_short=os.environ["BENCH_COMMIT"][:7], commit_dirty=None)
    root = Path(__file__).resolve().parent.parent
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
        dirty = (
            subprocess.run(
                ["git", "status", "--porcelain", "--untracked-files=no"],
                cwd=root,
                capture_output=True,
                text=True,
                timeout=10,
            ).stdout.strip()
            != ""
        )
        short = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
        return dict(commit=commit or "unknown", commit_short=short or None, commit_dirty=dirty)
    except Exception:  # noqa: BLE001
        return dict(commit="unknown", commit_dirty=None)


def versions() -> dict:
    out = dict(python=platform.python_version(), torch=torch.__version__)
    for mod in ("triton", "liger_kernel", "trl", "grpo_fast"):
        try:
            m = __import__(mod)
            out[mod] = getattr(m, "__version__", "unknown")
        except Exception:  # noqa: BLE001
            out[mod] = None
    if out.get("liger_kernel") == "unknown":
        try:
            from importlib.metadata import version

            out["liger_kernel"] = version("liger-kernel")
        except Exception:  # noqa: BLE001
            pass
    return out


def load_average():
    """The machine's 1, 5 and 15 minute load averages (None where the OS has none)."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (OSError, AttributeError):
        return None


def now():
    return datetime.datetime.now(datetime.timezone.utc)


# ----------------------------------------------------------------------------------------------- derived numbers
def _sweeps(r):
    """The matmul FLOPs the implementation ran (counted on a CPU), in vocabulary sweeps of the completion tokens:
    units of 2 N D V. None where not counted."""
    counted = r.get("matmul_flops")
    return counted / (2 * r["active_tokens"] * r["D"] * r["V"]) if counted is not None else None


def at_start(device):
    """(the start's time stamp, the load average before the run, device_info(device), whether it is CUDA)."""
    info = device_info(device)
    return now(), load_average(), info, info["device_type"] == "cuda"


def derive(records, matmul_tflops):
    """Adds TFLOP/s, % of the measured matmul throughput, the ratios to eager (same shape, N, scenario and mode), the
    time in units of the point's bare cuBLAS product (``product_ms``, CUDA) and, for a padded batch, the ratios to
    the same implementation on the dense batch of the same shape, N and mode."""
    ok_records = {(r["shape"], r["N"], r["scenario"], r["mode"], r["impl"]): r for r in records if r["status"] == "ok"}
    for r in records:
        r.setdefault("median_ms", None)
        r.setdefault("times_ms", [])
        r.setdefault("peak_mem_bytes", None)
        r.setdefault("errors", {})
        r.setdefault("reason", None)
        ok = r["status"] == "ok" and r["median_ms"]
        r["tflops"] = r["flops"] / (r["median_ms"] * 1e-3) / 1e12 if ok else None
        r["pct_of_matmul_peak"] = 100.0 * r["tflops"] / matmul_tflops if ok and matmul_tflops else None
        e = ok_records.get((r["shape"], r["N"], r["scenario"], r["mode"], "eager"))
        r["ratio_time_vs_eager"], r["ratio_mem_vs_eager"] = _ratios(r, e) if ok else (None, None)
        product = r.get("product_ms")
        r["ratio_time_vs_product"] = r["median_ms"] / product if ok and product else None
        d = ok_records.get((r["shape"], r["N"], "dense", r["mode"], r["impl"])) if r["scenario"] != "dense" else None
        r["ratio_time_vs_dense"], r["ratio_mem_vs_dense"] = _ratios(r, d) if ok else (None, None)
        if r["mode"] in SAMPLER_MODES:  # against the plain log-prob pass and TRL's head, same point and mode
            for peer, impl in (("plain", "grpo_fast"), ("trl", "trl")):
                other = ok_records.get((r["shape"], r["N"], r["scenario"], r["mode"], impl))
                r[f"ratio_time_vs_{peer}"], r[f"ratio_mem_vs_{peer}"] = _ratios(r, other) if ok else (None, None)
    return records


def _ratios(r, other):
    """(time ratio, peak memory ratio) of record r to the record other (None where either lacks the number)."""
    if other is None:
        return None, None
    mem = (
        r["peak_mem_bytes"] / other["peak_mem_bytes"]
        if r["peak_mem_bytes"] is not None and other["peak_mem_bytes"]
        else None
    )
    return r["median_ms"] / other["median_ms"], mem


def _find(records, impl, shape=GOAL_SHAPE, N=GOAL_TOKENS, mode="fwdbwd", scenario="dense"):
    for r in records:
        if (r["impl"], r["shape"], r["N"], r["mode"], r["scenario"]) == (impl, shape, N, mode, scenario):
            return r
    return None


def evaluate_goals(meta, records):
    """The five goals at Qwen2.5-1.5B, N = 16k, dense, fwd+bwd, on a GPU (grpo_fast's memory against eager's and
    Liger's, its time against eager's and Liger's, its share of the matmul throughput): PASS, FAIL or 'not measured',
    with why."""
    goals = []

    def add(name, target, measured, result, note=""):
        goals.append(dict(goal=name, target=target, measured=measured, result=result, note=note))

    names = [
        ("memory_vs_eager", "peak memory of grpo_fast fwd+bwd <= 10% of eager's"),
        ("memory_vs_liger", "peak memory of grpo_fast fwd+bwd below Liger's"),
        ("time_vs_eager", "time of grpo_fast fwd+bwd <= 0.5x eager's"),
        ("time_vs_liger", "time of grpo_fast fwd+bwd below Liger's"),
        ("matmul_fraction", "grpo_fast fwd+bwd >= 60% of the measured matmul throughput (its head's sweeps)"),
    ]
    if meta.get("device_type") != "cuda":
        for _key, name in names:
            add(name, "", None, "not measured", "CPU run: the goals are for an H100/H200 GPU")
        return goals
    g, e, lg = _find(records, "grpo_fast"), _find(records, "eager"), _find(records, "liger")
    if g is None or g["status"] in ("skipped", "unavailable"):
        for _key, name in names:
            add(name, "", None, "not measured", f"grpo_fast was not run at {GOAL_SHAPE}, N={GOAL_TOKENS}")
        return goals
    if g["status"] != "ok":
        for _key, name in names:
            add(name, "", None, "FAIL", f"grpo_fast: {g['status']} ({g.get('reason') or ''})")
        return goals

    def versus(name, field, limit, other, other_name, fmt, oom_passes=False):
        """limit: grpo_fast / other <= limit; None: strictly below the other's."""
        if other is None or other["status"] in ("skipped", "unavailable", "error", "wrong"):
            why = "not run" if other is None else f"{other['status']}: {other.get('reason') or ''}"
            add(name, "", None, "not measured", f"{other_name} {why}")
            return
        if other["status"] == "oom":
            if oom_passes:
                add(name, "", "OOM", "PASS", f"{other_name} ran out of memory at this point; grpo_fast did not")
            else:
                add(name, "", "OOM", "not measured", f"{other_name} ran out of memory: no ratio")
            return
        if not other.get(field):
            add(name, "", None, "not measured", f"{other_name} has no {field}")
            return
        ratio = g[field] / other[field]
        passed = ratio <= limit if limit is not None else ratio < 1.0
        target = f"<= {fmt(limit)}" if limit is not None else f"< {fmt(1.0)}"
        unit = (lambda v: f"{v / 2**20:.0f} MiB") if field == "peak_mem_bytes" else (lambda v: f"{v:.2f} ms")
        add(
            name,
            target,
            fmt(ratio),
            "PASS" if passed else "FAIL",
            f"grpo_fast {unit(g[field])} vs {other_name} {unit(other[field])}",
        )

    pct = lambda v: f"{100 * v:.1f}%"  # noqa: E731
    times = lambda v: f"{v:.3f}x"  # noqa: E731
    versus(names[0][1], "peak_mem_bytes", 0.10, e, "eager", pct)
    versus(names[1][1], "peak_mem_bytes", None, lg, "Liger", times, oom_passes=True)
    versus(names[2][1], "median_ms", 0.5, e, "eager", times)
    versus(names[3][1], "median_ms", None, lg, "Liger", times)
    frac = g.get("pct_of_matmul_peak")
    if frac is None:
        add(names[4][1], ">= 60%", None, "not measured", "no matmul throughput measured")
    else:
        add(
            names[4][1],
            ">= 60%",
            f"{frac:.1f}%",
            "PASS" if frac >= 60.0 else "FAIL",
            f"{g['tflops']:.1f} TFLOP/s of {meta.get('matmul_peak_tflops', 0):.1f}",
        )
    return goals


# ----------------------------------------------------------------------------------------------- writers
def _clean(obj):
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    return obj


def write_json(path, doc):
    path = Path(path)
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "w") as f:
        json.dump(_clean(doc), f, indent=1, allow_nan=False)
        f.write("\n")
    os.replace(tmp, path)


def run_and_report(run_points, write, plot, markdown, paths, *, no_plot, tag):
    """Run a benchmark's points and report them: ``run_points(on_point_done)`` returns the records and calls
    ``on_point_done(records)`` after each point, which ``write(records, complete)`` saves (json + md) and returns as
    a document; SIGTERM (``timeout``, a machine's time limit) or Ctrl-C keeps what was measured, written as
    incomplete, and exits 130 after the report. Then the plot (a failure is reported, not fatal: the numbers are
    written), the markdown on stdout and the files written. Returns the document."""
    done = {"records": []}

    def point_done(records):
        done["records"] = records
        write(records, False)

    def terminate(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, terminate)
    try:
        records, complete = run_points(point_done), True
    except KeyboardInterrupt:
        records, complete = done["records"], False
        print(f"[{tag}] interrupted: writing the points measured so far", file=sys.stderr, flush=True)
    finally:
        signal.signal(signal.SIGTERM, previous)
    doc = write(records, complete)
    if not no_plot:
        try:
            plot(doc, paths["png"])
        except Exception as e:  # noqa: BLE001
            print(f"[{tag}] plot failed: {type(e).__name__}: {e}", file=sys.stderr)
    print(markdown(doc))
    print(f"[{tag}] wrote {', '.join(str(p) for p in paths.values() if p.exists())}", flush=True)
    if not complete:
        raise SystemExit(130)
    return doc


def _mib(b):
    return None if b is None else b / 2**20


def _fmt(v, spec):
    return "" if v is None else format(v, spec)


# the precision columns of each mode: (key in a record's errors, column title)
ERROR_COLUMNS = {
    "fwdbwd": (
        ("loss_abs_err", "loss err"),
        ("grad_hidden_rel_err", "dH rel err"),
        ("grad_weight_rel_err", "dW rel err"),
    ),
    "logprobs": (("logprobs_max_abs_err", "logp err"),),
}


def _batch(r):
    return "dense" if r["scenario"] == "dense" else f"{r['scenario']} {100 * r['fill']:.0f}%"


MODES_ORDER = ("fwdbwd", "logprobs", *SAMPLER_MODES)
MODE_TITLES = {
    "fwdbwd": "Forward + backward (loss, dH, dW)",
    "logprobs": "Log-probs, no grad (reference / old policy)",
    "sampler": "Sampler log-probs, no grad (the old policy's pass: grpo_fast.sampler_logprobs)",
    "sampler_fwdbwd": "Sampler log-probs, forward + backward (d/dH, d/dW of sum c logp + d support)",
}
# the plot's short name of each mode
MODE_SHORT = {"fwdbwd": "fwd+bwd", "logprobs": "log-probs", "sampler": "sampler", "sampler_fwdbwd": "sampler fwd+bwd"}
# the modes of the generic tables (the sampler modes have their own section: sampler_markdown)
GENERIC_MODES = ("fwdbwd", "logprobs")


def display_order(doc):
    """Records sorted for reading: by shape (as given), N, then implementation (as given)."""
    m, records = doc["meta"], doc["results"]
    shapes = list(m.get("shapes") or {}) + [r["shape"] for r in records]
    impls = list(m.get("impl_labels") or {}) + [r["impl"] for r in records]
    return sorted(
        records, key=lambda r: (shapes.index(r["shape"]), r["N"], r["scenario"] != "dense", impls.index(r["impl"]))
    )


def _time_and_memory_cells(r):
    """[median ms, peak MiB] of a record for the summary table (its status when it was not timed)."""
    if r is None:
        return ["", ""]
    if r["status"] != "ok":
        return [f"**{r['status'].upper()}**", ""]
    return [_fmt(r["median_ms"], ".1f"), _fmt(_mib(r["peak_mem_bytes"]), ".0f")]


def summary_markdown(doc) -> list[str]:
    """One row per (shape, N, batch, implementation): both modes' time and peak memory and the precision columns,
    the results file's summary table."""
    records = display_order(doc)
    by_mode = {(r["shape"], r["N"], r["scenario"], r["impl"], r["mode"]): r for r in records}
    lines = [
        "| shape | N | batch | implementation | fwd+bwd ms | fwd+bwd MiB | log-probs ms | log-probs MiB "
        "| logp err | dH rel err | dW rel err |",
        "| --- | ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for key in dict.fromkeys((r["shape"], r["N"], r["scenario"], r["impl"]) for r in records):
        fwdbwd, logprobs = by_mode.get((*key, "fwdbwd")), by_mode.get((*key, "logprobs"))
        first = fwdbwd or logprobs
        if all(r is None or r["status"] in ("unavailable", "skipped") for r in (fwdbwd, logprobs)):
            continue  # the "Why not timed" list says why
        errors = [
            _fmt((r or {}).get("errors", {}).get(k), ".1e")
            for r, k in (
                (logprobs, "logprobs_max_abs_err"),
                (fwdbwd, "grad_hidden_rel_err"),
                (fwdbwd, "grad_weight_rel_err"),
            )
        ]
        lines.append(
            "| "
            + " | ".join(
                [
                    first["shape"],
                    str(first["N"]),
                    _batch(first),
                    first["impl"],
                    *_time_and_memory_cells(fwdbwd),
                    *_time_and_memory_cells(logprobs),
                    *errors,
                ]
            )
            + " |"
        )
    return lines


def _load(values):
    return " / ".join(f"{v:.2f}" for v in values) if values else "not recorded"


def markdown(doc) -> str:
    m, records = doc["meta"], display_order(doc)
    lines = [f"# grpo_fast benchmark: {m['device_name']}", ""]
    if m["device_type"] != "cuda":
        lines += [f"> **{CPU_BANNER}**", ""]
    if not doc.get("complete", True):
        lines += ["> **Incomplete**: the run stopped before the end of the sweep.", ""]
    skipped = [r for r in doc["results"] if r["status"] == "skipped"]
    if skipped:
        lines += [
            f"> **Partial**: {len(skipped)} of {len(doc['results'])} measurements were skipped "
            f"({skipped[0].get('reason')}): "
            + "; ".join(f"{r['impl']} {r['mode']} at {r['shape']} N={r['N']} {r['scenario']}" for r in skipped)
            + ". This file holds the rest.",
            "",
        ]
    v = m["versions"]
    lines += [
        f"- date: {m['date']}; commit `{m['commit']}`"
        + (f" (`{m['commit_short']}`)" if m.get("commit_short") else "")
        + (" (uncommitted changes)" if m.get("commit_dirty") else ""),
        f"- torch {v['torch']}, triton {v.get('triton')}, trl {v.get('trl') or 'not installed'}, "
        f"liger-kernel {v.get('liger_kernel') or 'not installed'}, python {v['python']}"
        + (f", CUDA {m['cuda_version']}" if m.get("cuda_version") else ""),
        f"- dtype {m['dtype']}; loss {json.dumps(m['loss_config'])}; B = 16 completions x T positions (N = B T)",
        "- batches: `dense`, every completion T tokens; `padded NN%`, the completions' lengths those of GSM8K "
        "solutions (SmolLM2 tokens, bench/completion_lengths.py) scaled so that the longest fills T, NN% = the "
        "completion tokens' fraction of the B T positions; the implementations that can skip padding get the mask",
        f"- measured {m['dtype']} matmul throughput: {m['matmul_peak_tflops']:.4g} TFLOP/s "
        f"({m['matmul_size']}^3 products)"
        if m.get("matmul_peak_tflops")
        else "- matmul throughput: not measured",
        f"- time: {m['timing_method']}; peak memory: {m['memory_method']}",
        *(
            [
                f"- CPU threads {m.get('cpu_threads')}, thread policy {m.get('thread_policy') or 'not recorded'}; load "
                f"average (1, 5, 15 min) {_load(m.get('load_average_before'))} before the run, "
                f"{_load(m.get('load_average_after'))} at its end (other processes share this machine's cores)"
            ]
            if m["device_type"] != "cuda"
            else []
        ),
        "- TFLOP/s count the matmul work on the completion tokens n: for grpo_fast's rows that of the head that ran "
        "(`head`: the log-prob pass 2nDV, frozen 4nDV, three-sweep 6nDV, frozen recompute 6nDV, recompute 8nDV), for "
        "the others the floor (2nDV log-probs, 8nDV fwd+bwd, 4nDV with a frozen lm_head); "
        "`matmul / 2NDV`: the matmul FLOPs each ran, counted on a CPU; `x eager` is the ratio to eager (which "
        "computes dW) at the same point; `x product` the time in units of cuBLAS's bare H W^T over the same "
        "completion tokens in the input dtype, measured at the same point (CUDA; a log-prob pass's floor is 1, a "
        "trained head's 3 or 4); peak MiB is the memory above the inputs, gradients included",
        "- precision (`err` columns), at the input dtype, against grpo_fast.reference with fp64 logits (row-chunked) "
        "on the completion tokens: loss |error|; dH, dW: max |error| / max |truth|; logp: max |error| in nats. "
        "Beyond the guard's tolerances an implementation is `wrong` and not timed; `oom` ran out of memory",
        "",
    ]
    generic = any(r["mode"] in GENERIC_MODES for r in records) or not records
    if generic:  # the goals are the loss head's (fwd+bwd): a run of the sampler mode alone has none to show
        lines += [
            f"## Goals (Qwen2.5-1.5B shape, N = {GOAL_TOKENS} tokens, fwd+bwd)",
            "",
            "| goal | target | measured | result | note |",
            "| --- | --- | --- | --- | --- |",
        ]
        for g in doc.get("goals", []):
            lines.append(f"| {g['goal']} | {g['target']} | {g['measured'] or ''} | **{g['result']}** | {g['note']} |")
        lines += ["", "## Summary", "", *summary_markdown(doc), ""]
    lines += sampler_markdown(doc, records)
    for mode in GENERIC_MODES:
        rows = [r for r in records if r["mode"] == mode]
        if not rows:
            continue
        columns = ERROR_COLUMNS[mode]
        lines += [
            f"## {MODE_TITLES[mode]}",
            "",
            "| shape | N | batch | implementation | head | status | median ms | x eager | x product | peak MiB "
            "| mem x eager | TFLOP/s | % matmul | matmul / 2NDV | " + " | ".join(title for _, title in columns) + " |",
            "| --- | ---: | --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
            + " ---: |" * len(columns),
        ]
        for r in rows:
            status = r["status"] if r["status"] == "ok" else f"**{r['status'].upper()}**"
            errors = " | ".join(_fmt(r["errors"].get(key), ".1e") for key, _ in columns)
            lines.append(
                f"| {r['shape']} | {r['N']} | {_batch(r)} | {r['impl']} | {r.get('head') or ''} | {status} "
                f"| {_fmt(r['median_ms'], '.3f')} "
                f"| {_fmt(r['ratio_time_vs_eager'], '.3f')} | {_fmt(r.get('ratio_time_vs_product'), '.2f')} "
                f"| {_fmt(_mib(r['peak_mem_bytes']), '.1f')} "
                f"| {_fmt(r['ratio_mem_vs_eager'], '.3f')} | {_fmt(r['tflops'], '.3g')} "
                f"| {_fmt(r['pct_of_matmul_peak'], '.1f')} | {_fmt(_sweeps(r), '.2f')} | {errors} |"
            )
        lines.append("")
    padded = [
        r
        for r in records
        if r["scenario"] != "dense" and r["status"] not in ("unavailable", "skipped") and r["mode"] in GENERIC_MODES
    ]
    if padded:
        dense = {(r["shape"], r["N"], r["mode"], r["impl"]): r for r in records if r["scenario"] == "dense"}
        lines += [
            "## Padded batch against the dense batch (same B x T positions)",
            "",
            "| shape | N | mode | batch | completion tokens | implementation | ms dense | ms padded "
            "| time x dense | MiB dense | MiB padded | mem x dense |",
            "| --- | ---: | --- | --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for r in sorted(padded, key=lambda r: MODES_ORDER.index(r["mode"])):  # stable: display order within
            d = dense.get((r["shape"], r["N"], r["mode"], r["impl"]), {})
            lines.append(
                f"| {r['shape']} | {r['N']} | {r['mode']} | {_batch(r)} | {r['active_tokens']} | {r['impl']} "
                f"| {_fmt(d.get('median_ms'), '.3f')} | {_fmt(r['median_ms'], '.3f')} "
                f"| {_fmt(r['ratio_time_vs_dense'], '.3f')} | {_fmt(_mib(d.get('peak_mem_bytes')), '.1f')} "
                f"| {_fmt(_mib(r['peak_mem_bytes']), '.1f')} | {_fmt(r['ratio_mem_vs_dense'], '.3f')} |"
            )
        lines.append("")
    notes = [
        (r["shape"], r["N"], r["scenario"], r["mode"], r["impl"], r["status"], r["reason"])
        for r in records
        if r["status"] != "ok" and r.get("reason")
    ]
    if notes:
        lines += ["## Why not timed", ""]
        seen = set()
        for shape, N, scenario, mode, impl, status, reason in notes:
            key = (impl, status, reason) if status in ("unavailable", "skipped") else (shape, N, scenario, mode, impl)
            if key in seen:
                continue
            seen.add(key)
            where = "everywhere" if status in ("unavailable", "skipped") else f"{shape} N={N} {scenario} {mode}"
            lines.append(f"- {impl} ({where}): {status}: {reason}")
        lines.append("")
    lines += ["Implementations:", ""]
    for name, label in m.get("impl_labels", {}).items():
        lines.append(f"- `{name}`: {label}")
    lines.append("")
    return "\n".join(lines)


SAMPLER_ERROR_COLUMNS = {
    "sampler": (("logprobs_max_abs_err", "logp err"), ("support_max_abs_err", "support err")),
    "sampler_fwdbwd": ERROR_COLUMNS["fwdbwd"],
}


def sampler_markdown(doc, records) -> list[str]:
    """The sampler mode's section: issue 45's targets, then a table per mode (no grad, forward + backward) with each
    row's time and memory against the plain log-prob pass (grpo_fast), TRL's head and cuBLAS's product measured in the
    same run, its precision against the fp64 spec and its kept sets."""
    rows = [r for r in records if r["mode"] in SAMPLER_MODES]
    if not rows:
        return []
    s = doc["meta"].get("sampler") or {}
    lines = [
        "## Sampler log-probs: grpo_fast.sampler_logprobs (issue 45)",
        "",
        "`grpo_fast` is the plain log-prob pass (`grpo_fast.logprobs`; forward + backward: `logprobs_and_entropy`'s "
        "log-probs), `trl` TRL 1.16's head's log-prob pass, the `sampler_*` rows `grpo_fast.sampler_logprobs` with "
        "the sampling parameters (the parameters' path: each chunk of token rows' whole fp32 logits) or replayed "
        "`kept_ids` (the K kept entries' logits, the full log-prob by the plain op), all on one batch whose targets "
        "every rule could have drawn"
        + (f" ({s['targets']})" if s.get("targets") else "")
        + (f"; replayed sets: {s['replayed_sets']}" if s.get("replayed_sets") else "")
        + ". `x plain`, `x trl`: the time (`mem x`: the peak memory) over the plain pass's and TRL's at the same "
        "point and mode; `x product`: over cuBLAS's bare H W^T at the point (CUDA; a log-prob pass's floor is 1); "
        "`x dense`: a padded batch's time over the dense one's. Forward + backward differentiates "
        + (s.get("loss") or "sum c logp + d support")
        + ". Precision against the fp64 spec (`reference.logits`, `reference.kept_mask`, the support's formula): "
        "`support err` over the certain tokens; `uncertain`: tokens whose fp64 kept set a rounding of the logits "
        "could change"
        + (f" ({s['uncertain_tokens']})" if s.get("uncertain_tokens") else "")
        + "; `kept`: the kept sets' median / largest size (a replayed set: its entries).",
        "",
        "### Targets (issue 45: the no-grad pass's time over the plain log-prob pass's, same run)",
        "",
        "| shape | N | batch | implementation | target | measured | result | note |",
        "| --- | ---: | --- | --- | ---: | ---: | --- | --- |",
    ]
    by_key = {(r["shape"], r["N"], r["scenario"], r["mode"], r["impl"]): r for r in rows}
    for t in sampler.target_rows(doc):
        r = by_key.get((t["shape"], t["N"], t["scenario"], "sampler", t["impl"]), {"scenario": t["scenario"]})
        batch = _batch(r) if "fill" in r else t["scenario"]
        lines.append(
            f"| {t['shape']} | {t['N']} | {batch} | {t['impl']} | <= {t['target']:.2f}x "
            f"| {_fmt(t['measured'], '.3f')}{'x' if t['measured'] is not None else ''} | **{t['result']}** "
            f"| {t['note']} |"
        )
    lines.append("")
    for mode in SAMPLER_MODES:
        mode_rows = [r for r in rows if r["mode"] == mode]
        if not mode_rows:
            continue
        columns = SAMPLER_ERROR_COLUMNS[mode]
        lines += [
            f"### {MODE_TITLES[mode]}",
            "",
            "| shape | N | batch | implementation | status | median ms | x plain | x trl | x product | x dense "
            "| peak MiB | mem x plain | mem x trl | matmul / 2NDV | "
            + " | ".join(title for _, title in columns)
            + " | uncertain | kept |",
            "| --- | ---: | --- | --- | --- |" + " ---: |" * (9 + len(columns)) + " ---: | ---: |",
        ]
        for r in mode_rows:
            status = r["status"] if r["status"] == "ok" else f"**{r['status'].upper()}**"
            errors = " | ".join(_fmt(r["errors"].get(key), ".1e") for key, _ in columns)
            kept = f"{r['kept_set_median']:.0f} / {r['kept_set_max']}" if r.get("kept_set_max") is not None else ""
            lines.append(
                f"| {r['shape']} | {r['N']} | {_batch(r)} | {r['impl']} | {status} | {_fmt(r['median_ms'], '.3f')} "
                f"| {_fmt(r.get('ratio_time_vs_plain'), '.3f')} | {_fmt(r.get('ratio_time_vs_trl'), '.3f')} "
                f"| {_fmt(r.get('ratio_time_vs_product'), '.2f')} | {_fmt(r.get('ratio_time_vs_dense'), '.3f')} "
                f"| {_fmt(_mib(r['peak_mem_bytes']), '.1f')} | {_fmt(r.get('ratio_mem_vs_plain'), '.3f')} "
                f"| {_fmt(r.get('ratio_mem_vs_trl'), '.3f')} | {_fmt(_sweeps(r), '.2f')} | {errors} "
                f"| {_fmt(r.get('uncertain_tokens'), 'd')} | {kept} |"
            )
        lines.append("")
    return lines


def _plot_value(r, kind):
    """The number a plot panel shows for record r, or None: time and memory of a timed run, the error of a checked
    one (a precision panel)."""
    if kind == "time":
        return r["median_ms"] if r["status"] == "ok" else None
    if kind == "mem":
        return _mib(r["peak_mem_bytes"]) if r["status"] == "ok" else None
    err = r["errors"].get(kind) if r["status"] in ("ok", "wrong") else None
    return err if err else None  # an exact 0 has no place on a log scale


PANEL_LABELS = {
    "time": "median ms",
    "mem": "peak MiB above inputs",
    "logprobs_max_abs_err": "max |logp - fp64| (nats)",
    "grad_hidden_rel_err": "dH: max |err| / max |dH|",
    "support_max_abs_err": "max |support logp - fp64| (nats)",
}


def plot(doc, path):
    """Time and peak memory against N, a row per mode and quantity, a column per shape, a line per implementation
    (dense batch solid, padded dotted with open markers), then one row of precision against fp64 (the log-probs'
    error, or dH's without the logprobs mode) on the dense batch. OOM / WRONG are crosses at the top."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.ticker import LogFormatter, NullLocator
    from matplotlib.transforms import blended_transform_factory

    records = display_order(doc)
    modes = [m for m in MODES_ORDER if any(r["mode"] == m for r in records)]
    shapes = list(dict.fromkeys(r["shape"] for r in records))
    impls = list(dict.fromkeys(r["impl"] for r in records))
    if not modes or not shapes:
        return None
    panels = [(mode, kind) for mode in modes for kind in ("time", "mem")]
    if "logprobs" in modes:
        panels.append(("logprobs", "logprobs_max_abs_err"))
    elif "fwdbwd" in modes:
        panels.append(("fwdbwd", "grad_hidden_rel_err"))
    if "sampler" in modes:
        panels.append(("sampler", "support_max_abs_err"))
    colors = {name: plt.cm.tab10(i % 10) for i, name in enumerate(impls)}
    scenarios = list(dict.fromkeys(r["scenario"] for r in records))
    nrows = len(panels)
    fig, axes = plt.subplots(nrows, len(shapes), figsize=(max(9.0, 4.2 * len(shapes)), 2.8 * nrows), squeeze=False)
    for row, (mode, kind) in enumerate(panels):
        for si, shape in enumerate(shapes):
            ax = axes[row][si]
            trans = blended_transform_factory(ax.transData, ax.transAxes)
            for impl in impls:
                for scenario in scenarios if kind in ("time", "mem") else ["dense"]:
                    rs = sorted(
                        (
                            r
                            for r in records
                            if (r["mode"], r["shape"], r["impl"], r["scenario"]) == (mode, shape, impl, scenario)
                        ),
                        key=lambda r: r["N"],
                    )
                    pts = [(r["N"], _plot_value(r, kind)) for r in rs]
                    pts = [(n, y) for n, y in pts if y is not None]
                    dense = scenario == "dense"
                    if pts:
                        ax.plot(
                            *zip(*pts, strict=True),
                            marker="o",
                            ms=3.5,
                            color=colors[impl],
                            linestyle=("--" if impl.endswith("frozen") else "-") if dense else ":",
                            markerfacecolor=colors[impl] if dense else "none",
                        )
                    for r in rs:
                        if r["status"] in ("oom", "wrong"):
                            ax.plot([r["N"]], [0.97], marker="x", color=colors[impl], transform=trans, clip_on=False)
                            ax.annotate(
                                r["status"].upper(),
                                (r["N"], 0.97),
                                xycoords=trans,
                                fontsize=6,
                                color=colors[impl],
                                xytext=(-8, -10),
                                textcoords="offset points",
                            )
            ax.set_xscale("log", base=2)
            ns = sorted({r["N"] for r in records if r["shape"] == shape})
            ax.set_xticks(ns)
            ax.set_xticklabels([f"{n // 1024}k" if n % 1024 == 0 else str(n) for n in ns])
            ax.xaxis.set_minor_locator(NullLocator())
            if ax.has_data():
                ax.set_yscale("log")
                if kind in ("time", "mem"):  # 20, 50, not 2x10^1; errors keep the scientific labels
                    ax.yaxis.set_major_formatter(LogFormatter(labelOnlyBase=False))
                    ax.yaxis.set_minor_formatter(LogFormatter(labelOnlyBase=False, minor_thresholds=(1, 0.4)))
            ax.grid(True, which="both", alpha=0.3)
            ax.set_xlabel("positions N = B x T")
            ax.set_ylabel(f"{MODE_SHORT[mode]}: {PANEL_LABELS[kind]}", fontsize=8)
            if row == 0:
                ax.set_title(shape)
    plotted = [i for i in impls if any(r["impl"] == i and r["status"] in ("ok", "wrong", "oom") for r in records)]
    handles = [
        Line2D([], [], color=colors[i], marker="o", ms=3.5, linestyle="--" if i.endswith("frozen") else "-", label=i)
        for i in plotted
    ]
    fills = sorted({f"{100 * r['fill']:.0f}%" for r in records if r["scenario"] == "padded"})
    if fills:
        handles += [
            Line2D([], [], color="gray", marker="o", ms=3.5, label="dense batch"),
            Line2D(
                [],
                [],
                color="gray",
                marker="o",
                ms=3.5,
                linestyle=":",
                markerfacecolor="none",
                label=f"padded batch ({', '.join(fills)} completion tokens)",
            ),
        ]
    ncol = min(len(handles), 4 if len(shapes) <= 2 else 8)
    legend_rows = -(-len(handles) // ncol)
    height = fig.get_size_inches()[1]
    m = doc["meta"]
    title = f"grpo_fast benchmark, {m['device_name']}, {m['dtype']}, {m['date'][:10]}"
    if m["device_type"] != "cuda":
        title = "CPU numbers, not GPU figures: " + title
    fig.suptitle(title, y=1 - 0.05 / height, fontsize=10, va="top")
    fig.legend(
        handles=handles,
        loc="upper center",
        ncol=ncol,
        frameon=False,
        fontsize=8,
        bbox_to_anchor=(0.5, 1 - 0.25 / height),
    )
    fig.tight_layout(rect=(0, 0, 1, 1 - (0.25 + 0.18 * legend_rows) / height))
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
