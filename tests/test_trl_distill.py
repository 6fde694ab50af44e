"""grpo_fast.trl's DistillationTrainer against TRL 1.16's own on the same student / teacher pair (fp32, CPU).

The pair: a tiny Qwen2 student (hidden 48) and a wider tiny Qwen2 teacher (hidden 64), one vocabulary, their heads
scaled up so that the two distributions are far apart and peaked. One generation batch, made by TRL's trainer with
gradient accumulation 2 (so ``num_items_in_batch`` counts the tokens of both micro-batches, as TRL sets it), some
completions cut short (masked tokens), goes through both trainers' ``compute_loss`` for every ``beta`` convention,
a temperature, and the logit transforms TRL reads from the configs (soft-cap, logit scale, Granite's
``logits_scaling``): the loss, every student parameter's gradient and the logged entropy agree within 1e-5
(trl_pairs.RTOL). TRL's ``ChunkedDivergenceFunction`` raises around every grpo_fast computation (and the trap does
catch TRL's own trainer). A PEFT student (LoRA on the attention, frozen head) matches too and takes grpo_fast's
frozen-head path. Slow: a training run with gradient accumulation (generation, logging, optimizer steps) equals
TRL's run; DDP and FSDP2 (``fully_shard`` by hand, as accelerate applies it) on 2 gloo processes equal one process.
"""

import contextlib
import copy

import pytest
import torch
import trl
from peft import LoraConfig
from torch.distributed.tensor import DTensor
from trl.kernels.chunked_divergence import ChunkedDivergenceFunction
from trl_harness import _PROMPTS, byte_tokenizer, tiny_prompt_dataset, tiny_qwen2
from trl_pairs import TIMING_KEYS, assert_close, assert_tensors_close, autograd_function_forbidden

import grpo_fast
from grpo_fast.backends import divergence_twin
from grpo_fast.kernels import divergence_loss
from grpo_fast.trl import DistillationConfig, DistillationTrainer

TEACHER = dict(seed=1, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)
BATCH, ACCUMULATION = 2, 2
# the logit transforms TRL reads from a config: set on the models' configs for one case (Qwen2 itself ignores them,
# which changes neither trainer's loss: both read them, as they would on Gemma 2, Cohere or Granite)
TRANSFORMS = dict(student=dict(final_logit_softcapping=4.0, logit_scale=1.5), teacher=dict(logits_scaling=0.8))


def tiny_pair():
    """A student and a wider teacher over one vocabulary, their heads scaled so that their distributions are peaked
    and differ (randomly initialised heads give nearly uniform ones)."""
    student, teacher = tiny_qwen2(), tiny_qwen2(**TEACHER)
    with torch.no_grad():
        student.lm_head.weight.mul_(20.0)
        teacher.lm_head.weight.mul_(30.0)
    return student, teacher


# the trainer logs every optimizer step (the tests compare each step's log)
LOG_EVERY_STEP = dict(logging_strategy="steps", logging_steps=1)


def distill_config(output_dir, **overrides):
    """One CPU process, fp32, no checkpointing, no saving, no reporting; any field can be overridden."""
    kw = dict(output_dir=str(output_dir), use_cpu=True, bf16=False, gradient_checkpointing=False, seed=0)
    kw.update(per_device_train_batch_size=BATCH, gradient_accumulation_steps=ACCUMULATION, max_completion_length=8)
    kw.update(report_to="none", save_strategy="no", disable_tqdm=True, dataloader_num_workers=0)
    kw.update(overrides)
    return DistillationConfig(**kw)


def trl_divergence_forbidden():
    """TRL's ChunkedDivergenceFunction raises if anything calls it."""
    return autograd_function_forbidden(ChunkedDivergenceFunction)


def build(trainer_cls, student, teacher, args, **kwargs):
    return trainer_cls(
        model=copy.deepcopy(student),
        teacher_model=copy.deepcopy(teacher),
        args=args,
        train_dataset=tiny_prompt_dataset(),
        processing_class=byte_tokenizer(),
        **kwargs,
    )


