"""The student-teacher divergence head of on-policy distillation: ``grpo_fast.divergence``,
``grpo_fast.divergence_and_entropy`` and ``grpo_fast.distillation_loss`` (TRL's loss, its gradients formed in the
forward), TRL 1.16's DistillationTrainer semantics without either model's logits.

    div = grpo_fast.divergence(student_hidden, student_weight, teacher_hidden, teacher_weight, completion_mask,
                               beta=0.5, temperature=0.9)          # [B, T] fp32, differentiable (student only)

beta 0 is the forward KL(teacher || student), 1 the reverse KL(student || teacher) (TRL's default), in between the
generalized JSD beta KL(p_t || m) + (1 - beta) KL(p_s || m), m = (1 - beta) p_s + beta p_t; grpo_fast.reference's
divergence section is the spec. Each model's logits get its own soft-cap and logit scale, then one temperature for
both (TRL's order): one LogitTransform per model.

Here are the checks (named errors before any value is read) and the choice of path; the computation is two custom ops
(grpo_fast.distillation.ops), or, for vocab-parallel heads, grpo_fast.distillation.parallel. The teacher never gets a
gradient. The entropy is the student's, detached (TRL's head marks it non-differentiable: the trainer only logs it).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import TypedDict

import torch
from typing_extensions import Unpack

from grpo_fast.backends.protocol import Backend, BackendName, ModelHead
from grpo_fast.backends.resolver import resolve_backend
from grpo_fast.distillation import ops as divergence_ops
from grpo_fast.distillation import parallel
from grpo_fast.head.inputs import (
    FLOAT_DTYPES,
    Rows,
    ValueChecks,
    check_head,
    check_mask,
    check_same_device,
    check_tensor,
    row_values,
    scatter_rows,
    scored_rows,
)
from grpo_fast.head.keywords import takes_keywords
from grpo_fast.head.shard import VocabShard
from grpo_fast.head.transform import LogitTransform, check_chunk, check_number, check_softcap_and_scale
from grpo_fast.kernels.config import HEAD_PATHS, HeadPath


# ----------------------------------------------------------------------------------------------- checks
def _checked(student, teacher, completion_mask, beta, backend, checks, sharded):
    """Every check of the public functions, with named errors (those that read values go to ``checks``, read once
    with the scored-row count: inputs.scored_rows); returns the resolved backend. ``student`` and ``teacher``
    are the public arguments as ModelHeads, their transforms not yet checked; ``sharded``: the weights are this
    rank's rows of vocab-parallel heads, which may hold none."""
    B, T, _, V = check_head(("student_hidden", "student_weight", "student_bias"), *student[:3], sharded)
    Bt, Tt, _, Vt = check_head(("teacher_hidden", "teacher_weight", "teacher_bias"), *teacher[:3], sharded)
    if (Bt, Tt) != (B, T):
        raise ValueError(
            f"teacher_hidden's [B, T] = {[Bt, Tt]} differs from student_hidden's {[B, T]}: both score the same tokens"
        )
    if Vt != V:
        raise ValueError(
            f"student_weight has V = {V} rows but teacher_weight has V = {Vt}: the vocabularies must match"
        )
    if completion_mask is not None:
        check_tensor("completion_mask", completion_mask)
    others = zip(
        ("student_weight", "student_bias", "teacher_hidden", "teacher_weight", "teacher_bias"),
        (*student[1:3], *teacher[:3]),
    )
    check_same_device([*others, ("completion_mask", completion_mask)], student.hidden.device, "student_hidden")
    if completion_mask is not None:
        check_mask(completion_mask, (B, T), checks)
    check_number(
        "beta",
        beta,
        lambda v: 0.0 <= v <= 1.0,
        "a number in [0, 1] (0: forward KL(teacher || student), 1: reverse KL(student || teacher))",
    )
    check_number("temperature", student.transform.temperature, lambda v: v > 0, "a positive number")
    for name, transform in (("student", student.transform), ("teacher", teacher.transform)):
        check_softcap_and_scale(transform.softcap, transform.logit_scale, (f"{name}_softcap", f"{name}_logit_scale"))
    backend = resolve_backend(backend, student.hidden.device)
    backend.check_sizes(B * T, V)  # a vocab-parallel shard: V is its rows, all the kernels index
    return backend


