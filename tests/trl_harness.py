"""Offline builders for tests that run TRL 1.16's own ``GRPOTrainer`` (trl is a test dependency).

Nothing here touches the hub or the network: the models are randomly initialised from configs, the tokenizer is
built in memory, the dataset is a handful of literal prompts. Everything is fp32 on the CPU.

Builders (names are stable: other test modules import them):

* ``tiny_qwen2_config`` / ``tiny_qwen2``: a 2-layer Qwen2 (hidden 48, vocab ``BYTE_VOCAB_SIZE`` = 259, not a power
  of two), attention dropout 0, untied lm_head (its weight is a separate parameter, as in a larger Qwen2).
* ``tiny_gemma2_config`` / ``tiny_gemma2``: a 2-layer Gemma 2 with ``final_logit_softcapping`` (the softcap path).
* ``byte_tokenizer``: grpo_fast's own (``gsm8k.tokenizer``), a ``PreTrainedTokenizerFast`` over the 256
  bytes plus ``<|im_end|>`` (EOS, 256), ``<|endoftext|>`` (pad, 257) and ``<|im_start|>`` (258), with a ChatML chat
  template; ``ascii_tokenizer``: the same over the 128 ASCII bytes (131 tokens: EOS 128, pad 129, im_start 130),
  for a smaller vocabulary (the Triton interpreter's cost grows with V). The model builders take the special ids as
  the last three of ``vocab_size``, which is right for both.
* ``tiny_prompt_dataset``: a ``datasets.Dataset`` with a ``prompt`` column (plain text or conversational).
* ``length_reward``: a trivial reward function (TRL's signature).
* ``grpo_config``: a ``GRPOConfig`` for one CPU process: no reporting, no saving, no logging, fp32, no gradient
  accumulation, one generation per step; any field can be overridden.
* ``build_trainer``: a ``GRPOTrainer`` from the above (each part replaceable), its model in train mode, and the
  state ``_compute_loss`` reads outside a training loop (``current_gradient_accumulation_steps``) set.
* ``set_loss_options``: changes, on a built trainer, every attribute ``_compute_loss`` reads for a ``GRPOConfig``
  option (``loss_type``, ``beta``, ``epsilon`` ...), asserting each exists so a TRL change cannot make a test
  silently vacuous; ``temperature`` re-patches TRL's fused LM head, which captured it at construction.
* ``LOSS_OPTION_ATTRIBUTES``: that mapping, GRPOConfig field -> trainer attributes; ``loss_option_defaults`` and
  ``reset_loss_options``: every one at its ``GRPOConfig`` default.
* ``score_scripted_rollout``: TRL's own ``_generate_and_score_completions`` on scripted prompt / completion ids (and
  sampler log-probs, as vLLM returns them): TRL's padding, masks, advantages, ``num_items_in_batch``, old log-probs and
  vLLM importance-sampling ratios, with no generation and no vLLM.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile

import torch
from gsm8k.tokenizer import ASCII_VOCAB_SIZE, BYTE_VOCAB_SIZE, byte_tokenizer

# ----------------------------------------------------------------------------------------------- tokenizer
# grpo_fast's own byte tokenizer (examples/gsm8k/tokenizer.py); the harness names its special ids
EOS_ID, PAD_ID, IM_START_ID = BYTE_VOCAB_SIZE - 3, BYTE_VOCAB_SIZE - 2, BYTE_VOCAB_SIZE - 1  # 256, 257, 258
ASCII_EOS_ID, ASCII_PAD_ID, ASCII_IM_START_ID = ASCII_VOCAB_SIZE - 3, ASCII_VOCAB_SIZE - 2, ASCII_VOCAB_SIZE - 1


def ascii_tokenizer():
    """``byte_tokenizer`` over the 128 ASCII bytes only (131 tokens; other characters are dropped when encoding)."""
    return byte_tokenizer(ascii_only=True)


def _special_ids(vocab_size):
    """bos (im_start), eos, pad: the last three ids, as both tokenizers above lay them out."""
    return dict(bos_token_id=vocab_size - 1, eos_token_id=vocab_size - 3, pad_token_id=vocab_size - 2)


# ----------------------------------------------------------------------------------------------- models
def _tiny_config(config_class, vocab_size, **fields):
    """A transformers config of ``config_class`` small enough for CPU tests: dropout off, no KV cache, eager
    attention, the byte tokenizer's special ids; ``fields`` set the rest (and may override these)."""
    defaults = dict(max_position_embeddings=256, attention_dropout=0.0, use_cache=False)
    config = config_class(vocab_size=vocab_size, **{**defaults, **_special_ids(vocab_size), **fields})
    config._attn_implementation = "eager"
    return config


