"""The backend protocol: everything a part asks of the implementation a call runs on, as the methods of one object.

Two objects implement it (``resolver``): the Triton backend (``triton_backend``: the kernels of ``grpo_fast.kernels``,
cuBLAS around them, each launch configured from the device and dtype) and the torch backend (``torch_backend``: the
chunked-torch twins here, on any device). A public function resolves its ``backend=`` once
(``resolver.resolve_backend``); the custom ops' schemas carry the backend's name, which ``resolver.named`` turns back
into the object; nothing else compares a backend's name, and no part above calls a kernel but through these methods.

The methods, by the part that calls them:
* layer 1 (``grpo_fast.head``): the forward and its record (a vocab-parallel shard's), the frozen-head forward and
  record, the three-sweep trained head, the backward, and what each allocates (``workspace_bytes``); the sampler's
  kept set and its log-sum-exp, forward and backward (``grpo_fast.sampler``); the logits at given ids, forward
  and backward (``grpo_fast.served``);
* layer 2 (``grpo_fast.grpo_loss``): the token loss, and its workspace;
* the divergence head (``grpo_fast.distillation``, ``grpo_fast.loss(teacher=...)``): its forward (and its frozen-head
  forward), a shard's records, its backward, the loss with its gradients formed in the forward (with layer 1's term:
  RL and distillation in one call), and the combined GRPO + distillation head's forward and backward.

The records the methods take and return are the kernels' (``grpo_fast.kernels.operands``,
``divergence_records.ModelHead``), named here so that a caller needs no kernel module.
"""

from __future__ import annotations

from typing import Literal, Protocol, get_args

import torch

from grpo_fast.kernels.config import BackwardMode
from grpo_fast.kernels.divergence_records import ModelHead, TeacherSegments
from grpo_fast.kernels.operands import (
    GradientColumns,
    HeadGrads,
    HeadOperands,
    Layer1Gradient,
    LossLayer1,
    SamplerSupport,
    SupportRecord,
    TokenLossInputs,
    gemm_weight,
)
from grpo_fast.kernels.softmax_stats import BackwardStats, SoftmaxStats

# the public ``backend=`` choice: "auto" resolves to "triton" where it runs (CUDA tensors, or any under
# TRITON_INTERPRET=1), else to "torch"
BackendName = Literal["auto", "triton", "torch"]
BACKEND_NAMES: tuple[str, ...] = get_args(BackendName)

__all__ = [
    "BACKEND_NAMES",
    "Backend",
    "BackendName",
    "BackwardStats",
    "HeadGrads",
    "HeadOperands",
    "Layer1Gradient",
    "LossLayer1",
    "ModelHead",
    "SamplerSupport",
    "SoftmaxStats",
    "SupportRecord",
    "TokenLossInputs",
    "gemm_weight",
]


