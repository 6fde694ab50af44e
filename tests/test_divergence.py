"""The student-teacher divergence head (grpo_fast.divergence): the spec against TRL 1.16's own divergence code,
and the fused op (torch twin, Triton kernels) against the fp64 spec, confident tokens and hard cases included."""

import functools
import math

import pytest
import torch
from helpers import non_finite_inputs

from grpo_fast import reference

F64 = torch.float64
BETAS = [0.0, 1.0, 0.5, 0.1]
# each model's transform as TRL's head takes it: (temperature, student softcap, student scale, teacher softcap,
# teacher scale)
TRANSFORMS = {
    "plain": dict(),
    "temperature": dict(temperature=0.7),
    "softcap-scale": dict(
        temperature=1.3, student_softcap=3.0, student_logit_scale=0.8, teacher_softcap=5.0, teacher_logit_scale=1.25
    ),
}


def pair_inputs(N, Ds, Dt, V, dtype=F64, bias=True, seed=0, scale=1.0):
    """(student hidden [N, Ds], weight [V, Ds], bias [V], teacher hidden [N, Dt], weight [V, Dt], bias [V])."""
    g = torch.Generator().manual_seed(seed)
    hs = torch.randn(N, Ds, generator=g, dtype=F64)
    ws = torch.randn(V, Ds, generator=g, dtype=F64) * scale / Ds**0.5 * 3
    bs = 0.5 * torch.randn(V, generator=g, dtype=F64) if bias else None
    ht = torch.randn(N, Dt, generator=g, dtype=F64)
    wt = torch.randn(V, Dt, generator=g, dtype=F64) * scale / Dt**0.5 * 3
    bt = 0.5 * torch.randn(V, generator=g, dtype=F64) if bias else None
    return tuple(x.to(dtype) if x is not None else None for x in (hs, ws, bs, ht, wt, bt))


def _trl_kwargs(kw):
    return dict(
        temperature=kw.get("temperature", 1.0),
        student_logit_scale=kw.get("student_logit_scale", 1.0),
        student_final_logit_softcapping=kw.get("student_softcap"),
        teacher_logit_scale=kw.get("teacher_logit_scale", 1.0),
        teacher_final_logit_softcapping=kw.get("teacher_softcap"),
    )


def spec_grads(inputs, beta, kw, compute_dtype=F64, grad_div=None):
    """(divergence [N], entropy [N], d student hidden, weight, bias) of sum(grad_div * divergence) by the spec."""
    hs, ws, bs, ht, wt, bt = (x.detach().clone() if x is not None else None for x in inputs)
    for x in (hs, ws, bs):
        x.requires_grad_()
    div, ent = reference.divergence_and_entropy(
        hs[None], ws, ht[None], wt, beta=beta, student_bias=bs, teacher_bias=bt, compute_dtype=compute_dtype, **kw
    )
    div, ent = div[0], ent[0]
    (div * (grad_div if grad_div is not None else 1.0)).sum().backward()
    return div.detach(), ent.detach(), hs.grad, ws.grad, bs.grad


