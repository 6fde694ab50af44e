"""Tile helpers: the device functions the layer-1 kernels share: the logit transform (value and slope), one logit
tile (through tensor descriptors or pointers, or read from a GEMM's output in memory), a token block's gradient
coefficients, and one tile of the general path's gradient.

    u[i, j] = h_i . W_j + l_i . B_j + b_j          (fp32 accumulation over D in BLOCK_D steps, then with HAS_LORA
                                                    over r in BLOCK_R steps into the same accumulator)
    z[i, j] = softcap * tanh(logit_scale * u / softcap) / tau     (no tanh without HAS_SOFTCAP; TRL 1.16's order;
                                                                   columns past the vocab are -inf)
    g[i, j] = dL/du = dz * dz/du,  dz/du = logit_scale (1 - tanh^2) / tau  (logit_scale / tau without a soft-cap),
        with c = grad_logp, e = grad_entropy (only with ENTROPY_GRAD), p = exp(z - lse), mean = sum_j p_j z_j:
        dz[i, j] = -c_i p_ij + e_i p_ij (mean_i - z_ij)                              for j != y_i
        dz[i, y] =  c_i (1 - p_iy) + e_i p_iy (mean_i - z_iy)      (1 - p_iy, mean_i - z_iy: from the forward)
(the entropy H = lse - mean, so dH/dz_j = p_j (mean - z_j)). The target column reads 1 - p_y and mean - z_y from the
forward's record (``softmax_stats``), where they are sums of same-signed terms: recomputed here they would cancel.
tanh is formed from e = exp(-2|x|) as (1 - e) / (1 + e) and its slope as 4e / (1 + e)^2: no overflow, and the slope
keeps its relative precision where tanh saturates (``transform.LogitTransform.apply`` is the same in torch). LoRA's
pair l [N, r], B [V, r] (contiguous, row stride R) is in the adapters' dtype, its dot at LORA_DOT_PRECISION.

Rounding for a GEMM (``gemm_scale``): g (and the frozen head's P') are rounded to fp16 / bf16 for the tensor cores;
dL/dlogp carries GRPO's 1/tokens normaliser (1e-4 and below) and fp16's smallest normal is 6.1e-5, so unscaled they
would land in fp16's subnormals (or flush to zero). The kernels multiply them by an exact power of two 2^k before
the rounding, chosen from a bound on their magnitude, and multiply the fp32 products by 2^-k: exact, so only the
rounding to the GEMM dtype remains, at its full relative precision whatever the gradient's scale.

Memory: registers only, a BLOCK_N x BLOCK_V fp32 tile. ``DOT_FP32`` upcasts the dot operands (the CPU interpreter's
bf16 tl.dot is wrong in triton 3.9); on a GPU they stay in the input dtype for the tensor cores.
"""

import triton
import triton.language as tl

from .launch import interpreting

# gemm_scale puts the bound at 2^GRAD_SCALE_EXP..2^(GRAD_SCALE_EXP + 1): the largest value then stays far below fp16's
# 65504 (the backward's g is at most its bound times ln V + 1 < 17, its entropy term's largest factor) while the
# small ones keep 8 more bits above the subnormals than at a bound of 1
GRAD_SCALE_EXP = tl.constexpr(8)
GRAD_SCALE_CEILING = tl.constexpr(2.0 ** (GRAD_SCALE_EXP.value + 1))  # the scaled bound is below it
# a GPU converts fp32 to bf16 rounding to nearest even; triton 3.9's interpreter drops the low 16 bits instead (round
# toward zero: twice the error, all of one sign, so a GEMM's sum of rounded g grows it coherently): there to_gemm
# rounds the bits first, and the CPU tests see the GPU's bf16 operands
ROUND_BF16_BY_HAND = tl.constexpr(interpreting())


