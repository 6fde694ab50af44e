"""tools/gpu_tune.py's rows, run on a CPU by Triton's interpreter with a counting timer, each timed as the GPU run
would time it, beside cuBLAS's products: every forward candidate tile gives the default configuration's log-probs,
every divergence candidate tile (the copy engine's too) its divergence (the record sweep and the g kernel timed),
every trained-head chunk and the recompute path the default chunk's dW."""

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tools"))

import gpu_tune  # noqa: E402


def counting_timer(ms):
    """(a timer that runs what it times once and says ``ms``, the list of what it timed)."""
    timed = []

    def bench(run):
        run()
        timed.append(run)
        return ms

    return bench, timed


def test_divergence_rows_time_every_candidate_and_agree():
    bench, timed = counting_timer(1.0)
    rows = gpu_tune.divergence_rows(40, 16, 32, 300, torch.float32, 90, device="cpu", bench=bench)
    assert [r["config"] for r in rows][0] == "cuBLAS mm of both models"
    assert len(rows) == 1 + len(gpu_tune.DIVERGENCE_CANDIDATES)
    assert len(timed) == 1 + 2 * len(gpu_tune.DIVERGENCE_CANDIDATES)
    for r in rows[1:]:
        assert r["sweep_ms"] == r["g_ms"] == 1.0, r
        assert r["err"] < 1e-5, r
    assert all(gpu_tune.divergence_line(r).startswith(r["config"]) for r in rows)


def test_trained_rows_time_every_chunk_and_the_recompute_path():
    """The three-sweep head at each chunk and the recompute path: timed, their peaks taken, each dW the default's."""
    bench, timed = counting_timer(2.0)
    chunks = (None, 16, 32, 64)  # 64: more than N, left out
    rows = gpu_tune.trained_rows(
        48, 16, 200, torch.float32, device="cpu", bench=bench, peak=lambda run: run() or 3 * 2**20, chunks=chunks
    )
    names = [r["config"] for r in rows]
    assert names[0].startswith("cuBLAS") and rows[0]["ms"] == 6.0  # three products at 2 ms
    assert names[1:] == ["chunk default", "chunk 16", "chunk 32", "recompute path (head_path general)"]
    assert len(timed) == len(rows)
    for r in rows[1:]:
        assert r["ms"] == 2.0 and r["peak_mib"] == 3.0, r
        assert r["err"] < 1e-5, r  # every chunk and the recompute path: the default chunk's dW
    assert all(gpu_tune.trained_line(r).startswith(r["config"]) for r in rows)


def test_logprobs_rows_time_every_candidate_and_agree():
    bench, timed = counting_timer(1.0)
    rows = gpu_tune.logprobs_rows(40, 16, 300, torch.float32, 90, device="cpu", bench=bench)
    assert rows[0]["config"] == "cuBLAS mm, 32768-column pieces"
    assert len(rows) == len(timed) == 1 + len(gpu_tune.CANDIDATES)
    for r in rows[1:]:
        assert r["ms"] == 1.0 and r["err"] < 1e-5, r  # every tile: the default configuration's log-probs
    assert all(gpu_tune.logprobs_line(r).startswith(r["config"]) for r in rows)


def test_distillation_rows_time_every_tile_chunk_and_the_per_token_head():
    """The fused distillation loss at each sweep tile and chunk and the per-token head then a sum: timed, their peaks
    taken, each dW the default's; the table's tile is restored after each."""
    from grpo_fast.kernels import tiles as ktiles

    bench, timed = counting_timer(2.0)
    table = ktiles.STORED
    tiles = [(8, 128, 4, 2), (8, 64, 4, 2)]
    rows = gpu_tune.distillation_rows(
        40, 16, 24, 200, torch.float32, device="cpu", bench=bench, peak=lambda run: run() or 3 * 2**20,
        tiles=tiles, chunks=(None, 16, 64),
    )  # fmt: skip
    names = [r["config"] for r in rows]
    assert names[0].startswith("cuBLAS") and rows[0]["ms"] == 8.0  # three student and one teacher product at 2 ms
    assert names[1:] == [
        "tile 8x128 w4 s2",
        "tile 8x64 w4 s2",
        "chunk 16",  # 64: more than N, left out
        "per-token head + sum (head_path general)",
    ]
    assert len(timed) == len(rows) + 1  # the two cuBLAS products timed apart
    for r in rows[1:]:
        assert r["ms"] == 2.0 and r["peak_mib"] == 3.0, r
        assert r["err"] < 1e-5, r
    assert ktiles.STORED == table
    assert all(gpu_tune.trained_line(r).startswith(r["config"]) for r in rows)
