"""Layer 2 (the per-token GRPO kernel): loss, metrics and dL/dlogp against the reference's autograd.

Every loss type x importance level x on/off-policy x KL on/off x per-sequence/per-token advantages, plus
delta, epsilon_high, importance weights, fully masked rows, ties on the clip boundary and num_items_in_batch.
"""

import itertools
import math

import pytest
import torch

import grpo_fast
from grpo_fast import reference

LOSS_TYPES = reference.LOSS_TYPES
B, T = 4, 11


def _batch(seed=0, per_token_adv=False):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(B, T, generator=g) * 3
    mask = torch.rand(B, T, generator=g) > 0.25
    mask[2] = False          # a fully masked sequence
    mask[3, 1:] = False      # a one-token completion
    mask[3, 0] = True
    adv = torch.randn((B, T) if per_token_adv else (B,), generator=g)
    old = logp + 0.4 * torch.randn(B, T, generator=g)
    ref = logp + 0.4 * torch.randn(B, T, generator=g)
    entropy = torch.rand(B, T, generator=g) * 4
    return logp, mask, adv, old, ref, entropy


def _compare(logp, adv, mask, entropy, **kw):
    out = {}
    for backend in ("reference", "triton"):
        leaf = logp.clone().requires_grad_()
        if backend == "reference":
            loss, metrics = reference.token_loss(leaf, adv, mask, entropy=entropy, **kw)
        else:
            loss, metrics = grpo_fast.token_loss(leaf, adv, mask, entropy=entropy, backend="triton", **kw)
        loss.backward()
        out[backend] = (loss.detach(), dict(metrics), leaf.grad)
    (rl, rm, rg), (fl, fm, fg) = out["reference"], out["triton"]
    assert torch.isfinite(fl) and torch.isfinite(fg).all()
    torch.testing.assert_close(fl, rl, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(fg, rg, rtol=1e-5, atol=1e-7)
    assert set(fm) == set(rm)
    for k in rm:
        torch.testing.assert_close(fm[k], rm[k], rtol=1e-5, atol=1e-6, msg=lambda m: f"{k}: {m}")
    return rl, rm, rg


@pytest.mark.parametrize("loss_type, level, off_policy, beta, per_token_adv", list(itertools.product(
    LOSS_TYPES, ("token", "sequence"), (False, True), (0.0, 0.04), (False, True))))
def test_token_kernel_matches_reference(loss_type, level, off_policy, beta, per_token_adv):
    logp, mask, adv, old, ref, entropy = _batch(per_token_adv=per_token_adv)
    _compare(logp, adv, mask, entropy, old_logprobs=old if off_policy else None, ref_logprobs=ref, beta=beta,
             loss_type=loss_type, importance_sampling_level=level, max_completion_length=T, epsilon_high=0.28)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("level", ("token", "sequence"))
def test_delta_and_importance_weights(loss_type, level):
    logp, mask, adv, old, ref, entropy = _batch(seed=1)
    g = torch.Generator().manual_seed(5)
    for iw in (torch.rand(B, T, generator=g) * 2, torch.rand(B, generator=g) * 2):
        _compare(logp, adv, mask, entropy, old_logprobs=old, ref_logprobs=ref, beta=0.1, delta=1.1,
                 importance_weights=iw, loss_type=loss_type, importance_sampling_level=level,
                 max_completion_length=T + 3, epsilon=0.1, epsilon_high=0.15, num_items_in_batch=57,
                 sapo_temperature_pos=0.9, sapo_temperature_neg=1.3)


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "luspo"])
@pytest.mark.parametrize("delta", [None, 1.0])
def test_ties_on_the_clip_boundary_follow_torch_min_and_clamp(loss_type, delta):
    # on-policy the ratio is exactly 1; with epsilon = 0 it sits on both clamp bounds (and on delta = 1):
    # both min branches tie, clamp passes the gradient on its bounds, torch.min splits a tie in half
    logp = -torch.rand(2, 5)
    adv = torch.tensor([[1.0, -1.0, -2.0, 0.5, 0.0], [3.0, 0.0, -1.0, 1.0, 2.0]])
    _compare(logp, adv, torch.ones(2, 5), None, loss_type=loss_type, epsilon=0.0, epsilon_high=0.0, delta=delta)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_all_masked_batch_is_zero_not_nan(loss_type):
    logp, _, adv, old, ref, entropy = _batch()
    logp[0, 0] = float("-inf")  # garbage under the mask must not leak
    mask = torch.zeros(B, T, dtype=torch.bool)
    for backend in ("triton", "torch"):
        leaf = logp.clone().requires_grad_()
        loss, metrics = grpo_fast.token_loss(leaf, adv, mask, entropy=entropy, old_logprobs=old, ref_logprobs=ref,
                                             beta=0.04, loss_type=loss_type, max_completion_length=T, backend=backend)
        loss.backward()
        if backend == "triton":  # the reference itself multiplies -inf by 0 here; ours must not
            assert loss.item() == 0.0
            assert torch.equal(leaf.grad, torch.zeros_like(leaf))
            assert all(math.isfinite(v.item()) for v in metrics.values())


def test_num_items_in_batch_tensor_and_float_agree():
    logp, mask, adv, old, _, _ = _batch()
    a, _ = grpo_fast.token_loss(logp, adv, mask, old_logprobs=old, num_items_in_batch=torch.tensor(40.0),
                                backend="triton")
    b, _ = grpo_fast.token_loss(logp, adv, mask, old_logprobs=old, num_items_in_batch=40, backend="triton")
    c, _ = reference.token_loss(logp, adv, mask, old_logprobs=old, num_items_in_batch=40)
    assert a.item() == b.item()
    assert math.isclose(a.item(), c.item(), rel_tol=1e-6)
