"""The compiled Triton kernels on a CUDA GPU against the fp32 reference (skipped without CUDA).

Run on a GPU machine with the interpreter off:  TRITON_INTERPRET=0 pytest tests/test_gpu.py
Tolerance on a GPU in bf16: the backward feeds bf16 tensor cores with g = c (onehot - p) / tau rounded to
bf16, so gradients match the fp32 reference to about 1% of their largest entry; fp32 inputs use IEEE
fp32 dots and match tightly.
"""

import itertools

import pytest
import torch

import grpo_fast
from grpo_fast import reference
from grpo_fast.kernels.config import interpreting

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or interpreting(),
                                reason="needs a CUDA GPU and TRITON_INTERPRET unset or 0")

GPU_TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 5e-3}


def _max_rel(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-12)).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("loss_type, level", list(itertools.product(reference.LOSS_TYPES, ("token", "sequence"))))
def test_loss_on_gpu_matches_reference(dtype, loss_type, level):
    g = torch.Generator(device="cuda").manual_seed(0)
    B, T, D, V = 4, 301, 520, 9973  # nothing a block multiple
    hidden = torch.randn(B, T, D, device="cuda", generator=g).to(dtype)
    weight = (torch.randn(V, D, device="cuda", generator=g) * 0.05).to(dtype)
    bias = (torch.randn(V, device="cuda", generator=g) * 0.1).to(dtype)
    targets = torch.randint(0, V, (B, T), device="cuda", generator=g)
    mask = torch.rand(B, T, device="cuda", generator=g) > 0.2
    mask[1] = False
    adv = torch.randn(B, device="cuda", generator=g)
    true = reference.logprobs(hidden, weight, targets, bias, 0.9)
    old = true + 0.2 * torch.randn(B, T, device="cuda", generator=g)
    ref = true + 0.2 * torch.randn(B, T, device="cuda", generator=g)
    kw = dict(old_logprobs=old, ref_logprobs=ref, beta=0.04, epsilon_high=0.28, loss_type=loss_type,
              importance_sampling_level=level, temperature=0.9, max_completion_length=T)
    outs = []
    for fn, inputs in ((reference.loss, (hidden.float(), weight.float(), bias.float())),
                       (grpo_fast.loss, (hidden, weight, bias))):
        leaves = [x.detach().clone().requires_grad_() for x in inputs]
        extra = dict(compute_dtype=torch.float64) if fn is reference.loss else {}
        loss, metrics = fn(leaves[0], leaves[1], targets, adv, mask, bias=leaves[2], **kw, **extra)
        loss.backward()
        outs.append((loss, metrics, [x.grad for x in leaves]))
    (rl, rm, rg), (fl, fm, fg) = outs
    assert abs(fl.item() - rl.item()) <= 1e-4 * max(1.0, abs(rl.item()))
    for k in rm:
        assert abs(fm[k].item() - rm[k].item()) <= 1e-4 * max(1.0, abs(rm[k].item())), k
    for name, a, b in zip(("hidden", "weight", "bias"), fg, rg):
        assert a.dtype == dtype
        assert _max_rel(a, b) < GPU_TOL[dtype], name


def test_logprobs_on_gpu_few_tokens_large_vocab():
    # few tokens: the forward splits the vocab across programs and merges the partials
    hidden = torch.randn(1, 3, 896, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(151936, 896, device="cuda", dtype=torch.bfloat16) * 0.02
    targets = torch.randint(0, 151936, (1, 3), device="cuda")
    lp = grpo_fast.logprobs(hidden, weight, targets)
    torch.testing.assert_close(lp, reference.logprobs(hidden, weight, targets, compute_dtype=torch.float64),
                               rtol=1e-4, atol=1e-3)
