"""Half-precision gradients keep their precision at every gradient scale.

The general path's backward rounds g = dL/du to the input dtype for its GEMMs, and the frozen-head forward rounds
P' = e s' for its second GEMM. dL/dlogp carries GRPO's 1/tokens normaliser (1e-4 and below), and fp16's smallest
normal is 6.1e-5: unscaled, a small gradient lands in fp16's subnormals (or flushes to zero) and loses its relative
precision, and P' of a confident token (every non-target e about 1e-6) does too. The kernels scale g and P' by a
power of two before the rounding and divide it out exactly in fp32 (kernels/tile.py's ``gemm_scale``).

Checked under the interpreter, whose rounding is the GPU kernels' (the fused backward rounds g as a GPU does, then
upcasts for the interpreter's dot), against fp64 from the same rounded inputs: the chunked and fused backward (dH,
dW, db in their fp32 buffers: the kernels' precision, before the autograd layer's cast to the parameter dtype) at
dL/dlogp of 10 down to 1e-4 per token and in a batch whose dL/dlogp varies 1e4-fold, with and without an entropy
gradient and a soft-cap; and the frozen head's J = d logp / dh with fp16 / bf16 P', confident tokens (1 - p_y down to
1e-6) included. Error: max |error| / max |entry| (J: per row, as dH = c J scales each row by its own c). The
interpreter runs the kernels with wider vocabulary tiles than its default (a fifth to a tenth of the time; the block
shape is a launch choice).
"""

import pytest
import torch
import triton
import triton.language as tl
from helpers import non_finite_inputs
from test_confident_tokens import confident_batch

from grpo_fast import reference
from grpo_fast.backends.resolver import TRITON
from grpo_fast.head.transform import LogitTransform
from grpo_fast.kernels import backward as kbackward
from grpo_fast.kernels import config as kconfig
from grpo_fast.kernels import forward as kforward
from grpo_fast.kernels import forward_frozen as kfrozen
from grpo_fast.kernels.operands import HeadGrads, HeadOperands
from grpo_fast.kernels.tile import to_gemm

F64 = torch.float64
# max |error| / max |entry| against fp64, at every gradient scale (the bounds: fp16 rounds g to 2^-11,
# bf16 to 2^-8 relative)
TOL = {torch.float16: 2e-3, torch.bfloat16: 1.2e-2}
# a real-ish vocabulary (odd, not a block multiple), a small model width, a few token blocks
N, D, V = 40, 64, 6007
SCALES = (10.0, 1e-2, 1e-4, "mixed")
# launch configurations: the interpreter's default tiles (16 x 32) take ~10x as long at this vocabulary
_TILES = dict(block_n=16, block_v=512, num_warps=4, num_stages=1)
VARIANTS = {
    "plain": dict(transform=dict(), entropy=False),
    "entropy-softcap": dict(transform=dict(softcap=30.0, temperature=0.7), entropy=True),
}


def _inputs(dtype, seed=0):
    """(hidden, weight, bias, targets): logits of a few nats' spread (p from 0.98 down to 1e-12, median 1e-5: most
    below fp16's smallest normal times 1e4), the target favoured by 0..14 nats (1 - p_y from 0.02 to ~1)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(V, D, generator=g, dtype=F64) / D**0.5
    y = torch.randint(0, V, (N,), generator=g)
    h = 2.0 * torch.randn(N, D, generator=g, dtype=F64) + 14.0 * torch.rand(N, 1, generator=g, dtype=F64) * w[y]
    b = 0.3 * torch.randn(V, generator=g, dtype=F64)
    return h.to(dtype), w.to(dtype), b.to(dtype), y


def _coefficients(scale, entropy, seed=1):
    """(dL/dlogp, dL/dentropy or None) [N] fp32: magnitude ``scale`` per token with random signs ("mixed": log-uniform
    over 1e-4..1, a 1e4-fold spread), the entropy's half as large; one masked row (both zero)."""
    g = torch.Generator().manual_seed(seed)
    if scale == "mixed":
        size = torch.exp(torch.empty(N).uniform_(torch.log(torch.tensor(1e-4)).item(), 0.0, generator=g))
    else:
        size = torch.full((N,), scale) * torch.empty(N).uniform_(0.5, 1.0, generator=g)
    sign = torch.where(torch.rand(N, generator=g) < 0.5, -1.0, 1.0)
    grad_logp = size * sign
    grad_entropy = 0.5 * size * torch.randn(N, generator=g) if entropy else None
    grad_logp[3] = 0.0
    if entropy:
        grad_entropy[3] = 0.0
    return grad_logp, grad_entropy


