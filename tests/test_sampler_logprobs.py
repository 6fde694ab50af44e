"""grpo_fast.sampler_logprobs against the fp64 spec (reference.sampler_logprobs, reference.kept_mask), and the spec's
rules against a brute-force reading of vLLM's.

Both backends, fp32 / bf16 / fp16, the sampling parameters (top-k, top-p, min-p, combined) and replayed kept sets:
the three outputs, and the gradients of a loss on both log-probs (hidden, weight, bias, LoRA). Kept sets of one entry
to the whole vocabulary, ties at the top-k and top-p thresholds, temperature, soft-cap and bias, confident tokens,
masked rows and empty masks; each bad argument's named error.

The targets are drawn from the spec's kept sets, and each case's data keep every logit at least ``MARGIN`` from its
row's threshold (asserted): a kept set computed from fp32 logits of bf16 inputs is then the fp64 one.
"""

import math

import pytest
import torch
from conftest import assert_grad_close, backend_device
from helpers import head_inputs, non_finite_inputs, randn

import grpo_fast
from grpo_fast import reference

F64 = torch.float64
BACKENDS = ["triton", "torch"]
RULES = {
    "top_k": dict(top_k=7),
    "top_p": dict(top_p=0.8),
    "min_p": dict(min_p=0.05),
    "all-three": dict(top_k=20, top_p=0.9, min_p=0.02),
    "replayed": dict(replay=True),
}
MARGIN = 1e-3


def _z(h, w, b, temperature, **transform):
    return reference.logits(h, w, b, temperature, compute_dtype=F64, **transform)


def _drawn_targets(keep, generator):
    """One entry of each row's kept set, drawn uniformly."""
    weights = keep.to(F64).reshape(-1, keep.shape[-1])
    return torch.multinomial(weights, 1, generator=generator).reshape(keep.shape[:-1])


def _threshold_gap(z, keep):
    """The smallest distance of a logit to its row's threshold (between the kept set's least and the rest's most)."""
    low = torch.where(keep, z, math.inf).amin(-1)
    high = torch.where(keep, -math.inf, z).amax(-1)
    return (low - high).min().item()


def _case(rule, dtype, device, shape=(2, 7, 40, 157), temperature=0.8, first_seed=0, **transform):
    B, T, D, V = shape
    params = {k: v for k, v in RULES[rule].items() if k != "replay"}
    for seed in range(first_seed, first_seed + 100, 10):  # the first seed whose data keep every logit off its threshold
        h, w, b, _ = head_inputs(B, T, D, V, dtype, scale=0.4, device=device, seed=seed)
        z = _z(h, w, b, temperature, **transform)
        keep = reference.kept_mask(z, **(params or dict(top_p=0.7)))
        if _threshold_gap(z, keep) > MARGIN:
            break
    assert _threshold_gap(z, keep) > MARGIN, "no seed keeps the logits off their thresholds"
    y = _drawn_targets(keep, torch.Generator().manual_seed(seed + 1)).to(device)
    if "replay" in RULES[rule]:
        # the kept ids in a shuffled order, padded with -1 to a width beyond the largest set
        order = torch.randperm(V, generator=torch.Generator().manual_seed(seed + 2)).to(device)
        ids = torch.where(keep[..., order], order, -1)
        ids = ids.sort(dim=-1, descending=True).values[..., : int(keep.sum(-1).max()) + 3]
        params = dict(kept_ids=ids)
    return h, w, b, y, params


def _run(fn, h, w, b, y, coefficients, **kwargs):
    leaves = [x.clone().requires_grad_() if x is not None else None for x in (h, w, b)]
    out = fn(leaves[0], leaves[1], y, bias=leaves[2], **kwargs)
    total = sum((c * x).sum() for c, x in zip(coefficients, out[:2]))
    total.backward()
    return [x.detach() for x in out], [x.grad if x is not None else None for x in leaves]


def _spec(h, w, y, bias, completion_mask=None, **kwargs):
    out = reference.sampler_logprobs(h, w, y, bias, compute_dtype=F64, **kwargs)
    if completion_mask is None:
        return out
    return tuple(torch.where(completion_mask.bool(), x, 0.0) for x in out)


