"""Layer 1's public functions: ``logprobs`` (no gradient) and ``logprobs_and_entropy`` (differentiable).

Only completion tokens are computed: with a ``completion_mask``, the rows with mask 1 are gathered before layer 1
(forward and backward) and the per-token outputs are scattered back, with exact zeros at masked positions
(``inputs.scored_rows``). Backends: "triton" runs the Triton kernels (CUDA tensors, or CPU tensors under
TRITON_INTERPRET=1); "torch" runs the same algorithm in chunked PyTorch (any device); "auto" picks triton for CUDA
tensors and under the interpreter, torch otherwise.
"""

from __future__ import annotations

import torch

from grpo_fast.backends.protocol import BackendName
from grpo_fast.head import inputs, ops
from grpo_fast.head import vocab_parallel as vocab_parallel_head
from grpo_fast.head.keywords import takes_keywords
from grpo_fast.head.lora import HeadLora
from grpo_fast.head.shard import VocabShard
from grpo_fast.kernels.config import BackwardMode, HeadPath


@takes_keywords()
def logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    softcap: float | None = None,
    logit_scale: float = 1.0,
    completion_mask: torch.Tensor | None = None,
    lora: HeadLora | tuple | None = None,
    vocab_parallel: VocabShard | None = None,
    backend: BackendName = "auto",
    check_values: bool = True,
) -> torch.Tensor:
    """Per-token log-probs of ``targets`` for the reference and old policies, without gradients.

    ``logprobs_and_entropy`` without the entropy and without autograd: no [tokens, V] logits are built and no graph
    is kept.

    Args:
        hidden: [B, T, D] float32, bfloat16 or float16; hidden[b, t] predicts targets[b, t].
        weight: [V, D] in hidden's dtype, or fp32 over bf16 / fp16 hidden (vocab-parallel: this rank's rows, or a
            DTensor).
        targets: [B, T] integer token ids.
        bias: [V] or None.
        temperature: divides the logits.
        softcap: soft-cap of the logits, or None.
        logit_scale: multiplies the raw logits.
        completion_mask: [B, T] bool or 0/1: the tokens computed; None: all.
        lora: a HeadLora (or tuple) on the head, or None.
        vocab_parallel: this rank's VocabShard, or None.
        backend: "auto", "triton" or "torch".
        check_values: read the value checks on the host, once.

    Returns:
        [B, T] float32 log-probs, detached; exact zeros where completion_mask is 0.

    Raises:
        TypeError: as ``logprobs_and_entropy``, for the arguments both take.
        ValueError: as ``logprobs_and_entropy``, for the arguments both take.
    """
    call = inputs.HeadCall.check(
        hidden,
        weight,
        targets,
        completion_mask,
        bias=bias,
        temperature=temperature,
        softcap=softcap,
        logit_scale=logit_scale,
        lora=lora,
        vocab_parallel=vocab_parallel,
        backend=backend,
        check_values=check_values,
    )
    with torch.no_grad():
        rows = call.rows()
        head = call.operands(rows)
        if call.shard is not None:
            if head.hidden.shape[0] == 0:
                return torch.zeros(call.shape, dtype=torch.float32, device=hidden.device)
            logp = vocab_parallel_head.logprobs(head, call.backend, call.shard)
        else:
            operands = ops.LinearOpOperands.of(head, call.backend.name)
            logp = ops.linear_logprobs(operands, False, False, rows.count)[0]
        return call.scattered(logp, rows)


