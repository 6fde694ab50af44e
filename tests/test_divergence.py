"""The student-teacher divergence head (grpo_fast.divergence): the spec against TRL 1.16's own divergence code,
and the fused op (torch twin, Triton kernels) against the fp64 spec, confident tokens and hard cases included."""

import math

import pytest
import torch

from grpo_fast import reference

F64 = torch.float64
BETAS = [0.0, 1.0, 0.5, 0.1]
# each model's transform as TRL's head takes it: (temperature, student softcap, student scale, teacher softcap,
# teacher scale)
TRANSFORMS = {
    "plain": dict(),
    "temperature": dict(temperature=0.7),
    "softcap-scale": dict(temperature=1.3, student_softcap=3.0, student_logit_scale=0.8, teacher_softcap=5.0,
                          teacher_logit_scale=1.25),
}


def pair_inputs(N, Ds, Dt, V, dtype=F64, bias=True, seed=0, scale=1.0):
    """(student hidden [N, Ds], weight [V, Ds], bias [V], teacher hidden [N, Dt], weight [V, Dt], bias [V])."""
    g = torch.Generator().manual_seed(seed)
    hs = torch.randn(N, Ds, generator=g, dtype=F64)
    ws = torch.randn(V, Ds, generator=g, dtype=F64) * scale / Ds ** 0.5 * 3
    bs = 0.5 * torch.randn(V, generator=g, dtype=F64) if bias else None
    ht = torch.randn(N, Dt, generator=g, dtype=F64)
    wt = torch.randn(V, Dt, generator=g, dtype=F64) * scale / Dt ** 0.5 * 3
    bt = 0.5 * torch.randn(V, generator=g, dtype=F64) if bias else None
    return tuple(x.to(dtype) if x is not None else None for x in (hs, ws, bs, ht, wt, bt))


def _trl_kwargs(kw):
    return dict(temperature=kw.get("temperature", 1.0), student_logit_scale=kw.get("student_logit_scale", 1.0),
                student_final_logit_softcapping=kw.get("student_softcap"),
                teacher_logit_scale=kw.get("teacher_logit_scale", 1.0),
                teacher_final_logit_softcapping=kw.get("teacher_softcap"))


def spec_grads(inputs, beta, kw, compute_dtype=F64, grad_div=None):
    """(divergence [N], entropy [N], d student hidden, weight, bias) of sum(grad_div * divergence) by the spec."""
    hs, ws, bs, ht, wt, bt = (x.detach().clone() if x is not None else None for x in inputs)
    for x in (hs, ws, bs):
        x.requires_grad_()
    div, ent = reference.divergence_and_entropy(hs[None], ws, ht[None], wt, beta=beta, student_bias=bs,
                                                teacher_bias=bt, compute_dtype=compute_dtype, **kw)
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
    args = dict(s_scale=t["student_logit_scale"], s_softcap=t["student_final_logit_softcapping"] or 1.0,
                t_scale=t["teacher_logit_scale"], t_softcap=t["teacher_final_logit_softcapping"] or 1.0,
                inv_t=1 / t["temperature"], S_HAS_SOFTCAP=t["student_final_logit_softcapping"] is not None,
                T_HAS_SOFTCAP=t["teacher_final_logit_softcapping"] is not None, BLOCK_SIZE=1024)
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
    cd._backward_tile(grad_tile, V, t_tile, V, s_log_z, t_log_z, aux, torch.ones(N, dtype=F64), V, beta,
                      MODE=0 if beta == 0.0 else 1 if beta == 1.0 else 2, **args)
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
        torch.testing.assert_close(a, e, rtol=1e-10, atol=1e-12, msg=lambda m: f"{name}: {m}")


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
    for name, a, e in zip(("divergence", "entropy", "d hidden", "d weight", "d bias"),
                          (div, ent) + tuple(x.grad for x in leaves[:3]), expected):
        err = (a.double() - e).abs().max().item()
        assert err <= 2e-5 * e.abs().max().item() + 1e-7, f"{name}: {err:.3g}"


# ----------------------------------------------------------------------------------------------- hard batches
def _rest_mass(h, w, b, y, transform):
    """1 - p_y per row, fp64, from the full logits."""
    z = transform.apply(h @ w.T + b)
    return -torch.expm1(torch.log_softmax(z, dim=-1).gather(1, y[:, None]).squeeze(1))


def confident_pair(N, Ds, Dt, V, kw, confident=("student", "teacher"), dtype=torch.float32, seed=0):
    """pair_inputs' six tensors where each model named in ``confident`` puts 1 - p_y log-uniformly in [1e-6, 1e-3]
    on one token y per row (the same y for both): h = alpha (W_y + noise), alpha by bisection in fp64. The other
    model, if any, stays ordinary (alpha 1)."""
    from grpo_fast.kernels.config import LogitTransform

    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, V, (N,), generator=g)
    out = []
    for model, D in (("student", Ds), ("teacher", Dt)):
        w = torch.randn(V, D, generator=g, dtype=F64)
        w = w / w.norm(dim=1, keepdim=True)
        b = 0.3 * torch.randn(V, generator=g, dtype=F64)
        direction = w[y] + 0.1 * torch.randn(N, D, generator=g, dtype=F64) / D ** 0.5
        transform = LogitTransform(kw.get("temperature", 1.0), kw.get(f"{model}_softcap"),
                                   kw.get(f"{model}_logit_scale", 1.0))
        if model in confident:
            goal = torch.exp(torch.empty(N, dtype=F64).uniform_(math.log(1e-6), math.log(1e-3), generator=g))
            softcap = kw.get(f"{model}_softcap")
            top = softcap / kw.get(f"{model}_logit_scale", 1.0) if softcap is not None else 400.0
            lo, hi = torch.zeros(N, dtype=F64), torch.full((N,), top, dtype=F64)
            for _ in range(60):
                mid = (lo + hi) / 2
                unsure = _rest_mass(mid[:, None] * direction, w, b, y, transform) > goal
                lo, hi = torch.where(unsure, mid, lo), torch.where(unsure, hi, mid)
            h = hi[:, None] * direction
        else:
            h = direction * D ** 0.5 * 0.3
        out += [h, w, b]
    return tuple(x.to(dtype) for x in out)


def relative_errors(actual, expected):
    """max |actual - expected| / max |expected| of each pair."""
    return [((a.double() - e.double()).abs().max() / e.double().abs().max()).item() for a, e in zip(actual, expected)]


def ours(inputs, beta, kw, backend, requires=(0, 1, 2), mask=None, grad_div=None):
    """(divergence [N], entropy [N], d student hidden, weight, bias) of sum(grad_div * divergence) by
    grpo_fast.divergence_and_entropy on ``backend``, rows as one sequence [1, N]."""
    import grpo_fast

    leaves = [x.detach().clone().requires_grad_(i in requires) if x is not None else None
              for i, x in enumerate(inputs)]
    div, ent = grpo_fast.divergence_and_entropy(leaves[0][None], leaves[1], leaves[3][None], leaves[4],
                                                mask, beta=beta, student_bias=leaves[2],
                                                teacher_bias=leaves[5], backend=backend, **kw)
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