def generation_batch(trainer):
    """One micro-batch of TRL's own generation batch (BATCH x ACCUMULATION prompts; ``num_items_in_batch`` counts
    them all), with some completions cut short so that masked tokens exist."""
    trainer.model.train()
    torch.manual_seed(1)
    inputs = dict(trainer._prepare_inputs([{"prompt": p} for p in _PROMPTS[: BATCH * ACCUMULATION]]))
    mask = inputs["completion_mask"].clone()
    mask[0, 3:] = 0
    inputs["completion_mask"] = mask
    assert mask.sum() < inputs["num_items_in_batch"]
    return inputs


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """TRL's trainer and grpo_fast's on copies of one pair, and one generation batch made by TRL's."""
    student, teacher = tiny_pair()
    args = distill_config(tmp_path_factory.mktemp("distill"))
    theirs = build(trl.DistillationTrainer, student, teacher, args)
    with trl_divergence_forbidden():
        ours = build(DistillationTrainer, student, teacher, args)
    return dict(trl=theirs, grpo_fast=ours), generation_batch(theirs)


def loss_gradients_entropy(trainer, inputs, forbid_trl_head, **compute_loss_kwargs):
    trainer._metrics["train"].clear()
    trainer.model.zero_grad(set_to_none=True)
    with trl_divergence_forbidden() if forbid_trl_head else contextlib.nullcontext():
        loss = trainer.compute_loss(trainer.model, inputs, **compute_loss_kwargs)
        loss.backward()
    grads = {name: p.grad for name, p in trainer.model.named_parameters() if p.grad is not None}
    return loss.detach(), grads, trainer._metrics["train"]["entropy"][-1]


@contextlib.contextmanager
def configured(trainer, beta, temperature, transforms):
    """The trainer's ``beta`` and ``temperature`` (what ``_compute_loss`` reads) and config attributes on its
    student and teacher, restored afterwards."""
    saved = trainer.beta, trainer.temperature
    models = dict(student=trainer.model, teacher=trainer.teacher_model)
    trainer.beta, trainer.temperature = beta, temperature
    for role, attributes in transforms.items():
        for name, value in attributes.items():
            setattr(models[role].config, name, value)
    try:
        yield
    finally:
        trainer.beta, trainer.temperature = saved
        for role, attributes in transforms.items():
            for name in attributes:
                delattr(models[role].config, name)


# every divergence mode (beta 0, 1, between), a temperature, the configs' transforms, with TRL's num_items_in_batch
# or none; grpo_fast's Triton kernels run here (the interpreter, on a CPU): two cases in the fast tier
CASES = [
    dict(beta=b, num_items=n, **extra)
    for n in ("from_generation", "none")
    for b, extra in (
        (0.0, {}),
        (1.0, {}),
        (0.5, {}),
        (0.1, dict(temperature=0.7)),
        (1.0, dict(transforms=TRANSFORMS)),
        (0.5, dict(temperature=1.3, transforms=TRANSFORMS)),
    )
]
FAST_CASES = (
    dict(beta=0.5, num_items="from_generation", temperature=1.3, transforms=TRANSFORMS),
    dict(beta=1.0, num_items="none"),
)


def case_id(case):
    return "-".join(f"{k}={v}" for k, v in case.items() if k != "transforms") + (
        "-transforms" if "transforms" in case else ""
    )


