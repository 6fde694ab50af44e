"""RL and distillation in one call: grpo_fast.loss(..., teacher=grpo_fast.Teacher(...), distillation_coef=...)
against the sum of the two separate calls (loss, metrics, every student gradient) and against the fp64 spec
(grpo_fast.reference.loss_with_teacher), its vocabulary sweeps against the separate calls', and bad input."""

import pytest
import torch
from conftest import assert_grad_close, backend_device
from helpers import make_batch, matmul_flops

import grpo_fast
from grpo_fast import reference
from grpo_fast.grpo_loss.options import LossOptions

F64 = torch.float64
DT = 29  # the teacher's hidden size (the student's: make_batch's D = 37)
COEF = 0.3


def _batch(dtype=torch.float32, seed=0, B=3, T=7, V=203, device="cpu"):
    """make_batch's (a fully masked sequence) with a one-token completion in the last row, and a teacher whose
    logits track the student's loosely (a soft-capped head of its own); built on CPU (the same numbers on every
    device), on ``device``."""
    batch = make_batch(B=B, T=T, V=V, dtype=dtype, bias=True, seed=seed)
    batch["mask"][B - 1] = False
    batch["mask"][B - 1, T // 2] = True
    g = torch.Generator().manual_seed(seed + 1)
    batch["teacher"] = grpo_fast.Teacher(
        (torch.randn(B, T, DT, generator=g)).to(dtype),
        (torch.randn(V, DT, generator=g) * 0.4).to(dtype),
        bias=(0.3 * torch.randn(V, generator=g)).to(dtype),
        softcap=6.0,
        logit_scale=0.9,
    )
    t = batch["teacher"]
    batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    batch["teacher"] = grpo_fast.Teacher(
        t.hidden.to(device), t.weight.to(device), bias=t.bias.to(device), softcap=t.softcap, logit_scale=t.logit_scale
    )
    return batch


def _leaves(batch):
    return [batch[n].detach().clone().requires_grad_() for n in ("hidden", "weight", "bias")]


def _grads(total, leaves):
    return torch.autograd.grad(total, leaves)


def _combined(batch, distillation_beta, kw, backend="torch"):
    h, w, b = _leaves(batch)
    total, metrics = grpo_fast.loss(
        h,
        w,
        batch["targets"],
        batch["advantages"],
        batch["mask"],
        bias=b,
        teacher=batch["teacher"],
        distillation_coef=COEF,
        distillation_beta=distillation_beta,
        backend=backend,
        **kw,
    )
    return total.detach(), dict(metrics), _grads(total, (h, w, b))


def _separate(batch, distillation_beta, kw, backend="torch"):
    """grpo_fast.loss without the teacher + COEF * the loss type's reduction of grpo_fast.divergence."""
    h, w, b = _leaves(batch)
    t = batch["teacher"]
    total, metrics = grpo_fast.loss(
        h, w, batch["targets"], batch["advantages"], batch["mask"], bias=b, backend=backend, **kw
    )
    div = grpo_fast.divergence(
        h,
        w,
        t.hidden,
        t.weight,
        batch["mask"],
        beta=distillation_beta,
        temperature=kw.get("temperature", 1.0),
        student_bias=b,
        teacher_bias=t.bias,
        student_softcap=kw.get("softcap"),
        teacher_softcap=t.softcap,
        student_logit_scale=kw.get("logit_scale", 1.0),
        teacher_logit_scale=t.logit_scale,
        backend=backend,
        head_path="general",
    )
    options = LossOptions.resolve(None, {k: v for k, v in kw.items() if k in LossOptions.__dataclass_fields__})
    n_items = kw.get("num_items_in_batch")
    n_items = torch.tensor(float(n_items), device=h.device) if n_items is not None else None
    total = total + COEF * options.aggregate(div, batch["mask"], n_items)
    mask = batch["mask"]
    metrics = dict(metrics, distillation_loss=div.detach()[mask].sum() / mask.sum())
    return total.detach(), metrics, _grads(total, (h, w, b))


def _assert_same(actual, expected, rtol=1e-6):
    """``rtol``: the torch twin's folds are the separate heads' (the same chunks); the Triton one derives layer 1's
    record from the divergence's (fp32 rounding of the same sums)."""
    (la, ma, ga), (le, me, ge) = actual, expected
    torch.testing.assert_close(la, le, rtol=rtol, atol=rtol / 10)
    assert set(ma) == set(me)
    for k in me:
        torch.testing.assert_close(ma[k], me[k], rtol=rtol, atol=rtol / 10, msg=lambda m, k=k: f"metric {k}: {m}")
    for name, a, e in zip(("d hidden", "d weight", "d bias"), ga, ge):
        # one summed logit gradient against two: fp32 rounding of the GEMMs' sums
        torch.testing.assert_close(
            a, e, rtol=1e-5, atol=1e-6 * e.abs().max().item(), msg=lambda m, name=name: f"{name}: {m}"
        )


CASES = {  # loss options and the student's transform, each with one importance-sampling or entropy twist
    "grpo-softcap": dict(loss_type="grpo", temperature=0.7, softcap=5.0, logit_scale=1.2),
    "dapo-num-items-is": dict(loss_type="dapo", temperature=1.3, num_items_in_batch=17, importance_weights="per-token"),
    "dr_grpo-kl": dict(loss_type="dr_grpo", beta=0.04, max_completion_length=9),
    "bnpo-entropy-bonus": dict(loss_type="bnpo", entropy_coef=0.05, temperature=0.9),
    "grpo-sequence-level": dict(loss_type="grpo", importance_sampling_level="sequence", softcap=4.0),
}
# the fast tier: the torch twin's few cases; the interpreter's (seconds each) in test_matches_the_fp64_spec's one
FAST = {("torch", "grpo-softcap", 0.5), ("torch", "dapo-num-items-is", 1.0), ("torch", "bnpo-entropy-bonus", 0.0)}


def _options(batch, case):
    kw = dict(CASES[case], old_logprobs=batch["old"], ref_logprobs=batch["ref"])
    if kw.get("importance_weights") == "per-token":
        kw["importance_weights"] = (torch.rand(batch["mask"].shape, generator=torch.Generator().manual_seed(5)) * 2).to(
            batch["mask"].device
        )
    return kw


@pytest.mark.parametrize(
    "backend, case, distillation_beta",
    [
        pytest.param(backend, case, b, marks=() if (backend, case, b) in FAST else pytest.mark.slow)
        for backend in ("torch", "triton")
        for case in CASES
        for b in (0.0, 0.5, 1.0)
    ],
)
def test_equals_the_sum_of_the_separate_calls(backend, case, distillation_beta, device):
    """loss + metrics + every student gradient = grpo_fast.loss (no teacher) + COEF * reduced grpo_fast.divergence,
    with the mean divergence over the scored tokens as metrics["distillation_loss"], on each backend (Triton: the
    interpreter on CPU)."""
    batch = _batch(device=backend_device(backend, device))
    kw = _options(batch, case)
    _assert_same(
        _combined(batch, distillation_beta, kw, backend),
        _separate(batch, distillation_beta, kw, backend),
        rtol=1e-6 if backend == "torch" else 1e-5,
    )


SPEC_FAST = {("torch", torch.float32, 1.0), ("torch", torch.float16, 1.0), ("triton", torch.bfloat16, 0.5)}


@pytest.mark.parametrize(
    "backend, dtype, distillation_beta",
    [
        pytest.param(backend, dtype, b, marks=() if (backend, dtype, b) in SPEC_FAST else pytest.mark.slow)
        for backend in ("torch", "triton")
        for dtype in (torch.float32, torch.bfloat16, torch.float16)
        for b in (0.0, 0.5, 1.0)
    ],
)
def test_matches_the_fp64_spec(backend, dtype, distillation_beta, device):
    """Against reference.loss_with_teacher in fp64 on the same (rounded) inputs, at test_api's tolerances."""
    batch = _batch(dtype=dtype, seed=2, V=131, device=backend_device(backend, device))
    kw = dict(
        loss_type="grpo",
        temperature=0.8,
        softcap=5.0,
        beta=0.04,
        entropy_coef=0.02,
        old_logprobs=batch["old"],
        ref_logprobs=batch["ref"],
    )
    loss, metrics, grads = _combined(batch, distillation_beta, kw, backend)
    t = batch["teacher"]
    # the spec on fp32 copies of the same rounded inputs, computing in fp64 (as test_api's)
    h, w, b = (x.detach().float().requires_grad_() for x in (batch["hidden"], batch["weight"], batch["bias"]))
    spec, spec_metrics = reference.loss_with_teacher(
        h,
        w,
        batch["targets"],
        batch["advantages"],
        batch["mask"],
        t.hidden.float(),
        t.weight.float(),
        bias=b,
        distillation_coef=COEF,
        distillation_beta=distillation_beta,
        teacher_bias=t.bias.float(),
        teacher_softcap=t.softcap,
        teacher_logit_scale=t.logit_scale,
        compute_dtype=F64,
        **kw,
    )
    spec_grads = torch.autograd.grad(spec, (h, w, b))
    torch.testing.assert_close(loss, spec.float(), rtol=1e-4, atol=1e-5)
    assert set(metrics) == set(spec_metrics)
    for k in spec_metrics:
        torch.testing.assert_close(
            metrics[k], spec_metrics[k].float(), rtol=1e-4, atol=1e-5, msg=lambda m, k=k: f"metric {k}: {m}"
        )
    for name, a, e in zip(("hidden", "weight", "bias"), grads, spec_grads):
        assert_grad_close(a, e, dtype, f"d{name}")


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=pytest.mark.slow)])
def test_a_nan_in_a_masked_row_changes_nothing(backend, device):
    """Row 1 is fully masked: NaN hidden states there (student's and teacher's) leave loss, metrics and gradients
    as they were."""
    batch = _batch(device=backend_device(backend, device))
    kw = _options(batch, "grpo-softcap")
    clean = _combined(batch, 0.5, kw, backend)
    batch["hidden"][1] = float("nan")
    t = batch["teacher"]
    t.hidden[1] = float("nan")
    dirty = _combined(batch, 0.5, kw, backend)
    torch.testing.assert_close(dirty[0], clean[0], rtol=0, atol=0)
    for k in clean[1]:
        torch.testing.assert_close(dirty[1][k], clean[1][k], rtol=0, atol=0)
    for a, e in zip(dirty[2], clean[2]):
        torch.testing.assert_close(a, e, rtol=0, atol=0)


