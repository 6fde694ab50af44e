"""What only a CUDA GPU checks: the compiled kernels at larger shapes (bf16 / fp16 on tensor cores, tensors past
2^31 elements) against the fp64 reference (skipped without CUDA).

On a machine with CUDA the plain `pytest` runs the kernel tests compiled (tests/conftest.py leaves the interpreter
off there: the ``device`` fixture is the GPU), this file included; alone:  pytest tests/test_gpu.py
Tolerance on a GPU in bf16: the backward feeds bf16 tensor cores with g = dL/du rounded to bf16, so gradients
match the fp64 reference to about 1% of their largest entry; fp32 inputs use IEEE fp32 dots and match tightly
(conftest.GRAD_TOL's "cuda" row).
"""

import itertools

import pytest
import torch
from conftest import grad_rtol

import grpo_fast
from grpo_fast import reference
from grpo_fast.head.ops import linear_logprobs_path
from grpo_fast.head.transform import LogitTransform
from grpo_fast.kernels.config import interpreting
from grpo_fast.kernels.operands import HeadOperands

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
    pytest.mark.skipif(interpreting(), reason="TRITON_INTERPRET=1 in this process: the kernels are not compiled"),
]

GPU_TOL = {dtype: grad_rtol("cuda", dtype) for dtype in (torch.float32, torch.bfloat16, torch.float16)}


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
    _loss_matches_reference(
        dtype,
        hidden,
        weight,
        bias,
        targets,
        adv,
        mask,
        old_logprobs=old,
        ref_logprobs=ref,
        beta=0.04,
        epsilon_high=0.28,
        loss_type=loss_type,
        importance_sampling_level=level,
        temperature=0.9,
        max_completion_length=T,
    )


