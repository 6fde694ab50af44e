"""Mixed precision: bf16 / fp16 hidden states over an fp32 lm_head (a master weight, as a model keeps it under
torch.autocast), and calls inside an autocast region.

The weight is cast to the hidden states' dtype for the GEMMs (``kernels.operands.gemm_weight``), inside the ops: the
values are exactly those of the same call with the weight cast beforehand, and its gradient comes back in fp32,
unrounded (its bf16 rounding is the pre-cast call's gradient). An autocast region changes nothing of what grpo_fast
computes (``head.boundary.without_autocast``). Any other pair of dtypes is still a named TypeError."""

import pytest
import torch
from conftest import assert_grad_close, backend_device, grad_rtol
from helpers import assert_close_to_scale, head_inputs

import grpo_fast
from grpo_fast import reference

B, T, D, DT, V = 2, 5, 32, 24, 257
F64 = torch.float64
COEF, BETA = 0.7, 0.5


def _inputs(device, dtype=torch.bfloat16):
    """Student and teacher tensors, a mask with a masked tail and advantages: hidden states in ``dtype``, the weights
    and the student's bias fp32."""
    g = torch.Generator().manual_seed(0)
    hidden, weight, bias, targets = head_inputs(B, T, D, V, generator=g, device=device)
    teacher_hidden, teacher_weight, _, _ = head_inputs(B, T, DT, V, bias=False, generator=g, device=device)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[1, 3:] = False
    advantages = torch.randn(B, generator=g)
    return dict(
        hidden=hidden.to(dtype),
        weight=weight,
        bias=bias,
        targets=targets,
        mask=mask.to(device),
        advantages=advantages.to(device),
        teacher_hidden=teacher_hidden.to(dtype),
        teacher_weight=teacher_weight,
    )


# each entry point as (hidden, weight, the inputs, backend) -> (its outputs, the scalar its backward takes or None);
# ``_spec`` gives each one's fp64 spec
def _logprobs(h, w, x, backend):
    return (grpo_fast.logprobs(h, w, x["targets"], completion_mask=x["mask"], backend=backend),), None


def _logprobs_and_entropy(h, w, x, backend):
    logp, entropy = grpo_fast.logprobs_and_entropy(
        h, w, x["targets"], bias=x["bias"], completion_mask=x["mask"], temperature=0.9, backend=backend
    )
    return (logp, entropy), logp.sum() + 0.3 * entropy.sum()


def _loss(h, w, x, backend):
    loss, metrics = grpo_fast.loss(h, w, x["targets"], x["advantages"], x["mask"], bias=x["bias"], backend=backend)
    return (loss, metrics.logprobs, metrics.entropies), loss


def _loss_with_teacher(h, w, x, backend):
    teacher = grpo_fast.Teacher(x["teacher_hidden"], x["teacher_weight"])
    loss, metrics = grpo_fast.loss(
        h, w, x["targets"], x["advantages"], x["mask"], teacher=teacher, distillation_coef=COEF, backend=backend
    )
    return (loss, metrics.logprobs), loss


def _divergence(h, w, x, backend):
    div, entropy = grpo_fast.divergence_and_entropy(
        h, w, x["teacher_hidden"], x["teacher_weight"], x["mask"], beta=BETA, backend=backend
    )
    return (div, entropy), div.sum()


def _distillation_loss(h, w, x, backend):
    loss, div, entropy = grpo_fast.distillation_loss(
        h, w, x["teacher_hidden"], x["teacher_weight"], x["mask"], beta=BETA, backend=backend
    )
    return (loss, div, entropy), loss


CALLS = {
    "logprobs": _logprobs,
    "logprobs_and_entropy": _logprobs_and_entropy,
    "loss": _loss,
    "loss_with_teacher": _loss_with_teacher,
    "divergence": _divergence,
    "distillation_loss": _distillation_loss,
}


