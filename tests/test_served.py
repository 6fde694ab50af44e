"""Distillation from a served teacher (``grpo_fast.served_divergence_and_entropy`` / ``served_distillation_loss``):
the spec against TRL 1.16's experimental trainers' own loss functions, each backend against the fp64 spec (values,
metrics and every gradient, three dtypes), the dense divergence at K = V, and the named errors."""

import math

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters
from torch._subclasses.fake_tensor import FakeTensorMode

import grpo_fast
from grpo_fast import reference
from grpo_fast.served import teacher as served_teacher
from tests.conftest import assert_grad_close, backend_device

F64 = torch.float64
BETAS = (0.0, 0.5, 1.0)


def _served_batch(B=3, T=5, D=24, V=61, K=6, dtype=torch.float32, seed=0, device="cpu", bias=True, sharp=1.0):
    """Student inputs and a teacher's top-K lists: a random teacher head's log-probs at its K largest entries,
    rank-sorted, the sampled token appended where it ranks lower (a server's prompt_logprobs), with gaps: a token
    with no entries, a token with fewer, a masked token."""
    g = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(B, T, D, generator=g) * 0.6).to(dtype)
    weight = (torch.randn(V, D, generator=g) * 0.6).to(dtype)
    b = (torch.randn(V, generator=g) * 0.3).to(dtype) if bias else None
    teacher_logits = torch.randn(B, T, V, generator=g, dtype=F64) * 2.0 * sharp
    teacher_lp = teacher_logits.log_softmax(-1)
    targets = torch.randint(0, V, (B, T), generator=g)
    targets[0, 1] = teacher_lp[0, 1].argmax()  # the sampled token is the teacher's top-1 (T >= 2)
    top = teacher_lp.topk(K - 1, dim=-1)
    ids = torch.full((B, T, K), -1, dtype=torch.int64)
    lps = torch.full((B, T, K), -math.inf, dtype=F64)
    ids[..., : K - 1], lps[..., : K - 1] = top.indices, top.values
    listed = (top.indices == targets[..., None]).any(-1)
    ids[..., K - 1] = torch.where(listed, -1, targets)
    lps[..., K - 1] = torch.where(listed, -math.inf, teacher_lp.gather(-1, targets[..., None])[..., 0])
    mask = torch.ones(B, T, dtype=torch.bool)
    if B >= 3 and T >= 5:
        ids[1, 2] = -1  # no entry at all
        ids[2, 0, 3:] = -1  # fewer
        mask[2, 4] = False
    lps = torch.where(ids >= 0, lps, 0.0)
    to = dict(device=device)
    return dict(
        hidden=hidden.to(**to),
        weight=weight.to(**to),
        bias=b.to(**to) if b is not None else None,
        ids=ids.to(**to),
        logprobs=lps.float().to(**to),
        targets=targets.to(**to),
        mask=mask.to(**to),
        teacher_logits=teacher_logits.to(**to),
    )


# ----------------------------------------------------------------------------------------------- the spec vs TRL
def _trl_loss(batch, beta, tail, temperature, softcap, logit_scale):
    """TRL 1.16's AsyncDistillationTrainer loss pieces on the batch: (sum of the divergence, its gradients wrt
    hidden and weight, the summed student entropy, the summed teacher entropy), over the tokens TRL scores."""
    trainer = pytest.importorskip("trl.experimental.async_distillation.async_distillation_trainer")
    h = batch["hidden"].float().reshape(-1, batch["hidden"].shape[-1]).clone().requires_grad_()
    w = batch["weight"].float().clone().requires_grad_()
    ids = batch["ids"].reshape(-1, batch["ids"].shape[-1])
    lps = batch["logprobs"].reshape(-1, ids.shape[-1])
    lps = torch.where(ids >= 0, lps, -math.inf)
    wide = ids != -1
    if beta == 0.0:
        target_ids, teacher_lps, valid = ids, lps, wide
    else:
        target_ids, teacher_lps, valid = trainer._narrow_top1_actual_support(
            ids, lps, batch["targets"].reshape(-1), wide, beta
        )
    rows = batch["mask"].reshape(-1) & valid.any(-1)
    b = batch["bias"].float() if batch["bias"] is not None else None
    loss, _, entropy, teacher_entropy, _ = trainer._jsd_loss_chunk(
        h[rows], w, b, logit_scale, softcap, target_ids[rows], teacher_lps[rows], valid[rows], beta, temperature,
        tail, None, 1,
    )  # fmt: skip
    loss.backward()
    return loss.detach(), h.grad.reshape(batch["hidden"].shape), w.grad, entropy, teacher_entropy, rows


