"""grpo_fast through verl's own ``apply_monkey_patch(model, use_fused_kernels=True, fused_kernels_backend=...)`` on a
tiny random Qwen2: per-position log-probs, entropies and every parameter's gradient against an fp64 truth and beside
verl's torch backend, in verl's padded [B, T] and remove-padding [1, nnz] layouts, tied and untied heads, fp32 and
bf16, on grpo_fast's CPU path (chunked torch) and its Triton kernels (interpreter). Also: the soft-cap verl ignores,
LoRA on the lm_head (PEFT) against the eager PEFT model, the errors for what is not supported, the plugin's
registration and its loud failure."""

import copy
import importlib
import logging
import sys
import types

import pytest
import torch
from transformers import Qwen2Config, Qwen2VLConfig
from verl.models.transformers import dense_common, monkey_patch
from verl.workers.engine.base import EngineRegistry
from verl_harness import (
    HIDDEN_GRAD,
    fused_outputs,
    head_truth,
    loss_and_grads,
    model_truth,
    packed_batch,
    padded_batch,
    patched,
    tiny_gemma2,
    tiny_qwen2,
)

import grpo_fast

TEMPERATURE = 0.7
# Gradients of the whole model: the largest error over the largest entry, per parameter. fp32: the backbone's own
# fp32 rounding (two layers of attention and MLP, against the same model in fp64) reaches ~1e-6 of the scale, per
# element a few 1e-5 where a gradient of order 10 cancels to a small entry. bf16: the head's input gradient is held
# to tests/conftest.py's bf16 bound (the Triton backward feeds its GEMMs bf16, as tensor cores need; the CPU path
# rounds once); the bf16 backbone's backward then re-rounds every step, which grows that to ~2e-2 on the weights
# (verl's torch backend, against the same truth: 1.5e-2 to 3.1e-2).
GRAD_RTOL = {torch.float32: 1e-4, torch.bfloat16: 3e-2}
HEAD_GRAD_RTOL_BF16 = 1e-2
# grpo_fast's per-token head outputs from bf16 hidden states and weight against fp64 from the same inputs: the
# products are exact in fp32, the sums fp32 (verl's torch backend rounds its logits to bf16: ~1e-2)
HEAD_ATOL_BF16 = 1e-4


@pytest.fixture
def grpo_fast_path(request, monkeypatch):
    """grpo_fast's head on the named path ("torch": its chunked CPU path; "triton": its kernels, here under the
    interpreter); the calls the plugin makes are recorded."""
    calls = []
    real = grpo_fast.logprobs_and_entropy

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return real(*args, **kwargs, backend=request.param)

    monkeypatch.setattr(grpo_fast, "logprobs_and_entropy", spy)
    return calls


def batch(layout):
    return padded_batch() if layout == "padded" else packed_batch()


