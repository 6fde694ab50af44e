"""Shared builders for the loss tests: random GRPO batches with odd shapes."""

import contextlib
import os
import pathlib
import socket
import subprocess
import sys
import time
import warnings

import interpreter_calls
import pytest
import torch

import grpo_fast
from grpo_fast import reference

interpreter_calls.install()  # in a rank spawn_ranks starts too (conftest installs it in the session)


@contextlib.contextmanager
def non_finite_inputs():
    """A block that feeds the kernels non-finite values on purpose (a NaN or an inf at a scored token): the
    interpreter's numpy warns on what it is handed there, which conftest otherwise makes an error (a kernel forms no
    NaN of its own)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        yield


def head_inputs(B, T, D, V, dtype=torch.float32, scale=0.3, bias=True, seed=0, generator=None, device="cpu"):
    """(hidden [B, T, D], lm_head weight [V, D] times ``scale``, bias [V] or None, targets [B, T]) in ``dtype``
    (targets int64) on ``device``, drawn on CPU from ``generator`` (default: a fresh one seeded with ``seed``): the
    same numbers on every device."""
    g = torch.Generator().manual_seed(seed) if generator is None else generator
    hidden = torch.randn(B, T, D, generator=g).to(device, dtype)
    weight = (torch.randn(V, D, generator=g) * scale).to(device, dtype)
    b = (torch.randn(V, generator=g) * 0.5).to(device, dtype) if bias else None
    targets = torch.randint(0, V, (B, T), generator=g).to(device)
    return hidden, weight, b, targets


def randn(*shape, generator, device="cpu"):
    """torch.randn drawn on CPU from ``generator`` (the same numbers on every device), on ``device``."""
    return torch.randn(*shape, generator=generator).to(device)


def make_batch(
    B=3, T=7, D=37, V=203, dtype=torch.float32, bias=False, logit_scale=0.3, masked_row=True, seed=0, device="cpu"
):
    """Hidden states, lm_head, targets (``head_inputs``), then advantages, a mask with a fully masked sequence and
    old / reference log-probs near the true ones, from the same generator (CPU), on ``device``."""
    g = torch.Generator().manual_seed(seed)
    hidden, weight, b, targets = head_inputs(B, T, D, V, dtype, logit_scale, bias, generator=g, device=device)
    mask = (torch.rand(B, T, generator=g) > 0.3).to(device)
    mask[0, 0] = True
    if masked_row and B > 1:
        mask[1] = False
    advantages = randn(B, generator=g, device=device)
    true_logp = reference.logprobs(hidden, weight, targets, b)
    old = true_logp + 0.3 * randn(B, T, generator=g, device=device)
    ref = true_logp + 0.3 * randn(B, T, generator=g, device=device)
    return dict(
        hidden=hidden,
        weight=weight,
        bias=b,
        targets=targets,
        mask=mask,
        advantages=advantages,
        old=old,
        ref=ref,
        generator=g,
    )


def run_loss(fn, batch, requires=("hidden", "weight", "bias"), **kwargs):
    """Loss, metrics and gradients of fn (reference.loss or grpo_fast.loss) on fresh leaf copies of the inputs."""
    leaves = {}
    for name in ("hidden", "weight", "bias"):
        x = batch[name]
        if x is not None:
            x = x.detach().clone().requires_grad_(name in requires)
        leaves[name] = x
    advantages = kwargs.pop("advantages", batch["advantages"])
    loss, metrics = fn(
        leaves["hidden"], leaves["weight"], batch["targets"], advantages, batch["mask"], bias=leaves["bias"], **kwargs
    )
    loss.backward()
    grads = {n: (x.grad if x is not None else None) for n, x in leaves.items()}
    return loss.detach(), {k: v for k, v in metrics.items()}, grads


def assert_close_to_scale(actual, expected, rtol, name=""):
    """max |actual - expected| <= rtol * max |expected|: two computations of one quantity whose sums run in another
    order (another chunking, row selection, GEMM, fused or not; another CPU) agree to the rounding of the quantity's
    scale. An entry that cancels to near zero (a gradient, a divergence) keeps an error of that scale, not a
    fraction of itself, so an element-wise rtol on it fails on other machines."""
    what = f"{name}: {actual.dtype} {tuple(actual.shape)} vs {expected.dtype} {tuple(expected.shape)}"
    assert actual.shape == expected.shape and actual.dtype == expected.dtype, what
    a, e = actual.detach().cpu().double(), expected.detach().cpu().double()
    err, scale = (a - e).abs().max().item(), e.abs().max().item()
    assert err <= rtol * scale, f"{name}: max error {err:.3g} vs {rtol:g} x max |expected| {scale:.3g}"


def matmul_flops(fn):
    """The matmul FLOPs torch counts while fn() runs (FlopCounterMode; grpo_fast's CPU paths use out= GEMMs, which
    it counts, never in-place addmm_, which it does not)."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


@contextlib.contextmanager
def head_calls_recorded():
    """Within: each call of grpo_fast.logprobs_and_entropy (what the TRL and verl heads call) appends (type name,
    shape) of the weight it was given to the yielded list: the distributed tests check how a sharded head arrives."""
    import grpo_fast

    seen = []
    real = grpo_fast.logprobs_and_entropy

    def spy(hidden, weight, targets, **kwargs):
        seen.append((type(weight).__name__, tuple(weight.shape)))
        return real(hidden, weight, targets, **kwargs)

    grpo_fast.logprobs_and_entropy = spy
    try:
        yield seen
    finally:
        grpo_fast.logprobs_and_entropy = real


