"""The boundary with torch that every part's custom ops share: a custom op's schema written from an operand record
(``op_schema``), the op itself (``custom_op``), the same implementation and autograd formula as an
``autograd.Function`` run in Python under a dispatch mode over real tensors (``inline_function``, ``runs_inline``),
and a gradient formed in a forward scaled by the loss's gradient (``scaled_gradient``). Every implementation runs
with torch.autocast off (``without_autocast``).

torch.compile traces each op as one node (no graph break, no guard on a value); FakeTensorMode and meta tensors run
the fake implementations, which read no value. Schemas take tensors and numbers only: optional tensors are
``Tensor?``, and an output that a path does not produce is an empty tensor (shape [0]).
"""

from __future__ import annotations

import functools
import typing

import torch

# a custom op's schema type of each annotation of an operand record and of the ops' other arguments
_SCHEMA_TYPES = {
    torch.Tensor: "Tensor",
    float: "float",
    int: "int",
    str: "str",
    bool: "bool",
    torch.dtype: "ScalarType",
}


def schema_fields(record: type, names=None) -> str:
    """Schema text of the fields of ``record`` (a NamedTuple of annotated tensors, numbers, strings and dtypes,
    optional as ``X | None``), or of those of them in ``names``, in the record's order."""
    fields = []
    for name, hint in typing.get_type_hints(record).items():
        if names is not None and name not in names:
            continue
        optional = type(None) in typing.get_args(hint)
        base = next(t for t in typing.get_args(hint) if t is not type(None)) if optional else hint
        fields.append(f"{_SCHEMA_TYPES[base]}{'?' if optional else ''} {name}")
    return ", ".join(fields)


def op_schema(record: type, before: str, after: str, returns: str) -> str:
    """A custom op's schema whose arguments are ``before``, the fields of ``record`` (``schema_fields``), then
    ``after`` (schema text, "" for none), returning ``returns``."""
    arguments = ", ".join(part for part in (before, schema_fields(record), after) if part)
    return f"({arguments}) -> {returns}"


def without_autocast(fn):
    """``fn`` with torch.autocast off on the device of its first tensor argument. The implementations choose their
    own precision (GEMM operands in the inputs' dtype, fp32 accumulation and records); an autocast region around a
    call would otherwise reach their torch GEMMs (the torch backend's, the cuBLAS products) and round fp32 operands
    to its dtype, silently less exact."""

    @functools.wraps(fn)
    def run(*args):
        device = next((x.device.type for x in args if isinstance(x, torch.Tensor)), None)
        if device is None or not torch.is_autocast_enabled(device):
            return fn(*args)
        with torch.autocast(device, enabled=False):
            return fn(*args)

    return run


def custom_op(name: str, impl, schema: str):
    """``impl`` as the custom op ``grpo_fast::<name>`` of ``schema``, mutating none of its arguments, run without
    autocast."""
    return torch.library.custom_op(f"grpo_fast::{name}", without_autocast(impl), mutates_args=(), schema=schema)


def inline_function(impl, setup_context, backward):
    """The op's implementation and autograd formula as a torch.autograd.Function, for ``runs_inline``; both run
    without autocast, as the op's."""

    def forward(ctx, *args):
        output = without_autocast(impl)(*args)
        setup_context(ctx, args, output)
        return output

    def backward_without_autocast(ctx, *grads):
        return without_autocast(backward)(ctx, *grads)

    return type(
        f"Inline_{impl.__name__.strip('_')}",
        (torch.autograd.Function,),
        {"forward": staticmethod(forward), "backward": staticmethod(backward_without_autocast)},
    )


def scaled_gradient(grad, scale, dtype, rows=8192):
    """``grad`` (fp32, formed in a forward) times the loss's gradient ``scale`` (a scalar tensor), in ``dtype``: a
    slab of rows at a time, so that the fp32 product never exists whole beside ``grad`` (one product when compiled:
    a loop over a dynamic size would specialise the graph on it, and the compiler fuses the product and the cast)."""
    if torch.compiler.is_compiling():
        return (grad * scale).to(dtype)
    out = torch.empty(grad.shape, dtype=dtype, device=grad.device)
    for r0 in range(0, grad.shape[0], rows):
        out[r0 : r0 + rows] = grad[r0 : r0 + rows] * scale
    return out


def runs_inline(args):
    """Run the implementation in Python rather than as the op: a TorchDispatchMode over real tensors (a FLOP or
    allocation counter, a host-sync counter) then sees the kernels' own torch ops, which an op's caller never
    sees (a mode is not active inside the op it intercepts). torch.compile, FakeTensorMode and meta tensors
    always get the op (one node; the fake implementation)."""
    from torch._subclasses.fake_tensor import FakeTensorMode, is_fake
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    if torch.compiler.is_compiling():
        return False
    tensors = [x for x in args if isinstance(x, torch.Tensor)]
    if any(x.device.type == "meta" or is_fake(x) for x in tensors):
        return False
    modes = _get_current_dispatch_mode_stack()
    return bool(modes) and not any(isinstance(mode, FakeTensorMode) for mode in modes)
