"""python -m bench.divergence: the student-teacher divergence head (grpo_fast.divergence) against eager PyTorch, TRL
1.16's ChunkedDivergenceFunction and Liger's LigerFusedLinearJSD at a real pair of heads: time, peak memory,
matmul FLOPs in vocabulary sweeps per model, and precision against an fp64 truth.

    python -m bench.divergence                                    # Qwen2.5-0.5B from 1.5B, N 1024 and 2048
    python -m bench.divergence --tokens 1024 --betas 1 --mode fwdbwd --time-budget 600
    python -m bench.divergence --student 48x3000 --teacher 80x3000 --tokens 64 --precision-tokens 64   # any DxV pair
    python -m bench.divergence --dtype bfloat16 --time-budget 2100 --out bench/results --name cpu-divergence-bf16

Writes <out>/<name>.json (every number), .md (the command, the machine and its load, the tables) and .png (time and
peak memory per implementation, and precision); <out> is runs/bench/ (ignored by git) unless --out says otherwise.
The measuring (medians of warm runs, peak memory above the inputs, the CPU thread policy) is bench.measure's, the
environment records bench.report's; see bench/README.md ("The divergence head").
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import shlex
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from bench import THREAD_POLICY, measure, report
from bench.__main__ import DTYPES, add_output_arguments
from bench.impls import _import_failure
from bench.shapes import resolve_shape
from grpo_fast import reference

SCHEMA_VERSION = 1
MODES = ("fwdbwd", "forward")
MODE_TITLES = {"fwdbwd": "forward + backward (loss = mean divergence; student dH, dW)", "forward": "forward only"}
SCENARIOS = ("ordinary", "confident")
BETAS = (1.0, 0.0, 0.5)  # TRL's default (reverse KL) first: the budget keeps what comes first
LOGIT_STD = 2.0  # the student's logits on the ordinary batch; the teacher's add noise of std 1
CONFIDENT_REST_MASS = 1e-6  # 1 - p of the chosen token in both models (within a factor 2): confident batch
TRUTH_CHUNK_ELEMENTS = 1 << 23  # rows x V per chunk of the fp64 truth (64 MiB per fp64 [rows, V] temporary)
# eager's peak in [N, V] fp32 tensors (measured: bench/results/cpu-divergence-bf16.json), to skip a point that would
# exhaust the machine's memory (no swap: the kernel would kill a process) rather than run it
EAGER_TEMPORARIES = {("fwdbwd", False): 9, ("fwdbwd", True): 17, ("forward", False): 5, ("forward", True): 9}


# ----------------------------------------------------------------------------------------------- the batches
@dataclass
class Pair:
    """One batch of a student-teacher pair: [1, N, D] hidden states and [V, D] heads (no biases, as Qwen2.5's)."""

    student_hidden: torch.Tensor  # leaf, requires grad
    student_weight: torch.Tensor  # leaf, requires grad
    teacher_hidden: torch.Tensor  # no grad: the teacher never gets one
    teacher_weight: torch.Tensor
    scenario: str

    def reset_grads(self):
        self.student_hidden.grad = None
        self.student_weight.grad = None


def _ordinary(N, Ds, Dt, V, g):
    """Student logits of std LOGIT_STD; the teacher's are the student's (its first min(Ds, Dt) features) plus
    independent logits of std 1: related distributions, a divergence of a fraction of a nat."""
    ws = torch.randn(V, Ds, generator=g) * (LOGIT_STD / Ds**0.5)
    hs = torch.randn(N, Ds, generator=g)
    k = min(Ds, Dt)
    wt = torch.randn(V, Dt, generator=g) / max(Dt - k, 1) ** 0.5
    ht = torch.randn(N, Dt, generator=g)
    wt[:, :k] = ws[:, :k] * (Ds / k) ** 0.5
    ht[:, :k] = hs[:, :k]
    if Dt == k:  # no independent features left: the noise comes from a rotation of the student's own
        wt = wt + torch.randn(V, Dt, generator=g) / Dt**0.5
    return hs, ws, ht, wt


def _confident_model(N, D, V, y, dtype, g):
    """One model's (hidden, weight) in ``dtype`` where 1 - p_y = CONFIDENT_REST_MASS within a factor 2 on every row:
    unit rows W, h = alpha (W_y + noise), alpha by bisection in fp64 on the rounded weight (the logits alpha c are
    linear in alpha: c = W h_1 is computed once)."""
    w = torch.randn(V, D, generator=g)
    w = (w / w.norm(dim=1, keepdim=True)).to(dtype)
    direction = (w[y].double() + 0.1 * torch.randn(N, D, generator=g, dtype=torch.float64) / D**0.5).to(dtype)
    c = direction.double() @ w.double().T  # [N, V]
    c_y = c.gather(1, y[:, None]).squeeze(1)
    others = c.scatter(1, y[:, None], -math.inf)
    goal = math.log(CONFIDENT_REST_MASS) + (torch.rand(N, generator=g, dtype=torch.float64) * 2 - 1) * math.log(2)
    lo, hi = torch.zeros(N, dtype=torch.float64), torch.full((N,), 1e4, dtype=torch.float64)
    for _ in range(40):
        mid = (lo + hi) / 2
        lse_others = torch.logsumexp(mid[:, None] * others, dim=1)
        log_rest = lse_others - torch.logaddexp(mid * c_y, lse_others)  # log(1 - p_y)
        unsure = log_rest > goal
        lo, hi = torch.where(unsure, mid, lo), torch.where(unsure, hi, mid)
    return (hi[:, None] * direction.double()).to(dtype), w


def make_pair(scenario, N, Ds, Dt, V, dtype, seed=0) -> Pair:
    g = torch.Generator().manual_seed(seed)
    if scenario == "ordinary":
        hs, ws, ht, wt = (x.to(dtype) for x in _ordinary(N, Ds, Dt, V, g))
    else:  # both models confident on the same token of each row (an on-policy student that has learned)
        y = torch.randint(0, V, (N,), generator=g)
        hs, ws = _confident_model(N, Ds, V, y, dtype, g)
        ht, wt = _confident_model(N, Dt, V, y, dtype, g)
    return Pair(
        hs[None].contiguous().requires_grad_(),
        ws.contiguous().requires_grad_(),
        ht[None].contiguous(),
        wt.contiguous(),
        scenario,
    )


@dataclass
class Truth:
    divergence: torch.Tensor  # [N] fp64
    loss: float  # mean divergence
    grad_hidden: torch.Tensor  # [N, Ds] of the loss (fp64 computed, kept in fp32: 6e-8 relative)
    grad_weight: torch.Tensor  # [V, Ds]
    rest_mass: dict  # median 1 - max p per model (where asked: the confident batch)


def fp64_truth(pair: Pair, beta: float, need_grads: bool, rest_mass: bool) -> Truth:
    """grpo_fast.reference (the spec: full logits, TRL's formula) in fp64 from the same inputs, in row chunks; the
    gradients are those of the mean divergence, split at the chunk's hidden states and the shared weight."""
    hs, ws = pair.student_hidden.detach()[0].double(), pair.student_weight.detach().double()
    ht, wt = pair.teacher_hidden.detach()[0].double(), pair.teacher_weight.detach().double()
    N, V = hs.shape[0], ws.shape[0]
    rows = max(1, TRUTH_CHUNK_ELEMENTS // V)
    ws.requires_grad_(need_grads)
    div = torch.empty(N, dtype=torch.float64, device=hs.device)
    grad_hidden = torch.zeros(hs.shape, dtype=torch.float32, device=hs.device) if need_grads else None
    grad_weight = torch.zeros(ws.shape, dtype=torch.float64, device=hs.device) if need_grads else None
    rest = {"student": [], "teacher": []}
    for r0 in range(0, N, rows):
        h = hs[r0 : r0 + rows].clone().requires_grad_(need_grads)
        d, _ = reference.divergence_and_entropy(
            h[None], ws, ht[None, r0 : r0 + rows], wt, beta=beta, compute_dtype=torch.float64
        )
        div[r0 : r0 + rows] = d[0].detach()
        if need_grads:
            gh, gw = torch.autograd.grad(d.sum() / N, (h, ws))
            grad_hidden[r0 : r0 + rows] = gh
            grad_weight += gw
            del gh, gw
        with torch.no_grad():
            for name, hh, w in (("student", hs, ws), ("teacher", ht, wt)) if rest_mass else ():
                top = torch.log_softmax(hh[r0 : r0 + rows] @ w.T, dim=-1).max(dim=-1).values
                rest[name].append(-torch.expm1(top))
        del d, h
    return Truth(
        div,
        float(div.mean()),
        grad_hidden,
        None if grad_weight is None else grad_weight.float(),
        {k: float(torch.cat(v).median()) for k, v in rest.items() if v},
    )


# ----------------------------------------------------------------------------------------------- implementations
# Each returns the per-token divergence [N] fp32 (Liger: its mean, a scalar); the loss is the mean over tokens.
def _eager(pair, beta, backend):
    """A plain training step: both models' full logits in the input dtype (a model's lm_head), fp32 from there,
    TRL's generalized JSD (trl.experimental.gkd's GKDTrainer.generalized_jsd_loss with reduction="none", its lines
    here: importing it brings TRL's trainer configs, a minute of imports on a loaded CPU) summed over the vocabulary."""
    student = F.log_softmax((pair.student_hidden[0] @ pair.student_weight.T).float(), dim=-1)
    with torch.no_grad():
        teacher = F.log_softmax((pair.teacher_hidden[0] @ pair.teacher_weight.T).float(), dim=-1)
    if beta == 0:
        jsd = F.kl_div(student, teacher, reduction="none", log_target=True)
    elif beta == 1:
        jsd = F.kl_div(teacher, student, reduction="none", log_target=True)
    else:
        b = torch.tensor(beta, dtype=student.dtype)
        mixture = torch.logsumexp(torch.stack([student + torch.log1p(-b), teacher + torch.log(b)]), dim=0)
        jsd = b * F.kl_div(mixture, teacher, reduction="none", log_target=True) + (1 - b) * F.kl_div(
            mixture, student, reduction="none", log_target=True
        )
    return jsd.sum(-1)


def _trl(pair, beta, backend):
    """As DistillationTrainer._chunked_divergence_loss calls it (no biases, temperature 1, no soft-cap, scale 1);
    on a CPU TRL projects every position, here all of them are completion tokens."""
    from trl.kernels.chunked_divergence import ChunkedDivergenceFunction

    div, _entropy = ChunkedDivergenceFunction.apply(
        pair.student_hidden[0],
        pair.student_weight,
        None,
        pair.teacher_hidden[0],
        pair.teacher_weight,
        None,
        beta,
        1.0,
        1.0,
        None,
        1.0,
        None,
    )
    return div


def _liger(pair, beta, backend):
    from liger_kernel.transformers.fused_linear_jsd import LigerFusedLinearJSD

    return LigerFusedLinearJSD(jsd_beta=beta)(
        pair.student_hidden[0], pair.student_weight, pair.teacher_hidden[0], pair.teacher_weight, None
    )


def _grpo_fast(pair, beta, backend):
    import grpo_fast

    return grpo_fast.divergence(
        pair.student_hidden, pair.student_weight, pair.teacher_hidden, pair.teacher_weight, beta=beta, backend=backend
    )[0]


def _grpo_fast_loss(pair, beta, backend):
    import grpo_fast

    return grpo_fast.distillation_loss(
        pair.student_hidden, pair.student_weight, pair.teacher_hidden, pair.teacher_weight, beta=beta, backend=backend
    )[0]


def _grpo_fast_mopd(pair, beta, backend):
    import grpo_fast

    # two teachers (the same head twice), the rows alternating between them: every token chunk holds both
    # ([1, N, D] rows -> N rows of one token each)
    student, teacher = pair.student_hidden[0][:, None], pair.teacher_hidden[0][:, None]
    index = torch.arange(student.shape[0], device=student.device) % 2
    teachers = grpo_fast.Teachers([grpo_fast.Teacher(teacher[i::2], pair.teacher_weight) for i in (0, 1)], index)
    return grpo_fast.multi_teacher_distillation_loss(
        student, pair.student_weight, teachers, beta=beta, backend=backend
    )[0]


def _liger_unavailable(device):
    if torch.device(device).type != "cuda":  # decided before importing it (liger_kernel.transformers: transformers)
        return (
            "LigerFusedLinearJSD's JSD is a Triton kernel (no torch fallback): on a CPU Triton has no driver "
            "(RuntimeError: 0 active drivers), and its interpreter (TRITON_INTERPRET=1) is far too slow at "
            "V=151936"
        )
    return _import_failure("liger-kernel", ("liger_kernel.transformers.fused_linear_jsd",))


@dataclass
class Impl:
    name: str
    label: str
    fn: object
    per_token: bool = True
    unavailable: object = staticmethod(lambda device: None)


IMPLS = {
    i.name: i
    for i in (
        Impl(
            "eager",
            "eager PyTorch: both models' full [N, V] logits in the input dtype, fp32 log-softmax, TRL's "
            "generalized JSD formula (GKDTrainer.generalized_jsd_loss's lines)",
            _eager,
        ),
        Impl(
            "trl",
            "TRL 1.16's trl.kernels.chunked_divergence.ChunkedDivergenceFunction, called as DistillationTrainer does",
            _trl,
            unavailable=lambda device: _import_failure("trl", ("trl.kernels.chunked_divergence",)),
        ),
        Impl(
            "liger",
            "Liger-Kernel's LigerFusedLinearJSD (a scalar mean: no per-token divergence)",
            _liger,
            per_token=False,
            unavailable=_liger_unavailable,
        ),
        Impl("grpo_fast", "grpo_fast.divergence (Triton on CUDA; the chunked torch twin on a CPU)", _grpo_fast),
        Impl(
            "grpo_fast_loss",
            "grpo_fast.distillation_loss: the mean divergence as one loss (TRL's DistillationTrainer's), the "
            "student's gradients formed in the forward (a scalar: no per-token divergence)",
            _grpo_fast_loss,
            per_token=False,
        ),
        Impl(
            "grpo_fast_mopd",
            "grpo_fast.multi_teacher_distillation_loss: grpo_fast_loss's loss with the rows routed alternately to two "
            "copies of the teacher (every token chunk holds both: one fused op, the teachers' products a teacher at "
            "a time)",
            _grpo_fast_mopd,
            per_token=False,
        ),
    )
}


# ----------------------------------------------------------------------------------------------- FLOPs per model
class MatmulCounter(TorchDispatchMode):
    """Matmul FLOPs per model, told apart by the hidden size in the product (the student's Ds, the teacher's Dt:
    the forward's contraction, dH's and dW's output width). grpo_fast's custom ops are opened (their Python bodies
    run under the counter), since torch's counters see a custom op as one opaque call."""

    MATMULS = ("mm", "matmul", "addmm", "addmm_", "bmm", "baddbmm", "baddbmm_")  # matmul: inside a custom op

    def __init__(self, Ds, Dt):
        super().__init__()
        self.Ds, self.Dt = Ds, Dt
        self.flops = {"student": 0, "teacher": 0, "other": 0}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "grpo_fast":
            from torch._library.custom_ops import OPDEFS

            opdef = OPDEFS.get(func._schema.name)
            if opdef is not None:
                with self:
                    return opdef._init_fn(*args, **kwargs)
        name = func.overloadpacket.__name__
        if name in self.MATMULS:
            a, b = (args[0], args[1]) if name in ("mm", "matmul", "bmm") else (args[1], args[2])
            k, n = a.shape[-1], b.shape[-1]
            flops = 2 * a.numel() * n
            owner = "student" if self.Ds in (k, n) else "teacher" if self.Dt in (k, n) else "other"
            self.flops[owner] += flops
        return func(*args, **kwargs)


# ----------------------------------------------------------------------------------------------- one measurement
def _errors(div, grads, truth: Truth, per_token: bool):
    e = {}
    if per_token:
        d = div.detach().double().reshape(-1).to(truth.divergence.device)
        err = float((d - truth.divergence).abs().max())
        e["div_max_abs_err"] = err
        e["div_rel_err"] = err / float(truth.divergence.abs().max())
        e["loss_abs_err"] = abs(float(d.mean()) - truth.loss)
    else:
        e["loss_abs_err"] = abs(float(div.detach()) - truth.loss)
    if grads is not None and truth.grad_hidden is not None:
        for name, actual, expected in (
            ("grad_hidden", grads[0], truth.grad_hidden),
            ("grad_weight", grads[1], truth.grad_weight),
        ):
            if actual is None:
                e[f"{name}_rel_err"] = None
                continue
            a = actual.detach().reshape(expected.shape).float().to(expected.device)
            e[f"{name}_rel_err"] = float((a - expected).abs().max() / expected.abs().max())
    return e


def _first_line(e):
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0] if lines else ''}"[:300]


