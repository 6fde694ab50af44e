"""The three-sweep trained head (kernels.forward_frozen.forward_trained_head, grpo_fast::trained_head_loss): a trained
lm_head whose loss is token-local forms dH, dW and db in the forward, from each token chunk's logits while they are
in hand. Against the fp64 spec (the kernel, given dL/dlogp; the loss through grpo_fast.loss), against the recompute
path (the same loss, metrics and gradients), on odd shapes, masked and one-token rows, confident tokens and both
dtypes it takes; three vocabulary sweeps; and taken exactly where the options and the inputs allow it."""

import pytest
import torch
from conftest import assert_grad_close, backend_device
from helpers import assert_close_to_scale, matmul_flops

import grpo_fast
from grpo_fast import reference
from grpo_fast.head.transform import LogitTransform
from grpo_fast.kernels import config as kconfig
from grpo_fast.kernels import forward_frozen as kfrozen
from grpo_fast.kernels.operands import GradientColumns, HeadGrads, HeadOperands

F64 = torch.float64


def _head(N, D, V, dtype, *, bias, scale=0.3, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N, D, generator=g).to(dtype)
    w = (torch.randn(V, D, generator=g) * scale).to(dtype)
    b = (torch.randn(V, generator=g) * 0.5).to(dtype) if bias else None
    y = torch.randint(0, V, (N,), generator=g)
    c = torch.randn(N, generator=g)
    c[::5] = 0.0  # masked rows: no gradient
    return [x.to(device) if x is not None else None for x in (h, w, b, y, c)]


def _truth(h, w, b, y, c, **transform):
    """(logp, dH, dW, db) of sum_n c_n logp_n in fp64 (the spec's logits)."""
    leaves = [x.to(F64).requires_grad_() if x is not None else None for x in (h, w, b)]
    logp = reference.logprobs_and_entropy(
        leaves[0][None], leaves[1], y[None], leaves[2], compute_dtype=F64, **transform
    )
    logp = logp[0][0]
    (c.to(F64) * logp).sum().backward()
    return logp.detach(), *(x.grad if x is not None else None for x in leaves)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "transform", [dict(), dict(temperature=0.7), dict(softcap=3.0, logit_scale=1.7, temperature=0.8)], ids=str
)
@pytest.mark.parametrize("bias", [False, True])
def test_the_kernel_gives_the_gradients_of_its_coefficients(dtype, transform, bias, device):
    # N 37 in chunks of 16 (a partial last chunk), D 29, V 203: no tile multiple
    h, w, b, y, c = _head(37, 29, 203, dtype, bias=bias, device=device)
    grads = HeadGrads(
        torch.empty(h.shape, device=device), torch.zeros(w.shape, device=device), torch.zeros(203, device=device)
    )
    if not bias:
        grads = grads._replace(bias=None)
    chunks = []

    def coefficients(n0, n1, logp, entropy):
        chunks.append((n0, n1))
        assert logp.shape == entropy.shape == (n1 - n0,)
        return c[n0:n1]

    head = HeadOperands(h, w, y, b, LogitTransform(**transform))
    config = kconfig.frozen_head_config(h.device)
    logp, entropy, _ = kfrozen.forward_trained_head(head, True, config, coefficients, grads, token_chunk=16)
    assert chunks == [(0, 16), (16, 32), (32, 37)]
    ref_logp, ref_h, ref_w, ref_b = _truth(h, w, b, y, c, **transform)
    torch.testing.assert_close(logp.double(), ref_logp.double().to(logp.device), rtol=1e-5, atol=2e-5)
    # the fp32 buffers against fp64, at the precision of their inputs' dtype
    for name, got, want in (
        ("hidden", grads.hidden, ref_h),
        ("weight", grads.weight, ref_w),
        ("bias", grads.bias, ref_b),
    ):
        if want is not None:
            assert_grad_close(got.to(dtype), want.float(), dtype, name)


