"""The benchmark (python -m bench) end to end on a CPU, in fresh processes run from the repository's root.

The interpreter is turned off in those processes (conftest turns it on for the kernel tests), so grpo_fast
runs its chunked torch path, as on any machine without CUDA.
"""

import importlib.util
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from bench import measure
from bench.impls import HEAD_SWEEPS, IMPLS, work
from bench.inputs import make_inputs
from grpo_fast.kernels.gemm import padded_rows

ROOT = Path(__file__).resolve().parent.parent
# trl is a declared test dependency (the test extra): the benchmark's TRL rows are checked, and without trl the tests
# that read them fail (not weaker assertions, not a skip)
TRL_MISSING = "trl is not installed: it is a declared test dependency (pip install -e '.[test]')"


def _env():
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    env["CUDA_VISIBLE_DEVICES"] = ""  # CPU numbers, also on a machine with a GPU
    # one thread: on these tiny shapes a second one only adds synchronisation, which costs seconds when the
    # machine's cores are shared (the test checks the results' form, not the CPU's speed)
    env["OMP_NUM_THREADS"] = "1"
    return env


def _run(args, timeout=300):
    proc = subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, (
        f"exit {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
    )
    return proc


def _only(directory, suffix):
    found = sorted(Path(directory).glob(f"*{suffix}"))
    assert len(found) == 1, found
    return found[0]


# Two runs in one process (one import of torch and TRL): the CI's quick mode, as `python -m bench --quick` runs it,
# and a bf16 log-probs point for the precision columns.
CPU_RUNS = textwrap.dedent("""
    import sys
    import bench
    bench.main(["--quick", "--out", sys.argv[1] + "/quick", "--no-progress"])
    bench.main(["--shapes", "64x2000", "--tokens", "256", "--dtype", "bfloat16", "--scenarios", "dense",
                "--mode", "logprobs", "--impls", "eager,trl,grpo_fast", "--reps", "1", "--warmup", "0", "--no-plot",
                "--no-progress", "--name", "bf16", "--out", sys.argv[1] + "/bf16"])
""")


@pytest.fixture(scope="module")
def cpu_runs(tmp_path_factory):
    """(the folder holding quick/ and bf16/, the process's stdout, its stderr)."""
    assert importlib.util.find_spec("trl") is not None, TRL_MISSING
    out = tmp_path_factory.mktemp("bench")
    proc = _run(["-c", CPU_RUNS, str(out)])
    return out, proc.stdout, proc.stderr


def test_default_output_folder_is_ignored_by_git(monkeypatch):
    """`python -m bench` leaves the checkout clean: its default folder is runs/bench/, which git ignores;
    --out (or --out-dir) names another, e.g. bench/results to commit results."""
    monkeypatch.syspath_prepend(str(ROOT))
    from bench.__main__ import parse_args

    assert Path(parse_args([]).out_dir) == ROOT / "runs" / "bench"
    assert parse_args(["--out", "bench/results"]).out_dir == "bench/results"
    assert parse_args(["--out-dir", "elsewhere"]).out_dir == "elsewhere"
    if not (ROOT / ".git").exists() or shutil.which("git") is None:
        pytest.skip("not a git checkout")
    probe = ROOT / "runs" / "bench" / "cpu-2000-01-01-quick.json"
    ignored = subprocess.run(["git", "check-ignore", "-q", str(probe)], cwd=ROOT)
    assert ignored.returncode == 0, f"git does not ignore {probe.relative_to(ROOT)}"


@pytest.mark.slow
def test_thread_policy_is_unknown_when_torch_was_imported_first():
    """OpenMP reads OMP_WAIT_POLICY when torch loads it: too late for bench to set it, and the results say so."""
    env = _env()
    env.pop("OMP_WAIT_POLICY", None)
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            "import torch, bench, os; print(bench.THREAD_POLICY); print(os.environ['OMP_WAIT_POLICY'])",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.splitlines() == ["unknown: torch was imported before bench set OMP_WAIT_POLICY", "PASSIVE"]


@pytest.mark.slow  # the benchmark end to end (its runs: a minute)
def test_runs_print_nothing_of_the_profiler_or_nanobind(cpu_runs):
    """The CPU's peak-memory runs start torch's profiler, whose libkineto logs `USDT: ... profiler_start/stop`
    markers to stderr; the sweep freezes objects out of the garbage collector's view, which Triton's nanobind
    bindings reported as leaked at exit until they were handed back. Neither reaches the output."""
    _, stdout, stderr = cpu_runs
    for text in (stdout, stderr):
        assert "USDT:" not in text and "profiler_start" not in text and "profiler_stop" not in text, text[-2000:]
        assert "nanobind" not in text and "leaked" not in text, text[-2000:]