@pytest.mark.parametrize(
    "case", [case if case in FAST_CASES else pytest.param(case, marks=pytest.mark.slow) for case in CASES], ids=case_id
)
def test_compute_loss_matches_trl(pair, case):
    """Loss, every student gradient and the logged entropy: TRL's num_items_in_batch (the generation batch's token
    count over the process count), or none (the mean over this micro-batch's tokens)."""
    trainers, inputs = pair
    if case["num_items"] == "none":
        inputs = {k: v for k, v in inputs.items() if k != "num_items_in_batch"}
    results = {}
    for name, trainer in trainers.items():
        with configured(trainer, case["beta"], case.get("temperature", 1.0), case.get("transforms", {})):
            results[name] = loss_gradients_entropy(trainer, inputs, forbid_trl_head=name == "grpo_fast")
    (loss, grads, entropy), (ref_loss, ref_grads, ref_entropy) = results["grpo_fast"], results["trl"]
    assert_close(loss, ref_loss, "loss")
    assert_tensors_close(grads, ref_grads, "gradient")
    assert_close(entropy, ref_entropy, "entropy")
    assert ref_loss > 1e-2 and "lm_head.weight" in ref_grads and ref_grads["lm_head.weight"].abs().max() > 0


PRECISIONS = {
    "fp32": dict(student=torch.float32, teacher=torch.float32, autocast=None),
    "bf16": dict(student=torch.bfloat16, teacher=torch.bfloat16, autocast=None),
    "fp32 under bf16 autocast": dict(student=torch.float32, teacher=torch.float32, autocast=torch.bfloat16),
    "fp32 student, bf16 teacher": dict(student=torch.float32, teacher=torch.bfloat16, autocast=None),
}


@pytest.mark.parametrize("precision", list(PRECISIONS))
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_divergence_loss_matches_trl_function(precision, beta):
    """grpo_fast.trl.divergence_loss against TRL's _chunked_divergence_loss on the same tensors (heads with biases,
    widths 16 and 24, V 37, masked tokens): each model's compute dtype (its hidden states', or autocast's), the casts,
    the fp32 biases, the reduction over num_items_in_batch; the result and the student's gradients."""
    from trl.trainer.distillation_trainer import _chunked_divergence_loss

    dtypes = PRECISIONS[precision]
    g = torch.Generator().manual_seed(0)
    B, T, V = 2, 5, 37

    def model(width, dtype, scale):
        hidden = torch.randn(B, T, width, generator=g).to(dtype)
        weight = (scale * torch.randn(V, width, generator=g) / width**0.5).to(dtype)
        return hidden, weight, torch.randn(V, generator=g)

    student, teacher = model(16, dtypes["student"], 3.0), model(24, dtypes["teacher"], 4.0)
    mask = torch.ones(B, T, dtype=torch.long)
    mask[0, 3:] = 0
    results = []
    for fn in (_chunked_divergence_loss, grpo_fast.trl.divergence_loss):
        leaves = [x.clone().requires_grad_() for x in student]
        autocast = torch.autocast("cpu", dtype=dtypes["autocast"]) if dtypes["autocast"] else contextlib.nullcontext()
        with autocast, trl_divergence_forbidden() if fn is grpo_fast.trl.divergence_loss else contextlib.nullcontext():
            loss, entropy_sum, valid = fn(
                leaves[0],
                teacher[0],
                leaves[1],
                teacher[1],
                mask,
                beta,
                num_items_in_batch=torch.tensor(11.0),
                student_lm_head_bias=leaves[2],
                teacher_lm_head_bias=teacher[2],
                temperature=0.8,
            )
        loss.backward()
        results.append((loss.detach(), entropy_sum, valid, {i: x.grad for i, x in enumerate(leaves)}))
    (ref_loss, ref_entropy, ref_valid, ref_grads), (loss, entropy, valid, grads) = results
    assert valid == ref_valid == 8
    assert_close(loss, ref_loss, "loss")
    assert_close(entropy, ref_entropy, "entropy sum")
    assert loss.dtype == ref_loss.dtype == torch.float32 and all(grads[i].dtype == student[i].dtype for i in grads)
    if dtypes["autocast"] is None and dtypes["student"] == torch.float32:
        assert_tensors_close(grads, ref_grads, "gradient")
        return
    # a bf16 student, or an fp32 one under autocast (TRL rounds each gradient tile d loss / d logits to bf16 before
    # its GEMMs, accumulates in fp32 and returns the gradient in the student's own dtype: bf16, or fp32 under
    # autocast): against the fp64 truth from the same bf16-rounded inputs, grpo_fast's gradients at least as exact
    # as TRL's, relative to their largest entry. Measured (beta 0, 0.5, 1; d hidden, d weight): TRL 2.4e-3 to 3.7e-3
    # in bf16, 1.7e-3 to 2.8e-3 under autocast; the Triton backward (rounding g to bf16 as a GPU does) equals TRL's,
    # the torch backend (fp32 g) is 1.4e-3 to 2.9e-3 in bf16 (bf16's own rounding of the fp64 value) and 1e-7 to
    # 4e-7 under autocast
    leaves = [
        x.to(dtypes["autocast"] or x.dtype).double().requires_grad_() if i < 2 else x.double().requires_grad_()
        for i, x in enumerate(student)
    ]
    teacher64 = [x.to(dtypes["autocast"] or x.dtype).double() if i < 2 else x.double() for i, x in enumerate(teacher)]
    divergence, _ = grpo_fast.reference.divergence_and_entropy(
        leaves[0],
        leaves[1],
        teacher64[0],
        teacher64[1],
        mask,
        beta=beta,
        temperature=0.8,
        student_bias=leaves[2],
        teacher_bias=teacher64[2],
        compute_dtype=torch.float64,
    )
    (divergence.sum() / 11.0).backward()
    for i, x in enumerate(leaves):
        scale = x.grad.abs().max().item()
        ours, theirs = ((g[i].double() - x.grad).abs().max().item() / scale for g in (grads, ref_grads))
        assert ours <= max(theirs, 2e-5), f"gradient {i}: grpo_fast {ours:.3g} of its max off fp64, TRL {theirs:.3g}"


