"""The sampler's support on a vocab-parallel head (``grpo_fast.head.vocab_parallel``'s layout: every rank holds rows
[offset, offset + V_local) of the head and sees every token).

Each rank computes on its rows (``support_twin``, the same functions as one process) and the reductions run over the
group (``GroupReduce``): the rows' maxima, minima and sums are all-reduced ([n] each, sums stacked), top-k's and
top-p's candidates all-gathered ([n, world x k]: each rank's largest k of a row), and top-p's rows that no candidate
count resolves are bisected over fp32's ordered keys (33 all-reduces of [n]); a row's whole logits are never
gathered. Traffic grows with the tokens, never with the vocabulary. Replayed kept sets: each rank scores the kept
ids in its rows (the others -1). The backward: each rank's dW and db rows, its part of dH summed over the group
(N x D fp32, as layer 1's).

The same requirements as ``head.vocab_parallel``: every rank passes the same hidden, targets, mask, sampling
parameters or kept sets, and upstream gradients.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from grpo_fast.backends.protocol import HeadOperands, SamplerSupport, SupportRecord, gemm_weight
from grpo_fast.head.boundary import without_autocast
from grpo_fast.head.shard import VocabShard
from grpo_fast.head.vocab_parallel import local_targets
from grpo_fast.sampler.ops import gradient_buffers, masked_support_gradient, support_outputs


class GroupReduce:
    """``support_twin.OneProcess``'s reduce steps over a process group."""

    complete_rows = False

    def __init__(self, group):
        self.group = group

    def _all_reduce(self, x, op):
        x = x.clone()
        dist.all_reduce(x, op=op, group=self.group)
        return x

    def max(self, x):
        return self._all_reduce(x, dist.ReduceOp.MAX)

    def min(self, x):
        return self._all_reduce(x, dist.ReduceOp.MIN)

    def sum(self, x):
        return self._all_reduce(x, dist.ReduceOp.SUM)

    def gather(self, x):
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)


def local_kept_ids(kept_ids, shard: VocabShard, rows: int):
    """The kept ids as this shard's columns, -1 where another shard holds them (or no entry)."""
    local = kept_ids - shard.offset
    return torch.where((kept_ids >= 0) & (local >= 0) & (local < rows), local, -1)


class _ShardSupport(torch.autograd.Function):
    @staticmethod
    @without_autocast
    def forward(ctx, backend, support, shard, transform, targets, hidden, weight, bias):
        head = HeadOperands(hidden, gemm_weight(weight, hidden), targets, bias, transform, None)
        record = backend.support_forward(head, support, shard.vocab_size, GroupReduce(shard.group))
        logp, support_logp, drawable = support_outputs(record, support.kept_ids is not None)
        ctx.backend, ctx.support, ctx.shard, ctx.transform = backend, support, shard, transform
        ctx.save_for_backward(targets, hidden, weight, bias, drawable, *record)
        ctx.mark_non_differentiable(drawable)
        ctx.set_materialize_grads(False)
        return logp, support_logp, drawable

    @staticmethod
    @without_autocast
    def backward(ctx, grad_logp, grad_support, _):
        targets, hidden, weight, bias, drawable, *fields = ctx.saved_tensors
        grad_support = masked_support_gradient(grad_support, drawable)
        if grad_logp is not None and grad_logp.numel() == 0:
            grad_logp = None
        grads = gradient_buffers((hidden, weight, bias), ctx.needs_input_grad[5:8])
        head = HeadOperands(hidden, gemm_weight(weight, hidden), targets, bias, ctx.transform, None)
        ctx.backend.support_backward(head, ctx.support, SupportRecord(*fields), grad_logp, grad_support, grads)
        if grads.hidden is not None:
            dist.all_reduce(grads.hidden, op=dist.ReduceOp.SUM, group=ctx.shard.group)
        out = [g.to(x.dtype) if g is not None else None for g, x in zip(grads, (hidden, weight, bias))]
        return (None, None, None, None, None, *out)


def sampler_support(head: HeadOperands, backend, support: SamplerSupport, shard: VocabShard):
    """``sampler.ops.sampler_support`` on this rank's shard of the head: (logp, support, drawable) [N], the whole
    head's on every rank. ``head``'s targets are global vocabulary ids; ``support``'s kept ids too."""
    rows = head.weight.shape[0]
    if support.kept_ids is not None:
        support = support._replace(kept_ids=local_kept_ids(support.kept_ids, shard, rows))
    targets = local_targets(head.targets, shard, rows)
    return _ShardSupport.apply(backend, support, shard, head.transform, targets, head.hidden, head.weight, head.bias)
