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

    def dot_precision(self, dtype):
        # fp32 inputs get IEEE fp32 products (tl.dot defaults to TF32 on GPUs); bf16/fp16 are exact products.
        return "ieee" if (dtype == torch.float32 or self.dot_fp32) else "tf32"


def launch_config(device: torch.device, fwd: bool) -> LaunchConfig:
    if interpreting() or device.type != "cuda":
        # small blocks keep the interpreter's numpy tiles cheap; shapes in tests are not block multiples
        return LaunchConfig(16, 32, 16, 4, 1, True, 8)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    if fwd:
        return LaunchConfig(128, 128, 64, 8, 3, False, 2 * sms)
    return LaunchConfig(128, 128, 64, 8, 3, False, 2 * sms)
