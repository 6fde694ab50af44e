"""What the linear log-probs kernels share: the caller's choices (head path, backward mode),
and one launch-configuration type per kernel family (forward, backward, frozen-head tile kernel).

The GPU configurations are chosen without a GPU by compiling every kernel variant for sm_90 / sm_89 / sm_80 with
tools/sm_compile.py (run in CI through tests/test_sm_compile.py): each fits the card's shared memory and spills no
registers; the CTAs per SM they allow size the forward's waves (FORWARD_CTAS_PER_SM). Speed is not tuned yet:
bench/ does that.
"""

import os
from dataclasses import dataclass

import torch

# the layer-1 path: "auto" takes the frozen-head path (J = d logp / d hidden built in the forward, two vocabulary
# sweeps) when only ``hidden`` needs a gradient; "general" always takes the recompute path (three sweeps with a
# frozen weight: the benchmark's comparison row, and callers whose entropy will be differentiated)
HEAD_PATHS = ("auto", "general")
# the Triton backward: "chunked" (a Triton kernel writes g per token chunk, cuBLAS does the two gradient GEMMs) or
# "fused" (one kernel, fp32 atomics, no g buffer); the torch backend has only "chunked"
BACKWARD_MODES = ("chunked", "fused")


def interpreting() -> bool:
    """True when Triton runs its CPU interpreter (TRITON_INTERPRET=1), as the CI tests do."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _dot_precision(dtype, dot_fp32):
    # fp32 inputs get IEEE fp32 products (tl.dot defaults to TF32 on GPUs); bf16/fp16 are exact products.
    return "ieee" if (dtype == torch.float32 or dot_fp32) else "tf32"


@dataclass(frozen=True, kw_only=True)
class _DotTileConfig:
    """The launch of a kernel that builds BLOCK_N x BLOCK_V logit tiles in K steps of BLOCK_D. ``dot_fp32``: upcast
    the dot operands (the interpreter's bf16 tl.dot is wrong in triton 3.9)."""

    block_n: int
    block_v: int
    block_d: int
    num_warps: int
    num_stages: int
    dot_fp32: bool

    def dot_precision(self, dtype):
        return _dot_precision(dtype, self.dot_fp32)

    def lora_block(self, rank):
        """BLOCK_R, the K step over a LoRA rank: a power of two, at least 16 (tl.dot's least K), at most BLOCK_D
        (the K-loop's tiles and registers are then no larger than the D loop's)."""
        return min(self.block_d, max(16, 1 << (rank - 1).bit_length()))


@dataclass(frozen=True, kw_only=True)
class ForwardConfig(_DotTileConfig):
    """kernels/forward.py's launch: logit tiles; the vocabulary is split so that the programs fill whole waves of
    ``target_programs``, the programs the GPU holds at once (forward.num_vocab_splits)."""

    target_programs: int


@dataclass(frozen=True, kw_only=True)
class BackwardConfig(_DotTileConfig):
    """kernels/backward.py's launch (either mode): gradient tiles; the fused mode with dW runs in groups of
    ``group_v`` vocabulary tiles (each group walks every token block before the next group starts)."""

    group_v: int


@dataclass(frozen=True, kw_only=True)
class FrozenHeadConfig:
    """kernels/forward_frozen.py's tile kernel (no dot: BLOCK_N rows x BLOCK_V columns of the u buffer a step);
    ``gemm_fp32``: its two cuBLAS GEMMs run on fp32 operands (the interpreter, a CPU device)."""

    block_n: int
    block_v: int
    num_warps: int
    num_stages: int
    gemm_fp32: bool


# What the Triton kernels can index: a CUDA grid's second axis holds at most 65535 blocks, and the backward's grid is
# (token blocks, vocabulary tiles) with vocabulary tiles at least 64 wide; row indices are 32-bit (their products
# with strides are 64-bit). grpo_fast.api checks both before a launch.
MAX_GRID_AXIS_1 = 65535
MAX_VOCAB = MAX_GRID_AXIS_1 * 64
MAX_ROWS = 2**31 - 1


def _compiled(device) -> bool:
    return not interpreting() and device.type == "cuda"


# the interpreter (and a CPU device): small blocks keep its numpy tiles cheap; shapes in tests are not block multiples
_INTERPRETER_TILES = dict(block_n=16, block_v=32, block_d=16, num_warps=4, num_stages=1, dot_fp32=True)


# The CTAs per SM the compiled forward kernel's registers, shared memory and warps allow, per (arch, dtype): the
# fewest over its constexpr variants. Data produced by ``TRITON_INTERPRET=0 python tools/sm_compile.py --table``;
# tests/test_sm_compile.py checks that it matches what compiles. Another arch counts one CTA per SM.
FORWARD_CTAS_PER_SM = {
    (80, "bf16"): 1,
    (80, "fp16"): 1,
    (80, "fp32"): 2,
    (89, "bf16"): 1,
    (89, "fp16"): 1,
    (89, "fp32"): 2,
    (90, "bf16"): 1,
    (90, "fp16"): 1,
    (90, "fp32"): 2,
}
DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def gpu_forward_config(dtype: torch.dtype, sm_count: int, arch: int) -> ForwardConfig:
    """The compiled forward's configuration on a device of compute capability ``arch`` (90: sm_90) with
    ``sm_count`` SMs: one wave is FORWARD_CTAS_PER_SM programs per SM."""
    if dtype == torch.float32:
        # IEEE fp32 products run on the FMA units, not the tensor cores: short K steps keep registers in bounds
        tiles = dict(block_n=64, block_v=64, block_d=32, num_warps=4, num_stages=2)
    else:
        tiles = dict(block_n=64, block_v=128, block_d=64, num_warps=8, num_stages=3)
    wave = FORWARD_CTAS_PER_SM.get((arch, DTYPE_NAMES[dtype]), 1) * sm_count
    return ForwardConfig(**tiles, dot_fp32=False, target_programs=wave)


def gpu_backward_config(
    dtype: torch.dtype, mode: str, smem_per_block: int, wide_epilogue: bool = False
) -> BackwardConfig:
    """The compiled backward's configuration for ``mode`` (BACKWARD_MODES) on a device with ``smem_per_block`` bytes
    of shared memory per block. ``wide_epilogue``: the tile gradient also has a soft-cap slope or an entropy term
    (more live values per logit)."""
    big_smem = smem_per_block >= 160 * 1024  # A100 / H100 class; an RTX 4090 has 99 KiB per block
    if dtype == torch.float32:
        tiles = (
            dict(block_n=32, block_v=64, block_d=16, num_warps=4, num_stages=2)
            if mode == "fused"
            else dict(block_n=64, block_v=64, block_d=32, num_warps=4, num_stages=2)
        )
    elif mode == "chunked":
        # a 128 x 128 tile with the soft-cap slope and the entropy term needs all 255 registers and spills on sm_8x
        tiles = dict(block_n=128, block_v=64 if wide_epilogue else 128, block_d=64, num_warps=8, num_stages=3)
    else:
        # the fused backward also stages W and H tiles for its two gradient products
        tiles = dict(block_n=64, block_v=128, block_d=32, num_warps=8, num_stages=3 if big_smem else 2)
    # 8 vocabulary tiles a group: the resident programs (1 or 2 per SM: sm_compile) spread over 8 vocabulary tiles
    # x 17 to 33 token blocks, so each dW row block takes ~1/8 of the concurrent atomic adds, each dH one a few
    return BackwardConfig(**tiles, dot_fp32=False, group_v=8)


def gpu_frozen_head_config() -> FrozenHeadConfig:
    """The compiled frozen-head tile kernel's configuration (the same for every card and dtype): few rows per
    program, so that one token chunk fills the GPU (1536 rows / 2 = 768 programs)."""
    return FrozenHeadConfig(block_n=2, block_v=512, num_warps=4, num_stages=1, gemm_fp32=False)


def _device_props(device):
    """(SM count, shared memory per block, arch as 10 major + minor) of a CUDA device."""
    props = torch.cuda.get_device_properties(device)
    # shared_memory_per_block_optin: the most one block may ask for (227 KiB on H100, 99 KiB on an RTX 4090)
    return (
        props.multi_processor_count,
        getattr(props, "shared_memory_per_block_optin", 0) or 101376,
        10 * props.major + props.minor,
    )


def forward_config(device: torch.device, dtype: torch.dtype) -> ForwardConfig:
    if not _compiled(device):
        return ForwardConfig(**_INTERPRETER_TILES, target_programs=8)
    sm_count, _, arch = _device_props(device)
    return gpu_forward_config(dtype, sm_count, arch)


def backward_config(device: torch.device, dtype: torch.dtype, mode: str, wide_epilogue: bool = False) -> BackwardConfig:
    if not _compiled(device):
        # groups of 2 vocabulary tiles: the tests' shapes have partial groups
        return BackwardConfig(**_INTERPRETER_TILES, group_v=2)
    return gpu_backward_config(dtype, mode, _device_props(device)[1], wide_epilogue)


def frozen_head_config(device: torch.device) -> FrozenHeadConfig:
    if not _compiled(device):
        return FrozenHeadConfig(block_n=16, block_v=32, num_warps=4, num_stages=1, gemm_fp32=True)
    return gpu_frozen_head_config()