@pytest.mark.parametrize("distillation_beta", [1.0, pytest.param(0.5, marks=pytest.mark.slow)])
def test_fewer_student_sweeps_than_the_separate_calls(distillation_beta):
    """The matmul FLOPs (FlopCounterMode; the ops run inline under it) of forward + backward: the combined call
    projects the student once per sweep for both terms and does one dH and one dW, so it saves the separate calls'
    layer-1 forward and recompute projections and their dH and dW: four student GEMMs, 4 * 2 N V Ds."""
    batch = _batch(B=4, T=16)  # 64 tokens: whole blocks of token rows (gemm.mm_token_rows pads a last partial one)
    batch["mask"][:] = True
    kw = dict(loss_type="grpo", old_logprobs=batch["old"])
    N, V, Ds = batch["mask"].numel(), batch["weight"].shape[0], batch["weight"].shape[1]
    combined = matmul_flops(lambda: _combined(batch, distillation_beta, kw))
    separate = matmul_flops(lambda: _separate(batch, distillation_beta, kw))
    sweep = 2 * N * V * (Ds + DT)  # one projection of each model
    gemm = 2 * N * V * Ds
    forward_sweeps = 2 if 0.0 < distillation_beta < 1.0 else 1
    assert combined == (forward_sweeps + 1) * sweep + 2 * gemm
    assert separate == combined + 4 * gemm


