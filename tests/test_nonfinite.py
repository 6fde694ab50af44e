"""A NaN is never hidden: a non-finite value that reaches a scored token gives a non-finite loss on both backends
(torch on CPU, and the Triton kernels on the ``device`` fixture: the interpreter, or compiled on a CUDA GPU), every
loss type and importance-sampling level, through
grpo_fast.token_loss (layer 2) and grpo_fast.loss (layer 1 too: the general path, the three-sweep trained head, the
frozen-head path, no grad);
a NaN at a masked token changes nothing (those tokens are never read).
"""

import pytest
import torch
from conftest import backend_device
from helpers import make_batch, non_finite_inputs

import grpo_fast
from grpo_fast.grpo_loss.options import LOSS_TYPES

BACKENDS = ("torch", "triton")
LEVELS = ("token", "sequence")
B, T = 4, 9
NAN = float("nan")


def _token_batch(device):
    """Log-probs, a mask (a sequence without tokens) and layer 2's other inputs, drawn on CPU, on ``device``."""
    g = torch.Generator().manual_seed(0)
    logp = -torch.rand(B, T, generator=g) * 3
    mask = torch.rand(B, T, generator=g) > 0.3
    mask[0, :3] = True
    mask[0, 3] = False
    mask[2] = False  # a sequence without tokens
    inputs = dict(
        advantages=torch.randn(B, generator=g),
        old_logprobs=logp + 0.3 * torch.randn(B, T, generator=g),
        ref_logprobs=logp + 0.3 * torch.randn(B, T, generator=g),
        entropy=torch.rand(B, T, generator=g) * 4,
        importance_weights=0.5 + torch.rand(B, T, generator=g),
    )
    return logp.to(device), mask.to(device), {name: x.to(device) for name, x in inputs.items()}


def _token_loss(logp, mask, inputs, backend, **options):
    leaf = logp.clone().requires_grad_()
    kw = dict(inputs)
    adv = kw.pop("advantages")
    loss, _ = grpo_fast.token_loss(leaf, adv, mask, backend=backend, **kw, **options)
    loss.backward()
    return loss.detach(), leaf.grad


def _with(inputs, name, index, value):
    out = dict(inputs)
    out[name] = inputs[name].clone()
    out[name][index] = value
    return out


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_token_loss_a_nan_at_a_scored_token_gives_a_nan_loss(loss_type, level, backend, device):
    logp, mask, inputs = _token_batch(backend_device(backend, device))
    scored = (0, 1)
    assert mask[scored]
    options = dict(loss_type=loss_type, importance_sampling_level=level, beta=0.04)
    clean, _ = _token_loss(logp, mask, inputs, backend, **options)
    assert torch.isfinite(clean)
    bad_logp = logp.clone()
    bad_logp[scored] = NAN
    cases = {
        "logprobs": (bad_logp, inputs, {}),
        "logprobs, on-policy": (bad_logp, {k: v for k, v in inputs.items() if k != "old_logprobs"}, {}),
        "old_logprobs": (logp, _with(inputs, "old_logprobs", scored, NAN), {}),
        "ref_logprobs": (logp, _with(inputs, "ref_logprobs", scored, NAN), {}),
        "advantages": (logp, _with(inputs, "advantages", 0, NAN), {}),
        "per-token advantages": (
            logp,
            _with(dict(inputs, advantages=inputs["advantages"][:, None].expand(B, T)), "advantages", scored, NAN),
            {},
        ),
        "importance_weights": (logp, _with(inputs, "importance_weights", scored, NAN), {}),
        "entropy, with the bonus": (logp, _with(inputs, "entropy", scored, NAN), dict(entropy_coef=0.01)),
        "logprobs, with the off-policy and top-entropy masks": (
            bad_logp,
            inputs,
            dict(off_policy_mask_threshold=0.1, top_entropy_quantile=0.5),
        ),
    }
    for name, (x, kw, extra) in cases.items():
        loss, _ = _token_loss(x, mask, kw, backend, **options, **extra)
        assert not torch.isfinite(loss), f"{name}: a NaN at a scored token gave the finite loss {loss.item()}"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_token_loss_a_nan_at_a_masked_token_changes_nothing(loss_type, level, backend, device):
    logp, mask, inputs = _token_batch(backend_device(backend, device))
    options = dict(loss_type=loss_type, importance_sampling_level=level, beta=0.04, entropy_coef=0.01)
    options.update(off_policy_mask_threshold=0.2, top_entropy_quantile=0.7)
    inputs["sampling_logprobs"] = inputs["old_logprobs"] + 0.2
    inputs["advantages"] = inputs["advantages"][:, None].expand(B, T).clone()
    if loss_type == "vespo":
        del inputs["importance_weights"]  # vespo reads the weights at padding too, as TRL: a NaN there reaches it
    clean, clean_grad = _token_loss(logp, mask, inputs, backend, **options)
    masked = ~mask
    bad_logp = logp.masked_fill(masked, NAN)
    bad = {name: x.masked_fill(masked, NAN) for name, x in inputs.items()}
    loss, grad = _token_loss(bad_logp, mask, bad, backend, **options)
    assert torch.isfinite(clean) and torch.isfinite(grad).all()
    assert torch.equal(loss, clean) and torch.equal(grad, clean_grad)
    # a sequence without tokens may have a NaN advantage
    per_sequence = dict(inputs, advantages=inputs["advantages"][:, 0].clone())
    clean, clean_grad = _token_loss(logp, mask, per_sequence, backend, **options)
    per_sequence["advantages"][2] = NAN
    loss, grad = _token_loss(logp, mask, per_sequence, backend, **options)
    assert torch.isfinite(grad).all()
    assert torch.equal(loss, clean) and torch.equal(grad, clean_grad)


