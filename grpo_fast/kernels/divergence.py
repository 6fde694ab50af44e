"""The divergence head's Triton kernels: both models' logit tiles in registers, the records of
grpo_fast/divergence_torch.py (which has the math, the exactness and the sweep counts), no [N, V] buffer.

* ``_sweep_kernel``: program (i, k) builds the student's and the teacher's BLOCK_N x BLOCK_V logit tiles (two
  K-loops, fp32 accumulators: tile.logit_tile) over the vocabulary range k, in one of two modes. The record sweep
  folds them into one record per model (max, argmax, rest, cross, other, zsum, unsupported), written per vocabulary
  split; the epilogue merges the splits with divergence_torch.merge (the same merge as the torch twin's chunks) and
  finishes with divergence_torch.finish. The JSD sweep (JSD): the generalized JSD's second sweep (0 < beta < 1)
  over the finished records, per split, summed in the epilogue.
* ``_backward_kernel``: recomputes both tiles for a chunk of at most ``gemm.chunk_size`` tokens and writes
  g = c d div / d z_s * dz_s/du (fp32 for fp32 inputs; else scaled by an exact power of two and rounded to the
  input dtype, tile.gemm_scale, as kernels/backward.py's chunked mode) and adds its column sums to db; cuBLAS does
  dH = g W_s and dW_s += g^T H_s with fp32 outputs (gemm.mm_fp32).
The argmax indices travel as fp32 in the split records (exact: V <= config.MAX_VOCAB < 2^24).
The combined GRPO + distillation head (grpo_fast/teacher_head.py) runs the same kernels: the record sweep also gathers
the student's logit at each target (WITH_TARGET), the backward adds layer 1's logit gradient to g (LAYER1).
"""

import torch
import triton
import triton.language as tl

from grpo_fast.distillation import torch_twin as divergence_torch

from .config import _INTERPRETER_TILES, BackwardConfig, ForwardConfig, _compiled, _device_props
from .forward import num_vocab_splits
from .gemm import chunk_size, mm_fp32
from .launch import on_first_argument_device
from .tile import gemm_scale, gradient_tile, logit_tile, row_coefficients, to_gemm

# the record fields of one model in the split buffer, in divergence_torch.Record's order
RECORD_FIELDS = len(divergence_torch.Record._fields)


def gpu_forward_config(dtype, sm_count):
    """The compiled sweep kernel's launch (both modes): two logit tiles live at once, so half the log-prob forward's
    vocabulary width (tools/sm_compile.py: no spills on sm_90 / 89 / 80)."""
    if dtype == torch.float32:
        # IEEE fp32 products on the FMA units: 8 warps keep both tiles' registers in bounds
        tiles = dict(block_n=32, block_v=64, block_d=32, num_warps=8, num_stages=2)
    else:
        tiles = dict(block_n=64, block_v=64, block_d=64, num_warps=8, num_stages=2)
    return ForwardConfig(**tiles, dot_fp32=False, target_programs=sm_count)


def gpu_backward_config(dtype, layer1=False):
    """The compiled backward's launch (both tiles and the gradient's epilogue live at once); ``layer1``: the combined
    head's, whose half-precision epilogue holds layer 1's term too (a narrower vocabulary tile: no spills)."""
    if dtype == torch.float32:
        tiles = dict(block_n=32, block_v=32, block_d=32, num_warps=4, num_stages=2)
    else:
        tiles = dict(block_n=64, block_v=32 if layer1 else 64, block_d=64, num_warps=8, num_stages=2)
    return BackwardConfig(**tiles, dot_fp32=False, group_v=1)


def forward_config(device, dtype):
    if not _compiled(device):
        return ForwardConfig(**_INTERPRETER_TILES, target_programs=8)
    return gpu_forward_config(dtype, _device_props(device)[0])


def backward_config(device, dtype, layer1=False):
    if not _compiled(device):
        return BackwardConfig(**_INTERPRETER_TILES, group_v=1)
    return gpu_backward_config(dtype, layer1)