def _reference_grads(h, w, b, y, transform, grad_logp, grad_entropy):
    """(dH, dW, db) of sum(grad_logp logp + grad_entropy entropy) in fp64 from the same rounded inputs."""
    leaves = [x.detach().to(F64).requires_grad_() for x in (h, w, b)]
    logp, entropy = reference.logprobs_and_entropy(leaves[0], leaves[1], y, leaves[2], compute_dtype=F64, **transform)
    loss = (grad_logp.to(F64) * logp).sum()
    if grad_entropy is not None:
        loss = loss + (grad_entropy.to(F64) * entropy).sum()
    loss.backward()
    return tuple(x.grad for x in leaves)


def _config(kind, device, dtype, mode=None):
    """The kernels' launch configuration: a GPU's own; under the interpreter, wider tiles (_TILES)."""
    if device.type == "cuda":
        return (
            kconfig.forward_config(device, dtype)
            if kind is kconfig.TileRecordConfig
            else kconfig.backward_config(device, dtype, mode, wide_epilogue=True)
        )
    extra = dict(tiles=2, group_n=2, use_tma=False) if kind is kconfig.TileRecordConfig else dict(group_v=2)
    return kind(**_TILES, block_d=64, dot_fp32=True, **extra)


def _kernel_grads(h, w, b, y, transform, stats, grad_logp, grad_entropy, mode):
    """(dH, dW, db) from the Triton backward in ``mode``, as its buffers hold them (fp32 accumulators)."""
    device = h.device
    grad_logp = grad_logp.to(device)
    grad_entropy = grad_entropy.to(device) if grad_entropy is not None else None
    grad_hidden = TRITON.grad_hidden_buffer(h, mode)
    grad_weight = torch.zeros(w.shape, dtype=torch.float32, device=device)
    grad_bias = torch.zeros(w.shape[0], dtype=torch.float32, device=device)
    backward = kbackward.backward_chunked if mode == "chunked" else kbackward.backward_fused
    head = HeadOperands(h, w, y, b, LogitTransform(**transform))
    grads = HeadGrads(grad_hidden, grad_weight, grad_bias)
    backward(head, stats, grad_logp, grad_entropy, grads, _config(kconfig.BackwardConfig, device, h.dtype, mode))
    return grad_hidden, grad_weight, grad_bias


def _relative_error(actual, expected):
    return ((actual.cpu().to(F64) - expected).abs().max() / expected.abs().max()).item()


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_backward_precision_is_the_same_at_every_gradient_scale(dtype, variant, device):
    """Both backward modes (one case each: the reference and the forward are shared)."""
    h, w, b, y = _inputs(dtype)
    transform, entropy = VARIANTS[variant]["transform"], VARIANTS[variant]["entropy"]
    inputs = tuple(x.to(device) for x in (h, w, b, y))
    hidden, weight, bias, targets = inputs
    head = HeadOperands(hidden, weight, targets, bias, LogitTransform(**transform))
    _, _, stats = kforward.forward(head, True, _config(kconfig.TileRecordConfig, device, dtype))
    errors = {}
    for scale in SCALES:
        grad_logp, grad_entropy = _coefficients(scale, entropy)
        expected = _reference_grads(h, w, b, y, transform, grad_logp, grad_entropy)
        for mode in kconfig.BACKWARD_MODES:
            actual = _kernel_grads(*inputs, transform, stats, grad_logp, grad_entropy, mode)
            for name, a, e in zip(("dH", "dW", "db"), actual, expected):
                errors[f"{mode} {name} at {scale}"] = _relative_error(a, e)
    worst = max(errors.values())
    assert worst <= TOL[dtype], f"worst {worst:.3g}: " + ", ".join(f"{k} {v:.2g}" for k, v in errors.items())


def _reference_frozen_grad(h, w, b, y, transform):
    """J = d logp / dh [N, D] fp64 from the same rounded inputs (logp_n depends on h_n only)."""
    leaf = h.detach().to(F64).requires_grad_()
    logp, _ = reference.logprobs_and_entropy(leaf, w.to(F64), y, b.to(F64), compute_dtype=F64, **transform)
    logp.sum().backward()
    return leaf.grad


