"""Layer 1 (fused linear log-probs) against the full-logits reference: both backends, fp32/bf16/fp16, odd shapes.

The Triton backend runs through Triton's interpreter here (conftest sets TRITON_INTERPRET=1).
"""

import pytest
import torch

import grpo_fast
from grpo_fast import reference
from grpo_fast.autograd import LinearLogprobs

from conftest import assert_grad_close

# the Triton backend has two backward kernels (GRPO_FAST_BWD): chunked g + GEMMs (default), fully fused
BACKENDS = ["triton", "triton-fused", "torch"]


@pytest.fixture(autouse=True)
def _bwd_mode(request, monkeypatch):
    backend = request.node.callspec.params.get("backend", "") if hasattr(request.node, "callspec") else ""
    monkeypatch.setenv("GRPO_FAST_BWD", "fused" if backend == "triton-fused" else "chunked")


def _impl(backend):
    return "triton" if backend.startswith("triton") else backend
# (N-ish as B x T, D, V): none a block multiple, V not a power of two, D not a multiple of 16, one token
# The reference runs in fp64 here: a stricter truth, and immune to the rare imprecise fp32 GEMM that torch's
# CPU BLAS was seen to return for one thread's rows under load (off by 1e-4 in a log-prob).
F64 = torch.float64
SHAPES = [(2, 9, 37, 203), (1, 1, 24, 50), (3, 5, 70, 131)]


def _inputs(B, T, D, V, dtype, scale=0.3, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(B, T, D, generator=g).to(dtype)
    w = (torch.randn(V, D, generator=g) * scale).to(dtype)
    b = (torch.randn(V, generator=g) * 0.5).to(dtype) if bias else None
    y = torch.randint(0, V, (B, T), generator=g)
    return h, w, b, y


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", SHAPES)
def test_forward_and_gradients_match_reference(backend, dtype, shape):
    B, T, D, V = shape
    h, w, b, y = _inputs(B, T, D, V, dtype)
    coef = torch.randn(B * T)  # an arbitrary dL/dlogp
    ent_ref = None
    results = []
    for impl in ("reference", backend):
        leaves = [x.clone().requires_grad_() for x in (h, w, b)]
        if impl == "reference":
            logp, ent = reference.logprobs_and_entropy(*leaves[:2], y, leaves[2], temperature=0.8, compute_dtype=F64)
            logp, ent = logp.reshape(-1), ent.reshape(-1)
        else:
            logp, ent = LinearLogprobs.apply(leaves[0].view(-1, D), leaves[1], leaves[2], y.view(-1), 0.8, True,
                                             _impl(impl))
        (logp * coef).sum().backward()
        results.append((logp.detach(), ent.detach(), *[x.grad for x in leaves]))
    (ref_logp, ent_ref, *ref_grads), (logp, ent, *grads) = results
    torch.testing.assert_close(logp, ref_logp, rtol=1e-5, atol=2e-5)  # fp32 outputs in every dtype
    torch.testing.assert_close(ent, ent_ref, rtol=1e-5, atol=2e-5)
    for name, g, rg in zip(("hidden", "weight", "bias"), grads, ref_grads):
        assert_grad_close(g, rg.float(), dtype, name)


@pytest.mark.parametrize("backend", BACKENDS)
def test_frozen_weight_gets_no_gradient_and_hidden_still_does(backend):
    h, w, b, y = _inputs(2, 4, 20, 77, torch.float32, bias=False)
    h.requires_grad_()
    logp, _ = LinearLogprobs.apply(h.view(-1, 20), w, None, y.view(-1), 1.0, False, _impl(backend))
    logp.sum().backward()
    assert w.grad is None
    h2 = h.detach().clone().requires_grad_()
    reference.logprobs_and_entropy(h2, w, y, compute_dtype=F64)[0].sum().backward()
    torch.testing.assert_close(h.grad, h2.grad, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_extreme_logits_and_minus_inf_bias_give_no_nan(backend):
    # logits of size ~1e4 and a bias that removes most of the vocabulary: log-softmax stays finite and exact
    h, w, _, y = _inputs(2, 3, 16, 300, torch.float32, scale=300.0, bias=False)
    bias = torch.full((300,), float("-inf"))
    bias[::7] = 0.0
    y = (y // 7) * 7
    h.requires_grad_()
    logp, ent = LinearLogprobs.apply(h.view(-1, 16), w, bias, y.view(-1), 1.0, True, _impl(backend))
    logp.sum().backward()
    ref_logp, ref_ent = reference.logprobs_and_entropy(h.detach(), w, y, bias, compute_dtype=F64)
    assert torch.isfinite(logp).all() and torch.isfinite(ent).all() and torch.isfinite(h.grad).all()
    torch.testing.assert_close(logp, ref_logp.reshape(-1), rtol=1e-5, atol=1e-3)
    torch.testing.assert_close(ent, torch.nan_to_num(ref_ent.reshape(-1)), rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("backend", BACKENDS)
def test_logprobs_function_is_fp32_without_grad(backend):
    h, w, b, y = _inputs(2, 5, 33, 150, torch.bfloat16)
    h.requires_grad_()
    logp = grpo_fast.logprobs(h, w, y, bias=b, temperature=0.9, backend=_impl(backend))
    assert logp.shape == (2, 5) and logp.dtype == torch.float32 and not logp.requires_grad
    torch.testing.assert_close(logp, reference.logprobs(h, w, y, b, 0.9, compute_dtype=F64), rtol=1e-5, atol=2e-5)


def test_many_vocab_splits_merge_exactly():
    # one token block and a vocab of many tiles: the forward splits the vocab and merges the partials
    h, w, b, y = _inputs(1, 3, 16, 1000, torch.float32)
    logp = grpo_fast.logprobs(h, w, y, bias=b, backend="triton")
    torch.testing.assert_close(logp, reference.logprobs(h, w, y, b, compute_dtype=F64), rtol=1e-5, atol=1e-5)
