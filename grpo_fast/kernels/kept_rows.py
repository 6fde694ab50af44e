"""The sampler's kept set over rows of logits held in memory (fp32 [n, V], one chunk of tokens, written by cuBLAS):
two row sweeps that replace the torch twin's passes over the rows (``grpo_fast.sampler_logprobs`` with the sampling
parameters, on the Triton backend).

Math. ``row_records``: per row, the online softmax record (max m, s = sum exp(z - m), the non-target sum
r = sum_{v != y} exp(z - m), the target's logit z_y) and, with CANDIDATES > 0, the row's largest CANDIDATES logits,
descending: each block's ``tl.topk`` merged into the running ones (``tl.join`` of the two, ``tl.topk`` again), as the
records merge. ``kept_sums``: given a floor f per row, sum_{z >= f} exp(z - m) and the same without the target: the
kept set's mass and its non-target part once f is its threshold tau (or the survivors' mass under min-p and top-k,
which top-p's decision needs). Lanes past the row are -inf: no mass, never a difference of infinities (the pivot of
an all -inf prefix is 0).

Work and memory. Each kernel reads the rows once (4 V bytes a row) and writes a few floats a row (and the
candidates), one program a row, BLOCK_V entries a step. The sums are memory-bound; the candidates cost a bitonic
``tl.topk`` of a block (~56k compare-exchanges for 1024 entries) where a block beats the row's running last
candidate, which is most blocks early in a row and fewer later: at most ~8M compare-exchanges a row of 151936, ~4.5 ms
for 16k rows on an H200's CUDA cores (argued from the operation count, not timed), beside the 12.7 ms GEMM that
writes the rows. With the GEMM that writes the rows, the support's forward is
that GEMM and two or three reads of its output, where the torch twin's passes (log-sum-exp, the kept mask, masked
log-sum-exps, the non-target masses, topk's own passes) read and write it some ten times.
"""

import torch
import triton
import triton.language as tl

from grpo_fast.kernels.launch import interpreting, on_first_argument_device

BLOCK_V = 1024
# under the interpreter (numpy): tl.topk's bitonic network over 1024 entries took ~3 s a row, over 128 a tenth of it
INTERPRETER_BLOCK_V = 128
NUM_WARPS = 4
# the most candidates the record keeps a row (a power of two): top-k up to it takes no other selection
MAX_CANDIDATES = 64


@triton.jit
def _row_records_kernel(
    z_ptr, targets_ptr, records_ptr, candidates_ptr, V, stride_z, CANDIDATES: tl.constexpr, BLOCK_V: tl.constexpr
):
    row = tl.program_id(0)
    target = tl.load(targets_ptr + row)
    row_ptr = z_ptr + row.to(tl.int64) * stride_z
    m = -float("inf")
    s = 0.0
    rest = 0.0
    target_logit = -float("inf")
    if CANDIDATES > 0:
        candidates = tl.full((CANDIDATES,), -float("inf"), tl.float32)
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        z = tl.load(row_ptr + cols, mask=cols < V, other=-float("inf"))
        new_m = tl.maximum(m, tl.max(z, axis=0))
        pivot = tl.where(new_m == -float("inf"), 0.0, new_m)  # an all -inf prefix: no mass, no inf - inf
        e = tl.exp(z - pivot)
        at_target = cols == target
        rescale = tl.exp(m - pivot)
        s = s * rescale + tl.sum(e, axis=0)
        rest = rest * rescale + tl.sum(tl.where(at_target, 0.0, e), axis=0)
        target_logit = tl.maximum(target_logit, tl.max(tl.where(at_target, z, -float("inf")), axis=0))
        m = new_m
        if CANDIDATES > 0:
            # a block none of whose entries beats the running last candidate changes nothing: no sort (one program
            # a row, so the branch is the row's own)
            if tl.max(z, axis=0) > tl.min(candidates, axis=0):
                both = tl.reshape(tl.join(candidates, tl.topk(z, CANDIDATES)), (2 * CANDIDATES,))
                candidates = tl.topk(both, CANDIDATES)
    out = records_ptr + row.to(tl.int64) * 4
    tl.store(out, m)
    tl.store(out + 1, s)
    tl.store(out + 2, rest)
    tl.store(out + 3, target_logit)
    if CANDIDATES > 0:
        tl.store(candidates_ptr + row.to(tl.int64) * CANDIDATES + tl.arange(0, CANDIDATES), candidates)


@triton.jit
def _kept_sums_kernel(z_ptr, targets_ptr, floor_ptr, pivot_ptr, sums_ptr, V, stride_z, BLOCK_V: tl.constexpr):
    row = tl.program_id(0)
    target = tl.load(targets_ptr + row)
    floor = tl.load(floor_ptr + row)
    pivot = tl.load(pivot_ptr + row)
    pivot = tl.where(pivot == -float("inf"), 0.0, pivot)
    row_ptr = z_ptr + row.to(tl.int64) * stride_z
    total = 0.0
    rest = 0.0
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        z = tl.load(row_ptr + cols, mask=cols < V, other=-float("inf"))
        e = tl.where(z >= floor, tl.exp(z - pivot), 0.0)
        total += tl.sum(e, axis=0)
        rest += tl.sum(tl.where(cols == target, 0.0, e), axis=0)
    tl.store(sums_ptr + row.to(tl.int64) * 2, total)
    tl.store(sums_ptr + row.to(tl.int64) * 2 + 1, rest)


def _block_v():
    return INTERPRETER_BLOCK_V if interpreting() else BLOCK_V


@on_first_argument_device
def row_records(z, targets, candidates):
    """(records [n, 4] fp32: max, sum exp(z - max), its non-target part, the target's logit (-inf where ``targets``
    [n] int64 is outside [0, V)); [n, candidates] the largest logits, descending, or None) of rows ``z`` [n, V] fp32
    (rows contiguous). ``candidates``: 0 or a power of two up to MAX_CANDIDATES."""
    n, V = z.shape
    records = torch.empty((n, 4), dtype=torch.float32, device=z.device)
    top = torch.empty((n, max(candidates, 1)), dtype=torch.float32, device=z.device)
    if n:
        _row_records_kernel[(n,)](
            z, targets, records, top, V, z.stride(0), CANDIDATES=candidates, BLOCK_V=_block_v(), num_warps=NUM_WARPS
        )
    return records, (top if candidates else None)


@on_first_argument_device
def kept_sums(z, targets, floor, pivot):
    """[n, 2] fp32: sum over z >= floor[n] of exp(z - pivot[n]), and the same without the target's entry."""
    n, V = z.shape
    sums = torch.empty((n, 2), dtype=torch.float32, device=z.device)
    if n:
        _kept_sums_kernel[(n,)](
            z,
            targets,
            floor.contiguous(),
            pivot.contiguous(),
            sums,
            V,
            z.stride(0),
            BLOCK_V=_block_v(),
            num_warps=NUM_WARPS,
        )
    return sums
