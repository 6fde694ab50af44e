"""The divergence head of on-policy distillation: the student-teacher divergence from both models' hidden states
(API, custom ops, vocab-parallel), and RL with distillation in one call (``teacher``)."""
