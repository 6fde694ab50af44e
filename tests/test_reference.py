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
    expected = {
        "grpo": -1.0,
        "bnpo": -1.0,
        "dapo": -1.0,
        "dr_grpo": -4 / (2 * 8),
        "luspo": -4 / 2,
        "cispo": 0.0,
        "sapo": -2.0,
    }  # sapo at r = 1: sigmoid(0) * 4 / tau = 2
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
    loss, metrics = reference.token_loss(
        logp,
        adv,
        torch.ones(1, 3),
        old_logprobs=old,
        ref_logprobs=ref,
        beta=0.1,
        epsilon=0.2,
        epsilon_high=0.28,
        loss_type="bnpo",
        use_bias_correction_kl=False,
    )
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
    _, metrics = reference.token_loss(
        logp, torch.tensor([1.0]), mask, old_logprobs=old, importance_sampling_level="sequence"
    )
    assert math.isclose(metrics["ratio_mean"].item(), math.exp((0.5 + 0.1) / 2), rel_tol=1e-6)


def test_bias_corrected_kl_multiplies_by_the_ratio_and_its_gradient_flows_on_policy():
    # on-policy r = 1 exactly, yet d(k r)/dlogp = dk/dlogp + k: the gradient differs from the plain k3 KL's
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    ref = torch.tensor([[-1.5, -1.0]])
    adv = torch.tensor([0.0])  # no policy term: the loss is the KL alone
    loss, metrics = reference.token_loss(logp, adv, torch.ones(1, 2), ref_logprobs=ref, beta=1.0, loss_type="bnpo")
    loss.backward()
    diff = ref - logp.detach()
    k = diff.exp() - diff - 1
    torch.testing.assert_close(loss.detach(), k.mean())
    torch.testing.assert_close(metrics["kl"], k.mean())
    torch.testing.assert_close(logp.grad, ((1 - diff.exp()) + k) / 2)
    off_policy = torch.tensor([[-1.2, -2.0]])  # ratios exp(0.2), 1: the KL is weighted by them
    loss, metrics = reference.token_loss(
        logp.detach(), adv, torch.ones(1, 2), old_logprobs=off_policy, ref_logprobs=ref, beta=1.0, loss_type="bnpo"
    )
    torch.testing.assert_close(loss, (k * torch.tensor([[math.exp(0.2), 1.0]])).mean())


def test_vespo_gamma_weight_by_hand():
    # phi(W) = exp(lam + k log W - lam W), W = exp of the masked summed log-ratio plus the sampler's log-weights
    logp = torch.tensor([[-1.0, -1.0, -9.0], [-2.0, -2.0, -2.0]], requires_grad=True)
    old = torch.tensor([[-1.1, -1.2, 0.0], [-2.0, -2.0, -2.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    adv = torch.tensor([1.0, -1.0])
    iw = torch.tensor([[0.5, 1.0, 1.5], [1.0, 1.0, 1.0]])  # 1.5 sits under the mask: counted, as TRL sums them all
    loss, metrics = reference.token_loss(logp, adv, mask, old_logprobs=old, importance_weights=iw, loss_type="vespo")
    log_w0 = 0.1 + 0.2 + math.log(0.5) + math.log(1.5)
    phi0 = math.exp(3.0 + 2.0 * log_w0 - 3.0 * math.exp(log_w0))  # A >= 0: k = 2, lam = 3
    phi1 = 1.0  # W = 1: phi(1) = exp(lam - lam) = 1 for any k, lam
    expected = (-phi0 * 1.0 * (-2.0) - phi1 * (-1.0) * (-6.0)) / 5  # dapo: sum over 5 tokens / 5
    assert math.isclose(loss.item(), expected, rel_tol=1e-6)
    assert math.isclose(metrics["vespo/phi_seq_mean"].item(), (phi0 + phi1) / 2, rel_tol=1e-6)
    loss.backward()  # phi is detached: d/dlogp = -phi A / num_items
    torch.testing.assert_close(logp.grad, torch.tensor([[-phi0, -phi0, 0.0], [1.0, 1.0, 1.0]]) / 5)


def test_off_policy_mask_drops_negative_advantage_sequences_far_from_the_sampler():
    logp = torch.zeros(3, 2, requires_grad=True)
    sampler = torch.tensor([[1.0, float("nan")], [1.0, 1.0], [0.2, 0.2]])  # mean KL: 0.5 (NaN is 0), 1.0, 0.2
    adv = torch.tensor([-1.0, 1.0, -1.0])
    loss, _ = reference.token_loss(
        logp, adv, torch.ones(3, 2), sampling_logprobs=sampler, off_policy_mask_threshold=0.3, loss_type="bnpo"
    )
    # sequence 0: negative advantage and KL 0.5 > 0.3: dropped; 1: positive advantage: kept; 2: KL 0.2: kept
    assert math.isclose(loss.item(), (0 + 0 - 1 - 1 + 1 + 1) / 6, abs_tol=1e-7)
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, 0.0], [-1.0, -1.0], [1.0, 1.0]]) / 6)


def test_top_entropy_mask_and_entropy_bonus_by_hand():
    logp = torch.zeros(1, 4, requires_grad=True)
    entropy = torch.tensor([[0.5, 2.0, 1.0, 3.0]], requires_grad=True)
    adv = torch.tensor([1.0])
    # the quantile 0.5 of [0.5, 1, 2, 3] is 1.5: tokens 1 and 3 carry the policy loss and the bonus
    loss, metrics = reference.token_loss(
        logp, adv, torch.ones(1, 4), entropy=entropy, top_entropy_quantile=0.5, entropy_coef=0.1, loss_type="bnpo"
    )
    assert math.isclose(metrics["policy_loss"].item(), -2 / 4, rel_tol=1e-6)
    assert math.isclose(loss.item(), -2 / 4 - 0.1 * (2.0 + 3.0) / 2, rel_tol=1e-6)
    assert math.isclose(metrics["entropy"].item(), 6.5 / 4, rel_tol=1e-6)  # the metric: every completion token
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, -0.25, 0.0, -0.25]]))
    torch.testing.assert_close(entropy.grad, torch.tensor([[0.0, -0.05, 0.0, -0.05]]))


def test_sampling_importance_weights_by_hand():
    old = torch.tensor([[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    sampler = torch.tensor([[-1.0, 0.5, float("nan")], [-0.2, -0.2, -5.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    e = math.exp
    w = reference.sampling_importance_weights(old, sampler, mask, "token_truncate", clip_max=2.0, clip_min=0.7)
    torch.testing.assert_close(w, torch.tensor([[2.0, 0.7, 1.0], [e(0.2), e(0.2), 1.0]]))
    w = reference.sampling_importance_weights(old, sampler, mask, "token_mask", clip_max=2.0, clip_min=0.7)
    torch.testing.assert_close(w, torch.tensor([[0.0, 0.0, 1.0], [e(0.2), e(0.2), 1.0]]))
    # summed log-ratios 0.5 and 0.4 (the masked -5.0 and the NaN count 0)
    w = reference.sampling_importance_weights(old, sampler, mask, "sequence_truncate", clip_max=1.6)
    torch.testing.assert_close(w, torch.tensor([[1.6], [e(0.4)]]))
    w = reference.sampling_importance_weights(old, sampler, mask, "sequence_mask", clip_max=1.6)
    torch.testing.assert_close(w, torch.tensor([[0.0], [e(0.4)]]))
