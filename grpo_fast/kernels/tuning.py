"""The forward's tile timed on first use and cached on disk: a choice among a few candidates per card, for users
whose shapes or card the fixed table (``tiles.RECORD``) was not measured on. Off by default.

``GRPO_FAST_TUNE=1`` turns it on. The first Triton forward of a (card, Triton version, dtype, epilogue, D, V, token
bucket) then times ``record_candidates`` on its own inputs (CUDA events, the median of a few warm runs each),
keeps the fastest and writes it to ``forward-tiles.json`` in ``GRPO_FAST_CACHE_DIR`` (default
``~/.cache/grpo_fast``); later calls, and later processes, read the choice from there. The token bucket is N
rounded up to a power of two (at least 1024): nearby batch sizes share one choice. A candidate that fails to
launch (a card with less shared memory than its tile needs) is recorded as failed and never chosen.

Nothing is timed where timing cannot run or would change the call: under torch.compile's tracing, on fake or meta
tensors, during CUDA-graph capture, on the interpreter; the cache's choice or the fixed table's is taken there.
The timing synchronises the device (once per key and process, only with tuning on). The choice is made per token
bucket, so two calls of different N may run different candidates: every candidate reduces a row as the table's tile
does (its patches of ``block_v x tiles`` columns, its K steps of ``block_d``; ``record_candidates`` drops the
variants that do not), and computes the same records bit for bit (docs/batch-invariance.md); they differ in
``block_n``, warps and stages, which only group rows and order independent programs.
"""

from __future__ import annotations

import json
import os
import statistics
import warnings
from dataclasses import asdict, replace

import torch

from . import tiles
from .config import TRITON_VERSION, TileRecordConfig, compiled_arch, forward_config, gpu_record_config

ENV_TUNE = "GRPO_FAST_TUNE"
ENV_CACHE_DIR = "GRPO_FAST_CACHE_DIR"
CACHE_FILE = "forward-tiles.json"
WARMUP, REPS = 1, 5
MIN_BUCKET = 1024


def enabled() -> bool:
    """Whether tuning is on (``GRPO_FAST_TUNE`` set to 1, true, yes or on)."""
    return os.environ.get(ENV_TUNE, "").strip().lower() in ("1", "true", "yes", "on")


def cache_path() -> str:
    """The cache file: ``GRPO_FAST_CACHE_DIR`` (default ~/.cache/grpo_fast) / forward-tiles.json."""
    folder = os.environ.get(ENV_CACHE_DIR) or os.path.join(os.path.expanduser("~"), ".cache", "grpo_fast")
    return os.path.join(folder, CACHE_FILE)


def record_candidates(dtype: torch.dtype, arch: int, wide_epilogue: bool = False) -> list[TileRecordConfig]:
    """The fixed table's configuration first, then its variants for this architecture's class
    (``tiles.RECORD_VARIANTS``; none for fp32, whose FMA tiles are one), each kept within the table's rules (128
    columns for a wide epilogue or a Triton that spills at 256); no configuration twice; none that reduces a row
    otherwise than the table's tile (another ``block_v x tiles`` patch or ``block_d`` step: a narrower tile merges
    a row's vocabulary in other pieces, so a row's log-prob would change with the token bucket)."""
    default = gpu_record_config(dtype, arch, wide_epilogue)
    if dtype == torch.float32:
        return [default]
    out = [default]
    for change in tiles.RECORD_VARIANTS[tiles.arch_class(arch).name]:
        candidate = replace(default, **change)
        if candidate.block_v > default.block_v:  # the table's column limit holds for every candidate
            candidate = replace(candidate, block_v=default.block_v)
        if _row_reduction(candidate) != _row_reduction(default):
            continue
        if candidate not in out:
            out.append(candidate)
    return out


def _row_reduction(config: TileRecordConfig) -> tuple[int, int]:
    """What orders a row's reduction in the forward's tile: its patch of the vocabulary (block_v x tiles columns,
    merged in patch order) and its K step over D (block_d)."""
    return config.block_v * config.tiles, config.block_d


def token_bucket(n: int) -> int:
    """N rounded up to a power of two, at least MIN_BUCKET."""
    return max(MIN_BUCKET, 1 << max(0, n - 1).bit_length())


def cache_key(arch: int, dtype: torch.dtype, wide_epilogue: bool, n: int, d: int, v: int) -> str:
    """The cache's key of a forward: card, Triton version, dtype, epilogue, D, V and the token bucket."""
    epilogue = "wide" if wide_epilogue else "narrow"
    triton_version = ".".join(map(str, TRITON_VERSION))
    dtype_name = str(dtype).removeprefix("torch.")
    return f"sm{arch}|triton{triton_version}|{dtype_name}|{epilogue}|D{d}|V{v}|N{token_bucket(n)}"


