"""A type checker sees grpo_fast's public signatures: mypy, run over a caller, names the loss-option keyword that does
not exist (and the one it meant), the option given a value of the wrong type, and a name outside an enumeration's
``Literal`` (a loss type, an importance-sampling level or mode), and passes the right calls."""

import pytest
from helpers import mypy_errors

from grpo_fast.grpo_loss.options import IMPORTANCE_SAMPLING_LEVELS, IMPORTANCE_SAMPLING_MODES, LOSS_TYPES

CALLER = """
import torch

import grpo_fast

logp, adv, mask = torch.zeros(2, 3), torch.zeros(2), torch.ones(2, 3)
hidden, weight, targets = torch.zeros(2, 3, 4), torch.zeros(5, 4), torch.zeros(2, 3, dtype=torch.long)
grpo_fast.token_loss(logp, adv, mask, loss_type="grpo", epsilon_high=0.3, delta=None, max_completion_length=64)
grpo_fast.loss(hidden, weight, targets, adv, mask, options=grpo_fast.LossOptions(beta=0.04), epsilon=0.1)
grpo_fast.sampling_importance_weights(logp, logp, mask, mode="token_mask", clip_max=2.0)
grpo_fast.token_loss(logp, adv, mask, epsilon_hi=0.3)
grpo_fast.loss(hidden, weight, targets, adv, mask, loss_type=3)
grpo_fast.token_loss(logp, adv, mask, loss_type="ppo")
grpo_fast.LossOptions(importance_sampling_level="batch")
grpo_fast.sampling_importance_weights(logp, logp, mask, mode="token_clip")
"""


def _literal(names):
    """How mypy writes a Literal of these names."""
    return "Literal[" + ", ".join(repr(name) for name in names) + "]"


@pytest.mark.slow
def test_mypy_checks_the_loss_option_keywords(tmp_path):
    errors, result = mypy_errors(tmp_path, CALLER)
    loss_types, levels, modes = map(_literal, (LOSS_TYPES, IMPORTANCE_SAMPLING_LEVELS, IMPORTANCE_SAMPLING_MODES))
    assert errors == [
        'error: Unexpected keyword argument "epsilon_hi" for "token_loss"; did you mean "epsilon_high" or "epsilon"?  '
        "[call-arg]",
        f'error: Argument "loss_type" to "loss" has incompatible type "Literal[3]"; expected "{loss_types}"  '
        "[arg-type]",
        f'error: Argument "loss_type" to "token_loss" has incompatible type "Literal[\'ppo\']"; '
        f'expected "{loss_types}"  [arg-type]',
        f'error: Argument "importance_sampling_level" to "LossOptions" has incompatible type "Literal[\'batch\']"; '
        f'expected "{levels}"  [arg-type]',
        f'error: Argument "mode" to "sampling_importance_weights" has incompatible type "Literal[\'token_clip\']"; '
        f'expected "{modes}"  [arg-type]',
    ], result.stdout + result.stderr
