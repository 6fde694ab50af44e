"""Layer 1's tile-parallel forward (kernels/forward.py) against fp64 at the launch level: every path of its launch
(pointers or tensor descriptors, one tile or several a program, groups cut short, rows in several launches), a bias,
a soft-cap and LoRA, padding rows past a device count, and a target outside the weight's rows (a vocab-parallel
shard's): the log-probs, the entropy and the record the backward and the shards' merge read.

The interpreter runs the descriptor path (``use_tma``) as well as the pointer path, so both are checked here on a
CPU; on a GPU the launch configuration is the card's (tests/test_gpu.py and the layer-1 tests run it compiled).
"""

import dataclasses

import pytest
import torch

from grpo_fast import reference
from grpo_fast.head.transform import LogitTransform
from grpo_fast.kernels import config as kconfig
from grpo_fast.kernels import forward as kforward
from grpo_fast.kernels.operands import HeadOperands

F64 = torch.float64
IDENTITY = LogitTransform()


def _truth(hidden, weight, targets, bias=None, transform=IDENTITY, lora=None):
    """(logp, entropy, lse, 1 - p_y) in fp64 from the spec's full logits; LoRA's operand pair (l [N, r], B [V, r]) as
    the kernel takes it: the concatenated [h | l] . [W | B]."""
    if lora is not None:
        hidden, weight = torch.cat([hidden, lora[0]], 1), torch.cat([weight, lora[1]], 1)
    z = reference.logits(hidden, weight, bias, compute_dtype=F64, transform=transform)
    log_p = torch.log_softmax(z, dim=1)
    logp = log_p.gather(1, targets[:, None].clamp(0, weight.shape[0] - 1))[:, 0]
    entropy = -(log_p.exp() * log_p).sum(1)
    return logp, entropy, torch.logsumexp(z, 1), -torch.expm1(logp)


def _config(device, dtype, **changes):
    return dataclasses.replace(kconfig.forward_config(device, dtype), **changes)


def _inputs(N, D, V, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, D, generator=g).to(dtype).to(device)
    weight = (torch.randn(V, D, generator=g) * D**-0.5 * 3).to(dtype).to(device)
    targets = torch.randint(0, V, (N,), generator=g).to(device)
    return hidden, weight, targets


# (use_tma, tiles a program, token blocks a group): the descriptor path, several tiles a program and a group wider
# than the token blocks, one tile and groups of one
LAUNCHES = [(False, 2, 2), (True, 2, 2), (True, 3, 8), (False, 1, 1)]


