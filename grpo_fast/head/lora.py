"""LoRA on lm_head: the adapter's description (``HeadLora``), its checks, and the small [N, r] operand it adds.

PEFT's LoRA linear computes ``base(x) + lora_B(lora_A(dropout(x))) * scaling`` with x cast to lora_A's dtype, so
the head's raw logits are
    u = h W^T (+ bias) + l B^T,    l = scaling * dropout(h) A^T   [N, r], in the adapters' dtype,
one GEMM over the concatenated operands [h | l] and [W | B]. Layer 1 (its custom op, the torch twin, the kernels)
takes (l, B) as a second operand pair and runs a second K-loop over r into the same fp32 accumulator; its backward
gives dl = g B [N, r] and dB = g^T l [V, r] from the same tiles g = dL/du, and autograd carries dl back to h and A
through ``lora_hidden``. No merged [V, D] weight and no logits are built; the extra memory is O((N + V) r).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass

import torch

from grpo_fast.kernels.config import FLOAT_DTYPES


@dataclass(frozen=True)
class HeadLora:
    """LoRA on the lm_head, PEFT's adapter as grpo_fast's ``lora=`` takes it.

    a and b share a float dtype, which may differ from the base head's (PEFT keeps adapters in fp32 over a bf16
    base): the LoRA branch is computed in it, as PEFT does. Gradients reach a and b where they require one.

    Attributes:
        a: [r, D] float: PEFT's ``lora_A.weight``.
        b: [V, r] float, a's dtype and device: PEFT's ``lora_B.weight``.
        scaling: PEFT's ``scaling[adapter]`` (lora_alpha / r, or / sqrt(r) with rsLoRA); a finite number.
        dropout: the callable PEFT applies to the hidden states before A (its ``lora_dropout[adapter]``:
            nn.Dropout or nn.Identity, as it is), or None.

    Raises:
        TypeError: a or b not a float tensor, a and b of different dtypes, or a dropout that is not callable.
        ValueError: a or b not 2-D, their ranks differing or 0, a and b on different devices, or a scaling that
            is not a finite number.
    """

    a: torch.Tensor
    b: torch.Tensor
    scaling: float
    dropout: Callable[[torch.Tensor], torch.Tensor] | None = None

    def __post_init__(self):
        for name, x in (("a", self.a), ("b", self.b)):
            if not isinstance(x, torch.Tensor):
                raise TypeError(f"lora.{name} must be a torch.Tensor, got {type(x).__name__}")
            if x.dtype not in FLOAT_DTYPES:
                raise TypeError(f"lora.{name} must be float32, bfloat16 or float16, got {x.dtype}")
            if x.dim() != 2:
                raise ValueError(
                    f"lora.{name} must be 2-D (a: lora_A.weight [r, D], b: lora_B.weight [V, r]), got "
                    f"shape {tuple(x.shape)}"
                )
        if self.a.dtype != self.b.dtype:
            raise TypeError(f"lora.a ({self.a.dtype}) and lora.b ({self.b.dtype}) must share a dtype")
        if self.a.shape[0] != self.b.shape[1] or self.a.shape[0] == 0:
            raise ValueError(
                f"lora rank mismatch: a [r, D] has r = {self.a.shape[0]}, b [V, r] has r = "
                f"{self.b.shape[1]} (r must be the same and > 0)"
            )
        if self.a.device != self.b.device:
            raise ValueError(f"lora.a is on {self.a.device} but lora.b is on {self.b.device}")
        s = self.scaling
        if isinstance(s, bool) or not isinstance(s, numbers.Real) or not math.isfinite(s):
            raise ValueError(f"lora.scaling must be a finite number, got {s!r}")
        object.__setattr__(self, "scaling", float(s))
        if self.dropout is not None and not callable(self.dropout):
            raise TypeError(
                f"lora.dropout must be None or a callable (PEFT's lora_dropout module), got "
                f"{type(self.dropout).__name__}"
            )

    @property
    def rank(self):
        """r, the adapter's rank."""
        return self.a.shape[0]


def as_head_lora(lora):
    """None, a HeadLora, or a plain tuple (a, b, scaling[, dropout]) -> None or a HeadLora."""
    if lora is None or isinstance(lora, HeadLora):
        return lora
    if isinstance(lora, tuple) and len(lora) in (3, 4):
        return HeadLora(*lora)
    raise TypeError(f"lora must be None, a grpo_fast.HeadLora or a tuple (a, b, scaling), got {type(lora).__name__}")


def check_against_head(lora, hidden, weight, vocab_parallel):
    """The adapter fits this head: a's D is hidden's, b's V is weight's rows, same device as hidden; a vocab-parallel
    head with LoRA is not supported yet."""
    if vocab_parallel:
        raise ValueError("lora= with a vocab-parallel head is not supported yet: gather the head or use one process")
    D, V = hidden.shape[-1], weight.shape[0]
    if lora.a.shape[1] != D:
        raise ValueError(
            f"hidden has D = {D} but lora.a has shape {tuple(lora.a.shape)}: lora.a's second dimension must equal "
            "hidden's last"
        )
    if lora.b.shape[0] != V:
        raise ValueError(
            f"weight has V = {V} rows but lora.b has shape {tuple(lora.b.shape)}: lora.b's first dimension must "
            "equal weight's"
        )
    if lora.a.device != hidden.device:
        raise ValueError(
            f"lora.a is on {lora.a.device} but hidden is on {hidden.device}: all tensors must share a device"
        )


def lora_hidden(lora, hidden, rows):
    """l = scaling * dropout(h) A^T [N, r] in the adapters' dtype (differentiable) for the scored rows (``rows``:
    their flat indices, or None for all) of hidden [B, T, D].

    A dropout module sees the whole hidden tensor, as PEFT's does (the same shape, so the same random mask from the
    same RNG state); without one (None, nn.Identity) only the scored rows are cast and multiplied."""
    x = hidden
    identity = lora.dropout is None or isinstance(lora.dropout, torch.nn.Identity)
    if identity:
        x = x.reshape(-1, x.shape[-1])
        if rows is not None:
            x = x.index_select(0, rows)
        x = x.to(lora.a.dtype)
    else:
        x = lora.dropout(x.to(lora.a.dtype)).reshape(-1, x.shape[-1])
        if rows is not None:
            x = x.index_select(0, rows)
    return lora.scaling * (x @ lora.a.T)
