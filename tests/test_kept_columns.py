"""kernels.tile_selection.kept_columns: the kept ids from the tile candidates' columns (the parameters' tile path with
gradients) against its torch twin (support_tiles.kept_columns) and against the ids read from the whole rows.

Candidates are built in torch from rows of logits as the sweep lists them (each tile's 3 largest, ties repeated, the
4th, and ``kforward._tile_columns``' packed sums of columns; the last tile padded with -inf), and from the sweep
itself on a head whose logits are exact (small integers). Rows of every kind: distinct values, ties inside tiles
(the columns cannot name them: resolved cleared) and across tiles, more than LISTED kept entries, rows the selection
left, tiles of -inf, NaN entries, negative logits, a row of -inf. ``resolved`` is the twin's bit for bit; the ids
too where the kept values differ (both by value descending), the same set in the same value order where they tie
across tiles (torch's topk orders a tie its own way)."""

import dataclasses
import math

import pytest
import torch

from grpo_fast.backends import support_tiles
from grpo_fast.head.transform import LogitTransform
from grpo_fast.kernels import config as kconfig
from grpo_fast.kernels import forward as kforward
from grpo_fast.kernels import tile_selection
from grpo_fast.kernels.operands import HeadOperands

LISTED = tile_selection.LISTED


def _candidates(z, block_v):
    """[5, tiles, n] fp32 (rows contiguous) of rows z [n, V]: each tile's 4 largest logits (ties repeated; torch's
    topk puts NaN first), then ``_tile_columns``' int32 in the fp32 field's bits: F_k = the sum of the columns j
    with z_j >= the k-th, packed F_1 + F_2 2^10 + F_3 2^20 with int32's wraparound (a tile of -inf overflows)."""
    n, V = z.shape
    tiles = -(-V // block_v)
    padded = torch.full((n, tiles * block_v), -math.inf).index_copy(1, torch.arange(V), z).view(n, tiles, block_v)
    top = padded.topk(4, dim=-1).values
    column = torch.arange(block_v)
    sums = [torch.where(padded >= top[..., k : k + 1], column, 0).sum(-1) for k in range(3)]
    bits = kforward.COLUMN_FIELD_BITS
    packed = (sums[0] + (sums[1] << bits) + (sums[2] << (2 * bits))) & 0xFFFFFFFF
    packed = torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)
    return torch.cat([top.permute(2, 1, 0), packed.T[None].contiguous().view(torch.float32)]).contiguous()


