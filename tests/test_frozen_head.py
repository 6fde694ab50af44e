"""The frozen-head forward (a frozen lm_head: only dH needed): J = d logp / d h built in the forward, dH = c J.

Both paths: the chunked torch one (grpo_fast.backends.head_twin.forward_frozen_head) and the Triton one
(grpo_fast.kernels.forward_frozen, through Triton's interpreter on CPU, compiled on a CUDA GPU: the ``device``
fixture; the torch path on CPU), against the
fp64 reference's autograd (J = d(sum logp)/dh, dH = d(sum c logp)/dh); the forward's outputs against today's
forward. Small token and vocabulary chunks are forced so that the running max moves between chunks, the
target falls in every chunk position and the token loop runs several times. The "triton-bf16-gemm" case rounds P'
to bf16 as a GPU does (written over the fp32 u buffer's bytes); under the interpreter the GEMMs are computed on fp32
operands.
Also: the matmul FLOPs of a frozen-head forward + backward (at most 2.2 x 2NDV), the path through
grpo_fast.head.ops.linear_logprobs_path (entropy gradient included: the recompute fallback) and grpo_fast.loss, which
takes it by itself for a frozen weight and equals the recompute path.
"""

import dataclasses

import pytest
import torch
from conftest import assert_grad_close, backend_device, grad_rtol
from helpers import matmul_flops

import grpo_fast
from grpo_fast import reference
from grpo_fast.backends import head_twin as torch_twin
from grpo_fast.head import ops as head_ops
from grpo_fast.head import paths as backends
from grpo_fast.head.transform import LogitTransform
from grpo_fast.kernels import config as kconfig
from grpo_fast.kernels import forward as kforward
from grpo_fast.kernels import forward_frozen as kfrozen
from grpo_fast.kernels import gemm
from grpo_fast.kernels.operands import HeadGrads, HeadOperands

F64 = torch.float64
PATHS = ["torch", "triton", "triton-bf16-gemm"]


