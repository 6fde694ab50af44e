"""The backward pass of layer 1: dH, dW, db from dL/dlogp and dL/dentropy, recomputing the logits tile by tile.

Math (tile.py): for token n with c_n = dL/dlogp_n and e_n = dL/dentropy_n (the entropy term is a compile-time
option: without an entropy gradient it is not formed), z recomputed with fp32 accumulation,
    g_nv = dL/du_nv = (c_n (1[v = y_n] - p_nv) + e_n p_nv (mean_n - z_nv)) * dz/du_nv,   p_nv = exp(z_nv - lse_n)
    dH = g W  [N, D],   dW = g^T H  [V, D],   db = sum_n g_nv  [V].
One kernel, ``_backward_kernel``, forms g for a BLOCK_N x BLOCK_V tile (the K-loop over D, as the forward; a token
block whose coefficients are all zero, i.e. masked rows, is exactly zero and skips the matmul). Its two modes:

* chunked (the default, ``backward_chunked``): the kernel writes g for a chunk of at most D tokens in the input
  dtype, and cuBLAS does the two gradient products as dense GEMMs: dH[chunk] = g W (written once),
  dW += g^T H[chunk] (fp32 accumulator). On CUDA with torch >= 2.8, ``torch.addmm(..., out_dtype=torch.float32)``
  adds each chunk's bf16 g^T H to the fp32 accumulator inside the GEMM, never rounding a chunk's product to bf16
  (TRL reports that bf16-rounded chunk sums bias training: the entropy drifts lower); elsewhere the product of one
  vocabulary slab is formed in fp32 (CPU, and under the interpreter) and added.
  Memory: one chunk of g, chunk_n x V with chunk_n <= D, so at most the size of W; the fp32 dW accumulator (only
  when the weight needs a gradient) and, without out_dtype, one vocabulary slab of g^T H in fp32; dH in the input
  dtype; the saved per-token lse, mean logit and coefficients are O(N). No tensor of N x V exists for N > D.
* fused (``GRPO_FAST_BWD=fused``, ``backward_fused``): the kernel walks D in BLOCK_D steps and adds g W_j into dH_i
  and g^T H_i into dW_j with fp32 atomics; no g buffer. Memory: fp32 accumulators for dH (N x D) and dW (V x D,
  only if the weight needs one) and db. About N*V*D*(1/BLOCK_V + 1/BLOCK_N) atomic adds (~240 GB of traffic at
  N = 16k, V = 152k, D = 1536, by count), which is why chunked is the default; atomics also make the summation
  order vary run to run (fp32 rounding level).

A frozen lm_head skips every dW product in both modes.
"""

import torch
import triton
import triton.language as tl

from .tile import row_coefficients, tile_grad

# torch.mm / torch.addmm(..., out_dtype=torch.float32) from bf16 / fp16 operands: CUDA only, torch >= 2.8
OUT_DTYPE_GEMM = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 8)


