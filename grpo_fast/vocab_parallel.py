"""A vocab-parallel lm_head: the head's vocabulary split over the ranks of a process group, never gathered.

Tensor parallelism splits the head by rows (Megatron's vocab-parallel layout; a DTensor ``Shard(0)`` from torch's
tensor-parallel plans and transformers' ``tp_plan``). Every rank of the group sees the same tokens (hidden [N, D] and
targets [N], replicated) and holds rows [offset, offset + V_local) of the weight [V, D] (and of the bias). Each rank
then returns exactly what the unsharded head returns:

* forward: each rank runs layer 1's forward on its shard, with the targets it does not own replaced by -1 (a
  column no kernel ever matches), and turns its per-token statistics into a partial record: the shard's
  log-sum-exp, its mean logit and, on the target's owner, the target's logit. Two all-reduces of O(N) merge them
  (the max of the shards' log-sum-exps, then one summed [3, N] fp32 tensor: sum of exp(lse_r - max), the same
  weights times the shards' mean logits, the target logit from its one owner):
      lse = max + log sum_r exp(lse_r - max),   mean = sum_r exp(lse_r - lse) mean_r,
      logp = z_y - lse,   entropy = lse - mean.
* backward: each rank runs layer 1's backward on its shard with the GLOBAL lse and mean logit (its tiles' softmax
  probabilities are then the global ones), keeps its dW rows and bias rows local, and all-reduces its partial dH
  (sum over shards of g W_shard) in fp32: N x D x 4 bytes, the only tensor that scales with more than N.

What crosses the network per training step: 16 N bytes in the forward (12 N without the entropy: ``logprobs``) and
4 N D bytes in the backward (none when hidden needs no gradient), whatever V is. No rank holds more than its shard of
the weight, or any tensor of size V x N.

Path: the vocab-parallel head always takes layer 1's general (recompute) path, also for a frozen head. The
frozen-head path builds J = d logp / d hidden per shard relative to the shard's own softmax; merging the shards' J
exactly needs, besides rescaling each by exp(lse_r - lse), the target's share 1 - p_y from the other shards' sums,
which today's frozen-head forward does not return, and it would all-reduce the same N x D fp32 bytes in the forward
that the general path all-reduces in the backward. It would save one vocabulary sweep per shard; the general path
is exact today.

Requirements (not checked: checking would cost a collective per call): the shards of the group tile [0, V) without
overlap, and every rank passes the same hidden, targets and mask (tensor parallelism's layout) and the same
upstream gradients (a loss computed identically on every rank, as ``grpo_fast.loss`` does). dH is the full gradient
of the replicated hidden states: do not all-reduce it again (Megatron's ``copy_to_tensor_model_parallel_region``
does exactly this reduction; skip it for the head's input).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from grpo_fast import autograd


@dataclass(frozen=True)
class VocabShard:
    """This rank's part of a vocab-parallel head: rows [offset, offset + weight.shape[0]) of a [vocab_size, D] head,
    split over the ranks of ``group`` (a ``torch.distributed`` process group; None: the default group). Megatron:
    ``VocabShard(get_tensor_model_parallel_group(), vocab_start_index, padded_vocab_size)``."""

    group: "dist.ProcessGroup | None"
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
        raise ValueError(f"vocab_parallel: this rank's weight rows [offset, offset + {rows}) = [{shard.offset}, "
                         f"{shard.offset + rows}) must lie in [0, vocab_size) = [0, {shard.vocab_size})")
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("vocab_parallel needs torch.distributed initialised (init_process_group) on every rank of "
                         "its group")


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
            raise ValueError("vocab_parallel is for a plain [V_local, D] weight shard: a DTensor weight carries its "
                             "own sharding, pass it alone")
        return _from_dtensor(hidden, weight, bias)
    if _is_dtensor(bias):
        raise ValueError("bias is a DTensor but weight is not: pass both as DTensors sharded on dim 0, or both as "
                         "this rank's rows with vocab_parallel=VocabShard(...)")
    if _is_dtensor(hidden):
        hidden = _replicated_local("hidden", hidden)
    if vocab_parallel is None:
        return hidden, weight, bias, None
    if not isinstance(vocab_parallel, VocabShard):
        raise TypeError(f"vocab_parallel must be a grpo_fast.VocabShard(group, offset, vocab_size), got "
                        f"{type(vocab_parallel).__name__}")
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
        raise ValueError(f"{name} is a DTensor with placements {tuple(x.placements)}: the vocab-parallel head takes "
                         "replicated hidden states (every rank the same tokens); pass a plain tensor or a Replicate "
                         "DTensor")
    return x.to_local()


def _from_dtensor(hidden, weight, bias):
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    placements = tuple(weight.placements)
    if not is_vocab_sharded(weight):
        raise ValueError(f"weight is a DTensor with placements {placements}: grpo_fast takes a head sharded by "
                         "vocabulary (Shard(0) on one mesh dimension, Replicate on any other); gather another "
                         "layout with weight.full_tensor()")
    mesh_dim = next(dim for dim, p in enumerate(placements) if not p.is_replicate())
    if bias is not None and (not _is_dtensor(bias) or tuple(bias.placements) != placements
                             or bias.device_mesh != weight.device_mesh):
        raise ValueError(f"weight is a DTensor sharded on dim 0: bias must be None or a DTensor on the same mesh "
                         f"with the same placements {placements}")
    if _is_dtensor(hidden):
        hidden = _replicated_local("hidden", hidden)
    mesh = weight.device_mesh
    _, global_offset = compute_local_shape_and_global_offset(weight.shape, mesh, placements)
    shard = VocabShard(mesh.get_group(mesh_dim), int(global_offset[0]), int(weight.shape[0]))
    local_bias = None if bias is None else bias.to_local()
    return hidden, weight.to_local(), local_bias, shard


# ------------------------------------------------------------------------------------------------------------
# The adapter: the only code that knows layer 1's internals. Today layer 1 returns per token (logp, entropy, lse,
# mean logit) of the rows it is given, and its backward takes lse and the mean logit. From them a shard's partial
# record is (lse_r, mean_r, target logit = logp_r + lse_r on the owner). The target logit comes back by adding
# lse_r to logp_r = z_y - lse_r: a rounding of eps |lse_r| (about 1e-6 at |lse| = 12); the softmax terms of the
# backward are layer 1's own. Calls: autograd.forward and autograd.backward (and autograd._grad_hidden_buffer, the
# dH buffer the backward expects), on this rank's rows with targets from ``local_targets``.
# With a layer 1 whose forward returns its mergeable per-token record (max, sum of exp, the non-target sum, the
# z-sum, the target logit) before finishing it, and whose backward reads the finished record, this adapter becomes:
# the shard's record, exchanged over the group and merged with layer 1's own merge, finished with layer 1's own
# finish (no target logit recovered by cancellation, 1 - p_y carried); the backward call unchanged but for the
# record. ``merge`` below then goes.
# ------------------------------------------------------------------------------------------------------------
def _shard_statistics(hidden, weight, local_targets, bias, transform, compute_entropy, backend):
    """(lse_r, mean_r or None, target logit_r) [N] fp32 of this shard (target logit 0 where the target is not in
    it). An empty shard (torch's chunking can leave the last rank none) contributes nothing: lse_r = -inf."""
    N = hidden.shape[0]
    if weight.shape[0] == 0:
        lse = torch.full((N,), float("-inf"), device=hidden.device)
        zero = torch.zeros(N, device=hidden.device)
        return lse, zero if compute_entropy else None, zero
    logp, _, lse, mean_logit = autograd.forward(hidden, weight, local_targets, bias, transform, compute_entropy,
                                                backend)
    owned = local_targets >= 0
    target_logit = torch.where(owned, logp + lse, torch.zeros_like(lse))
    return lse, mean_logit, target_logit


def _shard_backward(hidden, weight, local_targets, bias, lse, mean_logit, grad_logp, grad_entropy, transform,
                    need_hidden, need_weight, need_bias, backend, backward_mode):
    """Layer 1's backward on this shard with the global lse and mean logit: (partial dH fp32 or None, dW rows fp32
    or None, db rows fp32 or None). ``backward_mode``: today's layer 1 reads the Triton backward's mode from its
    launch configuration, so it is not passed on yet."""
    dev = hidden.device
    grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=dev) if need_weight else None
    grad_bias = torch.zeros(weight.shape[0], dtype=torch.float32, device=dev) if need_bias else None
    if weight.shape[0] == 0:
        return (torch.zeros(hidden.shape, dtype=torch.float32, device=dev) if need_hidden else None), grad_weight, \
            grad_bias
    grad_hidden = autograd._grad_hidden_buffer(hidden, backend) if need_hidden else None
    autograd.backward(hidden, weight, local_targets, bias, lse, mean_logit, grad_logp, grad_entropy, transform,
                      grad_hidden, grad_weight, grad_bias, backend)
    return (grad_hidden.float() if need_hidden else None), grad_weight, grad_bias
