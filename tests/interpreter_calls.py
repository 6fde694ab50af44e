"""Triton's interpreter (TRITON_INTERPRET=1), made cheaper where it repeats work: a call of one ``@triton.jit``
function from another (``_top_four`` combining a reduction's pairs, the kernels' helpers) re-patches triton.language
for the callee on every call (``interpreter._patch_lang``: ``inspect.getmembers`` over ``tl``, ``tl.tensor``,
``tl.math``: milliseconds a call), although the launch that runs it has already patched those very modules and
keeps them patched until it ends. One sampler call of tests/test_batch_invariance.py made 40 000 of them: 110 s of its
152 s under cProfile.

``install()`` skips a device call's patch when every language module the callee sees is one its launch already
patched; the kernels run the same code on the same numpy values, so every number a test asserts is unchanged. A
callee that sees a module its launch did not patch (``tl.core`` under another name) is patched as before. Imported by
conftest (this session) and helpers (the ranks ``spawn_ranks`` starts import it from their test module).
"""

import inspect
import os

_MODULES = {}  # a function's language modules (its module's imports: fixed once imported)


def _language_modules(fn, tl):
    if fn not in _MODULES:
        _MODULES[fn] = frozenset(id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core))
    return _MODULES[fn]


def install():
    """Under the interpreter: ``interpreter._patch_lang`` once a launch for the modules it patches (above)."""
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
            return interpreter._LangPatchScope()  # a device call: nothing to patch, nothing to restore
        scope = patch_lang(fn)  # the launch's own patch, or a device call that sees another module: as Triton does
        if launches:
            launches[-1] = seen if launches[-1] is None else launches[-1] | seen
        return scope

    run = executor.__call__
    once_a_launch.once_a_launch = True
    executor.__call__ = launch
    interpreter._patch_lang = once_a_launch