@pytest.mark.parametrize("beta", BETAS)
@pytest.mark.parametrize("tail", [True, False])
@pytest.mark.parametrize("head", [dict(), dict(temperature=0.7, softcap=3.0, logit_scale=1.3)])
def test_spec_matches_trl(beta, tail, head):
    batch = _served_batch(bias=False)
    temperature, softcap, scale = head.get("temperature", 1.0), head.get("softcap"), head.get("logit_scale", 1.0)
    trl_sum, trl_dh, trl_dw, trl_entropy, trl_teacher_entropy, rows = _trl_loss(
        batch, beta, tail, temperature, softcap, scale
    )
    h = batch["hidden"].to(F64).requires_grad_()
    w = batch["weight"].to(F64).requires_grad_()
    div, entropy = reference.served_divergence_and_entropy(
        h, w, batch["ids"], batch["logprobs"], batch["mask"], targets=batch["targets"], beta=beta,
        temperature=temperature, add_tail_bucket=tail, student_softcap=softcap, student_logit_scale=scale,
        compute_dtype=F64,
    )  # fmt: skip
    div.sum().backward()
    assert div.sum().item() == pytest.approx(trl_sum.item(), rel=2e-5, abs=1e-6)
    torch.testing.assert_close(h.grad.float(), trl_dh, rtol=1e-4, atol=2e-6)
    torch.testing.assert_close(w.grad.float(), trl_dw, rtol=1e-4, atol=2e-6)
    flat = entropy.reshape(-1)
    assert flat[rows].sum().item() == pytest.approx(trl_entropy.item(), rel=1e-5)
    # a token TRL drops (no teacher entry) has divergence 0 here
    assert (div.reshape(-1)[~rows] == 0).all()
    # TRL's teacher_entropy metric: the teacher's entropy over the support (served.teacher.teacher_entropy)
    K = batch["ids"].shape[-1]
    support = served_teacher.support(
        batch["ids"].reshape(-1, K), batch["logprobs"].reshape(-1, K), batch["targets"].reshape(-1), beta
    )
    ours = served_teacher.teacher_entropy(support, tail)
    assert ours[rows].sum().item() == pytest.approx(trl_teacher_entropy.item(), rel=1e-5, abs=1e-6)
    assert (ours[~support.valid.any(-1)] == 0).all()


