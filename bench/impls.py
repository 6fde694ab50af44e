"""The implementations the benchmark compares, in a registry that tests (and users) can extend.

An Impl builds, for a mode, a function of (inputs, weight):
  mode "fwdbwd":   returns the loss (a differentiable scalar, or a tuple whose first item is); the runner calls
                   backward on it, so the timed region is forward + backward (gradients of hidden and weight).
  mode "logprobs": returns the per-token log-probs [B, T] of the targets, without autograd (only the completion
                   tokens' are checked: an implementation that skips the padding may leave anything there).
  mode "sampler":  the same on the sampler mode's batch (bench/sampler.py: drawable targets, replayed kept sets),
                   or a grpo_fast.SamplerLogprobs (the sampler_logprobs rows).
  mode "sampler_fwdbwd": that batch's loss sum c logp (+ d support_logp for the sampler_logprobs rows).
``weight`` is inputs.weight (requires grad) or, for a frozen Impl, inputs.weight_frozen (the same storage, no
grad: the LoRA case, no dW). Every implementation gets the same batch, completion mask (inputs.mask) and loss
configuration (inputs.options, .temperature, .num_items_in_batch); those that can skip the padding are given the
mask to do so, eager PyTorch computes every position as a plain training step does.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

import grpo_fast
from bench import sampler
from grpo_fast import reference

MODES = ("fwdbwd", "logprobs")
# the sampler mode's (bench/sampler.py): no-grad (the old policy's pass) and forward + backward, on its own batch
SAMPLER_MODES = sampler.SAMPLER_MODES


@dataclass
class Impl:
    name: str
    label: str
    build: Callable  # build(mode, options) -> fn(inputs, weight)
    modes: tuple = MODES
    frozen: bool = False
    unavailable: Callable = field(default=lambda device: None)  # unavailable(device) -> reason or None
    note: str = ""
    # head(mode, inputs, options) -> the name of the head it runs there (a HEAD_SWEEPS key), or None where the bench
    # does not know its sweeps (its TFLOP/s then count the floor, ``flops``)
    head: Callable | None = None


IMPLS: dict[str, Impl] = {}


def register(impl: Impl) -> Impl:
    IMPLS[impl.name] = impl
    return impl


def register_with_frozen(name, label, frozen_label, build, unavailable, note=""):
    """A peer's head and its frozen twin ``<name>_frozen`` (the lm_head frozen, LoRA's case: fwd+bwd only)."""
    register(Impl(name, label, build, unavailable=unavailable, note=note))
    register(Impl(f"{name}_frozen", frozen_label, build, modes=("fwdbwd",), frozen=True, unavailable=unavailable))


# ----------------------------------------------------------------------------------------------- eager
# The eager baseline computes the logits as a training step does: the lm_head matmul in the input dtype (bf16 on
# tensor cores), then fp32 for the log-softmax (grpo_fast.reference with fp32_matmul=False).
def _eager_loss(hidden, weight, targets, advantages, mask, old, ref, options, temperature, num_items_in_batch):
    return reference.loss(
        hidden,
        weight,
        targets,
        advantages,
        mask,
        options,
        old_logprobs=old,
        ref_logprobs=ref,
        temperature=temperature,
        num_items_in_batch=num_items_in_batch,
        fp32_matmul=False,
    )


def _eager_logprobs(hidden, weight, targets, bias, temperature):
    return reference.logprobs(hidden, weight, targets, bias, temperature, fp32_matmul=False)


def _eager_arguments(mode, x, w):
    """``_eager_loss``'s arguments (mode "fwdbwd") or ``_eager_logprobs``' from a bench input and the weight."""
    if mode == "fwdbwd":
        labels = (x.targets, x.advantages, x.mask, x.old_logprobs, x.ref_logprobs)
        return (x.hidden, w, *labels, x.options, x.temperature, x.num_items_in_batch)
    return (x.hidden, w, x.targets, None, x.temperature)


def _build_eager(mode, options):
    fn = _eager_loss if mode == "fwdbwd" else _eager_logprobs
    return lambda x, w: fn(*_eager_arguments(mode, x, w))


register(
    Impl(
        "eager",
        "eager PyTorch (grpo_fast.reference: full logits of every position, matmul in the input dtype)",
        _build_eager,
    )
)


def _completion_head_impl(mode, completion_outputs):
    """A bench function of (inputs x, weight w) from a peer's head over the completion tokens,
    ``completion_outputs(x, w, with_entropy)`` -> (logp, entropy or None) [B, T]: the log-probs without autograd
    (mode "logprobs"), else TRL's GRPO loss on them (``reference.token_loss``)."""
    if mode == "logprobs":

        def logprobs(x, w):
            with torch.no_grad():
                return completion_outputs(x, w, False)[0]

        return logprobs

    def loss(x, w):
        logp, entropy = completion_outputs(x, w, True)
        return reference.token_loss(logp, x.advantages, x.mask, x.options, entropy=entropy, **x.logprob_keywords())

    return loss