class Backend(Protocol):
    """What a backend implements (module docstring). Every tensor it returns is fp32 unless said; none tracks
    autograd (the custom ops around the calls hold the formulas)."""

    name: str  # "triton" or "torch": what the ops' schemas carry
    backward_modes: tuple[BackwardMode, ...]  # layer 1's backward modes it has
    # it forms a head's gradients in the forward from fp32 logits held in memory, in three vocabulary sweeps (the
    # trained head's forward_trained_head, the divergence head's divergence_loss, with layer 1's term or without)
    three_sweep_heads: bool

    def runs_on(self, device: torch.device) -> bool:
        """Whether it runs on tensors of ``device``."""
        ...

    def check_sizes(self, tokens: int, vocab_size: int) -> None:
        """Raise ValueError for sizes it cannot index."""
        ...

    # ------------------------------------------------------------------------------------------- layer 1
    def forward(self, head: HeadOperands, compute_entropy: bool, row_count: torch.Tensor | None = None):
        """(logp, entropy or None, BackwardStats) [N]; ``row_count``: None, or the [1] int32 device count of the
        scored rows, which come first (the rest are padding: their values are placeholders)."""
        ...

    def forward_record(self, head: HeadOperands, compute_entropy: bool) -> SoftmaxStats:
        """The unfinished per-token record over these weight rows (V > 0), for a caller that merges it first."""
        ...

    def frozen_head_available(self, hidden: torch.Tensor) -> bool:
        """Whether the frozen-head forward runs for these hidden states."""
        ...

    def forward_frozen_head(self, head: HeadOperands):
        """(logp, entropy, BackwardStats, J = d logp / d hidden [N, D], J_lora [N, r] or None)."""
        ...

    def forward_frozen_record(self, head: HeadOperands):
        """``forward_frozen_head`` unfinished: (SoftmaxStats, acc [N, D], target slope [N]) over these rows."""
        ...

    def forward_trained_head(
        self,
        head: HeadOperands,
        coefficients,
        grads: HeadGrads,
        token_chunk: int | None = None,
        columns: GradientColumns | None = None,
    ):
        """The three-sweep trained head: (logp, entropy, BackwardStats), and dH / dW / db of the loss whose
        dL/dlogp ``coefficients(n0, n1, logp, entropy)`` gives token chunk by chunk, into ``grads``; with
        ``columns`` (an operands.GradientColumns) dW and db also take those entries, on the rows it does not leave to
        the caller in ``columns.rest``."""
        ...

    def grad_hidden_buffer(self, hidden: torch.Tensor, backward_mode: BackwardMode) -> torch.Tensor:
        """dH's fp32 buffer for ``backward``."""
        ...

    def backward(
        self,
        head: HeadOperands,
        stats: BackwardStats,
        grad_logp: torch.Tensor,
        grad_entropy: torch.Tensor | None,
        grads: HeadGrads,
        backward_mode: BackwardMode,
    ) -> None:
        """Layer 1's general-path backward into ``grads``' buffers."""
        ...

    def workspace_bytes(
        self,
        op: str,
        hidden_shape: tuple[int, int],
        vocab_size: int,
        dtype: torch.dtype,
        frozen_head: bool,
        backward_mode: BackwardMode,
        device_type: str,
        compute_capability: int | None,
    ) -> int:
        """What a layer-1 op ("linear_logprobs" or "linear_logprobs_backward") allocates besides its outputs, its
        launch sized for a card of ``compute_capability`` (None: the ``device_type`` device's)."""
        ...

    def trained_head_workspace_bytes(
        self,
        hidden_shape: tuple[int, int],
        vocab_size: int,
        dtype: torch.dtype,
        token_chunk: int | None,
        chunk_row_bytes: int = 0,
    ) -> int:
        """What ``forward_trained_head`` allocates besides its outputs and ``grads``, plus ``chunk_row_bytes`` for
        each token of one chunk (a caller's buffers a chunk, as its coefficients' callback holds them)."""
        ...

    def divergence_loss_workspace_bytes(
        self, hidden_shape: tuple[int, int], vocab_size: int, dtype: torch.dtype, token_chunk: int | None
    ) -> int:
        """What ``divergence_loss`` allocates besides its outputs and ``grads`` (the student's [N, Ds] rows, its
        gradients formed)."""
        ...

    def gathered_logits(self, head: HeadOperands, ids: torch.Tensor, slope: bool = False):
        """The logits z of each row at ``ids`` [N, K] int64 (-1: no entry), fp32 [N, K] (-inf at -1): a gather of K
        weight rows a token, O(N K D), no vocabulary sweep (``grpo_fast.served``' student side); with ``slope``
        (z, dz/du there: [N, K] fp32 with a soft-cap, else a number) from the same gather."""
        ...

    def gathered_backward(
        self, head: HeadOperands, ids: torch.Tensor, grad_logits: torch.Tensor, grads: HeadGrads, slope=None
    ):
        """Accumulate the gradients of ``gathered_logits`` from dL/dz ``grad_logits`` [N, K] fp32 into ``grads``
        (``slope``: dz/du at ``ids`` where the caller has it, else recomputed)."""
        ...

    def gathered_logits_and_rows(self, head: HeadOperands, ids: torch.Tensor, weights: torch.Tensor):
        """``gathered_logits`` and two sums of the same weight rows (no LoRA): (z [N, K], dz/du [N, K], pivot [N],
        P [N, D], T [N, D]), ``support_twin.kept_logits_and_rows``' contract; the Triton backend reads each row
        once (``kernels.kept_set.kept_dot_rows``)."""
        ...

    def gathered_backward_workspace_bytes(self, ids_shape: tuple[int, int]) -> int:
        """What ``gathered_backward`` (and the replayed kept sets' backward) allocates besides ``grads`` to form dW
        (or LoRA's) at ids [N, K]."""
        ...

    def replayed_record_workspace_bytes(
        self, hidden_shape: tuple[int, int], vocab_size: int, kept: int, dtype: torch.dtype, device_type: str
    ) -> tuple[int, bool]:
        """Replayed kept sets [N, K] without gradients (``support_forward``'s whole record): (the bytes its log-prob's
        record allocates besides the outputs, whether the sets' logits are gathered as [N, K] buffers too)."""
        ...

    def replayed_backward_workspace_bytes(
        self, hidden_shape: tuple[int, int], vocab_size: int, dtype: torch.dtype
    ) -> int:
        """Replayed kept sets whose forward gave the log-prob with gradients (``replayed_takes_logprob``): what
        their backward allocates besides ``grads`` (backends where it can hold)."""
        ...

    def support_forward(
        self,
        head: HeadOperands,
        support: SamplerSupport,
        vocab_size: int | None = None,
        reduce=None,
        differentiable: bool = True,
        trains_head: bool = False,
    ) -> SupportRecord:
        """The sampler's kept set of each row and the log-sum-exp over it (``grpo_fast.sampler_logprobs``); with
        the sampling parameters also the log-prob's, from the same rows of logits, and with replayed sets without
        gradients (one process) too (``support_twin.with_logprob``). A vocab-parallel shard's: the
        whole head's ``vocab_size`` and its group's ``reduce`` (``support_twin.OneProcess``'s methods).
        ``differentiable``: a backward may follow (it must differentiate the forward's kept set: its recompute in the
        forward's arithmetic, or the set carried, ``carried_kept_width``)."""
        ...

    def replayed_takes_logprob(self, differentiable: bool, trains_head: bool) -> bool:
        """Whether one process's ``support_forward`` of replayed sets gives the log-prob too (its record's lse,
        nontarget_mass and logprob; its backward then both log-probs' gradients), where layer 1's op would otherwise
        (``trains_head``: layer 1 would take its general path, not the frozen head's)."""
        ...

    def carried_kept_width(self, support: SamplerSupport, reduce=None, differentiable: bool = True) -> int:
        """K where ``support_forward``'s record carries each row's kept ids to the backward
        (``SupportRecord.carried_ids`` [N, K]), else 0: decided from the arguments alone (the op's fake decides
        alike)."""
        ...

    def support_backward(
        self,
        head: HeadOperands,
        support: SamplerSupport,
        record: SupportRecord,
        grad_logp,
        grad_support,
        grads: HeadGrads,
    ) -> None:
        """Accumulate dL/dlogp's (the parameters' path; replayed sets leave the log-prob to layer 1) and dL/ds's
        gradients ([N] fp32 each, or None) into ``grads``."""
        ...

    # ------------------------------------------------------------------------------------------- layer 2
    def token_loss(self, inputs: TokenLossInputs, options, *, scale, entropy_threshold):
        """(dL/dlogp [B, T], the entropy bonus's mask [B, T] or None, the per-sequence statistics): the token
        kernel's contract (``grpo_fast.kernels.token_loss.token_loss``)."""
        ...

    def token_loss_workspace_bytes(self, batch_shape: tuple[int, int]) -> int:
        """What ``token_loss`` allocates besides its outputs."""
        ...

    # ------------------------------------------------------------------------------------------- the divergence head
    def divergence_forward(self, student: ModelHead, teacher: ModelHead, beta: float, frozen_head: bool = False):
        """(divergence [N], the student's entropy [N], saved [8, N], argmax [2, N] int64, J = d div / d student
        hidden [N, Ds] with ``frozen_head``, else None)."""
        ...

    def divergence_records(
        self, student: ModelHead, teacher: ModelHead, beta: float, offset: int, frozen_head: bool = False
    ):
        """A vocab-parallel shard's part of the forward: ((student, teacher) divergence_records.Record [N] over these
        weight rows, argmax global; the JSD sweep over them; the frozen-head accumulators of its token chunks, or
        None)."""
        ...

    def divergence_backward(
        self,
        grad_divergence: torch.Tensor,
        student: ModelHead,
        teacher: ModelHead,
        saved: torch.Tensor,
        argmax: torch.Tensor,
        beta: float,
        grads: tuple,
        offset: int = 0,
    ) -> None:
        """The student's gradients (dH written, dW and db accumulated, each None where not wanted) into ``grads``."""
        ...

    def divergence_loss(
        self,
        student: ModelHead,
        teacher: ModelHead | TeacherSegments,
        beta: float,
        weights: torch.Tensor,
        grads: tuple,
        token_chunk: int | None = None,
        layer1: LossLayer1 | None = None,
    ):
        """The loss sum_n weights_n div_n's gradients into ``grads``, formed in the forward: (divergence [N], the
        student's entropy [N], its log-probs [N] with ``layer1`` (layer 1's term: ``three_sweep_heads`` backends
        only), else None, the teacher's entropy [N] from its records). ``teacher``: one teacher over all N tokens,
        or TeacherSegments (several, each over a range of them; no ``layer1``)."""
        ...

    def combined_forward(self, student: ModelHead, targets: torch.Tensor, teacher: ModelHead, beta: float):
        """The combined GRPO + distillation head's forward: (logp, entropy, divergence [N], layer1 [4, N], saved
        [8, N], argmax [2, N] int64)."""
        ...

    def combined_backward(
        self,
        grads: tuple,
        student: ModelHead,
        targets: torch.Tensor,
        teacher: ModelHead,
        layer1: torch.Tensor,
        saved: torch.Tensor,
        argmax: torch.Tensor,
        beta: float,
        student_grads: tuple,
    ) -> None:
        """The combined head's backward: (dL/dlogp, dL/dentropy or None, dL/d div) [N] each -> the student's
        gradients into ``student_grads``."""
        ...
