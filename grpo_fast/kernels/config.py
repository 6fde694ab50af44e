"""What the linear log-probs kernels share: the logit transform, and the launch configuration (blocks, warps, dots)."""

import os
from dataclasses import dataclass

import torch


def interpreting() -> bool:
    """True when Triton runs its CPU interpreter (TRITON_INTERPRET=1), as the CI tests do."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@dataclass(frozen=True)
class LogitTransform:
    """z = softcap * tanh(logit_scale * (h . W + b) / softcap) / temperature, TRL 1.16's order (no tanh: softcap None).

    Gemma 2 / 3 soft-cap their logits (config.final_logit_softcapping); Cohere, Granite, Falcon-H1 and others scale
    them (logit_scale, 1 / logits_scaling, lm_head_multiplier, ...).
    """

    temperature: float = 1.0
    softcap: "float | None" = None
    logit_scale: float = 1.0

    def apply(self, u):
        """z from raw fp32 logits u = h . W + b, in torch (the kernels' tile functions compute the same in-tile)."""
        z = u * self.logit_scale
        if self.softcap is not None:
            z = self.softcap * torch.tanh(z / self.softcap)
        return z / self.temperature

    def kernel_scalars(self):
        """(inv_temperature, logit_scale, softcap) as the kernels take them (softcap 1.0 when unused)."""
        return 1.0 / self.temperature, float(self.logit_scale), float(self.softcap or 1.0)


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
# a frozen lm_head: "jacobian" builds d logp / d hidden in the forward (two vocabulary sweeps, the default),
# "recompute" takes the general path (three), for comparison (the benchmark's grpo_fast_frozen_recompute)
FROZEN_MODES = ("jacobian", "recompute")


def bwd_mode() -> str:
    mode = os.environ.get("GRPO_FAST_BWD", "chunked")
    if mode not in BWD_MODES:
        raise ValueError(f"GRPO_FAST_BWD must be one of {BWD_MODES}, got {mode!r}")
    return mode


def frozen_mode() -> str:
    mode = os.environ.get("GRPO_FAST_FROZEN", "jacobian")
    if mode not in FROZEN_MODES:
        raise ValueError(f"GRPO_FAST_FROZEN must be one of {FROZEN_MODES}, got {mode!r}")
    return mode


def gpu_launch_config(fwd: bool, dtype: torch.dtype, sm_count: int, smem_per_block: int,
                      mode: "str | None" = None, wide_epilogue: bool = False) -> LaunchConfig:
    """The compiled-GPU configuration for a device with sm_count SMs and smem_per_block bytes of shared memory.

    ``wide_epilogue``: the backward's tile gradient also has a soft-cap slope or an entropy term (more live values
    per logit). Chosen without a GPU by compiling every kernel for sm_90 / sm_89 / sm_80 (tests/sm_compile.py, run
    in CI): each choice fits the card's shared memory and spills no registers. Speed is not tuned yet: bench/ does
    that.
    """
    mode = mode or bwd_mode()
    big_smem = smem_per_block >= 160 * 1024  # A100 / H100 class; an RTX 4090 has 99 KiB per block
    if dtype == torch.float32:
        # IEEE fp32 products run on the FMA units, not the tensor cores: short K steps keep registers in bounds
        block_n, block_v, block_d, warps, stages = (32, 64, 16, 4, 2) if (not fwd and mode == "fused") \
            else (64, 64, 32, 4, 2)
    elif fwd:
        block_n, block_v, block_d, warps, stages = 64, 128, 64, 8, 3
    elif mode == "chunked":
        # a 128 x 128 tile with the soft-cap slope and the entropy term needs all 255 registers and spills on sm_8x
        block_n, block_v, block_d, warps, stages = (128, 64, 64, 8, 3) if wide_epilogue else (128, 128, 64, 8, 3)
    else:
        # the fused backward also stages W and H tiles for its two gradient products
        block_n, block_v, block_d, warps, stages = 64, 128, 32, 8, 3 if big_smem else 2
    return LaunchConfig(block_n, block_v, block_d, warps, stages, False, 2 * sm_count, mode)


def launch_config(device: torch.device, fwd: bool, dtype: torch.dtype = torch.bfloat16,
                  wide_epilogue: bool = False) -> LaunchConfig:
    if interpreting() or device.type != "cuda":
        # small blocks keep the interpreter's numpy tiles cheap; shapes in tests are not block multiples
        return LaunchConfig(16, 32, 16, 4, 1, True, 8, bwd_mode())
    props = torch.cuda.get_device_properties(device)
    # shared_memory_per_block_optin: the most one block may ask for (227 KiB on H100, 99 KiB on an RTX 4090)
    smem = getattr(props, "shared_memory_per_block_optin", 0) or 101376
    return gpu_launch_config(fwd, dtype, props.multi_processor_count, smem, wide_epilogue=wide_epilogue)


def frozen_launch_config(device: torch.device) -> LaunchConfig:
    """The frozen-head forward's tile kernel (kernels/forward_frozen.py): no dot, two elementwise passes over a
    [<= D tokens, vocab chunk] fp32 buffer between two cuBLAS GEMMs. Few rows per program, so that one token chunk
    fills the GPU (1536 rows / 2 = 768 programs). ``dot_fp32``: the GEMMs run on fp32 operands (the interpreter, a
    CPU device); block_d, target_programs and bwd_mode are unused. Compiled for sm_90 / 89 / 80 without spills."""
    if interpreting() or device.type != "cuda":
        return LaunchConfig(16, 32, 16, 4, 1, True, 8)
    return gpu_frozen_launch_config()


def gpu_frozen_launch_config() -> LaunchConfig:
    """The compiled-GPU configuration of the frozen-head forward's tile kernel (the same for every card and dtype)."""
    return LaunchConfig(2, 512, 16, 4, 1, False, 0)
