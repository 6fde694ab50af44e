"""Batch invariance (docs/batch-invariance.md): a sequence's per-token values, and the gradient its own tokens send
to its hidden states, are bitwise the same whatever else shares its call.

One probe sequence (an interior and a trailing masked token) is computed alone, then beside other sequences: a pair
padded to a longer T (the probe's extra positions masked, their hidden states junk, their targets -100) with
``check_values=False``; and a batch of 8 that holds the probe three times (first, middle, last) between other
sequences and fully masked ones, with every row-grouping size a caller can set at its smallest (the trained head's
``trained_head_chunk``; the forward's rows per launch, ``kernels.forward.PARTS_BYTES``; the torch twin's
``head_twin.CHUNK_N``; the support twin's row budgets). Each of the probe's per-token values (``logprobs``,
``logprobs_and_entropy``, ``loss``'s ``metrics.logprobs`` / ``metrics.entropies``, ``sampler_logprobs``' three
outputs) and its rows of dH, for dL/dlogp and dL/dentropy fixed per token, must be ``torch.equal`` to the probe's
alone, on both backends, in fp32, bf16 and fp16.

Every case must hold, strictly: no case is expected to fail. What the guarantee does not cover (a vocab-parallel head
across shard counts, the fused backward's dH, the divergence heads) is docs/batch-invariance.md's to name, not a
case here. ``test_tuning_candidates_keep_a_rows_reduction`` and ``test_frozen_vocab_chunk_ignores_token_count`` check
the launch policy itself, tests/test_gemm.py's ``test_token_row_products_ignore_the_row_count`` the token-row GEMMs.
"""

from __future__ import annotations

import pytest
import torch
from conftest import KERNEL_DEVICE, backend_device

import grpo_fast
from grpo_fast.backends import head_twin
from grpo_fast.head.transform import LogitTransform
from grpo_fast.kernels import config as kconfig
from grpo_fast.kernels import forward as kforward
from grpo_fast.kernels import forward_frozen as kfrozen
from grpo_fast.kernels import tiles, tuning
from grpo_fast.kernels.operands import HeadOperands

V, D, T, PADDED_T = 300, 48, 7, 12
PROBE_MASK = (1, 1, 0, 1, 1, 1, 0)
TOP_K, TOP_P, KEPT = 20, 0.9, 6
ITEMS = 50.0  # dapo's normaliser, the same in every context: a token's dL/dlogp is then its own
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
DTYPE_IDS = ["fp32", "bf16", "fp16"]
# each path's per-token outputs, beside dH
PATHS = {
    "logprobs": ("logprobs",),
    "general": ("logprobs", "entropy", "dH"),  # logprobs_and_entropy with a trained weight: the recompute path
    "frozen_head": ("logprobs", "entropy", "dH"),  # logprobs_and_entropy, only hidden needs a gradient
    "loss": ("logprobs", "entropy", "dH"),  # metrics.logprobs / .entropies; a trained weight, dapo (token-local)
    "loss_frozen_head": ("logprobs", "entropy", "dH"),
    "sampler_top": ("logprobs", "support_logprobs", "log_kept_mass", "dH"),  # top_k and top_p
    # the same without gradients: the Triton backend's record sweep with tile candidates (backends.support_tiles)
    "sampler_top_no_grad": ("logprobs", "support_logprobs", "log_kept_mass"),
    "sampler_replay": ("logprobs", "support_logprobs", "log_kept_mass", "dH"),  # replayed kept_ids
}
# (name, rows: "probe", "masked" or another sequence's index, T, check_values, row-grouping sizes at their smallest)
CONTEXTS = (
    ("a padded pair", (3, "probe"), PADDED_T, False, False),
    ("a batch of 8 in small chunks", ("probe", 0, "masked", "probe", 1, 2, "masked", "probe"), T, True, True),
)


