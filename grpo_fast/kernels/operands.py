"""The kernels' operand records: what every implementation of a computation (the kernels' launchers, the torch
twins, the backends, the reduce steps) takes in place of the same list of arguments. Layer 1's operands and gradient
buffers (``HeadOperands``, ``HeadGrads``), layer 2's prepared batch (``TokenLossInputs``), and the combined GRPO +
distillation head's layer-1 term in the divergence head's backward (``Layer1Gradient``) and fused loss
(``LossLayer1``). The divergence head's own records are ``divergence_records``'."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch


class HeadOperands(NamedTuple):
    """The scored tokens' logits z = transform(hidden weight^T + lora_hidden lora_weight^T + bias) and their targets.

    Attributes:
        hidden: [N, D] the scored tokens' last hidden states, rows contiguous.
        weight: [V, D] the lm_head's rows (a vocab-parallel shard's rows), hidden's dtype (``gemm_weight``).
        targets: [N] int64 vocabulary indices (one outside [0, V): in no column of these rows).
        bias: [V] or None.
        transform: the logit transform (a LogitTransform: ``apply``, ``kernel_scalars``, ``softcap``).
        lora: None, or LoRA's operand pair (lora_hidden [N, r], lora_weight [V, r]), whose product is added to the
            raw logits (``head.lora.HeadLora``).
    """

    hidden: torch.Tensor
    weight: torch.Tensor
    targets: torch.Tensor
    bias: torch.Tensor | None
    transform: Any
    lora: tuple[torch.Tensor, torch.Tensor] | None = None

    def tokens(self, start: int, stop: int) -> HeadOperands:
        """The same operands over the tokens [start, stop) only."""
        lora = (self.lora[0][start:stop], self.lora[1]) if self.lora is not None else None
        return self._replace(hidden=self.hidden[start:stop], targets=self.targets[start:stop], lora=lora)

    def rows(self, index: torch.Tensor) -> HeadOperands:
        """The same operands over the tokens ``index`` ([n] int64) only, their rows copied contiguous."""
        lora = (self.lora[0][index].contiguous(), self.lora[1]) if self.lora is not None else None
        hidden, targets = self.hidden[index].contiguous(), self.targets[index].contiguous()
        return self._replace(hidden=hidden, targets=targets, lora=lora)


def gemm_weight(weight: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """``weight`` as the GEMMs read it: in ``hidden``'s dtype, since a GEMM takes one dtype. A weight kept in fp32
    under bf16 / fp16 hidden states (an fp32 master weight under torch.autocast; ``head.inputs.check_weight_dtype``
    says which pairs are taken) becomes a copy in hidden's dtype, V x D x 2 bytes while the op that casts it runs.
    The ops take the weight in its own dtype and cast it inside, so that its gradient, accumulated in fp32, comes
    back in fp32 without a rounding to hidden's dtype."""
    return weight if weight.dtype == hidden.dtype else weight.to(hidden.dtype)


class HeadGrads(NamedTuple):
    """Layer 1's fp32 gradient buffers, each None where that gradient is not wanted (or its operand is absent):
    d hidden [N, D], d weight [V, D], d bias [V], d lora_hidden [N, r], d lora_weight [V, r]."""

    hidden: torch.Tensor | None = None
    weight: torch.Tensor | None = None
    bias: torch.Tensor | None = None
    lora_hidden: torch.Tensor | None = None
    lora_weight: torch.Tensor | None = None


class GradientColumns(NamedTuple):
    """A token-local loss's gradient entries at a few columns a row besides the softmax's (a served teacher's
    support): dL/du = ``grad`` x ``slope`` at ``ids``, for the three-sweep trained head's dW and db
    (``kernels.forward_frozen.forward_trained_head``).

    Attributes:
        ids: [N, K] int64, -1: no entry.
        grad: [N, K] fp32 dL/dz there, each chunk's rows written by the head's ``coefficients`` before it returns.
        slope: dz/du there, [N, K] fp32 (likewise written by then), or a number (a 0-d tensor too).
        rest: [N, K] fp32, written: ``grad`` on the rows the head left to the caller, 0 on those it took.
    """

    ids: torch.Tensor
    grad: torch.Tensor
    slope: torch.Tensor | float
    rest: torch.Tensor


class TokenLossInputs(NamedTuple):
    """Layer 2's prepared per-batch tensors: fp32, contiguous, on one device, a sequence a row.

    Attributes:
        logp: the policy's log-probs [B, T].
        advantages: [B] or [B, T].
        mask: the completion mask [B, T], 0 / 1.
        old: the old policy's log-probs [B, T], or None (on-policy: the ratio is 1, its gradient flows).
        ref: the reference log-probs [B, T], or None without a KL term.
        sampler: the off-policy mask's sampler log-probs [B, T] (NaN: not scored), or None without that mask.
        importance_weights: [B] or [B, T], or None.
        entropy: the token entropies [B, T], or None.
    """

    logp: torch.Tensor
    advantages: torch.Tensor
    mask: torch.Tensor
    old: torch.Tensor | None
    ref: torch.Tensor | None
    sampler: torch.Tensor | None
    importance_weights: torch.Tensor | None
    entropy: torch.Tensor | None


