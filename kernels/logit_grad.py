"""Backward, chunked: recompute a chunk of logits, write its gradient g, and let cuBLAS do dH and dW.

Math (as in linear_logprobs_bwd.py): for the tokens n of one chunk,
    g_nv = c_n * (1[v = y_n] - exp(z_nv - lse_n)) / tau,   z = (H W^T + b) / tau recomputed with fp32 accumulation
then  dH[chunk] = g W  (one GEMM, fp32 accumulation inside, written once),
      dW       += g^T H[chunk]  (fp32 accumulator, added in vocab slabs),   db += sum_n g_nv (fp32 atomics).

Why beside the fully fused kernel: the fused kernel adds a BLOCK_N x D and a BLOCK_V x D partial per tile with
fp32 atomics, about N*V*D*(1/BLOCK_V + 1/BLOCK_N) atomic adds (~240 GB of traffic at N = 16k, V = 152k,
D = 1536), which outweighs the matmuls; here the two gradient products run as dense GEMMs at tensor-core speed.

Memory: one chunk of g in the input dtype, chunk_n x V with chunk_n <= D, so at most the size of W (and of dW);
the fp32 dW accumulator (V x D, only when the weight needs a gradient) and one vocab slab of g^T H in the input
dtype; dH is written in place in the input dtype. No tensor of N x V exists for N > D.
"""

import torch
import triton
import triton.language as tl

from grpo_fast.kernels.logit_tile import logit_grad


@triton.jit
def _logit_grad_kernel(
    hidden_ptr, weight_ptr, bias_ptr, targets_ptr, lse_ptr, coef_ptr, g_ptr, grad_bias_ptr,
    N, V, D,
    stride_hn, stride_hd, stride_wv, stride_wd, stride_gn,
    inv_temperature,
    HAS_BIAS: tl.constexpr, COMPUTE_DB: tl.constexpr, DOT_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr,
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

    coef = tl.load(coef_ptr + offs_n, mask=n_mask, other=0.0)
    if tl.max(tl.abs(coef), axis=0) == 0.0:  # masked rows: exactly zero, no matmul needed
        tl.store(g_ptrs, tl.zeros((BLOCK_N, BLOCK_V), tl.float32).to(g_ptr.dtype.element_ty), mask=out_mask)
        return
    g = logit_grad(hidden_ptr, weight_ptr, bias_ptr, targets_ptr, lse_ptr, grad_bias_ptr, coef,
                   offs_n, offs_v, n_mask, v_mask, D, stride_hn, stride_hd, stride_wv, stride_wd, inv_temperature,
                   HAS_BIAS, COMPUTE_DB, DOT_FP32, DOT_PRECISION, BLOCK_N, BLOCK_V, BLOCK_D)
    tl.store(g_ptrs, g.to(g_ptr.dtype.element_ty), mask=out_mask)


def chunk_size(N, D):
    """Tokens per chunk: g of one chunk (chunk x V) is never larger than the weight (V x D), D >= 16."""
    return min(N, max(16, (D // 16) * 16))


def linear_logprobs_bwd_chunked(hidden, weight, targets, bias, lse, coef, temperature,
                                grad_hidden, grad_weight, grad_bias, config, vocab_slab=16384):
    """dH (input dtype, written in place), dW (fp32 accumulator, added to), db (fp32, added to); any may be None."""
    N, D = hidden.shape
    V = weight.shape[0]
    chunk = chunk_size(N, D)
    g = torch.empty((chunk, V), dtype=hidden.dtype, device=hidden.device)
    dummy = lse
    for n0 in range(0, N, chunk):
        n1 = min(n0 + chunk, N)
        rows = n1 - n0
        grid = (triton.cdiv(rows, config.block_n), triton.cdiv(V, config.block_v))
        _logit_grad_kernel[grid](
            hidden[n0:n1], weight, bias if bias is not None else dummy, targets[n0:n1], lse[n0:n1], coef[n0:n1],
            g, grad_bias if grad_bias is not None else dummy,
            rows, V, D,
            hidden.stride(0), hidden.stride(1), weight.stride(0), weight.stride(1), g.stride(0),
            1.0 / temperature,
            HAS_BIAS=bias is not None, COMPUTE_DB=grad_bias is not None, DOT_FP32=config.dot_fp32,
            DOT_PRECISION=config.dot_precision(hidden.dtype),
            BLOCK_N=config.block_n, BLOCK_V=config.block_v, BLOCK_D=config.block_d,
            num_warps=config.num_warps, num_stages=config.num_stages,
        )
        g_rows = g[:rows]
        if grad_hidden is not None:
            torch.mm(g_rows, weight, out=grad_hidden[n0:n1])
        if grad_weight is not None:
            h_rows = hidden[n0:n1]
            if grad_weight.dtype == g.dtype:
                grad_weight.addmm_(g_rows.T, h_rows)
            else:  # fp32 accumulator for bf16/fp16 inputs, one vocab slab of g^T H at a time
                for v0 in range(0, V, vocab_slab):
                    v1 = min(v0 + vocab_slab, V)
                    grad_weight[v0:v1] += g_rows[:, v0:v1].T @ h_rows
