"""The sampler's kept set from the record sweep's tile candidates, one kernel a launch: each row's threshold tau, its
kept sums and whether the candidates resolve it (``backends.support_tiles``'s selection, whose torch form,
``support_tiles._select``, is its twin and the statement of the rule; the Triton backend passes ``select`` in). With
gradients a second kernel a launch names each resolved row's kept ids from the tiles' columns (``kept_columns``:
its docstring; the twin ``support_tiles.kept_columns``).

Math. Per row, from ``kernels.forward``'s candidates [4, tiles, n] (each vocabulary tile's 3 largest logits, ties
repeated, and its 4th, the bound of its others) and the row's record (m, s, z_y): the running list of the ``LISTED``
largest entries, descending, and the largest entry it dropped (every entry above that is listed): a step sorts
BLOCK_T tiles' 4 fields ascending (the 4th as -inf: LISTED lanes), takes the larger of each pair of list and block
(Batcher's half-cleaner: the union's LISTED largest, one bitonic run, which one bitonic merge sorts descending) and
the smaller ones' max into the dropped one. b_t, the largest 4th field, is a running max. Then, as the
twin: min-p's floor m + log(min_p), top-k's k-th listed entry, top-p's cut: the survivors' masses exp(v - m) in fp64,
each entry's mass strictly above it (an exclusive prefix sum, carried through a tie group from its first entry by a
scan whose combine keeps the left value where the two tie: associative over a descending list) against top_p x the
total (s, or after a floor the fp32 sum of the entries' masses at or above it); the resolved test; the kept sums
sum_{v >= tau} exp(v - m) over the listed entries (with min-p every entry: one more sweep of the candidates, two with
top-p, which needs the total at the floor before tau) and their non-target part (ties with z_y beyond its own added
back as exp(z_y - m) each). Sums of positive terms, never a difference; -inf lanes carry no mass (exp(-inf) = 0, and
a row whose m is not finite is not resolved).

Equal to the twin: the listed values, the 65th, b_t and every comparison are exact, so tau and resolved are the twin's
bit for bit wherever top-p's comparisons of a prefix mass with top_p x total do not lie within the rounding of the
sums' order (tl.sum's tree, not torch's; exp is Triton's) - a tie of mass to 1e-7 relative, which random logits do not
meet; a row holding a NaN logit is not resolved either way (its tau is not compared). The kept sums equal the twin's
within fp32's rounding of a sum of positive terms in another order (tests: 2e-6 of the sum).

Work and memory. One program a BLOCK_N rows (a field's rows lie side by side: a 32-byte sector a tile and field),
NUM_WARPS warps, no memory but registers and the sorts' shared memory (``tools/sm_compile.py``, sm_90: 64-68
registers, 3 KiB, no spill; min-p alone needs no list: 40). It reads each row's 4 x tiles fp32 candidates once (with
min-p once or twice more, from L2) and writes 3 fp32 and a byte a row: at Qwen2.5's vocabulary in 256-column tiles,
594 tiles, 9.5 KB a row, 156 MB for 16384 rows (~0.03 ms at the H200's 4.8 TB/s). The sorts dominate: every
BLOCK_T = 16 tiles a sort of 64 lanes (21 rounds of 32 compare-exchanges), the half-cleaner's 64 and a merge's 6
rounds of 32: 928 compare-exchanges, a max and a min each; 38 steps a row of 594 tiles, 1.2e9 min / max for 16384
rows, ~0.07 ms at the ALU pipe's rate (64 lanes a clock an SM), ~0.1-0.2 ms with the exchanges' shuffles and selects
(argued from the operation count, not timed; 128-column tiles, 1187 of them, twice that). The selection after the
list is a few hundred operations a row.
"""

import math
import struct

import torch
import triton
import triton.language as tl

from grpo_fast.kernels.forward import COLUMN_FIELD_BITS, TILE_CANDIDATES
from grpo_fast.kernels.launch import interpreting, on_first_argument_device

