"""Layer 1 (fused linear log-probs and entropy) against the full-logits reference, forward and every gradient.

Both backends (the Triton backend with both backward kernels), fp32 / bf16 / fp16, odd shapes, the logit
transforms (temperature, soft-cap, logit scale, bias), losses on the log-probs, on the entropies and on both,
masked rows and one-token completions. The Triton backend runs through Triton's interpreter here (conftest sets
TRITON_INTERPRET=1) on a machine without CUDA, compiled on a CUDA GPU (the ``device`` fixture); the torch backend
runs on CPU. The reference runs in fp64: a stricter truth, and immune to the rare imprecise fp32 GEMM
that torch's CPU BLAS was seen to return for one thread's rows under load (off by 1e-4 in a log-prob).
"""

import pytest
import torch
from conftest import assert_grad_close, backend_device
from helpers import head_inputs, randn

import grpo_fast
from grpo_fast import reference

# the Triton backend has two backward kernels (config.BACKWARD_MODES): chunked g + GEMMs (default), fully fused
BACKENDS = ["triton", "triton-fused", "torch"]
F64 = torch.float64
# (B, T, D, V): none a block multiple, V not a power of two, D not a multiple of 16, one token
SHAPES = [(2, 9, 37, 203), (1, 1, 24, 50), (3, 5, 70, 131)]


def _impl(backend):
    return "triton" if backend.startswith("triton") else backend


def _mode(backend):
    """The backward_mode of a BACKENDS entry."""
    return "fused" if backend == "triton-fused" else "chunked"


def _head_choice(backend):
    """The backend and backward_mode keywords of a BACKENDS entry."""
    return dict(backend=_impl(backend), backward_mode=_mode(backend))


def _check(backend, dtype, h, w, b, y, *, grad_logp, grad_entropy, completion_mask=None, **transform):
    """grpo_fast.logprobs_and_entropy vs the fp64 reference: outputs, and the gradients of
    sum(grad_logp * logp + grad_entropy * entropy) (either may be None: that output gets no gradient)."""
    results = []
    for impl in ("reference", backend):
        leaves = [x.clone().requires_grad_() if x is not None else None for x in (h, w, b)]
        if impl == "reference":
            logp, ent = reference.logprobs_and_entropy(
                leaves[0], leaves[1], y.clamp(min=0), leaves[2], compute_dtype=F64, **transform
            )
            if completion_mask is not None:
                logp, ent = logp * completion_mask, ent * completion_mask
        else:
            logp, ent = grpo_fast.logprobs_and_entropy(
                leaves[0],
                leaves[1],
                y,
                bias=leaves[2],
                completion_mask=completion_mask,
                **_head_choice(impl),
                **transform,
            )
        total = sum((c * x).sum() for c, x in ((grad_logp, logp), (grad_entropy, ent)) if c is not None)
        total.backward()
        results.append((logp.detach(), ent.detach(), [x.grad if x is not None else None for x in leaves]))
    (ref_logp, ref_ent, ref_grads), (logp, ent, grads) = results
    assert logp.dtype == ent.dtype == torch.float32
    torch.testing.assert_close(logp, ref_logp, rtol=1e-5, atol=2e-5)  # fp32 outputs in every dtype
    torch.testing.assert_close(ent, ref_ent, rtol=1e-5, atol=2e-5)
    for name, g, rg in zip(("hidden", "weight", "bias"), grads, ref_grads):
        if rg is not None:
            assert_grad_close(g, rg.float(), dtype, name)
    return logp, ent, grads


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", SHAPES)
def test_forward_and_gradients_match_reference(backend, dtype, shape, device):
    # a loss on both outputs with random coefficients: dL/dlogp and dL/dentropy both reach hidden, weight, bias
    B, T, D, V = shape
    dev = backend_device(backend, device)
    h, w, b, y = head_inputs(B, T, D, V, dtype, device=dev)
    g = torch.Generator().manual_seed(1)
    _check(
        backend,
        dtype,
        h,
        w,
        b,
        y,
        grad_logp=randn(B, T, generator=g, device=dev),
        grad_entropy=randn(B, T, generator=g, device=dev),
        temperature=0.8,
    )


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("loss_on", ["logprobs", "entropy"])
def test_a_loss_on_one_output_only(backend, dtype, loss_on, device):
    dev = backend_device(backend, device)
    h, w, b, y = head_inputs(2, 7, 40, 157, dtype, device=dev)
    coef = randn(2, 7, generator=torch.Generator().manual_seed(2), device=dev)
    _check(
        backend,
        dtype,
        h,
        w,
        b,
        y,
        grad_logp=coef if loss_on == "logprobs" else None,
        grad_entropy=coef if loss_on == "entropy" else None,
        temperature=1.3,
    )