# ----------------------------------------------------------------------------------------------- the spec vs TRL
def _trl_fold(inputs, beta, kw):
    """TRL 1.16's divergence and entropy (trl.kernels.chunked_divergence's torch tile folds and its finishing
    formulas) on fp64 logits of the whole vocabulary as one tile, and its student-logit gradient (its backward
    tile) contracted to d hidden / d weight / d bias: TRL's code at fp64, where its head runs its buffers in fp32."""
    from trl.kernels import chunked_divergence as cd

    hs, ws, bs, ht, wt, bt = inputs
    t = _trl_kwargs(kw)
    args = dict(
        s_scale=t["student_logit_scale"],
        s_softcap=t["student_final_logit_softcapping"] or 1.0,
        t_scale=t["teacher_logit_scale"],
        t_softcap=t["teacher_final_logit_softcapping"] or 1.0,
        inv_t=1 / t["temperature"],
        S_HAS_SOFTCAP=t["student_final_logit_softcapping"] is not None,
        T_HAS_SOFTCAP=t["teacher_final_logit_softcapping"] is not None,
        BLOCK_SIZE=1024,
    )
    N, V = hs.shape[0], ws.shape[0]
    s_tile, t_tile = hs @ ws.T + bs, ht @ wt.T + bt
    zeros = [torch.zeros(N, dtype=F64) for _ in range(9)]
    s_max, t_max = zeros[0] - math.inf, zeros[1] - math.inf
    s_sum, s_x_sum, t_sum, t_gap, s_gap, jsd, kl_student = zeros[2:]
    cd._stats_tile(s_tile, V, t_tile, V, s_max, s_sum, s_x_sum, t_max, t_sum, t_gap, s_gap, V, **args)
    s_log_z, t_log_z = s_max + torch.log(s_sum), t_max + torch.log(t_sum)
    if 0.0 < beta < 1.0:
        cd._jsd_tile(s_tile, V, t_tile, V, s_log_z, t_log_z, jsd, kl_student, V, beta, **args)
    # ChunkedDivergenceFunction.forward's finishing lines
    entropy = s_log_z - s_x_sum / s_sum
    if beta == 0.0:
        div = aux = t_gap / t_sum - t_log_z + s_log_z
    elif beta == 1.0:
        div = aux = s_gap / s_sum - s_log_z + t_log_z
    else:
        div, aux = jsd, kl_student
    grad_tile = s_tile.clone()
    cd._backward_tile(
        grad_tile,
        V,
        t_tile,
        V,
        s_log_z,
        t_log_z,
        aux,
        torch.ones(N, dtype=F64),
        V,
        beta,
        MODE=0 if beta == 0.0 else 1 if beta == 1.0 else 2,
        **args,
    )
    return div, entropy, grad_tile @ ws, grad_tile.T @ hs, grad_tile.sum(0)


@pytest.mark.parametrize("transform", TRANSFORMS, ids=list(TRANSFORMS))
@pytest.mark.parametrize("beta", BETAS)
def test_spec_equals_trl_fold_fp64(beta, transform):
    """The spec's beta convention, transform order, divergence, entropy and student gradients are TRL's, at fp64."""
    kw = TRANSFORMS[transform]
    inputs = pair_inputs(13, 11, 17, 53)
    expected = _trl_fold(inputs, beta, kw)
    actual = spec_grads(inputs, beta, kw)
    for name, a, e in zip(("divergence", "entropy", "d hidden", "d weight", "d bias"), actual, expected):
        torch.testing.assert_close(a, e, rtol=1e-10, atol=1e-12, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("beta", BETAS)
def test_spec_equals_trl_head_fp32(beta):
    """TRL's ChunkedDivergenceFunction itself (its CPU path: fp32 tiles) against the spec at fp32-logit precision:
    divergence, entropy and the student's gradients (its entropy has none; its teacher gets none)."""
    from trl.kernels.chunked_divergence import ChunkedDivergenceFunction

    kw = TRANSFORMS["softcap-scale"]
    inputs = pair_inputs(9, 24, 40, 301, dtype=torch.float32)
    leaves = [x.detach().clone().requires_grad_(i < 3) for i, x in enumerate(inputs)]
    div, ent = ChunkedDivergenceFunction.apply(*leaves[:3], *leaves[3:], beta, *_trl_kwargs(kw).values())
    div.sum().backward()
    assert not ent.requires_grad
    expected = spec_grads(tuple(x.to(F64) for x in inputs), beta, kw)
    for name, a, e in zip(
        ("divergence", "entropy", "d hidden", "d weight", "d bias"),
        (div, ent) + tuple(x.grad for x in leaves[:3]),
        expected,
    ):
        err = (a.double() - e).abs().max().item()
        assert err <= 2e-5 * e.abs().max().item() + 1e-7, f"{name}: {err:.3g}"


# ----------------------------------------------------------------------------------------------- hard batches
def _rest_mass(h, w, b, y, transform):
    """1 - p_y per row, fp64, from the full logits."""
    z = transform.apply(h @ w.T + b)
    return -torch.expm1(torch.log_softmax(z, dim=-1).gather(1, y[:, None]).squeeze(1))


def confident_pair(
    N, Ds, Dt, V, kw, confident=("student", "teacher"), dtype=torch.float32, seed=0, rest_range=(1e-6, 1e-3)
):
    """pair_inputs' six tensors where each model named in ``confident`` puts 1 - p_y log-uniformly in
    ``rest_range`` on one token y per row (the same y for both): h = alpha (W_y + noise), alpha by bisection in
    fp64. The other model, if any, stays ordinary."""
    return _confident_pair(N, Ds, Dt, V, tuple(sorted(kw.items())), tuple(confident), dtype, seed, rest_range)


@functools.cache
def _confident_pair(N, Ds, Dt, V, kw, confident, dtype, seed, rest_range):
    from grpo_fast.head.transform import LogitTransform

    kw = dict(kw)
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, V, (N,), generator=g)
    out = []
    for model, D in (("student", Ds), ("teacher", Dt)):
        w = torch.randn(V, D, generator=g, dtype=F64)
        w = w / w.norm(dim=1, keepdim=True)
        b = 0.3 * torch.randn(V, generator=g, dtype=F64)
        direction = w[y] + 0.1 * torch.randn(N, D, generator=g, dtype=F64) / D**0.5
        transform = LogitTransform(
            kw.get("temperature", 1.0), kw.get(f"{model}_softcap"), kw.get(f"{model}_logit_scale", 1.0)
        )
        if model in confident:
            goal = torch.exp(torch.empty(N, dtype=F64).uniform_(*map(math.log, rest_range), generator=g))
            softcap = kw.get(f"{model}_softcap")
            top = softcap / kw.get(f"{model}_logit_scale", 1.0) if softcap is not None else 400.0
            lo, hi = torch.zeros(N, dtype=F64), torch.full((N,), top, dtype=F64)
            for _ in range(60):
                mid = (lo + hi) / 2
                unsure = _rest_mass(mid[:, None] * direction, w, b, y, transform) > goal
                lo, hi = torch.where(unsure, mid, lo), torch.where(unsure, hi, mid)
            h = hi[:, None] * direction
        else:
            h = direction * D**0.5 * 0.3
        out += [h, w, b]
    return tuple(x.to(dtype) for x in out)


