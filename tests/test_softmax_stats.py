"""The per-token softmax record and its merge (grpo_fast/kernels/softmax_stats.py): records of any partition of the
vocabulary, merged in any grouping, finish to the full softmax's log-prob, entropy and backward values; as a
vocab-parallel head would merge its ranks' shards. fp64 logits against the direct formulas, on the ``device``
fixture (the records are torch ops: a CUDA GPU where one is present)."""

import torch

from grpo_fast.kernels import softmax_stats

F64 = torch.float64


def _direct(z, y):
    logp_all = torch.log_softmax(z, dim=1)
    p = logp_all.exp()
    logp = logp_all.gather(1, y[:, None]).squeeze(1)
    plogp = torch.where(p > 0, p * logp_all, 0.0)
    mean = torch.where(p > 0, p * z, 0.0).sum(1)
    return dict(
        logp=logp,
        entropy=-plogp.sum(1),
        lse=torch.logsumexp(z, 1),
        nontarget_mass=1 - logp.exp(),
        mean_logit=mean,
        mean_minus_target=mean - z.gather(1, y[:, None]).squeeze(1),
    )


def _finished(stats):
    logp, entropy, backward = softmax_stats.finish(stats, True)
    return dict(logp=logp, entropy=entropy, **backward._asdict())


def _shard_records(z, y, bounds):
    return [softmax_stats.record(z[:, v0:v1], y - v0)[0] for v0, v1 in zip(bounds[:-1], bounds[1:])]


def test_any_partition_and_grouping_merges_to_the_full_softmax(device):
    g = torch.Generator().manual_seed(0)
    N, V = 7, 203
    z = 3.0 * torch.randn(N, V, generator=g, dtype=F64).to(device)
    z[:, 150:180] = float("-inf")  # a shard with no finite logit: an empty record
    y = torch.randint(0, 150, (N,), generator=g).to(device)
    expected = _direct(z, y)
    bounds = [0, 13, 64, 150, 180, V]
    shards = _shard_records(z, y, bounds)
    flat = softmax_stats.merge(softmax_stats.stack(*shards))
    nested = softmax_stats.merge(
        softmax_stats.stack(
            softmax_stats.merge(softmax_stats.stack(*shards[:2])), softmax_stats.merge(softmax_stats.stack(*shards[2:]))
        )
    )
    for merged in (flat, nested):
        got = _finished(merged)
        for name, value in expected.items():
            torch.testing.assert_close(
                got[name], value, rtol=1e-12, atol=1e-12, msg=lambda m, name=name: f"{name}: {m}"
            )


def test_confident_rows_keep_relative_precision_in_fp32(device):
    # 1 - p_y = 1e-7..1e-5, target in the second of three shards: logp, 1 - p_y and mean - z_y keep fp32's relative
    # precision (formed from R and Z, never as differences of numbers near 1 or near z_y)
    g = torch.Generator().manual_seed(1)
    N, V = 6, 300
    z = torch.randn(N, V, generator=g, dtype=F64).to(device)
    y = torch.randint(100, 200, (N,), generator=g).to(device)
    z[torch.arange(N, device=device), y] = 20.0 + torch.linspace(0, 5, N, dtype=F64, device=device)
    expected = _direct(z, y)
    assert expected["nontarget_mass"].max() < 1e-5
    got = _finished(softmax_stats.merge(softmax_stats.stack(*_shard_records(z.float(), y, [0, 100, 200, V]))))
    for name in ("logp", "nontarget_mass", "mean_minus_target", "entropy"):
        rel = ((got[name].to(F64) - expected[name]).abs() / expected[name].abs()).max().item()
        assert rel < 1e-5, (name, rel)