# ----------------------------------------------------------------------------------------------- torch.compile
_COMPILED = {}


def _raise_recompile_limit(limit=64):
    import torch._dynamo.config as dynamo_config

    for name in ("recompile_limit", "cache_size_limit"):  # the name changed across torch versions
        if hasattr(dynamo_config, name):
            setattr(dynamo_config, name, max(limit, getattr(dynamo_config, name)))


def _build_compile(mode, options):
    _raise_recompile_limit()
    if mode not in _COMPILED:
        _COMPILED[mode] = torch.compile(_eager_loss if mode == "fwdbwd" else _eager_logprobs)
    fn = _COMPILED[mode]
    return lambda x, w: fn(*_eager_arguments(mode, x, w))


# ----------------------------------------------------------------------------------------------- Liger-Kernel


def _import_failure(package, modules):
    """Why ``package`` is unavailable (None when it is): the first of ``modules`` that fails to import, and why."""
    try:
        for module in modules:
            importlib.import_module(module)
    except Exception as e:  # ImportError, or a failure inside its imports (Triton kernels, transformers, ...)
        return f"{package} cannot be imported: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return None


def _liger_unavailable(device):
    return _import_failure("liger-kernel", ("liger_kernel.chunked_loss",))


def _build_liger(mode, options):
    from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

    _raise_recompile_limit()  # it compiles its loss math: the sweep's many shapes must not push it back to eager

    if mode == "logprobs":
        # Liger has no public log-probs function; its GRPO loss computes the policy's log-probs with this
        # chunked (2048 rows x 4096 vocab) selective log-softmax, which is what a Liger user could call.
        from liger_kernel.chunked_loss.fused_linear_ppo import LigerFusedLinearPPOBase

        def logprobs(x, w):
            with torch.no_grad():
                return LigerFusedLinearPPOBase.chunk_forward(
                    x.hidden, w, x.targets, bias=None, temperature=x.temperature
                )

        return logprobs

    cache = {}

    def loss(x, w):
        o = x.options
        key = (o, x.temperature)
        if key not in cache:
            cache[key] = LigerFusedLinearGRPOLoss(
                beta=o.beta,
                compiled=x.hidden.is_cuda,
                use_ref_model=o.beta != 0.0,
                chunk_size=1,
                epsilon_low=o.epsilon,
                epsilon_high=o.clip_high,
                loss_type=o.loss_type,
                importance_sampling_level=o.importance_sampling_level,
                temperature=x.temperature,
                use_bias_correction_kl=o.use_bias_correction_kl,
            )
        # returns (loss, (mean KL, clip ratio)); it computes the gradients inside its forward
        return cache[key](
            x.hidden,
            w,
            x.targets,
            x.mask,
            x.advantages,
            bias=None,
            ref_per_token_logps=x.ref_logprobs,
            old_per_token_logps=x.old_logprobs,
            num_items_in_batch=x.num_items_in_batch,
        )

    return loss


register_with_frozen(
    "liger",
    "Liger-Kernel LigerFusedLinearGRPOLoss (chunk_size=1)",
    "Liger-Kernel, lm_head frozen (no dW)",
    _build_liger,
    _liger_unavailable,
    note="logprobs mode: LigerFusedLinearPPOBase.chunk_forward (internal; Liger has no public one)",
)

# ----------------------------------------------------------------------------------------------- TRL's fused head
# TRL 1.16's GRPOTrainer patches the policy with add_fused_lm_head (trl/trainer/utils.py): the model's forward
# calls trl.kernels.ChunkedLogProbFunction on the positions whose label is not -100, [4096 tokens x 32768 vocab]
# tiles of logits in the input dtype (cuBLAS), each folded into an online logsumexp by a Triton kernel (its torch
# twin on a CPU), the backward recomputing each tile; the trainer's _compute_loss then applies the GRPO formula,
# which grpo_fast.reference.token_loss follows line by line. On CUDA, add_fused_lm_head scores only the labelled
# positions (hidden[mask]); on other devices it scores every position, to keep the tile shapes fixed. The
# benchmark scores only the completion tokens on every device: what a TRL user gets on a GPU.


