"""A vocab-parallel lm_head on CPU ranks (gloo): per-rank peak memory and bytes through collectives, grpo_fast's
vocab-parallel head against gathering the weight with ``full_tensor()`` as TRL 1.16's fused head does.

    python -m bench.vocab_parallel                       # Qwen2.5-1.5B and Gemma-3-1B heads, 2 and 4 ranks
    python -m bench.vocab_parallel --out bench/results   # also write vocab-parallel-cpu.{json,md} there

Each measurement runs in fresh processes (one per rank): the head is a DTensor sharded on dim 0 (each rank creates
only its rows, bf16), every rank holds the same N tokens of hidden states (tensor parallelism), and one training
step runs ``grpo_fast.logprobs_and_entropy`` forward and backward (a log-prob and an entropy-bonus objective; the
weight and hidden need gradients) on the torch backend:

* ``vocab_parallel``: the DTensor is passed as it is (grpo_fast.head.vocab_parallel: O(N) statistics all-reduced in the
  forward, dH in the backward);
* ``gather``: ``weight.full_tensor()`` first (TRL 1.16), then the unsharded head. Every rank would do the same
  work on the same tokens, so to fit 4 ranks in a small machine's memory only rank 0 computes after the all-gather
  (the others join the collective and drop the gathered weight): its peak is every rank's.

Peak memory: the rank's resident-set high-water mark (VmHWM, reset just before the shard is created) minus its
resident set then (CPU: no allocator statistics), so it counts the shard, the gathered weight, the gradients and every
temporary. Bytes: the payload of every collective: the all-reduced tensors (counted by wrapping
``torch.distributed``), and the gathered [V, D] tensor of ``full_tensor()``. Time is not reported: 2 shared CPU
cores say nothing about a GPU.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import subprocess
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HEADS = {"qwen2.5-1.5b": (151936, 1536), "gemma-3-1b (256k)": (262144, 1152)}
WORLDS = (2, 4)
METHODS = ("vocab_parallel", "gather")


def _status_bytes(field):
    """VmRSS (resident now) or VmHWM (its high-water mark) of this process, from /proc/self/status (Linux)."""
    with open("/proc/self/status") as f:
        kib = next(line.split()[1] for line in f if line.startswith(field + ":"))
    return int(kib) * 1024


def _reset_peak():
    """Start VmHWM again from the current resident set (Linux >= 4.0), so that an earlier peak (imports) is not
    counted."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _count_all_reduce(counter):
    real = dist.all_reduce

    def counting(tensor, *args, **kwargs):
        counter["bytes"] += tensor.numel() * tensor.element_size()
        return real(tensor, *args, **kwargs)

    dist.all_reduce = counting
    return real