# ----------------------------------------------------------------------------------------------- product vs spec
def _spec(batch, beta, tail, **head):
    leaves = {k: batch[k].to(F64).requires_grad_() for k in ("hidden", "weight", "bias") if batch[k] is not None}
    div, entropy = reference.served_divergence_and_entropy(
        leaves["hidden"], leaves["weight"], batch["ids"], batch["logprobs"], batch["mask"], targets=batch["targets"],
        beta=beta, add_tail_bucket=tail, student_bias=leaves.get("bias"), compute_dtype=F64, **head,
    )  # fmt: skip
    return div, entropy, leaves


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("beta", BETAS)
@pytest.mark.parametrize("tail", [True, False])
def test_matches_the_spec(backend, dtype, beta, tail, device):
    batch = _served_batch(dtype=dtype, device=backend_device(backend, device))
    head = dict(temperature=0.8, student_softcap=4.0)
    div, entropy, leaves = _spec(batch, beta, tail, **head)
    upstream = torch.randn(div.shape, generator=torch.Generator().manual_seed(5), dtype=F64)
    (upstream * div).sum().backward()
    ours = {k: batch[k].clone().requires_grad_() for k in ("hidden", "weight", "bias")}
    teacher = grpo_fast.ServedTeacher(batch["ids"], batch["logprobs"], add_tail_bucket=tail)
    got, got_entropy = grpo_fast.served_divergence_and_entropy(
        ours["hidden"], ours["weight"], teacher, batch["mask"], targets=batch["targets"], beta=beta,
        student_bias=ours["bias"], backend=backend, **head,
    )  # fmt: skip
    (upstream.to(got) * got).sum().backward()
    torch.testing.assert_close(got, div.float().to(got.device), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_entropy, entropy.float().to(got.device), rtol=1e-5, atol=1e-5)
    assert not got_entropy.requires_grad
    for name in ("hidden", "weight", "bias"):
        assert_grad_close(ours[name].grad, leaves[name].grad.to(dtype), dtype, name)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_loss_reduction_and_frozen_head(backend, device):
    """The loss is the scored tokens' sum over their count (or num_items_in_batch); with only the hidden states
    requiring a gradient (a frozen head: layer 1's frozen-head path) the gradient is the spec's."""
    batch = _served_batch(device=backend_device(backend, device))
    teacher = grpo_fast.ServedTeacher(batch["ids"], batch["logprobs"])
    spec_loss, _, _ = reference.served_distillation_loss(
        batch["hidden"].to(F64), batch["weight"].to(F64), batch["ids"], batch["logprobs"], batch["mask"],
        student_bias=batch["bias"].to(F64), compute_dtype=F64,
    )  # fmt: skip
    h = batch["hidden"].clone().requires_grad_()
    loss, div, entropy = grpo_fast.served_distillation_loss(
        h, batch["weight"], teacher, batch["mask"], student_bias=batch["bias"], backend=backend
    )
    assert loss.item() == pytest.approx(spec_loss.item(), rel=1e-5)
    assert div.shape == entropy.shape == batch["mask"].shape and not div.requires_grad
    loss.backward()
    ref_h = batch["hidden"].to(F64).requires_grad_()
    ref_loss, _, _ = reference.served_distillation_loss(
        ref_h, batch["weight"].to(F64), batch["ids"], batch["logprobs"], batch["mask"],
        student_bias=batch["bias"].to(F64), compute_dtype=F64,
    )  # fmt: skip
    ref_loss.backward()
    assert_grad_close(h.grad, ref_h.grad.float(), torch.float32, "hidden")
    scaled, _, _ = grpo_fast.served_distillation_loss(
        batch["hidden"], batch["weight"], teacher, batch["mask"], student_bias=batch["bias"], backend=backend,
        num_items_in_batch=40,
    )  # fmt: skip
    count = int(batch["mask"].sum())
    assert scaled.item() == pytest.approx(loss.item() * count / 40, rel=1e-6)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_every_id_listed_is_the_dense_forward_kl(backend, device):
    """K = V without a tail bucket: the teacher's whole distribution listed, the served forward KL is the dense one
    (``grpo_fast.divergence`` at beta 0 against the same teacher head), gradients alike."""
    dev = backend_device(backend, device)
    g = torch.Generator().manual_seed(3)
    B, T, D, Dt, V = 2, 3, 16, 12, 37
    hidden, weight = torch.randn(B, T, D, generator=g).to(dev), (torch.randn(V, D, generator=g) * 0.5).to(dev)
    t_hidden, t_weight = torch.randn(B, T, Dt, generator=g).to(dev), (torch.randn(V, Dt, generator=g) * 0.5).to(dev)
    t_lp = (t_hidden @ t_weight.T / 0.9).log_softmax(-1)
    order = t_lp.argsort(-1, descending=True)
    teacher = grpo_fast.ServedTeacher(order, t_lp.gather(-1, order), add_tail_bucket=False)
    h1, h2 = hidden.clone().requires_grad_(), hidden.clone().requires_grad_()
    served, _ = grpo_fast.served_divergence_and_entropy(h1, weight, teacher, temperature=0.9, backend=backend)
    dense = grpo_fast.divergence(h2, weight, t_hidden, t_weight, beta=0.0, temperature=0.9, backend=backend)
    torch.testing.assert_close(served, dense, rtol=1e-5, atol=1e-6)
    served.sum().backward()
    dense.sum().backward()
    torch.testing.assert_close(h1.grad, h2.grad, rtol=1e-4, atol=1e-6)


