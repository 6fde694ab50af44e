"""Replayed kept sets: the logits of the K entries a sampler kept for each token, and their gradients, without a
vocabulary sweep (``grpo_fast.sampler_logprobs(kept_ids=...)``; a served teacher's top-k, ``grpo_fast.served``).

Math. For token n with kept ids k_1..k_K (-1: no entry) and an operand pair (x [N, E], y [V, E]), the raw logit of
its j-th kept entry is u[n, j] = x[n] . y[k_j]: the head's pair (hidden, weight) and LoRA's (lora_hidden,
lora_weight) each add theirs (``kept_dot``); the bias and the transform are elementwise on [N, K] around it. From
g = dL/du [N, K]: dx[n] = sum_j g[n, j] y[k_j] (``kept_grad_rows``) and dy[v] += sum_{(n, j): k_j = v} g[n, j] x[n]
(``kept_grad_table``). ``kept_dot_rows`` (a served teacher's student side at beta 0) reads a token's kept rows once for
its logits z (bias and transform inside) and two sums of the same rows, P = sum_j exp(z_j - max z) dz_j/du_j y[k_j]
(rescaled to the running max, an online softmax's sum) and T = sum_j w_j dz_j/du_j y[k_j] for given weights w: dx of
any g = w + c exp(z - max z), a row's scalar c known only once z is, as T + c P.

``kept_grad_table`` sorts the M = N K (token, slot) pairs by id (``sorted_pairs``: torch.sort of int32 keys on the
device, stable; -1 and g = 0 pairs get key -1 and sort first, where a program skips them), so each id's pairs form one
run. A program takes a span of sorted pairs, SORTED_BLOCK_M rows at a time, all of E in SORTED_BLOCK_E columns: it
gathers the rows' x[n] (x's rows are the token rows: H, which an H200's L2 holds at 4096 x 1536 bf16), forms g x[n] in
fp32 and sums each run with a segmented scan along the rows (``_segmented_add``: a thread holds every row of its
columns, so the scan is a select and an FMA an element, no shuffle), then adds each run's sum to dy[v] once: at the
run's last row, or at the block's last row for a run that goes on (the next block's part is added to it, read back by
the same thread). A run held by no other program is read, added and stored (the adds in the sorted order:
deterministic); the runs that hold the span's first or last id may continue in the neighbouring program and are added
with relaxed fp32 atomics (their order, and so those rows' last bits, vary from run to run). fp32 products and sums
throughout.

Work and memory. Each kernel reads, for each kept entry, one row of y or x (E elements): O(N K E), in place of the
O(N V E) of a vocabulary sweep; the filling (-1) is masked off and read from nowhere (the sort reads and writes its
keys), so the cost is that of the entries kept, whatever K the sets are padded to. Memory-bound (a multiply and an
add per element read, no tensor-core dot: a gathered row is shared by no other token of the tile). ``kept_dot`` and
``kept_grad_rows`` read N K rows of y (the weight: from HBM unless the ids repeat); ``kept_grad_table`` reads N K
rows of x and reads and writes E fp32 of dy once a (block, id) run: each distinct id's row once (at most V rows: dy
through HBM once), plus a partial row for each block whose last run goes on (read back from L2; at most
N K / SORTED_BLOCK_M), where one fp32 atomic an element, N K E of them, added them before; atomics only for the runs
at a span's two ends. Its issue: ~40 warp instructions a pair and 128 columns (sm_90 SASS), ~3x the atomic kernel's.
Buffers: the [N, K] fp32 logits and gradients, and the sort's keys and outputs (``grad_table_workspace_bytes``:
SORT_BYTES_PER_PAIR a pair, PAIRS_PER_SORT pairs at a time).
"""

import torch
import triton
import triton.language as tl

from grpo_fast.kernels.launch import interpreting, on_first_argument_device
from grpo_fast.kernels.tile import transform_and_slope