def _rank(rank, world, port, out_dir, method, V, D, N):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import DTensor, Shard

        import grpo_fast

        mesh = init_device_mesh("cpu", (world,))
        g = torch.Generator().manual_seed(0)
        hidden = torch.randn(1, N, D, generator=g).to(torch.bfloat16).requires_grad_()
        targets = torch.randint(0, V, (1, N), generator=g)
        coef = torch.randn(2, 1, N, generator=g)
        chunk = -(-V // world)
        rows = min(chunk, V - rank * chunk)
        # load the CPU's GEMM libraries and thread pools before the baseline: they are no part of the head's cost
        small = torch.randn(64, D, dtype=torch.bfloat16, requires_grad=True)
        grpo_fast.logprobs_and_entropy(hidden, small, targets % 64, backend="torch")[0].sum().backward()
        hidden.grad = None
        _reset_peak()
        baseline = _status_bytes("VmRSS")
        shard = (torch.randn(rows, D, generator=torch.Generator().manual_seed(rank)) * 0.02).to(torch.bfloat16)
        weight = torch.nn.Parameter(
            DTensor.from_local(shard, mesh, [Shard(0)], run_check=False, shape=(V, D), stride=(D, 1))
        )
        counter = {"bytes": 0}
        real_all_reduce = _count_all_reduce(counter)
        try:
            if method == "vocab_parallel":
                w, computes = weight, True
            else:
                w = weight.full_tensor()  # TRL 1.16's fused head
                counter["bytes"] += w.numel() * w.element_size()
                computes = rank == 0
                if not computes:
                    del w
            if computes:
                logp, entropy = grpo_fast.logprobs_and_entropy(hidden, w, targets, entropy_grad=True, backend="torch")
                ((logp * coef[0]).sum() + (entropy * coef[1]).sum()).backward()
                assert weight.grad is not None and hidden.grad is not None
        finally:
            dist.all_reduce = real_all_reduce
        peak = _status_bytes("VmHWM") - baseline
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(
                dict(
                    peak_bytes=peak,
                    comm_bytes=counter["bytes"],
                    computes=computes,
                    shard_bytes=shard.numel() * shard.element_size(),
                ),
                f,
            )
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(method, V, D, N, world):
    """One step on ``world`` fresh ranks; {peak_bytes (max over the computing ranks), comm_bytes (per rank), ...}."""
    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(
            _rank, args=(world, _free_port(), out_dir, method, V, D, N), nprocs=world, start_method="spawn", join=True
        )
        ranks = [json.load(open(os.path.join(out_dir, f"rank{r}.json"))) for r in range(world)]
    computing = [r for r in ranks if r["computes"]]
    return dict(
        method=method,
        V=V,
        D=D,
        N=N,
        world=world,
        peak_bytes=max(r["peak_bytes"] for r in computing),
        comm_bytes=max(r["comm_bytes"] for r in ranks),
        shard_bytes=max(r["shard_bytes"] for r in ranks),
        weight_bytes=V * D * 2,
    )


def _gib(x):
    return f"{x / 2**30:.2f} GiB"


def _mib(x):
    return f"{x / 2**20:.2f} MiB"


def table(rows):
    lines = [
        "| head (V x D) | ranks | method | per-rank peak memory | bytes through collectives per rank per step |",
        "| --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        lines.append(
            f"| {r['head']} ({r['V']} x {r['D']}) | {r['world']} | {r['method']} | {_gib(r['peak_bytes'])} "
            f"| {_mib(r['comm_bytes'])} |"
        )
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=128, help="tokens N per step on every rank (128)")
    parser.add_argument("--out", default=None, help="folder for vocab-parallel-cpu.{json,md}")
    args = parser.parse_args(argv)
    os.environ["TRITON_INTERPRET"] = "0"  # the torch backend: the interpreter would time Python, not the head
    rows = []
    for head, (V, D) in HEADS.items():
        for world in WORLDS:
            for method in METHODS:
                row = dict(head=head, **measure(method, V, D, args.tokens, world))
                rows.append(row)
                print(table([row]).splitlines()[-1], flush=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    meta = dict(
        date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        commit=commit,
        tokens=args.tokens,
        torch=torch.__version__,
        dtype="bfloat16",
        backend="torch",
        device="cpu (gloo)",
    )
    text = (
        f"# Vocab-parallel lm_head on CPU ranks: memory and communication against gathering\n\n"
        f"{meta['date']}, commit {commit}, torch {torch.__version__}, N = {args.tokens} tokens per rank, bf16 "
        f"weight, one forward + backward of logprobs_and_entropy (weight and hidden trained, entropy gradient), "
        f"torch backend, gloo. `python -m bench.vocab_parallel --out bench/results` (bench/vocab_parallel.py "
        f"says what is measured).\n\n{table(rows)}\n"
    )
    print("\n" + text)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "vocab-parallel-cpu.json"), "w") as f:
            json.dump(dict(meta=meta, rows=rows), f, indent=1)
        with open(os.path.join(args.out, "vocab-parallel-cpu.md"), "w") as f:
            f.write(text)


if __name__ == "__main__":
    sys.exit(main())