# ----------------------------------------------------------------------------------------------- errors
def test_named_errors():
    batch = _served_batch()
    h, w, mask, targets = batch["hidden"], batch["weight"], batch["mask"], batch["targets"]
    teacher = grpo_fast.ServedTeacher(batch["ids"], batch["logprobs"])
    call = grpo_fast.served_divergence_and_entropy
    with pytest.raises(TypeError, match="grpo_fast.ServedTeacher"):
        call(h, w, (batch["ids"], batch["logprobs"]), mask)
    with pytest.raises(TypeError, match="teacher.ids must be an integer tensor"):
        call(h, w, teacher._replace(ids=batch["ids"].float()), mask)
    with pytest.raises(TypeError, match="teacher.logprobs must be float32"):
        call(h, w, teacher._replace(logprobs=batch["logprobs"].double()), mask)
    with pytest.raises(ValueError, match=r"teacher.ids must have shape \[B, T, K\]"):
        call(h, w, teacher._replace(ids=batch["ids"][:, :2]), mask)
    with pytest.raises(ValueError, match="teacher.logprobs must have teacher.ids' shape"):
        call(h, w, teacher._replace(logprobs=batch["logprobs"][..., :2]), mask)
    with pytest.raises(ValueError, match="targets .the sampled tokens. are needed for beta != 0"):
        call(h, w, teacher, mask, beta=0.5)
    with pytest.raises(ValueError, match="beta"):
        call(h, w, teacher, mask, beta=1.5)
    with pytest.raises(TypeError, match=r"served_distillation_loss\(\) got an unexpected keyword argument 'bета'"):
        grpo_fast.served_distillation_loss(h, w, teacher, mask, bета=0.5)
    bad_ids = batch["ids"].clone()
    bad_ids[0, 0, 0] = w.shape[0]
    with pytest.raises(ValueError, match=r"teacher.ids must hold token ids in \[0, V\)"):
        call(h, w, teacher._replace(ids=bad_ids), mask)
    positive = batch["logprobs"].clone()
    positive[1, 1, 0] = 0.5
    with pytest.raises(ValueError, match=r"teacher.logprobs\[1, 1\] holds a log-prob above 0"):
        call(h, w, teacher._replace(logprobs=positive), mask)
    heavy = batch["logprobs"].clone()
    heavy[0, 3, :3] = math.log(0.45)
    with pytest.raises(ValueError, match=r"teacher.logprobs\[0, 3\] sum to a probability above 1"):
        call(h, w, teacher._replace(logprobs=heavy), mask)
    twice = batch["ids"].clone()
    twice[0, 0, 1] = twice[0, 0, 0]
    with pytest.raises(ValueError, match="an id twice"):
        call(h, w, teacher._replace(ids=twice), mask)
    unsorted = batch["logprobs"].clone()
    unsorted[0, 2, [0, 1]] = unsorted[0, 2, [1, 0]]
    with pytest.raises(ValueError, match="rank-sorted"):
        call(h, w, teacher._replace(logprobs=unsorted), mask, targets=targets, beta=0.5)
    # masked tokens are not checked, and check_values=False reads nothing
    call(h, w, teacher._replace(ids=bad_ids), mask, check_values=False)
    with pytest.raises(TypeError, match="num_items_in_batch"):
        grpo_fast.served_distillation_loss(h, w, teacher, mask, num_items_in_batch=torch.ones(2))


def test_nan_teacher_logprob_is_never_hidden():
    batch = _served_batch()
    lps = batch["logprobs"].clone()
    lps[0, 0, 1] = math.nan
    teacher = grpo_fast.ServedTeacher(batch["ids"], lps)
    div, _ = grpo_fast.served_divergence_and_entropy(batch["hidden"], batch["weight"], teacher, batch["mask"])
    assert div[0, 0].isnan() and div.isnan().sum() == 1


# ----------------------------------------------------------------------------------------------- more heads and inputs
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_lora_on_the_student_head(backend, device):
    """LoRA's pair gets the spec's gradients (the merged weight W + scaling B A in fp64), beta 0.5, a tail bucket."""
    dev = backend_device(backend, device)
    batch = _served_batch(device=dev, bias=False)
    g = torch.Generator().manual_seed(9)
    a = (torch.randn(4, batch["hidden"].shape[-1], generator=g) * 0.3).to(dev)
    b = (torch.randn(batch["weight"].shape[0], 4, generator=g) * 0.3).to(dev)
    ref = {"a": a.to(F64).requires_grad_(), "b": b.to(F64).requires_grad_(), "h": batch["hidden"].to(F64)}
    ref["h"].requires_grad_()
    merged = batch["weight"].to(F64) + 2.0 * ref["b"] @ ref["a"]
    div, _ = reference.served_divergence_and_entropy(
        ref["h"], merged, batch["ids"], batch["logprobs"], batch["mask"], targets=batch["targets"], beta=0.5,
        compute_dtype=F64,
    )  # fmt: skip
    div.sum().backward()
    ours = {"a": a.clone().requires_grad_(), "b": b.clone().requires_grad_(), "h": batch["hidden"].clone()}
    ours["h"].requires_grad_()
    got, _ = grpo_fast.served_divergence_and_entropy(
        ours["h"], batch["weight"], grpo_fast.ServedTeacher(batch["ids"], batch["logprobs"]), batch["mask"],
        targets=batch["targets"], beta=0.5, lora=grpo_fast.HeadLora(ours["a"], ours["b"], 2.0), backend=backend,
    )  # fmt: skip
    got.sum().backward()
    torch.testing.assert_close(got, div.float().to(dev), rtol=1e-5, atol=1e-5)
    for name in ("a", "b", "h"):
        assert_grad_close(ours[name].grad, ref[name].grad.float(), torch.float32, name)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("sharp", [0.05, 6.0], ids=["tail_mass_near_1", "tail_mass_near_0"])
