"""Launches on any GPU of the machine, the forward's launches sized to their buffer, and the divergence head's
vocabulary split sized to whole waves.

No GPU here: the Triton kernels and the cuBLAS GEMM helper are replaced by recorders that note the device made
current (by torch.cuda.device, or by launch.on_device, each replaced by a recorder) at each call. Fake CUDA tensors
(torch's FakeTensorMode gives tensors on cuda:1 on a CPU-only torch: shapes and devices, no data) run the forward's
host code; the other wrappers index tensors, which a CPU-only torch refuses for fake CUDA tensors, so they run on
CPU tensors with the device guard recorded.
"""

import contextlib

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import grpo_fast
from grpo_fast.grpo_loss.options import LossOptions
from grpo_fast.head.transform import LogitTransform
from grpo_fast.kernels import backward, divergence_sweep, forward, forward_frozen, launch, tiles, token_loss
from grpo_fast.kernels import config as kconfig
from grpo_fast.kernels.operands import HeadGrads, HeadOperands, TokenLossInputs
from grpo_fast.kernels.softmax_stats import BackwardStats

# every Triton kernel and the cuBLAS helper, by the module that calls it
CALLS = (
    (forward, "_tile_records_kernel"),
    (forward, "_merge_parts_kernel"),
    (backward, "_backward_kernel"),
    (backward, "mm_fp32"),
    (backward, "mm_token_rows"),
    (forward_frozen, "_frozen_chunk_kernel"),
    (forward_frozen, "mm_token_rows"),
    (token_loss, "_token_loss_kernel"),
)


class _Launches:
    """The current device (as the recorded guard sets it) at each recorded call, by name."""

    def __init__(self):
        self.current, self.seen = [], []

    @contextlib.contextmanager
    def guard(self, device):
        self.current.append(torch.device(device))
        try:
            yield
        finally:
            self.current.pop()

    def recorder(self, name):
        def record(*args, **kwargs):
            self.seen.append((name, self.current[-1] if self.current else None))

        class Kernel:  # kernel[grid](...) records too
            def __getitem__(self, grid):
                return record

            def __call__(self, *args, **kwargs):
                record()

        return Kernel()


@pytest.fixture
def launches(monkeypatch):
    calls = _Launches()
    for module, name in CALLS:
        monkeypatch.setattr(module, name, calls.recorder(f"{module.__name__.rsplit('.', 1)[1]}.{name}"))
    return calls


def _inputs(device, N=6, D=32, V=96):
    hidden, weight = torch.zeros(N, D, device=device), torch.zeros(V, D, device=device)
    return hidden, weight, torch.zeros(N, dtype=torch.long, device=device), LogitTransform()


def _forward(device):
    hidden, weight, targets, transform = _inputs(device)
    head = HeadOperands(hidden, weight, targets, None, transform)
    forward.forward_record(head, True, kconfig.gpu_record_config(torch.float32, 90))


def _every_other_wrapper(device):
    hidden, weight, targets, transform = _inputs(device)
    head = HeadOperands(hidden, weight, targets, None, transform)
    per_token = torch.zeros(hidden.shape[0], device=device)
    stats = BackwardStats(per_token, per_token, per_token, per_token)
    for mode, run in (("chunked", backward.backward_chunked), ("fused", backward.backward_fused)):
        grads = HeadGrads(torch.zeros_like(hidden), torch.zeros_like(weight))
        run(head, stats, per_token, per_token, grads, kconfig.gpu_backward_config(torch.float32, mode, 90))
    forward_frozen.forward_frozen_record(head, True, kconfig.gpu_frozen_head_config())
    logp = torch.zeros(2, 3, device=device)
    token_loss.token_loss(
        TokenLossInputs(logp, torch.zeros(2, device=device), logp, logp, logp, None, None, logp),
        LossOptions(loss_type="grpo", beta=0.04),
        scale=1.0,
        entropy_threshold=None,
    )


def test_a_cuda_tensor_makes_its_device_current_and_a_cpu_tensor_none(monkeypatch):
    calls = _Launches()
    monkeypatch.setattr(torch.cuda, "device", calls.guard)
    with FakeTensorMode():
        with launch.on_device(torch.zeros(1, device="cuda:1")):
            assert calls.current == [torch.device("cuda:1")]
    assert isinstance(launch.on_device(torch.zeros(1)), contextlib.nullcontext)


def test_the_forward_launches_on_its_tensors_cuda_device(launches, monkeypatch):
    # tensors on cuda:1 (fake): the forward's Triton launch runs with cuda:1 current
    monkeypatch.setattr(torch.cuda, "device", launches.guard)
    with FakeTensorMode():
        _forward(torch.device("cuda:1"))
    assert launches.seen == [
        ("forward._tile_records_kernel", torch.device("cuda:1")),
        ("forward._merge_parts_kernel", torch.device("cuda:1")),
    ]