def _loss_matches_reference(dtype, hidden, weight, bias, targets, advantages, mask, **kw):
    """grpo_fast.loss against the fp64 reference: loss and metrics to 1e-4, gradients within GPU_TOL."""
    outs = []
    for fn, inputs in (
        (reference.loss, (hidden.float(), weight.float(), bias.float())),
        (grpo_fast.loss, (hidden, weight, bias)),
    ):
        leaves = [x.detach().clone().requires_grad_() for x in inputs]
        extra = dict(compute_dtype=torch.float64) if fn is reference.loss else {}
        loss, metrics = fn(leaves[0], leaves[1], targets, advantages, mask, bias=leaves[2], **kw, **extra)
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
    torch.testing.assert_close(
        lp, reference.logprobs(hidden, weight, targets, compute_dtype=torch.float64), rtol=1e-4, atol=1e-3
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backward_mode", ["chunked", "fused"])
@pytest.mark.parametrize(
    "transform",
    [dict(), dict(softcap=30.0), dict(softcap=2.0, logit_scale=1.7, temperature=0.7), dict(logit_scale=0.0625)],
)
def test_logprobs_and_entropy_gradients_on_gpu(dtype, backward_mode, transform):
    # a loss on both outputs: the entropy-gradient and soft-cap variants of both backward kernels, compiled
    g = torch.Generator(device="cuda").manual_seed(1)
    B, T, D, V = 3, 211, 520, 9973
    hidden = torch.randn(B, T, D, device="cuda", generator=g).to(dtype)
    weight = (torch.randn(V, D, device="cuda", generator=g) * (2.0 if "softcap" in transform else 0.05)).to(dtype)
    bias = (torch.randn(V, device="cuda", generator=g) * 0.1).to(dtype)
    targets = torch.randint(0, V, (B, T), device="cuda", generator=g)
    mask = torch.rand(B, T, device="cuda", generator=g) > 0.2
    c_logp, c_ent = torch.randn(B, T, device="cuda", generator=g), torch.randn(B, T, device="cuda", generator=g)
    outs = []
    for fn, inputs in (
        (reference.logprobs_and_entropy, (hidden.double(), weight.double(), bias.double())),
        (grpo_fast.logprobs_and_entropy, (hidden, weight, bias)),
    ):
        leaves = [x.detach().clone().requires_grad_() for x in inputs]
        if fn is reference.logprobs_and_entropy:
            logp, ent = fn(leaves[0], leaves[1], targets, leaves[2], compute_dtype=torch.float64, **transform)
            logp, ent = logp * mask, ent * mask
        else:
            logp, ent = fn(
                leaves[0],
                leaves[1],
                targets,
                bias=leaves[2],
                completion_mask=mask,
                backward_mode=backward_mode,
                **transform,
            )
        ((c_logp * logp).sum() + (c_ent * ent).sum()).backward()
        outs.append((logp.detach(), ent.detach(), [x.grad for x in leaves]))
    (rl, re, rg), (fl, fe, fg) = outs
    torch.testing.assert_close(fl, rl.float(), rtol=1e-4, atol=1e-3 if dtype == torch.bfloat16 else 1e-4)
    torch.testing.assert_close(fe, re.float(), rtol=1e-4, atol=1e-3 if dtype == torch.bfloat16 else 1e-4)
    for name, a, b in zip(("hidden", "weight", "bias"), fg, rg):
        assert a.dtype == dtype
        assert _max_rel(a, b) < GPU_TOL[dtype], name


def _cuda_batch(seed, B, T, D, V, dtype, **transform):
    """hidden, weight, bias (dtype), targets, mask (80% ones), advantages [B] and old / reference log-probs 0.2 nat
    around the true ones, on CUDA."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    hidden = torch.randn(B, T, D, device="cuda", generator=g).to(dtype)
    weight = (torch.randn(V, D, device="cuda", generator=g) * 0.05).to(dtype)
    bias = (torch.randn(V, device="cuda", generator=g) * 0.1).to(dtype)
    targets = torch.randint(0, V, (B, T), device="cuda", generator=g)
    mask = torch.rand(B, T, device="cuda", generator=g) > 0.2
    adv = torch.randn(B, device="cuda", generator=g)
    true = reference.logprobs(hidden, weight, targets, bias, **transform)
    old = true + 0.2 * torch.randn(B, T, device="cuda", generator=g)
    ref = true + 0.2 * torch.randn(B, T, device="cuda", generator=g)
    return hidden, weight, bias, targets, mask, adv, old, ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "options",
    [
        dict(entropy_coef=0.01, top_entropy_quantile=0.2),
        dict(loss_type="vespo"),
        dict(off_policy_mask_threshold=0.05),
        dict(importance_sampling_level="sequence", use_bias_correction_kl=True),
    ],
)
def test_trl_options_on_gpu_match_reference(dtype, options):
    hidden, weight, bias, targets, mask, adv, old, ref = _cuda_batch(2, 4, 157, 264, 5003, dtype)
    _loss_matches_reference(
        dtype, hidden, weight, bias, targets, adv, mask, old_logprobs=old, ref_logprobs=ref, beta=0.04, **options
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("transform", [dict(), dict(softcap=30.0), dict(softcap=2.0, logit_scale=1.7, temperature=0.7)])
def test_frozen_head_on_gpu_matches_reference(dtype, transform):
    # a frozen weight and bias, no entropy bonus: the forward builds d logp / dh (kernels/forward_frozen.py: cuBLAS
    # with fp32 output, the tile kernel, cuBLAS into fp32 J) and dH = c J; several token and vocabulary chunks
    from grpo_fast.head import paths as backends
    from grpo_fast.kernels import forward_frozen

    D = 264
    hidden, weight, bias, targets, mask, adv, old, _ = _cuda_batch(4, 4, 300, D, 50021, dtype, **transform)
    assert forward_frozen.available(hidden.reshape(-1, D)) or dtype != torch.float32
    calls = []
    original = backends.head_forward_frozen_head
    backends.head_forward_frozen_head = lambda *a: calls.append(1) or original(*a)
    try:
        leaf = hidden.clone().requires_grad_()
        loss, _ = grpo_fast.loss(leaf, weight, targets, adv, mask, bias=bias, old_logprobs=old, **transform)
        loss.backward()
    finally:
        backends.head_forward_frozen_head = original
    assert calls == ([1] if forward_frozen.available(hidden.reshape(-1, D)) else [])
    ref_leaf = hidden.double().requires_grad_()
    ref_loss, _ = reference.loss(
        ref_leaf,
        weight.double(),
        targets,
        adv,
        mask,
        bias=bias.double(),
        old_logprobs=old,
        compute_dtype=torch.float64,
        **transform,
    )
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss.float(), rtol=1e-4, atol=1e-5)
    assert leaf.grad.dtype == dtype
    assert _max_rel(leaf.grad, ref_leaf.grad) < GPU_TOL[dtype]


def _graph_replays(step, batches, trained):
    """``step(*batch)`` (a forward and backward) captured in a CUDA graph on the first batch (warmed up on a side
    stream: Triton's compilation, cuBLAS's handles), then replayed on each later batch's values copied into its
    static tensors, and run eagerly on a copy: per later batch (replayed output, replayed gradients of the leaves
    ``trained`` (indices into the batch), eager output, eager gradients)."""
    static = [x.clone() for x in batches[0]]
    leaves = [static[i].requires_grad_() for i in trained]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            for leaf in leaves:
                leaf.grad = None
            step(*static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for leaf in leaves:
            leaf.grad = None
        static_out = step(*static)
    static_grads = [leaf.grad for leaf in leaves]
    out = []
    for batch in batches[1:]:
        with torch.no_grad():
            for dst, src in zip(static, batch):
                dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        eager = [x.clone() for x in batch]
        eager_leaves = [eager[i].requires_grad_() for i in trained]
        eager_out = step(*eager)
        out.append((static_out, static_grads, eager_out, [leaf.grad for leaf in eager_leaves]))
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("frozen_weight", [False, True])
def test_loss_step_in_a_cuda_graph_equals_eager(dtype, frozen_weight):
    """A loss step (forward and backward; check_values=False, static shapes) captured in a CUDA graph, replayed on
    new input values copied into its static tensors, equals the eager step: loss, metrics and gradients. Capture
    fails on any host synchronisation inside the step; a frozen weight takes the frozen-head path (cuBLAS and
    Triton), a trained one the general path. Both runs launch the same kernels on the same values; the tolerance
    allows only another reduction order (cuBLAS may pick another algorithm under capture)."""
    B, T, D, V = 4, 67, 264, 5003
    options = dict(beta=0.04, epsilon_high=0.28, temperature=0.9, backend="triton", check_values=False)
    batches = [_cuda_batch(seed, B, T, D, V, dtype, temperature=0.9) for seed in (5, 6, 7)]
    trained = (0,) if frozen_weight else (0, 1, 2)  # hidden; weight and bias

    def step(hidden, weight, bias, targets, mask, adv, old, ref):
        loss, metrics = grpo_fast.loss(
            hidden, weight, targets, adv, mask, bias=bias, old_logprobs=old, ref_logprobs=ref, **options
        )
        loss.backward()
        return loss, metrics

    grad_tol = 1e-5 if dtype == torch.float32 else 1e-2
    for (static_loss, static_metrics), static_grads, (loss, metrics), grads in _graph_replays(step, batches, trained):
        torch.testing.assert_close(static_loss.detach(), loss.detach(), rtol=1e-5, atol=1e-6)
        assert sorted(static_metrics) == sorted(metrics)
        for name in metrics:
            torch.testing.assert_close(
                static_metrics[name].detach(), metrics[name].detach(), rtol=1e-5, atol=1e-6, msg=name
            )
        for name, got, expected in zip(("hidden", "weight", "bias"), static_grads, grads):
            assert got.dtype == dtype, name
            assert _max_rel(got, expected) <= grad_tol, name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backward_mode", ["chunked", "fused"])
def test_confident_tokens_on_gpu(dtype, backward_mode):
    # every token confident (1 - p_y from 1e-3 down to 1e-6), soft-cap, temperature, bias, entropy bonus: the
    # compiled general path against fp64 (tests/test_confident_tokens.py has the batch and the CPU / interpreter runs)
    from test_confident_tokens import GRAD_TOL, TRANSFORMS, confident_batch

    kw = TRANSFORMS["softcap-temperature"]
    N, D, V = 300, 264, 5003
    h, w, b, y = (x.cuda() for x in confident_batch(N, D, V, dtype, kw))
    g = torch.Generator(device="cuda").manual_seed(5)
    grad_logp, grad_entropy = torch.randn(N, device="cuda", generator=g), torch.randn(N, device="cuda", generator=g)
    grads = []
    for backend in (None, "triton"):
        leaves = [
            x.detach().clone().requires_grad_()
            for x in ((h, w, b) if backend else (h.double(), w.double(), b.double()))
        ]
        if backend is None:
            logp, ent = reference.logprobs_and_entropy(
                leaves[0], leaves[1], y, leaves[2], compute_dtype=torch.float64, **kw
            )
        else:
            head = HeadOperands(leaves[0], leaves[1], y, leaves[2], LogitTransform(**kw))
            logp, ent = linear_logprobs_path(head, backend, "general", backward_mode)
        ((grad_logp * logp).sum() + (grad_entropy * ent).sum()).backward()
        grads.append([x.grad for x in leaves])
    for name, a, e in zip(("hidden", "weight", "bias"), grads[1], grads[0]):
        assert _max_rel(a.double(), e) <= GRAD_TOL[dtype], name


# ------------------------------------------------------------------------------------ tensors past 2^31 elements
# (N tokens, D, V), by the tensor that passes 2^31 elements (tests/test_large_offsets.py covers the same offsets
# under the interpreter with strided views, and says which it cannot):
#   weight: W (V x D); with N >= D tokens the chunked backward's g (D x V) too; the fused backward's fp32 dW; with
#           an fp32 weight, the frozen-head forward's u buffer (token chunk x vocabulary, fp32, the size of W)
#   hidden: the hidden states (N x D); the backwards' fp32 dH (both modes); the frozen-head path's fp32 J
PAST_2_31 = {"weight": (16400, 16384, 131200), "hidden": (131200, 16384, 1000)}


def _max_rel_by_rows(a, b, rows=8192):
    """_max_rel of two large tensors, a slab of rows at a time (no full-size fp32 temporaries)."""
    err = scale = 0.0
    for r0 in range(0, a.shape[0], rows):
        x, y = a[r0 : r0 + rows].float(), b[r0 : r0 + rows].float()
        err, scale = max(err, (x - y).abs().max().item()), max(scale, y.abs().max().item())
    return err / max(scale, 1e-12)


def _layer1_matches_reference_in_token_chunks(
    N,
    D,
    V,
    dtype,
    frozen,
    device,
    monkeypatch,
    backward_mode="chunked",
    token_chunk=1024,
    logp_atol=1e-3,
    grad_rtol=2e-2,
):
    """LinearLogprobs on the Triton backend (random [N, D] hidden, [V, D] weight, bias; soft-cap and temperature)
    against the fp32 reference computed one token chunk at a time (N x V logits would not fit): log-probs,
    entropies and every gradient of sum(c logp + e entropy); ``frozen``: the weight and bias frozen, a loss on the
    log-probs only, and the frozen-head path must be the one taken."""
    from grpo_fast.head import ops as head_ops
    from grpo_fast.head import paths as backends
    from grpo_fast.head.transform import LogitTransform

    transform = dict(temperature=0.7, softcap=30.0)
    g = torch.Generator(device=device).manual_seed(9)
    hidden = torch.randn(N, D, device=device, generator=g, dtype=dtype)
    weight = torch.randn(V, D, device=device, generator=g, dtype=dtype).mul_(2.0 * D**-0.5)  # logits of std ~2
    bias = torch.randn(V, device=device, generator=g, dtype=dtype)
    targets = torch.randint(0, V, (N,), device=device, generator=g)
    c_logp = torch.randn(N, device=device, generator=g)
    c_ent = None if frozen else torch.randn(N, device=device, generator=g)

    def weighted(logp, ent, rows):
        return (c_logp[rows] * logp).sum() + ((c_ent[rows] * ent).sum() if c_ent is not None else 0.0)

    frozen_calls = []
    original = backends.head_forward_frozen_head
    monkeypatch.setattr(backends, "head_forward_frozen_head", lambda *a: frozen_calls.append(1) or original(*a))
    for leaf, trained in ((hidden, True), (weight, not frozen), (bias, not frozen)):
        leaf.requires_grad_(trained)
    head = HeadOperands(hidden, weight, targets, bias, LogitTransform(**transform))
    logp, ent = head_ops.linear_logprobs_path(head, "triton", "auto" if frozen else "general", backward_mode)
    assert len(frozen_calls) == frozen
    weighted(logp, ent, slice(None)).backward()
    logp, ent = logp.detach(), ent.detach()

    ref_weight = weight.detach().float().requires_grad_(not frozen)  # the same tensor when fp32 and frozen
    ref_bias = bias.detach().float().requires_grad_(not frozen)
    err = {"logp": 0.0, "entropy": 0.0, "hidden": 0.0}
    scale = dict.fromkeys(err, 0.0)
    for n0 in range(0, N, token_chunk):
        rows = slice(n0, n0 + token_chunk)
        h = hidden.detach()[rows].to(torch.float32, copy=True).requires_grad_()
        ref_logp, ref_ent = reference.logprobs_and_entropy(h, ref_weight, targets[rows], ref_bias, **transform)
        weighted(ref_logp, ref_ent, rows).backward()
        for name, ours, ref in (
            ("logp", logp[rows], ref_logp),
            ("entropy", ent[rows], ref_ent),
            ("hidden", hidden.grad[rows], h.grad),
        ):
            err[name] = max(err[name], (ours.float() - ref.detach()).abs().max().item())
            scale[name] = max(scale[name], ref.detach().abs().max().item())
    assert err["logp"] <= logp_atol and err["entropy"] <= logp_atol, err
    assert err["hidden"] <= grad_rtol * scale["hidden"], (err, scale)
    if not frozen:
        for name, leaf, ref in (("weight", weight, ref_weight), ("bias", bias, ref_bias)):
            assert leaf.grad.dtype == dtype
            assert _max_rel_by_rows(leaf.grad, ref.grad) < grad_rtol, name


@pytest.mark.slow
@pytest.mark.parametrize("path", ["chunked", "fused", "frozen"])
@pytest.mark.parametrize("large", list(PAST_2_31))
def test_layer1_with_tensors_past_2_31_elements_on_gpu(large, path, monkeypatch):
    # real tensors past 2^31 elements, forward and backward; the 32-bit offsets that wrapped there read and wrote
    # the wrong memory without an error
    if torch.cuda.get_device_properties(0).total_memory < 60 * 2**30:
        pytest.skip("needs 60 GiB of GPU memory (tensors of 2^31 elements in fp32 and bf16, and the reference's)")
    N, D, V = PAST_2_31[large]
    assert (V if large == "weight" else N) * D > 2**31
    # the frozen-head path's u buffer is about W's size in bytes: past 2^31 fp32 elements with an fp32 weight
    dtype = torch.float32 if (large, path) == ("weight", "frozen") else torch.bfloat16
    _layer1_matches_reference_in_token_chunks(
        N,
        D,
        V,
        dtype,
        path == "frozen",
        "cuda",
        monkeypatch,
        backward_mode="fused" if path == "fused" else "chunked",
        logp_atol=1e-3 if dtype == torch.bfloat16 else 1e-4,
        grad_rtol=GPU_TOL[dtype],
    )


# ----------------------------------------------------------------------------------------------- distillation_loss
def _cuda_pair(seed, B, T, Ds, Dt, V, dtype):
    """Student hidden, weight, bias, teacher hidden, weight (dtype) and a mask (80% ones), on CUDA."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    student_hidden = torch.randn(B, T, Ds, device="cuda", generator=g).to(dtype)
    student_weight = (torch.randn(V, Ds, device="cuda", generator=g) * 0.1).to(dtype)
    student_bias = (torch.randn(V, device="cuda", generator=g) * 0.1).to(dtype)
    teacher_hidden = torch.randn(B, T, Dt, device="cuda", generator=g).to(dtype)
    teacher_weight = (torch.randn(V, Dt, device="cuda", generator=g) * 0.1).to(dtype)
    mask = torch.rand(B, T, device="cuda", generator=g) > 0.2
    return student_hidden, student_weight, student_bias, teacher_hidden, teacher_weight, mask


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_distillation_loss_on_gpu_matches_reference(dtype, beta):
    """The fused distillation loss compiled (cuBLAS products, the record, JSD and g kernels over them, several
    chunks): loss and every student gradient against the fp64 spec on the same rounded inputs."""
    hs, ws, bs, ht, wt, mask = _cuda_pair(11, 4, 97, 264, 320, 5003, dtype)
    leaves = [x.clone().requires_grad_() for x in (hs, ws, bs)]
    loss, _, _ = grpo_fast.distillation_loss(
        leaves[0], leaves[1], ht, wt, mask, beta=beta, student_bias=leaves[2], temperature=0.9, token_chunk=128
    )
    loss.backward()
    ref_leaves = [x.detach().double().requires_grad_() for x in (hs, ws, bs)]
    div, _ = reference.divergence_and_entropy(
        ref_leaves[0], ref_leaves[1], ht.double(), wt.double(), beta=beta, student_bias=ref_leaves[2],
        temperature=0.9, compute_dtype=torch.float64,
    )  # fmt: skip
    ref_loss = div[mask].sum() / mask.sum()
    ref_loss.backward()
    assert abs(loss.item() - ref_loss.item()) <= 2e-5 * abs(ref_loss.item())
    for leaf, ref_leaf in zip(leaves, ref_leaves):
        assert leaf.grad.dtype == dtype
        assert _max_rel(leaf.grad, ref_leaf.grad) < GPU_TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_distillation_loss_step_in_a_cuda_graph_equals_eager(dtype):
    """A distillation_loss step (check_values=False, static shapes) captured in a CUDA graph and replayed on new
    values equals the eager step: no host synchronisation inside the fused path."""
    batches = [_cuda_pair(seed, 3, 61, 264, 320, 5003, dtype) for seed in (21, 22, 23)]

    def step(hs, ws, bs, ht, wt, mask):
        loss, _, _ = grpo_fast.distillation_loss(hs, ws, ht, wt, mask, beta=0.5, student_bias=bs, check_values=False)
        loss.backward()
        return loss

    for static_loss, static_grads, loss, grads in _graph_replays(step, batches, (0, 1, 2)):
        torch.testing.assert_close(static_loss.detach(), loss.detach(), rtol=1e-5, atol=1e-6)
        for got, expected in zip(static_grads, grads):
            assert _max_rel(got, expected) <= (1e-5 if dtype == torch.float32 else 1e-2)