def relative_errors(actual, expected):
    """max |actual - expected| / max |expected| of each pair."""
    return [((a.double() - e.double()).abs().max() / e.double().abs().max()).item() for a, e in zip(actual, expected)]


def ours(inputs, beta, kw, backend, requires=(0, 1, 2), mask=None, grad_div=None, head_path="auto"):
    """(divergence [N], entropy [N], d student hidden, weight, bias) of sum(grad_div * divergence) by
    grpo_fast.divergence_and_entropy on ``backend``, rows as one sequence [1, N]."""
    import grpo_fast

    leaves = [x.detach().clone().requires_grad_(i in requires) if x is not None else None for i, x in enumerate(inputs)]
    div, ent = grpo_fast.divergence_and_entropy(
        leaves[0][None],
        leaves[1],
        leaves[3][None],
        leaves[4],
        mask,
        beta=beta,
        student_bias=leaves[2],
        teacher_bias=leaves[5],
        backend=backend,
        head_path=head_path,
        **kw,
    )
    if any(leaves[i].requires_grad for i in (0, 1, 2)):
        (div[0] * (grad_div if grad_div is not None else 1.0)).sum().backward()
    return (div[0].detach(), ent[0]) + tuple(leaves[i].grad for i in (0, 1, 2)), leaves


def trl_head(inputs, beta, kw):
    """TRL 1.16's ChunkedDivergenceFunction (its CPU path) on the same inputs: the same five values as ``ours``."""
    from trl.kernels.chunked_divergence import ChunkedDivergenceFunction

    leaves = [x.detach().clone().requires_grad_(i < 3) for i, x in enumerate(inputs)]
    div, ent = ChunkedDivergenceFunction.apply(*leaves[:3], *leaves[3:], beta, *_trl_kwargs(kw).values())
    div.sum().backward()
    return (div.detach(), ent) + tuple(x.grad for x in leaves[:3])


# ----------------------------------------------------------------------------------------------- the op vs the spec
BACKENDS = ["torch", "triton"]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# max |error| / max |fp64 value| of the divergence and of each student gradient, by input dtype. fp32: as exact as
# fp32 logits allow. bf16 / fp16: the spec runs on the same rounded inputs, so the divergence keeps fp32
# accumulation's precision; the gradients come back in the input dtype (and the Triton backward rounds g to it for
# the GEMMs): 2^-8 / 2^-11 relative per entry
DIV_TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-5, torch.float16: 2e-5}
GRAD_TOL = {torch.float32: 2e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}


@pytest.fixture(autouse=True)
def _small_torch_chunks(monkeypatch):
    """The torch twin's chunks smaller than the test shapes, so that its records merge over tokens and vocabulary."""
    from grpo_fast.backends import divergence_twin as torch_twin

    monkeypatch.setattr(torch_twin, "CHUNK_N", 16)
    monkeypatch.setattr(torch_twin, "CHUNK_V", 48)


