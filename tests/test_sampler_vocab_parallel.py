"""grpo_fast.sampler_logprobs on a vocab-parallel head (grpo_fast.sampler.vocab_parallel) on 2 and 4 CPU processes
(gloo) equals one process: the three outputs, dH and the rank's dW and db rows, for each sampling rule and replayed
kept sets, on the torch backend and the Triton kernels (under the interpreter); top-p's rows that no candidate count
resolves (a flat distribution whose kept set outgrows 1024 candidates a shard) take the bisection. Each collective's
bytes are counted: they grow with the tokens and the candidates, never with the vocabulary. And the bisection
itself, on one process, against the spec's kept sets."""

import os

import pytest
import torch
from helpers import gloo_group, spawn_ranks
from test_vocab_parallel import CollectiveBytes, max_error, splits

import grpo_fast
from grpo_fast import reference
from grpo_fast.backends import support_twin
from grpo_fast.kernels.operands import SamplerSupport

pytestmark = pytest.mark.interpreter_only

ATOL = 2e-5
TIMEOUT_S = 300
B, T, D = 2, 5, 12
CASES = {
    "top_k": (0.5, dict(top_k=6)),
    "top_p": (0.5, dict(top_p=0.8)),
    "min_p": (0.5, dict(min_p=0.05)),
    "all-three": (0.5, dict(top_k=30, top_p=0.9, min_p=0.01)),
    "kept_ids": (0.5, dict(kept_ids=True)),
    # near-uniform logits: top-p keeps most of the vocabulary, past every candidate count of a shard
    "top_p-bisected": (0.01, dict(top_p=0.9)),
}


def _inputs(V, scale, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, D, generator=g)
    weight = torch.randn(V, D, generator=g) * scale
    bias = torch.randn(V, generator=g) * scale
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[1, 3:] = False
    z = reference.logits(hidden, weight, bias, 0.8, compute_dtype=torch.float64)
    targets = z.argmax(-1)  # in every kept set
    kept = reference.kept_mask(z, top_p=0.7)
    kept_ids = (
        torch.where(kept, torch.arange(V), -1).sort(dim=-1, descending=True).values[..., : int(kept.sum(-1).max())]
    )
    return hidden, weight, bias, targets, mask, kept_ids


def _call(hidden, weight, bias, targets, mask, kept_ids, backend, params, **shard):
    params = dict(kept_ids=kept_ids) if "kept_ids" in params else params
    h, w, b = (x.clone().requires_grad_() for x in (hidden, weight, bias))
    out = grpo_fast.sampler_logprobs(h, w, targets, mask, bias=b, temperature=0.8, backend=backend, **params, **shard)
    g = torch.Generator().manual_seed(1)
    (
        (out.logprobs * torch.randn(B, T, generator=g)).sum()
        + (out.support_logprobs * torch.randn(B, T, generator=g)).sum()
    ).backward()
    return out, (h.grad, w.grad, b.grad)


def _rank(rank, port, out_dir, world, V, names, backends, triton_names=None):
    """``V``: the head's rows, or a case's rows by its name."""
    with gloo_group(rank, world, port):
        import torch.distributed as dist

        errors, traffic = {}, {}
        for name in names:
            vocab = V[name] if isinstance(V, dict) else V
            edges = splits(vocab, world)
            rows = slice(edges[rank], edges[rank + 1])
            scale, params = CASES[name]
            hidden, weight, bias, targets, mask, kept_ids = _inputs(vocab, scale)
            for backend in backends:
                if backend == "triton" and triton_names is not None and name not in triton_names:
                    continue
                whole, whole_grads = _call(hidden, weight, bias, targets, mask, kept_ids, backend, params)
                shard = grpo_fast.VocabShard(dist.group.WORLD, edges[rank], vocab)
                with CollectiveBytes() as counted:
                    part, part_grads = _call(
                        hidden, weight[rows], bias[rows], targets, mask, kept_ids, backend, params, vocab_parallel=shard
                    )
                errors[f"{name}/{backend}"] = max(
                    [max_error(a, e) for a, e in zip(part, whole)]
                    + [
                        max_error(part_grads[0], whole_grads[0]),
                        max_error(part_grads[1], whole_grads[1][rows]),
                        max_error(part_grads[2], whole_grads[2][rows]),
                    ]
                )
                traffic[f"{name}/{backend}"] = counted.bytes
        torch.save((errors, traffic), os.path.join(out_dir, f"rank{rank}.pt"))