def tiny_qwen2_config(vocab_size=BYTE_VOCAB_SIZE, **overrides):
    """A ``Qwen2Config`` small enough for CPU tests: 2 layers of width 48, 4 heads over 2 KV heads, untied."""
    from transformers import Qwen2Config

    shape = dict(hidden_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    fields = dict(intermediate_size=96, tie_word_embeddings=False)
    return _tiny_config(Qwen2Config, vocab_size, **{**shape, **fields, **overrides})


def tiny_gemma2_config(vocab_size=BYTE_VOCAB_SIZE, **overrides):
    """A ``Gemma2Config`` small enough for CPU tests, with Gemma 2's final logit softcap (30.0 by default) and its
    tied embeddings."""
    from transformers import Gemma2Config

    shape = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    fields = dict(intermediate_size=64, final_logit_softcapping=30.0, sliding_window=64)
    return _tiny_config(Gemma2Config, vocab_size, **{**shape, **fields, **overrides})


def _causal_lm(config, seed, dtype):
    from transformers import AutoModelForCausalLM

    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model


def tiny_qwen2(seed=0, dtype=torch.float32, **config_overrides):
    """A randomly initialised ``Qwen2ForCausalLM`` (fp32 by default); the global RNG is left untouched."""
    return _causal_lm(tiny_qwen2_config(**config_overrides), seed, dtype)


def tiny_gemma2(seed=0, dtype=torch.float32, **config_overrides):
    """A randomly initialised ``Gemma2ForCausalLM`` (fp32 by default); the global RNG is left untouched."""
    return _causal_lm(tiny_gemma2_config(**config_overrides), seed, dtype)


# ----------------------------------------------------------------------------------------------- data, reward
_PROMPTS = ["2+2=", "What is 3*4?", "Name a colour.", "Count to three:", "hi", "The sky is", "Q: 7-5? A:", "Say yes."]


def tiny_prompt_dataset(n=8, conversational=False):
    """A ``datasets.Dataset`` of ``n`` short prompts in a ``prompt`` column (chat messages if conversational)."""
    from datasets import Dataset

    prompts = [_PROMPTS[i % len(_PROMPTS)] for i in range(n)]
    if conversational:
        prompts = [[{"role": "user", "content": p}] for p in prompts]
    return Dataset.from_dict({"prompt": prompts})


def length_reward(completions, **kwargs):
    """A trivial reward in TRL's signature: minus the completion's length in characters / 10."""
    texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
    return [-len(t) / 10.0 for t in texts]


# ----------------------------------------------------------------------------------------------- config, trainer
def grpo_config(
    output_dir=None,
    *,
    per_device_train_batch_size=4,
    num_generations=2,
    max_completion_length=8,
    config_class=None,
    **overrides,
):
    """A ``GRPOConfig`` for one CPU process in fp32: nothing reported, saved or logged, no gradient accumulation,
    ``steps_per_generation`` 1 (so the dapo/cispo/vespo normaliser is exactly ``num_items_in_batch``).

    ``per_device_train_batch_size`` must be a multiple of ``num_generations``. Any ``GRPOConfig`` field can be
    overridden; ``output_dir`` defaults to a fresh temporary directory (nothing is written there).
    ``config_class``: another trainer's config with these fields (``trl.RLOOConfig``); default ``GRPOConfig``.
    """
    from trl import GRPOConfig

    if output_dir is None:
        output_dir = tempfile.mkdtemp(prefix="grpo_fast_trl_")
    kw = dict(
        output_dir=os.fspath(output_dir),
        use_cpu=True,
        report_to="none",
        bf16=False,
        fp16=False,
        per_device_train_batch_size=per_device_train_batch_size,
        num_generations=num_generations,
        max_completion_length=max_completion_length,
        gradient_accumulation_steps=1,
        steps_per_generation=1,
        save_strategy="no",
        logging_strategy="no",
        eval_strategy="no",
        dataloader_num_workers=0,
        disable_tqdm=True,
        seed=0,
        max_steps=1,
    )
    kw.update(overrides)
    return (config_class or GRPOConfig)(**kw)


def build_trainer(
    args=None, *, model=None, processing_class=None, train_dataset=None, reward_funcs=None, **trainer_kwargs
):
    """TRL's ``GRPOTrainer`` over the offline parts (each defaults to the builders above).

    ``args`` defaults to ``grpo_config()``. ``beta`` must be 0 at construction for a non-PEFT model instance (TRL
    would load a reference model by the config's name, from the hub): set it afterwards with ``set_loss_options``,
    or pass the model as a local path. The model is put in train
    mode (``_compute_loss`` logs under ``"train"`` and scales by the accumulation steps there), and
    ``current_gradient_accumulation_steps``, which the training loop sets, is set to 1.
    """
    from trl import GRPOTrainer

    args = grpo_config() if args is None else args
    if args.beta != 0.0 and not isinstance(model, (str, os.PathLike)) and not hasattr(model, "peft_config"):
        raise ValueError(
            "build the trainer with beta=0 (TRL would load a reference model by name from the hub) "
            "and set it afterwards with set_loss_options(trainer, beta=...)"
        )
    model = tiny_qwen2() if model is None else model
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[length_reward] if reward_funcs is None else reward_funcs,
        args=args,
        train_dataset=tiny_prompt_dataset() if train_dataset is None else train_dataset,
        processing_class=byte_tokenizer() if processing_class is None else processing_class,
        **trainer_kwargs,
    )
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    return trainer


