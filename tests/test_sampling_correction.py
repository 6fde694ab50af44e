"""The sampler's importance weights over its support: ``loss(sampling_correction=...)`` against the spec's composition
(reference.sampler_logprobs' support log-probs, reference.sampling_importance_weights, reference.loss), the ratio's
mean 1 when policy and sampler are one model (TRL 1.16's full-vocabulary ratio is the kept mass there), and its
named errors."""

import pytest
import torch
from conftest import assert_grad_close, backend_device
from helpers import head_inputs

import grpo_fast
from grpo_fast import reference

F64 = torch.float64
BACKENDS = ["triton", "torch"]


def _sampled(dtype, device, params, B=4, T=6, D=24, V=90, temperature=1.0):
    """A batch whose tokens a sampler with ``params`` drew from the policy itself, with the sampler's processed
    log-probs (the spec's support log-probs: what vLLM returns for the same model)."""
    h, w, b, _ = head_inputs(B, T, D, V, dtype, scale=0.5, device=device)
    z = reference.logits(h, w, b, temperature, compute_dtype=F64)
    if "kept_ids" in params:
        keep = reference.kept_mask(z, top_p=0.8)
        params = dict(kept_ids=torch.where(keep, torch.arange(V, device=device), -1))
    else:
        keep = reference.kept_mask(z, **params)
    q = torch.where(keep, torch.softmax(z, -1), 0.0).reshape(-1, V)
    y = torch.multinomial(q.cpu(), 1, generator=torch.Generator().manual_seed(3)).reshape(B, T).to(device)
    _, sampling, _ = reference.sampler_logprobs(h, w, y, b, temperature, compute_dtype=F64, **params)
    mask = torch.ones(B, T, dtype=torch.bool, device=device)
    mask[1, 4:] = False
    advantages = torch.randn(B, generator=torch.Generator().manual_seed(4)).to(device)
    return h, w, b, y, mask, advantages, sampling.float(), params


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "params",
    [dict(top_p=0.9), dict(top_k=8), dict(min_p=0.1), dict(kept_ids=True)],
    ids=["top_p", "top_k", "min_p", "kept"],
)
@pytest.mark.parametrize("mode", ["token_truncate", "sequence_mask"])
def test_loss_with_the_correction_matches_the_spec(backend, dtype, params, mode, device):
    dev = backend_device(backend, device)
    h, w, b, y, mask, adv, sampling, params = _sampled(dtype, dev, params)
    correction = grpo_fast.SamplingCorrection(sampling, mode=mode, **params)
    results = []
    for impl in ("reference", backend):
        leaves = [x.clone().requires_grad_() for x in (h, w, b)]
        if impl == "reference":
            with torch.no_grad():
                _, support, _ = reference.sampler_logprobs(*leaves[:2], y, leaves[2], compute_dtype=F64, **params)
            weights = reference.sampling_importance_weights(support * mask, sampling, mask, mode=mode)
            loss, _ = reference.loss(*leaves[:2], y, adv, mask, bias=leaves[2], importance_weights=weights, beta=0.0)
        else:
            loss, _ = grpo_fast.loss(
                *leaves[:2], y, adv, mask, bias=leaves[2], sampling_correction=correction, backend=backend
            )
        loss.backward()
        results.append((loss.detach().float(), [x.grad for x in leaves]))
    (ref_loss, ref_grads), (loss, grads) = results
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    for name, g, rg in zip(("hidden", "weight", "bias"), grads, ref_grads):
        assert_grad_close(g, rg.float(), dtype, name)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("params", [dict(top_p=0.9), dict(top_k=5), dict(min_p=0.2)], ids=["top_p", "top_k", "min_p"])
def test_one_model_has_ratio_one_over_the_support(backend, params, device):
    dev = backend_device(backend, device)
    h, w, b, y, mask, _, sampling, params = _sampled(torch.float32, dev, params, temperature=0.9)
    out = grpo_fast.sampler_logprobs(h, w, y, mask, bias=b, temperature=0.9, backend=backend, **params)
    over_support = grpo_fast.sampling_importance_weights(out.support_logprobs, sampling, mask, mode="token_truncate")
    full = grpo_fast.sampling_importance_weights(out.logprobs, sampling, mask, mode="token_truncate")
    scored = mask.bool()
    assert abs(over_support[scored].mean().item() - 1.0) < 1e-5
    # TRL 1.16's ratio across the two supports: the kept mass, well below 1
    kept_mass = out.log_kept_mass.exp()
    torch.testing.assert_close(full[scored], kept_mass[scored], rtol=1e-5, atol=1e-6)
    assert full[scored].mean().item() < 0.99


@pytest.mark.parametrize("backend", BACKENDS)
def test_old_support_logprobs_given(backend, device):
    # an old policy (num_iterations > 1): its support log-probs come from generation time, the loss takes them
    dev = backend_device(backend, device)
    h, w, b, y, mask, adv, sampling, params = _sampled(torch.float32, dev, dict(top_p=0.85))
    old = grpo_fast.sampler_logprobs(h * 1.01, w, y, mask, bias=b, backend=backend, **params)
    correction = grpo_fast.SamplingCorrection(sampling, old_support_logprobs=old.support_logprobs, **params)
    loss, _ = grpo_fast.loss(
        h, w, y, adv, mask, bias=b, old_logprobs=old.logprobs, sampling_correction=correction, backend=backend
    )
    weights = grpo_fast.sampling_importance_weights(old.support_logprobs, sampling, mask)
    expected, _ = grpo_fast.loss(
        h, w, y, adv, mask, bias=b, old_logprobs=old.logprobs, importance_weights=weights, backend=backend
    )
    assert torch.equal(loss, expected)


def test_named_errors():
    h, w, b, y, mask, adv, sampling, _ = _sampled(torch.float32, "cpu", dict(top_p=0.9))
    correction = grpo_fast.SamplingCorrection(sampling, top_p=0.9)

    def call(**kw):
        return grpo_fast.loss(h, w, y, adv, mask, bias=b, backend="torch", **kw)

    cases = [
        (dict(sampling_correction=correction, importance_weights=torch.ones(4)), "either importance_weights"),
        (dict(sampling_correction=correction, old_logprobs=torch.zeros(4, 6)), "needs old_support_logprobs"),
        (
            dict(sampling_correction=grpo_fast.SamplingCorrection(sampling, top_p=0.9), loss_type="vespo"),
            "must be token_truncate or token_mask",
        ),
        (dict(sampling_correction=grpo_fast.SamplingCorrection(sampling, mode="token")), "mode must be one of"),
        (dict(sampling_correction=grpo_fast.SamplingCorrection(sampling, top_p=1.2)), r"top_p must be in \(0, 1\]"),
        (dict(sampling_correction=grpo_fast.SamplingCorrection(sampling[:, :3], top_p=0.9)), "sampling_logprobs must"),
    ]
    for kwargs, match in cases:
        with pytest.raises(ValueError, match=match):
            call(**kwargs)