@pytest.mark.parametrize("teacher_dtype", [torch.float32, torch.bfloat16])
def test_tail_mass_extremes_and_teacher_dtypes(backend, sharp, teacher_dtype, device):
    """A flat teacher (its top-K hold little: the tail bucket near 1) and a sharp one (near 0); the teacher's
    log-probs in fp32 and bf16 (the spec reads the same rounded values); a confident student at sharp 6."""
    batch = _served_batch(device=backend_device(backend, device), sharp=sharp)
    batch["hidden"] = batch["hidden"] * (4.0 if sharp > 1 else 1.0)
    batch["logprobs"] = batch["logprobs"].to(teacher_dtype)
    div, _, leaves = _spec(batch, 0.0, True)
    div.sum().backward()
    ours = {k: batch[k].clone().requires_grad_() for k in ("hidden", "weight", "bias")}
    got, _ = grpo_fast.served_divergence_and_entropy(
        ours["hidden"], ours["weight"], grpo_fast.ServedTeacher(batch["ids"], batch["logprobs"]), batch["mask"],
        student_bias=ours["bias"], backend=backend,
    )  # fmt: skip
    got.sum().backward()
    torch.testing.assert_close(got, div.float().to(got.device), rtol=1e-5, atol=1e-5)
    for name in ("hidden", "weight", "bias"):
        assert_grad_close(ours[name].grad, leaves[name].grad.float(), torch.float32, name)


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("frozen", [False, True], ids=["general", "frozen_head"])
def test_fake_and_meta_tensors_run_forward_and_backward(backend, frozen, device):
    def run(dev):
        batch = _served_batch(device=dev)
        hidden = batch["hidden"].requires_grad_()
        weight = batch["weight"].requires_grad_(not frozen)
        teacher = grpo_fast.ServedTeacher(batch["ids"], batch["logprobs"])
        loss, div, entropy = grpo_fast.served_distillation_loss(
            hidden, weight, teacher, batch["mask"], targets=batch["targets"], beta=0.5, backend=backend
        )
        assert loss.shape == () and div.shape == entropy.shape == batch["mask"].shape
        loss.backward()
        assert hidden.grad.shape == hidden.shape and (weight.grad is None) == frozen
        return loss

    dev = backend_device(backend, device)
    with FakeTensorMode():
        run(dev)
    if dev.type == "cpu":
        assert run("meta").device.type == "meta"


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_compiled_step_is_one_graph_equal_to_eager(backend, device):
    dev = backend_device(backend, device)
    weight = _served_batch(device=dev)["weight"].requires_grad_()

    def step(hidden, ids, logprobs, mask):
        loss, _, _ = grpo_fast.served_distillation_loss(
            hidden, weight, grpo_fast.ServedTeacher(ids, logprobs), mask, temperature=0.9, backend=backend
        )
        loss.backward()
        return loss.detach()

    torch._dynamo.reset()
    counters.clear()
    with torch._dynamo.config.patch(trace_autograd_ops=True):
        compiled = torch.compile(step, fullgraph=True, dynamic=True, backend="aot_eager")
        for seed, (B, T) in enumerate([(3, 5), (4, 7), (5, 6)]):
            batch = _served_batch(B=B, T=T, seed=seed, device=dev)
            hidden = batch["hidden"].requires_grad_()
            results = []
            for fn in (step, compiled):
                hidden.grad = weight.grad = None
                results.append((fn(hidden, batch["ids"], batch["logprobs"], batch["mask"]), hidden.grad, weight.grad))
            for eager, comp in zip(*results, strict=True):
                torch.testing.assert_close(comp, eager, rtol=1e-5, atol=1e-5)
    assert counters["stats"]["unique_graphs"] == 1