def _mem_available():
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def measure_one(impl: Impl, mode, pair: Pair, beta, truth: Truth, opts, timed: bool) -> dict:
    """The first run under the FLOP counter and, on a CPU, the memory profiler: its outputs give the precision
    (``truth``: a precision point); then, if ``timed``, the timed runs (bench.measure), or with --reps 0 the first
    run's own time."""
    N, V = pair.student_hidden.shape[1], pair.student_weight.shape[0]
    Ds, Dt = pair.student_hidden.shape[2], pair.teacher_hidden.shape[2]
    if impl.name == "eager" and opts.device == "cpu":
        need = EAGER_TEMPORARIES[(mode, 0.0 < beta < 1.0)] * N * V * 4
        avail = _mem_available()
        if avail is not None and need > 0.7 * avail:
            return dict(
                status="skipped",
                reason=f"memory: eager needs about {need / 2**30:.1f} GiB of [N, V] fp32 "
                f"temporaries, {avail / 2**30:.1f} GiB available",
            )
    out = {}

    def call():
        if mode == "fwdbwd":
            div = impl.fn(pair, beta, opts.backend)
            (div.mean() if impl.per_token else div).backward()
        else:
            with torch.no_grad():
                div = impl.fn(pair, beta, opts.backend)
        out["div"] = div
        out["grads"] = (pair.student_hidden.grad, pair.student_weight.grad) if mode == "fwdbwd" else None

    rec = {}
    try:
        counter = MatmulCounter(Ds, Dt)
        cuda = torch.device(opts.device).type == "cuda"

        first_ms = []

        def first():
            start = time.perf_counter()
            with counter:
                call()
            measure.synchronize(opts.device)
            first_ms.append((time.perf_counter() - start) * 1e3)

        if cuda:
            pair.reset_grads()
            first()
            peak = None
        else:
            peak = measure.cpu_peak_bytes(first, pair.reset_grads)
        rec.update(
            flops_student=counter.flops["student"],
            flops_teacher=counter.flops["teacher"],
            flops_other=counter.flops["other"],
            sweeps_student=counter.flops["student"] / (2 * N * V * Ds),
            sweeps_teacher=counter.flops["teacher"] / (2 * N * V * Dt),
        )
        rec["errors"] = _errors(out["div"], out["grads"], truth, impl.per_token) if truth is not None else {}
        out.clear()
        if timed and opts.reps == 0:  # the first run is the timed one (a machine too slow for more)
            rec.update(times_ms=first_ms, median_ms=first_ms[0])
        elif timed:
            times, cuda_peak = measure.time_runs(
                call, pair.reset_grads, opts.device, opts.warmup, opts.reps, opts.min_reps, opts.max_seconds
            )
            out.clear()
            rec.update(times_ms=times, median_ms=measure.median(times))
            peak = cuda_peak if cuda else peak
        rec.update(status="ok", peak_mem_bytes=peak)
    except Exception as e:  # noqa: BLE001 (every failure is a record, the sweep goes on)
        oom = measure.is_oom(e)
        rec.update(status="oom" if oom else "error", reason=_first_line(e))
        if not oom:
            rec["traceback"] = traceback.format_exc(limit=-6)
    out.clear()
    pair.reset_grads()
    measure.cleanup(opts.device)
    return rec


