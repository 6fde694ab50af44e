"""The Triton backend: ``protocol.Backend`` by the kernels of ``grpo_fast.kernels`` (and cuBLAS GEMMs around them),
each launch configured here from the device and dtype (``kernels.config``, ``kernels.tuning``). CUDA tensors, or any
device under Triton's interpreter (TRITON_INTERPRET=1 before importing grpo_fast).

Where no kernel has anything to launch (no scored token, a vocab-parallel shard of no rows) and on the divergence
head's frozen-head path (no kernel of its own: the torch twin's algorithm, its GEMMs on cuBLAS), the methods run the
torch twin's code, as ``torch_backend`` does.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from grpo_fast.backends import divergence_twin, support_rows, support_tiles, support_twin
from grpo_fast.kernels import backward as kbackward
from grpo_fast.kernels import config as kconfig
from grpo_fast.kernels import (
    divergence_gradient,
    divergence_loss,
    divergence_sweep,
    gemm,
    kept_rows,
    kept_set,
    softmax_stats,
    tile_selection,
    tuning,
)
from grpo_fast.kernels import forward as kforward
from grpo_fast.kernels import forward_frozen as kfrozen
from grpo_fast.kernels import token_loss as ktoken_loss
from grpo_fast.kernels.divergence_records import finish, layer1_record
from grpo_fast.kernels.loss_statistics import SLOTS
from grpo_fast.kernels.operands import Layer1Gradient, SupportGradient, SupportRecord, no_kept_ids

# the sampling parameters' row sweeps (support_rows.RowSweeps)
KEPT_ROW_KERNELS = support_rows.RowSweeps(kept_rows.row_records, kept_rows.kept_sums)
# replayed kept sets' three products (support_twin.KeptDots)
KEPT_SET_KERNELS = support_twin.KeptDots(kept_set.kept_dot, kept_set.kept_grad_rows, kept_set.kept_grad_table)
# the tile candidates' selection and, with gradients, the kept ids of the rows it resolves
TILE_SELECTION_KERNELS = support_tiles.SelectionKernels(tile_selection.select, tile_selection.kept_columns)


def support_record_config(head, wide=False):
    """The record sweep with tile candidates, with their columns or replayed sets' bitmaps (``wide``): the log-prob
    pass's table tile, or the wide epilogue's columns (``tools/sm_compile.py``: the candidates' rounds, their columns
    and the bitmaps' epilogue compile there without a spill, where Triton 3.6's 256-column tile spills the bitmaps'
    120 bytes on sm_90 and the columns' 8; fp32's 64 x 64 tile on 8 warps, where 4 spill 16 bytes on sm_120, Triton
    3.6 and 3.9); the timed choice is not taken: its candidates were timed without the rounds."""
    wide = wide or kconfig.wide_record_epilogue(
        head.transform.softcap is not None, head.bias is not None, head.lora is not None
    )
    config = kconfig.forward_config(head.hidden.device, head.hidden.dtype, wide)
    return replace(config, num_warps=8) if head.hidden.dtype == torch.float32 else config


def kept_backward_config(head):
    """Layer 1's chunked backward with a replayed set's support term (``kernels.backward``, KEPT_BITS): the wide
    epilogue's tile (``tools/sm_compile.py``: the bitmaps' term compiles there without a spill on every class under
    Triton 3.9, where the 128 x 256 tile spills 424 bytes on sm_90 under 3.6), fp32's on 8 warps (4 spilled 8 bytes
    on sm_90)."""
    hidden = head.hidden
    config = kconfig.backward_config(hidden.device, hidden.dtype, "chunked", True, head.lora is not None)
    return replace(config, num_warps=8) if hidden.dtype == torch.float32 else config


def replayed_record(head, kept_ids):
    """Replayed kept sets: the whole SupportRecord (``support_twin.with_logprob``) from the log-prob's record sweep
    reading each launch's bitmaps of the wide sets (``kforward.kept_record``). A row's path is its own set's width
    (its ids in [0, V)), never the batch's K: its values do not depend on how far a batch pads its sets (batch
    invariance). The rows whose sums the sweep does not serve (a narrow set, ``kforward.KEPT_GATHERED``; a set far
    below the row's max, ``kforward.KEPT_RANGE``) take their kept entries' gathers (``kept_set.kept_record_rows``: no
    host read), by their own values alone."""
    layer1, kept = kforward.kept_record(head, kept_ids, support_record_config(head, wide=True))
    kept_set.kept_record_rows(head, kept_ids, kept)
    # the op's outputs alias nothing: each field its own tensor (3 x N fp32 copied)
    fields = [x.clone() for x in kept[:3].unbind(0)] + [kept.new_empty(0) for _ in range(4)]
    return support_twin.with_logprob(SupportRecord(*fields, no_kept_ids(kept.device)), layer1)


class TritonBackend:
    """``protocol.Backend`` by the Triton kernels (module docstring)."""

    name = "triton"
    backward_modes = kconfig.BACKWARD_MODES
    three_sweep_heads = True

    def runs_on(self, device):
        """CUDA tensors, or any device under Triton's interpreter (TRITON_INTERPRET=1 before importing grpo_fast)."""
        return device.type == "cuda" or kconfig.interpreting()

    def check_sizes(self, tokens, vocab_size):
        """Sizes the kernels cannot index (``kernels.config``: MAX_VOCAB, MAX_ROWS) are an error here, not a failed
        launch."""
        if vocab_size > kconfig.MAX_VOCAB:
            raise ValueError(
                f"weight has V = {vocab_size} rows; the Triton kernels take at most {kconfig.MAX_VOCAB} "
                "(the backward's grid of vocabulary tiles): split the head over ranks (vocab_parallel) "
                "or use backend='torch'"
            )
        if tokens > kconfig.MAX_ROWS:
            raise ValueError(
                f"{tokens} tokens in one call; the Triton kernels take at most {kconfig.MAX_ROWS}: split the batch"
            )

    # ------------------------------------------------------------------------------------------- layer 1
    def forward(self, head, compute_entropy, row_count=None):
        """``row_count``: the kernel computes no block wholly past it (``kernels.forward.forward_record``)."""
        return kforward.forward(head, compute_entropy, self._record_config(head), row_count)

    def forward_record(self, head, compute_entropy):
        return kforward.forward_record(head, compute_entropy, self._record_config(head))

    def _record_config(self, head):
        """The forward's tile for these operands' device, dtype and epilogue (``kernels.tuning``: the fixed table's,
        or the timed choice with GRPO_FAST_TUNE=1)."""
        wide = kconfig.wide_record_epilogue(
            head.transform.softcap is not None, head.bias is not None, head.lora is not None
        )
        return tuning.record_config(head, wide, lambda config: kforward.forward_record(head, True, config))

    def frozen_head_available(self, hidden):
        """Where cuBLAS can return fp32 from bf16 (``kernels.forward_frozen.available``)."""
        return kfrozen.available(hidden)

    def forward_frozen_head(self, head):
        return kfrozen.forward_frozen_head(head, True, kconfig.frozen_head_config(head.hidden.device))

    def forward_frozen_record(self, head):
        return kfrozen.forward_frozen_record(head, True, kconfig.frozen_head_config(head.hidden.device))[:3]

    def forward_trained_head(self, head, coefficients, grads, token_chunk=None, columns=None):
        """``kernels.forward_frozen.forward_trained_head``: three vocabulary sweeps."""
        config = kconfig.frozen_head_config(head.hidden.device)
        return kfrozen.forward_trained_head(head, True, config, coefficients, grads, token_chunk, columns=columns)

    def grad_hidden_buffer(self, hidden, backward_mode):
        """The chunked backward's GEMMs write dH once (fp32 output, never a K = V reduction rounded to the input
        dtype); the fused one accumulates into zeros."""
        if backward_mode == "chunked":
            return torch.empty(hidden.shape, dtype=torch.float32, device=hidden.device)
        return torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)

    def backward(self, head, stats, grad_logp, grad_entropy, grads, backward_mode):
        wide_epilogue = head.transform.softcap is not None or grad_entropy is not None
        hidden, has_lora = head.hidden, head.lora is not None
        cfg = kconfig.backward_config(hidden.device, hidden.dtype, backward_mode, wide_epilogue, has_lora)
        run = kbackward.backward_chunked if backward_mode == "chunked" else kbackward.backward_fused
        run(head, stats, grad_logp, grad_entropy, grads, cfg)

    def workspace_bytes(
        self, op, hidden_shape, vocab_size, dtype, frozen_head, backward_mode, device_type, compute_capability
    ):
        """By the launchers' formulas: the forward's partial and merged records (its launch sized for
        ``compute_capability``, None: the ``device_type`` device's), or the frozen head's state, u buffer of one token
        chunk x vocabulary chunk and its finishing copy of W_y's rows; the chunked backward's g, one token chunk x V
        in the input dtype (the fused one allocates nothing more)."""
        itemsize = torch.empty(0, dtype=dtype).element_size()
        (N, D), V = hidden_shape, vocab_size
        if op == "linear_logprobs":
            if frozen_head:
                chunk = gemm.chunk_size(N, D)
                vchunk = kfrozen.vocab_chunk_size(V, D, chunk, itemsize)
                return kfrozen.STATE_ROWS * N * 4 + chunk * vchunk * 4 + min(N, 1024) * D * 4
            if compute_capability is not None:
                config = kconfig.gpu_record_config(dtype, compute_capability)
            else:
                config = kconfig.forward_config(torch.device(device_type), dtype)
            return kforward.workspace_bytes(N, V, True, config)
        if op == "linear_logprobs_backward":
            return gemm.chunk_size(N, D) * V * itemsize if backward_mode == "chunked" else 0
        raise ValueError(f"op must be 'linear_logprobs' or 'linear_logprobs_backward', got {op!r}")

    def trained_head_workspace_bytes(self, hidden_shape, vocab_size, dtype, token_chunk, chunk_row_bytes=0):
        """The three-sweep head's fp32 logits of one token chunk over the vocabulary, J (N x D fp32), its state and
        one chunk's GEMM operand (and the caller's ``chunk_row_bytes`` a token of a chunk)."""
        (N, D), V = hidden_shape, vocab_size
        itemsize = torch.empty(0, dtype=dtype).element_size()
        chunk = min(N, token_chunk or kfrozen.trained_chunk_size(N, V, D, itemsize))
        return chunk * (V * 4 + D * itemsize + chunk_row_bytes) + N * D * 4 + kfrozen.STATE_ROWS * N * 4

    def divergence_loss_workspace_bytes(self, hidden_shape, vocab_size, dtype, token_chunk):
        """``kernels.divergence_loss.loss_workspace_bytes``: a chunk's two fp32 products and its g."""
        (N, D), itemsize = hidden_shape, torch.empty(0, dtype=dtype).element_size()
        return divergence_loss.loss_workspace_bytes(N, D, vocab_size, itemsize, token_chunk)

    def gathered_logits(self, head, ids, slope=False):
        """``kernels.kept_set``'s gathers (the replayed kept sets' products)."""
        return support_twin.kept_logits(head, ids, KEPT_SET_KERNELS, slope=slope)

    def gathered_backward(self, head, ids, grad_logits, grads, slope=None):
        support_twin.kept_backward(head, ids, grad_logits, grads, KEPT_SET_KERNELS, slope)

    def gathered_logits_and_rows(self, head, ids, weights):
        """``kernels.kept_set.kept_dot_rows``: each kept row read once for the logits and both sums."""
        support_twin.check_no_lora(head)
        return kept_set.kept_dot_rows(head.hidden, head.weight, head.bias, ids, weights, head.transform)

    def gathered_backward_workspace_bytes(self, ids_shape):
        """``kernels.kept_set.grad_table_workspace_bytes``: one sort of dW's pairs."""
        return kept_set.grad_table_workspace_bytes(*ids_shape)

    def replayed_record_workspace_bytes(self, hidden_shape, vocab_size, kept, dtype, device_type):
        """``replayed_record``'s: the record sweep's workspace (``kforward.workspace_bytes``: the bitmaps of a launch's
        rows within its PARTS_BYTES), a launch's width count (three [rows, K] bool temporaries and a row's int64 and
        int32) and the kept record's 4 x N fp32 (its flags too) before the op's copy; no gathered buffers."""
        (N, _), V = hidden_shape, vocab_size
        config = kconfig.forward_config(torch.device(device_type), dtype, True)  # support_record_config's columns
        rows = kforward.parts_shape(N, V, False, config, kept_bits=True)[2] if N else 0
        return kforward.workspace_bytes(N, V, False, config, kept_bits=True) + rows * (3 * kept + 12) + 4 * N * 4, False

    def replayed_backward_workspace_bytes(self, hidden_shape, vocab_size, dtype):
        """``_replayed_backward``'s: layer 1's chunked g (a token chunk x V in the input dtype), the sets' bitmaps of a
        chunk (``kforward.kept_words``), the support's coefficients with their temporaries (6 x N fp32: the spread,
        the factor, the three ``SupportGradient`` coefficients, a comparison's bytes rounded up) and a zero dL/dlogp
        [N] fp32 where none arrives."""
        (N, D), V = hidden_shape, vocab_size
        chunk, itemsize = gemm.chunk_size(N, D), torch.empty(0, dtype=dtype).element_size()
        return chunk * (V * itemsize + kforward.kept_words(V) * 4) + 7 * N * 4

    def support_forward(self, head, support, vocab_size=None, reduce=None, differentiable=True, trains_head=False):
        """Replayed kept sets: on one process without gradients or with a trained head (``replayed_takes_logprob``)
        the log-prob's record sweep reading the sets' bitmaps gives both (``replayed_record``); otherwise their logits
        by ``kernels.kept_set`` (no vocabulary sweep), the log-prob left to layer 1's op. The
        sampling parameters (one process, top-k 0 or up to LISTED): the log-prob's record sweep with its tiles'
        candidates (``support_tiles``; with gradients their columns too, and the record carries the kept ids);
        otherwise, and for the rows those do not resolve, each chunk's rows of logits from cuBLAS, then
        ``kernels.kept_rows``' row sweeps (``support_rows``)."""
        reduce = reduce or support_twin.ONE_PROCESS
        if support.kept_ids is not None:
            if reduce is support_twin.ONE_PROCESS and self.replayed_takes_logprob(differentiable, trains_head):
                return replayed_record(head, support.kept_ids)
            return support_twin.replayed_forward(head, support.kept_ids, KEPT_SET_KERNELS, reduce)

        def rows_forward(rows_head, rows_support):
            return support_rows.parameter_forward(rows_head, rows_support, vocab_size, reduce, KEPT_ROW_KERNELS)

        carry = self.carried_kept_width(support, reduce, differentiable) > 0
        if support_tiles.serves(support, reduce) and head.hidden.shape[0] and head.weight.shape[0]:
            config = support_record_config(head, wide=carry)
            return support_tiles.parameter_forward(head, support, config, rows_forward, TILE_SELECTION_KERNELS, carry)
        record = rows_forward(head, support)
        if carry:  # no row to sweep: the carried ids' shape all the same
            return record._replace(
                carried_ids=torch.full((0, tile_selection.LISTED), -1, dtype=torch.int64, device=head.hidden.device)
            )
        return record

    def replayed_takes_logprob(self, differentiable, trains_head):
        """Without gradients, and with a trained head: one record sweep reading the sets' bitmaps gives both
        log-probs (``replayed_record``), and the backward both gradients from layer 1's chunked backward with the
        support's term in its g (``kernels.backward``, KEPT_BITS): any K at the cost of the bitmaps, where the gathers
        of K rows a token cost ~2x at K = 1024. A frozen head keeps layer 1's frozen path and the gathers."""
        return not differentiable or trains_head

    def carried_kept_width(self, support, reduce=None, differentiable=True):
        """The parameters' tile path with gradients (``support_tiles``): its record carries LISTED kept ids a row."""
        return tile_selection.LISTED if differentiable and support_tiles.serves(support, reduce) else 0

    def support_backward(self, head, support, record, grad_logp, grad_support, grads):
        """Replayed sets whose record holds the log-prob's: layer 1's chunked backward with the support's term
        (``_replayed_backward``). Carried kept ids: layer 1's backward for the log-prob and the kept entries' gathers
        for the support (``support_tiles.carried_backward``). Otherwise the twin's (``support_twin.backward``)."""
        if support.kept_ids is not None and record.lse.numel():
            self._replayed_backward(head, support.kept_ids, record, grad_logp, grad_support, grads)
            return
        if record.carried_ids.dim() == 2:

            def layer1_backward(stats, grad_logp, grads):
                self.backward(head, stats, grad_logp, None, grads, "chunked")

            support_tiles.carried_backward(
                head, record, grad_logp, grad_support, grads, layer1_backward, KEPT_SET_KERNELS
            )
            return
        support_twin.backward(head, support, record, grad_logp, grad_support, grads, KEPT_SET_KERNELS)

    def _replayed_backward(self, head, kept_ids, record, grad_logp, grad_support, grads):
        """Both log-probs' gradients of a replayed record that holds the log-prob's (``replayed_takes_logprob``):
        layer 1's chunked backward with the support's term in its g, the sets as bitmaps a chunk."""
        if head.hidden.shape[0] == 0:
            return
        stats = softmax_stats.BackwardStats(record.lse, record.nontarget_mass, None, None)
        support_term = None
        if grad_support is not None:
            # q_v = p_v exp(L - L_kept) in the sweep's g where exp(L - L_kept) <= exp(KEPT_RANGE) (the p_v it scales
            # that fp32 flushes then weigh under 2^-62); the other rows (a set far below the row's max, an empty
            # set, a NaN) by their own exponential, in the blocks that hold one; a NaN d stays NaN
            spread, reach = record.lse - record.kept_lse, kforward.KEPT_RANGE.value
            swept = spread <= reach
            factor = torch.where(swept, torch.exp(spread.clamp(max=reach)), 0.0)
            support_term = SupportGradient(
                kept_ids,
                grad_support,
                grad_support * factor,
                grad_support * record.kept_nontarget_mass,
                torch.where(swept, 0.0, grad_support),
                record.kept_lse,
            )
        if grad_logp is None:  # the support's gradient alone: a zero dL/dlogp
            grad_logp = torch.zeros(head.hidden.shape[0], dtype=torch.float32, device=head.hidden.device)
        kbackward.backward_chunked(
            head, stats, grad_logp, None, grads, kept_backward_config(head), support=support_term
        )

    # ------------------------------------------------------------------------------------------- layer 2
    def token_loss(self, inputs, options, *, scale, entropy_threshold):
        """The token kernel (``kernels.token_loss``)."""
        return ktoken_loss.token_loss(inputs, options, scale=scale, entropy_threshold=entropy_threshold)

    def token_loss_workspace_bytes(self, batch_shape):
        """The kernel's B x len(SLOTS) fp32 statistics and its B x T fp32 bonus mask (an upper bound: it exists only
        with an entropy bonus)."""
        B, T = batch_shape
        return B * len(SLOTS) * 4 + B * T * 4

    # ------------------------------------------------------------------------------------------- the divergence head
    def divergence_forward(self, student, teacher, beta, frozen_head=False):
        """The record sweep (``kernels.divergence_sweep``); the frozen-head path and no scored row: the twin's."""
        if frozen_head or student.hidden.shape[0] == 0:
            return divergence_twin.forward(student, teacher, beta, frozen_head)
        return (*divergence_sweep.forward(student, teacher, beta), None)

    def divergence_records(self, student, teacher, beta, offset, frozen_head=False):
        """The record sweep over the shard's rows; the frozen-head path and a shard of no rows: the twin's."""
        if frozen_head or student.weight.shape[0] == 0:
            return divergence_twin.shard_records(student, teacher, beta, offset, frozen_head)
        sweep = divergence_sweep.records(student, teacher, beta, offset=offset)
        return (sweep.student, sweep.teacher), sweep.jsd_sweep, None

    def divergence_backward(self, grad_divergence, student, teacher, saved, argmax, beta, grads, offset=0):
        """The g kernel and cuBLAS (``kernels.divergence_gradient``); a shard of no rows has nothing to recompute
        (its part of dH is 0: the twin's loops run empty)."""
        if student.weight.shape[0] == 0:
            return divergence_twin.backward(grad_divergence, student, teacher, saved, argmax, beta, grads, offset)
        divergence_gradient.backward(grad_divergence, student, teacher, saved, argmax, beta, grads, offset=offset)

    def divergence_loss(self, student, teacher, beta, weights, grads, token_chunk=None, layer1=None):
        """``kernels.divergence_loss.loss_gradients``: three student sweeps and one teacher sweep; no scored row: the
        twin's."""
        if student.hidden.shape[0] == 0 and layer1 is None:
            div, entropy, teacher_entropy = divergence_twin.loss(student, teacher, beta, weights, grads)
            return div, entropy, None, teacher_entropy
        return divergence_loss.loss_gradients(student, teacher, beta, weights, grads, token_chunk, layer1=layer1)

    def combined_forward(self, student, targets, teacher, beta):
        """The record sweep, which also gathers the student's logit at each target; layer 1's record is then
        ``layer1_record``'s. No scored token: the twin's (nothing to launch)."""
        if student.hidden.shape[0] == 0:
            return divergence_twin.combined_forward(student, targets, teacher, beta)
        sweep = divergence_sweep.records(student, teacher, beta, targets=targets)
        logp, entropy, layer1 = softmax_stats.finish(layer1_record(sweep.student, targets, sweep.target_logit), True)
        div, _, saved, argmax = finish(sweep.student, sweep.teacher, beta, sweep.jsd_sweep)
        return logp, entropy, div, torch.stack(tuple(layer1)), saved, argmax

    def combined_backward(self, grads, student, targets, teacher, layer1, saved, argmax, beta, student_grads):
        """The g kernel with layer 1's term (its softmax is p_s: one normaliser)."""
        grad_logp, grad_entropy, grad_divergence = grads
        layer1_term = Layer1Gradient(targets, layer1.contiguous(), grad_logp, grad_entropy)
        divergence_gradient.backward(
            grad_divergence, student, teacher, saved, argmax, beta, student_grads, layer1=layer1_term
        )