@triton.jit
def _model_tile(hidden_ptr, weight_ptr, bias_ptr, offs_n, offs_v, n_mask, v_mask, D, stride_hn, stride_wv,
                inv_temperature, logit_scale, softcap, HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
                DOT_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr):  # fmt: skip
    """One model's transformed logits (-inf past the vocabulary) and dz/du: tile.logit_tile without LoRA."""
    return logit_tile(
        hidden_ptr,
        weight_ptr,
        bias_ptr,
        hidden_ptr,
        weight_ptr,
        offs_n,
        offs_v,
        n_mask,
        v_mask,
        D,
        0,
        stride_hn,
        1,
        stride_wv,
        1,
        inv_temperature,
        logit_scale,
        softcap,
        HAS_BIAS,
        False,
        HAS_SOFTCAP,
        DOT_FP32,
        DOT_PRECISION,
        DOT_PRECISION,
        BLOCK_N,
        BLOCK_V,
        BLOCK_D,
        16,
    )


@triton.jit
def _pair_tiles(hs_ptr, ws_ptr, bs_ptr, ht_ptr, wt_ptr, bt_ptr, offs_n, n_mask, v0, v_end, Ds, Dt,
                stride_hs, stride_ws, stride_ht, stride_wt,
                inv_temperature, s_logit_scale, s_softcap, t_logit_scale, t_softcap,
                S_HAS_BIAS: tl.constexpr, T_HAS_BIAS: tl.constexpr, S_HAS_SOFTCAP: tl.constexpr,
                T_HAS_SOFTCAP: tl.constexpr, DOT_FP32: tl.constexpr, S_DOT_PRECISION: tl.constexpr,
                T_DOT_PRECISION: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr,
                BLOCK_D: tl.constexpr):  # fmt: skip
    """The vocabulary tile at v0 (entries from v_end on masked): its indices, both models' transformed logits (two
    K-loops) and the student's slope dz/du."""
    offs_v = v0 + tl.arange(0, BLOCK_V)
    v_mask = offs_v < v_end
    zs, slope = _model_tile(hs_ptr, ws_ptr, bs_ptr, offs_n, offs_v, n_mask, v_mask, Ds, stride_hs, stride_ws,
                            inv_temperature, s_logit_scale, s_softcap, S_HAS_BIAS, S_HAS_SOFTCAP, DOT_FP32,
                            S_DOT_PRECISION, BLOCK_N, BLOCK_V, BLOCK_D)  # fmt: skip
    zt, _ = _model_tile(ht_ptr, wt_ptr, bt_ptr, offs_n, offs_v, n_mask, v_mask, Dt, stride_ht, stride_wt,
                        inv_temperature, t_logit_scale, t_softcap, T_HAS_BIAS, T_HAS_SOFTCAP, DOT_FP32,
                        T_DOT_PRECISION, BLOCK_N, BLOCK_V, BLOCK_D)  # fmt: skip
    return offs_v, zs, slope, zt


@triton.jit
def _split_range(split, vocab_per_split, V):
    """The vocabulary entries [begin, end) of a sweep program's split."""
    begin = split * vocab_per_split
    return begin, tl.minimum(begin + vocab_per_split, V)


@triton.jit
def _load_saved(saved_ptr, argmax_ptr, stride_saved, stride_argmax, offs_n, n_mask):
    """A token block's divergence_torch.SAVED_FIELDS (8 rows) and both argmax indices."""
    fields = saved_ptr + offs_n
    return (
        tl.load(fields, mask=n_mask, other=0.0),
        tl.load(fields + stride_saved, mask=n_mask, other=0.0),
        tl.load(fields + 2 * stride_saved, mask=n_mask, other=0.0),
        tl.load(fields + 3 * stride_saved, mask=n_mask, other=0.0),
        tl.load(fields + 4 * stride_saved, mask=n_mask, other=0.0),
        tl.load(fields + 5 * stride_saved, mask=n_mask, other=0.0),
        tl.load(fields + 6 * stride_saved, mask=n_mask, other=0.0),
        tl.load(fields + 7 * stride_saved, mask=n_mask, other=0.0),
        tl.load(argmax_ptr + offs_n, mask=n_mask, other=-1),
        tl.load(argmax_ptr + stride_argmax + offs_n, mask=n_mask, other=-1),
    )