def _inputs(N, D, V, dtype, scale=0.3, bias=True, seed=0, device="cpu"):
    """(hidden, weight, bias, targets, dL/dlogp), drawn on CPU, on ``device``."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N, D, generator=g).to(device, dtype)
    w = (torch.randn(V, D, generator=g) * scale).to(device, dtype)
    b = (torch.randn(V, generator=g) * 0.5).to(device, dtype) if bias else None
    y = torch.randint(0, V, (N,), generator=g).to(device)
    c = torch.randn(N, generator=g).to(device)
    return h, w, b, y, c


def _truth(h, w, b, y, c, **transform):
    """fp64 reference: logp, entropy, J = d(sum logp)/dh and dH = d(sum c logp)/dh (each logp_n depends on h_n only)."""
    h64 = h.to(F64).requires_grad_()
    logp, ent = reference.logprobs_and_entropy(h64, w, y, b, compute_dtype=F64, **transform)
    (jac,) = torch.autograd.grad(logp.sum(), h64, retain_graph=True)
    (grad_hidden,) = torch.autograd.grad((c.to(F64) * logp).sum(), h64)
    return logp.detach(), ent.detach(), jac, grad_hidden


def _frozen(path, h, w, b, y, transform, small_chunks, monkeypatch):
    """(logp, entropy, BackwardStats, J) by the path (without the J_l of LoRA); small_chunks: 16 tokens and 64
    vocabulary entries a chunk."""
    t = LogitTransform(**transform)
    if path == "torch":
        if small_chunks:
            monkeypatch.setattr(torch_twin, "CHUNK_N", 16)
            monkeypatch.setattr(torch_twin, "CHUNK_V", 64)
        return torch_twin.forward_frozen_head(HeadOperands(h, w, y, b, t), True)[:4]
    chunks = dict(token_chunk=16, vocab_chunk=64) if small_chunks else {}
    gemm_dtype = torch.bfloat16 if path == "triton-bf16-gemm" else None
    config = kconfig.frozen_head_config(h.device)
    return kfrozen.forward_frozen_head(HeadOperands(h, w, y, b, t), True, config, gemm_dtype=gemm_dtype, **chunks)[:4]


def _todays_forward(path, h, w, b, y, transform):
    t = LogitTransform(**transform)
    if path == "torch":
        return torch_twin.forward(HeadOperands(h, w, y, b, t), True)
    return kforward.forward(HeadOperands(h, w, y, b, t), True, kconfig.forward_config(h.device, h.dtype))


def _check(path, dtype, h, w, b, y, c, monkeypatch, small_chunks=True, **transform):
    """Outputs vs the fp64 reference and today's forward; J and dH = c J vs the fp64 backends."""
    out = _frozen(path, h, w, b, y, transform, small_chunks, monkeypatch)
    logp, ent, stats, jac = out
    ref_logp, ref_ent, ref_jac, ref_grad_hidden = _truth(h, w, b, y, c, **transform)
    assert jac.dtype == torch.float32 and jac.shape == h.shape
    torch.testing.assert_close(logp, ref_logp.float(), rtol=1e-5, atol=2e-5)
    torch.testing.assert_close(ent, ref_ent.float(), rtol=1e-5, atol=2e-5)
    today = _todays_forward(path, h, w, b, y, transform)
    for name, a, t in zip(("logp", "entropy") + stats._fields, (logp, ent) + tuple(stats), today[:2] + tuple(today[2])):
        if path == "torch":  # the same operations in the same order
            assert torch.equal(a, t), name
        else:  # u from one GEMM instead of the forward kernel's tiles: fp32 rounding of another summation order
            torch.testing.assert_close(a, t, rtol=1e-6, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}")
    grad_hidden = (c[:, None] * jac).to(dtype)  # the backward: dH = c J
    # P' rounded to bf16 for the GEMM, as backward.py rounds g: asked for, or a GPU's bf16 inputs
    rounded = path == "triton-bf16-gemm" or (
        path == "triton" and dtype != torch.float32 and not kconfig.frozen_head_config(h.device).gemm_fp32
    )
    if rounded:
        err = (jac.double() - ref_jac).abs().max().item()
        assert err <= grad_rtol(h.device, torch.bfloat16) * ref_jac.abs().max().item(), err
    else:  # fp32 accumulation everywhere: J is fp32-exact whatever the input dtype
        assert_grad_close(jac, ref_jac.float(), torch.float32, "J")
        assert (jac.double() - ref_jac).abs().max() <= 1e-5 * ref_jac.abs().max()
    assert_grad_close(grad_hidden, ref_grad_hidden.float(), dtype, "hidden")
    return out


# weight scale and transform: Gemma 2's soft-cap 30 with logits of ~200 (most of tanh saturated); a small cap with
# a logit scale and a temperature; a logit scale (Cohere 0.0625), a negative one; a temperature alone
TRANSFORMS = {
    "none": (0.3, dict()),
    "temperature": (0.3, dict(temperature=0.7)),
    "logit-scale": (1.0, dict(logit_scale=0.0625)),
    "negative-logit-scale": (0.3, dict(logit_scale=-1.5, temperature=1.2)),
    "softcap-saturated": (40.0, dict(softcap=30.0)),
    "softcap-scale-temperature": (1.0, dict(softcap=2.0, logit_scale=1.7, temperature=0.7)),
}


# the bf16 GEMM rounding is for bf16 inputs
PATH_DTYPES = [
    pytest.param(p, d, id=f"{p}-{str(d).split('.')[-1]}")
    for p in PATHS
    for d in (torch.float32, torch.bfloat16)
    if not (p == "triton-bf16-gemm" and d == torch.float32)
]


@pytest.mark.parametrize("path, dtype", PATH_DTYPES)
@pytest.mark.parametrize("transform", list(TRANSFORMS))
def test_transforms_with_and_without_bias(path, dtype, transform, monkeypatch, device):
    # N 37, D 29, V 203: no block multiple, V not a power of two; 3 token chunks x 4 vocabulary chunks
    scale, kw = TRANSFORMS[transform]
    h, w, b, y, c = _inputs(
        37, 29, 203, dtype, scale=scale, bias=transform != "none", device=backend_device(path, device)
    )
    _check(path, dtype, h, w, b, y, c, monkeypatch, **kw)


