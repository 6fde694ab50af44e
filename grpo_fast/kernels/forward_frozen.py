"""The frozen-head forward of layer 1: log-probs, entropy, the backward's per-token values, and J = d logp / d h.

When neither the weight nor the bias needs a gradient and the entropy needs none (a LoRA / frozen lm_head, the
entropy a metric only), the backward is dH = c[:, None] * J, c = dL/dlogp: two vocabulary GEMM sweeps in all
(u = H W^T and P' W, both here) instead of three. TRL's chunked log-prob head has the same shape: cuBLAS for both
GEMMs, a Triton kernel for the softmax state between them.

Math, for token n, u_nv = h_n . W_v (+ b_v), the transform of ``tile`` (soft-cap c, logit scale k, temperature tau):
    z_nv = c tanh(k u_nv / c) / tau,   s'_nv = dz_nv / du_nv = k (1 - tanh^2) / tau   (k u / tau, k / tau without one)
    J_n  = s'_ny W_y - sum_v p_nv s'_nv W_v = (s'_ny R_n W_y - sum_{v != y} e_nv s'_nv W_v) / S_n,
with e_nv = exp(z_nv - m_n), S_n = sum_v e_nv, R_n = sum_{v != y} e_nv: 1 - p_ny = R_n / S_n is a sum of positive
terms, never a difference, so J stays exact where the model is sure of its token. Per token chunk (at most
``gemm.chunk_size(N, D)`` rows) and vocabulary chunk [v0, v1) (``vocab_chunk_size`` from ``gemm.chunk_rows(D)``: the
same split of a row's vocabulary at any N): u = H_chunk W[v0:v1]^T (fp32, cuBLAS; both GEMMs in blocks of
``gemm.TOKEN_GEMM_ROWS`` token rows, ``gemm.mm_token_rows``: a row's products whatever N); then
``_frozen_chunk_kernel`` in two passes over the chunk's tiles: the row max and largest non-target z (the new pivot,
rescale = exp(m - m_new), P''s power of two), then e = exp(z - m_new), the record's sums (softmax_stats' merge) and
P' = 2^k e s' with the target column zeroed, written over u in the GEMM dtype; then J_chunk = J_chunk rescale
2^(k_new - k_old) + P' W[v0:v1] (fp32, cuBLAS addmm). At the end J = (s'_y R W_y - 2^-k J_chunk) / S
(softmax_stats.finish_frozen_grad) and the outputs by softmax_stats.finish. With LoRA (a frozen adapter, l [N, r],
B [V, r]) u += l B^T, and J_l = d logp / d l [N, r] accumulates P' B alike.

Rounding: u, the state and J are fp32; P' is rounded to the input dtype for the tensor cores after a per-row power of
two 2^k (``tile.gemm_scale``) from the bound on the row's P' so far (on a confident token every non-target e is
~1e-6, below fp16's smallest normal); a chunk that moves k folds 2^(k_new - k_old) into the rescale (at most 1).
fp32 inputs keep fp32 P'. Under TRITON_INTERPRET=1 or on a CPU device every GEMM runs on fp32 operands.

Memory: J, N x D fp32 (kept for the backward: 100 MB at N 16k, D 1536); the u buffer, chunk (in whole blocks of
token rows: the last block's padding) x vocabulary chunk fp32, about the size of W (``vocab_chunk_size``: 467 MB at
the Qwen2.5-1.5B head); 8 x N fp32 of state. P' lies over the u tile it came from (a program's stores reach only
entries it has already read). No tensor of N x V exists. Taken where ``available``: CUDA with torch >= 2.8
(cuBLAS's out_dtype) or fp32 inputs, a CPU device, the interpreter.
"""

import torch
import triton
import triton.language as tl

from . import softmax_stats
from .gemm import OUT_DTYPE_GEMM, chunk_rows, chunk_size, mm_fp32, mm_token_rows, padded_rows, token_chunk_rows
from .launch import on_first_argument_device
from .tile import GRAD_SCALE_CEILING, gemm_scale, to_gemm, transform_and_slope

