"""A vocab-parallel head's shard as the public functions take it: ``VocabShard`` (this rank's rows of a head split by
vocabulary, Megatron's layout) and ``resolve``, which turns the public arguments (a DTensor weight sharded on dim 0,
or a plain weight with ``vocab_parallel=VocabShard(...)``) into the local tensors and the shard that
``grpo_fast.head.vocab_parallel`` computes on."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class VocabShard:
    """This rank's part of a vocab-parallel head: rows [offset, offset + weight.shape[0]) of a [vocab_size, D] head.

    Megatron: ``VocabShard(get_tensor_model_parallel_group(), vocab_start_index, padded_vocab_size)``. Checked
    when a function takes it (``vocab_parallel=``): offset and vocab_size ints (else TypeError), the rows inside
    [0, vocab_size) and torch.distributed initialised (else ValueError).

    Attributes:
        group: the ``torch.distributed`` process group the vocabulary is split over; None: the default group.
        offset: the first vocabulary row this rank holds.
        vocab_size: V, the whole head's rows over every rank.
    """

    group: dist.ProcessGroup | None
    offset: int
    vocab_size: int


def _int(name, value):
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"vocab_parallel.{name} must be an int, got {type(value).__name__}")
    return value


def _check_shard(shard, rows):
    _int("offset", shard.offset)
    _int("vocab_size", shard.vocab_size)
    if shard.vocab_size <= 0 or shard.offset < 0 or shard.offset + rows > shard.vocab_size:
        raise ValueError(
            f"vocab_parallel: this rank's weight rows [offset, offset + {rows}) = [{shard.offset}, "
            f"{shard.offset + rows}) must lie in [0, vocab_size) = [0, {shard.vocab_size})"
        )
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError(
            "vocab_parallel needs torch.distributed initialised (init_process_group) on every rank of its group"
        )


def _is_dtensor(x):
    return type(x).__name__ == "DTensor" and hasattr(x, "placements")


def resolve(hidden, weight, bias, vocab_parallel):
    """The public API's entry: (hidden, weight, bias, shard) as layer 1 computes on them.

    A DTensor weight sharded on dim 0 is recognised (its local rows, bias rows and group); a plain weight with
    ``vocab_parallel=VocabShard(...)`` is Megatron's layout; a plain weight alone gives shard None (not parallel).
    Local tensors come from ``to_local()``, which is differentiable: the DTensor's gradient is the local one, with the
    DTensor's placements."""
    if _is_dtensor(weight):
        if vocab_parallel is not None:
            raise ValueError(
                "vocab_parallel is for a plain [V_local, D] weight shard: a DTensor weight carries its "
                "own sharding, pass it alone"
            )
        return _from_dtensor(hidden, weight, bias)
    if _is_dtensor(bias):
        raise ValueError(
            "bias is a DTensor but weight is not: pass both as DTensors sharded on dim 0, or both as "
            "this rank's rows with vocab_parallel=VocabShard(...)"
        )
    if _is_dtensor(hidden):
        hidden = _replicated_local("hidden", hidden)
    if vocab_parallel is None:
        return hidden, weight, bias, None
    if not isinstance(vocab_parallel, VocabShard):
        raise TypeError(
            f"vocab_parallel must be a grpo_fast.VocabShard(group, offset, vocab_size), got "
            f"{type(vocab_parallel).__name__}"
        )
    if isinstance(weight, torch.Tensor) and weight.dim() == 2:
        _check_shard(vocab_parallel, weight.shape[0])
    return hidden, weight, bias, vocab_parallel


def is_vocab_sharded(weight):
    """True for a DTensor weight that this module computes on as it is: Shard(0) on one mesh dimension, Replicate on
    any other."""
    if not _is_dtensor(weight):
        return False
    sharded = [p for p in weight.placements if not p.is_replicate()]
    return len(sharded) == 1 and sharded[0].is_shard(0)


def _replicated_local(name, x):
    if not all(p.is_replicate() for p in x.placements):
        raise ValueError(
            f"{name} is a DTensor with placements {tuple(x.placements)}: the vocab-parallel head takes "
            "replicated hidden states (every rank the same tokens); pass a plain tensor or a Replicate "
            "DTensor"
        )
    return x.to_local()


def _from_dtensor(hidden, weight, bias):
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    placements = tuple(weight.placements)
    if not is_vocab_sharded(weight):
        raise ValueError(
            f"weight is a DTensor with placements {placements}: grpo_fast takes a head sharded by "
            "vocabulary (Shard(0) on one mesh dimension, Replicate on any other); gather another "
            "layout with weight.full_tensor()"
        )
    mesh_dim = next(dim for dim, p in enumerate(placements) if not p.is_replicate())
    if bias is not None and (
        not _is_dtensor(bias) or tuple(bias.placements) != placements or bias.device_mesh != weight.device_mesh
    ):
        raise ValueError(
            f"weight is a DTensor sharded on dim 0: bias must be None or a DTensor on the same mesh "
            f"with the same placements {placements}"
        )
    if _is_dtensor(hidden):
        hidden = _replicated_local("hidden", hidden)
    mesh = weight.device_mesh
    _, global_offset = compute_local_shape_and_global_offset(weight.shape, mesh, placements)
    shard = VocabShard(mesh.get_group(mesh_dim), int(global_offset[0]), int(weight.shape[0]))
    local_bias = None if bias is None else bias.to_local()
    return hidden, weight.to_local(), local_bias, shard
