"""Layer 1's operands and gradient buffers as two records: what every layer-1 function (the kernels' launchers, the
torch twin, the backends, the reduce steps) takes in place of the same list of arguments."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch


class HeadOperands(NamedTuple):
    """The scored tokens' logits z = transform(hidden weight^T + lora_hidden lora_weight^T + bias) and their targets.

    Attributes:
        hidden: [N, D] the scored tokens' last hidden states, rows contiguous.
        weight: [V, D] the lm_head's rows (a vocab-parallel shard's rows), hidden's dtype.
        targets: [N] int64 vocabulary indices (one outside [0, V): in no column of these rows).
        bias: [V] or None.
        transform: the logit transform (a LogitTransform: ``apply``, ``kernel_scalars``, ``softcap``).
        lora: None, or LoRA's operand pair (lora_hidden [N, r], lora_weight [V, r]), whose product is added to the
            raw logits (``head.lora.HeadLora``).
    """

    hidden: torch.Tensor
    weight: torch.Tensor
    targets: torch.Tensor
    bias: torch.Tensor | None
    transform: Any
    lora: tuple[torch.Tensor, torch.Tensor] | None = None

    def tokens(self, start: int, stop: int) -> HeadOperands:
        """The same operands over the tokens [start, stop) only."""
        lora = (self.lora[0][start:stop], self.lora[1]) if self.lora is not None else None
        return self._replace(hidden=self.hidden[start:stop], targets=self.targets[start:stop], lora=lora)


class HeadGrads(NamedTuple):
    """Layer 1's fp32 gradient buffers, each None where that gradient is not wanted (or its operand is absent):
    d hidden [N, D], d weight [V, D], d bias [V], d lora_hidden [N, r], d lora_weight [V, r]."""

    hidden: torch.Tensor | None = None
    weight: torch.Tensor | None = None
    bias: torch.Tensor | None = None
    lora_hidden: torch.Tensor | None = None
    lora_weight: torch.Tensor | None = None