# a column entry folds into P' while |dL/du / f| < 2^COLUMN_FOLD_EXP and |f| >= 2^-COLUMN_FOLD_EXP
# (``forward_trained_head``'s ``columns``): P' stays far inside bf16's range and f H (bf16) far above its subnormals
COLUMN_FOLD_EXP = 60
# the vocabulary chunk is a multiple of this: P' rows (bf16 / fp16, row stride 2 x chunk) stay 16-byte aligned
VOCAB_ALIGN = 128
# the rows of the running state [8, N] fp32 (``state.unbind(0)`` on the host, in this order): running max m,
# S = sum e, R = sum_{v != y} e, Z = sum e (z - m), target logit (softmax_stats.SoftmaxStats' fields, in its order),
# target slope, the last chunk's rescale of the J accumulator (exp(m_old - m_new) 2^(k_new - k_old)), and 2^-k, the
# inverse of the power of two the accumulator (and the last chunk's P') is scaled by
STATE_ROWS = 8
_MAX, _SUMEXP, _REST, _ZSUM, _TARGET, _SLOPE, _RESCALE, _UNSCALE = (tl.constexpr(i) for i in range(STATE_ROWS))


@triton.jit
def _transformed_tile(
    u_ptr,
    bias_ptr,
    offs_n,
    offs_v,
    n_mask,
    v_mask,
    stride_un,
    inv_temperature,
    logit_scale,
    softcap,
    HAS_BIAS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
):
    """(z, dz/du) of one tile of the u buffer: z is -inf past the chunk; dz/du is a number without a soft-cap."""
    # int64 row offsets: the u buffer is about the size of W and may pass 2^31 elements (``tile``)
    u = tl.load(
        u_ptr + offs_n[:, None].to(tl.int64) * stride_un + offs_v[None, :],
        mask=n_mask[:, None] & v_mask[None, :],
        other=0.0,
    )
    if HAS_BIAS:
        u += tl.load(bias_ptr + offs_v, mask=v_mask, other=0.0).to(tl.float32)[None, :]
    z, slope = transform_and_slope(u, inv_temperature, logit_scale, softcap, HAS_SOFTCAP)
    return tl.where(v_mask[None, :], z, float("-inf")), slope


