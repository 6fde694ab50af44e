"""The benchmark's verl peer (bench/impls.py ``verl_torch``: verl's torch backend) where verl is importable: it is
available, and its loss, gradients and log-probs pass the benchmark's own checks against fp64 in fp32."""

import torch

from bench.impls import IMPLS
from bench.inputs import check_fwdbwd, check_logprobs, make_inputs, reference_fwdbwd


def test_verl_torch_peer_passes_the_bench_checks():
    impl = IMPLS["verl_torch"]
    assert impl.unavailable("cpu") is None
    x = make_inputs(D=24, V=203, B=3, T=17, dtype=torch.float32, device="cpu", scenario="padded")
    loss, _metrics = impl.build("fwdbwd", {})(x, x.weight)  # the loss and TRL's metrics, as every peer returns
    loss.backward()
    ok, errors = check_fwdbwd(
        loss.detach(), x.hidden.grad, x.weight.grad, reference_fwdbwd(x), torch.float32, frozen=False
    )
    assert ok, errors
    ok, errors = check_logprobs(impl.build("logprobs", {})(x, x.weight), x, torch.float32)
    assert ok, errors
