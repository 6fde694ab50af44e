"""One record per loss type (grpo_fast.grpo_loss.options.LOSS_TYPE_RECORDS): the spec, the token kernel's launcher, its
torch twin, the normaliser and the metrics builder all read it, and each raises on what it does not know.

A hypothetical loss type registered here as a record, and nothing else, runs on both backends with the normaliser
and metrics the record names; a record whose formula exists nowhere raises in the spec and in the launcher. The
Triton backend runs on the ``device`` fixture (the interpreter on CPU, compiled on a CUDA GPU), torch on CPU.
"""

import math

import pytest
import torch
from conftest import backend_device

import grpo_fast
from grpo_fast import reference
from grpo_fast.grpo_loss import metrics as metrics_module
from grpo_fast.grpo_loss.options import (
    LOSS_TYPE_RECORDS,
    LOSS_TYPES,
    NUM_ITEMS_LOSS_TYPES,
    POLICY_TERMS,
    LossOptions,
    LossType,
    Metric,
    PolicyTerm,
)
from grpo_fast.kernels import loss_statistics
from grpo_fast.kernels import token_loss as token_kernel

B, T = 4, 9


def _batch(seed=0, device="cpu"):
    """Log-probs, a mask (a sequence without tokens), advantages, old / reference log-probs and entropies, drawn on
    CPU, on ``device``."""
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(B, T, generator=g) * 3
    mask = torch.rand(B, T, generator=g) > 0.3
    mask[2] = False  # a sequence without tokens
    mask[3, 0] = True
    adv = torch.randn(B, generator=g)
    old = logp + 0.4 * torch.randn(B, T, generator=g)
    ref = logp + 0.4 * torch.randn(B, T, generator=g)
    entropy = torch.rand(B, T, generator=g) * 4
    return tuple(x.to(device) for x in (logp, mask, adv, old, ref, entropy))


def _run(fn, logp, adv, mask, entropy, **kw):
    leaf = logp.clone().requires_grad_()
    loss, metrics = fn(leaf, adv, mask, entropy=entropy, **kw)
    loss.backward()
    return loss.detach(), dict(metrics), leaf.grad