@triton.jit
def _frozen_chunk_kernel(
    u_ptr,
    p_ptr,
    bias_ptr,
    targets_ptr,
    state_ptr,
    rows,
    cols,
    v0,
    stride_un,
    stride_pn,
    stride_state,
    inv_temperature,
    logit_scale,
    softcap,
    HAS_BIAS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    COMPUTE_ENTROPY: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < rows
    # the target's column in this chunk, -1 where another chunk holds it: a tile may reach past the chunk's last
    # column (cols need not be a multiple of BLOCK_V), and a target there would match a masked (-inf) column
    local_target = tl.load(targets_ptr + offs_n, mask=n_mask, other=-1) - v0
    local_target = tl.where((local_target >= 0) & (local_target < cols), local_target, -1)

    # pass 1: the chunk's row max and largest non-target logit
    chunk_max = tl.full((BLOCK_N,), float("-inf"), tl.float32)
    rest_max = tl.full((BLOCK_N,), float("-inf"), tl.float32)
    for c0 in range(0, cols, BLOCK_V):
        offs_v = c0 + tl.arange(0, BLOCK_V)
        z, _ = _transformed_tile(
            u_ptr,
            bias_ptr,
            offs_n,
            offs_v,
            n_mask,
            offs_v < cols,
            stride_un,
            inv_temperature,
            logit_scale,
            softcap,
            HAS_BIAS,
            HAS_SOFTCAP,
        )
        chunk_max = tl.maximum(chunk_max, tl.max(z, axis=1))
        is_target = offs_v[None, :] == local_target[:, None]
        rest_max = tl.maximum(rest_max, tl.max(tl.where(is_target, float("-inf"), z), axis=1))
    old_max = tl.load(state_ptr + _MAX * stride_state + offs_n, mask=n_mask, other=float("-inf"))
    new_max = tl.maximum(old_max, chunk_max)
    # a row whose logits so far are all -inf (a bias that masks the vocab) keeps a finite pivot: no inf - inf
    pivot = tl.where(new_max == float("-inf"), 0.0, new_max)
    rescale = tl.exp(old_max - pivot)
    # P''s power of two 2^k (tile.gemm_scale) from a bound on the row's P' so far against the new pivot: this chunk's
    # largest non-target e times the largest slope, and the earlier chunks' (below GRAD_SCALE_CEILING 2^-k_old
    # before the rescale). So the accumulator's rescale exp(m_old - m_new) 2^(k - k_old) is at most 1
    old_unscale = tl.load(state_ptr + _UNSCALE * stride_state + offs_n, mask=n_mask, other=0.0)
    p_bound = tl.maximum(
        tl.exp(rest_max - pivot) * tl.abs(logit_scale * inv_temperature), rescale * old_unscale * GRAD_SCALE_CEILING
    )
    p_scale, p_unscale = gemm_scale(p_bound)

    # pass 2: the state's sums, and P' = e s' (the target's column zeroed) written over the u tile just read
    sumexp = tl.zeros((BLOCK_N,), tl.float32)
    rest = tl.zeros((BLOCK_N,), tl.float32)
    zsum = tl.zeros((BLOCK_N,), tl.float32)
    target_logit = tl.zeros((BLOCK_N,), tl.float32)
    target_slope = tl.zeros((BLOCK_N,), tl.float32)
    for c0 in range(0, cols, BLOCK_V):
        offs_v = c0 + tl.arange(0, BLOCK_V)
        v_mask = offs_v < cols
        z, slope = _transformed_tile(
            u_ptr,
            bias_ptr,
            offs_n,
            offs_v,
            n_mask,
            v_mask,
            stride_un,
            inv_temperature,
            logit_scale,
            softcap,
            HAS_BIAS,
            HAS_SOFTCAP,
        )
        e = tl.exp(z - pivot[:, None])
        is_target = offs_v[None, :] == local_target[:, None]
        e_rest = tl.where(is_target, 0.0, e)
        sumexp += tl.sum(e, axis=1)
        rest += tl.sum(e_rest, axis=1)
        if COMPUTE_ENTROPY:
            # e is 0 where z is -inf: zero those z first so that 0 * -inf never forms a NaN
            zsum += tl.sum(e * tl.where(z == float("-inf"), 0.0, z - pivot[:, None]), axis=1)
        target_logit += tl.sum(tl.where(is_target, z, 0.0), axis=1)
        if HAS_SOFTCAP:
            target_slope += tl.sum(tl.where(is_target, slope, 0.0), axis=1)
        tl.store(
            p_ptr + offs_n[:, None].to(tl.int64) * stride_pn + offs_v[None, :],
            to_gemm(e_rest * slope * p_scale[:, None], p_ptr.dtype.element_ty),
            mask=n_mask[:, None] & v_mask[None, :],
        )

    # the running state (targets fall in one chunk: their sums just add)
    s = state_ptr + offs_n
    tl.store(s + _MAX * stride_state, new_max, mask=n_mask)
    tl.store(s + _REST * stride_state, tl.load(s + _REST * stride_state, mask=n_mask) * rescale + rest, mask=n_mask)
    if COMPUTE_ENTROPY:
        # Z is relative to the pivot: the old part moves by (m_old - m_new) S_old (softmax_stats' merge); an empty
        # record (m_old = -inf) adds nothing
        shift = tl.where(old_max == float("-inf"), 0.0, old_max - pivot)
        old_sumexp = tl.load(s + _SUMEXP * stride_state, mask=n_mask)
        tl.store(
            s + _ZSUM * stride_state,
            (tl.load(s + _ZSUM * stride_state, mask=n_mask) + shift * old_sumexp) * rescale + zsum,
            mask=n_mask,
        )
    tl.store(
        s + _SUMEXP * stride_state, tl.load(s + _SUMEXP * stride_state, mask=n_mask) * rescale + sumexp, mask=n_mask
    )
    tl.store(s + _TARGET * stride_state, tl.load(s + _TARGET * stride_state, mask=n_mask) + target_logit, mask=n_mask)
    if HAS_SOFTCAP:
        tl.store(s + _SLOPE * stride_state, tl.load(s + _SLOPE * stride_state, mask=n_mask) + target_slope, mask=n_mask)
    tl.store(s + _RESCALE * stride_state, rescale * p_scale * old_unscale, mask=n_mask)
    tl.store(s + _UNSCALE * stride_state, p_unscale, mask=n_mask)


def available(hidden) -> bool:
    """Whether this path runs for ``hidden``'s device and dtype: cuBLAS must give an fp32 product of bf16 / fp16
    operands (CUDA with torch >= 2.8); fp32 inputs, a CPU device and the interpreter always can."""
    return not hidden.is_cuda or hidden.dtype == torch.float32 or OUT_DTYPE_GEMM


def vocab_chunk_size(V, D, chunk, weight_bytes_per_entry, align=VOCAB_ALIGN):
    """Vocabulary columns per chunk: the fp32 u buffer (chunk x columns) about the size of W (V x D), in equal
    chunks rounded up to ``align`` (at most V)."""
    most = max(1, (V * D * weight_bytes_per_entry) // (chunk * 4))
    n_chunks = triton.cdiv(V, most)
    return min(V, triton.cdiv(triton.cdiv(V, n_chunks), align) * align)


def forward_frozen_head(head, compute_entropy, config, token_chunk=None, vocab_chunk=None, gemm_dtype=None):
    """An operands.HeadOperands (hidden [N, D], weight [V, D], targets [N], bias, transform, lora) -> (logp, entropy,
    softmax_stats.BackwardStats) as ``forward.forward``'s (entropy None without ``compute_entropy``),
    J = d logp / d hidden [N, D] fp32 and J_l = d logp / d lora_hidden [N, r] fp32 with LoRA (else None).

    ``config``: a config.FrozenHeadConfig (gemm_fp32: every GEMM on fp32 operands). ``token_chunk`` (default
    gemm.chunk_size(N, D)), ``vocab_chunk`` (default vocab_chunk_size) and ``gemm_dtype`` (P''s dtype: default the
    input dtype on a GPU, fp32 with gemm_fp32) are for tests and tuning.
    """
    record, acc, target_slope, lora_acc = forward_frozen_record(
        head, compute_entropy, config, token_chunk, vocab_chunk, gemm_dtype
    )
    grad = softmax_stats.finish_frozen_grad(acc, record, target_slope, head.weight, head.targets)
    if head.lora is not None:
        lora_acc = softmax_stats.finish_frozen_grad(lora_acc, record, target_slope, head.lora[1], head.targets)
    return (*softmax_stats.finish(record, compute_entropy), grad, lora_acc)


@on_first_argument_device
def forward_frozen_record(
    head, compute_entropy, config, token_chunk=None, vocab_chunk=None, gemm_dtype=None, chunk_done=None
):
    """``forward_frozen_head`` up to "finish": (record softmax_stats.SoftmaxStats, acc [N, D] fp32, target slope [N]
    fp32, lora_acc [N, r] fp32 or None without LoRA), unfinished (acc = sum_{v != y} e_v s'_v W_v against the
    record's max; lora_acc the same over lora_weight), for softmax_stats.finish_frozen_grad and
    softmax_stats.finish, or for a caller that merges them with other rows' first (a vocab-parallel head's
    shards). V >= 1. ``chunk_done(n0, n1, p, state)``, with one vocabulary chunk (``vocab_chunk`` = V): called
    after each token chunk with its P' [n1 - n0, V] (2^k e s', the target column 0, in the GEMM dtype) and its
    final state [STATE_ROWS, n1 - n0] (the record's fields first, then the target slope, the rescale and 2^-k)."""
    hidden, weight, targets, bias, transform, lora = head
    N, D = hidden.shape
    V = weight.shape[0]
    dev = hidden.device
    if gemm_dtype is None:
        gemm_dtype = torch.float32 if config.gemm_fp32 else hidden.dtype
    chunk = min(N, token_chunk or chunk_size(N, D))
    # the vocabulary's split orders a row's reduction: sized from the chunk of any N (or the caller's), never this N
    vchunk = min(V, vocab_chunk or vocab_chunk_size(V, D, token_chunk or chunk_rows(D), weight.element_size()))
    bias = bias.contiguous() if bias is not None else None
    targets = targets.contiguous()

    state = torch.zeros((STATE_ROWS, N), dtype=torch.float32, device=dev)
    row_max, sumexp, rest, zsum, target_logit, target_slope, rescale, unscale = state.unbind(0)
    row_max.fill_(float("-inf"))
    grad = torch.empty((N, D), dtype=torch.float32, device=dev)
    lora_grad = None
    if lora is not None:
        lora_hidden, lora_weight = lora
        lora_grad = torch.empty((N, lora_weight.shape[1]), dtype=torch.float32, device=dev)
        lora_weight_p = lora_weight.to(gemm_dtype)  # the P' B GEMM's operand: P''s dtype
    # u with its last block's padding rows (gemm.mm_token_rows): no temporary of a block x vchunk
    u_buffer = torch.empty(padded_rows(chunk, dev) * vchunk, dtype=torch.float32, device=dev)
    inv_temperature, logit_scale, softcap = transform.kernel_scalars()
    if transform.softcap is None:
        target_slope.fill_(logit_scale * inv_temperature)
    for n0 in range(0, N, chunk):
        n1 = min(n0 + chunk, N)
        rows = n1 - n0
        acc = grad[n0:n1]
        chunk_state = state[:, n0:n1]
        for v0 in range(0, V, vchunk):
            v1 = min(v0 + vchunk, V)
            cols = v1 - v0
            # the token rows' products in blocks of gemm.TOKEN_GEMM_ROWS (a row's products whatever N): u's rows
            # past ``rows`` are the last block's, zero (zero rows of H), and so are P''s there
            u = u_buffer[: padded_rows(rows, dev) * cols].view(-1, cols)
            mm_token_rows(hidden[n0:n1], weight[v0:v1].T, u, accumulate=False, rows=rows)
            if lora is not None:
                mm_token_rows(lora_hidden[n0:n1], lora_weight[v0:v1].T, u, accumulate=True, rows=rows)
            # P' over u: in place (fp32), or the first half of each u row's bytes (bf16 / fp16, row stride 2 cols)
            p = u if gemm_dtype == torch.float32 else u.view(gemm_dtype)[:, :cols]
            _frozen_chunk_kernel[(triton.cdiv(rows, config.block_n),)](
                u,
                p,
                bias[v0:] if bias is not None else u,
                targets[n0:n1],
                chunk_state,
                rows,
                cols,
                v0,
                u.stride(0),
                p.stride(0),
                chunk_state.stride(0),
                inv_temperature,
                logit_scale,
                softcap,
                HAS_BIAS=bias is not None,
                HAS_SOFTCAP=transform.softcap is not None,
                COMPUTE_ENTROPY=compute_entropy,
                BLOCK_N=config.block_n,
                BLOCK_V=config.block_v,
                num_warps=config.num_warps,
                num_stages=config.num_stages,
            )
            if v0 > 0:
                acc.mul_(rescale[n0:n1, None])
            mm_token_rows(p, weight[v0:v1], acc, accumulate=v0 > 0, rows=rows)
            if lora is not None:
                if v0 > 0:
                    lora_grad[n0:n1].mul_(rescale[n0:n1, None])
                mm_token_rows(p, lora_weight_p[v0:v1], lora_grad[n0:n1], accumulate=v0 > 0, rows=rows)
        acc.mul_(unscale[n0:n1, None])  # P''s power of two out, exactly
        if lora is not None:
            lora_grad[n0:n1].mul_(unscale[n0:n1, None])
        if chunk_done is not None:
            chunk_done(n0, n1, p[:rows], chunk_state)
    return softmax_stats.SoftmaxStats(row_max, sumexp, rest, zsum, target_logit), grad, target_slope, lora_grad


def _fold_columns(columns, n0, n1, factor, p):
    """A chunk's column entries dL/du into P' (``p`` [n1 - n0, V]) as dL/du / f where they fold
    (``forward_trained_head``), the rest into ``columns.rest``."""
    ids, grad = columns.ids[n0:n1], columns.grad[n0:n1]
    if ids.shape[1] == 0:  # no column: nothing to fold
        return
    slope = columns.slope
    slope = slope[n0:n1] if isinstance(slope, torch.Tensor) and slope.ndim else slope
    live = ids >= 0
    grad_u = torch.where(live, grad * slope, 0.0)
    inverse = 1.0 / factor
    bound = 2.0**COLUMN_FOLD_EXP
    folds = (factor != 0) & (grad_u.abs().amax(-1) * inverse.abs() < bound) & (factor.abs() >= 1.0 / bound)
    values = torch.where(folds[:, None] & live, grad_u * inverse[:, None], 0.0)
    rows = torch.arange(n1 - n0, device=ids.device)[:, None].expand_as(ids)
    p.index_put_((rows, ids.clamp(min=0)), values.to(p.dtype), accumulate=True)
    columns.rest[n0:n1] = torch.where(folds[:, None], 0.0, grad)


def trained_chunk_size(N, V, D, weight_bytes_per_entry):
    """Tokens per chunk of ``forward_trained_head``: its fp32 logits over the whole vocabulary (chunk x V) about the
    size of W (V x D; 467 MB at the Qwen2.5-1.5B head in bf16: 768 tokens), a multiple of gemm.TOKEN_CHUNK_ALIGN
    (``gemm.token_chunk_rows``: only a call's last chunk pads a block of its token-row products)."""
    return min(N, token_chunk_rows(D * weight_bytes_per_entry // 4))


def forward_trained_head(
    head, compute_entropy, config, coefficients, grads, token_chunk=None, gemm_dtype=None, columns=None
):
    """The trained head in three vocabulary GEMM sweeps, for a loss whose dL/dlogp is known token by token as soon
    as the token's log-prob is (``coefficients``): (logp, entropy, softmax_stats.BackwardStats) as ``forward``'s,
    and the gradients of that loss in ``grads`` (an operands.HeadGrads: hidden written, weight and bias added to).
    bf16 or fp32 inputs.

    Per token chunk (``trained_chunk_size``) the frozen head's sweep over the whole vocabulary: u = H W^T (1), the
    record and P' = 2^k e s' over u, J's accumulator P' W (2); then the chunk's log-probs, c =
    ``coefficients(n0, n1, logp, entropy)`` [n1 - n0] fp32 (dL/dlogp of those tokens), and with g = c (onehot - p) s'
    = f P' off the target column (f = -c 2^-k / S) and c s'_y R / S on it:
        dW += P'^T (f H) (3),   dW[y] += c s'_y (R / S) h,   db += P'^T f,   db[y] += c s'_y R / S,
    the operands f H and f rounded to the GEMM dtype once (bf16 has fp32's exponent range: nothing there flushes to
    zero; fp16's does not, hence no fp16), and dH = c J (J the frozen head's, exact on confident tokens). Nothing
    is recomputed: three sweeps against the recompute path's four. No LoRA
    (``head.lora`` None) and no entropy gradient (dL/dentropy is not part of g).

    ``columns`` (an operands.GradientColumns, or None): g's entries at a few columns a row besides the softmax's,
    dL/du = grad slope at ids: dW and db take them in product (3) itself, as entries of P' (each dL/du / f added to
    P' at its column, rounded once to P''s dtype: an id twice adds twice), on the rows where f is nonzero and every
    |dL/du / f| under 2^COLUMN_FOLD_EXP (f H then keeps its precision); the other rows' entries go to
    ``columns.rest`` for the caller. dH's entries are the caller's (J is summed before they are known).

    Memory: the u buffer (chunk x V fp32), J (N x D fp32), 8 N fp32 of state, one chunk's operand (chunk x D); the
    fp32 dH, dW and db are the caller's (``grads``).
    """
    hidden, weight, targets, _, _, lora = head
    if lora is not None:
        raise ValueError("forward_trained_head takes no LoRA operands")
    N, D = hidden.shape
    V = weight.shape[0]
    chunk = token_chunk or trained_chunk_size(N, V, D, weight.element_size())
    coefficient_rows = torch.zeros(N, dtype=torch.float32, device=hidden.device)

    def chunk_done(n0, n1, p, state):
        record = softmax_stats.SoftmaxStats(*state[:5])
        logp, entropy, _ = softmax_stats.finish(record, compute_entropy)
        c = coefficients(n0, n1, logp, entropy).float()
        coefficient_rows[n0:n1] = c
        if grads.weight is None and grads.bias is None:
            if columns is not None:  # no product to take them: every entry the caller's
                columns.rest[n0:n1] = columns.grad[n0:n1]
            return
        sumexp, rest, target_slope, unscale = state[1], state[2], state[5], state[7]
        factor = -(c / sumexp) * unscale  # g = factor P' off the target column
        if columns is not None:
            _fold_columns(columns, n0, n1, factor, p)
        target_g = c * (rest / sumexp) * target_slope  # g at the target column, never 1 - p_y by cancellation
        rows = hidden[n0:n1].float()
        y = targets[n0:n1]
        if grads.weight is not None:
            mm_fp32(p.T, (rows * factor[:, None]).to(p.dtype), grads.weight, accumulate=True)
            grads.weight.index_add_(0, y, rows * target_g[:, None])
        if grads.bias is not None:
            mm_fp32(p.T, factor[:, None].to(p.dtype), grads.bias[:, None], accumulate=True)
            grads.bias.index_add_(0, y, target_g)

    record, acc, target_slope, _ = forward_frozen_record(
        head, compute_entropy, config, chunk, V, gemm_dtype, chunk_done=chunk_done
    )
    if grads.hidden is not None:
        jacobian = softmax_stats.finish_frozen_grad(acc, record, target_slope, weight, targets)
        torch.mul(jacobian, coefficient_rows[:, None], out=grads.hidden)
    return softmax_stats.finish(record, compute_entropy)