@pytest.mark.slow
def test_quick_mode_writes_a_well_formed_results_file(cpu_runs):
    out, stdout, _ = cpu_runs
    assert "CPU numbers: not GPU figures" in stdout
    doc = json.loads(_only(out / "quick", ".json").read_text())
    md = _only(out / "quick", ".md").read_text()
    png = _only(out / "quick", ".png")
    assert png.stat().st_size > 1000 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "CPU numbers: not GPU figures" in md and "## Goals" in md
    assert "## Padded batch against the dense batch" in md
    for column in ("loss err", "dH rel err", "dW rel err", "logp err"):
        assert f"| {column} |" in md, column

    assert doc["complete"] is True and doc["schema_version"] == 2
    meta = doc["meta"]
    assert meta["device_type"] == "cpu" and meta["device_name"].startswith("CPU")
    assert "not GPU figures" in meta["banner"]
    for key in (
        "date",
        "commit",
        "versions",
        "dtype",
        "loss_config",
        "matmul_peak_tflops",
        "memory_method",
        "precision_method",
        "scenarios",
        "padded_lengths",
    ):
        assert key in meta, key
    assert meta["versions"]["torch"] and "triton" in meta["versions"] and "trl" in meta["versions"]
    assert meta["matmul_peak_tflops"] > 0
    assert meta["loss_config"]["use_bias_correction_kl"] is True  # TRL 1.16's default, given to every peer
    assert meta["scenarios"] == ["dense", "padded"] and "GSM8K" in meta["padded_lengths"]["source"]
    assert _only(out / "quick", ".json").name.startswith("cpu-")
    # the thread policy the timings ran under (bench sets OMP_WAIT_POLICY before torch loads OpenMP) and the
    # machine's load around the run
    policy = os.environ.get("OMP_WAIT_POLICY", "PASSIVE")
    assert meta["thread_policy"] == f"OMP_WAIT_POLICY={policy}" and meta["env"]["OMP_WAIT_POLICY"] == policy
    for key in ("load_average_before", "load_average_after"):
        assert len(meta[key]) == 3 and all(v >= 0 for v in meta[key]), key
    assert f"thread policy OMP_WAIT_POLICY={policy}; load average (1, 5, 15 min) " in md

    records = doc["results"]
    statuses = {"ok", "wrong", "oom", "unavailable", "error", "skipped"}
    assert all(r["status"] in statuses for r in records)
    points = {(r["shape"], r["N"], r["scenario"]) for r in records}
    assert {scenario for _, _, scenario in points} == {"dense", "padded"} and len(points) >= 4
    by_key = {(r["shape"], r["N"], r["scenario"], r["mode"], r["impl"]): r for r in records}
    for shape, N, scenario in points:
        expected = (
            ("fwdbwd", ("eager", "grpo_fast", "grpo_fast_frozen", "grpo_fast_frozen_recompute")),
            ("logprobs", ("eager", "grpo_fast")),
        )
        for mode, impls in expected:
            for impl in impls:
                r = by_key[(shape, N, scenario, mode, impl)]
                assert r["status"] == "ok", r
            trl = by_key[(shape, N, scenario, mode, "trl")]
            assert trl["status"] == "ok", f"TRL's head: {trl['status']} ({trl['reason']})"
        assert by_key[(shape, N, scenario, "fwdbwd", "liger")]["status"] in ("ok", "unavailable")
        assert (shape, N, scenario, "logprobs", "grpo_fast_frozen") not in by_key  # no dW to skip without grad

    for r in records:
        assert r["N"] == r["B"] * r["T"] and math.isclose(r["fill"], r["active_tokens"] / r["N"])
        if r["scenario"] == "dense":
            assert r["active_tokens"] == r["N"] and r["ratio_time_vs_dense"] is None
        else:
            assert 0.2 < r["fill"] < 0.9, r["fill"]  # GSM8K solutions padded to the longest of 16
        if r["status"] != "ok":
            assert r["reason"] and r["median_ms"] is None
            continue
        assert r["times_ms"] and all(t > 0 for t in r["times_ms"])
        assert math.isclose(r["median_ms"], statistics.median(r["times_ms"]))
        assert isinstance(r["peak_mem_bytes"], int) and r["peak_mem_bytes"] > 0
        # the work, on the completion tokens only: grpo_fast's rows the sweeps of the head that ran, the others the
        # floor (2nDV log-probs, 8nDV fwd+bwd, 4nDV frozen)
        assert r["head"] == CPU_HEADS.get((r["mode"], r["impl"])), (r["mode"], r["impl"], r["head"])
        floor = 2 if r["mode"] == "logprobs" else (4 if r["frozen"] else 8)
        factor = 2 * HEAD_SWEEPS[r["head"]] if r["head"] else floor
        assert r["flops"] == factor * r["active_tokens"] * r["D"] * r["V"]
        # the matmul FLOPs each ran (counted on a CPU), in vocabulary sweeps of the completion tokens: the frozen head
        # builds d logp / dh in the forward (two sweeps); its general path and TRL's head recompute (three)
        sweeps = r["matmul_flops"] / (2 * r["active_tokens"] * r["D"] * r["V"])
        # grpo_fast's products whose rows are tokens (the CPU's torch backend: the logits, the recompute, J's and dH's;
        # not dW, whose rows are the vocabulary) run in whole blocks of rows (gemm.mm_token_rows: a row's value
        # whatever the batch), so their sweeps cover the padded rows, P of them a completion token
        P = padded_rows(r["active_tokens"], "cpu") / r["active_tokens"]
        expected_sweeps = {
            ("fwdbwd", "grpo_fast"): (3 * P + 0.9, 3 * P + 1.1),
            ("fwdbwd", "grpo_fast_frozen"): (2 * P - 0.1, 2 * P + 0.2),
            ("fwdbwd", "grpo_fast_frozen_recompute"): (3 * P - 0.1, 3 * P + 0.1),
            ("fwdbwd", "trl_frozen"): (2.9, 3.1),
            ("logprobs", "grpo_fast"): (P - 0.1, P + 0.1),
        }.get((r["mode"], r["impl"]))
        if expected_sweeps:
            assert expected_sweeps[0] <= sweeps <= expected_sweeps[1], (r["impl"], r["mode"], sweeps)
        assert math.isclose(r["tflops"], r["flops"] / (r["median_ms"] * 1e-3) / 1e12, rel_tol=1e-9)
        assert math.isclose(r["pct_of_matmul_peak"], 100 * r["tflops"] / meta["matmul_peak_tflops"], rel_tol=1e-9)
        eager = by_key[(r["shape"], r["N"], r["scenario"], r["mode"], "eager")]
        assert math.isclose(r["ratio_time_vs_eager"], r["median_ms"] / eager["median_ms"], rel_tol=1e-9)
        assert math.isclose(r["ratio_mem_vs_eager"], r["peak_mem_bytes"] / eager["peak_mem_bytes"], rel_tol=1e-9)
        if r["scenario"] == "padded":
            dense = by_key[(r["shape"], r["N"], "dense", r["mode"], r["impl"])]
            assert math.isclose(r["ratio_time_vs_dense"], r["median_ms"] / dense["median_ms"], rel_tol=1e-9)
            assert math.isclose(r["ratio_mem_vs_dense"], r["peak_mem_bytes"] / dense["peak_mem_bytes"], rel_tol=1e-9)
        # precision against the fp64 truth, fp32 inputs: every implementation within fp32 rounding
        errors = r["errors"]
        if r["mode"] == "fwdbwd":
            assert errors["loss_abs_err"] < 1e-5 and errors["grad_hidden_rel_err"] < 1e-4
            assert ("grad_weight_rel_err" in errors) != r["frozen"]
            if not r["frozen"]:
                assert errors["grad_weight_rel_err"] < 1e-4
        else:
            assert errors["logprobs_max_abs_err"] < 1e-4

    for shape, N, scenario in points:
        # the eager baseline holds the fp32 logits of every position, padding included: its peak grows with N x V
        r = by_key[(shape, N, scenario, "fwdbwd", "eager")]
        assert r["peak_mem_bytes"] >= 4 * N * r["V"]
        if scenario == "padded":  # grpo_fast and TRL's head score only the completion tokens: less memory
            for mode in ("fwdbwd", "logprobs"):
                for impl in ("grpo_fast", "trl"):
                    assert by_key[(shape, N, scenario, mode, impl)]["ratio_mem_vs_dense"] < 0.9, (N, mode, impl)

    goals = doc["goals"]
    assert len(goals) == 5 and all(g["result"] == "not measured" for g in goals)


