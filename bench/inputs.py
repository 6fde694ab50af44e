"""The benchmark's batches and the fp64 truth that checks every implementation and measures its precision.

A batch looks like a GRPO step's: B = 16 completions padded to T positions, one advantage per completion, and
old / ref log-probs near the policy's (the true log-probs plus noise of std 0.2, so that about a quarter of the
ratios clip at epsilon 0.2 / 0.28 and the KL term is not zero), computed here, outside any timed region. No
token's log-ratio lies within CLIP_MARGIN of a clipping boundary (log 0.8, log 1.28): an implementation whose
log-probs are within the guard's tolerance of the truth (logits rounded to bf16 are off by ~0.02 nat) then clips
the same tokens as the truth, and its gradients differ from the truth's by its rounding, not by tokens switched
between clipped (no gradient) and not. Two scenarios share B and T:
  dense:   every completion is T tokens long (the mask is all ones): the lm_head's work at N = B T tokens.
  padded:  the completions' lengths are GSM8K solutions' (bench/completion_lengths.py), the longest filling the
           T positions; the mask ends after each, so only a fraction of the B T positions are completion tokens.

The truth is grpo_fast.reference (the eager spec) in fp64, evaluated in row chunks on the completion tokens
only, so it exists at shapes where the eager implementation runs out of memory: the log-probs of a chunk of
rows do not depend on the other rows, and the loss's gradient is split at the log-probs (dL/dlogp from
reference.token_loss, then each chunk's logits are rebuilt in fp64 and back-propagated with that coefficient).
Its errors are the precision columns of the results; the guard's tolerances on the same errors decide `wrong`.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from bench import completion_lengths
from grpo_fast import reference
from grpo_fast.grpo_loss.options import LossOptions

# The loss the benchmark measures, passed to every implementation: TRL 1.16's GRPOConfig defaults (DAPO, token
# level, temperature 1, the k3 KL multiplied by the importance ratio: use_bias_correction_kl) with a KL term
# (beta 0.04) and clip-higher (epsilon_high 0.28). Liger-Kernel 0.8.5 takes every one of these arguments.
LOSS_OPTIONS = LossOptions(
    beta=0.04,
    epsilon=0.2,
    epsilon_high=0.28,
    loss_type="dapo",
    importance_sampling_level="token",
    use_bias_correction_kl=True,
)
TEMPERATURE = 1.0  # the logits' (layer 1's), not a loss option
LOSS_CONFIG = dict(dataclasses.asdict(LOSS_OPTIONS), temperature=TEMPERATURE)  # for the results' metadata
SCENARIOS = ("dense", "padded")
LOGIT_STD = 2.0  # std of the logits of the random lm_head on random hidden states
OLD_REF_NOISE = 0.2  # std of old/ref log-probs around the true log-probs
CLIP_MARGIN = 0.1  # nats from any token's log-ratio to a clipping boundary (the guard's bf16 log-prob tolerance)
CHUNK_ELEMENTS = 1 << 27  # rows x V per chunk of the fp64 truth (1 GiB of fp64 logits)


@dataclass
class Inputs:
    hidden: torch.Tensor  # [B, T, D] leaf, requires grad
    weight: torch.Tensor  # [V, D] leaf, requires grad
    weight_frozen: torch.Tensor  # the same storage, no grad (the LoRA case)
    targets: torch.Tensor  # [B, T] int64
    advantages: torch.Tensor  # [B] fp32
    mask: torch.Tensor  # [B, T] bool, the completion mask
    old_logprobs: torch.Tensor  # [B, T] fp32
    ref_logprobs: torch.Tensor  # [B, T] fp32
    true_logprobs: torch.Tensor  # [B, T] fp64, the truth on the completion tokens (0 elsewhere)
    num_items_in_batch: float  # completion tokens in the batch (TRL passes it; dapo normalises by it)
    scenario: str  # "dense" or "padded"
    B: int
    T: int
    D: int
    V: int

    @property
    def N(self):
        """Positions B x T, padding included."""
        return self.B * self.T

    @property
    def active_tokens(self):
        """Completion tokens: the positions with mask 1, the work an lm_head pass needs."""
        return int(self.num_items_in_batch)

    # every implementation gets the same loss: these options, this temperature, this batch's num_items_in_batch
    options = LOSS_OPTIONS
    temperature = TEMPERATURE

    def logprob_keywords(self):
        """The per-token inputs every loss takes by keyword: the old and reference log-probs, num_items_in_batch."""
        return dict(
            old_logprobs=self.old_logprobs, ref_logprobs=self.ref_logprobs, num_items_in_batch=self.num_items_in_batch
        )

    def reset_grads(self):
        self.hidden.grad = None
        self.weight.grad = None


def _active_row_chunks(mask, V):
    """The flat indices of the completion tokens, in chunks of at most CHUNK_ELEMENTS / V rows."""
    rows = mask.reshape(-1).nonzero().squeeze(1)
    return rows.split(max(1, CHUNK_ELEMENTS // V))


def _fp64_logprobs(hidden_rows, weight64, targets_rows, temperature):
    """The spec's logits (reference.logits) in fp64, then their log-softmax at the targets: [n] fp64."""
    z = reference.logits(hidden_rows, weight64, None, temperature, compute_dtype=torch.float64)
    return torch.log_softmax(z, dim=-1).gather(-1, targets_rows.unsqueeze(-1)).squeeze(-1)


