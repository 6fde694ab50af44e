"""Launch configurations on a CUDA GPU: each candidate tile timed at one head shape, its output checked against the
default configuration's, beside cuBLAS's product of the same shape (the floor a GEMM-bound kernel approaches). Data for
the tile tables (kernels/tiles.py: RECORD, SWEEP, G and STORED);
the benchmark (bench/) makes the claims.

    TRITON_INTERPRET=0 python3 tools/gpu_tune.py --shape 1536x151936 --tokens 16384 --out tune.json
    TRITON_INTERPRET=0 python3 tools/gpu_tune.py --head divergence --shape 896x151936 --teacher-dim 1536 \
        --tokens 4096 --out tune-divergence.json
    TRITON_INTERPRET=0 python3 tools/gpu_tune.py --head trained --out tune-trained.json
    TRITON_INTERPRET=0 python3 tools/gpu_tune.py --head distillation --out tune-distillation.json

Layer 1's forward (``--head logprobs``): one row per configuration (median ms over warm runs, TFLOP/s of the 2NDV
product, max |logp - default's|). The divergence head (``--head divergence``, beta 1): per configuration the record
sweep (both models' 2NV(Ds + Dt)) and the g kernel of the backward (the same products recomputed, dH and dW left
out), each against cuBLAS's products of both models; the error is the divergence's, max |div - default's|. The
trained head (``--head trained``): ``grpo_fast.loss``'s forward and backward with a trained weight (dapo, token-local:
the three-sweep head) per ``trained_head_chunk`` and the recompute path (``head_path="general"``), each with its peak
memory above the inputs and its dW against the default chunk's, beside three of cuBLAS's products. The fused
distillation loss (``--head distillation``, beta 1, the divergence head's shape): ``grpo_fast.distillation_loss``'s
forward and backward per tile of its sweeps over products in memory and per ``token_chunk``, and the per-token head
then a sum, each with its peak and its dW against the default's, beside cuBLAS's three student and one teacher
products. A configuration that fails to compile or run is recorded with its error.
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
from grpo_fast.kernels import divergence_gradient, divergence_sweep  # noqa: E402
from grpo_fast.kernels import forward as kforward  # noqa: E402
from grpo_fast.kernels import tiles as ktiles  # noqa: E402
from grpo_fast.kernels.divergence_records import ModelHead, finish  # noqa: E402
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
# the divergence head's (block_n, block_v, block_d, num_warps, num_stages, use_tma), for the record sweep and the g
# kernel alike: the sm_90 table's tile, its neighbours, and the 64-row tile through pointers (sm_80's)
DIVERGENCE_CANDIDATES = [
    (128, 64, 64, 8, 3, True),
    (128, 64, 64, 8, 4, True),
    (128, 64, 32, 8, 4, True),
    (64, 128, 64, 4, 3, True),
    (64, 64, 64, 8, 2, False),
    (64, 64, 64, 4, 3, False),
]


def failed_row(name, error, *fields):
    """The row of a configuration that failed to compile or run: its measured ``fields`` None, the error named."""
    return dict(config=name, **dict.fromkeys(fields), err=f"{type(error).__name__}: {str(error)[:120]}")


def median_ms(run):
    """The median time of ``run()`` over warm runs, in ms (triton.testing.do_bench)."""
    return triton.testing.do_bench(run, return_mode="median")


def _cublas_ms(pairs, V, dtype, bench):
    """cuBLAS's products of each (hidden, weight) pair in [N, 32768] pieces (what a chunked head computes)."""
    N = pairs[0][0].shape[0]
    product = torch.empty(N, 32768, device=pairs[0][0].device, dtype=dtype)
    return bench(
        lambda: [
            torch.mm(hidden, weight[v0 : v0 + 32768].T, out=product[:, : min(32768, V - v0)])
            for hidden, weight in pairs
            for v0 in range(0, V, 32768)
        ]
    )


