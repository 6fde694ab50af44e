"""The divergence head's backward: the g kernel recomputes both models' tiles for a chunk of tokens and writes
g = c d div / d z_s dz_s/du (c the upstream dL/d div; fp32 for fp32 inputs, else scaled by an exact power of two and
rounded to the input dtype) and adds its column sums to db; cuBLAS does dH = g W_s and dW_s += g^T H_s with fp32
outputs. The g formula of each divergence is divergence_tile.logit_gradient's (by the divergence's constexpr MODE).
The combined GRPO + distillation head's backward adds layer 1's logit gradient to g (its softmax is p_s: one
normaliser).

Memory: g, one token chunk x V in the student's dtype (gemm.chunk_size's rows). No tensor of size N x V.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .config import g_config, narrow_g_epilogue
from .divergence_records import divergence_of
from .divergence_tile import (
    layer1_rows,
    load_saved,
    local_argmax,
    log_probs,
    logit_gradient,
    pair_tiles,
    pointers,
    shared_arguments,
)
from .gemm import chunk_size, mm_fp32
from .launch import on_first_argument_device, tensor_descriptors_fit, tile_operand
from .tile import gemm_scale, gradient_tile, row_coefficients, to_gemm


@triton.jit
def _g_kernel(
    hs,
    ws,
    bs_ptr,
    ht,
    wt,
    bt_ptr,
    saved_ptr,
    argmax_ptr,
    grad_ptr,
    g_ptr,
    grad_bias_ptr,
    coefficient_max_ptr,
    g_unscale_ptr,
    targets_ptr,
    layer1_ptr,
    grad_logp_ptr,
    grad_entropy_ptr,
    N,
    V,
    Ds,
    Dt,
    N_ALL,
    stride_saved,
    stride_g,
    stride_hs,
    stride_ws,
    stride_ht,
    stride_wt,
    inv_temperature,
    s_logit_scale,
    s_softcap,
    t_logit_scale,
    t_softcap,
    beta,
    log_1m_beta,
    log_beta,
    MODE: tl.constexpr,
    S_HAS_BIAS: tl.constexpr,
    T_HAS_BIAS: tl.constexpr,
    S_HAS_SOFTCAP: tl.constexpr,
    T_HAS_SOFTCAP: tl.constexpr,
    USE_TMA: tl.constexpr,
    LOGITS_IN_MEMORY: tl.constexpr,
    COMPUTE_DB: tl.constexpr,
    SCALE_G: tl.constexpr,
    DOT_FP32: tl.constexpr,
    S_DOT_PRECISION: tl.constexpr,
    T_DOT_PRECISION: tl.constexpr,
    LAYER1: tl.constexpr,
    ENTROPY_GRAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """The g tile (pid_n, pid_v) of a chunk of N tokens; MODE: the divergence's (divergence_records.Divergence). The
    saved values' rows are N_ALL apart (this launch's rows are a slice of them). LAYER1 (the combined head): g also
    gets layer 1's term from dL/dlogp (and dL/dentropy with ENTROPY_GRAD) and softmax_stats.BackwardStats' rows at
    layer1_ptr (N_ALL apart), as tile.tile_grad forms it."""
    pid_n = tl.program_id(0)
    pid_v = tl.program_id(1)
    offs_n, offs_v, n_mask, v_mask, g_ptrs, g_mask = gradient_tile(
        g_ptr, stride_g, pid_n, pid_v, N, V, BLOCK_N, BLOCK_V
    )
    c = tl.load(grad_ptr + offs_n, mask=n_mask, other=0.0)
    # a sum, not a max: a NaN coefficient must reach the gradient (tile.row_coefficients)
    coefficient_sum = tl.sum(tl.abs(c), axis=0)
    if LAYER1:
        grad_logp, grad_entropy, _, layer1_sum = row_coefficients(
            grad_logp_ptr, grad_entropy_ptr, grad_logp_ptr, grad_logp_ptr, offs_n, n_mask, ENTROPY_GRAD, False
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
    s_max, s_log_sumexp, s_rest_mass, t_max, t_log_sumexp, t_rest_mass, reference, excess, s_top, t_top = load_saved(
        saved_ptr, argmax_ptr, stride_saved, N_ALL, offs_n, n_mask
    )
    _, zs, slope, zt = pair_tiles(
        hs,
        ws,
        bs_ptr,
        ht,
        wt,
        bt_ptr,
        pid_n * BLOCK_N,
        pid_v * BLOCK_V,
        N,
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
        USE_TMA,
        LOGITS_IN_MEMORY,
        DOT_FP32,
        S_DOT_PRECISION,
        T_DOT_PRECISION,
        BLOCK_N,
        BLOCK_V,
        BLOCK_D,
    )
    log_ps, top_s = log_probs(zs, offs_v, s_max, s_log_sumexp, s_top)
    log_pt, top_t = log_probs(zt, offs_v, t_max, t_log_sumexp, t_top)
    dz, ps = logit_gradient(
        zs,
        zt,
        log_ps,
        log_pt,
        top_s,
        top_t,
        s_rest_mass,
        t_rest_mass,
        reference,
        excess,
        beta,
        log_1m_beta,
        log_beta,
        MODE,
    )
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


@on_first_argument_device
def backward(grad_divergence, student, teacher, saved, argmax, beta, grads, config=None, offset=0, layer1=None):
    """The student's gradients by the g kernel (g per token chunk) and cuBLAS (dH, dW).

    Args:
        grad_divergence: [N] fp32 dL/d divergence, contiguous.
        student: the student's ModelHead over N > 0 tokens (rows contiguous).
        teacher: the teacher's ModelHead, over the same tokens and weight rows.
        saved: [8, N] fp32, the forward's saved values (divergence_records.SAVED_FIELDS) over the whole vocabulary.
        argmax: [2, N] int64, the forward's global argmax indices.
        beta: the forward's beta.
        grads: the fp32 buffers (grad_hidden [N, Ds], written; grad_weight [V, Ds] and grad_bias [V], zero on entry,
            accumulated), each None where not wanted.
        config: the BackwardConfig (None: ``config.g_config``'s).
        offset: the weights' row v is vocabulary entry offset + v (a vocab-parallel shard).
        layer1: the combined head's layer-1 term (a whole head, offset 0), or None.
    """
    _, grad_weight, grad_bias = grads
    N, Ds = student.hidden.shape
    V = student.weight.shape[0]
    dev = student.hidden.device
    descriptors_fit = tensor_descriptors_fit(student.hidden, student.weight, teacher.hidden, teacher.weight)
    if config is None:
        narrow = narrow_g_epilogue(student, teacher, divergence_of(beta), layer1 is not None)
        config = g_config(dev, student.hidden.dtype, layer1 is not None, descriptors_fit, narrow)
    chunk = chunk_size(N, Ds)
    g = torch.empty((chunk, V), dtype=student.hidden.dtype, device=dev)
    scale = None
    if student.hidden.dtype != torch.float32:
        # the bound of the coefficients of g (tile.gemm_scale): |c| + |dL/dlogp| + |dL/dentropy|
        terms = [grad_divergence] + ([x for x in layer1[2:] if x is not None] if layer1 is not None else [])
        scale = GScale.of(terms)
    use_tma = config.use_tma and descriptors_fit
    student_weight, teacher_weight = (
        tile_operand(w, use_tma, config.block_v, config.block_d) for w in (student.weight, teacher.weight)
    )
    student_bias, teacher_bias = pointers(student)[2], pointers(teacher)[2]
    arguments = dict(USE_TMA=use_tma, **shared_arguments(student, teacher, beta, config))
    argmax = local_argmax(argmax, offset, V)
    for n0 in range(0, N, chunk):
        n1 = min(n0 + chunk, N)
        operands = (
            tile_operand(student.hidden[n0:n1], use_tma, config.block_n, config.block_d),
            student_weight,
            student_bias,
            tile_operand(teacher.hidden[n0:n1], use_tma, config.block_n, config.block_d),
            teacher_weight,
            teacher_bias,
        )
        launch_g(
            operands, saved, argmax, grad_divergence, slice(n0, n1), g, grad_bias, scale, layer1, arguments, config
        )
        student_gradients(g[: n1 - n0], student, n0, n1, grads, scale)
    if scale is not None and grad_weight is not None:
        grad_weight.mul_(scale.unscale)


class GScale(NamedTuple):
    """g's power-of-two scale in half precision (tile.gemm_scale: g's coefficients times it stay within the dtype's
    range), fp32 [1] each."""

    bound: torch.Tensor  # the largest |coefficient| of a row of g; the g kernel derives the scale from it
    unscale: torch.Tensor  # the scale's inverse, which the g kernel writes and the gradients are multiplied by

    @classmethod
    def of(cls, terms) -> GScale:
        """The scale of g rows whose coefficients are the sum of ``terms`` ([N] fp32 each) in absolute value."""
        bound = terms[0].abs()
        for term in terms[1:]:
            bound = bound + term.abs()
        return cls(bound.amax().reshape(1), torch.ones(1, dtype=torch.float32, device=bound.device))


def launch_g(operands, saved, argmax, grad, rows, g, grad_bias, scale, layer1, arguments, config):
    """The g kernel over the token ``rows`` (a slice of the columns of ``saved``, ``argmax``, ``grad`` and
    ``layer1``'s rows), written into g's first rows, its column sums added to ``grad_bias``.

    Args:
        operands: the kernel's six tile operands of those rows: the student's hidden rows, weight, bias, the
            teacher's (tensors or tensor descriptors; with LOGITS_IN_MEMORY both models' products, twice each).
        saved: [8, N_ALL] fp32 (divergence_records.SAVED_FIELDS).
        argmax: [2, N_ALL] int64, rows of these weights (``local_argmax``).
        grad: [N_ALL] fp32 dL/d div.
        rows: the token rows, a slice of [0, N_ALL).
        g: [>= rows, V] in the student's dtype.
        grad_bias: [V] fp32, accumulated, or None.
        scale: a GScale for half-precision g, or None (fp32 g).
        layer1: the combined head's Layer1Gradient over N_ALL rows, or None.
        arguments: ``shared_arguments`` and USE_TMA / LOGITS_IN_MEMORY, beta's divergence among them.
        config: the BackwardConfig.
    """
    n0, n1 = rows.start, rows.stop
    V = g.shape[1]
    grid = (triton.cdiv(n1 - n0, config.block_n), triton.cdiv(V, config.block_v))
    _g_kernel[grid](
        *operands,
        saved[:, n0:],
        argmax[:, n0:],
        grad[n0:n1],
        g,
        grad_bias if grad_bias is not None else saved,
        *(scale if scale is not None else (saved, saved)),
        *layer1_rows(layer1, n0, n1, placeholder=saved),
        N=n1 - n0,
        V=V,
        N_ALL=saved.shape[1],
        stride_saved=saved.stride(0),
        stride_g=g.stride(0),
        MODE=divergence_of(arguments["beta"]).mode,
        COMPUTE_DB=grad_bias is not None,
        SCALE_G=scale is not None,
        LAYER1=layer1 is not None,
        ENTROPY_GRAD=layer1 is not None and layer1.grad_entropy is not None,
        **arguments,
    )


def student_gradients(g_rows, student, n0, n1, grads, scale):
    """cuBLAS's products of the g rows of tokens [n0, n1), fp32 outputs: dH of those rows written (its GScale
    ``scale`` undone, where it is not None) and dW accumulated (its scale undone by the caller once, after the last
    chunk)."""
    grad_hidden, grad_weight, _ = grads
    if grad_hidden is not None:
        mm_fp32(g_rows, student.weight, grad_hidden[n0:n1], accumulate=False)
        if scale is not None:
            grad_hidden[n0:n1].mul_(scale.unscale)
    if grad_weight is not None:
        mm_fp32(g_rows.T, student.hidden[n0:n1], grad_weight, accumulate=True)
