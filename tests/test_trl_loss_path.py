"""grpo_fast.trl.GRPOTrainer computes TRL's loss through ``grpo_fast.loss`` where TRL's options are token-local.

With token-local options (``grpo_fast.LossOptions.token_local``: token-level importance sampling, no VESPO, no
top-entropy mask, off-policy mask or entropy bonus) the policy's pass in ``_compute_loss`` runs ``grpo_fast.loss`` in
the fused head (the three-sweep trained head under the Triton interpreter: ``forward_trained_head``), and TRL's own
code computes the metrics and the loss's value from the detached log-probs it returns; other options keep TRL's loss
code over grpo_fast's log-probs. Either way, against TRL 1.16's own trainer on the same model and inputs (fp32): the
loss, every parameter's gradient and every logged metric within 1e-5, including the scaling of each loss type under
gradient accumulation and ``steps_per_generation``, in evaluation mode, and with the vLLM importance-sampling ratios.
"""

from __future__ import annotations

import contextlib
import copy
import os

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
    reset_loss_options,
    score_scripted_rollout,
    set_loss_options,
    tiny_gemma2,
    tiny_prompt_dataset,
    tiny_qwen2,
)
from trl_pairs import assert_close, assert_runs_match, assert_tensors_close, train, trl_kernel_forbidden

import grpo_fast
from grpo_fast.backends.triton_backend import TritonBackend
from grpo_fast.trl import GRPOTrainer

# three groups of two; row 2 is EOS alone, row 3 ends without EOS (its tokens count: no mask_truncated_completions)
PROMPT_IDS = [[72, 105, 33], [72, 105, 33], [50, 43, 50, 61, 63, 10], [50, 43, 50, 61, 63, 10], [81, 58], [81, 58]]
COMPLETION_IDS = [
    [52, 32, 52, 61, 56, 46, 32, ASCII_EOS_ID],
    [53, 33, 10, ASCII_EOS_ID],
    [ASCII_EOS_ID],
    [9, 8, 7, 6, 5],
    [100, 101, 102, 103, 104, 105, ASCII_EOS_ID],
    [120, 121, ASCII_EOS_ID],
]
ADVANTAGES = [0.8, -1.1, 0.0, 0.6, -0.7, 1.3]


def policy():
    return tiny_qwen2(vocab_size=ASCII_VOCAB_SIZE, hidden_size=32, intermediate_size=64)


@pytest.fixture(scope="module")
def pair():
    """TRL's trainer and grpo_fast's on copies of one tiny Qwen2 (hidden 32, vocab 131)."""
    args = grpo_config(per_device_train_batch_size=6, num_generations=2, max_completion_length=11)
    theirs = build_trainer(args, model=policy(), processing_class=ascii_tokenizer())
    assert type(theirs) is trl.GRPOTrainer
    ours = GRPOTrainer(
        model=policy(),
        reward_funcs=[length_reward],
        args=args,
        train_dataset=tiny_prompt_dataset(),
        processing_class=ascii_tokenizer(),
    )
    ours.model.train()
    ours.current_gradient_accumulation_steps = 1
    return {"trl": theirs, "grpo_fast": ours}


@pytest.fixture(scope="module")
def batch(pair):
    """TRL's inputs for a scripted rollout (its masks, num_items_in_batch and vLLM ratios of two modes), with old and
    reference log-probs that are the model's plus noise (clipping happens, the KL is not zero)."""
    theirs = pair["trl"]
    zeros = [[0.0] * len(c) for c in COMPLETION_IDS]
    true = score_scripted_rollout(theirs, PROMPT_IDS, COMPLETION_IDS, zeros)["old_per_token_logps"]
    g = torch.Generator().manual_seed(3)
    sampling = [
        (true[b, : len(c)] + 0.3 * torch.randn(len(c), generator=g)).tolist() for b, c in enumerate(COMPLETION_IDS)
    ]
    ratios = {}
    for mode in ("token_mask", "sequence_truncate"):
        scored = score_scripted_rollout(
            theirs, PROMPT_IDS, COMPLETION_IDS, sampling, vllm_importance_sampling_mode=mode
        )
        ratios[mode] = scored["importance_sampling_ratio"]
    keys = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "num_items_in_batch")
    mask = scored["completion_mask"]
    return dict(
        inputs={k: scored[k] for k in keys},
        old=(true + 0.3 * torch.randn(true.shape, generator=g)) * mask,
        ref=(true + 0.3 * torch.randn(true.shape, generator=g)) * mask,
        advantages=torch.tensor(ADVANTAGES),
        ratios=ratios,
    )


