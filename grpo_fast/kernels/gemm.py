"""The fp32-output GEMM the layer-1 paths run on cuBLAS (the chunked backward's gradient products, the frozen-head
forward's two vocabulary GEMMs), and the token chunk both walk.

``mm_fp32`` never rounds a product to the operands' dtype: fp32 operands are multiplied as they are; bf16 / fp16
operands on CUDA with torch >= 2.8 use ``out_dtype=torch.float32`` (cuBLAS accumulates and writes fp32: TRL reports
that bf16-rounded chunk sums bias training); elsewhere (a CPU device, the interpreter) the operands are upcast, one
slab of ``a``'s rows at a time, so that the only extra buffer is one fp32 slab and fp32 ``b``.

Accumulating (out += a @ b) from bf16 / fp16 operands: ``torch.addmm(out, a, b, out_dtype=torch.float32, out=out)``
with an fp32 ``out`` fails with "self and mat2 must have the same dtype" (pytorch #154086) on the torch releases
before the fix (pytorch #167931). So whether this torch takes it is probed once per device and dtype
(``addmm_out_dtype_accumulates``), not read off a version; where it does not, the product goes into an fp32
temporary of one slab of ``a``'s rows (``slab`` x b's columns) and is added to ``out``: the same fp32 result, one
fp32 slab more memory.

``mm_token_rows``: a product whose rows are tokens, in blocks of exactly ``TOKEN_GEMM_ROWS`` rows (the last one
padded), so that a token's row is computed alike whatever else shares its call (docs/batch-invariance.md).
"""

import functools

import torch

# torch.mm / torch.addmm(..., out_dtype=torch.float32) from bf16 / fp16 operands: CUDA only, torch >= 2.8
OUT_DTYPE_GEMM = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 8)


# The rows of every call (block) of a product whose rows are tokens (``mm_token_rows``), by device type (another
# device: CUDA's). CPU: 64, enough rows for MKL's packed sgemm, few enough that a call's last block pads at most 63.
# CUDA: 256, argued, not timed: a block of 256 rows still gives cuBLAS a grid of tiles for the logits (256 x a
# vocabulary chunk) and an output tile count for dH (256 x D) that its split-K fills; 512 would halve the calls but
# double the padding a call's last block may compute (at most 255 rows against 511).
TOKEN_GEMM_ROWS = {"cpu": 64, "cuda": 256}
# the device types whose blocks go to one batched call (``torch.bmm``): bitwise the separate calls' at any block
# count on MKL (checked); cuBLAS's batched heuristics take the batch count, so CUDA makes one call a block
BATCHED_BLOCKS = ("cpu",)
# every device's block divides it: the default token chunks are its multiples (where they hold one), so that of a
# call's blocks only the last one pads
TOKEN_CHUNK_ALIGN = 256


def token_gemm_rows(device):
    """The rows of a block of ``mm_token_rows`` on ``device`` (a torch.device, or its type's name)."""
    kind = device if isinstance(device, str) else device.type
    return TOKEN_GEMM_ROWS.get(kind, TOKEN_GEMM_ROWS["cuda"])


