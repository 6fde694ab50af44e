"""Tests run the Triton kernels on CPU through Triton's interpreter; it must be on before triton.jit runs."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

# Tolerances against the fp32 reference. fp32: float rounding of a different summation order.
# bf16 / fp16: the kernels' outputs (gradients in the input dtype) carry one rounding of that dtype
# (2^-8 relative for bf16); on a GPU the backward's dot operands are bf16 too (see tests/gpu).
TOLERANCES = {
    torch.float32: dict(rtol=1e-4, atol=1e-5),
    torch.bfloat16: dict(rtol=2e-2, atol=2e-3),
    torch.float16: dict(rtol=5e-3, atol=1e-3),
}


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
