"""Rollout pieces (gsm8k.rollout: the completion mask, decoding, prompts, generation and its progress bar)
and the generic GRPO pieces (grpo_fast.grpo_loss.advantages: group advantages;
grpo_fast.integrations.hidden_states: completion hidden states)."""

import inspect
import io

import pytest
import torch
from gsm8k import rollout
from gsm8k.tokenizer import byte_tokenizer
from helpers import tiny_generator_config

import grpo_fast
from grpo_fast import reference
from grpo_fast.grpo_loss.advantages import group_advantages
from grpo_fast.integrations.hidden_states import completion_hidden_states


def tiny_model(seed=0):
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(seed)
    return Qwen2ForCausalLM(tiny_generator_config()).eval()


# ------------------------------------------------------------------------------------------ completion mask
def test_completion_mask_cut_after_first_eos():
    ids = torch.tensor([[5, 2, 7, 2], [5, 6, 7, 8], [2, 0, 0, 0], [3, 4, 2, 2]])
    expected = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 1, 0]])
    assert torch.equal(rollout.completion_mask(ids, [2]), expected)


def test_completion_mask_several_eos_ids():
    ids = torch.tensor([[5, 9, 2, 1], [9, 2, 2, 2], [1, 1, 1, 1]])
    expected = torch.tensor([[1, 1, 0, 0], [1, 0, 0, 0], [1, 1, 1, 1]])
    assert torch.equal(rollout.completion_mask(ids, [2, 9]), expected)


# ------------------------------------------------------------------------------------------ advantages
REWARDS = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 5.0, 5.0, 5.0])


def test_group_advantages_group_scaling_and_zero_std_group():
    adv, std = group_advantages(REWARDS, 4, "group")
    s = 1.2909944487358056  # unbiased std of 1, 2, 3, 4
    expected = torch.tensor([-1.5, -0.5, 0.5, 1.5]) / (s + 1e-4)
    torch.testing.assert_close(adv[:4], expected)
    assert torch.equal(adv[4:], torch.zeros(4))  # all-equal rewards: zero advantages, no NaN
    torch.testing.assert_close(std, torch.tensor([s] * 4 + [0.0] * 4))
    torch.testing.assert_close(adv[:4].mean(), torch.tensor(0.0), atol=1e-6, rtol=0)


def test_group_advantages_batch_and_none():
    adv, std = group_advantages(REWARDS, 4, "batch")
    s = float(REWARDS.std())  # one std over the whole batch
    assert s == pytest.approx(1.5811388300841898)  # sqrt(17.5 / 7)
    torch.testing.assert_close(adv, torch.tensor([-1.5, -0.5, 0.5, 1.5, 0.0, 0.0, 0.0, 0.0]) / (s + 1e-4))
    torch.testing.assert_close(std, torch.full((8,), s))
    adv, std = group_advantages(REWARDS, 4, "none")  # Dr. GRPO: no division
    assert torch.equal(adv, torch.tensor([-1.5, -0.5, 0.5, 1.5, 0.0, 0.0, 0.0, 0.0]))
    adv, _ = group_advantages(torch.zeros(6), 3, "batch")  # the whole batch at zero std
    assert torch.equal(adv, torch.zeros(6))


def test_group_advantages_errors():
    with pytest.raises(ValueError, match="scale_rewards"):
        group_advantages(REWARDS, 4, "sequence")
    with pytest.raises(ValueError, match="num_generations"):
        group_advantages(REWARDS, 3)
    with pytest.raises(ValueError, match="num_generations"):
        group_advantages(REWARDS, 1)


# ------------------------------------------------------------------------------------------ text
def test_tokenize_prompts_left_pads_and_decode_drops_masked_and_unknown_ids():
    tok = byte_tokenizer()
    prompts = [[{"role": "user", "content": "hi"}], [{"role": "user", "content": "a longer one"}]]
    ids, mask = rollout.tokenize_prompts(tok, prompts)
    assert ids.shape[0] == 2 and mask[0, 0] == 0 and mask[1].all() and mask[:, -1].all()
    assert ids[0, 0] == tok.pad_token_id
    assert tok.decode(ids[1]).endswith("<|im_start|>assistant\n")
    comp = torch.tensor([tok("ok")["input_ids"] + [tok.eos_token_id, 65], tok("x")["input_ids"] + [1000, 66, 67]])
    texts = rollout.decode_completions(tok, comp, rollout.completion_mask(comp, [tok.eos_token_id]))
    assert texts == ["ok", tok.decode([66, 67]).join(["x", ""])]


def test_tokenize_prompts_completion_prefix_follows_the_generation_prompt():
    tok = byte_tokenizer()
    prompts = [[{"role": "user", "content": "hi"}], [{"role": "user", "content": "a longer one"}]]
    plain, _ = rollout.tokenize_prompts(tok, prompts)
    ids, mask = rollout.tokenize_prompts(tok, prompts, completion_prefix="<reasoning>\n")
    for row, m in zip(ids, mask):
        assert tok.decode(row[m.bool()]).endswith("<|im_start|>assistant\n<reasoning>\n")
    assert tok.decode(ids[1]) == tok.decode(plain[1]) + "<reasoning>\n"


