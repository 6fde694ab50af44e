"""grpo_fast.distillation_loss: TRL 1.16's distillation loss (the divergence summed over the scored tokens over a
normaliser) with the student's gradients formed in the forward (kernels.divergence_loss.loss_gradients on the Triton
backend: both models' logits of a token chunk once, from GEMM outputs in memory), against the fp64 spec, against the
per-token head it replaces, and in its sweep count."""

import pytest
import torch
from helpers import assert_close_to_scale, matmul_flops
from test_divergence import BETAS, TRANSFORMS, confident_pair, on, pair_inputs, spec_grads

import grpo_fast

F64 = torch.float64
BACKENDS = ["torch", "triton"]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# max |error| / max |fp64 value|, by input dtype: the loss, divergence and entropy keep fp32 accumulation's precision
# from the rounded inputs; the gradients come back in the input dtype, and the Triton path rounds g to it for the
# GEMMs (2^-8 / 2^-11 relative per entry): test_divergence.py's bounds for the per-token head
VALUE_TOL = 2e-5
GRAD_TOL = {torch.float32: 2e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}


def _leaves(inputs, device, requires=(0, 1, 2)):
    return [
        x.detach().clone().to(device).requires_grad_(i in requires) if x is not None else None
        for i, x in enumerate(inputs)
    ]


def _loss(leaves, mask, beta, kw, **options):
    """grpo_fast.distillation_loss on [1, N] rows of ``leaves`` (pair_inputs' order)."""
    return grpo_fast.distillation_loss(
        leaves[0][None],
        leaves[1],
        leaves[3][None],
        leaves[4],
        mask,
        beta=beta,
        student_bias=leaves[2],
        teacher_bias=leaves[5],
        **kw,
        **options,
    )


def check_against_spec(inputs, beta, kw, backend, device, dtype, mask, token_chunk=None, num_items=None, tol=None):
    """The loss, the per-token divergence and entropy and every student gradient against the fp64 spec of
    sum(mask * divergence) / (num_items or mask's count) on the same rounded inputs."""
    rounded = tuple(x.to(dtype) if x is not None else None for x in inputs)
    keep = mask.reshape(-1).to(F64)
    divisor = num_items if num_items is not None else max(float(keep.sum()), 1.0)
    spec = tuple(x.to(F64) if x is not None else None for x in rounded)
    div, ent, *grads = spec_grads(spec, beta, kw, grad_div=keep / divisor)
    expected_loss = float((div * keep).sum()) / divisor
    dev = on(backend, device, (rounded[0],))[0].device
    leaves = _leaves(rounded, dev)
    options = dict(backend=backend, token_chunk=token_chunk if backend == "triton" else None)
    if num_items is not None:
        options["num_items_in_batch"] = num_items
    loss, per_token, entropy = _loss(leaves, mask.to(dev)[None], beta, kw, **options)
    assert loss.dtype == torch.float32 and loss.shape == ()
    assert not per_token.requires_grad and not entropy.requires_grad
    loss.backward()
    assert abs(loss.item() - expected_loss) <= VALUE_TOL * max(abs(expected_loss), 1e-3)
    for name, a, e in (("divergence", per_token[0], div * keep), ("entropy", entropy[0], ent * keep)):
        err = ((a.cpu().double() - e).abs().max() / e.abs().max()).item()
        assert err <= VALUE_TOL, f"{name}: {err:.3g}"
    for name, leaf, e in zip(("d student_hidden", "d student_weight", "d student_bias"), leaves, grads):
        assert leaf.grad.dtype == dtype, name
        err = ((leaf.grad.cpu().double() - e).abs().max() / e.abs().max()).item()
        assert err <= (tol or GRAD_TOL[dtype]), f"{name}: {err:.3g}"
    assert all(leaves[i].grad is None for i in (3, 4, 5)), "the teacher got a gradient"
    return loss, leaves


