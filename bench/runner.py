"""The sweep: for each shape, token count and scenario (dense, padded), one batch; for each mode and
implementation, the correctness guard (one run compared with the fp64 reference, whose errors are kept as the
precision columns), then warm-up and timed runs. Every outcome is a record: ok (timed), wrong (the guard failed:
not timed), oom, unavailable, error, or skipped (time budget)."""

from __future__ import annotations

import gc
import time
import traceback
from dataclasses import dataclass, field

import torch

from bench import measure
from bench import sampler as sampler_mode
from bench.impls import Impl, work
from bench.inputs import SCENARIOS, check_fwdbwd, check_logprobs, completion_lengths_of, make_inputs, reference_fwdbwd
from bench.shapes import GOAL_SHAPE, GOAL_TOKENS, batch_of


@dataclass
class Options:
    shapes: list  # [(name, D, V)]
    tokens: list  # [N]
    impls: list  # [Impl]
    modes: list  # of "fwdbwd", "logprobs", "sampler", "sampler_fwdbwd"
    device: str
    dtype: torch.dtype
    reps: int = 10
    warmup: int = 2
    min_reps: int = 3
    max_seconds: float = 3.0  # per implementation and point: stop timing once this much has passed (>= min_reps)
    time_budget: float = float("inf")  # seconds for the whole sweep; what is left after it is recorded as skipped
    backend: str = "auto"
    seed: int = 0
    progress: bool = True
    impl_options: dict = field(default_factory=dict)
    scenarios: list = field(default_factory=lambda: list(SCENARIOS))  # ["dense", "padded"]


def ordered_points(shapes, tokens, scenarios=("dense",)):
    """(shape, N, scenario) triples, most wanted first, so that a time budget cuts the least useful: the goals'
    point (Qwen2.5-1.5B, 16k tokens), dense then padded, then the dense points (the goal shape at the other N, the
    other shapes at 16k, the rest), then the padded ones in the same order."""

    def priority(p):
        (name, _, _), N, scenario = p
        return (name != GOAL_SHAPE or N != GOAL_TOKENS, scenario != "dense", name != GOAL_SHAPE, N != GOAL_TOKENS)

    return sorted(((s, N, sc) for s in shapes for N in tokens for sc in scenarios), key=priority)  # stable


def _first_line(e: BaseException) -> str:
    msg = str(e).strip().splitlines()
    return f"{type(e).__name__}: {msg[0] if msg else ''}"[:300]


def _loss_of(out):
    return out[0] if isinstance(out, (tuple, list)) else out


def _run_fwdbwd(fn, x, w):
    loss = _loss_of(fn(x, w))
    loss.backward()
    return loss


# the modes whose runs are forward + backward (the others run without autograd)
FWDBWD_MODES = ("fwdbwd", "sampler_fwdbwd")


def bench_one(impl: Impl, mode: str, x, ref, opts: Options) -> dict:
    """Guard, then time one implementation on one batch. Returns the record's measured fields. The sampler modes'
    ``x`` is their batch (bench.sampler.SamplerInputs) and ``ref`` the row's reference there."""
    device = opts.device
    fwdbwd = mode in FWDBWD_MODES
    w = x.weight_frozen if (impl.frozen or not fwdbwd) else x.weight
    rec = {}
    failure = None
    try:
        fn = impl.build(mode, dict(opts.impl_options, backend=opts.backend))
        x.reset_grads()
        with measure.count_matmul_flops(device) as counted:  # the guard's run: untimed
            if fwdbwd:
                loss = _run_fwdbwd(fn, x, w)
            else:
                logp = fn(x, w)
        if counted:
            rec["matmul_flops"] = counted[0]
        if fwdbwd:
            ok, errors = check_fwdbwd(
                float(loss.detach()),
                x.hidden.grad,
                None if impl.frozen else x.weight.grad,
                ref,
                x.hidden.dtype,
                impl.frozen,
            )
            del loss
        elif mode == "sampler":
            ok, errors = sampler_mode.check(logp, x, impl.name, x.hidden.dtype)
            del logp
        else:
            ok, errors = check_logprobs(logp, x, x.hidden.dtype)
            del logp
        x.reset_grads()
        rec["errors"] = errors
        if not ok:
            rec.update(status="wrong", reason="differs from the reference beyond the tolerance: not timed")
        else:
            call = (lambda: _run_fwdbwd(fn, x, w)) if fwdbwd else (lambda: fn(x, w))
            warmup, cpu_peak = opts.warmup, None
            if torch.device(device).type != "cuda":  # the CPU's peak: one warm-up run under the profiler
                cpu_peak = measure.cpu_peak_bytes(call, x.reset_grads)
                warmup = max(0, warmup - 1)
            times, peak = measure.time_runs(
                call, x.reset_grads, device, warmup, opts.reps, opts.min_reps, opts.max_seconds
            )
            peak = cpu_peak if cpu_peak is not None else peak
            rec.update(status="ok", times_ms=times, median_ms=measure.median(times), peak_mem_bytes=peak)
    except Exception as e:  # noqa: BLE001 (every failure is a record, the sweep goes on)
        failure = (
            "oom" if measure.is_oom(e) else "error",
            _first_line(e),
            None if measure.is_oom(e) else traceback.format_exc(limit=-8),
        )
    if failure is not None:  # outside the except block, so the traceback's frames (and tensors) are gone
        rec["status"], rec["reason"] = failure[0], failure[1]
        if failure[2]:
            rec["traceback"] = failure[2]
    x.reset_grads()
    measure.cleanup(device)
    return rec


