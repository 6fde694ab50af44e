"""The forward pass of layer 1 (linear log-probs): log-prob of each target and entropy, without [N, V] logits.

Math: the transformed logits z of tile.py (a BLOCK_N x BLOCK_V tile at a time, fp32 accumulator; LoRA's operand
pair only with ``lora``), folded tile by tile into the per-token softmax record of softmax_stats.py (m, S, R, Z only
with COMPUTE_ENTROPY, the target logit) by its merge formulas. ``softmax_stats.finish`` turns it
into logp, H and what the backward reads (lse, 1 - p_y, mean logit, mean - z_y): O(N) values, saved by the caller,
with 1 - p_y and mean - z_y formed as sums of same-signed terms (exact where a token is confident).

The vocabulary is cut into ``num_splits`` contiguous ranges so that few tokens still fill the GPU, in whole waves of
the programs it holds at once (``num_vocab_splits``; config.FORWARD_CTAS_PER_SM, the compiled occupancy): program
(i, k) sweeps the vocab range k for the token block i and writes its record for each token; the epilogue folds the
splits with ``softmax_stats.merge`` (a handful of [num_splits, N] fp32 ops): the same record and merge that a
vocab-parallel head uses across ranks (``forward_record`` returns the merged record unfinished).

Memory: inputs (LoRA's [N, r] and [V, r] too) are read in place; the only buffers are 5 x num_splits x N fp32
records and N fp32 outputs.
No tensor of size V x N exists, in any dtype. On a GPU the matmul runs on tensor cores in the input dtype
(bf16/fp16), fp32 accumulation; fp32 inputs use IEEE fp32 dots (no TF32) so fp32 is exact. Under
TRITON_INTERPRET=1 (CPU) the dot operands are upcast to fp32 (``DOT_FP32``, tile.py).
"""

import torch
import triton
import triton.language as tl

from . import softmax_stats
from .launch import on_first_argument_device
from .tile import logit_tile, lora_kernel_args

# the most waves the forward's vocabulary split adds to the unsplit launch's (num_vocab_splits): more splits fill
# the last wave better, and each adds a record of 5 x N fp32 to write and merge
EXTRA_WAVES = 8
# a padding row's logit (see _forward_kernel): far above any real logit, far below fp32's overflow
PADDING_LOGIT = tl.constexpr(1e30)


@triton.jit
def _forward_kernel(
    hidden_ptr, weight_ptr, bias_ptr, targets_ptr, stats_ptr, row_count_ptr,
    N, V, D, vocab_per_split, stride_stats_field,
    stride_hn, stride_hd, stride_wv, stride_wd,
    inv_temperature, logit_scale, softcap, lora_hidden_ptr, lora_weight_ptr, R,
    HAS_BIAS: tl.constexpr, HAS_LORA: tl.constexpr, HAS_SOFTCAP: tl.constexpr, COMPUTE_ENTROPY: tl.constexpr,
    HAS_ROW_COUNT: tl.constexpr,
    DOT_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr, LORA_DOT_PRECISION: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr,
):  # fmt: skip
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    targets = tl.load(targets_ptr + offs_n, mask=n_mask, other=-1)

    # the running record (softmax_stats.SoftmaxStats), its sums taken against the pivot: m, or 0 while m is -inf
    run_max = tl.full((BLOCK_N,), float("-inf"), tl.float32)
    run_sumexp = tl.zeros((BLOCK_N,), tl.float32)
    run_rest = tl.zeros((BLOCK_N,), tl.float32)
    run_zsum = tl.zeros((BLOCK_N,), tl.float32)
    target_logit = tl.zeros((BLOCK_N,), tl.float32)

    v_begin = split * vocab_per_split
    v_end = tl.minimum(v_begin + vocab_per_split, V)
    if HAS_ROW_COUNT:
        # a block of padding rows only (past the scored count, a device value) computes no tile: its record (split
        # 0's; the others' are empty) is a certain token at a far logit, m = z_y = PADDING_LOGIT and S = 1: lse
        # finite, logp 0, entropy 0, and a backward's recompute sees p = exp(z - lse) = 0 on every column
        padding = pid_n * BLOCK_N >= tl.load(row_count_ptr)
        v_end = tl.where(padding, v_begin, v_end)
        first = padding & (split == 0)
        run_max = tl.where(first, PADDING_LOGIT, run_max)
        run_sumexp = tl.where(first, 1.0, run_sumexp)
        target_logit = tl.where(first, PADDING_LOGIT, target_logit)
    for v0 in range(v_begin, v_end, BLOCK_V):
        offs_v = v0 + tl.arange(0, BLOCK_V)
        v_mask = offs_v < v_end
        z, _ = logit_tile(hidden_ptr, weight_ptr, bias_ptr, lora_hidden_ptr, lora_weight_ptr, offs_n, offs_v, n_mask,
                          v_mask, D, R, stride_hn, stride_hd, stride_wv, stride_wd, inv_temperature, logit_scale,
                          softcap, HAS_BIAS, HAS_LORA, HAS_SOFTCAP, DOT_FP32, DOT_PRECISION, LORA_DOT_PRECISION,
                          BLOCK_N, BLOCK_V, BLOCK_D, BLOCK_R)  # fmt: skip

        new_max = tl.maximum(run_max, tl.max(z, axis=1))
        # a row whose logits so far are all -inf (a bias that masks the vocab) keeps a finite pivot: no inf - inf
        pivot = tl.where(new_max == float("-inf"), 0.0, new_max)
        rescale = tl.exp(run_max - pivot)
        e = tl.exp(z - pivot[:, None])
        is_target = offs_v[None, :] == targets[:, None]
        if COMPUTE_ENTROPY:
            # Z relative to the new pivot: (Z_old + (m_old - m_new) S_old) rescale; an empty record adds nothing, and
            # e is 0 where z is -inf: zero those z first so that 0 * -inf never forms a NaN
            shift = tl.where(run_max == float("-inf"), 0.0, run_max - pivot)
            run_zsum = (run_zsum + shift * run_sumexp) * rescale + tl.sum(
                e * tl.where(z == float("-inf"), 0.0, z - pivot[:, None]), axis=1
            )
        run_sumexp = run_sumexp * rescale + tl.sum(e, axis=1)
        run_rest = run_rest * rescale + tl.sum(tl.where(is_target, 0.0, e), axis=1)
        target_logit += tl.sum(tl.where(is_target, z, 0.0), axis=1)
        run_max = new_max

    out = stats_ptr + split * N + offs_n
    tl.store(out, run_max, mask=n_mask)
    tl.store(out + stride_stats_field, run_sumexp, mask=n_mask)
    tl.store(out + 2 * stride_stats_field, run_rest, mask=n_mask)
    tl.store(out + 3 * stride_stats_field, run_zsum, mask=n_mask)
    tl.store(out + 4 * stride_stats_field, target_logit, mask=n_mask)