def on(backend, device, inputs):
    # conftest.backend_device, not imported: spawned workers (test_divergence_parallel.py) import this module where
    # 'conftest' can name tests/verl_env's
    dev = device if backend == "triton" else torch.device("cpu")
    return tuple(x.to(dev) if x is not None else None for x in inputs)


def check_against_spec(inputs, beta, kw, backend, device, dtype, mask=None, grad_div=None, div_tol=None, grad_tol=None):
    """ours (on ``backend``, inputs rounded to ``dtype``) against the fp64 spec on the same rounded inputs:
    divergence, entropy and every student gradient; the teacher gets no gradient."""
    rounded = tuple(x.to(dtype) if x is not None else None for x in inputs)
    spec_grad_div = torch.ones(rounded[0].shape[0], dtype=F64) if grad_div is None else grad_div.to(F64)
    if mask is not None:  # masked tokens: no value, no gradient
        spec_grad_div = spec_grad_div * mask.reshape(-1)
    expected = spec_grads(
        tuple(x.to(F64) if x is not None else None for x in rounded), beta, kw, grad_div=spec_grad_div
    )
    if mask is not None:
        keep = mask.reshape(-1).to(F64)
        expected = (expected[0] * keep, expected[1] * keep) + expected[2:]
    actual, leaves = ours(
        on(backend, device, rounded),
        beta,
        kw,
        backend,
        requires=(0, 1, 2, 3, 4, 5),
        mask=None
        if mask is None
        else mask.to(rounded[0].device if backend == "torch" else on(backend, device, (mask,))[0].device)[None],
        grad_div=None if grad_div is None else on(backend, device, (grad_div,))[0],
    )
    assert all(leaves[i].grad is None for i in (3, 4, 5)), "the teacher got a gradient"
    names = ("divergence", "entropy", "d student_hidden", "d student_weight", "d student_bias")
    tols = (div_tol or DIV_TOL[dtype],) * 2 + (grad_tol or GRAD_TOL[dtype],) * 3
    for name, a, e, tol in zip(names, actual, expected, tols):
        assert a.dtype == (torch.float32 if name in names[:2] else dtype), name
        err = ((a.cpu().double() - e).abs().max() / e.abs().max()).item()
        assert err <= tol, f"{name}: {err:.3g} of max > {tol}"
    return actual


