"""The frameworks: TRL's trainers (``trl``) and verl's fused-head backend (``verl``), public as ``grpo_fast.trl`` and
``grpo_fast.verl``; the Hugging Face glue both share (``hf``); a causal LM's completion hidden states for a GRPO loop
of one's own (``hidden_states``)."""
