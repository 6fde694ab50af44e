"""grpo_fast.trl.add_fused_lm_head against TRL 1.16's own add_fused_lm_head, output by output (fp32, CPU).

Each case patches two copies of one tiny model, one with TRL's head and one with grpo_fast's, runs
``model(..., labels=..., fused_lm_head=True)`` and compares every field of the ``FusedCausalLMOutput`` and every
parameter's gradient of a loss that uses both the log-probs and the entropy. PEFT LoRA on the lm_head, which TRL's
head ignores, is compared with the PEFT model's own logits path in fp64 instead.
"""

import contextlib
import copy
import functools
import importlib
import inspect
import sys

import pytest
import torch
from conftest import grad_rtol
from transformers import MixtralConfig, MixtralForCausalLM
from trl.trainer.utils import add_fused_lm_head as trl_add_fused_lm_head
from trl_harness import BYTE_VOCAB_SIZE, tiny_gemma2, tiny_qwen2
from trl_pairs import assert_close, assert_tensors_close, trl_kernel_forbidden

import grpo_fast
import grpo_fast.trl
from grpo_fast import reference
from grpo_fast.trl import OUTPUTS, add_fused_lm_head


def batch(B=3, T=10, prompt=4, seed=0):
    """input ids and labels: -100 on each row's prompt, and on the whole last row (no label at all)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, BYTE_VOCAB_SIZE, (B, T), generator=g)
    labels = ids.clone()
    labels[:, :prompt] = -100
    labels[-1] = -100
    return ids, labels


def patched_pair(model, **head_kwargs):
    theirs, ours = model, copy.deepcopy(model)
    trl_add_fused_lm_head(theirs, **head_kwargs)
    add_fused_lm_head(ours, **head_kwargs)
    return ours, theirs


def forward_backward(model, entropy_weight=0.1, **inputs):
    """The fused output and every parameter's gradient of loss + entropy_weight * sum(entropy)."""
    model.zero_grad(set_to_none=True)
    out = model(**inputs, fused_lm_head=True)
    (out.loss + entropy_weight * out.entropy.sum()).backward()
    return out, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_outputs_match(ours, theirs, outputs=OUTPUTS):
    for name in outputs + ("loss",):
        assert_close(getattr(ours, name).float(), getattr(theirs, name).float(), name)
    assert torch.equal(ours.label_mask, theirs.label_mask)
    assert ours.is_top1 is None or ours.is_top1.dtype == torch.bool


def with_bias(model):
    """The model with a biased lm_head (TRL's head reads ``lm_head.bias``)."""
    head = model.lm_head
    biased = torch.nn.Linear(head.in_features, head.out_features, bias=True)
    with torch.no_grad():
        biased.weight.copy_(head.weight)
        biased.bias.copy_(torch.randn(head.out_features, generator=torch.Generator().manual_seed(3)))
    model.lm_head = biased
    return model


def with_config(**attributes):
    """A Qwen2 whose config carries a logit scale that TRL's head reads (Qwen2's own forward ignores them)."""
    model = tiny_qwen2()
    for name, value in attributes.items():
        setattr(model.config, name, value)
    return model


def softcapped_gemma2():
    model = tiny_gemma2(final_logit_softcapping=2.0)
    with torch.no_grad():
        model.lm_head.weight.mul_(40.0)  # raw logits well past the cap
    return model


MODELS = {
    "qwen2_untied": tiny_qwen2,
    "qwen2_tied": lambda: tiny_qwen2(tie_word_embeddings=True),
    "gemma2_softcap": softcapped_gemma2,
    "bias": lambda: with_bias(tiny_qwen2()),
    "logit_scale": lambda: with_config(logit_scale=0.5),
    "output_multiplier": lambda: with_config(output_multiplier=2.0),
    "lm_head_multiplier": lambda: with_config(lm_head_multiplier=3.0),
    "logits_scaling_divides": lambda: with_config(logits_scaling=4.0),
    "logits_scaling_hyperclovax_multiplies": lambda: with_config(logits_scaling=1.5, model_type="hyperclovax"),
}


