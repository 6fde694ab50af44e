"""Launch configurations of the layer-1 forward on a CUDA GPU: each candidate tile timed at one head shape, its
log-probs checked against the default configuration's, beside cuBLAS's product of the same shape (the floor a
GEMM-bound kernel approaches). Data for kernels/config.py's RECORD_TILES; the benchmark (bench/) makes the claims.

    TRITON_INTERPRET=0 python3 tools/gpu_tune.py --shape 1536x151936 --tokens 16384 --out tune.json

Prints one row per configuration (median ms over warm runs, TFLOP/s of the 2NDV product, max |logp - default's|);
a configuration that fails to compile or run is recorded with its error.
"""

import argparse
import dataclasses
import json
import os
import sys

import torch
import triton.testing

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from grpo_fast.head.transform import LogitTransform  # noqa: E402
from grpo_fast.kernels import config as kconfig  # noqa: E402
from grpo_fast.kernels import forward as kforward  # noqa: E402
from grpo_fast.kernels.operands import HeadOperands  # noqa: E402

# (block_n, block_v, block_d, num_warps, num_stages, group_n, use_tma): the default's neighbours and the usual GEMM
# tiles; the copy engine's rows run on sm_90 and later only
CANDIDATES = [
    (128, 256, 64, 8, 3, 8, True),
    (128, 256, 64, 8, 4, 8, True),
    (128, 128, 64, 8, 4, 8, True),
    (256, 128, 64, 8, 3, 8, True),
    (128, 256, 64, 8, 3, 8, False),
    (128, 128, 64, 8, 3, 8, False),
    (128, 128, 64, 8, 4, 8, False),
    (128, 128, 32, 4, 4, 8, False),
    (64, 128, 64, 4, 4, 8, False),
]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="1536x151936", help="DxV of the head (Qwen2.5-1.5B's)")
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--out", default=None, help="a JSON file for the rows")
    args = p.parse_args()
    if not torch.cuda.is_available() or kconfig.interpreting():
        sys.exit("a CUDA GPU with the kernels compiled (TRITON_INTERPRET unset)")
    D, V = map(int, args.shape.split("x"))
    N, dev, dtype = args.tokens, torch.device("cuda"), torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    hidden = torch.randn(N, D, device=dev, generator=g).to(dtype)
    weight = (torch.randn(V, D, device=dev, generator=g) * 0.02).to(dtype)
    targets = torch.randint(0, V, (N,), device=dev, generator=g)
    head = HeadOperands(hidden, weight, targets, None, LogitTransform())
    flops = 2 * N * D * V
    rows = []
    product = torch.empty(N, 32768, device=dev, dtype=dtype)
    # cuBLAS: the same 2NDV in [N, 32768] pieces (what a chunked head computes; no softmax)
    ms = triton.testing.do_bench(
        lambda: [
            torch.mm(hidden, weight[v0 : v0 + 32768].T, out=product[:, : min(32768, V - v0)])
            for v0 in range(0, V, 32768)
        ],
        return_mode="median",
    )
    rows.append(dict(config="cuBLAS mm, 32768-column pieces", ms=ms, tflops=flops / ms / 1e9, err=None))
    default = kconfig.forward_config(dev, dtype)
    reference = kforward.forward(head, True, default)[0]
    arch = 10 * torch.cuda.get_device_capability()[0] + torch.cuda.get_device_capability()[1]
    for bn, bv, bd, warps, stages, group, tma in CANDIDATES:
        if tma and arch < 90:
            continue
        tile = dict(block_n=bn, block_v=bv, block_d=bd, num_warps=warps, num_stages=stages, group_n=group)
        cfg = dataclasses.replace(default, **tile, use_tma=tma)
        name = f"{bn}x{bv}x{bd} w{warps} s{stages} g{group}{' tma' if tma else ''}" + (
            " (default)" if cfg == default else ""
        )
        try:
            logp = kforward.forward(head, True, cfg)[0]
            err = float((logp - reference).abs().max())
            ms = triton.testing.do_bench(
                lambda cfg=cfg: kforward.forward(head, True, cfg),
                return_mode="median",
            )
            rows.append(dict(config=name, ms=ms, tflops=flops / ms / 1e9, err=err))
        except Exception as e:  # a tile that does not fit: recorded, the others still run
            rows.append(dict(config=name, ms=None, tflops=None, err=f"{type(e).__name__}: {str(e)[:120]}"))
    print(f"forward (logp + entropy), bf16, N {N}, D {D}, V {V}, {torch.cuda.get_device_name()}")
    for r in rows:
        ms = "-" if r["ms"] is None else f"{r['ms']:.2f} ms {r['tflops']:.0f} TFLOP/s"
        print(f"  {r['config']:<34} {ms:<26} {'' if r['err'] is None else r['err']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), N=N, D=D, V=V, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