@pytest.mark.parametrize("vocab_chunk", [64, 96])
def test_the_gpu_tile_past_a_vocabulary_chunk_with_targets_in_later_chunks(vocab_chunk, monkeypatch, device):
    # the compiled kernel's tile (2 rows x 512 columns) is wider than these chunks: a tile reaches past the chunk's
    # last column, where a target held by a later chunk must not match a masked (-inf) column (found on an H200:
    # logp -inf; the interpreter's 32-column tiles divide 64 and never reach past a chunk)
    config = dataclasses.replace(
        kconfig.gpu_frozen_head_config(), gemm_fp32=kconfig.frozen_head_config(device).gemm_fp32
    )
    h, w, b, y, c = _inputs(37, 29, 203, torch.float32, device=device)
    head = HeadOperands(h, w, y, b, LogitTransform())
    logp, ent, _, jac = kfrozen.forward_frozen_head(head, True, config, token_chunk=16, vocab_chunk=vocab_chunk)[:4]
    ref_logp, ref_ent, ref_jac, _ = _truth(h, w, b, y, c)
    torch.testing.assert_close(logp, ref_logp.float(), rtol=1e-5, atol=2e-5)
    torch.testing.assert_close(ent, ref_ent.float(), rtol=1e-5, atol=2e-5)
    assert (jac.double() - ref_jac).abs().max() <= 1e-5 * ref_jac.abs().max()


def test_softcap_really_saturates_in_the_saturated_case():
    scale, kw = TRANSFORMS["softcap-saturated"]
    h, w, b, _, _ = _inputs(37, 29, 203, torch.float32, scale=scale)
    assert (torch.tanh((h @ w.T + b) / kw["softcap"]).abs() > 0.999).float().mean() > 0.5


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("shape", [(1, 24, 50), (3, 70, 131), (20, 16, 1000)])
def test_odd_shapes_one_token_and_default_chunks(path, shape, monkeypatch, device):
    # the default chunking (one token chunk; the vocabulary in one chunk for fp32, two for bf16 u-sized chunks)
    N, D, V = shape
    dtype = torch.bfloat16 if path == "triton-bf16-gemm" else torch.float32
    h, w, b, y, c = _inputs(N, D, V, dtype, device=backend_device(path, device))
    _check(path, dtype, h, w, b, y, c, monkeypatch, small_chunks=False, temperature=0.9)


