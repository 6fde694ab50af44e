"""Distillation from a served teacher: ``grpo_fast.served_divergence_and_entropy`` and
``grpo_fast.served_distillation_loss``, TRL 1.16's ``trl.experimental`` distillation trainers' divergence from a
teacher's top-k log-probs (``ServedTeacher``) without the student's logits.

    teacher = grpo_fast.ServedTeacher(topk_ids, topk_logprobs)        # [B, T, K] each, -1 filling
    loss, div, entropy = grpo_fast.served_distillation_loss(hidden, weight, teacher, completion_mask)

The student's side is a log-prob head at K ids a token: its logits there (``head.gathered``: a gather of K weight
rows, no vocabulary sweep) and its log-sum-exp and entropy (layer 1's op, one sweep; its log-prob of a target
outside the vocabulary is -lse), then the sparse divergence on [N, K + 1] values (``served.teacher``). Backward:
the sparse part through the gathered rows, the dense part (a multiple of the softmax) through layer 1's backward,
whose frozen-head path (only the hidden states need a gradient) builds d lse / d hidden in the forward.
"""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass
from typing import Literal, TypedDict, get_args

import torch
from typing_extensions import Unpack

from grpo_fast.backends.protocol import BackendName, HeadOperands
from grpo_fast.distillation.api import check_num_items_in_batch, token_weights
from grpo_fast.distillation.teacher import check_coef_and_beta
from grpo_fast.head import inputs, ops, paths
from grpo_fast.head import vocab_parallel as vocab_parallel_head
from grpo_fast.head.api import logprobs_and_entropy_rows
from grpo_fast.head.gathered import gathered_logits
from grpo_fast.head.keywords import takes_keywords
from grpo_fast.head.lora import HeadLora
from grpo_fast.head.shard import VocabShard
from grpo_fast.head.transform import check_chunk, check_number
from grpo_fast.kernels.config import HeadPath
from grpo_fast.served import ops as served_ops
from grpo_fast.served import teacher as served_teacher
from grpo_fast.served import vocab_parallel as served_vocab_parallel
from grpo_fast.served.teacher import ServedTeacher

# a teacher's log-prob may round above 0 by this much (a near-certain token from a server's fp32 log-softmax)
LOGPROB_SLACK = 1e-4
# a teacher's summed probability over its listed ids may exceed 1 by this much, by its log-probs' dtype
MASS_SLACK = {torch.float32: 1e-3, torch.bfloat16: 2e-2, torch.float16: 5e-3}


# the support of a token: TRL's rule by beta (the listed ids at beta 0, the teacher's top-1 and the sampled token
# otherwise), or the listed ids whatever beta
ServedSupport = Literal["trl", "listed"]
SUPPORTS: tuple[str, ...] = get_args(ServedSupport)