BLOCK_K = 16
BLOCK_E = 128
NUM_WARPS = 4
# kept_grad_table: a block of SORTED_BLOCK_M sorted pairs x SORTED_BLOCK_E columns on one warp (its 32 lanes x 4
# contiguous columns: every row of a column in one thread, 32 fp32 values a thread at 8 rows; sm_compile: no spill);
# a span of up to SORTED_BLOCKS blocks a program, fewer while that would leave under SORTED_PROGRAMS programs
SORTED_BLOCK_M = 8
# under the interpreter (numpy), where each operation's cost is its call: 4x the rows, a quarter of the calls
INTERPRETER_SORTED_BLOCK_M = 32
SORTED_BLOCK_E = 128
SORTED_WARPS = 1
SORTED_BLOCKS = 16
SORTED_PROGRAMS = 1024
# kept_dot_rows: a step's whole rows in registers, DOT_ROWS_ELEMENTS fp32 over DOT_ROWS_WARPS warps (32 a thread; 4
# rows at D = 1536 padded to 2048, 1 at D = 8192; sm_90: 96 registers, no spill, 2 programs an SM: 48 KiB of bf16
# rows in flight an SM)
DOT_ROWS_ELEMENTS = 8192
DOT_ROWS_WARPS = 8
# a sort takes at most PAIRS_PER_SORT pairs (whole tokens; n K + j fits int32); torch.sort of int32 keys holds about
# SORT_BYTES_PER_PAIR a pair at its peak: the keys (4), its int64 index input (8), the sorted keys and order (4 + 8)
# and the radix sort's alternate buffers of both (12)
PAIRS_PER_SORT = 2**21
SORT_BYTES_PER_PAIR = 36


@triton.jit
def _kept_ids(ids_ptr, row, slots, in_set, stride_ids):
    """A token's kept ids at ``slots`` as int64, -1 (no entry) past the set's width."""
    return tl.load(ids_ptr + row.to(tl.int64) * stride_ids + slots, mask=in_set, other=-1).to(tl.int64)


