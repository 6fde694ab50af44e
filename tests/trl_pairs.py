"""Run TRL 1.16's own trainer and grpo_fast.trl's on identical copies, seeds and data, and compare them.

Builders beyond tests/trl_harness.py (whose tiny models, tokenizer, prompts and config this module reuses):

* ``token_reward``: a reward in TRL's signature that differs between completions (the mean token id), so every
  group has non-zero advantages; it records the completion ids it scores in ``token_reward.seen``.
* ``GradRecorder``: a ``TrainerCallback`` that keeps every parameter's gradient at each optimizer step.
* ``trl_kernel_forbidden``: a context in which TRL's ``ChunkedLogProbFunction`` raises if anything calls it.
* ``train``: one ``trainer.train()`` of a trainer class on a model copy -> ``Run`` (log history, gradients,
  completions, final parameters); ``assert_runs_match``: two runs equal within ``RTOL``.
* ``save_model``: a tiny model saved to a folder, so that TRL builds its reference model from that path (offline).
* ``eager_lm_head``: TRL's ``add_fused_lm_head`` protocol on the model's own logits (the lm_head module's forward,
  so a PEFT adapter on it applies): what TRL's trainer is compared against where TRL's fused head is wrong (LoRA on
  the lm_head: TRL 1.16 has no non-fused path).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import types

import torch
from transformers import TrainerCallback
from trl.kernels.chunked_logprob import ChunkedLogProbFunction
from trl.trainer.utils import FusedCausalLMOutput
from trl_harness import BYTE_VOCAB_SIZE, byte_tokenizer, tiny_prompt_dataset

# "within 1e-5" (fp32): metrics and losses relative, with an absolute floor for values that are ~0 (a loss or KL of
# rounding noise at the first step); gradients relative to each tensor's largest entry
RTOL, ATOL = 1e-5, 1e-6
# log_history entries that measure time, not the model
TIMING_KEYS = ("step_time", "train_runtime", "train_samples_per_second", "train_steps_per_second")


def token_reward(completions, completion_ids, **kwargs):
    """The mean token id of each completion / vocab size (TRL's reward signature); records the ids it saw."""
    token_reward.seen.append([list(ids) for ids in completion_ids])
    return [sum(ids) / (BYTE_VOCAB_SIZE * max(len(ids), 1)) for ids in completion_ids]


token_reward.seen = []


class GradRecorder(TrainerCallback):
    """Every parameter's gradient at each optimizer step (after clipping, as the optimizer sees it)."""

    def __init__(self):
        self.grads = []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.grads.append({name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None})


@contextlib.contextmanager
def autograd_function_forbidden(function_cls):
    """``function_cls`` (a torch.autograd.Function of TRL's) raises if anything applies it."""

    def forbidden(*args, **kwargs):
        raise AssertionError(f"TRL's {function_cls.__name__} ran")

    own = {name: function_cls.__dict__.get(name) for name in ("apply", "forward")}  # apply is inherited
    function_cls.apply = classmethod(forbidden)
    function_cls.forward = staticmethod(forbidden)
    try:
        yield
    finally:
        for name, attribute in own.items():
            if attribute is None:
                delattr(function_cls, name)
            else:
                setattr(function_cls, name, attribute)


def trl_kernel_forbidden():
    """TRL's fused-head kernel raises if called (``trl.trainer.utils._ChunkedLogProbFunction`` is the same class)."""
    return autograd_function_forbidden(ChunkedLogProbFunction)


@dataclasses.dataclass
class Run:
    log_history: list
    grads: list
    completions: list
    params: dict


def train(trainer_cls, model, args, *, forbid_trl_kernel=False, **trainer_kwargs) -> Run:
    """``trainer_cls(model=model, ...)`` trained for ``args.max_steps`` from seed 0 (LoRA init and sampling too)."""
    recorder = GradRecorder()
    token_reward.seen = []
    kernel_guard = trl_kernel_forbidden() if forbid_trl_kernel else contextlib.nullcontext()
    with kernel_guard:
        torch.manual_seed(0)
        trainer = trainer_cls(
            model=model,
            reward_funcs=[token_reward],
            args=args,
            train_dataset=trainer_kwargs.pop("train_dataset", tiny_prompt_dataset()),
            processing_class=byte_tokenizer(),
            callbacks=[recorder],
            **trainer_kwargs,
        )
        trainer.train()
    params = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    return Run(trainer.state.log_history, recorder.grads, token_reward.seen, params)


def assert_close(actual, expected, name):
    torch.testing.assert_close(
        torch.as_tensor(actual, dtype=torch.float64),
        torch.as_tensor(expected, dtype=torch.float64),
        rtol=RTOL,
        atol=ATOL,
        msg=lambda m: f"{name}: {m}",
    )


def assert_tensors_close(actual: dict, expected: dict, what):
    """Each tensor within RTOL of the largest |entry| of the expected one."""
    assert actual.keys() == expected.keys(), what
    for name, b in expected.items():
        err = (actual[name].double() - b.double()).abs().max().item()
        scale = b.double().abs().max().item()
        assert err <= RTOL * scale + 1e-12, f"{what} {name}: max error {err:.3g} vs max |value| {scale:.3g}"


def assert_runs_match(ours: Run, theirs: Run):
    """Same completions, every logged metric and loss, every gradient at every step, the final parameters."""
    assert ours.completions == theirs.completions and ours.completions, "the completions differ"
    assert len(ours.log_history) == len(theirs.log_history)
    for step, (a, b) in enumerate(zip(ours.log_history, theirs.log_history)):
        assert a.keys() == b.keys(), f"log entry {step}"
        for key in b:
            if key not in TIMING_KEYS:
                assert_close(a[key], b[key], f"log entry {step} {key}")
    assert len(ours.grads) == len(theirs.grads) > 0
    for step, (a, b) in enumerate(zip(ours.grads, theirs.grads)):
        assert_tensors_close(a, b, f"gradient at optimizer step {step}")
    assert_tensors_close(ours.params, theirs.params, "trained parameter")


def save_model(model, folder):
    """``model`` saved to ``folder`` (returned as a string): TRL loads the policy and its reference model from it."""
    model.save_pretrained(folder)
    return str(folder)


def eager_lm_head(model, temperature=1.0, cast_lm_head_to_fp32=False, outputs=("log_probs",)):
    """TRL's ``add_fused_lm_head`` (log-probs, entropy, loss, label mask) computed eagerly from the [B, T, V] logits of
    ``model.get_output_embeddings()`` called as a module, in fp32, for text models without a logit transform."""
    assert not cast_lm_head_to_fp32 and getattr(model.config.get_text_config(), "final_logit_softcapping", None) is None
    original_forward = model.forward

    @functools.wraps(type(model).forward)
    def forward(self, *args, fused_lm_head=False, labels=None, num_items_in_batch=None, **kwargs):
        if not fused_lm_head:
            return original_forward(*args, labels=labels, **kwargs)
        hidden = self.base_model(*args, **kwargs, use_cache=False).last_hidden_state[:, :-1]
        labels = labels[:, 1:]
        mask = labels != -100
        logp_all = torch.log_softmax(self.get_output_embeddings()(hidden).float() / temperature, -1)
        log_probs = logp_all.gather(-1, labels.clamp(min=0)[..., None])[..., 0] * mask
        entropy = -(logp_all.exp() * logp_all).sum(-1) * mask
        loss = -log_probs.sum() / (mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch)
        return FusedCausalLMOutput(
            loss=loss, log_probs=log_probs, entropy=entropy if "entropy" in outputs else None, label_mask=mask
        )

    model.forward = types.MethodType(forward, model)