@pytest.mark.parametrize("transform", TRANSFORMS, ids=list(TRANSFORMS))
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("beta", BETAS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_matches_spec(backend, beta, dtype, transform, device):
    """Odd shapes (N, V, Ds, Dt not block multiples, V not a power of two, Ds != Dt), biases, a mask."""
    inputs = pair_inputs(3 * 7, 19, 37, 101)
    mask = (torch.rand(21, generator=torch.Generator().manual_seed(1)) > 0.3).float()
    check_against_spec(inputs, beta, TRANSFORMS[transform], backend, device, dtype, mask=mask)


@pytest.mark.parametrize("confident", ["both", "student", "teacher"])
@pytest.mark.parametrize("beta", BETAS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_confident_tokens(backend, beta, confident, device):
    """1 - p from 1e-6 to 1e-3 for either model or both: fp32 divergence and student gradients within 2e-5 of
    their max against fp64 (no 1 - p formed by subtraction)."""
    kw = TRANSFORMS["softcap-scale"] if confident == "both" else TRANSFORMS["temperature"]
    models = ("student", "teacher") if confident == "both" else (confident,)
    inputs = confident_pair(
        24,
        32,
        48,
        211,
        dict(kw, student_softcap=None, teacher_softcap=None)
        if confident != "both"
        else dict(kw, student_softcap=30.0, teacher_softcap=30.0),
        models,
    )
    kw = kw if confident != "both" else dict(kw, student_softcap=30.0, teacher_softcap=30.0)
    check_against_spec(inputs, beta, kw, backend, device, torch.float32)


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_confident_tokens_vs_trl_head(backend, device):
    """Every token confident in both models (1 - p = 1e-6 +- a factor 2): ours within 2e-5 of the max against fp64;
    TRL's head (its CPU path, on the same fp32 inputs) is recorded beside it (README, issue 30)."""
    kw = TRANSFORMS["temperature"]
    inputs = confident_pair(32, 32, 48, 211, kw, seed=3, rest_range=(5e-7, 2e-6))
    for beta in (0.0, 1.0, 0.5):
        actual = check_against_spec(inputs, beta, kw, backend, device, torch.float32)
        expected = spec_grads(tuple(x.to(F64) for x in inputs), beta, kw)
        trl_errors = relative_errors(trl_head(inputs, beta, kw), expected)
        ours_errors = relative_errors([x.cpu() for x in actual], expected)
        print(f"beta {beta}: ours {[f'{e:.1e}' for e in ours_errors]}, TRL {[f'{e:.1e}' for e in trl_errors]}")


@pytest.mark.parametrize("beta", BETAS)
@pytest.mark.parametrize("backend", [pytest.param("torch", marks=pytest.mark.slow), "triton"])
def test_realistic_gradient_scale(backend, beta, device):
    """dL/d divergence of 1 / tokens (1e-5: TRL's mean over a large batch) from fp16 inputs: the student gradients
    in the backward's fp32 buffers (before the cast to fp16, whose subnormals would hold them) keep fp16's relative
    precision (the Triton backward scales g by an exact power of two before rounding it for the GEMMs)."""
    from grpo_fast.backends import divergence_twin as torch_twin
    from grpo_fast.head.transform import LogitTransform
    from grpo_fast.kernels import divergence_gradient, divergence_sweep
    from grpo_fast.kernels.divergence_records import ModelHead

    kw = TRANSFORMS["softcap-scale"]
    inputs = tuple(x.to(torch.float16) for x in pair_inputs(21, 19, 37, 101))
    grad_div = torch.full((21,), 1e-5)
    expected = spec_grads(tuple(x.to(F64) for x in inputs), beta, kw, grad_div=grad_div.to(F64))
    hs, ws, bs, ht, wt, bt = on(backend, device, inputs)
    triton = (divergence_sweep.forward, divergence_gradient.backward)
    forward, backward = triton if backend == "triton" else (torch_twin.forward, torch_twin.backward)
    student = ModelHead(hs, ws, bs, LogitTransform(kw["temperature"], kw["student_softcap"], kw["student_logit_scale"]))
    teacher = ModelHead(ht, wt, bt, LogitTransform(kw["temperature"], kw["teacher_softcap"], kw["teacher_logit_scale"]))
    saved, argmax = forward(student, teacher, beta)[2:4]
    grads = tuple(torch.zeros(x.shape, device=hs.device) for x in (hs, ws, bs))
    backward(grad_div.to(hs.device), student, teacher, saved, argmax, beta, grads)
    for name, a, e in zip(("d hidden", "d weight", "d bias"), grads, expected[2:]):
        err = ((a.cpu().double() - e).abs().max() / e.abs().max()).item()
        assert err <= GRAD_TOL[torch.float16], f"{name}: {err:.3g}"


@pytest.mark.parametrize("beta", BETAS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_saturated_softcap_and_infinite_bias(backend, beta, device):
    """Soft-caps that saturate (|logit| 40 x the cap) and -inf bias entries shared by both models (a padded
    vocabulary: those entries add nothing)."""
    hs, ws, bs, ht, wt, bt = pair_inputs(21, 19, 37, 101, scale=8.0)
    padded = torch.zeros(101, dtype=torch.bool)
    padded[[0, 17, 50, 100]] = True
    bs, bt = bs.masked_fill(padded, -math.inf), bt.masked_fill(padded, -math.inf)
    kw = dict(temperature=0.8, student_softcap=2.0, teacher_softcap=1.5, teacher_logit_scale=2.0)
    div = check_against_spec((hs, ws, bs, ht, wt, bt), beta, kw, backend, device, torch.float32)[0]
    assert bool(torch.isfinite(div).all())


@pytest.mark.parametrize("backend", BACKENDS)
def test_unsupported_entries_give_infinite_kl(backend, device):
    """A teacher entry of -inf where the student has mass makes KL(s || t) +inf (and a student -inf where the
    teacher has mass KL(t || s)), as the spec; the JSD stays finite."""
    hs, ws, bs, ht, wt, bt = on(backend, device, pair_inputs(5, 8, 8, 37, dtype=torch.float32))
    import grpo_fast

    kill = torch.zeros(37, dtype=torch.bool, device=bs.device)
    kill[3] = True
    with non_finite_inputs():  # -inf logits where the other model has mass, on purpose
        for beta, student_bias, teacher_bias in (
            (1.0, bs, bt.masked_fill(kill, -math.inf)),
            (0.0, bs.masked_fill(kill, -math.inf), bt),
        ):
            div = grpo_fast.divergence(
                hs[None],
                ws,
                ht[None],
                wt,
                beta=beta,
                student_bias=student_bias,
                teacher_bias=teacher_bias,
                backend=backend,
            )
            assert bool((div == math.inf).all())
        div = grpo_fast.divergence(
            hs[None],
            ws,
            ht[None],
            wt,
            beta=0.5,
            student_bias=bs,
            teacher_bias=bt.masked_fill(kill, -math.inf),
            backend=backend,
        )
    assert bool(torch.isfinite(div).all())


@pytest.mark.parametrize("beta", BETAS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_nan_in_masked_rows_changes_nothing(backend, beta, device):
    """NaN hidden states at masked positions (both models): outputs and gradients bit-identical to zeros there,
    masked outputs and gradient rows exactly 0; a NaN at a scored token reaches its divergence and the gradients."""
    import grpo_fast

    hs, ws, bs, ht, wt, bt = on(backend, device, pair_inputs(12, 19, 37, 101, dtype=torch.float32))
    mask = torch.ones(2, 6, device=hs.device)
    mask[0, 2:4] = 0
    mask[1, 5] = 0
    masked = mask.reshape(-1) == 0

    def run(hs, ht, mask):
        leaves = [x.detach().clone().requires_grad_() for x in (hs, ws, bs)]
        div, ent = grpo_fast.divergence_and_entropy(
            leaves[0].view(2, 6, -1),
            leaves[1],
            ht.view(2, 6, -1),
            wt,
            mask,
            beta=beta,
            student_bias=leaves[2],
            teacher_bias=bt,
            backend=backend,
        )
        div.sum().backward()
        return (div, ent) + tuple(x.grad for x in leaves)

    clean = run(hs.masked_fill(masked[:, None], 0.0), ht.masked_fill(masked[:, None], 0.0), mask)
    dirty = run(hs.masked_fill(masked[:, None], math.nan), ht.masked_fill(masked[:, None], math.nan), mask)
    for a, b in zip(clean, dirty):
        assert torch.equal(a, b)
    assert bool((clean[0].reshape(-1)[masked] == 0).all()) and bool((clean[2][masked] == 0).all())
    with non_finite_inputs():
        poisoned = run(hs.index_fill(0, torch.tensor([7], device=hs.device), math.nan), ht, mask)
    assert bool(poisoned[0].reshape(-1)[7].isnan()) and bool(poisoned[3].isnan().any())
    assert bool(torch.isfinite(poisoned[0].reshape(-1)[:7]).all())


@pytest.mark.parametrize("backend", BACKENDS)
def test_one_token_rows_and_all_masked(backend, device):
    """[B, 1] sequences; every position masked: zeros, zero gradients (nothing computed)."""
    import grpo_fast

    inputs = pair_inputs(4, 19, 37, 101)
    check_against_spec(inputs, 1.0, {}, backend, device, torch.float32)
    hs, ws, bs, ht, wt, bt = on(backend, device, tuple(x.float() for x in inputs))
    hs, ws = hs.requires_grad_(), ws.requires_grad_()
    div, ent = grpo_fast.divergence_and_entropy(
        hs.view(4, 1, -1), ws, ht.view(4, 1, -1), wt, torch.zeros(4, 1, device=hs.device), beta=0.5, backend=backend
    )
    div.sum().backward()
    assert div.shape == ent.shape == (4, 1) and not bool(div.any()) and not bool(ent.any())
    assert not bool(hs.grad.any()) and not bool(ws.grad.any())


def test_named_errors():
    import grpo_fast

    hs, ws, _, ht, wt, _ = (x.float() if x is not None else None for x in pair_inputs(6, 8, 12, 31, bias=False))
    hs, ht = hs.view(2, 3, 8), ht.view(2, 3, 12)
    with pytest.raises(ValueError, match="student_weight has V = 31 rows but teacher_weight has V = 30"):
        grpo_fast.divergence(hs, ws, ht, wt[:30])
    with pytest.raises(TypeError, match="teacher_weight dtype"):
        grpo_fast.divergence(hs, ws, ht, wt.half())
    with pytest.raises(
        ValueError,
        match=r"student_hidden has D = 8 but student_weight has shape \(31, 7\): student_hidden's last dimension "
        "must equal student_weight's second",
    ):
        grpo_fast.divergence(hs, ws[:, :7], ht, wt)
    with pytest.raises(ValueError, match="teacher_hidden's"):
        grpo_fast.divergence(hs, ws, ht[:, :2], wt)
    with pytest.raises(ValueError, match="beta must be a number in"):
        grpo_fast.divergence(hs, ws, ht, wt, beta=1.5)
    with pytest.raises(ValueError, match="temperature"):
        grpo_fast.divergence(hs, ws, ht, wt, temperature=0.0)
    with pytest.raises(ValueError, match="teacher_softcap"):
        grpo_fast.divergence(hs, ws, ht, wt, teacher_softcap=-1.0)
    with pytest.raises(ValueError, match="completion_mask must have shape"):
        grpo_fast.divergence(hs, ws, ht, wt, torch.ones(2, 4))
    with pytest.raises(ValueError, match="on meta"):
        grpo_fast.divergence(hs, ws, ht.to("meta"), wt)
    with pytest.raises(ValueError, match="backend must be one of"):
        grpo_fast.divergence(hs, ws, ht, wt, backend="cuda")


@pytest.mark.slow
def test_op_registration():
    """The custom ops pass torch.library.opcheck (schema, fake implementation, autograd registration)."""
    from grpo_fast.distillation.ops import _forward_op

    hs, ws, bs, ht, wt, bt = (x.float() for x in pair_inputs(5, 8, 12, 31))
    for frozen in (False, True):
        torch.library.opcheck(
            _forward_op,
            (
                hs.detach().requires_grad_(),
                ws.detach().requires_grad_(not frozen),
                bs,
                ht,
                wt,
                bt,
                0.5,
                0.9,
                None,
                1.0,
                2.0,
                1.0,
                "torch",
                torch.bfloat16,
                frozen,
            ),
        )


@pytest.mark.parametrize("confident", ["none", "both"])
@pytest.mark.parametrize("beta", BETAS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_frozen_student_head(backend, beta, confident, device):
    """Only student_hidden requires a gradient (LoRA, a frozen lm_head): the forward builds d div / d h, the
    backward is dH = c J; equal to the fp64 spec (confident tokens too) and to the general path."""
    kw = TRANSFORMS["softcap-scale"]
    inputs = (
        pair_inputs(21, 19, 37, 101, dtype=torch.float32)
        if confident == "none"
        else confident_pair(24, 32, 48, 211, dict(kw, student_softcap=30.0, teacher_softcap=30.0))
    )
    kw = kw if confident == "none" else dict(kw, student_softcap=30.0, teacher_softcap=30.0)
    grad_div = torch.linspace(0.5, 2.0, inputs[0].shape[0])
    expected = spec_grads(tuple(x.to(F64) for x in inputs), beta, kw, grad_div=grad_div.to(F64))
    frozen, _ = ours(
        on(backend, device, inputs), beta, kw, backend, requires=(0,), grad_div=on(backend, device, (grad_div,))[0]
    )
    general, _ = ours(
        on(backend, device, inputs),
        beta,
        kw,
        backend,
        requires=(0,),
        head_path="general",
        grad_div=on(backend, device, (grad_div,))[0],
    )
    for name, a, e in zip(("divergence", "entropy", "d hidden"), frozen[:3], expected[:3]):
        err = ((a.cpu().double() - e).abs().max() / e.abs().max()).item()
        assert err <= 2e-5, f"{name}: {err:.3g}"
    torch.testing.assert_close(frozen[0], general[0])  # the frozen forward is the torch twin on every backend
    torch.testing.assert_close(frozen[2], general[2], rtol=1e-4, atol=1e-4 * general[2].abs().max().item())


@pytest.mark.parametrize("head_path", ["general", "frozen"])
@pytest.mark.parametrize("beta", [0.0, 0.5])
@pytest.mark.parametrize("backend", BACKENDS)
def test_student_gemm_dtype_rounds_only_the_gemm_operands(backend, beta, head_path, device):
    """fp32 student tensors with student_gemm_dtype=bf16 (autocast over an fp32 model, as TRL's head computes): the
    divergence and entropy are the bf16-rounded student's, bit for bit; the gradients come back fp32, from the fp32
    accumulators, not rounded to bf16. Against the fp64 spec on the rounded inputs: the torch twin and the frozen
    head's J (fp32 GEMMs) within 2e-5 of max, where a bf16 gradient is off by up to 2^-8; the Triton backward
    rounds g to bf16 for its GEMMs (as TRL's head does), within bf16's bound."""
    import grpo_fast

    kw = TRANSFORMS["softcap-scale"]
    inputs = on(backend, device, pair_inputs(21, 19, 37, 101, dtype=torch.float32))
    rounded = tuple(x.to(torch.bfloat16) if i in (0, 1) else x for i, x in enumerate(inputs))
    requires = (0,) if head_path == "frozen" else (0, 1, 2)

    def call(leaves, **extra):
        hs, ws, bs, ht, wt, bt = leaves
        return grpo_fast.divergence_and_entropy(
            hs[None], ws, ht[None], wt, beta=beta, student_bias=bs, teacher_bias=bt, backend=backend, **kw, **extra
        )

    leaves = [x.detach().clone().requires_grad_(i in requires) for i, x in enumerate(inputs)]
    div, ent = call(leaves, student_gemm_dtype=torch.bfloat16)
    div[0].sum().backward()
    rounded_leaves = [x.detach().clone().requires_grad_(i in requires) for i, x in enumerate(rounded)]  # one path
    reference_div, reference_ent = call(rounded_leaves)
    assert torch.equal(div, reference_div) and torch.equal(ent, reference_ent)
    expected = spec_grads(tuple(x.cpu().to(F64) for x in rounded), beta, kw)[2:]  # the spec on CPU
    tol = 1e-2 if backend == "triton" and head_path == "general" else 2e-5
    for i in requires:
        assert leaves[i].grad.dtype == torch.float32
        err = relative_errors([leaves[i].grad.cpu()], [expected[i]])[0]
        assert err <= tol, f"gradient {i}: {err:.3g} of max > {tol}"
    with pytest.raises(TypeError, match="student_gemm_dtype must be"):
        grpo_fast.divergence(leaves[0][None], leaves[1], leaves[3][None], leaves[4], student_gemm_dtype=torch.int8)


@pytest.mark.parametrize("beta", [pytest.param(0.0, marks=pytest.mark.slow), 1.0, 0.5])
def test_vocabulary_sweep_flops(beta):
    """The matmul FLOPs of the torch twin (forward + backward), counted by FlopCounterMode, are docs/api.md's table:
    with a trainable head those of TRL 1.16's ChunkedDivergenceFunction (projections of both models: forward 1
    sweep, 2 for the JSD; backward 1; dH and dW), with a frozen one (only hidden needs a gradient) one sweep of the
    teacher fewer (beta 0, 1: 2 N V (3 Ds + Dt) against TRL's 2 N V (3 Ds + 2 Dt); JSD: 2 N V (4 Ds + 2 Dt)
    against 2 N V (4 Ds + 3 Dt))."""
    from helpers import matmul_flops

    from grpo_fast.backends import divergence_twin as torch_twin
    from grpo_fast.head.transform import LogitTransform
    from grpo_fast.kernels.divergence_records import ModelHead

    N, Ds, Dt, V = 21, 19, 37, 101
    hs, ws, bs, ht, wt, bt = pair_inputs(N, Ds, Dt, V, dtype=torch.float32)
    student, teacher = ModelHead(hs, ws, bs, LogitTransform()), ModelHead(ht, wt, bt, LogitTransform())

    def trainable():  # the op's forward and backward (custom ops hide their insides from FlopCounterMode)
        _, _, saved, argmax, _ = torch_twin.forward(student, teacher, beta)
        grads = (torch.zeros(N, Ds), torch.zeros(V, Ds), torch.zeros(V))
        torch_twin.backward(torch.ones(N), student, teacher, saved, argmax, beta, grads)

    def frozen():  # the backward is then dH = c J: no matmul
        torch_twin.forward(student, teacher, beta, frozen_head=True)

    sweep = 2 * N * V * (Ds + Dt)  # one projection of each model
    gemm = 2 * N * V * Ds  # one student-sized GEMM (dH, dW, or a frozen-head accumulator)
    forward_sweeps = 2 if 0.0 < beta < 1.0 else 1
    trl_trainable = (forward_sweeps + 1) * sweep + 2 * gemm
    trl_frozen = (forward_sweeps + 1) * sweep + gemm
    assert matmul_flops(trainable) == trl_trainable
    assert matmul_flops(frozen) == forward_sweeps * sweep + 2 * gemm == trl_frozen - 2 * N * V * Dt
