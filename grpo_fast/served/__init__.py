"""Distillation from a teacher served as top-k log-probs (``api``: the public functions; ``teacher``: the record,
its support and the sparse divergence's math)."""
