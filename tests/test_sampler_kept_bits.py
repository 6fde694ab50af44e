"""Replayed kept sets from the log-prob's own record sweep (kernels/forward.py ``kept_record``: each launch's rows'
sets as a bitmap read in the tiles' epilogue) against the fp64 spec, at the launch and through
``grpo_fast.sampler_logprobs``, without gradients and with a trained head (then layer 1's chunked backward with the
support's term in its g, kernels/backward.py KEPT_BITS); its agreement with the gathers' path (``kernels.kept_set``),
which the Triton backend takes where only the hidden states train (beside layer 1's frozen head); a row's values
and gradients whatever the sets' padding.

Odd shapes (V not a multiple of 32 nor of the tiles, partial token blocks) in fp32 / bf16 / fp16, one launch holding
every kind of row: a set of one entry, every entry, sets without the row's max (~20 nats below it: the sums against
the max serve them), kept entries ~100 nats below their tile's max (past KEPT_RANGE: the row recomputed from its
gathers forward, its own exponential backward, its neighbours' values bit for bit unchanged), -inf logits in a set,
a target outside its set, an empty set; padding rows past a device count, rows in
several launches, an id twice in a set (check_values=False: the bitmap counts it once, the gathers twice), masked
rows, the fake implementation's shapes and no host read.
"""

import dataclasses
import math

import pytest
import torch
from conftest import assert_grad_close, backend_device
from test_host_syncs import count_syncs
from torch._subclasses.fake_tensor import FakeTensorMode

import grpo_fast
from grpo_fast import reference
from grpo_fast.head.transform import LogitTransform
from grpo_fast.kernels import config as kconfig
from grpo_fast.kernels import forward as kforward
from grpo_fast.kernels import gemm, kept_set, softmax_stats
from grpo_fast.kernels.operands import HeadOperands
from grpo_fast.memory import support_workspace

F64 = torch.float64
IDENTITY = LogitTransform()
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
N, D, V = 37, 40, 301  # a partial token block; V = 9 words and 13 bits, a partial tile and patch
# columns the bias moves: HIGH ~20 nats above every other logit (a set without it lies that far below its row's max:
# the sums against the max serve it), LOW and LOWER ~100 nats below HIGH (their tile's max: the same 32-column tile
# on the interpreter's tiles; past kforward.KEPT_RANGE, the row recomputed), GONE at -inf
HIGH, LOW, LOWER, GONE = 3, 7, 9, (11, 250)


def _head(dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, D, generator=g).to(dtype)
    weight = (torch.randn(V, D, generator=g) * D**-0.5 * 2).to(dtype)
    bias = (torch.randn(V, generator=g) * 0.5).to(dtype)
    bias[HIGH], bias[LOW], bias[LOWER] = 20.0, -80.0, -79.0
    bias[list(GONE)] = -math.inf
    targets = torch.randint(0, V, (N,), generator=g)
    targets = torch.where((targets == GONE[0]) | (targets == GONE[1]), 0, targets)  # no target at -inf
    return hidden.to(device), weight.to(device), bias.to(device), targets.to(device)


def _kept_ids(targets, generator):
    """[N, K] sets, -1 filling, one kind of row each (module docstring); row 6's set lacks its target."""
    K = V + 2
    ids = torch.full((N, K), -1, dtype=torch.int64)
    for n, y in enumerate(targets.tolist()):
        others = [v for v in torch.randperm(V, generator=generator).tolist() if v not in (y, HIGH)]
        size = int(torch.randint(1, 40, (1,), generator=generator))
        row = {
            0: [y],  # the target alone
            1: list(range(V)),  # every entry (the row's max, -inf ones included)
            2: [y, *others[:20]],  # not the row's max
            3: [LOW, LOWER],  # ~100 nats below the tile's max, the target among them
            4: [y, *GONE, *others[:5]],  # -inf logits
            5: [y, *GONE],  # the target and -inf logits
            6: others[:10],  # the target outside
            7: [],  # empty
        }.get(n, [*others[:size], y])
        ids[n, : len(row)] = torch.tensor(row, dtype=torch.int64)[torch.randperm(len(row), generator=generator)]
    targets = targets.clone()
    targets[3] = LOW
    return ids, targets


