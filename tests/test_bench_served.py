"""python -m bench.served (bench/served.py): the served-teacher loss beside the plain log-prob pass, TRL's async
trainer's loss function and eager PyTorch, end to end on a CPU at a tiny shape: every row measured, its ratios, sweeps
and precision against the fp64 spec, and the report."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def served_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench-served")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    argv = ["--shape", "32x600", "--tokens", "128", "--k", "4,32", "--dtype", "float32", "--reps", "1", "--warmup",
            "0", "--no-progress", "--out", str(out), "--name", "served"]  # fmt: skip
    proc = subprocess.run(
        [sys.executable, "-m", "bench.served", *argv], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((out / "served.json").read_text()), (out / "served.md").read_text()


def test_rows_ratios_sweeps_and_precision(served_run):
    doc, md = served_run
    rows = {(r["impl"], r["K"]): r for r in doc["results"]}
    assert set(rows) == {("plain", None)} | {(i, K) for i in ("served", "trl_async", "eager") for K in (4, 32)}
    plain = rows["plain", None]
    for (impl, K), r in rows.items():
        assert r["status"] == "ok", (impl, K, r.get("reason"))
        assert r["x_plain"] == pytest.approx(r["median_ms"] / plain["median_ms"], rel=1e-9)
        if K is not None:
            peer = rows["trl_async", K]
            assert r["x_trl_async"] == pytest.approx(r["median_ms"] / peer["median_ms"], rel=1e-9)
            e = r["errors"]  # fp32 inputs: each within fp32 rounding of the fp64 spec (eager's logits too)
            assert e["loss_rel_err"] < 1e-5 and e["grad_hidden_rel_err"] < 1e-4 and e["grad_weight_rel_err"] < 1e-4
    # vocabulary sweeps on the CPU (the torch backend's per-token path: the forward and the recompute's three; the
    # gathered K rows add 2 K / V: their logits and dH, dW an index add; without a soft-cap the backward gathers
    # nothing again); TRL's checkpointed chunks: four; eager: three
    assert plain["sweeps"] == pytest.approx(4.0)
    for K in (4, 32):
        assert rows["served", K]["sweeps"] == pytest.approx(4.0 + 2 * K / 600)
        assert rows["trl_async", K]["sweeps"] == pytest.approx(4.0)
        assert rows["eager", K]["sweeps"] == pytest.approx(3.0)
    assert doc["meta"]["targets"] == {"x_plain": 1.1, "x_trl_async": 0.25}
    assert doc["meta"]["commit"] and doc["meta"]["device"]["device_type"] == "cpu"
    assert "CPU numbers: not GPU figures" in md and "| served | 32 | 128 |" in md
