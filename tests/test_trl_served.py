"""grpo_fast.trl's served-teacher trainer: ``served_jsd_loss`` against TRL 1.16's own ``_chunked_jsd_loss``
(``trl.experimental.async_distillation``) on the same tensors: the loss, every metric (MOPD's per-teacher ones
included) and the student's gradients within 1e-5, each beta, with and without the tail bucket, soft-cap, scale and
bias; and ``AsyncDistillationTrainer`` is TRL's class with only that function rebound."""

import math

import pytest
import torch

trainer_module = pytest.importorskip("trl.experimental.async_distillation.async_distillation_trainer")

import grpo_fast.trl  # noqa: E402

N, D, V, K = 37, 24, 101, 6


def _inputs(beta, dtype, seed=0):
    """TRL's arguments of ``_chunked_jsd_loss`` at the positions it scores: a teacher's rank-sorted top-K lists
    (some shorter), narrowed by beta as TRL narrows them."""
    g = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(N, D, generator=g) * 0.5).to(dtype)
    weight = (torch.randn(V, D, generator=g) * 0.5).to(dtype)
    bias = (torch.randn(V, generator=g) * 0.2).to(dtype)
    teacher = (torch.randn(N, V, generator=g, dtype=torch.float64) * 2).log_softmax(-1)
    top = teacher.topk(K, dim=-1)
    ids, lps = top.indices.clone(), top.values.float()
    ids[::5, 4:] = -1  # shorter lists
    lps = torch.where(ids >= 0, lps, -math.inf)
    actual = torch.where(torch.rand(N, generator=g) < 0.5, ids[:, 1], torch.randint(0, V, (N,), generator=g))
    wide = ids != -1
    if beta == 0.0:
        target_ids, teacher_lps, valid = ids, lps, wide
    else:
        target_ids, teacher_lps, valid = trainer_module._narrow_top1_actual_support(ids, lps, actual, wide, beta)
    rows = valid.any(-1)  # TRL scores the positions with teacher signal only
    teacher_ids = torch.randint(0, 3, (N,), generator=g)
    return hidden[rows], weight, bias, target_ids[rows], teacher_lps[rows], valid[rows], teacher_ids[rows]


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("tail", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head", [dict(), dict(logit_scale=1.3, softcap=5.0, temperature=0.8)])
def test_equals_trls_chunked_jsd_loss(beta, tail, dtype, head):
    hidden, weight, bias, ids, lps, valid, teacher_ids = _inputs(beta, dtype)
    scale, softcap, temperature = head.get("logit_scale", 1.0), head.get("softcap"), head.get("temperature", 1.0)
    results = []
    for fn in (trainer_module._chunked_jsd_loss, grpo_fast.trl.served_jsd_loss):
        leaves = [x.clone().requires_grad_() for x in (hidden, weight, bias)]
        out = fn(*leaves, scale, softcap, ids, lps, valid, beta, temperature, tail, teacher_ids, 3, 16)
        out[0].backward()
        results.append((out, [x.grad.float() for x in leaves]))
    (trl_out, trl_grads), (ours, our_grads) = results
    for name, mine, theirs in zip(("loss", "jsd", "entropy", "teacher_entropy", "per_teacher"), ours, trl_out):
        torch.testing.assert_close(mine.detach().float(), theirs.detach().float(), rtol=1e-5, atol=1e-5, msg=name)
    assert ours[4][0::3].sum() == hidden.shape[0]  # every position counted by one teacher
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # bf16: the gradients rounded to bf16 (TRL's alike)
    for name, mine, theirs in zip(("hidden", "weight", "bias"), our_grads, trl_grads):
        scale_of = theirs.abs().max()
        assert (mine - theirs).abs().max() <= tol * scale_of, name


def test_the_trainer_is_trls_with_the_loss_rebound():
    trainer = grpo_fast.trl.AsyncDistillationTrainer
    assert issubclass(trainer, trainer_module.AsyncDistillationTrainer)
    assert trainer._compute_loss.__code__ is trainer_module.AsyncDistillationTrainer._compute_loss.__code__
    assert trainer._compute_loss.__globals__["_chunked_jsd_loss"] is grpo_fast.trl.served_jsd_loss
    assert trainer_module._chunked_jsd_loss is not grpo_fast.trl.served_jsd_loss  # TRL's module untouched
    assert grpo_fast.trl.AsyncDistillationConfig is trainer_module.AsyncDistillationConfig


class _Stub:
    """A rollout worker and a weight transfer that are never started: the loss is computed on given batches."""

    rollout_buffer = None

    def __getattr__(self, name):
        return lambda *args, **kwargs: None


def _trainer(cls, tmp_path, beta, tail, teachers):
    from gsm8k.tokenizer import byte_tokenizer
    from trl_harness import tiny_prompt_dataset, tiny_qwen2

    model_dir = tmp_path / "student"
    tiny_qwen2(seed=3).save_pretrained(model_dir)
    args = grpo_fast.trl.AsyncDistillationConfig(
        output_dir=str(tmp_path / "out"), report_to=[], use_cpu=True, bf16=False, beta=beta, add_tail_bucket=tail,
        teacher_temperature=0.9, model_init_kwargs=dict(attn_implementation="eager", dtype=torch.float32), max_steps=1,
        teacher_server_urls={t: f"http://localhost:{8001 + i}" for i, t in enumerate(teachers)},
    )  # fmt: skip
    trainer = cls(
        str(model_dir), args=args, train_dataset=tiny_prompt_dataset(), processing_class=byte_tokenizer(),
        rollout_worker=_Stub(), weight_transfer=_Stub(),
    )  # fmt: skip
    trainer.current_gradient_accumulation_steps = 1
    return trainer


def _packed_batch(V, K=5, L=23, seed=0, teachers=2):
    """One packed row as TRL's collator gives it: two sequences (position ids restarting), their completion masks,
    a teacher's rank-sorted candidates at each position (none at some), each sequence's teacher."""
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, V - 3, (1, L), generator=g)
    position_ids = torch.cat([torch.arange(11), torch.arange(L - 11)])[None]
    completion_mask = torch.zeros(1, L, dtype=torch.long)
    completion_mask[0, 5:11] = 1
    completion_mask[0, 16:] = 1
    teacher = (torch.randn(1, L, V, generator=g, dtype=torch.float64) * 2).log_softmax(-1)
    top = teacher.topk(K, dim=-1)
    ids, lps = top.indices.clone(), top.values.float()
    ids[0, 7] = -1  # a position the teacher did not score
    ids[0, 18, 3:] = -1
    lps = torch.where(ids >= 0, lps, -math.inf)
    # the sampled token among the candidates (a server's prompt_logprobs always lists it)
    ids[0, :, K - 1] = torch.where(ids[0, :, 0] >= 0, input_ids[0], -1)
    sampled = teacher[0].gather(-1, input_ids[0, :, None])[:, 0].float()
    lps[0, :, K - 1] = torch.where(ids[0, :, K - 1] >= 0, sampled, -math.inf)
    dup = (ids[0, :, : K - 1] == input_ids[0, :, None]).any(-1)
    ids[0, dup, K - 1], lps[0, dup, K - 1] = -1, -math.inf
    return dict(
        input_ids=input_ids, attention_mask=torch.ones(1, L, dtype=torch.long), position_ids=position_ids,
        completion_mask=completion_mask, teacher_topk_ids=ids, teacher_topk_logprobs=lps,
        teacher_id_idx=torch.cat([torch.zeros(11), torch.ones(L - 11)]).long()[None] % teachers,
        global_n_tokens=completion_mask.sum().reshape(1), global_n_forward_tokens=torch.tensor([L]),
        mean_seq_len=torch.tensor([L / 2]),
    )  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("beta,tail", [(0.0, True), (0.0, False), (0.5, True), (1.0, True)])