def _check(backend, dtype, h, w, b, y, coefficients, completion_mask=None, **kwargs):
    (logp, support, log_mass), grads = _run(
        grpo_fast.sampler_logprobs, h, w, b, y, coefficients, backend=backend, completion_mask=completion_mask, **kwargs
    )
    (ref_logp, ref_support, ref_mass), ref_grads = _run(
        _spec, h, w, b, y, coefficients, completion_mask=completion_mask, **kwargs
    )
    for name, x, r in (("logprobs", logp, ref_logp), ("support", support, ref_support), ("mass", log_mass, ref_mass)):
        assert x.dtype == torch.float32, name
        torch.testing.assert_close(x, r.float(), rtol=1e-5, atol=2e-5, msg=lambda m, name=name: f"{name}: {m}")
    for name, g, rg in zip(("hidden", "weight", "bias"), grads, ref_grads):
        if rg is not None:
            assert_grad_close(g, rg.float(), dtype, name)
    return (logp, support, log_mass), grads


# ------------------------------------------------------------------------------------------------------ the spec
def _brute_force_kept(z, top_k=0, top_p=1.0, min_p=0.0):
    """vLLM's rules read literally, entry by entry (O(V^2) a row): min-p, then top-k, then top-p."""
    keep = torch.ones_like(z, dtype=torch.bool)
    for row in range(z.shape[0]):
        p = torch.softmax(z[row], -1)
        alive = p >= min_p * p.max() if min_p > 0 else torch.ones_like(p, dtype=torch.bool)
        if top_k > 0:
            ranked = sorted(z[row][alive].tolist(), reverse=True)
            kth = ranked[min(top_k, len(ranked)) - 1]
            alive &= z[row] >= kth
        if top_p < 1:
            q = torch.where(alive, torch.exp(z[row] - z[row].max()), 0.0)
            q = q / q.sum()
            above = torch.stack([q[alive & (z[row] > z[row][v])].sum() for v in range(z.shape[1])])
            alive &= above < top_p
        keep[row] = alive
    return keep


@pytest.mark.parametrize(
    "params",
    [dict(top_k=5), dict(top_p=0.9), dict(top_p=0.3), dict(min_p=0.1), dict(top_k=12, top_p=0.7, min_p=0.01)],
    ids=lambda p: "-".join(f"{k}={v}" for k, v in p.items()),
)
def test_spec_kept_mask_is_vllms_rules(params):
    z = torch.randn(6, 60, dtype=F64, generator=torch.Generator().manual_seed(0)) * 2
    assert torch.equal(reference.kept_mask(z, **params), _brute_force_kept(z, **params))


def test_spec_keeps_every_tie_at_a_threshold():
    # three tied at the top, two tied below: top_k 2 keeps the three; top_p 0.5 keeps the three (0 mass above them)
    z = torch.tensor([[1.0, 1.0, 1.0, 0.0, 0.0, -1.0]], dtype=F64)
    assert reference.kept_mask(z, top_k=2).tolist() == [[True] * 3 + [False] * 3]
    assert reference.kept_mask(z, top_k=4).tolist() == [[True] * 5 + [False]]
    assert reference.kept_mask(z, top_p=0.5).tolist() == [[True] * 3 + [False] * 3]
    # the two at 0 have 3e / (3e + 2 + 1/e) = 0.78 of the mass above them: kept under top_p 0.8, not under 0.7
    assert reference.kept_mask(z, top_p=0.8).tolist() == [[True] * 5 + [False]]
    assert reference.kept_mask(z, top_p=0.7).tolist() == [[True] * 3 + [False] * 3]
    assert torch.equal(reference.kept_mask(z, top_k=2), _brute_force_kept(z, top_k=2))


def test_spec_kept_mass_and_support():
    h, w, b, _ = head_inputs(2, 3, 16, 30, F64)
    z = _z(h, w, b, 1.0)
    y = z.argmax(-1)
    logp, support, log_mass = reference.sampler_logprobs(h, w, y, b, top_k=1, compute_dtype=F64)
    torch.testing.assert_close(support, torch.zeros_like(support))  # a kept set of one: log 1
    torch.testing.assert_close(log_mass, logp)
    keep = reference.kept_mask(z, top_p=0.6)
    mass = torch.where(keep, torch.softmax(z, -1), 0.0).sum(-1)
    _, _, log_mass = reference.sampler_logprobs(h, w, y, b, top_p=0.6, compute_dtype=F64)
    torch.testing.assert_close(log_mass, mass.log().float())


# ------------------------------------------------------------------------------------------- against the spec
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rule", list(RULES))
def test_matches_the_spec(backend, dtype, rule, device):
    dev = backend_device(backend, device)
    h, w, b, y, params = _case(rule, dtype, dev)
    g = torch.Generator().manual_seed(5)
    coefficients = (randn(*y.shape, generator=g, device=dev), randn(*y.shape, generator=g, device=dev))
    (logp, support, log_mass), _ = _check(backend, dtype, h, w, b, y, coefficients, temperature=0.8, **params)
    assert bool((log_mass <= 1e-6).all())
    assert bool((log_mass < -1e-3).any())  # the case truncates


