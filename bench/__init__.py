"""The grpo_fast benchmark: speed, peak memory and precision against eager PyTorch, torch.compile, TRL 1.16's fused
head and Liger-Kernel, on dense and padded batches.

    python -m bench --quick                 # a first look (CPU: a tiny shape, CPU numbers only)
    python -m bench                         # the full sweep (GPU: model shapes, N = 2k .. 64k; CPU: two model heads)

Modules: shapes (the named lm_head shapes and token counts), impls (the registry of implementations),
inputs (the batches and the chunked fp64 truth), completion_lengths (the padded batch's GSM8K lengths),
measure (timers, peak memory, matmul throughput), runner (the sweep), report (JSON, Markdown, goals, plot), sampler
(the sampler mode: grpo_fast.sampler_logprobs beside the plain log-prob pass, issue 45),
summary (the top-level README's picture from committed results: python -m bench.summary).
See bench/README.md.
"""

import os
import sys

# Before torch starts OpenMP (the examples set the same): idle OpenMP threads sleep instead of spinning. On a CPU
# that other processes share, spinning threads wait for each other at every matrix product and the timings measure
# the spinning (a quick CPU sweep: 40 s with it, 12 s without). The results' metadata records the policy in effect.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# OpenMP reads the policy when torch loads it: unknown when torch was imported before the benchmark
THREAD_POLICY = (
    f"OMP_WAIT_POLICY={os.environ['OMP_WAIT_POLICY']}"
    if "torch" not in sys.modules
    else "unknown: torch was imported before bench set OMP_WAIT_POLICY"
)

from bench.impls import IMPLS, Impl, register  # noqa: E402 (after the thread policy)

__all__ = ["IMPLS", "Impl", "register", "main", "THREAD_POLICY"]


def main(argv=None):
    from bench.__main__ import main as _main

    return _main(argv)