class Layer1Gradient(NamedTuple):
    """The combined head's layer-1 term, which ``divergence_gradient.backward`` adds to g."""

    targets: torch.Tensor  # [N] int64 target ids, rows of the weights
    stats: torch.Tensor  # [4, N] fp32: softmax_stats.BackwardStats' rows
    grad_logp: torch.Tensor  # [N] fp32: dL/dlogp
    grad_entropy: torch.Tensor | None  # [N] fp32 dL/dentropy, or None: the entropy has no gradient


class LossLayer1(NamedTuple):
    """The combined GRPO + distillation loss's layer-1 term for ``divergence_loss.loss_gradients``."""

    targets: torch.Tensor  # [N] int64 target ids
    # (n0, n1, logp [n1 - n0], entropy [n1 - n0]) -> dL/dlogp of those tokens [n1 - n0] fp32: the layer-2 gradient
    # of a loss whose token values read no other token's log-prob (called once per chunk, in order)
    coefficients: object


class SamplerSupport(NamedTuple):
    """The set a sampler draws each token from: its parameters (vLLM 0.32's rules, ``grpo_fast.sampler``) or the
    replayed sets.

    Attributes:
        top_k: keep the k largest logits (every one tied with the k-th too); 0: no top-k.
        top_p: keep an entry while the survivors' mass ranked strictly above it is below top_p; 1.0: no top-p.
        min_p: keep p_v >= min_p * max p; 0.0: no min-p.
        kept_ids: None, or [N, K] int64 replayed kept sets (-1 filling), which replace the three parameters.
    """

    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    kept_ids: torch.Tensor | None = None

    @property
    def truncates(self) -> bool:
        """Whether the kept set can be smaller than the vocabulary (else the support's log-probs are the log-probs)."""
        return self.kept_ids is not None or self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0


class SupportGradient(NamedTuple):
    """A replayed kept set's support term in layer 1's backward (``kernels.backward.backward_chunked``): d = dL/ds of
    s = z_y - L_kept, as -d q_v on each kept v != y and d (1 - q_y) at the target, [N] fp32 each but the ids.

    Attributes:
        kept_ids: [N, K] int64, -1 filling (ids outside [0, V) skipped).
        grad_support: d (NaN where the target is outside its set: ``sampler.ops.masked_support_gradient``): |d|
            bounds the term's |dL/dz| (g's power of two).
        kept_coefficient: d exp(L - L_kept), q_v's factor on the softmax's p_v, where that factor is at most
            exp(``forward.KEPT_RANGE``); 0 (NaN with d) on the other rows.
        target_coefficient: d (1 - q_y), carried.
        exact_coefficient: d on the other rows (a set far below its row's max: q_v its own exponential
            exp(z_v - L_kept)), 0 elsewhere.
        kept_lse: L_kept (read on those rows).
    """

    kept_ids: torch.Tensor
    grad_support: torch.Tensor
    kept_coefficient: torch.Tensor
    target_coefficient: torch.Tensor
    exact_coefficient: torch.Tensor
    kept_lse: torch.Tensor


class SupportRecord(NamedTuple):
    """What the support's forward leaves for its backward, [N] fp32 each (an empty tensor where a path has none).

    Attributes:
        target_logit: z_y (-inf where a replayed set lacks the target).
        kept_lse: log sum_{v kept} exp(z_v).
        kept_nontarget_mass: sum_{v kept, v != y} exp(z_v - kept_lse) = 1 - q_y, the support's target column
            carried exactly (never 1 - q_y by cancellation).
        threshold: with the parameters, tau: the kept set is {v : z_v >= tau}.
        lse: with the parameters (and replayed sets without gradients), log sum_v exp(z_v) over the vocabulary (the
            log-prob's; the same rows' logits).
        nontarget_mass: with the parameters (and replayed sets without gradients), 1 - p_y, carried.
        logprob: the log-prob over the vocabulary where the forward computes it: with the parameters z_y - lse, with
            replayed sets without gradients layer 1's (``support_twin.with_logprob``: finite where the set lacks the
            target, exact where the token is confident).
        carried_ids: [N, LISTED] int64 where the forward carries the kept set out to its backward (the parameters'
            tile path with gradients, ``support_tiles``): each row's kept ids, -1 after them; a row of -1 alone took
            the rows' path (a kept set is never empty). Empty (int64) on the other paths.
    """

    target_logit: torch.Tensor
    kept_lse: torch.Tensor
    kept_nontarget_mass: torch.Tensor
    threshold: torch.Tensor
    lse: torch.Tensor
    nontarget_mass: torch.Tensor
    logprob: torch.Tensor
    carried_ids: torch.Tensor

    @classmethod
    def to_fill(cls, rows: int, device, carried_ids=None) -> SupportRecord:
        """A record of ``rows`` tokens for a path to fill: [rows] fp32 fields (uninitialised), ``carried_ids`` as
        given (None: none carried)."""
        fields = [torch.empty(rows, dtype=torch.float32, device=device) for _ in cls._fields[:-1]]
        return cls(*fields, no_kept_ids(device) if carried_ids is None else carried_ids)


def no_kept_ids(device) -> torch.Tensor:
    """``SupportRecord.carried_ids`` of a path that carries no kept set to its backward."""
    return torch.empty(0, dtype=torch.int64, device=device)
