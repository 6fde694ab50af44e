"""python -m bench.served: the student's side of distillation from a served teacher (issue 46): the loss of
``grpo_fast.served_distillation_loss`` forward + backward (a trained head) beside the plain log-prob pass with
gradients of the same head (``grpo_fast.logprobs_and_entropy``), TRL 1.16's ``AsyncDistillationTrainer`` loss
function (``_chunked_jsd_loss``: fp32 [256, V] logits a chunk under activation checkpointing) and eager PyTorch
(the full [N, V] fp32 logits, as ``ServerDistillationTrainer`` takes them): time, peak memory, matmul sweeps and
precision against the fp64 spec (``grpo_fast.reference.served_distillation_loss``).

    python -m bench.served                                   # Qwen2.5-1.5B's head, N 4096, K 8 and 256
    python -m bench.served --shape 64x2000 --tokens 256 --k 8 --reps 3 --out runs/bench --name cpu-served

The teacher: a random head's log-probs at its K largest entries (rank-sorted), forward KL with a tail bucket (TRL's
async defaults). The targets (issue 46): the student's side at most 1.1x the plain pass with gradients, at most
0.25x TRL's async loss, at N 4096 and K 8 and 256 on a GPU; on a CPU the times are the torch twin's and say nothing
of a GPU. Writes <out>/<name>.json (every number) and .md (the table); <out> is runs/bench/ unless --out says.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch

import grpo_fast
from bench import measure, report
from bench.shapes import resolve_shape
from grpo_fast import reference

F64 = torch.float64
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
TARGETS = {"x_plain": 1.1, "x_trl_async": 0.25}  # issue 46's, for the served rows
LOGIT_STD = 2.0  # the student's logits on random hidden states; the teacher's: its own head, the same scale
TRUTH_ROWS = 256  # rows a chunk of the fp64 truth
EAGER_MAX_LOGITS = 1 << 28  # eager's [N, V] fp32 logits above this many elements: skipped (a few GiB, several alive)


def make_batch(D, V, N, K, dtype, device, seed=0):
    """(hidden [1, N, D], weight [V, D], ServedTeacher with [1, N, K] lists): the teacher's top-K log-probs of a
    random head related to the student's (its logits plus independent noise)."""
    g = torch.Generator(device=device).manual_seed(seed)
    hidden = torch.randn(1, N, D, generator=g, device=device).to(dtype)
    weight = (torch.randn(V, D, generator=g, device=device) * (LOGIT_STD / D**0.5)).to(dtype)
    ids = torch.empty(1, N, K, dtype=torch.int64, device=device)
    lps = torch.empty(1, N, K, dtype=torch.float32, device=device)
    for r0 in range(0, N, TRUTH_ROWS):
        r1 = min(r0 + TRUTH_ROWS, N)
        z = hidden[0, r0:r1].double() @ weight.double().T
        z = z + torch.randn(z.shape, generator=g, device=device, dtype=F64)
        top = z.log_softmax(-1).topk(K, dim=-1)
        ids[0, r0:r1], lps[0, r0:r1] = top.indices, top.values.float()
    return hidden, weight, grpo_fast.ServedTeacher(ids, lps)


def truth(hidden, weight, teacher):
    """(loss, dH, dW) fp64 of the spec's served loss (the mean over the N tokens), in row chunks."""
    N = hidden.shape[1]
    w = weight.double().requires_grad_()
    grad_hidden = torch.zeros(hidden.shape[1:], dtype=F64)
    loss = 0.0
    for r0 in range(0, N, TRUTH_ROWS):
        r1 = min(r0 + TRUTH_ROWS, N)
        h = hidden[:, r0:r1].double().requires_grad_()
        div, _ = reference.served_divergence_and_entropy(
            h, w, teacher.ids[:, r0:r1], teacher.logprobs[:, r0:r1], compute_dtype=F64
        )
        part = div.sum() / N
        part.backward()
        loss += float(part)
        grad_hidden[r0:r1] = h.grad[0].cpu()
    return loss, grad_hidden, w.grad.cpu()


# ----------------------------------------------------------------------------------------------- the rows
def _served(hidden, weight, teacher):
    return grpo_fast.served_distillation_loss(hidden, weight, teacher)[0]


