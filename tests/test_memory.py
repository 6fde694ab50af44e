"""No tensor of size tokens x vocab is ever built, forward or backward, by either backend, and padding costs nothing.

Three checks: (1) every tensor that any torch op creates during loss + backward is recorded through a
TorchDispatchMode, and the largest must stay far below N x V elements (the reference, as a control, crosses
it); (2) in a fresh process the torch backend's peak resident memory stays far below what fp32 logits of
the same shape would take; (3) the matmul FLOPs of a padded batch (counted by torch's FlopCounterMode on the
torch backend) scale with its completion tokens, not with B x T.
"""

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from helpers import matmul_flops
from torch.utils._python_dispatch import TorchDispatchMode

import grpo_fast
from grpo_fast import reference


class LargestTensor(TorchDispatchMode):
    """Records the largest tensor (in bytes) that any torch op returns while active."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel() * t.element_size())
        return out


def _largest_tensor_of(fn, N, D, V):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(1, N, D, generator=g, requires_grad=True)
    weight = torch.randn(V, D, generator=g).mul_(0.1).requires_grad_()
    targets = torch.randint(0, V, (1, N), generator=g)
    old = torch.randn(1, N, generator=g) - 5
    with LargestTensor() as probe:
        loss, _ = fn(
            hidden, weight, targets, torch.ones(1), torch.ones(1, N), old_logprobs=old, ref_logprobs=old, beta=0.04
        )
        loss.backward()
    return probe.largest


@pytest.mark.slow
@pytest.mark.parametrize("backend", [pytest.param("triton", marks=pytest.mark.interpreter_only), "torch"])
def test_no_tokens_by_vocab_tensor_is_created(backend):
    # N x V = 330k elements; the weight and its gradient are V x D = 16k; a block of token rows (gemm.TOKEN_GEMM_ROWS,
    # 64 on a CPU) of the logits is 66k, a fixed size: N is large enough to tell it from N x V
    N, D, V = 320, 16, 1031
    if backend == "torch":  # a vocab of several chunks and token chunks smaller than N
        N, V = 2100, 20011
    fused = _largest_tensor_of(lambda *a, **k: grpo_fast.loss(*a, backend=backend, **k), N, D, V)
    eager = _largest_tensor_of(reference.loss, N, D, V)
    logits_bytes = N * V * 4
    assert eager >= logits_bytes  # the probe sees the reference's fp32 logits
    # at most an fp32 weight gradient or one torch-backend tile (1024 x 8192 fp32), never N x V
    assert fused <= max(V * D * 4, 1024 * 8192 * 4)
    assert fused < logits_bytes / 4


SCRIPT = textwrap.dedent("""
    import resource, torch, grpo_fast
    N, D, V = 4096, 32, 131072
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(1, N, D, generator=g, requires_grad=True)
    weight = (torch.randn(V, D, generator=g) * 0.1).requires_grad_()
    targets = torch.randint(0, V, (1, N), generator=g)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    loss, _ = grpo_fast.loss(hidden, weight, targets, torch.ones(1), torch.ones(1, N), backend="torch")
    loss.backward()
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print((after - before) * 1024)
""")


@pytest.mark.slow
def test_process_peak_memory_stays_far_below_full_logits():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        cwd=os.path.dirname(__file__),
    )
    assert out.returncode == 0, out.stderr
    grown = int(out.stdout.strip().splitlines()[-1])
    full_logits = 4096 * 131072 * 4  # 2 GiB of fp32 logits, which eager PyTorch builds several times
    assert grown < full_logits / 4, f"peak RSS grew by {grown / 2**20:.0f} MiB"


def test_padded_batch_costs_only_its_completion_tokens():
    # 8 completions padded to 64 tokens, 16 real tokens each: 25% fill. Loss + backward and the no-grad log-probs
    # must do about a quarter of the dense batch's matmul work (only rows with mask 1 enter the kernels)
    B, T, D, V = 8, 64, 32, 3001
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(B, T, D, generator=g, requires_grad=True)
    weight = (torch.randn(V, D, generator=g) * 0.1).requires_grad_()
    targets = torch.randint(0, V, (B, T), generator=g)
    advantages = torch.randn(B, generator=g)
    dense = torch.ones(B, T, dtype=torch.bool)
    padded = torch.zeros(B, T, dtype=torch.bool)
    padded[:, :16] = True
    targets_padded = targets.masked_fill(~padded, -100)  # padding ids are never read

    def fwd_bwd(mask, y):
        return lambda: grpo_fast.loss(hidden, weight, y, advantages, mask, backend="torch")[0].backward()

    def logprobs(mask, y):
        return lambda: grpo_fast.logprobs(hidden, weight, y, completion_mask=mask, backend="torch")

    for make in (fwd_bwd, logprobs):
        dense_flops = matmul_flops(make(dense, targets))
        padded_flops = matmul_flops(make(padded, targets_padded))
        assert dense_flops > 0
        assert 0.24 <= padded_flops / dense_flops <= 0.26, (make.__name__, padded_flops / dense_flops)
