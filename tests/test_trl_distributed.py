"""grpo_fast's TRL head across 2 processes (CPU, gloo): DDP, FSDP2 and DeepSpeed ZeRO-3 equal one process.

DDP and FSDP2: two spawned ranks each build the same tiny Qwen2 with grpo_fast.trl's head, wrap it (DDP; FSDP2
``fully_shard`` on each decoder layer and the root, as accelerate does; FSDP2 with the lm_head as a unit of its
own, also with PEFT LoRA on it: its adapter is gathered and reduced with the head), score their half of one global
batch through ``model(..., labels=..., fused_lm_head=True)``, take a TRL-style loss (DAPO's token sum over the
global token count, with an entropy bonus) and run the backward. The loss summed over ranks and every trainable
parameter's full gradient (DTensor shards gathered) must equal a single-process run of the whole batch.

DeepSpeed ZeRO-3 (when deepspeed is installed; its CPU accelerator, gloo): grpo_fast.trl's GRPOTrainer trains one
step on 2 ranks, each with half of the global batch, against one process with all of it. The completions are
scripted (a ``rollout_func``), so sampling cannot differ; with SGD at learning rate 1 and no clipping a
parameter's change is minus its gradient, so the logged loss and every parameter's change (gathered from ZeRO-3's
partitions) must equal the single process's (within RTOL of the largest change, plus the rounding of the fp32
parameter the change is read from).
"""

import importlib.util
import os

import pytest
import torch
import torch.distributed as dist
from helpers import gloo_group, spawn_ranks

WORLD = 2
CASES = ("ddp", "fsdp2", "fsdp2_head_unit", "fsdp2_lora_head_unit")
ENTROPY_COEF = 0.1
TIMEOUT_S = 300  # a hung collective must not hang CI


def global_batch():
    """8 sequences of 12 tokens: ids, labels (-100 on a 4-token prompt and on padding), per-sequence advantages."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 259, (8, 12), generator=g)
    labels = ids.clone()
    labels[:, :4] = -100
    for row, length in enumerate([8, 3, 5, 8, 1, 6, 8, 2]):
        labels[row, 4 + length :] = -100
    advantages = torch.randn(8, generator=g)
    return ids, labels, advantages


def trl_style_loss(model, ids, labels, advantages, num_tokens, scale):
    """DAPO on-policy (ratio exp(logp - stopgrad logp)) normalised by the global token count, minus an entropy
    bonus; ``scale`` = the world size, as TRL multiplies each rank's loss so that the gradient average is the sum."""
    out = model(input_ids=ids, labels=labels, fused_lm_head=True)
    mask = out.label_mask.float()
    ratio = torch.exp(out.log_probs - out.log_probs.detach())
    policy = -(ratio * advantages[:, None] * mask).sum()
    return (policy - ENTROPY_COEF * (out.entropy * mask).sum()) / num_tokens * scale


def build_model(case):
    """The tiny Qwen2 with grpo_fast.trl's head; for a "lora" case, PEFT LoRA on q_proj and the lm_head (random B),
    its HF model inside (as TRL trains it)."""
    from trl_harness import tiny_qwen2

    from grpo_fast.trl import add_fused_lm_head

    model = tiny_qwen2()
    add_fused_lm_head(model, outputs=("log_probs", "entropy"))
    if "lora" in case:
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(1)
        lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "lm_head"], init_lora_weights=False)
        model = get_peft_model(model, lora).get_base_model()
    return model


def full_gradients(model):
    from torch.distributed.tensor import DTensor

    return {
        name: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).detach().clone()
        for name, p in model.named_parameters()
        if p.requires_grad
    }


def unwrapped(model):
    return getattr(model, "module", model)  # DDP holds the model as .module; FSDP2 changes the model's class only


def wrap(model, case):
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from torch.nn.parallel import DistributedDataParallel

    if case == "ddp":
        return DistributedDataParallel(model)
    for layer in model.model.layers:
        fully_shard(layer)
    if case.endswith("head_unit"):
        fully_shard(model.lm_head)
    fully_shard(model)
    weight = model.lm_head.weight
    assert isinstance(weight, DTensor) and weight.to_local().shape[0] < weight.shape[0], "lm_head is not sharded"
    return model