@pytest.mark.parametrize("name", MODELS)
def test_every_output_and_gradient_match_trl_head(name):
    ours, theirs = patched_pair(MODELS[name](), temperature=0.7, outputs=OUTPUTS)
    ids, labels = batch()
    with trl_kernel_forbidden():
        out, grads = forward_backward(ours, input_ids=ids, labels=labels)
    ref_out, ref_grads = forward_backward(theirs, input_ids=ids, labels=labels)
    assert_outputs_match(out, ref_out)
    assert_tensors_close(grads, ref_grads, "gradient")
    assert (out.log_probs[labels[:, 1:] == -100] == 0).all() and (out.entropy[labels[:, 1:] == -100] == 0).all()


@pytest.mark.parametrize("name", ["qwen2_untied", "gemma2_softcap"])
def test_cpu_torch_backend_matches_trl_head(monkeypatch, name):
    """Outside the tests' Triton interpreter a CPU tensor runs grpo_fast's chunked torch path: the same check."""
    monkeypatch.setattr(
        grpo_fast, "logprobs_and_entropy", functools.partial(grpo_fast.logprobs_and_entropy, backend="torch")
    )
    test_every_output_and_gradient_match_trl_head(name)


def test_the_logit_transforms_bind():
    """The soft-cap and scale cases above are not vacuous: without the transform the log-probs differ a lot."""
    ids, labels = batch()
    for model, plain_config in (
        (softcapped_gemma2(), dict(final_logit_softcapping=None)),
        (with_config(logits_scaling=4.0), dict(logits_scaling=None)),
    ):
        plain = copy.deepcopy(model)
        for key, value in plain_config.items():
            setattr(plain.config, key, value)
        add_fused_lm_head(model)
        add_fused_lm_head(plain)
        with torch.no_grad():
            diff = (
                (
                    model(input_ids=ids, labels=labels, fused_lm_head=True).log_probs
                    - plain(input_ids=ids, labels=labels, fused_lm_head=True).log_probs
                )
                .abs()
                .max()
            )
        assert diff > 0.1


def test_shift_labels_num_items_and_only_log_probs():
    """Pre-shifted labels are scored as given; num_items_in_batch divides the loss; unrequested fields are None."""
    ours, theirs = patched_pair(tiny_qwen2())
    ids, labels = batch()
    shift = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], -100)], 1)
    kwargs = dict(input_ids=ids, shift_labels=shift, num_items_in_batch=torch.tensor(7))
    out, ref = ours(**kwargs, fused_lm_head=True), theirs(**kwargs, fused_lm_head=True)
    assert out.log_probs.shape == ids.shape
    assert_outputs_match(out, ref, outputs=("log_probs",))
    assert all(getattr(out, name) is None for name in OUTPUTS[1:]) and out.aux_loss is None
    unshifted = ours(input_ids=ids, labels=labels, fused_lm_head=True)
    torch.testing.assert_close(out.log_probs[:, :-1], unshifted.log_probs)


def test_all_masked_batch_is_a_connected_zero():
    """A micro-batch without labels: zero outputs and loss, and a backward that works and gives zero gradients."""
    ours, _ = patched_pair(tiny_qwen2(), outputs=OUTPUTS)
    ids, _ = batch()
    out, grads = forward_backward(ours, input_ids=ids, labels=torch.full_like(ids, -100))
    assert out.loss.item() == 0 and not any(getattr(out, name).any() for name in OUTPUTS)
    assert out.loss.requires_grad and all(not g.any() for g in grads.values())


def test_plain_forward_and_generation_are_the_model_own():
    model = tiny_qwen2()
    original = copy.deepcopy(model)
    add_fused_lm_head(model)
    ids, labels = batch()
    torch.testing.assert_close(model(input_ids=ids).logits, original(input_ids=ids).logits, rtol=0, atol=0)
    torch.testing.assert_close(model(input_ids=ids, labels=ids).loss, original(input_ids=ids, labels=ids).loss)
    assert "input_ids" in inspect.signature(model.forward).parameters  # generate validates kwargs against it
    generated = model.generate(ids[:1, :4], max_new_tokens=3, do_sample=False)
    assert torch.equal(generated, original.generate(ids[:1, :4], max_new_tokens=3, do_sample=False))


def test_unknown_output_is_refused():
    with pytest.raises(ValueError, match="logits"):
        add_fused_lm_head(tiny_qwen2(), outputs=("log_probs", "logits"))


