"""verl's kernel test (tests/utils/test_linear_cross_entropy.py in verl's repository: CUDA only) adapted to a CPU, at
real vocabularies: bf16 hidden states and lm_head drawn uniform in [-0.5, 0.5], temperature 1.5, random upstream
gradients for the log-probs and the entropies. grpo_fast's head (its CPU path) and verl's torch backend
(FusedLinearForPPO, what impl_backend=torch runs, on the same bf16 inputs) against an fp64 truth, with verl's own
tolerances beside ours. The truth is computed in vocabulary chunks (an fp64 copy of a 151936 x 896 head is 1 GB)."""

import pytest
import torch
from verl.utils.experimental.torch_functional import FusedLinearForPPO

import grpo_fast

TEMPERATURE = 1.5
TOKENS = 48
# (hidden size, vocabulary): Qwen2.5-0.5B's head (verl's case 1), DeepSeek-Coder's 32256 (case 2), and 129920, a
# vocabulary that is not a multiple of 256
SHAPES = [(896, 151936), (2048, 32256), (1024, 129920)]
# verl's tolerances in that test (atol, rtol): log-probs, entropy, gradients
VERL_TOL = {"log_probs": (1e-3, 2e-4), "entropy": (5e-3, 5e-4), "grad": (2e-2, 4e-2)}
# ours: grpo_fast accumulates in fp32 from bf16 inputs (products exact): per token 1e-4 nat is generous; its CPU
# path's gradients are rounded to bf16 once (tests/conftest.py's bound, relative to the largest entry)
OURS_ATOL, OURS_GRAD_RTOL = 1e-4, 1e-2
CHUNK = 16384


def inputs(D, V, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.empty(TOKENS, D).uniform_(-0.5, 0.5, generator=g).bfloat16()
    weight = torch.empty(V, D).uniform_(-0.5, 0.5, generator=g).bfloat16()
    labels = torch.randint(0, V, (TOKENS,), generator=g)
    g_entropy = torch.empty(TOKENS).uniform_(-0.5, 0.5, generator=g).bfloat16()
    g_logp = torch.empty(TOKENS).uniform_(-1, 1, generator=g).bfloat16()
    return hidden, weight, labels, g_logp.double(), g_entropy.double()


def truth(hidden, weight, labels, g_logp, g_entropy):
    """fp64 log-probs, entropies, dH and dW (the last as a function of a row range, to compare chunk by chunk)."""
    h = hidden.double()
    logits = torch.cat([h @ weight[i : i + CHUNK].double().T for i in range(0, weight.shape[0], CHUNK)], 1)
    logits /= TEMPERATURE
    logp_all = logits.log_softmax(-1)
    p = logp_all.exp()
    entropy = -(p * logp_all).sum(-1)
    logp = logp_all.gather(-1, labels[:, None])[:, 0]
    # d/dz of sum(g_logp * logp + g_entropy * entropy), then through z = h W^T / temperature
    dz = g_logp[:, None] * (-p)
    dz[torch.arange(TOKENS), labels] += g_logp
    dz -= g_entropy[:, None] * p * (logp_all + entropy[:, None])
    dz /= TEMPERATURE
    dh = sum(dz[:, i : i + CHUNK] @ weight[i : i + CHUNK].double() for i in range(0, weight.shape[0], CHUNK))
    return logp, entropy, dh, lambda i: dz[:, i : i + CHUNK].T @ h


def run(fn, hidden, weight, labels, g_logp, g_entropy):
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    logp, entropy = fn(h, w, labels)
    (logp.double() * g_logp + entropy.double() * g_entropy).sum().backward()
    return logp.detach().double(), entropy.detach().double(), h.grad.double(), w.grad


def ours(h, w, labels):
    logp, entropy = grpo_fast.logprobs_and_entropy(
        h[None], w, labels[None], temperature=TEMPERATURE, entropy_grad=True, backend="torch"
    )
    return logp[0], entropy[0]


def verl_torch(h, w, labels):
    return FusedLinearForPPO()(h, w, labels, temperature=TEMPERATURE)


def errors(result, expected):
    """max |error| of log-probs and entropies; max |error| / max |truth| of dH and dW (dW chunk by chunk)."""
    logp, entropy, dh, dw = result
    t_logp, t_entropy, t_dh, t_dw = expected
    dw_err = dw_scale = 0.0
    for i in range(0, dw.shape[0], CHUNK):
        chunk = t_dw(i)
        dw_err = max(dw_err, (dw[i : i + CHUNK].double() - chunk).abs().max().item())
        dw_scale = max(dw_scale, chunk.abs().max().item())
    return dict(
        log_probs=(logp - t_logp).abs().max().item(),
        entropy=(entropy - t_entropy).abs().max().item(),
        dh=(dh - t_dh).abs().max().item() / t_dh.abs().max().item(),
        dw=dw_err / dw_scale,
    )


def within_verl_tolerance(result, expected):
    """verl's assert_close tolerances, elementwise: |error| <= atol + rtol |truth|."""
    logp, entropy, dh, _ = result
    t_logp, t_entropy, t_dh, _ = expected
    return all(
        bool(((a - b).abs() <= VERL_TOL[k][0] + VERL_TOL[k][1] * b.abs()).all())
        for k, a, b in (("log_probs", logp, t_logp), ("entropy", entropy, t_entropy), ("grad", dh, t_dh))
    )


@pytest.mark.slow
@pytest.mark.parametrize("D, V", SHAPES, ids=[f"{d}x{v}" for d, v in SHAPES])
def test_head_at_real_vocabularies(D, V):
    data = inputs(D, V)
    expected = truth(*data)
    grpo = run(ours, *data)
    peer = run(verl_torch, *data)
    ours_err, peer_err = errors(grpo, expected), errors(peer, expected)
    print(f"D {D} V {V}: grpo_fast {ours_err}; verl's torch backend {peer_err}")
    assert within_verl_tolerance(grpo, expected)
    assert ours_err["log_probs"] <= OURS_ATOL and ours_err["entropy"] <= OURS_ATOL, ours_err
    assert ours_err["dh"] <= OURS_GRAD_RTOL and ours_err["dw"] <= OURS_GRAD_RTOL, ours_err
    # what verl's torch backend does with the same bf16 inputs: its logits are rounded to bf16
    assert peer_err["log_probs"] > 10 * ours_err["log_probs"], (peer_err, ours_err)
