"""Tests run the Triton kernels on CPU through Triton's interpreter; it must be on before triton.jit runs."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

# Gradient tolerances against the fp64 reference. fp32: the rounding of another summation order, per element.
# bf16 / fp16: the backward feeds the GEMMs with g = c (onehot - p) / tau rounded to the input dtype
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


# ----------------------------------------------------------------------------------------------- the fast tier
# `pytest -m "not slow"` is the inner loop (1.5 min on 2 quiet cores, 8 min 30 s on 2 busy ones: README's figures);
# `pytest` runs everything (README, CI).
# Slow are: the tests marked @pytest.mark.slow (whole training runs, TRL trainer comparisons, several processes,
# the benchmark end to end, the offline GPU compiles), and, of each parametrized test, the cases beyond a covering
# subset: the fast tier keeps, in collection order, the fewest cases in which every value of every parameter
# appears at least once (a dict parameter: every key=value; a parameter with an ``id``: every "-"-separated part
# of it), so every backend, dtype, loss type, level and option still runs at small size.


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "slow: whole-training, multi-process, benchmark and compile runs, and the parametrized cases "
                   "beyond a covering subset; deselect with -m 'not slow' for the fast tier")


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
            gain, best = max(((len(f - covered), -i) for i, f in enumerate(facts) if i not in kept),
                             default=(0, 0))
            if gain == 0:
                break
            kept.add(-best)
            covered |= facts[-best]
        for i, item in enumerate(cases):
            if i not in kept:
                item.add_marker(pytest.mark.slow)
