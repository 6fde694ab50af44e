"""What the linear log-probs kernels share: the caller's choices (head path, backward mode), one
launch-configuration type per kernel family, the configurations per GPU architecture, and the sizes the kernels can
index.

Each GPU configuration compiles for its architecture within the card's shared memory (the sm_compile tool checks
every variant for sm_90 / sm_89 / sm_80 in CI); the sm_90 tiles of the forward and of the chunked backward are the
fastest measured on an H200 (the timings are in the documentation's "How it works"), the others are argued from the
compiled code.
"""

import os
from dataclasses import dataclass
from typing import Literal, get_args

import torch
import triton

# the layer-1 path: "auto" takes the frozen-head path (J = d logp / d hidden built in the forward, two vocabulary
# sweeps) when only ``hidden`` needs a gradient; "general" always takes the recompute path (three sweeps with a
# frozen weight: the benchmark's comparison row, and callers whose entropy will be differentiated)
HeadPath = Literal["auto", "general"]
HEAD_PATHS = get_args(HeadPath)
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
class TileRecordConfig(_DotTileConfig):
    """The layer-1 forward's launch (``kernels.forward``): one program per token block and patch of ``tiles``
    vocabulary tiles, in groups of ``group_n`` token blocks; ``use_tma``: H and W tiles through tensor descriptors
    (sm_90 and later), where the tensors allow it."""

    tiles: int
    group_n: int
    use_tma: bool


@dataclass(frozen=True, kw_only=True)
class ForwardConfig(_DotTileConfig):
    """The divergence head's record sweep (``kernels.divergence``): logit tiles; the vocabulary is split so that the
    programs fill whole waves of ``target_programs``, the programs the GPU holds at once
    (``divergence.num_vocab_splits``); ``use_tma``: H and W tiles through tensor descriptors (sm_90 and later), where
    the tensors allow it."""

    target_programs: int
    use_tma: bool = False


@dataclass(frozen=True, kw_only=True)
class BackwardConfig(_DotTileConfig):
    """``kernels.backward``'s launch (either mode): gradient tiles; the fused mode with dW runs in groups of
    ``group_v`` vocabulary tiles (each group walks every token block before the next group starts); ``use_tma``:
    the chunked mode reads H and W tiles through tensor descriptors (sm_90 and later)."""

    group_v: int
    use_tma: bool = False


@dataclass(frozen=True, kw_only=True)
class FrozenHeadConfig:
    """``kernels.forward_frozen``'s tile kernel (no dot: BLOCK_N rows x BLOCK_V columns of the u buffer a step);
    ``gemm_fp32``: its two cuBLAS GEMMs run on fp32 operands (the interpreter, a CPU device)."""

    block_n: int
    block_v: int
    num_warps: int
    num_stages: int
    gemm_fp32: bool


# What the Triton kernels can index: a CUDA grid's second axis holds at most 65535 blocks, and the backward's grid is
# (token blocks, vocabulary tiles) with vocabulary tiles at least 64 wide; row indices are 32-bit (their products
# with strides are 64-bit). The Triton backend checks both before a launch (its check_sizes).
MAX_GRID_AXIS_1 = 65535
MAX_VOCAB = MAX_GRID_AXIS_1 * 64
MAX_ROWS = 2**31 - 1


def _compiled(device) -> bool:
    return not interpreting() and device.type == "cuda"


# the interpreter (and a CPU device): small blocks keep its numpy tiles cheap; shapes in tests are not block multiples
_INTERPRETER_TILES = dict(block_n=16, block_v=32, block_d=16, num_warps=4, num_stages=1, dot_fp32=True)


DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
# the input dtypes every kernel takes (the API checks them)
FLOAT_DTYPES = tuple(DTYPE_NAMES)

# The forward's tiles per architecture (bf16 / fp16; fp32 takes FP32_TILES everywhere). sm_90: 128 x 256 x 64 tiles on
# 8 warps (two warpgroups, each a 64 x 256 wgmma), 3 stages, the copy engine: 14.0-14.3 ms for Qwen2.5-1.5B's head
# at 16k tokens on an H200, 1.2x cuBLAS's bare product, where 128 x 128 took 18.8 and 256 x 128 14.7. sm_80 (A100,
# 163 KiB of shared memory a block): 128 x 128 through pointers (mma.sync; 128 x 256 spills 24 bytes there, and
# nothing has measured it). sm_89 (RTX 4090, 99 KiB): a 128 x 128 tile, 4 stages of 64-wide K steps (64 KiB): one CTA
# an SM (240 registers a thread), so the pipeline's depth is what hides the loads' latency.
RECORD_TILES = {
    90: dict(block_n=128, block_v=256, block_d=64, num_warps=8, num_stages=3, use_tma=True),
    80: dict(block_n=128, block_v=128, block_d=64, num_warps=8, num_stages=3, use_tma=False),
    89: dict(block_n=128, block_v=128, block_d=64, num_warps=8, num_stages=4, use_tma=False),
}
# a soft-cap's tanh and slope, LoRA's second K loop or a bias keep more values alive per logit: a 256-column tile then
# spills (hundreds of bytes on sm_80 and sm_90 for the first two, 40 for a bias), so these variants take 128 columns
WIDE_EPILOGUE_BLOCK_V = 128


def wide_record_epilogue(has_softcap: bool, has_bias: bool, has_lora: bool) -> bool:
    """Whether the forward's epilogue is a wide one (``gpu_record_config``'s ``wide_epilogue``)."""
    return has_softcap or has_bias or has_lora