@triton.jit
def _tile_record(z, z_other, offs_v, BIG: tl.constexpr):
    """divergence_torch.tile_record in registers: (max, argmax, rest, cross, other, zsum, unsupported)."""
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
    """divergence_torch.merge in registers: the first record holds the lower indices (it wins ties)."""
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
    tl.store(ptr, m, mask=mask)
    tl.store(ptr + stride_field, a, mask=mask)
    tl.store(ptr + 2 * stride_field, r, mask=mask)
    tl.store(ptr + 3 * stride_field, c, mask=mask)
    tl.store(ptr + 4 * stride_field, o, mask=mask)
    tl.store(ptr + 5 * stride_field, z, mask=mask)
    tl.store(ptr + 6 * stride_field, u, mask=mask)


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
    hs_ptr, ws_ptr, bs_ptr, ht_ptr, wt_ptr, bt_ptr, out_ptr, targets_ptr, saved_ptr, argmax_ptr,
    N, V, Ds, Dt, vocab_per_split, stride_out, stride_saved,
    stride_hs, stride_ws, stride_ht, stride_wt,
    inv_temperature, s_logit_scale, s_softcap, t_logit_scale, t_softcap, beta, log_1m_beta, log_beta,
    JSD: tl.constexpr,
    S_HAS_BIAS: tl.constexpr, T_HAS_BIAS: tl.constexpr, S_HAS_SOFTCAP: tl.constexpr, T_HAS_SOFTCAP: tl.constexpr,
    DOT_FP32: tl.constexpr, S_DOT_PRECISION: tl.constexpr, T_DOT_PRECISION: tl.constexpr,
    WITH_TARGET: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """One sweep of program (i, k) over its vocabulary split, written per split at out_ptr (fields stride_out apart).
    JSD false, the record sweep: both models' records (divergence_torch.Record's fields, the student's then the
    teacher's), WITH_TARGET also the student's logit at each token's target (0 where this split does not hold it)
    in the field after them (the combined head, grpo_fast/teacher_head.py). JSD true, the generalized JSD's second
    sweep: (jsd, excess) from the saved values (saved_ptr, argmax_ptr: _load_saved's rows). The other mode's
    pointers are placeholders."""
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
    for v0 in range(v_begin, v_end, BLOCK_V):
        offs_v, zs, _, zt = _pair_tiles(hs_ptr, ws_ptr, bs_ptr, ht_ptr, wt_ptr, bt_ptr, offs_n, n_mask, v0, v_end, Ds,
                                        Dt, stride_hs, stride_ws, stride_ht, stride_wt, inv_temperature, s_logit_scale,
                                        s_softcap, t_logit_scale, t_softcap, S_HAS_BIAS, T_HAS_BIAS, S_HAS_SOFTCAP,
                                        T_HAS_SOFTCAP, DOT_FP32, S_DOT_PRECISION, T_DOT_PRECISION, BLOCK_N, BLOCK_V,
                                        BLOCK_D)  # fmt: skip
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
    hs_ptr, ws_ptr, bs_ptr, ht_ptr, wt_ptr, bt_ptr, saved_ptr, argmax_ptr, grad_ptr, g_ptr, grad_bias_ptr,
    coefficient_max_ptr, g_unscale_ptr, targets_ptr, layer1_ptr, grad_logp_ptr, grad_entropy_ptr,
    N, V, Ds, Dt, N_ALL, stride_saved, stride_g,
    stride_hs, stride_ws, stride_ht, stride_wt,
    inv_temperature, s_logit_scale, s_softcap, t_logit_scale, t_softcap, beta, log_1m_beta, log_beta,
    MODE: tl.constexpr, S_HAS_BIAS: tl.constexpr, T_HAS_BIAS: tl.constexpr, S_HAS_SOFTCAP: tl.constexpr,
    T_HAS_SOFTCAP: tl.constexpr, COMPUTE_DB: tl.constexpr, SCALE_G: tl.constexpr,
    DOT_FP32: tl.constexpr, S_DOT_PRECISION: tl.constexpr, T_DOT_PRECISION: tl.constexpr,
    LAYER1: tl.constexpr, ENTROPY_GRAD: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """MODE 0: forward KL, 1: reverse KL, 2: JSD. The saved values' rows are N_ALL apart (this launch's rows are a
    slice of them). LAYER1 (the combined head, grpo_fast/teacher_head.py): g also gets layer 1's term from dL/dlogp
    (and dL/dentropy with ENTROPY_GRAD) and softmax_stats.BackwardStats' rows at layer1_ptr (N_ALL apart), as
    tile.tile_grad forms it."""
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
        hs_ptr,
        ws_ptr,
        bs_ptr,
        ht_ptr,
        wt_ptr,
        bt_ptr,
        offs_n,
        n_mask,
        pid_v * BLOCK_V,
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