INJECTED = textwrap.dedent("""
    import json, sys
    import bench
    from bench.impls import IMPLS, Impl, register

    def scaled(mode, options):
        good = IMPLS["grpo_fast"].build(mode, options)
        if mode == "fwdbwd":
            return lambda x, w: good(x, w)[0] * 1.5
        return lambda x, w: good(x, w) + 0.5

    def no_dw(mode, options):  # the right loss, but the lm_head gets no gradient
        good = IMPLS["grpo_fast"].build(mode, options)
        return lambda x, w: good(x, x.weight_frozen)

    def broken(mode, options):
        def fn(x, w):
            raise RuntimeError("kernel exploded")
        return fn

    register(Impl("wrong_scale", "test: grpo_fast's loss x 1.5", scaled))
    register(Impl("wrong_no_dw", "test: no weight gradient", no_dw, modes=("fwdbwd",)))
    register(Impl("broken", "test: raises", broken))
    register(Impl("absent", "test: unavailable", broken, unavailable=lambda device: "not installed"))
    bench.main(["--shapes", "32x300", "--tokens", "128", "--scenarios", "dense", "--reps", "2", "--warmup", "0",
                "--no-plot", "--no-progress", "--name", "injected", "--out", sys.argv[1],
                "--impls", "eager,grpo_fast,wrong_scale,wrong_no_dw,broken,absent"])
""")


