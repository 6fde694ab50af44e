"""The fp32-output GEMM the layer-1 paths run on cuBLAS (the chunked backward's gradient products, the frozen-head
forward's two vocabulary GEMMs), and the token chunk both walk.

``mm_fp32`` never rounds a product to the operands' dtype: fp32 operands are multiplied as they are; bf16 / fp16
operands on CUDA with torch >= 2.8 use ``out_dtype=torch.float32`` (cuBLAS accumulates and writes fp32: TRL reports
that bf16-rounded chunk sums bias training); elsewhere (a CPU device, the interpreter) the operands are upcast, one
slab of ``a``'s rows at a time, so that the only extra buffer is one fp32 slab and fp32 ``b``.
"""

import torch

# torch.mm / torch.addmm(..., out_dtype=torch.float32) from bf16 / fp16 operands: CUDA only, torch >= 2.8
OUT_DTYPE_GEMM = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 8)


def chunk_size(N, D):
    """Tokens per chunk: one chunk's [chunk, V] buffer is never larger than the weight (V x D), D >= 16."""
    return min(N, max(16, (D // 16) * 16))


def mm_fp32(a, b, out, accumulate, slab=16384):
    """out (fp32) = a @ b, or out += a @ b, without rounding the product to the operands' dtype."""
    if a.dtype == torch.float32 and b.dtype == torch.float32:
        if accumulate:
            torch.addmm(out, a, b, out=out)  # not addmm_, which FlopCounterMode does not count
        else:
            torch.mm(a, b, out=out)
    elif out.is_cuda and OUT_DTYPE_GEMM and a.dtype == b.dtype:
        if accumulate:
            torch.addmm(out, a, b, out_dtype=torch.float32, out=out)
        else:
            torch.mm(a, b, out_dtype=torch.float32, out=out)
    else:  # fp32 operands, a slab of a's rows at a time
        b32 = b.float()
        for r0 in range(0, a.shape[0], slab):
            r1 = min(r0 + slab, a.shape[0])
            mm_fp32(a[r0:r1].float(), b32, out[r0:r1], accumulate)
