"""A vocab-parallel lm_head: the head's vocabulary split over the ranks of a process group, never gathered.

Tensor parallelism splits the head by rows (Megatron's vocab-parallel layout; a DTensor ``Shard(0)`` from torch's
tensor-parallel plans and transformers' ``tp_plan``). Every rank of the group sees the same tokens (hidden [N, D] and
targets [N], replicated) and holds rows [offset, offset + V_local) of the weight [V, D] (and of the bias); each rank
returns exactly what the unsharded head returns:

* forward: layer 1's forward on the shard up to its unfinished per-token record (``softmax_stats.SoftmaxStats``;
  targets it does not own are -1, a column no kernel matches); the records merge by softmax_stats' merge over the
  group (an all-reduce (max) of the N maxima, then one all-reduce (sum) of [4, N] fp32, [3, N] without the entropy)
  and are finished by ``softmax_stats.finish``, so confident tokens are as exact as unsharded.
* backward (the general path): layer 1's backward on the shard with the GLOBAL BackwardStats; dW and db rows stay
  local, the partial dH is all-reduced in fp32 (N x D x 4 bytes, the only tensor that scales with more than N).
* frozen head (``ops.linear_logprobs_path``'s choice, alike on every rank): each rank's part of J = d logp / d hidden,
  rescaled to the global max and finished with the global sums (``softmax_stats.finish_frozen_grad``), is summed by
  one all-reduce of N x D fp32 in the forward; the backward is dH = grad_logp J with no collective. An entropy
  gradient that arrives anyway gets the general path's entropy-only term, as on one process.

What crosses the network per training step: 20 N bytes in the forward (16 N without the entropy) and 4 N D bytes
(dH in the backward, or J in the forward), whatever V and the number of ranks. No rank holds more than its shard of
the weight, or any tensor of size V x N.

Requirements (not checked: checking would cost a collective per call): the shards tile [0, V) without overlap, and
every rank passes the same hidden, targets and mask and the same upstream gradients (a loss computed identically on
every rank, as ``grpo_fast.loss`` does). dH is the full gradient of the replicated hidden states: do not all-reduce it
again (skip Megatron's ``copy_to_tensor_model_parallel_region`` for the head's input).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from grpo_fast.head import ops, paths
from grpo_fast.head.shard import VocabShard
from grpo_fast.kernels import softmax_stats
from grpo_fast.kernels.operands import HeadOperands
from grpo_fast.kernels.softmax_stats import SoftmaxStats


# ------------------------------------------------------------------------------------------------------------
# The adapter: the only code that knows layer 1's internals. A shard's forward is layer 1's unfinished per-token
# record over its rows (paths.head_forward_record: max, sum of exp, the non-target sum, the z-sum, the target
# logit; softmax_stats.SoftmaxStats); the ranks' records are merged by softmax_stats' one merge (``merge_records``)
# and finished by softmax_stats.finish, as one process finishes its own record; the frozen-head path's acc
# (paths.head_forward_frozen_record) is finished by softmax_stats.finish_frozen_grad. The shard's backward is
# layer 1's own (the head's one backward, in head.ops) with the finished GLOBAL BackwardStats,
# its dH summed by ``GroupReduce.sum_grad_hidden``; its target column reads the carried 1 - p_y and mean - z_y only
# on the target's owner (the other ranks pass target -1, a column no kernel matches: no target term there).
# ------------------------------------------------------------------------------------------------------------
def merge_records(record, compute_entropy, group):
    """This rank's record (softmax_stats.SoftmaxStats, [N] fp32 fields) -> the record of the whole vocabulary, on
    every rank: an all-reduce (max) of the N maxima, this rank's record expressed against that global max (``merge``
    with the empty record at it), then one all-reduce (sum) of [4, N] fp32 (sum of exp, non-target sum, target logit,
    z-sum; [3, N] without the entropy): records that share their max merge by adding their sums."""
    row_max = record.max.clone()
    dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
    local = softmax_stats.merge(softmax_stats.stack(record, softmax_stats.empty(row_max)))
    sums = [local.sumexp, local.rest, local.target] + ([local.zsum] if compute_entropy else [])
    packed = torch.stack(sums)
    dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=group)
    return SoftmaxStats(
        row_max, packed[0], packed[1], packed[3] if compute_entropy else torch.zeros_like(row_max), packed[2]
    )


class GroupReduce:
    """The head's reduce step over a vocab-parallel group (``paths.OneProcess``'s counterpart, which the head's
    one implementation in ``head.ops`` takes): each rank's forward stops at its unfinished record, the records
    merge over the group (``merge_records``) and are finished as one process finishes its own; J and dH are summed
    over the group. No LoRA (the public API rejects it with a vocab-parallel head)."""

    def __init__(self, group):
        self.group = group

    def forward(self, head, compute_entropy, backend, row_count=None):
        """(logp, entropy or None, BackwardStats of the whole vocabulary), [N] fp32, on every rank. ``row_count`` is
        not read: a padding row's placeholder record would not merge over the ranks as a real one does. ``head``'s
        targets are this rank's columns (``local_targets``)."""
        record = paths.head_forward_record(head, compute_entropy, backend)
        return softmax_stats.finish(merge_records(record, compute_entropy, self.group), compute_entropy)

    def frozen_forward(self, head, backend):
        """The frozen-head path's forward: (logp, entropy, BackwardStats, J = d logp / d hidden [N, D] fp32, None),
        the whole vocabulary's, on every rank. This shard's unfinished record, acc (sum over its non-target rows of
        e_v s'_v W_v, against its own max m_r) and target slope (layer 1's frozen forward up to "finish"); the
        records merge as in ``forward``; acc is rescaled to the global max by the record's own factor exp(m_r - m)
        and finished with the GLOBAL R and S (softmax_stats.finish_frozen_grad: the target's s'_y R W_y only on its
        owner), so that the ranks' parts sum to J: one all-reduce (sum) of N x D fp32."""
        record, acc, target_slope = paths.head_forward_frozen_record(head, backend)
        merged = merge_records(record, True, self.group)
        acc.mul_(softmax_stats.rescale(record.max, merged.max)[:, None])
        grad = softmax_stats.finish_frozen_grad(acc, merged, target_slope, head.weight, head.targets)
        dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=self.group)
        return (*softmax_stats.finish(merged, True), grad, None)

    def sum_grad_hidden(self, grad_hidden):
        """dH [N, D] fp32: this shard's part (sum over its rows of g W_shard) summed over the group, in place."""
        dist.all_reduce(grad_hidden, op=dist.ReduceOp.SUM, group=self.group)
        return grad_hidden