def test_confident_tokens_keep_their_target_gradient(device):
    """Each token's own row of W along its hidden state: z_y = 51 nats, tens above the rest, 1 - p_y far below
    fp32's epsilon, never formed by cancellation: dH and dW (the target rows' c s'_y R / S h and every other row's)
    within fp32's rounding of the fp64 truth relative to their own scale, however small that is."""
    N, D, V = 24, 32, 96
    h, w, _, _, c = _head(N, D, V, torch.float32, bias=False, device=device)
    h = h / h.norm(dim=1, keepdim=True) * D**0.5  # |h|^2 = D: z_y = 1.6 D
    y = torch.arange(N, device=device) * 3
    w[y] = h * 1.6
    grads = HeadGrads(torch.empty(h.shape, device=device), torch.zeros(w.shape, device=device))
    head = HeadOperands(h, w, y, None, LogitTransform())
    config = kconfig.frozen_head_config(h.device)
    kfrozen.forward_trained_head(head, True, config, lambda n0, n1, logp, e: c[n0:n1], grads, token_chunk=8)
    _, ref_h, ref_w, _ = _truth(h, w, None, y, c)
    assert 0 < ref_h.abs().max() < 1e-8  # confident indeed, and not exactly 0
    # relative to the gradient's own scale: the fp32 logits of 51 nats carry 51 x 2^-24 = 3e-6 each, and dH's entries
    # are differences of the target's and the other rows' terms (the recompute path's are the same)
    for got, want in ((grads.hidden, ref_h), (grads.weight, ref_w)):
        assert (got.double() - want.to(device)).abs().max() <= 2e-4 * want.abs().max()