def _check_teacher(teacher, call: inputs.HeadCall, narrows, targets_given):
    """Named errors for ``teacher`` (a ServedTeacher) against the student's call; its value checks queued on the
    call's checks (read with the scored rows, one host synchronisation)."""
    if not isinstance(teacher, ServedTeacher):
        raise TypeError(
            f"teacher must be a grpo_fast.ServedTeacher (top-k ids and log-probs), got {type(teacher).__name__}; "
            "a teacher given by its hidden states and lm_head is grpo_fast.distillation_loss's"
        )
    ids, logprobs = teacher.ids, teacher.logprobs
    inputs.check_tensor("teacher.ids", ids)
    if ids.dtype.is_floating_point or ids.dtype == torch.bool or ids.is_complex():
        raise TypeError(f"teacher.ids must be an integer tensor of token ids (-1: no entry), got {ids.dtype}")
    inputs.check_float_tensor("teacher.logprobs", logprobs)
    if not isinstance(teacher.add_tail_bucket, bool):
        raise TypeError(f"teacher.add_tail_bucket must be a bool, got {teacher.add_tail_bucket!r}")
    if teacher.temperature is not None:
        check_number("teacher.temperature", teacher.temperature, lambda v: v > 0, "None or a positive number")
        if teacher.add_tail_bucket and float(teacher.temperature) != call.transform.temperature:
            raise ValueError(
                f"teacher.temperature {teacher.temperature} differs from the divergence's temperature "
                f"{call.transform.temperature}: a tail bucket needs the teacher's mass outside its ids at the "
                "divergence's temperature, which top-k log-probs do not carry (add_tail_bucket=False renormalises "
                "over the ids, exact at any temperature; or serve the teacher at the divergence's temperature)"
            )
    B, T = call.shape
    if ids.dim() != 3 or tuple(ids.shape[:2]) != (B, T) or ids.shape[2] == 0:
        raise ValueError(f"teacher.ids must have shape [B, T, K] = [{B}, {T}, K] with K >= 1, got {tuple(ids.shape)}")
    if tuple(logprobs.shape) != tuple(ids.shape):
        raise ValueError(
            f"teacher.logprobs must have teacher.ids' shape {tuple(ids.shape)}, got {tuple(logprobs.shape)}"
        )
    device = call.hidden.device
    inputs.check_same_device([("teacher.ids", ids), ("teacher.logprobs", logprobs)], device, "student_hidden")
    if narrows and not targets_given:
        raise ValueError(
            "targets (the sampled tokens) are needed for beta != 0: the support is then the teacher's top-1 and "
            "the sampled token (support='listed': the listed ids, whatever beta)"
        )
    checks = call.checks
    if not checks.run:
        return
    V = call.weight.shape[0] if call.shard is None else call.shard.vocab_size
    scored = (
        torch.ones((B, T), dtype=torch.bool, device=device)
        if call.completion_mask is None
        else call.completion_mask.bool()
    )
    ids = ids.to(torch.int64)
    outside = scored[..., None] & ((ids < -1) | (ids >= V))
    checks.add(
        [outside.any(), torch.where(outside, ids, 0).min(), torch.where(outside, ids, 0).max()],
        lambda _, lo, hi: ValueError(
            f"teacher.ids must hold token ids in [0, V) = [0, {V}) or -1 where completion_mask is 1, got values in "
            f"[{lo}, {hi}]"
        ),
    )
    listed = scored[..., None] & (ids >= 0)
    lp = logprobs.float()
    above = listed & (lp > LOGPROB_SLACK)
    position = above.any(-1).reshape(-1).int().argmax()
    checks.add(
        [above.any(), position // T, position % T],
        lambda _, b, t: ValueError(f"teacher.logprobs[{b}, {t}] holds a log-prob above 0: not a log-probability"),
    )
    mass = torch.where(listed, lp.exp(), 0.0).sum(-1)
    heavy = mass > 1.0 + MASS_SLACK[logprobs.dtype]
    position = heavy.reshape(-1).int().argmax()
    checks.add(
        [heavy.any(), position // T, position % T],
        lambda _, b, t: ValueError(
            f"teacher.logprobs[{b}, {t}] sum to a probability above 1 over its ids: not one distribution's "
            "log-probs (at one temperature)"
        ),
    )
    ordered = ids.sort(dim=-1).values
    repeated = scored & ((ordered[..., 1:] == ordered[..., :-1]) & (ordered[..., 1:] >= 0)).any(-1)
    checks.add([repeated.any()], lambda _: ValueError("teacher.ids holds an id twice in one token's list"))
    if narrows:
        # the teacher's top-1 is read as entry 0: the lists must be rank-sorted (a server's prompt_logprobs, sorted
        # by rank, as TRL's client parses them)
        unsorted = listed & (lp > lp[..., :1]) | (scored & (ids[..., 0] < 0) & (ids >= 0).any(-1))[..., None]
        checks.add(
            [unsorted.any()],
            lambda _: ValueError(
                "teacher.ids must be rank-sorted at beta != 0 (entry 0 the teacher's top-1, its largest log-prob)"
            ),
        )


class ServedKeywords(TypedDict, total=False):
    """``served_distillation_loss``' keywords: those of ``served_divergence_and_entropy``, which documents them."""

    targets: torch.Tensor | None
    beta: float
    temperature: float
    student_bias: torch.Tensor | None
    student_softcap: float | None
    student_logit_scale: float
    lora: HeadLora | tuple | None
    backend: BackendName
    head_path: HeadPath
    check_values: bool
    support: ServedSupport
    vocab_parallel: VocabShard | None


@dataclass(frozen=True)
class _ServedCall:
    """A checked call: layer 1's (the student), its scored rows and their operands, the support of each row."""

    call: inputs.HeadCall
    rows: inputs.Rows
    head: HeadOperands  # the scored rows; targets: the sampled tokens (placeholders at beta 0)
    support: served_teacher.Support
    beta: float
    add_tail_bucket: bool

    @classmethod
    def check(cls, student_hidden, student_weight, teacher, completion_mask, keywords) -> _ServedCall:
        k = {**_KEYWORDS, **keywords}
        beta = k["beta"]
        check_number(
            "beta",
            beta,
            lambda v: 0.0 <= v <= 1.0,
            "a number in [0, 1] (0: forward KL(teacher || student) over the teacher's top-k, 1: reverse KL at the "
            "sampled token)",
        )
        beta = float(beta)
        if k["support"] not in SUPPORTS:
            raise ValueError(f"support must be one of {SUPPORTS}, got {k['support']!r}")
        narrows = beta != 0.0 and k["support"] == "trl"
        targets = k["targets"]
        if targets is None:
            inputs.check_tensor("student_hidden", student_hidden)
            shape = tuple(student_hidden.shape[:2]) if student_hidden.dim() == 3 else (0, 0)
            targets = torch.zeros(shape, dtype=torch.int64, device=student_hidden.device)
        call = inputs.HeadCall.check(
            student_hidden,
            student_weight,
            targets,
            completion_mask,
            bias=k["student_bias"],
            temperature=k["temperature"],
            softcap=k["student_softcap"],
            logit_scale=k["student_logit_scale"],
            lora=k["lora"],
            vocab_parallel=k["vocab_parallel"],
            backend=k["backend"],
            check_values=k["check_values"],
            head_path=k["head_path"],
        )
        if call.shard is not None and call.lora is not None:
            raise ValueError("lora with vocab_parallel is not supported by the served divergence")
        _check_teacher(teacher, call, narrows, k["targets"] is not None)
        return cls.of(call, call.rows(), teacher, beta, narrows)

    @classmethod
    def of(cls, call: inputs.HeadCall, rows: inputs.Rows, teacher: ServedTeacher, beta, narrows) -> _ServedCall:
        """The served divergence of a checked call's scored ``rows`` (the teacher checked against it, its value
        checks read with the rows); ``narrows``: TRL's support at beta != 0 (else the listed ids)."""
        head = call.operands(rows)
        K = teacher.ids.shape[-1]
        ids = inputs.row_values(teacher.ids.reshape(-1, K), rows).to(torch.int64)
        if rows.keep is not None:  # a device partition's padding rows: no teacher entries
            ids = torch.where(rows.keep[:, None], ids, -1)
        logprobs = inputs.row_values(teacher.logprobs.reshape(-1, K), rows)
        support = served_teacher.support(ids, logprobs, head.targets, beta if narrows else 0.0)
        support = support._replace(ids=support.ids.contiguous())
        if teacher.temperature is not None and float(teacher.temperature) != call.transform.temperature:
            # log p at T_s, times T_s / T and renormalised over the support (no tail bucket): p at T there
            ratio = float(teacher.temperature) / call.transform.temperature
            support = support._replace(teacher=support.teacher * ratio)
        return cls(call, rows, head, support, beta, teacher.add_tail_bucket)

    def anchors(self):
        """[N] each row's anchor: its support's first valid id (the teacher's top-1, or the sampled token; 0 where
        it has none), and [N, 1] that entry's column."""
        first = self.support.valid.int().argmax(-1, keepdim=True)
        anchor = torch.where(self.support.valid.any(-1), self.support.ids.gather(-1, first)[:, 0], 0)
        return anchor, first

    def per_token(self):
        """(divergence [N], entropy [N]) of the scored rows, the divergence differentiable (autograd through the
        gathered logits' op and layer 1's)."""
        call, head, support = self.call, self.head, self.support
        if call.shard is not None:
            student_logits = served_vocab_parallel.gathered_logits(head, support.ids, call.backend, call.shard)
        else:
            student_logits = gathered_logits(head, support.ids, call.backend.name)
        # the row's log-sum-exp as z_a - logp_a at an anchor a in the support: layer 1's log-prob there, its logit
        # gathered above; d lse = p (the anchor's columns cancel), a likely token so that p_a is not a rounding
        # error beside 1
        anchor, first = self.anchors()
        at_anchor = head._replace(targets=anchor)
        if call.shard is not None:
            logp_anchor, entropy = vocab_parallel_head.linear_logprobs(
                at_anchor, call.backend, call.shard, call.head_path, call.backward_mode
            )
        else:
            logp_anchor, entropy = ops.linear_logprobs_path(
                at_anchor, call.backend, call.head_path, call.backward_mode, row_count=self.rows.count
            )
        lse = None
        if self.add_tail_bucket:
            lse = torch.where(support.valid.any(-1), student_logits.gather(-1, first)[:, 0] - logp_anchor, 0.0)
        div = served_teacher.divergence(student_logits, lse, support, self.beta, self.add_tail_bucket)
        if self.rows.keep is not None:
            div = torch.where(self.rows.keep, div, 0.0)
        return div, entropy.detach()

    def teacher_entropy(self):
        """[N] fp32: the teacher's entropy over each scored row's support, as the divergence sees it (with its tail
        bucket, or renormalised; at the divergence's temperature): TRL's ``teacher_entropy`` metric
        (``served.teacher.teacher_entropy``); 0 where the teacher lists nothing and on a device partition's padding
        rows."""
        return served_teacher.teacher_entropy(self.support, self.add_tail_bucket)

    def loss(self, num_items_in_batch, token_chunk):
        """``served_distillation_loss``' outputs: (loss, divergence [N], entropy [N]), the last two detached."""
        weights = token_weights(self.rows, self.head.hidden, num_items_in_batch)
        fused = self.fused_loss(weights, token_chunk)
        if fused is not None:
            return fused
        if token_chunk is not None:
            raise ValueError(
                "token_chunk sizes the three-sweep trained head, which this call does not run (it needs the Triton "
                "backend, a trained weight, no LoRA, bf16 or fp32, head_path='auto')"
            )
        div, entropy = self.per_token()
        return (weights * div).sum(), div.detach(), entropy

    def fused_loss(self, weights, token_chunk):
        """(loss, divergence [N], entropy [N]) by the three-sweep trained head (``served.ops``), or None where it is
        not taken (``paths.takes_trained_head``)."""
        call, head = self.call, self.head
        grad = torch.is_grad_enabled()
        needs = [grad and x is not None and x.requires_grad for x in head[:4]]
        if call.shard is not None or not paths.takes_trained_head(
            needs, head.hidden, call.backend, call.head_path, head.lora is not None
        ):
            return None
        anchor, _ = self.anchors()
        transform = head.transform.as_floats()
        need_weight = needs[1] or needs[3]
        operands = served_ops.ServedLossOperands(
            head.hidden, head.weight, anchor, head.bias, *transform, *self.support, weights.contiguous(), self.beta,
            self.add_tail_bucket, token_chunk or 0, need_weight, call.backend.name,
        )  # fmt: skip
        return served_ops.served_trained_loss(operands)


@takes_keywords()
def served_divergence_and_entropy(
    student_hidden: torch.Tensor,
    student_weight: torch.Tensor,
    teacher: ServedTeacher,
    completion_mask: torch.Tensor | None = None,
    *,
    targets: torch.Tensor | None = None,
    beta: float = 0.0,
    temperature: float = 1.0,
    student_bias: torch.Tensor | None = None,
    student_softcap: float | None = None,
    student_logit_scale: float = 1.0,
    lora: HeadLora | tuple | None = None,
    backend: BackendName = "auto",
    head_path: HeadPath = "auto",
    check_values: bool = True,
    support: ServedSupport = "trl",
    vocab_parallel: VocabShard | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token divergence between a student head and a teacher served as top-k log-probs, and the student's
    entropy, without the student's logits.

    TRL 1.16's ``AsyncDistillationTrainer`` (and ``ServerDistillationTrainer``): at beta 0 the forward KL over the
    teacher's listed ids, at beta != 0 over the teacher's top-1 and the sampled token (beta 1: the sampled token
    alone), each with a tail bucket holding the rest of the mass (``teacher.add_tail_bucket``) or renormalised over
    the support (``grpo_fast.served.teacher`` gives the math). The student's logit is ``softcap * tanh(logit_scale *
    (h . W + b) / softcap) / temperature``. Only tokens with completion_mask 1 are computed; a token without any
    teacher entry has divergence 0 and no gradient.

    Args:
        student_hidden: [B, T, D] float32, bfloat16 or float16; position t predicts the token the teacher scored at t.
        student_weight: [V, D] the student's lm_head weight, student_hidden's dtype (or fp32 over bf16 / fp16).
        teacher: a ``ServedTeacher``: ids and log-probs [B, T, K] (-1 filling), ``add_tail_bucket``.
        completion_mask: [B, T] bool or 0/1: the tokens computed; None: every token.
        targets: [B, T] integer: the sampled tokens; needed at beta != 0 (the support holds them), unread at 0.
        beta: in [0, 1] (TRL's ``AsyncDistillationConfig.beta``, default 0: forward KL).
        temperature: divides the student's logits (> 0): the temperature the teacher's log-probs were served at.
        student_bias: [V] in student_hidden's dtype, or None.
        student_softcap: the student's soft-cap (> 0), or None.
        student_logit_scale: multiplies the student's raw logits (non-zero).
        lora: LoRA on the student's lm_head (a HeadLora or tuple), or None.
        backend: "auto", "triton" or "torch", as in ``loss``.
        head_path: "auto": with a frozen student head (only student_hidden requires a gradient) the forward also
            builds d lse / d hidden, so the backward needs no vocabulary sweep; "general": always recompute.
        check_values: read the value checks on the host in one synchronisation: those of ``logprobs`` (targets,
            mask), and teacher ids in [-1, V), each once in a token's list, log-probs at most 0, their mass at most
            1, rank-sorted lists at beta != 0. False: nothing is read.
        support: "trl": TRL's support by beta (above); "listed": the listed ids whatever beta (a wider support for
            the reverse KL and the JSD, where the listed ids hold the student's mass; targets unread).
        vocab_parallel: this rank's VocabShard when the weight (and bias) hold this rank's rows, or None
            (docs/vocab-parallel.md: the ids gathered on their owners, one all-reduce of [N, K]; no
            LoRA). Every rank passes the same hidden states and teacher and gets the whole result.

    Returns:
        divergence: [B, T] float32, differentiable with respect to the student's hidden states, weight, bias and LoRA.
        entropy: [B, T] float32, the student's entropy over the whole vocabulary, detached.

    Raises:
        TypeError: as ``logprobs_and_entropy``; a teacher that is not a ServedTeacher, integer ids or float log-probs
            of another dtype, a keyword it does not take.
        ValueError: as ``logprobs_and_entropy``; teacher tensors of a shape other than [B, T, K], a beta outside
            [0, 1], beta != 0 without targets (TRL's support), an unknown ``support``, a teacher temperature other
            than the divergence's with a tail bucket, and (with ``check_values``) the value checks above.
    """
    served = _ServedCall.check(
        student_hidden,
        student_weight,
        teacher,
        completion_mask,
        dict(
            targets=targets,
            beta=beta,
            temperature=temperature,
            student_bias=student_bias,
            student_softcap=student_softcap,
            student_logit_scale=student_logit_scale,
            lora=lora,
            backend=backend,
            head_path=head_path,
            check_values=check_values,
            support=support,
            vocab_parallel=vocab_parallel,
        ),
    )
    div, entropy = served.per_token()
    return served.call.scattered(div, served.rows), served.call.scattered(entropy, served.rows)


# served_divergence_and_entropy's keywords and their defaults: the one place they are written is its signature
_KEYWORDS = dict(inspect.unwrap(served_divergence_and_entropy).__kwdefaults__)


@takes_keywords(ServedKeywords, "served_divergence_and_entropy's keywords")
def served_distillation_loss(
    student_hidden: torch.Tensor,
    student_weight: torch.Tensor,
    teacher: ServedTeacher,
    completion_mask: torch.Tensor | None = None,
    *,
    num_items_in_batch: float | torch.Tensor | None = None,
    token_chunk: int | None = None,
    **keywords: Unpack[ServedKeywords],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """TRL 1.16's served-teacher distillation loss: the divergence summed over the scored tokens, divided by
    ``num_items_in_batch`` or by their count (``AsyncDistillationTrainer``'s tokens a rank at one process and no
    accumulation; ``ServerDistillationTrainer``'s batch mean).

    Its dL/d divergence is known before the forward, so with a trained student head (the weight requires a
    gradient; the Triton backend, no LoRA, bf16 or fp32) the forward forms the gradients in the three vocabulary
    sweeps of layer 1's trained head (``served.ops``); the backward only scales them. Otherwise (a frozen head: two
    sweeps, the frozen-head path; the torch backend; LoRA) ``served_divergence_and_entropy`` then the same sum.

    Args:
        student_hidden: [B, T, D] float32, bfloat16 or float16.
        student_weight: [V, D] the student's lm_head weight, student_hidden's dtype (or fp32 over bf16 / fp16).
        teacher: a ``ServedTeacher``.
        completion_mask: [B, T] bool or 0/1: the tokens scored (and counted); None: every token.
        num_items_in_batch: the divisor, a number > 0 or a one-element tensor (the gradient-accumulation window's
            token count); None: the scored tokens' count (at least 1).
        token_chunk: tokens per chunk of the three-sweep trained head (a positive int); None: its default. Only
            where that head runs.
        **keywords: ``served_divergence_and_entropy``'s keywords (ServedKeywords), with its defaults.

    Returns:
        loss: the differentiable float32 scalar.
        divergence: [B, T] float32, detached (zeros off the mask).
        entropy: [B, T] float32, detached: the student's entropy.

    Raises:
        TypeError: as ``served_divergence_and_entropy``; ``num_items_in_batch`` a tensor of more than one element.
        ValueError: as ``served_divergence_and_entropy``; ``num_items_in_batch`` not a positive number;
            ``token_chunk`` not a positive int, or given where the three-sweep head does not run.
    """
    check_chunk("token_chunk", token_chunk, "tokens per chunk of the trained head")
    check_num_items_in_batch(num_items_in_batch)
    served = _ServedCall.check(student_hidden, student_weight, teacher, completion_mask, keywords)
    loss, div, entropy = served.loss(num_items_in_batch, token_chunk)
    call, rows = served.call, served.rows
    return loss, call.scattered(div, rows), call.scattered(entropy, rows)


@takes_keywords(ServedKeywords, "served_divergence_and_entropy's keywords")
def served_loss_and_teacher_entropy(
    student_hidden: torch.Tensor,
    student_weight: torch.Tensor,
    teacher: ServedTeacher,
    completion_mask: torch.Tensor | None = None,
    *,
    num_items_in_batch: float | torch.Tensor | None = None,
    **keywords: Unpack[ServedKeywords],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``served_distillation_loss``' (loss, divergence, entropy) and the teacher's entropy over each scored token's
    support [B, T] fp32, detached (TRL's ``teacher_entropy``: with the tail bucket or renormalised, as the divergence
    sees the teacher; 0 off the mask and where the teacher lists nothing): several teachers' served rows."""
    check_num_items_in_batch(num_items_in_batch)
    served = _ServedCall.check(student_hidden, student_weight, teacher, completion_mask, keywords)
    loss, div, entropy = served.loss(num_items_in_batch, None)
    call, rows = served.call, served.rows
    return loss, *(call.scattered(x, rows) for x in (div, entropy, served.teacher_entropy()))


@dataclass(frozen=True)
class ServedDistillation:
    """``grpo_fast.loss(..., teacher=ServedTeacher(...))``'s checked teacher: the per-token loss gains ``coef``
    times the served divergence (TRL's support by ``beta``, the loss's targets the sampled tokens), from the
    student's log-prob head beside layer 1's (its own vocabulary sweep: not one head as ``Teacher``'s)."""

    teacher: ServedTeacher
    coef: float
    beta: float

    @classmethod
    def check(cls, teacher, coef, beta) -> ServedDistillation:
        coef, beta = check_coef_and_beta(
            coef, beta, 0.0, "0: forward KL over the teacher's top-k, 1: reverse KL at the sampled token"
        )
        return cls(teacher, coef, beta)

    def check_against(self, head: inputs.HeadCall) -> None:
        """The teacher against the student's checked call (its value checks queued with the call's). A
        vocab-parallel student head (``vocab_parallel`` or a sharded DTensor weight) takes the served head's
        vocab-parallel path (``served.vocab_parallel``), as ``served_divergence_and_entropy`` does."""
        if head.shard is not None and head.lora is not None:
            raise ValueError("lora with vocab_parallel is not supported by the served divergence")
        _check_teacher(self.teacher, head, self.beta != 0.0, True)

    def logprobs_entropy_divergence(self, head: inputs.HeadCall, rows: inputs.Rows):
        """(logp, entropy, divergence) [B, T] fp32 of the call's scored ``rows``, differentiable."""
        logp, entropy = logprobs_and_entropy_rows(head, rows, head.head_path)
        return logp, entropy, head.scattered(served_divergence_rows(head, rows, self.teacher, self.beta), rows)


def served_divergence_rows(
    head: inputs.HeadCall, rows: inputs.Rows, teacher: ServedTeacher, beta: float, checked: bool = True
):
    """[N] the served divergence of a checked call's scored ``rows`` (the call's targets the sampled tokens, TRL's
    support by ``beta``), differentiable: a composed head's (``loss``'s with a served teacher, several teachers').
    ``checked``: the teacher was checked against the call before its rows were read; False: checked here (its value
    checks read in a synchronisation of their own)."""
    if not checked:
        checks = inputs.ValueChecks(head.checks.run, head.hidden)
        _check_teacher(teacher, dataclasses.replace(head, checks=checks), beta != 0.0, True)
        checks.read()
    div, _ = _ServedCall.of(head, rows, teacher, beta, beta != 0.0).per_token()
    return div


__all__ = ["ServedKeywords", "ServedTeacher", "served_distillation_loss", "served_divergence_and_entropy"]