def _trl_unavailable(device):
    # ChunkedLogProbFunction's backward imports trl.trainer.utils (and with it datasets and accelerate)
    return _import_failure("trl", ("trl.kernels", "trl.trainer.utils"))


def _build_trl(mode, options):
    from trl.kernels import ChunkedLogProbFunction
    from trl.trainer.utils import _CHUNKED_LOGPROB_CHUNK_SIZE  # the vocabulary tile add_fused_lm_head passes

    def completion_outputs(x, w, with_entropy):
        """ChunkedLogProbFunction on the completion tokens, each requested output scattered back to [B, T] with
        zeros at the padding (add_fused_lm_head's masked_scatter); the reference model's head asks for the log-probs
        only (add_fused_lm_head's default outputs), the policy's for the entropy too (the trainer's metric)."""
        outputs = ("log_probs", "entropy") if with_entropy else ("log_probs",)
        per_token = ChunkedLogProbFunction.apply(
            x.hidden[x.mask], w, None, x.targets[x.mask], x.temperature, _CHUNKED_LOGPROB_CHUNK_SIZE, None, 1.0, outputs
        )  # no soft-cap, logit scale 1 (Qwen2.5's, Llama's heads); the temperature: applied in the head
        return [None if t is None else t.new_zeros(x.mask.shape).masked_scatter(x.mask, t) for t in per_token[:2]]

    if mode == "sampler":
        mode = "logprobs"
    elif mode == "sampler_fwdbwd":  # the log-probs alone (the reference model's outputs), with their gradient
        return lambda x, w: sampler.plain_loss(completion_outputs(x, w, False)[0], x)
    return _completion_head_impl(mode, completion_outputs)


register_with_frozen(
    "trl",
    "TRL 1.16's fused head (trl.kernels.ChunkedLogProbFunction on the completion tokens) + TRL's GRPO loss",
    "TRL 1.16's fused head, lm_head frozen (LoRA: no dW; its backward recomputes the tiles)",
    _build_trl,
    _trl_unavailable,
)
IMPLS["trl"].modes = MODES + SAMPLER_MODES  # the sampler mode's peer: its log-prob pass (and its gradient)

# ----------------------------------------------------------------------------------------------- verl
# verl 0.9's fused heads. Its torch backend (fused_kernel_options.impl_backend=torch): FusedLinearForPPO, chunks of
# 512 tokens whose logits are computed in the input dtype (bf16), then fp32 for the log-softmax and the entropy.
# verl's model forward scores every position it is given; in its remove-padding layout those are the real tokens
# only, so the benchmark gives it the completion tokens, then the same loss as every peer. verl pins transformers
# and tensordict against TRL 1.16, so these peers run in an environment with grpo_fast[verl] (python -m bench
# there); elsewhere they are marked unavailable.


def _verl_unavailable(device):
    return _import_failure("verl", ("verl.utils.experimental.torch_functional",))


def _verl_triton_unavailable(device):
    if torch.device(device).type != "cuda":
        return "verl's Triton backend needs CUDA"
    return _import_failure("verl", ("verl.utils.kernel.linear_cross_entropy",))


def _verl_head(backend):
    """verl's fused head of ``backend`` as f(hidden [N, D], weight, targets [N], temperature) -> (logp, entropy)."""
    if backend == "triton":
        from verl.utils.kernel.linear_cross_entropy import linear_cross_entropy

        return lambda h, w, y, temperature: linear_cross_entropy(h, w, y, float(temperature), "none")
    from verl.utils.experimental.torch_functional import FusedLinearForPPO

    head = FusedLinearForPPO(impl_backend="torch")
    return lambda h, w, y, temperature: head(h, w, y, temperature=temperature)


def _build_verl(mode, options, backend):
    head = _verl_head(backend)

    def completion_outputs(x, w, with_entropy):
        logp, entropy = head(x.hidden[x.mask], w, x.targets[x.mask], x.temperature)
        return [t.float().new_zeros(x.mask.shape).masked_scatter(x.mask, t.float()) for t in (logp, entropy)]

    return _completion_head_impl(mode, completion_outputs)


