"""Layer 1's backends and the reduce step of one process.

``TRITON`` (the kernels) and ``TORCH`` (the chunked-torch twin, ``head.torch_twin``): two objects with one set of
methods (the forward, the forward record of a vocab-parallel shard, the frozen-head forward and record, the
backward), chosen once: the public API resolves its ``backend=`` string to one, and the custom ops' schemas carry
its ``name`` (layer 2 picks its token kernel or its torch twin by the same name). ``head_forward`` and its siblings
run the chosen backend; ``takes_frozen_head`` is the choice of path that ``ops.linear_logprobs_path`` makes before it
calls the op; ``ONE_PROCESS`` is the reduce step of one process (``vocab_parallel.GroupReduce`` a group's).

Every layer-1 function takes its operands as one ``kernels.operands.HeadOperands`` (hidden, weight, targets, bias,
the ``transform.LogitTransform``, LoRA's pair or None), as the kernels do, and a backward its fp32 buffers as one
``HeadGrads``; the head path is one of config.HEAD_PATHS and the backward mode one of config.BACKWARD_MODES (the
caller's choices, passed down as arguments).
"""

import torch

from grpo_fast.head import torch_twin
from grpo_fast.kernels import backward as kbackward
from grpo_fast.kernels import config as kconfig
from grpo_fast.kernels import forward as kforward
from grpo_fast.kernels import forward_frozen as kfrozen
from grpo_fast.kernels import softmax_stats, tuning


class TritonBackend:
    """Layer 1 by the Triton kernels (``kernels``; cuBLAS GEMMs in the chunked backward and the frozen head), each
    launch configured here from the device and dtype. ``TorchBackend`` has the same methods and signatures."""

    name = "triton"
    backward_modes = kconfig.BACKWARD_MODES
    trained_head = True  # forward_trained_head

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

    def forward_trained_head(self, head, coefficients, grads, token_chunk=None):
        """The three-sweep trained head (``kernels.forward_frozen.forward_trained_head``): (logp, entropy,
        BackwardStats), dH / dW / db of the loss whose dL/dlogp ``coefficients`` gives into ``grads``, in chunks of
        ``token_chunk`` tokens (None: the default)."""
        config = kconfig.frozen_head_config(head.hidden.device)
        return kfrozen.forward_trained_head(head, True, config, coefficients, grads, token_chunk)

    def grad_hidden_buffer(self, hidden, backward_mode):
        """dH's fp32 buffer for ``backward``: the chunked backward's GEMMs write it once (fp32 output, never a K = V
        reduction rounded to the input dtype); the fused one accumulates into zeros."""
        if backward_mode == "chunked":
            return torch.empty(hidden.shape, dtype=torch.float32, device=hidden.device)
        return torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)

    def backward(self, head, stats, grad_logp, grad_entropy, grads, backward_mode):
        wide_epilogue = head.transform.softcap is not None or grad_entropy is not None
        hidden, has_lora = head.hidden, head.lora is not None
        cfg = kconfig.backward_config(hidden.device, hidden.dtype, backward_mode, wide_epilogue, has_lora)
        run = kbackward.backward_chunked if backward_mode == "chunked" else kbackward.backward_fused
        run(head, stats, grad_logp, grad_entropy, grads, cfg)


class TorchBackend:
    """Layer 1 by the chunked-torch twin (``head.torch_twin``), on any device, with one backward ("chunked")."""

    name = "torch"
    backward_modes = ("chunked",)
    trained_head = False  # no forward_trained_head: the recompute path

    def runs_on(self, device):
        return True

    def check_sizes(self, tokens, vocab_size):
        """No index limit: torch indexes in int64."""

    def forward(self, head, compute_entropy, row_count=None):
        """``row_count`` is not read: the twin's chunks compute the padding rows too (zeros)."""
        return torch_twin.forward(head, compute_entropy)

    def forward_record(self, head, compute_entropy):
        return torch_twin.forward_record(head, compute_entropy)

    def frozen_head_available(self, hidden):
        return True

    def forward_frozen_head(self, head):
        return torch_twin.forward_frozen_head(head, True)

    def forward_frozen_record(self, head):
        return torch_twin.forward_frozen_record(head, True)[:3]

    def grad_hidden_buffer(self, hidden, backward_mode):
        """dH's fp32 zero accumulator for ``backward``."""
        return torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)

    def backward(self, head, stats, grad_logp, grad_entropy, grads, backward_mode):
        torch_twin.backward(head, stats, grad_logp, grad_entropy, grads)


TRITON, TORCH = TritonBackend(), TorchBackend()
BACKENDS = {backend.name: backend for backend in (TRITON, TORCH)}


def as_backend(backend):
    """A backend object from itself or its name (the custom ops' schemas carry the name)."""
    return BACKENDS[backend] if isinstance(backend, str) else backend


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
        and backend.trained_head
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
