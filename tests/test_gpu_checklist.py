"""tools/gpu_checklist.sh's options, parsed without a GPU: every time limit its help lists (``--name S``) is read as
that option's value and checked, so a malformed one stops the script with its one-line usage error (exit 2) before
anything runs, rather than reaching pytest as a test path."""

import re
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "tools" / "gpu_checklist.sh"
HELP = subprocess.run(["bash", str(SCRIPT), "--help"], capture_output=True, text=True, check=True).stdout
TIME_OPTIONS = re.findall(r"^  (--[a-z-]+) S ", HELP, flags=re.MULTILINE)


def test_the_help_lists_the_time_limits():
    assert {"--tests-limit", "--memory-limit", "--recipe-limit", "--tune-limit", "--total"} <= set(TIME_OPTIONS)


@pytest.mark.parametrize("option", TIME_OPTIONS)
def test_a_malformed_time_limit_is_a_usage_error(option):
    run = subprocess.run(["bash", str(SCRIPT), option, "soon"], capture_output=True, text=True, timeout=60)
    assert run.returncode == 2, (option, run.stderr)
    assert "a time is a whole number of seconds, not 'soon'" in run.stderr
