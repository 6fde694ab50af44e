"""Builders for the verl tests: tiny random models (configs in code, no hub), verl's two input layouts, the fp64
truth, and verl's apply_monkey_patch with a chosen backend (restoring the class forward it replaces)."""

import contextlib

import torch
import verl  # noqa: F401  (loads the plugins, grpo_fast.verl among them)
from transformers import Gemma2Config, Gemma2ForCausalLM, Qwen2Config, Qwen2ForCausalLM
from verl.models.transformers.monkey_patch import apply_monkey_patch

VOCAB = 131  # not a power of two, not a multiple of any block
HIDDEN_GRAD = "the last hidden states"


def _keep_hidden_states(backbone, args, output):
    """A forward hook on the backbone: its last hidden states (the head's input) keep their gradient."""
    if output.last_hidden_state.requires_grad:
        output.last_hidden_state.retain_grad()
    backbone.last_hidden_states = output.last_hidden_state


def tiny_qwen2(tied, dtype=torch.float32, seed=0, vocab_size=VOCAB):
    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=tied,
        attn_implementation="sdpa",
        attention_dropout=0.0,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    # a random init with logits of order 1: a real softmax, not a near-uniform one
    with torch.no_grad():
        model.get_output_embeddings().weight.normal_(0, 0.3)
    model.model.register_forward_hook(_keep_hidden_states)
    return model.to(dtype)


def tiny_gemma2(dtype=torch.float32, seed=0):
    """A tied Gemma 2 whose final_logit_softcapping (4.0, small so that it bites) verl's backends ignore."""
    config = Gemma2Config(
        vocab_size=VOCAB,
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=12,
        final_logit_softcapping=4.0,
        attn_implementation="sdpa",
        attention_dropout=0.0,
        sliding_window=8,
    )
    torch.manual_seed(seed)
    model = Gemma2ForCausalLM(config)
    with torch.no_grad():  # logits of a few units, which the cap of 4 bends
        model.get_output_embeddings().weight.normal_(0, 0.5)
    model.model.register_forward_hook(_keep_hidden_states)
    return model.to(dtype)


@contextlib.contextmanager
def patched(model, backend, use_remove_padding=False):
    """``apply_monkey_patch(model, use_fused_kernels=True, fused_kernels_backend=backend)``, verl's own call;
    verl replaces the model's class forward, which is restored on exit."""
    cls = type(model)
    original = cls.forward
    try:
        apply_monkey_patch(
            model, use_remove_padding=use_remove_padding, use_fused_kernels=True, fused_kernels_backend=backend
        )
        yield model
    finally:
        cls.forward = original


def padded_batch(B=3, T=9, seed=1):
    """verl's padded layout: ids [B, T] right-padded (rows of lengths T, T - 3, 2), attention mask, positions."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (B, T), generator=g)
    lengths = torch.tensor([T, T - 3, 2][:B])
    mask = torch.arange(T)[None] < lengths[:, None]
    ids[~mask] = 0  # the pad id
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    return dict(input_ids=ids, attention_mask=mask.long(), position_ids=positions), mask


def packed_batch(lengths=(7, 4, 1, 5), seed=1):
    """verl's remove-padding layout: the sequences packed into [1, nnz], positions restarting per sequence, no
    attention mask, and shift_labels the ids rolled over the whole packed sequence (as the FSDP engine passes)."""
    g = torch.Generator().manual_seed(seed)
    nnz = sum(lengths)
    ids = torch.randint(0, VOCAB, (1, nnz), generator=g)
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    return dict(input_ids=ids, position_ids=positions, shift_labels=torch.roll(ids, -1, dims=1)), torch.ones(
        1, nnz, dtype=torch.bool
    )


def targets_of(inputs):
    return inputs.get("shift_labels", torch.roll(inputs["input_ids"], -1, dims=-1))


def truth_from_logits(logits, targets, temperature):
    """fp64 log-probs and entropies from logits (the model's own, its soft-cap and scale included)."""
    logp_all = (logits.double() / temperature).log_softmax(-1)
    logp = logp_all.gather(-1, targets[..., None])[..., 0]
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


def model_truth(model, inputs, temperature):
    """Per-position log-probs and entropies through the model's own (HF, unpatched) forward, differentiable: the
    truth when the model is fp64."""
    logits = model(**{k: v for k, v in inputs.items() if k != "shift_labels"}, use_cache=False).logits
    return truth_from_logits(logits, targets_of(inputs), temperature)


def head_truth(model, inputs, temperature):
    """The model's own backbone in its dtype, its lm_head in fp64 from those hidden states (no soft-cap: Qwen2)."""
    hidden = model.model(**{k: v for k, v in inputs.items() if k != "shift_labels"}, use_cache=False).last_hidden_state
    head = model.get_output_embeddings()
    logits = hidden.double() @ head.weight.double().T
    return truth_from_logits(logits, targets_of(inputs), temperature)


def fused_outputs(model, inputs, temperature):
    out = model(**inputs, return_dict=True, temperature=temperature, use_cache=False)
    return out.log_probs, out.entropy


def loss_and_grads(model, outputs, valid, seed=2):
    """sum(c * logp + e * entropy) over the valid positions with fixed random c, e; the backward; every parameter's
    gradient (fp64 for comparison) by name, and the head's input gradient as HIDDEN_GRAD."""
    g = torch.Generator().manual_seed(seed)
    c = torch.randn(valid.shape, generator=g, dtype=torch.float64)
    e = torch.randn(valid.shape, generator=g, dtype=torch.float64)
    logp, entropy = outputs
    loss = ((c * logp.double() + e * entropy.double()) * valid).sum()
    model.zero_grad(set_to_none=True)
    loss.backward()
    grads = {name: p.grad.double().clone() for name, p in model.named_parameters() if p.grad is not None}
    grads[HIDDEN_GRAD] = model.model.last_hidden_states.grad.double()
    return grads
