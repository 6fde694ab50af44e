"""Several teachers over vocab-parallel heads (``multi_teacher_distillation_loss(..., vocab_parallel=...)`` or DTensor
weights: ``grpo_fast.multi_teacher.parallel``) on 2 CPU processes (gloo) equal one process: the loss, the per-token
divergence, the student's and the teachers' entropy, dH and the rank's dW and db rows, with in-process teachers of
different widths and transforms and a served one routed by row; plain shards (uneven) and DTensors (never gathered),
a frozen student head, the torch backend and the Triton kernels (the interpreter); ``grpo_fast.loss`` with the same
teachers (RL and MOPD in one call) likewise; and the named errors on one rank.
"""

import os

import pytest
import torch
from helpers import dtensors_never_gathered, gloo_group, spawn_ranks
from test_multi_teacher import _batch
from test_vocab_parallel import max_error, splits
from test_vocab_parallel import one_rank_group as one_rank_mesh  # noqa: F401 (a fixture: a 1-process gloo group's mesh)

import grpo_fast

pytestmark = pytest.mark.interpreter_only

# sharded vs one process, both fp32: the records merge in another order (tests/test_divergence_parallel.py's bar)
RTOL = 1e-5
TIMEOUT_S = 300
# (layout, backend, beta, frozen student head, num_items_in_batch)
CASES = [
    ("shard", "torch", 0.5, False, None),
    ("shard", "torch", 0.0, True, 40),
    ("dtensor", "torch", 1.0, False, None),
    ("shard", "triton", 0.5, False, None),
]


def _sharded(teachers, rows, mesh):
    """The teachers with each in-process one's weight and bias rows ``rows`` (DTensors sharded on dim 0 on
    ``mesh``)."""
    from torch.distributed.tensor import Shard, distribute_tensor

    out = []
    for t in teachers:
        if isinstance(t, grpo_fast.Teacher):
            if mesh is not None:
                weight, bias = (
                    None if x is None else distribute_tensor(x, mesh, [Shard(0)]) for x in (t.weight, t.bias)
                )
            else:
                weight, bias = (None if x is None else x[rows] for x in (t.weight, t.bias))
            t = grpo_fast.Teacher(t.hidden, weight, bias, t.softcap, t.logit_scale)
        out.append(t)
    return out


def _leaves(case, rows=None, mesh=None):
    """The batch, its mask, routing and teachers (each in-process one's weight rows ``rows``, or DTensors on
    ``mesh``), and fresh leaves of the student's hidden states and weight / bias (those rows; frozen as the case
    says)."""
    frozen = case[3]
    batch, mask, index, teachers, _ = _batch()
    weight, bias = batch["weight"], batch["bias"]
    if mesh is not None:
        from torch.distributed.tensor import Shard, distribute_tensor

        weight, bias = (distribute_tensor(x, mesh, [Shard(0)]) for x in (weight, bias))
    elif rows is not None:
        weight, bias = weight[rows], bias[rows]
    h = batch["hidden"].clone().requires_grad_()
    w, b = (torch.nn.Parameter(x.detach().clone(), requires_grad=not frozen) for x in (weight, bias))
    if rows is not None or mesh is not None:
        teachers = _sharded(teachers, rows, mesh)
    return batch, mask, index, teachers, h, w, b


def _call(case, rows=None, mesh=None, shard=None):
    """The call on fresh leaves of the student's hidden states and weight / bias rows ``rows`` (None: whole heads),
    and its backward: (loss, divergence, entropy, teacher entropy, dH, this rank's dW, db)."""
    _, backend, beta, _, num_items = case
    batch, mask, index, teachers, h, w, b = _leaves(case, rows, mesh)
    out = grpo_fast.multi_teacher_distillation_loss(
        h, w, grpo_fast.Teachers(teachers, index), mask, beta=beta, temperature=0.8, targets=batch["targets"],
        student_bias=b, student_softcap=4.0, backend=backend, num_items_in_batch=num_items,
        return_teacher_entropy=True, vocab_parallel=shard,
    )  # fmt: skip
    (40.0 * out[0]).backward()  # gradients of order 1 (the loss is a mean over ~40 tokens)

    def local(x):
        return None if x is None else (x.to_local() if type(x).__name__ == "DTensor" else x)

    return (out[0].detach(), *out[1:], h.grad, local(w.grad), local(b.grad))


def _loss_call(case, rows=None, mesh=None, shard=None):
    """``grpo_fast.loss`` with the teachers beside the policy-gradient loss (RL and several teachers in one call) on
    fresh leaves, and its backward: (loss, log-probs, the distillation metric, dH, this rank's dW, db)."""
    _, backend, beta, _, _ = case
    batch, mask, index, teachers, h, w, b = _leaves(case, rows, mesh)
    advantages = torch.linspace(-1.0, 1.0, h.shape[0])
    loss, metrics = grpo_fast.loss(
        h, w, batch["targets"], advantages, mask, bias=b, temperature=0.8, softcap=4.0, backend=backend,
        teacher=grpo_fast.Teachers(teachers, index), distillation_coef=0.3, distillation_beta=beta,
        vocab_parallel=shard,
    )  # fmt: skip
    (10.0 * loss).backward()

    def local(x):
        return None if x is None else (x.to_local() if type(x).__name__ == "DTensor" else x)

    return (loss.detach(), metrics.logprobs, metrics["distillation_loss"], h.grad, local(w.grad), local(b.grad))