@pytest.mark.parametrize("use_tma, tiles, group_n", LAUNCHES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logprobs_entropy_and_record_match_fp64(dtype, use_tma, tiles, group_n, device):
    if use_tma and device.type == "cuda" and torch.cuda.get_device_capability(device)[0] < 9:
        pytest.skip("tensor descriptors need sm_90")
    N, D, V = 37, 48, 301  # a partial token block, partial patches, D not a multiple of the K step
    hidden, weight, targets = _inputs(N, D, V, dtype, device)
    cfg = _config(device, dtype, use_tma=use_tma, tiles=tiles, group_n=group_n)
    logp, entropy, stats = kforward.forward(HeadOperands(hidden, weight, targets, None, LogitTransform()), True, cfg)
    truth_logp, truth_entropy, truth_lse, truth_mass = _truth(hidden.cpu(), weight.cpu(), targets.cpu())
    # fp32 sums over D and V (bf16 inputs are exact in fp32 products): rounding only
    assert (logp.cpu().to(F64) - truth_logp).abs().max() < 5e-6
    assert (entropy.cpu().to(F64) - truth_entropy).abs().max() < 5e-6
    assert (stats.lse.cpu().to(F64) - truth_lse).abs().max() < 5e-6
    torch.testing.assert_close(stats.nontarget_mass.cpu().to(F64), truth_mass, rtol=1e-5, atol=1e-7)


def test_rows_in_several_launches_equal_one_launch(monkeypatch, device):
    N, D, V = 70, 32, 257
    hidden, weight, targets = _inputs(N, D, V, torch.float32, device, seed=1)
    cfg = _config(device, torch.float32)
    whole = kforward.forward_record(HeadOperands(hidden, weight, targets, None, LogitTransform()), True, cfg)
    patches = -(-V // (cfg.block_v * cfg.tiles))
    # partials for one token block a launch, then for two: 5 and 3 launches, the last one short
    for blocks in (1, 2):
        monkeypatch.setattr(kforward, "PARTS_BYTES", 3 * patches * cfg.block_n * blocks * 4)
        assert kforward.parts_shape(N, V, True, cfg)[2] == cfg.block_n * blocks
        chunked = kforward.forward_record(HeadOperands(hidden, weight, targets, None, LogitTransform()), True, cfg)
        for field, a, b in zip(whole._fields, whole, chunked):
            assert torch.equal(a, b), (blocks, field)


@pytest.mark.parametrize("use_tma", [False, True])
def test_bias_softcap_and_lora(use_tma, device):
    if use_tma and device.type == "cuda" and torch.cuda.get_device_capability(device)[0] < 9:
        pytest.skip("tensor descriptors need sm_90")
    N, D, V, r = 29, 32, 200, 8
    hidden, weight, targets = _inputs(N, D, V, torch.float32, device, seed=2)
    g = torch.Generator().manual_seed(3)
    bias = torch.randn(V, generator=g).to(device)
    lora = (torch.randn(N, r, generator=g).to(device), (torch.randn(V, r, generator=g) * 0.1).to(device))
    transform = LogitTransform(temperature=0.7, softcap=5.0, logit_scale=0.5)
    cfg = _config(device, torch.float32, use_tma=use_tma)
    logp, entropy, _ = kforward.forward(HeadOperands(hidden, weight, targets, bias, transform, lora), True, cfg)
    lora_cpu = tuple(x.cpu() for x in lora)
    truth_logp, truth_entropy, _, _ = _truth(hidden.cpu(), weight.cpu(), targets.cpu(), bias.cpu(), transform, lora_cpu)
    assert (logp.cpu().to(F64) - truth_logp).abs().max() < 5e-6
    assert (entropy.cpu().to(F64) - truth_entropy).abs().max() < 5e-6


@pytest.mark.parametrize("use_tma", [False, True])
def test_blocks_past_the_row_count_are_placeholders(use_tma, device):
    if use_tma and device.type == "cuda" and torch.cuda.get_device_capability(device)[0] < 9:
        pytest.skip("tensor descriptors need sm_90")
    N, D, V = 48, 32, 130
    hidden, weight, targets = _inputs(N, D, V, torch.float32, device, seed=4)
    cfg = _config(device, torch.float32, use_tma=use_tma)
    count = 17
    row_count = torch.tensor([count], dtype=torch.int32, device=device)
    logp, entropy, stats = kforward.forward(
        HeadOperands(hidden, weight, targets, None, LogitTransform()), True, cfg, row_count
    )
    first_padding_block = -(-count // cfg.block_n) * cfg.block_n
    truth_logp, _, _, _ = _truth(hidden.cpu(), weight.cpu(), targets.cpu())
    # the scored rows and the rest of their block are computed; whole blocks past the count are placeholders: a
    # certain token at a far logit (logp 0, entropy 0, lse finite, no probability anywhere for a recompute)
    assert (logp[:first_padding_block].cpu().to(F64) - truth_logp[:first_padding_block]).abs().max() < 5e-6
    assert torch.equal(logp[first_padding_block:].cpu(), torch.zeros(N - first_padding_block))
    assert torch.equal(entropy[first_padding_block:].cpu(), torch.zeros(N - first_padding_block))
    assert torch.equal(stats.nontarget_mass[first_padding_block:].cpu(), torch.zeros(N - first_padding_block))
    assert (stats.lse[first_padding_block:] == kforward.PADDING_LOGIT.value).all()


def test_a_target_outside_the_rows_leaves_the_record_without_one(device):
    # a vocab-parallel shard that does not hold a row's target: its record has target 0 and rest = sumexp, so the
    # shards' records merge into the whole head's
    N, D, V = 20, 32, 150
    hidden, weight, targets = _inputs(N, D, V, torch.float32, device, seed=5)
    outside = targets.clone()
    outside[::3] = V + 7
    cfg = _config(device, torch.float32)
    record = kforward.forward_record(HeadOperands(hidden, weight, outside, None, LogitTransform()), True, cfg)
    rows = torch.arange(N, device=device)[::3]
    assert torch.equal(record.target[rows], torch.zeros(len(rows), device=device))
    assert torch.equal(record.rest[rows], record.sumexp[rows])
    # the other rows: the target's logit, and S = R + exp(z_y - m)
    inside = torch.ones(N, dtype=torch.bool, device=device)
    inside[rows] = False
    z = hidden.to(F64) @ weight.to(F64).T
    truth_target = z.gather(1, targets[:, None])[:, 0]
    assert (record.target[inside].to(F64) - truth_target[inside]).abs().max() < 1e-5
    torch.testing.assert_close(
        record.sumexp[inside], record.rest[inside] + torch.exp(record.target[inside] - record.max[inside])
    )


def test_tile_candidates_are_each_tiles_four_largest_logits(monkeypatch, device):
    # the sampler's pass without gradients (backends.support_tiles): each vocabulary tile's 4 largest logits a row,
    # ties repeated, beside the record, which is the plain pass's bit for bit (its max is the candidates' first).
    # Small integers make every product exact in fp32 and tie many logits; a bias of -inf masks columns; rows in two
    # launches and a partial last tile
    cfg = _config(device, torch.float32)
    N, D, V = 40, 16, 2 * cfg.block_v + 22
    g = torch.Generator().manual_seed(6)
    hidden = torch.randint(-2, 3, (N, D), generator=g).float().to(device)
    weight = torch.randint(-1, 2, (V, D), generator=g).float().to(device)
    targets = torch.randint(0, V, (N,), generator=g).to(device)
    bias = torch.zeros(V, device=device)
    bias[3:20:2] = -torch.inf  # a few in the first tile
    bias[cfg.block_v : 2 * cfg.block_v - 2] = -torch.inf  # all but 2 of the second tile's
    head = HeadOperands(hidden, weight, targets, bias, LogitTransform())
    tiles, patches = -(-V // cfg.block_v), -(-V // (cfg.block_v * cfg.tiles))
    row_bytes = (2 * patches + kforward.candidate_fields() * tiles) * 4
    monkeypatch.setattr(kforward, "PARTS_BYTES", row_bytes * cfg.block_n)
    assert kforward.parts_shape(N, V, False, cfg, candidates=kforward.candidate_fields())[2] == cfg.block_n
    seen = []

    def keep(n0, n1, candidates, record):
        seen.append((n0, n1, candidates.clone(), record.clone()))

    record = kforward.forward_record(head, False, cfg, tile_candidates=keep)
    assert [(n0, n1) for n0, n1, _, _ in seen] == [(n, min(n + cfg.block_n, N)) for n in range(0, N, cfg.block_n)]
    z = hidden.cpu() @ weight.cpu().T + bias.cpu()  # exact: integers
    padded = torch.full((N, tiles * cfg.block_v), -torch.inf)
    padded[:, :V] = z
    four = padded.view(N, tiles, cfg.block_v).topk(4, dim=-1).values.permute(2, 1, 0)
    assert kforward.candidate_fields() == 4
    for n0, n1, candidates, part in seen:
        assert torch.equal(candidates.cpu(), four[:, :, n0:n1]), (n0, n1)
        assert torch.equal(part.cpu(), torch.stack(list(record))[:, n0:n1].cpu())
    assert bool((four[1] == four[0]).any()) and bool((four[2] == -torch.inf).any())  # ties listed, -inf listed
    plain = kforward.forward_record(head, False, cfg)
    for field, a, b in zip(plain._fields, plain, record):
        assert torch.equal(a, b), field