def test_every_launch_and_gemm_runs_under_its_wrappers_device_guard(launches, monkeypatch):
    # launch.on_device recorded: each wrapper's Triton launches and cuBLAS GEMMs run inside the guard of its
    # first tensor's device (here the CPU: on_device is then a null context, but the guard is entered)
    monkeypatch.setattr(launch, "on_device", lambda tensor: launches.guard(tensor.device))
    _forward(torch.device("cpu"))
    _every_other_wrapper(torch.device("cpu"))
    assert {name for name, _ in launches.seen} == {f"{m.__name__.rsplit('.', 1)[1]}.{n}" for m, n in CALLS}
    assert [(name, device) for name, device in launches.seen if device != torch.device("cpu")] == []


def test_tensors_on_two_cuda_devices_are_a_named_error():
    with FakeTensorMode():
        hidden, weight = torch.zeros(1, 2, 8, device="cuda:0"), torch.zeros(16, 8, device="cuda:1")
        targets = torch.zeros(1, 2, dtype=torch.long, device="cuda:0")
        for fn in (grpo_fast.logprobs, grpo_fast.logprobs_and_entropy):
            with pytest.raises(ValueError, match="weight is on cuda:1 but hidden is on cuda:0"):
                fn(hidden, weight, targets)
        logp = torch.zeros(1, 2, device="cuda:1")
        with pytest.raises(ValueError, match="advantages is on cuda:0 but logprobs is on cuda:1"):
            grpo_fast.token_loss(logp, torch.zeros(1, device="cuda:0"), torch.ones(1, 2, device="cuda:1"))


@pytest.mark.parametrize("compute_entropy", [True, False])
def test_the_forward_takes_rows_in_launches_whose_partials_fit_their_budget(compute_entropy):
    cfg = kconfig.gpu_record_config(torch.bfloat16, 90)
    V = 151936  # Qwen2.5's head: 594 patches of 256 columns (1187 of 128)
    patches = -(-V // (cfg.block_v * cfg.tiles))
    fields = 3 if compute_entropy else 2
    assert forward.parts_shape(65536, V, compute_entropy, cfg)[:2] == (fields, patches)
    rows = forward.parts_shape(65536, V, compute_entropy, cfg)[2]
    assert rows % cfg.block_n == 0
    assert fields * patches * rows * 4 <= forward.PARTS_BYTES < fields * patches * (rows + cfg.block_n) * 4
    assert forward.parts_shape(100, V, compute_entropy, cfg)[2] == 100  # fewer rows: one launch
    # a vocabulary too wide for one block of rows within the budget: one block a launch, never none
    assert forward.parts_shape(1000, 2**27, compute_entropy, cfg)[2] == cfg.block_n


def test_the_gpu_forward_tiles_follow_the_architecture():
    classes = ((90, "sm90"), (100, "sm100"), (80, "sm80"), (86, "sm89"), (89, "sm89"), (75, "sm80"), (120, "sm120"))
    for arch, expected in classes:
        cfg = kconfig.gpu_record_config(torch.bfloat16, arch)
        table = tiles.RECORD.rows[expected].fields()
        if not kconfig.COLUMNS_256:  # a compiler that spills the 256-column tile: 128 columns
            table["block_v"] = min(table["block_v"], 128)
        assert {k: getattr(cfg, k) for k in table} == table, arch
        # a soft-cap or LoRA: at most 128 columns, everywhere
        assert kconfig.gpu_record_config(torch.bfloat16, arch, wide_epilogue=True).block_v <= 128
    assert kconfig.gpu_record_config(torch.float32, 90).use_tma is False  # IEEE fp32 dots run on the FMA units


def _fill(N, V, cfg):
    """(splits, the share of the GPU's program slots the launch's waves fill)."""
    splits, _ = divergence_sweep.num_vocab_splits(N, V, cfg)
    programs = -(-N // cfg.block_n) * splits
    return splits, programs / (-(-programs // cfg.target_programs) * cfg.target_programs)


def test_the_divergence_split_fills_whole_waves():
    # the divergence head's record sweep, 64 x 128 tiles, one CTA per SM on an H100
    cfg = kconfig.ForwardConfig(
        block_n=64, block_v=128, block_d=64, num_warps=8, num_stages=3, dot_fp32=False, target_programs=132
    )
    V = 151936  # Qwen2.5's head: 1187 tiles of 128
    # 100 token blocks: unsplit, 24 % of the wave idles; 9 splits are 7 waves 97 % full
    assert _fill(6400, V, cfg) == (9, 900 / 924)
    # one token block: one split per program slot; a whole wave of token blocks is not split
    assert _fill(1, V, cfg) == (132, 1.0)
    assert _fill(64 * 132, V, cfg) == (1, 1.0)
    # every token count up to 10 waves of token blocks: the waves are at least 90 % full (with 2 x SMs programs as
    # the split's target, as before, 53 token blocks took 2 x 53 programs: 132 slots 67 % full)
    fills = [_fill(64 * n_blocks, V, cfg)[1] for n_blocks in range(1, 10 * 132)]
    assert min(fills) >= 0.9, min(fills)
