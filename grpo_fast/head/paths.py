"""Layer 1's paths over a backend (``grpo_fast.backends``), and the reduce step of one process.

``takes_frozen_head`` and ``takes_trained_head`` are the choices of path that ``ops.linear_logprobs_path`` and
``grpo_fast.loss`` make before they call an op; ``head_forward`` and its siblings run the chosen backend, the empty
shard (V = 0 rows of a vocab-parallel head) included; ``ONE_PROCESS`` is the reduce step of one process
(``vocab_parallel.GroupReduce`` a group's).

Every layer-1 function takes its operands as one ``kernels.operands.HeadOperands`` (hidden, weight, targets, bias,
the ``transform.LogitTransform``, LoRA's pair or None), as the kernels do, and a backward its fp32 buffers as one
``HeadGrads``; the head path is one of config.HEAD_PATHS and the backward mode one of config.BACKWARD_MODES (the
caller's choices, passed down as arguments).
"""

import torch

from grpo_fast.kernels import softmax_stats


def head_forward(head, compute_entropy, backend, row_count=None):
    """(logp, entropy, softmax_stats.BackwardStats), fp32 [N], by the chosen backend; entropy (and the stats'
    entropy values) None without ``compute_entropy``; ``row_count``: None, or the [1] int32 device count of the
    scored rows, which come first (the others are padding: their values are placeholders); no autograd."""
    return backend.forward(head, compute_entropy, row_count)


def head_forward_record(head, compute_entropy, backend):
    """The unfinished per-token record (softmax_stats.SoftmaxStats, [N] fp32 fields) over these weight rows, which
    ``head_forward`` finishes: for a caller that merges it with records of other rows first (a vocab-parallel head's
    shards). A target of -1 is in no column: the record then has no target (target logit 0, rest = sumexp).
    No rows (V = 0): the empty record (max -inf, sums 0). No autograd."""
    if head.weight.shape[0] == 0:
        return softmax_stats.empty(_no_max(head.hidden))
    return backend.forward_record(head, compute_entropy)


def head_forward_frozen_head(head, backend):
    """(logp, entropy, BackwardStats, J = d logp / d hidden [N, D] fp32, J_l = d logp / d lora_hidden [N, r] fp32 or
    None without LoRA) by the chosen backend; no autograd."""
    return backend.forward_frozen_head(head)


def head_forward_frozen_record(head, backend):
    """``head_forward_frozen_head`` up to "finish": (record softmax_stats.SoftmaxStats, acc [N, D] fp32, target slope
    [N] fp32), unfinished (softmax_stats.finish_frozen_grad says what acc is), for a caller that merges them with
    other rows' first (a vocab-parallel head's shards). A target of -1 is in no column; no rows (V = 0): the empty
    record, acc 0. No autograd."""
    hidden = head.hidden
    if head.weight.shape[0] == 0:
        no_max = _no_max(hidden)
        return (
            softmax_stats.empty(no_max),
            torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device),
            torch.zeros_like(no_max),
        )
    return backend.forward_frozen_record(head)


def _no_max(hidden):
    """[N] fp32 -inf: the max of no vocabulary entry, for hidden's N tokens."""
    return torch.full((hidden.shape[0],), float("-inf"), dtype=torch.float32, device=hidden.device)


def takes_frozen_head(needs_input_grad, hidden, backend, head_path, lora_weight_grad=False):
    """The frozen-head path is taken: head_path "auto", only hidden (the first input) needs a gradient (and, with
    LoRA, lora_hidden, whose J the path also builds; not lora_weight: ``lora_weight_grad``), rows to compute, and the
    path runs on this backend. One decision for the single-process head and the vocab-parallel one (whose ranks all
    decide alike, so their collectives pair up)."""
    need_h, need_w, _, need_b = needs_input_grad[:4]
    return (
        head_path == "auto"
        and need_h
        and not need_w
        and not need_b
        and not lora_weight_grad
        and hidden.shape[0] > 0
        and backend.frozen_head_available(hidden)
    )


# the input dtypes of the three-sweep trained head: its operand f H is rounded to the GEMM dtype, whose exponent range
# must be fp32's (bf16's is; fp16's is not)
TRAINED_HEAD_DTYPES = (torch.bfloat16, torch.float32)


def takes_trained_head(needs_input_grad, hidden, backend, head_path, has_lora, frozen_weight=False):
    """The three-sweep trained head is taken, for a caller that knows dL/dlogp token by token
    (``LossOptions.token_local``): head_path "auto", the weight needs a gradient (or, with ``frozen_weight``, the
    hidden states do: RL and distillation in one call, whose fused path then forms dH alone), no LoRA, a bf16 or fp32
    head, rows to compute, and a backend that has it where its GEMMs run (the frozen head's)."""
    need_h, need_w = needs_input_grad[:2]
    return (
        head_path == "auto"
        and (need_w or (frozen_weight and need_h))
        and not has_lora
        and hidden.dtype in TRAINED_HEAD_DTYPES
        and hidden.shape[0] > 0
        and backend.three_sweep_heads
        and backend.frozen_head_available(hidden)
    )


def head_backward(head, stats, grad_logp, grad_entropy, grads, backend, backward_mode):
    """Layer 1's general-path backward by the chosen backend and mode into ``grads``' buffers (a HeadGrads; dH:
    backend.grad_hidden_buffer, the others fp32 zeros, each may be None)."""
    backend.backward(head, stats, grad_logp, grad_entropy, grads, backward_mode)


class OneProcess:
    """The head's reduce step on one process: identity (its records cover the whole vocabulary, its dH is whole).
    ``vocab_parallel.GroupReduce`` is the same step over a vocab-parallel group (the ranks' records merged, J and dH
    summed); the head's one implementation in ``head.ops`` takes either, so the frozen-head backward, the entropy
    fallback and the empty case exist once."""

    def forward(self, head, compute_entropy, backend, row_count=None):
        """(logp, entropy or None, BackwardStats) [N] fp32 of the whole vocabulary (``head_forward``)."""
        return head_forward(head, compute_entropy, backend, row_count)

    def frozen_forward(self, head, backend):
        """(logp, entropy, BackwardStats, J, J_lora or None) of the whole vocabulary (``head_forward_frozen_head``)."""
        return head_forward_frozen_head(head, backend)

    def sum_grad_hidden(self, grad_hidden):
        """dH [N, D] fp32 of the whole vocabulary from this process's part: already whole."""
        return grad_hidden


ONE_PROCESS = OneProcess()
