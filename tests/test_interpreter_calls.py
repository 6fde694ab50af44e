"""tests/interpreter_calls.py's reduction by position is the interpreter's own, bitwise: a combine of several values
(the tile candidates' top-four merge, ``tl.topk``'s xor network), along either axis, with and without kept dims."""

import pytest
import torch
import triton
import triton.language as tl
from interpreter_calls import TRITON_GENERIC_REDUCE

from grpo_fast.kernels import forward, launch


@triton.jit
def _reduce_kernel(z_ptr, out_ptr, top_ptr, AXIS: tl.constexpr, R: tl.constexpr, C: tl.constexpr, W: tl.constexpr):
    offsets = tl.arange(0, R)[:, None] * C + tl.arange(0, C)[None, :]
    z = tl.load(z_ptr + offsets)
    none = tl.full(z.shape, float("-inf"), tl.float32)
    a, b, c, d = tl.reduce((z, none, none, none), AXIS, forward._top_four, keep_dims=True)
    both = tl.join(tl.join(a, c), tl.join(b, d))  # [R or 1, C or 1, 2, 2]: W (R or C) quadruples a, b, c, d
    tl.store(out_ptr + tl.arange(0, W * 4), tl.reshape(both, (W * 4,)))
    tl.store(top_ptr + tl.arange(0, R)[:, None] * 4 + tl.arange(0, 4)[None, :], tl.topk(z, 4, dim=1))


@pytest.mark.skipif(TRITON_GENERIC_REDUCE is None or not launch.interpreting(), reason="the interpreter's reduction")
@pytest.mark.parametrize("axis", [0, 1])
def test_reduce_by_position_is_the_interpreters(axis, monkeypatch):
    from triton.runtime import interpreter

    z = torch.randn(8, 16)
    z[2, 3:9] = z[2, 1]  # ties, repeated in the candidates
    z[5] = -float("inf")
    width = 8 if axis == 1 else 16
    ours = torch.empty(width * 4), torch.empty(8, 4)
    _reduce_kernel[(1,)](z, *ours, axis, 8, 16, width)
    monkeypatch.setattr(interpreter.ReduceOps, "generic_reduce", TRITON_GENERIC_REDUCE)
    theirs = torch.empty(width * 4), torch.empty(8, 4)
    _reduce_kernel[(1,)](z, *theirs, axis, 8, 16, width)
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs))
    # and the values they are: each row's (column's) 4 largest, descending, ties repeated; each row's top 4
    expected = z.topk(4, dim=axis).values.movedim(axis, -1).reshape(-1)
    assert torch.equal(ours[0], expected)
    assert torch.equal(ours[1], z.topk(4, dim=1).values)
