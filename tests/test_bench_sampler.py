"""python -m bench --mode sampler (bench/sampler.py): grpo_fast.sampler_logprobs beside the plain log-prob pass and
TRL's head, end to end on a CPU at a tiny shape (its report's rows, ratios and precision columns), its batch (drawable
targets, replayed sets, the fp64 truth) and issue 45's targets' verdicts."""

import importlib.util
import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import sampler  # noqa: E402
from bench.inputs import make_inputs  # noqa: E402
from grpo_fast import reference  # noqa: E402

VARIANTS = list(sampler.VARIANTS)
SAMPLER_RUN = textwrap.dedent("""
    import sys
    import bench
    bench.main(["--mode", "sampler", "--shapes", "32x600", "--tokens", "64", "--reps", "1", "--warmup", "0",
                "--no-progress", "--name", "sampler", "--out", sys.argv[1]])
""")


@pytest.fixture(scope="module")
def sampler_run(tmp_path_factory):
    """The sampler mode's default rows at D 32, V 600, N 64, dense and padded, fp32 on the CPU (a fresh process, the
    interpreter off: grpo_fast's torch path)."""
    assert importlib.util.find_spec("trl") is not None, "trl is a declared test dependency"
    out = tmp_path_factory.mktemp("bench-sampler")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-c", SAMPLER_RUN, str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((out / "sampler.json").read_text()), (out / "sampler.md").read_text(), out


def test_sampler_mode_rows_ratios_and_precision(sampler_run):
    doc, md, out = sampler_run
    assert doc["complete"] and doc["meta"]["modes"] == ["sampler", "sampler_fwdbwd"]
    assert doc["meta"]["sampler"]["targets_x_plain_logprobs"] == sampler.TARGETS
    assert doc["meta"]["commit_short"] and doc["meta"]["commit"].startswith(doc["meta"]["commit_short"])
    assert list(doc["meta"]["impl_labels"]) == ["trl", "grpo_fast", *VARIANTS]
    records = doc["results"]
    by_key = {(r["scenario"], r["mode"], r["impl"]): r for r in records}
    assert set(by_key) == {
        (s, m, i) for s in ("dense", "padded") for m in sampler.SAMPLER_MODES for i in doc["meta"]["impl_labels"]
    }
    for (scenario, mode, impl), r in by_key.items():
        assert r["status"] == "ok", (scenario, mode, impl, r["reason"])
        plain, trl = by_key[scenario, mode, "grpo_fast"], by_key[scenario, mode, "trl"]
        assert math.isclose(r["ratio_time_vs_plain"], r["median_ms"] / plain["median_ms"], rel_tol=1e-9)
        assert math.isclose(r["ratio_time_vs_trl"], r["median_ms"] / trl["median_ms"], rel_tol=1e-9)
        assert math.isclose(r["ratio_mem_vs_plain"], r["peak_mem_bytes"] / plain["peak_mem_bytes"], rel_tol=1e-9)
        assert r["ratio_time_vs_product"] is None  # cuBLAS's product: CUDA only
        assert r["ratio_time_vs_eager"] is None
        factor = 2 if mode == "sampler" else 8
        assert r["flops"] == factor * r["active_tokens"] * r["D"] * r["V"]
        e = r["errors"]
        if mode == "sampler":  # fp32 inputs: within fp32 rounding of the fp64 spec
            assert e["logprobs_max_abs_err"] < 1e-4
            if impl in sampler.VARIANTS:
                assert e["support_max_abs_err"] < 1e-4 and e["uncertain_tokens"] == r["uncertain_tokens"]
        else:
            assert e["loss_abs_err"] < 1e-5 and e["grad_hidden_rel_err"] < 1e-4 and e["grad_weight_rel_err"] < 1e-4
        if impl in sampler.VARIANTS:
            assert 1 <= r["kept_set_median"] <= r["kept_set_max"] <= 600
            assert 0 <= r["uncertain_tokens"] < r["active_tokens"] / 4
    assert by_key["dense", "sampler", "sampler_top_k"]["kept_set_max"] == 50
    assert by_key["dense", "sampler", "sampler_kept64"]["kept_set_max"] <= 64
    # one vocabulary sweep for the parameters' path; replayed sets: the plain op's sweep and K of V entries more
    sweeps = lambda r: r["matmul_flops"] / (2 * r["active_tokens"] * r["D"] * r["V"])  # noqa: E731
    assert 0.9 < sweeps(by_key["dense", "sampler", "sampler_top_p"]) < 1.1
    assert 1.0 < sweeps(by_key["dense", "sampler", "sampler_kept64"]) < 1.0 + 64 / 600 + 0.05
    # the report: the targets (not evaluated on a CPU), both tables with the ratios to the plain pass, TRL, cuBLAS
    assert "## Sampler log-probs: grpo_fast.sampler_logprobs (issue 45)" in md and "## Goals" not in md
    assert "CPU numbers: not GPU figures" in md
    targets = [line for line in md.splitlines() if "<= 1." in line and "not evaluated" in line]
    assert len(targets) == 2 * len(sampler.TARGETS)  # each target at the dense and the padded batch
    assert "| d32-v600 | 64 | dense | sampler_top_p | <= 1.50x |" in md
    for title in ("### Sampler log-probs, no grad", "### Sampler log-probs, forward + backward"):
        assert title in md
    assert "| x plain | x trl | x product | x dense |" in md and "| support err | uncertain | kept |" in md
    png = out / "sampler.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_sampler_batch_targets_sets_and_truth():
    """Every completion token's target lies in each rule's fp64 kept set and in every replayed set; the replayed sets
    are the spec's top_p=0.95 set's largest entries, ascending, -1 filling last; the truth is the spec's values."""
    x = make_inputs(24, 500, 4, 6, torch.float32, "cpu", seed=3, scenario="padded")
    xs = sampler.make_inputs(x, VARIANTS + ["grpo_fast"], grads=True, seed=3)
    mask = xs.mask
    z = reference.logits(xs.hidden.detach(), xs.weight.detach(), None, 1.0, compute_dtype=torch.float64)
    y = xs.targets
    for name in VARIANTS:
        kw = xs.sampler_keywords(name)
        logp, support, _ = reference.sampler_logprobs(
            xs.hidden.detach(), xs.weight.detach(), y, compute_dtype=torch.float64, **kw
        )
        assert torch.isfinite(support[mask]).all(), name
        torch.testing.assert_close(support[mask].double(), xs.support_truth[name][mask], rtol=0, atol=1e-5)
        torch.testing.assert_close(logp[mask].double(), xs.true_logprobs[mask], rtol=0, atol=1e-5)
    keep95 = reference.kept_mask(z, top_p=sampler.TOP_P_OF_REPLAYED)
    for K, ids in xs.kept_ids.items():
        assert ids.shape == (4, 6, K)
        valid = ids >= 0
        assert (ids[~mask] == -1).all()
        assert ((ids == y[..., None]) & valid).any(-1)[mask].all()  # the target in its set
        first_pad = valid.sum(-1, keepdim=True)
        assert (valid == (torch.arange(K) < first_pad)).all()  # the filling last
        sorted_ids = torch.where(valid, ids, 10**9)
        assert (sorted_ids[..., 1:] > sorted_ids[..., :-1])[valid[..., 1:]].all()  # ascending, no repeats
        assert keep95.gather(-1, ids.clamp(min=0))[valid].all()  # every entry in the spec's top_p=0.95 set
        assert (first_pad[..., 0] == keep95.sum(-1).clamp(max=K))[mask].all()  # its K largest, or all of it
    # the references: plain and every variant, gradients of sum c logp (+ d support) in fp64
    assert set(xs.references) == {sampler.PLAIN, *VARIANTS}
    assert (xs.support_coef["sampler_top_p"][~mask] == 0).all() and (xs.logp_coef[~mask] == 0).all()


