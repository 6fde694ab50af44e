"""Device functions shared by the linear log-probs kernels: one logit tile, and its gradient.

    z[i, j] = (h_i . W_j + b_j) / tau   for a BLOCK_N x BLOCK_V tile (fp32 accumulation over D in BLOCK_D steps;
                                         columns past the vocab are -inf)
    g[i, j] = c_i (1[j = y_i] - exp(z[i, j] - lse_i)) / tau     (dL/d(h_i . W_j + b_j))

Registers only: a BLOCK_N x BLOCK_V fp32 tile (logit_grad also adds the tile's column sums of g to an fp32 db). ``DOT_FP32`` upcasts the dot operands (the CPU interpreter's bf16
tl.dot is wrong in triton 3.9); on a GPU they stay in the input dtype for the tensor cores.
"""

import triton
import triton.language as tl


@triton.jit
def logit_tile(hidden_ptr, weight_ptr, bias_ptr, offs_n, offs_v, n_mask, v_mask, D,
               stride_hn, stride_hd, stride_wv, stride_wd, inv_temperature,
               HAS_BIAS: tl.constexpr, DOT_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr):
    acc = tl.zeros((BLOCK_N, BLOCK_V), tl.float32)
    for d0 in range(0, D, BLOCK_D):
        offs_d = d0 + tl.arange(0, BLOCK_D)
        d_mask = offs_d < D
        h = tl.load(hidden_ptr + offs_n[:, None] * stride_hn + offs_d[None, :] * stride_hd,
                    mask=n_mask[:, None] & d_mask[None, :], other=0.0)
        w = tl.load(weight_ptr + offs_v[None, :] * stride_wv + offs_d[:, None] * stride_wd,
                    mask=v_mask[None, :] & d_mask[:, None], other=0.0)
        if DOT_FP32:
            h = h.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(h, w, acc, input_precision=DOT_PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_v, mask=v_mask, other=0.0).to(tl.float32)[None, :]
    return tl.where(v_mask[None, :], acc * inv_temperature, float("-inf"))


@triton.jit
def logit_grad(hidden_ptr, weight_ptr, bias_ptr, targets_ptr, lse_ptr, grad_bias_ptr, coef,
               offs_n, offs_v, n_mask, v_mask, D,
               stride_hn, stride_hd, stride_wv, stride_wd, inv_temperature,
               HAS_BIAS: tl.constexpr, COMPUTE_DB: tl.constexpr, DOT_FP32: tl.constexpr,
               DOT_PRECISION: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr):
    """g for one tile, from the recomputed logits and the saved lse; adds its column sums to db when COMPUTE_DB."""
    targets = tl.load(targets_ptr + offs_n, mask=n_mask, other=-1)
    lse = tl.load(lse_ptr + offs_n, mask=n_mask, other=0.0)
    z = logit_tile(hidden_ptr, weight_ptr, bias_ptr, offs_n, offs_v, n_mask, v_mask, D,
                   stride_hn, stride_hd, stride_wv, stride_wd, inv_temperature,
                   HAS_BIAS, DOT_FP32, DOT_PRECISION, BLOCK_N, BLOCK_V, BLOCK_D)
    p = tl.exp(z - lse[:, None])
    is_target = (offs_v[None, :] == targets[:, None]).to(tl.float32)
    g = (coef * inv_temperature)[:, None] * (is_target - p)
    if COMPUTE_DB:
        tl.atomic_add(grad_bias_ptr + offs_v, tl.sum(g, axis=0), mask=v_mask)
    return g