def test_the_trainer_equals_trls(tmp_path, beta, tail, monkeypatch):
    """TRL's AsyncDistillationTrainer and grpo_fast.trl's, built alike (rollout worker and weight transfer stubbed:
    the batches are given), on one packed batch of two sequences scored by two teachers (MOPD): the loss, every
    gradient of the student and every metric (per teacher too) within 1e-5."""
    # TRL's constructor reads the CUDA device's name for its MFU metric (None: MFU off, as on an unknown device)
    monkeypatch.setattr(trainer_module, "get_peak_flops_per_device", lambda *args: None)
    trl_calls = []
    trl_loss_function = trainer_module._chunked_jsd_loss
    monkeypatch.setattr(
        trainer_module, "_chunked_jsd_loss", lambda *a, **k: trl_calls.append(1) or trl_loss_function(*a, **k)
    )
    teachers = ("math", "code")
    results = []
    for cls in (trainer_module.AsyncDistillationTrainer, grpo_fast.trl.AsyncDistillationTrainer):
        trainer = _trainer(cls, tmp_path / cls.__module__, beta, tail, teachers)
        batch = _packed_batch(trainer.model.config.vocab_size)
        trainer.model.train()
        loss = trainer.compute_loss(trainer.model, batch)
        loss.backward()
        grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
        metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}
        results.append((loss.detach(), grads, metrics))
    (trl_loss, trl_grads, trl_metrics), (loss, grads, metrics) = results
    assert trl_calls == [1]  # TRL's loss function ran in TRL's trainer only
    assert loss > 0 and metrics["jsd"] > 0
    torch.testing.assert_close(loss, trl_loss, rtol=1e-5, atol=1e-6)
    assert grads.keys() == trl_grads.keys() and "lm_head.weight" in grads
    for name in grads:
        err = (grads[name] - trl_grads[name]).abs().max()
        assert err <= 1e-5 * trl_grads[name].abs().max() + 1e-7, name
    assert metrics.keys() == trl_metrics.keys() and "teacher_jsd/code" in metrics
    for key in metrics:
        assert metrics[key] == pytest.approx(trl_metrics[key], rel=1e-5, abs=1e-6), key
