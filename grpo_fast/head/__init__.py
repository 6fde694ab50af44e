"""Layer 1, the log-prob head: per-token log-probs and entropies of the targets from hidden states and the lm_head
weight, forward and backward, no [tokens, vocab] logits (API, argument checks, custom ops, path choices, LoRA,
vocab-parallel)."""
