"""The divergence head's Triton kernels: both models' logit tiles in registers, folded into the records of
grpo_fast.kernels.divergence_records (which has their algebra), no [N, V] buffer.

* ``_sweep_kernel``, program (i, k): both models' BLOCK_N x BLOCK_V logit tiles (two K-loops, fp32 accumulators)
  over vocabulary split k, in one of two modes. The record sweep folds them into one record per model per split
  (and, for the combined GRPO + distillation head, gathers the student's logit at each target);
  ``_merge_splits_kernel`` folds a row's split records in order (one launch). The JSD sweep: the generalized JSD's
  second sweep over the finished records, summed over the splits. On sm_90 the tiles come through tensor descriptors
  (the copy engine; ``USE_TMA``), elsewhere through pointers.
* ``_backward_kernel``: recomputes both tiles for a chunk of tokens and writes g = c d div / d z_s dz_s/du (c the
  upstream dL/d div; fp32 for fp32 inputs, else scaled by an exact power of two and rounded to the input dtype) and
  adds its column sums to db; cuBLAS does dH = g W_s and dW_s += g^T H_s with fp32 outputs. With p = softmax(z):
      beta = 0:  d div / d z_s = p_s - p_t                            (q_t - q_s at a shared argmax: carried rests)
      beta = 1:  d div / d z_s = p_s (l_v - KL),  l = log p_s - log p_t
      between:   d div / d z_s = (1 - beta) p_s (r_v - KL(p_s || m)),  r = log p_s - log m
  Where the student is confident and the teacher is not, l_a and KL agree to O(q): their difference is carried,
  l_v - KL = (l_v - l_a) - C_s / S_s with l_v - l_a = g_v - g_a (0 at the argmax, exactly), and
  r_v - KL(p_s || m) = (r_v - r_a) - sum_v p_s (r_v - r_a), the sum from the JSD sweep. The combined head's backward
  adds layer 1's logit gradient to g (its softmax is p_s: one normaliser).
The argmax indices travel as fp32 in the split records (exact: V <= config.MAX_VOCAB < 2^24).
* ``loss_gradients`` (a loss whose dL/d div is known before the forward): per token chunk cuBLAS forms both models'
  fp32 products once, and the same three kernels read them from memory (``LOGITS_IN_MEMORY``, no dot): the records,
  the JSD sweep, g; then cuBLAS dH and dW. Three student sweeps and one teacher sweep, against ``forward`` +
  ``backward``'s four and two (five and three for the JSD).

Memory: the split records, 14 or 15 fields x splits x N fp32 (splits: ``num_vocab_splits``, a few waves' worth), the
merged ones 15 x N; the backward's g, chunk x V in the student's dtype; ``loss_gradients``' g (rows x V in the
student's dtype) and both models' fp32 products of half the rows. No tensor of size N x V.
"""

import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from . import softmax_stats
from .config import _INTERPRETER_TILES, BackwardConfig, ForwardConfig, _compiled, _device_props
from .divergence_records import JsdSweep, Record, finish, layer1_record
from .gemm import chunk_size, mm_fp32
from .launch import on_device, on_first_argument_device, tensor_descriptors_fit, tile_operand
from .tile import gemm_scale, gradient_tile, logit_tile_at, row_coefficients, stored_logit_tile_at, to_gemm

# the fields of one model's record in the split buffer, in Record's order
RECORD_FIELDS = len(Record._fields)
# the rows of one program of the splits' merge (memory-bound: 15 loads a row and split)
MERGE_BLOCK_N = 64


# the most waves the record sweep's vocabulary split adds to the unsplit launch's (num_vocab_splits): more splits fill
# the last wave better, and each adds a record to write and merge
EXTRA_WAVES = 8


