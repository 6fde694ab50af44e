"""``grpo_fast.trl``: TRL's trainers with grpo_fast's fused head (the code: ``grpo_fast.integrations.trl``).

This name is that module itself, not a copy: ``grpo_fast.trl is grpo_fast.integrations.trl``.
"""

import importlib
import sys

# through sys.modules (not the package attribute): a test that drops both names re-imports the module
sys.modules[__name__] = importlib.import_module("grpo_fast.integrations.trl")
