"""grpo_fast.trl.GRPOTrainer's vLLM importance-sampling correction over the sampler's support, against TRL 1.16's.

vLLM (``--logprobs-mode processed_logprobs``, which TRL 1.16 asks of its servers) returns each sampled token's
log-prob renormalised over the tokens its sampler could draw (top_k / top_p / min_p of logits / temperature); TRL 1.16
divides by it the old policy's log-prob over the whole vocabulary, so with an identical policy and sampler its ratio is
each token's kept mass S (below 1), not 1. grpo_fast's trainer renormalises the old log-prob over the same kept set.

"vLLM" here: the completions are drawn from the tiny model's own truncated distribution (``reference.kept_mask``,
vLLM's rules) and their sampler log-probs are ``grpo_fast.reference.sampler_logprobs``' support values of the same
model, so policy and sampler are identical; TRL's own ``_generate_and_score_completions`` scores the scripted rollout
(tests/trl_harness.py ``score_scripted_rollout``: a ``rollout_func`` in place of vLLM). Compared: the ratio through
grpo_fast's trainer (mean 1 within 1e-3, each token 1 within 1e-4), TRL's trainer (mean = the mean kept mass) and
grpo_fast's with ``sampler_support=False`` (TRL's ratio within 1e-5); the loss's old log-probs stay the whole
vocabulary's in both. Without truncation the two corrections are the same.
"""

from __future__ import annotations

import logging

import pytest
import torch
import trl
from trl_harness import (
    ASCII_EOS_ID,
    ASCII_VOCAB_SIZE,
    ascii_tokenizer,
    build_trainer,
    grpo_config,
    length_reward,
    score_scripted_rollout,
    set_loss_options,
    tiny_prompt_dataset,
    tiny_qwen2,
)

import grpo_fast
from grpo_fast import reference
from grpo_fast.trl import GRPOTrainer

# two prompts of one length (no left padding: the model's positions are the sampler's), two completions each
PROMPT_IDS = [[72, 105, 33, 32], [72, 105, 33, 32], [50, 43, 50, 61], [50, 43, 50, 61]]
COMPLETION_LENGTH = 8
# sharper than a random tiny head's near-uniform logits, so that the samplers cut a real part of the mass
HEAD_SCALE = 25.0
# the sampler's settings per case (GRPOConfig's fields); "none" truncates nothing
SAMPLERS = {
    "top_p": dict(top_p=0.9),
    "top_k": dict(top_k=5),
    "min_p": dict(min_p=0.1),
    "all_three_and_temperature": dict(top_k=20, top_p=0.95, min_p=0.02, temperature=0.8),
    "none": dict(),
}
SAMPLING_FIELDS = dict(top_k=0, top_p=1.0, min_p=None, temperature=1.0)


def policy():
    model = tiny_qwen2(vocab_size=ASCII_VOCAB_SIZE, hidden_size=32, intermediate_size=64)
    with torch.no_grad():
        model.lm_head.weight.mul_(HEAD_SCALE)
    return model


def config():
    return grpo_config(per_device_train_batch_size=4, num_generations=2, max_completion_length=COMPLETION_LENGTH)


def ours(**kwargs):
    """grpo_fast's trainer on the policy (``kwargs``: its own keywords)."""
    trainer = GRPOTrainer(
        model=policy(),
        reward_funcs=[length_reward],
        args=config(),
        train_dataset=tiny_prompt_dataset(),
        processing_class=ascii_tokenizer(),
        **kwargs,
    )
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    return trainer


def trainers():
    """TRL's trainer, grpo_fast's, and grpo_fast's with ``sampler_support=False``, on copies of one policy."""
    theirs = build_trainer(config(), model=policy(), processing_class=ascii_tokenizer())
    assert type(theirs) is trl.GRPOTrainer
    return {"trl": theirs, "ours": ours(), "ours_parity": ours(sampler_support=False)}


def set_sampler(trainer, fields):
    """The sampler's settings on a built trainer (TRL reads top_k / top_p / min_p from the trainer when it scores;
    the temperature is captured by the fused head, which ``set_loss_options`` re-patches)."""
    for name in ("top_k", "top_p", "min_p"):
        setattr(trainer, name, fields[name])
        setattr(trainer.args, name, fields[name])
    set_loss_options(trainer, temperature=fields["temperature"])


def sampled_rollout(model, fields, seed=0):
    """Completions drawn from ``model``'s truncated distribution (vLLM's kept set), each ending at EOS or at
    COMPLETION_LENGTH tokens, and their sampler log-probs (the support log-probs vLLM returns) and kept masses."""
    g = torch.Generator().manual_seed(seed)
    sampling = dict(top_k=fields["top_k"], top_p=fields["top_p"], min_p=fields["min_p"] or 0.0)
    head = model.get_output_embeddings()
    completions, logprobs, kept_mass = [], [], []
    with torch.no_grad():
        for prompt in PROMPT_IDS:
            ids = list(prompt)
            for _ in range(COMPLETION_LENGTH):
                hidden = model.model(input_ids=torch.tensor([ids])).last_hidden_state[:, -1]
                z = reference.logits(hidden, head.weight, head.bias, fields["temperature"])[0].double()
                p = torch.softmax(z.masked_fill(~reference.kept_mask(z, **sampling), -torch.inf), -1)
                ids.append(int(torch.multinomial(p, 1, generator=g)))
                if ids[-1] == ASCII_EOS_ID:
                    break
            completion = ids[len(prompt) :]
            hidden = model.model(input_ids=torch.tensor([ids])).last_hidden_state[0, len(prompt) - 1 : -1]
            _, support, log_kept = reference.sampler_logprobs(
                hidden, head.weight, torch.tensor(completion), head.bias, fields["temperature"], **sampling
            )
            assert torch.isfinite(support).all(), "a sampled token outside the sampler's kept set"
            completions.append(completion)
            logprobs.append(support.tolist())
            kept_mass.append(log_kept.exp())
    return completions, logprobs, torch.nn.utils.rnn.pad_sequence(kept_mass, batch_first=True)