def true_logprobs(hidden, weight, targets, mask, temperature=1.0):
    """The fp64 log-probs of the targets on the completion tokens, 0 elsewhere: [B, T] fp64, no grad."""
    D = hidden.shape[-1]
    h, t = hidden.detach().reshape(-1, D), targets.reshape(-1)
    out = torch.zeros(h.shape[0], dtype=torch.float64, device=h.device)
    with torch.no_grad():
        w64 = weight.detach().double()
        for rows in _active_row_chunks(mask, weight.shape[0]):
            out[rows] = _fp64_logprobs(h[rows], w64, t[rows], temperature)
    return out.view(targets.shape)


def completion_lengths_of(scenario, B, T, seed=0) -> torch.Tensor:
    """The B completions' lengths [B] int64 (CPU; the same on every device) of a scenario's batch of T positions."""
    if scenario == "dense":
        return torch.full((B,), T, dtype=torch.int64)
    if scenario == "padded":
        return completion_lengths.sample(B, T, seed)
    raise ValueError(f"unknown scenario {scenario!r}: choose from {', '.join(SCENARIOS)}")


def away_from_clip_boundaries(log_ratio):
    """Log-ratios (logp - old) within CLIP_MARGIN of log(1 - epsilon) or log(1 + epsilon_high) moved out to the
    nearer edge of that band."""
    for boundary in (math.log(1 - LOSS_OPTIONS.epsilon), math.log(1 + LOSS_OPTIONS.clip_high)):
        offset = log_ratio - boundary
        edge = boundary + torch.where(offset < 0, -CLIP_MARGIN, CLIP_MARGIN)
        log_ratio = torch.where(offset.abs() < CLIP_MARGIN, edge, log_ratio)
    return log_ratio


def make_inputs(D, V, B, T, dtype, device, seed=0, scenario="dense"):
    device = torch.device(device)
    g = torch.Generator(device=device).manual_seed(seed)
    hidden = torch.randn(B, T, D, generator=g, device=device).to(dtype).requires_grad_()
    weight = (torch.randn(V, D, generator=g, device=device) * (LOGIT_STD / D**0.5)).to(dtype).requires_grad_()
    targets = torch.randint(0, V, (B, T), generator=g, device=device)
    advantages = torch.randn(B, generator=g, device=device)
    lengths = completion_lengths_of(scenario, B, T, seed).to(device)
    mask = torch.arange(T, device=device)[None, :] < lengths[:, None]
    true = true_logprobs(hidden, weight, targets, mask, TEMPERATURE)
    old = true.float() - away_from_clip_boundaries(OLD_REF_NOISE * torch.randn(B, T, generator=g, device=device))
    ref = true.float() + OLD_REF_NOISE * torch.randn(B, T, generator=g, device=device)
    return Inputs(
        hidden=hidden,
        weight=weight,
        weight_frozen=weight.detach(),
        targets=targets,
        advantages=advantages,
        mask=mask,
        old_logprobs=old,
        ref_logprobs=ref,
        true_logprobs=true,
        num_items_in_batch=float(mask.sum()),
        scenario=scenario,
        B=B,
        T=T,
        D=D,
        V=V,
    )