# ------------------------------------------------------------------------------------------ hidden states
def test_completion_hidden_states_match_model_logits_and_ignore_left_padding():
    model = tiny_model()
    torch.manual_seed(1)
    prompt = torch.randint(0, 256, (1, 7))
    completion = torch.randint(0, 256, (1, 5))
    # row 0: a 7-token prompt; row 1: its last 4 tokens behind 3 pad tokens
    pad = torch.full((1, 3), 257)
    short = prompt[:, 3:]
    prompt_ids = torch.cat([prompt, torch.cat([pad, short], 1)], 0)
    prompt_mask = torch.cat([torch.ones(1, 7), torch.cat([torch.zeros(1, 3), torch.ones(1, 4)], 1)], 0).long()
    completion_ids = completion.repeat(2, 1)
    completion_mask = torch.ones_like(completion_ids)
    with torch.no_grad():
        hidden = completion_hidden_states(model, prompt_ids, prompt_mask, completion_ids, completion_mask)
        assert hidden.shape == (2, 5, 32)
        # row 0: the model's own logits at positions 6..10 predict the completion
        logits = model(torch.cat([prompt, completion], 1)).logits[:, 6:11]
        torch.testing.assert_close(hidden[:1] @ model.lm_head.weight.T, logits, rtol=1e-5, atol=1e-5)
        # row 1: padding changes nothing: equal to the unpadded short prompt alone
        alone = model(torch.cat([short, completion], 1)).logits[:, 3:8]
        torch.testing.assert_close(hidden[1:] @ model.lm_head.weight.T, alone, rtol=1e-5, atol=1e-5)
        logp = grpo_fast.logprobs(hidden, model.lm_head.weight, completion_ids)
        torch.testing.assert_close(
            logp, reference.logprobs(hidden, model.lm_head.weight, completion_ids), rtol=1e-5, atol=1e-5
        )


def test_generate_shapes_mask_and_force_full_length():
    model, tok = tiny_model(), byte_tokenizer()
    prompts = [[{"role": "user", "content": "1+1?"}], [{"role": "user", "content": "2+2, please?"}]]
    torch.manual_seed(0)
    batch = rollout.generate(model, tok, prompts, num_generations=3, max_completion_length=6)
    assert batch.prompt_ids.shape[0] == batch.completion_ids.shape[0] == 6
    assert torch.equal(batch.prompt_ids[0], batch.prompt_ids[2])
    assert not torch.equal(batch.prompt_ids[0], batch.prompt_ids[3])
    assert torch.equal(batch.completion_mask, rollout.completion_mask(batch.completion_ids, [tok.eos_token_id]))
    full = rollout.generate(model, tok, prompts, num_generations=2, max_completion_length=6, force_full_length=True)
    assert full.completion_ids.shape == (4, 6) and full.completion_mask.all()
    assert not (full.completion_ids == tok.eos_token_id).any()
    part = full.select(slice(1, 3))
    assert part.completion_ids.shape == (2, 6) and torch.equal(part.prompt_ids, full.prompt_ids[1:3])


def test_generation_progress_counts_finished_rows_and_tokens(capsys):
    progress = rollout.GenerationProgress(3, 4, [9], desc="t")
    progress.put(torch.tensor([[1, 2], [1, 2], [1, 2]]))  # the prompt ids: not counted
    progress.put(torch.tensor([5, 9, 5]))
    assert (progress.steps, progress.tokens, progress.bar.n) == (1, 3, 1)
    progress.put(torch.tensor([9, 9, 5]))  # row 1 is padding now: not a token
    assert (progress.steps, progress.tokens, progress.bar.n) == (2, 5, 2)
    progress.end()
    assert progress.bar.n == 3


class Terminal(io.StringIO):
    """A stream that says it is a terminal (bars redraw on it)."""

    def isatty(self):
        return True


def test_generation_progress_redraws_the_token_counter_while_no_sequence_finishes():
    """The token counter moves on screen while every row is still sampling (no finished sequence moves the bar)."""
    screen = Terminal()
    progress = rollout.GenerationProgress(2, 50, [9], desc="t", refresh_s=0.0, file=screen)
    progress.put(torch.tensor([[1, 2], [1, 2]]))
    for _ in range(3):
        progress.put(torch.tensor([5, 5]))
    assert progress.bar.n == 0 and "token 3/50" in screen.getvalue()
    progress.put(torch.tensor([9, 5]))
    assert progress.bar.n == 1 and "token 4/50" in screen.getvalue()
    quiet = Terminal()  # redraws are rate-limited: none within refresh_s of the last
    progress = rollout.GenerationProgress(2, 50, [9], desc="t", refresh_s=3600.0, file=quiet)
    progress.put(torch.tensor([[1, 2], [1, 2]]))
    for _ in range(3):
        progress.put(torch.tensor([5, 5]))
    assert "token 3/50" not in quiet.getvalue()
    progress.end()


