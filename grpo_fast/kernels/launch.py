"""The device every kernel wrapper runs on: its first tensor argument's.

Triton launches on the current CUDA device, not on its arguments' device, and nothing else in grpo_fast sets it: a
head on cuda:1 (``device_map="auto"`` over two GPUs puts lm_head on the last one) launched while cuda:0 is current
crashes or reads the wrong memory. Each kernel wrapper (forward, both backwards, the frozen-head forward, the token
loss) runs under ``on_device(its first tensor)``, its Triton launches and the cuBLAS calls and buffers around them
alike; the API checks before that that all tensors share one device (grpo_fast.api._same_device).
"""

import contextlib
import functools

import torch


def on_device(tensor):
    """``torch.cuda.device(tensor.device)`` for a CUDA tensor, a null context for any other."""
    return torch.cuda.device(tensor.device) if tensor.device.type == "cuda" else contextlib.nullcontext()


def on_first_argument_device(wrapper):
    """Decorator: run ``wrapper`` (its first argument a tensor) ``on_device`` of that tensor."""

    @functools.wraps(wrapper)
    def run(first, *args, **kwargs):
        with on_device(first):
            return wrapper(first, *args, **kwargs)

    return run
