"""Several teachers in one call (MOPD: ``grpo_fast.Teachers``, ``grpo_fast.multi_teacher_distillation_loss``,
``grpo_fast.teacher_metrics``): in-process teachers of different widths, transforms and biases and served ones of
different K, each row routed by its index, against the fp64 spec (loss, divergence, entropy, every student gradient,
three dtypes, both backends), against the one-teacher calls it composes, in its sweep count, and the named errors."""

import math

import pytest
import torch
from helpers import matmul_flops
from test_served import _served_batch

import grpo_fast
from grpo_fast import reference
from tests.conftest import assert_grad_close, backend_device

F64 = torch.float64
BETAS = (0.0, 0.5, 1.0)
# each row's teacher: teacher 0 three rows, 1 two, 2 one (in-process, in-process, served by default)
INDEX = (1, 0, 2, 0, 1, 0)
B, T, DS, V = len(INDEX), 5, 24, 61


def _batch(kinds=("dense", "dense", "served"), dtype=torch.float32, device="cpu", index=INDEX, seed=0):
    """The student's inputs [B, T], each row's teacher, and the teachers: in-process ones of widths 40, 16, ...
    (the first with a bias and a soft-cap, the second a logit scale), served ones of K = 5, 8, ... (top-k of a
    random teacher head, the sampled token appended: test_served's lists); a masked token, a fully masked row."""
    g = torch.Generator().manual_seed(seed)
    index = torch.tensor(index)
    batch = dict(
        hidden=(torch.randn(B, T, DS, generator=g) * 0.6).to(dtype),
        weight=(torch.randn(V, DS, generator=g) * 0.6).to(dtype),
        bias=(torch.randn(V, generator=g) * 0.3).to(dtype),
        targets=torch.randint(0, V, (B, T), generator=g),
    )
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[0, 3] = False
    mask[3] = False  # a row of teacher 0 without a scored token
    teachers, specs = [], []
    widths, ks = iter((40, 16, 33)), iter((5, 8, 4))
    for i, kind in enumerate(kinds):
        rows = (index == i).nonzero()[:, 0]
        if kind == "dense":
            D = next(widths)
            hidden = (torch.randn(len(rows), T, D, generator=g) * 0.6).to(dtype)
            weight = (torch.randn(V, D, generator=g) * 0.6).to(dtype)
            numbers = dict(bias=(torch.randn(V, generator=g) * 0.3).to(dtype), softcap=5.0) if i == 0 else {}
            numbers = numbers if i != 1 else dict(logit_scale=0.7)
            teachers.append(grpo_fast.Teacher(hidden, weight, **numbers))
            specs.append(dict(hidden=hidden.to(F64), weight=weight.to(F64), **{
                k: (v.to(F64) if isinstance(v, torch.Tensor) else v) for k, v in numbers.items()
            }))  # fmt: skip
        else:
            served = _served_batch(B=max(len(rows), 1), T=T, D=DS, V=V, K=next(ks), seed=seed + 10 + i)
            ids, logprobs = served["ids"][: len(rows)], served["logprobs"][: len(rows)]
            batch["targets"][rows] = served["targets"][: len(rows)]
            teachers.append(grpo_fast.ServedTeacher(ids, logprobs))
            specs.append(dict(ids=ids, logprobs=logprobs))
    to = dict(device=device)
    moved = []
    for t in teachers:  # every teacher tensor on the test's device
        if isinstance(t, grpo_fast.ServedTeacher):
            moved.append(t._replace(ids=t.ids.to(**to), logprobs=t.logprobs.to(**to)))
        else:
            bias = t.bias.to(**to) if t.bias is not None else None
            moved.append(grpo_fast.Teacher(t.hidden.to(**to), t.weight.to(**to), bias, t.softcap, t.logit_scale))
    batch = {k: v.to(**to) for k, v in batch.items()}
    return batch, mask.to(**to), index.to(**to), moved, specs


