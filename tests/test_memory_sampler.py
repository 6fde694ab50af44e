"""python -m grpo_fast.memory --sampler: grpo_fast.sampler_logprobs' head in the step's estimate (the old policy's pass
and / or the training pass), and its memory model (grpo_fast.memory.sampler) against the chunked twin's measured
buffers on a CPU; the estimate grows with the tokens by O(N) terms only (never N x V)."""

import sys
from pathlib import Path

import pytest
import torch

from grpo_fast import memory
from grpo_fast.backends import support_twin
from grpo_fast.backends.resolver import named
from grpo_fast.head.transform import LogitTransform
from grpo_fast.kernels import kept_set
from grpo_fast.kernels.operands import HeadGrads, HeadOperands, SamplerSupport
from grpo_fast.memory import command
from grpo_fast.memory import support_workspace as sw

ROOT = Path(__file__).resolve().parents[1]
F32 = torch.float32

# a vocabulary wide enough that a micro-batch spans several chunks of the parameters' path (2^27 / 4V = 256 rows)
V = 131072
TINY = [
    "--hidden-size",
    "64",
    "--intermediate-size",
    "128",
    "--num-layers",
    "2",
    "--num-heads",
    "4",
    "--num-kv-heads",
    "2",
    "--vocab-size",
    str(V),
    "--micro-batch-size",
    "2",
    "--prompt-length",
    "16",
    "--prompts-per-step",
    "2",
    "--num-generations",
    "4",
    "--lora-r",
    "4",
    "--quiet",
]