# (id, GRPOConfig options, vLLM ratio mode or None, (accumulation steps, steps_per_generation), eval mode, fused)
CASES = [
    ("dapo", dict(), None, (1, 1), False, True),
    ("dapo-accumulation", dict(), None, (2, 4), False, True),
    ("dapo-eval", dict(), None, (2, 4), True, True),
    ("grpo-beta-is", dict(loss_type="grpo", beta=0.04), "token_mask", (2, 1), False, True),
    ("bnpo-delta", dict(loss_type="bnpo", delta=1.1, epsilon_high=0.28), None, (1, 1), False, True),
    ("dr_grpo", dict(loss_type="dr_grpo", max_completion_length=30), None, (2, 2), False, True),
    ("cispo-is-sequence", dict(loss_type="cispo", epsilon_high=1.2), "sequence_truncate", (2, 1), False, True),
    ("sapo-beta", dict(loss_type="sapo", beta=0.04, use_bias_correction_kl=False), None, (1, 1), False, True),
    ("luspo-temperature", dict(loss_type="luspo", temperature=0.7), None, (2, 1), False, True),
    # not token-local: TRL's loss code over grpo_fast's log-probs
    ("grpo-sequence", dict(loss_type="grpo", importance_sampling_level="sequence"), None, (1, 1), False, False),
    ("vespo", dict(loss_type="vespo"), "token_mask", (1, 1), False, False),
    ("dapo-entropy-bonus", dict(entropy_coef=0.01), None, (1, 1), False, False),
    ("dapo-top-entropy", dict(top_entropy_quantile=0.5), None, (1, 1), False, False),
    ("dapo-off-policy-mask", dict(off_policy_mask_threshold=0.1), None, (1, 1), False, False),
]


