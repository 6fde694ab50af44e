"""Layer 2, the GRPO loss: the loss options and loss-type records, the token loss's op, its metrics, and ``loss``,
which checks its arguments into one call record and runs both layers."""