def _scalars(student_transform, teacher_transform):
    inv_t, s_scale, s_softcap = student_transform.kernel_scalars()
    _, t_scale, t_softcap = teacher_transform.kernel_scalars()
    return dict(
        inv_temperature=inv_t, s_logit_scale=s_scale, s_softcap=s_softcap, t_logit_scale=t_scale, t_softcap=t_softcap
    )


def _model_constexprs(
    student_hidden, student_bias, teacher_hidden, teacher_bias, student_transform, teacher_transform, config
):
    return dict(S_HAS_BIAS=student_bias is not None, T_HAS_BIAS=teacher_bias is not None,
                S_HAS_SOFTCAP=student_transform.softcap is not None,
                T_HAS_SOFTCAP=teacher_transform.softcap is not None, DOT_FP32=config.dot_fp32,
                S_DOT_PRECISION=config.dot_precision(student_hidden.dtype),
                T_DOT_PRECISION=config.dot_precision(teacher_hidden.dtype),
                BLOCK_N=config.block_n, BLOCK_V=config.block_v, BLOCK_D=config.block_d,
                num_warps=config.num_warps, num_stages=config.num_stages)  # fmt: skip


def _beta_scalars(beta):
    import math

    inner = 0.0 < beta < 1.0
    return dict(
        beta=float(beta), log_1m_beta=math.log1p(-beta) if inner else 0.0, log_beta=math.log(beta) if inner else 0.0
    )


def local_argmax(argmax, offset, rows):
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


@on_first_argument_device
def forward(student_hidden, student_weight, student_bias, teacher_hidden, teacher_weight, teacher_bias, beta,
            student_transform, teacher_transform, config=None):  # fmt: skip
    """divergence_torch.forward's outputs by the Triton kernels (rows contiguous, N >= 0)."""
    if student_hidden.shape[0] == 0:
        return divergence_torch.forward(student_hidden, student_weight, student_bias, teacher_hidden,
                                        teacher_weight, teacher_bias, beta, student_transform,
                                        teacher_transform)[:4]  # fmt: skip
    run_s, run_t, jsd_sweep = records(student_hidden, student_weight, student_bias, teacher_hidden, teacher_weight,
                                      teacher_bias, beta, student_transform, teacher_transform,
                                      config=config)[:3]  # fmt: skip
    return divergence_torch.finish(run_s, run_t, beta, jsd_sweep)