# the largest entries a row's selection lists (a power of two): top-k up to it can be resolved from the candidates
LISTED = 64
# tiles a step: their 4 fields fill the LISTED lanes joined to the list
BLOCK_T = LISTED // 4
BLOCK_N = 8
# under the interpreter (numpy) a sort costs per call, not per element: more rows a program
INTERPRETER_BLOCK_N = 64
NUM_WARPS = 8
# the kept columns' launch (``kept_columns``): rows a program (8 rows' fp32 of a tile and field: a 32-byte sector;
# a launch's ~900 rows at V 151936 make ~112 programs, about one an SM), tiles a step (32 KB of loads; 8 a thread)
COLUMNS_BLOCK_N = 8
COLUMNS_BLOCK_T = 256
COLUMNS_NUM_WARPS = 8


@triton.jit
def _first_of_tie(left_value, left_above, right_value, right_above):
    """Scan combine over a descending list: the mass above a tie group's first entry, carried through the group."""
    return right_value, tl.where(left_value == right_value, left_above, right_above)


@triton.jit
def _indicator(n_dims: tl.constexpr, j: tl.constexpr):
    """0, 1 along the hypercube's j-th innermost axis."""
    return tl.reshape(tl.arange(0, 2), [1] * (n_dims - j - 1) + [2] + [1] * j)


@triton.jit
def _compare_and_swap(h, flip, i: tl.constexpr, n_dims: tl.constexpr):
    """Each pair along the hypercube ``h``'s i-th innermost axis in order: descending where ``flip``."""
    hi = tl.max(h, axis=n_dims - 1 - i, keep_dims=True)
    lo = tl.min(h, axis=n_dims - 1 - i, keep_dims=True)
    return tl.where((flip ^ _indicator(n_dims, i)).to(tl.int1), hi, lo)


@triton.jit
def _bitonic_stage(h, stage: tl.constexpr, n_dims: tl.constexpr, order: tl.constexpr):
    """A bitonic network's stage-th merge over the hypercube ``h``: runs of 2^stage in order (0 ascending, 1
    descending, 2 alternating as a sort's inner stages)."""
    if order == 2:
        flip = _indicator(n_dims, stage)
    else:
        flip = order
    for i in tl.static_range(stage):
        h = _compare_and_swap(h, flip, stage - 1 - i, n_dims)
    return h


@triton.jit
def _sort(x, N_DIMS: tl.constexpr, LOG_N: tl.constexpr, ORDER: tl.constexpr):
    """x [BLOCK_N, 2^LOG_N] (2^N_DIMS values) sorted along its rows, ascending (``ORDER`` 0) or descending (1):
    ``tl.sort``'s bitonic network, each compare-and-swap a max and a min over a pair's axis (Triton's takes the
    partner by an xor reduction, which its interpreter runs one scalar at a time: ~40 s a call at [64, 128])."""
    h = tl.reshape(x, [2] * N_DIMS)
    for stage in tl.static_range(1, LOG_N + 1):
        h = _bitonic_stage(h, stage, N_DIMS, 2 if stage < LOG_N else ORDER)
    return tl.reshape(h, x.shape)


@triton.jit
def _merge_descending(x, N_DIMS: tl.constexpr, LOG_N: tl.constexpr):
    """x [BLOCK_N, 2^LOG_N] bitonic along its rows (one descending run, then one ascending) sorted descending."""
    return tl.reshape(_bitonic_stage(tl.reshape(x, [2] * N_DIMS), LOG_N, N_DIMS, 1), x.shape)


@triton.jit
def _at(x, index, lanes):
    """x[n, index[n]] of x [BLOCK_N, LISTED] (a float's value; a flag's as 0 / 1)."""
    return tl.max(tl.where(lanes[None, :] == index[:, None], x, -float("inf")), axis=1)


