"""What the kernels share: the caller's choices (head path, backward mode), one launch-configuration type per kernel
family, each family's configuration on a device (built from ``tiles``' table row of its architecture class and the
family's rules), and the sizes the kernels can index.

The interpreter (and a CPU device) takes small tiles everywhere; a compiled CUDA device takes its class's row
(``tiles.arch_class`` of its compute capability: the one place an architecture is classified).
"""

from dataclasses import dataclass, replace
from typing import Literal, get_args

import torch
import triton

from . import tiles
from .launch import interpreting

# the layer-1 path: "auto" takes the frozen-head path (J = d logp / d hidden built in the forward, two vocabulary
# sweeps) when only ``hidden`` needs a gradient; "general" always takes the recompute path (three sweeps with a
# frozen weight: the benchmark's comparison row, and callers whose entropy will be differentiated)
HeadPath = Literal["auto", "general"]
HEAD_PATHS = get_args(HeadPath)
# the Triton backward: "chunked" (a Triton kernel writes g per token chunk, cuBLAS does the two gradient GEMMs) or
# "fused" (one kernel, fp32 atomics, no g buffer); the torch backend has only "chunked"
BackwardMode = Literal["chunked", "fused"]
BACKWARD_MODES = get_args(BackwardMode)


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
    """The divergence head's record sweep (``kernels.divergence_sweep``): logit tiles; the vocabulary is split so that
    the programs fill whole waves of ``target_programs``, the programs the GPU holds at once
    (``divergence_sweep.num_vocab_splits``); ``use_tma``: H and W tiles through tensor descriptors (sm_90 and later),
    where the tensors allow it."""

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


# the interpreter (and a CPU device): small blocks keep its numpy tiles cheap; shapes in tests are not block multiples
_INTERPRETER_TILES = dict(block_n=16, block_v=32, block_d=16, num_warps=4, num_stages=1, dot_fp32=True)


DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
# the input dtypes every kernel takes (the API checks them)
FLOAT_DTYPES = tuple(DTYPE_NAMES)

# ----------------------------------------------------------------------------------------------- layer 1
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
# 8 token blocks a group (the programs resident at once share their W tiles), one tile a program: measured on the
# H200 (16 token blocks: the same time; 2 or 4 tiles a program: 4-14 % slower)
RECORD_GROUP_N = 8
# the fused backward with dW runs in groups of 8 vocabulary tiles: the resident programs (1 or 2 per SM: sm_compile)
# spread over 8 vocabulary tiles x 17 to 33 token blocks, so each dW row block takes ~1/8 of the concurrent atomic
# adds, each dH one a few
BACKWARD_GROUP_V = 8


def record_columns(block_v: int, wide_epilogue: bool) -> int:
    """The forward's columns within its row's: at most WIDE_EPILOGUE_BLOCK_V for a wide epilogue or a Triton that
    spills the 256-column tile (COLUMNS_256)."""
    return min(block_v, WIDE_EPILOGUE_BLOCK_V) if wide_epilogue or not COLUMNS_256 else block_v


def gpu_record_config(dtype: torch.dtype, arch: int, wide_epilogue: bool = False) -> TileRecordConfig:
    """The compiled forward's configuration on a device of compute capability ``arch`` (90: sm_90): ``tiles.RECORD``'s
    row of its class, at most ``record_columns`` wide. ``wide_epilogue``: a soft-cap, LoRA or a bias."""
    row = tiles.RECORD.row(dtype, arch)
    if dtype != torch.float32:
        row = replace(row, block_v=record_columns(row.block_v, wide_epilogue))
    return TileRecordConfig(**row.fields(), dot_fp32=False, tiles=1, group_n=RECORD_GROUP_N)