def _scored(model, rows, detach=False):
    """The model's scored rows [N, D] (inputs.Rows; row-contiguous), its weight and bias contiguous, its transform's
    numbers as floats; ``detach``: none of them takes a gradient (the teacher)."""
    hidden = row_values(model.hidden.reshape(-1, model.hidden.shape[-1]), rows)
    hidden = hidden if hidden.stride(-1) == 1 else hidden.contiguous()
    weight, bias = (x.contiguous() if x is not None else None for x in model[1:3])
    if detach:
        hidden, weight, bias = (x.detach() if x is not None else None for x in (hidden, weight, bias))
    return ModelHead(hidden, weight, bias, LogitTransform.from_floats(*model.transform.as_floats()))


# ----------------------------------------------------------------------------------------------- one checked call
@dataclass(frozen=True)
class _Call:
    """A checked call of the public functions: both models' scored rows and what the path takes."""

    student: ModelHead  # the scored rows [N, Ds], the weight and bias contiguous
    teacher: ModelHead  # detached
    shard: VocabShard | None
    backend: Backend
    rows: Rows
    shape: tuple[int, int]  # (B, T)
    beta: float
    head_path: str
    frozen_head: bool  # only the student's hidden states need a gradient, on the "auto" path
    student_gemm_dtype: torch.dtype | None


def _checked_call(student_hidden, student_weight, teacher_hidden, teacher_weight, completion_mask, keywords):
    """Every check of a call (``_checked``'s and the scored rows' one host read), and its _Call; ``keywords``:
    divergence_and_entropy's (the public functions take no other: ``takes_keywords``), its defaults where absent."""
    k = {**_KEYWORDS, **keywords}
    student, teacher, shard = parallel.resolve_pair(
        ModelHead(
            student_hidden,
            student_weight,
            k["student_bias"],
            LogitTransform(k["temperature"], k["student_softcap"], k["student_logit_scale"]),
        ),
        ModelHead(
            teacher_hidden,
            teacher_weight,
            k["teacher_bias"],
            LogitTransform(k["temperature"], k["teacher_softcap"], k["teacher_logit_scale"]),
        ),
        k["vocab_parallel"],
    )
    gemm_dtype = k["student_gemm_dtype"]
    if gemm_dtype is not None and gemm_dtype not in FLOAT_DTYPES:
        raise TypeError(f"student_gemm_dtype must be None, float32, bfloat16 or float16, got {gemm_dtype!r}")
    checks = ValueChecks(k["check_values"], student.hidden, teacher.hidden, completion_mask)
    beta = k["beta"]
    backend = _checked(student, teacher, completion_mask, beta, k["backend"], checks, sharded=shard is not None)
    head_path = k["head_path"]
    if head_path not in HEAD_PATHS:
        raise ValueError(f"head_path must be one of {HEAD_PATHS}, got {head_path!r}")
    frozen_head = (
        head_path == "auto"
        and torch.is_grad_enabled()
        and student.hidden.requires_grad
        and not student.weight.requires_grad
        and not (student.bias is not None and student.bias.requires_grad)
    )
    shape = tuple(student.hidden.shape[:2])
    rows = scored_rows(completion_mask, checks)
    if shard is not None and gemm_dtype is not None:
        # vocab-parallel heads: a differentiable cast of both (the op casts inside, with fp32 gradients)
        student = student._replace(hidden=student.hidden.to(gemm_dtype), weight=student.weight.to(gemm_dtype))
    student, teacher = _scored(student, rows), _scored(teacher, rows, detach=True)
    return _Call(student, teacher, shard, backend, rows, shape, float(beta), head_path, frozen_head, gemm_dtype)


def _operands(call):
    """The divergence ops' OpOperands of a call on whole heads."""
    dtype = call.student_gemm_dtype or call.student.hidden.dtype
    return divergence_ops.OpOperands.from_heads(call.student, call.teacher, call.beta, call.backend.name, dtype)


def _per_token(call):
    """(divergence [N], entropy [N]) of the scored rows, the divergence differentiable."""
    if call.shard is not None:
        div, entropy, _ = parallel.VocabParallelDivergence.apply(
            *call.student[:3],
            *call.teacher[:3],
            call.beta,
            call.student.transform,
            call.teacher.transform,
            call.shard,
            call.frozen_head,
            call.backend.name,
        )
        return div, entropy
    div, entropy, _, _, _ = divergence_ops.divergence_forward(_operands(call), call.frozen_head)
    return div, entropy


