"""What an estimate is of: a model's published shape, one training step's sizes (a recipe), the card it must fit."""

from __future__ import annotations

from dataclasses import dataclass

import torch

# every projection of a Qwen2 / Llama decoder layer: attention's four and the MLP's three
DECODER_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class ModelShape:
    """A Qwen2-style decoder's published shape (the config numbers that size its tensors).

    Attributes:
        hidden_size: D, the hidden states' width.
        intermediate_size: the MLP's inner width.
        num_layers: decoder layers.
        num_heads: attention heads.
        num_kv_heads: key / value heads (grouped-query attention).
        vocab_size: V, the lm_head's rows.
        tie_word_embeddings: the lm_head shares the input embedding's weight.
        config_path: a local config.json the shape was read from (``from_config_file``): the model is built from
            it, its architecture and every other setting with these numbers; None: a Qwen2 config.
        explicit_head_dim: the config's own head_dim where it sets one apart from hidden_size / num_heads (Qwen3's),
            else None.
    """

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    vocab_size: int
    tie_word_embeddings: bool = True
    config_path: str | None = None
    explicit_head_dim: int | None = None

    @property
    def head_dim(self) -> int:
        """The config's head_dim, else hidden_size / num_heads."""
        return self.explicit_head_dim or self.hidden_size // self.num_heads

    @classmethod
    def from_config_file(cls, path) -> ModelShape:
        """The shape of a local ``config.json`` (a path to it, or to a folder holding it), read by transformers'
        AutoConfig without reaching a hub.

        Args:
            path: the file or folder.

        Returns:
            Its ModelShape, ``config_path`` the file.

        Raises:
            ValueError: no config.json there, one transformers cannot read, of a model that is no causal LM, or
                without a decoder's sizes.
        """
        from pathlib import Path

        from transformers import AutoConfig

        file = Path(path)
        file = file / "config.json" if file.is_dir() else file
        if not file.is_file():
            raise ValueError(f"{path}: no config.json there")
        try:
            config = AutoConfig.from_pretrained(str(file), local_files_only=True)
        except Exception as e:  # noqa: BLE001 - transformers' errors for a malformed or unknown config vary
            raise ValueError(f"{file}: transformers cannot read it ({type(e).__name__}: {e})") from None
        config = getattr(config, "text_config", None) or config
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

        if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
            raise ValueError(f"{file}: a {config.model_type} config, which transformers builds no causal LM of")
        names = {
            "hidden_size": "hidden_size",
            "intermediate_size": "intermediate_size",
            "num_layers": "num_hidden_layers",
            "num_heads": "num_attention_heads",
            "vocab_size": "vocab_size",
        }
        missing = [name for name in names.values() if getattr(config, name, None) is None]
        if missing:
            raise ValueError(f"{file}: a decoder's config needs {', '.join(missing)}")
        values = {field: int(getattr(config, name)) for field, name in names.items()}
        kv_heads = getattr(config, "num_key_value_heads", None) or values["num_heads"]
        head_dim = getattr(config, "head_dim", None)
        own_head_dim = head_dim and head_dim != values["hidden_size"] // values["num_heads"]
        return cls(
            **values,
            num_kv_heads=int(kv_heads),
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            config_path=str(file.resolve()),
            explicit_head_dim=int(head_dim) if own_head_dim else None,
        )

    def config(self):
        """transformers' config with these numbers: ``config_path``'s (its architecture and other settings), else a
        Qwen2Config (Qwen2.5's rope base, RMS epsilon and context).

        Returns:
            A ``transformers.PretrainedConfig`` with SDPA attention and no cache.
        """
        if self.config_path is not None:
            from transformers import AutoConfig

            config = AutoConfig.from_pretrained(self.config_path, local_files_only=True)
            config = getattr(config, "text_config", None) or config
            config.hidden_size, config.intermediate_size = self.hidden_size, self.intermediate_size
            config.num_hidden_layers, config.num_attention_heads = self.num_layers, self.num_heads
            config.num_key_value_heads, config.vocab_size = self.num_kv_heads, self.vocab_size
            config.tie_word_embeddings, config.use_cache = self.tie_word_embeddings, False
            if self.explicit_head_dim is not None:
                config.head_dim = self.explicit_head_dim
            config._attn_implementation = "sdpa"
            return config
        from transformers import Qwen2Config

        config = Qwen2Config(
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads,
            vocab_size=self.vocab_size,
            tie_word_embeddings=self.tie_word_embeddings,
            max_position_embeddings=32768,
            rope_theta=1e6,
            rms_norm_eps=1e-6,
            hidden_act="silu",
            use_cache=False,
        )
        config._attn_implementation = "sdpa"
        return config


# Qwen2.5 instruct models' public configs (hub: Qwen/Qwen2.5-*-Instruct, config.json)
MODELS = {
    "qwen2.5-0.5b": ModelShape(
        hidden_size=896, intermediate_size=4864, num_layers=24, num_heads=14, num_kv_heads=2, vocab_size=151936
    ),
    "qwen2.5-1.5b": ModelShape(
        hidden_size=1536, intermediate_size=8960, num_layers=28, num_heads=12, num_kv_heads=2, vocab_size=151936
    ),
}