def gpu_backward_config(
    dtype: torch.dtype, mode: str, arch: int, wide_epilogue: bool = False, lora: bool = False
) -> BackwardConfig:
    """The compiled backward's configuration for ``mode`` (BACKWARD_MODES) on a device of compute capability ``arch``:
    ``tiles.CHUNKED_BACKWARD``'s or ``tiles.FUSED_BACKWARD``'s row of its class. ``wide_epilogue``: the tile gradient
    also has a soft-cap slope or an entropy term (more live values per logit: the chunked mode's "wide" row);
    ``lora``: the logits have LoRA's K loop (its "lora" row); a Triton other than 3.6 takes at most 128 columns on a
    copy-engine row (COLUMNS_256)."""
    if mode == "fused":
        return BackwardConfig(
            **tiles.FUSED_BACKWARD.row(dtype, arch).fields(), dot_fp32=False, group_v=BACKWARD_GROUP_V
        )
    row = tiles.CHUNKED_BACKWARD.row(dtype, arch, "wide" if wide_epilogue else "lora" if lora else None)
    if row.use_tma and not COLUMNS_256:
        row = replace(row, block_v=min(row.block_v, WIDE_EPILOGUE_BLOCK_V))
    return BackwardConfig(**row.fields(), dot_fp32=False, group_v=BACKWARD_GROUP_V)


def gpu_frozen_head_config(arch: int = 90) -> FrozenHeadConfig:
    """The compiled frozen-head tile kernel's configuration (``tiles.FROZEN_HEAD``: the same on every card and
    dtype)."""
    row = tiles.FROZEN_HEAD.row(torch.bfloat16, arch)
    return FrozenHeadConfig(
        block_n=row.block_n, block_v=row.block_v, num_warps=row.num_warps, num_stages=row.num_stages, gemm_fp32=False
    )


# ----------------------------------------------------------------------------------------------- the divergence head
# the g kernel's columns for a narrow epilogue on a copy-engine row (narrow_g_epilogue), and for the combined head's
# on a pointer row (layer 1's term: no spills at 32)
NARROW_G_BLOCK_V = 128
LAYER1_POINTER_G_BLOCK_V = 32


def narrow_g_epilogue(student, teacher, divergence, layer1: bool) -> bool:
    """Whether the g kernel's epilogue for these ModelHeads is a narrow one (``gpu_g_config``): a divergence without
    a mixture (divergence_records.Divergence.mixture false: the forward or the reverse KL), no soft-cap and no bias
    on either model, no layer-1 term."""
    softcap = student.transform.softcap is not None or teacher.transform.softcap is not None
    bias = student.bias is not None or teacher.bias is not None
    return not (divergence.mixture or softcap or bias or layer1)


def gpu_sweep_config(dtype: torch.dtype, sm_count: int, arch: int = 90, descriptors_fit: bool = True) -> ForwardConfig:
    """The compiled sweep kernel's launch (the record sweep and the JSD sweep) on a GPU of ``sm_count``
    multiprocessors (the programs of one wave) and compute capability ``arch``: ``tiles.SWEEP``'s row of its class,
    its pointer row where the tensors do not fit the copy engine (``descriptors_fit`` false)."""
    row = tiles.SWEEP.row(dtype, arch, None if descriptors_fit else "pointer")
    return ForwardConfig(**row.fields(), dot_fp32=False, target_programs=sm_count)


def gpu_g_config(
    dtype: torch.dtype,
    layer1: bool = False,
    arch: int = 90,
    descriptors_fit: bool = True,
    narrow_epilogue: bool = False,
) -> BackwardConfig:
    """The compiled g kernel's launch on a GPU of compute capability ``arch``: ``tiles.G``'s row of its class, its
    pointer row where the tensors do not fit the copy engine; ``layer1``: the combined head's backward, whose
    half-precision epilogue also holds layer 1's term (LAYER1_POINTER_G_BLOCK_V columns on a pointer row);
    ``narrow_epilogue``: ``narrow_g_epilogue``'s (NARROW_G_BLOCK_V columns on a copy-engine row)."""
    row = tiles.G.row(dtype, arch, None if descriptors_fit else "pointer")
    if dtype != torch.float32:
        if layer1 and not row.use_tma:
            row = replace(row, block_v=LAYER1_POINTER_G_BLOCK_V)
        if narrow_epilogue and not layer1 and row.use_tma:
            row = replace(row, block_v=NARROW_G_BLOCK_V)
    return BackwardConfig(**row.fields(), dot_fp32=False, group_v=1)