def spy_on_kernel(monkeypatch):
    """Records the hidden states and weight grpo_fast.trl hands to grpo_fast.logprobs_and_entropy."""
    seen = []
    real = grpo_fast.logprobs_and_entropy

    def spy(hidden, weight, targets, **kwargs):
        seen.append((hidden.detach(), weight.detach(), targets, kwargs))
        return real(hidden, weight, targets, **kwargs)

    monkeypatch.setattr(grpo_fast, "logprobs_and_entropy", spy)
    return seen


@pytest.mark.parametrize(
    "autocast, cast_lm_head_to_fp32, compute_dtype",
    [(False, False, torch.float32), (True, False, torch.bfloat16), (True, True, torch.float32)],
)
def test_compute_dtype_as_trl(monkeypatch, autocast, cast_lm_head_to_fp32, compute_dtype):
    """TRL's compute dtype: the autocast dtype when autocast is on, unless cast_lm_head_to_fp32 (fp32, autocast off).
    An fp32 model under bf16 autocast: grpo_fast gets bf16 hidden states and weight (a differentiable cast: the
    weight's gradient comes back in fp32) and is exact for those inputs, where TRL's bf16 logit tiles are not."""
    seen = spy_on_kernel(monkeypatch)
    ours, theirs = patched_pair(
        tiny_qwen2(), cast_lm_head_to_fp32=cast_lm_head_to_fp32, outputs=("log_probs", "entropy")
    )
    ids, labels = batch()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out, grads = forward_backward(ours, input_ids=ids, labels=labels)
        ref, _ = forward_backward(theirs, input_ids=ids, labels=labels)
    hidden, weight, targets, kwargs = seen[0]
    assert hidden.dtype == weight.dtype == compute_dtype
    assert out.log_probs.dtype == torch.float32 and grads["lm_head.weight"].dtype == torch.float32
    truth, _ = reference.logprobs_and_entropy(
        hidden.double(), weight.double(), targets.clamp(min=0), compute_dtype=torch.float64
    )
    truth = truth.masked_fill(~kwargs["completion_mask"], 0)
    assert (out.log_probs.double() - truth).abs().max() < 1e-5
    trl_error = (ref.log_probs.double() - truth).abs().max()
    assert trl_error < (0.1 if compute_dtype == torch.bfloat16 else 1e-5)