TRANSFORMS = {
    "temperature": dict(temperature=1.7),
    "softcap": dict(softcap=2.0, logit_scale=1.5, temperature=0.7),
}


@pytest.fixture
def tile_selections(monkeypatch):
    """The rows ``support_tiles`` resolved from the tile candidates and those it passed to the rows' path."""
    from grpo_fast.backends import support_tiles

    counts = dict(resolved=0, passed=0)
    select = support_tiles._select

    def counted(*args):
        out = select(*args)
        counts["resolved"] += int(out[3].sum())
        counts["passed"] += int((~out[3]).sum())
        return out

    monkeypatch.setattr(support_tiles, "_select", counted)
    return counts


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rule", ["top_k", "top_p", "min_p", "all-three"])
def test_without_gradients_from_the_tile_candidates(dtype, rule, tile_selections, device):
    # no gradient: the Triton backend's record sweep lists each tile's 3 largest logits and the 4th; the rows they
    # resolve are the spec's, the others go to the rows' path (the same numbers), and a row's values do not depend
    # on which way its neighbours went
    dev = backend_device("triton", device)
    h, w, b, y, params = _case(rule, dtype, dev, shape=(2, 7, 40, 257))
    ref = _spec(h, w, y, b, temperature=0.8, **params)
    with torch.no_grad():
        out = grpo_fast.sampler_logprobs(h, w, y, bias=b, temperature=0.8, backend="triton", **params)
    for name, x, r in zip(("logprobs", "support", "mass"), out, ref):
        torch.testing.assert_close(x, r.float(), rtol=1e-5, atol=2e-5, msg=lambda m, name=name: f"{name}: {m}")
    assert tile_selections["resolved"] > 0
    if dtype != torch.float32:
        return
    # the same rows with gradients: the same sweep, with the entries' columns; equal within fp32's rounding
    with_grad = grpo_fast.sampler_logprobs(h, w.clone().requires_grad_(), y, bias=b, temperature=0.8, **params)
    for x, g in zip(out, with_grad):
        torch.testing.assert_close(x, g.detach(), rtol=0, atol=1e-5)


def _six_in_the_first_tile(dev):
    """(h, w, b, y): a bias puts the first sequence's 6 largest logits in the first vocabulary tile; the second's own
    logits dwarf it."""
    h, w, b, _ = head_inputs(2, 6, 24, 200, torch.float32, scale=0.2, device=dev)
    b = b.clone()
    b[:6] = torch.arange(20.0, 14.0, -1.0, device=dev)
    on_top = torch.zeros(2, 6, dtype=torch.bool, device=dev)
    on_top[0] = True  # row 0's tokens: the bias's six on top; row 1's: no bias
    h = torch.where(on_top[..., None], h, h * 40.0)  # row 1's own logits dwarf the bias
    return h, w, b, torch.where(on_top, 2, _z(h, w, b, 1.0).argmax(-1))


def test_rows_the_tile_candidates_cannot_show_take_the_rows_path(tile_selections, device):
    # a bias puts each row's 6 largest logits in the first vocabulary tile: its 3 candidates cannot show top_k=5's
    # threshold (the 4th largest there is above it), so those rows go to the rows' path; the others are resolved
    dev = backend_device("triton", device)
    h, w, b, y = _six_in_the_first_tile(dev)
    for params in (dict(top_k=5), dict(top_p=0.999), dict(min_p=1e-8)):
        tile_selections.update(resolved=0, passed=0)
        with torch.no_grad():
            out = grpo_fast.sampler_logprobs(h, w, y, bias=b, backend="triton", **params)
        ref = _spec(h, w, y, b, **params)
        for x, r in zip(out, ref):
            torch.testing.assert_close(x, r.float(), rtol=1e-5, atol=2e-5)
        assert tile_selections["passed"] >= 6, params


