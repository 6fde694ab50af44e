"""python -m bench.divergence end to end at a tiny pair of heads: the files, the report's columns, real precision
numbers (grpo_fast against the fp64 truth, eager's bf16 rounding, the confident batch where TRL's head and eager lose
the divergence) and the vocabulary sweeps counted per model."""

import json
import math

import pytest

from bench import divergence as bench_divergence

ARGS = [
    "--student",
    "24x1000",
    "--teacher",
    "40x1000",
    "--tokens",
    "48",
    "--betas",
    "1,0.5",
    "--precision-tokens",
    "32",
    "--reps",
    "1",
    "--no-progress",
    "--name",
    "tiny",
]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench-divergence")
    doc = bench_divergence.main([*ARGS, "--out", str(out)])
    return out, doc


def _record(doc, scenario, beta, mode, impl, timed=False):
    (r,) = [
        r
        for r in doc["results"]
        if (r["scenario"], r["beta"], r["mode"], r["impl"], r["timed"]) == (scenario, beta, mode, impl, timed)
    ]
    return r


def test_files_and_report(run):
    out, doc = run
    assert doc["complete"]
    for ext in ("json", "md", "png"):
        assert (out / f"tiny.{ext}").stat().st_size > 0
    saved = json.loads((out / "tiny.json").read_text())
    assert saved["results"] == json.loads(json.dumps(doc["results"]))
    md = (out / "tiny.md").read_text()
    assert md.splitlines()[2] == "```bash"
    assert md.splitlines()[3].startswith("python -m bench.divergence --student 24x1000")
    assert "load average (1, 5, 15 min)" in md
    header = next(line for line in md.splitlines() if line.startswith("| batch |"))
    for column in (
        "fwd+bwd ms",
        "fwd+bwd MiB",
        "fwd ms",
        "fwd MiB",
        "sweeps fwd+bwd (student / teacher)",
        "sweeps fwd",
        "max abs div err",
        "div err / max div",
        "dH rel err",
        "dW rel err",
    ):
        assert f"| {column} |" in header
    # a row per implementation that ran (eager, trl, grpo_fast, grpo_fast_loss, grpo_fast_mopd) and point: precision
    # (N 32: ordinary and confident, betas 1 and 0.5), timed (N 48, ordinary, betas 1 and 0.5)
    rows = [line for line in md.splitlines() if line.startswith("| ordinary |") or line.startswith("| confident |")]
    assert len(rows) == 5 * (4 + 2)


def test_statuses_and_measurements(run):
    _, doc = run
    for r in doc["results"]:
        if r["impl"] == "liger":  # a Triton kernel: no CPU path
            assert r["status"] == "unavailable" and r["reason"]
            continue
        assert r["status"] == "ok", r
        assert r["peak_mem_bytes"] > 0
        if r["timed"]:
            assert r["N"] == 48 and r["median_ms"] > 0 and len(r["times_ms"]) == 1 and r["errors"] == {}
        elif r["impl"] in ("grpo_fast_loss", "grpo_fast_mopd"):  # a scalar loss: its error, no per-token one
            assert r["N"] == 32 and "median_ms" not in r and "div_rel_err" not in r["errors"]
            assert r["errors"]["loss_abs_err"] is not None
        else:  # a precision point: untimed, against the fp64 truth
            assert r["N"] == 32 and "median_ms" not in r and r["errors"]["div_rel_err"] is not None
    assert {(r["scenario"], r["mode"], r["timed"]) for r in doc["results"]} == {
        ("ordinary", "fwdbwd", True),
        ("ordinary", "forward", True),
        ("ordinary", "fwdbwd", False),
        ("confident", "fwdbwd", False),
    }


def test_sweeps_counted_per_model(run):
    _, doc = run
    ours = _record(doc, "ordinary", 1.0, "fwdbwd", "grpo_fast", timed=True)
    # reverse KL: the student's forward, recompute, dH, dW; the teacher's forward and recompute
    assert (ours["sweeps_student"], ours["sweeps_teacher"]) == (4.0, 2.0)
    assert (ours["flops_other"]) == 0
    forward = _record(doc, "ordinary", 1.0, "forward", "grpo_fast", timed=True)
    assert (forward["sweeps_student"], forward["sweeps_teacher"]) == (1.0, 1.0)
    for beta in (1.0, 0.5):
        for mode in ("fwdbwd", "forward"):
            trl, ours = (_record(doc, "ordinary", beta, mode, impl, timed=True) for impl in ("trl", "grpo_fast"))
            assert ours["sweeps_student"] <= trl["sweeps_student"] and ours["sweeps_teacher"] <= trl["sweeps_teacher"]
        # the loss with two teachers, each over its rows: the one teacher's sweeps
        one, two = (
            _record(doc, "ordinary", beta, "fwdbwd", impl, timed=True) for impl in ("grpo_fast_loss", "grpo_fast_mopd")
        )
        assert (two["sweeps_student"], two["sweeps_teacher"]) == (one["sweeps_student"], one["sweeps_teacher"])


def test_precision_numbers_are_real(run):
    _, doc = run
    for beta in (1.0, 0.5):
        ours = _record(doc, "ordinary", beta, "fwdbwd", "grpo_fast")["errors"]
        eager = _record(doc, "ordinary", beta, "fwdbwd", "eager")["errors"]
        assert all(math.isfinite(v) for v in (*ours.values(), *eager.values()))
        # from bf16 inputs: ours is fp32 accumulation's, eager rounds both models' logits to bf16
        assert 0 < ours["div_rel_err"] < 1e-5
        assert eager["div_rel_err"] > 1e-3
        # the gradients come back in bf16: its rounding, 2^-9 of the largest entry, and no more than a few of it
        assert 1e-4 < ours["grad_hidden_rel_err"] < 1e-2 and 1e-4 < ours["grad_weight_rel_err"] < 1e-2
        # the loss of grpo_fast.distillation_loss: fp32 accumulation's, its gradients as the per-token head's
        for impl in ("grpo_fast_loss", "grpo_fast_mopd"):  # two copies of the teacher: the same loss
            loss = _record(doc, "ordinary", beta, "fwdbwd", impl)["errors"]
            assert loss["loss_abs_err"] < 1e-5
            for name in ("grad_hidden_rel_err", "grad_weight_rel_err"):
                assert loss[name] == pytest.approx(ours[name], rel=0.05)
    # confident tokens (1 - p ~ 1e-6 in both models): TRL's head and eager form 1 - p by subtraction
    ours, trl, eager = (
        _record(doc, "confident", 1.0, "fwdbwd", impl)["errors"] for impl in ("grpo_fast", "trl", "eager")
    )
    assert ours["div_rel_err"] < 1e-4
    assert trl["div_rel_err"] > 100 * ours["div_rel_err"] and eager["div_rel_err"] > 100 * ours["div_rel_err"]
    rest = _record(doc, "confident", 1.0, "fwdbwd", "grpo_fast")["truth"]["rest_mass_median"]
    assert 2e-7 < rest["student"] < 5e-6 and 2e-7 < rest["teacher"] < 5e-6