# ------------------------------------------------------------------------------- several processes (gloo, CPU)
def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _then_exit(rank, fn, *args):
    """``fn(rank, *args)``, then the process ends at once (``os._exit(0)``) once it returned: a rank's results are
    written by then, and the interpreter's teardown of gloo's and DeepSpeed's C++ threads could abort the process
    after its work ("terminate called without an active exception", SIGABRT) and fail a run that succeeded. An
    exception still propagates (torch reports it to the parent)."""
    fn(rank, *args)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn_ranks(fn, world, out_dir, timeout, *args):
    """``fn(rank, port, out_dir, *args)`` on ``world`` spawned ranks (TRITON_INTERPRET and sys.path reach the children
    from this process); a rank's exception is raised here, a run past ``timeout`` seconds is killed and fails the
    test."""
    import torch.multiprocessing as mp

    ranks = mp.start_processes(
        _then_exit, args=(fn, free_port(), out_dir) + args, nprocs=world, start_method="spawn", join=False
    )
    deadline = time.monotonic() + timeout
    while not ranks.join(timeout=5):  # re-raises a rank's exception
        if time.monotonic() > deadline:
            for process in ranks.processes:
                process.kill()
            pytest.fail(f"the {world}-process run did not finish in {timeout} s")


@contextlib.contextmanager
def gloo_group(rank, world, port):
    """Within: the default process group of ``world`` ranks on loopback, gloo."""
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def dtensors_never_gathered(what):
    """Within: DTensor.full_tensor raises (``what`` names the head that must not gather its DTensor weight)."""
    from torch.distributed.tensor import DTensor

    real = DTensor.full_tensor

    def gathered(self, *args, **kwargs):
        raise AssertionError(f"{what} gathered a DTensor")

    DTensor.full_tensor = gathered
    try:
        yield
    finally:
        DTensor.full_tensor = real


def parser_actions(parse_args, argv):
    """{dest: argparse action} of the parser a command's ``parse_args(argv)`` builds, caught as it parses."""
    import argparse

    captured = {}
    real = argparse.ArgumentParser.parse_args

    def grab(self, args=None, namespace=None):
        captured["actions"] = self._actions
        return real(self, args, namespace)

    argparse.ArgumentParser.parse_args = grab
    try:
        parse_args(argv)
    finally:
        argparse.ArgumentParser.parse_args = real
    return {action.dest: action for action in captured["actions"]}


def out_of_range_cases(ranges, actions):
    """For each numeric flag of ``ranges`` ({dest: gsm8k.cli.Range}), the values its range refuses just
    outside each end (and "nan" for a float flag): (dest, argv, the error's text after "error: ") as
    ``cli.check_numbers`` words it, with the range as ``Range.describe`` words it (its wording: test_cli_wording)."""
    for dest, accepted in ranges.items():
        integer = actions[dest].type is int
        step = 1 if integer else 0.5
        values = [] if integer else [float("nan")]
        if accepted.low is not None:
            low = accepted.low if accepted.low_open else accepted.low - step
            while low in accepted.also:
                low -= step
            values.append(low)
        if accepted.high is not None:
            values.append(accepted.high if accepted.high_open else accepted.high + step)
        flag = "--" + dest.replace("_", "-")
        for value in values:
            text = str(value) if integer else f"{value:g}"
            yield dest, [flag, text], f"{flag} {text}: expected {accepted.describe(integer)}"


def mypy_errors(tmp_path, source):
    """mypy's errors over ``source`` as a module of its own, each 'error: message  [code]', and the run."""
    caller = tmp_path / "caller.py"
    caller.write_text(source)
    options = ["--follow-imports=silent", "--ignore-missing-imports", "--no-error-summary"]
    # run from the folder that holds the package, so that an editable install (an import hook mypy does not follow)
    # is found as source; a regular install is found through its py.typed
    result = subprocess.run(
        [sys.executable, "-m", "mypy", *options, "--cache-dir", str(tmp_path / "cache"), str(caller)],
        cwd=pathlib.Path(grpo_fast.__file__).parents[1],
        capture_output=True,
        text=True,
    )
    return [line.split(": ", 1)[1] for line in result.stdout.splitlines() if ": error: " in line], result


def tiny_generator_config():
    """A tied 2-layer Qwen2Config of width 32 over the byte tokenizer's vocabulary (its EOS and padding ids, no BOS),
    for tests that generate."""
    from gsm8k.tokenizer import byte_tokenizer
    from transformers import Qwen2Config

    tok = byte_tokenizer()
    shape = dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
    )
    special = dict(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None)
    return Qwen2Config(vocab_size=len(tok), tie_word_embeddings=True, max_position_embeddings=512, **shape, **special)


def run_suite_in_environment(python, folder, request, timeout, *extra):
    """pytest on ``folder`` (relative to the checkout) in another environment's ``python``, with this session's ``-m``
    expression (``pytest`` runs them all, ``pytest -m "not slow"`` their fast tier); fails with its output unless it
    passed."""
    import re

    root = pathlib.Path(__file__).resolve().parent.parent
    command = [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-W", "ignore::UserWarning", *extra, folder]
    markexpr = request.config.getoption("markexpr")
    if markexpr:
        command += ["-m", markexpr]
    run = subprocess.run(command, cwd=root, capture_output=True, text=True, timeout=timeout)
    summary = run.stdout.strip().splitlines()[-1] if run.stdout.strip() else ""
    print(f"{python}: {summary}")
    sys.stdout.flush()
    assert run.returncode == 0, f"{folder} failed in {python}:\n{run.stdout[-12000:]}\n{run.stderr[-4000:]}"
    assert re.search(r"\d+ passed", summary) and "failed" not in summary, summary
