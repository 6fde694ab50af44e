"""Layer 2, the GRPO loss: the loss options and loss-type records, the token loss (its op and torch twin), its
metrics, and ``loss``, which runs both layers in one call."""
