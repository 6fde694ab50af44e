"""kernels.tile_selection: the tile candidates' selection kernel against its torch twin (support_tiles._select) on
rows built to reach every branch: ties inside a tile and across tiles, tiles all -inf, NaN logits, targets at -inf,
rows the candidates cannot resolve, vocabularies of fewer entries than the list or than k; every combination of
min-p, top-k and top-p (top_p = 1 and top_k = 0 among them). tau and resolved are the twin's bit for bit; the kept
sums within 2e-6 of the kept sum (fp32 sums of at most a few hundred positive terms in another order)."""

import itertools
import math

import pytest
import torch

from grpo_fast.backends import support_tiles
from grpo_fast.kernels import tile_selection
from grpo_fast.kernels.operands import SamplerSupport

# the sums' tolerance, relative to the kept sum (the larger of the two, both sums of positive terms)
SUM_RTOL = 2e-6


def _candidates(z, columns):
    """kernels.forward's tile candidates of rows z [n, V] fp32 in torch: each tile's 3 largest logits, ties repeated,
    then its 4th ([4, tiles, n], rows contiguous). NaN sorts as torch's topk puts it, which the kernel need not
    match: such rows' records are NaN and neither path resolves them."""
    n, V = z.shape
    tiles = -(-V // columns)
    padded = torch.full((n, tiles * columns), -math.inf).index_copy(1, torch.arange(V), z).view(n, tiles, columns)
    return padded.topk(4, dim=-1).values.permute(2, 1, 0).contiguous()


def _rows(n, V, seed):
    """Rows of logits [n, V] with every kind of row, and their targets."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(n, V, generator=g) * 3.0
    kind = torch.arange(n) % 8
    z[kind == 1] = (z[kind == 1] * 2).round() / 2  # many ties, inside tiles and across them
    z[kind == 2] = (z[kind == 2] / 3).round()  # few distinct values: ties past a tile's 3 and the list
    z[kind == 3, : V // 3] = -math.inf  # whole tiles of -inf
    z[kind == 4, 5] = math.nan
    z[kind == 5, :6] = 12.0 + torch.arange(6.0)  # 6 of the largest in the first tile: top-k up to 6 unresolved
    z[kind == 6, :] = z[kind == 6, :1]  # one value everywhere
    y = torch.randint(0, V, (n,), generator=g)
    y[kind == 3] = 0  # a target at -inf
    return z, y


def _record(z, y):
    m = z.max(-1).values
    pivot = torch.where(m == -math.inf, 0.0, m)
    s = torch.exp(z - pivot[:, None]).sum(-1)
    return m, s, z.gather(1, y[:, None]).squeeze(1)


def _both(candidates, m, s, target_logit, support, V):
    n = m.shape[0]
    twin = support_tiles._select(candidates, m, s, target_logit, support, V)
    out = (*torch.empty(3, n), torch.zeros(n, dtype=torch.bool))
    got = tile_selection.select(candidates, m, s, target_logit, support, V, out)
    return twin, got


def _check(z, twin, got, m, s, target_logit):
    tau, kept, kept_rest, resolved = twin
    assert torch.equal(got[3], resolved)
    clean = ~z.isnan().any(-1)  # a NaN row: not resolved either way, its tau not compared
    assert torch.equal(got[0][clean], tau[clean])
    r = resolved
    scale = kept[r]
    for a, b in ((got[1], kept), (got[2], kept_rest)):
        assert bool(((a[r] - b[r]).abs() <= SUM_RTOL * scale).all()), (a[r] - b[r]).abs().max()
    return int(r.sum())


PARAMETERS = list(itertools.product((0.0, 0.05), (0, 1, 5, 64), (1.0, 0.6, 0.97)))


@pytest.mark.parametrize("columns, V", [(8, 200), (4, 21)])
def test_selection_equals_the_twin(columns, V):
    # 200 columns in 8-column tiles: 25 tiles, 75 entries, past the 65 a row lists; 21 in 4-column tiles: 6 tiles,
    # 18 entries, fewer than top-k = 64 (unresolved) and than the list
    z, y = _rows(48, V, seed=V)
    candidates = _candidates(z, columns)
    m, s, target_logit = _record(z, y)
    resolved = 0
    for min_p, top_k, top_p in PARAMETERS:
        support = SamplerSupport(min_p=min_p, top_k=top_k, top_p=top_p)
        twin, got = _both(candidates, m, s, target_logit, support, V)
        resolved += _check(z, twin, got, m, s, target_logit)
        # some rows resolved, some not, across the cases: both branches compared
    assert 0 < resolved < len(PARAMETERS) * z.shape[0]


def test_selection_over_many_tiles_and_a_top_k_past_the_vocabulary():
    # 40 tiles of 3 entries: three steps of 16 tiles (the list's merges, the last one partly past the tiles); top-k
    # past the vocabulary is no top-k: alone it keeps every logit, which the candidates never show
    V = 40 * 6
    z, y = _rows(24, V, seed=3)
    candidates = _candidates(z, 6)
    m, s, target_logit = _record(z, y)
    for support in (SamplerSupport(top_k=V), SamplerSupport(top_k=V, top_p=0.8), SamplerSupport(min_p=0.01)):
        twin, got = _both(candidates, m, s, target_logit, support, V)
        resolved = _check(z, twin, got, m, s, target_logit)
        assert resolved == 0 if support.top_p == 1 and support.min_p == 0 else resolved > 0


def test_rows_a_program_leaves_and_a_launchs_slices():
    # rows past a program's block are not written; a launch's candidates are a view of a larger buffer, its outputs
    # slices of [N] tensors (as support_tiles passes them)
    V = 64
    z, y = _rows(5, V, seed=7)
    candidates = _candidates(z, 8)
    buffer = torch.full((candidates.numel() + 100,), math.nan)
    candidates = buffer[: candidates.numel()].view(candidates.shape).copy_(candidates)
    m, s, target_logit = _record(z, y)
    support = SamplerSupport(top_k=4, top_p=0.9)
    tau, kept, kept_rest = torch.full((3, 9), -7.0)
    resolved = torch.ones(9, dtype=torch.bool)
    out = tuple(x[2:7] for x in (tau, kept, kept_rest, resolved))
    tile_selection.select(candidates, m, s, target_logit, support, V, out)
    twin = support_tiles._select(candidates, m, s, target_logit, support, V)
    _check(z, twin, out, m, s, target_logit)
    assert bool((tau[:2] == -7.0).all() and (tau[7:] == -7.0).all() and resolved[:2].all() and resolved[7:].all())


def test_candidates_of_another_layout_are_refused():
    z, y = _rows(4, 32, seed=1)
    m, s, target_logit = _record(z, y)
    out = (*torch.empty(3, 4), torch.zeros(4, dtype=torch.bool))
    with pytest.raises(ValueError, match="candidates"):
        tile_selection.select(torch.zeros(3, 4, 4), m, s, target_logit, SamplerSupport(top_k=2), 32, out)