@pytest.mark.slow
def test_guard_marks_a_wrong_implementation_wrong_and_does_not_time_it(tmp_path):
    _run(["-c", INJECTED, str(tmp_path)])
    doc = json.loads((tmp_path / "injected.json").read_text())
    status = {(r["mode"], r["impl"]): r for r in doc["results"]}
    for mode in ("fwdbwd", "logprobs"):
        assert status[(mode, "eager")]["status"] == "ok"
        assert status[(mode, "grpo_fast")]["status"] == "ok"
        wrong = status[(mode, "wrong_scale")]
        assert wrong["status"] == "wrong" and wrong["times_ms"] == [] and wrong["median_ms"] is None
        assert wrong["ratio_time_vs_eager"] is None and wrong["errors"]
        assert status[(mode, "broken")]["status"] == "error"
        assert "kernel exploded" in status[(mode, "broken")]["reason"]
        assert status[(mode, "absent")]["status"] == "unavailable"
    assert status[("fwdbwd", "wrong_scale")]["errors"]["loss_abs_err"] > 1e-3
    no_dw = status[("fwdbwd", "wrong_no_dw")]
    assert no_dw["status"] == "wrong" and no_dw["errors"]["grad_weight_max_abs_err"] is None
    md = (tmp_path / "injected.md").read_text()
    assert "**WRONG**" in md and "**ERROR**" in md and "**UNAVAILABLE**" in md


@pytest.mark.slow
def test_precision_columns_show_the_logits_rounded_to_bf16(cpu_runs):
    """From bf16 inputs, eager and TRL's head round the logits to bf16 before the log-softmax; grpo_fast accumulates
    them in fp32: its log-probs are orders of magnitude closer to the fp64 truth."""
    doc = json.loads((cpu_runs[0] / "bf16" / "bf16.json").read_text())
    err = {r["impl"]: r["errors"]["logprobs_max_abs_err"] for r in doc["results"] if r["status"] == "ok"}
    peers = ("eager", "trl")
    assert set(err) == {"grpo_fast", *peers}, doc["results"]
    assert err["grpo_fast"] < 1e-4
    for peer in peers:
        assert err[peer] > 20 * err["grpo_fast"], err


GOALS = textwrap.dedent("""
    import json
    from bench import report

    def rec(impl, status="ok", ms=None, mem=None, **kw):
        r = dict(shape="qwen2.5-1.5b", N=16384, scenario="dense", mode="fwdbwd", impl=impl, status=status,
                 median_ms=ms, times_ms=[ms] if ms else [], peak_mem_bytes=mem, frozen=False,
                 flops=8 * 16384 * 1536 * 151936)
        r.update(kw)
        return r

    meta = dict(device_type="cuda", matmul_peak_tflops=800.0)
    out = {}
    pass_all = [rec("eager", ms=400.0, mem=50e9), rec("liger", ms=150.0, mem=3e9), rec("grpo_fast", ms=60.0, mem=1e9)]
    out["pass"] = report.evaluate_goals(meta, report.derive(pass_all, 800.0))
    fail_all = [rec("eager", ms=100.0, mem=5e9), rec("liger", ms=50.0, mem=1e9), rec("grpo_fast", ms=90.0, mem=2e9)]
    out["fail"] = report.evaluate_goals(meta, report.derive(fail_all, 800.0))
    oom = [rec("eager", status="oom", reason="OOM"), rec("liger", status="oom", reason="OOM"),
           rec("grpo_fast", ms=60.0, mem=1e9)]
    out["oom"] = report.evaluate_goals(meta, report.derive(oom, 800.0))
    out["absent"] = report.evaluate_goals(meta, report.derive([rec("eager", ms=1.0, mem=1)], 800.0))
    out["cpu"] = report.evaluate_goals(dict(device_type="cpu"), report.derive(pass_all, 800.0))
    print(json.dumps(out))
""")


