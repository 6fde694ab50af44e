"""grpo_fast.sampler_logprobs at torch's boundary: fake CPU and meta tensors (the ops' fake implementations, no value
read, gradients of the real shapes), torch.compile of a step (one graph over dynamic shapes, equal to eager), and
its host synchronisations (as ``logprobs``': one with the value checks, none without; the sampling parameters'
check of each target's kept set after the forward is a second, and top-p's staged selection reads on the host which
rows its candidates resolved)."""

import pytest
import torch
import torch._dynamo
from conftest import backend_device
from test_host_syncs import count_syncs
from torch._dynamo.utils import counters
from torch._subclasses.fake_tensor import FakeTensorMode

import grpo_fast

B, T, D, V = 2, 5, 16, 40
SUPPORTS = {"top_k": dict(top_k=5), "top_p": dict(top_p=0.9), "kept_ids": dict(kept_ids=True)}


def _inputs(dtype, device="cpu", weight_grad=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, D, generator=g).to(device, dtype).requires_grad_()
    weight = (torch.randn(V, D, generator=g) * 0.3).to(device, dtype).requires_grad_(weight_grad)
    targets = torch.randint(0, V, (B, T), generator=g).to(device)
    mask = torch.ones(B, T, dtype=torch.bool, device=device)
    return hidden, weight, targets, mask


def _drawable(hidden, weight):
    """Each row's most likely token: in every kept set."""
    return grpo_fast.reference.logits(hidden.detach().float(), weight.detach().float()).argmax(-1)


def _support(name, targets):
    """The case's keywords: replayed sets of the target and six others, padded with -1."""
    if name != "kept_ids":
        return SUPPORTS[name]
    others = (targets[..., None] + torch.arange(1, 7, device=targets.device)) % V
    filling = torch.full((*targets.shape, 2), -1, dtype=torch.int64, device=targets.device)
    return dict(kept_ids=torch.cat([targets[..., None], others, filling], -1))


def _check_shapes(hidden, weight, targets, mask, backend, name):
    out = grpo_fast.sampler_logprobs(
        hidden, weight, targets, mask, backend=backend, check_values=False, **_support(name, targets)
    )
    assert all(x.shape == (B, T) and x.dtype == torch.float32 for x in out)
    grads = torch.autograd.grad((out.logprobs + out.support_logprobs).sum(), [hidden, weight])
    assert grads[0].shape == hidden.shape and grads[0].dtype == hidden.dtype
    assert grads[1].shape == weight.shape and grads[1].dtype == weight.dtype
    return out


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("name", list(SUPPORTS))
def test_fake_cpu_tensors(backend, name):
    with FakeTensorMode():
        out = _check_shapes(*_inputs(torch.bfloat16), backend, name)
        assert type(out.support_logprobs).__name__ == "FakeTensor"


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("name", list(SUPPORTS))
def test_meta_tensors(backend, name):
    out = _check_shapes(*_inputs(torch.float32, "meta"), backend, name)
    assert out.support_logprobs.device.type == "meta"


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("name", ["top_k", "kept_ids"])
def test_compiled_step_is_one_graph_and_equals_eager(backend, name, device):
    dev = backend_device(backend, device)

    def step(hidden, weight, targets, mask, support):
        out = grpo_fast.sampler_logprobs(hidden, weight, targets, mask, backend=backend, check_values=False, **support)
        (out.logprobs - 2 * out.support_logprobs).sum().backward()
        return out.support_logprobs.detach(), out.log_kept_mass.detach()

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(step, fullgraph=True, dynamic=True, backend="aot_eager")
    with torch._dynamo.config.patch(trace_autograd_ops=True):
        for seed in range(2):
            hidden, weight, targets, mask = _inputs(torch.float32, dev, seed=seed)
            targets = _drawable(hidden, weight)
            mask[1, seed + 2 :] = False
            support = _support(name, targets)
            results = []
            for fn in (step, compiled):
                hidden.grad = weight.grad = None
                values = fn(hidden, weight, targets, mask, support)
                results.append((*values, hidden.grad.clone(), weight.grad.clone()))
            for eager, traced in zip(*results):
                torch.testing.assert_close(traced, eager, rtol=1e-5, atol=1e-6)
    assert counters["stats"]["unique_graphs"] == 1
    assert sum(counters["recompiles"].values()) == 0


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("name", list(SUPPORTS))
def test_host_synchronisations(backend, name, monkeypatch, device):
    dev = backend_device(backend, device)
    hidden, weight, targets, mask = _inputs(torch.float32, dev)
    mask[0, 3:] = False
    targets = _drawable(hidden, weight)
    support = _support(name, targets)

    def run(check_values, fn=grpo_fast.sampler_logprobs, **support):
        out = fn(hidden, weight, targets, completion_mask=mask, backend=backend, check_values=check_values, **support)
        (out[0] + out[1]).sum().backward()

    _, with_checks = count_syncs(lambda: run(True, **support), monkeypatch)
    _, without = count_syncs(lambda: run(False, **support), monkeypatch)
    if name == "kept_ids":  # layer 1's own (the torch backend's twin reads the host in its backward), no more
        _, layer1_with = count_syncs(lambda: run(True, grpo_fast.logprobs_and_entropy), monkeypatch)
        _, layer1_without = count_syncs(lambda: run(False, grpo_fast.logprobs_and_entropy), monkeypatch)
        assert (with_checks, without) == (layer1_with, layer1_without)
        if backend == "triton":
            assert len(with_checks) == 1 and without == [], (with_checks, without)
    elif name == "top_k" and backend == "triton":
        # the tile candidates' path with gradients: which rows the candidates left to the rows' path, read once in the
        # forward and once in the backward (a nonzero each)
        resolved = ["aten.nonzero.default"] * 2
        assert len(with_checks) == 2 + len(resolved) and without == resolved, (with_checks, without)
    elif name == "top_k":
        assert len(with_checks) == 2 and without == [], (with_checks, without)
    else:  # top-p's staged candidates: which rows each stage resolved
        assert without and len(with_checks) == len(without) + 2, (with_checks, without)
