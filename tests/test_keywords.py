"""A keyword argument a public function does not take: one error (grpo_fast.head.keywords) that names the function,
the name the caller likely meant (TRL's names for the same input, the README's variables, a misspelling) and every
name the function takes, its tensors' included."""

import inspect
import re
import typing
from pathlib import Path

import pytest
import torch

import grpo_fast
from grpo_fast.head.keywords import ALIASES

PUBLIC_FUNCTIONS = [
    getattr(grpo_fast, name) for name in grpo_fast.__all__ if inspect.isfunction(getattr(grpo_fast, name))
]


def _taken(function):
    """The names ``function`` takes, in its error's order: its own parameters, then its **keywords' TypedDict's."""
    own, typed = [], []
    for name, parameter in inspect.signature(function).parameters.items():
        if parameter.kind is parameter.VAR_KEYWORD:
            typed = list(typing.get_args(typing.get_type_hints(function)[name])[0].__annotations__)
        elif parameter.kind is not parameter.VAR_POSITIONAL:
            own.append(name)
    return own, typed


@pytest.mark.parametrize("function", PUBLIC_FUNCTIONS, ids=lambda f: f.__name__)
def test_every_public_function_names_every_keyword_it_takes(function):
    """Checked before the arguments bind: no tensor is needed to get the error, and a misnamed one is not reported
    as missing."""
    own, typed = _taken(function)
    name = function.__name__
    with pytest.raises(TypeError) as error:
        function(not_an_argument=1)
    message = str(error.value)
    assert message.startswith(f"{name}() got an unexpected keyword argument 'not_an_argument'; {name}() takes ")
    listed = message.split(f"{name}() takes ", 1)[1]
    assert listed.startswith(", ".join(own)), listed
    for keyword in typed:
        assert re.search(rf"\b{keyword}\b", listed), (name, keyword)


LIKELY = [
    # the README's variable and TRL's inputs
    (grpo_fast.loss, "completion_ids", "targets"),
    (grpo_fast.logprobs, "completion_ids", "targets"),
    (grpo_fast.logprobs_and_entropy, "completion_ids", "targets"),
    (grpo_fast.sampler_logprobs, "completion_ids", "targets"),
    (grpo_fast.served_distillation_loss, "completion_ids", "targets"),
    (grpo_fast.loss, "old_per_token_logps", "old_logprobs"),
    (grpo_fast.loss, "ref_per_token_logps", "ref_logprobs"),
    (grpo_fast.loss, "sampling_per_token_logps", "sampling_logprobs"),
    (grpo_fast.loss, "importance_sampling_ratio", "importance_weights"),
    (grpo_fast.token_loss, "per_token_logps", "logprobs"),
    (grpo_fast.token_loss, "entropies", "entropy"),
    (grpo_fast.sampling_importance_weights, "vllm_importance_sampling_mode", "mode"),
    (grpo_fast.sampling_importance_weights, "vllm_importance_sampling_clip_max", "clip_max"),
    # close names, among the function's own parameters and its option keywords
    (grpo_fast.loss, "num_items", "num_items_in_batch"),
    (grpo_fast.token_loss, "num_items", "num_items_in_batch"),
    (grpo_fast.distillation_loss, "num_item", "num_items_in_batch"),
    (grpo_fast.loss, "epsilon_hi", "epsilon_high"),
    (grpo_fast.divergence, "temprature", "temperature"),
    (grpo_fast.divergence_and_entropy, "betta", "beta"),
    (grpo_fast.served_divergence_and_entropy, "student_softcapp", "student_softcap"),
]


@pytest.mark.parametrize("function, given, meant", LIKELY, ids=lambda x: getattr(x, "__name__", x))
def test_the_name_meant_is_suggested(function, given, meant):
    with pytest.raises(TypeError) as error:
        function(**{given: None})
    assert str(error.value).startswith(
        f"{function.__name__}() got an unexpected keyword argument {given!r} (did you mean {meant!r}?); "
    )


def test_a_misnamed_tensor_among_positional_ones():
    """The README's call with its variable's name as a keyword: the misnamed tensor is named, not 'targets'
    reported missing."""
    hidden, weight = torch.zeros(1, 2, 4), torch.zeros(5, 4)
    ids, mask = torch.zeros(1, 2, dtype=torch.long), torch.ones(1, 2)
    with pytest.raises(
        TypeError, match=r"^loss\(\) got an unexpected keyword argument 'completion_ids' \(did you mean"
    ):
        grpo_fast.loss(hidden, weight, advantages=torch.ones(1), completion_mask=mask, completion_ids=ids)
    with pytest.raises(TypeError, match=r"^logprobs\(\) got unexpected keyword arguments 'completion_ids' \(did you "):
        grpo_fast.logprobs(hidden, weight, completion_ids=ids, mask=mask)


def test_a_name_no_function_takes_gets_no_suggestion():
    with pytest.raises(TypeError) as error:
        grpo_fast.logprobs(zzz=1)
    assert "did you mean" not in str(error.value)


def test_the_aliases_are_trl_names_for_names_here():
    """Each alias is a name in TRL 1.16's GRPOTrainer or GRPOConfig, and means a parameter a public function takes."""
    import trl

    trainer = Path(trl.__file__).parent / "trainer"
    trl_source = (trainer / "grpo_trainer.py").read_text() + (trainer / "grpo_config.py").read_text()
    taken = {name for function in PUBLIC_FUNCTIONS for names in _taken(function) for name in names}
    for trl_name, name in ALIASES.items():
        assert re.search(rf"\b{trl_name}\b", trl_source), trl_name
        assert name in taken, name
