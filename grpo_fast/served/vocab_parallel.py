"""The served teacher's student side on a vocab-parallel head (``grpo_fast.head.vocab_parallel``'s layout: every
rank holds rows [offset, offset + V_local) of the head and sees every token).

The log-sum-exp and entropy come from layer 1's vocab-parallel op (records merged over the group). The logits at the
teacher's ids: each rank gathers the ids in its rows (the others -1: -inf there), and one all-reduce (max) of
[N, K] fp32 gives every rank every id's logit (each id has one owner). The backward: each rank's dW and db rows from
its own ids, its part of dH summed over the group (N x D fp32, as layer 1's). Traffic: 4 N K bytes forward and
4 N D backward, whatever V.

The same requirements as ``head.vocab_parallel``: every rank passes the same hidden, teacher, mask and upstream
gradients (a loss computed identically on every rank).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from grpo_fast.backends.protocol import HeadGrads, HeadOperands, gemm_weight
from grpo_fast.head.boundary import without_autocast
from grpo_fast.head.shard import VocabShard


def local_ids(ids, shard: VocabShard, rows: int):
    """The ids as this shard's columns, -1 where another shard holds them (or no entry)."""
    local = ids - shard.offset
    return torch.where((ids >= 0) & (local >= 0) & (local < rows), local, -1)


class _ShardGathered(torch.autograd.Function):
    @staticmethod
    @without_autocast
    def forward(ctx, backend, shard, transform, ids, hidden, weight, bias):
        head = HeadOperands(hidden, gemm_weight(weight, hidden), ids.new_empty(0), bias, transform, None)
        logits = backend.gathered_logits(head, ids).contiguous()
        dist.all_reduce(logits, op=dist.ReduceOp.MAX, group=shard.group)
        ctx.backend, ctx.shard, ctx.transform = backend, shard, transform
        ctx.save_for_backward(ids, hidden, weight, bias)
        return logits

    @staticmethod
    @without_autocast
    def backward(ctx, grad_logits):
        ids, hidden, weight, bias = ctx.saved_tensors
        needs = ctx.needs_input_grad[4:7]
        grads = HeadGrads(
            *(
                torch.zeros(x.shape, dtype=torch.float32, device=x.device) if need and x is not None else None
                for x, need in zip((hidden, weight, bias), needs)
            )
        )
        head = HeadOperands(hidden, gemm_weight(weight, hidden), ids.new_empty(0), bias, ctx.transform, None)
        ctx.backend.gathered_backward(head, ids, grad_logits.float().contiguous(), grads)
        if needs[0]:
            dist.all_reduce(grads.hidden, op=dist.ReduceOp.SUM, group=ctx.shard.group)
        out = [g.to(x.dtype) if g is not None else None for g, x in zip(grads[:3], (hidden, weight, bias))]
        return (None, None, None, None, *out)


def gathered_logits(head: HeadOperands, ids: torch.Tensor, backend, shard: VocabShard) -> torch.Tensor:
    """z [N, K] fp32 of ``head``'s rows (this rank's shard of the weight) at the global ``ids`` [N, K] (-1: none;
    -inf there), on every rank, differentiable (hidden, this rank's weight and bias rows). No LoRA."""
    local = local_ids(ids, shard, head.weight.shape[0])
    logits = _ShardGathered.apply(backend, shard, head.transform, local, head.hidden, head.weight, head.bias)
    return logits.masked_fill(ids < 0, float("-inf"))
