"""grpo_fast.trl's GRPOTrainer / RLOOTrainer against TRL 1.16's own on the same model, seed and data (fp32, CPU).

Training runs: the completions must be identical (generation does not go through the fused head), then every
logged metric and loss, every parameter's gradient at every optimizer step and the trained parameters agree within
1e-5. One shared generation batch then sweeps every loss type x importance-sampling level and the loss options
through ``compute_loss``. TRL's ``ChunkedLogProbFunction`` is made to raise around every grpo_fast trainer, and a
test shows that the trap does catch TRL's own trainer. LoRA on the lm_head, which TRL's trainers refuse (their head
would ignore it), is compared with TRL's trainer on an eager head (trl_pairs.eager_lm_head), its refusal lifted.
"""

import contextlib
import copy
import functools
import types

import pytest
import torch
import trl
from peft import LoraConfig
from peft.tuners.tuners_utils import BaseTunerLayer
from trl.trainer import grpo_trainer as trl_grpo_trainer
from trl.trainer import rloo_trainer as trl_rloo_trainer
from trl.trainer.utils import add_fused_lm_head as trl_add_fused_lm_head
from trl_harness import (
    _PROMPTS,
    byte_tokenizer,
    grpo_config,
    set_loss_options,
    tiny_gemma2,
    tiny_prompt_dataset,
    tiny_qwen2,
)
from trl_pairs import (
    assert_close,
    assert_runs_match,
    assert_tensors_close,
    eager_lm_head,
    save_model,
    token_reward,
    train,
    trl_kernel_forbidden,
)

import grpo_fast.trl
from grpo_fast.integrations.hf import with_module_names
from grpo_fast.trl import GRPOTrainer, RLOOTrainer

LOGGED = dict(logging_strategy="steps", logging_steps=1, optim="sgd", learning_rate=0.5, max_steps=2)


def offline_trainer_parts(args, **kwargs):
    """A trainer's keywords for a fresh tiny Qwen2, the token reward, the tiny prompt set and the byte tokenizer."""
    parts = dict(model=tiny_qwen2(), reward_funcs=[token_reward], args=args, train_dataset=tiny_prompt_dataset())
    return dict(parts, processing_class=byte_tokenizer(), **kwargs)


def runs(model, args, trainer_classes=(trl.GRPOTrainer, GRPOTrainer), **kwargs):
    """TRL's run and grpo_fast's (with TRL's kernel forbidden) of the same model (a path, or copied)."""
    theirs_cls, ours_cls = trainer_classes
    copy_of = (lambda m: m) if isinstance(model, str) else copy.deepcopy
    theirs = train(theirs_cls, copy_of(model), args, **kwargs)
    ours = train(ours_cls, copy_of(model), args, forbid_trl_kernel=True, **kwargs)
    return ours, theirs


@pytest.mark.slow
def test_reference_model_accumulation_generation_reuse_entropy_bonus_and_mask(tmp_path):
    """Untied Qwen2 loaded by path (TRL builds the reference model from it: beta != 0 runs grpo_fast's head on the
    reference model), gradient accumulation 2, steps_per_generation 2, num_iterations 2 (old-policy log-probs),
    entropy bonus, top-entropy mask, temperature."""
    path = save_model(tiny_qwen2(), tmp_path / "qwen2")
    args = grpo_config(
        beta=0.04,
        gradient_accumulation_steps=2,
        steps_per_generation=2,
        num_iterations=2,
        entropy_coef=0.01,
        top_entropy_quantile=0.5,
        temperature=0.9,
        loss_type="dapo",
        **LOGGED,
    )
    ours, theirs = runs(path, args)
    assert_runs_match(ours, theirs)
    assert {"kl", "entropy", "clip_ratio/region_mean"} <= theirs.log_history[0].keys()
    assert any(entry.get("kl", 0) > 0 for entry in theirs.log_history)  # the reference model was used


@pytest.mark.slow
def test_tied_embeddings_lora_reference_and_gradient_checkpointing():
    """Tied Qwen2 + PEFT LoRA (the head patched on the base model; beta != 0: the reference is the policy with the
    adapter disabled), gradient checkpointing, sequence-level importance sampling, accumulation 2."""
    model = tiny_qwen2(tie_word_embeddings=True)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"], task_type="CAUSAL_LM")
    args = grpo_config(
        beta=0.04,
        gradient_checkpointing=True,
        gradient_accumulation_steps=2,
        loss_type="grpo",
        importance_sampling_level="sequence",
        **LOGGED,
    )
    ours, theirs = runs(model, args, peft_config=lora)
    assert_runs_match(ours, theirs)
    assert ours.grads[0] and all("lora_" in name for name in ours.grads[0])


