"""The forward's tile timed on first use and cached on disk (kernels.tuning): off by default; on, the fastest
candidate by the timer, written to the cache file and read back without timing again; a candidate that fails is
never chosen; a broken cache file is ignored with a warning; nothing is timed where it cannot be."""

import dataclasses
import json

import pytest
import torch

from grpo_fast.backends.resolver import TRITON
from grpo_fast.head.transform import LogitTransform
from grpo_fast.kernels import config as kconfig
from grpo_fast.kernels import forward as kforward
from grpo_fast.kernels import tuning
from grpo_fast.kernels.operands import HeadOperands


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv(tuning.ENV_CACHE_DIR, str(tmp_path))
    monkeypatch.setattr(tuning, "_PROCESS_CACHES", {})
    return tmp_path


@pytest.mark.parametrize("arch", [80, 89, 90, 120])
@pytest.mark.parametrize("wide", [False, True])
def test_candidates_start_with_the_fixed_table_and_keep_its_column_limit(arch, wide):
    candidates = tuning.record_candidates(torch.bfloat16, arch, wide)
    assert candidates[0] == kconfig.gpu_record_config(torch.bfloat16, arch, wide)
    assert len(candidates) == len(set(candidates)) >= 3
    assert all(c.block_v <= candidates[0].block_v for c in candidates)
    assert all(c.use_tma == (arch == 90) for c in candidates)
    assert tuning.record_candidates(torch.float32, arch, wide) == [kconfig.gpu_record_config(torch.float32, arch)]


def test_cache_key_names_the_card_triton_dtype_epilogue_and_a_token_bucket():
    key = tuning.cache_key(90, torch.bfloat16, True, 16385, 1536, 151936)
    triton_version = ".".join(map(str, kconfig.TRITON_VERSION))
    assert key == f"sm90|triton{triton_version}|bfloat16|wide|D1536|V151936|N32768"
    assert [tuning.token_bucket(n) for n in (1, 1000, 1024, 1025, 16384)] == [1024, 1024, 1024, 2048, 16384]


def test_the_fastest_candidate_is_chosen_written_and_read_back_without_timing(cache_dir):
    # sm80 bf16: the table's tile and two variants; its narrower 128 x 64 variant is no candidate (it would merge a
    # row's vocabulary in other patches, so a row's log-prob would change with the token bucket:
    # docs/batch-invariance.md)
    candidates = tuning.record_candidates(torch.bfloat16, 80)
    assert len(candidates) == 3
    times = {tuning.config_name(c): ms for c, ms in zip(candidates, (5.0, 3.0, 1.0))}
    ran = []

    def run(config):
        if config is candidates[2]:
            raise RuntimeError("out of resources: shared memory")  # the fastest on paper cannot launch
        ran.append(config)

    def timer(call):
        call()
        return times[tuning.config_name(ran[-1])]

    cache = tuning.TileCache(tuning.cache_path())
    assert tuning.choose("k", candidates, run, cache, timer) == candidates[1]
    written = json.loads((cache_dir / tuning.CACHE_FILE).read_text())["k"]
    assert written["config"] == dataclasses.asdict(candidates[1])
    expected = {tuning.config_name(c): times[tuning.config_name(c)] for c in candidates[:2]}
    assert written["ms"] == {**expected, tuning.config_name(candidates[2]): None}

    def no_timing(call):
        raise AssertionError("timed again")

    assert tuning.choose("k", candidates, run, tuning.TileCache(tuning.cache_path()), no_timing) == candidates[1]


