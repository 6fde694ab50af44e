"""The one resolver: a public ``backend=`` choice, or the name a custom op's schema carries, as the backend object
(``protocol.Backend``). Nowhere else is a backend's name compared."""

from __future__ import annotations

import torch

from grpo_fast.backends.protocol import BACKEND_NAMES, Backend
from grpo_fast.backends.torch_backend import TorchBackend
from grpo_fast.backends.triton_backend import TritonBackend

TRITON, TORCH = TritonBackend(), TorchBackend()
BACKENDS: dict[str, Backend] = {backend.name: backend for backend in (TRITON, TORCH)}


def resolve_backend(backend: str, device: torch.device) -> Backend:
    """The public ``backend=`` string as the backend object, for tensors on ``device``: "auto" takes the Triton
    backend where it runs (CUDA tensors, or any under TRITON_INTERPRET=1), else the torch backend.

    Raises:
        ValueError: an unknown name, or "triton" where it cannot run.
    """
    if backend not in BACKEND_NAMES:
        raise ValueError(f"backend must be one of {BACKEND_NAMES}, got {backend!r}")
    if backend == "auto":
        return TRITON if TRITON.runs_on(device) else TORCH
    chosen = BACKENDS[backend]
    if not chosen.runs_on(device):
        raise ValueError("backend='triton' needs CUDA tensors, or TRITON_INTERPRET=1 set before importing grpo_fast")
    return chosen


def named(backend: str | Backend) -> Backend:
    """The backend object of a resolved backend's name (what a custom op's schema carries), or the object itself."""
    return BACKENDS[backend] if isinstance(backend, str) else backend