def _check_both_backends(spec, device, logp, adv, mask, entropy, **kw):
    """Both backends of the product give the spec's loss, metrics and gradient (``spec``: _run's result)."""
    for backend in ("torch", "triton"):
        dev = backend_device(backend, device)
        on_dev = {name: x.to(dev) for name, x in kw.items() if isinstance(x, torch.Tensor)}
        loss, metrics, grad = _run(
            grpo_fast.token_loss,
            *(x.to(dev) for x in (logp, adv, mask, entropy)),
            backend=backend,
            **dict(kw, **on_dev),
        )
        torch.testing.assert_close(loss.cpu(), spec[0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(grad.cpu(), spec[2], rtol=1e-5, atol=1e-7)
        assert set(metrics) == set(spec[1])
        for name in spec[1]:
            torch.testing.assert_close(metrics[name].cpu(), spec[1][name], rtol=1e-5, atol=1e-6)


def test_the_records_are_trls_loss_types():
    assert LOSS_TYPES == ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")
    assert tuple(LOSS_TYPE_RECORDS) == LOSS_TYPES  # one record per name of the Literal, in its order
    assert NUM_ITEMS_LOSS_TYPES == ("dapo", "cispo", "vespo")
    assert {name for name, r in LOSS_TYPE_RECORDS.items() if r.policy_term.formula == "clipped"} == {
        "grpo",
        "bnpo",
        "dr_grpo",
        "dapo",
        "luspo",
    }
    assert {name for name, r in LOSS_TYPE_RECORDS.items() if r.row_mean} == {"grpo", "sapo"}
    # every record's formula exists in the token kernel
    assert {r.policy_term.formula for r in LOSS_TYPE_RECORDS.values()} == set(token_kernel.LOSS_KINDS)
    # the families' facts: cispo's and vespo's terms are -stopgrad(c) A logp, vespo's is weighted by phi, which its
    # weights enter
    assert {name for name, term in POLICY_TERMS.items() if term.gradient_wrt == "logprob"} == {"cispo", "vespo"}
    assert {name for name, term in POLICY_TERMS.items() if term.gamma_weighted} == {"vespo"}
    assert {name for name, term in POLICY_TERMS.items() if term.importance_weights_in_term} == {"vespo"}
    assert {name for name, term in POLICY_TERMS.items() if "delta" in term.options} == {"clipped"}


# a value for each family's own options (a term's options, LossOptions attributes): clip_high through epsilon_high
FAMILY_OPTION_VALUES = {
    "epsilon": dict(epsilon=0.1),
    "clip_high": dict(epsilon_high=0.05),
    "delta": dict(delta=1.05),
    "sapo_temperature_pos": dict(sapo_temperature_pos=0.5),
    "sapo_temperature_neg": dict(sapo_temperature_neg=2.0),
    "vespo_k_pos": dict(vespo_k_pos=1.0),
    "vespo_lambda_pos": dict(vespo_lambda_pos=1.5),
    "vespo_k_neg": dict(vespo_k_neg=1.0),
    "vespo_lambda_neg": dict(vespo_lambda_neg=1.5),
}


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_a_familys_options_are_its_records(loss_type):
    """The options a family's record names (PolicyTerm.options) are those that change the spec's loss: each of
    them does (the batch clips, caps and has advantages of both signs), and none of the other families' does
    (epsilon_high given, so that epsilon is the lower offset alone)."""
    logp, mask, adv, old, _, _ = _batch(seed=4)
    old = logp + 0.8 * (old - logp)  # ratios far enough from 1 that every clip and cap bites
    adv = torch.tensor([0.9, -1.2, 0.5, -0.4])
    term = LOSS_TYPE_RECORDS[loss_type].policy_term
    assert set(term.options) <= set(FAMILY_OPTION_VALUES)
    given = dict(old_logprobs=old, loss_type=loss_type, epsilon_high=0.28)
    baseline, _ = reference.token_loss(logp, adv, mask, **given)
    for name, changed in FAMILY_OPTION_VALUES.items():
        loss, _ = reference.token_loss(logp, adv, mask, **dict(given, **changed))
        assert (loss.item() != baseline.item()) == (name in term.options), (name, loss.item(), baseline.item())


def test_the_statistics_are_named_once():
    """grpo_fast.kernels.loss_statistics names the statistics: the token kernel's STAT_ slots are its SLOTS (each slot
    once), a metric that reads another statistic is an error, and both layer-2 backends return the same statistics."""
    kernel_slots = {
        name.removeprefix("STAT_").lower(): slot.value
        for name, slot in vars(token_kernel).items()
        if name.startswith("STAT_")
    }
    assert kernel_slots == loss_statistics.SLOTS
    assert sorted(loss_statistics.SLOTS.values()) == list(range(token_kernel.NUM_STATS.value))
    assert list(loss_statistics.SLOTS) == list(loss_statistics.STATISTICS)
    assert {m.statistic for r in LOSS_TYPE_RECORDS.values() for m in r.metrics} <= set(loss_statistics.STATISTICS)
    with pytest.raises(ValueError, match="metric 'clip_ratio/median': statistic must be one of .* got 'median'"):
        Metric("clip_ratio/median", "median")


# A loss type TRL does not have: cispo's per-token term, normalised per sequence (grpo's reduction), logging the
# cispo clip fraction and its largest per-sequence value.
CISPO_PER_SEQUENCE = LossType(
    "cispo_per_sequence",
    POLICY_TERMS["cispo"],
    "sequences",
    row_mean=True,
    metrics=(Metric("cispo_clip_ratio", "cispo"), Metric("cispo_clip_ratio/max", "cispo", "max_over_sequences")),
)


@pytest.mark.parametrize("level", ("token", "sequence"))
def test_a_new_loss_type_is_one_record(monkeypatch, level, device):
    monkeypatch.setitem(LOSS_TYPE_RECORDS, CISPO_PER_SEQUENCE.name, CISPO_PER_SEQUENCE)
    logp, mask, adv, old, ref, entropy = _batch(seed=1)
    kw = dict(
        loss_type="cispo_per_sequence",
        importance_sampling_level=level,
        old_logprobs=old,
        ref_logprobs=ref,
        beta=0.04,
        epsilon_high=1.1,
    )
    assert LossOptions(loss_type="cispo_per_sequence").denominator(B, mask.sum()) == B
    spec = _run(reference.token_loss, logp, adv, mask, entropy, **kw)

    # the spec by hand: -min(r, eps_high) A logp + beta k3 r, each sequence's token mean, averaged over sequences
    m = mask.float()
    log_ratio = logp - old
    if level == "sequence":
        log_ratio = (log_ratio * m).sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp(min=1.0)
    r = log_ratio.exp().expand(B, T)
    kl = ((ref - logp).exp() - (ref - logp) - 1) * r
    per_token = -torch.clamp(r, max=1.1) * adv[:, None] * logp + 0.04 * kl
    expected = ((per_token * m).sum(-1) / m.sum(-1).clamp(min=1.0)).mean()
    assert math.isclose(spec[0].item(), expected.item(), rel_tol=1e-6)
    clipped = ((r > 1.1) & (adv[:, None] > 0)).float()
    if level == "token":
        per_sequence = (clipped * m).sum(-1)[m.sum(-1) > 0] / m.sum(-1)[m.sum(-1) > 0]
        assert math.isclose(spec[1]["cispo_clip_ratio"].item(), ((clipped * m).sum() / m.sum()).item(), rel_tol=1e-6)
    else:  # one value per sequence, every sequence
        per_sequence = clipped[:, 0]
        assert math.isclose(spec[1]["cispo_clip_ratio"].item(), per_sequence.mean().item(), rel_tol=1e-6)
    assert spec[1]["cispo_clip_ratio/max"].item() == per_sequence.max().item()
    assert per_sequence.max().item() > 0  # not vacuous: some sequence clips
    assert set(spec[1]) == {"kl", "entropy", "cispo_clip_ratio", "cispo_clip_ratio/max", "ratio_mean"}

    _check_both_backends(spec, device, logp, adv, mask, entropy, **kw)


# A family TRL does not have: vespo's formula with the importance weights used as every other family uses them
# (multiplying the term, any shape) instead of inside phi's log W; a loss type of it, one record.
VESPO_WEIGHTED = LossType(
    "vespo_weighted",
    PolicyTerm("vespo", POLICY_TERMS["vespo"].options, gradient_wrt="logprob", gamma_weighted=True),
    "num_items_in_batch",
    metrics=(Metric("vespo/phi_seq_mean", "phi"),),
)


@pytest.mark.parametrize("weights", ("sequence", "token"))
def test_a_loss_types_importance_weight_use_is_its_records(monkeypatch, weights, device):
    monkeypatch.setitem(LOSS_TYPE_RECORDS, VESPO_WEIGHTED.name, VESPO_WEIGHTED)
    logp, mask, adv, old, _, entropy = _batch(seed=2)
    g = torch.Generator().manual_seed(3)
    iw = 0.5 + torch.rand((B,) if weights == "sequence" else (B, T), generator=g)
    kw = dict(loss_type="vespo_weighted", old_logprobs=old, importance_weights=iw)
    spec = _run(reference.token_loss, logp, adv, mask, entropy, **kw)

    # the spec by hand: -phi(W) A logp w, phi of the log-ratios alone (no weights in log W), over the mask's sum
    m = mask.float()
    w = iw[:, None].expand(B, T) if weights == "sequence" else iw
    phi = reference.gamma_weights(adv[:, None], logp - old, m, None, 2.0, 3.0, 3.0, 2.0)
    in_phi = reference.gamma_weights(adv[:, None], logp - old, m, w, 2.0, 3.0, 3.0, 2.0)
    assert not torch.allclose(phi, in_phi)  # not vacuous: weights in log W would give another phi
    per_token = -phi * adv[:, None] * logp * w
    expected = (per_token * m).sum() / m.sum()
    assert math.isclose(spec[0].item(), expected.item(), rel_tol=1e-6)
    torch.testing.assert_close(spec[2], -phi * adv[:, None] * w * m / m.sum(), rtol=1e-6, atol=1e-7)
    assert math.isclose(spec[1]["vespo/phi_seq_mean"].item(), phi.mean().item(), rel_tol=1e-6)

    _check_both_backends(spec, device, logp, adv, mask, entropy, **kw)


def test_a_records_inconsistent_facts_raise():
    # importance weights in a term without phi: nothing would read them
    with pytest.raises(
        ValueError, match="policy term 'sapo' puts the importance weights in its term, but the term has no"
    ):
        PolicyTerm("sapo", importance_weights_in_term=True)
    with pytest.raises(ValueError, match="gradient_wrt must be one of \\('ratio', 'logprob'\\), got 'advantage'"):
        PolicyTerm("clipped", gradient_wrt="advantage")
    with pytest.raises(ValueError, match="gamma_weighted must be a bool, got 1"):
        PolicyTerm("vespo", gamma_weighted=1)


def test_weights_in_a_term_the_spec_does_not_weigh_by_phi_raise(monkeypatch):
    """The spec states it in its own words: only vespo's term reads the weights (a record claiming phi for sapo)."""
    record = LossType(
        "sapo_weights_in_term",
        PolicyTerm("sapo", gamma_weighted=True, importance_weights_in_term=True),
        "sequences",
        row_mean=True,
    )
    monkeypatch.setitem(LOSS_TYPE_RECORDS, record.name, record)
    logp, mask, adv, old, _, _ = _batch()
    with pytest.raises(ValueError, match="loss type 'sapo_weights_in_term' puts the importance weights in its term"):
        reference.token_loss(
            logp, adv, mask, old_logprobs=old, importance_weights=torch.ones_like(logp), loss_type=record.name
        )


def test_an_unknown_policy_term_raises_in_the_spec_and_the_launcher(monkeypatch, device):
    monkeypatch.setitem(LOSS_TYPE_RECORDS, "tanh_clip", LossType("tanh_clip", PolicyTerm("tanh_clip"), "tokens"))
    logp, mask, adv, old, _, entropy = _batch()
    with pytest.raises(ValueError, match="loss type 'tanh_clip' has an unknown policy term 'tanh_clip'"):
        reference.token_loss(logp, adv, mask, old_logprobs=old, loss_type="tanh_clip")
    with pytest.raises(ValueError, match="loss type 'tanh_clip' has an unknown policy term 'tanh_clip'"):
        grpo_fast.token_loss(logp, adv, mask, old_logprobs=old, loss_type="tanh_clip", backend="torch")
    logp, mask, adv, old, _, entropy = _batch(device=device)
    with pytest.raises(ValueError, match="policy term the token kernel does not have: 'tanh_clip'"):
        grpo_fast.token_loss(logp, adv, mask, old_logprobs=old, loss_type="tanh_clip", backend="triton")


def test_an_unknown_normaliser_raises(monkeypatch, device):
    monkeypatch.setitem(LOSS_TYPE_RECORDS, "per_group", LossType("per_group", POLICY_TERMS["clipped"], "groups"))
    logp, mask, adv, old, _, _ = _batch()
    with pytest.raises(ValueError, match="loss type 'per_group' has an unknown normaliser 'groups'"):
        LossOptions(loss_type="per_group").denominator(B, mask.sum())
    for backend in ("torch", "triton"):
        logp, mask, adv, old, _, _ = _batch(device=backend_device(backend, device))
        with pytest.raises(ValueError, match="unknown normaliser 'groups'"):
            grpo_fast.token_loss(logp, adv, mask, old_logprobs=old, loss_type="per_group", backend=backend)


def test_an_unknown_metric_reduction_raises(monkeypatch, device):
    record = LossType(
        "bnpo_median", POLICY_TERMS["clipped"], "tokens", metrics=(Metric("clip_ratio/median", "low", "median"),)
    )
    monkeypatch.setitem(LOSS_TYPE_RECORDS, record.name, record)
    for backend in ("torch", "triton"):
        logp, mask, adv, old, _, _ = _batch(device=backend_device(backend, device))
        with pytest.raises(
            ValueError, match="metric 'clip_ratio/median' of loss type 'bnpo_median' has an unknown reduction 'median'"
        ):
            grpo_fast.token_loss(logp, adv, mask, old_logprobs=old, loss_type="bnpo_median", backend=backend)


def test_an_unknown_loss_type_raises():
    with pytest.raises(ValueError, match=r"loss_type must be one of \('grpo', "):
        LossOptions(loss_type="ppo")


def test_metrics_builder_reductions_by_hand():
    # two sequences of 2 and 0 tokens, a per-token statistic and a per-sequence one
    options = LossOptions(loss_type="bnpo", beta=0.1)
    counts = torch.tensor([2.0, 0.0, 1.0])
    rows = {
        "ratio": metrics_module.RowValues(torch.tensor([1.5, 0.7, 1.2]), per_sequence=True),
        "kl": metrics_module.RowValues(torch.tensor([0.3, 0.0, 0.6])),
        "low": metrics_module.RowValues(torch.tensor([1.0, 0.0, 0.0])),
        "high": metrics_module.RowValues(torch.tensor([0.0, 0.0, 1.0])),
        "region": metrics_module.RowValues(torch.tensor([1.0, 0.0, 1.0])),
    }
    got = metrics_module.loss_metrics(options, rows, counts)
    expected = {
        "kl": 0.9 / 3,
        "ratio_mean": 3.4 / 3,
        "clip_ratio/low_mean": 1 / 3,
        "clip_ratio/high_mean": 1 / 3,
        "clip_ratio/region_mean": 2 / 3,
        "clip_ratio/low_min": 0.0,  # per-sequence fractions 0.5 and 0 (the empty sequence has none)
        "clip_ratio/high_max": 1.0,
    }
    assert set(got) == set(expected)
    for name, value in expected.items():
        assert math.isclose(got[name].item(), value, rel_tol=1e-6), name
