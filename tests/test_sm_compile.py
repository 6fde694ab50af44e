"""Every kernel compiles for one card of every architecture class of the tile tables (sm_80 A100, sm_89 RTX 4090,
sm_90 H100/H200, sm_100 B200, sm_120 RTX 5090) with the GPU launch configuration, fits the card's shared memory and
spills no registers; half-precision dots run on the class's tensor-core instruction; no atomic costs a memory fence;
the kernels whose table row reads through the copy engine do, and no others. No GPU needed: see
tools/sm_compile.py."""

import json
import os
import subprocess
import sys

import pytest
import triton

from grpo_fast.kernels import tiles

HERE = os.path.dirname(__file__)
PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
# each class's reference card (tiles.ARCH_CLASSES: what sm_compile compiles), and how its half-precision dots run:
# Hopper's warpgroup MMA, Blackwell's tcgen05 (the accumulator in tensor memory), mma.sync elsewhere (consumer
# Blackwell included)
ARCHS = tuple(c.capability for c in tiles.ARCH_CLASSES.values())
TENSOR_CORES = {80: "mma", 89: "mma", 90: "wgmma", 100: "tcgen05", 120: "mma"}
# the kernel families read from a table whose row may read through the copy engine
DESCRIBED_FAMILIES = {
    "fwd": tiles.RECORD,
    "fwd candidates": tiles.RECORD,  # the sampler's pass without gradients: the forward's own tile
    "fwd candidates columns": tiles.RECORD,  # with gradients: the wide epilogue's
    "fwd kept bits": tiles.RECORD,  # replayed sets without gradients: the forward's own tile
    "bwd chunked": tiles.CHUNKED_BACKWARD,
    "bwd chunked kept bits": tiles.CHUNKED_BACKWARD,  # replayed sets with a trained head: the wide epilogue's
    "div fwd": tiles.SWEEP,
    "div jsd": tiles.SWEEP,
    "div bwd": tiles.G,
}


# sm_compile's launches per arch, counted from its variant lists: layer 1's five kernels (forward, its merge, chunked
# backward, fused backward, fused backward with a frozen W) for bf16, fp16, fp32 and each LAYER1_EXTRA; the frozen-head
# forward's and the GRPO token kernel's variants; the divergence head's record sweep, its splits' merge and its backward
# per variant, plus the JSD sweep where 0 < beta < 1; the fused distillation loss's record sweep and g kernel per
# variant, plus its JSD sweep (run in a process of its own: sm_compile refuses the interpreter conftest turns on)
_COUNT_VARIANTS = (
    "import sys; sys.path.insert(0, 'tools'); import sm_compile as s\n"
    "div = sum(3 + (0.0 < kw['beta'] < 1.0) for _, _, kw in s.DIVERGENCE_VARIANTS)\n"
    "div += sum(2 + (0.0 < kw['beta'] < 1.0) for _, _, kw in s.STORED_VARIANTS)\n"
    "base = 5 * (3 + len(s.LAYER1_EXTRA)) + len(s.FROZEN_VARIANTS) + len(s.TOKEN_LOSS_VARIANTS) + div\n"
    "base += len(s.kept_set_launches()) + len(s.kept_rows_launches()) + len(s.tile_selection_launches())\n"
    "print(*(f'{arch}:{base + len(s.tuning_launches(arch)) + len(s.tile_candidate_launches(arch))"
    " + len(s.kept_bits_launches(arch))}' for arch in s.CLASSES))\n"
)


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    if not os.path.exists(PTXAS):
        pytest.skip(f"this triton wheel ships no ptxas ({PTXAS})")
    out = tmp_path_factory.mktemp("sm") / "rows.json"
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONWARNINGS="ignore")
    command = [
        sys.executable,
        os.path.join(HERE, "..", "tools", "sm_compile.py"),
        "--arch",
        *map(str, ARCHS),
        "--json",
        str(out),
    ]
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    assert out.exists(), proc.stdout + proc.stderr
    return json.loads(out.read_text()), proc