def _cpu_peak(fn, *args):
    """(the CPU allocator's peak above its start over ``fn(*args)`` (bench.measure's profiler method), its result)."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from bench.measure import cpu_peak_bytes

    results = []
    peak = cpu_peak_bytes(lambda: results.append(fn(*args)), lambda: None)
    return peak, results[0]


def test_model_covers_the_chunked_twins_buffers(monkeypatch):
    """The model's buffer counts against the measured peak of the torch backend's sampler forward and backward (the
    chunked path the Triton backend shares, fp32, several chunks; replayed sets: support_twin's with in-place
    products, as Triton's kernels): at or above it, within 35 %; top-p at its worst (every row sorted whole: logits
    of std 2 over 16384 entries, whose 1024 largest do not hold 0.9)."""
    torch_backend = named("torch")
    monkeypatch.setattr(support_twin, "ROW_BUDGET_BYTES", 1 << 22)
    N, D, Vs = 192, 32, 16384
    r = sw.chunk_rows(N, Vs)
    assert r == 64 and N == 3 * r
    g = torch.Generator().manual_seed(0)
    h = torch.randn(N, D, generator=g)
    w = torch.randn(Vs, D, generator=g) * (2 / D**0.5)
    y = torch.randint(0, Vs, (N,), generator=g)
    head = HeadOperands(h, w, y, None, LogitTransform.from_floats(1.0, None, 1.0), None)
    record_bytes = 6 * N * 4  # the forward's outputs

    def model(op, **kw):
        return sw.support_workspace_bytes(
            op, N, D, Vs, F32, need_hidden=False, need_weight=False, device_type="cpu", **kw
        )

    for params in (dict(top_k=50), dict(min_p=0.05), dict(top_p=0.9)):
        support = SamplerSupport(params.get("top_k", 0), params.get("top_p", 1.0), params.get("min_p", 0.0), None)
        measured, record = _cpu_peak(torch_backend.support_forward, head, support)
        measured -= record_bytes
        predicted = model("sampler_support", **params)
        assert measured <= predicted <= 1.35 * measured, (params, measured / (r * Vs * 4), predicted / (r * Vs * 4))
        grads = HeadGrads(torch.zeros(N, D), torch.zeros(Vs, D), None, None, None)
        c, d = torch.randn(N, generator=g), torch.randn(N, generator=g)
        measured, _ = _cpu_peak(torch_backend.support_backward, head, support, record, c, d, grads)
        predicted = model("sampler_support_backward", **params)
        assert measured <= predicted <= 1.35 * measured, (params, measured / (r * Vs * 4))
    # replayed sets: Triton's products write in place and allocate nothing; these stand-ins do the same
    in_place = support_twin.KeptDots(*(lambda a, b, ids, out: out,) * 3)
    for K in (64, 1024):
        ids = torch.randint(0, Vs, (N, K), generator=g)
        ids[:, 0] = y
        measured, record = _cpu_peak(support_twin.replayed_forward, head, ids, in_place)
        predicted = model("sampler_support", kept=K)
        assert measured - 3 * N * 4 <= predicted <= 1.35 * measured, (K, measured / (N * K * 4))
        grads = HeadGrads(torch.zeros(N, D), torch.zeros(Vs, D), None, None, None)
        d = torch.randn(N, generator=g)
        measured, _ = _cpu_peak(support_twin.replayed_backward, head, ids, record, d, grads, in_place)
        predicted = model("sampler_support_backward", kept=K)
        assert measured <= predicted <= 1.35 * measured, (K, measured / (N * K * 4))


def test_model_grows_with_the_tokens_by_per_token_terms_only():
    """Past one chunk of rows the parameters' path holds the same buffers at any N; the backward adds dH's fp32 rows
    (and dW once); replayed sets grow by K entries a token, and their dW's sort by K pairs a token up to one sort's:
    nothing of N x V."""
    D, Vq = 1536, 151936
    r = sw.chunk_rows(10**9, Vq)
    assert r == 2**27 // (4 * Vq) == 220

    def sort_bytes(op, N, params):
        backward = op == "sampler_support_backward" and "kept" in params
        return kept_set.grad_table_workspace_bytes(N, params["kept"]) if backward else 0

    for K in (64, 1024):  # one sort's: linear in N up to PAIRS_PER_SORT pairs, then constant
        assert (
            kept_set.grad_table_workspace_bytes(64 * r, K)
            == min(64 * r * K, kept_set.PAIRS_PER_SORT) * kept_set.SORT_BYTES_PER_PAIR
        )
    for params in (dict(top_k=50), dict(top_p=0.9), dict(min_p=0.05), dict(kept=64), dict(kept=1024)):
        for op in ("sampler_support", "sampler_support_backward"):
            sizes = [
                sw.support_workspace_bytes(op, N, D, Vq, torch.bfloat16, **params) - sort_bytes(op, N, params)
                for N in (r, 4 * r, 64 * r)
            ]
            per_token = (sizes[2] - sizes[1]) / (60 * r)
            assert per_token == pytest.approx((sizes[1] - sizes[0]) / (3 * r)), (params, op)  # linear in N
            expected = 4 * D * (op == "sampler_support_backward")
            if "kept" in params:
                count = sw.REPLAYED_FORWARD if op == "sampler_support" else sw.REPLAYED_BACKWARD
                expected += 4 * params["kept"] * count
            assert per_token == pytest.approx(expected), (params, op)
            assert per_token < Vq / 4  # not a row of logits a token
    # the old policy's pass at Qwen2.5's head: 16 buffers of 220 x 151936 fp32 for top-p's worst case (2 GiB), 4.5
    # for top-k, whatever the tokens
    top_p = sw.support_workspace_bytes("sampler_support", 4096, D, Vq, torch.bfloat16, top_p=0.9)
    assert top_p == 16 * 220 * Vq * 4
    top_k = sw.support_workspace_bytes("sampler_support", 4096, D, Vq, torch.bfloat16, top_k=50)
    assert top_k == 4.5 * 220 * Vq * 4
    # a trained lm_head: the backward's fp32 dW [V, D] (LoRA's frozen head: none)
    trained = sw.support_workspace_bytes("sampler_support_backward", 4096, D, Vq, torch.bfloat16, top_k=50)
    frozen = sw.support_workspace_bytes(
        "sampler_support_backward", 4096, D, Vq, torch.bfloat16, top_k=50, need_weight=False
    )
    assert trained - frozen == 4 * Vq * D


@pytest.fixture(scope="module")
def estimates():
    """The command line's sampler head (top-p, both passes) and replayed sets (K 64, the training pass) beside
    grpo_fast's, at two completion lengths (N = 512 and 1024 tokens, each past one 256-row chunk)."""
    out = {}
    for T in (256, 512):
        base = TINY + ["--completion-length", str(T)]
        out["top_p", T] = memory.main(
            base + ["--sampler", "both", "--top-p", "0.9", "--heads", "grpo_fast,grpo_fast_sampler"]
        )
        out["kept", T] = memory.main(base + ["--sampler", "train", "--kept-k", "64", "--heads", "grpo_fast_sampler"])
    return out