def test_generation_progress_off_a_terminal_is_one_line_at_the_end():
    log = io.StringIO()  # a file or a pipe: no redraws, one line when sampling ends
    progress = rollout.GenerationProgress(2, 50, [9], desc="step 1: sampling", refresh_s=0.0, file=log)
    progress.put(torch.tensor([[1, 2], [1, 2]]))
    for token in ([5, 5], [9, 5], [9, 5]):
        progress.put(torch.tensor(token))
    assert log.getvalue() == ""
    progress.end()
    line = log.getvalue()
    assert line.count("\n") == 1 and "\r" not in line
    assert line.startswith("step 1: sampling: 2/2 seq in 0 s, token 3/50, ") and line.endswith(" tokens/s\n")
    assert progress.tokens == 5  # 2 + 2 + 1: row 0 stopped at its EOS


def test_generate_and_hidden_states_pass_the_cache_by_the_models_own_keyword():
    """A prompt's key / value cache goes to generate and to the decoder under the keyword the model's forward takes
    (transformers 5.24 warns on ``past_key_values`` once it takes ``cache``): no deprecation warning, same values."""
    import logging
    import warnings

    from grpo_fast.integrations.hidden_states import cache_keyword, decoder_of

    model, tok = tiny_model(), byte_tokenizer()
    keyword = cache_keyword(decoder_of(model))
    from transformers import Qwen2Model

    assert keyword == ("cache" if "cache" in inspect.signature(Qwen2Model.forward).parameters else "past_key_values")
    prompts = [[{"role": "user", "content": "1+1?"}], [{"role": "user", "content": "2+2, please?"}]]
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    hf_logger = logging.getLogger("transformers")
    hf_logger.addHandler(handler)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            torch.manual_seed(0)
            batch = rollout.generate(model, tok, prompts, num_generations=3, max_completion_length=6)
            hidden = completion_hidden_states(
                model,
                batch.prompt_ids,
                batch.prompt_mask,
                batch.completion_ids,
                batch.completion_mask,
                share_prompts=True,
            )
    finally:
        hf_logger.removeHandler(handler)
    assert [r.getMessage() for r in records if "deprecated" in r.getMessage()] == []
    torch.manual_seed(0)
    unshared = rollout.generate(model, tok, prompts, num_generations=3, max_completion_length=6, share_prompts=False)
    assert torch.equal(batch.completion_ids, unshared.completion_ids)
    plain = completion_hidden_states(
        model, batch.prompt_ids, batch.prompt_mask, batch.completion_ids, batch.completion_mask
    )
    mask = batch.completion_mask.bool()
    torch.testing.assert_close(hidden[mask], plain[mask], rtol=1e-5, atol=1e-5)


def test_generate_with_progress_and_show_generation_progress():
    model, tok = tiny_model(), byte_tokenizer()
    prompts = [[{"role": "user", "content": "1+1?"}]]
    torch.manual_seed(0)
    plain = rollout.generate(model, tok, prompts, num_generations=2, max_completion_length=5)
    torch.manual_seed(0)
    shown = rollout.generate(model, tok, prompts, num_generations=2, max_completion_length=5, progress="p")
    assert torch.equal(plain.completion_ids, shown.completion_ids)  # the bar changes nothing
    seen = []
    real = rollout.GenerationProgress.put
    try:
        rollout.GenerationProgress.put = lambda self, value: (seen.append(value.shape), real(self, value))
        rollout.show_generation_progress(model, tok)
        ids, mask = rollout.tokenize_prompts(tok, prompts)
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=257)
    finally:
        rollout.GenerationProgress.put = real
        del model.generate
    assert seen and seen[0] == ids.shape  # the prompt, then each new token


def test_prime_chat_template_and_rewards_with_the_prefix():
    from gsm8k.rewards import strict_format_reward, with_completion_prefix

    tok = byte_tokenizer()
    prompts = [[{"role": "user", "content": "hi"}]]
    plain = tok.apply_chat_template(prompts[0], tokenize=False, add_generation_prompt=True)
    rollout.prime_chat_template(tok, "<reasoning>\n")
    assert tok.apply_chat_template(prompts[0], tokenize=False, add_generation_prompt=True) == plain + "<reasoning>\n"
    assert tok.apply_chat_template(prompts[0], tokenize=False) == plain.removesuffix("<|im_start|>assistant\n")
    rest = "2 + 2 = 4.\n</reasoning>\n<answer>\n4\n</answer>\n"
    primed = with_completion_prefix(strict_format_reward, "<reasoning>\n")
    assert primed.__name__ == "strict_format_reward"  # TRL logs it under its own name
    assert strict_format_reward(prompts, [rest]) == [0.0]
    assert primed(prompts, [rest, [{"role": "assistant", "content": rest}]]) == [0.5, 0.5]