def run(opts: Options, on_point_done=None) -> list:
    """The sweep; returns the records. ``on_point_done(records)`` is called after each (shape, N) point."""
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover
        tqdm = None
    points = ordered_points(opts.shapes, opts.tokens, opts.scenarios)
    todo = [(p, m, i) for p in points for m in opts.modes for i in opts.impls if m in i.modes]
    bar = tqdm(total=len(todo), disable=not opts.progress, unit="run", dynamic_ncols=True) if tqdm else None
    # Each peer's check imports it (TRL brings transformers, datasets, pandas: millions of Python objects); freezing
    # them out of the garbage collector's view keeps the gc.collect() between runs at milliseconds.
    unavailable = {impl.name: impl.unavailable(opts.device) for impl in opts.impls}
    gc.collect()
    gc.freeze()
    try:
        return _sweep(opts, points, unavailable, bar, on_point_done)
    finally:
        # back in the collector's view: frozen objects are never collected, and at exit the extension modules'
        # own (Triton's nanobind) would report every one still held as leaked, on stderr
        gc.unfreeze()
        if bar:
            bar.close()


def _sweep(opts, points, unavailable, bar, on_point_done):
    records = []
    t_start = time.perf_counter()
    for (name, D, V), N, scenario in points:
        B, T = batch_of(N)
        active = int(completion_lengths_of(scenario, B, T, opts.seed).sum())
        jobs = [(m, i) for m in opts.modes for i in opts.impls if m in i.modes]
        point = dict(shape=name, D=D, V=V, N=N, B=B, T=T, scenario=scenario, active_tokens=active, fill=active / N)
        point_records = []
        x, ref, xs, setup_failure = None, None, None, None
        over = time.perf_counter() - t_start > opts.time_budget
        if not over:
            try:
                x = make_inputs(D, V, B, T, opts.dtype, opts.device, opts.seed, scenario)
                if "fwdbwd" in opts.modes:
                    ref = reference_fwdbwd(x)
                if any(m in sampler_mode.SAMPLER_MODES for m in opts.modes):  # its batch: drawable targets
                    xs = sampler_mode.make_inputs(
                        x, [i.name for i in opts.impls], "sampler_fwdbwd" in opts.modes, opts.seed
                    )
            except Exception as e:  # noqa: BLE001
                setup_failure = (
                    "oom" if measure.is_oom(e) else "error",
                    f"batch or guard reference failed: {_first_line(e)}",
                )
            if setup_failure:
                x = ref = xs = None
                measure.cleanup(opts.device)
            else:  # the same point's floor: cuBLAS's bare product over the completion tokens (CUDA)
                with torch.no_grad():
                    point["product_ms"] = measure.bare_product_ms(x.hidden.detach()[x.mask], x.weight, opts.device)
        for mode, impl in jobs:
            inputs = xs if mode in sampler_mode.SAMPLER_MODES else x
            head, work_flops = work(impl, mode, inputs, dict(opts.impl_options, backend=opts.backend), active, D, V)
            rec = dict(
                point, mode=mode, impl=impl.name, label=impl.label, frozen=impl.frozen, head=head, flops=work_flops
            )
            where = f"{name} N={N} {scenario} {mode} {impl.name}"
            if bar:
                bar.set_description(where)
            if time.perf_counter() - t_start > opts.time_budget:
                rec.update(status="skipped", reason=f"time budget of {opts.time_budget:.0f} s spent")
            elif setup_failure:
                rec.update(status=setup_failure[0], reason=setup_failure[1])
            else:
                why = unavailable[impl.name]
                if why:
                    rec.update(status="unavailable", reason=why)
                elif mode in sampler_mode.SAMPLER_MODES:
                    rec.update(xs.stats(impl.name))
                    key = sampler_mode.reference_key(impl.name)
                    rec.update(bench_one(impl, mode, xs, xs.references.get(key), opts))
                else:
                    rec.update(bench_one(impl, mode, x, ref, opts))
            point_records.append(rec)
            if bar:
                bar.update(1)
            if not opts.progress:  # a log line per run instead of the bar (logs of a remote machine)
                ms = f" {rec['median_ms']:.3f} ms" if rec.get("median_ms") else ""
                mem = f" {rec['peak_mem_bytes'] / 2**20:.0f} MiB" if rec.get("peak_mem_bytes") is not None else ""
                print(
                    f"[bench] {where}: {rec['status']}{ms}{mem}"
                    + (f" ({rec['reason']})" if rec.get("reason") and rec["status"] != "unavailable" else ""),
                    flush=True,
                )
        del x, ref, xs
        measure.cleanup(opts.device)
        records.extend(point_records)
        if on_point_done:
            on_point_done(records)
    return records
