"""A study of the head's shape at cuBLAS speed: tile-parallel forward records and the trained head in three sweeps,
timed beside cuBLAS, today's forward kernel and TRL's fused head in one process. Data for the kernels' design;
bench/ makes the claims.

Two kernels, both bf16 / fp16 only, no bias / LoRA / soft-cap (what the study needs to decide the shape):

* ``_tile_record_kernel``: one program per BLOCK_N x (TILES x BLOCK_V) patch of z = H W^T / tau, the whole D loop per
  tile (fp32 accumulator), programs ordered in groups of GROUP_N token blocks so that concurrent programs share W
  tiles in L2. Each program writes its patch's partial record per row, (m, R, Zr): the max, the sum of exp(z - m)
  without the target column, and sum exp(z - m)(z - m) without it; the program holding a row's target writes z_y.
  ``finish_parts`` merges the [3, patches, N] partials with the record algebra of softmax_stats
  (S = R + exp(z_y - m), Z = Zr + exp(z_y - m)(z_y - m), each taken against the merged max). With STORE_Z the
  fp32 tile is also written (the three-sweep head's chunk buffer). ``USE_TMA``: H and W tiles through tensor
  descriptors (Hopper's copy engine).
* ``_row_grad_kernel``: g = dL/dz of an fp32 logit chunk [C, V] from the rows' lse, 1 - p_y and c = dL/dlogp:
  g = -c p off the target, c (1 - p_y) on it, scaled by a power of two and rounded to the GEMM dtype; then cuBLAS
  does dH = g W and dW += g^T H with fp32 output: the trained head in three sweeps (z, dH, dW) when c is known in
  the forward (the GRPO loss with token-level importance sampling).

    TRITON_INTERPRET=0 python3 tools/gpu_tile_study.py --out DIR --time-budget 420

Writes DIR/tile-study.json (every row, rewritten as it goes) and prints a table; each row records the device and
the commit (BENCH_COMMIT, else git's HEAD).
"""

import argparse
import json
import math
import os
import subprocess
import sys
import time

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from grpo_fast.head.transform import LogitTransform  # noqa: E402
from grpo_fast.kernels import softmax_stats  # noqa: E402
from grpo_fast.kernels.gemm import mm_fp32  # noqa: E402

# the interpreter's bf16 tl.dot is wrong: its operands are upcast there (tile.py's DOT_FP32)
UPCAST = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"))
# "cpu" under TRITON_INTERPRET=1 with --dry-run: the harness checked end to end at toy sizes
DEVICE = "cuda"


@triton.jit
def _fold_tile(z, offs_v, targets, run_max, run_rest, run_zrest, target_logit, COMPUTE_ENTROPY: tl.constexpr):
    """Fold one fp32 tile z [BLOCK_N, BLOCK_V] (-inf past the vocabulary) into the running (m, R, Zr, z_y)."""
    is_target = offs_v[None, :] == targets[:, None]
    new_max = tl.maximum(run_max, tl.max(z, axis=1))
    pivot = tl.where(new_max == float("-inf"), 0.0, new_max)
    rescale = tl.exp(run_max - pivot)
    e = tl.where(is_target, 0.0, tl.exp(z - pivot[:, None]))
    if COMPUTE_ENTROPY:
        shift = tl.where(run_max == float("-inf"), 0.0, run_max - pivot)
        run_zrest = (run_zrest + shift * run_rest) * rescale + tl.sum(
            e * tl.where(z == float("-inf"), 0.0, z - pivot[:, None]), axis=1
        )
    run_rest = run_rest * rescale + tl.sum(e, axis=1)
    target_logit += tl.sum(tl.where(is_target, z, 0.0), axis=1)
    return new_max, run_rest, run_zrest, target_logit


