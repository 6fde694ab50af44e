"""Launch configuration shared by the linear log-probs kernels (block sizes, warps, dot precision)."""

import os
from dataclasses import dataclass

import torch


def interpreting() -> bool:
    """True when Triton runs its CPU interpreter (TRITON_INTERPRET=1), as the CI tests do."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@dataclass(frozen=True)
class LaunchConfig:
    block_n: int
    block_v: int
    block_d: int
    num_warps: int
    num_stages: int
    dot_fp32: bool          # upcast dot operands to fp32 (the interpreter's bf16 tl.dot is wrong)
    target_programs: int    # forward: split the vocab until about this many programs run
    bwd_mode: str = "chunked"  # backward: "chunked" (Triton g + cuBLAS GEMMs) or "fused" (one kernel, atomics)

    def dot_precision(self, dtype):
        # fp32 inputs get IEEE fp32 products (tl.dot defaults to TF32 on GPUs); bf16/fp16 are exact products.
        return "ieee" if (dtype == torch.float32 or self.dot_fp32) else "tf32"


BWD_MODES = ("chunked", "fused")


def bwd_mode() -> str:
    mode = os.environ.get("GRPO_FAST_BWD", "chunked")
    if mode not in BWD_MODES:
        raise ValueError(f"GRPO_FAST_BWD must be one of {BWD_MODES}, got {mode!r}")
    return mode


def launch_config(device: torch.device, fwd: bool) -> LaunchConfig:
    if interpreting() or device.type != "cuda":
        # small blocks keep the interpreter's numpy tiles cheap; shapes in tests are not block multiples
        return LaunchConfig(16, 32, 16, 4, 1, True, 8, bwd_mode())
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    # untuned first guesses for Hopper (no GPU was available when these were written): tune with bench/
    return LaunchConfig(64 if fwd else 128, 128, 64, 8 if fwd else 4, 3, False, 2 * sms, bwd_mode())