# ------------------------------------------------------------------------------------------------ end of adapter


def local_targets(targets, shard, rows):
    """The targets as this shard's column indices; -1 (never a column: the kernels match targets against column
    indices >= 0, and a target past the shard's last column could match a masked column of its last tile) where
    another rank owns the target."""
    local = targets - shard.offset
    return torch.where((local >= 0) & (local < rows), local, torch.full_like(local, -1))


def merge(lse_local, mean_local, target_local, group):
    """The shards' partial records -> (lse, mean logit or None, target logit), [N] fp32, on every rank: an
    all-reduce (max) of N values, then one (sum) of 3 N (2 N without the mean)."""
    row_max = lse_local.clone()
    dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
    pivot = torch.where(torch.isinf(row_max), torch.zeros_like(row_max), row_max)
    weight = torch.exp(lse_local - pivot)  # a shard's share of the partition function (0 for an empty shard)
    parts = [weight, target_local]
    if mean_local is not None:
        # an empty shard's mean is 0 / 0: its weight is 0, keep 0 * NaN out of the sum
        parts.append(torch.where(weight > 0, weight * mean_local, torch.zeros_like(weight)))
    packed = torch.stack(parts)
    dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=group)
    sumexp = packed[0]
    lse = pivot + torch.log(sumexp)
    mean_logit = packed[2] / sumexp if mean_local is not None else None
    return lse, mean_logit, packed[1]


