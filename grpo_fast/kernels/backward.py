"""The backward pass of layer 1: dH, dW, db from dL/dlogp and dL/dentropy, recomputing the logits tile by tile.

Math: ``_backward_kernel`` forms g = dL/du for one BLOCK_N x BLOCK_V tile (``tile``'s formula, from c = dL/dlogp,
e = dL/dentropy, the logits recomputed with fp32 accumulation over D and the forward's softmax_stats.BackwardStats;
the entropy term is compiled out without an entropy gradient; a token block whose coefficients are all zero, masked
rows, is exactly zero and skips the matmul) and adds the tile's column sums of g to db; then
    dH = g W  [N, D],   dW = g^T H  [V, D],   db = sum_n g_nv  [V].
bf16 / fp16 g is multiplied by an exact power of two 2^k from its coefficients' bound before it is rounded for the
tensor cores, and the fp32 products by 2^-k (``tile.gemm_scale``); fp32 g is neither rounded nor scaled.

Two modes (config.BACKWARD_MODES, the caller's choice):
* chunked (the default, ``backward_chunked``): the kernel writes g for a chunk of at most D tokens in the input dtype
  (one power of two for the whole call, from a device bound: no host read), and cuBLAS does dH[chunk] = g W (written
  once, in blocks of ``gemm.TOKEN_GEMM_ROWS`` token rows: a row's dH whatever N, ``gemm.mm_token_rows``) and
  dW += g^T H[chunk] as fp32-output GEMMs (``gemm.mm_fp32``: never a K = V reduction rounded to bf16). On
  sm_90 the kernel reads its H and W tiles through tensor descriptors (the copy engine; 128 x 256 tiles under triton
  3.6, config.gpu_backward_config). Memory: one chunk of g (chunk x V, at most the size of W), the fp32 dW
  accumulator (only when the weight needs a gradient; one fp32 slab more where cuBLAS cannot accumulate in fp32 from
  bf16, ``gemm``), dH in fp32 (N x D); no tensor of N x V for N > D.
* fused (``backward_fused``): one kernel walks D in BLOCK_D steps and adds g W into dH and g^T H into dW with relaxed
  fp32 atomics (plain reductions, no memory fence), in groups of GROUP_V vocabulary tiles so that the resident
  programs spread their dW adds; no g buffer, g's power of two the token block's. Memory: the fp32 accumulators.
  About N V D (1/BLOCK_V + 1/BLOCK_N) atomic adds and a summation order that varies run to run: why chunked is the
  default.

With a replayed kept set's support s = z_y - L_kept (``backward_chunked``'s ``support``, the sampler's replayed sets
with a trained head) g also takes its term, d = dL/ds: -d q_v on each kept v != y, q_v = p_v exp(L - L_kept) (the
row's coefficient d exp(L - L_kept) on the tile's own p: a select a logit; the sets as bitmaps a chunk, read in the
tile: ``tile.kept_bits_tile``), d (1 - q_y) at the target, carried (``operands.SupportGradient``); a token block
holding a set far below its row's max takes q_v = exp(z_v - L_kept) for those rows, its own exponential, the other
rows' values unchanged bit for bit (a term of 0 subtracted); memory: a chunk's bitmaps, ceil(V / 32) + 1 int32 a row.

A frozen lm_head skips every dW product. LoRA (z recomputed from h W^T + l B^T) adds dl = g B [N, r] and
dB = g^T l [V, r] from the same tiles g: two more GEMMs per chunk (the adapter operands in g's dtype), or a walk over
r in BLOCK_R steps with atomics in the fused mode; memory: the fp32 dl (N x r) and dB (V x r).
"""

import torch
import triton
import triton.language as tl

from .forward import kept_bitmaps, kept_words
from .gemm import chunk_size, mm_fp32, mm_token_rows
from .launch import on_first_argument_device, tensor_descriptors_fit, tile_operand
from .operands import HeadGrads
from .tile import gemm_scale, gradient_tile, lora_kernel_args, lora_tile, row_coefficients, tile_grad, to_gemm


