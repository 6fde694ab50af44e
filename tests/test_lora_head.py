"""LoRA on the lm_head (grpo_fast.HeadLora, lora=): log-probs, entropy, the loss and every trainable gradient against
an fp64 truth built as PEFT computes the head (base logits + scaling * (dropout(h) A^T) B^T, the [N, r] activation in
the adapters' dtype), on both backends and both Triton backwards, the general and the frozen-head path, fp32 / bf16
(with fp32 and with bf16 adapters) / fp16, odd shapes, masked rows, dropout; the API's named errors; a PEFT model.
"""

import pytest
import torch
from conftest import assert_grad_close, grad_rtol
from helpers import free_port, gloo_group, head_inputs

import grpo_fast
from grpo_fast import reference

F64 = torch.float64
BACKENDS = ["triton", "triton-fused", "torch"]
# (base dtype, adapter dtype): PEFT keeps fp32 adapters over a bf16 base by default (autocast_adapter_dtype)
DTYPES = {
    "fp32": (torch.float32, torch.float32),
    "bf16-fp32": (torch.bfloat16, torch.float32),
    "bf16-bf16": (torch.bfloat16, torch.bfloat16),
    "fp16": (torch.float16, torch.float16),
}
# which inputs train: the adapters alone over a frozen base (LoRA), the base too, or nothing but hidden (a frozen
# adapter scoring a reference: the frozen-head path, J over [W | B])
TRAINING = {"adapters": ("hidden", "a", "b"), "all": ("hidden", "weight", "bias", "a", "b"), "frozen": ("hidden",)}


def _impl(backend):
    return "triton" if backend.startswith("triton") else backend


def _mode(backend):
    return "fused" if backend == "triton-fused" else "chunked"