def logprobs(hidden, weight, targets, bias, transform, backend, shard):
    """No-grad log-probs [N] fp32 of a vocab-parallel head (12 N bytes through collectives)."""
    y = local_targets(targets, shard, weight.shape[0])
    lse_r, _, target_r = _shard_statistics(hidden, weight, y, bias, transform, False, backend)
    lse, _, target_logit = merge(lse_r, None, target_r, shard.group)
    return target_logit - lse


def linear_logprobs(hidden, weight, targets, bias, transform, backend, shard, backward_mode):
    """(logp, entropy) [N] fp32 of a vocab-parallel head, both differentiable (hidden, this rank's weight and bias
    rows)."""
    return VocabParallelLinearLogprobs.apply(hidden, weight, targets, bias, transform, backend, shard, backward_mode)


class VocabParallelLinearLogprobs(torch.autograd.Function):
    """(hidden [N, D] replicated, weight rows [V_local, D], targets [N] global ids, bias rows | None) -> logp, entropy
    [N] fp32, equal on every rank to the unsharded head's; gradients: dH (all-reduced over the group), this rank's
    dW and db rows (local). N = 0 on every rank: empty outputs, no collective."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, bias, transform, backend, shard, backward_mode):
        ctx.set_materialize_grads(False)
        y = local_targets(targets, shard, weight.shape[0])
        if hidden.shape[0] == 0:
            lse = mean_logit = logp = entropy = torch.zeros(0, dtype=torch.float32, device=hidden.device)
        else:
            lse_r, mean_r, target_r = _shard_statistics(hidden, weight, y, bias, transform, True, backend)
            lse, mean_logit, target_logit = merge(lse_r, mean_r, target_r, shard.group)
            logp, entropy = target_logit - lse, lse - mean_logit
        ctx.save_for_backward(hidden, weight, y, bias, lse, mean_logit)
        ctx.transform, ctx.backend, ctx.shard, ctx.backward_mode = transform, backend, shard, backward_mode
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        hidden, weight, y, bias, lse, mean_logit = ctx.saved_tensors
        need_h, need_w, _, need_b = ctx.needs_input_grad[:4]
        N, dev = hidden.shape[0], hidden.device
        grad_hidden = grad_weight = grad_bias = None
        if N == 0:
            grad_hidden = torch.zeros(hidden.shape, dtype=torch.float32, device=dev) if need_h else None
            grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=dev) if need_w else None
            grad_bias = torch.zeros(weight.shape[0], dtype=torch.float32, device=dev) if need_b else None
        elif need_h or need_w or need_b:
            coef = (grad_logp.float().contiguous() if grad_logp is not None
                    else torch.zeros(N, dtype=torch.float32, device=dev))
            entropy_coef = grad_entropy.float().contiguous() if grad_entropy is not None else None
            grad_hidden, grad_weight, grad_bias = _shard_backward(
                hidden, weight, y, bias, lse, mean_logit, coef, entropy_coef, ctx.transform, need_h, need_w, need_b,
                ctx.backend, ctx.backward_mode)
            if need_h:
                dist.all_reduce(grad_hidden, op=dist.ReduceOp.SUM, group=ctx.shard.group)
        return (grad_hidden.to(hidden.dtype) if need_h else None,
                grad_weight.to(weight.dtype) if need_w else None,
                None,
                grad_bias.to(bias.dtype) if need_b else None,
                None, None, None, None)
