"""verl's FSDP2 (its own ``apply_fsdp2``) with an untied lm_head, which verl makes a ``fully_shard`` unit of its own,
on 2 CPU ranks (gloo) equals one process: grpo_fast's forward installed by verl's ``apply_monkey_patch``, each rank
scoring its half of a global batch in verl's remove-padding layout, a no-grad pass (the reference / old-policy
log-probs), then log-probs and entropies into a loss and the backward. The summed loss and every parameter's full
gradient (DTensor shards gathered) equal a single process's over the whole batch."""

import os

import pytest
import torch
import torch.distributed as dist
from helpers import gloo_group, spawn_ranks

WORLD = 2
TIMEOUT_S = 300  # a hung collective must not hang CI
TEMPERATURE = 0.7
# per rank: its packed sequences (lengths) and a seed for their ids
SHARDS = [((7, 4, 1), 1), ((5, 6), 2)]


def shard_loss(model, rank, scale):
    """sum(c * logp + e * entropy) over the rank's packed tokens with fixed random c, e, times ``scale``."""
    from verl_harness import fused_outputs, packed_batch

    lengths, seed = SHARDS[rank]
    inputs, _ = packed_batch(lengths, seed)
    logp, entropy = fused_outputs(model, inputs, TEMPERATURE)
    g = torch.Generator().manual_seed(10 + rank)
    c, e = torch.randn(logp.shape, generator=g), torch.randn(logp.shape, generator=g)
    return (c * logp + e * entropy).sum() * scale


def full_gradients(model):
    from torch.distributed.tensor import DTensor

    return {
        name: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).detach().clone()
        for name, p in model.named_parameters()
    }


def run(rank, out_dir):
    from helpers import head_calls_recorded
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.distributed.tensor import DTensor
    from verl.utils.fsdp_utils import apply_fsdp2
    from verl_harness import patched, tiny_qwen2

    single = tiny_qwen2(tied=False)
    model = tiny_qwen2(tied=False)
    with patched(model, "grpo_fast", use_remove_padding=True):
        single_loss = sum(shard_loss(single, r, 1.0) for r in range(WORLD))
        single_loss.backward()

        mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("fsdp",))
        mp_policy = MixedPrecisionPolicy(
            param_dtype=torch.float32, reduce_dtype=torch.float32, cast_forward_inputs=True
        )
        apply_fsdp2(model, {"mesh": mesh, "mp_policy": mp_policy, "reshard_after_forward": True}, {})
        head_is_unit = type(model.lm_head).__name__.startswith("FSDP")
        assert isinstance(model.lm_head.weight, DTensor) and model.lm_head.weight.to_local().shape[0] < 131

        with head_calls_recorded() as weights_seen:
            with torch.no_grad():
                shard_loss(model, rank, 1.0)
            resharded_after_no_grad = isinstance(model.lm_head.weight, DTensor)
            loss = shard_loss(model, rank, float(WORLD))  # FSDP averages gradients over ranks: the sum is wanted
            loss.backward()
    loss_sum = loss.detach().clone() / WORLD
    dist.all_reduce(loss_sum)
    torch.save(
        dict(
            loss=loss_sum,
            single_loss=single_loss.detach(),
            grads=full_gradients(model),
            single_grads=full_gradients(single),
            weights_seen=weights_seen,
            head_is_unit=head_is_unit,
            resharded_after_no_grad=resharded_after_no_grad,
        ),
        os.path.join(out_dir, f"rank{rank}.pt"),
    )


def worker(rank, port, out_dir):
    with gloo_group(rank, WORLD, port):
        run(rank, out_dir)


@pytest.mark.slow
def test_fsdp2_untied_head_two_ranks_equal_one(tmp_path):
    spawn_ranks(worker, WORLD, str(tmp_path), TIMEOUT_S)
    for rank in range(WORLD):
        r = torch.load(tmp_path / f"rank{rank}.pt")
        assert r["head_is_unit"], "verl's apply_fsdp2 did not make the untied lm_head a unit of its own"
        torch.testing.assert_close(r["loss"], r["single_loss"], rtol=1e-5, atol=1e-5)
        assert r["grads"].keys() == r["single_grads"].keys()
        for name, grad in r["grads"].items():
            single = r["single_grads"][name]
            assert single.abs().max() > 0, name
            err = (grad - single).abs().max().item()
            assert err <= 1e-5 * single.abs().max().item() + 1e-7, f"rank {rank} d{name}: {err:.3g}"
        # the kernel got the whole [V, D] head as a plain tensor (FSDP gathered it), and resharded it after no-grad
        assert r["weights_seen"] and all(
            seen in (("Tensor", (131, 48)), ("Parameter", (131, 48))) for seen in r["weights_seen"]
        ), r["weights_seen"]
        assert r["resharded_after_no_grad"]