# ----------------------------------------------------------------------------------------------- public
class DivergenceKeywords(TypedDict, total=False):
    """``divergence``'s keywords (``**keywords: Unpack[DivergenceKeywords]``, PEP 692): those of
    ``divergence_and_entropy``, which documents them and their defaults; an IDE and a type checker see each name and
    type."""

    beta: float
    temperature: float
    student_bias: torch.Tensor | None
    teacher_bias: torch.Tensor | None
    student_softcap: float | None
    teacher_softcap: float | None
    student_logit_scale: float
    teacher_logit_scale: float
    backend: BackendName
    head_path: HeadPath
    check_values: bool
    vocab_parallel: VocabShard | None
    student_gemm_dtype: torch.dtype | None


@takes_keywords()
def divergence_and_entropy(
    student_hidden: torch.Tensor,
    student_weight: torch.Tensor,
    teacher_hidden: torch.Tensor,
    teacher_weight: torch.Tensor,
    completion_mask: torch.Tensor | None = None,
    *,
    beta: float = 1.0,
    temperature: float = 1.0,
    student_bias: torch.Tensor | None = None,
    teacher_bias: torch.Tensor | None = None,
    student_softcap: float | None = None,
    teacher_softcap: float | None = None,
    student_logit_scale: float = 1.0,
    teacher_logit_scale: float = 1.0,
    backend: BackendName = "auto",
    head_path: HeadPath = "auto",
    check_values: bool = True,
    vocab_parallel: VocabShard | None = None,
    student_gemm_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token divergence between a student and a teacher head, and the student's entropy, without logits.

    TRL 1.16's ``DistillationTrainer`` divergence: each model's logit is ``softcap * tanh(logit_scale * (h . W + b)
    / softcap) / temperature`` with its own soft-cap and scale (TRL's order). Only tokens with completion_mask 1
    are computed; masked positions are exact zeros and their hidden states are never read. The teacher never gets
    a gradient. Vocab-parallel heads: both weights DTensors sharded on dim 0 by the same ranges (biases alike), or
    this rank's rows of both with ``vocab_parallel``; the hidden states replicated. Every rank returns the
    unsharded result; dW and db are this rank's rows; neither weight is gathered.

    Args:
        student_hidden: [B, T, Ds] float32, bfloat16 or float16; position t predicts the next token.
        student_weight: [V, Ds] student lm_head weight, student_hidden's dtype (or fp32 over bf16 / fp16).
        teacher_hidden: [B, T, Dt] float32, bfloat16 or float16.
        teacher_weight: [V, Dt] teacher lm_head weight, teacher_hidden's dtype (or fp32 over bf16 / fp16).
        completion_mask: [B, T] bool or 0/1: the tokens computed; None: every token.
        beta: in [0, 1]: 0 forward KL(teacher || student), 1 reverse KL(student || teacher), between: the
            generalized JSD (TRL's ``DistillationConfig.beta``).
        temperature: divides both models' logits (> 0).
        student_bias: [V] in student_hidden's dtype, or None.
        teacher_bias: [V] in teacher_hidden's dtype, or None.
        student_softcap: the student's soft-cap (> 0), or None: no tanh.
        teacher_softcap: the teacher's soft-cap (> 0), or None: no tanh.
        student_logit_scale: multiplies the student's raw logits (non-zero).
        teacher_logit_scale: multiplies the teacher's raw logits (non-zero).
        backend: "auto", "triton" or "torch", as in ``loss``; with vocab-parallel heads each rank runs its
            kernels on its rows.
        head_path: "auto": with a frozen student head (only student_hidden requires a gradient: LoRA, a frozen
            lm_head) the forward also builds d divergence / d student_hidden, so the backward needs no vocabulary
            sweep; "general": always recompute in the backward.
        check_values: read the mask's 0/1 check with the scored-row count in one host synchronisation; False
            reads nothing on the host (the rows are then a device partition, padding zeroed).
        vocab_parallel: a ``grpo_fast.VocabShard`` when both weights hold this rank's rows (the same
            ranges); None: whole heads, or DTensor weights.
        student_gemm_dtype: float32, bfloat16 or float16: the student's hidden states and weight are rounded to it
            for the GEMMs (autocast's dtype over an fp32 model, as TRL's head computes) and their gradients still
            come back in their own dtype, from fp32 accumulators, not rounded to it; None: their own dtype.
            Vocab-parallel heads take it as a differentiable cast of both (their gradients rounded to it).

    Returns:
        divergence: [B, T] float32, differentiable with respect to the student's hidden states, weight and bias.
        entropy: [B, T] float32, the student's entropy, detached (as TRL's head gives it).

    Raises:
        TypeError: a tensor argument that is not a tensor, a float argument not float32/bfloat16/float16, a
            weight whose dtype is neither its hidden states' nor fp32 over bf16 / fp16 ones, or a
            ``student_gemm_dtype`` that is not None, float32, bfloat16 or float16.
        ValueError: a shape that does not match (B, T or V differing between the models), tensors on different
            devices, a mask value other than 0/1 (with ``check_values``), a beta outside [0, 1], a bad
            temperature, soft-cap or logit scale, an unknown ``backend`` or ``head_path``, sizes the Triton
            kernels cannot index, or vocab-parallel heads that are not sharded alike.
    """
    call = _checked_call(
        student_hidden,
        student_weight,
        teacher_hidden,
        teacher_weight,
        completion_mask,
        dict(
            beta=beta,
            temperature=temperature,
            student_bias=student_bias,
            teacher_bias=teacher_bias,
            student_softcap=student_softcap,
            teacher_softcap=teacher_softcap,
            student_logit_scale=student_logit_scale,
            teacher_logit_scale=teacher_logit_scale,
            backend=backend,
            head_path=head_path,
            check_values=check_values,
            vocab_parallel=vocab_parallel,
            student_gemm_dtype=student_gemm_dtype,
        ),
    )
    div, entropy = _per_token(call)
    B, T = call.shape
    return scatter_rows(div, call.rows, (B, T)), scatter_rows(entropy, call.rows, (B, T)).detach()


# divergence_and_entropy's keywords and their defaults: the one place they are written is its signature
_KEYWORDS = dict(inspect.unwrap(divergence_and_entropy).__kwdefaults__)


@takes_keywords(DivergenceKeywords, "divergence_and_entropy's keywords")
def divergence(
    student_hidden: torch.Tensor,
    student_weight: torch.Tensor,
    teacher_hidden: torch.Tensor,
    teacher_weight: torch.Tensor,
    completion_mask: torch.Tensor | None = None,
    **keywords: Unpack[DivergenceKeywords],
) -> torch.Tensor:
    """The per-token divergence alone: ``divergence_and_entropy``'s first output.

    Args:
        student_hidden: [B, T, Ds] float32, bfloat16 or float16.
        student_weight: [V, Ds] student lm_head weight, student_hidden's dtype (or fp32 over bf16 / fp16).
        teacher_hidden: [B, T, Dt] float32, bfloat16 or float16.
        teacher_weight: [V, Dt] teacher lm_head weight, teacher_hidden's dtype (or fp32 over bf16 / fp16).
        completion_mask: [B, T] bool or 0/1; None: every token.
        **keywords: ``divergence_and_entropy``'s keywords (DivergenceKeywords), with its defaults.

    Returns:
        [B, T] float32, differentiable with respect to the student's hidden states, weight and bias.

    Raises:
        TypeError: as ``divergence_and_entropy``, or a keyword it does not take.
        ValueError: as ``divergence_and_entropy``.
    """
    return divergence_and_entropy(
        student_hidden, student_weight, teacher_hidden, teacher_weight, completion_mask, **keywords
    )[0]


@takes_keywords(DivergenceKeywords, "divergence_and_entropy's keywords")
def distillation_loss(
    student_hidden: torch.Tensor,
    student_weight: torch.Tensor,
    teacher_hidden: torch.Tensor,
    teacher_weight: torch.Tensor,
    completion_mask: torch.Tensor | None = None,
    *,
    num_items_in_batch: float | torch.Tensor | None = None,
    token_chunk: int | None = None,
    **keywords: Unpack[DivergenceKeywords],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """TRL 1.16's distillation loss: the divergence summed over the scored tokens, divided by ``num_items_in_batch``
    or by their count (``DistillationTrainer``'s ``_chunked_divergence_loss``), in the fewest vocabulary sweeps.

    Its dL/d divergence is known before the forward, so the forward forms the student's gradients while each token
    chunk's logits are in hand: both models' logits of a chunk once (cuBLAS, fp32 products), their records, the
    divergence and g, then dH and dW; the backward only scales them. Three student sweeps and one teacher sweep,
    where ``divergence(...)`` then a reduction takes four and two (five and three for the JSD). Only the gradients
    asked for are formed (a frozen student head: dH alone). The torch backend, vocab-parallel heads and
    ``head_path="general"`` compute it as ``divergence_and_entropy`` then the same sum.

    Args:
        student_hidden: [B, T, Ds] float32, bfloat16 or float16.
        student_weight: [V, Ds] student lm_head weight, student_hidden's dtype (or fp32 over bf16 / fp16).
        teacher_hidden: [B, T, Dt] float32, bfloat16 or float16.
        teacher_weight: [V, Dt] teacher lm_head weight, teacher_hidden's dtype (or fp32 over bf16 / fp16).
        completion_mask: [B, T] bool or 0/1: the tokens scored; None: every token.
        num_items_in_batch: the divisor, a number > 0 or a one-element tensor (the gradient-accumulation window's
            token count); None: the scored tokens' count (at least 1).
        token_chunk: tokens per gradient GEMM (a positive int): the buffers are token_chunk x V x (2 + 4) bytes (g in
            the student's dtype, 4 + 4 from fp32; both models' fp32 logits for half of it). None: half the student's
            width rounded down to 128 (384 at Qwen2.5-0.5B's Ds 896). Only where the fused loss runs (the Triton
            backend, whole heads, ``head_path="auto"``).
        **keywords: ``divergence_and_entropy``'s keywords (DivergenceKeywords), with its defaults.

    Returns:
        loss: the differentiable float32 scalar.
        divergence: [B, T] float32, detached: the per-token divergence (zeros off the mask).
        entropy: [B, T] float32, detached: the student's entropy.

    Raises:
        TypeError: as ``divergence_and_entropy``; ``num_items_in_batch`` a tensor of more than one element.
        ValueError: as ``divergence_and_entropy``; ``num_items_in_batch`` not a positive number (a tensor's value
            is not read: no host synchronisation); ``token_chunk`` not a positive int, or given where it sizes
            nothing (the torch backend, vocab-parallel heads, ``head_path="general"``).
    """
    check_chunk("token_chunk", token_chunk, "tokens per gradient GEMM")
    check_num_items_in_batch(num_items_in_batch)
    call = _checked_call(student_hidden, student_weight, teacher_hidden, teacher_weight, completion_mask, keywords)
    weights = token_weights(call.rows, call.student.hidden, num_items_in_batch)
    fused = call.shard is None and call.head_path == "auto" and call.backend.three_sweep_heads
    if token_chunk is not None and not fused:
        raise ValueError(
            "token_chunk sizes the fused loss, which the torch backend, vocab-parallel heads and "
            "head_path='general' do not run"
        )
    if fused:
        grad = torch.is_grad_enabled()
        needs = tuple(grad and x is not None and x.requires_grad for x in call.student[:3])
        loss, div, entropy = divergence_ops.divergence_loss(_operands(call), weights, needs, token_chunk)
    else:
        div, entropy = _per_token(call)
        loss = (weights * div).sum()
        div = div.detach()
    B, T = call.shape
    return loss, scatter_rows(div, call.rows, (B, T)), scatter_rows(entropy, call.rows, (B, T)).detach()


def check_num_items_in_batch(num_items_in_batch):
    """A distillation loss's divisor: None, a number > 0 or a one-element tensor (its value not read)."""
    if isinstance(num_items_in_batch, torch.Tensor):
        if num_items_in_batch.numel() != 1:
            raise TypeError(
                "num_items_in_batch must be a number or a one-element tensor, got shape "
                f"{tuple(num_items_in_batch.shape)}"
            )
    elif num_items_in_batch is not None:
        check_number("num_items_in_batch", num_items_in_batch, lambda v: v > 0, "a positive number of tokens")


def token_weights(rows, like, num_items_in_batch):
    """dL/d div of each scored row [N] fp32 (``rows``; ``like``: any tensor of those N rows, on their device): 1 /
    num_items_in_batch, or 1 / the scored tokens' count (at least 1); 0 on a device partition's padding rows. No host
    read."""
    ones = torch.ones(like.shape[0], dtype=torch.float32, device=like.device)
    if isinstance(num_items_in_batch, torch.Tensor):
        weights = ones / num_items_in_batch.to(device=like.device, dtype=torch.float32).reshape(1)
    elif num_items_in_batch is not None:
        weights = ones / float(num_items_in_batch)
    else:
        count = rows.count.float() if rows.keep is not None else ones.sum()
        weights = ones / count.clamp(min=1.0)
    return torch.where(rows.keep, weights, 0.0) if rows.keep is not None else weights