def test_sampler_head_estimate_is_plausible(estimates):
    report = estimates["top_p", 512]
    assert list(report["heads"]) == ["grpo_fast", "grpo_fast_sampler"]
    fused, head = report["heads"]["grpo_fast"], report["heads"]["grpo_fast_sampler"]
    assert head["sampler"] == dict(top_k=0, top_p=0.9, min_p=0.0, kept=0, passes=["old", "train"])
    assert head["label"] == "grpo_fast + sampler_logprobs (top_p 0.9; both passes)"
    N, r = 2 * 512, 256
    buffers = sw.FORWARD_BUFFERS["top_p"] * r * V * 4  # the forward's 16 [256, V] fp32 buffers: 2 GiB
    # the head's own peak: the buffers (a fixed 2 GiB, more than this short batch's [N, V] fp32 logits) and
    # per-token tensors (a few KiB a token at D = 64)
    assert buffers <= head["loss_head_peak_bytes"] <= buffers + 4096 * N
    assert head["peak_bytes"] > fused["peak_bytes"] and sum(head["categories_bytes"].values()) == head["peak_bytes"]
    # both passes accounted, each on its own; the step's peak is the larger
    old = head["old_policy_pass"]
    assert old["peak_in"].startswith("old-policy pass") and buffers <= old["loss_head_peak_bytes"]
    assert sum(old["categories_bytes"].values()) == old["peak_bytes"] and old["categories_bytes"]["gradients"] == 0
    assert head["peak_bytes"] >= old["peak_bytes"]
    assert "old_policy_pass" not in fused
    text = memory.report.markdown(report)
    assert (
        "| old policy's pass (no grad): peak |  | " in text and "grpo_fast.sampler_logprobs (the sampler head)" in text
    )


def test_sampler_head_grows_with_tokens_by_per_token_terms_only(estimates):
    """From 512 to 1024 tokens the head's own peak grows by O(N) terms (a few KiB a token; K = 64 entries' fp32
    buffers for replayed sets), while one fp32 row of logits a token would be 512 KiB."""
    dN = 2 * (512 - 256)
    for kind in ("top_p", "kept"):
        small, large = (estimates[kind, T]["heads"]["grpo_fast_sampler"] for T in (256, 512))
        grown = large["loss_head_peak_bytes"] - small["loss_head_peak_bytes"]
        assert 0 < grown <= 4096 * dN, (kind, grown / dN)
        assert grown < dN * V * 4 / 100
    kept = estimates["kept", 512]["heads"]["grpo_fast_sampler"]
    assert "old_policy_pass" not in kept and kept["sampler"]["kept"] == 64
    assert kept["label"] == "grpo_fast + sampler_logprobs (replayed kept_ids K=64; training pass)"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--top-p", "0.9"], "--top-p describes the sampler of --sampler's head: give --sampler too"),
        (["--sampler", "old"], "--sampler old: the sampler truncates by --top-k, --top-p (< 1) or --min-p (> 0)"),
        (["--sampler", "both", "--top-p", "1"], "--sampler both: the sampler truncates"),
        (["--sampler", "both", "--kept-k", "64", "--top-k", "50"], "--kept-k replays kept sets"),
        (["--sampler", "train", "--top-p", "1.5"], "--top-p 1.5: expected a number in (0, 1]"),
        (["--sampler", "train", "--kept-k", "0"], "--kept-k 0: expected an integer"),
        (["--heads", "grpo_fast_sampler"], "--heads grpo_fast_sampler: expected distinct names among eager, grpo_fast"),
    ],
)
def test_sampler_flags_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as raised:
        command.parse_args(argv + ["--quiet"])
    assert raised.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("python -m grpo_fast.memory: error: ") and message in err, err


def test_sampler_flag_adds_its_head_after_the_others():
    args = command.parse_args(["--sampler", "old", "--min-p", "0.05", "--quiet"])
    assert args.heads == ["eager", "grpo_fast", "grpo_fast_sampler"]
    head = args.head_classes["grpo_fast_sampler"]
    assert issubclass(head, memory.SamplerHead) and head.old_policy_pass and head.kept_width == 0
    assert head.settings == memory.SamplerSettings(min_p=0.05, passes=("old",))
    train = command.parse_args(["--sampler", "train", "--kept-k", "1024", "--quiet"]).head_classes
    assert train["grpo_fast_sampler"].kept_width == 1024 and not train["grpo_fast_sampler"].old_policy_pass
    assert command.parse_args(["--quiet"]).heads == ["eager", "grpo_fast"]  # without --sampler: as before