# ----------------------------------------------------------------------------------------------- through grpo_fast.loss
def _batch(dtype, bias, seed=3, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    B, T, D, V = 3, 7, 24, 150
    hidden = (torch.randn(B, T, D, generator=g) * 0.5).to(dtype)
    weight = (torch.randn(V, D, generator=g) * 0.5).to(dtype)
    targets = torch.randint(0, V, (B, T), generator=g)
    mask = torch.rand(B, T, generator=g) > 0.3
    mask[1] = False
    mask[1, 0] = True  # a one-token completion
    mask[2] = False  # a fully masked row
    logp = reference.logprobs(hidden, weight, targets)
    batch = dict(
        hidden=hidden,
        weight=weight,
        bias=(torch.randn(V, generator=g) * 0.5).to(dtype) if bias else None,
        targets=targets,
        mask=mask,
        adv=torch.randn(B, generator=g),
        old=logp + 0.3 * torch.randn(B, T, generator=g),
        ref=logp + 0.3 * torch.randn(B, T, generator=g),
    )
    return {name: x.to(device) if x is not None else None for name, x in batch.items()}


def _loss(x, head_path, trained_calls=None, check_values=True, backend="triton", **kw):
    leaves = {name: x[name].clone().requires_grad_() for name in ("hidden", "weight")}
    leaves["bias"] = x["bias"].clone().requires_grad_() if x["bias"] is not None else None
    loss, metrics = grpo_fast.loss(
        leaves["hidden"],
        leaves["weight"],
        x["targets"],
        x["adv"],
        x["mask"],
        bias=leaves["bias"],
        old_logprobs=x["old"],
        ref_logprobs=x["ref"],
        head_path=head_path,
        backend=backend,
        check_values=check_values,
        **kw,
    )
    loss.backward()
    grads = {name: leaf.grad for name, leaf in leaves.items() if leaf is not None}
    return loss.detach(), metrics, grads


TOKEN_LOCAL = {
    "grpo": dict(loss_type="grpo", beta=0.04),
    "dapo": dict(loss_type="dapo", num_items_in_batch=11),
    "dr_grpo-softcap": dict(loss_type="dr_grpo", softcap=4.0, temperature=0.7),
    "bnpo-two-sided": dict(loss_type="bnpo", delta=1.5, epsilon_high=0.28),
    "cispo": dict(loss_type="cispo"),
    "sapo": dict(loss_type="sapo"),
    "luspo-kl-bias-corrected": dict(loss_type="luspo", beta=0.1, use_bias_correction_kl=True),
}


@pytest.fixture
def trained_calls(monkeypatch):
    calls = []
    real = kfrozen.forward_trained_head
    monkeypatch.setattr(kfrozen, "forward_trained_head", lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("options", list(TOKEN_LOCAL))
def test_the_loss_equals_the_recompute_paths_and_the_spec(dtype, bias, options, trained_calls, device):
    x = _batch(dtype, bias, device=backend_device("triton", device))
    kw = TOKEN_LOCAL[options]
    loss, metrics, grads = _loss(x, "auto", **kw)
    assert trained_calls == [1]
    general_loss, general_metrics, general_grads = _loss(x, "general", **kw)
    assert trained_calls == [1]  # "general": the recompute path
    torch.testing.assert_close(loss, general_loss, rtol=1e-6, atol=1e-7)
    assert list(metrics) == list(general_metrics)
    for name in metrics:
        torch.testing.assert_close(metrics[name], general_metrics[name], rtol=1e-6, atol=1e-7, equal_nan=True)
    torch.testing.assert_close(metrics.logprobs, general_metrics.logprobs, rtol=0, atol=2e-6)
    torch.testing.assert_close(metrics.entropies, general_metrics.entropies, rtol=0, atol=2e-6)
    spec = {
        name: x[name].to(F64).requires_grad_() if x[name] is not None else None for name in ("hidden", "weight", "bias")
    }
    labels = (x["targets"], x["adv"], x["mask"])
    logprobs = dict(old_logprobs=x["old"], ref_logprobs=x["ref"])
    ref_loss, _ = reference.loss(
        spec["hidden"], spec["weight"], *labels, bias=spec["bias"], compute_dtype=F64, **logprobs, **kw
    )
    ref_loss.backward()
    torch.testing.assert_close(loss.double(), ref_loss.detach().double().to(loss.device), rtol=1e-4, atol=1e-5)
    for name, grad in grads.items():
        assert_grad_close(grad, spec[name].grad.float(), dtype, name)
        assert_grad_close(general_grads[name], spec[name].grad.float(), dtype, f"{name} (recompute)")


def test_without_value_checks_the_rows_are_a_device_partition_and_the_result_the_same(trained_calls):
    x = _batch(torch.float32, True)
    checked = _loss(x, "auto", loss_type="dapo")
    unchecked = _loss(x, "auto", check_values=False, loss_type="dapo")
    assert trained_calls == [1, 1]
    torch.testing.assert_close(unchecked[0], checked[0], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(unchecked[1].logprobs, checked[1].logprobs, rtol=0, atol=1e-6)
    for name in checked[2]:  # dW sums other rows (padding): to the rounding of the gradient's scale
        assert_close_to_scale(unchecked[2][name], checked[2][name], 1e-5, name)


@pytest.mark.parametrize(
    "case",
    [
        "sequence-level",
        "vespo",
        "top-entropy",
        "off-policy-mask",
        "entropy-bonus",
        "fp16",
        "frozen-weight",
        "general",
        "torch-backend",
        "lora",
        "no-grad",
    ],
)
def test_taken_only_where_the_loss_and_the_inputs_allow_it(case, trained_calls):
    """Each condition alone sends the loss to another path (and its result is still the spec's: the other paths'
    own tests); the plain case takes the three-sweep head."""
    x = _batch(torch.float16 if case == "fp16" else torch.float32, False)
    hidden = x["hidden"].clone().requires_grad_()
    weight = x["weight"].clone().requires_grad_(case != "frozen-weight")
    kw = dict(old_logprobs=x["old"], backend="torch" if case == "torch-backend" else "triton")
    kw.update(
        {
            "sequence-level": dict(importance_sampling_level="sequence"),
            "vespo": dict(loss_type="vespo"),
            "top-entropy": dict(top_entropy_quantile=0.5),
            "off-policy-mask": dict(off_policy_mask_threshold=0.5),
            "entropy-bonus": dict(entropy_coef=0.01),
            "general": dict(head_path="general"),
            "lora": dict(lora=(torch.randn(4, 24), torch.randn(150, 4), 0.5)),
        }.get(case, {})
    )
    with torch.set_grad_enabled(case != "no-grad"):
        grpo_fast.loss(hidden, weight, x["targets"], x["adv"], x["mask"], **kw)
    assert trained_calls == []
    x = _batch(torch.float32, False)
    grpo_fast.loss(x["hidden"], x["weight"].requires_grad_(), x["targets"], x["adv"], x["mask"], backend="triton")
    assert trained_calls == [1]


def test_the_chunk_is_the_callers_choice(monkeypatch):
    """``trained_head_chunk`` sets the head's tokens per chunk (the same loss and gradients in chunks of 4 as in the
    default's one chunk); a value that is not a positive int, or one for a call the three-sweep head does not run,
    is refused."""
    chunks = []
    real = kfrozen.forward_trained_head

    def spy(*args, **kwargs):
        chunks.append(args[5] if len(args) > 5 else kwargs.get("token_chunk"))
        return real(*args, **kwargs)

    monkeypatch.setattr(kfrozen, "forward_trained_head", spy)
    x = _batch(torch.float32, True)
    default = _loss(x, "auto", loss_type="dapo")
    chunked = _loss(x, "auto", loss_type="dapo", trained_head_chunk=4)
    assert chunks == [None, 4]
    torch.testing.assert_close(chunked[0], default[0], rtol=1e-6, atol=1e-7)
    for name in default[2]:  # dW summed chunk by chunk: to the rounding of the gradient's scale
        assert_close_to_scale(chunked[2][name], default[2][name], 1e-5, name)
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="positive int"):
            _loss(x, "auto", trained_head_chunk=bad)
    for kw, name in (
        (dict(backend="torch"), "torch backend"),
        (dict(head_path="general"), "head_path"),
        (dict(lora=(torch.randn(4, 24), torch.randn(150, 4), 0.5)), "lora"),
        (dict(importance_sampling_level="sequence"), "token-local"),
    ):
        head_path = kw.pop("head_path", "auto")
        with pytest.raises(ValueError, match=name):
            _loss(x, head_path, trained_head_chunk=64, **kw)
    with pytest.raises(ValueError, match="float16 inputs"):
        _loss(
            {**x, "hidden": x["hidden"].half(), "weight": x["weight"].half(), "bias": None},
            "auto",
            trained_head_chunk=64,
        )


@pytest.mark.slow
def test_three_vocabulary_sweeps_against_the_recompute_paths_four():
    # B 4, T 64, D 64, V 1024, a trained weight: u = H W^T, J's P' W and dW's P'^T (f H), against 2 N D V each
    g = torch.Generator().manual_seed(1)
    B, T, D, V = 4, 64, 64, 1024
    hidden, weight = torch.randn(B, T, D, generator=g), torch.randn(V, D, generator=g) * 0.2
    targets, adv, mask = torch.randint(0, V, (B, T), generator=g), torch.randn(B, generator=g), torch.ones(B, T)

    def run(head_path):
        leaves = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        loss, _ = grpo_fast.loss(*leaves, targets, adv, mask, backend="triton", head_path=head_path)
        loss.backward()

    one_sweep = 2 * B * T * D * V
    # every product of the three-sweep head is a torch GEMM (its Triton kernel has no dot): all counted
    assert 2.9 <= matmul_flops(lambda: run("auto")) / one_sweep <= 3.1
    # the recompute path's four: the forward's and the backward's recomputed logits are Triton dots, which the
    # counter does not see, and the backward's dH and dW GEMMs, which it does
    assert 1.9 <= matmul_flops(lambda: run("general")) / one_sweep <= 2.1


def test_fake_tensors_and_the_memory_estimate_see_the_op():
    """Under FakeTensorMode the op's fake implementation gives the real outputs' shapes (the memory estimate runs the
    loss over fake tensors), and its workspace formula holds the chunk's logits and J."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from grpo_fast.grpo_loss import ops as loss_ops

    x = _batch(torch.bfloat16, True)
    real_loss, real_metrics, real_grads = _loss(x, "auto")
    with FakeTensorMode() as mode:
        fake = {name: mode.from_tensor(v) if isinstance(v, torch.Tensor) else v for name, v in x.items()}
        loss, metrics, grads = _loss(fake, "auto")
    assert loss.shape == real_loss.shape and set(metrics) == set(real_metrics)
    assert {name: (g.shape, g.dtype) for name, g in grads.items()} == {
        name: (g.shape, g.dtype) for name, g in real_grads.items()
    }
    N, D, V = 16384, 1536, 151936
    chunk = kfrozen.trained_chunk_size(N, V, D, 2)
    assert chunk == 768
    total = loss_ops.trained_head_workspace_bytes((N, D), V, torch.bfloat16, (16, 1024))
    assert chunk * V * 4 + N * D * 4 < total < chunk * V * 4 + N * D * 4 + 2**24


@pytest.mark.slow
def test_a_compiled_step_is_one_graph_with_the_eager_loss_and_gradients(trained_calls):
    """torch.compile(fullgraph=True) of a step through the three-sweep head (the op is one node): the eager step's
    loss and gradients, the head taken in both."""
    x = _batch(torch.float32, True)

    def step(hidden, weight, bias):
        labels = (x["targets"], x["adv"], x["mask"])
        loss, _ = grpo_fast.loss(
            hidden, weight, *labels, bias=bias, old_logprobs=x["old"], backend="triton", check_values=False
        )
        loss.backward()
        return loss.detach()

    results = []
    # the backward inside the compiled step, as tests/test_compile.py runs it
    with torch._dynamo.config.patch(trace_autograd_ops=True):
        for fn in (step, torch.compile(step, fullgraph=True, backend="aot_eager")):
            leaves = [x[name].clone().requires_grad_() for name in ("hidden", "weight", "bias")]
            results.append((fn(*leaves), *(leaf.grad for leaf in leaves)))
    assert trained_calls == [1, 1]
    for eager, compiled in zip(*results):
        torch.testing.assert_close(compiled, eager, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_column_entries_fold_into_the_weights_product(dtype, device):
    # a served teacher's entries at a few ids a row (operands.GradientColumns): dW and db take them in the chunk's
    # own product, on every row with a nonzero coefficient; the rows without one (c[::5] = 0: f = 0) go to ``rest``
    N, D, V, K = 37, 29, 203, 5
    h, w, b, y, c = _head(N, D, V, dtype, bias=True, device=device)
    g = torch.Generator().manual_seed(3)
    ids = torch.stack([torch.randperm(V, generator=g)[:K] for _ in range(N)])
    ids[1, 3:] = -1
    ids[2, 0] = y[2].cpu()  # the target among them
    ids = ids.to(device)
    grad = torch.randn(N, K, generator=g).to(device)
    temperature = 0.7
    columns = GradientColumns(ids, grad, 1.0 / temperature, torch.full((N, K), float("nan"), device=device))
    grads = HeadGrads(torch.empty(N, D, device=device), torch.zeros(V, D, device=device), torch.zeros(V, device=device))
    head = HeadOperands(h, w, y, b, LogitTransform(temperature=temperature))
    config = kconfig.frozen_head_config(h.device)
    kfrozen.forward_trained_head(head, False, config, lambda n0, n1, *_: c[n0:n1], grads, 16, columns=columns)
    folded = c != 0
    live = ids >= 0
    assert torch.equal(columns.rest[folded], torch.zeros_like(columns.rest[folded]))
    assert torch.equal(columns.rest[~folded], grad[~folded])
    # the caller's part: the rest's dW and db rows
    rest_u = torch.where(live, columns.rest / temperature, 0.0)
    weight = grads.weight.index_add(
        0, ids.clamp(min=0).flatten(), (rest_u[:, :, None] * h.float()[:, None]).flatten(0, 1)
    )
    bias = grads.bias.index_add(0, ids.clamp(min=0).flatten(), rest_u.flatten())
    leaves = [x.to(F64).requires_grad_() for x in (h, w, b)]
    z = reference.logits(leaves[0], leaves[1], leaves[2], temperature, compute_dtype=F64)
    logp = z.log_softmax(-1).gather(-1, y[:, None])[:, 0]
    at_ids = z.gather(-1, ids.clamp(min=0)).masked_fill(~live, 0.0)
    ((c.to(F64) * logp).sum() + (grad.to(F64) * at_ids).sum()).backward()
    assert_grad_close(weight.to(dtype), leaves[1].grad.float(), dtype, "weight")
    assert_grad_close(bias.to(dtype), leaves[2].grad.float(), dtype, "bias")


def test_column_entries_without_a_weight_gradient_stay_the_callers(device):
    # no dW nor db to take them: every entry goes to ``rest``; no column at all (K 0) folds nothing
    N, D, V = 9, 8, 40
    h, w, _, y, c = _head(N, D, V, torch.float32, bias=False, device=device)
    head = HeadOperands(h, w, y, None, LogitTransform())
    config = kconfig.frozen_head_config(h.device)
    for K, weight in ((3, None), (0, torch.zeros(V, D, device=device))):
        ids = torch.randint(0, V, (N, K), device=device)
        grad = torch.randn(N, K, device=device)
        columns = GradientColumns(ids, grad, 1.0, torch.full((N, K), float("nan"), device=device))
        grads = HeadGrads(torch.empty(N, D, device=device), weight)
        kfrozen.forward_trained_head(head, False, config, lambda n0, n1, *_: c[n0:n1], grads, 4, columns=columns)
        assert torch.equal(columns.rest, grad)
