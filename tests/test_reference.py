"""The spec itself, checked against numbers computed by hand and against torch's own cross-entropy."""

import math

import torch
import torch.nn.functional as F

from grpo_fast import reference


def test_logprobs_match_cross_entropy_with_temperature_and_bias():
    h, w, b = torch.randn(2, 5, 8), torch.randn(11, 8), torch.randn(11)
    y = torch.randint(0, 11, (2, 5))
    logp, entropy = reference.logprobs_and_entropy(h, w, y, b, temperature=0.7)
    logits = (h @ w.T + b) / 0.7
    expected = -F.cross_entropy(logits.reshape(-1, 11), y.reshape(-1), reduction="none").view(2, 5)
    torch.testing.assert_close(logp, expected)
    p = logits.softmax(-1)
    torch.testing.assert_close(entropy, -(p * p.log()).sum(-1))


def test_on_policy_token_loss_is_minus_mean_advantage_and_gradient_is_advantage():
    # ratio == 1 exactly: every loss is -A per token; d/dlogp = -A * normaliser
    logp = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.1, -9.0]], requires_grad=True)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    adv = torch.tensor([2.0, -1.0])
    loss, metrics = reference.token_loss(logp, adv, mask, loss_type="grpo")
    assert math.isclose(loss.item(), (-2.0 + 1.0) / 2, abs_tol=1e-7)
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-0.5, -0.5, 0.0], [1 / 6, 1 / 6, 1 / 6]]))
    assert metrics["ratio_mean"].item() == 1.0


def test_normalisations_by_hand():
    logp = torch.zeros(2, 4, requires_grad=True)
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]])
    adv = torch.tensor([1.0, 1.0])
    # per-token loss is -1 on every real token: 4 tokens, rows of 3 and 1
    expected = {"grpo": -1.0, "bnpo": -1.0, "dapo": -1.0, "dr_grpo": -4 / (2 * 8), "luspo": -4 / 2,
                "cispo": 0.0, "sapo": -2.0}  # sapo at r = 1: sigmoid(0) * 4 / tau = 2
    for loss_type, value in expected.items():
        loss, _ = reference.token_loss(logp, adv, mask, loss_type=loss_type, max_completion_length=8)
        assert math.isclose(loss.item(), value, abs_tol=1e-6), loss_type
    loss, _ = reference.token_loss(logp, adv, mask, loss_type="dapo", num_items_in_batch=16)
    assert math.isclose(loss.item(), -4 / 16, abs_tol=1e-7)


def test_clipping_kl_and_metrics_by_hand():
    logp = torch.tensor([[0.0, 0.0, 0.0]], requires_grad=True)
    old = torch.tensor([[math.log(2.0), -math.log(2.0), 0.0]])  # ratios 0.5, 2, 1
    ref = torch.tensor([[1.0, 0.0, 0.0]])
    adv = torch.tensor([[-1.0, 1.0, 1.0]])
    loss, metrics = reference.token_loss(logp, adv, torch.ones(1, 3), old_logprobs=old, ref_logprobs=ref, beta=0.1,
                                         epsilon=0.2, epsilon_high=0.28, loss_type="bnpo")
    # token 0: -min(0.5*-1, 0.8*-1) = 0.8; token 1: -min(2, 1.28) = -1.28; token 2: -1; kl: e - 2 on token 0
    kl0 = math.e - 1 - 1
    assert math.isclose(loss.item(), (0.8 - 1.28 - 1 + 0.1 * kl0) / 3, rel_tol=1e-6)
    assert math.isclose(metrics["kl"].item(), kl0 / 3, rel_tol=1e-6)
    assert math.isclose(metrics["clip_ratio/low_mean"].item(), 1 / 3, rel_tol=1e-6)
    assert math.isclose(metrics["clip_ratio/high_mean"].item(), 1 / 3, rel_tol=1e-6)
    assert math.isclose(metrics["clip_ratio/region_mean"].item(), 2 / 3, rel_tol=1e-6)
    assert math.isclose(metrics["ratio_mean"].item(), (0.5 + 2 + 1) / 3, rel_tol=1e-6)


def test_sequence_level_ratio_is_the_masked_mean_log_ratio():
    logp = torch.tensor([[-1.0, -1.0, -5.0]], requires_grad=True)
    old = torch.tensor([[-1.5, -1.1, 0.0]])
    mask = torch.tensor([[1, 1, 0]])
    _, metrics = reference.token_loss(logp, torch.tensor([1.0]), mask, old_logprobs=old,
                                      importance_sampling_level="sequence")
    assert math.isclose(metrics["ratio_mean"].item(), math.exp((0.5 + 0.1) / 2), rel_tol=1e-6)