def test_uncertain_rows_are_those_a_rounding_could_change():
    z = torch.tensor([[5.0, 4.0, 3.0, 2.0, 1.0], [5.0, 4.0, 4.0 - 1e-7, 2.0, 1.0]], dtype=torch.float64)
    assert sampler.certain_rows(z, dict(top_k=2)).tolist() == [True, False]  # 2nd and 3rd logits tied to 1e-7
    assert sampler.certain_rows(z, dict(min_p=math.exp(-1.0))).tolist() == [False, False]  # 4.0 at the cut
    assert sampler.certain_rows(z, dict(min_p=0.3)).tolist() == [True, True]
    q = torch.softmax(z[0], -1)
    at_cut = float(q[0] + q[1])  # top-p's cut exactly at the second entry's mass above: ambiguous
    assert sampler.certain_rows(z[:1], dict(top_p=at_cut)).tolist() == [False]
    assert sampler.certain_rows(z[:1], dict(top_p=at_cut - 0.05)).tolist() == [True]


def _doc(device_type, ratios):
    results = [
        dict(shape="s", N=16, scenario="dense", mode="sampler", impl=impl, status="ok", ratio_time_vs_plain=ratio)
        for impl, ratio in ratios.items()
    ]
    return dict(meta=dict(device_type=device_type), results=results)


def test_targets_pass_fail_on_a_gpu_and_are_not_evaluated_on_a_cpu():
    ratios = dict(sampler_top_k=1.08, sampler_top_p=1.6, sampler_min_p=3.0, sampler_kept64=1.05, sampler_kept1024=1.2)
    gpu = {t["impl"]: t["result"] for t in sampler.target_rows(_doc("cuda", ratios))}
    assert gpu == dict(sampler_top_k="PASS", sampler_top_p="FAIL", sampler_kept64="PASS", sampler_kept1024="FAIL")
    cpu = sampler.target_rows(_doc("cpu", ratios))
    assert {t["result"] for t in cpu} == {"not evaluated"} and all("CPU run" in t["note"] for t in cpu)
    missing = sampler.target_rows(_doc("cuda", dict(sampler_top_k=None)))
    assert missing[0]["result"] == "not measured"


def test_mode_choices_keep_both_and_add_sampler_and_all():
    import bench.__main__ as cli

    both = cli.build_options(cli.parse_args(["--device", "cpu"]))
    assert both.modes == ["fwdbwd", "logprobs"] and not any(i.name in sampler.VARIANTS for i in both.impls)
    only = cli.build_options(cli.parse_args(["--device", "cpu", "--mode", "sampler"]))
    assert only.modes == ["sampler", "sampler_fwdbwd"]
    assert [i.name for i in only.impls] == ["trl", "grpo_fast", *VARIANTS]
    every = cli.build_options(cli.parse_args(["--device", "cpu", "--mode", "all"]))
    assert every.modes == ["fwdbwd", "logprobs", "sampler", "sampler_fwdbwd"]
    assert [i.name for i in every.impls] == [i.name for i in both.impls] + VARIANTS
    chosen = cli.build_options(
        cli.parse_args(["--device", "cpu", "--mode", "sampler", "--impls", "grpo_fast,sampler_top_p"])
    )
    assert [i.name for i in chosen.impls] == ["grpo_fast", "sampler_top_p"]
