"""Layer 2 (the per-token GRPO kernel and its torch twin): loss, metrics, dL/dlogp and dL/dentropy against the
reference's autograd.

Every loss type x importance level x on/off-policy x KL on/off (bias-corrected or not) x per-sequence/per-token
advantages, plus delta, epsilon_high, importance weights of every shape, the off-policy mask (with NaN sampler
log-probs), the top-entropy mask, the entropy bonus, fully masked rows, ties on the clip boundary and
num_items_in_batch, on both backends. The kernel runs on the ``device`` fixture (the interpreter on CPU, compiled on a
CUDA GPU), the torch twin (grpo_fast.backends.token_loss_twin) on CPU; the inputs are drawn on CPU and moved there.
"""

import itertools
import math

import pytest
import torch
from conftest import backend_device

import grpo_fast
from grpo_fast import reference
from grpo_fast.backends import resolver
from grpo_fast.grpo_loss import ops as loss_ops
from grpo_fast.grpo_loss.metrics import metric_names
from grpo_fast.kernels.operands import TokenLossInputs

LOSS_TYPES = reference.LOSS_TYPES
BACKENDS = ("triton", "torch")
B, T = 4, 11


def _batch(seed=0, per_token_adv=False, device="cpu"):
    """Log-probs, a mask (a fully masked sequence, a one-token completion), advantages, old / reference log-probs and
    entropies, drawn on CPU, on ``device``."""
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(B, T, generator=g) * 3
    mask = torch.rand(B, T, generator=g) > 0.25
    mask[2] = False  # a fully masked sequence
    mask[3, 1:] = False  # a one-token completion
    mask[3, 0] = True
    adv = torch.randn((B, T) if per_token_adv else (B,), generator=g)
    old = logp + 0.4 * torch.randn(B, T, generator=g)
    ref = logp + 0.4 * torch.randn(B, T, generator=g)
    entropy = torch.rand(B, T, generator=g) * 4
    return tuple(x.to(device) for x in (logp, mask, adv, old, ref, entropy))


def _on(device, x):
    return x.to(device) if isinstance(x, torch.Tensor) else x