# ------------------------------------------------------------------------------------------------ end of adapter


def local_targets(targets, shard, rows):
    """The targets as this shard's column indices; -1 (never a column: the kernels match targets against column
    indices >= 0, and a target past the shard's last column could match a masked column of its last tile) where
    another rank owns the target."""
    local = targets - shard.offset
    return torch.where((local >= 0) & (local < rows), local, torch.full_like(local, -1))


def logprobs(head: HeadOperands, backend, shard: VocabShard) -> torch.Tensor:
    """No-grad log-probs [N] fp32 of a vocab-parallel head (16 N bytes through collectives); ``head``'s weight and
    bias are this rank's rows, its targets global vocabulary indices."""
    head = head._replace(targets=local_targets(head.targets, shard, head.weight.shape[0]))
    operands = ops.LinearOpOperands.of(head, backend.name)
    return ops.linear_logprobs(operands, False, False, reduce=GroupReduce(shard.group))[0]


def linear_logprobs(head: HeadOperands, backend, shard: VocabShard, head_path, backward_mode):
    """(logp, entropy) [N] fp32 of a vocab-parallel head, equal on every rank to the unsharded head's, both
    differentiable: dH (whole on every rank), this rank's dW and db rows (local). The single-process head's autograd
    path (ops.linear_logprobs_path: the same choice of path, the same backward, entropy fallback and empty case)
    with this group's reduce step: the frozen head ("auto", only hidden needs a gradient) builds J in the forward
    (one N x D all-reduce there) and its backward is dH = grad_logp J, with no collective; the general path
    all-reduces dH in the backward. N = 0 on every rank: empty outputs, no collective. ``head`` as ``logprobs``'."""
    head = head._replace(targets=local_targets(head.targets, shard, head.weight.shape[0]))
    return ops.linear_logprobs_path(head, backend, head_path, backward_mode, reduce=GroupReduce(shard.group))