def _plain(hidden, weight, teacher):
    """The plain log-prob pass with its gradient (the loss: the mean log-prob at the teacher's top-1)."""
    logp, _ = grpo_fast.logprobs_and_entropy(hidden, weight, teacher.ids[..., 0])
    return logp.mean()


def _trl_async(hidden, weight, teacher):
    from trl.experimental.async_distillation.async_distillation_trainer import _chunked_jsd_loss

    valid = teacher.ids[0] >= 0
    loss, *_ = _chunked_jsd_loss(
        hidden[0], weight, None, 1.0, None, teacher.ids[0], teacher.logprobs[0], valid, 0.0, 1.0, True, None, 1, 256
    )
    return loss / hidden.shape[1]


def _eager(hidden, weight, teacher):
    """The full [N, V] fp32 log-softmax gathered at the teacher's ids, the spec's formula on top (what
    ServerDistillationTrainer does with the model's logits)."""
    log_ps = torch.log_softmax((hidden[0] @ weight.T).float(), dim=-1).gather(-1, teacher.ids[0])
    log_pt = teacher.logprobs[0]

    def tail(x):
        return torch.cat([x, torch.log(-torch.expm1(torch.logsumexp(x, -1, keepdim=True).clamp(max=-1e-7)))], -1)

    log_ps, log_pt = tail(log_ps), tail(log_pt)
    return (log_pt.exp() * (log_pt - log_ps)).sum() / hidden.shape[1]


ROWS = {
    "plain": ("grpo_fast.logprobs_and_entropy forward + backward: the plain log-prob pass of the same head", _plain),
    "served": ("grpo_fast.served_distillation_loss (a trained head: three sweeps on the Triton backend)", _served),
    "trl_async": (
        "TRL 1.16's AsyncDistillationTrainer _chunked_jsd_loss (fp32 [256, V] chunks, checkpointed)",
        _trl_async,
    ),
    "eager": ("eager PyTorch: the full [N, V] fp32 log-softmax (ServerDistillationTrainer's path)", _eager),
}