# "trained": a trained weight with head_path "auto", the three-sweep head where the options are token-local (the
# Triton backend), the general path elsewhere; "general": the recompute path, asked for
PATHS = ("general", "trained", "frozen head", "no grad")


def _loss(batch, backend, path, **kw):
    hidden = batch["hidden"].clone().requires_grad_(path != "no grad")
    weight = batch["weight"].clone().requires_grad_(path in ("general", "trained"))
    targets, advantages, mask = batch["targets"], batch["advantages"], batch["mask"]
    kw.update(old_logprobs=batch["old"], ref_logprobs=batch["ref"], backend=backend)
    if path == "general":
        kw.update(head_path="general")
    with torch.set_grad_enabled(path != "no grad"):
        loss, _ = grpo_fast.loss(hidden, weight, targets, advantages, mask, **kw)
    if path != "no grad":
        loss.backward()
        return loss.detach(), hidden.grad
    return loss, None


# layer 1 carries a NaN the same way whatever the loss type (the token-loss tests above cover every type in the
# fast tier): the fast tier runs two of them, the full suite all
FAST_LAYER1_CASES = (("dapo", "token"), ("vespo", "sequence"))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "loss_type, level",
    [
        pytest.param(loss_type, level, marks=() if (loss_type, level) in FAST_LAYER1_CASES else pytest.mark.slow)
        for loss_type in LOSS_TYPES
        for level in LEVELS
    ],
)
def test_loss_a_non_finite_input_at_a_scored_token_gives_a_non_finite_loss(loss_type, level, backend, device):
    batch = make_batch(B=3, T=5, D=16, V=37, device=backend_device(backend, device))
    mask = batch["mask"]
    assert mask[0, 0] and not mask[1].any()
    options = dict(loss_type=loss_type, importance_sampling_level=level, beta=0.04)
    nan_hidden = dict(batch, hidden=batch["hidden"].clone())
    nan_hidden["hidden"][0, 0, 3] = NAN
    # an inf in the row of the target of token (0, 0), which its hidden state meets with a positive entry
    inf_weight = dict(batch, hidden=batch["hidden"].clone(), weight=batch["weight"].clone())
    inf_weight["hidden"][0, 0, 0] = 1.0
    inf_weight["weight"][batch["targets"][0, 0], 0] = float("inf")
    nan_old = dict(batch, old=batch["old"].clone())
    nan_old["old"][0, 0] = NAN
    # a NaN in a masked position's hidden state (a sequence without tokens, a padding token of another)
    masked_nan = dict(batch, hidden=batch["hidden"].clone())
    masked_nan["hidden"][1] = NAN
    padding = (~mask & mask.any(1, keepdim=True)).nonzero()
    assert padding.numel()
    masked_nan["hidden"][tuple(padding[0])] = NAN
    for path in PATHS:
        clean, clean_grad = _loss(batch, backend, path, **options)
        assert torch.isfinite(clean), path
        for name, bad in (("hidden", nan_hidden), ("weight", inf_weight), ("old_logprobs", nan_old)):
            with non_finite_inputs():
                loss, _ = _loss(bad, backend, path, **options)
            assert not torch.isfinite(loss), f"{path}: a non-finite {name} gave the finite loss {loss.item()}"
        loss, grad = _loss(masked_nan, backend, path, **options)
        assert torch.equal(loss, clean), path
        if grad is not None:
            assert torch.isfinite(grad).all(), path
            torch.testing.assert_close(grad, clean_grad, rtol=0, atol=0, equal_nan=False)