def num_vocab_splits(N, V, config):
    """(num_splits, vocab_per_split): the vocabulary split so that the programs fill whole waves of
    config.target_programs (the programs the GPU holds at once: CTAs per SM x SMs).

    A launch of s splits takes about waves(s) x tiles(s) tile steps, waves(s) = cdiv(token blocks x s, wave) and
    tiles(s) = cdiv(vocabulary tiles, s), the longest program's share. The candidates are, for k waves up to
    EXTRA_WAVES more than the unsplit launch's, the most splits whose programs fit in k waves; the one of fewest
    steps is taken (the fewest splits on a tie).
    E.g. 100 token blocks on a wave of 132 leave 24 % of the GPU idle unsplit; 9 splits fill 7 waves to 97 %."""
    n_blocks = max(1, triton.cdiv(N, config.block_n))
    v_tiles = triton.cdiv(V, config.block_v)
    wave = config.target_programs

    def steps(splits):
        tiles = triton.cdiv(v_tiles, splits)
        return triton.cdiv(n_blocks * triton.cdiv(v_tiles, tiles), wave) * tiles

    unsplit_waves = triton.cdiv(n_blocks, wave)  # fewer waves than these hold no split at all
    candidates = sorted(
        {max(1, min(v_tiles, k * wave // n_blocks)) for k in range(unsplit_waves, unsplit_waves + EXTRA_WAVES + 1)}
    )
    vocab_per_split = triton.cdiv(v_tiles, min(candidates, key=steps)) * config.block_v
    return triton.cdiv(V, vocab_per_split), vocab_per_split


def forward(hidden, weight, targets, bias, transform, compute_entropy, config, lora=None, row_count=None):
    """hidden [N, D], weight [V, D], targets [N] int -> (logp, entropy, softmax_stats.BackwardStats), [N] fp32 each.

    ``transform``: a LogitTransform; ``config``: a config.ForwardConfig. Entropy (and the backward's entropy
    values) are None without ``compute_entropy``. ``lora``: None or (lora_hidden [N, r], lora_weight [V, r]),
    contiguous (grpo_fast/lora.py).
    """
    return softmax_stats.finish(
        forward_record(hidden, weight, targets, bias, transform, compute_entropy, config, lora, row_count),
        compute_entropy,
    )


@on_first_argument_device
def forward_record(hidden, weight, targets, bias, transform, compute_entropy, config, lora=None, row_count=None):
    """The unfinished per-token record (softmax_stats.SoftmaxStats, [N] fp32 fields) over these weight rows (V >= 1),
    its vocabulary splits merged; ``forward`` finishes it. zsum is 0 without ``compute_entropy``. ``row_count``: None,
    or a [1] int32 device tensor: rows from it on are padding (zeros, no gradient), and the blocks wholly past it
    compute no tile (their records are placeholders whose finished values are finite: logp 0, entropy 0)."""
    N, D = hidden.shape
    V = weight.shape[0]
    num_splits, vocab_per_split = num_vocab_splits(N, V, config)
    # the five fields of softmax_stats.SoftmaxStats, one record per vocabulary split and token
    records = torch.empty((5, num_splits, N), dtype=torch.float32, device=hidden.device)
    _forward_kernel[(triton.cdiv(N, config.block_n), num_splits)](
        hidden,
        weight,
        bias if bias is not None else hidden,
        targets,
        records,
        row_count if row_count is not None else targets,
        N,
        V,
        D,
        vocab_per_split,
        records.stride(0),
        hidden.stride(0),
        hidden.stride(1),
        weight.stride(0),
        weight.stride(1),
        *transform.kernel_scalars(),
        **lora_kernel_args(lora, hidden, config),
        HAS_BIAS=bias is not None,
        HAS_SOFTCAP=transform.softcap is not None,
        COMPUTE_ENTROPY=compute_entropy,
        HAS_ROW_COUNT=row_count is not None,
        DOT_FP32=config.dot_fp32,
        DOT_PRECISION=config.dot_precision(hidden.dtype),
        BLOCK_N=config.block_n,
        BLOCK_V=config.block_v,
        BLOCK_D=config.block_d,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    return softmax_stats.merge(softmax_stats.SoftmaxStats(*records.unbind(0)))
