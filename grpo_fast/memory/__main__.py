"""``python -m grpo_fast.memory``: one GRPO training step's peak GPU memory, estimated on a CPU (``--help``)."""

from grpo_fast.memory import main

main()