@triton.jit
def _backward_kernel(
    hidden,
    weight,
    bias_ptr,
    targets_ptr,
    lse_ptr,
    nontarget_mass_ptr,
    mean_logit_ptr,
    mean_minus_target_ptr,
    grad_logp_ptr,
    grad_entropy_ptr,
    kept_coefficient_ptr,
    kept_bits_ptr,
    target_coefficient_ptr,
    exact_coefficient_ptr,
    kept_lse_ptr,
    g_ptr,
    grad_hidden_ptr,
    grad_weight_ptr,
    grad_bias_ptr,
    coefficient_max_ptr,
    g_unscale_ptr,
    N,
    V,
    D,
    stride_kept_row,
    stride_hn,
    stride_hd,
    stride_wv,
    stride_wd,
    stride_gn,
    inv_temperature,
    logit_scale,
    softcap,
    lora_hidden_ptr,
    lora_weight_ptr,
    R,
    grad_lora_hidden_ptr,
    grad_lora_weight_ptr,
    HAS_BIAS: tl.constexpr,
    HAS_LORA: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    ENTROPY_GRAD: tl.constexpr,
    KEPT_BITS: tl.constexpr,
    FUSED: tl.constexpr,
    USE_TMA: tl.constexpr,
    COMPUTE_DH: tl.constexpr,
    COMPUTE_DW: tl.constexpr,
    COMPUTE_DB: tl.constexpr,
    COMPUTE_DLH: tl.constexpr,
    COMPUTE_DLW: tl.constexpr,
    SCALE_G: tl.constexpr,
    DOT_FP32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    LORA_DOT_PRECISION: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_R: tl.constexpr,
    GROUP_V: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_v = tl.program_id(1)
    if FUSED and COMPUTE_DW:
        # grouped program order: the launch order (axis 0 fastest) walks GROUP_V vocabulary tiles of a token block,
        # then the next token block, so the programs resident at once add into ~GROUP_V dW row blocks, not all into
        # one; 32-bit, as _launch keeps the grid under 2^31 programs. Only here: without dW the token-block order
        # already spreads the atomics, and the remap spills registers in two fused frozen-W variants (sm_compile)
        pid_v, pid_n = tl.swizzle2d(pid_v, pid_n, tl.num_programs(1), tl.num_programs(0), GROUP_V)
    # int64 row offsets wherever a row times a stride may pass 2^31 elements (g: chunk x V with chunk <= D, at most
    # the size of W; hidden N x D; weight V x D; the fp32 dH and dW); ``tile`` says why
    offs_n, offs_v, n_mask, v_mask, g_ptrs, g_mask = gradient_tile(
        g_ptr, stride_gn, pid_n, pid_v, N, V, BLOCK_N, BLOCK_V
    )

    grad_logp, grad_entropy, kept_coefficients, coefficient_sum = row_coefficients(
        grad_logp_ptr,
        grad_entropy_ptr,
        kept_coefficient_ptr,
        exact_coefficient_ptr,
        offs_n,
        n_mask,
        ENTROPY_GRAD,
        KEPT_BITS,
    )
    if SCALE_G:
        # g's scale (tile.gemm_scale): |c| + |e| bounds the coefficients (the block's sum, fused; the call's max,
        # chunked: its GEMMs mix token blocks), logit_scale / temperature the slope
        coefficient_bound = coefficient_sum if FUSED else tl.load(coefficient_max_ptr)
        g_scale, g_unscale = gemm_scale(coefficient_bound * tl.abs(logit_scale * inv_temperature))
        if not FUSED:
            tl.store(g_unscale_ptr, g_unscale, mask=(pid_n == 0) & (pid_v == 0))
    else:  # fp32 g is not rounded
        g_scale = 1.0
        g_unscale = 1.0
    if coefficient_sum == 0.0:  # rows without a gradient (masked): exactly zero, no matmul needed
        if not FUSED:
            tl.store(g_ptrs, tl.zeros((BLOCK_N, BLOCK_V), tl.float32).to(g_ptr.dtype.element_ty), mask=g_mask)
        return
    g = tile_grad(
        hidden,
        weight,
        bias_ptr,
        lora_hidden_ptr,
        lora_weight_ptr,
        targets_ptr,
        lse_ptr,
        nontarget_mass_ptr,
        mean_logit_ptr,
        mean_minus_target_ptr,
        grad_logp,
        grad_entropy,
        kept_bits_ptr,
        stride_kept_row,
        kept_coefficients,
        target_coefficient_ptr,
        kept_lse_ptr,
        pid_n * BLOCK_N,
        pid_v * BLOCK_V,
        offs_n,
        offs_v,
        n_mask,
        v_mask,
        N,
        V,
        D,
        R,
        stride_hn,
        stride_wv,
        inv_temperature,
        logit_scale,
        softcap,
        HAS_BIAS,
        HAS_LORA,
        HAS_SOFTCAP,
        ENTROPY_GRAD,
        KEPT_BITS,
        USE_TMA,
        DOT_FP32,
        DOT_PRECISION,
        LORA_DOT_PRECISION,
        BLOCK_N,
        BLOCK_V,
        BLOCK_D,
        BLOCK_R,
    )
    if COMPUTE_DB:
        tl.atomic_add(grad_bias_ptr + offs_v, tl.sum(g, axis=0), mask=v_mask, sem="relaxed")
    if not FUSED:
        tl.store(g_ptrs, to_gemm(g * g_scale, g_ptr.dtype.element_ty), mask=g_mask)
    else:
        # the GEMM operand: g scaled and rounded to the input dtype, as the tensor cores take it (the interpreter
        # then upcasts it for its fp32 dot: the same rounding); every product is unscaled by g_unscale before its atomic
        g_dot = to_gemm(g * g_scale, hidden.dtype.element_ty)
        if DOT_FP32:
            g_dot = g_dot.to(tl.float32)
        for d0 in range(0, D, BLOCK_D):
            offs_d = d0 + tl.arange(0, BLOCK_D)
            d_mask = offs_d < D
            if COMPUTE_DH:
                w_vd = tl.load(
                    weight + offs_v[:, None].to(tl.int64) * stride_wv + offs_d[None, :] * stride_wd,
                    mask=v_mask[:, None] & d_mask[None, :],
                    other=0.0,
                )
                if DOT_FP32:
                    w_vd = w_vd.to(tl.float32)
                dh = tl.dot(g_dot, w_vd, input_precision=DOT_PRECISION) * g_unscale
                tl.atomic_add(
                    grad_hidden_ptr + offs_n[:, None].to(tl.int64) * D + offs_d[None, :],
                    dh,
                    mask=n_mask[:, None] & d_mask[None, :],
                    sem="relaxed",
                )
            if COMPUTE_DW:
                h_nd = tl.load(
                    hidden + offs_n[:, None].to(tl.int64) * stride_hn + offs_d[None, :] * stride_hd,
                    mask=n_mask[:, None] & d_mask[None, :],
                    other=0.0,
                )
                if DOT_FP32:
                    h_nd = h_nd.to(tl.float32)
                dw = tl.dot(tl.trans(g_dot), h_nd, input_precision=DOT_PRECISION) * g_unscale
                tl.atomic_add(
                    grad_weight_ptr + offs_v[:, None].to(tl.int64) * D + offs_d[None, :],
                    dw,
                    mask=v_mask[:, None] & d_mask[None, :],
                    sem="relaxed",
                )
        # LoRA's dl and dB: the adapter operands in g_dot's dtype, as the chunked mode's GEMMs take them (an fp32 dot
        # of fp32 g here spills registers on sm_90)
        if COMPUTE_DLH or COMPUTE_DLW:
            for r0 in range(0, R, BLOCK_R):
                offs_r = r0 + tl.arange(0, BLOCK_R)
                r_mask = offs_r < R
                if COMPUTE_DLH:
                    lw = lora_tile(lora_weight_ptr, offs_v, v_mask, r0, R, DOT_FP32, BLOCK_R).to(g_dot.dtype)
                    dlh = tl.dot(g_dot, lw, input_precision=DOT_PRECISION) * g_unscale
                    tl.atomic_add(
                        grad_lora_hidden_ptr + offs_n[:, None].to(tl.int64) * R + offs_r[None, :],
                        dlh,
                        mask=n_mask[:, None] & r_mask[None, :],
                        sem="relaxed",
                    )
                if COMPUTE_DLW:
                    lh = lora_tile(lora_hidden_ptr, offs_n, n_mask, r0, R, DOT_FP32, BLOCK_R).to(g_dot.dtype)
                    dlw = tl.dot(tl.trans(g_dot), lh, input_precision=DOT_PRECISION) * g_unscale
                    tl.atomic_add(
                        grad_lora_weight_ptr + offs_v[:, None].to(tl.int64) * R + offs_r[None, :],
                        dlw,
                        mask=v_mask[:, None] & r_mask[None, :],
                        sem="relaxed",
                    )


def _launch(
    head, stats, grad_logp, grad_entropy, grads, config, g=None, coefficient_max=None, g_unscale=None, support=None
):
    """One launch over hidden's rows; g (chunked: scaled by the power of two its kernel takes from
    ``coefficient_max`` [1] and writes the inverse of into ``g_unscale`` [1]) or the fp32 dH / dW / dl / dB (fused)
    receive the result (``grads``: an operands.HeadGrads). ``support``: None, or (bitmaps [rows, words] int32,
    SupportGradient) of these rows: a replayed kept set's support term (chunked only)."""
    hidden, weight, targets, bias, transform, lora = head
    N, D = hidden.shape
    V = weight.shape[0]
    dummy = stats.lse
    entropy_grad = grad_entropy is not None
    grid = (triton.cdiv(N, config.block_n), triton.cdiv(V, config.block_v))
    if grid[0] * grid[1] >= 2**31:
        raise ValueError(
            f"{N} tokens x {V} vocabulary entries make {grid[0] * grid[1]} backward programs; the "
            "kernel numbers them in 32 bits (at most 2^31 - 1): split the batch"
        )
    # the copy engine's tiles in the chunked mode (the fused one reads H and W rows again through pointers)
    use_tma = config.use_tma and g is not None and tensor_descriptors_fit(hidden, weight)
    _backward_kernel[grid](
        tile_operand(hidden, use_tma, config.block_n, config.block_d),
        tile_operand(weight, use_tma, config.block_v, config.block_d),
        bias if bias is not None else dummy,
        targets,
        stats.lse,
        stats.nontarget_mass,
        stats.mean_logit if entropy_grad else dummy,
        stats.mean_minus_target if entropy_grad else dummy,
        grad_logp,
        grad_entropy if entropy_grad else dummy,
        support[1].kept_coefficient if support is not None else dummy,
        support[0] if support is not None else dummy,
        support[1].target_coefficient if support is not None else dummy,
        support[1].exact_coefficient if support is not None else dummy,
        support[1].kept_lse if support is not None else dummy,
        g if g is not None else dummy,
        grads.hidden if grads.hidden is not None else dummy,
        grads.weight if grads.weight is not None else dummy,
        grads.bias if grads.bias is not None else dummy,
        coefficient_max if coefficient_max is not None else dummy,
        g_unscale if g_unscale is not None else dummy,
        N,
        V,
        D,
        support[0].stride(0) if support is not None else 0,
        hidden.stride(0),
        hidden.stride(1),
        weight.stride(0),
        weight.stride(1),
        g.stride(0) if g is not None else 0,
        *transform.kernel_scalars(),
        **lora_kernel_args(lora, dummy, config),
        grad_lora_hidden_ptr=grads.lora_hidden if grads.lora_hidden is not None else dummy,
        grad_lora_weight_ptr=grads.lora_weight if grads.lora_weight is not None else dummy,
        HAS_BIAS=bias is not None,
        HAS_SOFTCAP=transform.softcap is not None,
        ENTROPY_GRAD=entropy_grad,
        KEPT_BITS=support is not None,
        FUSED=g is None,
        USE_TMA=use_tma,
        COMPUTE_DH=grads.hidden is not None,
        COMPUTE_DW=grads.weight is not None,
        COMPUTE_DB=grads.bias is not None,
        COMPUTE_DLH=grads.lora_hidden is not None,
        COMPUTE_DLW=grads.lora_weight is not None,
        SCALE_G=hidden.dtype != torch.float32,
        DOT_FP32=config.dot_fp32,
        DOT_PRECISION=config.dot_precision(hidden.dtype),
        BLOCK_N=config.block_n,
        BLOCK_V=config.block_v,
        BLOCK_D=config.block_d,
        GROUP_V=config.group_v,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )


def _rows(stats, n0, n1):
    return type(stats)(*(x[n0:n1] if x is not None else None for x in stats))


@on_first_argument_device
def backward_chunked(head, stats, grad_logp, grad_entropy, grads, config, support=None):
    """Into ``grads`` (an operands.HeadGrads of fp32 buffers, any None): dH written, dW zero on entry, db added to;
    with LoRA d lora_hidden written, d lora_weight zero on entry. ``head``: the operands.HeadOperands.

    ``stats``: the forward's softmax_stats.BackwardStats; ``grad_logp`` = dL/dlogp [N] fp32; ``grad_entropy`` =
    dL/dentropy [N] fp32 or None (then the stats' entropy values are unused); ``config``: a config.BackwardConfig.
    ``support``: None, or an operands.SupportGradient: a replayed kept set's support term in the same g (each
    chunk's sets as bitmaps, ``forward.kept_bitmaps``, [chunk, ceil(V / 32)] int32).
    bf16 / fp16 g is scaled by one power of two for the whole call (tile.gemm_scale, from max |c| + |e| + |d|, on
    the device: no host read); dH is unscaled per chunk, dW once at the end (hence zero on entry).
    """
    hidden, weight, lora = head.hidden, head.weight, head.lora
    N, D = hidden.shape
    V = weight.shape[0]
    chunk = chunk_size(N, D)
    # dH = g W runs in blocks of gemm.TOKEN_GEMM_ROWS token rows (gemm.mm_token_rows: a row's dH whatever N); a
    # chunk of whole blocks (gemm.chunk_size from D = 256 on) holds the last chunk's padding rows itself (the rows an
    # earlier chunk left there), a single shorter chunk pads one block in a temporary
    g = torch.empty((chunk, V), dtype=hidden.dtype, device=hidden.device)
    # (gradient of the rows operand, of the columns operand, rows operand, columns operand): the base head's, and
    # LoRA's with its adapters in g's dtype (the GEMM operands)
    operand_pairs = [(grads.hidden, grads.weight, hidden, weight)]
    if lora is not None:
        operand_pairs.append((grads.lora_hidden, grads.lora_weight, *(x.to(g.dtype) for x in lora)))
    scaled = hidden.dtype != torch.float32
    coefficient_max = g_unscale = None
    if scaled:
        coefficients = grad_logp.abs() if grad_entropy is None else grad_logp.abs() + grad_entropy.abs()
        if support is not None:
            coefficients = coefficients + support.grad_support.abs()
        coefficient_max = coefficients.amax().reshape(1)
        g_unscale = torch.empty(1, dtype=torch.float32, device=hidden.device)
    bits = None
    if support is not None:
        bits = torch.empty((chunk, kept_words(V)), dtype=torch.int32, device=hidden.device)
    for n0 in range(0, N, chunk):
        n1 = min(n0 + chunk, N)
        chunk_support = None
        if support is not None:
            chunk_support = (kept_bitmaps(support.kept_ids[n0:n1], V, bits[: n1 - n0]), _rows(support, n0, n1))
        _launch(
            head.tokens(n0, n1),
            _rows(stats, n0, n1),
            grad_logp[n0:n1],
            grad_entropy[n0:n1] if grad_entropy is not None else None,
            HeadGrads(bias=grads.bias),
            config,
            g,
            coefficient_max,
            g_unscale,
            chunk_support,
        )
        rows = n1 - n0
        g_rows = g[:rows]
        for grad_rows, grad_columns, rows_operand, columns_operand in operand_pairs:
            if grad_rows is not None:  # dH = g W (LoRA: dl = g B), written per chunk, in blocks of token rows
                mm_token_rows(g, columns_operand, grad_rows[n0:n1], accumulate=False, rows=rows)
                if scaled:
                    grad_rows[n0:n1].mul_(g_unscale)
            if grad_columns is not None:  # dW += g^T H (LoRA: dB += g^T l), in g's scaled units until the end
                mm_fp32(g_rows.T, rows_operand[n0:n1], grad_columns, accumulate=True)
    for _, grad_columns, _, _ in operand_pairs:
        if scaled and grad_columns is not None:
            grad_columns.mul_(g_unscale)


@on_first_argument_device
def backward_fused(head, stats, grad_logp, grad_entropy, grads, config):
    """Accumulate dH, dW, db (and LoRA's dl, dB) into ``grads``' fp32 buffers (zero-initialised, or None when not
    needed) with atomics; the arguments as ``backward_chunked``'s."""
    _launch(head, stats, grad_logp, grad_entropy, grads, config)