def _call(batch, **kw):
    kw = dict(dict(teacher=batch["teacher"], distillation_coef=COEF, backend="torch"), **kw)
    return grpo_fast.loss(
        batch["hidden"], batch["weight"], batch["targets"], batch["advantages"], batch["mask"], bias=batch["bias"], **kw
    )


def test_bad_input_is_a_named_error():
    batch = _batch(B=2, T=3, V=11)
    t = batch["teacher"]
    cases = [
        (dict(teacher=None), ValueError, "distillation_coef is given but teacher is None"),
        (
            dict(teacher=None, distillation_coef=None, distillation_beta=0.5),
            ValueError,
            "distillation_beta is given but teacher is None",
        ),
        (dict(distillation_coef=None), ValueError, "teacher needs distillation_coef"),
        (dict(teacher=(t.hidden, t.weight)), TypeError, "teacher must be a grpo_fast.Teacher"),
        (dict(distillation_beta=1.5), ValueError, "distillation_beta must be a number in"),
        (dict(distillation_coef=float("nan")), ValueError, "distillation_coef must be"),
        (
            dict(teacher=grpo_fast.Teacher(t.hidden, t.weight[:7])),
            ValueError,
            "weight has V = 11 rows but teacher.weight has V = 7",
        ),
        (dict(teacher=grpo_fast.Teacher(t.hidden[:, :2], t.weight)), ValueError, "teacher.hidden must have shape"),
        (
            dict(teacher=grpo_fast.Teacher(t.hidden, t.weight[:, :5])),
            ValueError,
            r"teacher.hidden has D = \d+ but teacher.weight has shape \(11, 5\)",
        ),
        (dict(teacher=grpo_fast.Teacher(t.hidden, t.weight.double())), TypeError, "teacher.weight must be"),
        (dict(teacher=grpo_fast.Teacher(t.hidden, t.weight.half())), TypeError, "differs from teacher.hidden dtype"),
        (dict(teacher=grpo_fast.Teacher(t.hidden, t.weight, bias=t.bias[:3])), ValueError, "teacher.bias must have"),
        (dict(teacher=grpo_fast.Teacher(t.hidden, t.weight, softcap=-1.0)), ValueError, "teacher.softcap must be"),
        (
            dict(teacher=grpo_fast.Teacher(t.hidden, t.weight, logit_scale=0.0)),
            ValueError,
            "teacher.logit_scale must be",
        ),
        (dict(teacher=grpo_fast.Teacher(t.hidden.to("meta"), t.weight)), ValueError, "teacher.hidden is on meta"),
        (dict(lora=(torch.zeros(2, 37), torch.zeros(11, 2), 1.0)), ValueError, "lora with a teacher"),
        (dict(vocab_parallel=grpo_fast.VocabShard(None, 0, 11)), ValueError, "vocab_parallel with a teacher"),
    ]
    for kw, error, message in cases:
        with pytest.raises(error, match=message):
            _call(batch, **kw)


