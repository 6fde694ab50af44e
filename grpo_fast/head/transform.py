"""The logit transform: one object from the public keywords (temperature, softcap, logit_scale) to the kernels.

The public functions build it once (``from_keywords``: checked numbers); every internal signature takes it, the
torch forms call ``apply`` and the Triton kernels take ``kernel_scalars`` (their one place); the custom ops (layer
1's in ``head.ops``, the divergence head's), whose schemas take numbers only, carry ``as_floats`` and rebuild it with
``from_floats``.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch


def check_number(name, x, condition=lambda v: True, expected="a finite number"):
    """x must be a real number (a Python or numpy scalar, not a bool) for which condition holds."""
    # finite as comparisons, not math.isfinite: torch.compile folds these on a constant
    if isinstance(x, bool) or not isinstance(x, numbers.Real) or x != x or abs(x) == math.inf or not condition(x):
        raise ValueError(f"{name} must be {expected}, got {x!r}")


def check_chunk(name, x, unit):
    """x must be None or a positive int (not a bool): a number of ``unit`` (a token chunk's size)."""
    if x is not None and (isinstance(x, bool) or not isinstance(x, int) or x < 1):
        raise ValueError(f"{name} must be a positive int ({unit}) or None, got {x!r}")


def check_softcap_and_scale(softcap, logit_scale, names=("softcap", "logit_scale")):
    """A model's soft-cap (None or > 0) and logit scale (non-zero), each a named error under ``names``: every
    model's transform keywords, the policy's, a student's or a teacher's."""
    if softcap is not None:
        check_number(names[0], softcap, lambda v: v > 0, "None or a positive number (Gemma 2: 30.0)")
    check_number(names[1], logit_scale, lambda v: v != 0, "a finite non-zero number")


@dataclass(frozen=True)
class LogitTransform:
    """z = softcap * tanh(logit_scale * (h . W + b) / softcap) / temperature, TRL 1.16's order (no tanh: softcap None).

    Gemma 2 / 3 soft-cap their logits (config.final_logit_softcapping); Cohere, Granite, Falcon-H1 and others scale
    them (logit_scale, 1 / logits_scaling, lm_head_multiplier, ...). ``apply`` is the product's one torch form (the
    torch twins, TRL's head; the spec writes its own); ``kernels.tile.transform_and_slope`` is the one Triton form.
    """

    temperature: float = 1.0
    softcap: float | None = None
    logit_scale: float = 1.0

    def apply(self, u, slope=False):
        """z from raw logits u = h . W + b (any float dtype, differentiable); with ``slope`` also dz/du, a tensor
        (a soft-cap) or a number.

        dz/du = logit_scale (1 - tanh^2) / temperature, with 1 - tanh^2 x formed as 4e / (1 + e)^2, e = exp(-2|x|):
        it keeps its relative precision where tanh saturates (1 - tanh^2 would cancel to 0 there)."""
        z = u * self.logit_scale
        dz_du = self.logit_scale / self.temperature
        if self.softcap is not None:
            x = z / self.softcap
            if slope:
                e = torch.exp(-2.0 * x.abs())
                dz_du = (4.0 * dz_du) * e / (1.0 + e).square()
            z = self.softcap * torch.tanh(x)
        z = z / self.temperature
        return (z, dz_du) if slope else z

    def kernel_scalars(self):
        """(inv_temperature, logit_scale, softcap) as the kernels take them (softcap 1.0 when unused)."""
        return 1.0 / self.temperature, float(self.logit_scale), float(self.softcap or 1.0)

    def as_floats(self):
        """(temperature, softcap or None, logit_scale): a custom op's schema arguments (float, float?, float)."""
        return float(self.temperature), None if self.softcap is None else float(self.softcap), float(self.logit_scale)

    @classmethod
    def from_floats(cls, temperature, softcap, logit_scale):
        """The transform from ``as_floats``' three numbers."""
        return cls(float(temperature), None if softcap is None else float(softcap), float(logit_scale))

    @classmethod
    def from_keywords(cls, temperature=1.0, softcap=None, logit_scale=1.0):
        """The public keywords, checked (a named error for each bad number), as one transform."""
        check_number("temperature", temperature, lambda v: v > 0, "a positive number")
        check_softcap_and_scale(softcap, logit_scale)
        return cls.from_floats(temperature, softcap, logit_scale)