@on_first_argument_device
def records(student_hidden, student_weight, student_bias, teacher_hidden, teacher_weight, teacher_bias, beta,
            student_transform, teacher_transform, config=None, offset=0, targets=None):  # fmt: skip
    """Both models' records over the weights' rows by the record sweep, and the JSD's second sweep over them.

    Args:
        student_hidden, student_weight, student_bias, teacher_hidden, teacher_weight, teacher_bias: [N, Ds],
            [V, Ds], [V] | None, [N, Dt], [V, Dt], [V] | None; rows contiguous, N > 0, V > 0.
        beta, student_transform, teacher_transform: as divergence_torch.forward.
        config: the launch (None: forward_config's).
        offset: the vocabulary entry of the weights' first row (a vocab-parallel shard's; 0 for a whole head).
        targets: None, or [N] int64 target ids, rows of these weights (the combined head,
            grpo_fast/teacher_head.py, on a whole head): the record sweep also gathers the student's logit there.

    Returns:
        (student, teacher, jsd_sweep, target_logit): both models' divergence_torch.Records [N] (the kernel's
        per-split records merged with divergence_torch.merge; argmax indices global), divergence_torch.finish's
        ``jsd_sweep`` over these rows (given the whole vocabulary's finished records), and the student's logit at
        each target [N] fp32 (None without ``targets``).
    """
    N, Ds = student_hidden.shape
    Dt = teacher_hidden.shape[1]
    V = student_weight.shape[0]
    dev = student_hidden.device
    config = config or forward_config(dev, student_hidden.dtype)
    num_splits, vocab_per_split = num_vocab_splits(N, V, config)
    grid = (triton.cdiv(N, config.block_n), num_splits)
    split_records = torch.empty(
        (2 * RECORD_FIELDS + (targets is not None), num_splits, N), dtype=torch.float32, device=dev
    )
    models = (student_hidden, student_weight, student_bias if student_bias is not None else student_hidden,
              teacher_hidden, teacher_weight, teacher_bias if teacher_bias is not None else teacher_hidden)  # fmt: skip
    common = dict(N=N, V=V, Ds=Ds, Dt=Dt, vocab_per_split=vocab_per_split,
                  stride_hs=student_hidden.stride(0), stride_ws=student_weight.stride(0),
                  stride_ht=teacher_hidden.stride(0), stride_wt=teacher_weight.stride(0),
                  **_scalars(student_transform, teacher_transform), **_beta_scalars(beta),
                  **_model_constexprs(student_hidden, student_bias, teacher_hidden, teacher_bias, student_transform,
                                      teacher_transform, config))  # fmt: skip
    # the record sweep reads no saved values: split_records stands in for their pointers
    _sweep_kernel[grid](
        *models,
        split_records,
        targets if targets is not None else split_records,
        split_records,
        split_records,
        stride_out=split_records.stride(0),
        stride_saved=0,
        JSD=False,
        WITH_TARGET=targets is not None,
        **common,
    )
    runs = []
    for fields in (split_records[:RECORD_FIELDS], split_records[RECORD_FIELDS : 2 * RECORD_FIELDS]):
        per_split = [
            divergence_torch.Record(f[0], f[1].to(torch.int64) + offset, f[2], f[3], f[4], f[5], f[6] > 0)
            for f in fields.unbind(1)
        ]
        run = per_split[0]
        for split in per_split[1:]:
            run = divergence_torch.merge(run, split)
        runs.append(run)

    def jsd_sweep(student, teacher, top_log_ratio):
        saved = torch.stack([*student[:3], *teacher[:3], top_log_ratio, torch.zeros_like(top_log_ratio)])
        argmax = local_argmax(torch.stack([student.argmax, teacher.argmax]), offset, V)
        out = torch.empty((2, num_splits, N), dtype=torch.float32, device=dev)
        # the JSD sweep gathers no target: out stands in for the targets' pointer
        _sweep_kernel[grid](*models, out, out, saved, argmax, stride_out=out.stride(0), stride_saved=saved.stride(0),
                            JSD=True, WITH_TARGET=False, **common)  # fmt: skip
        jsd, excess = out.sum(1).unbind(0)
        return jsd, excess

    # one split holds the target: the others' zeros add exactly
    return (*runs, jsd_sweep, split_records[2 * RECORD_FIELDS].sum(0) if targets is not None else None)