@pytest.mark.slow
def test_lora_on_lm_head_against_trl_trainer_on_the_eager_head(monkeypatch):
    """PEFT LoRA on q_proj and lm_head (random B: the head's adapter matters from the first step). TRL's own fused head
    reads the base weight (TRL #6530, #7017), so TRL's trainer refuses the adapter and has no other path: it runs with
    that refusal lifted and the eager head (trl_pairs.eager_lm_head: the model's own logits); beta != 0: the
    reference is the policy with its adapters disabled."""
    lora = LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "lm_head"], init_lora_weights=False, task_type="CAUSAL_LM"
    )
    args = grpo_config(beta=0.04, loss_type="dapo", temperature=0.9, **LOGGED)
    with pytest.raises(ValueError, match="PEFT adapter to `lm_head` is not supported"):
        trl.GRPOTrainer(**offline_trainer_parts(args, peft_config=lora))
    with monkeypatch.context() as patch:
        patch.setattr(trl_grpo_trainer, "BaseTunerLayer", type("NoTunerLayer", (), {}))
        patch.setattr(trl_grpo_trainer, "add_fused_lm_head", eager_lm_head)
        theirs = train(trl.GRPOTrainer, tiny_qwen2(), args, peft_config=lora)
    ours = train(GRPOTrainer, tiny_qwen2(), args, forbid_trl_kernel=True, peft_config=lora)
    assert_runs_match(ours, theirs)
    head_adapter = [name for name in ours.grads[0] if "lm_head.lora_" in name]
    assert len(head_adapter) == 2 and all(step[name].abs().max() > 0 for step in ours.grads for name in head_adapter)
    assert any(entry.get("kl", 0) > 0 for entry in theirs.log_history)


@pytest.mark.parametrize(
    "trainer_cls, lm_head_dora",
    [(GRPOTrainer, False), (RLOOTrainer, False), (GRPOTrainer, True)],
    ids=["grpo", "rloo", "grpo_dora"],
)
def test_trainers_take_lora_on_lm_head_and_refuse_what_the_head_cannot_apply(tmp_path, trainer_cls, lm_head_dora):
    """TRL's constructors refuse an adapter on the lm_head; grpo_fast's take one its head applies and name what it
    cannot (DoRA); TRL's names are TRL's again afterwards."""
    lora = LoraConfig(r=4, target_modules=["q_proj", "lm_head"], use_dora=lm_head_dora, task_type="CAUSAL_LM")
    config_cls = trl.RLOOConfig if trainer_cls is RLOOTrainer else trl.GRPOConfig
    args = config_cls(
        output_dir=str(tmp_path),
        use_cpu=True,
        report_to="none",
        per_device_train_batch_size=2,
        num_generations=2,
        max_completion_length=4,
        save_strategy="no",
    )
    build = functools.partial(trainer_cls, **offline_trainer_parts(args, peft_config=lora))
    if lm_head_dora:
        with pytest.raises(NotImplementedError, match="DoraLinearVariant"):
            build()
    else:
        trainer = build()
        assert trainer.model.get_output_embeddings().lora_B["default"].weight.requires_grad
    module = trl_grpo_trainer if trainer_cls is GRPOTrainer else trl_rloo_trainer
    assert module.add_fused_lm_head is trl_add_fused_lm_head and module.BaseTunerLayer is BaseTunerLayer


def test_trl_refusal_of_cast_lm_head_to_fp32_with_lora_on_lm_head_stays(tmp_path):
    """TRL's other check on a PEFT lm_head (cast_lm_head_to_fp32 would replace the head's forward) is not lifted."""
    lora = LoraConfig(r=4, target_modules=["lm_head"], task_type="CAUSAL_LM")
    with pytest.raises(ValueError, match="cast_lm_head_to_fp32=True` is not supported"):
        GRPOTrainer(
            model=tiny_qwen2(),
            reward_funcs=[token_reward],
            peft_config=lora,
            args=grpo_config(str(tmp_path), cast_lm_head_to_fp32=True),
            train_dataset=tiny_prompt_dataset(),
            processing_class=byte_tokenizer(),
        )


@pytest.mark.slow
def test_softcapped_tied_gemma2():
    """Gemma 2's final-logit soft-cap, made to bind: cap 2.0 and a head scaled so that the raw logits reach 10+; its
    embeddings are tied, all parameters trained (the head's gradient and the embedding's meet in one tensor)."""
    model = tiny_gemma2(final_logit_softcapping=2.0)
    assert model.lm_head.weight is model.get_input_embeddings().weight
    with torch.no_grad():
        model.lm_head.weight.mul_(40.0)  # tied to the input embeddings: Gemma 2 normalises them anyway
        hidden = model.model(input_ids=torch.arange(16)[None]).last_hidden_state
        assert (hidden @ model.lm_head.weight.T).abs().max() > 5 * model.config.final_logit_softcapping
    args = grpo_config(loss_type="bnpo", temperature=0.7, steps_per_generation=2, **LOGGED)
    ours, theirs = runs(model, args)
    assert_runs_match(ours, theirs)