def _spec(name, h, w, x):
    """The fp64 spec of ``CALLS[name]`` on the hidden states ``h`` and the weight ``w`` as the GEMMs take them (the
    teacher's weight rounded to its hidden states' dtype alike)."""
    th = x["teacher_hidden"].to(F64)
    tw = x["teacher_weight"].to(x["teacher_hidden"].dtype).to(F64)
    bias = x["bias"].to(F64)
    mask = x["mask"]
    if name == "logprobs":
        return (reference.logprobs(h, w, x["targets"], compute_dtype=F64) * mask,), None
    if name == "logprobs_and_entropy":
        logp, entropy = reference.logprobs_and_entropy(h, w, x["targets"], bias, 0.9, compute_dtype=F64)
        logp, entropy = logp.double() * mask, entropy.double() * mask
        return (logp, entropy), logp.sum() + 0.3 * entropy.sum()
    if name == "loss":
        loss, metrics = reference.loss(h, w, x["targets"], x["advantages"], mask, bias=bias, compute_dtype=F64)
        return (loss,), loss
    if name == "loss_with_teacher":
        loss, _ = reference.loss_with_teacher(
            h, w, x["targets"], x["advantages"], mask, th, tw, distillation_coef=COEF, compute_dtype=F64
        )
        return (loss,), loss
    div, entropy = reference.divergence_and_entropy(h, w, th, tw, mask, beta=BETA, compute_dtype=F64)
    if name == "divergence":
        return (div, entropy), div.sum()
    loss = div.sum() / mask.sum()
    return (loss, div, entropy), loss


def _run(call, hidden, weight, x, backend):
    """(outputs detached, d hidden, d weight) of ``call`` (a CALLS entry's signature) on leaf copies of ``hidden``
    and ``weight`` (or, for a hidden with a graph, hidden itself, its gradient retained)."""
    h = hidden if hidden.grad_fn is not None else hidden.detach().clone().requires_grad_()
    h.retain_grad()
    w = weight.detach().clone().requires_grad_()
    outputs, scalar = call(h, w, x, backend)
    if scalar is None:
        return tuple(o.detach() for o in outputs), None, None
    scalar.backward()
    return tuple(o.detach() for o in outputs), h.grad, w.grad


def _assert_equal(actual, expected, what):
    for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
        assert a.dtype == e.dtype and torch.equal(a, e), f"{what} {i}: max diff {(a.float() - e.float()).abs().max()}"


@pytest.mark.parametrize("name", list(CALLS))
@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("in_autocast", [False, True], ids=["plain", "autocast"])
def test_fp32_weight_is_the_precast_weight_with_an_fp32_gradient(name, backend, in_autocast, device):
    """bf16 hidden states (under autocast: an autocast nn.Linear's output) over an fp32 weight: the outputs and
    d hidden of the call with the weight cast to bf16 beforehand, exactly; d weight fp32, whose bf16 rounding is
    that call's d weight, and which is not itself rounded to bf16."""
    dev = backend_device(backend, device)
    x = _inputs(dev)
    if in_autocast:
        # a model under autocast: an fp32 layer whose output the autocast region makes bf16
        projection = torch.nn.Linear(D, D, device=dev)
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            hidden = projection(x["hidden"].float())
            assert hidden.dtype == torch.bfloat16
            mixed = _run(CALLS[name], hidden, x["weight"], x, backend)
        x["hidden"] = hidden.detach()
    else:
        mixed = _run(CALLS[name], x["hidden"], x["weight"], x, backend)
    precast = _run(CALLS[name], x["hidden"], x["weight"].bfloat16(), x, backend)
    _assert_equal(mixed[0], precast[0], "output")
    if mixed[1] is None:
        return
    _assert_equal((mixed[1],), (precast[1],), "d hidden")
    grad_weight = mixed[2]
    assert grad_weight.dtype == torch.float32
    assert torch.equal(grad_weight.bfloat16(), precast[2])
    assert not torch.equal(grad_weight, grad_weight.bfloat16().float()), "d weight was rounded to bf16"


