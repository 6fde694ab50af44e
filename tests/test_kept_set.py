"""The replayed kept sets' kernels (``grpo_fast.kernels.kept_set``): ``kept_grad_table``, the sorted segmented sum
of dW, against an fp64 ``index_add_`` of every pair's g x: ids that repeat in runs longer than a block and a span
(the block's partial sums read back, the span's ends added with atomics), one id for every pair, all distinct, -1
filling and g == 0 pairs (dropped), K = 1, N = 1, empty, fp32 / bf16 / fp16 x, strided operands, several sorts;
each id's row to its own precision beside rows of 10^6 times its size. And the interpreter's scan
(``launch.scan_by_position``) against Triton's own."""

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from grpo_fast.kernels import kept_set, launch

F32_EPS = torch.finfo(torch.float32).eps


def _spec(g, x, ids, out):
    """out + sum over the pairs (n, j) with ids[n, j] = v >= 0 and g[n, j] != 0 of g[n, j] x[n], in fp64 (a pair of
    g = 0 adds nothing, whatever x[n]: not 0 x inf)."""
    table = out.double().clone()
    valid = ((ids >= 0) & (g != 0))[:, :, None]
    terms = torch.where(valid, g.double()[:, :, None] * x.double()[:, None, :], 0.0)
    return table.index_add_(0, ids.clamp(min=0).reshape(-1), terms.reshape(-1, x.shape[1]))


def _bound(g, x, ids, out):
    """Each entry's fp32 error bound: its terms' count (and the table's own value) times eps times their absolute
    sum, the worst case of a sum in any order."""
    count = torch.zeros(out.shape[0], dtype=torch.float64).index_add_(
        0, ids.clamp(min=0).reshape(-1), (ids >= 0).reshape(-1).double()
    )
    magnitude = _spec(g.abs(), x.abs(), ids, out.abs())
    return 2 * (count[:, None] + 2) * F32_EPS * magnitude


def _check(g, x, ids, V, device, out=None):
    g, x, ids = g.to(device), x.to(device), ids.to(device)
    out = torch.randn(V, x.shape[1]) if out is None else out
    expected, bound = _spec(g.cpu(), x.cpu(), ids.cpu(), out), _bound(g.cpu(), x.cpu(), ids.cpu(), out)
    table = kept_set.kept_grad_table(g, x, ids, out.to(device)).cpu()
    assert table.dtype == torch.float32
    error = (table.double() - expected).abs()
    worst = (error - bound).argmax()
    assert (error <= bound).all(), (error.flatten()[worst].item(), bound.flatten()[worst].item())
    return table, expected


