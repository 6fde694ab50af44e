"""Layer 1 is exact on confident tokens: every token's target dominates (1 - p_y from 1e-3 down to 1e-6).

There 1 - p_y and mean - z_y are 1e-6-sized, and a backward that forms them by subtraction (1 - exp(z_y - lse),
mean - z_y) loses them to fp32 rounding (a relative error of 1e-2 in dH and dW). The general path carries them from
the forward's record (grpo_fast/kernels/softmax_stats.py) instead. Checked against fp64 on the torch backend and on
the Triton kernels (chunked and fused backward; on the ``device`` fixture: the interpreter on CPU, compiled on a
CUDA GPU), with a soft-cap, temperature and logit scale, a bias,
an entropy bonus (dL/dentropy), odd shapes and rows without a gradient (masked); errors relative to the largest
entry of each gradient.
"""

import pytest
import torch
from conftest import backend_device

from grpo_fast import reference
from grpo_fast.head.ops import linear_logprobs_path
from grpo_fast.head.transform import LogitTransform
from grpo_fast.kernels.operands import HeadOperands

F64 = torch.float64
# max |error| / max |entry| against fp64 (from the same rounded inputs). fp32: the goal (measured: 3.4e-6 at most).
# bf16: the chunked backward rounds g to bf16 for the GEMMs and every gradient is returned in bf16 (2^-9 relative;
# measured 4.9e-3 at most); tests/test_gpu.py holds a compiled GPU to the same bounds at larger shapes
GRAD_TOL = {torch.float32: 2e-5, torch.bfloat16: 1e-2}
TRANSFORMS = {
    "plain": dict(),
    "softcap-temperature": dict(softcap=30.0, temperature=0.5),
    "softcap-scale-temperature": dict(softcap=20.0, logit_scale=0.8, temperature=0.35),
}
# (N, D, V): not block multiples, V not a power of two
SHAPES = [(21, 37, 203), (5, 48, 131)]


def _nontarget_mass(h, w, b, y, transform):
    """1 - p_y per row, fp64, from the full logits."""
    z = reference.logits(h.to(F64), w.to(F64), b.to(F64), compute_dtype=F64, **transform)
    logp = torch.log_softmax(z, dim=-1).gather(1, y[:, None]).squeeze(1)
    return -torch.expm1(logp)