def _draw(dtype):
    """The head, the probe sequence and 5 other sequences (PADDED_T long), from one seeded generator on the CPU: the
    same numbers for every backend and device."""
    g = torch.Generator().manual_seed(45)
    weight = (torch.randn(V, D, generator=g) * 0.3).to(dtype)
    bias = (torch.randn(V, generator=g) * 0.5).to(dtype)

    def sequences(n, length):
        kept = torch.stack([torch.randperm(V, generator=g)[:KEPT] for _ in range(n * length)]).view(n, length, KEPT)
        kept[..., -1] = torch.where(torch.rand(n, length, generator=g) > 0.5, kept[..., -1], -1)
        return dict(
            hidden=torch.randn(n, length, D, generator=g).to(dtype),
            targets=torch.randint(0, V, (n, length), generator=g),
            mask=torch.rand(n, length, generator=g) > 0.3,
            advantages=torch.randn(n, generator=g),
            old=-5.7 + 0.3 * torch.randn(n, length, generator=g),
            grad_logp=torch.randn(n, length, generator=g),
            grad_entropy=torch.randn(n, length, generator=g),
            kept=kept,
        )

    probe = {k: v[0] for k, v in sequences(1, T).items()}
    probe["mask"] = torch.tensor(PROBE_MASK, dtype=torch.bool)
    return weight, bias, probe, sequences(5, PADDED_T)


def _context(probe, others, rows, length, top1=None):
    """The batch of ``rows`` at ``length`` tokens: the probe's positions past T masked (junk hidden states, targets
    -100), "masked" a sequence without a scored token; ``top1``: the sampler's targets, each position's largest
    logit (in every kept set), each replayed set holding its target."""
    fields = {k: [] for k in probe}
    for row in rows:
        if row == "probe":
            source = dict(probe)
            for k, v in probe.items():
                if v.dim() > 0 and length > T:
                    junk = others[k][4, T:length]
                    if k == "mask":
                        junk = torch.zeros(length - T, dtype=torch.bool)
                    elif k == "targets":
                        junk = torch.full((length - T,), -100)
                    source[k] = torch.cat([v, junk])
        else:
            source = {k: v[1 if row == "masked" else row] for k, v in others.items()}
            source = {k: v[:length] if v.dim() > 0 else v for k, v in source.items()}
            if row == "masked":
                source["mask"] = torch.zeros(length, dtype=torch.bool)
                source["targets"] = torch.full((length,), -100)
        for k, v in source.items():
            fields[k].append(v)
    batch = {k: torch.stack(v) for k, v in fields.items()}
    if top1 is not None:
        scored, kept = batch["mask"], batch["kept"]
        batch["targets"] = torch.where(scored, top1(batch["hidden"]), batch["targets"])
        kept[..., 0] = torch.where(scored, batch["targets"], kept[..., 0])
        kept[..., 1:] = torch.where(kept[..., 1:] == batch["targets"][..., None], -1, kept[..., 1:])
        batch["kept"] = torch.where(scored[..., None], kept, -1)
    return batch