@pytest.mark.slow
def test_op_registration():
    """The combined head's custom op passes torch.library.opcheck (schema, fake implementation, autograd)."""
    from grpo_fast.distillation.teacher import _forward_op

    batch = _batch(B=2, T=3, V=31)
    t = batch["teacher"]
    h, w, b = (
        x.detach().reshape(-1, x.shape[-1]) if x.dim() == 3 else x.detach()
        for x in (batch["hidden"], batch["weight"], batch["bias"])
    )
    for distillation_beta in (0.0, 0.5):
        torch.library.opcheck(
            _forward_op,
            (
                batch["targets"].reshape(-1),
                h.clone().requires_grad_(),
                w.clone().requires_grad_(),
                b.clone().requires_grad_(),
                t.hidden.reshape(-1, DT),
                t.weight,
                t.bias,
                distillation_beta,
                0.9,
                3.0,
                1.1,
                t.softcap,
                t.logit_scale,
                "torch",
                h.dtype,
            ),
        )


def test_fake_tensors_give_the_shapes():
    """Under FakeTensorMode the call runs on the op's fake implementation: a scalar loss and the metrics."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    batch = _batch(B=2, T=3, V=31)
    with FakeTensorMode(allow_non_fake_inputs=False) as mode:
        fake = {k: mode.from_tensor(v) for k, v in batch.items() if isinstance(v, torch.Tensor)}
        t = batch["teacher"]
        teacher = grpo_fast.Teacher(*(mode.from_tensor(x) for x in (t.hidden, t.weight, t.bias)), softcap=t.softcap)
        h = fake["hidden"].clone().requires_grad_()
        args = (h, fake["weight"], fake["targets"], fake["advantages"], fake["mask"])
        total, metrics = grpo_fast.loss(
            *args, bias=fake["bias"], teacher=teacher, distillation_coef=COEF, backend="torch"
        )
        total.backward()
    assert total.shape == () and metrics["distillation_loss"].shape == () and h.grad.shape == h.shape


@pytest.mark.slow
def test_compiles_to_one_graph():
    """torch.compile(fullgraph=True) of a step with a teacher (the op's fake implementation and autograd; aot_eager)
    gives the eager loss, metric and gradients."""
    batch = _batch(B=2, T=5, V=31)
    t = batch["teacher"]

    def step(h, w, b):
        args = (h, w, batch["targets"], batch["advantages"], batch["mask"])
        distillation = dict(teacher=t, distillation_coef=COEF, distillation_beta=0.5)
        total, metrics = grpo_fast.loss(*args, bias=b, **distillation, backend="torch", check_values=False)
        return total, metrics["distillation_loss"]

    leaves = _leaves(batch)
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")(*leaves)
    eager = step(*leaves)
    torch.testing.assert_close(compiled[0], eager[0], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(compiled[1], eager[1], rtol=1e-6, atol=1e-7)
    for a, e in zip(_grads(compiled[0], leaves), _grads(eager[0], leaves)):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-7)


# ----------------------------------------------------------------------------------------------- the fused path
def _spied_fused(monkeypatch):
    """The calls of kernels.divergence_loss.loss_gradients (the fused path: both models' logits once per chunk) made,
    each as whether it had a layer-1 term."""
    from grpo_fast.kernels import divergence_loss

    calls, fused = [], divergence_loss.loss_gradients

    def spy(*args, **kwargs):
        calls.append(kwargs.get("layer1") is not None)
        return fused(*args, **kwargs)

    monkeypatch.setattr(divergence_loss, "loss_gradients", spy)
    return calls


FUSED_CASES = {  # token-local options (LossOptions.token_local): the fused path takes them
    "grpo-softcap": CASES["grpo-softcap"],
    "dapo-num-items-is": CASES["dapo-num-items-is"],
    "dr_grpo-kl": CASES["dr_grpo-kl"],
}


@pytest.mark.parametrize("distillation_beta", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("case", FUSED_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_fused_path_matches_the_fp64_spec(dtype, case, distillation_beta, monkeypatch, device):
    """A trained head with token-local options on the Triton backend takes the fused path (the student's three
    sweeps and the teacher's one; chunks of 4 tokens here, logits of 2 at a time): the loss, every metric and every
    student gradient against reference.loss_with_teacher in fp64 on the same rounded inputs."""
    calls = _spied_fused(monkeypatch)
    batch = _batch(dtype=dtype, seed=3, V=131, device=device)
    kw = _options(batch, case)
    loss, metrics, grads = _combined(batch, distillation_beta, dict(kw, trained_head_chunk=4), backend="triton")
    assert calls and all(calls)
    t = batch["teacher"]
    h, w, b = (x.detach().float().requires_grad_() for x in (batch["hidden"], batch["weight"], batch["bias"]))
    spec_kw = {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
    spec, spec_metrics = reference.loss_with_teacher(
        h.cpu(),
        w.cpu(),
        batch["targets"].cpu(),
        batch["advantages"].cpu(),
        batch["mask"].cpu(),
        t.hidden.float().cpu(),
        t.weight.float().cpu(),
        bias=b.cpu(),
        distillation_coef=COEF,
        distillation_beta=distillation_beta,
        teacher_bias=t.bias.float().cpu(),
        teacher_softcap=t.softcap,
        teacher_logit_scale=t.logit_scale,
        compute_dtype=F64,
        **spec_kw,
    )
    spec_grads = torch.autograd.grad(spec, (h, w, b))
    torch.testing.assert_close(loss.cpu(), spec.float(), rtol=1e-4, atol=1e-5)
    assert set(metrics) == set(spec_metrics)
    for k in spec_metrics:
        torch.testing.assert_close(
            metrics[k].cpu(), spec_metrics[k].float(), rtol=1e-4, atol=1e-5, msg=lambda m, k=k: f"metric {k}: {m}"
        )
    for name, a, e in zip(("hidden", "weight", "bias"), grads, spec_grads):
        assert_grad_close(a, e, dtype, f"d{name}")


def test_the_fused_path_is_taken_only_where_it_computes_the_same_loss(monkeypatch, device):
    """Not for options that are not token-local (the entropy bonus, sequence-level importance sampling), fp16 or
    the torch backend: those keep the combined head."""
    calls = _spied_fused(monkeypatch)
    for case in ("bnpo-entropy-bonus", "grpo-sequence-level"):
        batch = _batch(device=device)
        _combined(batch, 1.0, _options(batch, case), backend="triton")
    batch = _batch(dtype=torch.float16, device=device)
    _combined(batch, 1.0, _options(batch, "grpo-softcap"), backend="triton")
    batch = _batch()
    _combined(batch, 1.0, _options(batch, "grpo-softcap"), backend="torch")
    assert calls == []


@pytest.mark.parametrize("distillation_beta", [1.0, 0.5])
def test_a_frozen_student_head_forms_dh_alone_on_the_fused_path(distillation_beta, monkeypatch, device):
    """Only the hidden states need a gradient (LoRA elsewhere, a frozen lm_head): the fused path forms dH alone
    (the student's two sweeps and the teacher's one), equal to the combined head's (the torch twin) on the same
    inputs; the weight and bias get none."""
    calls = _spied_fused(monkeypatch)
    results = []
    for backend in ("triton", "torch"):
        batch = _batch(seed=4, device=backend_device(backend, device))
        h = batch["hidden"].detach().clone().requires_grad_()
        total, metrics = grpo_fast.loss(
            h, batch["weight"], batch["targets"], batch["advantages"], batch["mask"], bias=batch["bias"],
            teacher=batch["teacher"], distillation_coef=COEF, distillation_beta=distillation_beta, backend=backend,
            **_options(batch, "grpo-softcap"),
        )  # fmt: skip
        total.backward()
        results.append((total.detach().cpu(), metrics["distillation_loss"].cpu(), h.grad.cpu()))
    assert calls == [True]
    torch.testing.assert_close(results[0][0], results[1][0], rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(results[0][1], results[1][1], rtol=1e-5, atol=1e-7)
    scale = results[1][2].abs().max().item()
    torch.testing.assert_close(results[0][2], results[1][2], rtol=1e-4, atol=1e-5 * scale)


@pytest.mark.interpreter_only
@pytest.mark.parametrize("distillation_beta", [1.0, 0.5])
def test_the_fused_path_projects_the_student_three_times_and_the_teacher_once(distillation_beta):
    """Its matmul FLOPs (FlopCounterMode; the op runs inline under it): the student's product, dH and dW and the
    teacher's product, 2 N V (3 Ds + Dt), against the combined head's 2 N V (4 Ds + 2 Dt) (JSD: 5 Ds + 3 Dt)."""
    batch = _batch(B=4, T=16)  # 64 tokens: whole blocks of token rows (gemm.mm_token_rows pads a last partial one)
    batch["mask"][:] = True
    kw = dict(loss_type="grpo", old_logprobs=batch["old"])
    N, V, Ds = batch["mask"].numel(), batch["weight"].shape[0], batch["weight"].shape[1]
    fused = matmul_flops(lambda: _combined(batch, distillation_beta, kw, backend="triton"))
    assert fused == 2 * N * V * (3 * Ds + DT)