@on_first_argument_device
def backward(
    grad_divergence,
    student_hidden,
    student_weight,
    student_bias,
    teacher_hidden,
    teacher_weight,
    teacher_bias,
    saved,
    argmax,
    beta,
    student_transform,
    teacher_transform,
    grad_hidden,
    grad_weight,
    grad_bias,
    config=None,
    offset=0,
    layer1=None,
):
    """divergence_torch.backward by the Triton kernel (g per token chunk) and cuBLAS (dH, dW); grad_hidden is
    written, grad_weight and grad_bias accumulated (zero on entry); each may be None. ``offset``: the weights' row v
    is vocabulary entry offset + v (a vocab-parallel shard, with the whole vocabulary's saved values and argmax).
    ``layer1``: None, or the combined head's (targets [N], BackwardStats rows [4, N] fp32, dL/dlogp [N] fp32,
    dL/dentropy [N] fp32 or None), whose term joins g (grpo_fast/teacher_head.py; a whole head, offset 0)."""
    N, Ds = student_hidden.shape
    Dt = teacher_hidden.shape[1]
    V = student_weight.shape[0]
    dev = student_hidden.device
    config = config or backward_config(dev, student_hidden.dtype, layer1 is not None)
    chunk = chunk_size(N, Ds)
    g = torch.empty((chunk, V), dtype=student_hidden.dtype, device=dev)
    scaled = student_hidden.dtype != torch.float32
    targets, layer1_stats, grad_logp, grad_entropy = layer1 if layer1 is not None else (saved,) * 4
    if scaled:
        # the bound of the coefficients of g (tile.gemm_scale): |c| + |dL/dlogp| + |dL/dentropy|
        bound = grad_divergence.abs()
        for extra in (grad_logp, grad_entropy) if layer1 is not None else ():
            if extra is not None:
                bound = bound + extra.abs()
        coefficient_max = bound.amax().reshape(1)
    else:
        coefficient_max = saved
    g_unscale = torch.ones(1, dtype=torch.float32, device=dev)
    models = (student_hidden, student_weight, student_bias if student_bias is not None else student_hidden,
              teacher_hidden, teacher_weight, teacher_bias if teacher_bias is not None else teacher_hidden)  # fmt: skip
    common = dict(
        stride_hs=student_hidden.stride(0),
        stride_ws=student_weight.stride(0),
        stride_ht=teacher_hidden.stride(0),
        stride_wt=teacher_weight.stride(0),
        **_scalars(student_transform, teacher_transform),
        **_beta_scalars(beta),
        **_model_constexprs(
            student_hidden, student_bias, teacher_hidden, teacher_bias, student_transform, teacher_transform, config
        ),
    )
    mode = 0 if beta == 0.0 else 1 if beta == 1.0 else 2
    argmax = local_argmax(argmax, offset, V)
    for n0 in range(0, N, chunk):
        n1 = min(n0 + chunk, N)
        grid = (triton.cdiv(n1 - n0, config.block_n), triton.cdiv(V, config.block_v))
        _backward_kernel[grid](
            student_hidden[n0:n1],
            student_weight,
            models[2],
            teacher_hidden[n0:n1],
            *models[4:],
            saved[:, n0:],
            argmax[:, n0:],
            grad_divergence[n0:n1],
            g,
            grad_bias if grad_bias is not None else saved,
            coefficient_max,
            g_unscale,
            *(
                (
                    targets[n0:n1],
                    layer1_stats[:, n0:],
                    grad_logp[n0:n1],
                    (grad_entropy if grad_entropy is not None else grad_logp)[n0:n1],
                )
                if layer1 is not None
                else (saved,) * 4
            ),
            n1 - n0,
            V,
            Ds,
            Dt,
            N,
            saved.stride(0),
            g.stride(0),
            MODE=mode,
            COMPUTE_DB=grad_bias is not None,
            SCALE_G=scaled,
            LAYER1=layer1 is not None,
            ENTROPY_GRAD=layer1 is not None and grad_entropy is not None,
            **common,
        )
        g_rows = g[: n1 - n0]
        if grad_hidden is not None:
            mm_fp32(g_rows, student_weight, grad_hidden[n0:n1], accumulate=False)
            if scaled:
                grad_hidden[n0:n1].mul_(g_unscale)
        if grad_weight is not None:
            mm_fp32(g_rows.T, student_hidden[n0:n1], grad_weight, accumulate=True)
    if scaled and grad_weight is not None:
        grad_weight.mul_(g_unscale)