def test_the_trap_catches_trl_own_trainer(pair):
    trainers, inputs = pair
    with pytest.raises(AssertionError, match="ChunkedDivergenceFunction ran"):
        loss_gradients_entropy(trainers["trl"], inputs, forbid_trl_head=True)


def test_trl_module_is_untouched():
    """grpo_fast's loss is bound in its own copy of TRL's method: TRL's module and class keep theirs."""
    from trl.trainer import distillation_trainer

    assert distillation_trainer._chunked_divergence_loss.__module__ == "trl.trainer.distillation_trainer"
    assert trl.DistillationTrainer._compute_loss.__globals__ is distillation_trainer.__dict__
    assert DistillationTrainer._compute_loss.__globals__["_chunked_divergence_loss"] is grpo_fast.trl.divergence_loss
    assert DistillationTrainer._compute_loss.__code__ is trl.DistillationTrainer._compute_loss.__code__


def test_peft_student_with_a_frozen_head_matches_trl(tmp_path, monkeypatch):
    """LoRA on the attention (random B, so the adapter matters): the student's head is frozen, grpo_fast builds
    d divergence / dh alone in the forward (the Triton backend's fused loss, or the torch backend's frozen-head
    path) and the adapters' gradients equal TRL's."""
    student, teacher = tiny_pair()
    lora = LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False, task_type="CAUSAL_LM"
    )
    args = distill_config(tmp_path)
    theirs = build(trl.DistillationTrainer, student, teacher, args, peft_config=lora)
    with trl_divergence_forbidden():
        ours = build(DistillationTrainer, student, teacher, args, peft_config=lora)
    inputs = generation_batch(theirs)
    seen = []
    forward, fused = divergence_twin.forward, divergence_loss.loss_gradients

    def spy_forward(*args, frozen_head=False, **kwargs):
        seen.append(frozen_head)
        return forward(*args, frozen_head=frozen_head, **kwargs)

    def spy_fused(student, teacher, beta, weights, grads, *args, **kwargs):
        seen.append(tuple(grad is not None for grad in grads) == (True, False, False))
        return fused(student, teacher, beta, weights, grads, *args, **kwargs)

    monkeypatch.setattr(divergence_twin, "forward", spy_forward)
    monkeypatch.setattr(divergence_loss, "loss_gradients", spy_fused)
    loss, grads, entropy = loss_gradients_entropy(ours, inputs, forbid_trl_head=True)
    ref_loss, ref_grads, ref_entropy = loss_gradients_entropy(theirs, inputs, forbid_trl_head=False)
    assert seen == [True]
    assert_close(loss, ref_loss, "loss")
    assert_tensors_close(grads, ref_grads, "gradient")
    assert_close(entropy, ref_entropy, "entropy")
    assert grads and all("lora_" in name for name in grads)


