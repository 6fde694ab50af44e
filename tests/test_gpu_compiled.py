"""On a machine with CUDA, the README's test command runs the compiled kernels' tests too.

tests/conftest.py turns Triton's interpreter on for the whole process (every kernel test runs on CPU tensors that
way), and the interpreter cannot be turned off inside a process once kernels are built; so this test runs
tests/test_gpu.py in a child process with TRITON_INTERPRET=0 and fails with its output if any of it fails.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from grpo_fast.kernels.config import interpreting

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.skipif(not interpreting(), reason="the interpreter is off in this process: tests/test_gpu.py runs in it")
def test_compiled_kernels_on_this_gpu():
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=str(ROOT))
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_gpu.py"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=3600)
    assert run.returncode == 0, (run.stdout + run.stderr)[-6000:]
    assert " passed" in run.stdout, run.stdout[-2000:]
