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
"""

import functools

import torch

# torch.mm / torch.addmm(..., out_dtype=torch.float32) from bf16 / fp16 operands: CUDA only, torch >= 2.8
OUT_DTYPE_GEMM = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 8)


def chunk_size(N, D):
    """Tokens per chunk: one chunk's [chunk, V] buffer is never larger than the weight (V x D), D >= 16."""
    return min(N, max(16, (D // 16) * 16))


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