@pytest.mark.slow
def test_rloo_trainer(tmp_path):
    """RLOOTrainer shares the head: same comparison, with its reference model (beta != 0)."""
    path = save_model(tiny_qwen2(), tmp_path / "qwen2")
    # RLOO's own steps_per_generation (None: the accumulation steps)
    accumulation = dict(gradient_accumulation_steps=2, steps_per_generation=None)
    args = grpo_config(config_class=trl.RLOOConfig, beta=0.04, num_iterations=2, **accumulation, **LOGGED)
    ours, theirs = runs(path, args, trainer_classes=(trl.RLOOTrainer, RLOOTrainer))
    assert_runs_match(ours, theirs)


def test_the_kernel_trap_catches_trl_own_trainer():
    """The trap around grpo_fast's runs is not vacuous: TRL's own trainer trips it."""
    with pytest.raises(AssertionError, match="ChunkedLogProbFunction ran"):
        train(trl.GRPOTrainer, tiny_qwen2(), grpo_config(max_steps=1), forbid_trl_kernel=True)


def test_every_patched_model_gets_grpo_fast_head_and_trl_module_is_untouched(tmp_path, monkeypatch):
    """Both models TRL patches get grpo_fast's head; TRL's module keeps its names throughout: a TRL trainer built while
    ours is being built (here: from inside our head's call) gets TRL's head."""
    path = save_model(tiny_qwen2(), tmp_path / "qwen2")
    seen_during = []
    ours_head = grpo_fast.trl.add_fused_lm_head

    def head_that_looks(model, **kwargs):
        seen_during.append((trl_grpo_trainer.add_fused_lm_head, trl_grpo_trainer.BaseTunerLayer))
        other = tiny_qwen2()
        trl_grpo_trainer.add_fused_lm_head(other)  # TRL's name, called as TRL's other trainers call it
        assert other.forward.__func__.__code__.co_filename != grpo_fast.trl.__file__
        return ours_head(model, **kwargs)

    monkeypatch.setattr(grpo_fast.trl, "add_fused_lm_head", head_that_looks)
    trainer = GRPOTrainer(
        model=path,
        reward_funcs=[token_reward],
        args=grpo_config(beta=0.04),
        train_dataset=tiny_prompt_dataset(),
        processing_class=byte_tokenizer(),
    )
    for model in (trainer.model, trainer.ref_model):
        assert model.forward.__func__.__code__.co_filename == grpo_fast.trl.__file__
    assert seen_during == [(trl_add_fused_lm_head, BaseTunerLayer)] * 2
    assert trl_grpo_trainer.add_fused_lm_head is trl_add_fused_lm_head


def test_a_constructor_that_no_longer_reads_the_name_fails_loudly():
    """The head reaches TRL's constructor only through the names it reads: a release that moved the call is an
    error, not TRL's head in silence."""

    def constructor_without_the_call(self):
        return None

    with pytest.raises(RuntimeError, match=r"no longer reads \['add_fused_lm_head'\]"):
        with_module_names(constructor_without_the_call, grpo_fast.trl.TRL_VERSIONS, add_fused_lm_head=None)


def test_a_constructor_that_patched_no_model_fails_loudly():
    class Quiet(trl.GRPOTrainer):
        def __init__(self, model):  # reads both names, never calls the head
            if isinstance(model.lm_head, BaseTunerLayer):
                add_fused_lm_head(model)  # noqa: F821

    trainer = object.__new__(GRPOTrainer)
    with pytest.raises(RuntimeError, match="patched no model"):
        trainer._trl_init_with_grpo_fast_head(Quiet, (tiny_qwen2(),), {})


@pytest.mark.parametrize(
    "config, entropy_grad",
    [
        (dict(entropy_coef=0.0), False),
        (dict(entropy_coef=0.01), True),
        (dict(entropy_coef=0.0, use_adaptive_entropy=True), True),
        ({}, False),
    ],
)
def test_the_head_gets_the_trainers_entropy_decision_from_its_config(monkeypatch, config, entropy_grad):
    """The entropy is differentiated only with an entropy bonus in the trainer's config (RLOO's has none: {})."""
    calls = []
    monkeypatch.setattr(grpo_fast.trl, "add_fused_lm_head", lambda model, **kwargs: calls.append(kwargs))

    class TrainerLike(trl.GRPOTrainer):
        def __init__(self, model):  # as TRL's constructor: its config set, then the model patched
            self.args = types.SimpleNamespace(**config)
            assert not isinstance(model.lm_head, BaseTunerLayer)
            add_fused_lm_head(model, temperature=0.5)  # noqa: F821

    trainer = object.__new__(GRPOTrainer)
    trainer._trl_init_with_grpo_fast_head(TrainerLike, (tiny_qwen2(),), {})
    assert calls == [dict(temperature=0.5, entropy_grad=entropy_grad)]