@pytest.mark.parametrize("name", list(CALLS))
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_fp32_weight_against_the_spec(name, backend, device):
    """bf16 hidden states over an fp32 weight inside an autocast region against the fp64 spec on the weight as the
    GEMMs take it (rounded to bf16), at the bf16 tolerances of the other tests: the outputs, d hidden (bf16) and
    d weight (fp32)."""
    dev = backend_device(backend, device)
    x = _inputs(dev)
    with torch.autocast(dev.type, dtype=torch.bfloat16):
        outputs, grad_hidden, grad_weight = _run(CALLS[name], x["hidden"], x["weight"], x, backend)
    h = x["hidden"].to(F64).requires_grad_()
    w = x["weight"].bfloat16().to(F64).requires_grad_()
    expected, scalar = _spec(name, h, w, x)
    for i, (a, e) in enumerate(zip(outputs, expected)):
        torch.testing.assert_close(a, e.float(), rtol=1e-4, atol=1e-5, msg=lambda m, i=i: f"output {i}: {m}")
    if scalar is None:
        return
    scalar.backward()
    assert_grad_close(grad_hidden, h.grad, torch.bfloat16, "d hidden")
    assert grad_weight.dtype == torch.float32
    assert_close_to_scale(grad_weight.double(), w.grad, grad_rtol(dev, torch.bfloat16), "d weight")


def test_fp16_hidden_states_take_an_fp32_weight_too(device):
    """fp16 hidden states over an fp32 weight: the pre-cast (fp16) call's outputs, d weight fp32."""
    x = _inputs(device, torch.float16)
    mixed = _run(_logprobs_and_entropy, x["hidden"], x["weight"], x, "triton")
    precast = _run(_logprobs_and_entropy, x["hidden"], x["weight"].half(), x, "triton")
    _assert_equal(mixed[0] + (mixed[1],), precast[0] + (precast[1],), "output and d hidden")
    assert mixed[2].dtype == torch.float32 and torch.equal(mixed[2].half(), precast[2])


@pytest.mark.parametrize("name", list(CALLS))
@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_autocast_region_changes_nothing(name, backend, dtype, device):
    """Inputs of one dtype give the same outputs and gradients inside a bf16 autocast region as outside: the
    region does not reach the implementations' GEMMs (the torch backend's divergence rounded fp32 operands to bf16
    there)."""
    dev = backend_device(backend, device)
    x = _inputs(dev, dtype)
    x["weight"], x["teacher_weight"] = x["weight"].to(dtype), x["teacher_weight"].to(dtype)
    outside = _run(CALLS[name], x["hidden"], x["weight"], x, backend)
    with torch.autocast(dev.type, dtype=torch.bfloat16):
        inside = _run(CALLS[name], x["hidden"], x["weight"], x, backend)
    _assert_equal(inside[0], outside[0], "output")
    if inside[1] is not None:
        _assert_equal(inside[1:], outside[1:], "d hidden, d weight")


def _sampler_logprobs(h, w, x, backend):
    y = x["targets"]
    kept = torch.stack([y, (y + 1) % V, (y + 7) % V], -1)  # replayed kept sets that hold the targets
    logp, support, kept_mass = grpo_fast.sampler_logprobs(h, w, y, x["mask"], kept_ids=kept, backend=backend)
    # the support's gradient alone: one op's, so that d weight is one fp32 buffer (the log-probs' is layer 1's)
    return (logp, support, kept_mass), support.sum()


def _served_distillation_loss(h, w, x, backend):
    g = torch.Generator().manual_seed(2)
    ids = torch.randperm(V, generator=g)[: B * T * 4].view(B, T, 4).to(h.device)
    teacher = grpo_fast.ServedTeacher(ids, torch.randn(B, T, 4, generator=g).log_softmax(-1).to(h.device))
    loss, div, entropy = grpo_fast.served_distillation_loss(h, w, teacher, x["mask"], backend=backend)
    return (loss, div, entropy), loss


@pytest.mark.parametrize("call", [_sampler_logprobs, _served_distillation_loss], ids=["sampler", "served"])
def test_the_other_heads_take_an_fp32_weight(call, device):
    """The sampler's log-probs and the served teacher's loss, bf16 hidden states over an fp32 weight inside an
    autocast region: the pre-cast call's outputs and d hidden, d weight fp32 rounding to its."""
    x = _inputs(device)
    with torch.autocast(device.type, dtype=torch.bfloat16):
        mixed = _run(call, x["hidden"], x["weight"], x, "triton")
    precast = _run(call, x["hidden"], x["weight"].bfloat16(), x, "triton")
    _assert_equal(mixed[0] + (mixed[1],), precast[0] + (precast[1],), "output and d hidden")
    assert mixed[2].dtype == torch.float32 and torch.equal(mixed[2].bfloat16(), precast[2])