@pytest.mark.slow
def test_every_variant_was_compiled(compiled):
    rows, _ = compiled
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONWARNINGS="ignore")
    proc = subprocess.run(
        [sys.executable, "-c", _COUNT_VARIANTS],
        cwd=os.path.join(HERE, ".."),
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    # per arch: the variants of every kernel family, and the forward's tuning candidates (kernels.tuning)
    expected = {int(arch): int(count) for arch, count in (pair.split(":") for pair in proc.stdout.split())}
    for arch in ARCHS:
        assert expected[arch] >= 100  # what the lists held when this test was last read: none may vanish unnoticed
        assert sum(r["arch"] == arch for r in rows) == expected[arch]


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
def test_compiles_fits_shared_memory_and_does_not_spill(compiled, arch):
    rows, proc = compiled
    for r in (r for r in rows if r["arch"] == arch):
        assert r["error"] is None, (r["kernel"], r["error"])
        assert 0 < r["REG"] <= 255, r
        assert r["SHARED"] <= r["smem_limit"], (r["kernel"], r["SHARED"], r["smem_limit"])
        assert r["LOCAL"] == 0 and r["STACK"] == 0, (r["kernel"], "spills", r["LOCAL"], r["STACK"])
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
def test_half_precision_dots_run_on_tensor_cores(compiled, arch):
    # bf16/fp16 logit tiles must use the tensor cores (Hopper's wgmma, else mma.sync); the fp32 path asks for IEEE
    # fp32 products, which only the FMA units give; the GRPO token kernel, the frozen-head forward's tile kernel and
    # the fused distillation loss's sweeps (their GEMMs are cuBLAS's), the merges of records, and the sampler's kept
    # sets and row sweeps (a gathered row is shared by no other token: a multiply and a sum, no dot) have no dot
    rows, _ = compiled
    expected = TENSOR_CORES[arch]
    no_dot = ("token_loss", "fwd frozen", "fwd merge", "div merge", "div stored", "kept ")
    for r in (r for r in rows if r["arch"] == arch):
        if r["kernel"].startswith(no_dot) or " fp32" in r["kernel"]:
            assert r["tensor_cores"] == "none", r["kernel"]
        else:
            assert r["tensor_cores"] == expected, (r["kernel"], r["tensor_cores"])


# one compiled row as sm_compile.compile_all returns it, for main()'s verdicts
_MADE_UP_ROW = (
    "row = dict(arch=90, kernel='k', num_warps=4, num_stages=2, smem_limit=1000, error=None, REG=64, "
    "LOCAL=0, STACK=0, SHARED=10, tensor_cores='none', ctas_per_sm=8, MEMBAR_GPU=0, MEMBAR_CTA=0, "
    "ATOM=0, RED=0)\n"
)


def _verdicts_hold(code):
    """Runs ``code`` (main() on made-up rows, printing 'verdicts ok' at the end) with the real compiler's settings."""
    env = dict(
        os.environ,
        TRITON_INTERPRET="0",
        PYTHONWARNINGS="ignore",
        PYTHONPATH=os.path.join(HERE, "..") + os.pathsep + os.environ.get("PYTHONPATH", ""),
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=os.path.join(HERE, ".."), env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0 and "verdicts ok" in proc.stdout, proc.stdout + proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
def test_no_atomic_costs_a_memory_fence(compiled, arch):
    # an acq_rel atomic (tl.atomic_add's default) compiles to a GPU-scope MEMBAR, a value-returning ATOM and an L1
    # invalidation each (24 per D step in the fused backward on sm_89); a relaxed one whose value is unused to a
    # plain reduction RED. The CTA-scope MEMBARs of Hopper and datacenter Blackwell sit beside the async-proxy fence
    # that hands a shared memory tile to wgmma / tcgen05, not beside the atomics: none may appear where the dots run
    # on mma.sync.
    rows, _ = compiled
    for r in (r for r in rows if r["arch"] == arch):
        assert r["MEMBAR_GPU"] == 0 and r["ATOM"] == 0, (r["kernel"], r["MEMBAR_GPU"], r["ATOM"])
        if TENSOR_CORES[arch] == "mma":
            assert r["MEMBAR_CTA"] == 0, (r["kernel"], r["MEMBAR_CTA"])
        if r["family"].startswith("bwd fused"):
            assert r["RED"] > 0, r["kernel"]  # dH (and dW) are reductions: the SASS was read


@pytest.mark.slow
def test_the_rows_of_the_copy_engine_read_through_it(compiled):
    # bf16 / fp16 where the class's row reads through the copy engine (sm_90's and sm_100's forward, chunked backward,
    # divergence sweeps and g kernel): tensor descriptors (TMA); nothing else does
    rows, _ = compiled
    assert TENSOR_CORES.keys() == set(ARCHS)
    for r in rows:
        described = r["descriptors"] > 0
        half = " fp32" not in r["kernel"]
        table = DESCRIBED_FAMILIES.get(r["family"])
        row_reads_by_descriptor = table is not None and table.rows[tiles.arch_class(r["arch"]).name].use_tma
        assert described == (half and row_reads_by_descriptor), r["kernel"]


# the sampler's record sweeps without gradients beside the plain pass: (variant, bound on their extra SASS
# instructions a logit outside the K loop). The tile candidates' top-four network of min / max a row and tile
# (kernels.forward._tile_candidates) took 8.4 to 13.6 more on Triton 3.9 and 3.6 (sm_90 9.5 and 8.4; the three rounds
# of max, compare, count and select before it 15.8 to 23.3); the replayed sets' bitmaps (each logit's bit of its
# row's word broadcast to its 32 logits, a select, a max and a second exponential: kernels.forward._kept_tile) 17.5
# to 20.1 on Triton 3.9 (sm_90 18.1; a load of each logit's word took 77); the candidates with their columns (the
# pass with gradients: kernels.forward._tile_columns' compares, selects and integer sum) 14.1 to 20.2 (sm_90 17.8)
SAMPLER_SWEEP_BOUNDS = [("fwd candidates bf16", 15), ("fwd kept bits bf16", 32), ("fwd candidates columns bf16", 26)]


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("variant, bound", SAMPLER_SWEEP_BOUNDS, ids=["tile candidates", "kept bits", "columns"])
def test_the_samplers_sweeps_cost_a_bounded_number_of_instructions_a_logit(compiled, arch, variant, bound):
    rows, _ = compiled
    by_name = {r["kernel"]: r for r in rows if r["arch"] == arch}
    plain, sweep = by_name["fwd bf16 no entropy"], by_name[variant]
    assert plain["logits_per_thread"] == sweep["logits_per_thread"] >= 32
    per_logit = [sum(r["instructions"]["outside"].values()) / r["logits_per_thread"] for r in (plain, sweep)]
    assert 20 < per_logit[0] and 0 < per_logit[1] - per_logit[0] < bound, per_logit
    for r in (plain, sweep):  # the K loop found (sm_100 peels its first step's 4 MMAs out of it)
        assert r["instructions"]["loop"].get("mma", 0) >= max(4, r["instructions"]["outside"].get("mma", 0)), r


def test_run_by_hand_it_exits_non_zero_on_spills_or_shared_memory_overflow_and_counts_ctas_per_sm():
    # main()'s verdict on rows as compile_all returns them: a clean row passes, a spill or an overflow fails
    code = (
        "import sys; sys.argv = ['sm_compile']; sys.path.insert(0, 'tools'); import sm_compile as s\n"
        + _MADE_UP_ROW
        + "for change, want in ((dict(), 0), (dict(LOCAL=8), 1), (dict(STACK=16), 1), (dict(SHARED=2000), 1), "
        "(dict(error='E'), 1)):\n"
        "    s.compile_all = lambda archs, jobs=None, only=None: [dict(row, **change)]\n"
        "    assert s.main([]) == want, (change, want)\n"
        "print('verdicts ok')\n"
        # CTAs per SM: 156 registers -> 160 a thread, 3 warps of 8 in each of 4 sub-partitions: one 8-warp CTA on
        # sm_89; 110 -> 112: 4 warps a sub-partition, two; shared memory (100 KiB on sm_89, 1 KiB reserved a CTA),
        # warps (48 on sm_89) and CTAs (32 on sm_90) bound it too
        "for args, want in (((89, 156, 0, 8), 1), ((90, 110, 1024, 8), 2), ((89, 64, 60 * 1024, 4), 1), "
        "((89, 32, 0, 8), 6), ((90, 32, 0, 1), 32), ((80, 64, 40 * 1024, 4), 4)):\n"
        "    assert s.ctas_per_sm(*args) == want, (args, s.ctas_per_sm(*args), want)\n"
        "print('occupancy ok')\n"
    )
    _verdicts_hold(code)


def test_allow_spill_passes_small_spills_only():
    # --allow-spill (.ci/run's older Triton): a spill of at most the allowance is reported and passes, a larger one
    # and a shared-memory overflow still fail
    code = (
        "import sys; sys.path.insert(0, 'tools'); import sm_compile as s\n"
        + _MADE_UP_ROW
        + "for change, want in ((dict(LOCAL=16), 0), (dict(LOCAL=8, STACK=8), 0), (dict(LOCAL=24), 1), "
        "(dict(SHARED=2000), 1)):\n"
        "    s.compile_all = lambda archs, jobs=None, only=None: [dict(row, **change)]\n"
        "    assert s.main(['--allow-spill', '16']) == want, (change, want)\n"
        "print('verdicts ok')\n"
    )
    _verdicts_hold(code)
