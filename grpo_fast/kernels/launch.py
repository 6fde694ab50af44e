"""Where the kernels run: compiled or under Triton's interpreter (``interpreting``), the device every kernel wrapper
runs on (its first tensor argument's), and the tensor-descriptor operands of the kernels that read their tiles
through Hopper's copy engine (TMA).

Under the interpreter, a scan with a combine of its own (``tl.associative_scan``: ``kept_set``'s segmented sums) runs
through ``scan_by_position``, one combine a position along the axis on whole slices, in place of the interpreter's
one combine a scalar element (a [32, 128] tile: 32 calls, not 4096); a combine is elementwise, so the values are the
same.

Triton launches on the current CUDA device, not on its arguments' device, and nothing else in grpo_fast sets it: a head
on cuda:1 (``device_map="auto"`` over two GPUs puts lm_head on the last one) launched while cuda:0 is current crashes or
reads the wrong memory. Each kernel wrapper (forward, both backwards, the frozen-head forward, the token loss, the
divergence head's) runs under ``on_device(its first tensor)``, its Triton launches and the cuBLAS calls and buffers
around them alike; the public functions check before that that all tensors share one device (``head.inputs``).
"""

import contextlib
import functools
import os

import numpy as np
import torch


def interpreting() -> bool:
    """True when Triton runs its CPU interpreter (TRITON_INTERPRET=1), as the CI tests do."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def on_device(tensor):
    """``torch.cuda.device(tensor.device)`` for a CUDA tensor, a null context for any other."""
    return torch.cuda.device(tensor.device) if tensor.device.type == "cuda" else contextlib.nullcontext()


def on_first_argument_device(wrapper):
    """Decorator: run ``wrapper`` ``on_device`` of its first argument: a tensor, or a record (operands.HeadOperands)
    whose first field is one."""

    @functools.wraps(wrapper)
    def run(first, *args, **kwargs):
        with on_device(first if isinstance(first, torch.Tensor) else first[0]):
            return wrapper(first, *args, **kwargs)

    return run


def tensor_descriptors_fit(*tensors):
    """Whether these 2-D tensors can be read through tensor descriptors: 16-byte aligned base and row stride,
    contiguous rows (what Hopper's copy engine requires)."""
    return all(
        x.dim() == 2
        and x.stride(1) == 1
        and x.data_ptr() % 16 == 0
        and (x.stride(0) * x.element_size()) % 16 == 0
        and x.shape[0] > 0
        for x in tensors
    )


def tile_operand(x, use_tma, block_rows, block_d):
    """``x`` [rows, D] as the kernel reads it: a tensor descriptor of [block_rows, block_d] blocks, or itself."""
    if not use_tma:
        return x
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor(x, list(x.shape), list(x.stride()), [block_rows, block_d])


def scan_by_position(scan, inputs):
    """Triton's interpreter's scan with a combine of its own (``ScanOps.generic_scan``: ``scan`` the ScanOps,
    ``inputs`` its tensors), the combine called once a position along ``scan.axis`` on the slices across it."""
    data = [np.moveaxis(arg.handle.data, scan.axis, 0) for arg in inputs]
    out = [np.empty_like(d) for d in data]
    acc = None
    for i in range(data[0].shape[0]):
        slices = tuple(scan.to_tensor(np.ascontiguousarray(d[i]), arg.dtype) for d, arg in zip(data, inputs))
        if acc is None:
            acc = slices
        else:
            combined = scan.combine_fn.fn(*acc, *slices)
            acc = combined if isinstance(combined, tuple) else (combined,)
        for o, a in zip(out, acc):
            values = np.asarray(a.handle.data if hasattr(a, "handle") else a)  # a tensor, or a constant
            o[i] = values.reshape(o[i].shape) if values.size == o[i].size else np.broadcast_to(values, o[i].shape)
    return [scan.to_tensor(np.moveaxis(o, 0, scan.axis), arg.dtype) for o, arg in zip(out, inputs)]


if interpreting():
    from triton.runtime import interpreter

    # Triton's own, kept for the test that compares the two
    TRITON_GENERIC_SCAN = interpreter.ScanOps.generic_scan
    interpreter.ScanOps.generic_scan = scan_by_position
