"""python -m bench: grpo_fast against eager PyTorch, torch.compile, TRL 1.16's fused head and Liger-Kernel: speed,
peak memory and precision against fp64, on dense and padded batches.

    python -m bench --quick                                   # a first look
    python -m bench                                           # the full sweep
    python -m bench --shapes qwen2.5-1.5b --tokens 16384 --impls eager,trl,liger,grpo_fast --mode fwdbwd
    python -m bench --shapes 64x2000 --tokens 512 --device cpu --dtype float32 --scenarios padded
    python -m bench --mode sampler --shapes qwen2.5-1.5b --tokens 4k,16k    # grpo_fast.sampler_logprobs (issue 45)

Writes <out>/<device>-<date>[-quick].json, .md and .png (see bench/README.md); <out> is runs/bench/ in the
repository (ignored by git) unless --out names another folder (--out bench/results: results to commit).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

from bench import THREAD_POLICY, completion_lengths, measure, report, runner
from bench import impls as impl_registry
from bench.inputs import LOSS_CONFIG, SCENARIOS
from bench.sampler import SAMPLER_MODES, sampler_meta
from bench.shapes import (
    CPU_FULL_SHAPES,
    CPU_QUICK_SHAPES,
    CPU_QUICK_TOKENS,
    CPU_SHAPES,
    CPU_TOKENS,
    GPU_QUICK_SHAPES,
    GPU_QUICK_TOKENS,
    GPU_TOKENS,
    MODEL_SHAPES,
    resolve_shape,
)

# runs/ is ignored by git: a benchmark run leaves the checkout clean unless asked to write elsewhere
ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = str(ROOT / "runs" / "bench")
DEFAULT_OUT_SHOWN = "runs/bench"

DTYPES = {
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "float32": torch.float32,
    "fp32": torch.float32,
}


# --mode's choices: the record modes each runs
MODE_CHOICES = {
    "fwdbwd": ["fwdbwd"],
    "logprobs": ["logprobs"],
    "both": ["fwdbwd", "logprobs"],
    "sampler": list(SAMPLER_MODES),
    "all": ["fwdbwd", "logprobs", *SAMPLER_MODES],
}


def _csv(text):
    return [t.strip() for t in text.split(",") if t.strip()] if text else []


def _tokens(text):
    out = []
    for t in _csv(text):
        t = t.lower()
        mult = 1024 if t.endswith("k") else 1
        out.append(int(float(t[:-1] if mult > 1 else t) * mult))
    return out


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        prog="python -m bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--shapes",
        help="comma-separated: "
        + ", ".join(list(MODEL_SHAPES) + list(CPU_SHAPES))
        + ", or DxV (default: the model shapes on a GPU; CPU "
        + ",".join(CPU_FULL_SHAPES)
        + ", quick "
        + ",".join(CPU_QUICK_SHAPES)
        + ")",
    )
    p.add_argument(
        "--tokens",
        help="comma-separated positions per call N = 16 x T, e.g. 2k,4k,16k,64k "
        f"(default GPU {','.join(map(str, GPU_TOKENS))}; CPU {','.join(map(str, CPU_TOKENS))})",
    )
    p.add_argument(
        "--impls",
        help="comma-separated: "
        + ", ".join(impl_registry.IMPLS)
        + f" (default GPU {','.join(impl_registry.DEFAULT_GPU)}; CPU {','.join(impl_registry.DEFAULT_CPU)})",
    )
    p.add_argument(
        "--mode",
        choices=tuple(MODE_CHOICES),
        default="both",
        help="fwdbwd (the GRPO loss, forward + backward), logprobs (no grad), both (those two), sampler "
        "(grpo_fast.sampler_logprobs beside the plain log-prob pass, no-grad and forward + backward, on a batch of "
        "drawable targets: bench/sampler.py), all (the three) (default both)",
    )
    p.add_argument(
        "--scenarios",
        default=",".join(SCENARIOS),
        help="comma-separated: dense (every completion T tokens), padded (GSM8K solutions' lengths, "
        "padded to the longest) (default: both)",
    )
    p.add_argument("--reps", type=int, help="timed runs (at most; default 10, quick 5, CPU quick 3)")
    p.add_argument("--min-reps", type=int, default=3)
    p.add_argument("--warmup", type=int, help="untimed runs after the guard's run, itself untimed (default 1)")
    p.add_argument(
        "--max-seconds",
        type=float,
        default=3.0,
        help="stop timing an implementation at a point after this long (once --min-reps are done)",
    )
    p.add_argument(
        "--time-budget",
        type=float,
        default=float("inf"),
        help="seconds for the whole sweep; what is left is recorded as skipped and the files are written",
    )
    p.add_argument("--quick", action="store_true", help="a first look: few shapes, tokens and runs")
    p.add_argument("--device", help="cuda or cpu (default: cuda when available)")
    p.add_argument("--dtype", choices=sorted(DTYPES), help="input dtype (default bfloat16 on a GPU, float32 on a CPU)")
    p.add_argument("--backend", default="auto", choices=("auto", "triton", "torch"), help="grpo_fast's backend")
    add_output_arguments(p, "<device>-<date>[-quick]")
    return p.parse_args(argv)


def add_output_arguments(p, stem):
    """The flags both benchmarks (this one and bench.divergence) take for their output: the folder, the file stem
    (default ``stem``), the seed, no plot, no progress bar."""
    p.add_argument(
        "--out",
        "--out-dir",
        dest="out_dir",
        default=DEFAULT_OUT,
        help=f"output folder (default {DEFAULT_OUT_SHOWN}/, which git ignores; --out bench/results to commit results)",
    )
    p.add_argument("--name", help=f"file stem (default {stem})")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--no-progress", action="store_true")


def build_options(args):
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    cuda = torch.device(device).type == "cuda"
    if cuda and not torch.cuda.is_available():
        raise SystemExit("--device cuda: CUDA is not available")
    if args.shapes:
        shapes = [resolve_shape(s) for s in _csv(args.shapes)]
    elif cuda:
        shapes = [resolve_shape(s) for s in (GPU_QUICK_SHAPES if args.quick else MODEL_SHAPES)]
    else:
        shapes = [resolve_shape(s) for s in (CPU_QUICK_SHAPES if args.quick else CPU_FULL_SHAPES)]
    if args.tokens:
        tokens = _tokens(args.tokens)
    elif cuda:
        tokens = list(GPU_QUICK_TOKENS if args.quick else GPU_TOKENS)
    else:
        tokens = list(CPU_QUICK_TOKENS if args.quick else CPU_TOKENS)
    modes = MODE_CHOICES[args.mode]
    impls = impl_registry.resolve(_csv(args.impls), device)
    if not args.impls and any(m in SAMPLER_MODES for m in modes):
        # the sampler mode's rows beside the defaults, and only the implementations that run in a chosen mode
        impls = [
            i for i in impls + impl_registry.resolve(impl_registry.DEFAULT_SAMPLER, device) if set(i.modes) & set(modes)
        ]
    scenarios = _csv(args.scenarios)
    for scenario in scenarios:
        if scenario not in SCENARIOS:
            raise SystemExit(f"--scenarios: unknown scenario {scenario!r}: choose from {', '.join(SCENARIOS)}")
    reps = args.reps or (10 if not args.quick else (5 if cuda else 3))
    warmup = args.warmup if args.warmup is not None else 1  # after the guard's run, itself a first warm-up
    return runner.Options(
        shapes=shapes,
        tokens=tokens,
        impls=impls,
        modes=modes,
        scenarios=scenarios,
        device=device,
        dtype=DTYPES[args.dtype or ("bfloat16" if cuda else "float32")],
        reps=reps,
        warmup=warmup,
        min_reps=min(args.min_reps, reps),
        max_seconds=args.max_seconds,
        time_budget=args.time_budget,
        backend=args.backend,
        seed=args.seed,
        progress=not args.no_progress,
    )


def main(argv=None):
    args = parse_args(argv)
    opts = build_options(args)
    started, load_before, info, cuda = report.at_start(opts.device)
    if not cuda:
        print(f"[bench] {report.CPU_BANNER}", flush=True)
    print(
        f"[bench] {info['device_name']}; {len(opts.shapes)} shape(s) x {len(opts.tokens)} token count(s) x "
        f"{len(opts.impls)} implementation(s) x {len(opts.modes)} mode(s)",
        flush=True,
    )
    t0 = time.perf_counter()
    peak, peak_n = measure.matmul_peak_tflops(opts.device, opts.dtype)
    print(
        f"[bench] measured {str(opts.dtype).replace('torch.', '')} matmul throughput: {peak:.2f} TFLOP/s ({peak_n}^3)",
        flush=True,
    )
    opts.time_budget = opts.time_budget - (time.perf_counter() - t0)

    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = args.name or f"{info['device_slug']}-{started.strftime('%Y-%m-%d')}" + ("-quick" if args.quick else "")
    paths = {ext: out_dir / f"{stem}.{ext}" for ext in ("json", "md", "png")}
    meta = dict(
        info,
        date=started.isoformat(timespec="seconds"),
        **report.git_commit(),
        versions=report.versions(),
        argv=list(sys.argv[1:] if argv is None else argv),
        quick=args.quick,
        dtype=str(opts.dtype).replace("torch.", ""),
        loss_config=LOSS_CONFIG,
        backend=opts.backend,
        completions_per_batch=16,
        matmul_peak_tflops=peak,
        matmul_size=peak_n,
        **measure.methods(cuda, opts),
        impl_labels={i.name: i.label + (f" [{i.note}]" if i.note else "") for i in opts.impls},
        shapes={name: dict(D=D, V=V) for name, D, V in opts.shapes},
        tokens=opts.tokens,
        modes=opts.modes,
        scenarios=opts.scenarios,
        padded_lengths=completion_lengths.describe(),
        precision_method="errors against grpo_fast.reference with fp64 logits, on the completion tokens: loss "
        "|abs|; dH, dW max |error| / max |truth|; log-probs max |error| in nats",
        time_budget_s=None if opts.time_budget == float("inf") else args.time_budget,
        env={k: os.environ[k] for k in ("TRITON_INTERPRET", "OMP_WAIT_POLICY", "OMP_NUM_THREADS") if k in os.environ},
        thread_policy=THREAD_POLICY,
        # other processes' load (1, 5 and 15 minute averages of runnable processes) before and at the end
        load_average_before=load_before,
    )
    if not cuda:
        meta["banner"] = report.CPU_BANNER
    if any(m in SAMPLER_MODES for m in opts.modes):
        meta["sampler"] = sampler_meta()

    def write(records, complete):
        report.derive(records, peak)
        doc = dict(schema_version=report.SCHEMA_VERSION, complete=complete, meta=meta, results=records)
        doc["goals"] = report.evaluate_goals(meta, records)
        meta["elapsed_s"] = round(time.perf_counter() - t0, 1)
        meta["load_average_after"] = report.load_average()
        report.write_json(paths["json"], doc)
        paths["md"].write_text(report.markdown(doc))
        return doc

    return report.run_and_report(
        lambda point_done: runner.run(opts, on_point_done=point_done),
        write,
        report.plot,
        report.markdown,
        paths,
        no_plot=args.no_plot,
        tag="bench",
    )


if __name__ == "__main__":
    main()