def logprobs_rows(N, D, V, dtype, arch, device="cuda", bench=median_ms):
    """Layer 1's forward rows (module docstring) on ``device`` of compute capability ``arch``, timed by ``bench``."""
    dev = torch.device(device)
    g = torch.Generator(device=dev).manual_seed(0)
    hidden = torch.randn(N, D, device=dev, generator=g).to(dtype)
    weight = (torch.randn(V, D, device=dev, generator=g) * 0.02).to(dtype)
    targets = torch.randint(0, V, (N,), device=dev, generator=g)
    head = HeadOperands(hidden, weight, targets, None, LogitTransform())
    flops = 2 * N * D * V
    # cuBLAS: the same 2NDV in [N, 32768] pieces (what a chunked head computes; no softmax)
    ms = _cublas_ms([(hidden, weight)], V, dtype, bench)
    rows = [dict(config="cuBLAS mm, 32768-column pieces", ms=ms, tflops=flops / ms / 1e9, err=None)]
    default = kconfig.forward_config(dev, dtype)
    reference = kforward.forward(head, True, default)[0]
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
            ms = bench(lambda cfg=cfg: kforward.forward(head, True, cfg))
            rows.append(dict(config=name, ms=ms, tflops=flops / ms / 1e9, err=err))
        except Exception as e:  # a tile that does not fit: recorded, the others still run
            rows.append(failed_row(name, e, "ms", "tflops"))
    return rows


def logprobs_line(r):
    """A ``logprobs_rows`` row as one line."""
    ms = "-" if r["ms"] is None else f"{r['ms']:.2f} ms {r['tflops']:.0f} TFLOP/s"
    return f"{r['config']:<34} {ms:<26} {'' if r['err'] is None else r['err']}"


def divergence_line(r):
    """A ``divergence_rows`` row as one line."""
    ms = "-"
    if r["sweep_ms"] is not None:
        ms = f"sweep {r['sweep_ms']:.2f} ms ({r['tflops']:.0f} TFLOP/s), g {r['g_ms']:.2f} ms"
    return f"{r['config']:<44} {ms:<46} {'' if r['err'] is None else r['err']}"


def trained_line(r):
    """A ``trained_rows`` row as one line."""
    ms = "-" if r["ms"] is None else f"{r['ms']:.2f} ms"
    peak = "" if r["peak_mib"] is None else f"peak {r['peak_mib']:.0f} MiB"
    err = "" if r["err"] is None else (f"dW {r['err']:.1e}" if isinstance(r["err"], float) else r["err"])
    return f"{r['config']:<40} {ms:<12} {peak:<16} {err}"


def write_rows(path, meta, rows):
    """The rows and what they were measured at (``meta``, the device added) as JSON at ``path`` (None: not written)."""
    if path:
        with open(path, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), **meta, rows=rows), f, indent=1)


def divergence_rows(N, Ds, Dt, V, dtype, arch, device="cuda", bench=median_ms):
    """The divergence head's rows (module docstring) on ``device`` of compute capability ``arch``, timed by
    ``bench``."""
    dev = torch.device(device)
    g = torch.Generator(device=dev).manual_seed(0)
    hs, ht = (torch.randn(N, d, device=dev, generator=g).to(dtype) for d in (Ds, Dt))
    ws, wt = ((torch.randn(V, d, device=dev, generator=g) * 0.02).to(dtype) for d in (Ds, Dt))
    student, teacher = ModelHead(hs, ws, None, LogitTransform()), ModelHead(ht, wt, None, LogitTransform())
    flops = 2 * N * V * (Ds + Dt)
    cublas = _cublas_ms([(hs, ws), (ht, wt)], V, dtype, bench)
    rows = [
        dict(config="cuBLAS mm of both models", sweep_ms=cublas, g_ms=cublas, tflops=flops / cublas / 1e9, err=None)
    ]
    reference = divergence_sweep.forward(student, teacher, 1.0)
    saved, argmax = reference[2], reference[3]
    grad = torch.full((N,), 1.0 / N, device=dev)
    grads = (None, None, None)  # the g kernel alone: no dH, dW
    default_sweep = kconfig.sweep_config(dev, dtype)
    default_g = kconfig.g_config(dev, dtype)
    for bn, bv, bd, warps, stages, tma in DIVERGENCE_CANDIDATES:
        if tma and arch < 90:
            continue
        tile = dict(block_n=bn, block_v=bv, block_d=bd, num_warps=warps, num_stages=stages, use_tma=tma)
        sweep_cfg = dataclasses.replace(default_sweep, **tile)
        g_cfg = dataclasses.replace(default_g, **tile)
        name = f"{bn}x{bv}x{bd} w{warps} s{stages}{' tma' if tma else ''}"
        name += " (sweep default)" if sweep_cfg == default_sweep else ""
        name += " (g default)" if g_cfg == default_g else ""

        def sweep(cfg=sweep_cfg):
            out = divergence_sweep.records(student, teacher, 1.0, config=cfg)
            return finish(out.student, out.teacher, 1.0, out.jsd_sweep)[0]

        def g_kernel(cfg=g_cfg):
            divergence_gradient.backward(grad, student, teacher, saved, argmax, 1.0, grads, config=cfg)

        try:
            err = float((sweep() - reference[0]).abs().max())
            sweep_ms = bench(sweep)
            g_ms = bench(g_kernel)
            rows.append(dict(config=name, sweep_ms=sweep_ms, g_ms=g_ms, tflops=flops / sweep_ms / 1e9, err=err))
        except Exception as e:  # a tile that does not fit: recorded, the others still run
            rows.append(failed_row(name, e, "sweep_ms", "g_ms", "tflops"))
    return rows


