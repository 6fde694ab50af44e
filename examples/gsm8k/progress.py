"""Progress that suits where it goes: a redrawn tqdm bar on a terminal, one line per phase anywhere else.

    for i in bar(range(0, B, mb), desc="step 1: forward / backward", unit="micro-batch"):
        ...                          # a terminal: a tqdm bar; a file or a pipe: "step 1: forward / backward: 4/4
                                     # micro-batch in 31 s" when the phase ends
    with library_bars_off():         # off a terminal: transformers' own bars (GGUF dequantization, weight loading)
        model = load(...)            # stay quiet too

A bar redraws its line many times a second with carriage returns: on a terminal that is one line that moves, in a
log file it is hundreds of lines (a CPU run of the demo wrote 900 to stderr). ``bar`` decides once per phase, from
whether its stream (stderr unless ``file``) is a terminal.
"""

from __future__ import annotations

import contextlib
import sys
import time

__all__ = ["on_terminal", "bar", "PhaseLine", "library_bars_off", "duration"]


def on_terminal(file=None) -> bool:
    """Whether ``file`` (default: stderr, where bars go) is a terminal."""
    stream = sys.stderr if file is None else file
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


def duration(seconds: float) -> str:
    """``seconds`` in words: "48 s", "5 min 37 s", "1 h 02 min"."""
    seconds = max(0, round(seconds))
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60:02d} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60:02d} min"


def bar(iterable=None, *, desc, total=None, unit="it", initial=0, leave=False, file=None, **tqdm_kwargs):
    """A tqdm bar where ``file`` (stderr) is a terminal, else a ``PhaseLine``: the same calls, one line at the end."""
    if on_terminal(file):
        from tqdm.auto import tqdm

        return tqdm(
            iterable,
            desc=desc,
            total=total,
            unit=unit,
            initial=initial,
            leave=leave,
            dynamic_ncols=True,
            file=file,
            **tqdm_kwargs,
        )
    return PhaseLine(iterable, desc=desc, total=total, unit=unit, initial=initial, file=file)


class PhaseLine:
    """A tqdm bar's interface that draws nothing while the phase runs and writes one line when it ends (``close``,
    or the end of the iteration): ``"<desc>: <n>/<total> <unit> in <time>[, <postfix>]"``."""

    def __init__(self, iterable=None, *, desc, total=None, unit="it", initial=0, file=None):
        self.iterable, self.desc, self.unit, self.file = iterable, desc, unit, file
        if total is None and iterable is not None and hasattr(iterable, "__len__"):
            total = initial + len(iterable)
        self.total, self.n, self.initial = total, initial, initial
        self.postfix, self.closed = "", False
        self.start = time.perf_counter()

    def __iter__(self):
        try:
            for item in self.iterable:
                yield item
                self.n += 1
        finally:
            self.close()

    def update(self, n=1):
        self.n += n

    def set_postfix(self, ordered_dict=None, refresh=True, **kwargs):
        items = {**(ordered_dict or {}), **kwargs}
        self.postfix = ", ".join(f"{key}={value}" for key, value in items.items())

    def set_postfix_str(self, s="", refresh=True):
        self.postfix = str(s)

    def set_description_str(self, desc=None, refresh=True):
        self.desc = desc or ""

    def refresh(self):
        pass

    @staticmethod
    def write(s, file=None):
        print(s, file=sys.stdout if file is None else file, flush=True)

    def close(self):
        if self.closed:
            return
        self.closed = True
        done = f"{self.n - self.initial}" if self.total is None else f"{self.n}/{self.total}"
        line = f"{self.desc}: {done} {self.unit} in {duration(time.perf_counter() - self.start)}"
        print(line + (f", {self.postfix}" if self.postfix else ""), file=self.file or sys.stderr, flush=True)


@contextlib.contextmanager
def library_bars_off(file=None):
    """Off a terminal, no progress bar of transformers (its weight loading's, its GGUF dequantization's) while the
    block runs; on one, nothing changes. The switch is put back as it was after the block."""
    if on_terminal(file):
        yield
        return
    from transformers.utils import logging as hf_logging

    gguf_module = sys.modules.get("transformers.modeling_gguf_pytorch_utils")
    if gguf_module is None:
        with contextlib.suppress(ImportError):
            import transformers.modeling_gguf_pytorch_utils as gguf_module
    # the GGUF reader calls tqdm.auto.tqdm itself, not transformers' switchable one: swap its name for the block
    gguf_tqdm = getattr(gguf_module, "tqdm", None)
    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    if gguf_tqdm is not None:
        gguf_module.tqdm = _silent_tqdm(gguf_tqdm)
    try:
        yield
    finally:
        if gguf_tqdm is not None:
            gguf_module.tqdm = gguf_tqdm
        if was_enabled:
            hf_logging.enable_progress_bar()


def _silent_tqdm(tqdm_class):
    def silent(*args, **kwargs):
        return tqdm_class(*args, **{**kwargs, "disable": True})

    return silent
