"""Tests run the Triton kernels on CPU through Triton's interpreter; it must be on before triton.jit runs."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

# Gradient tolerances against the fp32 reference. fp32: the rounding of another summation order, per
# element. bf16 / fp16: the backward feeds the GEMMs with g = c (onehot - p) / tau rounded to the input dtype
# (2^-9 relative for bf16), as tensor cores need; a sum of rounded terms that cancel is off by a fraction of
# the terms, not of the result, so the bound is on the largest error relative to the largest gradient entry.
HALF_GRAD_RTOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3}


def assert_grad_close(actual, expected, dtype, name=""):
    assert actual.dtype == dtype, name
    if dtype == torch.float32:
        torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")
        return
    err = (actual.float() - expected.float()).abs().max().item()
    scale = expected.float().abs().max().item()
    assert err <= HALF_GRAD_RTOL[dtype] * scale, f"{name}: max error {err:.3g} vs max |grad| {scale:.3g}"


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