def padded_rows(M, device):
    """M rows rounded up to whole blocks of ``mm_token_rows`` on ``device``: the rows its calls compute."""
    rows = token_gemm_rows(device)
    return -(-M // rows) * rows


def token_chunk_rows(budget):
    """A token chunk of at most ``budget`` rows: a multiple of TOKEN_CHUNK_ALIGN where the budget holds one (then
    only a call's last chunk has a padded block), else a multiple of 16, at least 16."""
    if budget >= TOKEN_CHUNK_ALIGN:
        return budget // TOKEN_CHUNK_ALIGN * TOKEN_CHUNK_ALIGN
    return max(16, budget // 16 * 16)


def chunk_rows(D):
    """``chunk_size``'s chunk for any number of tokens (about D rows): what may size a split of the vocabulary,
    whatever N."""
    return token_chunk_rows(D)


def chunk_size(N, D):
    """Tokens per chunk: one chunk's [chunk, V] buffer is never larger than the weight (V x D), D >= 256 (a test's
    smaller head: D rounded to 16, at least 16)."""
    return min(N, chunk_rows(D))


def half_operands_on_cublas(out, a, b):
    """Whether the product of a and b (bf16 / fp16, one dtype) is written in fp32 by cuBLAS (``out_dtype``)."""
    return out.is_cuda and OUT_DTYPE_GEMM and a.dtype == b.dtype


@functools.cache
def addmm_out_dtype_accumulates(device, dtype):
    """Whether ``torch.addmm(out, a, b, out_dtype=torch.float32, out=out)`` with an fp32 ``out`` and ``dtype``
    operands runs on ``device`` and gives out + a @ b (a 2 x 2 probe, once per device and dtype)."""
    a = torch.tensor([[1.0, 2.0], [3.0, 4.0]], device=device).to(dtype)
    out = torch.full((2, 2), 0.5, device=device)
    try:
        torch.addmm(out, a, a, out_dtype=torch.float32, out=out)
    except RuntimeError:  # "self and mat2 must have the same dtype" (pytorch #154086); NotImplementedError on CPU
        return False
    return out.tolist() == [[7.5, 10.5], [15.5, 22.5]]


def mm_fp32(a, b, out, accumulate, slab=16384):
    """out (fp32) = a @ b, or out += a @ b, without rounding the product to the operands' dtype."""
    if a.dtype == torch.float32 and b.dtype == torch.float32:
        if accumulate:
            torch.addmm(out, a, b, out=out)  # not addmm_, which FlopCounterMode does not count
        else:
            torch.mm(a, b, out=out)
    elif half_operands_on_cublas(out, a, b):
        if not accumulate:
            torch.mm(a, b, out_dtype=torch.float32, out=out)
        elif addmm_out_dtype_accumulates(out.device, a.dtype):
            torch.addmm(out, a, b, out_dtype=torch.float32, out=out)
        else:  # this torch rejects an fp32 `self`: the product into an fp32 temporary, a slab of a's rows at a time
            for r0 in range(0, a.shape[0], slab):
                r1 = min(r0 + slab, a.shape[0])
                out[r0:r1].add_(torch.mm(a[r0:r1], b, out_dtype=torch.float32))
    else:  # fp32 operands, a slab of a's rows at a time
        b32 = b.float()
        for r0 in range(0, a.shape[0], slab):
            r1 = min(r0 + slab, a.shape[0])
            mm_fp32(a[r0:r1].float(), b32, out[r0:r1], accumulate)


def mm_token_rows(a, b, out, accumulate, rows=None):
    """``mm_fp32(a, b, out, accumulate)`` for a product whose rows are tokens (the logits h W^T, the frozen head's
    P' W, the backward's dH = g W, LoRA's alike), in blocks of exactly ``token_gemm_rows`` rows, the last block
    padded: on a CPU one batched call over the blocks (``torch.bmm`` of fp32 operands), elsewhere one call a block.

    ``rows``: the product's rows M (default ``a``'s, which must then be ``out``'s). ``a`` and ``out`` may hold more
    rows than M: those up to the last block's end are its padding, read from ``a`` (whatever they hold: a row of the
    product reads its own row of ``a`` only) or overwritten in ``out``; a block short of them is padded in a
    temporary (zero rows of ``a``; ``out``'s rows, one block). Callers whose buffers hold the padding save the
    temporaries.

    Why: a BLAS picks its kernel, blocking and split of the reduction by the row count (MKL's sgemm rounds a row
    otherwise at M = 1, at M = 2 to 3 and in a call's remainder rows; cuBLAS picks its tile and split-K by M), so in
    one call over whatever rows a chunk holds a token's products, hence its log-prob, would depend on how many
    tokens share the call. Calls of one shape agree row by row whatever the row's position among the block's rows
    and the other rows. On a CPU ``torch.bmm`` over [blocks, rows, K] with ``b`` broadcast (the whole blocks in one
    call, the padded one in another) is bitwise the separate calls' whatever the block count (checked with MKL on one
    and two threads), and faster than a call a block. On CUDA cuBLAS's heuristics take a batched call's batch count,
    so a batched call's algorithm could change with the block count; separate calls of one (m, n, k, layout, leading
    dimension) get one algorithm (a padded block keeps the full blocks' leading dimension; its fresh buffer is
    aligned as the package's own operands are). Only shapes are read (no host sync; fake and meta tensors run it)."""
    M = a.shape[0] if rows is None else rows
    if rows is None and out.shape[0] != M:
        raise ValueError(f"mm_token_rows: a has {M} rows, out {out.shape[0]}: pass rows=")
    if M == 0:
        return
    block = token_gemm_rows(a.device)
    padded = padded_rows(M, a.device)
    if a.device.type in BATCHED_BLOCKS:
        _bmm_blocks(a, b, out, accumulate, M, block, padded)
        return
    if not (a.dtype == b.dtype == torch.float32 or half_operands_on_cublas(out, a, b)):
        b = b.float()  # mm_fp32's fp32 operands: b upcast once, not once a block
    full = M - M % block
    for r0 in range(0, full, block):
        mm_fp32(a[r0 : r0 + block], b, out[r0 : r0 + block], accumulate)
    if full == M:
        return
    tail = M - full
    a_block = a[full:padded] if a.shape[0] >= padded else _padded_block(a[full:M], block, copy=True)
    if out.shape[0] >= padded:
        mm_fp32(a_block, b, out[full:padded], accumulate)
        return
    out_block = _padded_block(out[full:M], block, copy=accumulate)
    mm_fp32(a_block, b, out_block, accumulate)
    out[full:M] = out_block[:tail]


def _padded_block(x, block, copy):
    """A zero block of ``block`` rows with x's columns and leading dimension (cuBLAS sees the full blocks' layout),
    x's rows copied into its first rows with ``copy`` (else x is only a shape: an output's block, written)."""
    ld = x.stride(0) if x.stride(1) == 1 else x.shape[1]
    out = x.new_zeros((block, max(ld, x.shape[1])))[:, : x.shape[1]]
    if copy:
        out[: x.shape[0]] = x
    return out


def _bmm_blocks(a, b, out, accumulate, M, block, padded):
    """``mm_token_rows`` on a CPU: torch.bmm over [blocks, block, K] fp32 operands, b broadcast (its rows packed
    once, not copied per block): the whole blocks read in place (fp32 ``a``), the last, padded block from ``a``'s own
    rows or a zero-padded copy of one block; each written into ``out`` itself where it is contiguous there, else
    into a temporary added or copied to ``out``. A batched call is bitwise the separate calls', whatever the count."""
    K, cols = a.shape[1], out.shape[1]
    b32 = b.float()
    full = M - M % block
    pieces = [(0, full, a[:full])] if full else []
    if full < M:
        tail = a[full:padded] if a.shape[0] >= padded else _padded_block(a[full:M], block, copy=True)
        pieces.append((full, padded, tail))
    for r0, r1, a_rows in pieces:
        blocks = (r1 - r0) // block
        a_rows = a_rows.float().contiguous()
        direct = not accumulate and out.shape[0] >= r1 and out[r0:r1].is_contiguous()
        product = out[r0:r1] if direct else out.new_empty((r1 - r0, cols), dtype=torch.float32)
        torch.bmm(a_rows.view(blocks, block, K), b32.expand(blocks, K, cols), out=product.view(blocks, block, cols))
        if direct:
            continue
        m = min(r1, M) - r0
        if accumulate:
            out[r0 : r0 + m] += product[:m]
        else:
            out[r0 : r0 + m] = product[:m]