def _run(path, backend, batch, weight, bias, device, check_values, small_chunks):
    """The path's per-token outputs [B, length] and dH [B, length, D], fp32 on the CPU."""
    hidden = batch["hidden"].to(device).requires_grad_(path not in ("logprobs", "sampler_top_no_grad"))
    trained = path in ("general", "loss", "sampler_top", "sampler_replay")
    w, b = (x.to(device).requires_grad_(trained) for x in (weight, bias))
    y, mask = batch["targets"].to(device), batch["mask"].to(device)
    grad_logp, grad_entropy = batch["grad_logp"].to(device), batch["grad_entropy"].to(device)
    common = dict(bias=b, backend=backend, check_values=check_values)
    out, objective = {}, None
    if path == "logprobs":
        out["logprobs"] = grpo_fast.logprobs(hidden, w, y, completion_mask=mask, **common)
    elif path in ("general", "frozen_head"):
        logp, entropy = grpo_fast.logprobs_and_entropy(hidden, w, y, completion_mask=mask, **common)
        out.update(logprobs=logp, entropy=entropy)
        objective = (logp * grad_logp).sum()
        if path == "general":  # the frozen head's own backward (dH = c J) is the one without an entropy gradient
            objective = objective + (entropy * grad_entropy).sum()
    elif path in ("loss", "loss_frozen_head"):
        if small_chunks and backend == "triton" and path == "loss" and hidden.dtype != torch.float16:
            common["trained_head_chunk"] = 3
        objective, metrics = grpo_fast.loss(
            hidden,
            w,
            y,
            batch["advantages"].to(device),
            mask,
            old_logprobs=batch["old"].to(device),
            loss_type="dapo",
            num_items_in_batch=ITEMS,
            **common,
        )
        out.update(logprobs=metrics.logprobs, entropy=metrics.entropies)
    else:
        replayed = path == "sampler_replay"
        top = dict(kept_ids=batch["kept"].to(device)) if replayed else dict(top_k=TOP_K, top_p=TOP_P)
        result = grpo_fast.sampler_logprobs(hidden, w, y, mask, **common, **top)
        out.update(zip(("logprobs", "support_logprobs", "log_kept_mass"), result))
        if hidden.requires_grad:
            objective = (result.support_logprobs * grad_logp).sum()
    if objective is not None:
        objective.backward()
        out["dH"] = hidden.grad
    return {k: v.detach().float().cpu() for k, v in out.items()}


def _smallest_row_groups(monkeypatch):
    """Every row-grouping size a caller can set, at its smallest (``trained_head_chunk`` is ``_run``'s)."""
    monkeypatch.setattr(kforward, "PARTS_BYTES", 1)  # one token block a launch
    monkeypatch.setattr(head_twin, "CHUNK_N", 3)
    try:
        from grpo_fast.backends import support_twin
    except ImportError:
        return
    for name in ("ROW_BUDGET_BYTES", "GATHER_BUDGET_BYTES"):  # one row a chunk
        if hasattr(support_twin, name):
            monkeypatch.setattr(support_twin, name, 1)


def _check_probe(backend, dtype, path, device, monkeypatch):
    """The probe's values and dH rows in every context against the probe's alone (the module docstring)."""
    dev = backend_device(backend, device)
    weight, bias, probe, others = _draw(dtype)
    top1 = None
    if path.startswith("sampler"):
        w32, b32 = weight.float(), bias.float()

        def top1(hidden):
            return (hidden.float() @ w32.T + b32).argmax(-1)

    alone = _run(path, backend, _context(probe, others, ("probe",), T, top1), weight, bias, dev, True, False)
    for quantity in PATHS[path]:
        assert alone[quantity][0].isfinite().all(), quantity
    failures = []
    for name, rows, length, check_values, small_chunks in CONTEXTS:
        if small_chunks:
            _smallest_row_groups(monkeypatch)
        batch = _context(probe, others, rows, length, top1)
        out = _run(path, backend, batch, weight, bias, dev, check_values, small_chunks)
        for quantity in PATHS[path]:
            rows_off = [i for i, row in enumerate(rows) if row == "probe"]
            rows_off = [i for i in rows_off if not torch.equal(out[quantity][i, :T], alone[quantity][0])]
            if rows_off:
                failures.append(f"{quantity} in {name} (rows {rows_off})")
    assert not failures, f"not bitwise the row alone's: {failures}"


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_kernels_keep_a_rows_values(dtype, path, device, monkeypatch):
    """The Triton backend (the interpreter on a CPU, compiled on a GPU): the probe's values and dH rows, bitwise."""
    _check_probe("triton", dtype, path, device, monkeypatch)


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_torch_twin_keeps_a_rows_values(dtype, path, device, monkeypatch):
    """The torch backend (the chunked twins, on the CPU): the probe's values and dH rows, bitwise."""
    _check_probe("torch", dtype, path, device, monkeypatch)