# its Triton backend (impl_backend=triton: verl.utils.kernel's linear_cross_entropy) is CUDA only
for _backend, _label, _unavailable in (
    ("torch", "verl 0.9's torch backend (FusedLinearForPPO", _verl_unavailable),
    ("triton", "verl 0.9's Triton backend (linear_cross_entropy", _verl_triton_unavailable),
):
    register(
        Impl(
            f"verl_{_backend}",
            f"{_label} on the completion tokens) + TRL's GRPO loss",
            functools.partial(_build_verl, backend=_backend),
            unavailable=_unavailable,
        )
    )

# ----------------------------------------------------------------------------------------------- CCE
# Cut Cross-Entropy (cut-cross-entropy 25.1, Apple): linear_cross_entropy's "cce" kernels (the log-sum-exp of each
# row in one Triton sweep, the target logit by an indexed dot, a backward that skips gradient blocks below its
# filter_eps, its default) on the completion tokens, with reduction "none": logp = -loss. It takes no temperature:
# the hidden states are divided by it (z = (h / tau) W^T), and it returns no entropy (the loss's entropy metric is
# then absent). CUDA only.


def _cce_unavailable(device):
    if torch.device(device).type != "cuda":
        return "CCE's kernels need CUDA"
    return _import_failure("cut-cross-entropy", ("cut_cross_entropy",))


def _build_cce(mode, options):
    from cut_cross_entropy import linear_cross_entropy

    def completion_outputs(x, w, with_entropy):
        hidden = x.hidden[x.mask] if x.temperature == 1.0 else x.hidden[x.mask] / x.temperature
        logp = -linear_cross_entropy(hidden, w, x.targets[x.mask], reduction="none").float()
        return [logp.new_zeros(x.mask.shape).masked_scatter(x.mask, logp), None]

    return _completion_head_impl(mode, completion_outputs)


register_with_frozen(
    "cce",
    "Cut Cross-Entropy 25.1 (linear_cross_entropy, reduction none, on the completion tokens) + TRL's GRPO loss",
    "Cut Cross-Entropy 25.1, lm_head frozen (LoRA: no dW)",
    _build_cce,
    _cce_unavailable,
)

# ----------------------------------------------------------------------------------------------- grpo_fast


def _build_grpo_fast(mode, options, head_path="auto"):
    backend = options.get("backend", "auto")
    if mode == "sampler_fwdbwd":  # the plain log-prob pass with its gradient: the sampler rows' baseline
        return lambda x, w: sampler.plain_loss(
            grpo_fast.logprobs_and_entropy(
                x.hidden, w, x.targets, temperature=x.temperature, completion_mask=x.mask, backend=backend
            )[0],
            x,
        )
    if mode == "fwdbwd":
        return lambda x, w: grpo_fast.loss(
            x.hidden,
            w,
            x.targets,
            x.advantages,
            x.mask,
            **x.logprob_keywords(),
            temperature=x.temperature,
            options=x.options,
            head_path=head_path,
            backend=backend,
        )
    return lambda x, w: grpo_fast.logprobs(
        x.hidden, w, x.targets, temperature=x.temperature, completion_mask=x.mask, backend=backend
    )


def _build_grpo_fast_general_path(mode, options):
    """grpo_fast with its frozen-head path off (head_path="general"): the general path's three sweeps."""
    return _build_grpo_fast(mode, options, head_path="general")


def _grpo_fast_head(mode, x, options, head_path="auto", frozen=False):
    """The layer-1 head grpo_fast's loss (fwdbwd) or log-prob pass runs on these inputs, by the decisions its calls
    make (grpo_fast.head.paths): "log-prob pass"; with a frozen lm_head "frozen" (d logp / dh built in the forward)
    or "frozen recompute" (head_path="general"); with a trained one "three-sweep" (the gradients formed in the
    forward: the Triton backend, bf16 or fp32, a token-local loss) or "recompute" (the torch backend, fp16,
    head_path="general"). None for the sampler modes (their floors are the plain pass's)."""
    if mode == "logprobs":
        return "log-prob pass"
    if mode != "fwdbwd":
        return None
    from grpo_fast.backends.resolver import resolve_backend
    from grpo_fast.head import paths

    hidden = x.hidden.detach().reshape(-1, x.hidden.shape[-1])
    backend = resolve_backend(options.get("backend", "auto"), hidden.device)
    if frozen:
        frozen_path = paths.takes_frozen_head((True, False, False, False), hidden, backend, head_path)
        return "frozen" if frozen_path else "frozen recompute"
    three = x.options.token_local and paths.takes_trained_head((True, True), hidden, backend, head_path, False)
    return "three-sweep" if three else "recompute"