def _spec(batch, mask, index, specs, beta, num_items=None, **head):
    leaves = {k: batch[k].to(F64).requires_grad_() for k in ("hidden", "weight", "bias")}
    specs = [{k: v.to(index.device) if isinstance(v, torch.Tensor) else v for k, v in s.items()} for s in specs]
    loss, div, entropy = reference.multi_teacher_distillation_loss(
        leaves["hidden"], leaves["weight"], specs, index, mask, num_items, beta=beta, targets=batch["targets"],
        student_bias=leaves["bias"], compute_dtype=F64, **head,
    )  # fmt: skip
    loss.backward()
    return loss, div, entropy, leaves


def _ours(batch, mask, index, teachers, beta, backend, **options):
    ours = {k: batch[k].clone().requires_grad_() for k in ("hidden", "weight", "bias")}
    loss, div, entropy = grpo_fast.multi_teacher_distillation_loss(
        ours["hidden"], ours["weight"], grpo_fast.Teachers(teachers, index), mask, beta=beta,
        targets=batch["targets"], student_bias=ours["bias"], backend=backend, **options,
    )  # fmt: skip
    return loss, div, entropy, ours


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("beta", BETAS)
def test_matches_the_spec(backend, dtype, beta, device):
    """In-process and served teachers mixed: loss, per-token divergence and entropy, dH / dW / db against fp64;
    token chunks of 4 rows, so that chunks hold rows of two teachers."""
    dev = backend_device(backend, device)
    batch, mask, index, teachers, specs = _batch(dtype=dtype, device=dev)
    head = dict(temperature=0.8, student_softcap=4.0)
    spec_loss, div, entropy, leaves = _spec(batch, mask, index, specs, beta, **head)
    options = dict(token_chunk=4) if backend == "triton" else {}
    loss, got_div, got_entropy, ours = _ours(batch, mask, index, teachers, beta, backend, **head, **options)
    (2.0 * loss).backward()
    assert loss.item() == pytest.approx(spec_loss.item(), rel=1e-5, abs=1e-7)
    torch.testing.assert_close(got_div, div.float().to(dev), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_entropy, entropy.float().to(dev), rtol=1e-5, atol=1e-5)
    assert not got_div.requires_grad and not got_entropy.requires_grad
    for name in ("hidden", "weight", "bias"):
        assert_grad_close(ours[name].grad, 2.0 * leaves[name].grad.to(dtype), dtype, name)