def lora_inputs(B, T, D, V, r, dtype, adapter_dtype, device, seed=0):
    """head_inputs on ``device`` plus a = lora_A [r, D], b = lora_B [V, r] in ``adapter_dtype``; b is not PEFT's zero
    init, so that the LoRA term moves the log-probs by about a nat."""
    h, w, bias, y = head_inputs(B, T, D, V, dtype, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    a = (torch.randn(r, D, generator=g) / D**0.5).to(adapter_dtype)
    b = (torch.randn(V, r, generator=g) * 0.5).to(adapter_dtype)
    return [x.to(device) for x in (h, w, bias, y, a, b)]


def _assert_grad(actual, expected, base_dtype, name):
    """assert_grad_close in the gradient's own dtype; an fp32 adapter gradient over a half base is bounded by the
    base's rounding of g (the backward's GEMM operand) relative to its largest entry."""
    if actual.dtype == torch.float32 and base_dtype != torch.float32:
        err = (actual - expected.float()).abs().max().item()
        scale = expected.float().abs().max().item()
        bound = grad_rtol(actual.device, base_dtype) * scale
        assert err <= bound, f"{name}: max error {err:.3g} vs max |grad| {scale:.3g}"
    else:
        assert_grad_close(actual, expected.to(actual.dtype), actual.dtype, name)


def _check(
    backend, inputs, trainable, scaling=2.0, dropout=None, mask=None, entropy_grad=True, as_tuple=False, **kwargs
):
    """grpo_fast.logprobs_and_entropy with lora= against reference.logprobs_and_entropy in fp64: outputs and the
    gradients of sum(c1 logp + c2 entropy) for the ``trainable`` leaves."""
    h, w, bias, y, a, b = inputs
    names = ("hidden", "weight", "bias", "a", "b")
    coef = torch.Generator().manual_seed(5)
    c1 = torch.randn(y.shape, generator=coef).to(h.device)
    c2 = torch.randn(y.shape, generator=coef).to(h.device) if entropy_grad else None
    results = []
    for impl in ("reference", backend):
        leaves = dict(
            zip(names, (x.detach().clone().requires_grad_(n in trainable) for n, x in zip(names, (h, w, bias, a, b))))
        )
        lora = grpo_fast.HeadLora(leaves["a"], leaves["b"], scaling, dropout)
        if impl == "reference":
            logp, ent = reference.logprobs_and_entropy(
                leaves["hidden"], leaves["weight"], y, leaves["bias"], compute_dtype=F64, lora=lora, **kwargs
            )
            if mask is not None:
                logp, ent = logp * mask, ent * mask
        else:
            logp, ent = grpo_fast.logprobs_and_entropy(
                leaves["hidden"],
                leaves["weight"],
                y,
                bias=leaves["bias"],
                completion_mask=mask,
                lora=(leaves["a"], leaves["b"], scaling) if as_tuple else lora,
                backend=_impl(impl),
                backward_mode=_mode(impl),
                **kwargs,
            )
        total = (c1 * logp).sum() + ((c2 * ent).sum() if c2 is not None else 0.0)
        total.backward()
        results.append((logp.detach(), ent.detach(), {n: leaves[n].grad for n in trainable}))
    (ref_logp, ref_ent, ref_grads), (logp, ent, grads) = results
    torch.testing.assert_close(logp, ref_logp, rtol=1e-5, atol=2e-5)
    torch.testing.assert_close(ent, ref_ent, rtol=1e-5, atol=2e-5)
    for n in trainable:
        assert grads[n] is not None and grads[n].dtype == dict(zip(names, (h, w, bias, a, b)))[n].dtype, n
        _assert_grad(grads[n], ref_grads[n], h.dtype, n)
    return logp, grads


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtypes", list(DTYPES))
@pytest.mark.parametrize("training", list(TRAINING))
@pytest.mark.parametrize("r", [3, 8])
def test_lora_head_matches_the_peft_formula(backend, dtypes, training, r, device):
    # D, V not block multiples, V not a power of two; masked rows (a whole sequence); a loss on both outputs
    dtype, adapter_dtype = DTYPES[dtypes]
    inputs = lora_inputs(2, 9, 37, 203, r, dtype, adapter_dtype, device)
    mask = torch.rand(2, 9, generator=torch.Generator().manual_seed(3)) > 0.3
    mask[1] = False
    mask[0, 0] = True
    _check(
        backend, inputs, TRAINING[training], mask=mask.to(device), temperature=0.8, entropy_grad=training != "frozen"
    )


@pytest.mark.parametrize("backend", BACKENDS)
def test_frozen_adapter_takes_the_frozen_head_path_and_an_entropy_gradient_still_arrives(backend, device, monkeypatch):
    # only hidden trains: the forward builds J and J_l; an entropy gradient after all goes through the general
    # path's entropy term (lora term included)
    taken = []
    real = grpo_fast.head.paths.takes_frozen_head

    def spy(*args):
        taken.append(real(*args))
        return taken[-1]

    monkeypatch.setattr(grpo_fast.head.paths, "takes_frozen_head", spy)
    inputs = lora_inputs(1, 7, 40, 157, 4, torch.float32, torch.float32, device)
    _check(backend, inputs, ("hidden",), entropy_grad=True, softcap=3.0)
    _check(backend, inputs, ("hidden", "b"), entropy_grad=False)
    assert taken == [True, False]


@pytest.mark.parametrize("backend", BACKENDS)
def test_lora_moves_the_logprobs_and_a_zero_adapter_does_not(backend, device):
    h, w, bias, y, a, b = lora_inputs(2, 5, 24, 50, 4, torch.float32, torch.float32, device)
    base = grpo_fast.logprobs(h, w, y, bias=bias, backend=_impl(backend))
    with_lora = grpo_fast.logprobs(h, w, y, bias=bias, lora=(a, b, 2.0), backend=_impl(backend))
    truth = reference.logprobs(h, w, y, bias, compute_dtype=F64, lora=grpo_fast.HeadLora(a, b, 2.0))
    torch.testing.assert_close(with_lora, truth, rtol=1e-5, atol=2e-5)
    assert (with_lora - base).abs().max() > 0.1
    zero = grpo_fast.logprobs(h, w, y, bias=bias, lora=(a, torch.zeros_like(b), 2.0), backend=_impl(backend))
    torch.testing.assert_close(zero, base, rtol=0, atol=1e-6)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_dropout_in_train_mode_equals_the_eager_model_and_eval_mode_is_identity(backend, device):
    inputs = lora_inputs(2, 6, 32, 90, 4, torch.float32, torch.float32, device)
    h, w, bias, y, a, b = inputs
    dropout = torch.nn.Dropout(0.3).train()
    # the eager PEFT-like head with the same RNG state: same mask (dropout sees the whole hidden tensor)
    torch.manual_seed(11)
    eager = reference.logprobs(h, w, y, bias, lora=grpo_fast.HeadLora(a, b, 2.0, dropout))
    torch.manual_seed(11)
    fused = grpo_fast.logprobs(h, w, y, bias=bias, lora=grpo_fast.HeadLora(a, b, 2.0, dropout), backend=_impl(backend))
    torch.testing.assert_close(fused, eager, rtol=1e-5, atol=2e-5)
    no_dropout = grpo_fast.logprobs(h, w, y, bias=bias, lora=(a, b, 2.0), backend=_impl(backend))
    assert (fused - no_dropout).abs().max() > 1e-3  # the mask did act
    dropout.eval()
    torch.testing.assert_close(
        grpo_fast.logprobs(h, w, y, bias=bias, lora=grpo_fast.HeadLora(a, b, 2.0, dropout), backend=_impl(backend)),
        no_dropout,
        rtol=0,
        atol=0,
    )
    # the mask passed explicitly, with gradients, against fp64
    keep = (torch.rand(h.shape, generator=torch.Generator().manual_seed(4)) > 0.3).to(device)
    _check(backend, inputs, TRAINING["adapters"], dropout=lambda x: x * keep / 0.7, entropy_grad=False)


@pytest.mark.parametrize("backend", BACKENDS)
def test_loss_with_lora_equals_the_reference_loss(backend, device):
    h, w, bias, y, a, b = lora_inputs(3, 7, 37, 203, 3, torch.float32, torch.float32, device)
    g = torch.Generator().manual_seed(7)
    mask = (torch.rand(3, 7, generator=g) > 0.3).to(device)
    advantages = torch.randn(3, generator=g).to(device)
    old = reference.logprobs(h, w, y, bias, lora=grpo_fast.HeadLora(a, b, 2.0)) + 0.2
    results = []
    for impl in ("reference", backend):
        la, lb = (x.clone().requires_grad_() for x in (a, b))
        kwargs = dict(bias=bias, old_logprobs=old, loss_type="dapo", lora=grpo_fast.HeadLora(la, lb, 2.0))
        if impl == "reference":
            loss, _ = reference.loss(h, w, y, advantages, mask, compute_dtype=F64, **kwargs)
        else:
            loss, _ = grpo_fast.loss(
                h, w, y, advantages, mask, backend=_impl(impl), backward_mode=_mode(impl), **kwargs
            )
        loss.backward()
        results.append((loss.detach().double(), la.grad, lb.grad))
    (ref_loss, ref_ga, ref_gb), (loss, ga, gb) = results
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    assert ref_gb.abs().max() > 0
    assert_grad_close(ga, ref_ga.float(), torch.float32, "a")
    assert_grad_close(gb, ref_gb.float(), torch.float32, "b")


def test_a_tuple_is_accepted_and_converted(device):
    inputs = lora_inputs(1, 4, 20, 33, 2, torch.float32, torch.float32, device)
    _check("torch", inputs, TRAINING["adapters"], as_tuple=True, entropy_grad=False)


def test_named_errors(device):
    h, w, bias, y, a, b = lora_inputs(1, 3, 16, 20, 4, torch.float32, torch.float32, device)
    lp = grpo_fast.logprobs

    def fails(exc, match, lora):
        with pytest.raises(exc, match=match):
            lp(h, w, y, lora=lora)

    fails(ValueError, "rank mismatch", (a, b[:, :3], 1.0))
    fails(
        ValueError, r"hidden has D = 16 but lora.a has shape \(4, 15\): lora.a's second dimension", (a[:, :15], b, 1.0)
    )
    fails(
        ValueError, r"weight has V = 20 rows but lora.b has shape \(19, 4\): lora.b's first dimension", (a, b[:19], 1.0)
    )
    fails(TypeError, "share a dtype", (a, b.half(), 1.0))
    fails(TypeError, "float32, bfloat16 or float16", (a.long(), b.long(), 1.0))
    fails(TypeError, "float32, bfloat16 or float16", (a.double(), b.double(), 1.0))
    fails(ValueError, "finite number", (a, b, float("nan")))
    fails(ValueError, "finite number", (a, b, "2"))
    fails(ValueError, "2-D", (a[0], b, 1.0))
    fails(TypeError, "callable", (a, b, 1.0, 3))
    fails(TypeError, "HeadLora", [a, b, 1.0])
    fails(ValueError, "on meta but hidden", (a.to("meta"), b.to("meta"), 1.0))
    fails(ValueError, "lora.a is on", (a, b.to("meta"), 1.0))
    with gloo_group(0, 1, free_port()), pytest.raises(ValueError, match="vocab-parallel head is not supported"):
        grpo_fast.logprobs(h, w, y, lora=(a, b, 1.0), vocab_parallel=grpo_fast.VocabShard(None, 0, 20))


def test_peft_model_logits_path(device):
    # an actual PEFT LoRA on a tiny model's lm_head: HeadLora from its modules equals the model's own logits. peft is
    # a declared test dependency (the test extra): missing, the import fails the test
    import peft

    torch.manual_seed(0)

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.body = torch.nn.Linear(24, 24)
            self.lm_head = torch.nn.Linear(24, 61, bias=False)

        def forward(self, x):
            return self.lm_head(self.body(x))

    model = peft.get_peft_model(Tiny(), peft.LoraConfig(target_modules=["lm_head"], r=4, lora_alpha=8))
    head = model.base_model.model.lm_head
    torch.nn.init.normal_(head.lora_B["default"].weight, std=0.3)  # PEFT initialises B to zero
    model = model.to(device)
    x = torch.randn(2, 5, 24, device=device)
    y = torch.randint(0, 61, (2, 5), device=device)
    hidden = model.base_model.model.body(x)
    logits = model(x)
    truth = torch.log_softmax(logits.double(), -1).gather(-1, y[..., None]).squeeze(-1).float()
    lora = grpo_fast.HeadLora(
        head.lora_A["default"].weight,
        head.lora_B["default"].weight,
        head.scaling["default"],
        head.lora_dropout["default"],
    )
    logp, _ = grpo_fast.logprobs_and_entropy(hidden, head.base_layer.weight, y, lora=lora)
    torch.testing.assert_close(logp, truth, rtol=1e-5, atol=2e-5)
    base, _ = grpo_fast.logprobs_and_entropy(hidden, head.base_layer.weight, y)
    assert (base - truth).abs().max() > 0.05
    # the adapter trains: its gradients equal the PEFT model's
    logp.sum().backward()
    ga, gb = head.lora_A["default"].weight.grad.clone(), head.lora_B["default"].weight.grad.clone()
    model.zero_grad()
    truth_graph = torch.log_softmax(model(x).float(), -1).gather(-1, y[..., None]).sum()
    truth_graph.backward()
    assert_grad_close(ga, head.lora_A["default"].weight.grad, torch.float32, "lora_A")
    assert_grad_close(gb, head.lora_B["default"].weight.grad, torch.float32, "lora_B")


@pytest.mark.parametrize("backend", BACKENDS)
def test_one_token_and_every_row_masked(backend, device):
    # one token: one row of l; every row masked: zero outputs and exact zero gradients for a and b
    inputs = lora_inputs(1, 1, 24, 50, 3, torch.bfloat16, torch.float32, device)
    _check(backend, inputs, TRAINING["all"])
    h, w, bias, y, a, b = inputs
    la, lb = (x.clone().requires_grad_() for x in (a, b))
    logp, ent = grpo_fast.logprobs_and_entropy(
        h,
        w,
        y,
        bias=bias,
        completion_mask=torch.zeros_like(y),
        lora=(la, lb, 2.0),
        backend=_impl(backend),
        backward_mode=_mode(backend),
    )
    (logp.sum() + ent.sum()).backward()
    assert not logp.any() and not ent.any()
    assert la.grad is not None and not la.grad.any() and lb.grad is not None and not lb.grad.any()
