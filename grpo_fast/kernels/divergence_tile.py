"""The divergence head's device functions and launch arguments, shared by its three stages (``divergence_sweep``: the
record sweep and the JSD sweep; ``divergence_gradient``: the g kernel; ``divergence_loss``: the fused loss, the same
kernels over products in memory): both models' logit tiles, one model's record of a tile and the records' merge in
registers (divergence_records' algebra), and each divergence's formula, once: the g formula of every
divergence_records.Divergence by its constexpr MODE (``logit_gradient``) and the JSD sweep's terms (``jsd_terms``).

With p = softmax(z) (q = 1 - p at the argmax, carried by the records), the student's d div / d z_s:
    forward KL (MODE 0):  p_s - p_t                                (q_t - q_s at a shared argmax: carried rests)
    reverse KL (MODE 1):  p_s (l_v - KL),  l = log p_s - log p_t
    JSD (MODE 2):         (1 - beta) p_s (r_v - KL(p_s || m)),  r = log p_s - log m
Where the student is confident and the teacher is not, l_a and KL agree to O(q): their difference is carried,
l_v - KL = (l_v - l_a) - C_s / S_s with l_v - l_a = g_v - g_a (0 at the argmax, exactly), and
r_v - KL(p_s || m) = (r_v - r_a) - sum_v p_s (r_v - r_a), the sum from the JSD sweep.

No NaN is formed in a lane the kernels drop: past the vocabulary both models' logits are one finite stand-in far
below every logit (``PAST_VOCAB_LOGIT``: no mass, differences of 0), and the record sweep's running records start
at that max rather than -inf (their first merge then scales a finite shift by 0), so that the interpreter's numpy
warns of nothing and a compiler's reordering cannot let a NaN through; the row-wide terms (a JSD's log1p at a shared
argmax, an unsupported row's infinite reference) are guarded where they are formed. Only -inf among the inputs' own
logits (a padded vocabulary's -inf bias, an entry one model gives no mass) forms one in a dropped lane.
"""

import math

import torch
import triton
import triton.language as tl

from .divergence_records import divergence_of
from .launch import tile_operand
from .tile import logit_tile_at, stored_logit_tile_at

# the logit of an entry past the vocabulary in a pair of tiles: exp of it less any row's max is exactly 0 (the
# entry has no mass), and it is the same in both models' tiles (their difference is 0)
PAST_VOCAB_LOGIT = tl.constexpr(-1.0e30)