@triton.jit
def _tile_entries(candidates_ptr, rows, in_rows, t0, tiles, stride_field, stride_tile, BLOCK_T: tl.constexpr):
    """[BLOCK_N, 4 x BLOCK_T] tiles t0.. of the rows: fields 0-2 each tile's entries, field 3 its bound (-inf past the
    tiles); and which lanes are entries."""
    lanes = tl.arange(0, 4 * BLOCK_T)
    field = lanes // BLOCK_T
    tile = t0 + lanes % BLOCK_T
    offsets = field * stride_field + tile * stride_tile
    live = in_rows[:, None] & (tile < tiles)[None, :]
    x = tl.load(candidates_ptr + offsets[None, :] + rows[:, None], mask=live, other=-float("inf"))
    return x, (field < 3)[None, :]


@triton.jit
def _entry_sums(
    candidates_ptr, rows, in_rows, tiles, stride_field, stride_tile, tau, m, target_logit, BLOCK_T: tl.constexpr
):
    """(sum over every entry v >= tau of exp(v - m), the same over the entries off z_y plus exp(z_y - m) for each tie
    with it beyond its own) [BLOCK_N]."""
    kept = tl.zeros_like(m)
    kept_rest = tl.zeros_like(m)
    ties = tl.zeros_like(m).to(tl.int32)
    for t0 in range(0, tiles, BLOCK_T):
        x, is_entry = _tile_entries(candidates_ptr, rows, in_rows, t0, tiles, stride_field, stride_tile, BLOCK_T)
        at = is_entry & (x >= tau[:, None])
        e = tl.where(at, tl.exp(x - m[:, None]), 0.0)
        is_target = x == target_logit[:, None]
        kept += tl.sum(e, axis=1)
        kept_rest += tl.sum(tl.where(is_target, 0.0, e), axis=1)
        ties += tl.sum((at & is_target).to(tl.int32), axis=1)
    return kept, kept_rest + tl.maximum(ties - 1, 0).to(tl.float32) * tl.exp(target_logit - m)