def _compare(backend, device, logp, adv, mask, entropy, **kw):
    """``backend``'s loss, metrics and gradients (log-probs and entropy) on its device (``device`` for the kernel;
    every tensor argument is moved there) equal the reference's autograd."""
    device = backend_device(backend, device)
    logp, adv, mask, entropy = (_on(device, x) for x in (logp, adv, mask, entropy))
    kw = {name: _on(device, x) for name, x in kw.items()}
    out = {}
    for name in ("reference", backend):
        leaf = logp.clone().requires_grad_()
        ent_leaf = entropy.clone().requires_grad_() if entropy is not None else None
        if name == "reference":
            loss, metrics = reference.token_loss(leaf, adv, mask, entropy=ent_leaf, **kw)
        else:
            loss, metrics = grpo_fast.token_loss(leaf, adv, mask, entropy=ent_leaf, backend=backend, **kw)
        loss.backward()
        ent_grad = ent_leaf.grad if ent_leaf is not None else None
        if ent_grad is None and ent_leaf is not None:
            ent_grad = torch.zeros_like(ent_leaf)  # no entropy bonus: no gradient reaches the entropy
        out[name] = (loss.detach(), dict(metrics), leaf.grad, ent_grad)
    (rl, rm, rg, reg), (fl, fm, fg, feg) = out["reference"], out[backend]
    assert torch.isfinite(fl) and torch.isfinite(fg).all()
    torch.testing.assert_close(fl, rl, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(fg, rg, rtol=1e-5, atol=1e-7)
    if reg is not None:
        torch.testing.assert_close(feg, reg, rtol=1e-5, atol=1e-7)
    assert set(fm) == set(rm)
    for k in rm:
        torch.testing.assert_close(fm[k], rm[k], rtol=1e-5, atol=1e-6, equal_nan=True, msg=lambda m, k=k: f"{k}: {m}")
    return rl, rm, rg


@pytest.mark.parametrize(
    "loss_type, level, off_policy, kl, per_token_adv",
    list(
        itertools.product(
            LOSS_TYPES, ("token", "sequence"), (False, True), ("none", "k3", "bias-corrected"), (False, True)
        )
    ),
)
@pytest.mark.parametrize("backend", BACKENDS)
def test_layer2_matches_reference(loss_type, level, off_policy, kl, per_token_adv, backend, device):
    logp, mask, adv, old, ref, entropy = _batch(per_token_adv=per_token_adv)
    kl_options = dict(beta=0.0 if kl == "none" else 0.04, use_bias_correction_kl=kl == "bias-corrected")
    options = dict(loss_type=loss_type, importance_sampling_level=level, max_completion_length=T, epsilon_high=0.28)
    old = old if off_policy else None
    _compare(backend, device, logp, adv, mask, entropy, old_logprobs=old, ref_logprobs=ref, **kl_options, **options)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("level", ("token", "sequence"))
@pytest.mark.parametrize("backend", BACKENDS)
def test_delta_and_importance_weights(loss_type, level, backend, device):
    logp, mask, adv, old, ref, entropy = _batch(seed=1)
    g = torch.Generator().manual_seed(5)
    per_sequence = torch.rand(B, generator=g) * 2
    inputs = dict(old_logprobs=old, ref_logprobs=ref, num_items_in_batch=57)
    options = dict(loss_type=loss_type, importance_sampling_level=level, max_completion_length=T + 3, beta=0.1)
    options.update(delta=1.1, epsilon=0.1, epsilon_high=0.15, sapo_temperature_pos=0.9, sapo_temperature_neg=1.3)
    for iw in (torch.rand(B, T, generator=g) * 2, per_sequence, per_sequence[:, None]):
        if loss_type == "vespo" and iw.shape != (B, T):
            continue  # TRL rejects VESPO with sequence-level weights: test_vespo_rejects_per_sequence_weights
        _compare(backend, device, logp, adv, mask, entropy, importance_weights=iw, **inputs, **options)


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "luspo"])
@pytest.mark.parametrize("delta", [None, 1.0])
@pytest.mark.parametrize("backend", BACKENDS)
def test_ties_on_the_clip_boundary_follow_torch_min_and_clamp(loss_type, delta, backend, device):
    # on-policy the ratio is exactly 1; with epsilon = 0 it sits on both clamp bounds (and on delta = 1):
    # both min branches tie, clamp passes the gradient on its bounds, torch.min splits a tie in half
    logp = -torch.rand(2, 5)
    adv = torch.tensor([[1.0, -1.0, -2.0, 0.5, 0.0], [3.0, 0.0, -1.0, 1.0, 2.0]])
    _compare(
        backend,
        device,
        logp,
        adv,
        torch.ones(2, 5),
        None,
        loss_type=loss_type,
        epsilon=0.0,
        epsilon_high=0.0,
        delta=delta,
    )


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_all_masked_batch_is_zero_not_nan(loss_type, device):
    for backend in ("triton", "torch"):
        logp, _, adv, old, ref, entropy = _batch(device=backend_device(backend, device))
        logp[0, 0] = float("-inf")  # garbage under the mask must not leak
        mask = torch.zeros(B, T, dtype=torch.bool, device=logp.device)
        leaf = logp.clone().requires_grad_()
        options = dict(beta=0.04, loss_type=loss_type, max_completion_length=T)
        inputs = dict(entropy=entropy, old_logprobs=old, ref_logprobs=ref)
        loss, metrics = grpo_fast.token_loss(leaf, adv, mask, **inputs, **options, backend=backend)
        loss.backward()
        # the spec alone would multiply -inf by 0 here; neither backend may
        assert loss.item() == 0.0
        assert torch.equal(leaf.grad, torch.zeros_like(leaf))
        # a min / max over sequences that have no token is NaN in TRL too (its nanmin of nothing)
        undefined = {"clip_ratio/low_min", "clip_ratio/high_max"}
        assert all(math.isfinite(v.item()) for k, v in metrics.items() if k not in undefined)
        assert all(math.isnan(metrics[k].item()) for k in undefined & set(metrics))


