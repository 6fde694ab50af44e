"""The peers' loss heads for grpo_fast.memory's estimate, as they run on a GPU, over fake CPU tensors.

    heads = {"eager": memory.EagerHead, **peer_heads(), "grpo_fast": memory.GrpoFastHead}
    memory.main(argv, heads=heads)            # or memory.estimate(recipe, heads)

TRL 1.16's fused head (``TrlHead``): on a CPU, trl.kernels.chunked_logprob takes torch twins of its Triton kernels
that allocate fp32 copies of every logits tile; on a GPU its kernels write in place and cuBLAS accumulates in fp32
in place. ``trl_gpu_path`` swaps the module's private kernel hooks for in-place stand-ins for the block, so that
the tracker accounts what the GPU allocates. Its log-probs then go to grpo_fast's token loss, as every head's do.
"""

from __future__ import annotations

import contextlib
import importlib

import torch

from grpo_fast.memory import LossHead


class _InPlaceKernel:
    """A Triton kernel launched as ``kernel[grid](...)``: it writes into the buffers it is given and allocates
    nothing, so over fake tensors (no values to write) the launch is a no-op."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def _addmm_fp32_cuda(acc, a, b):
    """TRL's ``_addmm_fp32`` as it runs on CUDA, over fake tensors: cuBLAS accumulates the product into the fp32
    ``acc`` in place (``out_dtype`` for bf16 / fp16) and allocates nothing, so there is nothing to account and no
    value to write (not the CPU fallback's fp32 copies of both operands). Not run as an op: torch 2.11's fake
    ``addmm`` with ``out_dtype`` fails in its decomposition."""


@contextlib.contextmanager
def trl_gpu_path():
    """trl.kernels.chunked_logprob as it runs on a GPU: its Triton kernels (in-place stand-ins) instead of the torch
    twins a CPU takes, which allocate fp32 copies of every [4096, 32768] logits tile."""
    from trl.kernels import chunked_logprob

    names = ("_use_triton", "_forward_kernel", "_backward_kernel", "_addmm_fp32")
    saved = {name: getattr(chunked_logprob, name) for name in names}
    chunked_logprob._use_triton = lambda device: True
    chunked_logprob._forward_kernel = chunked_logprob._backward_kernel = _InPlaceKernel()
    chunked_logprob._addmm_fp32 = _addmm_fp32_cuda
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(chunked_logprob, name, value)


class TrlHead(LossHead):
    """TRL 1.16's fused head as GRPOTrainer calls it (trl.trainer.utils.add_fused_lm_head's forward with
    ``fused_lm_head=True``): the scored positions' hidden states gathered ([N, D], every completion token valid),
    ``ChunkedLogProbFunction`` with log-probs and entropy in tiles of 32768 vocabulary rows, scattered back to
    [B, T]; then grpo_fast's token loss."""

    label = "TRL 1.16 fused head"
    description = "TRL 1.16's fused head as on a GPU (its Triton kernels write in place)"
    packages = ("trl",)

    @contextlib.contextmanager
    def on_fake_tensors(self):
        """The product's token loss over fake tensors (LossHead's) and TRL's GPU path (``trl_gpu_path``)."""
        with super().on_fake_tensors(), trl_gpu_path():
            yield

    def forward(self, hidden, weight):
        """The micro-batch's loss (LossHead.forward)."""
        from trl.kernels import ChunkedLogProbFunction
        from trl.trainer.utils import _CHUNKED_LOGPROB_CHUNK_SIZE

        B, T, _ = hidden.shape
        mask = self.batch.mask.bool()
        # hidden_states[mask] with every position valid: one gathered [N, D] copy (a boolean selection's size is a
        # value, which fake tensors do not have; the same positions by index)
        rows = torch.arange(B, device=hidden.device).repeat_interleave(T)
        columns = torch.arange(T, device=hidden.device).repeat(B)
        logp, _entropy_metric, *_ = ChunkedLogProbFunction.apply(
            hidden[rows, columns],
            weight,
            None,
            self.batch.targets[rows, columns],
            self.recipe.temperature,
            _CHUNKED_LOGPROB_CHUNK_SIZE,
            None,
            1.0,
            ("log_probs", "entropy"),
        )
        logp = logp.new_zeros(mask.shape).masked_scatter(mask, logp)
        return self.token_loss(logp)


def peer_heads() -> dict[str, type[LossHead]]:
    """The peers' heads whose packages import here, by name: TRL's where trl.kernels and trl.trainer.utils do."""
    try:
        for module in ("trl.kernels", "trl.trainer.utils"):
            importlib.import_module(module)
    except Exception:  # ImportError, or a failure inside its imports (a missing datasets, accelerate, ...)
        return {}
    return {"trl": TrlHead}