def assert_fp32_close(actual, expected, name):
    torch.testing.assert_close(actual.double(), expected.double(), rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")


def assert_grads_close(actual, expected, dtype, name):
    err = (actual - expected).abs().max().item()
    scale = expected.abs().max().item()
    assert err <= GRAD_RTOL[dtype] * scale, f"{name}: max error {err:.3g} vs max |grad| {scale:.3g}"


@pytest.mark.parametrize(
    "grpo_fast_path", ["torch", pytest.param("triton", marks=pytest.mark.interpreter_only)], indirect=True
)  # verl's CPU models: the Triton kernels run on them under the interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_patched_model_equals_fp64(layout, tied, dtype, grpo_fast_path):
    inputs, valid = batch(layout)
    model = tiny_qwen2(tied, dtype)
    if dtype == torch.float32:  # the truth: the whole model in fp64, through its own HF forward
        truth_model = copy.deepcopy(model).double()
        truth = model_truth(truth_model, inputs, TEMPERATURE)
        truth_grads = loss_and_grads(truth_model, truth, valid)
    else:  # the truth: the same bf16 backbone, the head in fp64 (the backbone's own rounding is not the head's)
        truth = head_truth(model, inputs, TEMPERATURE)
        truth_grads = loss_and_grads(model, truth, valid)

    with patched(model, "grpo_fast", use_remove_padding=layout == "packed"):
        assert type(model).forward is sys.modules["grpo_fast.verl"].forward
        ours = fused_outputs(model, inputs, TEMPERATURE)
        grads = loss_and_grads(model, ours, valid)
    with patched(model, "torch", use_remove_padding=layout == "packed"):
        theirs = fused_outputs(model, inputs, TEMPERATURE)
        their_grads = loss_and_grads(model, theirs, valid)

    assert len(grpo_fast_path) == 1, "the plugin's forward did not run grpo_fast's head once"
    assert grads.keys() == truth_grads.keys() == their_grads.keys()
    assert all(g.abs().max() > 0 for g in truth_grads.values())
    for name, out, truth_out, their_out in zip(("log_probs", "entropy"), ours, truth, theirs):
        assert out.dtype == torch.float32 and out.shape == valid.shape, name
        assert (out[~valid] == 0).all(), f"{name}: padding positions are not computed"
        if dtype == torch.float32:
            assert_fp32_close(out[valid], truth_out[valid], name)
            assert_fp32_close(out[valid], their_out[valid], f"{name} against verl's torch backend")
        else:
            ours_err = (out[valid].double() - truth_out[valid]).abs().max().item()
            their_err = (their_out[valid].double() - truth_out[valid]).abs().max().item()
            assert ours_err <= HEAD_ATOL_BF16, f"{name}: {ours_err:.3g} from fp64 (verl's torch: {their_err:.3g})"
            assert ours_err < their_err, f"{name}: ours {ours_err:.3g}, verl's torch backend {their_err:.3g}"
    for name in truth_grads:
        if name == HIDDEN_GRAD and dtype == torch.bfloat16:
            err = (grads[name] - truth_grads[name]).abs().max().item()
            assert err <= HEAD_GRAD_RTOL_BF16 * truth_grads[name].abs().max().item(), f"d{name}: {err:.3g}"
        assert_grads_close(grads[name], truth_grads[name], dtype, f"d{name}")


@pytest.mark.parametrize("grpo_fast_path", ["torch"], indirect=True)
def test_softcap_applied_where_verl_ignores_it(grpo_fast_path):
    """Gemma 2's final_logit_softcapping: grpo_fast's head equals the model's own logits in fp64; verl's torch
    backend scores the raw logits (the check that this test can tell them apart)."""
    inputs, valid = padded_batch()
    model = tiny_gemma2()
    truth_model = copy.deepcopy(model).double()
    truth = model_truth(truth_model, inputs, TEMPERATURE)
    truth_grads = loss_and_grads(truth_model, truth, valid)
    with patched(model, "grpo_fast"):
        ours = fused_outputs(model, inputs, TEMPERATURE)
        grads = loss_and_grads(model, ours, valid)
    with patched(model, "torch"):
        theirs = fused_outputs(model, inputs, TEMPERATURE)
    assert grpo_fast_path[0]["softcap"] == 4.0
    for name, out, truth_out, their_out in zip(("log_probs", "entropy"), ours, truth, theirs):
        assert_fp32_close(out[valid], truth_out[valid], name)
        assert (their_out[valid].double() - truth_out[valid]).abs().max() > 1e-2, name
    for name in truth_grads:
        assert_grads_close(grads[name], truth_grads[name], torch.float32, f"d{name}")


def test_no_grad_pass_and_frozen_head():
    """The reference / old-policy pass (no grad) and a frozen lm_head (LoRA) give the same log-probs."""
    inputs, valid = packed_batch()
    model = tiny_qwen2(tied=False)
    with patched(model, "grpo_fast", use_remove_padding=True):
        logp, entropy = fused_outputs(model, inputs, TEMPERATURE)
        with torch.no_grad():
            logp_ng, entropy_ng = fused_outputs(model, inputs, TEMPERATURE)
        model.lm_head.weight.requires_grad_(False)
        frozen = fused_outputs(model, inputs, TEMPERATURE)
        grads = loss_and_grads(model, frozen, valid)
    assert not logp_ng.requires_grad
    assert_fp32_close(logp_ng, logp.detach(), "no-grad log_probs")
    assert_fp32_close(entropy_ng, entropy.detach(), "no-grad entropy")
    assert_fp32_close(frozen[0].detach(), logp.detach(), "frozen-head log_probs")
    assert "lm_head.weight" not in grads and grads["model.norm.weight"].abs().max() > 0


def lora_on_head(**config):
    """The tiny untied Qwen2 with PEFT LoRA on q_proj and lm_head (random B: the adapter changes the logits), as
    verl's FSDP engine builds it: the HF model inside the PEFT model, whose lm_head is a lora.Linear."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(1)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "lm_head"], init_lora_weights=False, **config)
    return get_peft_model(tiny_qwen2(tied=False), lora).get_base_model()


@pytest.mark.parametrize("grpo_fast_path", ["torch", "triton"], indirect=True)
@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_lora_on_lm_head_equals_fp64(layout, grpo_fast_path):
    """LoRA on the lm_head: the eager PEFT model in fp64 is the truth, gradients to the head's adapter included;
    verl's torch backend reads the base weight alone (the check that this test can tell them apart)."""
    inputs, valid = batch(layout)
    model = lora_on_head()
    truth_model = copy.deepcopy(model).double()
    truth = model_truth(truth_model, inputs, TEMPERATURE)
    truth_grads = loss_and_grads(truth_model, truth, valid)
    with patched(model, "grpo_fast", use_remove_padding=layout == "packed"):
        ours = fused_outputs(model, inputs, TEMPERATURE)
        grads = loss_and_grads(model, ours, valid)
    with patched(model, "torch", use_remove_padding=layout == "packed"):
        theirs = fused_outputs(model, inputs, TEMPERATURE)
    assert isinstance(grpo_fast_path[0]["lora"], grpo_fast.HeadLora)
    assert {"lm_head.lora_A.default.weight", "lm_head.lora_B.default.weight"} <= grads.keys() == truth_grads.keys()
    for name, out, truth_out, their_out in zip(("log_probs", "entropy"), ours, truth, theirs):
        assert_fp32_close(out[valid], truth_out[valid], name)
        assert (their_out[valid].double() - truth_out[valid]).abs().max() > 0.1, name
    for name in truth_grads:
        assert truth_grads[name].abs().max() > 0, name
        assert_grads_close(grads[name], truth_grads[name], torch.float32, f"d{name}")


def test_lora_variant_on_lm_head_refused():
    """What the head cannot apply exactly (here DoRA) raises, naming it, instead of scoring the base weight alone."""
    inputs, _ = padded_batch()
    model = lora_on_head(use_dora=True)
    with patched(model, "grpo_fast"), pytest.raises(NotImplementedError, match="DoraLinearVariant"):
        fused_outputs(model, inputs, TEMPERATURE)


@pytest.mark.parametrize(
    "backend, verl_forward", [("torch", "forward_with_torch_backend"), ("triton", "forward_with_triton_backend")]
)
def test_other_backends_untouched(backend, verl_forward):
    model = tiny_qwen2(tied=True)
    with patched(model, backend):
        assert type(model).forward is getattr(dense_common, verl_forward)
        assert model._verl_fused_kernels_backend == backend


def test_vision_language_model_refused():
    vl = types.SimpleNamespace(config=Qwen2VLConfig())
    with pytest.raises(NotImplementedError, match="vision-language.*strategy=fsdp or fsdp2"):
        monkey_patch.patch_forward_with_backends(vl, use_fused_kernels=True, fused_kernels_backend="grpo_fast")


def engine_configs(sp_size=1, hf_config=None, backend="grpo_fast"):
    model_config = types.SimpleNamespace(
        use_fused_kernels=True, fused_kernel_options={"impl_backend": backend}, hf_config=hf_config or Qwen2Config()
    )
    return dict(model_config=model_config, engine_config=types.SimpleNamespace(ulysses_sequence_parallel_size=sp_size))


@pytest.mark.parametrize(
    "strategy, configs, message",
    [
        ("megatron", engine_configs(), "'megatron' engine.*does not call verl's apply_monkey_patch"),
        ("veomni", engine_configs(), "'veomni' engine"),
        ("fsdp2", engine_configs(sp_size=2), "ulysses_sequence_parallel_size=2"),
        ("fsdp", engine_configs(hf_config=Qwen2VLConfig()), "vision-language"),
    ],
    ids=["megatron", "veomni", "sequence-parallel", "vision-language"],
)
def test_unsupported_engines_refused(strategy, configs, message):
    with pytest.raises(NotImplementedError, match=message):
        EngineRegistry.new(model_type="language_model", backend=strategy, **configs)


@pytest.mark.parametrize("strategy, backend", [("fsdp2", "grpo_fast"), ("fsdp", "grpo_fast"), ("megatron", "torch")])
def test_supported_engine_reaches_verl(strategy, backend, monkeypatch):
    """fsdp / fsdp2 with grpo_fast, and any engine with another backend, reach verl's registry unchanged."""
    built = []
    monkeypatch.setattr(
        EngineRegistry,
        "get_engine_cls",
        classmethod(lambda cls, model_type, name: lambda **kwargs: built.append((name, kwargs))),
    )
    EngineRegistry.new(model_type="language_model", backend=strategy, **engine_configs(backend=backend))
    assert [name for name, _ in built] == [strategy]


def test_registered_as_verl_plugin():
    from importlib.metadata import entry_points

    assert [ep.value for ep in entry_points(group="verl.plugins") if ep.name == "grpo_fast"] == ["grpo_fast.verl"]
    # `import verl` (verl_harness) loaded it: verl's function is wrapped, once
    wrapped = monkey_patch.patch_forward_with_backends
    assert wrapped.grpo_fast_wraps.__module__ == "verl.models.transformers.monkey_patch"
    assert not hasattr(wrapped.grpo_fast_wraps, "grpo_fast_wraps")


@pytest.mark.parametrize("break_verl", ["version", "internals"])
def test_load_failure_is_loud(break_verl, monkeypatch, caplog):
    import verl

    if break_verl == "version":
        monkeypatch.setattr(verl, "__version__", "0.8.0")
        expected = ImportError
    else:
        monkeypatch.delattr(monkey_patch, "patch_forward_with_backends")
        expected = AttributeError
    # the public name and the module it stands for (grpo_fast/verl.py makes them one): both imported afresh
    monkeypatch.delitem(sys.modules, "grpo_fast.verl")
    monkeypatch.delitem(sys.modules, "grpo_fast.integrations.verl")
    with caplog.at_level(logging.ERROR), pytest.raises(expected):
        importlib.import_module("grpo_fast.verl")
    assert any(
        r.levelno == logging.ERROR and "impl_backend=grpo_fast is unavailable" in r.getMessage() for r in caplog.records
    )