def test_add_fused_lm_head_checks_entropy_grad():
    with pytest.raises(TypeError, match="entropy_grad must be a bool"):
        grpo_fast.trl.add_fused_lm_head(tiny_qwen2(), entropy_grad=1)


# ------------------------------------------------------------------------ loss options on one generation batch
LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")
# the options a case may change, at their GRPOConfig defaults (each case sets them all, so none leaks into the next)
OPTION_DEFAULTS = dict(
    loss_type="dapo",
    importance_sampling_level="token",
    epsilon=0.2,
    epsilon_high=None,
    delta=None,
    use_bias_correction_kl=True,
    top_entropy_quantile=1.0,
    entropy_coef=0.0,
    off_policy_mask_threshold=None,
)
OPTION_CASES = [
    dict(loss_type=t, importance_sampling_level=level) for t in LOSS_TYPES for level in ("token", "sequence")
]
OPTION_CASES += [
    dict(loss_type="grpo", delta=1.5, epsilon_high=0.28),
    dict(loss_type="dapo", use_bias_correction_kl=False),
    dict(loss_type="dapo", top_entropy_quantile=0.3, entropy_coef=0.05),
    dict(loss_type="grpo", off_policy_mask_threshold=0.01),
]


@pytest.fixture(scope="module")
def trainer_pair(tmp_path_factory):
    """TRL's trainer and grpo_fast's on the same saved Qwen2 (beta != 0, so each has a reference model), each with its
    own generation batch from the same seed (old and reference log-probs from its own head), then both policies
    moved by the same noise so that the importance ratios differ from 1 and clipping happens."""
    path = save_model(tiny_qwen2(), tmp_path_factory.mktemp("qwen2"))
    args = grpo_config(beta=0.04, num_iterations=2)  # num_iterations 2 with no accumulation: old log-probs computed
    prompts = [{"prompt": p} for p in _PROMPTS[:2] for _ in range(args.num_generations)]
    pair = {}
    for name, cls in (("trl", trl.GRPOTrainer), ("grpo_fast", GRPOTrainer)):
        with trl_kernel_forbidden() if name == "grpo_fast" else contextlib.nullcontext():
            torch.manual_seed(0)
            trainer = cls(
                model=path,
                reward_funcs=[token_reward],
                args=args,
                train_dataset=tiny_prompt_dataset(),
                processing_class=byte_tokenizer(),
            )
            trainer.model.train()
            trainer.current_gradient_accumulation_steps = 1
            torch.manual_seed(1)
            inputs = trainer._generate_and_score_completions(prompts)
        noise = torch.Generator().manual_seed(2)
        with torch.no_grad():
            for p in trainer.model.parameters():
                p.add_(0.02 * torch.randn(p.shape, generator=noise))
        pair[name] = trainer, inputs
    return pair


@pytest.mark.slow
def test_generation_batches_match(trainer_pair):
    (_, theirs), (_, ours) = trainer_pair["trl"], trainer_pair["grpo_fast"]
    assert torch.equal(ours["completion_ids"], theirs["completion_ids"])
    for key in ("old_per_token_logps", "ref_per_token_logps"):
        assert_close(ours[key] * ours["completion_mask"], theirs[key] * theirs["completion_mask"], key)
    assert_close(ours["advantages"], theirs["advantages"], "advantages")


@pytest.mark.slow
@pytest.mark.parametrize("options", OPTION_CASES, ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()))
def test_loss_options_match_trl(trainer_pair, options):
    results = {}
    for name, (trainer, inputs) in trainer_pair.items():
        set_loss_options(trainer, **{**OPTION_DEFAULTS, **options})
        trainer._metrics["train"].clear()
        trainer.model.zero_grad(set_to_none=True)
        with trl_kernel_forbidden() if name == "grpo_fast" else contextlib.nullcontext():
            loss = trainer.compute_loss(trainer.model, inputs)
            loss.backward()
        grads = {n: p.grad for n, p in trainer.model.named_parameters() if p.grad is not None}
        metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}
        results[name] = loss.detach(), grads, metrics
    (loss, grads, metrics), (ref_loss, ref_grads, ref_metrics) = results["grpo_fast"], results["trl"]
    assert_close(loss, ref_loss, "loss")
    assert_tensors_close(grads, ref_grads, "gradient")
    assert metrics.keys() == ref_metrics.keys()
    for key in ref_metrics:
        assert_close(metrics[key], ref_metrics[key], key)
    if options == OPTION_CASES[0]:  # grpo, token level: the noise moved the policy enough to clip
        assert ref_metrics["clip_ratio/region_mean"] > 0