@triton.jit
def _select_kernel(
    candidates_ptr,
    m_ptr,
    s_ptr,
    target_ptr,
    tau_ptr,
    kept_ptr,
    kept_rest_ptr,
    resolved_ptr,
    n,
    tiles,
    stride_field,
    stride_tile,
    log_min_p,
    top_k,
    top_p_bits,
    MIN_P: tl.constexpr,
    TOP_K: tl.constexpr,
    TOP_P: tl.constexpr,
    LISTED: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_T: tl.constexpr,
    N_DIMS: tl.constexpr,
    LOG_LISTED: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    in_rows = rows < n
    lanes = tl.arange(0, LISTED)
    listed = tl.full((BLOCK_N, LISTED), -float("inf"), tl.float32)
    dropped = tl.full((BLOCK_N,), -float("inf"), tl.float32)  # the largest entry the list dropped
    outside = tl.full((BLOCK_N,), -float("inf"), tl.float32)  # b_t: the largest logit no tile lists
    for t0 in range(0, tiles, BLOCK_T):
        x, is_entry = _tile_entries(candidates_ptr, rows, in_rows, t0, tiles, stride_field, stride_tile, BLOCK_T)
        outside = tl.maximum(outside, tl.max(tl.where(is_entry, -float("inf"), x), axis=1))
        # Batcher's half-cleaner: against the block sorted ascending, the larger of each pair is the union's top
        # LISTED (a bitonic run), the smaller the rest
        x = _sort(tl.where(is_entry, x, -float("inf")), N_DIMS, LOG_LISTED, 0)
        dropped = tl.maximum(dropped, tl.max(tl.minimum(listed, x), axis=1))
        listed = _merge_descending(tl.maximum(listed, x), N_DIMS, LOG_LISTED)
    L = tl.minimum(3 * tiles, LISTED)  # the listed entries (fewer in a small vocabulary)
    valid = (lanes < L)[None, :]
    unlisted = tl.maximum(outside, dropped)  # every logit above it is listed, once (dropped: -inf past 3 x tiles)
    # min-p's survivors may outnumber the list: its sums run over every entry, bounded by b_t; the others' over the
    # list, bounded by ``unlisted``
    bound = outside if MIN_P else unlisted
    m = tl.load(m_ptr + rows, mask=in_rows, other=0.0)
    s = tl.load(s_ptr + rows, mask=in_rows, other=1.0)
    target_logit = tl.load(target_ptr + rows, mask=in_rows, other=0.0)
    record = m + s + target_logit
    resolved = (record == record) & (tl.abs(record) < float("inf"))  # a NaN or infinite record: the rows' path
    e = tl.where(valid, tl.exp(listed - m[:, None]), 0.0)
    floor = tl.full((BLOCK_N,), -float("inf"), tl.float32)
    if MIN_P:
        floor = m + log_min_p
    if TOP_K:
        resolved = resolved & (top_k <= L)  # fewer entries than k
        floor = tl.maximum(floor, _at(listed, tl.zeros_like(rows) + tl.minimum(top_k, L) - 1, lanes))
    tau = floor
    if TOP_P:
        cut = floor > -float("inf")
        resolved = resolved & (~cut | (bound < floor))
        if MIN_P:
            total, _ = _entry_sums(
                candidates_ptr, rows, in_rows, tiles, stride_field, stride_tile, floor, m, target_logit, BLOCK_T
            )
        else:
            total = tl.sum(tl.where(listed >= floor[:, None], e, 0.0), axis=1)
        total = tl.where(cut, total.to(tl.float64), s.to(tl.float64))
        survivors = valid & (listed >= floor[:, None])
        mass = tl.where(survivors, e.to(tl.float64), 0.0)
        _, above = tl.associative_scan((listed, tl.cumsum(mass, 1) - mass), 1, _first_of_tie)
        top_p = top_p_bits.to(tl.float64, bitcast=True)
        j = tl.sum((survivors & (above < top_p * total[:, None])).to(tl.int32), axis=1)
        out = tl.minimum(j, L - 1)
        # the first listed survivor that falls out, at or above b_t: the cut is the list's; or every survivor listed
        falls_out = (j < L) & (_at(survivors.to(tl.float32), out, lanes) > 0) & (outside <= _at(listed, out, lanes))
        resolved = resolved & (j >= 1) & (falls_out | (unlisted < floor))
        tau = _at(listed, tl.maximum(j - 1, 0), lanes)
    resolved = resolved & (bound < tau)
    if MIN_P:
        kept, kept_rest = _entry_sums(
            candidates_ptr, rows, in_rows, tiles, stride_field, stride_tile, tau, m, target_logit, BLOCK_T
        )
    else:
        at = valid & (listed >= tau[:, None])
        is_target = listed == target_logit[:, None]
        kept = tl.sum(tl.where(at, e, 0.0), axis=1)
        ties = tl.maximum(tl.sum((at & is_target).to(tl.int32), axis=1) - 1, 0)
        kept_rest = tl.sum(tl.where(at & ~is_target, e, 0.0), axis=1) + ties.to(tl.float32) * tl.exp(target_logit - m)
    tl.store(tau_ptr + rows, tau, mask=in_rows)
    tl.store(kept_ptr + rows, kept, mask=in_rows)
    tl.store(kept_rest_ptr + rows, kept_rest, mask=in_rows)
    tl.store(resolved_ptr + rows, resolved.to(tl.uint8), mask=in_rows)


def _block_n():
    return INTERPRETER_BLOCK_N if interpreting() else BLOCK_N


@on_first_argument_device
def select(candidates, m, s, target_logit, support, vocab_size, out):
    """``out`` (tau, kept, kept_rest fp32, resolved bool; each [n], contiguous) of rows whose tiles' candidates are
    ``candidates`` [4, tiles, n] fp32 (rows contiguous) and record m, s, z_y [n] (module docstring; the twin's
    ``_select`` with ``support``'s min_p, top_k, top_p)."""
    fields, tiles, n = candidates.shape
    if fields != TILE_CANDIDATES + 1 or candidates.stride(2) != 1:
        raise ValueError(f"candidates: [{TILE_CANDIDATES + 1}, tiles, n] with rows contiguous, got {candidates.shape}")
    tau, kept, kept_rest, resolved = out
    if n:
        top_p_bits = struct.unpack("<q", struct.pack("<d", float(support.top_p)))[0]
        _select_kernel[(triton.cdiv(n, _block_n()),)](
            candidates,
            m,
            s,
            target_logit,
            tau,
            kept,
            kept_rest,
            resolved.view(torch.uint8),
            n,
            tiles,
            candidates.stride(0),
            candidates.stride(1),
            math.log(support.min_p) if support.min_p > 0 else 0.0,  # the twin's m + log(min_p), added in fp32
            support.top_k,
            top_p_bits,
            MIN_P=support.min_p > 0,
            TOP_K=0 < support.top_k < vocab_size,
            TOP_P=support.top_p < 1,
            LISTED=LISTED,
            BLOCK_N=_block_n(),
            BLOCK_T=BLOCK_T,
            N_DIMS=(_block_n() * LISTED).bit_length() - 1,
            LOG_LISTED=LISTED.bit_length() - 1,
            num_warps=NUM_WARPS,
        )
    return out


# below every sort key (``_sort_keys``' high word of a non-NaN value is above int32's least)
_EMPTY_KEY = tl.constexpr(-(2**63))


@triton.jit
def _entry_word(value, column, tile, block_v):
    """An entry's 64-bit word (int64): its logit's fp32 bits high, its vocabulary id (tile x block_v + column) low;
    a register pair, no arithmetic but the id's."""
    vocab_id = tile * block_v + column
    return (value.to(tl.int32, bitcast=True).to(tl.int64) << 32) | vocab_id.to(tl.uint32, bitcast=True).to(tl.int64)


@triton.jit
def _sort_keys(words):
    """``_entry_word``'s words as int64 keys whose order is the values' then the ids' reversed (descending keys:
    values descending, ties by ascending id): the fp32 bits made monotone as a signed int32 (a negative float's
    magnitude bits flipped) high, the id's complement (unsigned) low."""
    bits = (words >> 32).to(tl.int32)
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    return (ordered.to(tl.int64) << 32) | (~words.to(tl.int32)).to(tl.uint32, bitcast=True).to(tl.int64)


@triton.jit
def _key_ids(keys):
    """The vocabulary ids of ``_sort_keys``' keys (int64; the id's own 32 bits, whatever the column sums held)."""
    return (~keys.to(tl.int32)).to(tl.int64)


@triton.jit(do_not_specialize=["stride_row"])
def _kept_columns_kernel(
    candidates_ptr,
    columns_ptr,
    tau_ptr,
    resolved_ptr,
    ids_ptr,
    n,
    tiles,
    stride_field,
    stride_tile,
    stride_row,
    stride_ids,
    block_v,
    LISTED: tl.constexpr,
    COLUMN_BITS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_T: tl.constexpr,
    N_DIMS: tl.constexpr,
    LOG_LISTED: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    in_rows = rows < n
    tau = tl.load(tau_ptr + rows, mask=in_rows, other=0.0)
    resolved = tl.load(resolved_ptr + rows, mask=in_rows, other=0) != 0
    count = tl.zeros((BLOCK_N,), tl.int32)  # a row's kept entries so far
    tied = tl.zeros((BLOCK_T, BLOCK_N), tl.int1)  # a tile whose kept entries tie
    row_slots = ids_ptr + rows[None, :] * stride_ids  # [1, BLOCK_N], as the tiles' tensors
    field_mask: tl.constexpr = (1 << COLUMN_BITS) - 1
    for t0 in range(0, tiles, BLOCK_T):
        tile = t0 + tl.arange(0, BLOCK_T)
        live = (tile < tiles)[:, None] & in_rows[None, :]
        counted = live & resolved[None, :]  # a row the selection left keeps nothing: its ids are -1
        # the rows' stride (1) unspecialised: the loads not vectorised, in the scatter stores' layout (no conversion)
        at = tile[:, None] * stride_tile + rows[None, :] * stride_row
        v1 = tl.load(candidates_ptr + at, mask=live, other=-float("inf"))
        v2 = tl.load(candidates_ptr + stride_field + at, mask=live, other=-float("inf"))
        v3 = tl.load(candidates_ptr + 2 * stride_field + at, mask=live, other=-float("inf"))
        packed = tl.load(columns_ptr + at, mask=live, other=0)
        # NaN >= tau is False: a NaN entry is not kept (nor is a lane past the tiles, whatever tau)
        k1 = counted & (v1 >= tau[None, :])
        k2 = counted & (v2 >= tau[None, :])
        k3 = counted & (v3 >= tau[None, :])
        tied = tied | (k2 & (v1 == v2)) | (k3 & (v2 == v3))
        f1 = packed & field_mask
        f2 = (packed >> COLUMN_BITS) & field_mask
        f3 = (packed >> (2 * COLUMN_BITS)) & field_mask
        # each kept entry's slot in its row: the entries kept before it, this step's by a prefix sum over the tiles
        r = k1.to(tl.int32) + k2.to(tl.int32) + k3.to(tl.int32)
        p1 = count[None, :] + tl.cumsum(r, axis=0) - r
        p2 = p1 + k1.to(tl.int32)
        p3 = p2 + k2.to(tl.int32)
        tl.store(row_slots + p1, _entry_word(v1, f1, tile[:, None], block_v), mask=k1 & (p1 < LISTED))
        tl.store(row_slots + p2, _entry_word(v2, f2 - f1, tile[:, None], block_v), mask=k2 & (p2 < LISTED))
        tl.store(row_slots + p3, _entry_word(v3, f3 - f2, tile[:, None], block_v), mask=k3 & (p3 < LISTED))
        count += tl.sum(r, axis=0)
    tied = tl.max(tied.to(tl.int32), axis=0)
    slots = ids_ptr + rows[:, None] * stride_ids
    resolved = resolved & (tied == 0) & (count <= LISTED)
    # the words other threads stored, read back: the CTA's barrier orders their global stores before these loads
    tl.debug_barrier()
    lanes = tl.arange(0, LISTED)[None, :]
    filled = (in_rows & resolved)[:, None] & (lanes < count[:, None])
    words = tl.load(slots + lanes, mask=filled, other=0)
    keys = _sort(tl.where(filled, _sort_keys(words), _EMPTY_KEY), N_DIMS, LOG_LISTED, 1)  # the empty slots last
    tl.store(slots + lanes, tl.where(filled, _key_ids(keys), -1), mask=in_rows[:, None])
    tl.store(resolved_ptr + rows, resolved.to(tl.uint8), mask=in_rows)


@on_first_argument_device
def kept_columns(candidates, tau, resolved, block_v, ids):
    """The kernel of ``support_tiles.kept_columns`` (its twin, the statement of the rule; same arguments and
    outputs): each resolved row's kept vocabulary ids written into ``ids`` [n, LISTED] int64 (rows contiguous) by
    value descending (ties by ascending id), -1 after them and in every other row; ``resolved`` [n] bool cleared in
    place where a tile's kept entries tie or more than LISTED are kept. ``candidates`` [5, tiles, n] fp32 (rows
    contiguous: ``kernels.forward``'s with their columns), ``tau`` [n] fp32.

    Math. A tile's entries v_1 >= v_2 >= v_3 are kept where v >= tau (NaN never); the k-th's column is
    F_k - F_(k-1) (F_0 = 0; ``kforward._tile_columns``' fields), its id tile x block_v + column. Each kept entry goes
    to its row's slot count + (kept entries before it in this step: an exclusive prefix sum over the step's tiles of
    their kept counts r, plus those before it in its tile) as a word of its value's bits and its id
    (``_entry_word``), slots past LISTED not stored; after the tiles the row's count and its ties (a kept v_2 = v_1
    or v_3 = v_2) decide ``resolved``, and its words read back (the CTA's barrier between) as keys (``_sort_keys``)
    and sorted descending (one bitonic sort of LISTED lanes a row) give its ids. The twin orders by torch's topk,
    which leaves ties across tiles in an order of its own: the ids are the twin's bit for bit where the kept values
    differ, the same set in the same value order where they tie.

    Work and memory (argued, not measured). One program a COLUMNS_BLOCK_N rows, COLUMNS_BLOCK_T tiles a step, the
    tiles the tensors' first axis (the loads' and the scatter stores' layouts then agree: no conversion through
    shared memory; the rows' stride unspecialised, so that the loads are not vectorised into another layout). A row
    reads its 3 entries and column field a tile, 16 bytes (the bound is not read), writes and reads back 8 bytes a
    kept entry and writes 512 bytes of ids: at N 16384 and V 151936 in 128-column tiles (1187), 19 KB a row, 311 MB
    in all, ~0.065 ms at the H200's 4.8 TB/s (a launch's candidates were just written by the sweep: partly in L2).
    ``tools/sm_compile.py``: 128 registers on sm_89-120 (sm_80 149) under Triton 3.9, 128-191 under 3.6 (8 bytes
    spilled on sm_120 there); the loop ~120 SASS instructions a tile and row (sm_90: the loads' and stores'
    addresses, the compares, the column fields, the in-thread prefix sum and predicates held in registers; 6
    barriers a step), 2.3e9 a thread's over N 16384 (7e7 warp instructions, ~0.08 ms at 4 a clock an SM). The
    sweep's launches (``kforward.PARTS_BYTES``: 896 rows each in bf16, 19) give ~112 programs, about one an SM, each
    5 steps of 256 tiles with a load round trip and ~1000 instructions a warp: ~2 us a step, ~12 us a launch, ~0.2
    ms in all, where the torch twin's ~10 operations over [rows, tiles, 3] ran ~1 ms (both argued)."""
    fields, tiles, n = candidates.shape
    if fields != TILE_CANDIDATES + 2 or candidates.stride(2) != 1:
        raise ValueError(f"candidates: [{TILE_CANDIDATES + 2}, tiles, n] with rows contiguous, got {candidates.shape}")
    if ids.shape != (n, LISTED) or ids.dtype != torch.int64 or ids.stride(1) != 1:
        raise ValueError(f"ids: [{n}, {LISTED}] int64 with contiguous rows, got {tuple(ids.shape)} {ids.dtype}")
    if n:
        _kept_columns_kernel[(triton.cdiv(n, COLUMNS_BLOCK_N),)](
            candidates,
            candidates[TILE_CANDIDATES + 1].view(torch.int32),
            tau,
            resolved.view(torch.uint8),
            ids,
            n,
            tiles,
            candidates.stride(0),
            candidates.stride(1),
            candidates.stride(2),
            ids.stride(0),
            block_v,
            LISTED=LISTED,
            COLUMN_BITS=COLUMN_FIELD_BITS,
            BLOCK_N=COLUMNS_BLOCK_N,
            BLOCK_T=COLUMNS_BLOCK_T,
            N_DIMS=(COLUMNS_BLOCK_N * LISTED).bit_length() - 1,
            LOG_LISTED=LISTED.bit_length() - 1,
            num_warps=COLUMNS_NUM_WARPS,
        )
    return ids