def measure_row(name, hidden, weight, teacher, ref, opts, device):
    """One row's record: median ms, peak bytes, matmul sweeps (CPU), errors against the fp64 truth."""
    fn = ROWS[name][1]
    N, V, D = hidden.shape[1], weight.shape[0], weight.shape[1]
    if name == "eager" and N * V > EAGER_MAX_LOGITS:
        return dict(status="skipped", reason=f"[N, V] = {N} x {V} fp32 logits: several alive at once")
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()

    def reset():
        h.grad = w.grad = None

    def call():
        fn(h, w, teacher).backward()

    try:
        reset()
        with measure.count_matmul_flops(device) as flops:
            loss = fn(h, w, teacher)
            loss.backward()
        errors = {}
        if name != "plain":
            loss_ref, dh_ref, dw_ref = ref
            errors = dict(
                loss_rel_err=abs(float(loss) - loss_ref) / max(abs(loss_ref), 1e-30),
                grad_hidden_rel_err=float((h.grad[0].cpu().double() - dh_ref).abs().max() / dh_ref.abs().max()),
                grad_weight_rel_err=float((w.grad.cpu().double() - dw_ref).abs().max() / dw_ref.abs().max()),
            )
        times, peak = measure.time_runs(call, reset, device, opts.warmup, opts.reps, opts.min_reps, opts.max_seconds)
        if peak is None:
            peak = measure.cpu_peak_bytes(call, reset)
    except Exception as e:  # noqa: BLE001
        if measure.is_oom(e):
            return dict(status="oom", reason=str(e).splitlines()[0])
        return dict(status="error", reason=f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
    sweeps = flops[0] / (2 * N * D * V) if flops else None
    return dict(status="ok", median_ms=measure.median(times), peak_mem_bytes=peak, sweeps=sweeps, errors=errors)


def run(opts):
    device = torch.device(opts.device)
    name, D, V = resolve_shape(opts.shape)
    dtype = DTYPES[opts.dtype]
    started, load, info, cuda = report.at_start(device)
    records = []
    for K in opts.k:
        hidden, weight, teacher = make_batch(D, V, opts.tokens, K, dtype, device, opts.seed)
        ref = truth(hidden, weight, teacher)
        for row in ROWS:
            if row == "plain" and K != opts.k[0]:
                continue  # one plain row: it does not depend on K
            t0 = time.time()
            r = dict(impl=row, K=None if row == "plain" else K, shape=name, D=D, V=V, N=opts.tokens)
            r.update(measure_row(row, hidden, weight, teacher, ref, opts, device))
            if not opts.no_progress:
                print(f"{row} K={K}: {r['status']} in {time.time() - t0:.1f} s", file=sys.stderr)
            records.append(r)
    plain = next((r for r in records if r["impl"] == "plain" and r["status"] == "ok"), None)
    for r in records:
        if r["status"] != "ok":
            continue
        peer = next((p for p in records if p["impl"] == "trl_async" and p["K"] == r["K"] and p["status"] == "ok"), None)
        r["x_plain"] = r["median_ms"] / plain["median_ms"] if plain else None
        r["x_trl_async"] = r["median_ms"] / peer["median_ms"] if peer else None
        r["mem_x_trl_async"] = r["peak_mem_bytes"] / peer["peak_mem_bytes"] if peer and peer["peak_mem_bytes"] else None
    meta = dict(
        command="python -m bench.served " + " ".join(sys.argv[1:]),
        started=started.isoformat(),
        load_average=load,
        device=info,
        versions=report.versions(),
        **report.git_commit(),
        dtype=opts.dtype,
        targets=TARGETS,
        rows={k: v[0] for k, v in ROWS.items()},
        **measure.methods(cuda, opts),
    )
    return dict(meta=meta, results=records)


def markdown(doc) -> str:
    meta = doc["meta"]
    lines = [
        "# Served-teacher distillation: the student's side (issue 46)",
        "",
        f"`{meta['command']}` at commit {meta.get('commit_short')}, {meta['device']['device_name']}, {meta['dtype']}"
        f" (load {meta['load_average']}).",
        "",
    ]
    if meta["device"]["device_type"] != "cuda":
        lines += [report.CPU_BANNER, ""]
    lines += [f"- `{k}`: {v}" for k, v in meta["rows"].items()]
    lines += [
        "",
        "Targets (GPU): served <= " + f"{TARGETS['x_plain']}x plain, <= {TARGETS['x_trl_async']}x trl_async.",
        "",
        "| row | K | N | ms | x plain | x trl_async | peak MiB | mem x trl_async | sweeps | loss err | dH err "
        "| dW err |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def f(v, spec=".3g"):
        return "-" if v is None else format(v, spec)

    for r in doc["results"]:
        if r["status"] != "ok":
            lines.append(f"| {r['impl']} | {r['K'] or '-'} | {r['N']} | {r['status']}: {r.get('reason', '')} |")
            continue
        e = r["errors"]
        lines.append(
            f"| {r['impl']} | {r['K'] or '-'} | {r['N']} | {f(r['median_ms'], '.1f')} | {f(r['x_plain'], '.2f')} | "
            f"{f(r['x_trl_async'], '.2f')} | {f(r['peak_mem_bytes'] / 2**20, '.1f')} | {f(r['mem_x_trl_async'], '.2f')}"
            f" | {f(r['sweeps'], '.2f')} | {f(e.get('loss_rel_err'))} | {f(e.get('grad_hidden_rel_err'))} | "
            f"{f(e.get('grad_weight_rel_err'))} |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench.served", description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="qwen2.5-1.5b", help="a model's head (bench.shapes) or DxV (default %(default)s)")
    p.add_argument("--tokens", type=int, default=4096, help="completion tokens N (default %(default)s)")
    p.add_argument("--k", type=lambda s: [int(x) for x in s.split(",")], default=[8, 256], help="teacher top-K list")
    p.add_argument("--dtype", choices=list(DTYPES), default="bfloat16")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--min-reps", type=int, default=3)
    p.add_argument("--max-seconds", type=float, default=math.inf)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/bench")
    p.add_argument("--name", default="served")
    p.add_argument("--no-progress", action="store_true")
    opts = p.parse_args(argv)
    doc = run(opts)
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    report.write_json(out / f"{opts.name}.json", doc)
    (out / f"{opts.name}.md").write_text(markdown(doc))
    print(markdown(doc))
    return doc


if __name__ == "__main__":
    main()
