"""Triton's interpreter (TRITON_INTERPRET=1), made cheaper where it repeats work: a call of one ``@triton.jit``
function from another (``_top_four`` combining a reduction's pairs, the kernels' helpers) re-patches triton.language
for the callee on every call (``interpreter._patch_lang``: ``inspect.getmembers`` over ``tl``, ``tl.tensor``,
``tl.math``: milliseconds a call), although the launch that runs it has already patched those very modules and
keeps them patched until it ends. One sampler call of tests/test_batch_invariance.py made 40 000 of them: 110 s of its
152 s under cProfile.

``install()`` skips a nested call's patch when every language module the callee sees is one its launch already
patched; the kernels run the same code on the same numpy values, so every number a test asserts is unchanged. A
callee that sees a module its launch did not patch (``tl.core`` under another name) is patched as before. Imported by
conftest (this session) and helpers (the ranks ``spawn_ranks`` starts import it from their test module).

And a reduction with a combine of its own (``tl.reduce``: the tile candidates' ``_top_four``; ``tl.topk``'s bitonic
network reduces with an xor combine, in the rows' sweeps of ``kernels.kept_rows``) runs through ``reduce_by_position``,
one combine a position along the axis on whole slices, in place of the interpreter's one combine a scalar element: as
``grpo_fast.kernels.launch.scan_by_position`` does for scans, and for the same reason (a combine is elementwise, so
the values are the same; a [16, 32] tile: 31 calls, not 512). The rows' sweep of 4 rows of 300 logits with 64
candidates took 40 s through Triton's.
"""

import inspect
import os

import numpy as np

TRITON_GENERIC_REDUCE = None  # Triton's own, once installed: for the test that compares the two
_MODULES = {}  # a function's language modules (its module's imports: fixed once imported)


def _language_modules(fn, tl):
    if fn not in _MODULES:
        _MODULES[fn] = frozenset(id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core))
    return _MODULES[fn]


def reduce_by_position(reduce, inputs, triton_reduce):
    """Triton's interpreter's reduction with a combine of its own (``ReduceOps.generic_reduce``: ``reduce`` the
    ReduceOps, ``inputs`` its tensors): the combine called once a position along ``reduce.axis`` on the slices across
    it, the running values kept in the inputs' dtypes between calls as Triton's keeps them. A reduction to a scalar
    (no axis, or a 1-d input: one combine a position either way) is Triton's own, ``triton_reduce``."""
    axis = reduce.axis
    if axis is None or inputs[0].handle.data.ndim < 2:
        return triton_reduce(reduce, inputs)
    data = [np.moveaxis(arg.handle.data, axis, 0) for arg in inputs]
    shape = data[0].shape[1:]

    def kept(values, d, arg):  # a combine's result as Triton stores it: the input's dtype, the output's shape
        values = np.asarray(values.handle.data if hasattr(values, "handle") else values)
        values = values.reshape(shape) if values.size == np.prod(shape) else np.broadcast_to(values, shape)
        return reduce.to_tensor(values.astype(d.dtype), arg.dtype)

    acc = tuple(kept(d[0], d, arg) for d, arg in zip(data, inputs))
    for i in range(1, data[0].shape[0]):
        slices = tuple(reduce.to_tensor(np.ascontiguousarray(d[i]), arg.dtype) for d, arg in zip(data, inputs))
        combined = reduce.combine_fn.fn(*acc, *slices)
        combined = combined if isinstance(combined, tuple) else (combined,)
        acc = tuple(kept(c, d, arg) for c, d, arg in zip(combined, data, inputs))
    if reduce.keep_dims:
        return [reduce.to_tensor(np.expand_dims(a.handle.data, axis), arg.dtype) for a, arg in zip(acc, inputs)]
    return list(acc)


def install():
    """Under the interpreter: ``interpreter._patch_lang`` once a launch for the modules it patches, and reductions
    with a combine of their own by ``reduce_by_position`` (above)."""
    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        return
    import triton.language as tl
    from triton.runtime import interpreter

    patch_lang = getattr(interpreter, "_patch_lang", None)
    executor = getattr(interpreter, "GridExecutor", None)
    if patch_lang is None or executor is None or getattr(patch_lang, "once_a_launch", False):
        return  # another Triton's interpreter (not the step this skips), or installed already
    launches = []  # a launch in progress: the modules it patched (None until its own patch, before its grid runs)

    def launch(self, *args, **kwargs):
        launches.append(None)
        try:
            return run(self, *args, **kwargs)
        finally:
            launches.pop()  # after the launch restored the modules

    def once_a_launch(fn):
        seen = _language_modules(fn, tl)
        if launches and launches[-1] is not None and seen <= launches[-1]:
            return interpreter._LangPatchScope()  # a nested call: nothing to patch, nothing to restore
        scope = patch_lang(fn)  # the launch's own patch, or a nested call that sees another module: as Triton does
        if launches:
            launches[-1] = seen if launches[-1] is None else launches[-1] | seen
        return scope

    run = executor.__call__
    once_a_launch.once_a_launch = True
    executor.__call__ = launch
    interpreter._patch_lang = once_a_launch
    global TRITON_GENERIC_REDUCE
    TRITON_GENERIC_REDUCE = triton_reduce = interpreter.ReduceOps.generic_reduce
    interpreter.ReduceOps.generic_reduce = lambda reduce, inputs: reduce_by_position(reduce, inputs, triton_reduce)
