"""torch.compile(step, fullgraph=True) of a training step that calls grpo_fast.logprobs (no grad) and
grpo_fast.loss, forward and backward: one graph (grpo_fast's layers are custom ops, grpo_fast.ops), equal to eager
(1e-5), on the Triton backend (the interpreter here) and the torch backend, with dynamic batch and length (three
shapes, one compilation); and torch.export of the forward (grpo_fast.logprobs) with dynamic batch and length.

The backward runs inside the compiled step (``loss.backward()``: torch._dynamo.config.trace_autograd_ops). The compiled
step's tests are slow (about 40 s a case on two cores): with the "aot_eager" backend (AOTAutograd's joint graph,
no code generation) and with Inductor, the default; the export test is in the fast tier."""

import pytest
import torch
import torch._dynamo
from conftest import backend_device
from torch._dynamo.utils import counters

import grpo_fast

D, V = 16, 37
SHAPES = [(2, 5), (3, 7), (4, 6)]


def _step_and_inputs(backend, options, device):
    """Drawn on CPU (the same numbers on every device), on ``device``."""
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(V, D, generator=g) * 0.3
    ref_weight = (weight + 0.05 * torch.randn(V, D, generator=g)).to(device)
    weight = weight.to(device)

    def step(hidden, targets, mask, advantages):
        ref = grpo_fast.logprobs(hidden, ref_weight, targets, completion_mask=mask, backend=backend)
        loss, metrics = grpo_fast.loss(
            hidden,
            weight,
            targets,
            advantages,
            mask,
            old_logprobs=ref.detach() - 0.1,
            ref_logprobs=ref,
            backend=backend,
            **options,
        )
        loss.backward()
        return loss.detach(), metrics

    batches = []
    for B, T in SHAPES:
        mask = torch.rand(B, T, generator=g) > 0.3
        batches.append(
            (
                torch.randn(B, T, D, generator=g).to(device).requires_grad_(),
                torch.where(mask, torch.randint(0, V, (B, T), generator=g), -100).to(device),
                mask.to(device),
                torch.randn(B, generator=g).to(device),
            )
        )
    return step, batches


def _run(step, batch):
    batch[0].grad = None
    loss, metrics = step(*batch)
    return loss, {name: value.detach() for name, value in metrics.items()}, batch[0].grad.clone()


def _check_one_graph_equals_eager(backend, compiler, options, device):
    torch._dynamo.reset()
    counters.clear()
    step, batches = _step_and_inputs(backend, options, device)
    with torch._dynamo.config.patch(trace_autograd_ops=True):
        compiled = torch.compile(step, fullgraph=True, dynamic=True, backend=compiler)
        for batch in batches:
            loss, metrics, grad = _run(step, batch)
            loss_c, metrics_c, grad_c = _run(compiled, batch)
            torch.testing.assert_close(loss_c, loss, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(grad_c, grad, rtol=1e-5, atol=1e-5)
            assert metrics_c.keys() == metrics.keys()
            for name in metrics:
                torch.testing.assert_close(metrics_c[name], metrics[name], rtol=1e-5, atol=1e-5, equal_nan=True)
    # one graph for the three shapes: no graph break (fullgraph) and no recompilation per batch or length
    assert counters["stats"]["unique_graphs"] == 1
    assert sum(counters["recompiles"].values()) == 0


OPTIONS = [dict(beta=0.04), dict(loss_type="grpo", top_entropy_quantile=0.5, entropy_coef=0.01)]


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("options", OPTIONS, ids=["dapo_kl", "grpo_entropy"])
def test_compiled_step_is_one_graph_and_equals_eager(backend, options, device):
    _check_one_graph_equals_eager(backend, "aot_eager", options, backend_device(backend, device))


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_compiled_step_with_inductor(backend, device):
    _check_one_graph_equals_eager(backend, "inductor", OPTIONS[0], backend_device(backend, device))


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_export_of_logprobs(backend, device):
    dev = backend_device(backend, device)
    g = torch.Generator().manual_seed(1)

    class Head(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter((torch.randn(V, D, generator=g) * 0.3).to(dev), requires_grad=False)

        def forward(self, hidden, targets, mask):
            return grpo_fast.logprobs(hidden, self.weight, targets, completion_mask=mask, backend=backend)

    head = Head()
    batch, length = torch.export.Dim("batch", min=1), torch.export.Dim("length", min=2)
    dims = {0: batch, 1: length}

    def inputs(B, T):
        mask = torch.rand(B, T, generator=g) > 0.3
        return (
            torch.randn(B, T, D, generator=g).to(dev),
            torch.randint(0, V, (B, T), generator=g).to(dev),
            mask.to(dev),
        )

    exported = torch.export.export(head, inputs(2, 5), dynamic_shapes=(dims, dims, dims))
    for B, T in SHAPES:
        x = inputs(B, T)
        # eager reads the scored count and computes those rows; the exported program reads nothing and computes the
        # device partition of all rows (grpo_fast.api): the torch twin's matmuls then see other row counts (fp32
        # rounding of another blocking)
        torch.testing.assert_close(exported.module()(*x), head(*x), rtol=1e-6, atol=1e-6)
