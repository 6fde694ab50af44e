"""The head's logits at given ids, as a torch.library custom op: ``grpo_fast::gathered_logits`` (z [N, K] of each
row at its K ids, -1: no entry) and its backward op, the autograd formula registered between them (``boundary``: one
node under torch.compile, fake implementations for fake and meta tensors).

Math. z[n, j] = transform(h_n . W_{ids[n, j]} (+ LoRA's product) + b_{ids[n, j]}), a gather of K weight rows a token:
O(N K D) work, no vocabulary sweep. From G = dL/dz [N, K]: dh_n = sum_j G[n, j] z'[n, j] W_{ids[n, j]} and
dW_{ids[n, j]} += G[n, j] z'[n, j] h_n (z': the transform's slope), the backend's ``gathered_backward`` (the Triton
backend's by ``kernels.kept_set``, its dW from the pairs sorted by id: each id's row added once a run). A row's
log-probs at its ids are these logits minus the row's log-sum-exp, which layer 1's op gives (its log-prob of a target
outside the vocabulary is -lse, with lse's gradient): together the log-probs at K ids a token in one vocabulary sweep
forward (``grpo_fast.served``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from grpo_fast.backends.protocol import HeadGrads, HeadOperands, gemm_weight
from grpo_fast.backends.resolver import named
from grpo_fast.head.boundary import custom_op, inline_function, op_schema, runs_inline
from grpo_fast.head.transform import LogitTransform

FP32 = torch.float32


class GatheredOpOperands(NamedTuple):
    """The gathered-logit ops' operands as their schemas take them.

    Attributes:
        hidden: [N, D] the rows, row-contiguous.
        weight: [V, D] the head's rows, hidden's dtype or fp32 over bf16 / fp16 hidden (``head`` casts it).
        ids: [N, K] int64 vocabulary ids, -1: no entry.
        bias: [V] or None.
        lora_hidden, lora_weight: LoRA's operand pair ([N, r], [V, r]) or None (both or neither).
        temperature, softcap, logit_scale: the logit transform (``LogitTransform.as_floats``).
        backend: a resolved backend's name.
    """

    hidden: torch.Tensor
    weight: torch.Tensor
    ids: torch.Tensor
    bias: torch.Tensor | None
    lora_hidden: torch.Tensor | None
    lora_weight: torch.Tensor | None
    temperature: float
    softcap: float | None
    logit_scale: float
    backend: str

    @classmethod
    def of(cls, head: HeadOperands, ids: torch.Tensor, backend: str) -> GatheredOpOperands:
        lora = head.lora if head.lora is not None else (None, None)
        return cls(head.hidden, head.weight, ids, head.bias, *lora, *head.transform.as_floats(), backend)

    def head(self) -> HeadOperands:
        """The HeadOperands the backends take (no targets: the ids are the columns)."""
        lora = (self.lora_hidden, self.lora_weight) if self.lora_hidden is not None else None
        transform = LogitTransform.from_floats(self.temperature, self.softcap, self.logit_scale)
        no_targets = self.ids.new_empty(0)
        return HeadOperands(self.hidden, gemm_weight(self.weight, self.hidden), no_targets, self.bias, transform, lora)

    def sources(self):
        """The operands a gradient can reach, in HeadGrads' order."""
        return (self.hidden, self.weight, self.bias, self.lora_hidden, self.lora_weight)


def _gathered_logits(*operands):
    operands = GatheredOpOperands(*operands)
    return named(operands.backend).gathered_logits(operands.head(), operands.ids).contiguous()


_gathered_logits_op = custom_op("gathered_logits", _gathered_logits, op_schema(GatheredOpOperands, "", "", "Tensor"))


@_gathered_logits_op.register_fake
def _(*operands):
    operands = GatheredOpOperands(*operands)
    return operands.hidden.new_empty(tuple(operands.ids.shape), dtype=FP32)


def _setup_context(ctx, inputs, output):
    operands = GatheredOpOperands(*inputs)
    ctx.save_for_backward(*(x if isinstance(x, torch.Tensor) else None for x in operands))
    ctx.numbers = [x if not isinstance(x, torch.Tensor) else None for x in operands]


def _backward(ctx, grad_logits):
    operands = GatheredOpOperands(*(t if n is None else n for t, n in zip(ctx.saved_tensors, ctx.numbers)))
    needs = tuple(ctx.needs_input_grad[i] for i in (0, 1, 3, 4, 5))
    grads = gathered_logits_backward(operands, grad_logits.float().contiguous(), needs)
    hidden, weight, bias, lora_hidden, lora_weight = (g if g is not None and g.numel() else None for g in grads)
    rest = (None,) * (len(GatheredOpOperands._fields) - 6)
    return (hidden, weight, None, bias, lora_hidden, lora_weight) + rest


def _gathered_logits_backward(*arguments):
    """(dH, dW, db, d lora_hidden, d lora_weight) in their operands' dtypes (empty where not needed) from dL/dz."""
    *operands, grad_logits = arguments[:-5]
    needs = arguments[-5:]
    operands = GatheredOpOperands(*operands)
    grads = HeadGrads(
        *(
            torch.zeros(x.shape, dtype=FP32, device=x.device) if need and x is not None else None
            for x, need in zip(operands.sources(), needs)
        )
    )
    named(operands.backend).gathered_backward(operands.head(), operands.ids, grad_logits, grads)
    return tuple(
        g.to(x.dtype) if g is not None else operands.hidden.new_empty(0) for g, x in zip(grads, operands.sources())
    )


_gathered_logits_backward_op = custom_op(
    "gathered_logits_backward",
    _gathered_logits_backward,
    op_schema(
        GatheredOpOperands,
        "",
        "Tensor grad_logits, bool need_hidden, bool need_weight, bool need_bias, bool need_lora_hidden, "
        "bool need_lora_weight",
        "(Tensor, Tensor, Tensor, Tensor, Tensor)",
    ),
)


@_gathered_logits_backward_op.register_fake
def _(*arguments):
    operands = GatheredOpOperands(*arguments[: len(GatheredOpOperands._fields)])
    needs = arguments[-5:]
    return tuple(
        x.new_empty(x.shape) if need and x is not None else operands.hidden.new_empty(0)
        for x, need in zip(operands.sources(), needs)
    )


def gathered_logits_backward(operands: GatheredOpOperands, grad_logits, needs):
    args = (*operands, grad_logits, *needs)
    return _gathered_logits_backward(*args) if runs_inline(args) else _gathered_logits_backward_op(*args)


_gathered_logits_op.register_autograd(_backward, setup_context=_setup_context)
_INLINE = inline_function(_gathered_logits, _setup_context, _backward)


def gathered_logits(head: HeadOperands, ids: torch.Tensor, backend: str) -> torch.Tensor:
    """z [N, K] fp32 of ``head``'s rows at ``ids`` [N, K] int64 (-inf at -1), differentiable (hidden, weight, bias,
    LoRA's pair); ``backend``: a resolved backend's name."""
    args = tuple(GatheredOpOperands.of(head, ids, backend))
    return _INLINE.apply(*args) if runs_inline(args) else _gathered_logits_op(*args)
