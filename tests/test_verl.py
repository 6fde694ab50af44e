"""grpo_fast.verl's tests (tests/verl_env) in verl's own environment, from this test session.

verl 0.9 pins transformers <5.11 and tensordict <=0.10 and breaks when TRL 1.16 is importable (its
apply_monkey_patch imports a class TRL 1.16 removed), so the verl tests cannot run beside the trl extra: they run in a
second environment with ``grpo_fast[verl]``, whose python ``GRPO_FAST_VERL_PYTHON`` names (.ci/run builds it and
sets it). This test runs pytest there on tests/verl_env with this session's ``-m`` expression, so ``pytest`` runs them
all and ``pytest -m "not slow"`` their fast tier. Where verl is importable in this environment, tests/verl_env is
collected by this session directly and this test skips.
"""

import importlib.util
import os

import pytest
from helpers import run_suite_in_environment

VERL_PYTHON = os.environ.get("GRPO_FAST_VERL_PYTHON")
TIMEOUT_S = 40 * 60


@pytest.mark.skipif(
    importlib.util.find_spec("verl") is not None,
    reason="verl is importable here: this session collects tests/verl_env itself",
)
# outside CI a checkout without verl's environment skips this test and says how to build one; under CI=true (.ci/run
# builds it and sets the variable) a missing environment fails instead
@pytest.mark.skipif(
    not VERL_PYTHON and os.environ.get("CI") != "true",
    reason="no verl environment: GRPO_FAST_VERL_PYTHON is not set (the python of an "
    "environment with grpo_fast[verl] installed; .ci/run builds one)",
)
def test_verl_environment(request):
    assert VERL_PYTHON, "CI=true but GRPO_FAST_VERL_PYTHON is not set: .ci/run builds verl's environment and sets it"
    run_suite_in_environment(VERL_PYTHON, "tests/verl_env", request, TIMEOUT_S)