def _spawn(tmp_path, world, V, names, backends=("torch", "triton"), triton_names=None):
    spawn_ranks(_rank, world, str(tmp_path), TIMEOUT_S, world, V, names, backends, triton_names)
    return [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]


# the head's rows by case (splits: a third on rank 0, the rest on rank 1). Top-p's candidates come 64, then 1024 a
# shard: at 2207 rows rank 1's 1472 rows outnumber both counts, so top-p resolves rows at 64 and at 1024 candidates
# with a finite bound on rank 1 and the flat case takes the bisection past both. The other rules' paths are the same
# at 307 rows (each shard past top-p's 64 candidates and every top-k here), at a seventh of the Triton kernels' work
# (the rows' sweeps, one program a row, 128 columns a step under the interpreter)
VOCAB = {"top_p": 2 * 1100 + 7, "top_p-bisected": 2 * 1100 + 7}
SMALL_VOCAB = 307

# the fast tier: one rule of each path (the candidates, the bisection, replayed sets), the Triton kernels (under the
# interpreter: minutes) on the candidates' path only; the rest, and the Triton kernels on every rule, in the slow one
FAST = ["top_p", "top_p-bisected", "kept_ids"]
FAST_TRITON = ["top_p"]


@pytest.mark.parametrize(
    "names, backends, triton_names",
    [
        (FAST, ("torch", "triton"), FAST_TRITON),
        pytest.param([n for n in CASES if n not in FAST], ("torch", "triton"), None, marks=pytest.mark.slow),
        pytest.param([n for n in FAST if n not in FAST_TRITON], ("triton",), None, marks=pytest.mark.slow),
    ],
    ids=["fast", "rest", "fast-rules-triton"],
)
def test_two_ranks_equal_one_process(tmp_path, names, backends, triton_names):
    results = _spawn(tmp_path, 2, {name: VOCAB.get(name, SMALL_VOCAB) for name in names}, names, backends, triton_names)
    for errors, _ in results:
        assert max(errors.values()) <= ATOL, errors


@pytest.mark.slow
def test_four_ranks_with_an_empty_shard_and_traffic_that_does_not_grow_with_the_vocabulary(tmp_path):
    traffic = []
    for V in (301, 602):
        (tmp_path / str(V)).mkdir()
        results = _spawn(tmp_path / str(V), 4, V, ["top_k", "top_p", "kept_ids"], ("torch",))
        for errors, _ in results:
            assert max(errors.values()) <= ATOL, errors
        traffic.append(results[0][1])
    assert traffic[0] == traffic[1]  # the same bytes for twice the vocabulary


@pytest.mark.parametrize("params", [dict(top_p=0.9), dict(top_p=0.5, min_p=0.01), dict(top_k=200, top_p=0.95)])
def test_bisection_is_the_spec(params):
    class WithoutWholeRows(support_twin.OneProcess):
        complete_rows = False

    g = torch.Generator().manual_seed(0)
    z = torch.randn(16, 3000, generator=g) * torch.tensor([0.01, 0.3, 1.0, 4.0]).repeat(4)[:, None]
    support = SamplerSupport(**params)
    tau = support_twin.kept_threshold(z, support, z.amax(-1), z.shape[-1], WithoutWholeRows())
    assert torch.equal(z >= tau[:, None], reference.kept_mask(z.double(), **params))