def gpu_stored_configs(sm_count: int, arch: int = 90) -> tuple[ForwardConfig, BackwardConfig]:
    """The compiled record sweep's and g kernel's launches over products in memory (``tiles.STORED``) on a GPU of
    ``sm_count`` multiprocessors."""
    row = tiles.STORED.row(torch.bfloat16, arch).fields()
    return ForwardConfig(**row, dot_fp32=False, target_programs=sm_count), BackwardConfig(
        **row, dot_fp32=False, group_v=1
    )


# ----------------------------------------------------------------------------------------------- on a device
def _compiled(device) -> bool:
    return not interpreting() and device.type == "cuda"


def _device_props(device):
    """(SM count, arch as 10 major + minor) of a CUDA device."""
    props = torch.cuda.get_device_properties(device)
    return props.multi_processor_count, 10 * props.major + props.minor


def compiled_arch(device: torch.device) -> int | None:
    """The compute capability (10 x major + minor) the kernels compile for on ``device``; None where they do not
    compile (the interpreter, a CPU)."""
    return _device_props(device)[1] if _compiled(device) else None


def forward_config(device: torch.device, dtype: torch.dtype, wide_epilogue: bool = False) -> TileRecordConfig:
    """The layer-1 forward's configuration on ``device`` (the interpreter's small tiles on a CPU: 2 tiles a patch,
    groups of 2 token blocks, so that the tests' shapes have partial patches and groups). ``wide_epilogue``: a
    soft-cap, LoRA or a bias."""
    if not _compiled(device):
        return TileRecordConfig(**_INTERPRETER_TILES, tiles=2, group_n=2, use_tma=False)
    return gpu_record_config(dtype, compiled_arch(device), wide_epilogue)


def backward_config(
    device: torch.device, dtype: torch.dtype, mode: str, wide_epilogue: bool = False, lora: bool = False
) -> BackwardConfig:
    """Layer 1's backward configuration on ``device`` for ``mode`` (``gpu_backward_config``'s)."""
    if not _compiled(device):
        # groups of 2 vocabulary tiles: the tests' shapes have partial groups
        return BackwardConfig(**_INTERPRETER_TILES, group_v=2)
    return gpu_backward_config(dtype, mode, compiled_arch(device), wide_epilogue, lora)


def frozen_head_config(device: torch.device) -> FrozenHeadConfig:
    """The frozen-head tile kernel's configuration on ``device`` (the interpreter: fp32 GEMMs, small tiles)."""
    if not _compiled(device):
        return FrozenHeadConfig(block_n=16, block_v=32, num_warps=4, num_stages=1, gemm_fp32=True)
    return gpu_frozen_head_config(compiled_arch(device))


def sweep_config(device: torch.device, dtype: torch.dtype, descriptors_fit: bool = True) -> ForwardConfig:
    """The divergence sweep kernel's launch on ``device`` for a student of ``dtype`` (``gpu_sweep_config``'s; the
    interpreter's small tiles on a CPU); ``descriptors_fit``: whether both models' tensors can be read through tensor
    descriptors."""
    if not _compiled(device):
        return ForwardConfig(**_INTERPRETER_TILES, target_programs=8)
    sm_count, arch = _device_props(device)
    return gpu_sweep_config(dtype, sm_count, arch, descriptors_fit)


def g_config(
    device: torch.device,
    dtype: torch.dtype,
    layer1: bool = False,
    descriptors_fit: bool = True,
    narrow_epilogue: bool = False,
) -> BackwardConfig:
    """The divergence g kernel's launch on ``device`` for a student of ``dtype`` (``gpu_g_config``'s)."""
    if not _compiled(device):
        return BackwardConfig(**_INTERPRETER_TILES, group_v=1)
    return gpu_g_config(dtype, layer1, compiled_arch(device), descriptors_fit, narrow_epilogue)


def stored_configs(device: torch.device) -> tuple[ForwardConfig, BackwardConfig]:
    """``gpu_stored_configs`` on ``device`` (the interpreter's small tiles on a CPU)."""
    if not _compiled(device):
        return ForwardConfig(**_INTERPRETER_TILES, target_programs=8), BackwardConfig(**_INTERPRETER_TILES, group_v=1)
    sm_count, arch = _device_props(device)
    return gpu_stored_configs(sm_count, arch)