# ----------------------------------------------------------------------------------------------- the sweep
@dataclass
class Options:
    student: tuple
    teacher: tuple
    tokens: list
    betas: list
    other_betas_tokens: list  # the N at which betas other than the first are timed
    precision_tokens: int  # N of the precision points (both batches, every beta; 0: none)
    untimed_impls: list  # implementations run at the precision points only
    impls: list
    modes: list
    device: str
    dtype: torch.dtype
    backend: str
    reps: int
    warmup: int
    min_reps: int
    max_seconds: float
    time_budget: float
    seed: int
    progress: bool


def ordered_points(opts: Options):
    """(scenario, N, beta, timed): precision points (untimed, at the precision N: the fp64 truth costs more than every
    implementation together) and timed points (no truth), most wanted first so that a time budget drops the last:
    the first beta (TRL's default) on both batches and timed at the smallest N, the other betas' precision, the
    first beta timed at the other N, the other betas timed at theirs."""
    first, rest = opts.betas[0], opts.betas[1:]
    tokens = sorted(opts.tokens)
    precision = (
        [(scenario, opts.precision_tokens, b, False) for b in opts.betas for scenario in SCENARIOS]
        if opts.precision_tokens
        else []
    )
    return (
        precision[: len(SCENARIOS)]
        + [("ordinary", tokens[0], first, True)]
        + precision[len(SCENARIOS) :]
        + [("ordinary", N, first, True) for N in tokens[1:]]
        + [("ordinary", N, b, True) for b in rest for N in tokens if N in opts.other_betas_tokens]
    )