@triton.jit
def _backward_kernel(
    hidden_ptr, weight_ptr, bias_ptr, targets_ptr, lse_ptr, mean_logit_ptr, coef_ptr, entropy_coef_ptr,
    g_ptr, grad_hidden_ptr, grad_weight_ptr, grad_bias_ptr,
    N, V, D,
    stride_hn, stride_hd, stride_wv, stride_wd, stride_gn,
    inv_temperature, logit_scale, softcap,
    HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, ENTROPY_GRAD: tl.constexpr, FUSED: tl.constexpr,
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
    # int64 row offsets wherever a row times a stride may pass 2^31 elements (g: chunk x V with chunk <= D, at most
    # the size of W; hidden N x D; weight V x D; the fp32 dH and dW); tile.py says why
    g_ptrs = g_ptr + offs_n[:, None].to(tl.int64) * stride_gn + offs_v[None, :]
    g_mask = n_mask[:, None] & v_mask[None, :]

    coef, entropy_coef, scale = row_coefficients(coef_ptr, entropy_coef_ptr, offs_n, n_mask, ENTROPY_GRAD)
    if scale == 0.0:  # rows without a gradient (masked): exactly zero, no matmul needed
        if not FUSED:
            tl.store(g_ptrs, tl.zeros((BLOCK_N, BLOCK_V), tl.float32).to(g_ptr.dtype.element_ty), mask=g_mask)
        return
    g = tile_grad(hidden_ptr, weight_ptr, bias_ptr, targets_ptr, lse_ptr, mean_logit_ptr, grad_bias_ptr,
                  coef, entropy_coef, offs_n, offs_v, n_mask, v_mask, D,
                  stride_hn, stride_hd, stride_wv, stride_wd, inv_temperature, logit_scale, softcap,
                  HAS_BIAS, HAS_SOFTCAP, ENTROPY_GRAD, COMPUTE_DB, DOT_FP32, DOT_PRECISION, BLOCK_N, BLOCK_V, BLOCK_D)
    if not FUSED:
        tl.store(g_ptrs, g.to(g_ptr.dtype.element_ty), mask=g_mask)
        return
    if DOT_FP32:
        g_dot = g
    else:
        g_dot = g.to(hidden_ptr.dtype.element_ty)
    for d0 in range(0, D, BLOCK_D):
        offs_d = d0 + tl.arange(0, BLOCK_D)
        d_mask = offs_d < D
        if COMPUTE_DH:
            w_vd = tl.load(weight_ptr + offs_v[:, None].to(tl.int64) * stride_wv + offs_d[None, :] * stride_wd,
                           mask=v_mask[:, None] & d_mask[None, :], other=0.0)
            if DOT_FP32:
                w_vd = w_vd.to(tl.float32)
            dh = tl.dot(g_dot, w_vd, input_precision=DOT_PRECISION)
            tl.atomic_add(grad_hidden_ptr + offs_n[:, None].to(tl.int64) * D + offs_d[None, :], dh,
                          mask=n_mask[:, None] & d_mask[None, :])
        if COMPUTE_DW:
            h_nd = tl.load(hidden_ptr + offs_n[:, None].to(tl.int64) * stride_hn + offs_d[None, :] * stride_hd,
                           mask=n_mask[:, None] & d_mask[None, :], other=0.0)
            if DOT_FP32:
                h_nd = h_nd.to(tl.float32)
            dw = tl.dot(tl.trans(g_dot), h_nd, input_precision=DOT_PRECISION)
            tl.atomic_add(grad_weight_ptr + offs_v[:, None].to(tl.int64) * D + offs_d[None, :], dw,
                          mask=v_mask[:, None] & d_mask[None, :])


def _launch(hidden, weight, targets, bias, lse, mean_logit, coef, entropy_coef, transform, g, grad_hidden,
            grad_weight, grad_bias, config):
    """One launch over hidden's rows; g (chunked) or the fp32 dH / dW (fused) receive the result."""
    N, D = hidden.shape
    V = weight.shape[0]
    dummy = lse
    grid = (triton.cdiv(N, config.block_n), triton.cdiv(V, config.block_v))
    _backward_kernel[grid](
        hidden, weight, bias if bias is not None else dummy, targets, lse,
        mean_logit if entropy_coef is not None else dummy, coef,
        entropy_coef if entropy_coef is not None else dummy,
        g if g is not None else dummy,
        grad_hidden if grad_hidden is not None else dummy,
        grad_weight if grad_weight is not None else dummy,
        grad_bias if grad_bias is not None else dummy,
        N, V, D,
        hidden.stride(0), hidden.stride(1), weight.stride(0), weight.stride(1), g.stride(0) if g is not None else 0,
        *transform.kernel_scalars(),
        HAS_BIAS=bias is not None, HAS_SOFTCAP=transform.softcap is not None, ENTROPY_GRAD=entropy_coef is not None,
        FUSED=g is None, COMPUTE_DH=grad_hidden is not None, COMPUTE_DW=grad_weight is not None,
        COMPUTE_DB=grad_bias is not None,
        DOT_FP32=config.dot_fp32, DOT_PRECISION=config.dot_precision(hidden.dtype),
        BLOCK_N=config.block_n, BLOCK_V=config.block_v, BLOCK_D=config.block_d,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )


def chunk_size(N, D):
    """Tokens per chunk: g of one chunk (chunk x V) is never larger than the weight (V x D), D >= 16."""
    return min(N, max(16, (D // 16) * 16))


def add_gt_h(grad_weight, g_rows, h_rows, vocab_slab):
    """grad_weight (fp32) += g_rows^T h_rows without rounding the product to the input dtype."""
    if grad_weight.dtype == g_rows.dtype:
        grad_weight.addmm_(g_rows.T, h_rows)
    elif OUT_DTYPE_GEMM and grad_weight.is_cuda:
        torch.addmm(grad_weight, g_rows.T, h_rows, out_dtype=torch.float32, out=grad_weight)
    else:  # one vocabulary slab at a time: the fp32 product of a slab is the only extra buffer
        h32 = h_rows.float()
        for v0 in range(0, grad_weight.shape[0], vocab_slab):
            v1 = min(v0 + vocab_slab, grad_weight.shape[0])
            grad_weight[v0:v1].addmm_(g_rows[:, v0:v1].T.float(), h32)


def backward_chunked(hidden, weight, targets, bias, lse, mean_logit, coef, entropy_coef, transform,
                     grad_hidden, grad_weight, grad_bias, config, vocab_slab=16384):
    """dH (input dtype, written in place), dW (fp32 accumulator, added to), db (fp32, added to); any may be None.

    ``coef`` = dL/dlogp [N] fp32; ``entropy_coef`` = dL/dentropy [N] fp32 or None (then ``mean_logit`` is unused).
    """
    N, D = hidden.shape
    V = weight.shape[0]
    chunk = chunk_size(N, D)
    g = torch.empty((chunk, V), dtype=hidden.dtype, device=hidden.device)
    entropy_grad = entropy_coef is not None
    for n0 in range(0, N, chunk):
        n1 = min(n0 + chunk, N)
        _launch(hidden[n0:n1], weight, targets[n0:n1], bias, lse[n0:n1], mean_logit[n0:n1] if entropy_grad else None,
                coef[n0:n1], entropy_coef[n0:n1] if entropy_grad else None, transform, g, None, None, grad_bias,
                config)
        g_rows = g[:n1 - n0]
        if grad_hidden is not None:
            torch.mm(g_rows, weight, out=grad_hidden[n0:n1])
        if grad_weight is not None:
            add_gt_h(grad_weight, g_rows, hidden[n0:n1], vocab_slab)


def backward_fused(hidden, weight, targets, bias, lse, mean_logit, coef, entropy_coef, transform,
                   grad_hidden, grad_weight, grad_bias, config):
    """Accumulate dH, dW, db into fp32 buffers (zero-initialised, or None when not needed) with atomics.

    ``coef`` = dL/dlogp [N] fp32; ``entropy_coef`` = dL/dentropy [N] fp32 or None (then ``mean_logit`` is unused).
    """
    _launch(hidden, weight, targets, bias, lse, mean_logit, coef, entropy_coef, transform, None, grad_hidden,
            grad_weight, grad_bias, config)