@dataclass
class Reference:
    loss: float
    grad_hidden: torch.Tensor  # [B, T, D] fp64, on the CPU (off the GPU, so that it takes no memory there)
    grad_weight: torch.Tensor  # [V, D] fp64, on the CPU
    grad_hidden_scale: float  # max |grad_hidden|
    grad_weight_scale: float


def reference_fwdbwd(x: Inputs) -> Reference:
    """Loss and gradients of grpo_fast.reference.loss on x, the logits in fp64, computed in row chunks (see the
    module's docstring). reference.token_loss computes in fp32: the coefficient dL/dlogp is exact to 1e-7
    relative, below every error the benchmark reports."""
    temperature = x.temperature
    D = x.D
    logp = x.true_logprobs.float().requires_grad_()
    loss, _ = reference.token_loss(logp, x.advantages, x.mask, x.options, **x.logprob_keywords())
    (coef,) = torch.autograd.grad(loss, logp)
    h, t, c = x.hidden.detach().reshape(-1, D), x.targets.reshape(-1), coef.double().reshape(-1)
    w64 = x.weight.detach().double().requires_grad_()
    grad_hidden = torch.zeros(x.N, D, dtype=torch.float64, device=h.device)
    for rows in _active_row_chunks(x.mask, x.V):
        hc = h[rows].double().requires_grad_()
        (_fp64_logprobs(hc, w64, t[rows], temperature) * c[rows]).sum().backward()
        grad_hidden[rows] = hc.grad
        del hc
    grad_weight = w64.grad if w64.grad is not None else torch.zeros_like(w64)  # no completion token: no gradient
    return Reference(
        loss=float(loss.detach()),
        grad_hidden=grad_hidden.view(x.B, x.T, D).cpu(),
        grad_weight=grad_weight.cpu(),
        grad_hidden_scale=float(grad_hidden.abs().max()),
        grad_weight_scale=float(grad_weight.abs().max()),
    )


# ----------------------------------------------------------------------------------------------- the guard
# Tolerances, on the errors against the fp64 truth; they catch a wrong loss or a missing term, not the rounding of
# the input dtype. Loss: |loss - ref| <= LOSS_ATOL + 1e-3 |ref|. Gradients: the largest error at most GRAD_RTOL of
# the largest reference entry: bf16 backward GEMMs round g = c (onehot - p) to bf16 (see tests/test_gpu.py), and an
# implementation that rounds the logits to bf16, as eager, TRL's head and Liger do, is off by up to half a bf16
# ulp of the logit (~0.03 nat at |z| ~ 10), which moves a token's ratio and p, and its gradient, by up to ~3%.
# Log-probs, on the completion tokens: the largest error at most LOGP_ATOL nats (those bf16 logits: a few 1e-2).
LOSS_RTOL = 1e-3
LOSS_ATOL = {torch.float32: 1e-5, torch.bfloat16: 1e-3, torch.float16: 5e-4}
GRAD_RTOL = {torch.float32: 1e-4, torch.bfloat16: 5e-2, torch.float16: 1e-2}
LOGP_ATOL = {torch.float32: 1e-3, torch.bfloat16: 1e-1, torch.float16: 2e-2}


def _max_abs_diff(actual: torch.Tensor, expected_cpu: torch.Tensor, rows=4096) -> float:
    """max |actual - expected| with expected on the CPU, moved to actual's device a block of rows at a time."""
    a = actual.detach().reshape(-1, actual.shape[-1])
    e = expected_cpu.reshape(-1, expected_cpu.shape[-1])
    worst = 0.0
    for r0 in range(0, a.shape[0], rows):
        d = float((a[r0 : r0 + rows].float() - e[r0 : r0 + rows].to(a.device)).abs().max())
        if d != d:  # nan
            return d
        worst = max(worst, d)
    return worst


def _finite(x):
    return x == x and x not in (float("inf"), float("-inf"))


def check_fwdbwd(loss, grad_hidden, grad_weight, ref: Reference, dtype, frozen: bool):
    """(ok, errors) of one implementation's loss and gradients against the fp64 reference."""
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
    """(ok, errors) of one implementation's log-probs against the truth, on the completion tokens (an
    implementation that skips padding leaves zeros there)."""
    if logp is None or tuple(logp.shape) != (x.B, x.T):
        return False, {"logprobs_max_abs_err": None}
    err = float((logp.detach().double() - x.true_logprobs)[x.mask].abs().max())
    return (_finite(err) and err <= LOGP_ATOL[dtype]), {"logprobs_max_abs_err": err}
