"""The kernel tests run where ``device`` (below) says: on CPU tensors through Triton's interpreter on a machine without
CUDA (TRITON_INTERPRET=1 is set here, before triton.jit runs), compiled on a CUDA GPU where one is present."""

import os
import sys

import torch

# the examples' own package (examples/gsm8k), as the example scripts import it, and the repository root (bench/, tools/:
# `pytest` puts no working directory on sys.path, and a test module must not depend on another having added it)
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(_ROOT, "examples"))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

# before any triton.jit runs (the test modules import grpo_fast after this file); TRITON_INTERPRET=1 set by hand
# keeps a CUDA machine on the interpreter
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import interpreter_calls  # noqa: E402

interpreter_calls.install()

import pytest  # noqa: E402

# `pytest -n N` (pytest-xdist: the README's test command): N worker processes share the cores, so each takes its share
# of torch's intra-op threads instead of all of them (oversubscribed threads only wait on each other)
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    torch.set_num_threads(max(1, torch.get_num_threads() // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))

# Gradient tolerances against the fp64 reference, by the device the gradient was computed on (the interpreter's and
# the torch backend's CPU; a compiled CUDA GPU) and its dtype: (criterion, bound).
# "elementwise": rtol 1e-4, atol 1e-5 per element (fp32 on CPU: the rounding of another summation order).
# "of max": the largest error over the largest |reference gradient| entry. bf16 / fp16: the backward feeds the
# GEMMs with g = c (onehot - p) / tau rounded to the input dtype (2^-9 relative for bf16), as tensor cores need; a
# sum of rounded terms that cancel is off by a fraction of the terms, not of the result. The interpreter's dots run
# on fp32-upcast operands (config.DOT_FP32); a GPU's bf16 / fp16 tensor-core dots and its fp32 atomics in another
# order need the wider bounds (tests/test_gpu.py's measured GPU_TOL at its larger shapes).
GRAD_TOL = {
    "cpu": {torch.float32: ("elementwise", 1e-4), torch.bfloat16: ("of max", 1e-2), torch.float16: ("of max", 2e-3)},
    "cuda": {torch.float32: ("of max", 1e-4), torch.bfloat16: ("of max", 2e-2), torch.float16: ("of max", 5e-3)},
}


def grad_rtol(device, dtype):
    """The "of max" bound for gradients computed on ``device`` in ``dtype`` (fp32 on CPU: 1e-4)."""
    return GRAD_TOL[torch.device(device).type][dtype][1]


def assert_grad_close(actual, expected, dtype, name=""):
    """actual (computed in ``dtype`` on its device) against the fp64 reference's gradient, by GRAD_TOL."""
    assert actual.dtype == dtype, name
    criterion, bound = GRAD_TOL[actual.device.type][dtype]
    expected = expected.to(actual.device)
    if criterion == "elementwise":
        torch.testing.assert_close(actual, expected, rtol=bound, atol=bound / 10, msg=lambda m: f"{name}: {m}")
        return
    err = (actual.float() - expected.float()).abs().max().item()
    scale = expected.float().abs().max().item()
    assert err <= bound * scale, f"{name}: max error {err:.3g} vs max |grad| {scale:.3g}"


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def _kernel_device():
    """Where the kernel tests put their tensors: a CUDA GPU (kernels compiled) when one is present and the
    interpreter is off, else the CPU (Triton's interpreter)."""
    interpreting = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    return torch.device("cuda" if torch.cuda.is_available() and not interpreting else "cpu")


KERNEL_DEVICE = _kernel_device()


@pytest.fixture
def device():
    """The kernel tests' device (``_kernel_device``): build every tensor a kernel test feeds grpo_fast on it."""
    return KERNEL_DEVICE


def backend_device(backend, device):
    """Where a test of ``backend`` runs: the Triton backends on the kernel device, the torch backend on CPU."""
    return device if backend.startswith("triton") else torch.device("cpu")


# ----------------------------------------------------------------------------------------------- the fast tier
# `pytest -m "not slow"` is the inner loop (its limit: 3 minutes on 2 cores, docs/development.md);
# `pytest` runs everything (README, CI).
# Slow are: the tests marked @pytest.mark.slow (whole training runs, TRL trainer comparisons, several processes,
# the benchmark end to end, the offline GPU compiles), and, of each parametrized test, the cases beyond a covering
# subset: the fast tier keeps, in collection order, the fewest cases in which every value of every parameter
# appears at least once (a dict parameter: every key=value; a parameter with an ``id``: every "-"-separated part
# of it), so every backend, dtype, loss type, level and option still runs at small size.


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "interpreter_only: feeds the Triton kernels CPU tensors (FLOP counts of the CPU path, gloo process "
        "groups, TRL's CPU models): skipped where the kernels are compiled (a CUDA device)",
    )
    config.addinivalue_line(
        "markers",
        "slow: whole-training, multi-process, benchmark and compile runs, and the parametrized cases "
        "beyond a covering subset; deselect with -m 'not slow' for the fast tier",
    )
    # under the interpreter the kernels are numpy: a NaN or an inf formed in a kernel (0 x inf, inf - inf, log 0, even
    # in a masked lane that a tl.where drops afterwards) warns there, and is an error here: the kernels form none,
    # one compiler change away from a wrong answer. A test that feeds non-finite values on purpose says so
    # (helpers.non_finite_inputs).
    if _kernel_device().type == "cpu":
        config.addinivalue_line("filterwarnings", "error::RuntimeWarning")
    # with -n, the tests of one file go to one worker (xdist's --dist loadfile), so a module's fixtures (a benchmark
    # run, the offline compiles, a trainer pair) are built once; an explicit --dist is kept. Set here rather than in
    # pyproject's addopts: an environment without pytest-xdist (verl's) would refuse the option.
    if getattr(config.option, "numprocesses", None) and getattr(config.option, "dist", "no") == "load":
        config.option.dist = "loadfile"


def _parameter_values(item):
    """The (parameter, value) facts a parametrized case covers."""
    facts = set()
    for name, value in item.callspec.params.items():
        if isinstance(value, dict):
            facts.update((name, key, repr(v)) for key, v in value.items())
            facts.add((name, "keys", tuple(sorted(map(str, value)))))
        elif isinstance(getattr(value, "id", None), str):
            facts.update((name, part) for part in value.id.split("-"))
        else:
            facts.add((name, repr(value)))
    return facts


def pytest_collection_modifyitems(config, items):
    if KERNEL_DEVICE.type == "cuda":
        compiled = pytest.mark.skip(
            reason="Triton kernels on CPU tensors need the interpreter (TRITON_INTERPRET=1); "
            "the kernels are compiled here"
        )
        for item in items:
            if item.get_closest_marker("interpreter_only") is not None:
                item.add_marker(compiled)
    families = {}
    for item in items:
        callspec = getattr(item, "callspec", None)
        if callspec is not None and callspec.params and item.get_closest_marker("slow") is None:
            families.setdefault((item.path, item.originalname), []).append(item)
    for cases in families.values():
        # greedy set cover: the case that adds the most facts not yet covered, the earliest on a tie
        facts = [_parameter_values(item) for item in cases]
        covered, kept = set(), set()
        while True:
            gain, best = max(((len(f - covered), -i) for i, f in enumerate(facts) if i not in kept), default=(0, 0))
            if gain == 0:
                break
            kept.add(-best)
            covered |= facts[-best]
        for i, item in enumerate(cases):
            if i not in kept:
                item.add_marker(pytest.mark.slow)
