"""The frameworks: Hugging Face glue shared by both (``hf``, ``hidden_states``), TRL's trainers (``trl``) and verl's
fused-head backend (``verl``); public as ``grpo_fast.trl`` and ``grpo_fast.verl``."""
