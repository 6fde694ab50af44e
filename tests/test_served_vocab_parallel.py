"""The served divergence on a vocab-parallel student head (grpo_fast.served.vocab_parallel) on 2 and 4 CPU processes
(gloo) equals one process: the divergence, the entropy, dH and the rank's dW and db rows, for each beta and with and
without the tail bucket, on the torch backend and the Triton kernels (under the interpreter); the teacher's ids fall
on every shard (and none on an empty one); the traffic does not grow with the vocabulary."""

import os

import pytest
import torch
from helpers import gloo_group, spawn_ranks
from test_vocab_parallel import CollectiveBytes, max_error, splits

import grpo_fast

pytestmark = pytest.mark.interpreter_only

ATOL = 2e-5
TIMEOUT_S = 300
B, T, D, K = 2, 5, 12, 6
CASES = [(0.0, True), (0.0, False), (0.5, True), (1.0, True)]


def _inputs(V, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, D, generator=g)
    weight = torch.randn(V, D, generator=g) * 0.5
    bias = torch.randn(V, generator=g) * 0.5
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[1, 3:] = False
    teacher = (torch.randn(B, T, V, generator=g, dtype=torch.float64) * 2).log_softmax(-1)
    top = teacher.topk(K, dim=-1)
    targets = top.indices[..., 1].clone()  # listed: TRL's support holds it at beta != 0
    return hidden, weight, bias, mask, targets, grpo_fast.ServedTeacher(top.indices, top.values.float())


def _call(hidden, weight, bias, mask, targets, teacher, backend, beta, tail, **shard):
    h, w, b = (x.clone().requires_grad_() for x in (hidden, weight, bias))
    div, entropy = grpo_fast.served_divergence_and_entropy(
        h, w, teacher._replace(add_tail_bucket=tail), mask, targets=targets, beta=beta, student_bias=b,
        temperature=0.8, backend=backend, **shard,
    )  # fmt: skip
    upstream = torch.randn(B, T, generator=torch.Generator().manual_seed(1))
    (div * upstream).sum().backward()
    return (div, entropy), (h.grad, w.grad, b.grad)


def _rank(rank, port, out_dir, world, V, backends):
    with gloo_group(rank, world, port):
        import torch.distributed as dist

        edges = splits(V, world)
        rows = slice(edges[rank], edges[rank + 1])
        errors, traffic = {}, {}
        inputs = _inputs(V)
        hidden, weight, bias, mask, targets, teacher = inputs
        for beta, tail in CASES:
            for backend in backends:
                whole, whole_grads = _call(*inputs, backend, beta, tail)
                shard = grpo_fast.VocabShard(dist.group.WORLD, edges[rank], V)
                with CollectiveBytes() as counted:
                    part, part_grads = _call(
                        hidden, weight[rows], bias[rows], mask, targets, teacher, backend, beta, tail,
                        vocab_parallel=shard,
                    )  # fmt: skip
                key = f"{beta}/{tail}/{backend}"
                errors[key] = max(
                    [max_error(a, e) for a, e in zip(part, whole)]
                    + [
                        max_error(part_grads[0], whole_grads[0]),
                        max_error(part_grads[1], whole_grads[1][rows]),
                        max_error(part_grads[2], whole_grads[2][rows]),
                    ]
                )
                traffic[key] = counted.bytes
        torch.save((errors, traffic), os.path.join(out_dir, f"rank{rank}.pt"))


def _spawn(tmp_path, world, V, backends):
    spawn_ranks(_rank, world, str(tmp_path), TIMEOUT_S, world, V, backends)
    return [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]


def test_two_ranks_equal_one_process(tmp_path):
    for errors, _ in _spawn(tmp_path, 2, 301, ("torch", "triton")):
        assert max(errors.values()) <= ATOL, errors


@pytest.mark.slow
def test_four_ranks_with_an_empty_shard_and_traffic_that_does_not_grow_with_the_vocabulary(tmp_path):
    traffic = []
    for V in (301, 602):
        (tmp_path / str(V)).mkdir()
        results = _spawn(tmp_path / str(V), 4, V, ("torch",))
        for errors, _ in results:
            assert max(errors.values()) <= ATOL, errors
        traffic.append(results[0][1])
    assert traffic[0] == traffic[1]  # the same bytes for twice the vocabulary


def _loss_call(inputs, backend, **shard):
    """grpo_fast.loss with the served divergence beside the policy-gradient loss (RL + distillation in one call):
    the loss, the per-token log-probs, the distillation metric, dH, dW and db."""
    hidden, weight, bias, mask, targets, teacher = inputs
    h, w, b = (x.clone().requires_grad_() for x in (hidden, weight, bias))
    advantages = torch.linspace(-1.0, 1.0, B)
    loss, metrics = grpo_fast.loss(
        h, w, targets, advantages, mask, bias=b, temperature=0.8, backend=backend, teacher=teacher,
        distillation_coef=0.5, distillation_beta=0.0, **shard,
    )  # fmt: skip
    loss.backward()
    values = (loss, metrics.logprobs, metrics["distillation_loss"])
    return values, (h.grad, w.grad, b.grad)


def _loss_rank(rank, port, out_dir, world, V):
    with gloo_group(rank, world, port):
        import torch.distributed as dist

        edges = splits(V, world)
        rows = slice(edges[rank], edges[rank + 1])
        inputs = _inputs(V)
        hidden, weight, bias, mask, targets, teacher = inputs
        errors = {}
        for backend in ("torch", "triton"):
            whole, whole_grads = _loss_call(inputs, backend)
            shard = grpo_fast.VocabShard(dist.group.WORLD, edges[rank], V)
            part, part_grads = _loss_call(
                (hidden, weight[rows], bias[rows], mask, targets, teacher), backend, vocab_parallel=shard
            )
            errors[backend] = max(
                [max_error(a, e) for a, e in zip(part, whole)]
                + [max_error(part_grads[0], whole_grads[0])]
                + [max_error(p, e[rows]) for p, e in zip(part_grads[1:], whole_grads[1:])]
            )
            errors[backend + "/scale"] = float(whole_grads[1].abs().max())  # the gradients are not all zero
        torch.save(errors, os.path.join(out_dir, f"rank{rank}.pt"))


def test_loss_with_a_served_teacher_on_two_ranks_equals_one_process(tmp_path):
    spawn_ranks(_loss_rank, 2, str(tmp_path), TIMEOUT_S, 2, 301)
    for rank in range(2):
        errors = torch.load(tmp_path / f"rank{rank}.pt")
        for backend in ("torch", "triton"):
            assert errors[backend + "/scale"] > 1e-3, errors
            assert errors[backend] <= ATOL, errors
