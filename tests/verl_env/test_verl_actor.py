"""One actor update through verl's own code on a CPU: ``FSDPEngineWithLMHead.forward_step`` (verl's input
preparation in both layouts, the patched model forward, its output unpacking into nested tensors) with verl's
``ppo_loss`` (verl's vanilla PPO policy loss from core_algos and its entropy bonus), the backward and an SGD step,
on a tiny Qwen2 patched with impl_backend=grpo_fast; the truth is the same code with the model in fp64 on verl's
torch backend (exact in fp64). verl's engine cannot be built without a GPU (its registry lists cuda and npu, its
set-up creates a device mesh there), so the engine object carries only what forward_step reads (the module, the
engine config, no sequence parallelism, fp32, no data-parallel group) and its device lookup names the CPU."""

import copy
import functools

import pytest
import torch
import verl.workers.engine.fsdp.transformer_impl as fsdp_engine
from verl.utils import tensordict_utils as tu
from verl.utils.dataset.dataset_utils import DatasetPadMode
from verl.workers.config import FSDPActorConfig, FSDPEngineConfig
from verl.workers.utils.losses import ppo_loss
from verl_harness import VOCAB, patched, tiny_qwen2

TEMPERATURE = 0.7
PROMPT_LENGTHS, RESPONSE_LENGTHS, ADVANTAGES = (3, 2, 4), (4, 5, 1), (1.0, -0.5, 0.7)
LR = 0.5


def nested(tensors):
    return torch.nested.nested_tensor(tensors, layout=torch.jagged)


def micro_batch(use_remove_padding):
    """What verl's actor hands forward_step: sequences (prompt + response) as jagged tensors, the rollout's old
    log-probs and the advantages on the response tokens, and the engine's per-batch settings."""
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g) for n in PROMPT_LENGTHS]
    responses = [torch.randint(0, VOCAB, (n,), generator=g) for n in RESPONSE_LENGTHS]
    ids = [torch.cat([p, r]) for p, r in zip(prompts, responses)]
    return tu.get_tensordict(
        dict(
            input_ids=nested(ids),
            position_ids=nested([torch.arange(len(i)) for i in ids]),
            prompts=nested(prompts),
            responses=nested(responses),
            response_mask=nested([torch.ones(n) for n in RESPONSE_LENGTHS]),
            old_log_probs=nested([-4.9 + 0.3 * torch.randn(n, generator=g) for n in RESPONSE_LENGTHS]),
            advantages=nested([torch.full((n,), a) for n, a in zip(RESPONSE_LENGTHS, ADVANTAGES)]),
        ),
        dict(
            temperature=TEMPERATURE,
            use_remove_padding=use_remove_padding,
            pad_mode=DatasetPadMode.NO_PADDING,
            use_fused_kernels=True,
            calculate_entropy=True,
            dp_size=1,
            batch_num_tokens=None,
            global_batch_size=None,
        ),
    )


def engine_for(model):
    engine = fsdp_engine.FSDPEngineWithLMHead.__new__(fsdp_engine.FSDPEngineWithLMHead)
    engine.module, engine.engine_config = model, FSDPEngineConfig(strategy="fsdp2")
    engine.pad_to_length, engine.use_ulysses_sp, engine.ulysses_sequence_parallel_size = False, False, 1
    engine._autocast_dtype = torch.float32
    engine.get_data_parallel_group = lambda: None
    return engine


def update(model, backend, use_remove_padding):
    """forward_step with ppo_loss, backward, SGD step; then forward_step again. Returns the loss, the metrics, the
    gradients and the log-probs after the step."""
    config = FSDPActorConfig(
        strategy="fsdp2", ppo_mini_batch_size=3, ppo_micro_batch_size_per_gpu=3, rollout_n=1, entropy_coeff=0.01
    )
    loss_fn = functools.partial(ppo_loss, config)
    with patched(model, backend, use_remove_padding):
        engine = engine_for(model)
        loss, output = engine.forward_step(micro_batch(use_remove_padding), loss_fn, forward_only=False)
        model.zero_grad(set_to_none=True)
        loss.backward()
        grads = {name: p.grad.double().clone() for name, p in model.named_parameters()}
        torch.optim.SGD(model.parameters(), lr=LR).step()
        with torch.no_grad():
            _, after = engine.forward_step(micro_batch(use_remove_padding), None, forward_only=True)
    metrics = {k: float(v.aggregate() if hasattr(v, "aggregate") else v) for k, v in output["metrics"].items()}
    return loss.item(), metrics, grads, after["model_output"]["log_probs"].values().double()


@pytest.mark.parametrize("use_remove_padding", [True, False], ids=["packed", "padded"])
def test_actor_update_equals_fp64(use_remove_padding, monkeypatch):
    monkeypatch.setattr(fsdp_engine, "get_device_id", lambda: "cpu")
    monkeypatch.setattr(fsdp_engine, "get_device_name", lambda: "cpu")
    model = tiny_qwen2(tied=False)
    truth_model = copy.deepcopy(model).double()
    loss, metrics, grads, logp_after = update(model, "grpo_fast", use_remove_padding)
    t_loss, t_metrics, t_grads, t_logp_after = update(truth_model, "torch", use_remove_padding)

    assert loss == pytest.approx(t_loss, rel=1e-5, abs=1e-6)
    assert metrics.keys() == t_metrics.keys() and "actor/entropy_loss" in metrics
    for name in metrics:
        assert metrics[name] == pytest.approx(t_metrics[name], rel=1e-4, abs=1e-6), name
    for name, grad in grads.items():
        scale = t_grads[name].abs().max().item()
        assert scale > 0, name
        assert (grad - t_grads[name]).abs().max().item() <= 1e-4 * scale, name
    assert logp_after.shape == (sum(PROMPT_LENGTHS) + sum(RESPONSE_LENGTHS),)
    torch.testing.assert_close(logp_after, t_logp_after, rtol=1e-4, atol=1e-5)