@triton.jit
def _gathered_raw(x_ptr, y_ptr, row, ids, live, E, stride_x, stride_y, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr):
    """x[row] . y[ids] for BLOCK_K ids (0 where not ``live``), fp32, BLOCK_E columns a step."""
    acc = tl.zeros((BLOCK_K,), dtype=tl.float32)
    for e0 in range(0, E, BLOCK_E):
        cols = e0 + tl.arange(0, BLOCK_E)
        in_cols = cols < E
        x = tl.load(x_ptr + row.to(tl.int64) * stride_x + cols, mask=in_cols, other=0.0).to(tl.float32)
        y = tl.load(
            y_ptr + ids[:, None] * stride_y + cols[None, :], mask=live[:, None] & in_cols[None, :], other=0.0
        ).to(tl.float32)
        acc += tl.sum(y * x[None, :], axis=1)
    return acc


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
    acc = _gathered_raw(x_ptr, y_ptr, row, ids, ids >= 0, E, stride_x, stride_y, BLOCK_K, BLOCK_E)
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
def _kept_dot_rows_kernel(
    x_ptr,
    y_ptr,
    bias_ptr,
    ids_ptr,
    weights_ptr,
    z_ptr,
    slope_ptr,
    pivot_ptr,
    p_ptr,
    t_ptr,
    K,
    E,
    stride_x,
    stride_y,
    stride_ids,
    stride_k,
    stride_e,
    inv_temperature,
    logit_scale,
    softcap,
    HAS_BIAS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    row = tl.program_id(0)
    k_row = row.to(tl.int64) * stride_k
    cols = tl.arange(0, BLOCK_E)
    in_cols = cols < E
    x = tl.load(x_ptr + row.to(tl.int64) * stride_x + cols, mask=in_cols, other=0.0).to(tl.float32)
    p = tl.zeros((BLOCK_E,), dtype=tl.float32)
    t = tl.zeros((BLOCK_E,), dtype=tl.float32)
    m = -float("inf")
    for k0 in range(0, K, BLOCK_K):
        slots = k0 + tl.arange(0, BLOCK_K)
        in_set = slots < K
        ids = _kept_ids(ids_ptr, row, slots, in_set, stride_ids)
        live = ids >= 0
        # BLOCK_K whole rows of y in registers: their logits, then both sums, from the one read
        y = tl.load(
            y_ptr + ids[:, None] * stride_y + cols[None, :], mask=live[:, None] & in_cols[None, :], other=0.0
        ).to(tl.float32)
        u = tl.sum(y * x[None, :], axis=1)
        if HAS_BIAS:
            u += tl.load(bias_ptr + ids, mask=live, other=0.0).to(tl.float32)
        z, slope = transform_and_slope(u, inv_temperature, logit_scale, softcap, HAS_SOFTCAP)
        slope = slope + tl.zeros((BLOCK_K,), dtype=tl.float32)
        z = tl.where(live, z, -float("inf"))
        tl.store(z_ptr + k_row + slots, z, mask=in_set)
        tl.store(slope_ptr + k_row + slots, slope, mask=in_set)
        # P so far rescaled to the running max (an all -inf prefix: no mass, no inf - inf)
        new_m = tl.maximum(m, tl.max(z, axis=0))
        pivot = tl.where(new_m == -float("inf"), 0.0, new_m)
        w_p = tl.where(live, tl.exp(z - pivot) * slope, 0.0)
        w_t = tl.load(weights_ptr + k_row + slots, mask=live, other=0.0) * slope
        p = p * tl.exp(m - pivot) + tl.sum(y * w_p[:, None], axis=0)
        t += tl.sum(y * w_t[:, None], axis=0)
        m = new_m
    tl.store(p_ptr + row.to(tl.int64) * stride_e + cols, p, mask=in_cols)
    tl.store(t_ptr + row.to(tl.int64) * stride_e + cols, t, mask=in_cols)
    tl.store(pivot_ptr + row, tl.where(m == -float("inf"), 0.0, m))


@triton.jit
def _kept_record_rows_kernel(
    x_ptr,
    y_ptr,
    lora_x_ptr,
    lora_y_ptr,
    bias_ptr,
    ids_ptr,
    targets_ptr,
    record_ptr,
    K,
    V,
    E,
    R,
    stride_x,
    stride_y,
    stride_lora_x,
    stride_lora_y,
    stride_ids,
    stride_record,
    inv_temperature,
    logit_scale,
    softcap,
    HAS_BIAS: tl.constexpr,
    HAS_LORA: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    row = tl.program_id(0)
    if tl.load(record_ptr + 3 * stride_record + row) != 0.0:  # the sweep's sums serve this row
        return
    target = tl.load(targets_ptr + row)
    m = -float("inf")
    s = 0.0
    rest = 0.0
    target_logit = -float("inf")
    for k0 in range(0, K, BLOCK_K):
        slots = k0 + tl.arange(0, BLOCK_K)
        ids = _kept_ids(ids_ptr, row, slots, slots < K, stride_ids)
        live = (ids >= 0) & (ids < V)  # as the bitmaps read the set
        if tl.max(live.to(tl.int32), axis=0) > 0:  # a block of filling only reads no row (a narrow set in a wide K)
            u = _gathered_raw(x_ptr, y_ptr, row, ids, live, E, stride_x, stride_y, BLOCK_K, BLOCK_E)
            if HAS_LORA:
                u += _gathered_raw(
                    lora_x_ptr, lora_y_ptr, row, ids, live, R, stride_lora_x, stride_lora_y, BLOCK_K, BLOCK_E
                )
            if HAS_BIAS:
                u += tl.load(bias_ptr + ids, mask=live, other=0.0).to(tl.float32)
            z, _ = transform_and_slope(u, inv_temperature, logit_scale, softcap, HAS_SOFTCAP)
            z = tl.where(live, z, -float("inf"))
            at_target = live & (ids == target)
            new_m = tl.maximum(m, tl.max(z, axis=0))
            pivot = tl.where(new_m == -float("inf"), 0.0, new_m)  # an all -inf prefix: no mass, no inf - inf
            e = tl.exp(z - pivot)
            rescale = tl.exp(m - pivot)
            s = s * rescale + tl.sum(e, axis=0)
            rest = rest * rescale + tl.sum(tl.where(at_target, 0.0, e), axis=0)
            target_logit = tl.maximum(target_logit, tl.max(tl.where(at_target, z, -float("inf")), axis=0))
            m = new_m
    pivot = tl.where(m == -float("inf"), 0.0, m)
    nonempty = s > 0.0
    divisor = tl.where(nonempty, s, 1.0)
    tl.store(record_ptr + row, target_logit)
    tl.store(record_ptr + stride_record + row, tl.where(nonempty, pivot + tl.log(divisor), -float("inf")))
    tl.store(record_ptr + 2 * stride_record + row, rest / divisor)


@triton.jit
def _segmented_add(a, a_starts, b, b_starts):
    """The combine of a segmented sum: b's sum, plus a's unless b starts a segment."""
    return b + tl.where(b_starts, 0.0, a), a_starts | b_starts


@triton.jit(do_not_specialize_on_alignment=["x_row_units"])
def _sorted_grad_table_kernel(
    g_ptr,
    x_ptr,
    sorted_ids_ptr,
    order_ptr,
    out_ptr,
    M,
    K,
    E,
    span,
    stride_g,
    x_row_units,
    stride_out,
    BLOCK_M: tl.constexpr,
    BLOCK_E: tl.constexpr,
    X_ROW_UNIT: tl.constexpr,
):
    # this program's pairs [first, last) of the sorted list, BLOCK_M at a time
    first = tl.program_id(0) * span
    last = tl.minimum(first + span, M)
    # the ids just outside the span: a run holding either may go on in the program before or the next one (added
    # with atomics); any other run is this program's alone (read, added, stored)
    before = tl.load(sorted_ids_ptr + first - 1, mask=first > 0, other=-1)
    after = tl.load(sorted_ids_ptr + last, mask=last < M, other=-1)
    for step in range(0, span, BLOCK_M):  # bounds that are numbers, not tensors (Triton 3.6's interpreter)
        m0 = first + step
        # past the pairs' end, nothing; the dropped pairs (-1) sort first: a block of them only has nothing to add
        if (m0 < last) & (tl.load(sorted_ids_ptr + tl.minimum(m0 + BLOCK_M, last) - 1) >= 0):
            pos = m0 + tl.arange(0, BLOCK_M)
            ids = tl.load(sorted_ids_ptr + pos, mask=pos < last, other=-1)
            live = ids >= 0
            previous = tl.load(sorted_ids_ptr + pos - 1, mask=live & (pos > 0), other=-1)
            following = tl.load(sorted_ids_ptr + pos + 1, mask=live & (pos + 1 < M), other=-1)
            pair = tl.load(order_ptr + pos, mask=live, other=0).to(tl.int32)  # n K + j < PAIRS_PER_SORT
            row = pair // K
            g = tl.load(g_ptr + row * stride_g + (pair - row * K), mask=live, other=0.0)
            # x's row unit (4 where its stride allows) tells the compiler its rows' alignment: x and dy then share
            # one layout of 4 columns a thread (no exchange of values between lanes)
            x_rows = x_ptr + row.to(tl.int64) * x_row_units * X_ROW_UNIT
            out_rows = out_ptr + ids.to(tl.int64) * stride_out
            # a segment starts at each run's first pair (and the scan at the block's first row); its sum, at its last
            # pair or the block's last row, is added to the id's row (a run over several blocks: a part a block; a
            # span is whole blocks, so its last row is a block's)
            starts = tl.broadcast_to((ids != previous)[:, None], (BLOCK_M, BLOCK_E))
            ends = live & ((ids != following) | (pos == m0 + BLOCK_M - 1))
            shared = (ids == before) | (ids == after)
            for e0 in range(0, E, BLOCK_E):
                cols = e0 + tl.arange(0, BLOCK_E)
                in_cols = cols < E
                # masked lanes hold any value: a dead row's segment and the columns past E are never written
                x = tl.load(x_rows[:, None] + cols[None, :], mask=live[:, None] & in_cols[None, :])
                sums, _ = tl.associative_scan((g[:, None] * x.to(tl.float32), starts), 0, _segmented_add)
                at = out_rows[:, None] + cols[None, :]
                alone = (ends & ~shared)[:, None] & in_cols[None, :]
                tl.store(at, tl.load(at, mask=alone) + sums, mask=alone)
                # relaxed: the adds need no ordering (an acq_rel atomic costs a GPU-scope fence and a value return)
                tl.atomic_add(at, sums, mask=(ends & shared)[:, None] & in_cols[None, :], sem="relaxed")


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


def sorted_pairs(g, ids):
    """The (token, slot) pairs of ``ids`` [N, K] in the order of their vocabulary ids: (the ids, int32 [N K]
    ascending; the pairs' flat indices n K + j, int64 [N K]); a pair with id -1 or g == 0 gets -1 (they sort first).
    Stable: the pairs of one id in token order."""
    keys = ids.to(torch.int32).masked_fill_((ids < 0) | (g == 0), -1).reshape(-1)
    return torch.sort(keys, stable=True)


def _tokens_per_sort(K):
    """The tokens of one sort: PAIRS_PER_SORT pairs' worth, at least one."""
    return max(1, PAIRS_PER_SORT // max(K, 1))


def grad_table_workspace_bytes(N, K):
    """The bytes ``kept_grad_table`` allocates at [N, K] (one sort's, ``SORT_BYTES_PER_PAIR`` a pair)."""
    return min(N, _tokens_per_sort(K)) * K * SORT_BYTES_PER_PAIR


def _block_m():
    return INTERPRETER_SORTED_BLOCK_M if interpreting() else SORTED_BLOCK_M


def _span(M, block_m):
    """A program's sorted pairs: SORTED_BLOCKS blocks, fewer where M would give under SORTED_PROGRAMS programs."""
    return block_m * max(1, min(SORTED_BLOCKS, M // (block_m * SORTED_PROGRAMS)))


@on_first_argument_device
def kept_grad_table(g, x, ids, out):
    """out [V, E] fp32, out[ids[n, j]] += g[n, j] x[n] (g [N, K] fp32, x [N, E]): the pairs sorted by id
    (``sorted_pairs``, PAIRS_PER_SORT at a time), each id's run summed in registers and added once a block."""
    N, K = ids.shape
    E = x.shape[1]
    block_m = _block_m()
    unit = 4 if x.stride(0) % 4 == 0 else 1
    rows = _tokens_per_sort(K)
    for n0 in range(0, N if K and E else 0, rows):
        n1 = min(N, n0 + rows)
        sorted_ids, order = sorted_pairs(g[n0:n1], ids[n0:n1])
        M = sorted_ids.numel()
        span = _span(M, block_m)
        _sorted_grad_table_kernel[(triton.cdiv(M, span),)](
            g[n0:n1],
            x[n0:n1],
            sorted_ids,
            order,
            out,
            M,
            K,
            E,
            span,
            g.stride(0),
            x.stride(0) // unit,
            out.stride(0),
            BLOCK_M=block_m,
            BLOCK_E=SORTED_BLOCK_E,
            X_ROW_UNIT=unit,
            num_warps=SORTED_WARPS,
        )
    return out


def dot_rows_block(E):
    """``kept_dot_rows``' rows a step: DOT_ROWS_ELEMENTS elements of whole rows (E padded to a power of two), at
    least one."""
    return max(1, DOT_ROWS_ELEMENTS // triton.next_power_of_2(E))


@on_first_argument_device
def kept_dot_rows(x, y, bias, ids, weights, transform):
    """One gather of the kept rows for a token's logits and two weighted sums of the same rows (a served teacher's
    student side at beta 0, ``served.ops``): with u = x[n] . y[k] + bias[k] and (z, dz/du) = ``transform`` of u,

        z [N, K] (-inf at -1), dz/du [N, K], pivot [N] (the largest z of a row, 0 where it has none),
        P [N, E] = sum_k exp(z_k - pivot) dz_k/du_k y[k],   T [N, E] = sum_k weights_k dz_k/du_k y[k],

    all fp32 (x [N, E], y [V, E] rows contiguous; ids [N, K] int64, -1 off; weights [N, K] fp32). A program takes a
    token and ``dot_rows_block`` whole rows of y at a time into registers (E padded to a power of two): their logits,
    then both sums from the same registers, P rescaled to the running max as an online softmax's sum: each kept row
    read once, where the logits' gather and a later ``kept_grad_rows`` read it twice."""
    N, K = ids.shape
    E = x.shape[1]
    dev = x.device
    z = torch.empty((N, K), dtype=torch.float32, device=dev)
    slope = torch.empty((N, K), dtype=torch.float32, device=dev)
    pivot = torch.zeros(N, dtype=torch.float32, device=dev)
    P = torch.zeros((N, E), dtype=torch.float32, device=dev)
    T = torch.zeros((N, E), dtype=torch.float32, device=dev)
    if N and K:
        inv_temperature, logit_scale, softcap = transform.kernel_scalars()
        _kept_dot_rows_kernel[(N,)](
            x, y, bias if bias is not None else x, ids, weights.contiguous(), z, slope, pivot, P, T, K, E,
            x.stride(0), y.stride(0), ids.stride(0), z.stride(0), P.stride(0),
            inv_temperature, logit_scale, softcap,
            HAS_BIAS=bias is not None, HAS_SOFTCAP=transform.softcap is not None,
            BLOCK_K=dot_rows_block(E), BLOCK_E=triton.next_power_of_2(E), num_warps=DOT_ROWS_WARPS,
        )  # fmt: skip
    return z, slope, pivot, P, T


@on_first_argument_device
def kept_record_rows(head, kept_ids, kept):
    """The rows of a kept record whose sums the record sweep does not serve (``forward.kept_record``'s kept [4, N]: its
    flag 0: a narrow set, an empty one, a set far below its row's max), recomputed in place from their kept entries'
    gathers: the target's logit (-inf where the set lacks it), kept_lse (its own max: exact however far the set
    lies) and kept_nontarget_mass (``head``: an operands.HeadOperands; ``kept_ids`` [N, K] int64, ids outside [0, V)
    skipped as the bitmaps skip them, an id twice counted twice). One program a row; a served row reads its flag and
    returns, so the launch costs ~N flag reads beside the flagged rows' K weight rows each: no host read."""
    hidden, weight, targets, bias, transform, lora = head
    N, K = kept_ids.shape
    if N and K:
        lora_x, lora_y = lora if lora is not None else (hidden, weight)
        inv_temperature, logit_scale, softcap = transform.kernel_scalars()
        _kept_record_rows_kernel[(N,)](
            hidden, weight, lora_x, lora_y, bias if bias is not None else hidden, kept_ids, targets, kept,
            K, weight.shape[0], hidden.shape[1], lora_x.shape[1],
            hidden.stride(0), weight.stride(0), lora_x.stride(0), lora_y.stride(0), kept_ids.stride(0), kept.stride(0),
            inv_temperature, logit_scale, softcap,
            HAS_BIAS=bias is not None, HAS_LORA=lora is not None, HAS_SOFTCAP=transform.softcap is not None,
            BLOCK_K=BLOCK_K, BLOCK_E=BLOCK_E, num_warps=NUM_WARPS,
        )  # fmt: skip
    return kept