def _inputs(N, K, E, ids, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(N, K, generator=gen), torch.randn(N, E, generator=gen).to(dtype), ids


@pytest.fixture(params=["default", "short spans"])
def layout(request, monkeypatch):
    """The launch's blocks as configured, or 8 rows a block and 3 blocks a span whatever the pairs' count (runs over
    blocks within a span, read back, and over spans, added with atomics, at small sizes)."""
    if request.param == "short spans":
        monkeypatch.setattr(kept_set, "SORTED_BLOCK_M", 8)
        monkeypatch.setattr(kept_set, "INTERPRETER_SORTED_BLOCK_M", 8)
        monkeypatch.setattr(kept_set, "SORTED_BLOCKS", 3)
        monkeypatch.setattr(kept_set, "SORTED_PROGRAMS", 1)
    return request.param


def _ids(kind, N, K, V, seed=0):
    gen = torch.Generator().manual_seed(seed)
    if kind == "few ids":  # runs of ~N K / 3 pairs: over many blocks and spans
        return torch.randint(0, 3, (N, K), generator=gen)
    if kind == "one id":
        return torch.full((N, K), V - 1)
    if kind == "distinct":
        return torch.randperm(V, generator=gen)[: N * K].reshape(N, K)
    if kind == "filled":  # -1 filling: at random, a whole token's set, and the sets' tails
        ids = torch.randint(0, V, (N, K), generator=gen)
        ids[torch.rand(N, K, generator=gen) < 0.3] = -1
        ids[1] = -1
        ids[:, K - 2 :] = -1
        return ids
    raise ValueError(kind)


@pytest.mark.parametrize("kind", ["few ids", "one id", "distinct", "filled"])
def test_equals_the_fp64_sum(kind, layout, device):
    N, K, E, V = 24, 7, 9, 200
    g, x, ids = _inputs(N, K, E, _ids(kind, N, K, V))
    table, expected = _check(g, x, ids, V, device)
    touched = torch.zeros(V, dtype=torch.bool)
    touched[ids[ids >= 0]] = True
    assert (table[~touched] == expected[~touched].float()).all()  # rows of no pair: untouched, bit for bit


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_half_precision_rows_are_added_exactly_as_given(dtype, device):
    # x's values upcast, fp32 products and sums: the bound is fp32's whatever x's dtype; E past one column block
    N, K, E, V = 16, 5, 150, 11
    g, x, ids = _inputs(N, K, E, torch.randint(0, V, (N, K), generator=torch.Generator().manual_seed(1)), dtype)
    _check(g, x, ids, V, device)


def test_dropped_pairs_add_nothing_even_at_a_non_finite_token(device):
    # g == 0 and -1 pairs are dropped before the sum: an inf in x at a token whose pairs all have g == 0 adds no NaN
    N, K, E, V = 12, 6, 5, 9
    g, x, ids = _inputs(N, K, E, torch.randint(0, V, (N, K), generator=torch.Generator().manual_seed(2)))
    g[torch.rand(N, K, generator=torch.Generator().manual_seed(3)) < 0.3] = 0.0
    g[4], x[4] = 0.0, float("inf")
    ids[7] = -1
    table, _ = _check(g, x, ids, V, device)
    assert torch.isfinite(table).all()


@pytest.mark.parametrize("shape", [(1, 1), (1, 9), (17, 1)], ids=str)
def test_single_tokens_and_single_slots(shape, layout, device):
    (N, K), E, V = shape, 6, 5
    g, x, ids = _inputs(N, K, E, torch.randint(0, V, (N, K), generator=torch.Generator().manual_seed(4)))
    _check(g, x, ids, V, device)


@pytest.mark.parametrize("shape", [(0, 4, 3), (3, 0, 3), (3, 4, 0)], ids=str)
def test_empty_sets_leave_the_table(shape, device):
    N, K, E = shape
    g, x, ids = torch.randn(N, K), torch.randn(N, E), torch.zeros(N, K, dtype=torch.int64)
    out = torch.randn(5, E)
    assert torch.equal(kept_set.kept_grad_table(g.to(device), x.to(device), ids.to(device), out.to(device)).cpu(), out)


def test_strided_operands_and_several_sorts(monkeypatch, device):
    # x rows at a stride not a multiple of 4 (the kernel's unaligned path), g rows of a wider tensor, and 5 tokens a
    # sort: the sorts' runs of one id add to the same rows
    monkeypatch.setattr(kept_set, "PAIRS_PER_SORT", 5 * 6)
    N, K, E, V = 23, 6, 7, 4
    gen = torch.Generator().manual_seed(5)
    g = torch.randn(N, K + 3, generator=gen)[:, :K]
    x = torch.randn(N, E + 2, generator=gen)[:, :E]
    ids = torch.randint(-1, V, (N, K), generator=gen)
    assert x.stride(0) % 4 != 0 and g.stride(0) != K
    _check(g, x, ids, V, device)


def test_each_row_to_its_own_precision(layout, device):
    # a small id's row summed beside a large one's in the same blocks keeps its own relative precision: no sum is
    # formed across ids (a prefix sum over the block, differenced at the runs, would leave it eps x the large row)
    N, K, E, V = 40, 4, 8, 2
    gen = torch.Generator().manual_seed(6)
    ids = torch.randint(0, V, (N, K), generator=gen)
    g = torch.where(ids == 0, 1e3, 1e-3) * torch.rand(N, K, generator=gen).add(0.5)
    x = torch.rand(N, E, generator=gen).add(0.5)  # positive terms: each row's sum is as large as its terms
    table, expected = _check(g, x, ids, V, device, out=torch.zeros(V, E))
    relative = ((table.double() - expected).abs() / expected.abs()).amax(dim=1)
    assert (relative <= 8 * F32_EPS * N * K).all(), relative


@triton.jit
def _scan_kernel(v_ptr, s_ptr, out_ptr, AXIS: tl.constexpr, R: tl.constexpr, C: tl.constexpr):
    offsets = tl.arange(0, R)[:, None] * C + tl.arange(0, C)[None, :]
    values, starts = tl.load(v_ptr + offsets), tl.load(s_ptr + offsets) != 0
    sums, _ = tl.associative_scan((values, starts), AXIS, kept_set._segmented_add)
    tl.store(out_ptr + offsets, sums)


@pytest.mark.skipif(not launch.interpreting(), reason="the interpreter's scan")
@pytest.mark.parametrize("axis", [0, 1])
def test_the_interpreters_scan_by_position_is_tritons(axis, monkeypatch):
    from triton.runtime import interpreter

    values = torch.randn(8, 16)
    starts = (torch.rand(8, 16) < 0.3).int()
    ours = torch.empty(8, 16)
    _scan_kernel[(1,)](values, starts, ours, axis, 8, 16)
    monkeypatch.setattr(interpreter.ScanOps, "generic_scan", launch.TRITON_GENERIC_SCAN)
    theirs = torch.empty(8, 16)
    _scan_kernel[(1,)](values, starts, theirs, axis, 8, 16)
    assert torch.equal(ours, theirs)
    # and the segmented sum it is: along the axis, restarting at each start
    expected = np.zeros((8, 16), dtype=np.float32)
    v, s = np.moveaxis(values.numpy(), axis, 0), np.moveaxis(starts.numpy(), axis, 0)
    acc = np.zeros(v.shape[1], dtype=np.float32)
    for i in range(v.shape[0]):
        acc = v[i] + np.where((s[i] != 0) | (i == 0), np.float32(0), acc)
        np.moveaxis(expected, axis, 0)[i] = acc
    assert np.array_equal(ours.numpy(), expected)


def _dot_rows_spec(x, y, bias, ids, weights, transform):
    """``kept_dot_rows``' outputs in fp64 from the fp32 values of its operands."""
    x, y, weights = x.double(), y.double(), weights.double()
    live = ids >= 0
    rows = y[ids.clamp(min=0)]
    u = (x[:, None, :] * rows).sum(-1) + (bias.double()[ids.clamp(min=0)] if bias is not None else 0.0)
    z, slope = transform.apply(u, slope=True)
    slope = torch.broadcast_to(torch.as_tensor(slope, dtype=torch.float64), u.shape)
    z = z.masked_fill(~live, -float("inf"))
    pivot = z.amax(-1)
    pivot = torch.where(pivot == -float("inf"), 0.0, pivot)
    e = torch.where(live, torch.exp(z - pivot[:, None]) * slope, 0.0)
    t = torch.where(live, weights * slope, 0.0)
    return z, slope, pivot, (e[:, :, None] * rows).sum(1), (t[:, :, None] * rows).sum(1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("softcap", [None, 3.0])
@pytest.mark.parametrize("kernels", ["triton", "twin"])
def test_kept_dot_rows_read_each_row_once_for_logits_and_both_sums(dtype, softcap, kernels, device):
    """``kept_dot_rows`` (one read of the kept rows for the logits, the softmax-weighted and the given-weighted sums
    of the rows: a served teacher's student side at beta 0) and the torch twin's ``kept_logits_and_rows`` against
    fp64: K over three steps of rows (the running max rescaling P), E not a power of two, -1 filling, a token
    without entries, a bias, a soft-cap; the sums to fp32 accuracy relative to their rows' scale."""
    from grpo_fast.backends import support_twin
    from grpo_fast.head.transform import LogitTransform
    from grpo_fast.kernels.operands import HeadOperands

    gen = torch.Generator().manual_seed(3)
    E, V = kept_set.BLOCK_E + 21, 97
    N, K = 5, 2 * kept_set.dot_rows_block(E) + 5  # three steps of rows, the last partial
    x = torch.randn(N, E, generator=gen).to(dtype)
    y = (torch.randn(V, E, generator=gen) * 0.3).to(dtype)
    bias = torch.randn(V, generator=gen).to(dtype)
    ids = torch.randint(0, V, (N, K), generator=gen)
    ids[1, 9:] = -1
    ids[3] = -1
    ids[4, :3] = -1  # filling before entries: the running max starts at a later block's
    weights = torch.randn(N, K, generator=gen)
    transform = LogitTransform(0.7, softcap, 1.3)
    expected = _dot_rows_spec(x, y, bias, ids, weights, transform)
    x, y, bias, ids, weights = (t.to(device) for t in (x, y, bias, ids, weights))
    if kernels == "triton":
        got = kept_set.kept_dot_rows(x, y, bias, ids, weights, transform)
    else:
        head = HeadOperands(x, y, ids[:, 0].clamp(min=0), bias, transform, None)
        got = support_twin.kept_logits_and_rows(head, ids, weights)
    z, slope, pivot, P, T = (t.cpu().double() for t in got)
    live = ids.cpu() >= 0
    scale = float(expected[0][live].abs().max())
    assert (z[~live] == -float("inf")).all() and (expected[0][~live] == -float("inf")).all()
    assert (z[live] - expected[0][live]).abs().max() <= 1e-5 * scale
    assert (slope[live] - expected[1][live]).abs().max() <= 1e-5 * float(expected[1][live].abs().max())
    assert (pivot - expected[2]).abs().max() <= 1e-5 * scale
    assert pivot[3] == 0.0 and (P[3] == 0).all() and (T[3] == 0).all()  # no entries: no mass
    for got_sum, want in ((P, expected[3]), (T, expected[4])):
        magnitude = float(want.abs().max())
        assert magnitude > 0.1
        assert (got_sum - want).abs().max() <= 1e-5 * magnitude
