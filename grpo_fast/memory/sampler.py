"""``grpo_fast.sampler_logprobs`` (issue 45) in a step's estimate: a loss head that runs it in the old policy's pass
(no grad) and / or the training pass, and the memory model of its custom ops' workspace on a GPU.

    heads = {"grpo_fast": memory.GrpoFastHead, "grpo_fast_sampler": sampler_head(SamplerSettings(top_p=0.9))}
    memory.estimate(recipe, heads)       # or: python -m grpo_fast.memory --sampler both --top-p 0.9

The memory model (``support_workspace_bytes``): over fake tensors the ops ``grpo_fast::sampler_support`` and
``grpo_fast::sampler_support_backward`` allocate their outputs only; their real implementations
(``grpo_fast.backends.support_twin``) allocate besides them:

* the sampling parameters' path: one chunk of token rows' whole logits at a time, fp32 [r, V] with r = min(N,
  max(1, ROW_BUDGET_BYTES // 4V)) (cuBLAS writes them: ``gemm.mm_fp32``), and the rules' temporaries of the same
  shape: ``FORWARD_BUFFERS`` such buffers at the forward's peak (top-p's worst case: rows whose 1024 largest logits do
  not hold top_p, each sorted whole, with its fp64 masses and int64 indices), ``BACKWARD_BUFFERS`` in the backward
  (the recompute, the gradient of the logits, the exp temporaries; on a GPU also the gradient's copy in the weight's
  half dtype that cuBLAS reads); the buffer does not grow with the tokens past r rows. A bound on the Triton
  backend's one-process path (``support_tiles``: the log-prob's record sweep with its tiles' candidates, and with
  gradients layer 1's backward and the carried kept ids' gathers), which holds such buffers only for the rows the
  candidates leave (at top-k 50 ~1e-4 of them), at most a chunk of them;
* replayed kept sets (``kept_ids`` [N, K]): [N, K] fp32 logits and gradients, ``REPLAYED_FORWARD`` /
  ``REPLAYED_BACKWARD`` of them (Triton's kernels write in place), linear in N, and where dW is formed the
  backend's ``gathered_backward_workspace_bytes`` (Triton's sort of the [N, K] pairs by id, ``kernels.kept_set``:
  at most ``PAIRS_PER_SORT`` pairs at a time); the full log-prob is layer 1's op, whose own workspace the estimate
  already adds. Without gradients (the old policy's pass) the op computes the log-prob itself, by the record sweep
  (``support_workspace.replayed_sweep_bytes``): its partials and the bitmaps of a launch's rows (V / 8 bytes a row,
  within the launch's PARTS_BYTES; on the Triton backend, at any K) instead of the [N, K] buffers, and so does the
  Triton backend's with a trained head, whose backward is layer 1's chunked one with the support's term (its g of a
  token chunk and the chunk's bitmaps: ``Backend.replayed_backward_workspace_bytes``);
* the backward's fp32 gradients of the operands it differentiates (dH [N, D], and dW [V, D] where the lm_head
  trains), cast to their dtypes at the end.

The buffer counts are measured on a CPU (the torch backend's chunked path, fp32; replayed sets with in-place
products, as Triton's kernels), each at its largest over one chunk and several (the previous chunk's buffers still
held while the next one's are made): tests/test_memory_sampler.py measures them and checks the model stays at or
above them, within 35 %. A GPU's sort workspaces and the Triton backend's own row kernels are not measured.
"""

from __future__ import annotations

from dataclasses import dataclass

from grpo_fast.memory.heads import GrpoFastHead, LossHead
from grpo_fast.memory.support_workspace import (
    PASSES,
    rules,
)


