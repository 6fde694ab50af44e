"""The benchmark's batch and the correctness guard's reference.

The batch looks like a GRPO step's: B = 16 completions of T tokens, each with its own length (the mask ends
after it), one advantage per completion, and old / ref log-probs near the policy's (the true log-probs plus
noise of std 0.2, so that about a quarter of the ratios clip at epsilon 0.2 / 0.28 and the KL term is not
zero). Old / ref log-probs are computed here, outside any timed region.

The guard's reference is grpo_fast.reference (the eager spec, fp32 math) evaluated in row chunks, so it
exists at shapes where the eager implementation itself runs out of memory: the log-probs of a chunk of rows
do not depend on the other rows, and the loss's gradient is split at the log-probs (dL/dlogp from
reference.token_loss, then each chunk's logits are rebuilt and back-propagated with that coefficient). This
is the chain rule of the same formulas; it agrees with reference.loss to fp32 rounding.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from grpo_fast import reference

# the loss the benchmark measures: TRL's DAPO defaults with a KL term (beta 0.04) and clip-higher
LOSS_CONFIG = dict(beta=0.04, epsilon=0.2, epsilon_high=0.28, loss_type="dapo", importance_sampling_level="token",
                   temperature=1.0)
LOGIT_STD = 2.0          # std of the logits of the random lm_head on random hidden states
OLD_REF_NOISE = 0.2      # std of old/ref log-probs around the true log-probs
CHUNK_ELEMENTS = 1 << 28  # rows x V per chunk of the guard's reference (1 GiB of fp32 logits)


@dataclass
class Inputs:
    hidden: torch.Tensor         # [B, T, D] leaf, requires grad
    weight: torch.Tensor         # [V, D] leaf, requires grad
    weight_frozen: torch.Tensor  # the same storage, no grad (the LoRA case)
    targets: torch.Tensor        # [B, T] int64
    advantages: torch.Tensor     # [B] fp32
    mask: torch.Tensor           # [B, T] bool
    old_logprobs: torch.Tensor   # [B, T] fp32
    ref_logprobs: torch.Tensor   # [B, T] fp32
    true_logprobs: torch.Tensor  # [B, T] fp32, the reference's log-probs (the logprobs mode's expected output)
    num_items_in_batch: float    # completion tokens in the batch (TRL passes it; dapo normalises by it)
    B: int
    T: int
    D: int
    V: int

    @property
    def N(self):
        return self.B * self.T

    def loss_kwargs(self):
        """The loss configuration with this batch's num_items_in_batch (every implementation gets the same)."""
        return dict(LOSS_CONFIG, num_items_in_batch=self.num_items_in_batch)

    def reset_grads(self):
        self.hidden.grad = None
        self.weight.grad = None


@contextlib.contextmanager
def _reference_matmul_precision(dtype):
    """Inputs rounded to bf16 / fp16 are exact in TF32, so the guard's fp32 products may use TF32 units."""
    if dtype == torch.float32:
        yield
        return
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