# ----------------------------------------------------------------------------------------------- loss options
# GRPOConfig field -> the trainer attributes (``args.`` = on trainer.args) that GRPOTrainer._compute_loss reads for it
LOSS_OPTION_ATTRIBUTES = {
    "loss_type": ("loss_type", "args.loss_type"),
    "beta": ("beta", "args.beta"),
    "epsilon": ("epsilon_low", "args.epsilon"),
    "epsilon_high": ("epsilon_high", "args.epsilon_high"),
    "delta": ("args.delta",),
    "importance_sampling_level": ("importance_sampling_level", "args.importance_sampling_level"),
    "max_completion_length": ("max_completion_length", "args.max_completion_length"),
    "temperature": ("temperature", "args.temperature"),
    "sapo_temperature_pos": ("args.sapo_temperature_pos",),
    "sapo_temperature_neg": ("args.sapo_temperature_neg",),
    "vespo_k_pos": ("args.vespo_k_pos",),
    "vespo_lambda_pos": ("args.vespo_lambda_pos",),
    "vespo_k_neg": ("args.vespo_k_neg",),
    "vespo_lambda_neg": ("args.vespo_lambda_neg",),
    "use_bias_correction_kl": ("args.use_bias_correction_kl",),
    "off_policy_mask_threshold": ("off_policy_mask_threshold", "args.off_policy_mask_threshold"),
    "top_entropy_quantile": ("top_entropy_quantile", "args.top_entropy_quantile"),
    "entropy_coef": ("entropy_coef", "args.entropy_coef"),
    "use_adaptive_entropy": ("use_adaptive_entropy", "args.use_adaptive_entropy"),
    "use_vllm": ("use_vllm", "args.use_vllm"),
    "vllm_importance_sampling_correction": (
        "vllm_importance_sampling_correction",
        "args.vllm_importance_sampling_correction",
    ),
    "vllm_importance_sampling_mode": ("vllm_importance_sampling_mode", "args.vllm_importance_sampling_mode"),
    "vllm_importance_sampling_clip_max": (
        "vllm_importance_sampling_clip_max",
        "args.vllm_importance_sampling_clip_max",
    ),
    "vllm_importance_sampling_clip_min": (
        "vllm_importance_sampling_clip_min",
        "args.vllm_importance_sampling_clip_min",
    ),
}


def loss_option_defaults():
    """Every ``LOSS_OPTION_ATTRIBUTES`` option at its ``GRPOConfig`` default (the state of a default trainer)."""
    from trl import GRPOConfig

    fields = {f.name: f for f in dataclasses.fields(GRPOConfig)}
    out = {}
    for name in LOSS_OPTION_ATTRIBUTES:
        f = fields[name]  # a KeyError here: TRL renamed or dropped a GRPOConfig field
        out[name] = f.default if f.default is not dataclasses.MISSING else f.default_factory()
    return out


def _set(trainer, path, value):
    obj, attr = (trainer.args, path[5:]) if path.startswith("args.") else (trainer, path)
    if not hasattr(obj, attr):
        raise AttributeError(f"GRPOTrainer has no attribute {path!r}: TRL changed what _compute_loss reads")
    setattr(obj, attr, value)


def _fused_head_of(trainer):
    """The ``add_fused_lm_head`` the trainer's own module patches with (TRL's for ``trl.GRPOTrainer``)."""
    import sys

    from trl.trainer import utils as trl_utils

    return getattr(sys.modules[type(trainer).__module__], "add_fused_lm_head", trl_utils.add_fused_lm_head)