@dataclass(frozen=True)
class Recipe:
    """One training step's sizes: the model, what trains, the micro-batch and lengths, the optimizer's settings.

    The rollout generates ``prompts_per_step`` x ``num_generations`` completions; the training step's forward /
    backward takes ``micro_batch_size`` of them, every one at ``prompt_length`` + ``completion_length`` tokens (the
    worst case: the longest prompt the recipe keeps, no completion ending early).

    Attributes:
        model: the shape's name (a ``MODELS`` key, or one marked as overridden).
        shape: the model's ``grpo_fast.memory.ModelShape``.
        lora_r: the LoRA rank; 0: every parameter trains.
        lora_alpha: LoRA's alpha.
        micro_batch_size: completions per forward / backward.
        prompt_length: prompt tokens per row.
        completion_length: completion tokens per row.
        prompts_per_step: prompts per rollout.
        num_generations: completions per prompt.
        gradient_checkpointing: the model recomputes its layers' activations in the backward.
        beta: the KL coefficient (0: no reference log-probs).
        lr: AdamW's learning rate.
        dtype: the model's dtype.
        lm_head_dtype: the lm_head weight's own dtype, or None: the model's. torch.float32 over a bf16 model is a
            master weight kept in fp32 (as a model trained under torch.autocast keeps it): an untied fp32 parameter,
            which grpo_fast's ops cast to the hidden states' dtype for their GEMMs (a V x D copy while each runs).
        temperature: the sampling temperature the logits are divided by.
        epsilon: the clip range.
        weight_decay: AdamW's weight decay.
        betas: AdamW's betas.
        max_grad_norm: the gradient clipping norm.
        lora_targets: the modules LoRA adapts (PEFT's ``target_modules``).
        teacher: the distillation heads' teacher model's shape (a model in the process: its weights and forward
            without gradients), or None: the student's shape.
        teacher_model: the teacher's name (as ``model``), or None: the student's.
        teacher_top_k: K, a served teacher's log-probs a token (TRL's ``teacher_top_k``).
    """

    model: str
    shape: ModelShape
    lora_r: int
    lora_alpha: int
    micro_batch_size: int
    prompt_length: int
    completion_length: int
    prompts_per_step: int
    num_generations: int
    gradient_checkpointing: bool
    beta: float
    lr: float
    dtype: torch.dtype = torch.bfloat16
    lm_head_dtype: torch.dtype | None = None
    temperature: float = 1.0
    epsilon: float = 0.2
    weight_decay: float = 0.1
    betas: tuple = (0.9, 0.99)
    max_grad_norm: float = 0.1
    lora_targets: tuple = DECODER_PROJECTIONS
    teacher: ModelShape | None = None
    teacher_model: str | None = None
    teacher_top_k: int = 8

    @property
    def teacher_shape(self) -> ModelShape:
        """The teacher model's shape: ``teacher``, else the student's."""
        return self.teacher or self.shape

    @property
    def completion_tokens(self) -> int:
        """The tokens the loss head scores in one micro-batch."""
        return self.micro_batch_size * self.completion_length

    @property
    def reference_copy(self) -> bool:
        """A frozen copy of the weights for the KL term (with LoRA the reference is the base model, no copy)."""
        return self.beta != 0.0 and self.lora_r == 0

    def describe(self) -> str:
        """The recipe in one line of prose.

        Returns:
            The description the report's title and the command's stderr show.
        """
        trains = f"LoRA r {self.lora_r} (alpha {self.lora_alpha})" if self.lora_r else "all parameters"
        head = "" if self.lm_head_dtype is None else f" (lm_head {str(self.lm_head_dtype).removeprefix('torch.')})"
        return (
            f"{self.model}, {trains}, {str(self.dtype).removeprefix('torch.')}{head}, AdamW, micro-batch "
            f"{self.micro_batch_size} x ({self.prompt_length} prompt + {self.completion_length} completion "
            f"tokens), gradient checkpointing {'on' if self.gradient_checkpointing else 'off'}, beta {self.beta:g}"
            f"{' (a reference copy of the weights)' if self.reference_copy else ''}; rollout "
            f"{self.prompts_per_step} x {self.num_generations} completions"
            + (f"; teacher {self.teacher_model}" if self.teacher is not None else "")
        )


# What `python -m grpo_fast.memory` estimates without flags: LoRA r 16 on Qwen2.5-1.5B-Instruct, micro-batches of 4
# completions of up to 1024 tokens after 512-token prompts, a rollout of 8 prompts x 8 completions, no KL term (TRL's
# default beta: no reference log-probs)
DEFAULT_RECIPE = Recipe(
    model="qwen2.5-1.5b",
    shape=MODELS["qwen2.5-1.5b"],
    lora_r=16,
    lora_alpha=32,
    micro_batch_size=4,
    prompt_length=512,
    completion_length=1024,
    prompts_per_step=8,
    num_generations=8,
    gradient_checkpointing=True,
    beta=0.0,
    lr=1e-5,
)


@dataclass(frozen=True)
class Gpu:
    """The card an estimate is compared with, and the architecture grpo_fast's launchers size their workspaces for.

    Attributes:
        name: the card's name, as the report shows it.
        memory_gib: its memory, GiB (nvidia-smi's total in MiB / 1024).
        compute_capability: 10 x major + minor (89: sm_89).
    """

    name: str
    memory_gib: float
    compute_capability: int


# The default card: 24 GB (nvidia-smi's total: 24564 MiB), sm_89
RTX_4090 = Gpu("RTX 4090", 24564 / 1024, 89)


def kv_cache_bytes(shape: ModelShape, sequences: int, tokens: int, element_bytes: int) -> int:
    """The generation phase's key / value cache: every layer keeps a key and a value vector per kv head and token.

    Args:
        shape: the model's shape.
        sequences: the sequences generated at once.
        tokens: tokens per sequence.
        element_bytes: bytes per cached value (the model's dtype's).

    Returns:
        The cache's bytes.
    """
    return shape.num_layers * 2 * shape.num_kv_heads * shape.head_dim * sequences * tokens * element_bytes
