"""``grpo_fast.verl``: grpo_fast as verl's fused-head backend (the code: ``grpo_fast.integrations.verl``).

This name is that module itself, not a copy: ``grpo_fast.verl is grpo_fast.integrations.verl``; verl's plugin entry
point imports it.
"""

import importlib
import sys

# through sys.modules (not the package attribute): a test that drops both names re-imports the module
sys.modules[__name__] = importlib.import_module("grpo_fast.integrations.verl")