def test_masked_positions_stay_exact_zeros():
    """The probe's masked positions are exact zeros in a padded batch without value checks (the scored rows are
    scattered back; nothing a neighbour computed lands there)."""
    weight, bias, probe, others = _draw(torch.float32)
    batch = _context(probe, others, (3, "probe"), PADDED_T)
    logp, entropy = grpo_fast.logprobs_and_entropy(
        batch["hidden"], weight, batch["targets"], bias=bias, completion_mask=batch["mask"], check_values=False
    )
    masked = ~batch["mask"]
    assert bool((logp[masked] == 0).all()) and bool((entropy[masked] == 0).all())


# ----------------------------------------------------------------------------------------------- the launch policy
@pytest.mark.parametrize("wide", [False, True], ids=["narrow", "wide"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_tuning_candidates_keep_a_rows_reduction(dtype, wide):
    """GRPO_FAST_TUNE=1 keeps the fastest of the forward's candidates per token bucket (N rounded up to a power of
    two), so the tile a call runs may change with N: every candidate must reduce a row as the fixed table's tile does
    (the same patch of block_v x tiles columns, the same K step block_d); block_n, warps and stages only group rows
    and order the independent programs."""

    def reduction(config):
        return config.block_v * config.tiles, config.block_d

    differ = []
    for name, arch in tiles.ARCH_CLASSES.items():
        default, *others = tuning.record_candidates(dtype, arch.capability, wide)
        for candidate in others:
            if reduction(candidate) != reduction(default):
                differ.append(f"{name}: {tuning.config_name(candidate)} beside {tuning.config_name(default)}")
    assert not differ, f"candidates split a row otherwise: {differ}"


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_frozen_vocab_chunk_ignores_token_count(dtype, device, monkeypatch):
    """The frozen head's vocabulary chunks (the order of a row's reduction over the vocabulary) are the same for 1,
    7 and 60 tokens."""
    sizes = []

    def recorded(*args, **kwargs):
        sizes.append(real(*args, **kwargs))
        return sizes[-1]

    real = kfrozen.vocab_chunk_size
    monkeypatch.setattr(kfrozen, "vocab_chunk_size", recorded)
    weight, _, probe, others = _draw(dtype)
    config = kconfig.frozen_head_config(device)
    for n in (1, 7, 60):
        hidden = others["hidden"].reshape(-1, D)[:n].contiguous().to(device)
        targets = others["targets"].reshape(-1)[:n].to(device)
        head = HeadOperands(hidden, weight.to(device), targets, None, LogitTransform(), None)
        kfrozen.forward_frozen_record(head, True, config)
    assert sizes, "forward_frozen_record no longer asks vocab_chunk_size: update this test"
    assert len(set(sizes)) == 1, f"the frozen head's vocabulary chunk depends on N: {sizes}"


@pytest.mark.skipif(KERNEL_DEVICE.type != "cuda", reason="the timed tile choice: compiled kernels on a CUDA GPU")
def test_timed_tile_choice_keeps_a_rows_logprobs(monkeypatch, tmp_path, device):
    """With GRPO_FAST_TUNE=1 the probe alone (token bucket 1024) and among 300 sequences (about 1500 scored tokens:
    bucket 2048) gets the same log-probs, each bucket's tile timed on its first call."""
    monkeypatch.setenv(tuning.ENV_TUNE, "1")
    monkeypatch.setenv(tuning.ENV_CACHE_DIR, str(tmp_path))
    monkeypatch.setattr(tuning, "_PROCESS_CACHES", {})
    weight, bias, probe, others = _draw(torch.bfloat16)

    def logp(rows):
        batch = _context(probe, others, rows, T)
        args = (batch["hidden"], weight, batch["targets"])
        return grpo_fast.logprobs(*(x.to(device) for x in args), completion_mask=batch["mask"].to(device))[0]

    assert torch.equal(logp(("probe",) + tuple(i % 5 for i in range(299))), logp(("probe",)))