@pytest.mark.parametrize("backend", BACKENDS)
def test_num_items_in_batch_tensor_and_float_agree(backend, device):
    device = backend_device(backend, device)
    logp, mask, adv, old, _, _ = _batch(device=device)
    a, _ = grpo_fast.token_loss(
        logp, adv, mask, old_logprobs=old, num_items_in_batch=torch.tensor(40.0, device=device), backend=backend
    )
    b, _ = grpo_fast.token_loss(logp, adv, mask, old_logprobs=old, num_items_in_batch=40, backend=backend)
    c, _ = reference.token_loss(logp, adv, mask, old_logprobs=old, num_items_in_batch=40)
    assert a.item() == b.item()
    assert math.isclose(a.item(), c.item(), rel_tol=1e-6)


def test_vespo_rejects_per_sequence_weights():
    logp, mask, adv, old, _, _ = _batch()
    for iw in (torch.ones(B), torch.ones(B, 1)):
        with pytest.raises(ValueError, match="vespo' takes per-token importance_weights"):
            grpo_fast.token_loss(logp, adv, mask, old_logprobs=old, importance_weights=iw, loss_type="vespo")


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("level", ("token", "sequence"))
@pytest.mark.parametrize("per_token_adv", (False, True))
@pytest.mark.parametrize("backend", BACKENDS)
def test_off_policy_mask_with_unscorable_sampler_tokens(loss_type, level, per_token_adv, backend, device):
    # sampler log-probs far off the policy on some sequences, NaN where the sampler could not score a token
    logp, mask, adv, old, ref, entropy = _batch(seed=2, per_token_adv=per_token_adv)
    g = torch.Generator().manual_seed(7)
    sampler = old + torch.tensor([0.0, 2.0, 0.0, 1.5])[:, None] + 0.1 * torch.randn(B, T, generator=g)
    sampler[0, 1] = float("nan")
    sampler[1, :3] = float("nan")
    options = dict(beta=0.04, loss_type=loss_type, importance_sampling_level=level, max_completion_length=T)
    for sampling in (sampler, None):  # None: the old policy's log-probs are the sampler's
        for threshold in (0.05, 0.5):
            inputs = dict(old_logprobs=old, ref_logprobs=ref, sampling_logprobs=sampling)
            _compare(
                backend, device, logp, adv, mask, entropy, off_policy_mask_threshold=threshold, **inputs, **options
            )


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("level", ("token", "sequence"))
@pytest.mark.parametrize("backend", BACKENDS)
def test_top_entropy_mask_and_entropy_bonus(loss_type, level, backend, device):
    logp, mask, adv, old, ref, entropy = _batch(seed=3)
    for kw in (
        dict(top_entropy_quantile=0.2),
        dict(entropy_coef=0.01),
        dict(top_entropy_quantile=0.5, entropy_coef=0.03),
        dict(top_entropy_quantile=0.0),
        dict(top_entropy_quantile=0.3, entropy_threshold=2.0, entropy_coef=0.02),
    ):
        options = dict(beta=0.04, loss_type=loss_type, importance_sampling_level=level, max_completion_length=T, **kw)
        _, metrics, _ = _compare(
            backend, device, logp, adv, mask, entropy, old_logprobs=old, ref_logprobs=ref, **options
        )
        assert ("policy_loss" in metrics) == ("entropy_coef" in kw)