@contextlib.contextmanager
def calls_counted(monkeypatch):
    """Counts of grpo_fast.loss calls and of the three-sweep trained head's forwards."""
    counts = {"loss": 0, "trained_head": 0}
    loss, trained_head = grpo_fast.loss, TritonBackend.forward_trained_head

    def counted_loss(*args, **kwargs):
        counts["loss"] += 1
        return loss(*args, **kwargs)

    def counted_trained_head(self, *args, **kwargs):
        counts["trained_head"] += 1
        return trained_head(self, *args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(grpo_fast, "loss", counted_loss)
        patch.setattr(TritonBackend, "forward_trained_head", counted_trained_head)
        yield counts


def run(trainer, batch, options, is_mode, accumulation, eval_mode):
    """The trainer's compute_loss and backward on the batch: (loss, gradients, metrics)."""
    reset_loss_options(trainer)
    if is_mode is not None:
        options = dict(options, use_vllm=True, vllm_importance_sampling_correction=True)
        options["vllm_importance_sampling_mode"] = is_mode
    set_loss_options(trainer, **options)
    inputs = dict(batch["inputs"], advantages=batch["advantages"], old_per_token_logps=batch["old"])
    if trainer.beta != 0.0:
        inputs["ref_per_token_logps"] = batch["ref"]
    if is_mode is not None:
        inputs["importance_sampling_ratio"] = batch["ratios"][is_mode]
        inputs["sampling_per_token_logps"] = batch["ratios"][is_mode]  # read by nothing here but TRL's off-policy mask
    trainer.current_gradient_accumulation_steps, trainer.args.steps_per_generation = accumulation
    trainer.model.train(not eval_mode)
    trainer.model.zero_grad(set_to_none=True)
    for mode in ("train", "eval"):
        trainer._metrics[mode].clear()
    try:
        loss = trainer.compute_loss(trainer.model, inputs)
        loss.backward()
    finally:
        trainer.current_gradient_accumulation_steps, trainer.args.steps_per_generation = 1, 1
        trainer.model.train()
        reset_loss_options(trainer)
    grads = {n: p.grad.detach().clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    metrics = {k: v[-1] for k, v in trainer._metrics["eval" if eval_mode else "train"].items()}
    return loss.detach(), grads, metrics


@pytest.mark.parametrize("case", CASES, ids=lambda c: c[0])
def test_loss_gradients_and_metrics_match_trl(pair, batch, case, monkeypatch):
    _, options, is_mode, accumulation, eval_mode, fused = case
    loss, grads, metrics = {}, {}, {}
    for name, trainer in pair.items():
        guard = trl_kernel_forbidden() if name == "grpo_fast" else contextlib.nullcontext()
        with guard, calls_counted(monkeypatch) as counts:
            loss[name], grads[name], metrics[name] = run(trainer, batch, options, is_mode, accumulation, eval_mode)
        if name == "grpo_fast":
            assert counts["loss"] == int(fused)
            assert counts["trained_head"] == int(fused)  # the three-sweep head (the interpreter runs Triton)
        else:
            assert counts == {"loss": 0, "trained_head": 0}
    assert_close(loss["grpo_fast"], loss["trl"], "loss")
    assert_tensors_close(grads["grpo_fast"], grads["trl"], "gradient")
    assert metrics["grpo_fast"].keys() == metrics["trl"].keys()
    for key, value in metrics["trl"].items():
        assert_close(metrics["grpo_fast"][key], value, key)
    if fused and "clip_ratio/region_mean" in metrics["trl"]:
        assert metrics["trl"]["clip_ratio/region_mean"] > 0  # the old log-probs' noise makes token ratios clip


def test_no_gradient_keeps_trls_code(pair, batch, monkeypatch):
    """Without autograd (TRL's prediction_step) there is no gradient to form: TRL's loss code runs."""
    trainer = pair["grpo_fast"]
    inputs = dict(batch["inputs"], advantages=batch["advantages"], old_per_token_logps=batch["old"])
    with calls_counted(monkeypatch) as counts, torch.no_grad():
        loss = trainer.compute_loss(trainer.model, inputs)
    trainer._metrics["train"].clear()
    assert counts["loss"] == 0 and torch.isfinite(loss)


@pytest.mark.slow
@pytest.mark.parametrize("model_name", ["qwen2", "gemma2_softcap_tied"])
def test_training_runs_match_trl(model_name, monkeypatch):
    """Two optimizer steps through the fused loss (token-local dapo, the default) with gradient checkpointing and
    gradient accumulation 2 over steps_per_generation 2: every logged metric, every gradient and the trained
    parameters equal TRL's run; a soft-capped tied Gemma 2 (the head's gradient and the embedding's in one tensor)."""
    if model_name == "qwen2":
        model = tiny_qwen2()
    else:
        model = tiny_gemma2(final_logit_softcapping=2.0)
        with torch.no_grad():
            model.lm_head.weight.mul_(40.0)  # raw logits well past the cap
    args = grpo_config(
        gradient_checkpointing=True,
        gradient_accumulation_steps=2,
        steps_per_generation=2,
        temperature=0.8,
        logging_strategy="steps",
        logging_steps=1,
        optim="sgd",
        learning_rate=0.5,
        max_steps=2,
    )
    theirs = train(trl.GRPOTrainer, copy.deepcopy(model), args)
    with calls_counted(monkeypatch) as counts:
        ours = train(GRPOTrainer, copy.deepcopy(model), args, forbid_trl_kernel=True)
    assert counts["loss"] == counts["trained_head"] == 4  # 2 optimizer steps x 2 accumulated micro-batches
    assert_runs_match(ours, theirs)


def ddp_step(out_dir, world):
    """One step of grpo_fast's GRPOTrainer (token-local dapo: the fused loss) on this process's share of the
    scripted global batch of tests/test_trl_distributed.py, DDP on 2 CPU processes (accelerate's gloo) when world > 1:
    (the logged loss, {parameter: (its value before, its change)}, the trained head's forward calls)."""
    from test_trl_distributed import GENERATIONS, GLOBAL_BATCH, scripted_rollout
    from trl_harness import byte_tokenizer
    from trl_pairs import token_reward

    model = tiny_qwen2()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    args = grpo_config(
        out_dir,
        per_device_train_batch_size=GLOBAL_BATCH // world,
        num_generations=GENERATIONS,
        max_completion_length=8,
        optim="sgd",
        learning_rate=1.0,
        max_grad_norm=1e9,
        logging_strategy="steps",
        logging_steps=1,
    )
    os.environ["TRL_EXPERIMENTAL_SILENCE"] = "1"  # rollout_func is experimental in TRL 1.16
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[token_reward],
        args=args,
        train_dataset=tiny_prompt_dataset(),
        processing_class=byte_tokenizer(),
        rollout_func=scripted_rollout,
    )
    calls = []
    trained_head = TritonBackend.forward_trained_head

    def counted(self, *a, **k):
        calls.append(1)
        return trained_head(self, *a, **k)

    TritonBackend.forward_trained_head = counted
    try:
        with trl_kernel_forbidden():
            trainer.train()
    finally:
        TritonBackend.forward_trained_head = trained_head
    if world > 1:
        assert type(trainer.model_wrapped).__name__ == "DistributedDataParallel"
    loss = next(entry["loss"] for entry in trainer.state.log_history if "loss" in entry)
    after = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    return loss, {name: (before[name], after[name] - before[name]) for name in before}, len(calls)


def ddp_worker(rank, port, out_dir):
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE="2",
        LOCAL_WORLD_SIZE="2",
    )
    result = ddp_step(os.path.join(out_dir, f"rank{rank}"), 2)
    if rank == 0:
        torch.save(result, os.path.join(out_dir, "ddp.pt"))


@pytest.mark.slow
def test_ddp_on_two_processes_equals_one(tmp_path):
    """The fused loss under DDP (its gradients formed in the forward, the loss taken from the wrapped model's output):
    with SGD at learning rate 1 and no clipping each parameter's change is minus its gradient, so the logged loss and
    every change on 2 processes (half the batch each) equal one process's."""
    from helpers import spawn_ranks
    from trl_pairs import RTOL

    spawn_ranks(ddp_worker, 2, str(tmp_path), 300)
    ddp_loss, ddp_deltas, ddp_calls = torch.load(tmp_path / "ddp.pt")
    loss, deltas, calls = ddp_step(str(tmp_path / "single"), 1)
    assert ddp_calls == calls == 1
    assert_close(ddp_loss, loss, "loss")
    for name, (before, delta) in deltas.items():
        err = (ddp_deltas[name][1] - delta).abs().max().item()
        allowed = RTOL * delta.abs().max().item() + torch.finfo(torch.float32).eps * before.abs().max().item()
        assert err <= allowed, f"{name}: the change (minus the gradient) is off by {err:.3g} (allowed {allowed:.3g})"
    assert all(delta.abs().max() > 0 for name, (_, delta) in deltas.items() if "lm_head" in name)