def test_a_cached_tile_that_is_no_candidate_is_timed_again(cache_dir):
    """A cache written by a version that timed tiles of another row reduction (sm80's 128 x 64 variant): its choice
    is not taken (it would change a row's log-probs with the token bucket), the candidates are timed again."""
    candidates = tuning.record_candidates(torch.bfloat16, 80)
    narrow = dataclasses.replace(candidates[0], block_v=candidates[0].block_v // 2)
    assert narrow not in candidates
    tuning.TileCache(tuning.cache_path()).put("k", narrow, {})
    timed = []

    def timer(call):
        timed.append(1)
        return float(len(timed))

    cache = tuning.TileCache(tuning.cache_path())
    assert tuning.choose("k", candidates, lambda config: None, cache, timer) == candidates[0]
    assert len(timed) == len(candidates)


def test_all_candidates_failing_gives_the_first(cache_dir):
    candidates = tuning.record_candidates(torch.bfloat16, 89)

    def fail(config):
        raise RuntimeError("no")

    cache = tuning.TileCache(tuning.cache_path())
    assert tuning.choose("k", candidates, fail, cache, lambda call: call()) == candidates[0]


def test_a_broken_cache_file_is_ignored_with_a_warning(cache_dir):
    (cache_dir / tuning.CACHE_FILE).write_text("{not json")
    with pytest.warns(UserWarning, match="ignoring the tile cache"):
        cache = tuning.TileCache(tuning.cache_path())
    assert cache.get("k") is None
    cache.put("k", tuning.record_candidates(torch.bfloat16, 90)[0], {})
    assert tuning.TileCache(tuning.cache_path()).get("k") == tuning.record_candidates(torch.bfloat16, 90)[0]
    (cache_dir / tuning.CACHE_FILE).write_text(json.dumps({"k": {"config": {"block_n": 1, "unknown": 2}}}))
    assert tuning.TileCache(tuning.cache_path()).get("k") is None  # another version's fields


def _head(n=8, d=16, v=64, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(n, d, generator=g).to(dtype)
    weight = (torch.randn(v, d, generator=g) * 0.3).to(dtype)
    return HeadOperands(hidden, weight, torch.randint(0, v, (n,), generator=g), None, LogitTransform())


def _no_run(config):
    raise AssertionError("timed")


def test_off_by_default_and_nothing_timed_where_it_cannot_be(cache_dir, monkeypatch):
    head = _head()
    default = kconfig.forward_config(head.hidden.device, head.hidden.dtype)
    monkeypatch.delenv(tuning.ENV_TUNE, raising=False)
    assert not tuning.enabled()
    assert tuning.record_config(head, False, _no_run) == default
    monkeypatch.setenv(tuning.ENV_TUNE, "1")
    assert tuning.enabled()
    assert tuning.record_config(head, False, _no_run) == default  # the interpreter: no compiled tile to choose
    monkeypatch.setattr(tuning, "compiled_arch", lambda device: 90)
    assert not tuning.can_time(head.hidden)  # a CPU tensor
    assert tuning.record_config(head, False, _no_run) == default
    assert not (cache_dir / tuning.CACHE_FILE).exists()


def test_on_a_compiled_card_the_backend_times_once_and_then_reads_the_cache(cache_dir, monkeypatch):
    """The Triton backend's forward with GRPO_FAST_TUNE=1 on a (stand-in) sm_80 card: every candidate runs the real
    forward once under the timer, the fastest is taken, and a second forward reads it without timing."""
    head = _head()
    monkeypatch.setenv(tuning.ENV_TUNE, "1")
    monkeypatch.setattr(tuning, "compiled_arch", lambda device: 80)
    monkeypatch.setattr(tuning, "can_time", lambda tensor: True)
    candidates = tuning.record_candidates(torch.bfloat16, 80)
    chosen = candidates[2]
    launched = []
    real_forward_record = kforward.forward_record

    def forward_record(head, compute_entropy, config, row_count=None):
        launched.append(config)
        # the interpreter runs the record kernel at the candidate's tile (its bf16 dot upcast, as in every CPU test)
        return real_forward_record(head, compute_entropy, dataclasses.replace(config, dot_fp32=True))

    timed = []

    def timer(call):
        call()
        timed.append(launched[-1])
        return 1.0 if launched[-1] == chosen else 2.0

    monkeypatch.setattr(kforward, "forward_record", forward_record)
    monkeypatch.setattr(tuning, "cuda_milliseconds", timer)
    logp, _, _ = TRITON.forward(head, True)
    assert timed == candidates and launched[-1] == chosen  # the call itself ran at the chosen tile
    key = tuning.cache_key(80, torch.bfloat16, False, 8, 16, 64)
    assert json.loads((cache_dir / tuning.CACHE_FILE).read_text())[key]["config"]["block_v"] == chosen.block_v
    TRITON.forward(head, True)
    assert len(timed) == len(candidates) and launched[-1] == chosen
    reference = torch.log_softmax(head.hidden.float() @ head.weight.float().T, -1).gather(1, head.targets[:, None])
    torch.testing.assert_close(logp, reference.squeeze(1), rtol=1e-5, atol=1e-5)