@dataclass(frozen=True)
class SamplerSettings:
    """The sampler a head's ``sampler_logprobs`` follows, and where it runs.

    Attributes:
        top_k: vLLM's top-k (0: off).
        top_p: its top-p (1.0: off).
        min_p: its min-p (0.0: off).
        kept: K of replayed kept sets (``kept_ids`` [B, T, K], a rollout input), instead of the parameters; 0: none.
        passes: where it runs: "old" (the old policy's pass: no grad, one micro-batch, after the update), "train" (the
            training pass: both log-probs differentiated, the loss on the full-vocabulary one), or both.
    """

    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    kept: int = 0
    passes: tuple = PASSES

    def __post_init__(self):
        if not self.passes or any(p not in PASSES for p in self.passes):
            raise ValueError(f"passes must be among {PASSES}, got {self.passes!r}")
        if bool(self.kept) == bool(rules(self.top_k, self.top_p, self.min_p)):
            raise ValueError("a sampler is replayed kept sets (kept > 0) or sampling parameters that truncate, one")

    def keywords(self, kept_ids=None) -> dict:
        """``sampler_logprobs``' keywords.

        Args:
            kept_ids: the replayed kept sets, where ``kept``.

        Returns:
            The keywords: kept_ids, or top_k, top_p and min_p.
        """
        if self.kept:
            return dict(kept_ids=kept_ids)
        return dict(top_k=self.top_k, top_p=self.top_p, min_p=self.min_p)

    def describe(self) -> str:
        """The sampler in a few words.

        Returns:
            The head's label: the rules or the replayed width, and the passes.
        """
        if self.kept:
            kind = f"replayed kept_ids K={self.kept}"
        else:
            kind = ", ".join(
                f"{name} {value:g}"
                for name, value, on in (
                    ("top_k", self.top_k, self.top_k > 0),
                    ("top_p", self.top_p, self.top_p < 1.0),
                    ("min_p", self.min_p, self.min_p > 0.0),
                )
                if on
            )
        where = {("old",): "old-policy pass", ("train",): "training pass"}.get(tuple(self.passes), "both passes")
        return f"{kind}; {where}"


class SamplerHead(LossHead):
    """grpo_fast with ``sampler_logprobs`` (its Triton path): in the training pass (``"train"`` in the settings'
    passes) its two log-probs differentiated and the loss on the full-vocabulary one; else ``grpo_fast.loss`` as
    ``GrpoFastHead``. ``"old"`` in the passes: the estimate also accounts the old policy's pass (``old_policy``).
    A subclass sets ``settings`` (``sampler_head``)."""

    settings = SamplerSettings(top_p=0.9)
    old_policy_pass = True
    kept_width = 0
    label = "grpo_fast + sampler_logprobs"
    description = "grpo_fast with sampler_logprobs"

    def _sampler_logprobs(self, hidden, weight):
        from grpo_fast.sampler.api import sampler_logprobs

        return sampler_logprobs(
            hidden,
            weight,
            self.batch.targets,
            self.batch.mask,
            temperature=self.recipe.temperature,
            backend="triton",
            check_values=False,  # no host reads: fake tensors hold no values
            **self.settings.keywords(self.batch.kept_ids),
        )

    def forward(self, hidden, weight):
        """The micro-batch's loss (LossHead.forward); in the old policy's pass (``old_policy``), the no-grad
        log-probs."""
        if self.in_old_policy_pass:
            return self._sampler_logprobs(hidden, weight).support_logprobs
        if "train" not in self.settings.passes:
            return GrpoFastHead.forward(self, hidden, weight)
        out = self._sampler_logprobs(hidden, weight)
        # the loss's value on the full-vocabulary log-prob; the support's gradient flows too (both differentiated)
        support = out.support_logprobs
        return self.token_loss(out.logprobs + (support - support.detach()))


def sampler_head(settings: SamplerSettings) -> type[LossHead]:
    """A ``SamplerHead`` class with these settings (a ``--heads`` choice, an ``estimate``'s head).

    Args:
        settings: the sampler and the passes it runs in.

    Returns:
        The LossHead subclass.
    """
    old = "old" in settings.passes
    return type(
        "SamplerHead",
        (SamplerHead,),
        {
            "settings": settings,
            "old_policy_pass": old,
            "kept_width": settings.kept,
            "label": f"grpo_fast + sampler_logprobs ({settings.describe()})",
            "description": (
                f"grpo_fast's Triton path with sampler_logprobs ({settings.describe()}: "
                + ("the old policy's no-grad pass of one micro-batch after the update" if old else "")
                + ("; " if old and "train" in settings.passes else "")
                + (
                    "the training pass with both its log-probs differentiated"
                    if "train" in settings.passes
                    else "; the training pass grpo_fast.loss's"
                )
                + ")"
            ),
        },
    )