@pytest.mark.parametrize("kinds", [("dense", "dense", "dense"), ("served", "served", "served")])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_one_kind_and_its_default_beta(kinds, backend, device):
    """Teachers all in-process take distillation_loss' default beta (1), all served served_distillation_loss'
    (0); against the spec at that beta, with num_items_in_batch."""
    dev = backend_device(backend, device)
    batch, mask, index, teachers, specs = _batch(kinds, device=dev)
    beta = 1.0 if kinds[0] == "dense" else 0.0
    spec_loss, div, _, leaves = _spec(batch, mask, index, specs, beta, num_items=40)
    loss, got_div, _, ours = _ours(batch, mask, index, teachers, None, backend, num_items_in_batch=40)
    loss.backward()
    assert loss.item() == pytest.approx(spec_loss.item(), rel=1e-5)
    as_tensor, _, _, _ = _ours(batch, mask, index, teachers, None, backend, num_items_in_batch=torch.tensor(40.0))
    assert as_tensor.item() == pytest.approx(loss.item(), rel=1e-6)  # a one-element tensor: its value not read
    torch.testing.assert_close(got_div, div.float().to(dev), rtol=1e-5, atol=1e-5)
    for name in ("hidden", "weight", "bias"):
        assert_grad_close(ours[name].grad, leaves[name].grad.float(), torch.float32, name)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_equals_the_one_teacher_calls(backend, device):
    """Each teacher's rows by its own distillation_loss / served_distillation_loss over the shared divisor: the
    same loss, divergence and gradients (the routing changes nothing a token sees); a frozen student head (only
    the hidden states take a gradient) too."""
    dev = backend_device(backend, device)
    batch, mask, index, teachers, _ = _batch(device=dev)
    divisor = int(mask.sum())
    for weight_grad in (True, False):
        ours = {k: batch[k].clone().requires_grad_(k != "weight" or weight_grad) for k in ("hidden", "weight")}
        loss, div, _ = grpo_fast.multi_teacher_distillation_loss(
            ours["hidden"], ours["weight"], grpo_fast.Teachers(teachers, index), mask, beta=0.5,
            targets=batch["targets"], backend=backend,
        )  # fmt: skip
        loss.backward()
        theirs = {k: batch[k].clone().requires_grad_(k != "weight" or weight_grad) for k in ("hidden", "weight")}
        total, expected = 0.0, torch.zeros_like(div)
        for i, teacher in enumerate(teachers):
            rows = (index == i).nonzero()[:, 0]
            h = theirs["hidden"][rows]
            if isinstance(teacher, grpo_fast.Teacher):
                part, d, _ = grpo_fast.distillation_loss(
                    h, theirs["weight"], teacher.hidden, teacher.weight, mask[rows], num_items_in_batch=divisor,
                    beta=0.5, teacher_bias=teacher.bias, teacher_softcap=teacher.softcap,
                    teacher_logit_scale=teacher.logit_scale, backend=backend,
                )  # fmt: skip
            else:
                part, d, _ = grpo_fast.served_distillation_loss(
                    h, theirs["weight"], teacher, mask[rows], num_items_in_batch=divisor, beta=0.5,
                    targets=batch["targets"][rows], backend=backend,
                )  # fmt: skip
            total, expected[rows] = total + part, d
        total.backward()
        assert loss.item() == pytest.approx(total.item(), rel=1e-6)
        torch.testing.assert_close(div, expected, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(ours["hidden"].grad, theirs["hidden"].grad, rtol=1e-5, atol=1e-8)
        if weight_grad:
            torch.testing.assert_close(ours["weight"].grad, theirs["weight"].grad, rtol=1e-5, atol=1e-8)
        else:
            assert ours["weight"].grad is None


@pytest.mark.interpreter_only
def test_three_student_sweeps_and_one_sweep_of_each_teacher():
    """The in-process teachers' fused loss (forward + backward, FlopCounterMode): the student's product, dH and dW
    over all their rows (3 sweeps) and each teacher's product over its own rows: 2 V (3 N Ds + sum_i N_i D_i)."""
    batch, _, index, teachers, _ = _batch(("dense", "dense", "dense"))
    counts = [int((index == i).sum()) * T for i in range(3)]
    widths = [t.hidden.shape[-1] for t in teachers]

    def run():
        hidden, weight = batch["hidden"].clone().requires_grad_(), batch["weight"].clone().requires_grad_()
        loss, _, _ = grpo_fast.multi_teacher_distillation_loss(
            hidden, weight, grpo_fast.Teachers(teachers, index), backend="triton", token_chunk=8
        )
        loss.backward()

    N = B * T
    assert matmul_flops(run) == 2 * V * (3 * N * DS + sum(n * d for n, d in zip(counts, widths, strict=True)))


def test_a_teacher_without_rows_and_the_metrics():
    """A teacher given no row this batch (its tensors [0, T, ...]) is skipped; teacher_metrics gives TRL's
    teacher_token_frac/<name> and teacher_jsd/<name> (NaN for a teacher without tokens)."""
    index = (0, 0, 2, 0, 2, 0)
    batch, mask, index_t, teachers, specs = _batch(index=index)
    assert teachers[1].hidden.shape[0] == 0
    spec_loss, div, _, _ = _spec(batch, mask, index_t, specs, 0.5)
    routed = grpo_fast.Teachers(teachers, index_t, names=["math", "code", "chat"])
    loss, got_div, _ = grpo_fast.multi_teacher_distillation_loss(
        batch["hidden"], batch["weight"], routed, mask, beta=0.5, targets=batch["targets"],
        student_bias=batch["bias"], backend="torch",
    )  # fmt: skip
    assert loss.item() == pytest.approx(spec_loss.item(), rel=1e-5)
    metrics = grpo_fast.teacher_metrics(routed, got_div, mask)
    names = ("math", "code", "chat")
    assert sorted(metrics) == sorted(f"teacher_{m}/{n}" for m in ("token_frac", "jsd") for n in names)
    scored = mask.float()
    for i, name in enumerate(("math", "code", "chat")):
        rows = (index_t == i).nonzero()[:, 0]
        count = scored[rows].sum()
        assert metrics[f"teacher_token_frac/{name}"].item() == pytest.approx((count / scored.sum()).item())
        if count == 0:
            assert math.isnan(metrics[f"teacher_jsd/{name}"].item())
        else:
            expected = (div.float()[rows] * scored[rows]).sum() / count
            assert metrics[f"teacher_jsd/{name}"].item() == pytest.approx(expected.item(), rel=1e-5)
    assert math.isnan(metrics["teacher_jsd/code"].item()) and metrics["teacher_token_frac/code"].item() == 0.0


def _trl_served_stats(batch, mask, index, teachers, beta, temperature):
    """TRL 1.16's AsyncDistillationTrainer on the served teachers' rows (their lists -1 padded to one K, as TRL's
    batch holds them; its support by beta): the per-teacher stats its MOPD metrics divide, [teachers, 3] (tokens,
    divergence sum, teacher entropy sum), and the [B, T] tokens it scores (masked in, with a teacher entry)."""
    trainer = pytest.importorskip("trl.experimental.async_distillation.async_distillation_trainer")
    served = [i for i, t in enumerate(teachers) if isinstance(t, grpo_fast.ServedTeacher)]
    K = max(teachers[i].ids.shape[-1] for i in served)
    ids = torch.full((B, T, K), -1, dtype=torch.int64)
    lps = torch.full((B, T, K), -math.inf)
    for i in served:
        rows, K_i = (index == i).nonzero()[:, 0], teachers[i].ids.shape[-1]
        ids[rows, :, :K_i] = teachers[i].ids
        lps[rows, :, :K_i] = torch.where(teachers[i].ids >= 0, teachers[i].logprobs, -math.inf)
    ids, lps, wide = ids.reshape(-1, K), lps.reshape(-1, K), ids.reshape(-1, K) >= 0
    if beta == 0.0:
        target_ids, teacher_lps, valid = ids, lps, wide
    else:
        target_ids, teacher_lps, valid = trainer._narrow_top1_actual_support(
            ids, lps, batch["targets"].reshape(-1), wide, beta
        )
    teacher_of = index.repeat_interleave(T)
    rows = mask.reshape(-1) & valid.any(-1) & torch.isin(teacher_of, torch.tensor(served))
    with torch.no_grad():
        _, _, _, _, stats = trainer._jsd_loss_chunk(
            batch["hidden"].reshape(B * T, -1)[rows], batch["weight"], batch["bias"], 1.0, None, target_ids[rows],
            teacher_lps[rows], valid[rows], beta, temperature, True, teacher_of[rows], len(teachers),
        )  # fmt: skip
    return stats.view(len(teachers), 3), rows.view(B, T)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("beta", BETAS)
def test_teacher_entropy_against_the_spec_and_trl(backend, beta, device):
    """return_teacher_entropy and teacher_metrics' teacher_entropy/<name>: an in-process teacher's entropy over the
    vocabulary (its bias, soft-cap and logit scale, at the temperature) per token against the fp64 spec, from the
    fused op's records (token chunks of 4 rows: chunks hold two teachers' rows); two served teachers' per-teacher
    means (and teacher_jsd/<name>) against TRL 1.16's AsyncDistillationTrainer's MOPD stats over the tokens it
    scores; NaN for a teacher without tokens; the other outputs unchanged by the flag."""
    dev = backend_device(backend, device)
    batch, mask, index, teachers, specs = _batch(("dense", "served", "served"))
    moved = _batch(("dense", "served", "served"), device=dev)[3]
    for listed in (teachers, moved):
        listed[1].ids[1, 2] = -1  # a token its teacher lists nothing for: TRL does not score it
    stats, trl_rows = _trl_served_stats(batch, mask, index, teachers, beta, 0.8)
    dense_rows = (index == 0)[:, None]
    scored = torch.where(dense_rows, mask, trl_rows)  # TRL's tokens on the served rows
    assert not trl_rows[4, 2] and mask[4, 2]
    routed = grpo_fast.Teachers(moved, index.to(dev), names=["math", "code", "chat"])
    options = dict(token_chunk=4) if backend == "triton" else {}
    call = dict(beta=beta, temperature=0.8, targets=batch["targets"].to(dev), student_bias=batch["bias"].to(dev))
    hidden, weight = batch["hidden"].to(dev), batch["weight"].to(dev)
    loss, div, entropy, teacher_entropy = grpo_fast.multi_teacher_distillation_loss(
        hidden, weight, routed, scored.to(dev), backend=backend, return_teacher_entropy=True, **call, **options
    )
    plain = grpo_fast.multi_teacher_distillation_loss(hidden, weight, routed, scored.to(dev), backend=backend, **call)
    assert len(plain) == 3
    for ours, theirs in zip((loss, div, entropy), plain, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
    assert not teacher_entropy.requires_grad and (teacher_entropy[~scored.to(dev)] == 0).all()
    # the in-process teacher: the spec's entropy of its head at the temperature
    spec = specs[0]
    _, expected = reference.logprobs_and_entropy(
        spec["hidden"], spec["weight"], torch.zeros(spec["hidden"].shape[:2], dtype=torch.int64), spec["bias"],
        0.8, softcap=spec["softcap"], compute_dtype=F64,
    )  # fmt: skip
    rows = dense_rows[:, 0].nonzero()[:, 0]
    got = teacher_entropy.cpu()[rows]
    torch.testing.assert_close(got, torch.where(mask[rows], expected, 0.0), rtol=1e-5, atol=1e-6)
    metrics = grpo_fast.teacher_metrics(routed, div, scored.to(dev), teacher_entropy=teacher_entropy)
    assert list(metrics) == [f"teacher_{m}/{n}" for n in routed.names for m in ("token_frac", "jsd", "entropy")]
    assert metrics["teacher_entropy/math"].item() == pytest.approx(expected[mask[rows]].mean().item(), rel=1e-5)
    # the served teachers: TRL's per-teacher means over the tokens it scores
    for i, name in ((1, "code"), (2, "chat")):
        count, jsd_sum, entropy_sum = stats[i].tolist()
        if count == 0:
            assert math.isnan(metrics[f"teacher_entropy/{name}"].item())
            continue
        assert metrics[f"teacher_entropy/{name}"].item() == pytest.approx(entropy_sum / count, rel=1e-5, abs=1e-6)
        assert metrics[f"teacher_jsd/{name}"].item() == pytest.approx(jsd_sum / count, rel=1e-4, abs=1e-6)
    assert stats[1:, 0].sum() > 0 and stats[1:, 2].sum() > 0  # TRL scored served tokens with some entropy
    empty = grpo_fast.Teachers(moved, torch.zeros_like(index).to(dev), names=["math", "code", "chat"])
    nan = grpo_fast.teacher_metrics(empty, div, scored.to(dev), teacher_entropy=teacher_entropy)
    assert math.isnan(nan["teacher_entropy/code"].item()) and not math.isnan(nan["teacher_entropy/math"].item())
    with pytest.raises(ValueError, match=r"teacher_entropy must have shape \[B, T\]"):
        grpo_fast.teacher_metrics(routed, div, teacher_entropy=teacher_entropy[:, :-1])


def _call(batch, mask, routed, **kw):
    return grpo_fast.multi_teacher_distillation_loss(batch["hidden"], batch["weight"], routed, mask, **kw)


def test_named_errors():
    batch, mask, index, teachers, _ = _batch()
    with pytest.raises(TypeError, match="teachers must be a grpo_fast.Teachers"):
        _call(batch, mask, teachers, beta=0.0)
    with pytest.raises(TypeError, match="non-empty list"):
        _call(batch, mask, grpo_fast.Teachers([], index), beta=0.0)
    with pytest.raises(TypeError, match=r"teachers.teachers\[1\] must be"):
        _call(batch, mask, grpo_fast.Teachers([teachers[0], "x"], index), beta=0.0)
    with pytest.raises(TypeError, match="teacher_index must be an integer tensor"):
        _call(batch, mask, grpo_fast.Teachers(teachers, index.float()), beta=0.0)
    with pytest.raises(ValueError, match=r"teacher_index must have shape \[B\]"):
        _call(batch, mask, grpo_fast.Teachers(teachers, index[:-1]), beta=0.0)
    with pytest.raises(ValueError, match=r"teacher_index must be in \[0, 3\).*\[0, 3\]"):
        _call(batch, mask, grpo_fast.Teachers(teachers, torch.tensor([0, 1, 3, 0, 1, 0])), beta=0.0)
    with pytest.raises(ValueError, match="beta is required when in-process and served teachers mix"):
        _call(batch, mask, grpo_fast.Teachers(teachers, index))
    with pytest.raises(ValueError, match="names must be 3 distinct names"):
        _call(batch, mask, grpo_fast.Teachers(teachers, index, names=["a", "a", "b"]), beta=0.0)
    wrong_rows = [teachers[1], teachers[0], teachers[2]]  # teacher 0 has 3 rows, teacher 1's tensors hold 2
    rows_error = r"teachers.teachers\[0\].hidden must have shape \[B_i, T, D\] with \[B_i, T\] = \[3, 5\]"
    with pytest.raises(ValueError, match=rows_error):
        _call(batch, mask, grpo_fast.Teachers(wrong_rows, index), beta=0.0)
    narrow = grpo_fast.Teacher(teachers[0].hidden, teachers[0].weight[:-1])
    with pytest.raises(ValueError, match="the vocabularies must match"):
        _call(batch, mask, grpo_fast.Teachers([narrow, *teachers[1:]], index), beta=0.0)
    _, _, _, served, _ = _batch(("served", "served", "served"))
    other_tail = served[1]._replace(add_tail_bucket=False)
    with pytest.raises(ValueError, match="must share add_tail_bucket and temperature"):
        _call(batch, mask, grpo_fast.Teachers([served[0], other_tail, served[2]], index))
    with pytest.raises(ValueError, match="completion_mask must be bool or hold only 0 and 1"):
        _call(batch, mask.float() * 2, grpo_fast.Teachers(teachers, index), beta=0.0)


def test_compiled_caller_and_tensors_without_data():
    """A compiled training step calls it (the routing runs eagerly: a graph break) with the eager result; fake or
    meta tensors, whose index cannot be read, get a named error."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    batch, mask, index, teachers, _ = _batch()
    routed = grpo_fast.Teachers(teachers, index)

    def step(hidden, weight):
        loss, div, _ = grpo_fast.multi_teacher_distillation_loss(
            hidden, weight, routed, mask, beta=0.5, targets=batch["targets"], backend="torch"
        )
        return 3.0 * loss, div

    eager, eager_div = step(batch["hidden"], batch["weight"])
    compiled, compiled_div = torch.compile(step, backend="eager")(batch["hidden"], batch["weight"])
    assert compiled.item() == pytest.approx(eager.item(), rel=1e-6)
    torch.testing.assert_close(compiled_div, eager_div)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = mode.from_tensor(batch["hidden"])
        with pytest.raises(ValueError, match="reading teacher_index on the host"):
            grpo_fast.multi_teacher_distillation_loss(fake, batch["weight"], routed, mask, beta=0.5)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_an_fp32_master_weight_over_bf16_hidden_states(backend, device):
    """An fp32 student lm_head over bf16 hidden states (torch.autocast's master weight), inside an autocast region:
    the values of the same call with the weight cast to bf16 first, the weight's gradient fp32 (not rounded; the
    in-process teachers: one op, so its rounding to bf16 is the bf16 call's)."""
    dev = backend_device(backend, device)
    batch, mask, index, teachers, _ = _batch(("dense", "dense", "dense"), dtype=torch.bfloat16, device=dev)
    runs = []
    for weight in (batch["weight"].float(), batch["weight"]):
        hidden, weight = batch["hidden"].clone().requires_grad_(), weight.clone().requires_grad_()
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            loss, div, _ = grpo_fast.multi_teacher_distillation_loss(
                hidden, weight, grpo_fast.Teachers(teachers, index), mask, beta=0.5, targets=batch["targets"],
                backend=backend,
            )  # fmt: skip
        loss.backward()
        runs.append((loss.detach(), div, hidden.grad, weight.grad))
    (loss, div, dh, dw), (loss_bf16, div_bf16, dh_bf16, dw_bf16) = runs
    assert dw.dtype == torch.float32 and dw_bf16.dtype == torch.bfloat16
    torch.testing.assert_close(loss, loss_bf16, rtol=0, atol=0)
    torch.testing.assert_close(div, div_bf16, rtol=0, atol=0)
    torch.testing.assert_close(dh, dh_bf16, rtol=0, atol=0)
    torch.testing.assert_close(dw.to(torch.bfloat16), dw_bf16, rtol=0, atol=0)
    assert (dw != dw.to(torch.bfloat16).float()).any()  # fp32 accumulators, not a bf16 gradient widened


def test_the_op_on_fake_tensors():
    """grpo_fast::routed_divergence_loss's fake implementation: the real outputs' shapes and dtypes, no kernel run
    (the public function reads the index on the host; the op itself traces)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from grpo_fast.multi_teacher import ops

    with FakeTensorMode():
        hidden, weight = torch.empty(7, DS, dtype=torch.bfloat16), torch.empty(V, DS)
        teachers = [torch.empty(3, 40, dtype=torch.bfloat16), torch.empty(4, 16)]
        operands = ops.RoutedOperands(
            hidden, weight, None, teachers, [torch.empty(V, 40, dtype=torch.bfloat16), torch.empty(V, 16)],
            [None, None], [0, 3, 7], 0.5, 1.0, None, 1.0, [0.0, 0.0], [1.0, 1.0], "triton",
        )  # fmt: skip
        loss, div, entropy, teacher_entropy = ops.routed_divergence_loss(operands, torch.empty(7), (True, True, False))
    assert loss.shape == () and div.shape == entropy.shape == teacher_entropy.shape == (7,)
    assert loss.dtype == div.dtype == teacher_entropy.dtype == torch.float32


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_rl_and_several_teachers_in_one_call(backend, device):
    """grpo_fast.loss(..., teacher=grpo_fast.Teachers(...)): the GRPO loss plus distillation_coef times the dapo
    reduction of each token's divergence from its row's teacher, equal to the two calls (loss, every gradient, the
    distillation_loss metric); against the spec's per-token divergence."""
    dev = backend_device(backend, device)
    batch, mask, index, teachers, specs = _batch(device=dev)
    g = torch.Generator().manual_seed(3)
    advantages = torch.randn(B, generator=g).to(dev)
    rl = dict(loss_type="dapo", num_items_in_batch=40, backend=backend, temperature=0.8, bias=batch["bias"])
    routed = grpo_fast.Teachers(teachers, index)
    runs = []
    for together in (True, False):
        hidden, weight = batch["hidden"].clone().requires_grad_(), batch["weight"].clone().requires_grad_()
        if together:
            loss, metrics = grpo_fast.loss(
                hidden, weight, batch["targets"], advantages, mask, teacher=routed, distillation_coef=0.3,
                distillation_beta=0.5, **rl,
            )  # fmt: skip
        else:
            loss, metrics = grpo_fast.loss(hidden, weight, batch["targets"], advantages, mask, **rl)
            mopd, div, _ = grpo_fast.multi_teacher_distillation_loss(
                hidden, weight, routed, mask, num_items_in_batch=40, beta=0.5, temperature=0.8,
                targets=batch["targets"], student_bias=batch["bias"], backend=backend,
            )  # fmt: skip
            loss = loss + 0.3 * mopd
            metrics["distillation_loss"] = div.sum() / mask.sum()
        loss.backward()
        runs.append((loss.detach(), metrics["distillation_loss"], hidden.grad, weight.grad))
    (loss, metric, dh, dw), (loss2, metric2, dh2, dw2) = runs
    assert loss.item() == pytest.approx(loss2.item(), rel=1e-5)
    assert metric.item() == pytest.approx(metric2.item(), rel=1e-5) and metric > 0
    torch.testing.assert_close(dh, dh2, rtol=1e-4, atol=1e-7)
    torch.testing.assert_close(dw, dw2, rtol=1e-4, atol=1e-7)
    _, div, _, _ = _spec(batch, mask, index, specs, 0.5, temperature=0.8)
    assert metric.item() == pytest.approx((div.sum() / mask.sum()).item(), rel=1e-5)
    with pytest.raises(ValueError, match="distillation_beta is required when in-process and served teachers mix"):
        grpo_fast.loss(batch["hidden"], batch["weight"], batch["targets"], advantages, mask, teacher=routed,
                       distillation_coef=0.3, **rl)  # fmt: skip
