"""grpo_fast.divergence at the boundary with torch, as grpo_fast.loss is there (tests/test_host_syncs.py,
test_fake_tensors.py, test_compile.py): one host synchronisation per call with the value checks (the mask's flags
and the scored-row count, read together), none without them, the same numbers either way; fake and meta tensors
through forward and backward (no value read); torch.compile(fullgraph=True) of a distillation step is one graph,
equal to eager, with dynamic batch and length."""

import pytest
import torch
import torch._dynamo
from conftest import backend_device
from helpers import assert_close_to_scale
from test_host_syncs import count_syncs
from torch._dynamo.utils import counters
from torch._subclasses.fake_tensor import FakeTensorMode

import grpo_fast

V, DS, DT = 37, 16, 24


def _pair(B=3, T=9, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(B, T, generator=g) > 0.3
    mask[-1] = False  # a sequence without tokens
    student_hidden = torch.randn(B, T, DS, generator=g)
    student_hidden[~mask] = float("nan")  # never read: the masked rows are not computed
    return dict(
        student_hidden=student_hidden.to(device).requires_grad_(),
        student_weight=(torch.randn(V, DS, generator=g) * 0.3).to(device).requires_grad_(),
        teacher_hidden=torch.randn(B, T, DT, generator=g).to(device),
        teacher_weight=(torch.randn(V, DT, generator=g) * 0.3).to(device),
        completion_mask=mask.to(device),
    )


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("beta", [1.0, 0.5])
def test_one_host_read_with_the_checks_none_without(backend, beta, monkeypatch, device):
    x = _pair(device=backend_device(backend, device))

    def step(check_values):
        x["student_hidden"].grad = x["student_weight"].grad = None
        div = grpo_fast.divergence(**x, beta=beta, backend=backend, check_values=check_values)
        div.sum().backward()
        return div.detach(), x["student_hidden"].grad.clone(), x["student_weight"].grad.clone()

    (div, grad_h, grad_w), syncs = count_syncs(lambda: step(True), monkeypatch)
    (div_off, grad_h_off, grad_w_off), syncs_off = count_syncs(lambda: step(False), monkeypatch)
    if backend == "triton":
        assert syncs == ["Tensor.tolist"]
        assert syncs_off == []
    else:  # the torch twin on a CPU may read what it likes; the API's own part reads once or never
        assert syncs.count("Tensor.tolist") == 1
    # the device partition (padding rows zeroed, computed, then dropped) gives the exact selection's numbers
    mask = x["completion_mask"]
    assert torch.isfinite(div).all() and (div[~mask] == 0).all() and (div_off[~mask] == 0).all()
    # (to the rounding of each one's scale: dW sums other rows, the GEMMs get other shapes, entries near 0 cancel)
    assert_close_to_scale(div_off, div, 1e-6, "divergence")
    assert_close_to_scale(grad_h_off, grad_h, 1e-5, "d hidden")
    assert_close_to_scale(grad_w_off, grad_w, 1e-5, "d weight")
    assert (grad_h[~mask] == 0).all()
    # and the spec's (the torch backend on CPU copies, leaves as they are)
    x_cpu = {k: v.detach().cpu().requires_grad_(v.requires_grad) for k, v in x.items()}
    expected = grpo_fast.divergence(**x_cpu, beta=beta, backend="torch")
    torch.testing.assert_close(div.cpu(), expected.detach(), rtol=1e-5, atol=1e-6)


def test_a_bad_mask_is_still_named(device):
    x = _pair(device=device)
    with pytest.raises(ValueError, match="completion_mask must be bool or hold only 0 and 1"):
        grpo_fast.divergence(**dict(x, completion_mask=x["completion_mask"].float() * 2), backend="triton")


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("frozen", [False, True], ids=["general", "frozen_head"])
def test_fake_and_meta_tensors_run_forward_and_backward(backend, frozen, device):
    def run(x):
        x["student_weight"].requires_grad_(not frozen)
        div, entropy = grpo_fast.divergence_and_entropy(**x, beta=0.5, backend=backend)
        assert div.shape == entropy.shape == (3, 9) and div.dtype == entropy.dtype == torch.float32
        div.sum().backward()
        assert x["student_hidden"].grad.shape == (3, 9, DS)
        assert (x["student_weight"].grad is None) == frozen
        return div

    dev = backend_device(backend, device)
    with FakeTensorMode():  # fake tensors on the backend's device (fake CUDA ones where the kernels are compiled)
        run(_pair(device=dev))
    if dev.type == "cpu":  # meta tensors: compiled Triton takes CUDA tensors only (the interpreter takes any)
        meta = run(_pair(device="meta"))
        assert meta.device.type == "meta"


def _compiled_equals_eager(step, student_weight, g, dev):
    """``step(student_hidden, teacher_hidden, mask)`` (a loss, its backward) compiled with fullgraph=True and
    dynamic shapes equals eager at three (B, T): the loss, d student_hidden and d student_weight; one graph."""
    torch._dynamo.reset()
    counters.clear()
    with torch._dynamo.config.patch(trace_autograd_ops=True):
        compiled = torch.compile(step, fullgraph=True, dynamic=True, backend="aot_eager")
        for B, T in [(2, 5), (3, 7), (4, 6)]:
            inputs = (
                torch.randn(B, T, DS, generator=g).to(dev).requires_grad_(),
                torch.randn(B, T, DT, generator=g).to(dev),
                (torch.rand(B, T, generator=g) > 0.3).to(dev),
            )
            results = []
            for fn in (step, compiled):
                inputs[0].grad = student_weight.grad = None
                results.append((fn(*inputs), inputs[0].grad.clone(), student_weight.grad.clone()))
            for eager, comp in zip(*results, strict=True):
                torch.testing.assert_close(comp, eager, rtol=1e-5, atol=1e-5)
    assert counters["stats"]["unique_graphs"] == 1


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_compiled_distillation_step_is_one_graph_equal_to_eager(backend, device):
    dev = backend_device(backend, device)
    g = torch.Generator().manual_seed(1)
    student_weight = (torch.randn(V, DS, generator=g) * 0.3).to(dev).requires_grad_()
    teacher_weight = (torch.randn(V, DT, generator=g) * 0.3).to(dev)

    def step(student_hidden, teacher_hidden, mask):
        div = grpo_fast.divergence(
            student_hidden,
            student_weight,
            teacher_hidden,
            teacher_weight,
            mask,
            beta=0.5,
            temperature=0.9,
            backend=backend,
        )
        loss = div.sum() / mask.sum()
        loss.backward()
        return loss.detach()

    _compiled_equals_eager(step, student_weight, g, dev)


# ----------------------------------------------------------------------------------------------- distillation_loss
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_distillation_loss_reads_the_host_once_with_the_checks_none_without(backend, monkeypatch, device):
    x = _pair(device=backend_device(backend, device))

    def step(check_values):
        x["student_hidden"].grad = x["student_weight"].grad = None
        loss, _, _ = grpo_fast.distillation_loss(**x, beta=0.5, backend=backend, check_values=check_values)
        loss.backward()
        return loss.detach(), x["student_hidden"].grad.clone(), x["student_weight"].grad.clone()

    on, syncs = count_syncs(lambda: step(True), monkeypatch)
    off, syncs_off = count_syncs(lambda: step(False), monkeypatch)
    if backend == "triton":
        assert syncs == ["Tensor.tolist"]
        assert syncs_off == []
    else:
        assert syncs.count("Tensor.tolist") == 1
    for name, a, b in zip(("loss", "d hidden", "d weight"), off, on, strict=True):  # other rows: to each one's scale
        assert_close_to_scale(a, b, 1e-5, name)
    assert torch.isfinite(on[0]) and (on[1][~x["completion_mask"]] == 0).all()


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("frozen", [False, True], ids=["trained", "frozen_head"])
def test_distillation_loss_on_fake_and_meta_tensors(backend, frozen, device):
    def run(x):
        x["student_weight"].requires_grad_(not frozen)
        loss, div, entropy = grpo_fast.distillation_loss(**x, beta=1.0, backend=backend, num_items_in_batch=20)
        assert loss.shape == () and div.shape == entropy.shape == (3, 9) and loss.dtype == torch.float32
        loss.backward()
        assert x["student_hidden"].grad.shape == (3, 9, DS)
        assert (x["student_weight"].grad is None) == frozen
        return loss

    dev = backend_device(backend, device)
    with FakeTensorMode():
        run(_pair(device=dev))
    if dev.type == "cpu":
        assert run(_pair(device="meta")).device.type == "meta"


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_compiled_distillation_loss_is_one_graph_equal_to_eager(backend, device):
    dev = backend_device(backend, device)
    g = torch.Generator().manual_seed(2)
    student_weight = (torch.randn(V, DS, generator=g) * 0.3).to(dev).requires_grad_()
    teacher_weight = (torch.randn(V, DT, generator=g) * 0.3).to(dev)

    def step(student_hidden, teacher_hidden, mask):
        loss, _, _ = grpo_fast.distillation_loss(
            student_hidden, student_weight, teacher_hidden, teacher_weight, mask, beta=0.5, backend=backend
        )
        loss.backward()
        return loss.detach()

    _compiled_equals_eager(step, student_weight, g, dev)
