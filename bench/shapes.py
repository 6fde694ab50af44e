"""The lm_head shapes the benchmark runs, named after the models they come from, and its token counts."""

from __future__ import annotations

import re

# name -> (hidden size D, vocabulary V) of the model's lm_head
MODEL_SHAPES = {
    "qwen2.5-1.5b": (1536, 151936),
    "qwen2.5-0.5b": (896, 151936),
    "qwen2.5-7b": (3584, 152064),
    "llama3.1-8b": (4096, 128256),
    "smollm2-135m": (576, 49152),
}

# small shapes for a CPU (the fallback path); not model shapes
CPU_SHAPES = {
    "cpu-d64-v2k": (64, 2048),  # within one tile of grpo_fast's torch path (1024 tokens x 8192 vocab)
    "cpu-d128-v4k": (128, 4096),
    "cpu-d128-v16k": (128, 16384),  # several vocab tiles: the memory gap shows from N = 2048 on
}
CPU_QUICK_SHAPES = ("cpu-d64-v2k",)  # CI's smoke run: seconds on 2 cores
CPU_FULL_SHAPES = ("smollm2-135m", "qwen2.5-1.5b")  # real vocabularies: the memory of a real lm_head

# positions per call N = B x T: 16 completions padded to T (the dense batch: N completion tokens)
COMPLETIONS = 16
GPU_TOKENS = (2048, 4096, 16384, 65536)
GPU_QUICK_SHAPES = ("qwen2.5-1.5b",)
GPU_QUICK_TOKENS = (4096, 16384)
CPU_TOKENS = (1024, 2048)
CPU_QUICK_TOKENS = (128, 512)

# where the goals are evaluated (bench/README.md, "Goals")
GOAL_SHAPE, GOAL_TOKENS = "qwen2.5-1.5b", 16384


def resolve_shape(spec: str) -> tuple[str, int, int]:
    """A shape name (MODEL_SHAPES, CPU_SHAPES) or 'DxV' (e.g. 64x2000) -> (name, D, V)."""
    key = spec.strip().lower()
    if key in MODEL_SHAPES:
        return (key, *MODEL_SHAPES[key])
    if key in CPU_SHAPES:
        return (key, *CPU_SHAPES[key])
    m = re.fullmatch(r"(\d+)x(\d+)", key)
    if m:
        D, V = int(m.group(1)), int(m.group(2))
        return (f"d{D}-v{V}", D, V)
    known = ", ".join(list(MODEL_SHAPES) + list(CPU_SHAPES))
    raise ValueError(f"unknown shape {spec!r}: use one of {known}, or DxV such as 64x2000")


def batch_of(N: int) -> tuple[int, int]:
    """N tokens as B completions of T tokens: 16 x N/16 when N divides, else 1 x N."""
    if N >= COMPLETIONS and N % COMPLETIONS == 0:
        return COMPLETIONS, N // COMPLETIONS
    return 1, N
