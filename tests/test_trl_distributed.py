"""grpo_fast's TRL head across 2 processes (CPU, gloo): DDP and FSDP2 equal the single-process run of the batch.

Two spawned ranks each build the same tiny Qwen2 with grpo_fast.trl's head, wrap it (DDP; FSDP2 ``fully_shard``
on each decoder layer and the root, as accelerate does; FSDP2 with the lm_head as a unit of its own), score their
half of one global batch through ``model(..., labels=..., fused_lm_head=True)``, take a TRL-style loss (DAPO's
token sum over the global token count, with an entropy bonus) and run the backward. The loss summed over ranks and
every parameter's full gradient (DTensor shards gathered) must equal a single-process run of the whole batch.
"""

import os
import socket
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 2
CASES = ("ddp", "fsdp2", "fsdp2_head_unit")
ENTROPY_COEF = 0.1
TIMEOUT_S = 300  # a hung collective must not hang CI


def global_batch():
    """8 sequences of 12 tokens: ids, labels (-100 on a 4-token prompt and on padding), per-sequence advantages."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 259, (8, 12), generator=g)
    labels = ids.clone()
    labels[:, :4] = -100
    for row, length in enumerate([8, 3, 5, 8, 1, 6, 8, 2]):
        labels[row, 4 + length:] = -100
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


def build_model():
    from grpo_fast.trl import add_fused_lm_head
    from trl_harness import tiny_qwen2

    model = tiny_qwen2()
    add_fused_lm_head(model, outputs=("log_probs", "entropy"))
    return model


def full_gradients(model):
    from torch.distributed.tensor import DTensor

    return {name: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).detach().clone()
            for name, p in model.named_parameters()}


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
    if case == "fsdp2_head_unit":
        fully_shard(model.lm_head)
    fully_shard(model)
    weight = model.lm_head.weight
    assert isinstance(weight, DTensor) and weight.to_local().shape[0] < weight.shape[0], "lm_head is not sharded"
    return model


def run_case(rank, case, out_dir):
    import grpo_fast

    ids, labels, advantages = global_batch()
    num_tokens = (labels[:, 1:] != -100).sum()
    single = build_model()
    single_loss = trl_style_loss(single, ids, labels, advantages, num_tokens, scale=1)
    single_loss.backward()

    model = wrap(build_model(), case)
    weights_seen = []
    real_kernel = grpo_fast.logprobs_and_entropy

    def spy(hidden, weight, targets, **kwargs):
        weights_seen.append((type(weight).__name__, tuple(weight.shape)))
        return real_kernel(hidden, weight, targets, **kwargs)

    grpo_fast.logprobs_and_entropy = spy
    try:
        rows = slice(rank * 4, rank * 4 + 4)
        with torch.no_grad():  # an old-policy pass: no backward will reshard a head that grpo_fast.trl unsharded
            model(input_ids=ids[rows], labels=labels[rows], fused_lm_head=True)
        head_sharded_after_no_grad = type(unwrapped(model).lm_head.weight).__name__ == "DTensor"
        loss = trl_style_loss(model, ids[rows], labels[rows], advantages[rows], num_tokens, scale=WORLD)
        loss.backward()
    finally:
        grpo_fast.logprobs_and_entropy = real_kernel
    loss_sum = loss.detach().clone()
    dist.all_reduce(loss_sum)
    torch.save(dict(loss=loss_sum / WORLD, grads=full_gradients(unwrapped(model)), single_loss=single_loss.detach(),
                    single_grads=full_gradients(single), weights_seen=weights_seen,
                    head_sharded_after_no_grad=head_sharded_after_no_grad),
               os.path.join(out_dir, f"{case}-rank{rank}.pt"))


def worker(rank, port, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        for case in CASES:
            run_case(rank, case, out_dir)
    finally:
        dist.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """One spawn of 2 ranks runs every case (TRITON_INTERPRET and sys.path reach the children from this process)."""
    out_dir = str(tmp_path_factory.mktemp("distributed"))
    ranks = mp.start_processes(worker, args=(free_port(), out_dir), nprocs=WORLD, start_method="spawn", join=False)
    deadline = time.monotonic() + TIMEOUT_S
    while not ranks.join(timeout=5):  # re-raises a rank's exception
        if time.monotonic() > deadline:
            for process in ranks.processes:
                process.kill()
            pytest.fail(f"the 2-process run did not finish in {TIMEOUT_S} s")
    return {(case, rank): torch.load(os.path.join(out_dir, f"{case}-rank{rank}.pt"))
            for case in CASES for rank in range(WORLD)}


@pytest.mark.parametrize("case", CASES)
def test_two_processes_equal_one(results, case):
    from trl_pairs import assert_close, assert_tensors_close

    for rank in range(WORLD):
        r = results[case, rank]
        assert_close(r["loss"], r["single_loss"], f"rank {rank} loss")
        assert_tensors_close(r["grads"], r["single_grads"], f"rank {rank} gradient")
        assert all(g.abs().max() > 0 for name, g in r["single_grads"].items() if "lm_head" in name)
        # the kernel always got the whole [V, D] weight as a plain tensor (FSDP gathered it, not grpo_fast)
        assert r["weights_seen"] and all(seen == ("Tensor", (259, 48)) or seen == ("Parameter", (259, 48))
                                         for seen in r["weights_seen"]), r["weights_seen"]
        if case == "fsdp2_head_unit":
            assert r["head_sharded_after_no_grad"]