def num_vocab_splits(N, V, config):
    """(num_splits, vocab_per_split) of the record sweep (a config with ``block_n``, ``block_v`` and
    ``target_programs``, the programs the GPU holds at once): the vocabulary split so that the programs fill whole
    waves.

    A launch of s splits takes about waves(s) x tiles(s) tile steps, waves(s) = cdiv(token blocks x s, wave) and
    tiles(s) = cdiv(vocabulary tiles, s), the longest program's share. The candidates are, for k waves up to
    EXTRA_WAVES more than the unsplit launch's, the most splits whose programs fit in k waves; the one of fewest
    steps is taken (the fewest splits on a tie).
    E.g. 100 token blocks on a wave of 132 leave 24 % of the GPU idle unsplit; 9 splits fill 7 waves to 97 %."""
    n_blocks = max(1, triton.cdiv(N, config.block_n))
    v_tiles = triton.cdiv(V, config.block_v)
    wave = config.target_programs

    def steps(splits):
        tiles = triton.cdiv(v_tiles, splits)
        return triton.cdiv(n_blocks * triton.cdiv(v_tiles, tiles), wave) * tiles

    unsplit_waves = triton.cdiv(n_blocks, wave)  # fewer waves than these hold no split at all
    candidates = sorted(
        {max(1, min(v_tiles, k * wave // n_blocks)) for k in range(unsplit_waves, unsplit_waves + EXTRA_WAVES + 1)}
    )
    vocab_per_split = triton.cdiv(v_tiles, min(candidates, key=steps)) * config.block_v
    return triton.cdiv(V, vocab_per_split), vocab_per_split


# The record sweep's tiles per architecture (bf16 / fp16; fp32 takes SWEEP_FP32_TILES). Two logit tiles (student and
# teacher) and both records' epilogue live at once. sm_90: 128 x 64 x 64 on 8 warps (two warpgroups, each a 64 x 64
# wgmma; 64-row tiles gave each warpgroup 64 x 32), 3 stages, the tiles through the copy engine: 248 registers, no
# spill (sm_compile); 128 columns spill 900 bytes, 128 rows through pointers 184. sm_80 / sm_89 (mma.sync) keep
# 64 x 64 x 64, where 128 rows spill 150-270 bytes; sm_90 takes it too where the tensors do not fit the copy engine.
SWEEP_TILES = {
    90: dict(block_n=128, block_v=64, block_d=64, num_warps=8, num_stages=3, use_tma=True),
    80: dict(block_n=64, block_v=64, block_d=64, num_warps=8, num_stages=2, use_tma=False),
}
# IEEE fp32 products on the FMA units: 8 warps keep both tiles' registers in bounds
SWEEP_FP32_TILES = dict(block_n=32, block_v=64, block_d=32, num_warps=8, num_stages=2, use_tma=False)


def gpu_forward_config(
    dtype: torch.dtype, sm_count: int, arch: int = 90, descriptors_fit: bool = True
) -> ForwardConfig:
    """The compiled sweep kernel's launch (both modes) on a GPU of ``sm_count`` multiprocessors (the programs of one
    wave) and compute capability ``arch`` (10 major + minor): SWEEP_TILES' row of the nearest arch at or below it (the
    sm_89 cards, ~100 KiB of shared memory a block, take sm_80's), the pointer tiles where the tensors do not fit the
    copy engine (``descriptors_fit`` false), SWEEP_FP32_TILES for an fp32 ``dtype``."""
    if dtype == torch.float32:
        tiles = SWEEP_FP32_TILES
    else:
        known = [a for a in sorted(SWEEP_TILES) if a <= arch] or [min(SWEEP_TILES)]
        tiles = SWEEP_TILES[80 if arch in (86, 87, 89) or arch >= 120 else known[-1]]
        if tiles["use_tma"] and not descriptors_fit:
            tiles = SWEEP_TILES[80]
    return ForwardConfig(**tiles, dot_fp32=False, target_programs=sm_count)


# The backward's g tiles per architecture (bf16 / fp16): both logit tiles and the gradient's epilogue live at once.
# sm_90: 128 x 64 x 64 on 8 warps through the copy engine, as the record sweep, and 128 columns for a narrow epilogue
# (``narrow_g_epilogue``: 238-255 registers, no spill; the JSD's mixture, a soft-cap, a bias or layer 1's term spill
# 16-1000 bytes there); elsewhere (and where the tensors do not fit the copy engine) 64 x 64 x 64 through pointers,
# 32 columns for the combined head (layer 1's term: no spills).
G_TILES = {
    90: dict(block_n=128, block_v=64, block_d=64, num_warps=8, num_stages=3, use_tma=True),
    80: dict(block_n=64, block_v=64, block_d=64, num_warps=8, num_stages=2, use_tma=False),
}
G_FP32_TILES = dict(block_n=32, block_v=32, block_d=32, num_warps=4, num_stages=2, use_tma=False)
NARROW_G_BLOCK_V = 128


def narrow_g_epilogue(student, teacher, beta: float, layer1: bool) -> bool:
    """Whether the g kernel's epilogue for these ModelHeads is a narrow one (``gpu_backward_config``): a plain KL
    (beta 0 or 1), no soft-cap and no bias on either model, no layer-1 term."""
    softcap = student.transform.softcap is not None or teacher.transform.softcap is not None
    bias = student.bias is not None or teacher.bias is not None
    return beta in (0.0, 1.0) and not (softcap or bias or layer1)


def gpu_backward_config(
    dtype: torch.dtype,
    layer1: bool = False,
    arch: int = 90,
    descriptors_fit: bool = True,
    narrow_epilogue: bool = False,
) -> BackwardConfig:
    """The compiled backward's launch on a GPU of compute capability ``arch``: G_TILES' row of the nearest arch at or
    below it (sm_89 cards take sm_80's), the pointer tiles where the tensors do not fit the copy engine
    (``descriptors_fit`` false), G_FP32_TILES for an fp32 ``dtype``; ``layer1``: the combined head's backward, whose
    half-precision epilogue also holds layer 1's term; ``narrow_epilogue``: ``narrow_g_epilogue``'s."""
    if dtype == torch.float32:
        tiles = dict(G_FP32_TILES)
    else:
        known = [a for a in sorted(G_TILES) if a <= arch] or [min(G_TILES)]
        tiles = dict(G_TILES[80 if arch in (86, 87, 89) or arch >= 120 else known[-1]])
        if tiles["use_tma"] and not descriptors_fit:
            tiles = dict(G_TILES[80])
        if layer1 and not tiles["use_tma"]:
            tiles["block_v"] = 32
        if narrow_epilogue and not layer1 and tiles["use_tma"]:
            tiles["block_v"] = NARROW_G_BLOCK_V
    return BackwardConfig(**tiles, dot_fp32=False, group_v=1)


def forward_config(device: torch.device, dtype: torch.dtype, descriptors_fit: bool = True) -> ForwardConfig:
    """The sweep kernel's launch on ``device`` for a student of ``dtype`` (the interpreter's small tiles on a CPU);
    ``descriptors_fit``: whether both models' tensors can be read through tensor descriptors."""
    if not _compiled(device):
        return ForwardConfig(**_INTERPRETER_TILES, target_programs=8)
    sm_count, _, arch = _device_props(device)
    return gpu_forward_config(dtype, sm_count, arch, descriptors_fit)


def backward_config(
    device: torch.device,
    dtype: torch.dtype,
    layer1: bool = False,
    descriptors_fit: bool = True,
    narrow_epilogue: bool = False,
) -> BackwardConfig:
    """The backward kernel's launch on ``device`` for a student of ``dtype`` (``layer1``: the combined head's;
    ``descriptors_fit``: whether both models' tensors can be read through tensor descriptors; ``narrow_epilogue``:
    ``narrow_g_epilogue``'s)."""
    if not _compiled(device):
        return BackwardConfig(**_INTERPRETER_TILES, group_v=1)
    return gpu_backward_config(dtype, layer1, _device_props(device)[2], descriptors_fit, narrow_epilogue)


@triton.jit
def _model_tile(
    hidden,
    weight,
    bias_ptr,
    n0,
    v0,
    N,
    V,
    D,
    stride_hn,
    stride_wv,
    inv_temperature,
    logit_scale,
    softcap,
    HAS_BIAS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    USE_TMA: tl.constexpr,
    LOGITS_IN_MEMORY: tl.constexpr,
    DOT_FP32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """One model's transformed logits at (n0, v0) (-inf past the vocabulary) and dz/du: tile.logit_tile_at without
    LoRA (``hidden`` and ``weight`` tensor descriptors with USE_TMA, else pointers), or with LOGITS_IN_MEMORY
    tile.stored_logit_tile_at (``hidden`` the fp32 products H W^T, rows ``stride_hn`` apart; ``weight`` unread)."""
    if LOGITS_IN_MEMORY:
        z, slope = stored_logit_tile_at(
            hidden,
            bias_ptr,
            n0,
            v0,
            N,
            V,
            stride_hn,
            inv_temperature,
            logit_scale,
            softcap,
            HAS_BIAS,
            HAS_SOFTCAP,
            BLOCK_N,
            BLOCK_V,
        )
    else:  # one return, after both branches (triton 3.6 compiles the code after a constexpr branch's return)
        z, slope = logit_tile_at(
            hidden,
            weight,
            bias_ptr,
            bias_ptr,
            bias_ptr,
            n0,
            v0,
            N,
            V,
            D,
            0,
            stride_hn,
            stride_wv,
            inv_temperature,
            logit_scale,
            softcap,
            HAS_BIAS,
            False,
            HAS_SOFTCAP,
            USE_TMA,
            DOT_FP32,
            DOT_PRECISION,
            DOT_PRECISION,
            BLOCK_N,
            BLOCK_V,
            BLOCK_D,
            16,
        )
    return z, slope


@triton.jit
def _pair_tiles(
    hs,
    ws,
    bs_ptr,
    ht,
    wt,
    bt_ptr,
    n0,
    v0,
    N,
    V,
    Ds,
    Dt,
    stride_hs,
    stride_ws,
    stride_ht,
    stride_wt,
    inv_temperature,
    s_logit_scale,
    s_softcap,
    t_logit_scale,
    t_softcap,
    S_HAS_BIAS: tl.constexpr,
    T_HAS_BIAS: tl.constexpr,
    S_HAS_SOFTCAP: tl.constexpr,
    T_HAS_SOFTCAP: tl.constexpr,
    USE_TMA: tl.constexpr,
    LOGITS_IN_MEMORY: tl.constexpr,
    DOT_FP32: tl.constexpr,
    S_DOT_PRECISION: tl.constexpr,
    T_DOT_PRECISION: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """The tile at (n0, v0): its vocabulary indices, both models' transformed logits (two K-loops; -inf from V on)
    and the student's slope dz/du."""
    zs, slope = _model_tile(
        hs,
        ws,
        bs_ptr,
        n0,
        v0,
        N,
        V,
        Ds,
        stride_hs,
        stride_ws,
        inv_temperature,
        s_logit_scale,
        s_softcap,
        S_HAS_BIAS,
        S_HAS_SOFTCAP,
        USE_TMA,
        LOGITS_IN_MEMORY,
        DOT_FP32,
        S_DOT_PRECISION,
        BLOCK_N,
        BLOCK_V,
        BLOCK_D,
    )
    zt, _ = _model_tile(
        ht,
        wt,
        bt_ptr,
        n0,
        v0,
        N,
        V,
        Dt,
        stride_ht,
        stride_wt,
        inv_temperature,
        t_logit_scale,
        t_softcap,
        T_HAS_BIAS,
        T_HAS_SOFTCAP,
        USE_TMA,
        LOGITS_IN_MEMORY,
        DOT_FP32,
        T_DOT_PRECISION,
        BLOCK_N,
        BLOCK_V,
        BLOCK_D,
    )
    return v0 + tl.arange(0, BLOCK_V), zs, slope, zt


@triton.jit
def _split_range(split, vocab_per_split, V):
    """The vocabulary entries [begin, end) of a sweep program's split."""
    begin = split * vocab_per_split
    return begin, tl.minimum(begin + vocab_per_split, V)


@triton.jit
def _load_saved(saved_ptr, argmax_ptr, stride_saved, stride_argmax, offs_n, n_mask):
    """A token block's divergence_records.SAVED_FIELDS (8 rows) and both argmax indices."""
    fields = saved_ptr + offs_n
    s_max, s_log_sumexp, s_rest_mass, t_max, t_log_sumexp, t_rest_mass, reference = _load_rows(
        fields, stride_saved, n_mask
    )
    return (
        s_max,
        s_log_sumexp,
        s_rest_mass,
        t_max,
        t_log_sumexp,
        t_rest_mass,
        reference,
        tl.load(fields + 7 * stride_saved, mask=n_mask, other=0.0),
        tl.load(argmax_ptr + offs_n, mask=n_mask, other=-1),
        tl.load(argmax_ptr + stride_argmax + offs_n, mask=n_mask, other=-1),
    )


@triton.jit
def _tile_record(z, z_other, offs_v, BIG: tl.constexpr):
    """divergence_records.tile_record in registers: (max, argmax, rest, cross, other, zsum, unsupported)."""
    row_max = tl.max(z, axis=1)
    top_index = tl.min(tl.where(z == row_max[:, None], offs_v[None, :], BIG), axis=1)
    pivot = tl.where(row_max == float("-inf"), 0.0, row_max)
    e = tl.exp(z - pivot[:, None])
    unsupported = tl.max(tl.where((e > 0.0) & (z_other == float("-inf")), 1.0, 0.0), axis=1)
    top = offs_v[None, :] == top_index[:, None]
    e = tl.where(top, 0.0, e)
    other = tl.sum(tl.where(top, z_other, 0.0), axis=1)
    gap_at_max = row_max - other
    cross = tl.sum(tl.where(e == 0.0, 0.0, e * ((z - z_other) - gap_at_max[:, None])), axis=1)
    zsum = tl.sum(tl.where(e == 0.0, 0.0, e * (z - pivot[:, None])), axis=1)
    return row_max, top_index.to(tl.float32), tl.sum(e, axis=1), cross, other, zsum, unsupported


@triton.jit
def _merge(m1, a1, r1, c1, o1, z1, u1, m2, a2, r2, c2, o2, z2, u2):
    """divergence_records.merge in registers: the first record holds the lower indices (it wins ties)."""
    second = m2 > m1
    wm = tl.where(second, m2, m1)
    lm = tl.where(second, m1, m2)
    wo = tl.where(second, o2, o1)
    lo = tl.where(second, o1, o2)
    lr = tl.where(second, r1, r2)
    lc = tl.where(second, c1, c2)
    lz = tl.where(second, z1, z2)
    pivot = tl.where(wm == float("-inf"), 0.0, wm)
    scale = tl.exp(lm - pivot)
    lose_sumexp = tl.where(lm > float("-inf"), 1.0, 0.0) + lr
    gap_shift = (lm - lo) - (wm - wo)
    cross = tl.where(scale == 0.0, 0.0, scale * (lc + gap_shift * lose_sumexp))
    zsum = tl.where(scale == 0.0, 0.0, scale * (lz + (lm - pivot) * lose_sumexp))
    return (
        wm,
        tl.where(second, a2, a1),
        tl.where(second, r2, r1) + scale * lose_sumexp,
        tl.where(second, c2, c1) + cross,
        wo,
        tl.where(second, z2, z1) + zsum,
        tl.maximum(u1, u2),
    )


@triton.jit
def _store_record(ptr, stride_field, mask, m, a, r, c, o, z, u):
    """A record's seven fields at ptr, stride_field apart."""
    tl.store(ptr, m, mask=mask)
    tl.store(ptr + stride_field, a, mask=mask)
    tl.store(ptr + 2 * stride_field, r, mask=mask)
    tl.store(ptr + 3 * stride_field, c, mask=mask)
    tl.store(ptr + 4 * stride_field, o, mask=mask)
    tl.store(ptr + 5 * stride_field, z, mask=mask)
    tl.store(ptr + 6 * stride_field, u, mask=mask)


@triton.jit
def _load_rows(ptr, stride_field, mask):
    """Seven fp32 rows at ptr, stride_field apart (a record in ``_store_record``'s layout; the saved values' first
    seven), 0 where masked."""
    return (
        tl.load(ptr, mask=mask, other=0.0),
        tl.load(ptr + stride_field, mask=mask, other=0.0),
        tl.load(ptr + 2 * stride_field, mask=mask, other=0.0),
        tl.load(ptr + 3 * stride_field, mask=mask, other=0.0),
        tl.load(ptr + 4 * stride_field, mask=mask, other=0.0),
        tl.load(ptr + 5 * stride_field, mask=mask, other=0.0),
        tl.load(ptr + 6 * stride_field, mask=mask, other=0.0),
    )


@triton.jit
def _merge_splits_kernel(
    split_ptr, out_ptr, N, num_splits, stride_field, WITH_TARGET: tl.constexpr, BLOCK_N: tl.constexpr
):
    """Both models' records of a block of rows folded over the record sweep's splits, the lower vocabulary first (it
    wins ties, as in divergence_records.merge): split_ptr [fields, num_splits, N] (fields stride_field apart), out_ptr
    [fields, N]; with WITH_TARGET the target-logit field summed (one split holds each target, the others add 0)."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = offs_n < N
    first = split_ptr + offs_n
    sm, sa, sr, sc, so, sz, su = _load_rows(first, stride_field, mask)
    tm, ta, tr, tc, to, tz, tu = _load_rows(first + 7 * stride_field, stride_field, mask)
    if WITH_TARGET:
        target_logit = tl.load(first + 14 * stride_field, mask=mask, other=0.0)
    for k in range(1, num_splits):
        split = first + k * N
        m, a, r, c, o, z, u = _load_rows(split, stride_field, mask)
        sm, sa, sr, sc, so, sz, su = _merge(sm, sa, sr, sc, so, sz, su, m, a, r, c, o, z, u)
        m, a, r, c, o, z, u = _load_rows(split + 7 * stride_field, stride_field, mask)
        tm, ta, tr, tc, to, tz, tu = _merge(tm, ta, tr, tc, to, tz, tu, m, a, r, c, o, z, u)
        if WITH_TARGET:
            target_logit += tl.load(split + 14 * stride_field, mask=mask, other=0.0)
    out = out_ptr + offs_n
    _store_record(out, N, mask, sm, sa, sr, sc, so, sz, su)
    _store_record(out + 7 * N, N, mask, tm, ta, tr, tc, to, tz, tu)
    if WITH_TARGET:
        tl.store(out + 14 * N, target_logit, mask=mask)


@triton.jit
def _log_probs(z, offs_v, row_max, log_sumexp, top_index):
    """log p = (z - m) - log S of a tile (exactly -log S at the argmax), and the argmax mask."""
    top = offs_v[None, :] == top_index[:, None]
    return tl.where(top, 0.0, z - row_max[:, None]) - log_sumexp[:, None], top


@triton.jit
def _log_mixture(log_ps, log_pt, shared_top, s_rest_mass, t_rest_mass, beta, log_1m_beta, log_beta):
    """log m, m = (1 - beta) p_s + beta p_t (log1p of the carried rests at a shared argmax)."""
    a = log_ps + log_1m_beta
    b = log_pt + log_beta
    top = tl.maximum(a, b)
    top = tl.where(top == float("-inf"), 0.0, top)
    log_m = top + tl.log(tl.exp(a - top) + tl.exp(b - top))
    # log1p(-x) for the carried x = 1 - m at a shared argmax (1e-6 where both models are sure): log(1 - x) would
    # lose x's digits; log(u) x / (1 - u), u = 1 - x rounded, is exact to fp32 (Goldberg's log1p)
    x = (1.0 - beta) * s_rest_mass + beta * t_rest_mass
    u = 1.0 - x
    at_top = tl.where(u == 1.0, -x, tl.log(u) * x / (1.0 - u))
    return tl.where(shared_top, at_top[:, None], log_m)


@triton.jit
def _sweep_kernel(
    hs,
    ws,
    bs_ptr,
    ht,
    wt,
    bt_ptr,
    out_ptr,
    targets_ptr,
    saved_ptr,
    argmax_ptr,
    N,
    V,
    Ds,
    Dt,
    vocab_per_split,
    stride_out,
    stride_saved,
    stride_hs,
    stride_ws,
    stride_ht,
    stride_wt,
    inv_temperature,
    s_logit_scale,
    s_softcap,
    t_logit_scale,
    t_softcap,
    beta,
    log_1m_beta,
    log_beta,
    JSD: tl.constexpr,
    S_HAS_BIAS: tl.constexpr,
    T_HAS_BIAS: tl.constexpr,
    S_HAS_SOFTCAP: tl.constexpr,
    T_HAS_SOFTCAP: tl.constexpr,
    USE_TMA: tl.constexpr,
    LOGITS_IN_MEMORY: tl.constexpr,
    DOT_FP32: tl.constexpr,
    S_DOT_PRECISION: tl.constexpr,
    T_DOT_PRECISION: tl.constexpr,
    WITH_TARGET: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """One sweep of program (i, k) over its vocabulary split, written per split at out_ptr (fields stride_out apart).
    JSD false, the record sweep: both models' records (Record's fields, the student's then the teacher's), and with
    WITH_TARGET the student's logit at each token's target (0 where this split does not hold it) in the field after
    them. JSD true, the generalized JSD's second sweep: (jsd, excess) from the saved values (saved_ptr, argmax_ptr:
    _load_saved's rows). The other mode's pointers are placeholders."""
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    v_begin, v_end = _split_range(split, vocab_per_split, V)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    BIG: tl.constexpr = 2**30
    if JSD:
        s_max, s_log_sumexp, s_rest_mass, t_max, t_log_sumexp, t_rest_mass, top_log_ratio, _excess, s_top, t_top = (
            _load_saved(saved_ptr, argmax_ptr, stride_saved, N, offs_n, n_mask)
        )
        jsd = tl.zeros((BLOCK_N,), tl.float32)
        excess = tl.zeros((BLOCK_N,), tl.float32)
    else:
        empty = tl.zeros((BLOCK_N,), tl.float32)
        no_max = tl.full((BLOCK_N,), float("-inf"), tl.float32)
        sm, sa, sr, sc, so, sz, su = no_max, empty, empty, empty, empty, empty, empty
        tm, ta, tr, tc, to, tz, tu = no_max, empty, empty, empty, empty, empty, empty
        target_logit = empty
        if WITH_TARGET:
            targets = tl.load(targets_ptr + offs_n, mask=n_mask, other=-1)
    # a split is whole tiles (num_vocab_splits): the tiles' own mask at V is the split's
    for v0 in range(v_begin, v_end, BLOCK_V):
        offs_v, zs, _, zt = _pair_tiles(
            hs,
            ws,
            bs_ptr,
            ht,
            wt,
            bt_ptr,
            pid_n * BLOCK_N,
            v0,
            N,
            V,
            Ds,
            Dt,
            stride_hs,
            stride_ws,
            stride_ht,
            stride_wt,
            inv_temperature,
            s_logit_scale,
            s_softcap,
            t_logit_scale,
            t_softcap,
            S_HAS_BIAS,
            T_HAS_BIAS,
            S_HAS_SOFTCAP,
            T_HAS_SOFTCAP,
            USE_TMA,
            LOGITS_IN_MEMORY,
            DOT_FP32,
            S_DOT_PRECISION,
            T_DOT_PRECISION,
            BLOCK_N,
            BLOCK_V,
            BLOCK_D,
        )
        if JSD:
            log_ps, top_s = _log_probs(zs, offs_v, s_max, s_log_sumexp, s_top)
            log_pt, top_t = _log_probs(zt, offs_v, t_max, t_log_sumexp, t_top)
            log_m = _log_mixture(log_ps, log_pt, top_s & top_t, s_rest_mass, t_rest_mass, beta, log_1m_beta, log_beta)
            ps = tl.exp(log_ps)
            pt = tl.exp(log_pt)
            log_ratio = log_ps - log_m
            kl_s = tl.where(ps == 0.0, 0.0, ps * log_ratio)
            kl_t = tl.where(pt == 0.0, 0.0, pt * (log_pt - log_m))
            jsd += tl.sum(beta * kl_t + (1.0 - beta) * kl_s, axis=1)
            excess += tl.sum(tl.where((ps == 0.0) | top_s, 0.0, ps * (log_ratio - top_log_ratio[:, None])), axis=1)
        else:
            m, a, r, c, o, z, u = _tile_record(zs, zt, offs_v, BIG)
            sm, sa, sr, sc, so, sz, su = _merge(sm, sa, sr, sc, so, sz, su, m, a, r, c, o, z, u)
            m, a, r, c, o, z, u = _tile_record(zt, zs, offs_v, BIG)
            tm, ta, tr, tc, to, tz, tu = _merge(tm, ta, tr, tc, to, tz, tu, m, a, r, c, o, z, u)
            if WITH_TARGET:
                # the tile's own value: at the argmax it is the record's max exactly
                target_logit += tl.sum(tl.where(offs_v[None, :] == targets[:, None], zs, 0.0), axis=1)
    out = out_ptr + split * N + offs_n
    if JSD:
        tl.store(out, jsd, mask=n_mask)
        tl.store(out + stride_out, excess, mask=n_mask)
    else:
        _store_record(out, stride_out, n_mask, sm, sa, sr, sc, so, sz, su)
        _store_record(out + 7 * stride_out, stride_out, n_mask, tm, ta, tr, tc, to, tz, tu)
        if WITH_TARGET:
            tl.store(out + 14 * stride_out, target_logit, mask=n_mask)


@triton.jit
def _backward_kernel(
    hs,
    ws,
    bs_ptr,
    ht,
    wt,
    bt_ptr,
    saved_ptr,
    argmax_ptr,
    grad_ptr,
    g_ptr,
    grad_bias_ptr,
    coefficient_max_ptr,
    g_unscale_ptr,
    targets_ptr,
    layer1_ptr,
    grad_logp_ptr,
    grad_entropy_ptr,
    N,
    V,
    Ds,
    Dt,
    N_ALL,
    stride_saved,
    stride_g,
    stride_hs,
    stride_ws,
    stride_ht,
    stride_wt,
    inv_temperature,
    s_logit_scale,
    s_softcap,
    t_logit_scale,
    t_softcap,
    beta,
    log_1m_beta,
    log_beta,
    MODE: tl.constexpr,
    S_HAS_BIAS: tl.constexpr,
    T_HAS_BIAS: tl.constexpr,
    S_HAS_SOFTCAP: tl.constexpr,
    T_HAS_SOFTCAP: tl.constexpr,
    USE_TMA: tl.constexpr,
    LOGITS_IN_MEMORY: tl.constexpr,
    COMPUTE_DB: tl.constexpr,
    SCALE_G: tl.constexpr,
    DOT_FP32: tl.constexpr,
    S_DOT_PRECISION: tl.constexpr,
    T_DOT_PRECISION: tl.constexpr,
    LAYER1: tl.constexpr,
    ENTROPY_GRAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """The g tile (pid_n, pid_v) of a chunk of N tokens; MODE 0: the forward KL, 1: the reverse KL, 2: the JSD. The
    saved values' rows are N_ALL apart (this launch's rows are a slice of them). LAYER1 (the combined head): g also
    gets layer 1's term from dL/dlogp (and dL/dentropy with ENTROPY_GRAD) and softmax_stats.BackwardStats' rows at
    layer1_ptr (N_ALL apart), as tile.tile_grad forms it."""
    pid_n = tl.program_id(0)
    pid_v = tl.program_id(1)
    offs_n, offs_v, n_mask, v_mask, g_ptrs, g_mask = gradient_tile(
        g_ptr, stride_g, pid_n, pid_v, N, V, BLOCK_N, BLOCK_V
    )
    c = tl.load(grad_ptr + offs_n, mask=n_mask, other=0.0)
    # a sum, not a max: a NaN coefficient must reach the gradient (tile.row_coefficients)
    coefficient_sum = tl.sum(tl.abs(c), axis=0)
    if LAYER1:
        grad_logp, grad_entropy, layer1_sum = row_coefficients(
            grad_logp_ptr, grad_entropy_ptr, offs_n, n_mask, ENTROPY_GRAD
        )
        coefficient_sum += layer1_sum
    if SCALE_G:
        g_scale, g_unscale = gemm_scale(tl.load(coefficient_max_ptr) * tl.abs(s_logit_scale * inv_temperature))
        tl.store(g_unscale_ptr, g_unscale, mask=(pid_n == 0) & (pid_v == 0))
    else:
        g_scale = 1.0
    if coefficient_sum == 0.0:  # rows without a gradient (masked): exactly zero
        tl.store(g_ptrs, tl.zeros((BLOCK_N, BLOCK_V), tl.float32).to(g_ptr.dtype.element_ty), mask=g_mask)
        return
    s_max, s_log_sumexp, s_rest_mass, t_max, t_log_sumexp, t_rest_mass, reference, excess, s_top, t_top = _load_saved(
        saved_ptr, argmax_ptr, stride_saved, N_ALL, offs_n, n_mask
    )
    _, zs, slope, zt = _pair_tiles(
        hs,
        ws,
        bs_ptr,
        ht,
        wt,
        bt_ptr,
        pid_n * BLOCK_N,
        pid_v * BLOCK_V,
        N,
        V,
        Ds,
        Dt,
        stride_hs,
        stride_ws,
        stride_ht,
        stride_wt,
        inv_temperature,
        s_logit_scale,
        s_softcap,
        t_logit_scale,
        t_softcap,
        S_HAS_BIAS,
        T_HAS_BIAS,
        S_HAS_SOFTCAP,
        T_HAS_SOFTCAP,
        USE_TMA,
        LOGITS_IN_MEMORY,
        DOT_FP32,
        S_DOT_PRECISION,
        T_DOT_PRECISION,
        BLOCK_N,
        BLOCK_V,
        BLOCK_D,
    )
    log_ps, top_s = _log_probs(zs, offs_v, s_max, s_log_sumexp, s_top)
    log_pt, top_t = _log_probs(zt, offs_v, t_max, t_log_sumexp, t_top)
    ps = tl.exp(log_ps)
    if MODE == 0:
        # p_s - p_t; at a shared argmax q_t - q_s from the carried rests
        dz = tl.where(top_s & top_t, (t_rest_mass - s_rest_mass)[:, None], ps - tl.exp(log_pt))
    else:
        if MODE == 1:
            relative = (zs - zt) - reference[:, None]
            weight = 1.0
        else:
            log_m = _log_mixture(log_ps, log_pt, top_s & top_t, s_rest_mass, t_rest_mass, beta, log_1m_beta, log_beta)
            relative = (log_ps - log_m) - reference[:, None]
            weight = 1.0 - beta
        relative = tl.where(top_s, 0.0, relative)
        dz = tl.where(ps == 0.0, 0.0, weight * ps * (relative - excess[:, None]))
    g = dz * c[:, None]
    if LAYER1:
        targets = tl.load(targets_ptr + offs_n, mask=n_mask, other=-1)
        stats = layer1_ptr + offs_n
        # layer 1's p is the student's p_s above (one normaliser): no lse to load, no second exp
        layer1_dz = -grad_logp[:, None] * ps
        target_dz = grad_logp[:, None] * tl.load(stats + N_ALL, mask=n_mask, other=0.0)[:, None]
        if ENTROPY_GRAD:
            mean_logit = tl.load(stats + 2 * N_ALL, mask=n_mask, other=0.0)
            mean_minus_target = tl.load(stats + 3 * N_ALL, mask=n_mask, other=0.0)
            # p is 0 where z is -inf: keep 0 * inf from forming a NaN
            layer1_dz += grad_entropy[:, None] * ps * tl.where(ps > 0.0, mean_logit[:, None] - zs, 0.0)
            target_dz += grad_entropy[:, None] * ps * mean_minus_target[:, None]
        g += tl.where(offs_v[None, :] == targets[:, None], target_dz, layer1_dz)
    g = tl.where(g_mask, g * slope, 0.0)
    if COMPUTE_DB:
        tl.atomic_add(grad_bias_ptr + offs_v, tl.sum(g, axis=0), mask=v_mask, sem="relaxed")
    tl.store(g_ptrs, to_gemm(g * g_scale, g_ptr.dtype.element_ty), mask=g_mask)


class SweepRecords(NamedTuple):
    """What the record sweep gives (``records``)."""

    student: Record  # [N], merged over the vocabulary splits; argmax global
    teacher: Record
    jsd_sweep: JsdSweep  # the JSD's second sweep over the same rows, for divergence_records.finish
    target_logit: torch.Tensor | None  # [N] fp32: the student's logit at each target (None without targets)


class Layer1Gradient(NamedTuple):
    """The combined head's layer-1 term, which ``backward`` adds to g."""

    targets: torch.Tensor  # [N] int64 target ids, rows of the weights
    stats: torch.Tensor  # [4, N] fp32: softmax_stats.BackwardStats' rows
    grad_logp: torch.Tensor  # [N] fp32: dL/dlogp
    grad_entropy: torch.Tensor | None  # [N] fp32 dL/dentropy, or None: the entropy has no gradient


def local_argmax(argmax: torch.Tensor, offset: int, rows: int) -> torch.Tensor:
    """Global argmax indices as row indices of a vocab-parallel shard's weights.

    Args:
        argmax: int64 vocabulary indices, any shape.
        offset: the vocabulary entry of the weights' first row.
        rows: the weights' row count.

    Returns:
        argmax - offset where it lies in [0, rows), else -1: a column no kernel matches (a row past the last one
        could match a masked column of the last tile).
    """
    local = argmax - offset
    return torch.where((local >= 0) & (local < rows), local, torch.full_like(local, -1))


def forward(student, teacher, beta, config=None):
    """The divergence head's forward by the Triton kernels, over a whole vocabulary.

    Args:
        student: the student's ModelHead over N > 0 tokens (hidden and weight rows contiguous).
        teacher: the teacher's ModelHead, over the same tokens and vocabulary.
        beta: in [0, 1]: 0 the forward KL, 1 the reverse KL, between the generalized JSD.
        config: the sweep's ForwardConfig (None: ``forward_config``'s).

    Returns:
        divergence_records.finish's (divergence [N] fp32, the student's entropy [N] fp32, saved [8, N] fp32,
        argmax [2, N] int64).

    Raises:
        ValueError: as ``records``.
    """
    sweep = records(student, teacher, beta, config=config)
    return finish(sweep.student, sweep.teacher, beta, sweep.jsd_sweep)


def records(student, teacher, beta, config=None, offset=0, targets=None):
    """Both models' records over the weights' rows by the record sweep, and the JSD's second sweep over them.

    Args:
        student: the student's ModelHead over N > 0 tokens (hidden and weight rows contiguous), V > 0 weight rows.
        teacher: the teacher's ModelHead, over the same tokens and weight rows.
        beta: in [0, 1] (the JSD sweep's mixture weight).
        config: the ForwardConfig (None: ``forward_config``'s).
        offset: the vocabulary entry of the weights' first row (a vocab-parallel shard's; 0 for a whole head).
        targets: None, or [N] int64 target ids, rows of these weights (the combined head, on a whole head): the
            record sweep also gathers the student's logit there.

    Returns:
        The SweepRecords: both models' records over these rows (the splits merged with divergence_records.merge,
        argmax global), the JSD sweep over these rows (given the whole vocabulary's finished records: it sums
        over these rows only), and the student's logit at each target.

    Raises:
        ValueError: no token or no weight row (a launch of no program; a caller's torch twin returns the empty
            outputs).
    """
    N = student.hidden.shape[0]
    V = student.weight.shape[0]
    if N == 0 or V == 0:
        raise ValueError(f"the divergence kernels need tokens and weight rows, got N = {N}, V = {V}")
    descriptors_fit = tensor_descriptors_fit(student.hidden, student.weight, teacher.hidden, teacher.weight)
    config = config or forward_config(student.hidden.device, student.hidden.dtype, descriptors_fit)
    use_tma = config.use_tma and descriptors_fit
    pointers = (*_tile_operands(student, use_tma, config), *_tile_operands(teacher, use_tma, config))
    arguments = dict(USE_TMA=use_tma, **_shared_arguments(student, teacher, beta, config))
    return _sweep_records(pointers, arguments, N, V, config, student.hidden, offset, targets)


def _sweep_records(pointers, arguments, N, V, config, like, offset=0, targets=None):
    """``records``' launches: the record sweep over N tokens and V weight rows, the splits' merge and the JSD sweep's
    closure, from the sweep kernel's six operands (``pointers``) and its other arguments but the sizes; ``like``: a
    tensor on the device."""
    dev = like.device
    num_splits, vocab_per_split = num_vocab_splits(N, V, config)
    grid = (triton.cdiv(N, config.block_n), num_splits)
    shared = dict(N=N, V=V, vocab_per_split=vocab_per_split, **arguments)
    with_target = targets is not None
    with on_device(like):
        split_records = torch.empty((2 * RECORD_FIELDS + with_target, num_splits, N), dtype=torch.float32, device=dev)
        # the record sweep reads no saved values: split_records stands in for their pointers
        _sweep_kernel[grid](
            *pointers,
            split_records,
            targets if with_target else split_records,
            split_records,
            split_records,
            stride_out=split_records.stride(0),
            stride_saved=0,
            JSD=False,
            WITH_TARGET=with_target,
            **shared,
        )
        fields = torch.empty((2 * RECORD_FIELDS + with_target, N), dtype=torch.float32, device=dev)
        _merge_splits_kernel[(triton.cdiv(N, MERGE_BLOCK_N),)](
            split_records,
            fields,
            N,
            num_splits,
            split_records.stride(0),
            WITH_TARGET=with_target,
            BLOCK_N=MERGE_BLOCK_N,
        )
        student_record, teacher_record = (
            Record(f[0], f[1].to(torch.int64) + offset, f[2], f[3], f[4], f[5], f[6] > 0)
            for f in (fields[:RECORD_FIELDS], fields[RECORD_FIELDS : 2 * RECORD_FIELDS])
        )
        target_logit = fields[2 * RECORD_FIELDS] if with_target else None

    def jsd_sweep(student_finished, teacher_finished, top_log_ratio):
        with on_device(like):
            saved = torch.stack(
                [*student_finished[:3], *teacher_finished[:3], top_log_ratio, torch.zeros_like(top_log_ratio)]
            )
            argmax = local_argmax(torch.stack([student_finished.argmax, teacher_finished.argmax]), offset, V)
            out = torch.empty((2, num_splits, N), dtype=torch.float32, device=dev)
            # the JSD sweep gathers no target: out stands in for the targets' pointer
            _sweep_kernel[grid](
                *pointers,
                out,
                out,
                saved,
                argmax,
                stride_out=out.stride(0),
                stride_saved=saved.stride(0),
                JSD=True,
                WITH_TARGET=False,
                **shared,
            )
            jsd, excess = out.sum(1).unbind(0)
        return jsd, excess

    return SweepRecords(student_record, teacher_record, jsd_sweep, target_logit)


@on_first_argument_device
def backward(grad_divergence, student, teacher, saved, argmax, beta, grads, config=None, offset=0, layer1=None):
    """The student's gradients by the backward kernel (g per token chunk) and cuBLAS (dH, dW).

    Args:
        grad_divergence: [N] fp32 dL/d divergence, contiguous.
        student: the student's ModelHead over N > 0 tokens (rows contiguous).
        teacher: the teacher's ModelHead, over the same tokens and weight rows.
        saved: [8, N] fp32, the forward's saved values (divergence_records.SAVED_FIELDS) over the whole vocabulary.
        argmax: [2, N] int64, the forward's global argmax indices.
        beta: the forward's beta.
        grads: the fp32 buffers (grad_hidden [N, Ds], written; grad_weight [V, Ds] and grad_bias [V], zero on entry,
            accumulated), each None where not wanted.
        config: the BackwardConfig (None: ``backward_config``'s).
        offset: the weights' row v is vocabulary entry offset + v (a vocab-parallel shard).
        layer1: the combined head's layer-1 term (a whole head, offset 0), or None.
    """
    _, grad_weight, grad_bias = grads
    N, Ds = student.hidden.shape
    V = student.weight.shape[0]
    dev = student.hidden.device
    descriptors_fit = tensor_descriptors_fit(student.hidden, student.weight, teacher.hidden, teacher.weight)
    if config is None:
        narrow = narrow_g_epilogue(student, teacher, beta, layer1 is not None)
        config = backward_config(dev, student.hidden.dtype, layer1 is not None, descriptors_fit, narrow)
    chunk = chunk_size(N, Ds)
    g = torch.empty((chunk, V), dtype=student.hidden.dtype, device=dev)
    scaled = student.hidden.dtype != torch.float32
    if scaled:
        # the bound of the coefficients of g (tile.gemm_scale): |c| + |dL/dlogp| + |dL/dentropy|
        bound = grad_divergence.abs()
        for extra in (layer1.grad_logp, layer1.grad_entropy) if layer1 is not None else ():
            if extra is not None:
                bound = bound + extra.abs()
        coefficient_max = bound.amax().reshape(1)
    else:
        coefficient_max = saved  # a placeholder: SCALE_G is off
    g_unscale = torch.ones(1, dtype=torch.float32, device=dev)
    use_tma = config.use_tma and descriptors_fit
    student_weight, teacher_weight = (
        tile_operand(w, use_tma, config.block_v, config.block_d) for w in (student.weight, teacher.weight)
    )
    student_bias, teacher_bias = _pointers(student)[2], _pointers(teacher)[2]
    shared = dict(USE_TMA=use_tma, **_shared_arguments(student, teacher, beta, config))
    argmax = local_argmax(argmax, offset, V)
    for n0 in range(0, N, chunk):
        n1 = min(n0 + chunk, N)
        grid = (triton.cdiv(n1 - n0, config.block_n), triton.cdiv(V, config.block_v))
        _backward_kernel[grid](
            tile_operand(student.hidden[n0:n1], use_tma, config.block_n, config.block_d),
            student_weight,
            student_bias,
            tile_operand(teacher.hidden[n0:n1], use_tma, config.block_n, config.block_d),
            teacher_weight,
            teacher_bias,
            saved[:, n0:],
            argmax[:, n0:],
            grad_divergence[n0:n1],
            g,
            grad_bias if grad_bias is not None else saved,
            coefficient_max,
            g_unscale,
            *_layer1_rows(layer1, n0, n1, placeholder=saved),
            N=n1 - n0,
            V=V,
            N_ALL=N,
            stride_saved=saved.stride(0),
            stride_g=g.stride(0),
            MODE=_g_mode(beta),
            COMPUTE_DB=grad_bias is not None,
            SCALE_G=scaled,
            LAYER1=layer1 is not None,
            ENTROPY_GRAD=layer1 is not None and layer1.grad_entropy is not None,
            **shared,
        )
        _student_gradients(g[: n1 - n0], student, n0, n1, grads, g_unscale if scaled else None)
    if scaled and grad_weight is not None:
        grad_weight.mul_(g_unscale)


def _g_mode(beta):
    """The g kernel's MODE: 0 the forward KL, 1 the reverse KL, 2 the JSD."""
    return 0 if beta == 0.0 else 1 if beta == 1.0 else 2


def _student_gradients(g_rows, student, n0, n1, grads, g_unscale):
    """cuBLAS's products of the g rows of tokens [n0, n1), fp32 outputs: dH of those rows written (times
    ``g_unscale``, g's power-of-two scale undone, where it is not None) and dW accumulated (its scale undone by the
    caller once, after the last chunk)."""
    grad_hidden, grad_weight, _ = grads
    if grad_hidden is not None:
        mm_fp32(g_rows, student.weight, grad_hidden[n0:n1], accumulate=False)
        if g_unscale is not None:
            grad_hidden[n0:n1].mul_(g_unscale)
    if grad_weight is not None:
        mm_fp32(g_rows.T, student.hidden[n0:n1], grad_weight, accumulate=True)


# The sweeps over products in memory (``loss_gradients``): no dot, memory-bound (two fp32 tiles in, the records or g
# out), one table for every arch and dtype: 8 x 128 on 4 warps, 8 elements of each tile a thread. sm_compile (sm_90,
# triton 3.9): the record sweep 127 registers with a bias and a soft-cap too, 4 CTAs (16 warps) an SM; the g kernel
# 38-89 registers, 5-12 CTAs; no spill. 16 x 128 on 4 warps: 168 registers, and with a bias and a soft-cap 255 and an
# 8-byte stack spill; 32 x 128 on 8 warps: one CTA an SM.
STORED_TILES = dict(block_n=8, block_v=128, block_d=16, num_warps=4, num_stages=2)


def gpu_stored_configs(sm_count: int) -> tuple[ForwardConfig, BackwardConfig]:
    """The compiled record sweep's and g kernel's launches over products in memory (STORED_TILES) on a GPU of
    ``sm_count`` multiprocessors."""
    tiles = dict(STORED_TILES, dot_fp32=False)
    return ForwardConfig(**tiles, target_programs=sm_count), BackwardConfig(**tiles, group_v=1)


def stored_configs(device: torch.device) -> tuple[ForwardConfig, BackwardConfig]:
    """``gpu_stored_configs`` on ``device`` (the interpreter's small tiles on a CPU)."""
    if not _compiled(device):
        return ForwardConfig(**_INTERPRETER_TILES, target_programs=8), BackwardConfig(**_INTERPRETER_TILES, group_v=1)
    return gpu_stored_configs(_device_props(device)[0])


def loss_chunk_rows(N: int, Ds: int) -> int:
    """Tokens per gradient GEMM of ``loss_gradients`` (the logits are formed for half of them at a time): half the
    student's width rounded down to 128 (384 at Qwen2.5-0.5B's Ds 896), at least 32, at most N. Its buffers, rows x V
    x (2 + 4) bytes of g and the two models' fp32 logits (4 + 4 from fp32 inputs), stay within 1.25x the unfused
    head's peak (dW's fp32 V x Ds x 4 and a g chunk of Ds x V in the student's dtype); fewer rows add dW's fp32
    accumulator traffic (V x Ds x 8 bytes a GEMM)."""
    return min(N, max(32, (Ds // 2) // 128 * 128))


class LossLayer1(NamedTuple):
    """The combined GRPO + distillation loss's layer-1 term for ``loss_gradients``."""

    targets: torch.Tensor  # [N] int64 target ids
    # (n0, n1, logp [n1 - n0], entropy [n1 - n0]) -> dL/dlogp of those tokens [n1 - n0] fp32: the layer-2 gradient
    # of a loss whose token values read no other token's log-prob (called once per chunk, in order)
    coefficients: object


@on_first_argument_device
def loss_gradients(student, teacher, beta, weights, grads, token_chunk=None, configs=None, layer1=None):
    """The divergence and its loss's gradients in one pass: the student's three GEMM sweeps and the teacher's one
    (against ``forward`` + ``backward``'s recompute: four and two), for the loss L = sum_n weights_n div_n, whose
    dL/d div is known before the forward (``weights``), plus with ``layer1`` a layer-2 loss of the student's
    log-probs whose dL/dlogp is known token by token as soon as the token's log-prob is (the combined head's: the
    record sweep also gathers the student's logit at each target, layer 1's record follows from the student's
    (``divergence_records.layer1_record``), and g gains layer 1's term).

    Per chunk of rows (``token_chunk``, ``loss_chunk_rows``'s by default) and per half of it: cuBLAS forms both
    models' fp32 products u = H W^T (1), the record sweep and the JSD sweep read them (``LOGITS_IN_MEMORY``: the
    same kernels and formulas as ``records``, the tiles from memory), ``finish`` gives the rows' divergence, and the
    g kernel writes g = weights_n d div / d u_s into the chunk's g rows, rounded to the student's dtype (fp16's: first
    scaled by an exact power of two from the weights' bound, as ``backward``'s; bf16 has fp32's exponent range); then
    dH = g W_s (2) and dW += g^T H_s (3) on cuBLAS with fp32 outputs, db from the g kernel's column sums. Where no
    gradient is wanted (``grads`` all None) no g is formed.

    Memory: g, rows x V in the student's dtype; both models' fp32 products, rows / 2 x V each; the merged records
    of rows / 2 tokens; the fp32 gradients are the caller's.

    Args:
        student: the student's ModelHead over N > 0 tokens (rows contiguous), V > 0 weight rows.
        teacher: the teacher's ModelHead over the same tokens and weight rows.
        beta: in [0, 1].
        weights: [N] fp32 dL/d div of each token, contiguous.
        grads: (grad_hidden [N, Ds], written; grad_weight [V, Ds] and grad_bias [V], zero on entry, accumulated),
            fp32, each None where not wanted.
        token_chunk: rows per gradient GEMM (None: ``loss_chunk_rows``'s).
        configs: (ForwardConfig, BackwardConfig) of the sweeps (None: ``stored_configs``').
        layer1: a LossLayer1, or None (bf16 or fp32 only: its dL/dlogp comes chunk by chunk, so no scale for fp16's
            range can be chosen before the first g).

    Returns:
        (divergence [N] fp32, the student's entropy [N] fp32 (with ``layer1`` by layer 1's record, as the log-probs),
        its log-probs [N] fp32 or None without ``layer1``).

    Raises:
        ValueError: no token or no weight row; ``layer1`` with fp16 inputs.
    """
    _, grad_weight, grad_bias = grads
    N, Ds = student.hidden.shape
    V = student.weight.shape[0]
    if N == 0 or V == 0:
        raise ValueError(f"the divergence kernels need tokens and weight rows, got N = {N}, V = {V}")
    dev, dtype = student.hidden.device, student.hidden.dtype
    scaled = dtype == torch.float16
    if layer1 is not None and scaled:
        raise ValueError("loss_gradients with a layer-1 term takes bf16 or fp32 inputs, not fp16")
    sweep_config, g_config = configs or stored_configs(dev)
    rows = min(N, token_chunk or loss_chunk_rows(N, Ds))
    half = (rows + 1) // 2
    products = [torch.empty((half, V), dtype=torch.float32, device=dev) for _ in range(2)]
    want_g = any(grad is not None for grad in grads)
    g = torch.empty((rows, V), dtype=dtype, device=dev) if want_g else None
    coefficient_max = weights.abs().amax().reshape(1) if scaled and want_g else weights  # weights: a placeholder
    g_unscale = torch.ones(1, dtype=torch.float32, device=dev)
    divergence = torch.empty(N, dtype=torch.float32, device=dev)
    entropy = torch.empty(N, dtype=torch.float32, device=dev)
    logp = torch.empty(N, dtype=torch.float32, device=dev) if layer1 is not None else None
    # the kernels read both products (rows V apart; a chunk's rows are the buffers' first ones, N masks the rest)
    pointers = (products[0], products[0], _pointers(student)[2], products[1], products[1], _pointers(teacher)[2])
    stored = dict(USE_TMA=False, LOGITS_IN_MEMORY=True, stride_hs=V, stride_ht=V)
    sweep_arguments, g_arguments = (
        {**_shared_arguments(student, teacher, beta, config), **stored} for config in (sweep_config, g_config)
    )
    for r0 in range(0, N, rows):
        r1 = min(r0 + rows, N)
        for n0 in range(r0, r1, half):
            n1 = min(n0 + half, r1)
            zs, zt = (z[: n1 - n0] for z in products)
            mm_fp32(student.hidden[n0:n1], student.weight.T, zs, accumulate=False)
            mm_fp32(teacher.hidden[n0:n1], teacher.weight.T, zt, accumulate=False)
            targets = layer1.targets[n0:n1] if layer1 is not None else None
            sweep = _sweep_records(pointers, sweep_arguments, n1 - n0, V, sweep_config, zs, targets=targets)
            div, ent, saved, argmax = finish(sweep.student, sweep.teacher, beta, sweep.jsd_sweep)
            divergence[n0:n1], entropy[n0:n1] = div, ent
            layer1_term = None
            if layer1 is not None:
                record = layer1_record(sweep.student, targets, sweep.target_logit)
                logp[n0:n1], entropy[n0:n1], stats = softmax_stats.finish(record, True)
                grad_logp = layer1.coefficients(n0, n1, logp[n0:n1], entropy[n0:n1]).float().contiguous()
                layer1_term = Layer1Gradient(targets, torch.stack(tuple(stats)), grad_logp, None)
            if not want_g:
                continue
            g_rows = g[n0 - r0 : n1 - r0]
            grid = (triton.cdiv(n1 - n0, g_config.block_n), triton.cdiv(V, g_config.block_v))
            with on_device(zs):
                _backward_kernel[grid](
                    *pointers,
                    saved,
                    local_argmax(argmax, 0, V),
                    weights[n0:n1],
                    g_rows,
                    grad_bias if grad_bias is not None else saved,
                    coefficient_max,
                    g_unscale,
                    *_layer1_rows(layer1_term, 0, n1 - n0, placeholder=saved),
                    N=n1 - n0,
                    V=V,
                    N_ALL=n1 - n0,
                    stride_saved=saved.stride(0),
                    stride_g=g_rows.stride(0),
                    MODE=_g_mode(beta),
                    COMPUTE_DB=grad_bias is not None,
                    SCALE_G=scaled,
                    LAYER1=layer1_term is not None,
                    ENTROPY_GRAD=False,
                    **g_arguments,
                )
        if want_g:
            _student_gradients(g[: r1 - r0], student, r0, r1, grads, g_unscale if scaled else None)
    if scaled and grad_weight is not None:
        grad_weight.mul_(g_unscale)
    return divergence, entropy, logp


def _tile_operands(model, use_tma, config):
    """``_pointers``, the hidden states and weight as tensor descriptors of the config's blocks with ``use_tma``."""
    hidden, weight, bias = _pointers(model)
    return (
        tile_operand(hidden, use_tma, config.block_n, config.block_d),
        tile_operand(weight, use_tma, config.block_v, config.block_d),
        bias,
    )


def _pointers(model):
    """A model's hidden states, weight and bias; the hidden states stand in for a missing bias (never read then)."""
    return model.hidden, model.weight, model.bias if model.bias is not None else model.hidden


def _layer1_rows(layer1, n0, n1, placeholder):
    """The backward kernel's four layer-1 pointers for the token rows [n0, n1) (placeholders without ``layer1``)."""
    if layer1 is None:
        return (placeholder,) * 4
    grad_entropy = layer1.grad_entropy if layer1.grad_entropy is not None else layer1.grad_logp
    return layer1.targets[n0:n1], layer1.stats[:, n0:], layer1.grad_logp[n0:n1], grad_entropy[n0:n1]


def _shared_arguments(student, teacher, beta, config):
    """The arguments both kernels take alike: the models' sizes and row strides, the transforms' and beta's scalars,
    the models' and the tiles' constexprs, the launch's warps and stages."""
    inv_temperature, s_logit_scale, s_softcap = student.transform.kernel_scalars()
    _, t_logit_scale, t_softcap = teacher.transform.kernel_scalars()
    inner = 0.0 < beta < 1.0  # the JSD's logs (the other modes read none)
    return dict(
        Ds=student.hidden.shape[1],
        Dt=teacher.hidden.shape[1],
        stride_hs=student.hidden.stride(0),
        stride_ws=student.weight.stride(0),
        stride_ht=teacher.hidden.stride(0),
        stride_wt=teacher.weight.stride(0),
        inv_temperature=inv_temperature,
        s_logit_scale=s_logit_scale,
        s_softcap=s_softcap,
        t_logit_scale=t_logit_scale,
        t_softcap=t_softcap,
        beta=float(beta),
        log_1m_beta=math.log1p(-beta) if inner else 0.0,
        log_beta=math.log(beta) if inner else 0.0,
        S_HAS_BIAS=student.bias is not None,
        T_HAS_BIAS=teacher.bias is not None,
        S_HAS_SOFTCAP=student.transform.softcap is not None,
        T_HAS_SOFTCAP=teacher.transform.softcap is not None,
        LOGITS_IN_MEMORY=False,
        DOT_FP32=config.dot_fp32,
        S_DOT_PRECISION=config.dot_precision(student.hidden.dtype),
        T_DOT_PRECISION=config.dot_precision(teacher.hidden.dtype),
        BLOCK_N=config.block_n,
        BLOCK_V=config.block_v,
        BLOCK_D=config.block_d,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
