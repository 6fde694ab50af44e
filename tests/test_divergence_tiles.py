"""The divergence head's record sweep (kernels/divergence_sweep.py) at the launch level: every path of its launch
(pointers or tensor descriptors, one vocabulary split or many, merged by the splits' merge kernel, the student's
target logit gathered or not) against both models' records of the whole fp64 logits (divergence_records.tile_record),
and the divergences finished from them against the fp64 spec.

The interpreter runs the descriptor path as well as the pointer path, so both are checked here on a CPU; on a GPU the
launch configuration is the card's (the divergence tests run it compiled).
"""

import dataclasses

import pytest
import torch

from grpo_fast import reference
from grpo_fast.head.transform import LogitTransform
from grpo_fast.kernels import config as kconfig
from grpo_fast.kernels import divergence_gradient, divergence_sweep
from grpo_fast.kernels.divergence_records import ModelHead, divergence_of, finish, tile_record

F64 = torch.float64
# (use_tma, programs a wave): the wave sets the vocabulary splits (1: a single split at these shapes; 64: many)
LAUNCHES = [(False, 1), (True, 1), (False, 64), (True, 64)]


def _pair(N, Ds, Dt, V, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    hs = torch.randn(N, Ds, generator=g)
    ws = torch.randn(V, Ds, generator=g) * 3 / Ds**0.5
    bs = 0.5 * torch.randn(V, generator=g)
    ht = torch.randn(N, Dt, generator=g)
    wt = torch.randn(V, Dt, generator=g) * 3 / Dt**0.5
    targets = torch.randint(0, V, (N,), generator=g)
    return [x.to(dtype).to(device) for x in (hs, ws, bs, ht, wt)] + [targets.to(device)]


@pytest.mark.parametrize("use_tma, wave", LAUNCHES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_records_match_fp64(dtype, use_tma, wave, device):
    if use_tma and device.type == "cuda" and torch.cuda.get_device_capability(device)[0] < 9:
        pytest.skip("tensor descriptors need sm_90")
    N, Ds, Dt, V = 37, 48, 64, 301  # a partial token block, a partial last tile, D not a multiple of the K step
    hs, ws, bs, ht, wt, targets = _pair(N, Ds, Dt, V, dtype, device)
    student_transform, teacher_transform = LogitTransform(0.7, 3.0, 0.8), LogitTransform(0.7, None, 1.25)
    student = ModelHead(hs, ws, bs, student_transform)
    teacher = ModelHead(ht, wt, None, teacher_transform)
    config = dataclasses.replace(kconfig.sweep_config(device, dtype), use_tma=use_tma, target_programs=wave)
    splits, _ = divergence_sweep.num_vocab_splits(N, V, config)
    assert (splits == 1) == (wave == 1), splits
    sweep = divergence_sweep.records(student, teacher, 1.0, config=config, targets=targets)

    zs = reference.logits(hs.cpu(), ws.cpu(), bs.cpu(), compute_dtype=F64, transform=student_transform)
    zt = reference.logits(ht.cpu(), wt.cpu(), None, compute_dtype=F64, transform=teacher_transform)
    for actual, expected in ((sweep.student, tile_record(zs, zt, 0)), (sweep.teacher, tile_record(zt, zs, 0))):
        assert torch.equal(actual.argmax.cpu(), expected.argmax)
        assert not bool(actual.unsupported.any())
        for name in ("max", "rest", "cross", "other", "zsum"):
            a, e = getattr(actual, name).cpu().double(), getattr(expected, name)
            err = ((a - e).abs() / e.abs().clamp_min(1.0)).max().item()
            assert err < 2e-5, f"{name}: {err:.2e} with {splits} splits"
    target_logit = zs.gather(1, targets.cpu()[:, None])[:, 0]
    assert (sweep.target_logit.cpu().double() - target_logit).abs().max().item() < 2e-5

    for beta in (0.0, 1.0, 0.5):
        sweep = divergence_sweep.records(student, teacher, beta, config=config)
        div = finish(sweep.student, sweep.teacher, beta, sweep.jsd_sweep)[0]
        expected = reference.divergence_and_entropy(
            hs.cpu().double()[None],
            ws.cpu().double(),
            ht.cpu().double()[None],
            wt.cpu().double(),
            beta=beta,
            student_bias=bs.cpu().double(),
            temperature=0.7,
            student_softcap=3.0,
            student_logit_scale=0.8,
            teacher_logit_scale=1.25,
            compute_dtype=F64,
        )[0][0]
        assert (div.cpu().double() - expected).abs().max().item() < 1e-5 * max(1.0, expected.abs().max().item())


@pytest.mark.parametrize("use_tma", [False, True])
@pytest.mark.parametrize("beta", [0.0, 1.0, 0.5])
def test_backward_tile_paths_match_fp64(beta, use_tma, device):
    """The backward's g tiles through pointers or tensor descriptors, in several token chunks: the student's
    gradients against the fp64 spec's."""
    if use_tma and device.type == "cuda" and torch.cuda.get_device_capability(device)[0] < 9:
        pytest.skip("tensor descriptors need sm_90")
    N, Ds, Dt, V = 37, 16, 32, 211  # D 16: chunks of 16 tokens, the last one partial
    hs, ws, bs, ht, wt, _ = _pair(N, Ds, Dt, V, torch.float32, device, seed=1)
    transform = LogitTransform(0.7, None, 1.0)
    student, teacher = ModelHead(hs, ws, bs, transform), ModelHead(ht, wt, None, transform)
    saved, argmax = divergence_sweep.forward(student, teacher, beta)[2:4]
    grad_div = torch.linspace(0.5, 1.5, N, device=device)
    config = dataclasses.replace(kconfig.g_config(device, torch.float32), use_tma=use_tma)
    grads = (torch.zeros(N, Ds, device=device), torch.zeros(V, Ds, device=device), torch.zeros(V, device=device))
    divergence_gradient.backward(grad_div, student, teacher, saved, argmax, beta, grads, config=config)

    leaves = [x.cpu().double().requires_grad_() for x in (hs, ws, bs)]
    div = reference.divergence_and_entropy(
        leaves[0][None],
        leaves[1],
        ht.cpu().double()[None],
        wt.cpu().double(),
        beta=beta,
        student_bias=leaves[2],
        temperature=0.7,
        compute_dtype=F64,
    )[0][0]
    expected = torch.autograd.grad((div * grad_div.cpu().double()).sum(), leaves)
    for name, actual, e in zip(("d hidden", "d weight", "d bias"), grads, expected):
        err = ((actual.cpu().double() - e).abs().max() / e.abs().max()).item()
        assert err < 1e-5, f"{name}: {err:.2e}"


def test_launch_tables_by_arch_epilogue_and_operands():
    """The compiled launches the tables give: sm_90 reads by descriptor (128 rows; the g kernel 128 columns for a
    plain KL's narrow epilogue), sm_89 / sm_80 and tensors the copy engine cannot read take the 64 x 64 pointer
    tiles (32 columns for the combined head's g)."""
    bf16 = torch.bfloat16
    sweep = kconfig.gpu_sweep_config(bf16, 132, 90)
    assert (sweep.block_n, sweep.block_v, sweep.use_tma) == (128, 64, True)
    for arch, fits in ((89, True), (80, True), (90, False)):
        assert not kconfig.gpu_sweep_config(bf16, 128, arch, fits).use_tma
    hs, ws, bs, ht, wt, _ = _pair(4, 16, 32, 64, bf16, "cpu")
    plain, capped = LogitTransform(0.7, None, 1.0), LogitTransform(0.7, 3.0, 1.0)
    student, teacher = ModelHead(hs, ws, None, plain), ModelHead(ht, wt, None, plain)
    assert kconfig.narrow_g_epilogue(student, teacher, divergence_of(1.0), False)
    assert kconfig.narrow_g_epilogue(student, teacher, divergence_of(0.0), False)
    for s, t, beta, layer1 in (
        (student, teacher, 0.5, False),  # the JSD's mixture
        (student, teacher, 1.0, True),  # layer 1's term
        (student._replace(transform=capped), teacher, 1.0, False),
        (student, teacher._replace(transform=capped), 0.0, False),
        (student._replace(bias=bs), teacher, 1.0, False),
        (student, teacher._replace(bias=bs), 1.0, False),
    ):
        assert not kconfig.narrow_g_epilogue(s, t, divergence_of(beta), layer1)
    g = kconfig.gpu_g_config(bf16, arch=90, narrow_epilogue=True)
    assert (g.block_n, g.block_v, g.use_tma) == (128, 128, True)
    assert kconfig.gpu_g_config(bf16, arch=90).block_v == 64
    for arch, fits in ((89, True), (90, False)):
        g = kconfig.gpu_g_config(bf16, arch=arch, descriptors_fit=fits, narrow_epilogue=True)
        assert (g.block_v, g.use_tma) == (64, False)
        assert kconfig.gpu_g_config(bf16, layer1=True, arch=arch, descriptors_fit=fits).block_v == 32