def run_case(rank, case, out_dir):
    from helpers import head_calls_recorded

    ids, labels, advantages = global_batch()
    num_tokens = (labels[:, 1:] != -100).sum()
    single = build_model(case)
    single_loss = trl_style_loss(single, ids, labels, advantages, num_tokens, scale=1)
    single_loss.backward()

    model = wrap(build_model(case), case)
    with head_calls_recorded() as weights_seen:
        rows = slice(rank * 4, rank * 4 + 4)
        with torch.no_grad():  # an old-policy pass: no backward will reshard a head that grpo_fast.trl unsharded
            model(input_ids=ids[rows], labels=labels[rows], fused_lm_head=True)
        head_sharded_after_no_grad = type(unwrapped(model).lm_head.weight).__name__ == "DTensor"
        loss = trl_style_loss(model, ids[rows], labels[rows], advantages[rows], num_tokens, scale=WORLD)
        loss.backward()
    loss_sum = loss.detach().clone()
    dist.all_reduce(loss_sum)
    torch.save(
        dict(
            loss=loss_sum / WORLD,
            grads=full_gradients(unwrapped(model)),
            single_loss=single_loss.detach(),
            single_grads=full_gradients(single),
            weights_seen=weights_seen,
            head_sharded_after_no_grad=head_sharded_after_no_grad,
        ),
        os.path.join(out_dir, f"{case}-rank{rank}.pt"),
    )


def worker(rank, port, out_dir):
    with gloo_group(rank, WORLD, port):
        for case in CASES:
            run_case(rank, case, out_dir)


def spawn(fn, out_dir, timeout=TIMEOUT_S):
    spawn_ranks(fn, WORLD, out_dir, timeout)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """One spawn of 2 ranks runs every case."""
    out_dir = str(tmp_path_factory.mktemp("distributed"))
    spawn(worker, out_dir)
    return {
        (case, rank): torch.load(os.path.join(out_dir, f"{case}-rank{rank}.pt"))
        for case in CASES
        for rank in range(WORLD)
    }


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_two_processes_equal_one(results, case):
    from trl_pairs import assert_close, assert_tensors_close

    for rank in range(WORLD):
        r = results[case, rank]
        assert_close(r["loss"], r["single_loss"], f"rank {rank} loss")
        assert_tensors_close(r["grads"], r["single_grads"], f"rank {rank} gradient")
        assert all(g.abs().max() > 0 for name, g in r["single_grads"].items() if "lm_head" in name)
        # the kernel always got the whole [V, D] weight as a plain tensor (FSDP gathered it, not grpo_fast)
        assert r["weights_seen"] and all(
            seen == ("Tensor", (259, 48)) or seen == ("Parameter", (259, 48)) for seen in r["weights_seen"]
        ), r["weights_seen"]
        if case.endswith("head_unit"):
            assert r["head_sharded_after_no_grad"]
        if "lora" in case:
            assert sum("lm_head.lora_" in name for name in r["grads"]) == 2


# ----------------------------------------------------------------------------------------------- DeepSpeed ZeRO-3
DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
# every parameter partitioned and released after use, however small (ZeRO-3 keeps parameters below
# stage3_param_persistence_threshold elements, 1e5 by default, gathered for good: the whole tiny model). The head's
# weight is then gathered by ZeRO-3 itself when the patched forward reads it (DeepSpeed 0.19 gathers a partitioned
# parameter on access inside a module's forward and registers it with that module for the backward).
ZERO3 = dict(
    zero_optimization=dict(
        stage=3, stage3_param_persistence_threshold=0, stage3_max_reuse_distance=0, stage3_prefetch_bucket_size=0
    ),
    train_micro_batch_size_per_gpu="auto",
    train_batch_size="auto",
    gradient_accumulation_steps="auto",
    gradient_clipping="auto",
    bf16=dict(enabled=False),
    fp16=dict(enabled=False),
)
GLOBAL_BATCH, GENERATIONS = 4, 2