@triton.jit
def _grouped(pid, num_pid_n, num_pid_v, GROUP_N: tl.constexpr):
    """(token block, vocabulary patch) of program ``pid``: GROUP_N token blocks walk each patch before the next."""
    in_group = GROUP_N * num_pid_v
    first_n = (pid // in_group) * GROUP_N
    group_size = tl.minimum(num_pid_n - first_n, GROUP_N)
    return first_n + (pid % in_group) % group_size, (pid % in_group) // group_size


@triton.jit
def _store_record(parts_ptr, target_logit_ptr, stride_field, pid_v, N, offs_n, n_mask, targets, v_lo, v_hi,
                  run_max, run_rest, run_zrest, target_logit, COMPUTE_ENTROPY: tl.constexpr):  # fmt: skip
    out = parts_ptr + pid_v * N + offs_n
    tl.store(out, run_max, mask=n_mask)
    tl.store(out + stride_field, run_rest, mask=n_mask)
    if COMPUTE_ENTROPY:
        tl.store(out + 2 * stride_field, run_zrest, mask=n_mask)
    holds_target = n_mask & (targets >= v_lo) & (targets < v_hi)
    tl.store(target_logit_ptr + offs_n, target_logit, mask=holds_target)


@triton.jit
def _tile_record_kernel(
    hidden_ptr, weight_ptr, targets_ptr, parts_ptr, target_logit_ptr, z_ptr,
    N, V, D, stride_field, stride_z, stride_hn, stride_wv, inv_temperature,
    COMPUTE_ENTROPY: tl.constexpr, STORE_Z: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr, TILES: tl.constexpr, GROUP_N: tl.constexpr,
):  # fmt: skip
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_pid_v = tl.cdiv(tl.cdiv(V, BLOCK_V), TILES)
    pid_n, pid_v = _grouped(tl.program_id(0), num_pid_n, num_pid_v, GROUP_N)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    # rows past N read row N - 1's data (no load mask in the K loop); their records are not stored
    rows = tl.minimum(offs_n, N - 1).to(tl.int64)
    targets = tl.load(targets_ptr + offs_n, mask=n_mask, other=-1)
    offs_d = tl.arange(0, BLOCK_D)
    run_max = tl.full((BLOCK_N,), float("-inf"), tl.float32)
    run_rest = tl.zeros((BLOCK_N,), tl.float32)
    run_zrest = tl.zeros((BLOCK_N,), tl.float32)
    target_logit = tl.zeros((BLOCK_N,), tl.float32)
    v_lo = pid_v * TILES * BLOCK_V
    for t in range(TILES):
        offs_v = v_lo + t * BLOCK_V + tl.arange(0, BLOCK_V)
        cols = tl.minimum(offs_v, V - 1).to(tl.int64)
        h_ptrs = hidden_ptr + rows[:, None] * stride_hn + offs_d[None, :]
        w_ptrs = weight_ptr + cols[None, :] * stride_wv + offs_d[:, None]
        acc = tl.zeros((BLOCK_N, BLOCK_V), tl.float32)
        for _ in range(0, D, BLOCK_D):  # D % BLOCK_D == 0 (the wrapper checks)
            h = tl.load(h_ptrs)
            w = tl.load(w_ptrs)
            if UPCAST:
                h, w = h.to(tl.float32), w.to(tl.float32)
            acc = tl.dot(h, w, acc)
            h_ptrs += BLOCK_D
            w_ptrs += BLOCK_D
        z = tl.where((offs_v < V)[None, :], acc * inv_temperature, float("-inf"))
        if STORE_Z:
            tl.store(z_ptr + offs_n[:, None].to(tl.int64) * stride_z + offs_v[None, :], z,
                     mask=n_mask[:, None] & (offs_v < V)[None, :])  # fmt: skip
        run_max, run_rest, run_zrest, target_logit = _fold_tile(
            z, offs_v, targets, run_max, run_rest, run_zrest, target_logit, COMPUTE_ENTROPY
        )
    _store_record(parts_ptr, target_logit_ptr, stride_field, pid_v, N, offs_n, n_mask, targets, v_lo,
                  v_lo + TILES * BLOCK_V, run_max, run_rest, run_zrest, target_logit, COMPUTE_ENTROPY)  # fmt: skip


@triton.jit
def _tile_record_tma_kernel(
    h_desc, w_desc, targets_ptr, parts_ptr, target_logit_ptr, z_ptr,
    N, V, D, stride_field, stride_z, inv_temperature,
    COMPUTE_ENTROPY: tl.constexpr, STORE_Z: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr, TILES: tl.constexpr, GROUP_N: tl.constexpr,
):  # fmt: skip
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_pid_v = tl.cdiv(tl.cdiv(V, BLOCK_V), TILES)
    pid_n, pid_v = _grouped(tl.program_id(0), num_pid_n, num_pid_v, GROUP_N)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    targets = tl.load(targets_ptr + offs_n, mask=n_mask, other=-1)
    run_max = tl.full((BLOCK_N,), float("-inf"), tl.float32)
    run_rest = tl.zeros((BLOCK_N,), tl.float32)
    run_zrest = tl.zeros((BLOCK_N,), tl.float32)
    target_logit = tl.zeros((BLOCK_N,), tl.float32)
    v_lo = pid_v * TILES * BLOCK_V
    for t in range(TILES):
        v0 = v_lo + t * BLOCK_V
        offs_v = v0 + tl.arange(0, BLOCK_V)
        acc = tl.zeros((BLOCK_N, BLOCK_V), tl.float32)
        for d0 in range(0, D, BLOCK_D):
            h = h_desc.load([pid_n * BLOCK_N, d0])
            w = w_desc.load([v0, d0])
            if UPCAST:
                h, w = h.to(tl.float32), w.to(tl.float32)
            acc = tl.dot(h, w.T, acc)
        z = tl.where((offs_v < V)[None, :], acc * inv_temperature, float("-inf"))
        if STORE_Z:
            tl.store(z_ptr + offs_n[:, None].to(tl.int64) * stride_z + offs_v[None, :], z,
                     mask=n_mask[:, None] & (offs_v < V)[None, :])  # fmt: skip
        run_max, run_rest, run_zrest, target_logit = _fold_tile(
            z, offs_v, targets, run_max, run_rest, run_zrest, target_logit, COMPUTE_ENTROPY
        )
    _store_record(parts_ptr, target_logit_ptr, stride_field, pid_v, N, offs_n, n_mask, targets, v_lo,
                  v_lo + TILES * BLOCK_V, run_max, run_rest, run_zrest, target_logit, COMPUTE_ENTROPY)  # fmt: skip


@triton.jit
def _tile_grad_tma_kernel(
    h_desc, w_desc, targets_ptr, lse_ptr, nontarget_mass_ptr, grad_logp_ptr, g_ptr,
    N, V, D, stride_g, inv_temperature, g_scale,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr, GROUP_N: tl.constexpr,
):  # fmt: skip
    """The four-sweep backward's recompute: g = dL/dz of one tile from the forward's lse and 1 - p_y, scaled by
    g_scale and rounded to g's dtype (the chunk buffer that cuBLAS's dH and dW read)."""
    pid_n, pid_v = _grouped(tl.program_id(0), tl.cdiv(N, BLOCK_N), tl.cdiv(V, BLOCK_V), GROUP_N)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_v = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    n_mask = offs_n < N
    acc = tl.zeros((BLOCK_N, BLOCK_V), tl.float32)
    for d0 in range(0, D, BLOCK_D):
        h = h_desc.load([pid_n * BLOCK_N, d0])
        w = w_desc.load([pid_v * BLOCK_V, d0])
        if UPCAST:
            h, w = h.to(tl.float32), w.to(tl.float32)
        acc = tl.dot(h, w.T, acc)
    lse = tl.load(lse_ptr + offs_n, mask=n_mask, other=float("inf"))
    c = tl.load(grad_logp_ptr + offs_n, mask=n_mask, other=0.0) * g_scale
    mass = tl.load(nontarget_mass_ptr + offs_n, mask=n_mask, other=0.0)
    targets = tl.load(targets_ptr + offs_n, mask=n_mask, other=-1)
    p = tl.exp(acc * inv_temperature - lse[:, None])
    g = tl.where(offs_v[None, :] == targets[:, None], (c * mass)[:, None], -c[:, None] * p)
    tl.store(g_ptr + offs_n[:, None].to(tl.int64) * stride_g + offs_v[None, :], g.to(g_ptr.dtype.element_ty),
             mask=n_mask[:, None] & (offs_v < V)[None, :])  # fmt: skip


@triton.jit
def _row_grad_inplace_kernel(z_ptr, stride_z, g_ptr, stride_g, targets_ptr, lse_ptr, nontarget_mass_ptr,
                             grad_logp_ptr, g_scale, V, BLOCK: tl.constexpr):  # fmt: skip
    """g over z in place: one program walks its row left to right, so a block's g (2 bytes an entry, in the first
    half of the row's bytes) lands on entries already read (this block's or earlier ones)."""
    row = tl.program_id(0).to(tl.int64)
    target = tl.load(targets_ptr + row)
    c = tl.load(grad_logp_ptr + row) * g_scale
    lse = tl.load(lse_ptr + row)
    target_g = c * tl.load(nontarget_mass_ptr + row)
    for v0 in range(0, V, BLOCK):
        offs = v0 + tl.arange(0, BLOCK)
        mask = offs < V
        z = tl.load(z_ptr + row * stride_z + offs, mask=mask, other=float("-inf"))
        g = tl.where(offs == target, target_g, -c * tl.exp(z - lse))
        tl.store(g_ptr + row * stride_g + offs, g.to(g_ptr.dtype.element_ty), mask=mask)


def chunk_pipeline(hidden, weight, targets, grad_logp, chunk, tile_cfg, train_weight=True, dw_layout="VD",
                   block=4096):  # fmt: skip
    """(logp, dH, dW) of sum_n c_n logp_n in three sweeps (two with a frozen weight): per token chunk the tile
    kernel (TMA) writes the fp32 logits and their records in one pass, g is written over them in place, cuBLAS
    does dH and dW (``dw_layout`` "DV": dW^T += H^T g, transposed once at the end)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    block_n, block_v, block_d, warps, stages, tiles, group_n = tile_cfg
    N, D = hidden.shape
    V = weight.shape[0]
    dev = hidden.device
    z = torch.empty((chunk, V), dtype=torch.float32, device=dev)
    g = z.view(hidden.dtype)[:, :V] if hidden.dtype != torch.float32 else z  # rows of stride 2V
    patches = triton.cdiv(triton.cdiv(V, block_v), tiles)
    parts = torch.empty((3, patches, chunk), dtype=torch.float32, device=dev)
    target_logit = torch.empty(chunk, dtype=torch.float32, device=dev)
    grad_hidden = torch.empty((N, D), dtype=torch.float32, device=dev)
    grad_weight = None
    if train_weight:
        grad_weight = torch.zeros((V, D) if dw_layout == "VD" else (D, V), dtype=torch.float32, device=dev)
    logp = torch.empty(N, dtype=torch.float32, device=dev)
    scale = _pow2_scale(float(grad_logp.abs().max()))
    w_desc = TensorDescriptor(weight, list(weight.shape), list(weight.stride()), [block_v, block_d])
    for n0 in range(0, N, chunk):
        n1 = min(n0 + chunk, N)
        rows = n1 - n0
        h = hidden[n0:n1]
        h_desc = TensorDescriptor(h, list(h.shape), list(h.stride()), [block_n, block_d])
        grid = (triton.cdiv(rows, block_n) * patches,)
        part_rows = parts.view(-1)[: 3 * patches * rows].view(3, patches, rows)  # the kernel's layout for `rows`
        _tile_record_tma_kernel[grid](h_desc, w_desc, targets[n0:n1], part_rows, target_logit, z, rows, V, D,
                                      part_rows.stride(0), z.stride(0), 1.0, COMPUTE_ENTROPY=True, STORE_Z=True,
                                      BLOCK_N=block_n, BLOCK_V=block_v, BLOCK_D=block_d, TILES=tiles,
                                      GROUP_N=group_n, num_warps=warps, num_stages=stages)  # fmt: skip
        record = finish_parts(part_rows, target_logit[:rows], True)
        lp, _, bstats = softmax_stats.finish(record, True)
        logp[n0:n1] = lp
        _row_grad_inplace_kernel[(rows,)](z, z.stride(0), g, g.stride(0), targets[n0:n1], bstats.lse,
                                          bstats.nontarget_mass, grad_logp[n0:n1], scale, V, BLOCK=block,
                                          num_warps=8)  # fmt: skip
        mm_fp32(g[:rows], weight, grad_hidden[n0:n1], accumulate=False)
        grad_hidden[n0:n1].mul_(1.0 / scale)
        if train_weight and dw_layout == "VD":
            mm_fp32(g[:rows].T, h, grad_weight, accumulate=True)
        elif train_weight:
            mm_fp32(h.T, g[:rows], grad_weight, accumulate=True)
    if train_weight:
        grad_weight.mul_(1.0 / scale)
        if dw_layout == "DV":
            grad_weight = grad_weight.T.contiguous()
    return logp, grad_hidden, grad_weight


def backward_four_sweeps(hidden, weight, targets, bstats, grad_logp, chunk, cfg):
    """dH, dW from the forward's lse and 1 - p_y (c known only in the backward): per chunk the TMA grad-tile
    kernel writes g, cuBLAS does dH and dW."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    block_n, block_v, block_d, warps, stages, _, group_n = cfg
    N, D = hidden.shape
    V = weight.shape[0]
    g = torch.empty((chunk, V), dtype=hidden.dtype, device=hidden.device)
    grad_hidden = torch.empty((N, D), dtype=torch.float32, device=hidden.device)
    grad_weight = torch.zeros((V, D), dtype=torch.float32, device=hidden.device)
    scale = _pow2_scale(float(grad_logp.abs().max()))
    w_desc = TensorDescriptor(weight, list(weight.shape), list(weight.stride()), [block_v, block_d])
    for n0 in range(0, N, chunk):
        n1 = min(n0 + chunk, N)
        rows = n1 - n0
        h = hidden[n0:n1]
        h_desc = TensorDescriptor(h, list(h.shape), list(h.stride()), [block_n, block_d])
        grid = (triton.cdiv(rows, block_n) * triton.cdiv(V, block_v),)
        _tile_grad_tma_kernel[grid](h_desc, w_desc, targets[n0:n1], bstats.lse[n0:n1], bstats.nontarget_mass[n0:n1],
                                    grad_logp[n0:n1], g, rows, V, D, g.stride(0), 1.0, scale, BLOCK_N=block_n,
                                    BLOCK_V=block_v, BLOCK_D=block_d, GROUP_N=group_n, num_warps=warps,
                                    num_stages=stages)  # fmt: skip
        mm_fp32(g[:rows], weight, grad_hidden[n0:n1], accumulate=False)
        grad_hidden[n0:n1].mul_(1.0 / scale)
        mm_fp32(g[:rows].T, h, grad_weight, accumulate=True)
    grad_weight.mul_(1.0 / scale)
    return grad_hidden, grad_weight


def finish_parts(parts, target_logit, compute_entropy):
    """The merged softmax_stats.SoftmaxStats of the kernels' partials ([3, patches, N]; targets all in range)."""
    part_max, part_rest, part_zrest = parts.unbind(0)
    row_max = part_max.max(dim=0).values
    pivot = torch.where(torch.isinf(row_max), 0.0, row_max)
    scale = torch.exp(part_max - pivot)
    rest = (part_rest * scale).sum(0)
    target_exp = torch.exp(target_logit - pivot)
    zsum = torch.zeros_like(rest)
    if compute_entropy:
        shift = torch.where(scale > 0, (part_max - pivot) * part_rest, 0.0)
        zsum = ((part_zrest + shift) * scale).sum(0) + target_exp * (target_logit - pivot)
    return softmax_stats.SoftmaxStats(row_max, rest + target_exp, rest, zsum, target_logit)


def tile_forward(hidden, weight, targets, cfg, compute_entropy=True, temperature=1.0, z_out=None, tma=False):
    """(logp, entropy) through the tile-record kernel; ``cfg`` = (block_n, block_v, block_d, warps, stages, tiles,
    group_n). ``z_out``: an fp32 [N, V] buffer that receives the logits (STORE_Z)."""
    block_n, block_v, block_d, warps, stages, tiles, group_n = cfg
    N, D = hidden.shape
    V = weight.shape[0]
    if D % block_d:
        raise ValueError(f"D {D} is not a multiple of BLOCK_D {block_d}")
    patches = triton.cdiv(triton.cdiv(V, block_v), tiles)
    parts = torch.empty((3, patches, N), dtype=torch.float32, device=hidden.device)
    target_logit = torch.empty(N, dtype=torch.float32, device=hidden.device)
    grid = (triton.cdiv(N, block_n) * patches,)
    common = dict(COMPUTE_ENTROPY=compute_entropy, BLOCK_N=block_n, BLOCK_V=block_v, BLOCK_D=block_d, TILES=tiles,
                  GROUP_N=group_n, num_warps=warps, num_stages=stages)  # fmt: skip
    if tma:
        from triton.tools.tensor_descriptor import TensorDescriptor

        h_desc = TensorDescriptor(hidden, list(hidden.shape), list(hidden.stride()), [block_n, block_d])
        w_desc = TensorDescriptor(weight, list(weight.shape), list(weight.stride()), [block_v, block_d])
        _tile_record_tma_kernel[grid](h_desc, w_desc, targets, parts, target_logit,
                                      z_out if z_out is not None else parts, N, V, D, parts.stride(0),
                                      z_out.stride(0) if z_out is not None else 0, 1.0 / temperature,
                                      STORE_Z=z_out is not None, **common)  # fmt: skip
    else:
        _tile_record_kernel[grid](hidden, weight, targets, parts, target_logit, z_out if z_out is not None else parts,
                                  N, V, D, parts.stride(0), z_out.stride(0) if z_out is not None else 0,
                                  hidden.stride(0), weight.stride(0), 1.0 / temperature,
                                  STORE_Z=z_out is not None, **common)  # fmt: skip
    logp, entropy, stats = softmax_stats.finish(finish_parts(parts, target_logit, compute_entropy), compute_entropy)
    return logp, entropy, stats


@triton.jit
def _row_record_kernel(z_ptr, stride_z, targets_ptr, stats_ptr, C, V, BLOCK: tl.constexpr):
    """Each row's (m, S, R, Z, z_y) of an fp32 logit chunk, one program per row (the cuBLAS variant's first pass)."""
    row = tl.program_id(0)
    target = tl.load(targets_ptr + row)
    m = tl.full((BLOCK,), float("-inf"), tl.float32)
    s = tl.zeros((BLOCK,), tl.float32)
    r = tl.zeros((BLOCK,), tl.float32)
    zs = tl.zeros((BLOCK,), tl.float32)
    zy = tl.zeros((BLOCK,), tl.float32)
    for v0 in range(0, V, BLOCK):  # per lane: a running record of the columns v0 + lane, merged at the end
        offs = v0 + tl.arange(0, BLOCK)
        z = tl.load(z_ptr + row.to(tl.int64) * stride_z + offs, mask=offs < V, other=float("-inf"))
        new_m = tl.maximum(m, z)
        pivot = tl.where(new_m == float("-inf"), 0.0, new_m)
        a = tl.exp(m - pivot)
        e = tl.exp(z - pivot)
        shift = tl.where(m == float("-inf"), 0.0, m - pivot)
        zs = (zs + shift * s) * a + e * tl.where(z == float("-inf"), 0.0, z - pivot)
        s = s * a + e
        r = r * a + tl.where(offs == target, 0.0, e)
        zy += tl.where(offs == target, z, 0.0)
        m = new_m
    row_max = tl.max(m, axis=0)
    pivot = tl.where(row_max == float("-inf"), 0.0, row_max)
    a = tl.exp(m - pivot)
    shift = tl.where(m == float("-inf"), 0.0, m - pivot)
    tl.store(stats_ptr + row, row_max)
    tl.store(stats_ptr + C + row, tl.sum(s * a, axis=0))
    tl.store(stats_ptr + 2 * C + row, tl.sum(r * a, axis=0))
    tl.store(stats_ptr + 3 * C + row, tl.sum((zs + shift * s) * a, axis=0))
    tl.store(stats_ptr + 4 * C + row, tl.sum(zy, axis=0))


@triton.jit
def _row_grad_kernel(z_ptr, stride_z, g_ptr, stride_g, targets_ptr, lse_ptr, nontarget_mass_ptr, grad_logp_ptr,
                     g_scale, V, BLOCK: tl.constexpr):  # fmt: skip
    """g = dL/dz of one row block of an fp32 logit chunk, scaled by g_scale and rounded to g's dtype."""
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < V
    z = tl.load(z_ptr + row.to(tl.int64) * stride_z + offs, mask=mask, other=float("-inf"))
    c = tl.load(grad_logp_ptr + row) * g_scale
    p = tl.exp(z - tl.load(lse_ptr + row))
    g = tl.where(offs == tl.load(targets_ptr + row), c * tl.load(nontarget_mass_ptr + row), -c * p)
    tl.store(g_ptr + row.to(tl.int64) * stride_g + offs, g.to(g_ptr.dtype.element_ty), mask=mask)


def _pow2_scale(bound):
    """An exact power of two putting ``bound`` (> 0) in [2^8, 2^9) (tile.gemm_scale's rule, on the host)."""
    k = max(-126, min(126, 8 - math.floor(math.log2(bound))))
    return 2.0**k


def trained_three_sweeps(hidden, weight, targets, grad_logp, chunk, producer="cublas", tile_cfg=None, block=4096):
    """(logp, dH, dW) of sum_n c_n logp_n: per token chunk the fp32 logits once (cuBLAS, or the tile kernel with
    its records), g in place of the softmax, then cuBLAS's dH and dW. c is known in the forward here."""
    N, D = hidden.shape
    V = weight.shape[0]
    dev = hidden.device
    z = torch.empty((chunk, V), dtype=torch.float32, device=dev)
    g = torch.empty((chunk, V), dtype=hidden.dtype, device=dev)
    stats = torch.empty((5, chunk), dtype=torch.float32, device=dev)
    grad_hidden = torch.empty((N, D), dtype=torch.float32, device=dev)
    grad_weight = torch.zeros((V, D), dtype=torch.float32, device=dev)
    logp = torch.empty(N, dtype=torch.float32, device=dev)
    scale = _pow2_scale(float(grad_logp.abs().max()))
    for n0 in range(0, N, chunk):
        n1 = min(n0 + chunk, N)
        rows = n1 - n0
        h = hidden[n0:n1]
        if producer == "cublas":
            mm_fp32(h, weight.T, z[:rows], accumulate=False)
            _row_record_kernel[(rows,)](z, z.stride(0), targets[n0:n1], stats, chunk, V, BLOCK=block, num_warps=8)
            record = softmax_stats.SoftmaxStats(*(f[:rows] for f in stats.unbind(0)))
            lp, _, bstats = softmax_stats.finish(record, False)
        else:
            lp, _, bstats = tile_forward(h, weight, targets[n0:n1], tile_cfg, compute_entropy=False, z_out=z)
        logp[n0:n1] = lp
        _row_grad_kernel[(rows, triton.cdiv(V, block))](z, z.stride(0), g, g.stride(0), targets[n0:n1], bstats.lse,
                                                        bstats.nontarget_mass, grad_logp[n0:n1], scale, V,
                                                        BLOCK=block, num_warps=8)  # fmt: skip
        mm_fp32(g[:rows], weight, grad_hidden[n0:n1], accumulate=False)
        grad_hidden[n0:n1].mul_(1.0 / scale)
        mm_fp32(g[:rows].T, h, grad_weight, accumulate=True)
    grad_weight.mul_(1.0 / scale)
    return logp, grad_hidden, grad_weight


# ------------------------------------------------------------------------------------------------ the measurements

# (block_n, block_v, block_d, warps, stages, tiles per program, group of token blocks)
FORWARD_CANDIDATES = [
    (128, 256, 64, 8, 3, 1, 8),
    (128, 256, 64, 8, 3, 4, 8),
    (128, 256, 64, 8, 4, 1, 8),
    (128, 128, 64, 8, 4, 1, 8),
    (128, 128, 64, 4, 4, 2, 8),
    (256, 128, 64, 8, 3, 1, 8),
    (128, 256, 64, 8, 3, 1, 16),
    (128, 128, 64, 8, 3, 1, 8),
]
TMA_CANDIDATES = [(128, 256, 64, 8, 3, 1, 8), (128, 256, 64, 8, 4, 1, 8)]


class Study:
    def __init__(self, out, budget):
        self.out, self.deadline, self.rows = out, time.monotonic() + budget, []
        self.meta = dict(
            device=torch.cuda.get_device_name() if DEVICE == "cuda" else DEVICE,
            torch=torch.__version__,
            triton=triton.__version__,
            commit=os.environ.get("BENCH_COMMIT") or _git_head(),
            date=time.strftime("%Y-%m-%d", time.gmtime()),
        )

    def left(self):
        return self.deadline - time.monotonic()

    def record(self, **row):
        self.rows.append(row)
        ms = row.get("ms")
        extra = {k: v for k, v in row.items() if k not in ("what", "shape", "ms")}
        print(f"{row['shape']:<22} {row['what']:<44} {'-' if ms is None else f'{ms:8.2f} ms'}  {extra}", flush=True)
        with open(os.path.join(self.out, "tile-study.json"), "w") as f:
            json.dump(dict(meta=self.meta, rows=self.rows), f, indent=1)

    def time(self, shape, what, fn, flops=None, **extra):
        if self.left() < 5:
            self.record(shape=shape, what=what, ms=None, error="skipped: time budget")
            return None
        try:
            if DEVICE == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
                fn()
                torch.cuda.synchronize()
                peak = (torch.cuda.max_memory_allocated() - base) / 2**20
                ms = triton.testing.do_bench(fn, warmup=50, rep=300, return_mode="median")
            else:  # the dry run: one call, wall clock
                peak, t0 = 0.0, time.perf_counter()
                fn()
                ms = (time.perf_counter() - t0) * 1e3
        except Exception as e:  # noqa: BLE001 - a variant that fails is a result
            self.record(shape=shape, what=what, ms=None, error=f"{type(e).__name__}: {str(e)[:200]}")
            return None
        row = dict(shape=shape, what=what, ms=ms, peak_mib=round(peak, 1), **extra)
        if flops:
            row["tflops"] = round(flops / ms / 1e9, 1)
        self.record(**row)
        return ms


def _git_head():
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _inputs(N, D, V, seed=0):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    hidden = torch.randn(N, D, device=DEVICE, generator=g).to(torch.bfloat16)
    weight = (torch.randn(V, D, device=DEVICE, generator=g) * 0.02).to(torch.bfloat16)
    targets = torch.randint(0, V, (N,), device=DEVICE, generator=g)
    return hidden, weight, targets


def _truth(hidden, weight, targets, rows=512):
    """fp64 log-probs and entropy of the first ``rows`` tokens."""
    z = hidden[:rows].double() @ weight.double().T
    logp_all = torch.log_softmax(z, dim=1)
    p = logp_all.exp()
    return logp_all.gather(1, targets[:rows, None])[:, 0], -(p * logp_all).sum(1)


def study_forward(st, N, D, V):
    shape = f"N{N} D{D} V{V}"
    hidden, weight, targets = _inputs(N, D, V)
    flops = 2 * N * D * V
    truth_logp, truth_entropy = _truth(hidden, weight, targets)
    piece = 32768
    product = torch.empty(N, piece, device=DEVICE, dtype=torch.bfloat16)
    st.time(
        shape,
        "cuBLAS bf16 mm (32768-column pieces)",
        lambda: [
            torch.mm(hidden, weight[v0 : v0 + piece].T, out=product[:, : min(piece, V - v0)])
            for v0 in range(0, V, piece)
        ],
        flops,
    )
    product32 = torch.empty(N, piece, device=DEVICE, dtype=torch.float32)
    st.time(
        shape,
        "cuBLAS mm fp32 out (32768-column pieces)",
        lambda: [
            mm_fp32(hidden, weight[v0 : v0 + piece].T, product32[:, : min(piece, V - v0)], accumulate=False)
            for v0 in range(0, V, piece)
        ],
        flops,
    )

    def err(logp, entropy):
        e = dict(logp_err=float((logp[:512].double() - truth_logp).abs().max()))
        if entropy is not None:
            e["entropy_err"] = float((entropy[:512].double() - truth_entropy).abs().max())
        return e

    from grpo_fast.kernels import config as kconfig
    from grpo_fast.kernels import forward as kforward

    transform = LogitTransform()
    default = kconfig.forward_config(hidden.device, hidden.dtype)
    try:
        logp, entropy, _ = kforward.forward(hidden, weight, targets, None, transform, True, default)
        extra = err(logp, entropy)
    except Exception as e:  # noqa: BLE001
        extra = dict(error=str(e)[:200])
    st.time(
        shape,
        "today's forward kernel (logp + entropy)",
        lambda: kforward.forward(hidden, weight, targets, None, transform, True, default),
        flops,
        **extra,
    )
    try:
        from trl.kernels import ChunkedLogProbFunction

        def trl_logprobs():
            with torch.no_grad():
                return ChunkedLogProbFunction.apply(
                    hidden, weight, None, targets, 1.0, 4096, None, 1.0, ("log_probs",)
                )[0]

        st.time(shape, "TRL 1.16 ChunkedLogProbFunction (logp)", trl_logprobs, flops, **err(trl_logprobs(), None))
    except ImportError as e:
        st.record(shape=shape, what="TRL 1.16 ChunkedLogProbFunction (logp)", ms=None, error=f"ImportError: {e}")
    for tma, candidates in ((False, FORWARD_CANDIDATES), (True, TMA_CANDIDATES)):
        for cfg in candidates:
            for entropy_on in (True, False) if cfg == candidates[0] else (True,):
                name = f"tile {'tma ' if tma else ''}{cfg[0]}x{cfg[1]}x{cfg[2]} w{cfg[3]} s{cfg[4]} t{cfg[5]} g{cfg[6]}"
                name += " +entropy" if entropy_on else ""
                try:
                    logp, entropy, _ = tile_forward(hidden, weight, targets, cfg, entropy_on, tma=tma)
                    extra = err(logp, entropy if entropy_on else None)
                except Exception as e:  # noqa: BLE001
                    st.record(shape=shape, what=name, ms=None, error=f"{type(e).__name__}: {str(e)[:200]}")
                    continue
                st.time(
                    shape,
                    name,
                    lambda cfg=cfg, e=entropy_on, t=tma: tile_forward(hidden, weight, targets, cfg, e, tma=t),
                    flops,
                    **extra,
                )


def study_trained(st, N, D, V):
    shape = f"N{N} D{D} V{V}"
    hidden, weight, targets = _inputs(N, D, V, seed=1)
    grad_logp = torch.randn(N, device=DEVICE) / N
    flops = 6 * N * D * V
    import grpo_fast

    h = hidden.view(1, N, D).detach().requires_grad_(True)
    w = weight.detach().requires_grad_(True)

    def ours_today():
        logp, entropy = grpo_fast.logprobs_and_entropy(h, w, targets.view(1, N))
        torch.autograd.backward(logp, grad_logp.view(1, N))
        h.grad = w.grad = None

    st.time(shape, "today's trained head fwd+bwd (logprobs_and_entropy)", ours_today, 8 * N * D * V)
    try:
        from trl.kernels import ChunkedLogProbFunction

        def trl_trained():
            logp, entropy = ChunkedLogProbFunction.apply(
                h.view(N, D), w, None, targets, 1.0, 4096, None, 1.0, ("log_probs", "entropy")
            )[:2]
            torch.autograd.backward(logp, grad_logp)
            h.grad = w.grad = None

        st.time(shape, "TRL 1.16 trained head fwd+bwd", trl_trained, 8 * N * D * V)
    except ImportError as e:
        st.record(shape=shape, what="TRL 1.16 trained head fwd+bwd", ms=None, error=f"ImportError: {e}")
    # precision of the three-sweep head's dH, dW against fp64 on a small slice (c known in the forward)
    n_small = 256
    lp, dh, dw = trained_three_sweeps(hidden[:n_small], weight, targets[:n_small], grad_logp[:n_small], 256)
    z = hidden[:n_small].double() @ weight.double().T
    p = torch.softmax(z, 1)
    g64 = -grad_logp[:n_small, None].double() * p
    g64[torch.arange(n_small), targets[:n_small]] += grad_logp[:n_small].double()
    dh64, dw64 = g64 @ weight.double(), g64.T @ hidden[:n_small].double()
    extra = dict(
        dh_rel_err=float((dh.double() - dh64).norm() / dh64.norm()),
        dw_rel_err=float((dw.double() - dw64).norm() / dw64.norm()),
    )
    del z, p, g64, dh64, dw64, lp, dh, dw
    st.record(shape=f"N{n_small} D{D} V{V}", what="3-sweep head precision vs fp64", ms=None, **extra)
    for chunk in (512, 1024, 2048):
        st.time(
            shape,
            f"3 sweeps, cuBLAS z, chunk {chunk}",
            lambda c=chunk: trained_three_sweeps(hidden, weight, targets, grad_logp, c),
            flops,
        )
    for chunk in (1024,):
        st.time(
            shape,
            f"3 sweeps, tile kernel z + records, chunk {chunk}",
            lambda c=chunk: trained_three_sweeps(hidden, weight, targets, grad_logp, c, "tile", FORWARD_CANDIDATES[0]),
            flops,
        )
    # the four-sweep backward (c known only in the backward: logprobs_and_entropy): today's chunked kernel's tiles
    from grpo_fast.kernels import backward as kbackward
    from grpo_fast.kernels import config as kconfig
    from grpo_fast.kernels import forward as kforward

    transform = LogitTransform()
    _, _, bstats = kforward.forward(
        hidden, weight, targets, None, transform, False, kconfig.forward_config(hidden.device, hidden.dtype)
    )
    gh = torch.empty((N, D), dtype=torch.float32, device=DEVICE)
    gw = torch.zeros((V, D), dtype=torch.float32, device=DEVICE)
    small = DEVICE != "cuda"
    for bn, bv, bd, warps, stages in ((128, 128, 64, 8, 3), (128, 256, 64, 8, 3), (256, 128, 64, 8, 3)):
        cfg = kconfig.BackwardConfig(
            block_n=16 if small else bn,
            block_v=32 if small else bv,
            block_d=16 if small else bd,
            num_warps=warps,
            num_stages=1 if small else stages,
            dot_fp32=small,
            group_v=8,
        )
        st.time(
            shape,
            f"today's chunked backward {bn}x{bv}x{bd} w{warps} s{stages}",
            lambda cfg=cfg: kbackward.backward_chunked(
                hidden, weight, targets, None, bstats, grad_logp, None, transform, gh, gw, None, cfg
            ),
            6 * N * D * V,
        )
    # the pieces at chunk 1024: where the time goes
    C = min(1024, N)
    z = torch.empty((C, V), dtype=torch.float32, device=DEVICE)
    g = torch.empty((C, V), dtype=hidden.dtype, device=DEVICE)
    stats = torch.empty((5, C), dtype=torch.float32, device=DEVICE)
    hs, ts = hidden[:C], targets[:C]
    cflops = 2 * C * D * V
    st.time(shape, "piece: z chunk fp32 (cuBLAS), x N/C", lambda: mm_fp32(hs, weight.T, z, accumulate=False), cflops)
    st.time(
        shape,
        "piece: row records of the chunk",
        lambda: _row_record_kernel[(C,)](z, z.stride(0), ts, stats, C, V, BLOCK=4096, num_warps=8),
    )
    lse = torch.zeros(C, device=DEVICE)
    st.time(
        shape,
        "piece: g of the chunk",
        lambda: _row_grad_kernel[(C, triton.cdiv(V, 4096))](
            z, z.stride(0), g, g.stride(0), ts, lse, lse, grad_logp[:C], 1.0, V, BLOCK=4096, num_warps=8
        ),
    )
    dh = torch.empty((C, D), dtype=torch.float32, device=DEVICE)
    dw = torch.zeros((V, D), dtype=torch.float32, device=DEVICE)
    st.time(shape, "piece: dH chunk (cuBLAS fp32 out)", lambda: mm_fp32(g, weight, dh, accumulate=False), cflops)
    st.time(shape, "piece: dW += chunk (cuBLAS fp32 acc)", lambda: mm_fp32(g.T, hs, dw, accumulate=True), cflops)


TMA_SECOND = [
    (128, 256, 64, 8, 3, 1, 8),
    (128, 256, 64, 8, 3, 4, 8),
    (128, 256, 64, 8, 3, 2, 8),
    (128, 256, 64, 8, 3, 1, 16),
    (128, 256, 128, 8, 2, 1, 8),
    (256, 128, 64, 8, 3, 1, 8),
]


def study_forward_tma(st, N, D, V, candidates):
    """The TMA tile kernel's neighbours (tiles per program, group, K step, tile shape), with the entropy."""
    shape = f"N{N} D{D} V{V}"
    hidden, weight, targets = _inputs(N, D, V)
    truth_logp, truth_entropy = _truth(hidden, weight, targets)
    for cfg in candidates:
        name = f"tile tma {cfg[0]}x{cfg[1]}x{cfg[2]} w{cfg[3]} s{cfg[4]} t{cfg[5]} g{cfg[6]} +entropy"
        try:
            logp, entropy, _ = tile_forward(hidden, weight, targets, cfg, True, tma=True)
            extra = dict(
                logp_err=float((logp[:512].double() - truth_logp).abs().max()),
                entropy_err=float((entropy[:512].double() - truth_entropy).abs().max()),
            )
        except Exception as e:  # noqa: BLE001
            st.record(shape=shape, what=name, ms=None, error=f"{type(e).__name__}: {str(e)[:200]}")
            continue
        st.time(shape, name, lambda cfg=cfg: tile_forward(hidden, weight, targets, cfg, True, tma=True),
                2 * N * D * V, **extra)  # fmt: skip


def study_pipeline(st, N, D, V):
    """The chunk pipeline (TMA z + records, g in place, cuBLAS dH / dW), trained and frozen, beside TRL's and
    today's heads; the four-sweep backward with the TMA grad tile."""
    shape = f"N{N} D{D} V{V}"
    hidden, weight, targets = _inputs(N, D, V, seed=1)
    grad_logp = torch.randn(N, device=DEVICE) / N
    cfg = (128, 256, 64, 8, 3, 1, 8) if DEVICE == "cuda" else (16, 32, 16, 4, 1, 1, 2)
    import grpo_fast

    h = hidden.view(1, N, D).detach().requires_grad_(True)
    w_trained = weight.detach().requires_grad_(True)
    w_frozen = weight.detach()
    try:
        from trl.kernels import ChunkedLogProbFunction

        for w, label in ((w_trained, "trained"), (w_frozen, "frozen")):

            def trl_head(w=w):
                logp, _ = ChunkedLogProbFunction.apply(h.view(N, D), w, None, targets, 1.0, 4096, None, 1.0,
                                                       ("log_probs", "entropy"))[:2]  # fmt: skip
                torch.autograd.backward(logp, grad_logp)
                h.grad = w_trained.grad = None

            st.time(shape, f"TRL 1.16 {label} head fwd+bwd", trl_head)
    except ImportError as e:
        st.record(shape=shape, what="TRL 1.16 heads", ms=None, error=f"ImportError: {e}")
    for w, label in ((w_trained, "trained"), (w_frozen, "frozen")):

        def ours_today(w=w):
            logp, _ = grpo_fast.logprobs_and_entropy(h, w, targets.view(1, N))
            torch.autograd.backward(logp, grad_logp.view(1, N))
            h.grad = w_trained.grad = None

        st.time(shape, f"today's {label} head fwd+bwd", ours_today)
    n_small = min(256, N)
    lp, dh, dw = chunk_pipeline(hidden[:n_small], weight, targets[:n_small], grad_logp[:n_small], n_small, cfg)
    z = hidden[:n_small].double() @ weight.double().T
    p = torch.softmax(z, 1)
    g64 = -grad_logp[:n_small, None].double() * p
    g64[torch.arange(n_small), targets[:n_small]] += grad_logp[:n_small].double()
    dh64, dw64 = g64 @ weight.double(), g64.T @ hidden[:n_small].double()
    truth_logp = torch.log_softmax(z, 1).gather(1, targets[:n_small, None])[:, 0]
    st.record(shape=f"N{n_small} D{D} V{V}", what="pipeline precision vs fp64", ms=None,
              logp_err=float((lp.double() - truth_logp).abs().max()),
              dh_rel_err=float((dh.double() - dh64).norm() / dh64.norm()),
              dw_rel_err=float((dw.double() - dw64).norm() / dw64.norm()))  # fmt: skip
    del z, p, g64, dh64, dw64
    chunks = (1024, 768, 1280) if DEVICE == "cuda" else (64,)
    for chunk in chunks:
        for layout in ("VD", "DV") if chunk == chunks[0] else ("VD",):
            st.time(shape, f"pipeline trained, chunk {chunk}, dW {layout}",
                    lambda c=chunk, lay=layout: chunk_pipeline(hidden, weight, targets, grad_logp, c, cfg,
                                                               dw_layout=lay), 6 * N * D * V)  # fmt: skip
    for chunk in chunks[:2]:
        st.time(shape, f"pipeline frozen, chunk {chunk}",
                lambda c=chunk: chunk_pipeline(hidden, weight, targets, grad_logp, c, cfg, train_weight=False),
                4 * N * D * V)  # fmt: skip
    _, _, bstats = tile_forward(hidden, weight, targets, cfg, False, tma=True)
    st.time(shape, "TMA tile forward, no entropy (the 4-sweep head's first)",
            lambda: tile_forward(hidden, weight, targets, cfg, False, tma=True), 2 * N * D * V)  # fmt: skip
    for chunk in (1536, 1024) if DEVICE == "cuda" else (64,):
        st.time(shape, f"4-sweep backward, TMA grad tile, chunk {chunk}",
                lambda c=chunk: backward_four_sweeps(hidden, weight, targets, bstats, grad_logp, c, cfg),
                6 * N * D * V)  # fmt: skip
    # the pieces at chunk 1024
    C = min(1024, N)
    from triton.tools.tensor_descriptor import TensorDescriptor

    zc = torch.empty((C, V), dtype=torch.float32, device=DEVICE)
    patches = triton.cdiv(V, cfg[1])
    parts = torch.empty((3, patches, C), dtype=torch.float32, device=DEVICE)
    tlog = torch.empty(C, dtype=torch.float32, device=DEVICE)
    hc = hidden[:C]
    h_desc = TensorDescriptor(hc, list(hc.shape), list(hc.stride()), [cfg[0], cfg[2]])
    w_desc = TensorDescriptor(weight, list(weight.shape), list(weight.stride()), [cfg[1], cfg[2]])

    def z_and_records():
        _tile_record_tma_kernel[(triton.cdiv(C, cfg[0]) * patches,)](
            h_desc, w_desc, targets[:C], parts, tlog, zc, C, V, D, parts.stride(0), zc.stride(0), 1.0,
            COMPUTE_ENTROPY=True, STORE_Z=True, BLOCK_N=cfg[0], BLOCK_V=cfg[1], BLOCK_D=cfg[2], TILES=1,
            GROUP_N=cfg[6], num_warps=cfg[3], num_stages=cfg[4])  # fmt: skip

    st.time(shape, "piece: TMA z fp32 + records, chunk", z_and_records, 2 * C * D * V)
    st.time(shape, "piece: merge + finish the chunk's records",
            lambda: softmax_stats.finish(finish_parts(parts, tlog, True), True))  # fmt: skip
    lse = torch.zeros(C, device=DEVICE)
    gv = zc.view(hidden.dtype)[:, :V]
    st.time(shape, "piece: g in place, chunk",
            lambda: _row_grad_inplace_kernel[(C,)](zc, zc.stride(0), gv, gv.stride(0), targets[:C], lse, lse,
                                                   grad_logp[:C], 1.0, V, BLOCK=4096, num_warps=8))  # fmt: skip
    dwt = torch.zeros((D, V), dtype=torch.float32, device=DEVICE)
    st.time(shape, "piece: dW^T += H^T g, chunk", lambda: mm_fp32(hc.T, gv, dwt, accumulate=True), 2 * C * D * V)
    dw = torch.zeros((V, D), dtype=torch.float32, device=DEVICE)
    st.time(shape, "piece: dW += g^T H (strided g), chunk", lambda: mm_fp32(gv.T, hc, dw, accumulate=True),
            2 * C * D * V)  # fmt: skip


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="the folder for tile-study.json")
    p.add_argument("--time-budget", type=float, default=420.0, help="seconds; what is left out is recorded skipped")
    p.add_argument("--parts", default="forward,trained,forward4096", help="which studies, in order")
    p.add_argument("--dry-run", action="store_true", help="toy sizes on the CPU under TRITON_INTERPRET=1")
    args = p.parse_args()
    global DEVICE, FORWARD_CANDIDATES, TMA_CANDIDATES  # noqa: PLW0603
    if args.dry_run:
        DEVICE = "cpu"
        FORWARD_CANDIDATES = [(16, 32, 16, 4, 1, 1, 2), (16, 32, 16, 4, 1, 2, 2)]
        TMA_CANDIDATES = [(16, 32, 16, 4, 1, 1, 2)]
        TMA_SECOND[:] = [(16, 32, 16, 4, 1, 1, 2), (16, 32, 16, 4, 1, 2, 2)]
    elif not torch.cuda.is_available():
        sys.exit("a CUDA GPU (TRITON_INTERPRET unset)")
    os.makedirs(args.out, exist_ok=True)
    st = Study(args.out, args.time_budget)
    print(st.meta, flush=True)
    # (N, D, V) of each part: Qwen2.5-1.5B's head at 16k tokens, a Qwen3-8B-wide head at 8k; toys for the dry run
    shapes = dict(forward=(16384, 1536, 151936), trained=(16384, 1536, 151936), forward4096=(8192, 4096, 151936))
    if args.dry_run:
        shapes = dict(forward=(40, 32, 1000), trained=(300, 32, 1000), forward4096=(24, 64, 1000))
    for part in args.parts.split(","):
        try:
            if part in ("forward", "forward4096"):
                study_forward(st, *shapes[part])
            elif part == "trained":
                study_trained(st, *shapes[part])
            elif part == "tma":
                study_forward_tma(st, *shapes["forward"], TMA_SECOND)
            elif part == "tma4096":
                study_forward_tma(st, *shapes["forward4096"], TMA_SECOND[:3])
            elif part == "pipeline":
                study_pipeline(st, *shapes["trained"])
            if DEVICE == "cuda":
                torch.cuda.empty_cache()
        except Exception as e:  # noqa: BLE001 - the next part still runs
            st.record(shape=part, what="study part", ms=None, error=f"{type(e).__name__}: {str(e)[:300]}")


if __name__ == "__main__":
    main()
