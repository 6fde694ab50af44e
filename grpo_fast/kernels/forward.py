"""The forward pass of layer 1 (linear log-probs): log-prob of each target and entropy, without [N, V] logits.

Math, for token n with hidden row h_n [D], weight W [V, D], optional bias b [V], temperature tau, optional
soft-cap c and logit scale k (TRL 1.16's order; tile.py):
    z_nv   = c tanh(k (h_n . W_v + b_v) / c) / tau           (a BLOCK_N x BLOCK_V tile at a time, fp32 accumulator)
    lse_n  = log sum_v exp(z_nv)                              (online: running max m, running sum s = sum exp(z - m))
    logp_n = z_n,y_n - lse_n                                  (the target logit is picked out of the tile that holds it)
    mean_n = sum_v softmax(z_n)_v z_nv                        (running t = sum exp(z - m) z, rescaled like s)
    H_n    = lse_n - mean_n
The backward needs lse (and mean, for the entropy's gradient): O(N) values, saved by the caller.

The vocabulary is cut into ``num_splits`` contiguous ranges so that few tokens still fill the GPU: program
(i, k) sweeps the vocab range k for the token block i and writes its partial (m, s, t, z_target) for each token.
``merge_partials`` folds the splits together (a logsumexp over k; a handful of [num_splits, N] fp32 ops).

Memory: inputs are read in place; the only buffers are 4 x num_splits x N fp32 partials and N fp32 outputs
(logp, entropy, lse, mean). No tensor of size V x N exists, in any dtype. On a GPU the matmul runs on tensor cores
in the input dtype (bf16/fp16), fp32 accumulation; fp32 inputs use IEEE fp32 dots (no TF32) so fp32 is exact.
Under TRITON_INTERPRET=1 (CPU) the dot operands are upcast to fp32 (``DOT_FP32``): the interpreter's bf16
``tl.dot`` is wrong in triton 3.9.
"""

import torch
import triton
import triton.language as tl

from .tile import logit_tile


@triton.jit
def _forward_kernel(
    hidden_ptr, weight_ptr, bias_ptr, targets_ptr,
    part_max_ptr, part_sumexp_ptr, part_zsum_ptr, part_target_ptr,
    N, V, D, vocab_per_split,
    stride_hn, stride_hd, stride_wv, stride_wd,
    inv_temperature, logit_scale, softcap,
    HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, COMPUTE_ENTROPY: tl.constexpr, DOT_FP32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    targets = tl.load(targets_ptr + offs_n, mask=n_mask, other=-1)

    run_max = tl.full((BLOCK_N,), float("-inf"), tl.float32)
    run_sumexp = tl.zeros((BLOCK_N,), tl.float32)
    run_zsum = tl.zeros((BLOCK_N,), tl.float32)
    target_logit = tl.zeros((BLOCK_N,), tl.float32)

    v_begin = split * vocab_per_split
    v_end = tl.minimum(v_begin + vocab_per_split, V)
    for v0 in range(v_begin, v_end, BLOCK_V):
        offs_v = v0 + tl.arange(0, BLOCK_V)
        v_mask = offs_v < v_end
        z = logit_tile(hidden_ptr, weight_ptr, bias_ptr, offs_n, offs_v, n_mask, v_mask, D,
                       stride_hn, stride_hd, stride_wv, stride_wd, inv_temperature, logit_scale, softcap,
                       HAS_BIAS, HAS_SOFTCAP, DOT_FP32, DOT_PRECISION, BLOCK_N, BLOCK_V, BLOCK_D)

        new_max = tl.maximum(run_max, tl.max(z, axis=1))
        # a row whose logits so far are all -inf (a bias that masks the vocab) keeps a finite pivot: no inf - inf
        pivot = tl.where(new_max == float("-inf"), 0.0, new_max)
        rescale = tl.exp(run_max - pivot)
        p = tl.exp(z - pivot[:, None])
        run_sumexp = run_sumexp * rescale + tl.sum(p, axis=1)
        if COMPUTE_ENTROPY:
            # p is 0 where z is -inf: zero those z first so that 0 * -inf never forms a NaN
            run_zsum = run_zsum * rescale + tl.sum(p * tl.where(z == float("-inf"), 0.0, z), axis=1)
        is_target = offs_v[None, :] == targets[:, None]
        target_logit += tl.sum(tl.where(is_target, z, 0.0), axis=1)
        run_max = new_max

    out = split * N + offs_n
    tl.store(part_max_ptr + out, run_max, mask=n_mask)
    tl.store(part_sumexp_ptr + out, run_sumexp, mask=n_mask)
    tl.store(part_target_ptr + out, target_logit, mask=n_mask)
    if COMPUTE_ENTROPY:
        tl.store(part_zsum_ptr + out, run_zsum, mask=n_mask)


def merge_partials(part_max, part_sumexp, part_zsum, part_target, compute_entropy):
    """Fold [num_splits, N] partials into logp, entropy, lse and mean logit, all [N] fp32 (entropy, mean: or None)."""
    row_max = part_max.max(dim=0).values
    pivot = torch.where(torch.isinf(row_max), torch.zeros_like(row_max), row_max)
    scale = torch.exp(part_max - pivot)
    sumexp = (part_sumexp * scale).sum(dim=0)
    lse = pivot + torch.log(sumexp)
    logp = part_target.sum(dim=0) - lse
    entropy = mean_logit = None
    if compute_entropy:
        mean_logit = (part_zsum * scale).sum(dim=0) / sumexp
        entropy = lse - mean_logit
    return logp, entropy, lse, mean_logit


def forward(hidden, weight, targets, bias, transform, compute_entropy, config):
    """hidden [N, D], weight [V, D], targets [N] int -> (logp, entropy, lse, mean logit), [N] fp32 each.

    ``transform``: a LogitTransform (temperature, softcap, logit_scale); entropy and mean are None without
    ``compute_entropy``.
    """
    N, D = hidden.shape
    V = weight.shape[0]
    block_n, block_v, block_d = config.block_n, config.block_v, config.block_d
    n_blocks = triton.cdiv(N, block_n)
    v_tiles = triton.cdiv(V, block_v)
    num_splits = max(1, min(v_tiles, triton.cdiv(config.target_programs, n_blocks)))
    vocab_per_split = triton.cdiv(v_tiles, num_splits) * block_v
    num_splits = triton.cdiv(V, vocab_per_split)

    parts = torch.empty((4, num_splits, N), dtype=torch.float32, device=hidden.device)
    part_max, part_sumexp, part_zsum, part_target = parts.unbind(0)
    _forward_kernel[(n_blocks, num_splits)](
        hidden, weight, bias if bias is not None else hidden, targets,
        part_max, part_sumexp, part_zsum, part_target,
        N, V, D, vocab_per_split,
        hidden.stride(0), hidden.stride(1), weight.stride(0), weight.stride(1),
        *transform.kernel_scalars(),
        HAS_BIAS=bias is not None, HAS_SOFTCAP=transform.softcap is not None, COMPUTE_ENTROPY=compute_entropy,
        DOT_FP32=config.dot_fp32,
        DOT_PRECISION=config.dot_precision(hidden.dtype),
        BLOCK_N=block_n, BLOCK_V=block_v, BLOCK_D=block_d,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return merge_partials(part_max, part_sumexp, part_zsum, part_target, compute_entropy)
