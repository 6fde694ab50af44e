"""The divergence head over vocab-parallel heads (grpo_fast.distillation.parallel) on 2, 3 and 4 CPU processes (gloo)
equals one process, on the torch backend and on the Triton kernels (the interpreter).

Each spawned rank builds the same inputs (ordinary tokens and tokens confident in both models, 1 - p ~ 1e-6..1e-3,
a masked row), computes the unsharded call on the whole heads (the one-process truth, fp32, the same backend), then
the same call on its rows of both heads: plain shards with ``vocab_parallel=VocabShard(...)`` (uneven splits, an empty
shard on 4 ranks) and DTensors sharded on dim 0 (torch's own chunking; DTensor.full_tensor raises meanwhile). The
divergence, the student's entropy, dH and the rank's dW and db rows must match the unsharded call to fp32 accuracy
(and the fp64 spec as the unsharded head does) for beta 0, 0.5, 1, and the frozen student head (only the hidden
state needs a gradient). Every torch.distributed collective is counted: 64 N bytes in the forward (72 N for the
JSD) and 4 N Ds for dH (N scored tokens): in the backward, or in the forward on the frozen-head path (J; then none
in the backward), the same for two vocabulary sizes.
"""

import pytest
import torch
from helpers import dtensors_never_gathered, gloo_group, spawn_ranks
from test_divergence import confident_pair, pair_inputs
from test_vocab_parallel import CollectiveBytes, max_error
from test_vocab_parallel import one_rank_group as one_rank_mesh  # noqa: F401 (a fixture: a 1-process gloo group's mesh)

pytestmark = pytest.mark.interpreter_only

# sharded vs unsharded, both fp32: the merge order differs, and a logit |z| ~ 30 recomputed by a GEMM of another
# shape rounds differently (eps |z| ~ 2e-6 in p; the unsharded dW is itself 3e-6 off fp64 here)
RTOL = 1e-5
SPEC_ATOL = 2e-5  # against the fp64 spec: the unsharded head's bar (tests/test_divergence.py)
CONFIDENT_RTOL = 2e-5  # confident tokens against their own size: as exact as fp32 logits allow (carried 1 - p)
TIMEOUT_S = 240
B, T, Ds, Dt = 2, 6, 12, 16
TRANSFORM = dict(
    temperature=0.8, student_softcap=30.0, teacher_softcap=30.0, student_logit_scale=1.1, teacher_logit_scale=0.9
)
BETAS = (0.0, 0.5, 1.0)