@pytest.mark.parametrize("transform", TRANSFORMS, ids=list(TRANSFORMS))
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("beta", BETAS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_matches_spec(backend, beta, dtype, transform, device):
    """Odd shapes (N, V, Ds, Dt not block multiples), biases, a mask, and chunks of 8 tokens (logits of 4 at a
    time) and of 7 (an odd half: 4 then 3): records, g and dW's accumulation over several chunks."""
    inputs = pair_inputs(3 * 7, 19, 37, 101)
    mask = (torch.rand(21, generator=torch.Generator().manual_seed(1)) > 0.3).float()
    for token_chunk in (8, 7):
        check_against_spec(inputs, beta, TRANSFORMS[transform], backend, device, dtype, mask, token_chunk)


@pytest.mark.parametrize("beta", BETAS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_confident_tokens(backend, beta, device):
    """Both models confident (1 - p from 1e-6 to 1e-3, soft-capped): the fp32 loss and gradients within 2e-5 of
    their max against fp64, as the per-token head (no 1 - p formed by subtraction)."""
    kw = dict(TRANSFORMS["softcap-scale"], student_softcap=30.0, teacher_softcap=30.0)
    inputs = confident_pair(24, 32, 48, 211, kw)
    mask = torch.ones(24)
    check_against_spec(inputs, beta, kw, "triton" if backend == "triton" else "torch", device, torch.float32, mask, 10)


@pytest.mark.parametrize("beta", [1.0, 0.5])
def test_realistic_gradient_scale_fp16(beta, device):
    """num_items_in_batch 1e5 (dL/d div 1e-5) from fp16 inputs: the fp32 gradients keep fp16's relative precision
    before the final cast (g is scaled by an exact power of two before its rounding for the GEMMs), the same
    bound as at dL/d div of order 1 once that cast's subnormals are set aside."""
    from grpo_fast.distillation import ops as divergence_ops
    from grpo_fast.head.transform import LogitTransform
    from grpo_fast.kernels.divergence_records import ModelHead

    kw = TRANSFORMS["softcap-scale"]
    inputs = tuple(x.to(torch.float16) for x in pair_inputs(21, 19, 37, 101))
    weights = torch.full((21,), 1e-5)
    expected = spec_grads(tuple(x.to(F64) for x in inputs), beta, kw, grad_div=weights.to(F64))
    hs, ws, bs, ht, wt, bt = on("triton", device, inputs)
    student = ModelHead(hs, ws, bs, LogitTransform(1.3, 3.0, 0.8))
    teacher = ModelHead(ht, wt, bt, LogitTransform(1.3, 5.0, 1.25))
    operands = divergence_ops.OpOperands.from_heads(student, teacher, beta, "triton", torch.float16)
    out = divergence_ops._loss_impl(*operands, weights.to(hs.device), True, True, True, 8)
    for name, actual, e in zip(("dH", "dW", "db"), out[4:], expected[2:]):
        err = ((actual.cpu().double() - e).abs().max() / e.abs().max()).item()
        assert err <= 2e-3, f"{name}: {err:.3g}"


@pytest.mark.parametrize("beta", [1.0, 0.5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_equals_the_per_token_head(dtype, beta, device):
    """The fused loss against grpo_fast.divergence_and_entropy then the same masked mean (the path it replaces,
    Triton kernels both): the same loss and divergence to fp32 rounding, gradients to g's rounding."""
    inputs = tuple(x.to(dtype) for x in pair_inputs(30, 24, 40, 133, seed=2))
    mask = (torch.rand(30, generator=torch.Generator().manual_seed(3)) > 0.2).float().to(device)[None]
    kw = TRANSFORMS["temperature"]
    fused_leaves = _leaves(inputs, device)
    loss, div, _ = _loss(fused_leaves, mask, beta, kw, backend="triton", token_chunk=12)
    loss.backward()
    leaves = _leaves(inputs, device)
    per_token, _ = grpo_fast.divergence_and_entropy(
        leaves[0][None], leaves[1], leaves[3][None], leaves[4], mask, beta=beta, student_bias=leaves[2],
        teacher_bias=leaves[5], backend="triton", **kw,
    )  # fmt: skip
    expected = per_token.sum() / mask.sum()
    expected.backward()
    assert abs(loss.item() - expected.item()) <= 1e-6 * abs(expected.item())
    # of the largest entry: a divergence near 0 and a gradient entry (db sums g over tokens) that cancel keep the
    # rounding of the terms, whose sums the two paths run in another order (fp32: each path within 1.1e-6 of fp64)
    assert_close_to_scale(div, per_token.detach(), 1e-6, "divergence")
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for name, a, e in zip(("dH", "dW", "db"), fused_leaves[:3], leaves[:3]):
        assert_close_to_scale(a.grad, e.grad, tol, name)


@pytest.mark.parametrize("backend", BACKENDS)
def test_normalisers_and_empty_masks(backend, device):
    """num_items_in_batch as a number and as a tensor divides the sum; a mask of zeros gives a zero loss and zero
    gradients (the count clamped to 1, TRL's), never NaN."""
    inputs = pair_inputs(12, 16, 24, 64, dtype=torch.float32)
    mask = torch.ones(12)
    mask[::3] = 0.0
    loss, _ = check_against_spec(inputs, 1.0, {}, backend, device, torch.float32, mask, num_items=40.0)
    dev = on(backend, device, (mask,))[0].device
    leaves = _leaves(inputs, dev)
    as_tensor, _, _ = _loss(leaves, mask.to(dev)[None], 1.0, {}, backend=backend, num_items_in_batch=torch.tensor(40))
    assert torch.allclose(as_tensor.cpu(), loss.detach().cpu(), rtol=1e-6)
    leaves = _leaves(inputs, dev)
    empty, div, entropy = _loss(leaves, torch.zeros(1, 12, device=dev), 1.0, {}, backend=backend)
    empty.backward()
    assert empty.item() == 0.0 and not div.any() and not entropy.any()
    assert all(not leaf.grad.any() for leaf in leaves[:3])


@pytest.mark.parametrize("backend", BACKENDS)
def test_device_partition_without_host_reads(backend, device):
    """check_values=False: the rows are a device partition (padding zeroed, its weights 0): the same loss and
    gradients as with the host read."""
    inputs = pair_inputs(14, 16, 24, 64, dtype=torch.float32, seed=4)
    mask = (torch.rand(14, generator=torch.Generator().manual_seed(5)) > 0.4).float()
    dev = on(backend, device, (mask,))[0].device
    results = []
    for check_values in (True, False):
        leaves = _leaves(inputs, dev)
        loss, div, _ = _loss(leaves, mask.to(dev)[None], 0.5, {}, backend=backend, check_values=check_values)
        loss.backward()
        results.append((loss.detach(), div, *(leaf.grad for leaf in leaves[:3])))
    # another row selection, so dW and db sum the rows in another order: to the rounding of each one's scale
    for a, b in zip(*results):
        assert_close_to_scale(a, b, 1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_frozen_student_head_forms_dh_alone(backend, device):
    """Only the student's hidden states need a gradient (LoRA elsewhere, a frozen lm_head): dH alone, as the spec's;
    the weight and bias get none. Under no_grad nothing is formed and the loss is the same number."""
    inputs = pair_inputs(16, 16, 24, 64, dtype=torch.float32, seed=6)
    mask = torch.ones(16)
    dev = on(backend, device, (mask,))[0].device
    leaves = _leaves(inputs, dev, requires=(0,))
    loss, _, _ = _loss(leaves, mask.to(dev)[None], 1.0, {}, backend=backend)
    loss.backward()
    expected = spec_grads(tuple(x.to(F64) for x in inputs), 1.0, {}, grad_div=torch.full((16,), 1 / 16, dtype=F64))
    assert leaves[1].grad is None and leaves[2].grad is None
    err = ((leaves[0].grad.cpu().double() - expected[2]).abs().max() / expected[2].abs().max()).item()
    assert err <= 2e-5
    with torch.no_grad():
        again, _, _ = _loss(_leaves(inputs, dev), mask.to(dev)[None], 1.0, {}, backend=backend)
    assert not again.requires_grad and again.item() == pytest.approx(loss.item(), rel=1e-6)


@pytest.mark.interpreter_only
@pytest.mark.parametrize("beta", [1.0, 0.5])
def test_three_student_sweeps_and_one_teacher_sweep(beta):
    """The fused loss's matmul FLOPs (forward + backward, counted by FlopCounterMode, which opens the op): the
    student's product, dH and dW (3 sweeps) and the teacher's product (1), whatever beta: 2 N V (3 Ds + Dt), against
    the per-token head's 2 N V (4 Ds + 2 Dt) for a KL and 2 N V (5 Ds + 3 Dt) for the JSD (TRL's alike)."""
    N, Ds, Dt, V = 21, 19, 37, 101
    inputs = pair_inputs(N, Ds, Dt, V, dtype=torch.float32)

    def fused():
        leaves = _leaves(inputs, torch.device("cpu"))
        _loss(leaves, None, beta, {}, backend="triton", token_chunk=8)[0].backward()

    def per_token():
        leaves = _leaves(inputs, torch.device("cpu"))
        div, _ = grpo_fast.divergence_and_entropy(
            leaves[0][None], leaves[1], leaves[3][None], leaves[4], beta=beta, backend="torch"
        )
        div.mean().backward()

    assert matmul_flops(fused) == 2 * N * V * (3 * Ds + Dt)
    forward_sweeps = 2 if 0.0 < beta < 1.0 else 1
    assert matmul_flops(per_token) == 2 * N * V * ((forward_sweeps + 1) * (Ds + Dt) + 2 * Ds)


def test_named_errors():
    hs, ws, _, ht, wt, _ = pair_inputs(4, 8, 8, 16, dtype=torch.float32, bias=False)
    args = (hs[None], ws, ht[None], wt)
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="token_chunk must be a positive int"):
            grpo_fast.distillation_loss(*args, token_chunk=bad)
    for other in (dict(head_path="general", backend="triton"), dict(backend="torch")):
        with pytest.raises(ValueError, match="token_chunk sizes the fused loss"):
            grpo_fast.distillation_loss(*args, token_chunk=8, **other)
    with pytest.raises(ValueError, match="num_items_in_batch"):
        grpo_fast.distillation_loss(*args, num_items_in_batch=0)
    with pytest.raises(TypeError, match="one-element tensor"):
        grpo_fast.distillation_loss(*args, num_items_in_batch=torch.ones(2))
    with pytest.raises(TypeError, match=r"distillation_loss\(\) got an unexpected keyword argument 'bta' \(did"):
        grpo_fast.distillation_loss(*args, bta=0.5)
    with pytest.raises(ValueError, match="beta"):
        grpo_fast.distillation_loss(*args, beta=1.5)


def test_general_path_is_the_per_token_sum(device):
    """head_path="general" computes divergence_and_entropy then the same sum: the same loss and gradients as the
    fused loss (the Triton backend, fp32)."""
    inputs = pair_inputs(10, 8, 12, 40, dtype=torch.float32, seed=7)
    results = []
    for head_path in ("auto", "general"):
        leaves = _leaves(inputs, device)
        loss, _, _ = _loss(leaves, None, 0.5, {}, backend="triton", head_path=head_path)
        loss.backward()
        results.append((loss.detach(), *(leaf.grad for leaf in leaves[:3])))
    # the two paths sum the vocabulary and the tokens in another order (and another CPU in yet another): a gradient
    # entry near zero keeps an error of the gradient's scale, so each is compared relative to its largest entry
    for name, a, b in zip(("loss", "dH", "dW", "db"), *results):
        assert_close_to_scale(a, b, 1e-5, name)