def _truth(hidden, weight, bias, targets, ids, transform=IDENTITY):
    """(kept target logit, kept_lse, kept_nontarget_mass, logp, lse) in fp64; an empty set: -inf, -inf, 0."""
    z = reference.logits(hidden.cpu(), weight.cpu(), bias.cpu(), compute_dtype=F64, transform=transform)
    ids, targets = ids.cpu(), targets.cpu()
    keep = torch.zeros(z.shape[0], V + 1, dtype=torch.bool).scatter(1, torch.where(ids >= 0, ids, V), True)[:, :V]
    rows = torch.arange(z.shape[0])
    kept_z = z.masked_fill(~keep, -math.inf)
    kept_lse = torch.logsumexp(kept_z, 1)
    rest = torch.exp(kept_z - kept_lse[:, None])
    rest[rows, targets] = 0.0
    mass = torch.nan_to_num(rest, nan=0.0).sum(1)
    target = torch.where(keep[rows, targets], z[rows, targets], -math.inf)
    lse = torch.logsumexp(z, 1)
    return target, kept_lse, mass, z[rows, targets] - lse, lse


def _config(device, dtype, **changes):
    return dataclasses.replace(kconfig.forward_config(device, dtype), **changes)


def _recomputed(head, ids, kept, transform=IDENTITY):
    """The kept record with the rows the sums do not serve recomputed (``kept_set.kept_record_rows``), checked to be
    the narrow sets (at most kforward.KEPT_GATHERED ids: their gathers), the empty ones, and those whose set's mass
    lies more than KEPT_RANGE nats below the row's max (the sums against that max would lose it; a row within a
    thousandth of a nat of the bound either way): row 3's, ~100 below."""
    hidden, weight, targets, bias, _, _ = head
    z = reference.logits(hidden.cpu(), weight.cpu(), bias.cpu(), compute_dtype=F64, transform=transform)
    kept_lse = _truth(hidden, weight, bias, targets, ids, transform)[1]
    below = kept_lse - z.amax(1) + kforward.KEPT_RANGE.value
    far, clear = (below < 0) & kept_lse.isfinite(), below.abs() > 1e-3
    assert far.nonzero().flatten().tolist() == [3] and bool(clear.all())
    wide = ((ids >= 0) & (ids < z.shape[1])).sum(-1).cpu() > kforward.KEPT_GATHERED
    served = wide & ~far & kept_lse.isfinite()
    assert torch.equal(kept[3].cpu(), served.float())
    return kept_set.kept_record_rows(head, ids, kept.clone())[:3]


def _same_served(a, b):
    """Two kept records [4, n] alike: their flags, and every field of the rows the sums serve (a row set aside holds
    what its tiles summed of words no kernel wrote: its gathers replace it)."""
    served = b[3] == 1
    return torch.equal(a[3], b[3]) and torch.equal(a[:, served], b[:, served])


