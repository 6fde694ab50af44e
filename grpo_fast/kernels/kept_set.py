"""Replayed kept sets: the logits of the K entries a sampler kept for each token, and their gradients, without a
vocabulary sweep (``grpo_fast.sampler_logprobs(kept_ids=...)``).

Math. For token n with kept ids k_1..k_K (-1: no entry) and an operand pair (x [N, E], y [V, E]), the raw logit of
its j-th kept entry is u[n, j] = x[n] . y[k_j]: the head's pair (hidden, weight) and LoRA's (lora_hidden,
lora_weight) each add theirs (``kept_dot``); the bias and the transform are elementwise on [N, K] around it. From
g = dL/du [N, K]: dx[n] = sum_j g[n, j] y[k_j] (``kept_grad_rows``) and dy[k_j] += g[n, j] x[n]
(``kept_grad_table``, fp32 atomics: the order of the adds, and so dy's last bits, vary from run to run).

Work and memory. Each kernel reads, for each kept entry, one row of y (E elements) and the token's x: O(N K E), in
place of the O(N V E) of a vocabulary sweep; the filling (-1) is masked off and read from nowhere, so the cost is
that of the entries kept, whatever K the sets are padded to. Memory-bound (a multiply and an add per element read,
no tensor-core dot: a gathered row is shared by no other token of the tile), fp32 accumulation; the only buffers are
the [N, K] fp32 logits and gradients.
"""

import triton
import triton.language as tl

from grpo_fast.kernels.launch import on_first_argument_device

BLOCK_K = 16
BLOCK_E = 128
NUM_WARPS = 4


@triton.jit
def _kept_ids(ids_ptr, row, slots, in_set, stride_ids):
    """A token's kept ids at ``slots`` as int64, -1 (no entry) past the set's width."""
    return tl.load(ids_ptr + row.to(tl.int64) * stride_ids + slots, mask=in_set, other=-1).to(tl.int64)


@triton.jit
def _kept_dot_kernel(
    x_ptr,
    y_ptr,
    ids_ptr,
    out_ptr,
    K,
    E,
    stride_x,
    stride_y,
    stride_ids,
    stride_out,
    BLOCK_K: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    row = tl.program_id(0)
    slots = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    in_set = slots < K
    ids = _kept_ids(ids_ptr, row, slots, in_set, stride_ids)
    live = ids >= 0
    acc = tl.zeros((BLOCK_K,), dtype=tl.float32)
    for e0 in range(0, E, BLOCK_E):
        cols = e0 + tl.arange(0, BLOCK_E)
        in_cols = cols < E
        x = tl.load(x_ptr + row.to(tl.int64) * stride_x + cols, mask=in_cols, other=0.0).to(tl.float32)
        y = tl.load(
            y_ptr + ids[:, None] * stride_y + cols[None, :], mask=live[:, None] & in_cols[None, :], other=0.0
        ).to(tl.float32)
        acc += tl.sum(y * x[None, :], axis=1)
    out = out_ptr + row.to(tl.int64) * stride_out + slots
    acc += tl.load(out, mask=in_set, other=0.0)
    tl.store(out, acc, mask=in_set)


@triton.jit
def _kept_grad_rows_kernel(
    g_ptr,
    y_ptr,
    ids_ptr,
    out_ptr,
    K,
    E,
    stride_g,
    stride_y,
    stride_ids,
    stride_out,
    BLOCK_K: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
    in_cols = cols < E
    acc = tl.zeros((BLOCK_E,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        slots = k0 + tl.arange(0, BLOCK_K)
        in_set = slots < K
        ids = _kept_ids(ids_ptr, row, slots, in_set, stride_ids)
        live = ids >= 0
        g = tl.load(g_ptr + row.to(tl.int64) * stride_g + slots, mask=live, other=0.0)
        y = tl.load(
            y_ptr + ids[:, None] * stride_y + cols[None, :], mask=live[:, None] & in_cols[None, :], other=0.0
        ).to(tl.float32)
        acc += tl.sum(y * g[:, None], axis=0)
    out = out_ptr + row.to(tl.int64) * stride_out + cols
    tl.store(out, tl.load(out, mask=in_cols, other=0.0) + acc, mask=in_cols)


@triton.jit
def _kept_grad_table_kernel(
    g_ptr,
    x_ptr,
    ids_ptr,
    out_ptr,
    K,
    E,
    stride_g,
    stride_x,
    stride_ids,
    stride_out,
    BLOCK_K: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    row = tl.program_id(0)
    slots = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    in_set = slots < K
    ids = _kept_ids(ids_ptr, row, slots, in_set, stride_ids)
    g = tl.load(g_ptr + row.to(tl.int64) * stride_g + slots, mask=in_set, other=0.0)
    live = (ids >= 0) & (g != 0.0)
    for e0 in range(0, E, BLOCK_E):
        cols = e0 + tl.arange(0, BLOCK_E)
        in_cols = cols < E
        x = tl.load(x_ptr + row.to(tl.int64) * stride_x + cols, mask=in_cols, other=0.0).to(tl.float32)
        # relaxed: the adds need no ordering (an acq_rel atomic costs a GPU-scope fence and a value return each)
        tl.atomic_add(
            out_ptr + ids[:, None] * stride_out + cols[None, :],
            g[:, None] * x[None, :],
            mask=live[:, None] & in_cols[None, :],
            sem="relaxed",
        )


def _launch(kernel, grid, a, b, ids, out, E):
    """One kernel of the family on (a, b, ids, out): the three share their arguments' order and meaning (a: the
    per-token operand, b: the per-vocabulary one, E: the width of their rows)."""
    if ids.shape[0] and ids.shape[1]:
        strides = (a.stride(0), b.stride(0), ids.stride(0), out.stride(0))
        kernel[grid](a, b, ids, out, ids.shape[1], E, *strides, BLOCK_K=BLOCK_K, BLOCK_E=BLOCK_E, num_warps=NUM_WARPS)
    return out


def _slots(ids):
    """The grid over each token's kept slots, BLOCK_K a program."""
    return (ids.shape[0], triton.cdiv(ids.shape[1], BLOCK_K))


@on_first_argument_device
def kept_dot(x, y, ids, out):
    """out [N, K] fp32 += x[n] . y[ids[n, j]] (x [N, E], y [V, E] rows contiguous; ids [N, K] int64, -1 off)."""
    return _launch(_kept_dot_kernel, _slots(ids), x, y, ids, out, x.shape[1])


@on_first_argument_device
def kept_grad_rows(g, y, ids, out):
    """out [N, E] fp32 += sum_j g[n, j] y[ids[n, j]] (g [N, K] fp32)."""
    grid = (ids.shape[0], triton.cdiv(y.shape[1], BLOCK_E))
    return _launch(_kept_grad_rows_kernel, grid, g, y, ids, out, y.shape[1])


@on_first_argument_device
def kept_grad_table(g, x, ids, out):
    """out [V, E] fp32, out[ids[n, j]] += g[n, j] x[n] (fp32 atomics; g [N, K] fp32, x [N, E])."""
    return _launch(_kept_grad_table_kernel, _slots(ids), g, x, ids, out, x.shape[1])