@pytest.mark.parametrize(
    "transform",
    [dict(), dict(softcap=20.0, logit_scale=0.8, temperature=0.35)],
    ids=["plain", "softcap-scale-temperature"],
)
@pytest.mark.parametrize("gemm_dtype", [torch.float16, torch.bfloat16])
def test_frozen_head_grad_keeps_its_precision_on_confident_tokens(gemm_dtype, transform, device):
    """J with P' rounded to fp16 / bf16, per row relative to the row's largest entry: half the rows confident
    (1 - p_y from 1e-6 to 1e-3, J that small), half the general batch's; fp32 inputs (only P' is rounded), two
    vocabulary chunks so that the running max and P''s scale move between chunks."""
    h_sure, w, b, y_sure = confident_batch(N // 2, D, V, torch.float32, transform)
    g = torch.Generator().manual_seed(2)
    h_unsure = torch.randn(N - N // 2, D, generator=g) * 2.0
    h, y = torch.cat([h_sure, h_unsure]), torch.cat([y_sure, torch.randint(0, V, (N - N // 2,), generator=g)])
    expected = _reference_frozen_grad(h, w, b, y, transform)
    cfg = (
        kconfig.frozen_head_config(device)
        if device.type == "cuda"
        else kconfig.FrozenHeadConfig(**_TILES, gemm_fp32=True)
    )
    head = HeadOperands(h.to(device), w.to(device), y.to(device), b.to(device), LogitTransform(**transform))
    grad = kfrozen.forward_frozen_head(head, False, cfg, vocab_chunk=3072, gemm_dtype=gemm_dtype)[
        3
    ]  # J; [4] is LoRA's J_l (None here)
    row_errors = (grad.cpu().to(F64) - expected).abs().amax(dim=1) / expected.abs().amax(dim=1)
    confident, others = row_errors[: N // 2].max().item(), row_errors[N // 2 :].max().item()
    assert max(confident, others) <= TOL[gemm_dtype], f"confident rows {confident:.3g}, others {others:.3g}"


@triton.jit
def _to_gemm_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(y_ptr + offs, to_gemm(tl.load(x_ptr + offs, mask=offs < n), y_ptr.dtype.element_ty), mask=offs < n)


@pytest.mark.parametrize("gemm_dtype", [torch.float16, torch.bfloat16])
def test_gemm_operands_round_to_nearest_even(gemm_dtype, device):
    """tile.to_gemm, which rounds g and P' for the GEMMs, gives torch's (a GPU's) round-to-nearest-even bits: every
    exponent of fp32, subnormals, ties to even either way, signed zeros, infinities, values that round to inf, NaNs
    (triton 3.9's interpreter truncates fp32 to bf16 by itself: twice the error, all toward zero)."""
    g = torch.Generator().manual_seed(0)
    bits = torch.randint(-(2**31), 2**31 - 1, (4000,), generator=g, dtype=torch.int64).to(torch.int32)
    ties = torch.tensor(
        [
            1.0 + 2**-8,
            1.0 + 3 * 2**-8,
            1.0 + 2**-11,
            1.0 + 3 * 2**-11,
            3.4e38,
            -3.4e38,
            65520.0,
            1e-45,
            0.0,
            -0.0,
            float("inf"),
            -float("inf"),
            float("nan"),
        ]
    )
    odd_nans = torch.tensor([0x7F800001, 0x7FFFFFFF, -1, 0x00008000, 0x00018000], dtype=torch.int32)
    x = torch.cat([bits.view(torch.float32), ties, odd_nans.view(torch.float32)]).to(device)
    y = torch.empty(x.shape, dtype=gemm_dtype, device=device)
    with non_finite_inputs():  # infinities, NaNs and values that round to inf, on purpose
        _to_gemm_kernel[(1,)](x, y, x.numel(), BLOCK=triton.next_power_of_2(x.numel()))
    expected = x.to(gemm_dtype)
    assert torch.equal(y.isnan(), expected.isnan())
    assert torch.equal(y[~y.isnan()].view(torch.int16), expected[~expected.isnan()].view(torch.int16))