def _rows_per_chunk(V):
    return max(1, CHUNK_ELEMENTS // V)


def reference_logprobs(hidden, weight, targets, temperature=1.0):
    """reference.logprobs in row chunks: [B, T] fp32, no grad."""
    B, T, D = hidden.shape
    h, t = hidden.detach().reshape(-1, D), targets.reshape(-1)
    rows = _rows_per_chunk(weight.shape[0])
    out = torch.empty(h.shape[0], dtype=torch.float32, device=h.device)
    with torch.no_grad(), _reference_matmul_precision(hidden.dtype):
        w = weight.detach().float()
        for r0 in range(0, h.shape[0], rows):
            out[r0:r0 + rows] = reference.logprobs(h[r0:r0 + rows], w, t[r0:r0 + rows], None, temperature)
    return out.view(B, T)


def make_inputs(D, V, B, T, dtype, device, seed=0):
    device = torch.device(device)
    g = torch.Generator(device=device).manual_seed(seed)
    hidden = torch.randn(B, T, D, generator=g, device=device).to(dtype).requires_grad_()
    weight = (torch.randn(V, D, generator=g, device=device) * (LOGIT_STD / D ** 0.5)).to(dtype).requires_grad_()
    targets = torch.randint(0, V, (B, T), generator=g, device=device)
    advantages = torch.randn(B, generator=g, device=device)
    lengths = torch.randint(max(1, T // 2), T + 1, (B,), generator=g, device=device)
    mask = torch.arange(T, device=device)[None, :] < lengths[:, None]
    true = reference_logprobs(hidden, weight, targets, LOSS_CONFIG["temperature"])
    old = true + OLD_REF_NOISE * torch.randn(B, T, generator=g, device=device)
    ref = true + OLD_REF_NOISE * torch.randn(B, T, generator=g, device=device)
    return Inputs(hidden=hidden, weight=weight, weight_frozen=weight.detach(), targets=targets,
                  advantages=advantages, mask=mask, old_logprobs=old, ref_logprobs=ref, true_logprobs=true,
                  num_items_in_batch=float(mask.sum()), B=B, T=T, D=D, V=V)


@dataclass
class Reference:
    loss: float
    grad_hidden: torch.Tensor  # [B, T, D] fp32, on the CPU (off the GPU, so that it takes no memory there)
    grad_weight: torch.Tensor  # [V, D] fp32, on the CPU
    grad_hidden_scale: float   # max |grad_hidden|
    grad_weight_scale: float


def reference_fwdbwd(x: Inputs) -> Reference:
    """Loss and gradients of grpo_fast.reference.loss on x, computed in row chunks (see the module's docstring)."""
    kw = x.loss_kwargs()
    temperature = kw.pop("temperature")
    N, D = x.N, x.D
    logp = x.true_logprobs.detach().clone().requires_grad_()
    loss, _ = reference.token_loss(logp, x.advantages, x.mask, old_logprobs=x.old_logprobs,
                                   ref_logprobs=x.ref_logprobs, **kw)
    (coef,) = torch.autograd.grad(loss, logp)
    h, t, c = x.hidden.detach().reshape(N, D), x.targets.reshape(N), coef.reshape(N)
    w32 = x.weight.detach().float().requires_grad_()
    grad_hidden = torch.empty(N, D, dtype=torch.float32, device=h.device)
    rows = _rows_per_chunk(x.V)
    with _reference_matmul_precision(x.hidden.dtype):
        for r0 in range(0, N, rows):
            hc = h[r0:r0 + rows].float().requires_grad_()
            lp = reference.logprobs_and_entropy(hc, w32, t[r0:r0 + rows], None, temperature)[0]
            (lp * c[r0:r0 + rows]).sum().backward()
            grad_hidden[r0:r0 + rows] = hc.grad
            del hc, lp
    return Reference(loss=float(loss.detach()), grad_hidden=grad_hidden.view(x.B, x.T, D).cpu(),
                     grad_weight=w32.grad.cpu(), grad_hidden_scale=float(grad_hidden.abs().max()),
                     grad_weight_scale=float(w32.grad.abs().max()))


# ----------------------------------------------------------------------------------------------- the guard
# Tolerances. Loss: |loss - ref| <= LOSS_ATOL + 1e-3 |ref|. Gradients: the largest error at most GRAD_RTOL of
# the largest reference entry (bf16 backward GEMMs round g = c (onehot - p) to bf16, see tests/test_gpu.py).
# Log-probs: the largest error at most LOGP_ATOL nats (an implementation that rounds the logits to bf16, as
# Liger's chunked matmul does, is off by up to a few 1e-2 nats on logits of magnitude ~10).
LOSS_RTOL = 1e-3
LOSS_ATOL = {torch.float32: 1e-5, torch.bfloat16: 1e-3, torch.float16: 5e-4}
GRAD_RTOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 5e-3}
LOGP_ATOL = {torch.float32: 1e-3, torch.bfloat16: 1e-1, torch.float16: 2e-2}


def _max_abs_diff(actual: torch.Tensor, expected_cpu: torch.Tensor, rows=4096) -> float:
    """max |actual - expected| with expected on the CPU, moved to actual's device a block of rows at a time."""
    a = actual.detach().reshape(-1, actual.shape[-1])
    e = expected_cpu.reshape(-1, expected_cpu.shape[-1])
    worst = 0.0
    for r0 in range(0, a.shape[0], rows):
        d = float((a[r0:r0 + rows].float() - e[r0:r0 + rows].to(a.device)).abs().max())
        if d != d:  # nan
            return d
        worst = max(worst, d)
    return worst


def _finite(x):
    return x == x and x not in (float("inf"), float("-inf"))


def check_fwdbwd(loss, grad_hidden, grad_weight, ref: Reference, dtype, frozen: bool):
    """(ok, errors) of one implementation's loss and gradients against the reference."""
    errors = {}
    loss = float(loss)
    errors["loss_abs_err"] = abs(loss - ref.loss) if _finite(loss) else float("nan")
    ok = _finite(loss) and errors["loss_abs_err"] <= LOSS_ATOL[dtype] + LOSS_RTOL * abs(ref.loss)
    pairs = [("grad_hidden", grad_hidden, ref.grad_hidden, ref.grad_hidden_scale)]
    if not frozen:
        pairs.append(("grad_weight", grad_weight, ref.grad_weight, ref.grad_weight_scale))
    for name, actual, expected, scale in pairs:
        if actual is None or tuple(actual.shape) != tuple(expected.shape):
            errors[f"{name}_max_abs_err"] = None
            errors[f"{name}_rel_err"] = None
            ok = False
            continue
        err = _max_abs_diff(actual, expected)
        errors[f"{name}_max_abs_err"] = err
        errors[f"{name}_rel_err"] = err / scale if scale > 0 else err
        ok = ok and _finite(err) and err <= GRAD_RTOL[dtype] * scale
    return ok, errors


def check_logprobs(logp, x: Inputs, dtype):
    if logp is None or tuple(logp.shape) != (x.B, x.T):
        return False, {"logprobs_max_abs_err": None}
    err = float((logp.detach().float() - x.true_logprobs).abs().max())
    return (_finite(err) and err <= LOGP_ATOL[dtype]), {"logprobs_max_abs_err": err}