@pytest.mark.parametrize("check_values", [True, False])
def test_host_synchronisations(check_values, monkeypatch, device):
    """One host synchronisation with the value checks (the teacher's flags read with the student's), none without,
    forward and backward, on the Triton path."""
    from tests.test_host_syncs import count_syncs

    batch = _served_batch(device=device)
    hidden, weight = batch["hidden"].requires_grad_(), batch["weight"].requires_grad_()
    teacher = grpo_fast.ServedTeacher(batch["ids"], batch["logprobs"])

    def step():
        loss, _, _ = grpo_fast.served_distillation_loss(
            hidden, weight, teacher, batch["mask"], targets=batch["targets"], beta=0.5, backend="triton",
            check_values=check_values,
        )  # fmt: skip
        loss.backward()

    _, syncs = count_syncs(step, monkeypatch)
    assert len(syncs) == (1 if check_values else 0), syncs


# ----------------------------------------------------------------------------------------------- the fused loss
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("beta", BETAS)
@pytest.mark.parametrize("tail", [True, False])
def test_trained_head_loss_matches_the_spec(dtype, beta, tail, device):
    """The Triton backend's three-sweep loss (a trained weight): loss, divergence, entropy and dH / dW / db against
    the fp64 spec, token chunks smaller than the rows (several chunks)."""
    batch = _served_batch(dtype=dtype, device=device)
    head = dict(temperature=0.8, student_softcap=4.0)
    div, entropy, leaves = _spec(batch, beta, tail, **head)
    spec_loss = div.sum() / batch["mask"].sum()
    spec_loss.backward()
    ours = {k: batch[k].clone().requires_grad_() for k in ("hidden", "weight", "bias")}
    teacher = grpo_fast.ServedTeacher(batch["ids"], batch["logprobs"], add_tail_bucket=tail)
    loss, got_div, got_entropy = grpo_fast.served_distillation_loss(
        ours["hidden"], ours["weight"], teacher, batch["mask"], targets=batch["targets"], beta=beta,
        student_bias=ours["bias"], backend="triton", token_chunk=4, **head,
    )  # fmt: skip
    (2.0 * loss).backward()
    assert loss.item() == pytest.approx(spec_loss.item(), rel=1e-5, abs=1e-7)
    torch.testing.assert_close(got_div, div.float().detach().to(device), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_entropy, entropy.float().to(device), rtol=1e-5, atol=1e-5)
    for name in ("hidden", "weight", "bias"):
        assert_grad_close(ours[name].grad, 2.0 * leaves[name].grad.to(dtype), dtype, name)


@pytest.mark.interpreter_only  # FlopCounterMode counts the CPU path's fp32 GEMMs
@pytest.mark.parametrize("weight_grad", [True, False], ids=["trained", "frozen"])
def test_vocabulary_sweeps(weight_grad):
    """The student's matmul FLOPs, forward and backward: a trained head three sweeps (the fused loss), a frozen
    head two (layer 1's frozen-head path); the K gathered rows are no GEMM."""
    from grpo_fast.kernels import gemm
    from tests.helpers import matmul_flops

    # token chunks of whole blocks of the token-row GEMMs (a padded block's rows would be counted too)
    block = gemm.token_gemm_rows(torch.device("cpu"))
    N, D, V = 2 * block, block, 256
    batch = _served_batch(B=2, T=block, D=D, V=V, bias=False)

    def run():
        hidden = batch["hidden"].clone().requires_grad_()
        weight = batch["weight"].clone().requires_grad_(weight_grad)
        chunk = dict(token_chunk=block) if weight_grad else {}
        teacher = grpo_fast.ServedTeacher(batch["ids"], batch["logprobs"])
        loss, _, _ = grpo_fast.served_distillation_loss(hidden, weight, teacher, backend="triton", **chunk)
        loss.backward()

    assert matmul_flops(run) == (3 if weight_grad else 2) * 2 * N * D * V