register(
    Impl(
        "grpo_fast",
        "grpo_fast (Triton on CUDA; chunked torch on a CPU)",
        _build_grpo_fast,
        modes=MODES + SAMPLER_MODES,
        head=_grpo_fast_head,
    )
)
# the sampler mode's rows: grpo_fast.sampler_logprobs with the sampling parameters or replayed kept sets
for _name in sampler.VARIANTS:
    register(Impl(_name, sampler.LABELS[_name], sampler.build_variant(_name), modes=SAMPLER_MODES))
register(
    Impl(
        "grpo_fast_frozen",
        "grpo_fast, lm_head frozen (LoRA: no dW; d logp / dh built in the forward, two vocabulary sweeps)",
        _build_grpo_fast,
        modes=("fwdbwd",),
        frozen=True,
        head=functools.partial(_grpo_fast_head, frozen=True),
    )
)
register(
    Impl(
        "grpo_fast_frozen_recompute",
        "grpo_fast, lm_head frozen, general path (head_path='general': three sweeps)",
        _build_grpo_fast_general_path,
        modes=("fwdbwd",),
        frozen=True,
        head=functools.partial(_grpo_fast_head, head_path="general", frozen=True),
    )
)

DEFAULT_GPU = (
    "eager",
    "compile",
    "trl",
    "liger",
    "grpo_fast",
    "grpo_fast_frozen",
    "trl_frozen",
    "grpo_fast_frozen_recompute",
    "cce",
    "cce_frozen",
)
DEFAULT_CPU = (
    "eager",
    "trl",
    "liger",
    "grpo_fast",
    "grpo_fast_frozen",
    "trl_frozen",  # torch.compile on a CPU: ask
    "grpo_fast_frozen_recompute",
)
# the sampler mode's (with the plain pass's grpo_fast and trl rows from the defaults above)
DEFAULT_SAMPLER = tuple(sampler.VARIANTS)


# the vocabulary sweeps (matmul work of 2 N D V each: one product of the N completion tokens' hidden states with the
# lm_head) of each of grpo_fast's heads, forward + backward in fwdbwd: a log-prob pass 1; a frozen head 2 (the
# logits, d logp / dh); the three-sweep head 3 (the logits, dH, dW, all in the forward); a frozen head's general path
# 3 (the logits, their recompute, dH); the recompute head 4 (the logits, their recompute, dH, dW)
HEAD_SWEEPS = {"log-prob pass": 1, "frozen": 2, "three-sweep": 3, "frozen recompute": 3, "recompute": 4}


def work(impl: Impl, mode: str, x, options: dict, N: int, D: int, V: int) -> tuple[str | None, int]:
    """(the head the row runs, the matmul work its TFLOP/s count) for N completion tokens: the head's sweeps
    (``HEAD_SWEEPS``) where the implementation declares its head (grpo_fast's rows), else (None, the floor:
    ``flops``)."""
    head = impl.head(mode, x, options) if impl.head is not None and x is not None else None
    if head is None:
        return None, flops(mode, impl.frozen, N, D, V)
    return head, HEAD_SWEEPS[head] * 2 * N * D * V


def flops(mode: str, frozen: bool, N: int, D: int, V: int) -> int:
    """The work's floor for N completion tokens, what a row whose head the bench does not know counts (``work``):
    2NDV for the forward matmul;
    forward + backward with the logits recomputed: 8NDV (forward, recompute, dH, dW); a frozen lm_head: 4NDV (the
    logits and d logp / dh = P' W built in the forward, grpo_fast_frozen's two sweeps; a recomputing backward does
    6NDV). Padding is no part of the work: an implementation that computes it does more. Each record also holds the
    matmul FLOPs the implementation did run, counted (``matmul_flops``, CPU runs: see runner.count_matmul_flops). The
    sampler mode's floors are the plain pass's: 2NDV no-grad, 8NDV forward + backward."""
    if mode in ("logprobs", "sampler"):
        return 2 * N * D * V
    return (4 if frozen else 8) * N * D * V


def resolve(names, device) -> list[Impl]:
    if not names:
        names = DEFAULT_GPU if torch.device(device).type == "cuda" else DEFAULT_CPU
    out = []
    for n in names:
        if n not in IMPLS:
            raise ValueError(f"unknown implementation {n!r}: choose from {', '.join(IMPLS)}")
        out.append(IMPLS[n])
    return out
