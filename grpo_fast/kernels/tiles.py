"""What runs on a given card: the architecture classes, the one rule that maps a compute capability to its class, and
each kernel family's tile table, a row per class.

A card's compute capability (10 x major + minor) takes the class of the highest capability at or below it
(``arch_class``), and a card below sm_80 sm_80's:

    sm_80 (A100)                                          -> sm80
    sm_86, sm_87, sm_89 (RTX 3090, Jetson Orin, RTX 4090) -> sm89    (~100 KiB of shared memory a block)
    sm_90 (H100, H200)                                    -> sm90
    sm_100, sm_103 (B200, B300)                           -> sm100
    sm_120, sm_121 (RTX 5090, DGX Spark)                  -> sm120   (~100 KiB of shared memory a block)

Each table holds a row for every class (``tests/test_tiles.py`` checks it), for bf16 / fp16 inputs; fp32 inputs take
the table's one fp32 row on every card (IEEE fp32 products run on the FMA units, not the tensor cores, whatever the
card). Adding an architecture is adding an ``ArchClass`` and a row to every table; ``tools/sm_compile.py`` compiles
every variant for every class, and the rows of a new class are chosen from what it compiles to (registers, shared
memory, spills, the MMA instruction) until a GPU measures them. ``config`` builds the launch configurations from these
rows (and the rules of each family: a wider epilogue takes fewer columns, tensors that do not fit the copy engine take
the pointer row); ``tuning`` times each class's candidates around them.

Measured or argued: the sm90 rows of layer 1's forward and chunked backward are the fastest measured on an H200 (the
timings are in the documentation's "How it works"). Every other row is ARGUED from the compiled code, NOT MEASURED on
its card: the sm100 rows from tools/sm_compile.py's compile for sm_100 (tcgen05 MMA with its accumulator in tensor
memory, the copy engine, 227 KiB of shared memory a block) and the sm120 rows from its compile for sm_120 (mma.sync,
~99 KiB a block; the same code for sm_121), with triton 3.6 and 3.9: every variant fits, none spills on 3.9, and 3.6
spills at most the 16 bytes it spills on sm_90 too (.ci/run's allowance). The comment above each table says why each
row is what it is.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Literal, get_args

import torch

ArchClassName = Literal["sm80", "sm89", "sm90", "sm100", "sm120"]
ARCH_CLASS_NAMES: tuple[str, ...] = get_args(ArchClassName)


@dataclass(frozen=True)
class ArchClass:
    """A class of cards that take the same tiles: the capability it starts at, and the facts its rows are chosen by
    (CUDA programming guide, compute capabilities; tools/sm_compile.py's occupancy reads them).

    Attributes:
        name: the class's key in every table.
        first: the lowest compute capability (10 x major + minor) the class covers (``arch_class``).
        capability: its reference card's, the one sm_compile compiles for; the facts below are that card's.
        smem_per_block: the most shared memory one block may ask for, in bytes (227 KiB on sm_90 / sm_100).
        smem_per_sm: shared memory per multiprocessor, in bytes.
        max_warps_per_sm: resident warps per multiprocessor.
        max_ctas_per_sm: resident blocks per multiprocessor.
        sm_count: multiprocessors (sm_compile's stand-in for a launch's wave).
    """

    name: ArchClassName
    first: int
    capability: int
    smem_per_block: int
    smem_per_sm: int
    max_warps_per_sm: int
    max_ctas_per_sm: int
    sm_count: int


KIB = 1024
# lowest first; sm_87's (Orin's) 164 KiB of shared memory a block are not used: it takes sm_89's rows
ARCH_CLASSES: dict[str, ArchClass] = {
    c.name: c
    for c in (
        ArchClass("sm80", 80, 80, 163 * KIB, 164 * KIB, 64, 32, 108),  # A100
        ArchClass("sm89", 86, 89, 99 * KIB, 100 * KIB, 48, 24, 128),  # RTX 4090 (sm_86: 16 CTAs an SM)
        ArchClass("sm90", 90, 90, 227 * KIB, 228 * KIB, 64, 32, 132),  # H100 / H200
        ArchClass("sm100", 100, 100, 227 * KIB, 228 * KIB, 64, 32, 148),  # B200
        ArchClass("sm120", 120, 120, 99 * KIB, 100 * KIB, 48, 32, 170),  # RTX 5090
    )
}


def arch_class(capability: int) -> ArchClass:
    """The architecture class of a card of compute ``capability`` (10 x major + minor): the class whose first
    capability is the highest at or below it; below sm_80, sm_80's (the module docstring lists the cards)."""
    below = [c for c in ARCH_CLASSES.values() if c.first <= capability]
    return below[-1] if below else ARCH_CLASSES["sm80"]


@dataclass(frozen=True)
class Tiles:
    """One launch's tile: BLOCK_N tokens x BLOCK_V vocabulary entries, K steps of BLOCK_D (a kernel without a dot
    ignores block_d), its warps and pipeline stages; ``use_tma``: the tiles come through tensor descriptors (the copy
    engine, sm_90 and later), where the tensors allow it."""

    block_n: int
    block_v: int
    block_d: int
    num_warps: int
    num_stages: int
    use_tma: bool = False

    def fields(self) -> dict:
        """The tile's fields as keywords of a launch configuration."""
        return dict(
            block_n=self.block_n,
            block_v=self.block_v,
            block_d=self.block_d,
            num_warps=self.num_warps,
            num_stages=self.num_stages,
            use_tma=self.use_tma,
        )


@dataclass(frozen=True)
class TileTable:
    """One kernel family's tiles.

    Attributes:
        family: what launches them.
        rows: a Tiles per architecture class (every class), for bf16 / fp16 inputs.
        fp32: the row of fp32 inputs (IEEE fp32 products on the FMA units), on every class but those that
            ``variants["fp32"]`` names.
        variants: per variant, the row of each class whose row differs from its plain one, e.g. "fp32"; "pointer":
            where the plain row reads through the copy engine and the tensors do not fit it
            (``launch.tensor_descriptors_fit``; a class not named takes its plain tile through pointers); a family's
            own ("wide": a wider epilogue, "lora": LoRA's second K loop).
    """

    family: str
    rows: dict[str, Tiles]
    fp32: Tiles
    variants: dict[str, dict[str, Tiles]] = field(default_factory=dict)

    def row(self, dtype: torch.dtype, capability: int, variant: str | None = None) -> Tiles:
        """The tile of ``dtype`` inputs on a card of compute ``capability``, in ``variant`` (None: the plain one)."""
        name = arch_class(capability).name
        if dtype == torch.float32:
            return self.variants.get("fp32", {}).get(name, self.fp32)
        tiles = self.rows[name]
        if variant == "pointer" and not tiles.use_tma:
            return tiles
        default = replace(tiles, use_tma=False) if variant == "pointer" else tiles
        return self.variants.get(variant, {}).get(name, default) if variant is not None else tiles


def every_class(tiles: Tiles) -> dict[str, Tiles]:
    """The same row for every class (a kernel whose tile no card's resources decide: no dot, no shared memory)."""
    return dict.fromkeys(ARCH_CLASS_NAMES, tiles)


# ----------------------------------------------------------------------------------------------- layer 1
# The forward (kernels.forward): sm90 128 x 256 x 64 on 8 warps (two warpgroups, each a 64 x 256 wgmma), 3 stages,
# the copy engine: 14.0-14.3 ms for Qwen2.5-1.5B's head at 16k tokens on an H200, 1.2x cuBLAS's bare product, where
# 128 x 128 took 18.8 and 256 x 128 14.7. sm80 (A100, 163 KiB a block): 128 x 128 through pointers (mma.sync;
# 128 x 256 spills 24 bytes there). sm89 (RTX 4090, 99 KiB): 128 x 128, 4 stages of 64-wide K steps: one CTA an SM
# (240 registers a thread), so the pipeline's depth is what hides the loads' latency. sm100: sm90's tile on tcgen05
# (the accumulator in tensor memory: 208 registers, 97 KiB of shared memory, no spill; 145 KiB at 256 columns on
# triton 3.6). sm120: sm89's (mma.sync; 236-255 registers, 97 KiB of its 99; the copy engine compiles there too, at
# 65 KiB, but gains no CTA an SM at 8 warps and spills 8 bytes on triton 3.6).
# Columns: a soft-cap, LoRA or a bias (the wide epilogue), and a Triton other than 3.6, take at most 128
# (config.WIDE_EPILOGUE_BLOCK_V, config.COLUMNS_256).
RECORD = TileTable(
    "layer 1's forward (kernels.forward)",
    {
        "sm80": Tiles(128, 128, 64, 8, 3),
        "sm89": Tiles(128, 128, 64, 8, 4),
        "sm90": Tiles(128, 256, 64, 8, 3, use_tma=True),
        "sm100": Tiles(128, 256, 64, 8, 3, use_tma=True),
        "sm120": Tiles(128, 128, 64, 8, 4),
    },
    fp32=Tiles(64, 64, 32, 4, 2),
)
# The chunked backward's g tiles (kernels.backward). sm90: the forward's 128 x 256 through the copy engine (41.5 ms
# on an H200 for Qwen2.5-1.5B's head at 16k tokens, 45.0 with 128 x 128); LoRA (184 bytes of spill at 256) and a
# Triton other than 3.6 (config.COLUMNS_256) take 128 columns, the wide epilogue (a soft-cap slope, an entropy term:
# more live values a logit) 64. sm80 / sm89: 128 x 128 through pointers, the wide epilogue 64 (128 x 128 with both
# terms needs all 255 registers and spills on sm_8x). sm100: 128 columns on every Triton (256 spill 160 bytes with a
# bias on 3.6, 56 with fp32 LoRA adapters on 3.9), LoRA 64, the wide epilogue 32 (64 spills 8 bytes with a soft-cap
# on 3.9): 221-255 registers, no spill. sm120: K steps of 32 (64 spill 24-40 bytes: consumer Blackwell runs none of
# the sm_8x prefetch pass), 254 registers, 65 KiB.
CHUNKED_BACKWARD = TileTable(
    "layer 1's chunked backward (kernels.backward)",
    {
        "sm80": Tiles(128, 128, 64, 8, 3),
        "sm89": Tiles(128, 128, 64, 8, 3),
        "sm90": Tiles(128, 256, 64, 8, 3, use_tma=True),
        "sm100": Tiles(128, 128, 64, 8, 3, use_tma=True),
        "sm120": Tiles(128, 128, 32, 8, 3),
    },
    fp32=Tiles(64, 64, 32, 4, 2),
    variants={
        "wide": {
            "sm80": Tiles(128, 64, 64, 8, 3),
            "sm89": Tiles(128, 64, 64, 8, 3),
            "sm90": Tiles(128, 64, 64, 8, 3, use_tma=True),
            "sm100": Tiles(128, 32, 64, 8, 3, use_tma=True),
            "sm120": Tiles(128, 64, 32, 8, 3),
        },
        "lora": {"sm90": Tiles(128, 128, 64, 8, 3, use_tma=True), "sm100": Tiles(128, 64, 64, 8, 3, use_tma=True)},
    },
)
# The fused backward (one kernel, fp32 atomics): it also stages W and H tiles for its two gradient products, 3 stages
# where a block has ~160 KiB of shared memory or more, 2 on the ~100 KiB cards. sm100: 2 stages (3 spill 32 bytes
# with fp32 LoRA adapters on 3.9), fp32 on 8 warps (4 spill 16 bytes). sm120: 64 columns (128 spill 8 bytes at 2 or 3
# stages), fp32 on 8 warps.
FUSED_BACKWARD = TileTable(
    "layer 1's fused backward (kernels.backward)",
    {
        "sm80": Tiles(64, 128, 32, 8, 3),
        "sm89": Tiles(64, 128, 32, 8, 2),
        "sm90": Tiles(64, 128, 32, 8, 3),
        "sm100": Tiles(64, 128, 32, 8, 2),
        "sm120": Tiles(64, 64, 32, 8, 2),
    },
    fp32=Tiles(32, 64, 16, 4, 2),
    variants={"fp32": {"sm100": Tiles(32, 64, 16, 8, 2), "sm120": Tiles(32, 64, 16, 8, 2)}},
)
# The frozen-head forward's tile kernel (kernels.forward_frozen; no dot: BLOCK_N rows x BLOCK_V columns of its u
# buffer a step): few rows a program, so that one token chunk fills the GPU (1536 rows / 2 = 768 programs).
FROZEN_HEAD = TileTable(
    "the frozen-head forward's tile kernel (kernels.forward_frozen)",
    every_class(Tiles(2, 512, 16, 4, 1)),
    fp32=Tiles(2, 512, 16, 4, 1),
)

# ----------------------------------------------------------------------------------------------- the divergence head
# The record sweep and the JSD sweep (kernels.divergence_sweep): two logit tiles (student and teacher) and both
# records' epilogue live at once. sm90: 128 x 64 x 64 on 8 warps (two warpgroups, each a 64 x 64 wgmma; 64-row tiles
# gave each warpgroup 64 x 32), 3 stages, the copy engine: 248 registers, no spill; 128 columns spill 900 bytes, 128
# rows through pointers 184. sm80 / sm89 (mma.sync): 64 x 64 x 64, where 128 rows spill 150-270 bytes; sm90 takes it
# where the tensors do not fit the copy engine. sm100: 64 rows through the copy engine (128 rows spill 128-272 bytes on
# 3.9 at any stages, K step or warps): 185 registers, 49 KiB. sm120: sm89's tile at 3 stages (2 spill 16 bytes on 3.9),
# 245-255 registers.
SWEEP = TileTable(
    "the divergence head's record and JSD sweeps (kernels.divergence_sweep)",
    {
        "sm80": Tiles(64, 64, 64, 8, 2),
        "sm89": Tiles(64, 64, 64, 8, 2),
        "sm90": Tiles(128, 64, 64, 8, 3, use_tma=True),
        "sm100": Tiles(64, 64, 64, 8, 3, use_tma=True),
        "sm120": Tiles(64, 64, 64, 8, 3),
    },
    # IEEE fp32 products on the FMA units: 8 warps keep both tiles' registers in bounds; on sm100 and sm120 K steps
    # of 16 (32 spill 24-40 bytes in the JSD sweep on triton 3.6)
    fp32=Tiles(32, 64, 32, 8, 2),
    variants={
        "pointer": {"sm90": Tiles(64, 64, 64, 8, 2), "sm100": Tiles(64, 64, 64, 8, 2)},
        "fp32": {"sm100": Tiles(32, 64, 16, 8, 2), "sm120": Tiles(32, 64, 16, 8, 2)},
    },
)
# The backward's g tiles (kernels.divergence_gradient): both logit tiles and the gradient's epilogue live at once.
# sm90: 128 x 64 x 64 on 8 warps through the copy engine, as the record sweep, and 128 columns for a narrow epilogue
# (config.narrow_g_epilogue: 238-255 registers, no spill; the JSD's mixture, a soft-cap, a bias or layer 1's term
# spill 16-1000 bytes there); elsewhere (and where the tensors do not fit the copy engine) 64 x 64 x 64 through
# pointers, 32 columns for the combined head (layer 1's term: no spills). sm100 as sm90 (229-255 registers, no
# spill), sm120 as sm89 (174-180 registers).
G = TileTable(
    "the divergence head's g kernel (kernels.divergence_gradient)",
    {
        "sm80": Tiles(64, 64, 64, 8, 2),
        "sm89": Tiles(64, 64, 64, 8, 2),
        "sm90": Tiles(128, 64, 64, 8, 3, use_tma=True),
        "sm100": Tiles(128, 64, 64, 8, 3, use_tma=True),
        "sm120": Tiles(64, 64, 64, 8, 2),
    },
    fp32=Tiles(32, 32, 32, 4, 2),
    variants={"pointer": {"sm90": Tiles(64, 64, 64, 8, 2), "sm100": Tiles(64, 64, 64, 8, 2)}},
)
# The sweeps over products in memory (kernels.divergence_loss: no dot, memory-bound: two fp32 tiles in, the records
# or g out), the same on every card: 8 x 128 on 4 warps, 8 elements of each tile a thread. sm_compile (sm_90, triton
# 3.9): the record sweep 127 registers with a bias and a soft-cap too, 4 CTAs (16 warps) an SM; the g kernel 38-89
# registers, 5-12 CTAs; no spill (likewise on sm_100 and sm_120). 16 x 128 on 4 warps: 168 registers, and with a bias
# and a soft-cap 255 and an 8-byte stack spill; 32 x 128 on 8 warps: one CTA an SM.
STORED = TileTable(
    "the fused distillation loss's sweeps over products in memory (kernels.divergence_loss)",
    every_class(Tiles(8, 128, 16, 4, 2)),
    fp32=Tiles(8, 128, 16, 4, 2),
)

TABLES = (RECORD, CHUNKED_BACKWARD, FUSED_BACKWARD, FROZEN_HEAD, SWEEP, G, STORED)

# ----------------------------------------------------------------------------------------------- tuning
# GRPO_FAST_TUNE=1's candidates for the forward beside RECORD's row (kernels.tuning), as changes to it: deeper or
# shallower pipelines, the transposed tile, and narrower tiles for shapes where the grid is small (few tokens)
RECORD_VARIANTS: dict[str, tuple[dict, ...]] = {
    "sm80": (
        dict(num_stages=4),
        dict(block_v=64, num_warps=4, num_stages=4),
        dict(block_n=64, num_warps=4, num_stages=4),
    ),
    "sm89": (dict(num_stages=3), dict(block_v=64, num_warps=4), dict(block_n=64, num_warps=4)),
    "sm90": (dict(num_stages=4), dict(block_v=128, num_stages=4), dict(block_n=64, num_warps=4, num_stages=4)),
    "sm100": (dict(num_stages=4), dict(block_v=128, num_stages=4), dict(block_n=64, num_warps=4, num_stages=4)),
    "sm120": (dict(num_stages=3), dict(block_v=64, num_warps=4), dict(block_n=64, num_warps=4)),
}