def set_loss_options(trainer, fused_head=None, **options):
    """Set GRPOConfig loss options on a built trainer, as its ``__init__`` would have from the config.

    Every name must be a key of ``LOSS_OPTION_ATTRIBUTES``; each attribute must already exist. Derived state is
    kept consistent: ``epsilon_high=None`` means ``epsilon`` (TRL's ``__init__``), the entropy bonus flag follows
    ``entropy_coef`` / ``use_adaptive_entropy``, and a new ``temperature`` re-patches TRL's fused LM head (it is
    captured when ``add_fused_lm_head`` runs in ``__init__``) with ``fused_head`` (default: the
    ``add_fused_lm_head`` of the module that defines the trainer's class, else TRL's). Returns the trainer.
    """
    unknown = set(options) - set(LOSS_OPTION_ATTRIBUTES)
    if unknown:
        raise KeyError(f"unknown loss options {sorted(unknown)}; known: {sorted(LOSS_OPTION_ATTRIBUTES)}")
    old_temperature = trainer.temperature
    for name, value in options.items():
        for path in LOSS_OPTION_ATTRIBUTES[name]:
            _set(trainer, path, value)
    if "epsilon" in options or "epsilon_high" in options:
        high = trainer.args.epsilon_high
        _set(trainer, "epsilon_high", trainer.args.epsilon if high is None else high)
    if "entropy_coef" in options or "use_adaptive_entropy" in options:
        _set(trainer, "_entropy_bonus_enabled", trainer.entropy_coef != 0.0 or trainer.use_adaptive_entropy)
    if "temperature" in options and trainer.temperature != old_temperature:
        model = trainer.model
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        # TRL's __init__ call, again: the new wrapper's fused path runs the backbone itself (no stacking)
        (fused_head or _fused_head_of(trainer))(
            base,
            temperature=trainer.temperature,
            cast_lm_head_to_fp32=trainer.args.cast_lm_head_to_fp32,
            outputs=("log_probs", "entropy"),
        )
    return trainer


def reset_loss_options(trainer):
    """Every loss option back to its ``GRPOConfig`` default (temperature included)."""
    return set_loss_options(trainer, **loss_option_defaults())


# ----------------------------------------------------------------------------------------------- scripted rollouts
def score_scripted_rollout(trainer, prompt_ids, completion_ids, sampling_logprobs=None, **is_options):
    """Run TRL's own ``_generate_and_score_completions`` on a scripted rollout instead of a generation.

    ``prompt_ids`` / ``completion_ids``: one list of token ids per completion (``per_device_train_batch_size`` of
    them, groups of ``num_generations`` consecutive); TRL pads them (prompts left, completions right), builds the
    masks (with ``mask_truncated_completions`` a completion not ending in EOS / pad is masked out entirely), computes
    rewards and advantages, and ``num_items_in_batch``. With ``sampling_logprobs`` (one list per completion, the
    sampler's log-probs; NaN or None where it could not score a token) the trainer runs as under vLLM with importance
    sampling correction: TRL computes ``old_per_token_logps`` with the model and the ``importance_sampling_ratio``
    for ``vllm_importance_sampling_mode`` (``is_options`` are ``LOSS_OPTION_ATTRIBUTES`` names, e.g.
    ``vllm_importance_sampling_mode="token_mask"``, ``vllm_importance_sampling_clip_min=0.5``). No vLLM is needed:
    a ``rollout_func`` stands in for it. The trainer's vLLM options and rollout function are restored after, its
    metrics cleared.

    Returns TRL's ``inputs`` dict for ``_compute_loss``.
    """
    if len(prompt_ids) != len(completion_ids) or (
        sampling_logprobs is not None and len(sampling_logprobs) != len(completion_ids)
    ):
        raise ValueError("one prompt, completion (and sampling log-prob list) per row")

    def rollout_func(prompts, trainer_):
        assert len(prompts) == len(completion_ids)
        logprobs = sampling_logprobs if sampling_logprobs is not None else [[0.0] * len(c) for c in completion_ids]
        return {
            "prompt_ids": [list(p) for p in prompt_ids],
            "completion_ids": [list(c) for c in completion_ids],
            "logprobs": [list(x) for x in logprobs],
        }

    vllm_options = [name for name in LOSS_OPTION_ATTRIBUTES if name.startswith(("vllm_", "use_vllm"))]
    saved = {name: getattr(trainer, name) for name in vllm_options}
    saved_rollout_func = trainer.rollout_func
    try:
        trainer.rollout_func = rollout_func
        correction = sampling_logprobs is not None
        set_loss_options(trainer, use_vllm=correction, vllm_importance_sampling_correction=correction, **is_options)
        # the rollout path syncs weights into vLLM when the step changed; there is no vLLM here
        trainer._last_loaded_step = trainer.state.global_step
        prompts = [{"prompt": "scripted"} for _ in completion_ids]
        with torch.no_grad():
            inputs = trainer._generate_and_score_completions(prompts)
        if sampling_logprobs is None:
            inputs.pop("sampling_per_token_logps", None)  # the placeholder zeros; no sampler here
    finally:
        trainer.rollout_func = saved_rollout_func
        set_loss_options(trainer, **saved)
        trainer._metrics["train"].clear()
    return inputs
