"""Timers, peak memory and the device's matmul throughput.

CUDA: each run is timed with CUDA events around it, after warm-up, with the inputs' gradients reset (outside
the timed region) before each; peak memory is ``torch.cuda.max_memory_allocated()`` after
``reset_peak_memory_stats()``, minus ``memory_allocated()`` just before the run: the memory above the inputs
(gradients, which the run allocates, count). The median over the timed runs is reported.

CPU: ``time.perf_counter`` around each run. Peak memory comes from one extra, untimed run under
``torch.profiler`` with ``profile_memory=True``: the CPU allocator reports every allocation and free with the
running total it holds, and the peak is the largest total minus the total before the run. That is the same
quantity as on CUDA (bytes of tensors alive at once above the inputs), not the process's RSS.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import re
import statistics
import sys
import tempfile
import time

import torch

CUDA_PEAK_METHOD = "torch.cuda.max_memory_allocated() - memory_allocated() before the run"
CPU_PEAK_METHOD = "torch.profiler(profile_memory=True): largest running total of the CPU allocator above its start"


def methods(cuda: bool, opts) -> dict:
    """How a benchmark measured, for its results' metadata: the timing and memory methods, and ``opts``' runs policy
    (``reps``, ``warmup``, ``min_reps``, ``max_seconds``: ``time_runs``' arguments)."""
    clock = "CUDA events" if cuda else "time.perf_counter"
    return dict(
        timing_method=f"{clock} around each run, median of the timed runs",
        memory_method=CUDA_PEAK_METHOD if cuda else CPU_PEAK_METHOD,
        reps=opts.reps,
        warmup=opts.warmup,
        min_reps=opts.min_reps,
        max_seconds=opts.max_seconds,
    )


def is_oom(exc: BaseException) -> bool:
    """torch.cuda.OutOfMemoryError, or the CPU allocator's failure."""
    if isinstance(exc, MemoryError):
        return True
    cuda_oom = getattr(torch.cuda, "OutOfMemoryError", None)
    if cuda_oom is not None and isinstance(exc, cuda_oom):
        return True
    msg = str(exc).lower()
    return isinstance(exc, RuntimeError) and ("out of memory" in msg or "can't allocate memory" in msg)


def cleanup(device):
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def synchronize(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def time_runs(call, reset, device, warmup, reps, min_reps=3, max_seconds=float("inf")):
    """Runs ``call`` warmup times, then up to ``reps`` timed times (at least min_reps, stopping once
    max_seconds have passed). Returns (times in ms, peak bytes above the inputs or None on a CPU)."""
    cuda = torch.device(device).type == "cuda"
    for _ in range(warmup):
        reset()
        call()
    synchronize(device)
    times, peaks = [], []
    t0 = time.perf_counter()
    for i in range(reps):
        reset()
        if cuda:
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            call()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
            peaks.append(torch.cuda.max_memory_allocated() - base)
        else:
            s = time.perf_counter()
            call()
            times.append((time.perf_counter() - s) * 1e3)
        if i + 1 >= min_reps and time.perf_counter() - t0 > max_seconds:
            break
    reset()
    return times, (max(peaks) if peaks else None)


def cpu_peak_bytes(call, reset):
    """Peak bytes held by the CPU allocator above its level before ``call`` (one run under the profiler)."""
    from torch.profiler import ProfilerActivity, profile

    reset()
    gc.collect()
    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    with _without_kineto_markers():
        prof.start()
    try:
        call()
    finally:
        with _without_kineto_markers():
            prof.stop()
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)
    reset()
    events = [
        e
        for e in trace.get("traceEvents", [])
        if e.get("name") == "[memory]" and int(e.get("args", {}).get("Device Type", 0)) == 0
    ]
    if not events:
        return 0
    events.sort(key=lambda e: (e.get("ts", 0), e["args"].get("Ev Idx", 0)))
    start = events[0]["args"]["Total Allocated"] - events[0]["args"]["Bytes"]
    return max(0, max(e["args"]["Total Allocated"] for e in events) - start)


# libkineto (inside torch) marks each trace's start and stop for USDT probes by logging
# "USDT:<date> <pid>:<tid> SyncActivityProfilerHandler.cpp:52] profiler_start" (and profiler_stop) to stderr, at a
# level above ERROR: KINETO_LOG_LEVEL could only drop them together with its errors. So the profiler's start and
# stop run with the process's stderr (fd 2, where C++ writes) sent to a file, and everything but those two lines
# goes back to stderr.
_KINETO_MARKER = re.compile(r"^USDT:.*\] profiler_(start|stop)$")


@contextlib.contextmanager
def _without_kineto_markers():
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as captured:
        os.dup2(captured.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            kept = [
                line
                for line in captured.read().decode(errors="replace").splitlines(keepends=True)
                if not _KINETO_MARKER.match(line.rstrip("\r\n"))
            ]
            if kept:
                sys.stderr.write("".join(kept))
                sys.stderr.flush()


def median(xs):
    return statistics.median(xs) if xs else None


def matmul_peak_tflops(device, dtype):
    """The device's measured matmul throughput: the best median over square products of the input dtype (bf16 on
    a GPU); on a CPU also of fp32, which the fallback computes in and which a CPU without bf16 units runs faster."""
    cuda = torch.device(device).type == "cuda"
    sizes = (4096, 8192, 16384) if cuda else (512, 1024)
    dtypes = (dtype,) if cuda or dtype == torch.float32 else (dtype, torch.float32)
    best, best_n = 0.0, None
    for n, dt in [(n, d) for d in dtypes for n in sizes]:
        try:
            tflops = _matmul_tflops(n, dt, device, cuda)
        except Exception as e:  # noqa: BLE001 (an OOM at the largest size leaves the best of the others)
            if not is_oom(e):
                raise
            tflops = 0.0
        if tflops > best:
            best, best_n = tflops, n
        cleanup(device)
    return best, best_n


def _matmul_tflops(n, dtype, device, cuda):
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    times, _ = time_runs(
        lambda: torch.matmul(a, b),
        lambda: None,
        device,
        warmup=3 if cuda else 1,
        reps=20 if cuda else 5,
        min_reps=5 if cuda else 3,
        max_seconds=2.0,
    )
    return 2 * n**3 / (median(times) * 1e-3) / 1e12


def bare_product_ms(hidden_rows, weight, device, piece=8192):
    """cuBLAS's bare logits product over these rows, ``hidden_rows @ weight.T`` in the input dtype (no softmax, no
    gradient), as the median ms of a few warm runs: the floor a head's one vocabulary sweep is measured against. In
    pieces of ``piece`` rows into one reused output (at most piece x V: the whole [n, V] need not fit). CUDA only
    (None elsewhere: a CPU's product of these sizes takes seconds and says nothing of a GPU's)."""
    if torch.device(device).type != "cuda" or hidden_rows.shape[0] == 0:
        return None
    n, V = hidden_rows.shape[0], weight.shape[0]
    out = torch.empty((min(n, piece), V), dtype=hidden_rows.dtype, device=device)
    weight_t = weight.detach().T

    def product():
        for r0 in range(0, n, piece):
            r1 = min(r0 + piece, n)
            torch.mm(hidden_rows[r0:r1], weight_t, out=out[: r1 - r0])

    times, _ = time_runs(product, lambda: None, device, warmup=2, reps=10, min_reps=3, max_seconds=2.0)
    return median(times)


def _addmm_inplace_flops(self_shape, a_shape, b_shape, *args, out_shape=None, **kwargs):
    return 2 * a_shape[0] * a_shape[1] * b_shape[1]


@contextlib.contextmanager
def count_matmul_flops(device):
    """The matmul FLOPs run inside (a one-item list, filled on exit) where torch sees every one: on a CPU, where
    each implementation runs in torch ops. torch's FlopCounterMode leaves in-place ``addmm_`` out (TRL's head
    accumulates dH with it): counted here. On CUDA, Triton kernels' dots are invisible to torch's counter, so
    nothing is counted (an empty list)."""
    counted = []
    if torch.device(device).type == "cuda":
        yield counted
        return
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False, custom_mapping={torch.ops.aten.addmm_: _addmm_inplace_flops}) as counter:
        yield counted
    counted.append(int(counter.get_total_flops()))