# Gemma 2's soft-cap is 30: weights of scale 40 make logits of ~200, most of tanh saturated; a small cap with a
# logit scale and a temperature; a logit scale alone (Granite divides by logits_scaling; Cohere's is 0.0625)
TRANSFORMS = {
    "softcap-saturated": (40.0, dict(softcap=30.0)),
    "softcap-scale-temperature": (1.0, dict(softcap=2.0, logit_scale=1.7, temperature=0.7)),
    "logit-scale": (1.0, dict(logit_scale=0.0625)),
    "negative-logit-scale": (0.3, dict(logit_scale=-1.5, temperature=1.2)),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("transform", list(TRANSFORMS))
def test_logit_transforms(backend, dtype, transform, device):
    weight_scale, kw = TRANSFORMS[transform]
    dev = backend_device(backend, device)
    h, w, b, y = head_inputs(2, 6, 37, 203, dtype, scale=weight_scale, device=dev)
    g = torch.Generator().manual_seed(3)
    _check(
        backend,
        dtype,
        h,
        w,
        b,
        y,
        grad_logp=randn(2, 6, generator=g, device=dev),
        grad_entropy=randn(2, 6, generator=g, device=dev),
        **kw,
    )


def test_softcap_really_saturates_in_the_saturated_case():
    # the test above is only meaningful if tanh saturates: most logits of that case sit beyond |tanh| = 0.999
    weight_scale, kw = TRANSFORMS["softcap-saturated"]
    h, w, b, _ = head_inputs(2, 6, 37, 203, torch.float32, scale=weight_scale)
    raw = (h @ w.T + b) / kw["softcap"]
    assert (torch.tanh(raw).abs() > 0.999).float().mean() > 0.5


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_masked_rows_and_one_token_completions(backend, dtype, device):
    # only rows with mask 1 are computed; masked targets are never read (-100 as TRL's labels), masked outputs
    # and their gradients are exact zeros
    dev = backend_device(backend, device)
    h, w, b, y = head_inputs(3, 8, 37, 131, dtype, device=dev)
    mask = torch.ones(3, 8, dtype=torch.bool, device=dev)
    mask[0, 5:] = False
    mask[1] = False
    mask[2, 1:] = False  # a one-token completion
    y = y.masked_fill(~mask, -100)
    g = torch.Generator().manual_seed(4)
    logp, ent, grads = _check(
        backend,
        dtype,
        h,
        w,
        b,
        y,
        grad_logp=randn(3, 8, generator=g, device=dev),
        grad_entropy=randn(3, 8, generator=g, device=dev),
        completion_mask=mask,
        temperature=0.9,
    )
    assert torch.count_nonzero(logp[~mask]) == 0 and torch.count_nonzero(ent[~mask]) == 0
    assert torch.count_nonzero(grads[0][~mask]) == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_all_rows_masked_gives_zeros_and_zero_gradients(backend, device):
    dev = backend_device(backend, device)
    h, w, b, y = head_inputs(2, 4, 20, 77, torch.float32, device=dev)
    leaves = [x.clone().requires_grad_() for x in (h, w, b)]
    mask = torch.zeros(2, 4, dtype=torch.bool, device=dev)
    logp, ent = grpo_fast.logprobs_and_entropy(
        leaves[0], leaves[1], y, bias=leaves[2], completion_mask=mask, **_head_choice(backend)
    )
    (logp.sum() + ent.sum()).backward()
    assert torch.count_nonzero(logp) == 0 and torch.count_nonzero(ent) == 0
    assert all(x.grad is not None and torch.count_nonzero(x.grad) == 0 for x in leaves)
    assert torch.count_nonzero(grpo_fast.logprobs(h, w, y, bias=b, completion_mask=mask, backend=_impl(backend))) == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_frozen_weight_gets_no_gradient_and_hidden_still_does(backend, device):
    h, w, _, y = head_inputs(2, 4, 20, 77, torch.float32, bias=False, device=backend_device(backend, device))
    h.requires_grad_()
    logp, ent = grpo_fast.logprobs_and_entropy(h, w, y, **_head_choice(backend))
    (logp.sum() + 0.1 * ent.sum()).backward()
    assert w.grad is None
    h2 = h.detach().clone().requires_grad_()
    ref_logp, ref_ent = reference.logprobs_and_entropy(h2, w, y, compute_dtype=F64)
    (ref_logp.sum() + 0.1 * ref_ent.sum()).backward()
    assert_grad_close(h.grad, h2.grad, torch.float32, "hidden")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("softcap", [None, 5.0])
def test_extreme_logits_and_minus_inf_bias_give_no_nan(backend, softcap, device):
    # logits of size ~1e4 and a bias that removes most of the vocabulary: log-softmax stays finite and exact, and so
    # does the entropy's gradient, whose p (mean - z) would be 0 * inf at a -inf logit. With a soft-cap the removed
    # entries sit at -softcap / temperature (tanh(-inf) = -1), as in the reference and TRL.
    dev = backend_device(backend, device)
    h, w, _, y = head_inputs(2, 3, 16, 300, torch.float32, scale=300.0, bias=False, device=dev)
    bias = torch.full((300,), float("-inf"), device=dev)
    bias[::7] = 0.0
    y = (y // 7) * 7
    h.requires_grad_()
    logp, ent = grpo_fast.logprobs_and_entropy(h, w, y, bias=bias, softcap=softcap, **_head_choice(backend))
    (logp.sum() + ent.sum()).backward()
    h2 = h.detach().clone().requires_grad_()
    ref_logp, ref_ent = reference.logprobs_and_entropy(h2, w, y, bias, softcap=softcap, compute_dtype=F64)
    (ref_logp.sum() + ref_ent.sum()).backward()
    assert torch.isfinite(logp).all() and torch.isfinite(ent).all() and torch.isfinite(h.grad).all()
    torch.testing.assert_close(logp, ref_logp, rtol=1e-5, atol=1e-3)
    torch.testing.assert_close(ent, ref_ent, rtol=1e-4, atol=1e-3)
    torch.testing.assert_close(h.grad, h2.grad.float(), rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("backend", BACKENDS)
def test_logprobs_function_is_fp32_without_grad(backend, device):
    h, w, b, y = head_inputs(2, 5, 33, 150, torch.bfloat16, device=backend_device(backend, device))
    h.requires_grad_()
    logp = grpo_fast.logprobs(h, w, y, bias=b, temperature=0.9, softcap=3.0, logit_scale=0.8, backend=_impl(backend))
    assert logp.shape == (2, 5) and logp.dtype == torch.float32 and not logp.requires_grad
    expected = reference.logprobs(h, w, y, b, 0.9, softcap=3.0, logit_scale=0.8, compute_dtype=F64)
    torch.testing.assert_close(logp, expected, rtol=1e-5, atol=2e-5)


def test_grouped_program_order_computes_every_tile_once(device):
    # the fused backward with dW runs its programs in groups of vocabulary tiles (config.BackwardConfig.group_v; 2
    # under the interpreter): V = 131 is 5 tiles of 32, the last group and tile partial; 75 tokens are 5 token
    # blocks of 16. A tile skipped or computed twice would miss or double its dH rows, dW rows and db entries.
    h, w, b, y = head_inputs(3, 25, 24, 131, torch.float32, device=device)
    g = torch.Generator().manual_seed(5)
    _check(
        "triton-fused",
        torch.float32,
        h,
        w,
        b,
        y,
        grad_logp=torch.randn(3, 25, generator=g).to(device),
        grad_entropy=torch.randn(3, 25, generator=g).to(device),
        temperature=0.9,
    )


def test_many_vocab_splits_merge_exactly(device):
    # one token block and a vocab of many tiles: the forward splits the vocab and merges the partials
    h, w, b, y = head_inputs(1, 3, 16, 1000, torch.float32, device=device)
    logp = grpo_fast.logprobs(h, w, y, bias=b, backend="triton")
    torch.testing.assert_close(logp, reference.logprobs(h, w, y, b, compute_dtype=F64), rtol=1e-5, atol=1e-5)


BAD_TRANSFORMS = [
    (dict(softcap=0.0), "softcap must be None or a positive number"),
    (dict(softcap=-30.0), "softcap must be None or a positive number"),
    (dict(softcap=float("inf")), "softcap must be None or a positive number"),
    (dict(logit_scale=0.0), "logit_scale must be a finite non-zero number"),
    (dict(logit_scale=float("nan")), "logit_scale must be a finite non-zero number"),
    (dict(logit_scale=float("inf")), "logit_scale must be a finite non-zero number"),
    (dict(temperature=0.0), "temperature must be a positive number"),
]


@pytest.mark.parametrize("kw, message", BAD_TRANSFORMS)
def test_bad_transform_raises_a_value_error_naming_the_argument(kw, message, device):
    h, w, b, y = head_inputs(1, 2, 8, 11, torch.float32, device=device)
    for fn in (grpo_fast.logprobs_and_entropy, grpo_fast.logprobs):
        with pytest.raises(ValueError, match=message):
            fn(h, w, y, **kw)
    with pytest.raises(ValueError, match=message):
        grpo_fast.loss(h, w, y, torch.zeros(1, device=device), torch.ones(1, 2, device=device), **kw)


def test_the_fused_case_runs_the_fused_backward(monkeypatch, device):
    # backward_mode="fused" (the "triton-fused" cases above) reaches backward_fused, not backward_chunked
    from grpo_fast.kernels import backward as kbackward

    calls = []
    monkeypatch.setattr(kbackward, "backward_chunked", lambda *a: calls.append("chunked"))
    original = kbackward.backward_fused
    monkeypatch.setattr(kbackward, "backward_fused", lambda *a: calls.append("fused") or original(*a))
    h, w, b, y = head_inputs(1, 3, 24, 50, torch.float32, device=device)
    logp, _ = grpo_fast.logprobs_and_entropy(h, w.requires_grad_(), y, bias=b, backend="triton", backward_mode="fused")
    logp.sum().backward()
    assert calls == ["fused"]
