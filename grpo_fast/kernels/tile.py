"""Tile helpers: the device functions the forward and backward kernels share: one logit tile, and its gradient.

    u[i, j] = h_i . W_j + b_j                          (fp32 accumulation over D in BLOCK_D steps)
    z[i, j] = softcap * tanh(logit_scale * u / softcap) / tau      (no tanh without HAS_SOFTCAP; TRL 1.16's order;
                                                                    columns past the vocab are -inf)
    g[i, j] = dL/du[i, j] = (c_i (1[j = y_i] - p_ij) + e_i p_ij (mean_i - z_ij)) * dz/du[i, j]
        with p_ij = exp(z_ij - lse_i), mean_i = sum_j p_ij z_ij, c = dL/dlogp, e = dL/dentropy (only with ENTROPY_GRAD),
        dz/du = logit_scale (1 - tanh^2) / tau  (logit_scale / tau without a soft-cap).

The entropy term: H = lse - sum_j p_j z_j, so dH/dz_j = p_j (mean - z_j). tanh is formed from e = exp(-2|x|) as
(1 - e) / (1 + e) and its slope as 4e / (1 + e)^2: no overflow for any x, and the slope keeps its relative precision
where tanh saturates (1 - tanh^2 would cancel to 0 there).

Registers only: a BLOCK_N x BLOCK_V fp32 tile (tile_grad also adds the tile's column sums of g to an fp32 db).
``DOT_FP32`` upcasts the dot operands (the CPU interpreter's bf16 tl.dot is wrong in triton 3.9); on a GPU they stay
in the input dtype for the tensor cores.
"""

import triton
import triton.language as tl


@triton.jit
def _raw_logit_tile(hidden_ptr, weight_ptr, bias_ptr, offs_n, offs_v, n_mask, v_mask, D,
                    stride_hn, stride_hd, stride_wv, stride_wd,
                    HAS_BIAS: tl.constexpr, DOT_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr):
    """u = H W^T + b for one tile, fp32."""
    acc = tl.zeros((BLOCK_N, BLOCK_V), tl.float32)
    for d0 in range(0, D, BLOCK_D):
        offs_d = d0 + tl.arange(0, BLOCK_D)
        d_mask = offs_d < D
        # int64 row offsets: N x D and V x D may pass 2^31 elements, and a 32-bit index times a 32-bit stride would
        # wrap (Triton passes a stride below 2^31 as i32); the column strides are 1 (the API makes them so)
        h = tl.load(hidden_ptr + offs_n[:, None].to(tl.int64) * stride_hn + offs_d[None, :] * stride_hd,
                    mask=n_mask[:, None] & d_mask[None, :], other=0.0)
        w = tl.load(weight_ptr + offs_v[None, :].to(tl.int64) * stride_wv + offs_d[:, None] * stride_wd,
                    mask=v_mask[None, :] & d_mask[:, None], other=0.0)
        if DOT_FP32:
            h = h.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(h, w, acc, input_precision=DOT_PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_v, mask=v_mask, other=0.0).to(tl.float32)[None, :]
    return acc


@triton.jit
def tanh_and_slope(x):
    """(tanh x, 1 - tanh^2 x), both exact in fp32 for every x (see the module docstring)."""
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0.0, -t, t), 4.0 * e / ((1.0 + e) * (1.0 + e))


@triton.jit
def logit_tile(hidden_ptr, weight_ptr, bias_ptr, offs_n, offs_v, n_mask, v_mask, D,
               stride_hn, stride_hd, stride_wv, stride_wd, inv_temperature, logit_scale, softcap,
               HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, DOT_FP32: tl.constexpr,
               DOT_PRECISION: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr):
    """The transformed logits z of one tile, -inf past the vocabulary."""
    a = _raw_logit_tile(hidden_ptr, weight_ptr, bias_ptr, offs_n, offs_v, n_mask, v_mask, D,
                        stride_hn, stride_hd, stride_wv, stride_wd,
                        HAS_BIAS, DOT_FP32, DOT_PRECISION, BLOCK_N, BLOCK_V, BLOCK_D) * logit_scale
    if HAS_SOFTCAP:
        t, _ = tanh_and_slope(a / softcap)
        a = softcap * t
    return tl.where(v_mask[None, :], a * inv_temperature, float("-inf"))


@triton.jit
def row_coefficients(coef_ptr, entropy_coef_ptr, offs_n, n_mask, ENTROPY_GRAD: tl.constexpr):
    """A token block's dL/dlogp and dL/dentropy (the latter only with ENTROPY_GRAD), and their largest magnitude:
    0 means the block has no gradient (masked rows), which the kernels skip exactly."""
    coef = tl.load(coef_ptr + offs_n, mask=n_mask, other=0.0)
    scale = tl.max(tl.abs(coef), axis=0)
    entropy_coef = coef
    if ENTROPY_GRAD:
        entropy_coef = tl.load(entropy_coef_ptr + offs_n, mask=n_mask, other=0.0)
        scale = tl.maximum(scale, tl.max(tl.abs(entropy_coef), axis=0))
    return coef, entropy_coef, scale


@triton.jit
def tile_grad(hidden_ptr, weight_ptr, bias_ptr, targets_ptr, lse_ptr, mean_logit_ptr, grad_bias_ptr,
               coef, entropy_coef, offs_n, offs_v, n_mask, v_mask, D,
               stride_hn, stride_hd, stride_wv, stride_wd, inv_temperature, logit_scale, softcap,
               HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, ENTROPY_GRAD: tl.constexpr,
               COMPUTE_DB: tl.constexpr, DOT_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr):
    """g = dL/du for one tile, from the recomputed logits and the saved lse (and mean logit with ENTROPY_GRAD).

    ``coef`` and ``entropy_coef`` are this tile's rows of dL/dlogp and dL/dentropy; adds the tile's column sums of g
    to db when COMPUTE_DB.
    """
    targets = tl.load(targets_ptr + offs_n, mask=n_mask, other=-1)
    lse = tl.load(lse_ptr + offs_n, mask=n_mask, other=0.0)
    a = _raw_logit_tile(hidden_ptr, weight_ptr, bias_ptr, offs_n, offs_v, n_mask, v_mask, D,
                        stride_hn, stride_hd, stride_wv, stride_wd,
                        HAS_BIAS, DOT_FP32, DOT_PRECISION, BLOCK_N, BLOCK_V, BLOCK_D) * logit_scale
    slope = logit_scale * inv_temperature
    if HAS_SOFTCAP:
        t, dt = tanh_and_slope(a / softcap)
        a = softcap * t
        slope = slope * dt
    z = tl.where(v_mask[None, :], a * inv_temperature, float("-inf"))
    p = tl.exp(z - lse[:, None])
    is_target = (offs_v[None, :] == targets[:, None]).to(tl.float32)
    dz = coef[:, None] * (is_target - p)
    if ENTROPY_GRAD:
        mean_logit = tl.load(mean_logit_ptr + offs_n, mask=n_mask, other=0.0)
        # p is 0 where z is -inf: keep 0 * inf from forming a NaN
        dz += entropy_coef[:, None] * p * tl.where(p > 0.0, mean_logit[:, None] - z, 0.0)
    g = dz * slope
    if COMPUTE_DB:
        tl.atomic_add(grad_bias_ptr + offs_v, tl.sum(g, axis=0), mask=v_mask)
    return g