@pytest.mark.parametrize("backward_mode", ["chunked", "fused"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_nan_gradient_for_one_token_reaches_dh_and_dw(backend, backward_mode, device):
    """Layer 1's backward skips a token block whose coefficients are all zero; a block whose only non-zero
    coefficient is NaN (the other tokens clipped or masked) is not skipped: that token's dH and dW are NaN."""
    if backend == "torch" and backward_mode == "fused":
        pytest.skip("the torch backend has one backward (chunked)")
    g = torch.Generator().manual_seed(3)
    N, D, V = 5, 12, 37
    dev = backend_device(backend, device)
    hidden = torch.randn(1, N, D, generator=g).to(dev).requires_grad_()
    weight = (torch.randn(V, D, generator=g) * 0.3).to(dev).requires_grad_()
    targets = torch.randint(0, V, (1, N), generator=g).to(dev)
    logp, _ = grpo_fast.logprobs_and_entropy(hidden, weight, targets, backend=backend, backward_mode=backward_mode)
    grad_logp = torch.tensor([[0.0, 0.0, NAN, 0.0, 0.0]], device=dev)
    logp.backward(grad_logp.nan_to_num(nan=0.0), inputs=[hidden], retain_graph=True)  # finite without the NaN
    assert torch.isfinite(hidden.grad).all()
    hidden.grad = None
    logp.backward(grad_logp)
    assert torch.isnan(hidden.grad[0, 2]).all() and torch.isfinite(hidden.grad[0, [0, 1, 3, 4]]).all()
    assert torch.isnan(weight.grad).any()


@pytest.mark.parametrize("backward_mode", ["chunked", "fused"])
@pytest.mark.parametrize("check_values", [True, False])
def test_large_logits_leave_no_nan_in_the_rows_past_the_batch(backward_mode, check_values, device):
    """Logits around 150 (a large bias) and a token count that is no multiple of the backward's row block: the rows
    of the last block past the batch must add nothing to dW and db (exp(z - lse) with no lse of theirs overflowed,
    and 0 x inf was a NaN in db), on both row selections; the gradients equal the torch backend's."""
    g = torch.Generator().manual_seed(0)
    Bn, Tn, D, V = 4, 40, 32, 97
    mask = torch.zeros(Bn, Tn, dtype=torch.bool)
    mask[0, :13] = True
    mask[2, 5:9] = True
    inputs = (
        torch.randn(Bn, Tn, D, generator=g),
        torch.randn(V, D, generator=g) * 0.3,
        torch.randn(V, generator=g) * 50,
    )
    targets = torch.randint(0, V, (Bn, Tn), generator=g)
    advantages = torch.randn(Bn, generator=g)
    grads = {}
    for backend in ("triton", "torch"):
        dev = backend_device(backend, device)
        leaves = [x.to(dev).requires_grad_() for x in inputs]
        loss, _ = grpo_fast.loss(
            leaves[0],
            leaves[1],
            targets.to(dev),
            advantages.to(dev),
            mask.to(dev),
            bias=leaves[2],
            entropy_coef=0.01,
            backend=backend,
            check_values=check_values,
            **({"backward_mode": backward_mode} if backend == "triton" else {}),
        )
        loss.backward()
        grads[backend] = [x.grad.cpu() for x in leaves]
    for name, actual, expected in zip(("dH", "dW", "db"), grads["triton"], grads["torch"], strict=True):
        assert torch.isfinite(actual).all(), name
        torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
