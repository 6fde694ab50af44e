"""Backward, chunked: recompute a chunk of logits, write its gradient g, and let cuBLAS do dH and dW.

Math (kernels/logit_tile.py): for the tokens n of one chunk, with z recomputed with fp32 accumulation,
    g_nv = dL/du_nv = (c_n (1[v = y_n] - p_nv) + e_n p_nv (mean_n - z_nv)) * dz/du_nv,   p_nv = exp(z_nv - lse_n)
(c = dL/dlogp; e = dL/dentropy, a compile-time option: without an entropy gradient its term is not formed), then
      dH[chunk] = g W  (one GEMM, fp32 accumulation inside, written once),
      dW       += g^T H[chunk]  (fp32 accumulator),   db += sum_n g_nv (fp32 atomics).

Why beside the fully fused kernel: the fused kernel adds a BLOCK_N x D and a BLOCK_V x D partial per tile with
fp32 atomics, about N*V*D*(1/BLOCK_V + 1/BLOCK_N) atomic adds (~240 GB of traffic at N = 16k, V = 152k,
D = 1536), which outweighs the matmuls; here the two gradient products run as dense GEMMs at tensor-core speed.

dW accumulation: on CUDA with torch >= 2.8, ``torch.addmm(..., out_dtype=torch.float32)`` adds each chunk's bf16 g^T H
to the fp32 accumulator inside the GEMM, never rounding a chunk's product to bf16 (TRL reports that bf16-rounded
chunk sums bias training: the entropy drifts lower). Elsewhere the product of one vocabulary slab is formed in
fp32 (CPU, and under the interpreter) and added.

Memory: one chunk of g in the input dtype, chunk_n x V with chunk_n <= D, so at most the size of W (and of dW);
the fp32 dW accumulator (V x D, only when the weight needs a gradient) and, without out_dtype, one vocabulary slab of
g^T H in fp32; dH is written in place in the input dtype; the saved per-token lse, mean logit and coefficients are
O(N). No tensor of N x V exists for N > D.
"""

import torch
import triton
import triton.language as tl

from grpo_fast.kernels.logit_tile import logit_grad, row_coefficients

# torch.addmm(..., out_dtype=torch.float32) from bf16 / fp16 operands: CUDA only, torch >= 2.8
_ADDMM_OUT_DTYPE = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 8)


@triton.jit
def _logit_grad_kernel(
    hidden_ptr, weight_ptr, bias_ptr, targets_ptr, lse_ptr, mean_logit_ptr, coef_ptr, entropy_coef_ptr,
    g_ptr, grad_bias_ptr,
    N, V, D,
    stride_hn, stride_hd, stride_wv, stride_wd, stride_gn,
    inv_temperature, logit_scale, softcap,
    HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, ENTROPY_GRAD: tl.constexpr, COMPUTE_DB: tl.constexpr,
    DOT_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_v = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_v = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    n_mask = offs_n < N
    v_mask = offs_v < V
    out_mask = n_mask[:, None] & v_mask[None, :]
    g_ptrs = g_ptr + offs_n[:, None] * stride_gn + offs_v[None, :]

    coef, entropy_coef, scale = row_coefficients(coef_ptr, entropy_coef_ptr, offs_n, n_mask, ENTROPY_GRAD)
    if scale == 0.0:  # rows without a gradient (masked): exactly zero, no matmul needed
        tl.store(g_ptrs, tl.zeros((BLOCK_N, BLOCK_V), tl.float32).to(g_ptr.dtype.element_ty), mask=out_mask)
        return
    g = logit_grad(hidden_ptr, weight_ptr, bias_ptr, targets_ptr, lse_ptr, mean_logit_ptr, grad_bias_ptr,
                   coef, entropy_coef, offs_n, offs_v, n_mask, v_mask, D,
                   stride_hn, stride_hd, stride_wv, stride_wd, inv_temperature, logit_scale, softcap,
                   HAS_BIAS, HAS_SOFTCAP, ENTROPY_GRAD, COMPUTE_DB, DOT_FP32, DOT_PRECISION, BLOCK_N, BLOCK_V, BLOCK_D)
    tl.store(g_ptrs, g.to(g_ptr.dtype.element_ty), mask=out_mask)


def chunk_size(N, D):
    """Tokens per chunk: g of one chunk (chunk x V) is never larger than the weight (V x D), D >= 16."""
    return min(N, max(16, (D // 16) * 16))


def _add_gt_h(grad_weight, g_rows, h_rows, vocab_slab):
    """grad_weight (fp32) += g_rows^T h_rows without rounding the product to the input dtype."""
    if grad_weight.dtype == g_rows.dtype:
        grad_weight.addmm_(g_rows.T, h_rows)
    elif _ADDMM_OUT_DTYPE and grad_weight.is_cuda:
        torch.addmm(grad_weight, g_rows.T, h_rows, out_dtype=torch.float32, out=grad_weight)
    else:  # one vocabulary slab at a time: the fp32 product of a slab is the only extra buffer
        h32 = h_rows.float()
        for v0 in range(0, grad_weight.shape[0], vocab_slab):
            v1 = min(v0 + vocab_slab, grad_weight.shape[0])
            grad_weight[v0:v1].addmm_(g_rows[:, v0:v1].T.float(), h32)


def linear_logprobs_bwd_chunked(hidden, weight, targets, bias, lse, mean_logit, coef, entropy_coef, transform,
                                grad_hidden, grad_weight, grad_bias, config, vocab_slab=16384):
    """dH (input dtype, written in place), dW (fp32 accumulator, added to), db (fp32, added to); any may be None.

    ``coef`` = dL/dlogp [N] fp32; ``entropy_coef`` = dL/dentropy [N] fp32 or None (then ``mean_logit`` is unused).
    """
    N, D = hidden.shape
    V = weight.shape[0]
    chunk = chunk_size(N, D)
    g = torch.empty((chunk, V), dtype=hidden.dtype, device=hidden.device)
    dummy = lse
    entropy_grad = entropy_coef is not None
    for n0 in range(0, N, chunk):
        n1 = min(n0 + chunk, N)
        rows = n1 - n0
        grid = (triton.cdiv(rows, config.block_n), triton.cdiv(V, config.block_v))
        _logit_grad_kernel[grid](
            hidden[n0:n1], weight, bias if bias is not None else dummy, targets[n0:n1], lse[n0:n1],
            mean_logit[n0:n1] if entropy_grad else dummy, coef[n0:n1],
            entropy_coef[n0:n1] if entropy_grad else dummy,
            g, grad_bias if grad_bias is not None else dummy,
            rows, V, D,
            hidden.stride(0), hidden.stride(1), weight.stride(0), weight.stride(1), g.stride(0),
            *transform.kernel_scalars(),
            HAS_BIAS=bias is not None, HAS_SOFTCAP=transform.softcap is not None, ENTROPY_GRAD=entropy_grad,
            COMPUTE_DB=grad_bias is not None, DOT_FP32=config.dot_fp32,
            DOT_PRECISION=config.dot_precision(hidden.dtype),
            BLOCK_N=config.block_n, BLOCK_V=config.block_v, BLOCK_D=config.block_d,
            num_warps=config.num_warps, num_stages=config.num_stages,
        )
        g_rows = g[:rows]
        if grad_hidden is not None:
            torch.mm(g_rows, weight, out=grad_hidden[n0:n1])
        if grad_weight is not None:
            _add_gt_h(grad_weight, g_rows, hidden[n0:n1], vocab_slab)