@pytest.mark.parametrize("beta", (0.0, 0.3, 1.0))
@pytest.mark.parametrize("tail", [True, False])
def test_written_out_gradients_equal_autograd(beta, tail):
    """``served.teacher.divergence_and_gradients`` (the fused loss's, inside its op) against autograd through
    ``divergence`` (the per-token path's), fp64, with a row without entries, a clamped tail and a clamped mixture."""
    batch = _served_batch(V=40, K=6)
    K = batch["ids"].shape[-1]
    rows = served_teacher.support(
        batch["ids"].reshape(-1, K), batch["logprobs"].reshape(-1, K).double(), batch["targets"].reshape(-1), beta
    )
    g = torch.Generator().manual_seed(2)
    z = torch.where(rows.ids >= 0, torch.randn(rows.ids.shape, generator=g, dtype=F64) * 2, -math.inf)
    lse = torch.logsumexp(torch.randn(z.shape[0], 40, generator=g, dtype=F64) * 2, -1)
    lse[0] = torch.logsumexp(z[0].masked_fill(~rows.valid[0], -math.inf), -1) + 1e-9  # the support holds ~all mass
    z.requires_grad_()
    lse.requires_grad_()
    div = served_teacher.divergence(z, lse, rows, beta, tail)
    grad_z, grad_lse = torch.autograd.grad(div.sum(), (z, lse), allow_unused=True)
    grad_z = torch.where(rows.valid, grad_z, 0.0)
    ours, our_z, our_lse = served_teacher.divergence_and_gradients(z.detach(), lse.detach(), rows, beta, tail)
    torch.testing.assert_close(ours, div.detach())
    torch.testing.assert_close(our_z, grad_z)
    torch.testing.assert_close(our_lse, grad_lse if grad_lse is not None else torch.zeros_like(our_lse))
    if beta == 0.0:  # the fused loss sums the rows with G before the student's logits exist: the teacher's alone
        pivot = served_teacher.support_pivot(z.detach(), rows)
        _, G, _ = served_teacher.gradient_factors(z.detach(), lse.detach(), rows, beta, tail, pivot)
        torch.testing.assert_close(served_teacher.teacher_entry_gradient(rows, tail), G, rtol=0, atol=0)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_teacher_served_at_another_temperature(backend, device):
    """Log-probs taken at temperature 1 (vLLM's prompt log-probs), a divergence at 0.7: without a tail bucket the
    teacher at 0.7 over its ids follows exactly (the spec given the teacher's own log-probs at 0.7); with one, an
    error naming the way out."""
    batch = _served_batch(device=backend_device(backend, device))
    ids = batch["ids"]
    at_07 = (batch["teacher_logits"] / 0.7).log_softmax(-1).gather(-1, ids.clamp(min=0))
    at_07 = torch.where(ids >= 0, at_07, 0.0)
    truth, _ = reference.served_divergence_and_entropy(
        batch["hidden"].to(F64), batch["weight"].to(F64), ids, at_07, batch["mask"], temperature=0.7,
        add_tail_bucket=False, student_bias=batch["bias"].to(F64), compute_dtype=F64,
    )  # fmt: skip
    teacher = grpo_fast.ServedTeacher(ids, batch["logprobs"], add_tail_bucket=False, temperature=1.0)
    got, _ = grpo_fast.served_divergence_and_entropy(
        batch["hidden"], batch["weight"], teacher, batch["mask"], temperature=0.7, student_bias=batch["bias"],
        backend=backend,
    )  # fmt: skip
    torch.testing.assert_close(got, truth.float(), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="a tail bucket needs the teacher's mass outside its ids"):
        grpo_fast.served_divergence_and_entropy(
            batch["hidden"], batch["weight"], teacher._replace(add_tail_bucket=True), temperature=0.7
        )
    # at its own temperature the record is as without one
    same = grpo_fast.served_divergence_and_entropy(
        batch["hidden"], batch["weight"], teacher._replace(temperature=0.7), batch["mask"], temperature=0.7,
        student_bias=batch["bias"], backend=backend,
    )[0]  # fmt: skip
    plain = grpo_fast.served_divergence_and_entropy(
        batch["hidden"], batch["weight"], teacher._replace(temperature=None), batch["mask"], temperature=0.7,
        student_bias=batch["bias"], backend=backend,
    )[0]  # fmt: skip
    assert torch.equal(same, plain)


