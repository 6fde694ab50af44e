"""grpo_fast.loss end to end (fused layer 1 + token kernel) against grpo_fast.reference.loss, and bad input.

The Triton backend runs on the ``device`` fixture (the interpreter on CPU, compiled on a CUDA GPU), torch on CPU."""

import itertools

import pytest
import torch
from conftest import assert_grad_close, backend_device
from helpers import make_batch, run_loss

import grpo_fast
from grpo_fast import reference


def _check_against_reference(batch, dtype, backend, requires=("hidden", "weight", "bias"), **kw):
    ref_batch = dict(batch)  # the spec runs in fp32 on the same (rounded) inputs
    for n in ("hidden", "weight", "bias"):
        if batch[n] is not None:
            ref_batch[n] = batch[n].float()
    # the spec in fp64 (see test_linear_logprobs.F64)
    rl, rm, rg = run_loss(reference.loss, ref_batch, requires=requires, compute_dtype=torch.float64, **dict(kw))
    fl, fm, fg = run_loss(
        lambda *a, **k: grpo_fast.loss(*a, backend=backend, **k), batch, requires=requires, **dict(kw)
    )
    torch.testing.assert_close(fl, rl, rtol=1e-4, atol=1e-5)
    assert set(fm) == set(rm)
    for k in rm:
        torch.testing.assert_close(fm[k], rm[k], rtol=1e-4, atol=1e-5, msg=lambda m, k=k: f"metric {k}: {m}")
    for name in requires:
        if rg[name] is None:
            continue
        assert_grad_close(fg[name], rg[name], dtype, f"d{name}")
    return fl, fm, fg


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("loss_type, level", list(itertools.product(reference.LOSS_TYPES, ("token", "sequence"))))
def test_loss_matches_reference(backend, dtype, loss_type, level, device):
    batch = make_batch(dtype=dtype, bias=True, device=backend_device(backend, device))
    _check_against_reference(
        batch,
        dtype,
        backend,
        old_logprobs=batch["old"],
        ref_logprobs=batch["ref"],
        beta=0.04,
        epsilon=0.2,
        epsilon_high=0.28,
        loss_type=loss_type,
        importance_sampling_level=level,
        temperature=0.7,
        max_completion_length=9,
    )


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_loss_with_every_option_at_once(backend, device):
    dev = backend_device(backend, device)
    batch = make_batch(B=2, T=13, D=40, V=257, bias=True, seed=3, device=dev)
    g = batch["generator"]
    _check_against_reference(
        batch,
        torch.float32,
        backend,
        advantages=torch.randn(2, 13, generator=g).to(dev),
        old_logprobs=batch["old"],
        ref_logprobs=batch["ref"],
        beta=0.1,
        epsilon=0.1,
        epsilon_high=0.3,
        delta=1.2,
        importance_weights=(torch.rand(2, 13, generator=g) * 2).to(dev),
        temperature=1.3,
        num_items_in_batch=31,
    )


