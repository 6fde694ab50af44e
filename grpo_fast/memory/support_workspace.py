"""The memory model of ``grpo_fast.sampler_logprobs``' custom ops on a GPU (``support_workspace_bytes``): what their
real implementations allocate besides their outputs, which ``heads.workspace_bytes`` adds to a step's estimate over
fake tensors. ``memory.sampler`` holds the loss head that runs them; its docstring gives the model's terms.
"""

from __future__ import annotations

import math

import torch

from grpo_fast.backends import support_twin
from grpo_fast.backends.resolver import named

# [r, V] fp32 buffers at the peak of the parameters' path, by rule (their largest when several apply)
FORWARD_BUFFERS = {"top_k": 4.5, "min_p": 4.5, "top_p": 16.0}
BACKWARD_BUFFERS = 6.25
# on a GPU with half weights, the backward's GEMMs read the logits' gradient in the weight's dtype: half a buffer
HALF_COPY_BUFFERS = 0.5
# [N, K] fp32 buffers of replayed kept sets
REPLAYED_FORWARD = 3.5
REPLAYED_BACKWARD = 4.5
PASSES = ("old", "train")


def chunk_rows(tokens: int, vocab_size: int) -> int:
    """The token rows of one chunk of the parameters' path (``support_twin``'s byte budget), at most the tokens."""
    return min(tokens, max(1, support_twin.ROW_BUDGET_BYTES // (4 * max(vocab_size, 1))))


def rules(top_k: int, top_p: float, min_p: float) -> list[str]:
    """The rules a set of sampling parameters applies."""
    return [name for name, on in (("top_k", top_k > 0), ("top_p", top_p < 1.0), ("min_p", min_p > 0.0)) if on]


def support_workspace_bytes(
    op: str,
    tokens: int,
    hidden_size: int,
    vocab_size: int,
    dtype: torch.dtype,
    *,
    kept: int = 0,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
    need_hidden: bool = True,
    need_weight: bool = True,
    need_bias: bool = False,
    lora_rank: int = 0,
    device_type: str = "cuda",
    backend: str = "triton",
    differentiable: bool = True,
    trains_head: bool = False,
) -> int:
    """The bytes a sampler op's implementation allocates besides its outputs (module docstring).

    Args:
        op: "sampler_support" (the forward) or "sampler_support_backward".
        tokens: N, the scored rows.
        hidden_size: D.
        vocab_size: V, the lm_head's rows (a shard's on a vocab-parallel head).
        dtype: the hidden states' and weight's dtype.
        kept: K of replayed kept sets, 0: the sampling parameters.
        top_k, top_p, min_p: the sampling parameters.
        need_hidden, need_weight, need_bias: the backward's gradients.
        lora_rank: the rank of LoRA on the head (0: none); its gradients' fp32 buffers.
        device_type: "cuda" (the GPU's: the gradient's half copy) or "cpu".
        backend: the backend that runs the op (with replayed sets its dW's workspace:
            ``gathered_backward_workspace_bytes``).
        differentiable: the forward's operands need gradients (replayed sets without: the op's record sweep too,
            ``replayed_sweep_bytes``).
        trains_head: the weight, bias or LoRA's weight needs a gradient (replayed sets on the Triton backend: the
            record sweep forward and layer 1's chunked backward, ``Backend.replayed_takes_logprob``).

    Returns:
        The workspace's bytes.
    """
    N, D, V = tokens, hidden_size, vocab_size
    if N == 0:
        return 0
    swept = kept and named(backend).replayed_takes_logprob(differentiable, trains_head)
    if swept and op == "sampler_support":
        chunk = replayed_sweep_bytes(N, D, V, dtype, kept, device_type, backend)
    elif swept:  # layer 1's chunked backward with the support's term: its g and a chunk's bitmaps
        chunk = named(backend).replayed_backward_workspace_bytes((N, D), V, dtype)
    elif kept:
        per_token = N * kept * 4
        chunk = per_token * (REPLAYED_FORWARD if op == "sampler_support" else REPLAYED_BACKWARD)
    else:
        buffer = chunk_rows(N, V) * V * 4
        if op == "sampler_support":
            chunk = buffer * max(
                [FORWARD_BUFFERS[r] for r in rules(top_k, top_p, min_p)] or [min(FORWARD_BUFFERS.values())]
            )
        else:
            half = device_type == "cuda" and torch.empty(0, dtype=dtype).element_size() < 4
            chunk = buffer * (BACKWARD_BUFFERS + (HALF_COPY_BUFFERS if half else 0.0))
    if op == "sampler_support":
        return math.ceil(chunk)
    if op != "sampler_support_backward":
        raise ValueError(f"op must be 'sampler_support' or 'sampler_support_backward', got {op!r}")
    grads = 4 * (need_hidden * N * D + need_weight * V * D + need_bias * V + lora_rank * (N + V))
    if kept and not swept and (need_weight or lora_rank):
        chunk += named(backend).gathered_backward_workspace_bytes((N, kept))
    return math.ceil(chunk) + grads


def replayed_sweep_bytes(N, D, V, dtype, kept, device_type="cuda", backend="triton"):
    """Replayed sets without gradients: the log-prob's record (the backend's ``replayed_record_workspace_bytes``: on
    the Triton backend its record sweep, with wide sets' bitmaps of a launch's rows within PARTS_BYTES, no [N, K]
    buffer) and, where the sets are gathered, REPLAYED_FORWARD [N, K] fp32 buffers."""
    sweep, gathered = named(backend).replayed_record_workspace_bytes((N, D), V, kept, dtype, device_type)
    return sweep + (math.ceil(N * kept * 4 * REPLAYED_FORWARD) if gathered else 0)


def workspace_of(op: str, bound: dict, device_type: str = "cuda") -> int:
    """``support_workspace_bytes`` of a sampler op's bound arguments (the op's schema names: ``heads.workspace_bytes``
    hands them over)."""
    hidden, weight, kept_ids = bound["hidden"], bound["weight"], bound.get("kept_ids")
    lora_weight = bound.get("lora_weight")
    backward = op == "sampler_support_backward"
    return support_workspace_bytes(
        op,
        hidden.shape[0],
        hidden.shape[1],
        weight.shape[0],
        hidden.dtype,
        kept=kept_ids.shape[1] if kept_ids is not None else 0,
        top_k=bound["top_k"],
        top_p=bound["top_p"],
        min_p=bound["min_p"],
        need_hidden=bool(bound.get("need_hidden", False)) if backward else False,
        need_weight=bool(bound.get("need_weight", False)) if backward else False,
        need_bias=bool(bound.get("need_bias", False)) if backward else False,
        lora_rank=lora_weight.shape[1] if backward and lora_weight is not None and bound.get("need_lora_hidden") else 0,
        device_type=device_type,
        backend=bound["backend"],
        differentiable=bool(bound.get("differentiable", True)),
        trains_head=bool(bound.get("trains_head", False)),
    )