@triton.jit
def pow2(k):
    """2^k exactly (its fp32 bit pattern), for integer k in [-126, 127]."""
    return ((k + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def gemm_scale(bound):
    """(2^k, 2^-k), exact powers of two with bound * 2^k in [2^GRAD_SCALE_EXP, 2^(GRAD_SCALE_EXP + 1)) for a bound
    >= 0 (a number or a tile), k within [-126, 126]: a zero or subnormal bound takes 2^126, inf or NaN 2^-120."""
    biased_exponent = (bound.to(tl.int32, bitcast=True) >> 23) & 0xFF
    k = tl.minimum(tl.maximum(GRAD_SCALE_EXP + 127 - biased_exponent, -126), 126)
    return pow2(k), pow2(-k)


@triton.jit
def to_gemm(x, dtype: tl.constexpr):
    """fp32 x converted to ``dtype`` (a GEMM operand's) rounded to nearest even, on a GPU and in the interpreter
    alike (ROUND_BF16_BY_HAND: bf16's bits taken by hand, past the interpreter's conversion, which also garbles
    subnormals); a NaN stays a NaN."""
    if ROUND_BF16_BY_HAND and dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        # the high half, rounded: bf16's bit pattern (a NaN's high half with the quiet bit set: a NaN still)
        high = tl.where(x == x, (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16, (bits >> 16) | 0x40)
        return high.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return x.to(dtype)


@triton.jit
def transform_and_slope(u, inv_temperature, logit_scale, softcap, HAS_SOFTCAP: tl.constexpr):
    """(z, dz/du) of raw fp32 logits u: dz/du is a tile with a soft-cap, a number without (unused: compiled out)."""
    a = u * logit_scale
    slope = logit_scale * inv_temperature
    if HAS_SOFTCAP:
        x = a / softcap
        e = tl.exp(-2.0 * tl.abs(x))
        t = (1.0 - e) / (1.0 + e)
        a = softcap * tl.where(x < 0.0, -t, t)
        slope = slope * (4.0 * e / ((1.0 + e) * (1.0 + e)))
    return a * inv_temperature, slope


def lora_kernel_args(lora, dummy, config):
    """The LoRA keywords of a tile kernel's launch (config: a config._DotTileConfig): the operand pair
    (lora_hidden [N, r], lora_weight [V, r], contiguous, one dtype) or ``dummy`` pointers without ``lora``, R, and
    the constexprs HAS_LORA, LORA_DOT_PRECISION (the adapters' dtype's) and BLOCK_R (config.lora_block)."""
    if lora is None:
        return dict(
            lora_hidden_ptr=dummy,
            lora_weight_ptr=dummy,
            R=0,
            HAS_LORA=False,
            LORA_DOT_PRECISION=config.dot_precision(dummy.dtype),
            BLOCK_R=16,
        )
    lora_hidden, lora_weight = lora
    R = lora_weight.shape[1]
    return dict(
        lora_hidden_ptr=lora_hidden,
        lora_weight_ptr=lora_weight,
        R=R,
        HAS_LORA=True,
        LORA_DOT_PRECISION=config.dot_precision(lora_weight.dtype),
        BLOCK_R=config.lora_block(R),
    )


@triton.jit
def lora_tile(ptr, offs_rows, row_mask, r0, R, DOT_FP32: tl.constexpr, BLOCK_R: tl.constexpr):
    """Rows ``offs_rows`` x columns [r0, r0 + BLOCK_R) of a LoRA operand [rows, R] (contiguous), zero outside."""
    offs_r = r0 + tl.arange(0, BLOCK_R)
    x = tl.load(
        ptr + offs_rows[:, None].to(tl.int64) * R + offs_r[None, :],
        mask=row_mask[:, None] & (offs_r < R)[None, :],
        other=0.0,
    )
    if DOT_FP32:
        x = x.to(tl.float32)
    return x


@triton.jit
def _raw_logit_tile(
    hidden_ptr,
    weight_ptr,
    bias_ptr,
    lora_hidden_ptr,
    lora_weight_ptr,
    offs_n,
    offs_v,
    n_mask,
    v_mask,
    D,
    R,
    stride_hn,
    stride_hd,
    stride_wv,
    stride_wd,
    HAS_BIAS: tl.constexpr,
    HAS_LORA: tl.constexpr,
    DOT_FP32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    LORA_DOT_PRECISION: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """u = H W^T + L B^T (HAS_LORA) + b for one tile, fp32."""
    acc = tl.zeros((BLOCK_N, BLOCK_V), tl.float32)
    for d0 in range(0, D, BLOCK_D):
        offs_d = d0 + tl.arange(0, BLOCK_D)
        d_mask = offs_d < D
        # int64 row offsets: N x D and V x D may pass 2^31 elements, and a 32-bit index times a 32-bit stride would
        # wrap (Triton passes a stride below 2^31 as i32); the column strides are 1 (the API makes them so)
        h = tl.load(
            hidden_ptr + offs_n[:, None].to(tl.int64) * stride_hn + offs_d[None, :] * stride_hd,
            mask=n_mask[:, None] & d_mask[None, :],
            other=0.0,
        )
        w = tl.load(
            weight_ptr + offs_v[None, :].to(tl.int64) * stride_wv + offs_d[:, None] * stride_wd,
            mask=v_mask[None, :] & d_mask[:, None],
            other=0.0,
        )
        if DOT_FP32:
            h = h.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(h, w, acc, input_precision=DOT_PRECISION)
    return _lora_and_bias(
        acc,
        bias_ptr,
        lora_hidden_ptr,
        lora_weight_ptr,
        offs_n,
        offs_v,
        n_mask,
        v_mask,
        R,
        HAS_BIAS,
        HAS_LORA,
        DOT_FP32,
        LORA_DOT_PRECISION,
        BLOCK_R,
    )


@triton.jit
def _lora_and_bias(
    acc,
    bias_ptr,
    lora_hidden_ptr,
    lora_weight_ptr,
    offs_n,
    offs_v,
    n_mask,
    v_mask,
    R,
    HAS_BIAS: tl.constexpr,
    HAS_LORA: tl.constexpr,
    DOT_FP32: tl.constexpr,
    LORA_DOT_PRECISION: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """acc + L B^T (HAS_LORA: the second K-loop, [h | l] . [W | B] in one accumulator) + b (HAS_BIAS)."""
    if HAS_LORA:
        for r0 in range(0, R, BLOCK_R):
            lh = lora_tile(lora_hidden_ptr, offs_n, n_mask, r0, R, DOT_FP32, BLOCK_R)
            lw = lora_tile(lora_weight_ptr, offs_v, v_mask, r0, R, DOT_FP32, BLOCK_R)
            acc = tl.dot(lh, tl.trans(lw), acc, input_precision=LORA_DOT_PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_v, mask=v_mask, other=0.0).to(tl.float32)[None, :]
    return acc


@triton.jit
def raw_logit_tile_at(
    hidden,
    weight,
    bias_ptr,
    lora_hidden_ptr,
    lora_weight_ptr,
    n0,
    v0,
    N,
    V,
    D,
    R,
    stride_hn,
    stride_wv,
    HAS_BIAS: tl.constexpr,
    HAS_LORA: tl.constexpr,
    USE_TMA: tl.constexpr,
    DOT_FP32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    LORA_DOT_PRECISION: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """u = H W^T + L B^T (HAS_LORA) + b for rows [n0, n0 + BLOCK_N) < N and columns [v0, v0 + BLOCK_V) < V, fp32.

    ``hidden`` and ``weight`` are tensor descriptors with USE_TMA (Hopper's copy engine: blocks [BLOCK_N, BLOCK_D]
    and [BLOCK_V, BLOCK_D], zero past each edge), else pointers (``_raw_logit_tile``'s masked loads)."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_v = v0 + tl.arange(0, BLOCK_V)
    n_mask = offs_n < N
    v_mask = offs_v < V
    if USE_TMA:
        acc = tl.zeros((BLOCK_N, BLOCK_V), tl.float32)
        for d0 in range(0, D, BLOCK_D):
            h = hidden.load([n0, d0])
            w = weight.load([v0, d0])
            if DOT_FP32:
                h = h.to(tl.float32)
                w = w.to(tl.float32)
            acc = tl.dot(h, w.T, acc, input_precision=DOT_PRECISION)
        acc = _lora_and_bias(
            acc,
            bias_ptr,
            lora_hidden_ptr,
            lora_weight_ptr,
            offs_n,
            offs_v,
            n_mask,
            v_mask,
            R,
            HAS_BIAS,
            HAS_LORA,
            DOT_FP32,
            LORA_DOT_PRECISION,
            BLOCK_R,
        )
    else:  # one return, after both branches: triton 3.6 compiles the code after a constexpr branch's return
        acc = _raw_logit_tile(
            hidden,
            weight,
            bias_ptr,
            lora_hidden_ptr,
            lora_weight_ptr,
            offs_n,
            offs_v,
            n_mask,
            v_mask,
            D,
            R,
            stride_hn,
            1,
            stride_wv,
            1,
            HAS_BIAS,
            HAS_LORA,
            DOT_FP32,
            DOT_PRECISION,
            LORA_DOT_PRECISION,
            BLOCK_N,
            BLOCK_V,
            BLOCK_D,
            BLOCK_R,
        )
    return acc


@triton.jit
def logit_tile_at(
    hidden,
    weight,
    bias_ptr,
    lora_hidden_ptr,
    lora_weight_ptr,
    n0,
    v0,
    N,
    V,
    D,
    R,
    stride_hn,
    stride_wv,
    inv_temperature,
    logit_scale,
    softcap,
    HAS_BIAS: tl.constexpr,
    HAS_LORA: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    USE_TMA: tl.constexpr,
    DOT_FP32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    LORA_DOT_PRECISION: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """The transformed logits z of the tile at (n0, v0) (-inf past the vocabulary) and dz/du (transform_and_slope):
    ``raw_logit_tile_at``'s u through the logit transform."""
    u = raw_logit_tile_at(
        hidden,
        weight,
        bias_ptr,
        lora_hidden_ptr,
        lora_weight_ptr,
        n0,
        v0,
        N,
        V,
        D,
        R,
        stride_hn,
        stride_wv,
        HAS_BIAS,
        HAS_LORA,
        USE_TMA,
        DOT_FP32,
        DOT_PRECISION,
        LORA_DOT_PRECISION,
        BLOCK_N,
        BLOCK_V,
        BLOCK_D,
        BLOCK_R,
    )
    z, slope = transform_and_slope(u, inv_temperature, logit_scale, softcap, HAS_SOFTCAP)
    offs_v = v0 + tl.arange(0, BLOCK_V)
    return tl.where((offs_v < V)[None, :], z, float("-inf")), slope


@triton.jit
def stored_logit_tile_at(
    logits,
    bias_ptr,
    n0,
    v0,
    N,
    V,
    stride_n,
    inv_temperature,
    logit_scale,
    softcap,
    HAS_BIAS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """``logit_tile_at``'s (z, dz/du) from products already in memory: ``logits`` the fp32 H W^T of rows < N (row
    stride ``stride_n``, a GEMM's output), the bias added here as the dot's tiles add it."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_v = v0 + tl.arange(0, BLOCK_V)
    v_mask = offs_v < V
    mask = (offs_n < N)[:, None] & v_mask[None, :]
    u = tl.load(logits + offs_n[:, None].to(tl.int64) * stride_n + offs_v[None, :], mask=mask, other=0.0)
    if HAS_BIAS:
        u += tl.load(bias_ptr + offs_v, mask=v_mask, other=0.0).to(tl.float32)[None, :]
    z, slope = transform_and_slope(u, inv_temperature, logit_scale, softcap, HAS_SOFTCAP)
    return tl.where(v_mask[None, :], z, float("-inf")), slope


@triton.jit
def logit_tile(
    hidden_ptr,
    weight_ptr,
    bias_ptr,
    lora_hidden_ptr,
    lora_weight_ptr,
    offs_n,
    offs_v,
    n_mask,
    v_mask,
    D,
    R,
    stride_hn,
    stride_hd,
    stride_wv,
    stride_wd,
    inv_temperature,
    logit_scale,
    softcap,
    HAS_BIAS: tl.constexpr,
    HAS_LORA: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    DOT_FP32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    LORA_DOT_PRECISION: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """The transformed logits z of one tile (-inf past the vocabulary) and dz/du (see transform_and_slope)."""
    u = _raw_logit_tile(
        hidden_ptr,
        weight_ptr,
        bias_ptr,
        lora_hidden_ptr,
        lora_weight_ptr,
        offs_n,
        offs_v,
        n_mask,
        v_mask,
        D,
        R,
        stride_hn,
        stride_hd,
        stride_wv,
        stride_wd,
        HAS_BIAS,
        HAS_LORA,
        DOT_FP32,
        DOT_PRECISION,
        LORA_DOT_PRECISION,
        BLOCK_N,
        BLOCK_V,
        BLOCK_D,
        BLOCK_R,
    )
    z, slope = transform_and_slope(u, inv_temperature, logit_scale, softcap, HAS_SOFTCAP)
    return tl.where(v_mask[None, :], z, float("-inf")), slope


@triton.jit
def gradient_tile(g_ptr, stride_g, pid_n, pid_v, N, V, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr):
    """Tile (pid_n, pid_v) of an [N, V] gradient buffer (the backwards' g): its rows and columns, their masks, and
    the tile's pointers (int64 row offsets: g may pass 2^31 elements) and mask."""
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_v = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    n_mask = offs_n < N
    v_mask = offs_v < V
    g_ptrs = g_ptr + offs_n[:, None].to(tl.int64) * stride_g + offs_v[None, :]
    return offs_n, offs_v, n_mask, v_mask, g_ptrs, n_mask[:, None] & v_mask[None, :]


@triton.jit
def row_coefficients(
    grad_logp_ptr,
    grad_entropy_ptr,
    kept_coefficient_ptr,
    exact_coefficient_ptr,
    offs_n,
    n_mask,
    ENTROPY_GRAD: tl.constexpr,
    KEPT_BITS: tl.constexpr,
):
    """A token block's dL/dlogp, dL/dentropy (only with ENTROPY_GRAD) and a kept set's coefficients (only with
    KEPT_BITS: ``operands.SupportGradient``'s kept and exact ones, a pair; 0 where d is), and the sum of their
    magnitudes: 0 means the block has no gradient (masked rows), which the kernels skip exactly.
    A sum, not a max: a NaN coefficient must make the block's gradient NaN, and max (the interpreter's nanmax, PTX
    max.f32) drops it."""
    grad_logp = tl.load(grad_logp_ptr + offs_n, mask=n_mask, other=0.0)
    scale = tl.sum(tl.abs(grad_logp), axis=0)
    grad_entropy = grad_logp
    if ENTROPY_GRAD:
        grad_entropy = tl.load(grad_entropy_ptr + offs_n, mask=n_mask, other=0.0)
        scale += tl.sum(tl.abs(grad_entropy), axis=0)
    kept_coefficients = (grad_logp, grad_logp)
    if KEPT_BITS:
        kept_coefficients = (
            tl.load(kept_coefficient_ptr + offs_n, mask=n_mask, other=0.0),
            tl.load(exact_coefficient_ptr + offs_n, mask=n_mask, other=0.0),
        )
        scale += tl.sum(tl.abs(kept_coefficients[0]) + tl.abs(kept_coefficients[1]), axis=0)
    return grad_logp, grad_entropy, kept_coefficients, scale


@triton.jit
def kept_bits_tile(kept_bits_ptr, stride_kept_row, offs_n, v0, n_mask, V, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr):
    """[BLOCK_N, BLOCK_V] bool: whether each column v0 + j is in its row's kept set, bit v & 31 of word v >> 5 of the
    row's bitmap (``forward.kept_bitmaps``; 0 where masked). The tile's words of each row are loaded once and each
    broadcast to its 32 logits ([BLOCK_N, WORDS, 32] as the tile: on sm_90 a bit test and a select a logit; the
    load of each logit's word, the tile then converted to the load's layout, took 77 SASS instructions a logit, a
    tl.gather of the words through shared memory 24)."""
    tl.static_assert(BLOCK_V % 32 == 0, "a tile covers whole words of the bitmap")
    WORDS: tl.constexpr = BLOCK_V // 32
    offs_w = v0 // 32 + tl.arange(0, WORDS)
    words = tl.load(
        kept_bits_ptr + offs_n[:, None] * stride_kept_row + offs_w[None, :],
        mask=n_mask[:, None] & (offs_w[None, :] * 32 < V),
        other=0,
    )
    column = tl.arange(0, BLOCK_V)
    word = tl.reshape(tl.broadcast_to(words[:, :, None], (BLOCK_N, WORDS, 32)), (BLOCK_N, BLOCK_V))
    return (word & (1 << (column & 31))[None, :]) != 0


@triton.jit
def tile_grad(
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
    n0,
    v0,
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
    HAS_BIAS: tl.constexpr,
    HAS_LORA: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    ENTROPY_GRAD: tl.constexpr,
    KEPT_BITS: tl.constexpr,
    USE_TMA: tl.constexpr,
    DOT_FP32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    LORA_DOT_PRECISION: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """g = dL/du for one tile (rows ``offs_n`` from n0, columns ``offs_v`` from v0), from the recomputed logits
    (``logit_tile_at``: ``hidden`` and ``weight`` are tensor descriptors with USE_TMA) and the forward's per-token
    values (module docstring). ``grad_logp`` and ``grad_entropy`` are this tile's rows of dL/dlogp and dL/dentropy.
    With KEPT_BITS also a replayed kept set's support s = z_y - L_kept (the sets as bitmaps, ``kept_bits_tile``):
    -d q_v on each kept v != y, q_v = p_v exp(L - L_kept), the row's kept coefficient d exp(L - L_kept) on the
    tile's own p (no exponential of its own), and d (1 - q_y) carried at the target (``target_coefficient_ptr``);
    ``kept_coefficients``: (kept, exact) of the rows (``operands.SupportGradient``): a block with an exact one (a set
    far below its row's max) also subtracts d exp(z_v - L_kept) on those rows' kept logits, its own exponential (0
    on the other rows: their values bit for bit the same)."""
    targets = tl.load(targets_ptr + offs_n, mask=n_mask, other=-1)
    # rows past the batch: lse +inf makes their p exactly 0 (with 0 their exp(z) overflows, and 0 x inf is a NaN in db)
    lse = tl.load(lse_ptr + offs_n, mask=n_mask, other=float("inf"))
    nontarget_mass = tl.load(nontarget_mass_ptr + offs_n, mask=n_mask, other=0.0)
    z, slope = logit_tile_at(
        hidden,
        weight,
        bias_ptr,
        lora_hidden_ptr,
        lora_weight_ptr,
        n0,
        v0,
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
        USE_TMA,
        DOT_FP32,
        DOT_PRECISION,
        LORA_DOT_PRECISION,
        BLOCK_N,
        BLOCK_V,
        BLOCK_D,
        BLOCK_R,
    )
    p = tl.exp(z - lse[:, None])
    is_target = offs_v[None, :] == targets[:, None]
    if KEPT_BITS:
        kept_coefficient, exact_coefficient = kept_coefficients
        kept = kept_bits_tile(kept_bits_ptr, stride_kept_row, offs_n, v0, n_mask, V, BLOCK_N, BLOCK_V)
        dz = -(grad_logp[:, None] + tl.where(kept, kept_coefficient[:, None], 0.0)) * p
        if tl.sum((exact_coefficient != 0.0).to(tl.int32), axis=0) > 0:  # NaN too
            # an empty set's L_kept is -inf: a finite pivot (no kept lane reads it); the exponent -inf off the set,
            # so no exp(z - L_kept) of a logit far above the set (an overflow) forms
            kept_lse = tl.load(kept_lse_ptr + offs_n, mask=n_mask, other=0.0)
            kept_lse = tl.where(kept_lse == float("-inf"), 0.0, kept_lse)
            q = tl.exp(tl.where(kept, z - kept_lse[:, None], float("-inf")))
            dz -= exact_coefficient[:, None] * q
        target_dz = grad_logp * nontarget_mass + tl.load(target_coefficient_ptr + offs_n, mask=n_mask, other=0.0)
        target_dz = target_dz[:, None]
    else:
        dz = -grad_logp[:, None] * p
        target_dz = grad_logp[:, None] * nontarget_mass[:, None]
    if ENTROPY_GRAD:
        mean_logit = tl.load(mean_logit_ptr + offs_n, mask=n_mask, other=0.0)
        mean_minus_target = tl.load(mean_minus_target_ptr + offs_n, mask=n_mask, other=0.0)
        # p is 0 where z is -inf: keep 0 * inf from forming a NaN
        dz += grad_entropy[:, None] * p * tl.where(p > 0.0, mean_logit[:, None] - z, 0.0)
        target_dz += grad_entropy[:, None] * p * mean_minus_target[:, None]
    return tl.where(is_target, target_dz, dz) * slope