@takes_keywords()
def logprobs_and_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    softcap: float | None = None,
    logit_scale: float = 1.0,
    completion_mask: torch.Tensor | None = None,
    entropy_grad: bool = False,
    head_path: HeadPath = "auto",
    backward_mode: BackwardMode = "chunked",
    lora: HeadLora | tuple | None = None,
    vocab_parallel: VocabShard | None = None,
    backend: BackendName = "auto",
    check_values: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-probs of ``targets`` and entropies, both differentiable, without full-vocab logits.

    The logit is ``softcap * tanh(logit_scale * (hidden @ weight.T + bias) / softcap) / temperature`` (TRL 1.16's
    order). Gradients reach hidden, weight, bias and the LoRA adapters through both outputs; no tensor of size
    V x tokens exists in the forward or the backward, and every gradient is exact whichever path is taken. A
    vocab-parallel head gives every rank the unsharded outputs and gradients, dW and db rows local
    (docs/vocab-parallel.md).

    Args:
        hidden: [B, T, D] float32, bfloat16 or float16: the last hidden states; hidden[b, t] predicts
            targets[b, t].
        weight: [V, D] lm_head weight, hidden's dtype, or fp32 over bf16 / fp16 hidden (cast for the GEMMs, its
            gradient fp32: docs/api.md#mixed-precision-autocast). Vocab-parallel: this rank's rows
            [V_local, D] (with ``vocab_parallel``) or a DTensor sharded on dim 0.
        targets: [B, T] integer token ids in [0, V); positions where completion_mask is 0 are not read.
        bias: [V] lm_head bias in hidden's dtype (this rank's rows when vocab-parallel), or None.
        temperature: divides the logits (> 0).
        softcap: the soft-cap c of ``c * tanh(x / c)`` (Gemma 2: 30.0); None: no tanh.
        logit_scale: multiplies the raw logits (non-zero; Cohere's logit_scale, Granite's 1 / logits_scaling).
        completion_mask: [B, T] bool or 0/1; only tokens with 1 are computed, the others are exact zeros.
            None: every token.
        entropy_grad: the entropy will be differentiated (an entropy bonus): take the general path, which serves
            it in fewer vocabulary sweeps than the frozen-head path.
        head_path: "auto": with a frozen weight and bias the forward also builds d logp / d hidden (two
            vocabulary sweeps in all instead of three); "general": always the recompute path.
        backward_mode: the Triton backward: "chunked" (g per token chunk and two GEMMs) or "fused" (one kernel,
            fp32 atomics); the torch backend has "chunked" only.
        lora: LoRA on the lm_head: a ``grpo_fast.HeadLora`` or a tuple (a, b, scaling[, dropout]);
            None: none.
        vocab_parallel: a ``grpo_fast.VocabShard`` when ``weight`` holds this rank's rows of a
            vocab-parallel head; None: a whole head, or a DTensor weight that carries its own sharding.
        backend: "auto" (Triton for CUDA tensors and under TRITON_INTERPRET=1, else torch), "triton" or "torch".
        check_values: read the value checks (targets in range where the mask is 1, the mask 0/1) in one host
            synchronisation; False reads nothing on the host.

    Returns:
        logprobs: [B, T] float32, exact zeros where completion_mask is 0.
        entropy: [B, T] float32, exact zeros where completion_mask is 0.

    Raises:
        TypeError: a tensor argument that is not a tensor, a float argument not float32/bfloat16/float16,
            weight's dtype neither hidden's nor fp32 over bf16 / fp16 hidden, targets not an integer tensor, or
            ``lora``, ``vocab_parallel``, ``entropy_grad`` or ``check_values`` of the wrong type.
        ValueError: a shape that does not match, tensors on different devices, a targets value outside [0, V) or
            a mask value other than 0/1 (with ``check_values``), a bad temperature, softcap or logit_scale, an
            unknown ``backend``, ``head_path`` or ``backward_mode`` or one that cannot run here, sizes the Triton
            kernels cannot index, or LoRA on a vocab-parallel head.
    """
    if not isinstance(entropy_grad, bool):
        raise TypeError(f"entropy_grad must be a bool, got {entropy_grad!r}")
    call = inputs.HeadCall.check(
        hidden,
        weight,
        targets,
        completion_mask,
        bias=bias,
        temperature=temperature,
        softcap=softcap,
        logit_scale=logit_scale,
        lora=lora,
        vocab_parallel=vocab_parallel,
        backend=backend,
        check_values=check_values,
        head_path=head_path,
        backward_mode=backward_mode,
    )
    return logprobs_and_entropy_rows(call, call.rows(), "general" if entropy_grad else call.head_path)


def logprobs_and_entropy_rows(call: inputs.HeadCall, rows: inputs.Rows, head_path: HeadPath):
    """Layer 1 with autograd on a checked call's scored ``rows``: (logp, entropy) [B, T] fp32. ``head_path`` "auto":
    with a frozen weight and bias, build d logp / d hidden in the forward (two vocabulary sweeps instead of three;
    ops.linear_logprobs_path), for callers whose entropy will usually get no gradient; "general": the recompute
    path. A vocab-parallel head makes the same choice over its shards (grpo_fast.head.vocab_parallel)."""
    head = call.operands(rows)
    if call.shard is not None:
        logp, entropy = vocab_parallel_head.linear_logprobs(
            head, call.backend, call.shard, head_path, call.backward_mode
        )
    else:
        logp, entropy = ops.linear_logprobs_path(
            head, call.backend, head_path, call.backward_mode, row_count=rows.count
        )
    return call.scattered(logp, rows), call.scattered(entropy, rows)