@pytest.mark.slow
def test_training_run_matches_trl(tmp_path):
    """Two optimizer steps of gradient accumulation 2 (one on-policy generation batch each, sampled by the student as
    it trains): every logged value, every gradient at each optimizer step and the trained student."""
    from trl_pairs import GradRecorder

    student, teacher = tiny_pair()
    args = distill_config(
        tmp_path, **LOG_EVERY_STEP, optim="sgd", learning_rate=0.5, max_steps=2, beta=0.5, temperature=0.9
    )
    runs = {}
    for name, cls in (("trl", trl.DistillationTrainer), ("grpo_fast", DistillationTrainer)):
        recorder = GradRecorder()
        with trl_divergence_forbidden() if name == "grpo_fast" else contextlib.nullcontext():
            torch.manual_seed(0)
            trainer = build(cls, student, teacher, args, callbacks=[recorder])
            trainer.train()
        runs[name] = trainer.state.log_history, recorder.grads, dict(trainer.model.named_parameters())
    (log, grads, params), (ref_log, ref_grads, ref_params) = runs["grpo_fast"], runs["trl"]
    assert len(log) == len(ref_log) == 3
    for step, (a, b) in enumerate(zip(log, ref_log, strict=True)):
        assert a.keys() == b.keys(), f"log entry {step}"
        for key in b:
            if key not in TIMING_KEYS:
                assert_close(a[key], b[key], f"log entry {step} {key}")
    assert "entropy" in ref_log[0] and ref_log[0]["loss"] > 1e-2
    assert len(grads) == len(ref_grads) == 2
    for step, (a, b) in enumerate(zip(grads, ref_grads, strict=True)):
        assert_tensors_close(a, b, f"gradient at optimizer step {step}")
    assert_tensors_close(
        {k: v.detach() for k, v in params.items()}, {k: v.detach() for k, v in ref_params.items()}, "trained parameter"
    )


# ----------------------------------------------------------------------------------------------- 2 processes
WORLD, GLOBAL_BATCH = 2, 4
# "ddp": accelerate's; "fsdp2": accelerate (1.x) enables FSDP only on accelerators (on CPU processes its FSDP plugin
# is not applied), so ``fully_shard`` is applied by hand as accelerate applies it (each decoder layer, then the
# root; the student's and the teacher's) and accelerate is told the student is prepared (no DDP around it)
DISTRIBUTED_CASES = ("ddp", "fsdp2")
WRAPPERS = {"ddp": "2 x DistributedDataParallel", "fsdp2": "2 x FSDPQwen2ForCausalLM"}
TIMEOUT_S = 300  # a hung collective must not hang CI


def scripted_generation(trainer):
    """``_generate_single_turn`` with completions fixed by the prompt (no sampling, so one process and two see the
    same batch): its ids reversed, of lengths 3 to 6, half of them ending in EOS (masked tails)."""
    eos = trainer.processing_class.eos_token_id

    def generate(prompt_ids, images, multimodal_fields):
        completions = []
        for ids in prompt_ids:
            k = len(ids) % 4
            completions.append(list(reversed(ids))[: 3 + k] + ([eos] if k % 2 == 0 else []))
        return completions

    return generate