# the trained head's tokens per chunk to time (None: the default, trained_chunk_size's)
TRAINED_CHUNKS = (None, 256, 512, 1024, 1536, 2048)


def step_row(name, run, grad, expected, bench, peak):
    """The row of a forward-and-backward step ``run``: run once, its weight gradient (``grad()``) against
    ``expected`` (relative to its largest entry), then timed by ``bench`` and its peak taken by ``peak``; a step
    that fails to compile or run (a tile, a chunk that does not fit) is recorded with its error."""
    try:
        run()
        err = float((grad().float() - expected).abs().max() / expected.abs().max())
        return dict(config=name, ms=bench(run), peak_mib=peak(run) / 2**20, err=err)
    except Exception as e:  # noqa: BLE001 - every failure is a row; the other cases still run
        return failed_row(name, e, "ms", "peak_mib")


def cuda_peak_bytes(run):
    """The bytes ``run()`` allocates at its peak above what was allocated before it (CUDA)."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    run()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


def trained_rows(N, D, V, dtype, device="cuda", bench=median_ms, peak=cuda_peak_bytes, chunks=TRAINED_CHUNKS):
    """The trained head's rows (module docstring) on ``device`` for the tokens per chunk ``chunks`` (those up to N),
    timed by ``bench``, its peak by ``peak``."""
    import grpo_fast

    dev = torch.device(device)
    g = torch.Generator(device=dev).manual_seed(0)
    B, T = (N // 1024, 1024) if N % 1024 == 0 else (1, N)
    hidden = torch.randn(B, T, D, device=dev, generator=g).to(dtype).requires_grad_()
    weight = (torch.randn(V, D, device=dev, generator=g) * 0.02).to(dtype).requires_grad_()
    targets = torch.randint(0, V, (B, T), device=dev, generator=g)
    advantages = torch.randn(B, device=dev, generator=g)
    mask = torch.ones(B, T, device=dev)
    cublas = _cublas_ms([(hidden.detach().view(N, D), weight.detach())], V, dtype, bench)
    rows = [dict(config="cuBLAS mm x 3 (the three sweeps' floor)", ms=3 * cublas, peak_mib=None, err=None)]

    def step(**kw):
        hidden.grad = weight.grad = None
        loss = grpo_fast.loss(
            hidden, weight, targets, advantages, mask, loss_type="dapo", backend="triton", check_values=False, **kw
        )
        loss[0].backward()

    step()
    expected = weight.grad.float().clone()
    chunks = [chunk for chunk in chunks if chunk is None or chunk <= N]
    cases = [(f"chunk {chunk or 'default'}", dict(trained_head_chunk=chunk)) for chunk in chunks]
    cases.append(("recompute path (head_path general)", dict(head_path="general")))
    for name, kw in cases:
        rows.append(step_row(name, lambda kw=kw: step(**kw), lambda: weight.grad, expected, bench, peak))
    return rows


# the fused distillation loss's sweeps over products in memory: (block_n, block_v, num_warps, num_stages), the table's
# tile first (kernels/tiles.py's STORED), and its tokens per gradient GEMM (None: loss_chunk_rows')
STORED_CANDIDATES = [(8, 128, 4, 2), (16, 128, 8, 2), (16, 64, 4, 2), (8, 256, 8, 2), (8, 128, 4, 3)]
DISTILLATION_CHUNKS = (None, 256, 768, 1024)


def distillation_rows(
    N,
    Ds,
    Dt,
    V,
    dtype,
    device="cuda",
    bench=median_ms,
    peak=cuda_peak_bytes,
    tiles=STORED_CANDIDATES,
    chunks=DISTILLATION_CHUNKS,
):
    """The fused distillation loss's rows (module docstring) on ``device``: ``grpo_fast.distillation_loss``'s forward
    and backward (beta 1) per sweep tile (``tiles``, at the default chunk) and per tokens per gradient GEMM
    (``chunks``, those up to N, at the table's tile), and the per-token head then a sum (``head_path="general"``),
    each timed by ``bench``, its peak by ``peak`` and its dW against the default's."""
    import grpo_fast

    dev = torch.device(device)
    g = torch.Generator(device=dev).manual_seed(0)
    hs = torch.randn(1, N, Ds, device=dev, generator=g).to(dtype).requires_grad_()
    ws = (torch.randn(V, Ds, device=dev, generator=g) * 0.02).to(dtype).requires_grad_()
    ht = torch.randn(1, N, Dt, device=dev, generator=g).to(dtype)
    wt = (torch.randn(V, Dt, device=dev, generator=g) * 0.02).to(dtype)
    student = _cublas_ms([(hs.detach()[0], ws.detach())], V, dtype, bench)
    teacher = _cublas_ms([(ht[0], wt)], V, dtype, bench)
    rows = [
        dict(config="cuBLAS mm: 3 student + 1 teacher (the floor)", ms=3 * student + teacher, peak_mib=None, err=None)
    ]

    def step(**kw):
        hs.grad = ws.grad = None
        grpo_fast.distillation_loss(hs, ws, ht, wt, beta=1.0, backend="triton", check_values=False, **kw)[0].backward()

    step()
    expected = ws.grad.float().clone()
    table = ktiles.STORED
    row = table.rows["sm90"]
    cases = [
        (f"tile {bn}x{bv} w{warps} s{stages}", dict(block_n=bn, block_v=bv, num_warps=warps, num_stages=stages), {})
        for bn, bv, warps, stages in tiles
    ]
    cases += [(f"chunk {chunk or 'default'}", {}, dict(token_chunk=chunk)) for chunk in chunks[1:] if chunk <= N]
    cases.append(("per-token head + sum (head_path general)", {}, dict(head_path="general")))
    for name, tile, kw in cases:
        ktiles.STORED = dataclasses.replace(table, rows=ktiles.every_class(dataclasses.replace(row, **tile)))
        try:
            rows.append(step_row(name, lambda kw=kw: step(**kw), lambda: ws.grad, expected, bench, peak))
        finally:
            ktiles.STORED = table
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--head",
        choices=("logprobs", "divergence", "trained", "distillation"),
        default="logprobs",
        help="which kernels to time",
    )
    p.add_argument(
        "--shape",
        default=None,
        help="DxV of the (student's) head (default: Qwen2.5-1.5B's 1536x151936; "
        "with --head divergence Qwen2.5-0.5B's 896x151936)",
    )
    p.add_argument("--teacher-dim", type=int, default=1536, help="the teacher's D (--head divergence)")
    p.add_argument("--tokens", type=int, default=None, help="N (default 16384; 4096 with --head divergence)")
    p.add_argument("--out", default=None, help="a JSON file for the rows")
    args = p.parse_args()
    if not torch.cuda.is_available() or kconfig.interpreting():
        sys.exit("a CUDA GPU with the kernels compiled (TRITON_INTERPRET unset)")
    divergence = args.head in ("divergence", "distillation")
    D, V = map(int, (args.shape or ("896x151936" if divergence else "1536x151936")).split("x"))
    N, dtype = args.tokens or (4096 if divergence else 16384), torch.bfloat16
    arch = 10 * torch.cuda.get_device_capability()[0] + torch.cuda.get_device_capability()[1]
    if args.head == "distillation":
        rows, line = distillation_rows(N, D, args.teacher_dim, V, dtype), trained_line
        title = (
            f"distillation loss (beta 1, fwd + bwd), bf16, N {N}, student D {D}, teacher D {args.teacher_dim}, V {V}"
        )
        meta = dict(head="distillation", N=N, Ds=D, Dt=args.teacher_dim, V=V)
    elif divergence:
        rows, line = divergence_rows(N, D, args.teacher_dim, V, dtype, arch), divergence_line
        title = f"divergence head (beta 1), bf16, N {N}, student D {D}, teacher D {args.teacher_dim}, V {V}"
        meta = dict(head="divergence", N=N, Ds=D, Dt=args.teacher_dim, V=V)
    elif args.head == "trained":
        rows, line = trained_rows(N, D, V, dtype), trained_line
        title, meta = f"trained head (dapo, fwd + bwd), bf16, N {N}, D {D}, V {V}", dict(head="trained", N=N, D=D, V=V)
    else:
        rows, line = logprobs_rows(N, D, V, dtype, arch), logprobs_line
        title, meta = f"forward (logp + entropy), bf16, N {N}, D {D}, V {V}", dict(N=N, D=D, V=V)
    print(f"{title}, {torch.cuda.get_device_name()}")
    for r in rows:
        print(f"  {line(r)}")
    write_rows(args.out, meta, rows)


if __name__ == "__main__":
    main()
