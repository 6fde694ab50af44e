"""The grpo_fast benchmark: speed and peak memory against eager PyTorch, torch.compile and Liger-Kernel.

    python -m bench --quick                 # a first look (CPU: small shapes, CPU numbers only)
    python -m bench                         # the full sweep on a CUDA GPU (model shapes, N = 2k .. 64k tokens)

Modules: shapes (the named lm_head shapes and token counts), impls (the registry of implementations),
inputs (the batch and the guard's chunked fp32 reference), measure (timers, peak memory, matmul throughput),
runner (the sweep), report (JSON, Markdown, goals, plot). See bench/README.md.
"""

from bench.impls import IMPLS, Impl, register

__all__ = ["IMPLS", "Impl", "register", "main"]


def main(argv=None):
    from bench.__main__ import main as _main

    return _main(argv)