def masked_mean(x, mask):
    return float((x * mask).sum() / mask.sum())


@pytest.mark.parametrize("case", SAMPLERS)
def test_ratio_over_the_samplers_support(case, caplog):
    fields = {**SAMPLING_FIELDS, **SAMPLERS[case]}
    pair = trainers()
    for trainer in pair.values():
        set_sampler(trainer, fields)
    completions, sampling, kept_mass = sampled_rollout(pair["trl"].model, fields)
    out = {}
    for mode in ("token_truncate", "sequence_mask"):
        with caplog.at_level(logging.INFO, logger="grpo_fast.integrations.trl"):
            out[mode] = {
                name: score_scripted_rollout(
                    trainer, PROMPT_IDS, completions, sampling, vllm_importance_sampling_mode=mode
                )
                for name, trainer in pair.items()
            }
    scored = out["token_truncate"]
    mask = scored["trl"]["completion_mask"]
    assert mask.shape == kept_mass.shape
    theirs, ours, parity = (scored[name]["importance_sampling_ratio"] for name in ("trl", "ours", "ours_parity"))
    kept = masked_mean(kept_mass, mask)

    # grpo_fast: like with like, every token's ratio 1; TRL 1.16: each token's kept mass
    assert abs(masked_mean(ours, mask) - 1.0) < 1e-3
    torch.testing.assert_close(ours * mask, mask.float(), rtol=0, atol=1e-4)
    assert masked_mean(theirs, mask) == pytest.approx(kept, abs=1e-5)
    torch.testing.assert_close(theirs * mask, kept_mass * mask, rtol=1e-5, atol=1e-5)
    # the parity argument: TRL's ratio
    torch.testing.assert_close(parity * mask, theirs * mask, rtol=1e-5, atol=1e-6)
    # sequence level: the product of the kept masses (TRL) against 1
    seq_theirs, seq_ours, seq_parity = (
        out["sequence_mask"][name]["importance_sampling_ratio"] for name in ("trl", "ours", "ours_parity")
    )
    product = torch.where(mask.bool(), kept_mass, 1.0).prod(-1, keepdim=True)
    torch.testing.assert_close(seq_theirs, product, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(seq_parity, seq_theirs, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(seq_ours, torch.ones_like(seq_ours), rtol=0, atol=1e-4)
    # the loss's old log-probs are the whole vocabulary's in every trainer
    for name in ("ours", "ours_parity"):
        torch.testing.assert_close(
            scored[name]["old_per_token_logps"] * mask,
            scored["trl"]["old_per_token_logps"] * mask,
            rtol=1e-5,
            atol=1e-5,
        )

    messages = [r.getMessage() for r in caplog.records if r.name == "grpo_fast.integrations.trl"]
    if case == "none":  # nothing truncated: the two corrections are one, TRL's
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
        assert kept == pytest.approx(1.0, abs=1e-6)
        assert len(messages) == 2 and all("does not truncate" in m for m in messages)
    else:
        assert kept < 0.99, "the sampler cut too little mass for the test to mean anything"
        # once per trainer, whatever the number of rollouts
        assert sum("over the sampler's support" in m for m in messages) == 1
        assert sum("sampler_support=False" in m and "TRL 1.16's, old" in m for m in messages) == 1
        assert len(messages) == 2


def test_sampler_support_must_be_a_bool():
    with pytest.raises(TypeError, match="sampler_support must be a bool"):
        GRPOTrainer(model=policy(), args=grpo_config(), sampler_support="yes")


def test_generation_kwargs_override_the_config():
    """TRL hands ``generation_kwargs`` to vLLM over the config's fields: the support follows them."""
    trainer = ours()
    trainer.args.generation_kwargs = {"top_p": 0.8, "top_k": None}
    assert grpo_fast.trl._vllm_truncation(trainer) == dict(top_k=0, top_p=0.8, min_p=0.0)
    trainer.args.generation_kwargs = {"top_k": -1}
    assert grpo_fast.trl._vllm_truncation(trainer) is None


def test_a_token_outside_the_kept_set_counts_as_no_correction():
    """A sampled token that the old policy's kept set lacks (the policy moved since the sampler drew it) has no
    support log-prob (NaN): TRL's correction counts it as a ratio of 1, as a token vLLM could not score; no error."""
    fields = {**SAMPLING_FIELDS, "top_k": 5}
    trainer = ours()
    set_sampler(trainer, fields)
    completions, sampling, _ = sampled_rollout(trainer.model, fields)
    head = trainer.model.get_output_embeddings()
    with torch.no_grad():
        hidden = trainer.model.model(input_ids=torch.tensor([PROMPT_IDS[0]])).last_hidden_state[:, -1]
        outside = int(reference.logits(hidden, head.weight, head.bias)[0].argmin())
    completions[0], sampling[0] = [outside], [-3.0]
    scored = score_scripted_rollout(
        trainer, PROMPT_IDS, completions, sampling, vllm_importance_sampling_mode="token_truncate"
    )
    ratio, mask = scored["importance_sampling_ratio"], scored["completion_mask"]
    assert ratio[0, 0] == 1.0 and mask[0].sum() == 1
    torch.testing.assert_close(ratio[1:] * mask[1:], mask[1:].float(), rtol=0, atol=1e-4)
    assert torch.isfinite(scored["old_per_token_logps"]).all()