def confident_batch(N, D, V, dtype, transform, seed=0):
    """(hidden [N, D], weight [V, D], bias [V], targets [N]) with 1 - p_y spread log-uniformly over [1e-6, 1e-3]:
    h_n = alpha_n (W_y + noise), alpha_n found by bisection (the target's logit dominates by ~7..14 nats more
    than the log of the vocabulary)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(V, D, generator=g, dtype=F64)
    w = w / w.norm(dim=1, keepdim=True)  # rows of one norm: W_y . W_v < |W_y|^2, the gap grows with alpha
    b = 0.3 * torch.randn(V, generator=g, dtype=F64)
    y = torch.randint(0, V, (N,), generator=g)
    direction = w[y] + 0.1 * torch.randn(N, D, generator=g, dtype=F64) / D**0.5
    goal = torch.exp(
        torch.empty(N, dtype=F64).uniform_(
            torch.log(torch.tensor(1e-6)).item(), torch.log(torch.tensor(1e-3)).item(), generator=g
        )
    )
    # 1 - p_y falls as alpha grows; with a soft-cap, until tanh saturates (then the gaps shrink): stop before
    top = transform["softcap"] / transform.get("logit_scale", 1.0) if "softcap" in transform else 200.0
    lo, hi = torch.zeros(N, dtype=F64), torch.full((N,), top, dtype=F64)
    for _ in range(60):
        mid = (lo + hi) / 2
        too_unsure = _nontarget_mass(mid[:, None] * direction, w, b, y, transform) > goal
        lo, hi = torch.where(too_unsure, mid, lo), torch.where(too_unsure, hi, mid)
    h = (hi[:, None] * direction).to(dtype)
    w, b = w.to(dtype), b.to(dtype)
    return h, w, b, y


def _gradients(h, w, b, y, transform, grad_logp, grad_entropy, backend=None, backward_mode="chunked"):
    """(logp, entropy, dH, dW, db) of sum(grad_logp logp + grad_entropy entropy): the fp64 reference when backend
    is None, else layer 1 on that backend (the general path: every input needs a gradient)."""
    leaves = [x.detach().to(F64 if backend is None else x.dtype).requires_grad_() for x in (h, w, b)]
    if backend is None:
        logp, entropy = reference.logprobs_and_entropy(*leaves[:2], y, leaves[2], compute_dtype=F64, **transform)
    else:
        head = HeadOperands(*leaves[:2], y, leaves[2], LogitTransform(**transform))
        logp, entropy = linear_logprobs_path(head, backend, "general", backward_mode)
    ((grad_logp * logp).sum() + (grad_entropy * entropy).sum()).backward()
    return (logp.detach(), entropy.detach()) + tuple(x.grad for x in leaves)


def relative_errors(actual, expected):
    """max |actual - expected| / max |expected| for dH, dW, db."""
    return {
        name: ((a.to(F64) - e).abs().max() / e.abs().max()).item()
        for name, a, e in zip(("hidden", "weight", "bias"), actual[2:], expected[2:])
    }


CASES = [("torch", "chunked"), ("triton", "chunked"), ("triton", "fused")]


@pytest.mark.parametrize("backend,backward_mode", CASES)
@pytest.mark.parametrize("transform", list(TRANSFORMS))
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_confident_tokens_match_fp64(backend, backward_mode, transform, shape, dtype, device):
    N, D, V = shape
    kw = TRANSFORMS[transform]
    dev = backend_device(backend, device)
    h, w, b, y = (x.to(dev) for x in confident_batch(N, D, V, dtype, kw))
    mass = _nontarget_mass(h, w, b, y, kw)
    # the batch is what it claims: every token confident, down to 1e-6 (bf16 rounding of h moves the values a bit)
    assert mass.max() < 3e-3 and mass.min() < 3e-6, (mass.min().item(), mass.max().item())
    g = torch.Generator().manual_seed(1)
    grad_logp = torch.randn(N, generator=g).to(dev)
    grad_entropy = 0.1 * torch.randn(N, generator=g).to(dev)
    grad_logp[1] = grad_entropy[1] = 0.0  # a row without a gradient (a masked token)
    expected = _gradients(h, w, b, y, kw, grad_logp.to(F64), grad_entropy.to(F64))
    actual = _gradients(h, w, b, y, kw, grad_logp, grad_entropy, backend, backward_mode)
    # the outputs: the log-prob to its own relative precision (it is -(1 - p_y), not a rounded zero)
    torch.testing.assert_close(actual[0].to(F64), expected[0].to(F64), rtol=1e-4, atol=1e-10)
    torch.testing.assert_close(actual[1].to(F64), expected[1].to(F64), rtol=1e-4, atol=1e-9)
    errors = relative_errors(actual, expected)
    assert max(errors.values()) <= GRAD_TOL[dtype], errors


@pytest.mark.parametrize("backend,backward_mode", CASES)
def test_an_entropy_only_loss_is_exact_too(backend, backward_mode, device):
    # the entropy's target column is p_y (mean - z_y): 1e-6-sized, carried from the forward as well
    N, D, V = SHAPES[0]
    kw = TRANSFORMS["softcap-temperature"]
    dev = backend_device(backend, device)
    h, w, b, y = (x.to(dev) for x in confident_batch(N, D, V, torch.float32, kw, seed=3))
    grad_entropy = torch.randn(N, generator=torch.Generator().manual_seed(2)).to(dev)
    zero = torch.zeros(N, device=dev)
    errors = relative_errors(
        _gradients(h, w, b, y, kw, zero, grad_entropy, backend, backward_mode),
        _gradients(h, w, b, y, kw, zero.to(F64), grad_entropy.to(F64)),
    )
    assert max(errors.values()) <= GRAD_TOL[torch.float32], errors