# the heads grpo_fast's rows run on a CPU (the torch backend): no three-sweep head there
CPU_HEADS = {
    ("fwdbwd", "grpo_fast"): "recompute",
    ("fwdbwd", "grpo_fast_frozen"): "frozen",
    ("fwdbwd", "grpo_fast_frozen_recompute"): "frozen recompute",
    ("logprobs", "grpo_fast"): "log-prob pass",
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_tflops_count_the_sweeps_of_the_head_that_ran(dtype):
    """Each grpo_fast row's work is its head's sweeps, the head named as grpo_fast's own path choice names it (the
    Triton backend's trained head: three sweeps, 6nDV; fp16 or the torch backend: the recompute, 8nDV); on the torch
    backend the counted matmul FLOPs are those sweeps exactly (a dense batch of whole row blocks); a peer's row counts
    the floor and names no head."""
    D, V, B, T = 32, 512, 2, 64
    N = B * T
    x = make_inputs(D, V, B, T, dtype, "cpu", 0, "dense")
    trained = "three-sweep" if dtype == torch.float32 else "recompute"  # the three-sweep head: bf16 or fp32
    cases = [
        ("grpo_fast", "fwdbwd", "triton", trained),  # the Triton backend, under TRITON_INTERPRET on a CPU
        *((impl, mode, "torch", head) for (mode, impl), head in CPU_HEADS.items()),
        ("trl", "fwdbwd", "torch", None),
        ("eager", "logprobs", "torch", None),
    ]
    for name, mode, backend, head in cases:
        impl = IMPLS[name]
        got, work_flops = work(impl, mode, x, {"backend": backend}, N, D, V)
        assert got == head, (name, mode, backend)
        floor = 2 if mode == "logprobs" else (4 if impl.frozen else 8)
        assert work_flops == (2 * HEAD_SWEEPS[head] if head else floor) * N * D * V, (name, mode)
        if head and backend == "torch" and dtype == torch.float32:
            fn = impl.build(mode, {"backend": backend})
            x.reset_grads()
            with measure.count_matmul_flops("cpu") as counted:
                out = fn(x, x.weight_frozen if impl.frozen else x.weight)
                if mode == "fwdbwd":
                    (out[0] if isinstance(out, tuple) else out).backward()
            assert counted[0] == work_flops, (name, mode, counted[0] / (2 * N * D * V))


def test_goals_are_evaluated_honestly():
    out = json.loads(_run(["-c", GOALS]).stdout.strip().splitlines()[-1])
    assert [g["result"] for g in out["pass"]] == ["PASS"] * 5
    # 8NDV / 60 ms = 509 TFLOP/s = 64% of 800
    assert out["pass"][4]["measured"].startswith("63.") or out["pass"][4]["measured"].startswith("64.")
    assert [g["result"] for g in out["fail"]] == ["FAIL"] * 5
    # eager and Liger out of memory: no ratio to eager; below Liger's memory; no time to compare with Liger
    assert [g["result"] for g in out["oom"]] == ["not measured", "PASS", "not measured", "not measured", "PASS"]
    assert all(g["result"] == "not measured" for g in out["absent"])
    assert all(g["result"] == "not measured" for g in out["cpu"])


def test_a_file_with_skipped_measurements_says_so_in_its_header(tmp_path):
    """A time budget that skipped measurements: the .md's header says how many and which, so the file never
    reads as a full sweep."""
    import bench.report as report

    doc = json.loads((ROOT / "bench" / "results" / "cpu-frozen-bf16.json").read_text())
    for r in doc["results"]:
        r.update(status="ok")
    assert "**Partial**" not in report.markdown(doc)
    doc["results"][0].update(status="skipped", reason="time budget of 60 s spent")
    first = doc["results"][0]
    header = [line for line in report.markdown(doc).splitlines() if "**Partial**" in line]
    assert header == [
        f"> **Partial**: 1 of {len(doc['results'])} measurements were skipped (time budget of 60 s "
        f"spent): {first['impl']} {first['mode']} at {first['shape']} N={first['N']} "
        f"{first['scenario']}. This file holds the rest."
    ]


def test_an_interrupted_run_writes_what_was_measured_and_exits_130(tmp_path, capsys, monkeypatch):
    # both benchmarks (bench/__main__.py, bench/divergence.py) run their points through report.run_and_report
    monkeypatch.syspath_prepend(str(ROOT))
    from bench import report

    writes, plots = [], []

    def run_points(point_done):
        point_done(["first point"])
        raise KeyboardInterrupt  # what SIGTERM becomes inside run_and_report

    def write(records, complete):
        writes.append((list(records), complete))
        (tmp_path / "r.md").write_text("table")
        return dict(records=records, complete=complete)

    paths = {"md": tmp_path / "r.md", "png": tmp_path / "r.png"}
    with pytest.raises(SystemExit) as exit_info:
        report.run_and_report(
            run_points,
            write,
            lambda doc, path: plots.append(doc),
            lambda doc: "the markdown",
            paths,
            no_plot=False,
            tag="t",
        )
    assert exit_info.value.code == 130
    assert writes == [(["first point"], False), (["first point"], False)]
    assert plots == [dict(records=["first point"], complete=False)]
    out, err = capsys.readouterr()
    assert "the markdown" in out and f"[t] wrote {tmp_path / 'r.md'}" in out and "[t] interrupted" in err
    assert report.run_and_report(
        lambda point_done: ["a", "b"], write, lambda doc, path: 1 / 0, lambda doc: "md", paths, no_plot=False, tag="t"
    ) == dict(records=["a", "b"], complete=True)
    assert "[t] plot failed: ZeroDivisionError" in capsys.readouterr().err


def test_cce_row_scores_the_completion_tokens_through_linear_cross_entropy(monkeypatch):
    """The CCE row (CUDA only: unavailable elsewhere, with the reason) reads logp = -linear_cross_entropy(h / tau,
    W, y, reduction="none") at the completion tokens, zeros at the padding, and feeds TRL's loss: here through a
    stand-in of cut_cross_entropy's function (the fp32 cross-entropy of the full logits), against the eager row."""
    import types

    import torch

    from bench.impls import IMPLS
    from bench.inputs import make_inputs

    assert IMPLS["cce"].unavailable("cpu") == "CCE's kernels need CUDA"
    calls = []

    def linear_cross_entropy(e, c, targets, reduction="mean"):
        calls.append((e.shape, reduction))
        return torch.nn.functional.cross_entropy(e.float() @ c.float().T, targets, reduction=reduction)

    monkeypatch.setitem(
        sys.modules, "cut_cross_entropy", types.SimpleNamespace(linear_cross_entropy=linear_cross_entropy)
    )
    x = make_inputs(24, 150, 3, 7, torch.float32, "cpu", scenario="padded")
    x.temperature = 0.7
    logp = IMPLS["cce"].build("logprobs", {})(x, x.weight)
    expected = IMPLS["eager"].build("logprobs", {})(x, x.weight) * x.mask
    assert calls == [((int(x.mask.sum()), 24), "none")]
    torch.testing.assert_close(logp, expected, rtol=1e-5, atol=1e-6)
    assert (logp[~x.mask] == 0).all()
    loss, _ = IMPLS["cce"].build("fwdbwd", {})(x, x.weight)
    eager_loss, _ = IMPLS["eager"].build("fwdbwd", {})(x, x.weight)
    torch.testing.assert_close(loss, eager_loss, rtol=1e-5, atol=1e-6)


def test_times_are_also_given_in_units_of_the_points_bare_product():
    """``x product``: a record's time over its point's cuBLAS product (``product_ms``, measured on CUDA only)."""
    import torch

    from bench.measure import bare_product_ms
    from bench.report import derive

    point = dict(shape="s", D=4, V=8, N=16, scenario="dense", mode="logprobs", status="ok", flops=1.0)
    records = derive(
        [
            dict(point, impl="eager", median_ms=20.0, product_ms=None),
            dict(point, impl="x", median_ms=14.0, product_ms=11.6),
        ],
        None,
    )
    assert records[0]["ratio_time_vs_product"] is None
    assert records[1]["ratio_time_vs_product"] == 14.0 / 11.6
    assert bare_product_ms(torch.ones(3, 4), torch.ones(8, 4), "cpu") is None