# Triton 3.6's compiler keeps the 256-column tile's record epilogue in registers (183 on sm_90); 3.9's spills 280 bytes
# there and in the chunked backward (sm_compile): other Triton versions take 128 columns (3.7 and 3.8 are
# not compiled here, so they take the tile known not to spill)
TRITON_VERSION = tuple(int(part) for part in triton.__version__.split(".")[:2])
COLUMNS_256 = TRITON_VERSION == (3, 6)
# IEEE fp32 products run on the FMA units, not the tensor cores: short K steps keep registers in bounds
FP32_TILES = dict(block_n=64, block_v=64, block_d=32, num_warps=4, num_stages=2, use_tma=False)
# 8 token blocks a group (the programs resident at once share their W tiles), one tile a program: measured on the
# H200 (16 token blocks: the same time; 2 or 4 tiles a program: 4-14 % slower)
RECORD_GROUP_N = 8


def gpu_record_config(dtype: torch.dtype, arch: int, wide_epilogue: bool = False) -> TileRecordConfig:
    """The compiled forward's configuration on a device of compute capability ``arch`` (90: sm_90); an arch not in
    RECORD_TILES takes the nearest lower one's (sm_100 sm_90's), one of ~100 KiB of shared memory a block sm_89's
    (sm_86, sm_87; sm_120 and later, the consumer Blackwell cards).
    ``wide_epilogue``: a soft-cap, LoRA or a bias (WIDE_EPILOGUE_BLOCK_V)."""
    if dtype == torch.float32:
        tiles = dict(FP32_TILES)
    else:
        known = [a for a in sorted(RECORD_TILES) if a <= arch] or [min(RECORD_TILES)]
        tiles = dict(RECORD_TILES[89 if arch in (86, 87, 89) or arch >= 120 else known[-1]])
        if wide_epilogue or not COLUMNS_256:
            tiles["block_v"] = min(tiles["block_v"], WIDE_EPILOGUE_BLOCK_V)
    return TileRecordConfig(**tiles, dot_fp32=False, tiles=1, group_n=RECORD_GROUP_N)


def gpu_backward_config(
    dtype: torch.dtype,
    mode: str,
    smem_per_block: int,
    wide_epilogue: bool = False,
    arch: int = 80,
    lora: bool = False,
) -> BackwardConfig:
    """The compiled backward's configuration for ``mode`` (BACKWARD_MODES) on a device of compute capability
    ``arch`` with ``smem_per_block`` bytes of shared memory per block. ``wide_epilogue``: the tile gradient also has
    a soft-cap slope or an entropy term (more live values per logit); ``lora``: the logits have LoRA's K loop."""
    big_smem = smem_per_block >= 160 * 1024  # A100 / H100 class; an RTX 4090 has 99 KiB per block
    if dtype == torch.float32:
        tiles = (
            dict(block_n=32, block_v=64, block_d=16, num_warps=4, num_stages=2)
            if mode == "fused"
            else dict(block_n=64, block_v=64, block_d=32, num_warps=4, num_stages=2)
        )
    elif mode == "chunked" and arch >= 90 and big_smem:
        # Hopper: the forward's 128 x 256 tile through the copy engine (on an H200 the chunked backward of
        # Qwen2.5-1.5B's head at 16k tokens took 41.5 ms with it, 45.0 with 128 x 128, both through pointers); Triton
        # versions other than 3.6 and LoRA (184 bytes of spill at 256) keep 128 x 128, the wider epilogue (its extra
        # live values per logit) 128 x 64
        block_v = 64 if wide_epilogue else 256 if COLUMNS_256 and not lora else 128
        tiles = dict(block_n=128, block_v=block_v, block_d=64, num_warps=8, num_stages=3)
        return BackwardConfig(**tiles, dot_fp32=False, group_v=8, use_tma=True)
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


def compiled_arch(device: torch.device) -> int | None:
    """The compute capability (10 x major + minor) the kernels compile for on ``device``; None where they do not
    compile (the interpreter, a CPU)."""
    return _device_props(device)[2] if _compiled(device) else None


def forward_config(device: torch.device, dtype: torch.dtype, wide_epilogue: bool = False) -> TileRecordConfig:
    """The layer-1 forward's configuration on ``device`` (the interpreter's small tiles on a CPU: 2 tiles a patch,
    groups of 2 token blocks, so that the tests' shapes have partial patches and groups). ``wide_epilogue``: a
    soft-cap, LoRA or a bias."""
    if not _compiled(device):
        return TileRecordConfig(**_INTERPRETER_TILES, tiles=2, group_n=2, use_tma=False)
    return gpu_record_config(dtype, _device_props(device)[2], wide_epilogue)


def backward_config(
    device: torch.device, dtype: torch.dtype, mode: str, wide_epilogue: bool = False, lora: bool = False
) -> BackwardConfig:
    if not _compiled(device):
        # groups of 2 vocabulary tiles: the tests' shapes have partial groups
        return BackwardConfig(**_INTERPRETER_TILES, group_v=2)
    _, smem_per_block, arch = _device_props(device)
    return gpu_backward_config(dtype, mode, smem_per_block, wide_epilogue, arch, lora)


def frozen_head_config(device: torch.device) -> FrozenHeadConfig:
    if not _compiled(device):
        return FrozenHeadConfig(block_n=16, block_v=32, num_warps=4, num_stages=1, gemm_fp32=True)
    return gpu_frozen_head_config()