class TileCache:
    """The cache file as a dict of key -> {"config": the chosen TileRecordConfig's fields, "ms": the candidates'
    median times (None: failed)}. A missing or unreadable file is an empty cache (an unreadable one is named in a
    warning and rewritten on the next choice); writes replace the file whole."""

    def __init__(self, path: str):
        self.path = path
        self.entries: dict = {}
        try:
            with open(path) as f:
                self.entries = json.load(f)
            if not isinstance(self.entries, dict):
                raise ValueError("not a JSON object")
        except FileNotFoundError:
            self.entries = {}
        except (OSError, ValueError) as e:
            warnings.warn(f"grpo_fast: ignoring the tile cache {path} ({e}); it is rewritten", stacklevel=2)
            self.entries = {}

    def get(self, key: str) -> TileRecordConfig | None:
        entry = self.entries.get(key)
        if not isinstance(entry, dict) or not isinstance(entry.get("config"), dict):
            return None
        try:
            return TileRecordConfig(**entry["config"])
        except TypeError:  # written by a version whose configuration had other fields
            return None

    def put(self, key: str, config: TileRecordConfig, times: dict) -> None:
        self.entries[key] = {"config": asdict(config), "ms": times}
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        partial = f"{self.path}.{os.getpid()}.tmp"
        with open(partial, "w") as f:
            json.dump(self.entries, f, indent=1, sort_keys=True)
        os.replace(partial, self.path)


def cuda_milliseconds(run) -> float:
    """The median of REPS timed calls of ``run()`` after WARMUP, in ms, by CUDA events (synchronises)."""
    for _ in range(WARMUP):
        run()
    times = []
    for _ in range(REPS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def choose(key: str, candidates: list[TileRecordConfig], run, cache: TileCache, timer=None):
    """The cached configuration of ``key``, else the fastest of ``candidates`` by ``timer(lambda: run(config))``
    (default ``cuda_milliseconds``; a candidate that raises is recorded as failed), written to ``cache``; the first
    candidate when all fail. A cached choice that is not a candidate (written by a version that timed tiles which
    reduce a row otherwise) is timed again."""
    timer = timer or cuda_milliseconds
    cached = cache.get(key)
    if cached in candidates:
        return cached
    times = {}
    for config in candidates:
        name = config_name(config)
        try:
            times[name] = timer(lambda config=config: run(config))
        except Exception:  # noqa: BLE001 - a tile this card cannot launch is a result, not an error
            times[name] = None
    timed = [(ms, i) for i, config in enumerate(candidates) if (ms := times[config_name(config)]) is not None]
    best = candidates[min(timed)[1]] if timed else candidates[0]
    cache.put(key, best, times)
    return best


def config_name(config: TileRecordConfig) -> str:
    """A candidate's short name: BLOCK_N x BLOCK_V x BLOCK_D, warps, stages, and tma where it reads by descriptor."""
    name = f"{config.block_n}x{config.block_v}x{config.block_d} w{config.num_warps} s{config.num_stages}"
    return name + (" tma" if config.use_tma else "")


def can_time(tensor: torch.Tensor) -> bool:
    """Whether a forward on ``tensor``'s device may be timed now: a real CUDA tensor, no compilation tracing, no
    CUDA-graph capture."""
    from torch._subclasses.fake_tensor import is_fake

    return (
        tensor.device.type == "cuda"
        and not is_fake(tensor)
        and not torch.compiler.is_compiling()
        and not torch.cuda.is_current_stream_capturing()
    )


_PROCESS_CACHES: dict[str, TileCache] = {}


def tuned_record_config(default: TileRecordConfig, candidates, key: str, run, tensor: torch.Tensor):
    """``default`` (the fixed table's configuration) unless tuning is on: then the cache's choice for ``key``, or,
    where ``can_time(tensor)``, the timed choice among ``candidates`` by ``run(config)``."""
    if not enabled():
        return default
    path = cache_path()
    cache = _PROCESS_CACHES.get(path)
    if cache is None:
        cache = _PROCESS_CACHES[path] = TileCache(path)
    cached = cache.get(key)
    if cached in candidates:  # not another version's tile of another row reduction
        return cached
    if not can_time(tensor):
        return default
    return choose(key, candidates, run, cache)


def record_config(head, wide_epilogue: bool, run) -> TileRecordConfig:
    """The forward's configuration for an operands.HeadOperands: ``config.forward_config``'s, or with tuning on a
    compiled device the tuned one, timed the first time on ``run(config)`` (the forward's records of ``head``)."""
    hidden = head.hidden
    default = forward_config(hidden.device, hidden.dtype, wide_epilogue)
    arch = compiled_arch(hidden.device) if enabled() else None
    if arch is None:
        return default
    (n, d), v = hidden.shape, head.weight.shape[0]
    key = cache_key(arch, hidden.dtype, wide_epilogue, n, d, v)
    return tuned_record_config(default, record_candidates(hidden.dtype, arch, wide_epilogue), key, run, hidden)