def run(opts: Options, on_point_done=None):
    unavailable = {i.name: i.unavailable(opts.device) for i in opts.impls}
    # the peers' imports (TRL: transformers) leave millions of Python objects: out of the collector's view, the
    # gc.collect() between runs takes milliseconds instead of seconds (as bench.runner does)
    gc.collect()
    gc.freeze()
    try:
        return _sweep(opts, unavailable, on_point_done)
    finally:
        gc.unfreeze()


def _sweep(opts, unavailable, on_point_done):
    _, Ds, V = opts.student
    _, Dt, _ = opts.teacher
    records, t0 = [], time.perf_counter()
    pairs = {}
    points = ordered_points(opts)
    todo = sum(len(opts.impls) * (len(opts.modes) if timed else 1) for *_, timed in points)
    done = 0
    for scenario, N, beta, timed in points:
        modes = opts.modes if timed else ["fwdbwd"]
        base = dict(scenario=scenario, N=N, Ds=Ds, Dt=Dt, V=V, beta=beta, timed=timed)
        over = time.perf_counter() - t0 > opts.time_budget
        truth = None
        if not over:
            key = (scenario, N)
            if key not in pairs:
                pairs.clear()
                measure.cleanup(opts.device)
                pairs[key] = make_pair(scenario, N, Ds, Dt, V, opts.dtype, opts.seed)
            pair = pairs[key]
        if not over and not timed:  # a precision point
            _log(opts, f"{scenario} N={N} beta={beta}: fp64 truth")
            truth = fp64_truth(pair, beta, need_grads="fwdbwd" in modes, rest_mass=scenario == "confident")
            base["truth"] = dict(
                divergence_max=float(truth.divergence.abs().max()), loss=truth.loss, rest_mass_median=truth.rest_mass
            )
        if not over and opts.device != "cpu":
            pair = pair.__class__(
                *(
                    x.to(opts.device) if isinstance(x, torch.Tensor) else x
                    for x in (
                        pair.student_hidden.detach(),
                        pair.student_weight.detach(),
                        pair.teacher_hidden,
                        pair.teacher_weight,
                        pair.scenario,
                    )
                )
            )
            pair.student_hidden.requires_grad_()
            pair.student_weight.requires_grad_()
        for mode in modes:
            for impl in opts.impls:
                rec = dict(base, mode=mode, impl=impl.name)
                done += 1
                where = f"{scenario} N={N} beta={beta} {mode} {impl.name}"
                if time.perf_counter() - t0 > opts.time_budget:
                    rec.update(status="skipped", reason=f"time budget of {opts.time_budget:.0f} s spent")
                elif unavailable[impl.name]:
                    rec.update(status="unavailable", reason=unavailable[impl.name])
                elif timed and impl.name in opts.untimed_impls:
                    rec.update(status="skipped", reason="not timed (--untimed-impls): precision points only")
                else:
                    _log(opts, f"[{done}/{todo}] {where} ...")
                    rec.update(measure_one(impl, mode, pair, beta, truth, opts, timed))
                rec.setdefault("reason", None)
                records.append(rec)
                ms = f" {rec['median_ms']:.0f} ms" if rec.get("median_ms") else ""
                mem = f" {rec['peak_mem_bytes'] / 2**20:.0f} MiB" if rec.get("peak_mem_bytes") is not None else ""
                err = rec.get("errors", {}).get("div_rel_err")
                _log(
                    opts,
                    f"[{done}/{todo}] {where}: {rec['status']}{ms}{mem}"
                    + (f" div rel err {err:.1e}" if err is not None else "")
                    + (f" ({rec['reason']})" if rec["reason"] and rec["status"] != "unavailable" else ""),
                )
        truth = None
        if on_point_done:
            on_point_done(records)
    return records