def _rows(n, V, block_v, seed):
    """Rows of logits [n, V] of every kind, a threshold a row (the k-th largest logit, k varied, or between two) and
    the selection's resolved flags (some rows left)."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(n, V, generator=g) * 3.0
    kind = torch.arange(n) % 8
    z[kind == 1] = (z[kind == 1] * 2).round() / 2  # ties inside tiles and across them
    z[kind == 2, : V // 3] = -math.inf  # whole tiles of -inf (and the first of the kept ones' tiles part -inf)
    # NaN entries: two in the first tile, whose third entry is kept, one in another
    z[kind == 3, 5 : 3 * block_v : block_v - 1] = math.nan
    z[kind == 3, 6] = math.nan
    z[kind == 3, 7] = 25.0
    z[kind == 4, :block_v] = 20.0 + torch.arange(block_v, dtype=torch.float32) / 8  # the top of one tile
    z[kind == 5] -= 30.0  # every logit negative: the keys' order of negative floats
    z[kind == 6] = -math.inf  # nothing kept
    z[kind == 7, 3 : 2 * block_v : block_v] = 30.0  # the largest twice, in two tiles
    k = torch.tensor([1, 3, 17, 40, 64, 65, 100, 2])[torch.randint(0, 8, (n,), generator=g)]
    ordered = z.nan_to_num(nan=-math.inf).sort(-1, descending=True).values
    tau = ordered.gather(1, (k - 1).clamp(max=V - 1)[:, None]).squeeze(1)
    between = torch.rand(n, generator=g) < 0.25  # a threshold between the k-th and the (k+1)-th
    tau = torch.where(between, (tau + ordered.gather(1, k.clamp(max=V - 1)[:, None]).squeeze(1)) / 2, tau)
    tau[kind == 6] = 0.0
    resolved = torch.rand(n, generator=g) > 0.15  # the rest left by the selection
    return z, tau, resolved


def _both(candidates, tau, resolved, block_v, device):
    n = tau.shape[0]
    twin_ids, got_ids = torch.full((2, n, LISTED), 7, dtype=torch.int64)
    twin_resolved = resolved.clone()
    support_tiles.kept_columns(candidates, tau, twin_resolved, block_v, twin_ids)
    got_resolved = resolved.clone().to(device)
    got_ids = got_ids.to(device)
    tile_selection.kept_columns(candidates.to(device), tau.to(device), got_resolved, block_v, got_ids)
    return (twin_ids, twin_resolved), (got_ids.cpu(), got_resolved.cpu())


def _check(candidates, tau, twin, got):
    """resolved bit for bit; the ids equal, or where kept values tie across tiles the same set in the same value
    order. Returns (rows resolved, rows whose kept values tie across tiles)."""
    (twin_ids, twin_resolved), (got_ids, got_resolved) = twin, got
    assert torch.equal(got_resolved, twin_resolved)
    values = candidates[:3].permute(2, 1, 0).reshape(tau.shape[0], -1)
    kept = values >= tau[:, None]
    ties = 0
    for row in range(tau.shape[0]):
        a, b = got_ids[row], twin_ids[row]
        if torch.equal(a, b):
            continue
        row_values = values[row][kept[row]]
        assert twin_resolved[row] and row_values.unique().numel() < row_values.numel(), row
        assert torch.equal(a.sort().values, b.sort().values), row
        count = int((b >= 0).sum())
        assert bool((a[count:] == -1).all())
        ties += 1
    return int(twin_resolved.sum()), ties


@pytest.mark.parametrize("block_t", [None, 16])
@pytest.mark.parametrize("block_v, V", [(128, 41 * 128 + 37), (256, 9 * 256 + 100)])
def test_kept_columns_equal_the_twin(block_v, V, block_t, monkeypatch, device):
    # 42 tiles of 128 columns, 10 of 256: one step of the launch's tiles, or (16 tiles a step) 3 steps, the last
    # mostly past the tiles, and 1
    if block_t is not None:
        monkeypatch.setattr(tile_selection, "COLUMNS_BLOCK_T", block_t)
    z, tau, resolved = _rows(40, V, block_v, seed=block_v)
    candidates = _candidates(z, block_v)
    twin, got = _both(candidates, tau, resolved, block_v, device)
    count, ties = _check(candidates, tau, twin, got)
    # both outcomes compared: rows resolved, rows the kernel cleared (a tie in a tile, more than LISTED kept) and
    # rows left before; ids of several entries
    assert 0 < count < int(resolved.sum()) < z.shape[0] and ties > 0
    assert int((twin[0] >= 0).sum(-1).max()) > 16


def _placed_rows(n, V, block_v, seed):
    """Rows [n, V] whose kept logits (>= tau, tau [n] their least) are placed: 1 to 90 of them, at most 3 a tile
    (some rows 4 in one tile), over a background 10 below; some with two equal kept logits (in one tile or across
    tiles), some with a NaN in a tile of kept entries."""
    g = torch.Generator().manual_seed(seed)
    tiles = -(-V // block_v)
    z = torch.randn(n, V, generator=g) - 10.0
    tau = torch.empty(n)
    for row in range(n):
        count = [1, 5, 40, 64, 65, 90, 12, 30][row % 8]
        slots = torch.randperm(tiles * 3, generator=g)[:count]  # a tile's 3 slots: at most 3 kept a tile
        # 4 distinct columns a tile (the last one's below V): 3 slots, and a NaN's
        widths = [min(block_v, V - t * block_v) for t in range(tiles)]
        columns = torch.stack([torch.randperm(width, generator=g)[:4] for width in widths])
        tile, slot = slots // 3, slots % 3
        at = tile * block_v + columns[tile, slot]
        values = torch.rand(count, generator=g) * 10
        kind = row // 8 % 4
        if kind == 1 and count > 1:  # two equal kept logits: in one tile where two slots share one, else across
            values[1] = values[0]
        if kind == 2 and count >= 4:  # a 4th kept logit in the tile of the first (its 4th no longer below tau)
            at = torch.cat([at, tile[:1] * block_v + columns[tile[0], 3]])
            values = torch.cat([values, values[:1] + 0.5])
        z[row, at] = values
        tau[row] = values.min()
        if kind == 3:
            z[row, tile[0] * block_v + columns[tile[0], 3]] = math.nan
    return z, tau


def test_kept_columns_are_the_rows_kept_logits(device):
    # against the ids read from the whole rows: where the selection's precondition holds (every tile's 4th below tau)
    # and the kernel keeps the row resolved, its ids are {v : z_v >= tau}, by value descending; and it clears a row
    # exactly where a tile's kept entries tie or more than LISTED are kept
    block_v, V = 128, 30 * 128 + 5
    n = 64
    z, tau = _placed_rows(n, V, block_v, seed=11)
    candidates = _candidates(z, block_v)
    bounded = candidates[3].amax(0) < tau
    ids = torch.full((n, LISTED), 7, dtype=torch.int64, device=device)
    got_resolved = bounded.clone().to(device)
    tile_selection.kept_columns(candidates.to(device), tau.to(device), got_resolved, block_v, ids)
    ids, got_resolved = ids.cpu(), got_resolved.cpu()
    padded = torch.full((n, candidates.shape[1] * block_v), -math.inf)
    padded[:, :V] = z
    kept = padded >= tau[:, None]
    tied_tile = torch.zeros(n, dtype=torch.bool)
    for row in range(n):
        for t, tile in enumerate(padded[row].view(-1, block_v)):
            v = tile[kept[row].view(-1, block_v)[t]]
            tied_tile[row] |= v.unique().numel() < v.numel()
    expected = bounded & ~tied_tile & (kept.sum(-1) <= LISTED)
    assert torch.equal(got_resolved, expected)
    checked = 0
    for row in expected.nonzero().squeeze(-1).tolist():
        truth = kept[row].nonzero().squeeze(-1)
        count = truth.numel()
        assert torch.equal(ids[row, :count].sort().values, truth), row
        assert bool((ids[row, count:] == -1).all()), row
        values = padded[row, ids[row, :count]]
        assert bool((values[1:] <= values[:-1]).all()), row
        checked += count > 1
    for row in (~expected).nonzero().squeeze(-1).tolist():
        assert bool((ids[row] == -1).all()), row
    # rows of many ids checked; rows cleared by a tie in a tile and by more than LISTED kept; rows left unbounded
    assert checked >= 20 and int((~bounded).sum()) > 0
    assert int((bounded & tied_tile).sum()) > 0 and int((bounded & (kept.sum(-1) > LISTED)).sum()) > 0


def test_a_launchs_slices_and_rows_past_a_program(device):
    # a launch's outputs are slices of [N] tensors (as parameter_forward passes them): rows around them untouched;
    # 37 rows: a program's block partly past them
    block_v, V = 128, 700
    z, tau, resolved = _rows(37, V, block_v, seed=5)
    candidates = _candidates(z, block_v)
    twin = (torch.full((37, LISTED), 7, dtype=torch.int64), resolved.clone())
    support_tiles.kept_columns(candidates, tau, twin[1], block_v, twin[0])
    ids = torch.full((41, LISTED), 9, dtype=torch.int64, device=device)
    flags = torch.ones(41, dtype=torch.bool, device=device)
    flags[2:39] = resolved.to(device)
    tile_selection.kept_columns(candidates.to(device), tau.to(device), flags[2:39], block_v, ids[2:39])
    _check(candidates, tau, twin, (ids[2:39].cpu(), flags[2:39].cpu()))
    assert bool((ids[:2] == 9).all() and (ids[39:] == 9).all() and flags[:2].all() and flags[39:].all())


@pytest.mark.parametrize("block_v", [128, 256])
def test_the_sweeps_columns_name_the_kept_logits(block_v, device):
    # the record sweep's own candidates with their columns (kforward.forward_record, candidate_columns): on a head
    # whose logits are small integers (exact in fp32: many ties) they are the torch construction's bit for bit, and
    # kernel and twin agree on the thresholds of each row's k-th logit
    cfg = dataclasses.replace(kconfig.forward_config(device, torch.float32), block_v=block_v)
    N, D, V = 24, 16, 2 * block_v + 37
    g = torch.Generator().manual_seed(block_v)
    hidden = torch.randint(-8, 9, (N, D), generator=g).float()
    weight = torch.randint(-8, 9, (V, D), generator=g).float()
    bias = torch.zeros(V)
    bias[5:40:3] = -math.inf
    head = HeadOperands(
        hidden.to(device),
        weight.to(device),
        torch.zeros(N, dtype=torch.long, device=device),
        bias.to(device),
        LogitTransform(),
    )
    seen = []
    kforward.forward_record(
        head,
        False,
        cfg,
        tile_candidates=lambda n0, n1, c, _: seen.append((n0, c.cpu().clone())),
        candidate_columns=True,
    )
    z = hidden @ weight.T + bias
    assert [n0 for n0, _ in seen] == [0]
    candidates = seen[0][1]
    assert torch.equal(candidates.view(torch.int32), _candidates(z, block_v).view(torch.int32))
    k = torch.tensor([1, 2, 5, 12, 30, 64])[torch.arange(N) % 6]
    tau = z.sort(-1, descending=True).values.gather(1, (k - 1)[:, None]).squeeze(1)
    twin, got = _both(candidates, tau, candidates[3].amax(0) < tau, block_v, device)
    count, _ = _check(candidates, tau, twin, got)
    assert count > 0


def test_bad_operands_are_refused(device):
    candidates = torch.zeros(5, 3, 4, device=device)
    tau, resolved = torch.zeros(4, device=device), torch.ones(4, dtype=torch.bool, device=device)
    with pytest.raises(ValueError, match="candidates"):
        tile_selection.kept_columns(candidates[:4], tau, resolved, 128, torch.zeros(4, LISTED, dtype=torch.int64))
    with pytest.raises(ValueError, match="ids"):
        tile_selection.kept_columns(candidates, tau, resolved, 128, torch.zeros(4, LISTED, dtype=torch.int32))


@pytest.mark.parametrize("block_v", [128, 256])
@pytest.mark.parametrize("params", [dict(top_k=50), dict(top_p=0.3)], ids=str)
def test_at_a_real_vocabulary_the_selected_rows_ids_are_their_kept_logits(block_v, params, device):
    # Qwen2.5's vocabulary (1187 or 594 tiles): the selection's threshold (support_tiles._select), then the kept ids
    # by the twin and the kernel: on every row both resolve, {v : z_v >= tau} read from the whole row
    from grpo_fast import reference
    from grpo_fast.kernels.operands import SamplerSupport

    g = torch.Generator().manual_seed(0)
    n, V = 8, 151936
    z = torch.randn(n, V, generator=g) * 6.0
    m, y = z.max(-1)
    s = torch.exp(z - m[:, None]).sum(-1)
    candidates = _candidates(z, block_v)
    support = SamplerSupport(**params)
    tau, _, _, resolved = support_tiles._select(candidates[:4], m, s, z.gather(1, y[:, None])[:, 0], support, V)
    assert bool(resolved.all())
    twin, got = _both(candidates, tau, resolved, block_v, device)
    assert _check(candidates, tau, twin, got) == (n, 0)
    keep = reference.kept_mask(z.double(), **params)
    for row in range(n):
        truth = keep[row].nonzero().squeeze(-1)
        assert 1 <= truth.numel() <= LISTED
        assert torch.equal(got[0][row, : truth.numel()].sort().values, truth), row