@pytest.mark.parametrize("tied, top_k", [(2, 2), (5, 3)])
def test_ties_in_a_tile_are_listed_or_take_the_rows_path(tied, top_k, tile_selections, device):
    # ``tied`` logits of the first vocabulary tile are equal (zero weight rows, one bias: exactly 9.0) and above all
    # the others. Two fit in the tile's 3 entries, each listed once: every row resolved there. Five do not: the
    # tile's 4th logit, the bound of its rest, equals them, and every row goes to the rows' path. Either way the kept
    # set holds every tied logit (ties at top-k's threshold are kept), the spec's; each target is one of them, so
    # its kept non-target mass is (tied - 1) / tied
    from grpo_fast.backends.triton_backend import TritonBackend
    from grpo_fast.head.transform import LogitTransform
    from grpo_fast.kernels.operands import HeadOperands, SamplerSupport

    dev = backend_device("triton", device)
    N, D, V = 6, 16, 100
    h, w, b, _ = head_inputs(1, N, D, V, torch.float32, scale=0.2, device=dev)
    h = h[0]
    w[1 : 1 + tied], b[1 : 1 + tied] = 0.0, 9.0
    y = torch.ones(N, dtype=torch.int64, device=dev)
    head = HeadOperands(h, w, y, b, LogitTransform())
    record = TritonBackend().support_forward(head, SamplerSupport(top_k=top_k), V, differentiable=False)
    assert tile_selections == (dict(resolved=N, passed=0) if tied <= 3 else dict(resolved=0, passed=N))
    z = _z(h.cpu(), w.cpu(), b.cpu(), 1.0)
    keep = reference.kept_mask(z, top_k=top_k)
    assert bool(keep[:, 1 : 1 + tied].all()) and bool((keep.sum(-1) == tied).all())
    kept_lse = torch.logsumexp(z.masked_fill(~keep, -math.inf), -1)
    assert torch.equal(record.threshold.cpu(), torch.where(keep, z, math.inf).amin(-1).float())
    torch.testing.assert_close(record.kept_lse.cpu().double(), kept_lse, rtol=0, atol=1e-6)
    torch.testing.assert_close(record.lse.cpu().double(), torch.logsumexp(z, -1), rtol=0, atol=1e-6)
    rest = -torch.expm1(z[:, 1] - kept_lse)
    torch.testing.assert_close(record.kept_nontarget_mass.cpu().double(), rest, rtol=1e-6, atol=0)
    assert torch.equal(record.kept_nontarget_mass.cpu(), torch.full((N,), (tied - 1) / tied))


def _carried(h, w, b, y, support, temperature=1.0):
    """The Triton backend's record of the parameters' support with gradients (the carried kept ids)."""
    from grpo_fast.backends.triton_backend import TritonBackend
    from grpo_fast.head.transform import LogitTransform
    from grpo_fast.kernels.operands import HeadOperands

    head = HeadOperands(h, w, y, b, LogitTransform(temperature=temperature))
    return TritonBackend().support_forward(head, support, w.shape[0], differentiable=True)


@pytest.mark.parametrize("rule", ["top_k", "top_p", "all-three"])
def test_with_gradients_the_tile_candidates_carry_the_kept_set(rule, device):
    # with gradients the record sweep's candidates (and their columns) name each row's kept set: the record carries
    # the spec's ids, whose gathers give the support's gradient (the spec's, test_matches_the_spec)
    from grpo_fast.kernels.operands import SamplerSupport

    dev = backend_device("triton", device)
    h, w, b, y, params = _case(rule, torch.float32, dev, shape=(1, 12, 40, 300))
    h = h[0]
    record = _carried(h, w, b, y[0], SamplerSupport(**params), temperature=0.8)
    keep = reference.kept_mask(_z(h, w, b, 0.8), **params)
    ids = record.carried_ids.cpu()
    assert ids.shape == (12, 64)
    carried = 0
    for row in range(12):
        listed = ids[row][ids[row] >= 0]
        if listed.numel():  # else the rows' path (top-p's cut past the candidates' list)
            assert sorted(listed.tolist()) == keep[row].nonzero().squeeze(-1).tolist(), row
            carried += 1
    assert carried == 12 if rule == "top_k" else carried > 0


@pytest.mark.parametrize("params", [dict(top_k=5), dict(top_p=0.999)], ids=str)
def test_with_gradients_rows_the_candidates_leave_take_the_rows_path(params, device):
    # a bias puts half the rows' 6 largest logits in the first tile (its 3 entries cannot show the cut): those rows
    # carry no ids and take the rows' path in both passes, the others carry theirs; every gradient the spec's
    from grpo_fast.kernels.operands import SamplerSupport

    dev = backend_device("triton", device)
    h, w, b, y = _six_in_the_first_tile(dev)
    record = _carried(h.reshape(12, -1), w, b, y.reshape(-1), SamplerSupport(**params))
    carried = (record.carried_ids[:, 0] >= 0).reshape(2, 6).cpu()
    assert not bool(carried[0].any()) and bool(carried[1].any()), carried
    g = torch.Generator().manual_seed(3)
    coefficients = (randn(2, 6, generator=g, device=dev), randn(2, 6, generator=g, device=dev))
    _check("triton", torch.float32, h, w, b, y, coefficients, **params)


