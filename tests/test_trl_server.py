"""grpo_fast.trl's ``ServerDistillationTrainer``: TRL 1.16's experimental trainer (its teacher client stubbed with a
tiny teacher model's own top-k log-probs) with ``compute_loss`` from the student's hidden states instead of its
[B, T, V] logits: the loss and every student gradient TRL's within 1e-5, each of TRL's regimes (beta 0 with top-k
lists, with and without the tail bucket; beta 0.5 and 1 with the top-1), left-padded prompts of unequal length."""

import pytest
import torch

server_module = pytest.importorskip("trl.experimental.server_distillation.server_distillation_trainer")

import grpo_fast.trl  # noqa: E402

V_SLACK = 3  # the byte tokenizer's ids stay below V - 3 (its special tokens)


class _TeacherClient:
    """TRL's VLLMClient's ``get_sequence_logprobs``, answered by a tiny teacher model in the process: each
    completion token's top-k log-probs at the request's temperature (rank-sorted, TRL's client's layout) and the
    sampled token's."""

    teacher = None

    def __init__(self, *args, **kwargs):
        pass

    def get_sequence_logprobs(self, sequences, prompt_lengths, top_logprobs=1, temperature=1.0, **_):
        result = {"logprobs": [], "logprob_token_ids": [], "actual_logprobs": []}
        for seq, start in zip(sequences, prompt_lengths, strict=True):
            ids = torch.tensor(seq)[None]
            with torch.no_grad():
                logp = (self.teacher(ids).logits[0].double() / temperature).log_softmax(-1)[start - 1 : -1]
            top = logp.topk(top_logprobs, dim=-1)
            result["logprobs"].append(top.values.tolist())
            result["logprob_token_ids"].append(top.indices.tolist())
            result["actual_logprobs"].append(logp.gather(-1, ids[0, start:, None]).tolist())
        return result


def _trainer(cls, tmp_path, beta, top_k, tail, monkeypatch):
    from gsm8k.tokenizer import byte_tokenizer
    from trl_harness import tiny_prompt_dataset, tiny_qwen2

    monkeypatch.setattr("trl.generation.vllm_client.VLLMClient", _TeacherClient)
    _TeacherClient.teacher = tiny_qwen2(seed=11).eval()
    model_dir = tmp_path / "student"
    tiny_qwen2(seed=3).save_pretrained(model_dir)
    args = grpo_fast.trl.ServerDistillationConfig(
        output_dir=str(tmp_path / "out"), report_to=[], use_cpu=True, bf16=False, beta=beta, loss_top_k=top_k,
        loss_add_tail=tail, temperature=0.9, teacher_model_server_url="http://localhost:1", max_steps=1,
        model_init_kwargs=dict(attn_implementation="eager", dtype=torch.float32),
    )  # fmt: skip
    trainer = cls(str(model_dir), args=args, train_dataset=tiny_prompt_dataset(), processing_class=byte_tokenizer())
    trainer.current_gradient_accumulation_steps = 2
    return trainer


def _batch(V, B=3, P=6, C=7, seed=0):
    """GRPO's layout: prompts left-padded to P (unequal lengths), completions right-padded to C (one of one token)."""
    g = torch.Generator().manual_seed(seed)
    prompt_ids = torch.randint(0, V - V_SLACK, (B, P), generator=g)
    completion_ids = torch.randint(0, V - V_SLACK, (B, C), generator=g)
    prompt_mask = torch.ones(B, P, dtype=torch.long)
    prompt_mask[0, :2] = 0
    prompt_mask[2, :1] = 0
    completion_mask = torch.ones(B, C, dtype=torch.long)
    completion_mask[1, 4:] = 0
    completion_mask[2, 1:] = 0
    prompt_ids = torch.where(prompt_mask.bool(), prompt_ids, 0)
    return dict(prompt_ids=prompt_ids, prompt_mask=prompt_mask, completion_ids=completion_ids,
                completion_mask=completion_mask)  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize(
    "beta,top_k,tail", [(0.0, 5, True), (0.0, 5, False), (0.5, 1, True), (0.5, 1, False), (1.0, 1, True)]
)
def test_the_trainer_equals_trls(tmp_path, beta, top_k, tail, monkeypatch):
    results = []
    for cls in (server_module.ServerDistillationTrainer, grpo_fast.trl.ServerDistillationTrainer):
        trainer = _trainer(cls, tmp_path / cls.__module__, beta, top_k, tail, monkeypatch)
        trainer.model.train()
        loss = trainer.compute_loss(trainer.model, _batch(trainer.model.config.vocab_size))
        loss.backward()
        grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
        results.append((loss.detach(), grads))
    (trl_loss, trl_grads), (loss, grads) = results
    assert loss > 0
    torch.testing.assert_close(loss, trl_loss, rtol=1e-5, atol=1e-7)
    assert grads.keys() == trl_grads.keys() and "lm_head.weight" in grads
    for name in grads:
        err = (grads[name] - trl_grads[name]).abs().max()
        assert err <= 1e-5 * trl_grads[name].abs().max() + 1e-8, name


def test_the_trainer_is_trls_with_compute_loss_replaced():
    trainer = grpo_fast.trl.ServerDistillationTrainer
    assert issubclass(trainer, server_module.ServerDistillationTrainer)
    assert grpo_fast.trl.ServerDistillationConfig is server_module.ServerDistillationConfig
    assert (
        trainer._get_teacher_token_logprobs_from_server
        is server_module.ServerDistillationTrainer._get_teacher_token_logprobs_from_server
    )


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_server_records_as_a_served_teacher(beta):
    """TRL's teacher records become the ServedTeacher lists TRL's support reads: the top-k lists (-inf entries
    unlisted) at beta 0, the top-1 and the sampled token at 0 < beta < 1, the sampled token at 1; TRL's error for a
    missing sampled-token log-prob."""
    from grpo_fast.integrations.trl_served import server_teacher

    inf = float("inf")
    labels = torch.tensor([[4, 7, -100]])
    top_k = 2 if beta == 0 else 1
    result = dict(
        topk_token_ids=torch.tensor([[[4, 1], [2, 3], [0, 0]]])[..., :top_k],
        topk_logprobs=torch.tensor([[[-0.1, -3.0], [-0.2, -inf], [-inf, -inf]]])[..., :top_k],
        actual_logprobs=torch.tensor([[-0.1, -2.5, -inf]]),
    )
    ids, logprobs = server_teacher(result, labels, beta)
    expected = {
        0.0: ([[[4, 1], [2, -1], [-1, -1]]], [[[-0.1, -3.0], [-0.2, 0.0], [0.0, 0.0]]]),
        0.5: ([[[4, -1], [2, 7], [-1, -1]]], [[[-0.1, 0.0], [-0.2, -2.5], [0.0, 0.0]]]),
        1.0: ([[[4], [7], [-1]]], [[[-0.1], [-2.5], [0.0]]]),
    }[beta]
    assert ids.tolist() == expected[0]
    torch.testing.assert_close(logprobs, torch.tensor(expected[1]))
    if beta != 0:
        result["actual_logprobs"][0, 1] = -inf
        with pytest.raises(ValueError, match="missing actual-token logprobs for required reverse-KL positions: 1/2"):
            server_teacher(result, labels, beta)