def splits(V, world):
    """Uneven row boundaries of a V-row head (on 4 ranks, rank 1 holds no row)."""
    return {2: [0, V // 3, V], 3: [0, V // 3 + 1, 2 * V // 3, V], 4: [0, 3, 3, V // 2 + 1, V]}[world]


def inputs(V):
    """Both heads (fp32) and a mask: half the tokens ordinary, half confident in both models (the same top)."""
    half = B * T // 2
    ordinary = pair_inputs(half, Ds, Dt, V, dtype=torch.float32, seed=1)
    confident = confident_pair(half, Ds, Dt, V, TRANSFORM, seed=2)
    # the confident tokens' heads are the ones used; the ordinary tokens' hidden states meet them as they are
    hs = torch.cat([ordinary[0] * 0.3, confident[0]]).reshape(B, T, Ds)
    ht = torch.cat([ordinary[3] * 0.3, confident[3]]).reshape(B, T, Dt)
    ws, bs, wt, bt = confident[1], confident[2], confident[4], confident[5]
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[0, 1] = mask[1, 4] = False
    return hs, ws, bs, ht, wt, bt, mask


def call(data, rows, beta, frozen=False, backend="torch", **head):
    """divergence_and_entropy on fresh leaves of hidden and weight rows ``rows`` (and a backward of a fixed random
    objective): ((div, entropy, dH, dW, db), (bytes through collectives in the forward, in the backward))."""
    import grpo_fast

    hs, ws, bs, ht, wt, bt, mask = data
    h = hs.clone().requires_grad_()
    w, b = (ws[rows].clone().requires_grad_(not frozen), bs[rows].clone().requires_grad_(not frozen))
    if "dtensor_mesh" in head:
        from torch.distributed.tensor import Shard, distribute_tensor

        mesh = head.pop("dtensor_mesh")
        w, b = (
            torch.nn.Parameter(distribute_tensor(x.detach(), mesh, [Shard(0)]), requires_grad=not frozen)
            for x in (ws, bs)
        )
        wt, bt = (distribute_tensor(x, mesh, [Shard(0)]) for x in (wt, bt))
    else:
        wt, bt = wt[rows], bt[rows]
    with CollectiveBytes() as forward_bytes:
        div, entropy = grpo_fast.divergence_and_entropy(
            h, w, ht, wt, mask, beta=beta, student_bias=b, teacher_bias=bt, backend=backend, **TRANSFORM, **head
        )
    coef = torch.randn(B, T, generator=torch.Generator().manual_seed(5))
    with CollectiveBytes() as backward_bytes:
        (div * coef).sum().backward()

    def local(x):
        return None if x is None else (x.to_local() if type(x).__name__ == "DTensor" else x)

    return (div.detach(), entropy, h.grad, local(w.grad), local(b.grad)), (forward_bytes.bytes, backward_bytes.bytes)


def spec(data, beta):
    """(div, entropy, dH, dW, db) of the fp64 spec (grpo_fast.reference) on the same inputs."""
    from grpo_fast import reference

    hs, ws, bs, ht, wt, bt, mask = (x.double() if x.is_floating_point() else x for x in data)
    h, w, b = (x.clone().requires_grad_() for x in (hs, ws, bs))
    div, entropy = reference.divergence_and_entropy(
        h, w, ht, wt, mask, beta=beta, student_bias=b, teacher_bias=bt, compute_dtype=torch.float64, **TRANSFORM
    )
    div, entropy = torch.where(mask, div, 0.0), torch.where(mask, entropy, 0.0)
    coef = torch.randn(B, T, generator=torch.Generator().manual_seed(5)).double()
    (div * coef).sum().backward()
    return div.detach(), entropy.detach(), h.grad, w.grad, b.grad


def compare(rank, world, V, beta, frozen, layout, backend):
    """{name: error} of the sharded call against the unsharded one on ``backend`` (and "spec/name" against the fp64
    spec), and the collective bytes of the sharded call."""
    import grpo_fast

    data = inputs(V)
    truth = call(data, slice(None), beta, frozen, backend)[0]
    truth64 = spec(data, beta)
    if layout == "dtensor":
        from torch.distributed.device_mesh import init_device_mesh

        chunk = -(-V // world)  # torch's Shard(0) chunking
        rows = slice(min(rank * chunk, V), min((rank + 1) * chunk, V))
        with dtensors_never_gathered("the vocab-parallel divergence head"):
            ours, sent = call(data, rows, beta, frozen, backend, dtensor_mesh=init_device_mesh("cpu", (world,)))
    else:
        bounds = splits(V, world)
        rows = slice(bounds[rank], bounds[rank + 1])
        ours, sent = call(data, rows, beta, frozen, backend, vocab_parallel=grpo_fast.VocabShard(None, rows.start, V))
    expected = (truth[0], truth[1], truth[2], None if frozen else truth[3][rows], None if frozen else truth[4][rows])
    names = ("div", "entropy", "dH", "dW", "db")
    errors = {name: max_error(a, e) for name, a, e in zip(names, ours, expected, strict=True)}
    errors.update(
        {
            f"spec/{name}": max_error(a, e if a is not None else None)
            for name, a, e in zip(
                ("div", "entropy", "dH", "dW", "db"),
                ours,
                (*truth64[:3], truth64[3][rows], truth64[4][rows]),
                strict=True,
            )
        }
    )
    # the confident tokens against their own size (their divergence and dH are ~1e-6 of the ordinary tokens')
    confident = slice(B * T // 2, None)
    for name, k in (("div_confident", 0), ("dH_confident", 2)):
        a, e = (x.reshape(B * T, -1)[confident].double() for x in (ours[k], truth[k]))
        errors[name] = float((a - e).abs().max() / e.abs().max())
    return errors, sent


def worker(rank, port, out_dir, world, cases, vocab_sizes):
    with gloo_group(rank, world, port):
        results = {}
        for V in vocab_sizes:
            for case in cases:
                results[(V, *case)] = compare(rank, world, V, *case)
        torch.save(results, f"{out_dir}/rank{rank}.pt")


def check(tmp_path, world, cases, vocab_sizes):
    spawn_ranks(worker, world, str(tmp_path), TIMEOUT_S, world, cases, vocab_sizes)
    N = B * T - 2  # scored tokens
    for rank in range(world):
        results = torch.load(tmp_path / f"rank{rank}.pt")
        for (V, beta, frozen, layout, backend), (errors, sent) in results.items():
            where = f"rank {rank}/{world}, V {V}, beta {beta}, frozen {frozen}, {layout}, {backend}"
            assert max(v for k, v in errors.items() if "/" not in k and "confident" not in k) < RTOL, (
                f"{where}: {errors}"
            )
            assert max(v for k, v in errors.items() if k.startswith("spec/")) < SPEC_ATOL, f"{where}: {errors}"
            assert max(v for k, v in errors.items() if "confident" in k) < CONFIDENT_RTOL, f"{where}: {errors}"
            forward_bytes = 64 * N + (8 * N if 0.0 < beta < 1.0 else 0)
            # dH's all-reduce: in the backward, or in the forward (J) on the frozen-head path
            expected = (forward_bytes + 4 * N * Ds, 0) if frozen else (forward_bytes, 4 * N * Ds)
            assert sent == expected, f"{where}: {sent} bytes through collectives (forward, backward)"


def test_two_ranks(tmp_path):
    """The fast case: 2 ranks, plain shards, the three betas and the frozen head on the torch backend, the JSD on the
    Triton kernels."""
    cases = [(beta, False, "shard", "torch") for beta in BETAS] + [
        (0.0, True, "shard", "torch"),
        (0.5, False, "shard", "triton"),
    ]
    check(tmp_path, 2, cases, (37,))


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_every_case(tmp_path, world):
    """Plain shards (an empty one on 4 ranks) and DTensors, every beta, trainable and frozen heads, two vocabulary
    sizes (the bytes are the same), the torch backend."""
    cases = [
        (beta, frozen, layout, "torch") for beta in BETAS for frozen in (False, True) for layout in ("shard", "dtensor")
    ]
    check(tmp_path, world, cases, (37, 301))


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3, 4])
def test_triton_kernels(tmp_path, world):
    """Each rank's records, JSD sums and backward by the Triton kernels (the interpreter; argmax indices global):
    plain shards and DTensors (V = 37 divides over neither 2 nor 3 ranks), every beta; on 4 ranks plain shards only
    (rank 1 holds no row: no kernel runs there, its records are empty); the frozen head (the torch twin's algorithm
    on every backend, as unsharded) once."""
    layouts = ("shard",) if world == 4 else ("shard", "dtensor")
    cases = [(beta, False, layout, "triton") for beta in BETAS for layout in layouts]
    check(tmp_path, world, cases + [(1.0, True, "shard", "triton")], (37,))


def test_wrong_combinations_are_named_errors(one_rank_mesh):  # noqa: F811 (the imported fixture)
    """One shard description for both heads, split by the same ranges; DTensors both or neither. One rank holding
    every row gives the unsharded result on either backend."""
    from torch.distributed.tensor import Shard, distribute_tensor

    import grpo_fast

    hs, ws, bs, ht, wt, bt, mask = inputs(37)
    shard = grpo_fast.VocabShard(None, 0, 37)
    cases = [
        (
            "one of student_weight and teacher_weight is a DTensor",
            dict(student_weight=distribute_tensor(ws, one_rank_mesh, [Shard(0)])),
        ),
        (
            "both heads must be split by the same vocabulary ranges",
            dict(teacher_weight=wt[:20], teacher_bias=bt[:20], vocab_parallel=shard),
        ),
    ]
    for message, override in cases:
        kwargs = {
            **dict(
                student_hidden=hs,
                student_weight=ws,
                teacher_hidden=ht,
                teacher_weight=wt,
                student_bias=bs,
                teacher_bias=bt,
                completion_mask=mask,
            ),
            **override,
        }
        with pytest.raises(ValueError, match=message):
            grpo_fast.divergence(**kwargs)
    for backend in ("torch", "triton"):
        alone = grpo_fast.divergence(hs, ws, ht, wt, mask, student_bias=bs, teacher_bias=bt, backend=backend)
        sharded = grpo_fast.divergence(
            hs, ws, ht, wt, mask, student_bias=bs, teacher_bias=bt, backend=backend, vocab_parallel=shard
        )
        assert max_error(sharded, alone) < RTOL, backend