def test_lora_under_autocast(device):
    """A LoRA head with fp32 adapters over an fp32 weight, bf16 hidden states inside an autocast region: the
    adapters' branch runs as PEFT's does there; gradients reach the weight and both adapters in fp32."""
    x = _inputs(device)
    g = torch.Generator().manual_seed(1)
    a = (torch.randn(4, D, generator=g) * 0.1).to(device).requires_grad_()
    b = (torch.randn(V, 4, generator=g) * 0.1).to(device).requires_grad_()
    h = x["hidden"].detach().clone().requires_grad_()
    w = x["weight"].detach().clone().requires_grad_()
    with torch.autocast(device.type, dtype=torch.bfloat16):
        logp, _ = grpo_fast.logprobs_and_entropy(h, w, x["targets"], completion_mask=x["mask"], lora=(a, b, 2.0))
    logp.sum().backward()
    h64, w64 = h.detach().to(F64), w.detach().bfloat16().to(F64)
    lora = grpo_fast.HeadLora(a.detach(), b.detach(), 2.0)
    with torch.autocast(device.type, dtype=torch.bfloat16):  # the spec's adapter branch as PEFT's under autocast
        expected = reference.logprobs(h64.bfloat16(), w64, x["targets"], compute_dtype=F64, lora=lora)
    torch.testing.assert_close(logp, expected.float() * x["mask"], rtol=1e-4, atol=1e-4)
    assert (h.grad.dtype, w.grad.dtype, a.grad.dtype, b.grad.dtype) == (torch.bfloat16,) + (torch.float32,) * 3


def test_other_dtype_pairs_are_named_errors():
    """Only an fp32 weight over bf16 / fp16 hidden states is cast; the error says which casts would do."""
    x = _inputs("cpu")
    h, w = x["hidden"], x["weight"]
    with pytest.raises(TypeError, match=r"weight dtype torch.bfloat16 differs from hidden dtype torch.float32"):
        grpo_fast.logprobs(h.float(), w.bfloat16(), x["targets"])
    with pytest.raises(TypeError, match="cast hidden to torch.float16 or weight to torch.bfloat16"):
        grpo_fast.loss(h, w.half(), x["targets"], x["advantages"], x["mask"])
    with pytest.raises(TypeError, match="teacher_weight dtype torch.bfloat16 differs from teacher_hidden dtype"):
        grpo_fast.divergence(h, w, x["teacher_hidden"].float(), x["teacher_weight"].bfloat16())
    teacher = grpo_fast.Teacher(x["teacher_hidden"], x["teacher_weight"].half())
    with pytest.raises(TypeError, match="teacher.weight dtype torch.float16 differs from teacher.hidden dtype"):
        grpo_fast.loss(h, w, x["targets"], x["advantages"], x["mask"], teacher=teacher, distillation_coef=COEF)


def test_memory_estimate_counts_an_fp32_lm_head():
    """``python -m grpo_fast.memory --lm-head-dtype float32``: the fp32 head, a parameter of its own beside the
    tied bf16 embedding (V x D x 4 bytes more weights), and the op's bf16 copy of it while it runs (V x D x 2 bytes
    more at the loss head's peak)."""
    from grpo_fast import memory

    hidden_size, vocab = 64, 8192
    shape = ["--hidden-size", str(hidden_size), "--intermediate-size", "128", "--num-layers", "1", "--num-heads", "4"]
    sizes = ["--num-kv-heads", "2", "--vocab-size", str(vocab), "--micro-batch-size", "2", "--prompt-length", "8"]
    rest = ["--completion-length", "32", "--prompts-per-step", "2", "--num-generations", "2", "--lora-r", "4"]
    argv = shape + sizes + rest + ["--heads", "grpo_fast", "--quiet"]
    plain = memory.main(argv)["heads"]["grpo_fast"]
    master = memory.main(argv + ["--lm-head-dtype", "float32"])["heads"]["grpo_fast"]
    assert master["categories_bytes"]["weights"] - plain["categories_bytes"]["weights"] == vocab * hidden_size * 4
    assert master["loss_head_peak_bytes"] - plain["loss_head_peak_bytes"] == vocab * hidden_size * 2
