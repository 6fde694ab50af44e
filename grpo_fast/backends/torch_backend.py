"""The torch backend: ``protocol.Backend`` by the chunked-torch twins (``head_twin``, ``token_loss_twin``,
``divergence_twin``), the kernels' algorithms in PyTorch, on any device. Layer 1 has one backward ("chunked") and no
three-sweep heads (``three_sweep_heads`` false: the callers take the recompute path).
"""

from __future__ import annotations

import torch

from grpo_fast.backends import divergence_twin, head_twin, support_rows, support_twin, token_loss_twin


class TorchBackend:
    """``protocol.Backend`` by the chunked-torch twins (module docstring)."""

    name = "torch"
    backward_modes = ("chunked",)
    three_sweep_heads = False

    def runs_on(self, device):
        return True

    def check_sizes(self, tokens, vocab_size):
        """No index limit: torch indexes in int64."""

    # ------------------------------------------------------------------------------------------- layer 1
    def forward(self, head, compute_entropy, row_count=None):
        """``row_count`` is not read: the twin's chunks compute the padding rows too (zeros)."""
        return head_twin.forward(head, compute_entropy)

    def forward_record(self, head, compute_entropy):
        return head_twin.forward_record(head, compute_entropy)

    def frozen_head_available(self, hidden):
        return True

    def forward_frozen_head(self, head):
        return head_twin.forward_frozen_head(head, True)

    def forward_frozen_record(self, head):
        return head_twin.forward_frozen_record(head, True)[:3]

    def forward_trained_head(self, head, coefficients, grads, token_chunk=None):
        """None here (``three_sweep_heads`` false): the callers take the recompute path."""
        raise NotImplementedError("the torch backend has no three-sweep trained head")

    def grad_hidden_buffer(self, hidden, backward_mode):
        """dH's fp32 zero accumulator for ``backward``."""
        return torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)

    def backward(self, head, stats, grad_logp, grad_entropy, grads, backward_mode):
        head_twin.backward(head, stats, grad_logp, grad_entropy, grads)

    def workspace_bytes(
        self, op, hidden_shape, vocab_size, dtype, frozen_head, backward_mode, device_type, compute_capability
    ):
        """An estimate, not a launcher's formula: CHUNK_N x CHUNK_V fp32 tiles, about four alive at once."""
        (N, _), V = hidden_shape, vocab_size
        return 4 * min(N, head_twin.CHUNK_N) * min(V, head_twin.CHUNK_V) * 4

    def trained_head_workspace_bytes(self, hidden_shape, vocab_size, dtype, token_chunk, chunk_row_bytes=0):
        """0: no three-sweep trained head here."""
        return 0

    def divergence_loss_workspace_bytes(self, hidden_shape, vocab_size, dtype, token_chunk):
        """0: the fused divergence loss (a three-sweep head) does not run here."""
        return 0

    def gathered_logits(self, head, ids, slope=False):
        return support_twin.kept_logits(head, ids, slope=slope)

    def gathered_backward(self, head, ids, grad_logits, grads, slope=None):
        support_twin.kept_backward(head, ids, grad_logits, grads, slope=slope)

    def gathered_logits_and_rows(self, head, ids, weights):
        return support_twin.kept_logits_and_rows(head, ids, weights)

    def gathered_backward_workspace_bytes(self, ids_shape):
        """0: the twin's chunks of gathered rows are not modelled (the estimate models the GPU's Triton path)."""
        return 0

    def replayed_record_workspace_bytes(self, hidden_shape, vocab_size, kept, dtype, device_type):
        """Layer 1's chunked record (``workspace_bytes``) and the gathers."""
        args = ("linear_logprobs", hidden_shape, vocab_size, dtype, False, None, device_type, None)
        return self.workspace_bytes(*args), True

    def support_forward(self, head, support, vocab_size=None, reduce=None, differentiable=True, trains_head=False):
        reduce = reduce or support_twin.ONE_PROCESS
        if support.kept_ids is None:
            return support_rows.parameter_forward(head, support, vocab_size, reduce, support_rows.TORCH_ROW_SWEEPS)
        record = support_twin.replayed_forward(head, support.kept_ids, reduce=reduce)
        if not support_twin.takes_logprob(differentiable, reduce):
            return record
        # the op's log-prob too (``sampler.ops.computes_logprob``), from layer 1's chunked record
        return support_twin.with_logprob(record, head_twin.forward_record(head, False))

    def replayed_takes_logprob(self, differentiable, trains_head):
        """Without gradients (``support_twin.takes_logprob``)."""
        return support_twin.takes_logprob(differentiable, support_twin.ONE_PROCESS)

    def carried_kept_width(self, support, reduce=None, differentiable=True):
        """None carried: the backward recomputes the rows in the forward's arithmetic."""
        return 0

    def support_backward(self, head, support, record, grad_logp, grad_support, grads):
        support_twin.backward(head, support, record, grad_logp, grad_support, grads)

    # ------------------------------------------------------------------------------------------- layer 2
    def token_loss(self, inputs, options, *, scale, entropy_threshold):
        """The token kernel's algebra on [B, T] tensors (``token_loss_twin``)."""
        return token_loss_twin.token_loss(inputs, options, scale=scale, entropy_threshold=entropy_threshold)

    def token_loss_workspace_bytes(self, batch_shape):
        """The twin's TEMPORARIES fp32 [B, T] tensors."""
        B, T = batch_shape
        return token_loss_twin.TEMPORARIES * B * T * 4

    # ------------------------------------------------------------------------------------------- the divergence head
    def divergence_forward(self, student, teacher, beta, frozen_head=False):
        return divergence_twin.forward(student, teacher, beta, frozen_head)

    def divergence_records(self, student, teacher, beta, offset, frozen_head=False):
        return divergence_twin.shard_records(student, teacher, beta, offset, frozen_head)

    def divergence_backward(self, grad_divergence, student, teacher, saved, argmax, beta, grads, offset=0):
        divergence_twin.backward(grad_divergence, student, teacher, saved, argmax, beta, grads, offset)

    def divergence_loss(self, student, teacher, beta, weights, grads, token_chunk=None, layer1=None):
        """The twin's forward, then its backward with the weights as dL/d div (``token_chunk`` sizes nothing here;
        no layer-1 term: ``three_sweep_heads`` false)."""
        if layer1 is not None:
            raise NotImplementedError("the torch backend has no divergence loss with layer 1's term")
        div, entropy, teacher_entropy = divergence_twin.loss(student, teacher, beta, weights, grads)
        return div, entropy, None, teacher_entropy

    def combined_forward(self, student, targets, teacher, beta):
        return divergence_twin.combined_forward(student, targets, teacher, beta)

    def combined_backward(self, grads, student, targets, teacher, layer1, saved, argmax, beta, student_grads):
        grad_logp, grad_entropy, grad_divergence = grads
        grad_entropy = grad_entropy if grad_entropy is not None else torch.zeros_like(grad_logp)
        twin_grads = (grad_logp, grad_entropy, grad_divergence)
        divergence_twin.combined_backward(
            twin_grads, student, targets, teacher, layer1, saved, argmax, beta, student_grads
        )