def scripted_rollout(prompts, trainer):
    """Completions fixed by the prompt and the generation's index within its group (no sampling): TRL's
    ``rollout_func`` signature; lengths differ, some end in EOS, some are truncated."""
    tok = trainer.processing_class
    seen, out = {}, dict(prompt_ids=[], completion_ids=[], logprobs=[])
    for prompt in prompts:
        k = seen[prompt] = seen.get(prompt, -1) + 1
        text = f"{prompt[::-1]} {k}" * (1 + (len(prompt) + k) % 2)
        ids = tok(text, add_special_tokens=False)["input_ids"][: 5 + 2 * k]
        if k % 2 == 0:
            ids = ids + [tok.eos_token_id]
        out["prompt_ids"].append(tok(prompt, add_special_tokens=False)["input_ids"])
        out["completion_ids"].append(ids)
        out["logprobs"].append([0.0] * len(ids))
    return out


def zero3_step(out_dir, world):
    """One GRPOTrainer step (grpo_fast.trl's) on this process's share of the batch; ZeRO-3 when world > 1.
    Returns (the logged loss, {parameter: (its value before, its change)})."""
    from trl_harness import byte_tokenizer, grpo_config, tiny_prompt_dataset, tiny_qwen2
    from trl_pairs import token_reward, trl_kernel_forbidden

    from grpo_fast.trl import GRPOTrainer

    model = tiny_qwen2()  # before the config: ZeRO-3 partitions it in deepspeed.initialize, not while it is built
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    args = grpo_config(
        out_dir,
        per_device_train_batch_size=GLOBAL_BATCH // world,
        num_generations=GENERATIONS,
        max_completion_length=8,
        deepspeed=ZERO3 if world > 1 else None,
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
    with trl_kernel_forbidden():  # grpo_fast's head, never TRL's kernel
        trainer.train()
    loss = next(entry["loss"] for entry in trainer.state.log_history if "loss" in entry)
    trained = trainer.model_wrapped if world > 1 else trainer.model
    if world > 1:
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(trained.parameters())):
            after = {name.removeprefix("module."): p.detach().clone() for name, p in trained.named_parameters()}
    else:
        after = {name: p.detach().clone() for name, p in trained.named_parameters()}
    return loss, {name: (before[name], after[name] - before[name]) for name in before}


def zero3_worker(rank, port, out_dir):
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(WORLD),
        LOCAL_WORLD_SIZE=str(WORLD),
        DS_ACCELERATOR="cpu",
    )
    import deepspeed.ops

    # DeepSpeed's shared-memory all-reduce (its CPU fast path) is a C++ op JIT-built on first use (minutes on CI's
    # 2 cores): marked unavailable, DeepSpeed sends the same collectives through gloo
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    loss, deltas = zero3_step(os.path.join(out_dir, f"rank{rank}"), WORLD)
    if rank == 0:
        torch.save(dict(loss=loss, deltas=deltas), os.path.join(out_dir, "zero3.pt"))


DEEPSPEED_INSTALL = 'pip install --no-build-isolation -e ".[zero3]"'


@pytest.mark.slow
# deepspeed is the zero3 extra, installed apart from the test extra (its build needs the torch already installed): a
# checkout without it skips this test and says how to install it; under CI=true (.ci/run installs it) it fails instead
@pytest.mark.skipif(
    not DEEPSPEED and os.environ.get("CI") != "true", reason=f"deepspeed is not installed ({DEEPSPEED_INSTALL})"
)
def test_deepspeed_zero3_grpo_trainer_equals_one_process(tmp_path):
    assert DEEPSPEED, f"deepspeed is not installed: run `{DEEPSPEED_INSTALL}` after torch"
    from trl_pairs import RTOL, assert_close

    spawn(zero3_worker, str(tmp_path))
    zero3 = torch.load(tmp_path / "zero3.pt")
    loss, deltas = zero3_step(str(tmp_path / "single"), 1)
    assert_close(zero3["loss"], loss, "loss")
    assert zero3["deltas"].keys() == deltas.keys()
    for name, (before, delta) in deltas.items():
        err = (zero3["deltas"][name][1] - delta).abs().max().item()
        # a change is read as after - before: exact but for the rounding of the fp32 parameter after the step
        allowed = RTOL * delta.abs().max().item() + torch.finfo(torch.float32).eps * before.abs().max().item()
        assert err <= allowed, f"{name}: the change (minus the gradient) is off by {err:.3g} (allowed {allowed:.3g})"
    assert all(delta.abs().max() > 0 for name, (_, delta) in deltas.items() if "lm_head" in name)