def _rank(rank, port, out_dir, world):
    with gloo_group(rank, world, port):
        from torch.distributed.device_mesh import init_device_mesh

        errors = {}
        for case in CASES:
            whole = _call(case)
            V = _batch()[0]["weight"].shape[0]
            if case[0] == "dtensor":
                chunk = -(-V // world)  # torch's Shard(0) chunking
                rows = slice(min(rank * chunk, V), min((rank + 1) * chunk, V))
                with dtensors_never_gathered("the several teachers' vocab-parallel head"):
                    part = _call(case, mesh=init_device_mesh("cpu", (world,)))
            else:
                bounds = splits(V, world)
                rows = slice(bounds[rank], bounds[rank + 1])
                part = _call(case, rows, shard=grpo_fast.VocabShard(None, rows.start, V))
            expected = (*whole[:5], *(None if x is None else x[rows] for x in whole[5:]))
            names = ("loss", "div", "entropy", "teacher_entropy", "dH", "dW", "db")
            errors[case] = {n: max_error(a, e) for n, a, e in zip(names, part, expected, strict=True)}
            errors[case]["teacher_entropy_scale"] = float(whole[3].abs().max())
            # RL and the teachers in one call, grpo_fast.loss, on the same layout
            whole = _loss_call(case)
            if case[0] == "dtensor":
                with dtensors_never_gathered("the loss with several teachers on a vocab-parallel head"):
                    part = _loss_call(case, mesh=init_device_mesh("cpu", (world,)))
            else:
                part = _loss_call(case, rows, shard=grpo_fast.VocabShard(None, rows.start, V))
            expected = (*whole[:4], *(None if x is None else x[rows] for x in whole[4:]))
            names = ("rl loss", "rl logprobs", "rl distillation_loss", "rl dH", "rl dW", "rl db")
            errors[case].update({n: max_error(a, e) for n, a, e in zip(names, part, expected, strict=True)})
        torch.save(errors, os.path.join(out_dir, f"rank{rank}.pt"))


def test_two_ranks_equal_one_process(tmp_path):
    spawn_ranks(_rank, 2, str(tmp_path), TIMEOUT_S, 2)
    for rank in range(2):
        for case, errors in torch.load(tmp_path / f"rank{rank}.pt").items():
            scale = errors.pop("teacher_entropy_scale")
            assert scale > 0.5, (rank, case)  # the teachers' entropies are there to compare
            assert max(errors.values()) <= RTOL, (rank, case, errors)


def test_named_errors(one_rank_mesh):  # noqa: F811 (the fixture)
    batch, mask, index, teachers, _ = _batch()
    V = batch["weight"].shape[0]
    shard = grpo_fast.VocabShard(None, 0, V)
    hidden, weight = batch["hidden"], batch["weight"]
    kw = dict(beta=0.5, targets=batch["targets"], vocab_parallel=shard)
    with pytest.raises(ValueError, match="token_chunk sizes the in-process teachers' fused loss"):
        grpo_fast.multi_teacher_distillation_loss(
            hidden, weight, grpo_fast.Teachers(teachers, index), mask, token_chunk=8, **kw
        )
    other_rows = [
        grpo_fast.Teacher(teachers[0].hidden, teachers[0].weight[1:], teachers[0].bias[1:], 5.0),
        *teachers[1:],
    ]
    with pytest.raises(ValueError, match=r"teachers.teachers\[0\] .*same vocabulary ranges"):
        grpo_fast.multi_teacher_distillation_loss(hidden, weight, grpo_fast.Teachers(other_rows, index), mask, **kw)
    from torch.distributed.tensor import Shard, distribute_tensor

    dtensor = [grpo_fast.Teacher(teachers[0].hidden, distribute_tensor(teachers[0].weight, one_rank_mesh, [Shard(0)]))]
    with pytest.raises(
        ValueError, match=r"teachers.teachers\[0\] .*one of student_weight and teacher_weight is a DTensor"
    ):
        grpo_fast.multi_teacher_distillation_loss(
            hidden, weight, grpo_fast.Teachers([*dtensor, *teachers[1:]], index), mask, beta=0.5,
            targets=batch["targets"],
        )  # fmt: skip
    with pytest.raises(ValueError, match=r"teachers.teachers\[0\] .*same vocabulary ranges"):
        grpo_fast.loss(
            hidden, weight, batch["targets"], torch.zeros(hidden.shape[0]), mask,
            teacher=grpo_fast.Teachers(other_rows, index), distillation_coef=0.3, distillation_beta=0.5,
            vocab_parallel=shard,
        )  # fmt: skip
