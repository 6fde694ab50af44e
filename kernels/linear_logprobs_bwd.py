"""Backward of the fused linear log-probs: dH, dW, db from dL/dlogp and dL/dentropy, recomputing the logits tile by tile.

Math (kernels/logit_tile.py): with c_n = dL/dlogp_n and e_n = dL/dH_n (the entropy; a compile-time option),
p_nv = exp(z_nv - lse_n) and mean_n = sum_v p_nv z_nv, the gradient with respect to u = H W^T + b is
    g_nv = (c_n (1[v = y_n] - p_nv) + e_n p_nv (mean_n - z_nv)) * dz/du_nv
and then  dH = g W  [N, D],  dW = g^T H  [V, D],  db = sum_n g_nv  [V].

Program (i, j) recomputes the logit tile of token block i and vocab block j (the K-loop over D, as in the
forward), forms g in registers, then walks D in BLOCK_D chunks and adds g W_j into dH_i and g^T H_i into dW_j
with fp32 atomics. A token block whose coefficients are all zero (masked rows) exits at once: that is exact.

Memory: fp32 accumulators for dH (N x D, only if hidden needs a gradient), dW (V x D, only if the weight needs
one: a frozen lm_head skips every dW product) and db (V); the inputs, the [N] fp32 lse, mean logit and coefficients.
No tensor of size N x V exists. The caller casts the accumulators to the input dtypes. Atomics make the float
summation order vary run to run (differences at fp32 rounding level).
"""

import triton
import triton.language as tl

from grpo_fast.kernels.logit_tile import logit_grad, row_coefficients


@triton.jit
def _linear_logprobs_bwd_kernel(
    hidden_ptr, weight_ptr, bias_ptr, targets_ptr, lse_ptr, mean_logit_ptr, coef_ptr, entropy_coef_ptr,
    grad_hidden_ptr, grad_weight_ptr, grad_bias_ptr,
    N, V, D,
    stride_hn, stride_hd, stride_wv, stride_wd,
    inv_temperature, logit_scale, softcap,
    HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, ENTROPY_GRAD: tl.constexpr,
    COMPUTE_DH: tl.constexpr, COMPUTE_DW: tl.constexpr, COMPUTE_DB: tl.constexpr,
    DOT_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_v = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_v = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    n_mask = offs_n < N
    v_mask = offs_v < V

    coef, entropy_coef, scale = row_coefficients(coef_ptr, entropy_coef_ptr, offs_n, n_mask, ENTROPY_GRAD)
    if scale == 0.0:  # rows without a gradient (masked): nothing to add
        return
    g = logit_grad(hidden_ptr, weight_ptr, bias_ptr, targets_ptr, lse_ptr, mean_logit_ptr, grad_bias_ptr,
                   coef, entropy_coef, offs_n, offs_v, n_mask, v_mask, D,
                   stride_hn, stride_hd, stride_wv, stride_wd, inv_temperature, logit_scale, softcap,
                   HAS_BIAS, HAS_SOFTCAP, ENTROPY_GRAD, COMPUTE_DB, DOT_FP32, DOT_PRECISION, BLOCK_N, BLOCK_V, BLOCK_D)
    if DOT_FP32:
        g_dot = g
    else:
        g_dot = g.to(hidden_ptr.dtype.element_ty)
    for d0 in range(0, D, BLOCK_D):
        offs_d = d0 + tl.arange(0, BLOCK_D)
        d_mask = offs_d < D
        if COMPUTE_DH:
            w_vd = tl.load(weight_ptr + offs_v[:, None] * stride_wv + offs_d[None, :] * stride_wd,
                           mask=v_mask[:, None] & d_mask[None, :], other=0.0)
            if DOT_FP32:
                w_vd = w_vd.to(tl.float32)
            dh = tl.dot(g_dot, w_vd, input_precision=DOT_PRECISION)
            tl.atomic_add(grad_hidden_ptr + offs_n[:, None] * D + offs_d[None, :], dh,
                          mask=n_mask[:, None] & d_mask[None, :])
        if COMPUTE_DW:
            h_nd = tl.load(hidden_ptr + offs_n[:, None] * stride_hn + offs_d[None, :] * stride_hd,
                           mask=n_mask[:, None] & d_mask[None, :], other=0.0)
            if DOT_FP32:
                h_nd = h_nd.to(tl.float32)
            dw = tl.dot(tl.trans(g_dot), h_nd, input_precision=DOT_PRECISION)
            tl.atomic_add(grad_weight_ptr + offs_v[:, None] * D + offs_d[None, :], dw,
                          mask=v_mask[:, None] & d_mask[None, :])


def linear_logprobs_bwd(hidden, weight, targets, bias, lse, mean_logit, coef, entropy_coef, transform,
                        grad_hidden, grad_weight, grad_bias, config):
    """Accumulate dH, dW, db (fp32 buffers, zero-initialised, or None when not needed).

    ``coef`` = dL/dlogp [N] fp32; ``entropy_coef`` = dL/dentropy [N] fp32 or None (then ``mean_logit`` is unused).
    """
    N, D = hidden.shape
    V = weight.shape[0]
    dummy = lse
    grid = (triton.cdiv(N, config.block_n), triton.cdiv(V, config.block_v))
    _linear_logprobs_bwd_kernel[grid](
        hidden, weight, bias if bias is not None else dummy, targets, lse,
        mean_logit if entropy_coef is not None else dummy, coef,
        entropy_coef if entropy_coef is not None else dummy,
        grad_hidden if grad_hidden is not None else dummy,
        grad_weight if grad_weight is not None else dummy,
        grad_bias if grad_bias is not None else dummy,
        N, V, D,
        hidden.stride(0), hidden.stride(1), weight.stride(0), weight.stride(1),
        *transform.kernel_scalars(),
        HAS_BIAS=bias is not None, HAS_SOFTCAP=transform.softcap is not None, ENTROPY_GRAD=entropy_coef is not None,
        COMPUTE_DH=grad_hidden is not None, COMPUTE_DW=grad_weight is not None,
        COMPUTE_DB=grad_bias is not None,
        DOT_FP32=config.dot_fp32, DOT_PRECISION=config.dot_precision(hidden.dtype),
        BLOCK_N=config.block_n, BLOCK_V=config.block_v, BLOCK_D=config.block_d,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