def test_moe_load_balancing_loss_as_trl():
    config = MixtralConfig(
        vocab_size=BYTE_VOCAB_SIZE,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_local_experts=4,
        num_experts_per_tok=2,
        output_router_logits=True,
        router_aux_loss_coef=0.1,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    ours, theirs = patched_pair(MixtralForCausalLM(config), outputs=("log_probs", "entropy"))
    ids, labels = batch()
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    out, grads = forward_backward(ours, input_ids=ids, labels=labels, attention_mask=mask)
    ref, ref_grads = forward_backward(theirs, input_ids=ids, labels=labels, attention_mask=mask)
    assert out.aux_loss is not None and out.aux_loss > 0
    assert_close(out.aux_loss, ref.aux_loss, "aux_loss")
    assert_outputs_match(out, ref, outputs=("log_probs", "entropy"))
    assert_tensors_close(grads, ref_grads, "gradient")


def test_peft_model_patched_on_its_base():
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    ours, theirs = patched_pair(tiny_qwen2(), outputs=("log_probs", "entropy"))
    torch.manual_seed(1)
    ours = get_peft_model(ours, lora)
    torch.manual_seed(1)
    theirs = get_peft_model(theirs, lora)
    ids, labels = batch()
    out, grads = forward_backward(ours, input_ids=ids, labels=labels)
    ref, ref_grads = forward_backward(theirs, input_ids=ids, labels=labels)
    assert_outputs_match(out, ref, outputs=("log_probs", "entropy"))
    assert_tensors_close(grads, ref_grads, "gradient")
    assert grads and all("lora_" in name for name in grads)


# --------------------------------------------------------------------------- DeepSpeed ZeRO-3, simulated
def zero3_simulation(monkeypatch, *partitioned):
    """DeepSpeed ZeRO-3's contract on some parameters, without DeepSpeed: their data is empty except inside the
    gather context (TRL's ``maybe_gather_lm_head_ctx``, which grpo_fast.trl calls)."""
    full = {id(p): p.data for p in partitioned}
    for p in partitioned:
        p.data = torch.empty(0)

    @contextlib.contextmanager
    def gather(*params):
        gathered = [p for p in params if p is not None and id(p) in full and p.numel() == 0]
        for p in gathered:
            p.data = full[id(p)]
        try:
            yield
        finally:
            for p in gathered:
                p.data = torch.empty(0)

    monkeypatch.setattr(grpo_fast.trl, "is_deepspeed_zero3_enabled", lambda: True)
    monkeypatch.setattr(grpo_fast.trl, "maybe_gather_lm_head_ctx", gather)


def zero3_grads(model, ids, labels):
    """Gradients by autograd.grad: the partitioned parameter's own grad accumulation is DeepSpeed's business."""
    out = model(input_ids=ids, labels=labels, fused_lm_head=True)
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.autograd.grad(out.loss + 0.1 * out.entropy.sum(), params)


def test_zero3_weight_is_gathered_for_the_forward_and_again_for_the_backward(monkeypatch):
    model, plain = patched_pair(tiny_qwen2(), outputs=("log_probs", "entropy"))
    add_fused_lm_head(plain, outputs=("log_probs", "entropy"))  # grpo_fast's head, unpartitioned
    ids, labels = batch()
    expected = zero3_grads(plain, ids, labels)
    zero3_simulation(monkeypatch, model.lm_head.weight)
    grads = zero3_grads(model, ids, labels)
    assert model.lm_head.weight.numel() == 0  # partitioned again after the backward
    for g, e in zip(grads, expected):
        torch.testing.assert_close(g, e)


def test_zero3_backward_without_the_second_gather_fails(monkeypatch):
    """Why the saved-tensor hook exists: the forward's gather has been released when the backward runs."""
    model = tiny_qwen2()
    add_fused_lm_head(model, outputs=("log_probs", "entropy"))
    zero3_simulation(monkeypatch, model.lm_head.weight)
    monkeypatch.setattr(grpo_fast.trl, "_gathered_again_for_backward", lambda *p: contextlib.nullcontext())
    ids, labels = batch()
    with pytest.raises(RuntimeError, match="invalid gradient"):  # the released (empty) weight, read by the backward
        zero3_grads(model, ids, labels)


# --------------------------------------------------------------------------- PEFT LoRA on the lm_head
# TRL's own head reads lm_head.weight (PEFT's base weight): on this model its log-probs are far off and lora_A / lora_B
# of the head get no gradient. The truth is the PEFT model's own logits path, in fp64.
HEAD_ADAPTER = ("base_model.model.lm_head.lora_A.default.weight", "base_model.model.lm_head.lora_B.default.weight")


def lora_on_head(dtype=torch.float32, target_modules=("q_proj", "lm_head"), cast_lm_head_to_fp32=False, **config):
    """A tiny Qwen2 with grpo_fast's head, then PEFT LoRA (random B: the adapter changes the logits)."""
    from peft import LoraConfig, get_peft_model

    model = tiny_qwen2(dtype=dtype)
    add_fused_lm_head(model, temperature=0.7, outputs=OUTPUTS, cast_lm_head_to_fp32=cast_lm_head_to_fp32)
    torch.manual_seed(1)
    config = dict(r=4, lora_alpha=8, init_lora_weights=False, **config)
    return get_peft_model(model, LoraConfig(target_modules=list(target_modules), **config))


def logits_path(logits, labels, temperature=0.7):
    """log-probs and entropies [B, T - 1] of the labels from the model's own logits (zero where the label is -100),
    and the fused head's loss."""
    logp_all = torch.log_softmax(logits[:, :-1] / temperature, -1)
    labels = labels[:, 1:]
    mask = labels != -100
    logp = logp_all.gather(-1, labels.clamp(min=0)[..., None])[..., 0] * mask
    entropy = -(logp_all.exp() * logp_all).sum(-1) * mask
    return logp, entropy, -logp.sum() / mask.sum()


def extras_path(logits, labels, temperature=0.7):
    """The no-grad extras of OUTPUTS from the model's own logits (zero / False where the label is -100)."""
    z, labels = logits[:, :-1] / temperature, labels[:, 1:]
    mask = labels != -100
    return dict(
        log_sum_sq_probs=(torch.logsumexp(2 * z, -1) - 2 * torch.logsumexp(z, -1)) * mask,
        mean_logits=z.mean(-1) * mask,
        is_top1=(z.argmax(-1) == labels) & mask,
    )


def own_logits(model, ids):
    """The PEFT model's own logits: its class's forward (the patched one's plain path would call the original
    model's forward, a closure over it, from a copy)."""
    base = model.get_base_model()
    return type(base).forward(base, input_ids=ids).logits


def truth_fp64(model, ids, labels, entropy_weight=0.1):
    """The PEFT model in fp64 through its own forward: log-probs, entropies, the extras and every gradient of
    loss + entropy_weight * sum(entropy) (forward_backward's)."""
    truth = copy.deepcopy(model).double()
    logits = own_logits(truth, ids)
    logp, entropy, loss = logits_path(logits, labels)
    (loss + entropy_weight * entropy.sum()).backward()
    grads = {n: p.grad for n, p in truth.named_parameters() if p.grad is not None}
    return logp, entropy, extras_path(logits.detach(), labels), grads


def assert_grads_within(grads, truth, rtol):
    """Each gradient within rtol of its largest entry, and none of them zero."""
    assert grads.keys() == truth.keys()
    for name, expected in truth.items():
        err = (grads[name].double() - expected).abs().max().item()
        scale = expected.abs().max().item()
        assert scale > 0 and err <= rtol * scale, f"d{name}: max error {err:.3g} vs max |grad| {scale:.3g}"


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_lora_on_lm_head_equals_peft_logits_path(monkeypatch, backend):
    monkeypatch.setattr(
        grpo_fast, "logprobs_and_entropy", functools.partial(grpo_fast.logprobs_and_entropy, backend=backend)
    )
    model = lora_on_head()
    ids, labels = batch()
    out, grads = forward_backward(model, input_ids=ids, labels=labels)
    logp, entropy, extras, truth_grads = truth_fp64(model, ids, labels)
    assert (out.log_probs.double() - logp).abs().max() < 1e-5
    assert (out.entropy.double() - entropy).abs().max() < 1e-5
    for name in ("log_sum_sq_probs", "mean_logits"):
        assert (getattr(out, name).double() - extras[name]).abs().max() < 1e-5, name
    assert torch.equal(out.is_top1, extras["is_top1"])
    assert set(HEAD_ADAPTER) <= grads.keys()
    assert_grads_within(grads, truth_grads, 1e-4)
    # what the base weight alone gives (TRL's head on this model): far off
    with model.disable_adapter():
        base = model(input_ids=ids, labels=labels, fused_lm_head=True).log_probs
    assert (base.double() - logp).abs().max() > 0.1


def test_lora_on_lm_head_bf16_model_fp32_adapters():
    """A bf16 model with PEFT's fp32 adapters (its default): the head's outputs and the adapter's gradients against
    the same bf16 backbone with the head in fp64 (PEFT's own path rounds its logits to bf16)."""
    model = lora_on_head(torch.bfloat16)
    head = model.base_model.model.lm_head
    assert head.lora_A["default"].weight.dtype == torch.float32
    ids, labels = batch()
    out, grads = forward_backward(model, input_ids=ids, labels=labels)

    model.zero_grad(set_to_none=True)
    hidden = model.base_model.model.model(input_ids=ids).last_hidden_state.double()
    a, b = head.lora_A["default"].weight, head.lora_B["default"].weight
    adapter = head.scaling["default"] * (hidden @ a.double().T) @ b.double().T
    logits = hidden @ head.base_layer.weight.double().T + adapter
    logp, entropy, loss = logits_path(logits, labels)
    (loss + 0.1 * entropy.sum()).backward()
    truth_grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert (out.log_probs.double() - logp).abs().max() < 1e-4
    assert (out.entropy.double() - entropy).abs().max() < 1e-4
    for name in HEAD_ADAPTER:  # fp32 adapters from bf16 hidden states: the head's own rounding
        assert grads[name].dtype == torch.float32
        bound = grad_rtol(grads[name].device, torch.bfloat16)
        assert_grads_within({name: grads[name]}, {name: truth_grads[name].double()}, bound)
    # the q_proj adapters, through the bf16 backbone's backward (re-rounded at every step)
    assert_grads_within(grads, {n: g.double() for n, g in truth_grads.items()}, 3e-2)


@pytest.mark.parametrize("adapter_trains", [True, False])
def test_head_path_follows_the_adapter(monkeypatch, adapter_trains):
    """A trainable head adapter needs its weight's gradient: the general path; a frozen one (and a frozen base head)
    takes the frozen-head path, which also builds the adapter's hidden-side gradient. Both exact."""
    taken = []
    real = grpo_fast.head.paths.takes_frozen_head
    monkeypatch.setattr(
        grpo_fast.head.paths, "takes_frozen_head", lambda *a, **k: taken.append(real(*a, **k)) or taken[-1]
    )
    model = lora_on_head()
    if not adapter_trains:
        for name, p in model.named_parameters():
            p.requires_grad_("lm_head" not in name)
    ids, labels = batch()
    out, grads = forward_backward(model, input_ids=ids, labels=labels, entropy_weight=0.0)
    logp, _, _, truth_grads = truth_fp64(model, ids, labels, entropy_weight=0.0)
    assert taken == [not adapter_trains]
    assert (out.log_probs.double() - logp).abs().max() < 1e-5
    assert (set(HEAD_ADAPTER) <= grads.keys()) == adapter_trains
    assert_grads_within(grads, truth_grads, 1e-4)


@pytest.mark.parametrize(
    "model_dtype, autocast, cast_lm_head_to_fp32, adapter_dtype",
    [
        (torch.float32, False, False, torch.float32),
        (torch.float32, True, False, torch.bfloat16),
        (torch.float32, True, True, torch.float32),
        (torch.bfloat16, False, False, torch.float32),
    ],
)
def test_adapter_dtype_policy(monkeypatch, model_dtype, autocast, cast_lm_head_to_fp32, adapter_dtype):
    """The adapter's weights in the compute dtype under autocast or cast_lm_head_to_fp32, else in their own (PEFT's
    fp32 adapters over a bf16 model); their gradients come back in the parameters' dtype."""
    seen = spy_on_kernel(monkeypatch)
    model = lora_on_head(model_dtype, cast_lm_head_to_fp32=cast_lm_head_to_fp32)
    ids, labels = batch()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = model(input_ids=ids, labels=labels, fused_lm_head=True)
    out.loss.backward()
    lora = seen[0][3]["lora"]
    assert lora.a.dtype == lora.b.dtype == adapter_dtype
    grad = model.get_base_model().lm_head.lora_B["default"].weight.grad
    assert grad.dtype == torch.float32 and grad.abs().max() > 0


def test_merged_and_disabled_adapters_are_the_base_weight():
    ids, labels = batch()
    model = lora_on_head()
    with torch.no_grad():
        model.merge_adapter()  # the delta is in the base weight now: PEFT's forward reads the base layer alone
        merged = model(input_ids=ids, labels=labels, fused_lm_head=True).log_probs
        logp, _, _ = logits_path(own_logits(model, ids), labels)
        assert (merged - logp).abs().max() < 1e-5
        model.unmerge_adapter()
        with model.disable_adapter():
            disabled = model(input_ids=ids, labels=labels, fused_lm_head=True).log_probs
            logp, _, _ = logits_path(own_logits(model, ids), labels)
        assert (disabled - logp).abs().max() < 1e-5
        model.merge_adapter()
        with model.disable_adapter(), pytest.raises(NotImplementedError, match="disabled but merged"):
            model(input_ids=ids, labels=labels, fused_lm_head=True)


def test_modules_to_save_lm_head():
    """modules_to_save=["lm_head"]: the wrapper's weight is the trained copy (changed here, so the test can tell)."""
    model = lora_on_head(target_modules=("q_proj",), modules_to_save=["lm_head"])
    with torch.no_grad():
        model.base_model.model.lm_head.modules_to_save["default"].weight.mul_(3.0)
    ids, labels = batch()
    out, grads = forward_backward(model, input_ids=ids, labels=labels)
    logp, _, _, truth_grads = truth_fp64(model, ids, labels)
    assert (out.log_probs.double() - logp).abs().max() < 1e-5
    assert "base_model.model.lm_head.modules_to_save.default.weight" in grads
    assert_grads_within(grads, truth_grads, 1e-4)


def two_active_adapters():
    from peft import LoraConfig

    model = lora_on_head()
    model.add_adapter("other", LoraConfig(r=2, target_modules=["lm_head"]))
    model.base_model.set_adapter(["default", "other"])
    return model


def fan_in_fan_out():
    model = lora_on_head()
    model.base_model.model.lm_head.fan_in_fan_out = True  # PEFT resets the option on an nn.Linear: set it directly
    return model


def ia3_on_head():
    from peft import IA3Config, get_peft_model

    model = tiny_qwen2()
    add_fused_lm_head(model)
    return get_peft_model(model, IA3Config(target_modules=["lm_head"], feedforward_modules=[]))


UNSUPPORTED_HEADS = {
    "dora": (lambda: lora_on_head(use_dora=True), "LoRA variant.*DoraLinearVariant"),
    "two_active_adapters": (two_active_adapters, "2 active LoRA adapters"),
    "lora_bias": (lambda: lora_on_head(lora_bias=True), "LoRA bias"),
    "fan_in_fan_out": (fan_in_fan_out, "fan_in_fan_out"),
    "ia3": (ia3_on_head, "lm_head is a Linear .*ia3"),
}


@pytest.mark.parametrize("name", UNSUPPORTED_HEADS)
def test_what_the_head_cannot_compute_exactly_is_refused(name):
    build, message = UNSUPPORTED_HEADS[name]
    ids, labels = batch()
    with pytest.raises(NotImplementedError, match=message):
        build()(input_ids=ids, labels=labels, fused_lm_head=True)


def test_lora_layer_weight_and_bias_are_the_base_layers():
    """The head reads lm_head.weight / .bias: on a PEFT lora.Linear, its base layer's (fsdp_unit_gathered)."""
    from peft import LoraConfig, get_peft_model

    from grpo_fast.integrations.hf import fsdp_unit_gathered

    head = get_peft_model(with_bias(tiny_qwen2()), LoraConfig(target_modules=["lm_head"])).base_model.model.lm_head
    with fsdp_unit_gathered(head) as (weight, bias):
        assert weight is head.base_layer.weight and bias is head.base_layer.bias


def test_zero3_lora_adapter_is_gathered(monkeypatch):
    """ZeRO-3 partitions the adapter's weights too: gathered for the call, and the backward reads the head's copy."""
    model = lora_on_head()
    ids, labels = batch()
    expected = zero3_grads(model, ids, labels)
    head = model.base_model.model.lm_head
    partitioned = (head.base_layer.weight, head.lora_A["default"].weight, head.lora_B["default"].weight)
    zero3_simulation(monkeypatch, *partitioned)
    grads = zero3_grads(model, ids, labels)
    assert all(p.numel() == 0 for p in partitioned)  # partitioned again after the backward
    for g, e in zip(grads, expected):
        torch.testing.assert_close(g, e)


# --------------------------------------------------------------------------- the version guard
@pytest.mark.parametrize("installed", ["1.14.2", "1.17.0", None])
def test_import_outside_the_tested_trl_versions_says_which_work(monkeypatch, installed):
    import trl

    if installed is None:
        monkeypatch.setitem(sys.modules, "trl", None)  # as if not installed
    else:
        monkeypatch.setattr(trl, "__version__", installed)
    # the public name, the module it stands for (grpo_fast/trl.py makes them one) and the integration's modules that
    # hold TRL (the pin itself in trl_version)
    monkeypatch.delitem(sys.modules, "grpo_fast.trl")
    for name in ("trl", "trl_version", "trl_distillation", "trl_served"):
        monkeypatch.delitem(sys.modules, f"grpo_fast.integrations.{name}", raising=False)
    with pytest.raises(ImportError, match=r"trl>=1\.16,<1\.17"):
        importlib.import_module("grpo_fast.trl")
    monkeypatch.undo()
    importlib.import_module("grpo_fast.trl")