def test_with_gradients_a_tie_among_a_tiles_kept_entries_takes_the_rows_path(device):
    # two equal logits on top of one tile (zero weight rows, one bias): without gradients the candidates list both,
    # with gradients their columns cannot be told apart (one sum names both), so every row takes the rows' path;
    # the support and its gradients the spec's either way
    from grpo_fast.kernels.operands import SamplerSupport

    dev = backend_device("triton", device)
    h, w, b, _ = head_inputs(1, 6, 16, 100, torch.float32, scale=0.2, device=dev)
    w, b = w.clone(), b.clone()
    w[1:3], b[1:3] = 0.0, 9.0
    y = torch.ones(1, 6, dtype=torch.int64, device=dev)
    record = _carried(h[0], w, b, y[0], SamplerSupport(top_k=3))
    assert bool((record.carried_ids[:, 0] < 0).all())
    g = torch.Generator().manual_seed(4)
    coefficients = (randn(1, 6, generator=g, device=dev), randn(1, 6, generator=g, device=dev))
    _check("triton", torch.float32, h, w, b, y, coefficients, top_k=3)


def _tile_candidates(z, columns, entries):
    """kernels.forward's tile candidates of rows z [n, V] (fp32) in torch: per tile of ``columns``, its ``entries``
    largest logits, ties repeated, then the next ([entries + 1, tiles, n])."""
    n, V = z.shape
    tiles = -(-V // columns)
    padded = torch.full((n, tiles * columns), -math.inf).index_copy(1, torch.arange(V), z).view(n, tiles, columns)
    return padded.topk(entries + 1, dim=-1).values.permute(2, 1, 0).contiguous()


@pytest.mark.parametrize("params", [dict(top_k=50), dict(top_k=64), dict(top_p=0.9), dict(min_p=0.05)], ids=str)
def test_tile_candidates_at_a_real_vocabulary(params):
    # Qwen2.5's vocabulary in the H200's 256-column tiles: top-k up to 64 resolves every row of random logits (4 of
    # its set in one tile is rare), min-p and top-p where the candidates show the cut; resolved rows' threshold and
    # kept sums are the direct ones over the whole row
    from grpo_fast.backends import support_tiles
    from grpo_fast.kernels import forward as kforward
    from grpo_fast.kernels.operands import SamplerSupport

    g = torch.Generator().manual_seed(0)
    n, V = 16, 151936
    z = torch.randn(n, V, generator=g) * 6.0
    m, y = z.max(-1)
    s = torch.exp(z - m[:, None]).sum(-1)
    candidates = _tile_candidates(z, 256, kforward.TILE_CANDIDATES)
    tau, kept, kept_rest, resolved = support_tiles._select(candidates, m, s, m, SamplerSupport(**params), V)
    assert int(resolved.sum()) == n if "top_k" in params else int(resolved.sum()) >= n // 2
    keep = reference.kept_mask(z.double(), **params)
    r = resolved
    assert torch.equal(tau[r], torch.where(keep, z, math.inf).amin(-1)[r]) or "min_p" in params
    e = torch.exp(z.double() - m[:, None].double())
    direct = torch.where(keep, e, 0.0).sum(-1)
    torch.testing.assert_close(kept[r].double(), direct[r], rtol=1e-5, atol=0)
    rest = direct - 1.0  # the target is each row's largest: exp(0) = 1
    torch.testing.assert_close(kept_rest[r].double(), rest[r], rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("transform", list(TRANSFORMS))
@pytest.mark.parametrize("rule", ["top_p", "replayed"])
def test_logit_transforms(backend, transform, rule, device):
    dev = backend_device(backend, device)
    kw = TRANSFORMS[transform]
    h, w, b, y, params = _case(rule, torch.float32, dev, **kw)
    g = torch.Generator().manual_seed(6)
    coefficients = (randn(*y.shape, generator=g, device=dev), randn(*y.shape, generator=g, device=dev))
    _check(backend, torch.float32, h, w, b, y, coefficients, **kw, **params)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("rule", ["top_k", "replayed"])
def test_lora_gradients(backend, rule, device):
    dev = backend_device(backend, device)
    h, w, b, y, params = _case(rule, torch.float32, dev, temperature=1.0)
    g = torch.Generator().manual_seed(7)
    a = (randn(4, h.shape[-1], generator=g, device=dev) * 0.01).requires_grad_()
    lb = (randn(w.shape[0], 4, generator=g, device=dev) * 0.01).requires_grad_()
    results = []
    for fn in (grpo_fast.sampler_logprobs, _spec):
        a.grad = lb.grad = None
        lora = grpo_fast.HeadLora(a, lb, 2.0)
        kwargs = dict(backend=backend) if fn is grpo_fast.sampler_logprobs else {}
        out = fn(h, w, y, bias=b, lora=lora, **params, **kwargs)
        out[1].sum().backward()
        results.append((out[1].detach(), a.grad.clone(), lb.grad.clone()))
    (support, da, db), (ref_support, ref_da, ref_db) = results
    torch.testing.assert_close(support, ref_support.float(), rtol=1e-5, atol=2e-5)
    assert_grad_close(da, ref_da.float(), torch.float32, "lora a")
    assert_grad_close(db, ref_db.float(), torch.float32, "lora b")
    # without gradients (the Triton backend: the record sweep's tile candidates, LoRA in its tiles)
    with torch.no_grad():
        lora = grpo_fast.HeadLora(a, lb, 2.0)
        out = grpo_fast.sampler_logprobs(h, w, y, bias=b, lora=lora, backend=backend, **params)
    torch.testing.assert_close(out[1], ref_support.float(), rtol=1e-5, atol=2e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_untruncated_support_is_the_logprobs(backend, device):
    dev = backend_device(backend, device)
    h, w, b, y = head_inputs(2, 5, 24, 77, torch.bfloat16, device=dev)
    out = grpo_fast.sampler_logprobs(h, w, y, bias=b, backend=backend, top_k=-1, top_p=1.0, min_p=0.0)
    assert torch.equal(out.support_logprobs, out.logprobs)
    assert torch.equal(out.log_kept_mass, torch.zeros_like(out.logprobs))
    assert torch.equal(out.logprobs, grpo_fast.logprobs(h, w, y, bias=b, backend=backend))
    # a top-k of the whole vocabulary keeps everything: the same numbers, through the kept-set path
    full = grpo_fast.sampler_logprobs(h, w, y, bias=b, backend=backend, top_k=77)
    torch.testing.assert_close(full.support_logprobs, out.logprobs, rtol=0, atol=2e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_kept_sets_of_one_entry(backend, device):
    dev = backend_device(backend, device)
    h, w, b, _ = head_inputs(2, 5, 24, 77, torch.float32, device=dev)
    y = _z(h, w, b, 1.0).argmax(-1)
    out = grpo_fast.sampler_logprobs(h, w, y, bias=b, backend=backend, top_k=1)
    assert torch.equal(out.support_logprobs, torch.zeros_like(out.logprobs))  # z_y - z_y
    torch.testing.assert_close(out.log_kept_mass, out.logprobs)
    replayed = grpo_fast.sampler_logprobs(h, w, y, bias=b, backend=backend, kept_ids=y[..., None])
    assert torch.equal(replayed.support_logprobs, out.support_logprobs)


@pytest.mark.parametrize("backend", BACKENDS)
def test_ties_at_the_thresholds_are_kept(backend, device):
    # weight rows repeated: logits tied exactly in every dtype; top-k and top-p cut inside the tie groups
    dev = backend_device(backend, device)
    h, w, b, _ = head_inputs(2, 4, 16, 12, torch.float32, bias=False, device=dev)
    w = w.repeat(3, 1)  # each logit three times
    z = _z(h, w, None, 1.0)
    for params in (dict(top_k=4), dict(top_k=5), dict(top_p=0.5)):
        keep = reference.kept_mask(z, **params)
        assert bool((keep.sum(-1) % 3 == 0).all())  # whole tie groups
        y = z.argmax(-1)
        out = grpo_fast.sampler_logprobs(h, w, y, backend=backend, **params)
        _, ref_support, _ = reference.sampler_logprobs(h, w, y, compute_dtype=F64, **params)
        torch.testing.assert_close(out.support_logprobs, ref_support, rtol=1e-5, atol=2e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_replayed_sets_equal_the_parameters(backend, device):
    dev = backend_device(backend, device)
    h, w, b, y, params = _case("all-three", torch.float32, dev)
    keep = reference.kept_mask(_z(h, w, b, 0.8), **params)
    ids = torch.where(keep, torch.arange(keep.shape[-1], device=dev), -1)
    by_parameters = grpo_fast.sampler_logprobs(h, w, y, bias=b, temperature=0.8, backend=backend, **params)
    replayed = grpo_fast.sampler_logprobs(h, w, y, bias=b, temperature=0.8, backend=backend, kept_ids=ids)
    torch.testing.assert_close(replayed.support_logprobs, by_parameters.support_logprobs, rtol=1e-6, atol=2e-6)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("replayed", [False, True], ids=["parameters", "replayed"])
def test_confident_tokens(backend, replayed, device):
    # logits of ~40 apart: the kept mass is 1 - 1e-17; its log and the gradients exact relative to their size (the
    # target's column 1 - p_y and 1 - q_y carried: formed as 1 - p they would cancel to 0)
    dev = backend_device(backend, device)
    h, w, b, _ = head_inputs(2, 5, 32, 90, torch.float32, scale=3.0, device=dev)
    z = _z(h, w, b, 1.0)
    y = z.argmax(-1)
    params = dict(top_p=0.95)
    if replayed:  # the two most likely entries: q_y is 1 - 1e-17 too
        params = dict(kept_ids=z.topk(2, dim=-1).indices)
    coefficients = (torch.zeros(y.shape, device=dev), torch.ones(y.shape, device=dev))  # the support alone
    (_, _, log_mass), grads = _check(backend, torch.float32, h, w, b, y, coefficients, **params)
    assert bool((log_mass <= 0).all())
    # each token's dL/dh = (1 - q_y) (W_y - E_q[W]) exact relative to its own size, the confident ones' too (1e-6
    # of the others': formed as 1 - q_y by cancellation, their error would be 1e-7 / 1e-6 of their size)
    (_, ref_grads) = _run(_spec, h, w, b, y, coefficients, **params)
    row_error = (grads[0] - ref_grads[0].float()).abs().amax(-1)
    row_size = ref_grads[0].abs().amax(-1).float()
    assert row_size.min().item() < 1e-4 * row_size.max().item()  # the case holds confident tokens
    assert bool((row_error <= 1e-4 * row_size).all()), (row_error / row_size).max()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("rule", ["top_p", "replayed"])
def test_masked_rows_and_empty_masks(backend, rule, device):
    dev = backend_device(backend, device)
    h, w, b, y, params = _case(rule, torch.float32, dev)
    mask = torch.ones(y.shape, dtype=torch.bool, device=dev)
    mask[0, 3:] = False
    mask[1, 0] = False
    y = torch.where(mask, y, -100)  # masked targets are never read
    if "kept_ids" in params:
        params["kept_ids"] = torch.where(mask[..., None], params["kept_ids"], 10**6)  # nor their kept sets
    g = torch.Generator().manual_seed(8)
    coefficients = (randn(*y.shape, generator=g, device=dev), randn(*y.shape, generator=g, device=dev))
    ref_y = y.clamp(min=0)
    ref_params = {k: (v.clamp(max=w.shape[0] - 1) if k == "kept_ids" else v) for k, v in params.items()}
    for check_values in (True, False):
        out = grpo_fast.sampler_logprobs(h, w, y, mask, bias=b, backend=backend, check_values=check_values, **params)
        ref = _spec(h, w, ref_y, b, mask, **ref_params)
        for x, r in zip(out, ref):
            assert torch.equal(x[~mask], torch.zeros_like(x[~mask]))
            torch.testing.assert_close(x[mask], r[mask].float(), rtol=1e-5, atol=2e-5)
    _check(backend, torch.float32, h, w, b, ref_y, coefficients, completion_mask=mask, **ref_params)
    empty = torch.zeros_like(mask)
    leaves = [x.clone().requires_grad_() for x in (h, w, b)]
    out = grpo_fast.sampler_logprobs(*leaves[:2], y, empty, bias=leaves[2], backend=backend, **params)
    assert all(torch.equal(x, torch.zeros_like(x)) for x in out)
    (out.logprobs.sum() + out.support_logprobs.sum()).backward()
    assert all(torch.equal(x.grad, torch.zeros_like(x.grad)) for x in leaves if x.grad is not None)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_target_outside_its_kept_set(backend, device):
    dev = backend_device(backend, device)
    h, w, b, _ = head_inputs(1, 4, 16, 40, torch.float32, device=dev)
    y = _z(h, w, b, 1.0).argmin(-1)  # never in a top-5
    with pytest.raises(ValueError, match="not in the kept set"):
        grpo_fast.sampler_logprobs(h, w, y, bias=b, backend=backend, top_k=5)
    out = grpo_fast.sampler_logprobs(h, w, y, bias=b, backend=backend, top_k=5, check_values=False)
    assert bool(out.support_logprobs.isnan().all()) and bool(out.logprobs.isfinite().all())
    ids = torch.zeros((1, 4, 1), dtype=torch.int64, device=dev) + (y[..., None] + 1) % 40
    with pytest.raises(ValueError, match=r"targets\[0, 0\] is not in its kept set"):
        grpo_fast.sampler_logprobs(h, w, y, bias=b, backend=backend, kept_ids=ids)
    leaf = h.clone().requires_grad_()
    out = grpo_fast.sampler_logprobs(leaf, w, y, bias=b, backend=backend, kept_ids=ids, check_values=False)
    assert bool(out.support_logprobs.isnan().all())
    out.support_logprobs.sum().backward()
    assert bool(leaf.grad.isnan().all())  # never a number that hides it


def test_named_errors():
    h, w, b, y = head_inputs(2, 3, 8, 20)
    call = lambda **kw: grpo_fast.sampler_logprobs(h, w, y, backend="torch", **kw)  # noqa: E731
    cases = [
        (dict(top_k=-2), ValueError, "top_k must be >= -1"),
        (dict(top_k=2.0), TypeError, "top_k must be an int"),
        (dict(top_k=True), TypeError, "top_k must be an int"),
        (dict(top_p=0.0), ValueError, r"top_p must be in \(0, 1\]"),
        (dict(top_p=1.5), ValueError, r"top_p must be in \(0, 1\]"),
        (dict(top_p="0.9"), TypeError, "top_p must be a float"),
        (dict(min_p=-0.1), ValueError, r"min_p must be in \[0, 1\]"),
        (dict(min_p=1.1), ValueError, r"min_p must be in \[0, 1\]"),
        (dict(kept_ids=y[..., None], top_p=0.9), ValueError, "either kept_ids"),
        (dict(kept_ids=y[..., None].float()), TypeError, "kept_ids must be an integer tensor"),
        (dict(kept_ids=y), ValueError, r"kept_ids must have shape \[B, T, K\]"),
        (dict(kept_ids=y[:1, :, None]), ValueError, r"kept_ids must have shape \[B, T, K\]"),
        (dict(kept_ids=torch.cat([y[..., None], y[..., None] * 0 + 20], -1)), ValueError, r"\[0, V\) = \[0, 20\)"),
        (dict(kept_ids=torch.cat([y[..., None], y[..., None]], -1)), ValueError, "an id twice"),
        (dict(kept_ids=y[..., None].to("meta")), ValueError, "kept_ids is on meta"),
        (dict(temperature=0.0), ValueError, "temperature"),
    ]
    for kwargs, error, match in cases:
        with pytest.raises(error, match=match):
            call(**kwargs)


def test_pack_kept_ids():
    kept = [[[3, 1], [0, 2, 4]], [{7: -0.1, 8: float("-inf"), 9: -2.5}]]
    packed = grpo_fast.pack_kept_ids(kept, length=3)
    assert packed.dtype == torch.int64 and packed.shape == (2, 3, 3)
    assert packed.tolist() == [[[3, 1, -1], [0, 2, 4], [-1, -1, -1]], [[7, 9, -1], [-1, -1, -1], [-1, -1, -1]]]
    with pytest.raises(ValueError, match="more than length=1"):
        grpo_fast.pack_kept_ids(kept, length=1)
    with pytest.raises(ValueError, match="kept ids must be >= 0"):
        grpo_fast.pack_kept_ids([[[1, -3]]])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("rule", ["top_p", "replayed"])
def test_a_nan_reaches_its_row_only(backend, rule, device):
    # a NaN hidden state: NaN log-probs at its token, never an error that calls it a target outside its set, and the
    # other tokens as without it
    dev = backend_device(backend, device)
    h, w, b, y, params = _case(rule, torch.float32, dev)
    clean = grpo_fast.sampler_logprobs(h, w, y, bias=b, temperature=0.8, backend=backend, **params)
    h = h.clone()
    h[1, 2, 5] = float("nan")
    with non_finite_inputs():
        out = grpo_fast.sampler_logprobs(h, w, y, bias=b, temperature=0.8, backend=backend, **params)
    nan = torch.zeros_like(y, dtype=torch.bool)
    nan[1, 2] = True
    for x, c in zip(out, clean):
        assert bool(x[nan].isnan().all())
        assert torch.equal(x[~nan], c[~nan])