def one_step(out_dir, world, case):
    """One optimizer step of grpo_fast's DistillationTrainer on this process's share of GLOBAL_BATCH prompts ->
    (logged loss, logged entropy, {parameter: gradient at the optimizer step}, "processes x the wrapped model's
    class")."""
    from trl_pairs import GradRecorder

    student, teacher = tiny_pair()
    # each rank's share of one global batch, in order; one plain SGD step
    batch = dict(
        per_device_train_batch_size=GLOBAL_BATCH // world, gradient_accumulation_steps=1, shuffle_dataset=False
    )
    step = dict(optim="sgd", learning_rate=1.0, max_grad_norm=1e9, max_steps=1)
    args = distill_config(out_dir, **batch, **step, **LOG_EVERY_STEP, beta=0.5)
    recorder = GradRecorder()
    trainer = DistillationTrainer(
        model=student,
        teacher_model=teacher,
        args=args,
        callbacks=[recorder],
        train_dataset=tiny_prompt_dataset(n=GLOBAL_BATCH),
        processing_class=byte_tokenizer(),
    )
    trainer._generate_single_turn = scripted_generation(trainer)
    if case == "fsdp2" and world > 1:
        fully_shard_by_hand(trainer)
    with trl_divergence_forbidden():
        trainer.train()
    logged = next(entry for entry in trainer.state.log_history if "loss" in entry)
    wrapper = f"{trainer.accelerator.num_processes} x {type(trainer.model_wrapped).__name__}"
    # an FSDP2 gradient is this rank's shard (a DTensor): gathered here, on every rank in the same order
    grads = {
        name.removeprefix("module."): g.full_tensor() if isinstance(g, DTensor) else g
        for name, g in recorder.grads[0].items()
    }
    return logged["loss"], logged["entropy"], grads, wrapper


def fully_shard_by_hand(trainer):
    """FSDP2 on the trainer's student and teacher as accelerate applies it on accelerators: ``fully_shard`` on each
    decoder layer, then on the root (the lm_head in the root's group, gathered by the root's forward, through which
    TRL's ``_forward_redirection`` routes the loss); the student marked prepared, so that accelerate does not wrap
    it in DDP."""
    from torch.distributed.fsdp import fully_shard

    for model in (trainer.model, trainer.teacher_model):
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        weight = model.lm_head.weight
        assert isinstance(weight, DTensor) and weight.to_local().shape[0] < weight.shape[0], "lm_head is not sharded"
    trainer.model._is_accelerate_prepared = True


def distributed_worker(rank, port, out_dir, case):
    import os

    ranks = dict(RANK=rank, LOCAL_RANK=rank, WORLD_SIZE=WORLD, LOCAL_WORLD_SIZE=WORLD)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), **{name: str(n) for name, n in ranks.items()})
    loss, entropy, grads, wrapper = one_step(os.path.join(out_dir, f"rank{rank}"), WORLD, case)
    if rank == 0:
        torch.save(dict(loss=loss, entropy=entropy, grads=grads, wrapper=wrapper), os.path.join(out_dir, f"{case}.pt"))


@pytest.mark.slow
@pytest.mark.parametrize("case", DISTRIBUTED_CASES)
def test_two_processes_equal_one(tmp_path, case):
    """DDP (accelerate's) and FSDP2 on 2 gloo processes, each with half of the prompts: the logged loss and entropy
    and every parameter's gradient at the optimizer step (DDP's average; FSDP2's reduce-scattered shards, gathered)
    equal one process with all of them."""
    from helpers import spawn_ranks

    spawn_ranks(distributed_worker, WORLD, str(tmp_path), TIMEOUT_S, case)
    two = torch.load(tmp_path / f"{case}.pt")
    loss, entropy, grads, _ = one_step(str(tmp_path / "single"), 1, case)
    assert two["wrapper"] == WRAPPERS[case]
    assert_close(two["loss"], loss, "loss")
    assert_close(two["entropy"], entropy, "entropy")
    assert_tensors_close(two["grads"], grads, "gradient")
    assert grads["lm_head.weight"].abs().max() > 0