# ----------------------------------------------------------------------------------------------- RL in the same call
@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
@pytest.mark.parametrize("beta", [0.0, 0.5])
def test_loss_with_a_served_teacher_is_the_two_calls(backend, loss_type, beta, device):
    """``grpo_fast.loss(..., teacher=ServedTeacher(...), distillation_coef=c)`` is ``loss`` without the teacher plus
    c times the loss type's reduction of the served divergence (``targets`` the sampled tokens), its gradients too,
    and reports the mean divergence as ``distillation_loss``."""
    batch = _served_batch(device=backend_device(backend, device))
    g = torch.Generator().manual_seed(4)
    advantages = torch.randn(batch["hidden"].shape[0], generator=g).to(batch["hidden"].device)
    teacher = grpo_fast.ServedTeacher(batch["ids"], batch["logprobs"])
    kw = dict(loss_type=loss_type, backend=backend, bias=batch["bias"])

    def leaves():
        return batch["hidden"].clone().requires_grad_(), batch["weight"].clone().requires_grad_()

    h1, w1 = leaves()
    combined, metrics = grpo_fast.loss(
        h1, w1, batch["targets"], advantages, batch["mask"], teacher=teacher, distillation_coef=0.3,
        distillation_beta=beta, **kw,
    )  # fmt: skip
    combined.backward()
    h2, w2 = leaves()
    alone, _ = grpo_fast.loss(h2, w2, batch["targets"], advantages, batch["mask"], **kw)
    div, _ = grpo_fast.served_divergence_and_entropy(
        h2, w2, teacher, batch["mask"], targets=batch["targets"], beta=beta, student_bias=batch["bias"],
        backend=backend,
    )  # fmt: skip
    options = grpo_fast.LossOptions(loss_type=loss_type)
    separate = alone + 0.3 * reference.aggregate(div, batch["mask"], options)
    separate.backward()
    assert combined.item() == pytest.approx(separate.item(), rel=1e-6, abs=1e-7)
    torch.testing.assert_close(h1.grad, h2.grad, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(w1.grad, w2.grad, rtol=1e-5, atol=1e-7)
    mask = batch["mask"]
    assert metrics["distillation_loss"].item() == pytest.approx((div.detach() * mask).sum().item() / mask.sum().item())


def test_unlisted_entries_are_never_read():
    """What a record holds where its ids are -1 (TRL pads with -inf) changes nothing, in the spec and the product."""
    batch = _served_batch(bias=False)
    padded = torch.where(batch["ids"] >= 0, batch["logprobs"], -math.inf)
    for beta in (0.0, 0.5):
        args = (batch["hidden"], batch["weight"])
        kw = dict(targets=batch["targets"], beta=beta)
        spec = [reference.served_divergence_and_entropy(*args, batch["ids"], lp, batch["mask"], **kw)[0]
                for lp in (batch["logprobs"], padded)]  # fmt: skip
        ours = [grpo_fast.served_divergence_and_entropy(*args, grpo_fast.ServedTeacher(batch["ids"], lp), batch["mask"],
                                                        **kw)[0] for lp in (batch["logprobs"], padded)]  # fmt: skip
        assert torch.equal(spec[0], spec[1]) and torch.equal(ours[0], ours[1]) and spec[0].isfinite().all()


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("tail", [True, False])
def test_one_listed_id(backend, tail, device):
    """K = 1 (a server's top-1, TRL's ServerDistillationTrainer default): the spec's values and gradients."""
    batch = _served_batch(K=2, device=backend_device(backend, device))
    batch["ids"], batch["logprobs"] = batch["ids"][..., :1].contiguous(), batch["logprobs"][..., :1].contiguous()
    div, _, leaves = _spec(batch, 0.0, tail)
    div.sum().backward()
    ours = {k: batch[k].clone().requires_grad_() for k in ("hidden", "weight", "bias")}
    got, _ = grpo_fast.served_divergence_and_entropy(
        ours["hidden"], ours["weight"], grpo_fast.ServedTeacher(batch["ids"], batch["logprobs"], tail), batch["mask"],
        student_bias=ours["bias"], backend=backend,
    )  # fmt: skip
    got.sum().backward()
    torch.testing.assert_close(got, div.float().to(got.device), rtol=1e-5, atol=1e-5)
    if not tail:
        assert (got == 0).all()  # one entry renormalised: both sides certain
    for name in ("hidden", "weight", "bias"):
        assert_grad_close(ours[name].grad, leaves[name].grad.float(), torch.float32, name)


def test_the_loss_takes_the_keywords_of_the_per_token_function():
    """One list of keywords for both functions: ServedKeywords names served_divergence_and_entropy's keyword-only
    parameters, each with its type (an IDE and a type checker see them on served_distillation_loss)."""
    import inspect
    import typing

    from grpo_fast.served.api import ServedKeywords

    signature = inspect.signature(grpo_fast.served_divergence_and_entropy)
    keywords = [name for name, p in signature.parameters.items() if p.kind is inspect.Parameter.KEYWORD_ONLY]
    hints = typing.get_type_hints(grpo_fast.served_divergence_and_entropy)
    assert typing.get_type_hints(ServedKeywords) == {name: hints[name] for name in keywords}
    assert list(ServedKeywords.__annotations__) == keywords
