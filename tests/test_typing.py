"""A type checker sees grpo_fast's public signatures: mypy, run over a caller, names the loss-option keyword that does
not exist (and the one it meant), the option given a value of the wrong type, and a name outside an enumeration's
``Literal`` (a loss type, an importance-sampling level or mode, a backend, a head path, a backward mode), and passes
the right calls."""

import pytest
from helpers import mypy_errors

from grpo_fast.backends.protocol import BACKEND_NAMES
from grpo_fast.grpo_loss.options import IMPORTANCE_SAMPLING_LEVELS, IMPORTANCE_SAMPLING_MODES, LOSS_TYPES
from grpo_fast.kernels.config import BACKWARD_MODES, HEAD_PATHS

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
grpo_fast.loss(hidden, weight, targets, adv, mask, backend="triton", head_path="general", backward_mode="fused")
grpo_fast.loss(hidden, weight, targets, adv, mask, backend="trion")
grpo_fast.logprobs_and_entropy(hidden, weight, targets, head_path="frozen", backward_mode="atomic")
grpo_fast.token_loss(logp, adv, mask, backend="cuda")
grpo_fast.divergence(hidden, weight, hidden, weight, backend="trion", head_path="frozen")
"""


def _literal(names):
    """How mypy writes a Literal of these names."""
    return "Literal[" + ", ".join(repr(name) for name in names) + "]"


@pytest.mark.slow
def test_mypy_checks_the_loss_option_keywords(tmp_path):
    errors, result = mypy_errors(tmp_path, CALLER)
    loss_types, levels, modes = map(_literal, (LOSS_TYPES, IMPORTANCE_SAMPLING_LEVELS, IMPORTANCE_SAMPLING_MODES))
    backends, head_paths, backward_modes = map(_literal, (BACKEND_NAMES, HEAD_PATHS, BACKWARD_MODES))
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
        f'error: Argument "backend" to "loss" has incompatible type "Literal[\'trion\']"; expected "{backends}"  '
        "[arg-type]",
        'error: Argument "head_path" to "logprobs_and_entropy" has incompatible type "Literal[\'frozen\']"; '
        f'expected "{head_paths}"  [arg-type]',
        'error: Argument "backward_mode" to "logprobs_and_entropy" has incompatible type "Literal[\'atomic\']"; '
        f'expected "{backward_modes}"  [arg-type]',
        f'error: Argument "backend" to "token_loss" has incompatible type "Literal[\'cuda\']"; expected "{backends}"  '
        "[arg-type]",
        f'error: Argument "backend" to "divergence" has incompatible type "Literal[\'trion\']"; expected "{backends}"  '
        "[arg-type]",
        'error: Argument "head_path" to "divergence" has incompatible type "Literal[\'frozen\']"; '
        f'expected "{head_paths}"  [arg-type]',
    ], result.stdout + result.stderr