def _assert_matches(kept, layer1, truth):
    target, kept_lse, mass, logp, lse = (x.to(F64) for x in truth)
    got_target, got_lse, got_mass = (x.cpu().to(F64) for x in kept)
    finite = target.isfinite()
    assert torch.equal(got_target.isfinite(), finite) and bool((got_target[~finite] == -math.inf).all())
    torch.testing.assert_close(got_target[finite], target[finite], rtol=1e-6, atol=5e-6)
    assert torch.equal(got_lse.isfinite(), kept_lse.isfinite())
    torch.testing.assert_close(got_lse[kept_lse.isfinite()], kept_lse[kept_lse.isfinite()], rtol=1e-6, atol=5e-6)
    assert bool(got_lse[~kept_lse.isfinite()].eq(-math.inf).all())
    # a sum of positive terms: relative precision where the mass is small (the target dominant)
    torch.testing.assert_close(got_mass, mass, rtol=2e-5, atol=1e-7)
    got_logp, _, stats = softmax_stats.finish(layer1, False)
    torch.testing.assert_close(got_logp.cpu().to(F64), logp, rtol=1e-6, atol=5e-6)
    torch.testing.assert_close(stats.lse.cpu().to(F64), lse, rtol=1e-6, atol=5e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gathered", [0, kforward.KEPT_GATHERED], ids=["bitmaps", "narrow sets gathered"])
def test_kept_record_matches_fp64(dtype, gathered, monkeypatch, device):
    # every nonempty set read from the bitmaps (KEPT_GATHERED 0), or the narrow ones from their gathers (all but row
    # 1's, every entry: its token block's epilogue sums, the other blocks skip it)
    monkeypatch.setattr(kforward, "KEPT_GATHERED", gathered)
    hidden, weight, bias, targets = _head(dtype, device)
    ids, targets = _kept_ids(targets.cpu(), torch.Generator().manual_seed(1))
    ids, targets = ids.to(device), targets.to(device)
    transform = LogitTransform(temperature=0.8)
    head = HeadOperands(hidden, weight, targets, bias, transform)
    layer1, swept = kforward.kept_record(head, ids, _config(device, dtype))
    truth = _truth(hidden, weight, bias, targets, ids, transform)
    kept = _recomputed(head, ids, swept, transform)
    _assert_matches(kept, layer1, truth)
    served = swept[3] == 1
    assert int(served.sum()) == (1 if gathered else N - 2)  # row 1 alone; all but the far and the empty
    assert torch.equal(kept[:, served], swept[:3, served])  # the served rows untouched
    # the plain fields are the plain sweep's
    plain = kforward.forward_record(head, False, _config(device, dtype))
    for name, x, y in zip(plain._fields, layer1, plain):
        torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")
    # the rows built to test something: ~100 nats below the tile's max, kept to relative precision; empty; outside
    assert kept[1][3].item() < -40 and kept[2][7].item() == 0.0 and kept[0][6].item() == -math.inf
    assert kept[0][7].item() == -math.inf and kept[1][7].item() == -math.inf
    assert not bool(kept.isnan().any())


def test_padding_rows_and_several_launches(monkeypatch, device):
    monkeypatch.setattr(kforward, "KEPT_GATHERED", 0)  # every nonempty set from the bitmaps
    hidden, weight, bias, targets = _head(torch.float32, device, seed=2)
    ids, targets = _kept_ids(targets.cpu(), torch.Generator().manual_seed(3))
    ids, targets = ids.to(device), targets.to(device)
    head = HeadOperands(hidden, weight, targets, bias, IDENTITY)
    cfg = _config(device, torch.float32)
    layer1, kept = kforward.kept_record(head, ids, cfg)
    _assert_matches(_recomputed(head, ids, kept), layer1, _truth(hidden, weight, bias, targets, ids))
    # the bitmap counts in the launch's rows: one token block a launch where the plain partials take two or more
    patches = -(-V // (cfg.block_v * cfg.tiles))
    monkeypatch.setattr(kforward, "PARTS_BYTES", (4 * patches + kforward.kept_words(V)) * 4 * cfg.block_n)
    assert kforward.parts_shape(N, V, False, cfg)[2] >= 2 * cfg.block_n
    assert kforward.parts_shape(N, V, False, cfg, kept_bits=True)[2] == cfg.block_n
    several = kforward.kept_record(head, ids, cfg)  # 3 launches, the last one short
    assert all(torch.equal(x, y) for x, y in zip(several[0], layer1)) and _same_served(several[1], kept)
    monkeypatch.setattr(kforward, "PARTS_BYTES", kforward.PARTS_BYTES)
    monkeypatch.undo()
    monkeypatch.setattr(kforward, "KEPT_GATHERED", 0)
    # rows from the device count on are padding: the blocks wholly past it write placeholders, finite, no NaN
    count = cfg.block_n
    padded, padded_kept = kforward.kept_record(head, ids, cfg, torch.tensor([count], dtype=torch.int32, device=device))
    assert all(torch.equal(x[:count], y[:count]) for x, y in zip(padded, layer1))
    assert _same_served(padded_kept[:, :count], kept[:, :count])
    past = padded_kept[:, count:]
    assert not bool(past.isnan().any()) and bool((past[2] == 0).all())
    logp, _, stats = softmax_stats.finish(softmax_stats.SoftmaxStats(*(x[count:] for x in padded)), False)
    assert bool((logp == 0).all()) and bool(stats.lse.isfinite().all())


def _sampler_inputs(dtype, device, seed=0):
    """[2, 5] tokens, V = 150 (4 words and 22 bits), sets of the target and up to 30 others, -1 filling; the second
    sequence's last tokens masked with sets outside [0, V) (never read)."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(2, 5, 24, generator=g).to(device, dtype)
    weight = (torch.randn(150, 24, generator=g) * 0.4).to(device, dtype)
    bias = (torch.randn(150, generator=g) * 0.3).to(device, dtype)
    targets = torch.randint(0, 150, (2, 5), generator=g)
    ids = torch.full((2, 5, 40), -1, dtype=torch.int64)
    for b in range(2):
        for t in range(5):
            others = [v for v in torch.randperm(150, generator=g).tolist() if v != targets[b, t]]
            row = [int(targets[b, t]), *others[: int(torch.randint(0, 31, (1,), generator=g))]]
            ids[b, t, : len(row)] = torch.tensor(row)[torch.randperm(len(row), generator=g)]
    mask = torch.ones(2, 5, dtype=torch.bool)
    mask[1, 3:] = False
    ids[1, 3:] = 10**6
    return hidden, weight, bias, targets.to(device), mask.to(device), ids.to(device)


def _sampler(backend, *inputs, grad=False, **kwargs):
    """``sampler_logprobs`` without gradients (the bitmap sweep on the Triton backend), or with (the gathers)."""
    hidden, weight, bias, targets, mask, ids = inputs
    with torch.set_grad_enabled(grad):
        hidden = hidden.clone().requires_grad_(grad)
        out = grpo_fast.sampler_logprobs(
            hidden, weight, targets, mask, bias=bias, temperature=0.9, backend=backend, kept_ids=ids, **kwargs
        )
    return type(out)(*(x.detach() for x in out))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_sampler_logprobs_without_gradients_match_fp64(backend, dtype, device):
    inputs = _sampler_inputs(dtype, backend_device(backend, device))
    hidden, weight, bias, targets, mask, ids = inputs
    out = _sampler(backend, *inputs)
    spec = reference.sampler_logprobs(
        hidden, weight, targets, bias, 0.9, kept_ids=ids.clamp(max=149), compute_dtype=F64
    )
    for name, x, r in zip(out._fields, out, spec):
        assert x.dtype == torch.float32, name
        assert torch.equal(x[~mask], torch.zeros_like(x[~mask])), name
        torch.testing.assert_close(x[mask], r[mask].float(), rtol=1e-5, atol=2e-5, msg=lambda m, n=name: f"{n}: {m}")


def test_the_bitmap_equals_the_gathers_and_layer1(device):
    inputs = _sampler_inputs(torch.float32, device, seed=1)
    bitmap, gathers = (_sampler("triton", *inputs, grad=grad) for grad in (False, True))
    for name, x, y in zip(bitmap._fields, bitmap, gathers):
        torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
    hidden, weight, bias, targets, mask, _ = inputs
    layer1 = grpo_fast.logprobs_and_entropy(
        hidden, weight, targets, bias=bias, temperature=0.9, completion_mask=mask, backend="triton"
    )[0]
    torch.testing.assert_close(bitmap.logprobs, layer1, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "backend, grad, gathered",
    [("triton", False, 0), ("triton", False, kforward.KEPT_GATHERED), ("triton", True, 0), ("torch", False, 0)],
)
def test_a_target_outside_its_set_and_an_id_twice(backend, grad, gathered, monkeypatch, device):
    monkeypatch.setattr(kforward, "KEPT_GATHERED", gathered)  # 0: every nonempty set from the bitmaps
    hidden, weight, bias, targets, mask, ids = _sampler_inputs(torch.float32, backend_device(backend, device), seed=2)
    outside = ids.clone()
    outside[0, 1] = torch.where(outside[0, 1] == targets[0, 1], -1, outside[0, 1])
    inputs = (hidden, weight, bias, targets, mask)
    with pytest.raises(ValueError, match=r"targets\[0, 1\] is not in its kept set"):
        _sampler(backend, *inputs, outside, grad=grad)
    out = _sampler(backend, *inputs, outside, grad=grad, check_values=False)
    spec = reference.sampler_logprobs(hidden, weight, targets, bias, 0.9, compute_dtype=F64)
    assert math.isnan(out.support_logprobs[0, 1].item())
    # the log-prob stays the target's over the vocabulary: a finite number, the spec's
    torch.testing.assert_close(out.logprobs[mask], spec[0][mask].float(), rtol=1e-5, atol=2e-5)
    # the target twice (no check): the bitmap keeps the set {ids} (as the spec's mask does), the gathers (a narrow
    # set's, a frozen head's, the torch backend's) sum the list
    twice = ids.clone()
    twice[0, 2, -1] = targets[0, 2]
    with pytest.raises(ValueError, match="an id twice"):
        _sampler(backend, *inputs, twice, grad=grad)
    out = _sampler(backend, *inputs, twice, grad=grad, check_values=False)
    z = reference.logits(hidden, weight, bias, 0.9, compute_dtype=F64)[0, 2]
    row = twice[0, 2][twice[0, 2] >= 0]
    as_set, as_list = torch.logsumexp(z[row.unique()], 0), torch.logsumexp(z[row], 0)
    bits = backend == "triton" and not grad and not gathered  # the bitmap sweep; else the gathers
    expected = z[targets[0, 2]] - (as_set if bits else as_list)
    torch.testing.assert_close(out.support_logprobs[0, 2], expected.float(), rtol=1e-5, atol=2e-5)
    assert abs((as_set - as_list).item()) > 1e-3  # the two readings differ


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_fake_tensors_and_no_host_read(backend, monkeypatch, device):
    with FakeTensorMode(), torch.no_grad():
        hidden, weight = torch.empty(2, 5, 16), torch.empty(40, 16)
        targets, ids = torch.zeros(2, 5, dtype=torch.int64), torch.zeros(2, 5, 300, dtype=torch.int64)
        out = grpo_fast.sampler_logprobs(hidden, weight, targets, backend=backend, kept_ids=ids, check_values=False)
        assert all(x.shape == (2, 5) and x.dtype == torch.float32 for x in out)
    dev = backend_device(backend, device)
    hidden, weight, bias, targets, mask, ids = _sampler_inputs(torch.float32, dev)

    def run(fn=grpo_fast.sampler_logprobs, **kept):
        with torch.no_grad():
            fn(hidden, weight, targets, completion_mask=mask, backend=backend, check_values=False, **kept)

    # as layer 1's own (the torch twin's record reads the host): none on the Triton backend
    syncs, layer1 = (count_syncs(f, monkeypatch)[1] for f in (lambda: run(kept_ids=ids), run))
    assert syncs == layer1 and (backend == "torch" or syncs == [])


def test_the_memory_model_counts_the_bitmap_sweep():
    # the no-grad forward of replayed sets: the record sweep's workspace with the bitmaps, no [N, K] buffers (at any
    # K); with gradients of hidden states alone (layer 1's frozen head beside) the gathers' [N, K] buffers
    N, D, V = 4096, 1536, 151936
    config = kconfig.forward_config(torch.device("cuda"), torch.bfloat16, True)  # the bitmaps' columns
    bits = kforward.workspace_bytes(N, V, False, config, kept_bits=True)
    # the bitmaps within the launch's bytes: fewer rows a launch
    assert kforward.parts_shape(N, V, False, config, kept_bits=True)[2] < kforward.parts_shape(N, V, False, config)[2]

    def model(kept, differentiable, trains_head=False, op="sampler_support"):
        return support_workspace.support_workspace_bytes(
            op, N, D, V, torch.bfloat16, kept=kept, differentiable=differentiable, trains_head=trains_head
        )

    rows = kforward.parts_shape(N, V, False, config, kept_bits=True)[2]
    assert model(1024, False) == bits + rows * (3 * 1024 + 12) + 4 * N * 4  # a launch's width count: [rows, K] bools
    assert model(64, False) == bits + rows * (3 * 64 + 12) + 4 * N * 4
    assert model(1024, True) == math.ceil(N * 1024 * 4 * support_workspace.REPLAYED_FORWARD)
    # a trained head: the same sweep forward, and a backward of layer 1's chunked g and a chunk's bitmaps (any K)
    assert model(1024, True, True) == model(1024, False) and model(64, True, True) == model(64, False)
    backward = model(1024, True, True, "sampler_support_backward") - 4 * (N * D + V * D)
    chunk = gemm.chunk_size(N, D)
    assert backward == chunk * (V * 2 + kforward.kept_words(V) * 4) + 7 * N * 4
    assert backward == model(64, True, True, "sampler_support_backward") - 4 * (N * D + V * D)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rows_values_do_not_depend_on_the_sets_padding(dtype, device):
    """Batch invariance (docs/batch-invariance.md) over the kept sets' padding: the same sets padded to a narrow and
    a wide K (the width pack_kept_ids gives a batch: its widest set's) give every row bitwise the same log-prob and
    support log-prob, without gradients (one path whatever K)."""
    hidden, weight, bias, targets = _head(dtype, device)
    narrow = (targets[:, None] + torch.arange(6, device=targets.device) * 37) % V  # 6 distinct ids, the target's first
    wide = torch.cat([narrow, torch.full((N, 200), -1, dtype=torch.int64, device=device)], dim=1)
    out = []
    with torch.no_grad():
        for kept in (narrow, wide):
            res = grpo_fast.sampler_logprobs(
                hidden[None], weight, targets[None], kept_ids=kept[None], bias=bias, backend="triton"
            )
            out.append(res)
    for a, b in zip(out[0], out[1]):
        assert torch.equal(a, b)


def _trained(backend, hidden, weight, bias, targets, mask, ids, coefficients, **kwargs):
    """(outputs, (dH, dW, db)) of sum c logp + d support with every head tensor trained (the Triton backend: the
    bitmap sweep forward, layer 1's chunked backward with the support's term in its g)."""
    leaves = [x.detach().clone().requires_grad_() for x in (hidden, weight, bias)]
    out = grpo_fast.sampler_logprobs(
        leaves[0], leaves[1], targets, mask, bias=leaves[2], temperature=0.9, backend=backend, kept_ids=ids, **kwargs
    )
    sum((c * x).sum() for c, x in zip(coefficients, out[:2])).backward()
    return type(out)(*(x.detach() for x in out)), [x.grad for x in leaves]


@pytest.mark.parametrize("dtype", DTYPES)
def test_with_a_trained_head_both_gradients_match_fp64(dtype, device):
    dev = backend_device("triton", device)
    hidden, weight, bias, targets, mask, ids = _sampler_inputs(dtype, dev)
    g = torch.Generator().manual_seed(3)
    coefficients = [torch.randn(2, 5, generator=g).to(dev) * mask for _ in range(2)]
    out, grads = _trained("triton", hidden, weight, bias, targets, mask, ids, coefficients)
    leaves = [x.detach().clone().double().requires_grad_() for x in (hidden, weight, bias)]
    spec = reference.sampler_logprobs(
        leaves[0], leaves[1], targets, leaves[2], 0.9, kept_ids=ids.clamp(max=149), compute_dtype=F64
    )
    sum((c.double() * x.masked_fill(~mask, 0.0)).sum() for c, x in zip(coefficients, spec[:2])).backward()
    for name, x, r in zip(out._fields, out, spec):
        torch.testing.assert_close(x[mask], r[mask].float(), rtol=1e-5, atol=2e-5, msg=lambda m, n=name: f"{n}: {m}")
    for name, got, leaf in zip(("hidden", "weight", "bias"), grads, leaves):
        assert_grad_close(got, leaf.grad.to(dtype), dtype, name)


def test_with_a_trained_head_every_kind_of_set(device):
    # the hard rows (module docstring): sets without the row's max, entries ~100 nats below their tile's max, -inf
    # logits in a set, an empty set and a target outside its set (check_values=False: their support NaN); the
    # gradients of rows whose support is a number are the spec's, the others' rows NaN, never a number that hides it
    dev = backend_device("triton", device)
    hidden, weight, bias, targets = _head(torch.float32, dev)
    ids, targets = _kept_ids(targets, torch.Generator().manual_seed(1))
    ids, targets = ids.to(dev), targets.to(dev)
    truth = _truth(hidden, weight, bias, targets, ids)
    drawable = truth[0].isfinite().to(dev)
    assert not bool(drawable.all()) and bool(drawable.sum() > N - 3)
    g = torch.Generator().manual_seed(4)
    c, d = (torch.randn(N, generator=g).to(dev) for _ in range(2))
    d_drawn = torch.where(drawable, d, 0.0)  # a NaN support takes no gradient here: the others' checked
    mask = torch.ones(1, N, dtype=torch.bool, device=dev)
    out, grads = _trained(
        "triton",
        hidden[None],
        weight,
        bias,
        targets[None],
        mask,
        ids[None],
        (c[None], d_drawn[None]),
        check_values=False,
    )
    leaves = [x.detach().clone().double().requires_grad_() for x in (hidden, weight, bias)]
    logp, support, _ = reference.sampler_logprobs(
        leaves[0], leaves[1], targets, leaves[2], 0.9, kept_ids=ids, compute_dtype=F64
    )
    support = torch.where(drawable, support, 0.0)
    ((c.double() * logp).sum() + (d_drawn.double() * support).sum()).backward()
    for name, got, leaf in zip(("hidden", "weight", "bias"), grads, leaves):
        scale = leaf.grad.abs().max().item()
        err = (got.double().cpu() - leaf.grad.cpu()).abs().max().item()
        assert err <= 1e-5 * scale, (name, err, scale)
    # a row whose support is NaN and gets a gradient: its dH row NaN, the others finite
    _, nan_grads = _trained(
        "triton", hidden[None], weight, bias, targets[None], mask, ids[None], (c[None], d[None]), check_values=False
    )
    rows_nan = nan_grads[0][0].isnan().any(-1)
    assert torch.equal(rows_nan, ~drawable)


def test_with_a_trained_head_a_rows_gradients_do_not_depend_on_the_sets_padding(device):
    # batch invariance with gradients: the same sets padded to K 6 and 206 give bitwise equal values and gradients
    dev = backend_device("triton", device)
    hidden, weight, bias, targets = _head(torch.float32, dev)
    narrow = (targets[:, None] + torch.arange(6, device=targets.device) * 37) % V
    wide = torch.cat([narrow, torch.full((N, 200), -1, dtype=torch.int64, device=dev)], dim=1)
    g = torch.Generator().manual_seed(5)
    coefficients = [torch.randn(1, N, generator=g).to(dev) for _ in range(2)]
    mask = torch.ones(1, N, dtype=torch.bool, device=dev)
    runs = [
        _trained("triton", hidden[None], weight, bias, targets[None], mask, kept[None], coefficients)
        for kept in (narrow, wide)
    ]
    for a, b in zip(runs[0][0] + tuple(runs[0][1]), runs[1][0] + tuple(runs[1][1])):
        assert torch.equal(a, b)


def test_a_frozen_head_keeps_layer1s_frozen_path_and_the_gathers(monkeypatch, device):
    # the bitmap backward only where layer 1 would take its general path (the head trains); a frozen lm_head keeps
    # layer 1's frozen-head path for the log-prob and the gathers for the support: both the spec's
    from grpo_fast.kernels import backward as kbackward

    dev = backend_device("triton", device)
    inputs = _sampler_inputs(torch.float32, dev, seed=1)
    calls = []
    chunked = kbackward.backward_chunked

    def counted(*args, support=None, **kwargs):
        calls.append(support is not None)
        return chunked(*args, support=support, **kwargs)

    monkeypatch.setattr(kbackward, "backward_chunked", counted)
    g = torch.Generator().manual_seed(6)
    coefficients = [torch.randn(2, 5, generator=g).to(dev) * inputs[4] for _ in range(2)]
    trained, trained_grads = _trained("triton", *inputs, coefficients)
    assert calls == [True]
    calls.clear()
    frozen = _sampler("triton", *inputs, grad=True)
    assert True not in calls
    for x, y in zip(trained, frozen):
        torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-6)


def test_a_rows_gradients_do_not_depend_on_a_far_set_beside_it(device):
    # batch invariance through the backward's exact branch: a token block holding a set far below its row's max
    # (row 3, past KEPT_RANGE: its own exponential) gives every other row bitwise the values and dH rows it has in a
    # block without one (row 3's set then the target alone)
    dev = backend_device("triton", device)
    hidden, weight, bias, targets = _head(torch.float32, dev)
    ids, targets = _kept_ids(targets, torch.Generator().manual_seed(1))
    ids, targets = ids.to(dev), targets.to(dev)
    near = ids.clone()
    near[3] = -1
    near[3, 0] = targets[3]
    g = torch.Generator().manual_seed(7)
    drawable = _truth(hidden, weight, bias, targets, ids)[0].isfinite().to(dev)
    coefficients = [torch.where(drawable, torch.randn(N, generator=g).to(dev), 0.0)[None] for _ in range(2)]
    inputs = (hidden[None], weight, bias, targets[None], torch.ones(1, N, dtype=torch.bool, device=dev))
    runs = [_trained("triton", *inputs, kept[None], coefficients, check_values=False) for kept in (ids, near)]
    others = torch.arange(N, device=dev) != 3
    for a, b in zip(runs[0][0], runs[1][0]):  # bitwise (rows 6 and 7: NaN support)
        torch.testing.assert_close(a[0, others], b[0, others], rtol=0, atol=0, equal_nan=True)
    dH = [run[1][0][0] for run in runs]
    assert torch.equal(dH[0][others], dH[1][others]) and not torch.equal(dH[0][3], dH[1][3])