def _log(opts, msg):
    if opts.progress:
        print(f"[bench.divergence {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ----------------------------------------------------------------------------------------------- report
def _fmt(v, spec):
    return "" if v is None else format(v, spec)


def _cells(r, key, spec):
    if r is None:
        return ""
    if r["status"] != "ok":
        return f"**{r['status'].upper()}**"
    return _fmt(r.get(key), spec)


def summary_rows(doc):
    """One row per (scenario, N, beta, implementation): both modes' time, memory, sweeps and the precision."""
    by = {(r["scenario"], r["N"], r["beta"], r["impl"], r["mode"]): r for r in doc["results"]}
    keys = list(dict.fromkeys((r["scenario"], r["N"], r["beta"], r["impl"]) for r in doc["results"]))
    lines = [
        "| batch | N | beta | implementation | fwd+bwd ms | fwd+bwd MiB | fwd ms | fwd MiB | sweeps fwd+bwd "
        "(student / teacher) | sweeps fwd | max abs div err | div err / max div | dH rel err | dW rel err |",
        "| --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for key in keys:
        fb, fw = by.get((*key, "fwdbwd")), by.get((*key, "forward"))
        if all(r is None or r["status"] in ("unavailable", "skipped") for r in (fb, fw)):
            continue
        first = fb if fb is not None and fb["status"] == "ok" else fw or fb
        e = (first or {}).get("errors", {})

        def sweeps(r):
            if r is None or r["status"] != "ok":
                return ""
            return f"{r['sweeps_student']:.2f} / {r['sweeps_teacher']:.2f}"

        def mib(r):
            if r is None or r["status"] != "ok" or r.get("peak_mem_bytes") is None:
                return _cells(r, "peak_mem_bytes", "")
            return f"{r['peak_mem_bytes'] / 2**20:.0f}"

        lines.append(
            "| "
            + " | ".join(
                [
                    key[0],
                    str(key[1]),
                    f"{key[2]:g}",
                    key[3],
                    _cells(fb, "median_ms", ".0f"),
                    mib(fb) if fb else "",
                    _cells(fw, "median_ms", ".0f"),
                    mib(fw) if fw else "",
                    sweeps(fb),
                    sweeps(fw),
                    _fmt(e.get("div_max_abs_err"), ".1e"),
                    _fmt(e.get("div_rel_err"), ".1e"),
                    _fmt(e.get("grad_hidden_rel_err"), ".1e"),
                    _fmt(e.get("grad_weight_rel_err"), ".1e"),
                ]
            )
            + " |"
        )
    return lines


def markdown(doc) -> str:
    m = doc["meta"]
    v = m["versions"]
    skipped = [r for r in doc["results"] if r["status"] == "skipped"]
    lines = [f"# grpo_fast divergence head benchmark: {m['device_name']}", "", "```bash", m["command"], "```", ""]
    if m["device_type"] != "cuda":
        lines += [f"> **{report.CPU_BANNER}**", ""]
    if not doc.get("complete", True):
        lines += ["> **Incomplete**: the run stopped before the end of the sweep.", ""]
    if skipped:
        lines += [
            f"> **Partial**: {len(skipped)} of {len(doc['results'])} measurements were skipped: "
            + "; ".join(
                f"{r['impl']} {r['mode']} at {r['scenario']} N={r['N']} beta={r['beta']:g} ({r['reason']})"
                for r in skipped
            )
            + ".",
            "",
        ]
    (sn, Ds, V), (tn, Dt, _) = m["student"], m["teacher"]
    lines += [
        f"- date: {m['date']}; commit `{m['commit']}`" + (" (uncommitted changes)" if m.get("commit_dirty") else ""),
        f"- torch {v['torch']}, triton {v.get('triton')}, trl {v.get('trl') or 'not installed'}, liger-kernel "
        f"{v.get('liger_kernel') or 'not installed'}, python {v['python']}",
        f"- pair: student {sn} (Ds {Ds}), teacher {tn} (Dt {Dt}), V {V}; inputs {m['dtype']}, no biases, temperature "
        f"1; grpo_fast backend `{m['backend']}`; the loss of fwd+bwd is the mean divergence over the N tokens (every "
        "token a completion token)",
        "- batches: `ordinary`: random heads, student logits of std 2, the teacher's the student's plus independent "
        f"logits of std 1; `confident`: both models put 1 - p = {CONFIDENT_REST_MASS:g} (within a factor 2) on the "
        "same token of each row (an on-policy student that has learned)",
        f"- precision points (N = {m['precision_tokens']}, both batches, every beta) run each implementation once "
        "against the fp64 truth, untimed; timed points (the other N) have no truth: the truth's fp64 passes cost more "
        "than every implementation together, and the errors are per token",
        f"- time: {m['timing_method']}; {m['reps']} timed runs at most (at least {m['min_reps']}, stopping after "
        f"{m['max_seconds']} s), {m['warmup']} untimed warm-up after the first run (itself untimed: it counts the "
        f"FLOPs, measures the memory and gives the precision); peak memory: {m['memory_method']}",
        f"- CPU threads {m.get('cpu_threads')}, thread policy {m.get('thread_policy')}; load average (1, 5, 15 min) "
        f"{report._load(m.get('load_average_before'))} before the run, {report._load(m.get('load_average_after'))} "
        "at its end (other processes share this machine's cores: the times are this machine's, loaded)"
        if m["device_type"] != "cuda"
        else f"- CUDA {m.get('cuda_version')}",
        "- sweeps: the matmul FLOPs each implementation ran (counted by torch dispatch, grpo_fast's custom ops "
        "opened), per model, in units of 2 N V D of that model (Ds for the student, Dt for the teacher)",
        "- precision: against grpo_fast.reference (full logits, TRL's formula) in fp64 from the same "
        f"{m['dtype']} inputs: the per-token divergence's max |error| (nats) and that over max |divergence|; dH, dW "
        "of the mean divergence: max |error| / max |truth|",
        f"- elapsed {m.get('elapsed_s')} s of a {m.get('time_budget_s') or 'unlimited'} s budget",
        "",
        "## Summary",
        "",
        *summary_rows(doc),
        "",
    ]
    conf = [r for r in doc["results"] if r["scenario"] == "confident" and r.get("truth")]
    if conf:
        t = conf[0]["truth"]
        rest = t["rest_mass_median"]
        lines += [
            f"Confident batch: median 1 - max p of the fp64 truth: student {rest['student']:.1e}, "
            f"teacher {rest['teacher']:.1e}; max divergence per beta: "
            + ", ".join(
                f"beta {r['beta']:g}: {r['truth']['divergence_max']:.2e} nats"
                for r in conf
                if r["impl"] == conf[0]["impl"]
            )
            + ".",
            "",
        ]
    notes = [r for r in doc["results"] if r["status"] != "ok" and r.get("reason")]
    if notes:
        lines += ["## Not measured", ""]
        seen = set()
        for r in notes:
            key = (r["impl"], r["status"], r["reason"])
            if key in seen:
                continue
            seen.add(key)
            lines.append(f"- {r['impl']}: {r['status']}: {r['reason']}")
        lines.append("")
    lines += ["## Notes", "", *[f"- {n}" for n in m.get("notes", [])], "", "Implementations:", ""]
    lines += [f"- `{name}`: {label}" for name, label in m["impl_labels"].items()]
    lines.append("")
    return "\n".join(lines)


def plot(doc, path):
    """Bars per implementation: fwd+bwd time, forward time, fwd+bwd peak memory (ordinary batch, per N and beta),
    and the divergence's error over its max against fp64 (every batch)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = doc["results"]
    impls = list(doc["meta"]["impl_labels"])
    colors = {name: plt.cm.tab10(i) for i, name in enumerate(impls)}
    panels = [
        ("fwdbwd", "median_ms", "fwd+bwd: median ms", "ordinary"),
        ("forward", "median_ms", "forward: median ms", "ordinary"),
        ("fwdbwd", "peak_mem_bytes", "fwd+bwd: peak MiB above inputs", "ordinary"),
        ("fwdbwd", "div_rel_err", "max |div err| / max div (fp64 truth)", None),
    ]
    fig, axes = plt.subplots(2, 2, figsize=(13, 8))
    for ax, (mode, key, title, scenario) in zip(axes.flat, panels):
        rs = [
            r
            for r in results
            if r["mode"] == mode
            and (scenario is None or r["scenario"] == scenario)
            and r["status"] == "ok"
            and (r.get("errors", {}).get(key) if key == "div_rel_err" else r["timed"])
        ]
        groups = list(dict.fromkeys((r["scenario"], r["N"], r["beta"]) for r in rs))  # measured points only
        width = 0.8 / max(len(impls), 1)
        for i, impl in enumerate(impls):
            xs, ys = [], []
            for gi, g in enumerate(groups):
                r = next((r for r in rs if (r["scenario"], r["N"], r["beta"], r["impl"]) == (*g, impl)), None)
                if r is None or r["status"] != "ok":
                    continue
                y = r.get("errors", {}).get(key) if key == "div_rel_err" else r.get(key)
                if key == "peak_mem_bytes" and y is not None:
                    y = y / 2**20
                if y:
                    xs.append(gi + (i - (len(impls) - 1) / 2) * width)
                    ys.append(y)
            if xs:
                ax.bar(xs, ys, width, color=colors[impl], label=impl)
        ax.set_xticks(range(len(groups)))
        ax.set_xlim(-0.5, len(groups) - 0.5)
        ax.set_xticklabels(
            [(f"{s}\n" if scenario is None else "") + f"N={n}\nβ={b:g}" for s, n, b in groups], fontsize=7
        )
        if ax.has_data() and key == "div_rel_err":  # errors span decades; times and memory compare linearly
            ax.set_yscale("log")
        ax.grid(True, axis="y", which="both", alpha=0.3)
        ax.set_title(title, fontsize=9)
    handles = [
        plt.Rectangle((0, 0), 1, 1, color=colors[i])
        for i in impls
        if any(r["impl"] == i and r["status"] == "ok" for r in results)
    ]
    labels = [i for i in impls if any(r["impl"] == i and r["status"] == "ok" for r in results)]
    m = doc["meta"]
    title = (
        f"divergence head, student {m['student'][0]} / teacher {m['teacher'][0]}, V {m['student'][2]}, "
        f"{m['dtype']}, {m['device_name']}, {m['date'][:10]}"
    )
    if m["device_type"] != "cuda":
        title = "CPU numbers, not GPU figures: " + title
    fig.suptitle(title, fontsize=9)
    fig.legend(handles, labels, loc="upper right", fontsize=8, ncol=len(labels))
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


# ----------------------------------------------------------------------------------------------- command line
def _csv(s):
    return [x.strip() for x in s.split(",") if x.strip()] if s else []


def _floats(s):
    return [float(x) for x in _csv(s)]


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        prog="python -m bench.divergence",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--student", default="qwen2.5-0.5b", help="the student's head: a shape name or DxV (qwen2.5-0.5b: 896 x 151936)"
    )
    p.add_argument("--teacher", default="qwen2.5-1.5b", help="the teacher's head (qwen2.5-1.5b: 1536 x 151936)")
    p.add_argument("--tokens", default="1024,2048", help="token counts N (1024,2048)")
    p.add_argument("--betas", default="1,0,0.5", help="betas, the first at every N (1,0,0.5)")
    p.add_argument("--other-betas-tokens", help="the N at which the betas after the first are timed (the smallest N)")
    p.add_argument(
        "--precision-tokens",
        type=int,
        default=128,
        help="N of the precision points: both batches, every beta, against the fp64 truth (128; 0: none)",
    )
    p.add_argument("--impls", default=",".join(IMPLS), help=f"of {', '.join(IMPLS)} (all)")
    p.add_argument("--untimed-impls", default="", help="implementations run at the precision points only (none)")
    p.add_argument("--mode", default="both", choices=("fwdbwd", "forward", "both"))
    p.add_argument("--device", help="cuda or cpu (default: cuda when available)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16", help="input dtype (bfloat16)")
    p.add_argument(
        "--backend",
        help="grpo_fast's backend (torch on a CPU: the Triton interpreter is far too slow at V=151936; auto on CUDA)",
    )
    p.add_argument(
        "--reps",
        type=int,
        default=2,
        help="timed runs at most (2; 0: the first run's own time, under the memory profiler and the FLOP counter)",
    )
    p.add_argument("--min-reps", type=int, default=1)
    p.add_argument("--max-seconds", type=float, default=20.0, help="stop timing after this, once --min-reps ran")
    p.add_argument("--warmup", type=int, default=0, help="untimed runs after the first (0: the first warms up)")
    p.add_argument(
        "--time-budget",
        type=float,
        default=float("inf"),
        help="seconds for the sweep; what is left after it is recorded as skipped (none)",
    )
    add_output_arguments(p, "<device>-divergence-<date>")
    return p.parse_args(argv)


def build_options(args) -> Options:
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    student, teacher = resolve_shape(args.student), resolve_shape(args.teacher)
    if student[2] != teacher[2]:
        raise SystemExit(
            f"--student has V = {student[2]} but --teacher has V = {teacher[2]}: the vocabularies must match"
        )
    if student[1] == teacher[1]:
        raise SystemExit(
            f"--student and --teacher both have D = {student[1]}: the FLOP count tells the models apart "
            "by their hidden sizes"
        )
    tokens = [int(x) for x in _csv(args.tokens)]
    impls = []
    for name in _csv(args.impls):
        if name not in IMPLS:
            raise SystemExit(f"--impls: unknown implementation {name!r}: choose from {', '.join(IMPLS)}")
        impls.append(IMPLS[name])
    betas = _floats(args.betas)
    if not betas or any(not 0.0 <= b <= 1.0 for b in betas):
        raise SystemExit("--betas: numbers in [0, 1]")
    return Options(
        student=student,
        teacher=teacher,
        tokens=tokens,
        betas=betas,
        other_betas_tokens=[int(x) for x in _csv(args.other_betas_tokens)] or [min(tokens)],
        precision_tokens=args.precision_tokens,
        impls=impls,
        untimed_impls=_csv(args.untimed_impls),
        modes=list(MODES) if args.mode == "both" else [args.mode],
        device=device,
        dtype=DTYPES[args.dtype],
        backend=args.backend or ("auto" if device == "cuda" else "torch"),
        reps=args.reps,
        warmup=args.warmup,
        min_reps=max(1, min(args.min_reps, args.reps)),
        max_seconds=args.max_seconds,
        time_budget=args.time_budget,
        seed=args.seed,
        progress=not args.no_progress,
    )


NOTES = [
    "TRL's head on a CPU projects its [4096, 32768] tiles in fp32 (its `_project`: `hidden.float() @ w.float()`), "
    "so from bf16 inputs its ordinary-batch precision is fp32 accumulation's, as grpo_fast's; on the confident batch "
    "it forms 1 - p by subtraction and loses the divergence (grpo_fast carries it as a sum).",
    "eager rounds both models' logits to bf16 (the lm_head matmul in the input dtype), then works in fp32: its "
    "error is the rounding's.",
    "grpo_fast runs its torch twin on a CPU; its Triton kernels run on a CPU only under Triton's interpreter, far "
    "too slow at V = 151936 (the tests check them against the same fp64 spec at small shapes).",
    "Liger's LigerFusedLinearJSD returns only the mean (no per-token divergence): its precision would be the loss's.",
    "On this CPU torch's bf16 matmuls are slow, and pathologically so where they contract over the vocabulary: eager's "
    "backward dH = dlogits [64, 151936] @ W [151936, 896] in bf16 took over 5 minutes alone (the same product in fp32: "
    "seconds), an eager fwd+bwd at N = 64 about 9 minutes; at N = 1024 eager would take hours. Where the committed "
    "run says so (--untimed-impls eager), eager ran at the precision points only. TRL's CPU path and grpo_fast's "
    "torch twin compute in fp32 from the bf16 inputs.",
]


def main(argv=None):
    args = parse_args(argv)
    opts = build_options(args)
    started, load_before, info, cuda = report.at_start(opts.device)
    print(
        f"[bench.divergence] {info['device_name']}; student {opts.student}, teacher {opts.teacher}; N "
        f"{opts.tokens}; betas {opts.betas}",
        flush=True,
    )
    t0 = time.perf_counter()
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = args.name or f"{info['device_slug']}-divergence-{started.strftime('%Y-%m-%d')}"
    paths = {ext: out_dir / f"{stem}.{ext}" for ext in ("json", "md", "png")}
    argv_used = list(sys.argv[1:] if argv is None else argv)
    meta = dict(
        info,
        date=started.isoformat(timespec="seconds"),
        **report.git_commit(),
        versions=report.versions(),
        argv=argv_used,
        command=" ".join(["python -m bench.divergence", *map(shlex.quote, argv_used)]),
        dtype=str(opts.dtype).replace("torch.", ""),
        backend=opts.backend,
        student=list(opts.student),
        teacher=list(opts.teacher),
        tokens=opts.tokens,
        betas=opts.betas,
        precision_tokens=opts.precision_tokens,
        modes=opts.modes,
        **measure.methods(cuda, opts),
        impl_labels={i.name: i.label for i in opts.impls},
        time_budget_s=None if args.time_budget == float("inf") else args.time_budget,
        env={k: os.environ[k] for k in ("TRITON_INTERPRET", "OMP_WAIT_POLICY", "OMP_NUM_THREADS") if k in os.environ},
        thread_policy=THREAD_POLICY,
        load_average_before=load_before,
        notes=NOTES,
    )

    def write(records, complete):
        meta["elapsed_s"] = round(time.perf_counter() - t0, 1)
        meta["load_average_after"] = report.load_average()
        doc = dict(schema_version=SCHEMA_VERSION, complete=complete, meta=meta, results=records)
        report.write_json(paths["json"], doc)
        paths["md"].write_text(markdown(doc))
        return doc

    return report.run_and_report(
        lambda point_done: run(opts, on_point_done=point_done),
        write,
        plot,
        markdown,
        paths,
        no_plot=args.no_plot,
        tag="bench.divergence",
    )


if __name__ == "__main__":
    main()