@triton.jit
def model_tile(
    hidden,
    weight,
    bias_ptr,
    n0,
    v0,
    N,
    V,
    D,
    stride_hn,
    stride_wv,
    inv_temperature,
    logit_scale,
    softcap,
    HAS_BIAS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    USE_TMA: tl.constexpr,
    LOGITS_IN_MEMORY: tl.constexpr,
    DOT_FP32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """One model's transformed logits at (n0, v0) (-inf past the vocabulary) and dz/du: tile.logit_tile_at without
    LoRA (``hidden`` and ``weight`` tensor descriptors with USE_TMA, else pointers), or with LOGITS_IN_MEMORY
    tile.stored_logit_tile_at (``hidden`` the fp32 products H W^T, rows ``stride_hn`` apart; ``weight`` unread)."""
    if LOGITS_IN_MEMORY:
        z, slope = stored_logit_tile_at(
            hidden,
            bias_ptr,
            n0,
            v0,
            N,
            V,
            stride_hn,
            inv_temperature,
            logit_scale,
            softcap,
            HAS_BIAS,
            HAS_SOFTCAP,
            BLOCK_N,
            BLOCK_V,
        )
    else:  # one return, after both branches (triton 3.6 compiles the code after a constexpr branch's return)
        z, slope = logit_tile_at(
            hidden,
            weight,
            bias_ptr,
            bias_ptr,
            bias_ptr,
            n0,
            v0,
            N,
            V,
            D,
            0,
            stride_hn,
            stride_wv,
            inv_temperature,
            logit_scale,
            softcap,
            HAS_BIAS,
            False,
            HAS_SOFTCAP,
            USE_TMA,
            DOT_FP32,
            DOT_PRECISION,
            DOT_PRECISION,
            BLOCK_N,
            BLOCK_V,
            BLOCK_D,
            16,
        )
    return z, slope


@triton.jit
def pair_tiles(
    hs,
    ws,
    bs_ptr,
    ht,
    wt,
    bt_ptr,
    n0,
    v0,
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
    S_HAS_BIAS: tl.constexpr,
    T_HAS_BIAS: tl.constexpr,
    S_HAS_SOFTCAP: tl.constexpr,
    T_HAS_SOFTCAP: tl.constexpr,
    USE_TMA: tl.constexpr,
    LOGITS_IN_MEMORY: tl.constexpr,
    DOT_FP32: tl.constexpr,
    S_DOT_PRECISION: tl.constexpr,
    T_DOT_PRECISION: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """The tile at (n0, v0): its vocabulary indices, both models' transformed logits (two K-loops; PAST_VOCAB_LOGIT
    from V on) and the student's slope dz/du."""
    zs, slope = model_tile(
        hs,
        ws,
        bs_ptr,
        n0,
        v0,
        N,
        V,
        Ds,
        stride_hs,
        stride_ws,
        inv_temperature,
        s_logit_scale,
        s_softcap,
        S_HAS_BIAS,
        S_HAS_SOFTCAP,
        USE_TMA,
        LOGITS_IN_MEMORY,
        DOT_FP32,
        S_DOT_PRECISION,
        BLOCK_N,
        BLOCK_V,
        BLOCK_D,
    )
    zt, _ = model_tile(
        ht,
        wt,
        bt_ptr,
        n0,
        v0,
        N,
        V,
        Dt,
        stride_ht,
        stride_wt,
        inv_temperature,
        t_logit_scale,
        t_softcap,
        T_HAS_BIAS,
        T_HAS_SOFTCAP,
        USE_TMA,
        LOGITS_IN_MEMORY,
        DOT_FP32,
        T_DOT_PRECISION,
        BLOCK_N,
        BLOCK_V,
        BLOCK_D,
    )
    offs_v = v0 + tl.arange(0, BLOCK_V)
    # past the vocabulary both models' logits are one finite stand-in far below every logit (the tiles give -inf):
    # an entry of no mass whose differences (z_s - z_t, log p_s - log m) are finite, so that no -inf - -inf or
    # 0 x inf is formed in a lane the kernels drop
    past = (offs_v >= V)[None, :]
    return offs_v, tl.where(past, PAST_VOCAB_LOGIT, zs), slope, tl.where(past, PAST_VOCAB_LOGIT, zt)


@triton.jit
def split_range(split, vocab_per_split, V):
    """The vocabulary entries [begin, end) of a sweep program's split."""
    begin = split * vocab_per_split
    return begin, tl.minimum(begin + vocab_per_split, V)


@triton.jit
def load_saved(saved_ptr, argmax_ptr, stride_saved, stride_argmax, offs_n, n_mask):
    """A token block's divergence_records.SAVED_FIELDS (8 rows) and both argmax indices."""
    fields = saved_ptr + offs_n
    s_max, s_log_sumexp, s_rest_mass, t_max, t_log_sumexp, t_rest_mass, reference = load_rows(
        fields, stride_saved, n_mask
    )
    return (
        s_max,
        s_log_sumexp,
        s_rest_mass,
        t_max,
        t_log_sumexp,
        t_rest_mass,
        reference,
        tl.load(fields + 7 * stride_saved, mask=n_mask, other=0.0),
        tl.load(argmax_ptr + offs_n, mask=n_mask, other=-1),
        tl.load(argmax_ptr + stride_argmax + offs_n, mask=n_mask, other=-1),
    )


@triton.jit
def tile_record(z, z_other, offs_v, BIG: tl.constexpr):
    """divergence_records.tile_record in registers: (max, argmax, rest, cross, other, zsum, unsupported)."""
    row_max = tl.max(z, axis=1)
    top_index = tl.min(tl.where(z == row_max[:, None], offs_v[None, :], BIG), axis=1)
    pivot = tl.where(row_max == float("-inf"), 0.0, row_max)
    e = tl.exp(z - pivot[:, None])
    unsupported = tl.max(tl.where((e > 0.0) & (z_other == float("-inf")), 1.0, 0.0), axis=1)
    top = offs_v[None, :] == top_index[:, None]
    e = tl.where(top, 0.0, e)
    other = tl.sum(tl.where(top, z_other, 0.0), axis=1)
    gap_at_max = row_max - other
    cross = tl.sum(tl.where(e == 0.0, 0.0, e * ((z - z_other) - gap_at_max[:, None])), axis=1)
    zsum = tl.sum(tl.where(e == 0.0, 0.0, e * (z - pivot[:, None])), axis=1)
    return row_max, top_index.to(tl.float32), tl.sum(e, axis=1), cross, other, zsum, unsupported


@triton.jit
def merge_records(m1, a1, r1, c1, o1, z1, u1, m2, a2, r2, c2, o2, z2, u2):
    """divergence_records.merge in registers: the first record holds the lower indices (it wins ties)."""
    second = m2 > m1
    wm = tl.where(second, m2, m1)
    lm = tl.where(second, m1, m2)
    wo = tl.where(second, o2, o1)
    lo = tl.where(second, o1, o2)
    lr = tl.where(second, r1, r2)
    lc = tl.where(second, c1, c2)
    lz = tl.where(second, z1, z2)
    pivot = tl.where(wm == float("-inf"), 0.0, wm)
    scale = tl.exp(lm - pivot)
    lose_sumexp = tl.where(lm > float("-inf"), 1.0, 0.0) + lr
    gap_shift = (lm - lo) - (wm - wo)
    cross = tl.where(scale == 0.0, 0.0, scale * (lc + gap_shift * lose_sumexp))
    zsum = tl.where(scale == 0.0, 0.0, scale * (lz + (lm - pivot) * lose_sumexp))
    return (
        wm,
        tl.where(second, a2, a1),
        tl.where(second, r2, r1) + scale * lose_sumexp,
        tl.where(second, c2, c1) + cross,
        wo,
        tl.where(second, z2, z1) + zsum,
        tl.maximum(u1, u2),
    )


@triton.jit
def store_record(ptr, stride_field, mask, m, a, r, c, o, z, u):
    """A record's seven fields at ptr, stride_field apart."""
    tl.store(ptr, m, mask=mask)
    tl.store(ptr + stride_field, a, mask=mask)
    tl.store(ptr + 2 * stride_field, r, mask=mask)
    tl.store(ptr + 3 * stride_field, c, mask=mask)
    tl.store(ptr + 4 * stride_field, o, mask=mask)
    tl.store(ptr + 5 * stride_field, z, mask=mask)
    tl.store(ptr + 6 * stride_field, u, mask=mask)


@triton.jit
def load_rows(ptr, stride_field, mask):
    """Seven fp32 rows at ptr, stride_field apart (a record in ``store_record``'s layout; the saved values' first
    seven), 0 where masked."""
    return (
        tl.load(ptr, mask=mask, other=0.0),
        tl.load(ptr + stride_field, mask=mask, other=0.0),
        tl.load(ptr + 2 * stride_field, mask=mask, other=0.0),
        tl.load(ptr + 3 * stride_field, mask=mask, other=0.0),
        tl.load(ptr + 4 * stride_field, mask=mask, other=0.0),
        tl.load(ptr + 5 * stride_field, mask=mask, other=0.0),
        tl.load(ptr + 6 * stride_field, mask=mask, other=0.0),
    )


@triton.jit
def log_probs(z, offs_v, row_max, log_sumexp, top_index):
    """log p = (z - m) - log S of a tile (exactly -log S at the argmax), and the argmax mask."""
    top = offs_v[None, :] == top_index[:, None]
    return tl.where(top, 0.0, z - row_max[:, None]) - log_sumexp[:, None], top


@triton.jit
def log_mixture(log_ps, log_pt, shared_top, s_rest_mass, t_rest_mass, beta, log_1m_beta, log_beta):
    """log m, m = (1 - beta) p_s + beta p_t (log1p of the carried rests at a shared argmax)."""
    a = log_ps + log_1m_beta
    b = log_pt + log_beta
    top = tl.maximum(a, b)
    top = tl.where(top == float("-inf"), 0.0, top)
    log_m = top + tl.log(tl.exp(a - top) + tl.exp(b - top))
    # log1p(-x) for the carried x = 1 - m at a shared argmax (1e-6 where both models are sure): log(1 - x) would
    # lose x's digits; log(u) x / (1 - u), u = 1 - x rounded, is exact to fp32 (Goldberg's log1p); u = 1: -x (1 - u
    # is then at least 2^-24, or 0: its floor keeps 0 / 0 from forming)
    x = (1.0 - beta) * s_rest_mass + beta * t_rest_mass
    u = 1.0 - x
    at_top = tl.where(u == 1.0, -x, tl.log(u) * (x / tl.maximum(1.0 - u, 1.0e-30)))
    return tl.where(shared_top, at_top[:, None], log_m)


@triton.jit
def logit_gradient(
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
    MODE: tl.constexpr,
):
    """d div / d z_s of a tile for the divergence of constexpr MODE (divergence_records.Divergence.mode; the module
    docstring has the formulas), and p_s; ``reference`` and ``excess`` the saved values (SAVED_FIELDS)."""
    tl.static_assert(MODE < 3, "logit_gradient has the formulas of MODE 0 (forward KL), 1 (reverse KL), 2 (JSD)")
    ps = tl.exp(log_ps)
    if MODE == 0:
        # p_s - p_t; at a shared argmax q_t - q_s from the carried rests
        dz = tl.where(top_s & top_t, (t_rest_mass - s_rest_mass)[:, None], ps - tl.exp(log_pt))
    else:
        # an unsupported row's infinite reference and excess (its KL is +inf, its gradient no number) taken as 0:
        # no difference of two infinities
        reference = tl.where(tl.abs(reference) == float("inf"), 0.0, reference)
        excess = tl.where(tl.abs(excess) == float("inf"), 0.0, excess)
        if MODE == 1:
            relative = (zs - zt) - reference[:, None]
            weight = 1.0
        else:
            log_m = log_mixture(log_ps, log_pt, top_s & top_t, s_rest_mass, t_rest_mass, beta, log_1m_beta, log_beta)
            relative = (log_ps - log_m) - reference[:, None]
            weight = 1.0 - beta
        relative = tl.where(top_s, 0.0, relative)
        dz = tl.where(ps == 0.0, 0.0, weight * ps * (relative - excess[:, None]))
    return dz, ps


@triton.jit
def jsd_terms(
    zs,
    zt,
    offs_v,
    s_max,
    s_log_sumexp,
    s_rest_mass,
    t_max,
    t_log_sumexp,
    t_rest_mass,
    top_log_ratio,
    s_top,
    t_top,
    beta,
    log_1m_beta,
    log_beta,
):
    """The JSD sweep's sums over a tile, [BLOCK_N] each: beta KL(p_t || m) + (1 - beta) KL(p_s || m)'s terms, and
    sum_v p_s (r_v - r_a) off the student's argmax (r = log p_s - log m; r_a = ``top_log_ratio``)."""
    log_ps, top_s = log_probs(zs, offs_v, s_max, s_log_sumexp, s_top)
    log_pt, top_t = log_probs(zt, offs_v, t_max, t_log_sumexp, t_top)
    log_m = log_mixture(log_ps, log_pt, top_s & top_t, s_rest_mass, t_rest_mass, beta, log_1m_beta, log_beta)
    ps = tl.exp(log_ps)
    pt = tl.exp(log_pt)
    log_ratio = log_ps - log_m
    kl_s = tl.where(ps == 0.0, 0.0, ps * log_ratio)
    kl_t = tl.where(pt == 0.0, 0.0, pt * (log_pt - log_m))
    jsd = tl.sum(beta * kl_t + (1.0 - beta) * kl_s, axis=1)
    excess = tl.sum(tl.where((ps == 0.0) | top_s, 0.0, ps * (log_ratio - top_log_ratio[:, None])), axis=1)
    return jsd, excess


# ----------------------------------------------------------------------------------------------- launch arguments
def local_argmax(argmax: torch.Tensor, offset: int, rows: int) -> torch.Tensor:
    """Global argmax indices as row indices of a vocab-parallel shard's weights.

    Args:
        argmax: int64 vocabulary indices, any shape.
        offset: the vocabulary entry of the weights' first row.
        rows: the weights' row count.

    Returns:
        argmax - offset where it lies in [0, rows), else -1: a column no kernel matches (a row past the last one
        could match a masked column of the last tile).
    """
    local = argmax - offset
    return torch.where((local >= 0) & (local < rows), local, torch.full_like(local, -1))


def tile_operands(model, use_tma, config):
    """``pointers``, the hidden states and weight as tensor descriptors of the config's blocks with ``use_tma``."""
    hidden, weight, bias = pointers(model)
    return (
        tile_operand(hidden, use_tma, config.block_n, config.block_d),
        tile_operand(weight, use_tma, config.block_v, config.block_d),
        bias,
    )


def pointers(model):
    """A model's hidden states, weight and bias; the hidden states stand in for a missing bias (never read then)."""
    return model.hidden, model.weight, model.bias if model.bias is not None else model.hidden


def layer1_rows(layer1, n0, n1, placeholder):
    """The backward kernel's four layer-1 pointers for the token rows [n0, n1) (placeholders without ``layer1``)."""
    if layer1 is None:
        return (placeholder,) * 4
    grad_entropy = layer1.grad_entropy if layer1.grad_entropy is not None else layer1.grad_logp
    return layer1.targets[n0:n1], layer1.stats[:, n0:], layer1.grad_logp[n0:n1], grad_entropy[n0:n1]


def shared_arguments(student, teacher, beta, config):
    """The arguments both kernels take alike: the models' sizes and row strides, the transforms' and beta's scalars,
    the models' and the tiles' constexprs, the launch's warps and stages."""
    inv_temperature, s_logit_scale, s_softcap = student.transform.kernel_scalars()
    _, t_logit_scale, t_softcap = teacher.transform.kernel_scalars()
    inner = divergence_of(beta).mixture  # the mixture's logs (the other divergences read none)
    return dict(
        Ds=student.hidden.shape[1],
        Dt=teacher.hidden.shape[1],
        stride_hs=student.hidden.stride(0),
        stride_ws=student.weight.stride(0),
        stride_ht=teacher.hidden.stride(0),
        stride_wt=teacher.weight.stride(0),
        inv_temperature=inv_temperature,
        s_logit_scale=s_logit_scale,
        s_softcap=s_softcap,
        t_logit_scale=t_logit_scale,
        t_softcap=t_softcap,
        beta=float(beta),
        log_1m_beta=math.log1p(-beta) if inner else 0.0,
        log_beta=math.log(beta) if inner else 0.0,
        S_HAS_BIAS=student.bias is not None,
        T_HAS_BIAS=teacher.bias is not None,
        S_HAS_SOFTCAP=student.transform.softcap is not None,
        T_HAS_SOFTCAP=teacher.transform.softcap is not None,
        LOGITS_IN_MEMORY=False,
        DOT_FP32=config.dot_fp32,
        S_DOT_PRECISION=config.dot_precision(student.hidden.dtype),
        T_DOT_PRECISION=config.dot_precision(teacher.hidden.dtype),
        BLOCK_N=config.block_n,
        BLOCK_V=config.block_v,
        BLOCK_D=config.block_d,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
