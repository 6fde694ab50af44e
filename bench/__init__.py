"""The grpo_fast benchmark: speed, peak memory and precision against eager PyTorch, torch.compile, TRL 1.16's fused
head and Liger-Kernel, on dense and padded batches.

    python -m bench --quick                 # a first look (CPU: a tiny shape, CPU numbers only)
    python -m bench                         # the full sweep (GPU: model shapes, N = 2k .. 64k; CPU: two model heads)

Modules: shapes (the named lm_head shapes and token counts), impls (the registry of implementations),
inputs (the batches and the chunked fp64 truth), completion_lengths (the padded batch's GSM8K lengths),
measure (timers, peak memory, matmul throughput), runner (the sweep), report (JSON, Markdown, goals, plot).
See bench/README.md.
"""

from bench.impls import IMPLS, Impl, register

__all__ = ["IMPLS", "Impl", "register", "main"]


def main(argv=None):
    from bench.__main__ import main as _main

    return _main(argv)