# TRL 1.16's options end to end, each on the fused path (entropy gradients through layer 1 included)
OPTIONS = {
    "softcap-logit-scale": dict(softcap=2.5, logit_scale=1.3, temperature=0.9),
    "entropy-bonus": dict(entropy_coef=0.05),
    "top-entropy-and-bonus": dict(top_entropy_quantile=0.4, entropy_coef=0.02),
    "off-policy-mask": dict(off_policy_mask_threshold=0.05),
    "vespo": dict(loss_type="vespo"),
    "sequence-weights": dict(importance_weights="per-sequence"),
    "no-bias-correction": dict(use_bias_correction_kl=False),
}


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("option", list(OPTIONS))
def test_trl_options_end_to_end(backend, dtype, option, device):
    dev = backend_device(backend, device)
    batch = make_batch(dtype=dtype, bias=True, seed=7, device=dev)
    kw = dict(OPTIONS[option])
    if kw.get("importance_weights") == "per-sequence":
        kw["importance_weights"] = (torch.rand(3, 1, generator=batch["generator"]) + 0.5).to(dev)
    _check_against_reference(
        batch, dtype, backend, old_logprobs=batch["old"], ref_logprobs=batch["ref"], beta=0.04, **kw
    )


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_on_policy_frozen_lm_head_like_lora(backend, device):
    batch = make_batch(seed=4, device=backend_device(backend, device))
    _, metrics, grads = _check_against_reference(batch, torch.float32, backend, requires=("hidden",), loss_type="grpo")
    assert grads["weight"] is None
    assert metrics["ratio_mean"].item() == 1.0


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_metrics_carry_per_token_logprobs_for_reuse_as_old(backend, device):
    batch = make_batch(seed=5, device=backend_device(backend, device))
    _, metrics = grpo_fast.loss(
        batch["hidden"], batch["weight"], batch["targets"], batch["advantages"], batch["mask"], backend=backend
    )
    expected_logp, expected_entropy = reference.logprobs_and_entropy(
        batch["hidden"], batch["weight"], batch["targets"], compute_dtype=torch.float64
    )
    assert not metrics.logprobs.requires_grad
    mask = batch["mask"]  # only completion tokens are computed: exact zeros elsewhere
    torch.testing.assert_close(metrics.logprobs, expected_logp * mask, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(metrics.entropies, expected_entropy * mask, rtol=1e-5, atol=1e-5)
    assert torch.count_nonzero(metrics.logprobs[~mask]) == 0
    assert all(v.dtype == torch.float32 and v.dim() == 0 and not v.requires_grad for v in metrics.values())


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_empty_mask_gives_zero_loss_and_zero_gradients(backend, device):
    batch = make_batch(seed=6, device=backend_device(backend, device))
    batch["mask"] = torch.zeros_like(batch["mask"])
    loss, metrics, grads = run_loss(
        lambda *a, **k: grpo_fast.loss(*a, backend=backend, **k),
        batch,
        old_logprobs=batch["old"],
        ref_logprobs=batch["ref"],
        beta=0.04,
    )
    assert loss.item() == 0.0
    # every metric is finite but TRL's min / max over sequences, of which there is none with a token (NaN in TRL too)
    undefined = {"clip_ratio/low_min", "clip_ratio/high_max"}
    assert all(torch.isfinite(v) for k, v in metrics.items() if k not in undefined)
    assert all(torch.isnan(metrics[k]) for k in undefined)
    for name in ("hidden", "weight"):
        assert torch.count_nonzero(grads[name]) == 0


# ------------------------------------------------------------------------------------------------ bad input
def _good(**override):
    batch = make_batch(B=2, T=3, D=8, V=11, masked_row=False)
    args = dict(
        hidden=batch["hidden"],
        weight=batch["weight"],
        targets=batch["targets"],
        advantages=batch["advantages"],
        completion_mask=batch["mask"],
    )
    args.update(override)
    return args


BAD_INPUTS = [
    (dict(hidden=torch.randn(6, 8)), ValueError, "hidden must have shape"),
    (
        dict(weight=torch.randn(11, 9)),
        ValueError,
        r"hidden has D = 8 but weight has shape \(11, 9\): hidden's last dimension must equal weight's second",
    ),
    (dict(weight=torch.randn(11)), ValueError, r"weight must have shape \[V, D\]"),
    (dict(weight=torch.randn(0, 8)), ValueError, "weight must have V > 0 rows"),
    (dict(weight=torch.randn(11, 8, dtype=torch.float64)), TypeError, "weight must be float32"),
    (dict(weight=torch.randn(11, 8).bfloat16()), TypeError, "differs from hidden dtype"),
    (dict(targets=torch.zeros(2, 4, dtype=torch.long)), ValueError, "targets must have shape"),
    (dict(targets=torch.full((2, 3), 11)), ValueError, r"targets must be token ids in \[0, V\)"),
    (dict(targets=torch.full((2, 3), -1)), ValueError, r"targets must be token ids in \[0, V\)"),
    (dict(targets=torch.zeros(2, 3)), TypeError, "targets must be an integer tensor"),
    (dict(advantages=torch.zeros(3)), ValueError, "advantages must have shape"),
    (dict(advantages=torch.zeros(2, 3, 1)), ValueError, "advantages must have shape"),
    (dict(completion_mask=torch.ones(2, 4)), ValueError, "completion_mask must have shape"),
    (dict(completion_mask=torch.full((2, 3), 0.5)), ValueError, "completion_mask must be bool or hold only 0 and 1"),
    (dict(completion_mask=torch.full((2, 3), 2)), ValueError, "completion_mask must be bool or hold only 0 and 1"),
    (dict(loss_type="ppo"), ValueError, "loss_type must be one of"),
    (dict(importance_sampling_level="batch"), ValueError, "importance_sampling_level must be"),
    (dict(beta=0.1), ValueError, "beta != 0 needs ref_logprobs"),
    (dict(loss_type="dr_grpo", max_completion_length=0), ValueError, "max_completion_length must be a positive int"),
    (dict(max_completion_length=12.5), ValueError, "max_completion_length must be a positive int"),
    (dict(loss_type="vespo", importance_weights=torch.ones(2)), ValueError, "vespo' takes per-token importance"),
    (dict(sampling_logprobs=torch.zeros(2, 3)), ValueError, "sampling_logprobs is only used by the off-policy mask"),
    (
        dict(sampling_logprobs=torch.zeros(2, 4), off_policy_mask_threshold=0.5),
        ValueError,
        "sampling_logprobs must have shape",
    ),
    (dict(off_policy_mask_threshold=float("nan")), ValueError, "off_policy_mask_threshold must be a finite number"),
    (dict(top_entropy_quantile=1.5), ValueError, r"top_entropy_quantile must be a number in \[0, 1\]"),
    (dict(entropy_threshold=1.0), ValueError, "entropy_threshold is only used with top_entropy_quantile < 1"),
    (dict(entropy_coef="0.1"), ValueError, "entropy_coef must be a finite number"),
    (dict(use_bias_correction_kl=1), ValueError, "use_bias_correction_kl must be a bool"),
    (dict(beta=float("inf")), ValueError, "beta must be a finite number"),
    (dict(old_logprobs=torch.zeros(2, 2)), ValueError, "old_logprobs must have shape"),
    (dict(ref_logprobs=torch.zeros(3, 3), beta=0.1), ValueError, "ref_logprobs must have shape"),
    (dict(importance_weights=torch.ones(5)), ValueError, "importance_weights must have shape"),
    (dict(importance_weights=torch.ones(2, 2)), ValueError, "importance_weights must have shape"),
    (
        dict(targets=torch.full((2, 3), -100), completion_mask=torch.tensor([[1, 0, 0], [0, 0, 0]])),
        ValueError,
        r"targets must be token ids in \[0, V\) = \[0, 11\) where completion_mask is 1",
    ),
    (dict(bias=torch.zeros(10)), ValueError, "bias must have shape"),
    (dict(temperature=0.0), ValueError, "temperature must be a positive number"),
    (dict(epsilon=-0.1), ValueError, "epsilon and epsilon_high must be >= 0"),
    (dict(hidden=torch.randn(0, 3, 8)), ValueError, "hidden must be non-empty"),
    (dict(backend="cuda"), ValueError, "backend must be one of"),
    (dict(head_path="frozen"), ValueError, "head_path must be one of"),
    (dict(backward_mode="atomic"), ValueError, "backward_mode must be one of"),
    (dict(backward_mode="fused", backend="torch"), ValueError, "backward_mode='fused' is a Triton backward"),
    (dict(epsilon_low=0.2), TypeError, r"loss\(\) got an unexpected keyword argument 'epsilon_low'"),
]


@pytest.mark.parametrize("override, error, message", BAD_INPUTS)
def test_bad_input_raises_a_named_error(override, error, message):
    args = _good(**override)
    with pytest.raises(error, match=message):
        grpo_fast.loss(
            args.pop("hidden"),
            args.pop("weight"),
            args.pop("targets"),
            args.pop("advantages"),
            args.pop("completion_mask"),
            **args,
        )


def test_mixed_devices_are_rejected():
    meta_mask = torch.ones(2, 3, device="meta")
    with pytest.raises(ValueError, match="completion_mask is on meta but hidden is on cpu"):
        grpo_fast.loss(**_good(completion_mask=meta_mask))


def test_a_vocabulary_beyond_the_triton_grid_is_a_named_error(device):
    """The backward's grid has at most 65535 vocabulary tiles (kernels/config.py): a larger head is refused before
    any launch on the Triton backend, and the torch backend takes it."""
    from grpo_fast.kernels import config as kconfig

    V = kconfig.MAX_VOCAB + 1
    hidden, weight = torch.randn(1, 2, 1), torch.randn(V, 1)
    targets = torch.tensor([[0, V - 1]])
    on_device = [x.to(device) for x in (hidden, weight, targets)]
    for fn in (grpo_fast.logprobs, grpo_fast.logprobs_and_entropy):
        with pytest.raises(ValueError, match=f"weight has V = {V} rows; the Triton kernels take at most"):
            fn(*on_device, backend="triton")
    with pytest.raises(ValueError, match="the Triton kernels take at most"):
        grpo_fast.loss(*on_device, torch.zeros(1, device=device), torch.ones(1, 2, device=device), backend="triton")
    # fp64 truth: an fp32 log-softmax over 4.2M entries is itself off by a few 1e-5 nat
    expected = torch.log_softmax(hidden[0].double() @ weight.double().T, dim=-1).gather(1, targets.T).T.float()
    torch.testing.assert_close(grpo_fast.logprobs(hidden, weight, targets, backend="torch"), expected)


def test_device_errors_name_the_argument_they_compare_with():
    """token_loss has no hidden; sampling_importance_weights checks devices before it reads the mask's values."""
    args = _good()
    logp = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="advantages is on meta but logprobs is on cpu"):
        grpo_fast.token_loss(logp, torch.zeros(2, device="meta"), args["completion_mask"])
    with pytest.raises(ValueError, match="entropy is on meta but logprobs is on cpu"):
        grpo_fast.token_loss(
            logp, args["advantages"], args["completion_mask"], entropy=torch.zeros(2, 3, device="meta")
        )
    with pytest.raises(ValueError, match="completion_mask is on meta but old_logprobs is on cpu"):
        grpo_fast.sampling_importance_weights(logp, logp, torch.ones(2, 3, device="meta"))


def test_logprobs_rejects_bad_shapes_too():
    args = _good()
    with pytest.raises(ValueError, match="targets must have shape"):
        grpo_fast.logprobs(args["hidden"], args["weight"], torch.zeros(2, 5, dtype=torch.long))