@pytest.mark.parametrize("path", ["torch", "triton"])
@pytest.mark.parametrize("softcap", [None, 5.0])
def test_minus_inf_bias_and_a_whole_chunk_of_minus_inf(path, softcap, monkeypatch, device):
    # a bias that removes most of the vocabulary, the whole first vocabulary chunk included (its running max is -inf:
    # the pivot stays finite, the next chunk's rescale is 0), logits of size ~1e3; with a soft-cap the removed
    # entries sit at -softcap / temperature and have slope 0
    dev = backend_device(path, device)
    h, w, _, y, c = _inputs(9, 16, 300, torch.float32, scale=30.0, bias=False, device=dev)
    bias = torch.full((300,), float("-inf"), device=dev)
    bias[70::7] = 0.0
    y = 70 + ((y % 230) // 7) * 7
    out = _frozen(path, h, w, bias, y, dict(softcap=softcap), True, monkeypatch)
    ref_logp, ref_ent, ref_jac, _ = _truth(h, w, bias, y, c, softcap=softcap)
    assert all(torch.isfinite(x).all() for x in out[:2] + tuple(out[2]) + out[3:])
    torch.testing.assert_close(out[0], ref_logp.float(), rtol=1e-5, atol=1e-3)
    torch.testing.assert_close(out[1], ref_ent.float(), rtol=1e-4, atol=1e-3)
    torch.testing.assert_close(out[3], ref_jac.float(), rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("path", ["torch", "triton"])
def test_confident_tokens_keep_their_gradient(path, monkeypatch, device):
    # a target logit far above the rest: 1 - p_y from 1e-4 down to 4e-10, below fp32's resolution of p_y near 1.
    # J = (s'_y R W_y - sum_{v != y} e_v s'_v W_v) / S never forms 1 - p_y by cancellation, so each row of J keeps
    # fp32's relative precision (the recompute path's c (onehot - p) was seen 0.6 % to 160 % off on these rows).
    g = torch.Generator().manual_seed(5)
    N, D, V = 8, 32, 203
    w = torch.randn(V, D, generator=g) * 0.3
    y = torch.randint(0, V, (N,), generator=g)
    direction = w[y] / w[y].norm(dim=1, keepdim=True) ** 2
    h = 0.3 * torch.randn(N, D, generator=g) + 4 * direction * torch.linspace(5, 10, N)[:, None]
    h, w, y = (x.to(backend_device(path, device)) for x in (h, w, y))
    ref_logp, _, ref_jac, _ = _truth(h, w, None, y, torch.ones(N, device=h.device))
    assert (ref_logp > -1e-4).all() and (ref_logp < -1e-10).all()
    jac = _frozen(path, h, w, None, y, {}, True, monkeypatch)[3].double()
    row_err = (jac - ref_jac).abs().max(1).values / ref_jac.abs().max(1).values
    assert (row_err < 5e-5).all(), row_err


def test_vocab_chunk_keeps_u_about_the_size_of_the_weight():
    # Qwen2.5-1.5B's head, bf16: two chunks of 76032 (a multiple of 128), u 1536 x 76032 fp32 ~ W's 467 MB
    V, D = 151936, 1536
    chunk = kfrozen.vocab_chunk_size(V, D, 1536, 2)
    assert chunk == 76032 and chunk % kfrozen.VOCAB_ALIGN == 0
    assert abs(1536 * chunk * 4 / (V * D * 2) - 1) < 0.01
    assert kfrozen.vocab_chunk_size(V, D, 1536, 4) == V  # fp32 weights: one chunk
    assert kfrozen.vocab_chunk_size(50, 24, 1, 4) == 50


# ------------------------------------------------------------------------------------------------ FLOPs
def test_frozen_forward_and_backward_do_two_vocabulary_gemms():
    # B 4, T 64, D 256, V 8192, frozen weight: forward (J built) + backward dH = c J, against 2 N D V per GEMM
    B, T, D, V = 4, 64, 256, 8192
    N = B * T
    h, w, _, y, c = _inputs(N, D, V, torch.float32, bias=False)
    t = LogitTransform(temperature=0.9)

    def frozen():
        jac = torch_twin.forward_frozen_head(HeadOperands(h, w, y, None, t), True)[3]
        return c[:, None] * jac

    def recompute():
        head = HeadOperands(h, w, y, None, t)
        _, _, stats = torch_twin.forward(head, True)
        torch_twin.backward(head, stats, c, None, HeadGrads(hidden=torch.zeros(N, D)))

    one_gemm = 2 * N * D * V
    frozen_ratio = matmul_flops(frozen) / one_gemm
    assert 1.9 <= frozen_ratio <= 2.2, frozen_ratio  # at least 1.9: both GEMMs are seen by the counter
    assert matmul_flops(recompute) / one_gemm >= 2.9  # today's three sweeps, for comparison

    # the same through the custom op (ops.linear_logprobs_path), with autograd
    def through_autograd():
        leaf = h.clone().requires_grad_()
        logp, _ = head_ops.linear_logprobs_path(HeadOperands(leaf, w, y, None, t), "torch", "auto", "chunked")
        (c * logp).sum().backward()

    assert matmul_flops(through_autograd) / one_gemm <= 2.2


# ------------------------------------------------------------------ through grpo_fast.head.paths and grpo_fast.loss
@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("entropy_grad", [False, True])
def test_linear_logprobs_frozen_path_matches_the_reference(backend, dtype, entropy_grad, device):
    # the frozen-head path through autograd: a loss on logp (and on the entropy, which takes the fallback) vs fp64
    h, w, b, y, c = _inputs(11, 29, 203, dtype, device=backend_device(backend, device))
    e = torch.randn(11, generator=torch.Generator().manual_seed(7)).to(h.device)
    kw = dict(softcap=3.0, temperature=0.8)
    t = LogitTransform(**kw)
    leaf = h.clone().requires_grad_()
    logp, ent = head_ops.linear_logprobs_path(HeadOperands(leaf, w, y, b, t), backend, "auto", "chunked")
    ((c * logp).sum() + ((e * ent).sum() if entropy_grad else 0.0)).backward()
    ref_leaf = h.to(F64).requires_grad_()
    ref_logp, ref_ent = reference.logprobs_and_entropy(ref_leaf, w, y, b, compute_dtype=F64, **kw)
    ((c * ref_logp).sum() + ((e * ref_ent).sum() if entropy_grad else 0.0)).backward()
    torch.testing.assert_close(logp, ref_logp.float(), rtol=1e-5, atol=2e-5)
    torch.testing.assert_close(ent, ref_ent.float(), rtol=1e-5, atol=2e-5)
    assert_grad_close(leaf.grad, ref_leaf.grad.float(), dtype, "hidden")


@pytest.mark.interpreter_only  # FlopCounterMode counts the CPU path's fp32 GEMMs
def test_triton_path_host_gemms_are_two_vocabulary_sweeps():
    # the Triton path's cuBLAS / torch GEMMs (its Triton kernel has no dot), on a shape the interpreter runs quickly;
    # the token-row products run in blocks of gemm.TOKEN_GEMM_ROWS rows (a call's last block padded, its padding
    # counted too): token chunks of whole blocks, so the count is the sweeps' own
    block = gemm.token_gemm_rows(torch.device("cpu"))  # _inputs' device
    N, D, V = 2 * block, 32, 512
    h, w, b, y, _ = _inputs(N, D, V, torch.float32)
    cfg = kconfig.frozen_head_config(h.device)
    head = HeadOperands(h, w, y, b, LogitTransform())
    flops = matmul_flops(lambda: kfrozen.forward_frozen_head(head, True, cfg, token_chunk=block, vocab_chunk=128))
    assert flops == 2 * (2 * N * D * V)


def _loss_batch(B=3, T=7, D=24, V=150, dtype=torch.float32, seed=3, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(B, T, D, generator=g) * 0.5).to(dtype)
    weight = (torch.randn(V, D, generator=g) * 0.5).to(dtype)
    targets = torch.randint(0, V, (B, T), generator=g)
    mask = torch.rand(B, T, generator=g) > 0.3
    mask[1, 1:] = False  # a one-token completion
    mask[1, 0] = True
    mask[2] = False  # a fully masked row
    adv = torch.randn(B, generator=g)
    logp = reference.logprobs(hidden, weight, targets)
    batch = dict(
        hidden=hidden,
        weight=weight,
        targets=targets,
        mask=mask,
        adv=adv,
        old=logp + 0.3 * torch.randn(B, T, generator=g),
        ref=logp + 0.3 * torch.randn(B, T, generator=g),
    )
    return {name: x.to(device) for name, x in batch.items()}


def _frozen_forward_calls(monkeypatch):
    """A list that grows by one each time the frozen-head forward runs."""
    calls = []
    original = backends.head_forward_frozen_head
    monkeypatch.setattr(backends, "head_forward_frozen_head", lambda *a: calls.append(1) or original(*a))
    return calls


def _loss_inputs(x):
    """A ``_loss_batch``'s (targets, advantages, mask) and keywords (old and reference log-probs, beta)."""
    return (x["targets"], x["adv"], x["mask"]), dict(old_logprobs=x["old"], ref_logprobs=x["ref"], beta=0.04)


def _loss_grad_hidden(x, weight_requires_grad, backend, **kw):
    hidden = x["hidden"].clone().requires_grad_()
    weight = x["weight"].clone().requires_grad_(weight_requires_grad)
    labels, keywords = _loss_inputs(x)
    loss, metrics = grpo_fast.loss(hidden, weight, *labels, backend=backend, **keywords, **kw)
    loss.backward()
    return loss, metrics, hidden.grad


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "loss_kw",
    [
        dict(loss_type="dapo"),
        dict(loss_type="grpo", importance_sampling_level="sequence"),
        dict(loss_type="cispo", softcap=4.0, temperature=0.7),
        dict(loss_type="dapo", entropy_coef=0.01),
    ],
)
def test_loss_with_a_frozen_weight_equals_the_recompute_path_and_the_reference(backend, dtype, loss_kw, device):
    """grpo_fast.loss with a frozen weight (the frozen-head path; with an entropy bonus, the general path) gives the
    loss, metrics and dH of the same call with a trainable weight (the recompute path) and of the fp64 spec."""
    x = _loss_batch(dtype=dtype, device=backend_device(backend, device))
    frozen_loss, frozen_metrics, frozen_dh = _loss_grad_hidden(x, False, backend, **loss_kw)
    loss, metrics, dh = _loss_grad_hidden(x, True, backend, **loss_kw)
    torch.testing.assert_close(frozen_loss, loss, rtol=1e-6, atol=1e-7)
    for name in metrics:
        torch.testing.assert_close(frozen_metrics[name], metrics[name], rtol=1e-6, atol=1e-7, equal_nan=True)
    assert_grad_close(frozen_dh, dh.float().to(dtype), dtype, "frozen vs recompute")
    hidden = x["hidden"].to(F64).requires_grad_()
    labels, keywords = _loss_inputs(x)
    ref_loss, _ = reference.loss(hidden, x["weight"].to(F64), *labels, compute_dtype=F64, **keywords, **loss_kw)
    ref_loss.backward()
    assert_grad_close(frozen_dh, hidden.grad.float(), dtype, "frozen vs fp64 spec")


def test_loss_takes_the_frozen_path_only_when_it_can(monkeypatch):
    """With a frozen weight and no entropy bonus grpo_fast.loss builds J in the forward; with a trainable weight, an
    entropy bonus or no gradient at all it does not."""
    calls = _frozen_forward_calls(monkeypatch)
    x = _loss_batch()
    _loss_grad_hidden(x, False, "torch")
    assert len(calls) == 1
    _loss_grad_hidden(x, True, "torch")
    _loss_grad_hidden(x, False, "torch", entropy_coef=0.01)
    with torch.no_grad():
        grpo_fast.loss(x["hidden"], x["weight"], x["targets"], x["adv"], x["mask"])
    assert len(calls) == 1


def test_loss_with_a_frozen_head_does_two_vocabulary_sweeps():
    """The required count: B 4, T 64, D 256, V 8192, frozen weight, grpo_fast.loss then backward on the CPU path:
    at most 2.2 x 2NDV matmul FLOPs (the recompute path, with a trainable weight's dW products left out by
    freezing, did 3.0)."""
    B, T, D, V = 4, 64, 256, 8192
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(B, T, D, generator=g, requires_grad=True)
    weight = torch.randn(V, D, generator=g) * 0.05
    targets = torch.randint(0, V, (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.bool)

    def step():
        loss, _ = grpo_fast.loss(hidden, weight, targets, torch.randn(B, generator=g), mask, backend="torch")
        loss.backward()

    assert matmul_flops(step) / (2 * B * T * D * V) <= 2.2


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_general_head_path_turns_the_frozen_path_off(backend, monkeypatch, device):
    """head_path="general" (the benchmark's comparison row) takes the general path with a frozen weight, "auto" the
    frozen-head path, with the same dH; an unknown head path or backward mode is an error naming the argument."""
    calls = _frozen_forward_calls(monkeypatch)
    h, w, b, y, c = _inputs(11, 29, 203, torch.float32, device=backend_device(backend, device))
    t = LogitTransform(temperature=0.8)

    def grad_hidden(head_path, backward_mode="chunked"):
        leaf = h.clone().requires_grad_()
        logp, _ = head_ops.linear_logprobs_path(HeadOperands(leaf, w, y, b, t), backend, head_path, backward_mode)
        (c * logp).sum().backward()
        return leaf.grad

    general = grad_hidden("general")
    assert calls == []
    frozen_head = grad_hidden("auto")
    assert calls == [1]
    assert_grad_close(frozen_head, general, torch.float32, "frozen head vs general")
    with pytest.raises(ValueError, match="head_path must be one of"):
        grad_hidden("recompute")
    with pytest.raises(ValueError, match="backward_mode must be one of"):
        grad_hidden("general", "atomic")


def test_logprobs_and_entropy_takes_the_frozen_path_unless_told_the_entropy_trains(monkeypatch):
    calls = _frozen_forward_calls(monkeypatch)
    x = _loss_batch()
    hidden = x["hidden"].clone().requires_grad_()
    grpo_fast.logprobs_and_entropy(hidden, x["weight"], x["targets"], backend="torch")
    assert calls == [1]
    grpo_fast.logprobs_and_entropy(hidden, x["weight"], x["targets"], entropy_grad=True, backend="torch")
    assert calls == [1]
    with pytest.raises(TypeError, match="entropy_grad must be a bool"):
        grpo_fast.logprobs_and_entropy(hidden, x["weight"], x["targets"], entropy_grad="yes")