@pytest.mark.parametrize("backend", BACKENDS)
def test_entropy_bonus_gradient_is_minus_coef_over_the_bonus_tokens(backend, device):
    device = backend_device(backend, device)
    logp, mask, adv, _, _, entropy = _batch(seed=4, device=device)
    ent = entropy.clone().requires_grad_()
    loss, metrics = grpo_fast.token_loss(logp, adv, mask, entropy=ent, entropy_coef=0.5, backend=backend)
    loss.backward()
    expected = -0.5 * mask.float() / mask.sum()
    torch.testing.assert_close(ent.grad, expected)
    bonus = 0.5 * (entropy * mask).sum() / mask.sum()
    assert math.isclose(loss.item(), metrics["policy_loss"].item() - bonus.item(), rel_tol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_top_entropy_quantile_zero_keeps_only_the_highest_entropy_token(backend, device):
    device = backend_device(backend, device)
    # TRL's doc: 0.0 masks all but the highest-entropy token; on-policy dapo, so each kept token gives -A / tokens
    logp, mask, adv, _, _, entropy = _batch(seed=5, device=device)
    leaf = logp.clone().requires_grad_()
    loss, _ = grpo_fast.token_loss(leaf, adv, mask, entropy=entropy, top_entropy_quantile=0.0, backend=backend)
    loss.backward()
    top = torch.where(mask, entropy, -1.0).flatten().argmax()
    expected = torch.zeros(B * T, device=device)
    expected[top] = -adv.repeat_interleave(T)[top] / mask.sum()
    torch.testing.assert_close(leaf.grad.flatten(), expected)


@pytest.mark.parametrize("mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_sampler_importance_weights_of_every_mode(mode, loss_type, backend, device):
    logp, mask, adv, old, ref, entropy = _batch(seed=6)
    g = torch.Generator().manual_seed(8)
    sampler = old + 0.3 * torch.randn(B, T, generator=g)
    sampler[0, 0] = float("nan")
    iw = grpo_fast.sampling_importance_weights(old, sampler, mask, mode=mode, clip_max=1.5, clip_min=0.6)
    assert iw.shape == ((B, T) if mode.startswith("token") else (B, 1))
    # the product's weights are the spec's, clipped or masked somewhere (the NaN sampler token: no correction)
    torch.testing.assert_close(iw, reference.sampling_importance_weights(old, sampler, mask, mode, 1.5, 0.6))
    assert ((iw == 1.5) | (iw == 0.6) if mode.endswith("truncate") else iw == 0.0).any()
    if loss_type == "vespo" and mode.startswith("sequence"):
        return
    _compare(
        backend,
        device,
        logp,
        adv,
        mask,
        entropy,
        old_logprobs=old,
        ref_logprobs=ref,
        beta=0.04,
        importance_weights=iw,
        loss_type=loss_type,
        max_completion_length=T,
    )


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("level", ("token", "sequence"))
@pytest.mark.parametrize("per_token_adv", (False, True))
def test_torch_twin_returns_the_kernels_statistics(loss_type, level, per_token_adv, device):
    """The two production layer-2 implementations (the token kernel's launcher and its torch twin), called on the
    same prepared inputs, return the same dL/dlogp, bonus mask and per-sequence statistics (names, whether each is
    one value per sequence, and values), with every option that changes them."""
    logp, mask, adv, old, ref, entropy = _batch(seed=9, per_token_adv=per_token_adv)
    g = torch.Generator().manual_seed(10)
    iw = 0.5 + torch.rand(B, T, generator=g)
    sampler = old + 0.3 * torch.randn(B, T, generator=g)
    every_option = dict(beta=0.04, delta=1.3, epsilon_high=0.28, max_completion_length=T, off_policy_mask_threshold=0.1)
    every_option.update(top_entropy_quantile=0.6, entropy_coef=0.01)
    options = grpo_fast.LossOptions(loss_type=loss_type, importance_sampling_level=level, **every_option)
    out = {}
    for name, backend in resolver.BACKENDS.items():
        dev = backend_device(name, device)
        tensors = [x.to(dev).float().contiguous() for x in (logp, adv, mask, old, ref, sampler, iw, entropy)]
        out[name] = backend.token_loss(
            TokenLossInputs(*tensors),
            options,
            scale=torch.full((), 1 / 17, device=dev),
            entropy_threshold=torch.full((), 1.5, device=dev),
        )
    (kernel_grad, kernel_bonus, kernel_stats), (torch_grad, torch_bonus, torch_stats) = out["triton"], out["torch"]
    torch.testing.assert_close(torch_grad, kernel_grad.cpu(), rtol=1e-5, atol=1e-7)
    assert torch.equal(torch_bonus, kernel_bonus.cpu())
    assert list(torch_stats) == list(kernel_stats)
    for name, (values, per_sequence) in torch_stats.items():
        assert per_sequence == kernel_stats[name][1], name
        torch.testing.assert_close(values, kernel_stats[name][0].cpu(), rtol=1e-5, atol=1e-6, msg=name)


# option sets for the fp64 comparison: every option that changes layer 2's algebra appears in one
FP64_OPTIONS = {
    "kl-iw-token": dict(beta=0.04, epsilon_high=0.28, importance_weights="token"),
    "k3-delta-iw-sequence-offpolicy": {
        **dict(beta=0.04, use_bias_correction_kl=False, delta=1.1, epsilon=0.1, epsilon_high=0.15),
        **dict(importance_weights="sequence", num_items_in_batch=57, off_policy_mask_threshold=0.1),
        **dict(sapo_temperature_pos=0.9, sapo_temperature_neg=1.3),
    },
    "onpolicy-entropy-mask-bonus": dict(
        on_policy=True, top_entropy_quantile=0.5, entropy_coef=0.03, max_completion_length=T + 3
    ),
}


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("level", ("token", "sequence"))
@pytest.mark.parametrize("per_token_adv", (False, True))
@pytest.mark.parametrize("case", list(FP64_OPTIONS))
def test_torch_layer2_equals_the_spec_in_fp64(loss_type, level, per_token_adv, case):
    """The torch layer 2 (the torch twin and the op's finishing, grpo_fast.grpo_loss.ops._layer2) in fp64 is the
    spec's fp64 autograd to rounding: loss, dL/dlogp and dL/dentropy to 1e-10, the metrics (fp32) to 1e-6. The
    inputs are fp32 values (the top-entropy mask compares entropies with an fp32 quantile in both)."""
    kw = dict(FP64_OPTIONS[case])
    on_policy = kw.pop("on_policy", False)
    weights = kw.pop("importance_weights", None)
    num_items = kw.pop("num_items_in_batch", None)
    options = grpo_fast.LossOptions(
        loss_type=loss_type, importance_sampling_level=level, **dict(dict(max_completion_length=T), **kw)
    )
    logp, mask, adv, old, ref, entropy = (x.double() for x in _batch(seed=11, per_token_adv=per_token_adv))
    g = torch.Generator().manual_seed(12)
    sampler = old + 0.3 * torch.randn(B, T, generator=g).double()
    if weights == "sequence" and loss_type == "vespo":
        weights = "token"  # TRL's VESPO takes per-token weights only
    iw = {
        None: None,
        "token": 0.5 + torch.rand(B, T, generator=g).double(),
        "sequence": 0.5 + torch.rand(B, generator=g).double(),
    }[weights]
    old = None if on_policy else old
    sampling = sampler if options.off_policy_mask_threshold is not None else None

    leaf, ent_leaf = logp.clone().requires_grad_(), entropy.clone().requires_grad_()
    spec_loss, spec_metrics = reference.token_loss(
        leaf,
        adv,
        mask,
        options,
        entropy=ent_leaf,
        old_logprobs=old,
        ref_logprobs=ref,
        sampling_logprobs=sampling,
        importance_weights=iw,
        num_items_in_batch=num_items,
    )
    spec_loss.backward()
    assert spec_loss.dtype == torch.float64

    batch = loss_ops.PreparedBatch(
        logp=logp,
        entropy=entropy,
        advantages=adv,
        mask=mask.double(),
        old_logprobs=old,
        ref_logprobs=ref if options.beta != 0.0 else None,
        sampling_logprobs=sampling,
        importance_weights=iw,
        num_items_in_batch=torch.tensor(float(num_items), dtype=torch.float64) if num_items is not None else None,
        entropy_threshold=None,
    )
    loss, metric_values, grad_logp, grad_entropy = loss_ops._layer2(resolver.TORCH, batch, options)
    assert loss.dtype == grad_logp.dtype == torch.float64
    torch.testing.assert_close(loss, spec_loss.detach(), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grad_logp, leaf.grad, rtol=1e-10, atol=1e-13)
    if options.entropy_coef != 0.0:
        torch.testing.assert_close(grad_entropy, ent_leaf.grad, rtol=1e-10, atol=1e-13)
    else:
        assert grad_entropy.numel() == 0 and ent_leaf.grad is None
    metrics = dict(zip(metric_names(options, True), metric_values))
    assert set(metrics) == set(spec_metrics)
    for name, value in spec_metrics.items():
        torch.testing.assert_close(metrics[name], value, rtol=1e-6, atol=1e-7, equal_nan=True, msg=name)
