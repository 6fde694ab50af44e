"""LossOptions: TRL 1.16.0 GRPOConfig's names and defaults, validated once; the keyword form of loss / token_loss."""

import dataclasses
import inspect
import typing

import pytest
import torch
from trl import GRPOConfig

import grpo_fast
from grpo_fast import reference
from grpo_fast.grpo_loss.options import FIELD_NAMES, LOSS_TYPES, LossOptionKeywords, LossOptions


def test_every_option_is_a_grpo_config_field_with_trls_default():
    trl_fields = {f.name: f for f in dataclasses.fields(GRPOConfig)}
    for field in dataclasses.fields(LossOptions):
        assert field.name in trl_fields, field.name
        assert trl_fields[field.name].default == field.default, field.name


def test_from_trl_reads_a_grpo_config():
    config = GRPOConfig(
        output_dir="unused", loss_type="cispo", beta=0.04, epsilon_high=5.0, report_to="none", use_cpu=True, bf16=False
    )
    options = LossOptions.from_trl(config)
    assert (options.loss_type, options.beta, options.epsilon_high, options.clip_high) == ("cispo", 0.04, 5.0, 5.0)


def test_option_keywords_are_typed_with_the_options_names_and_types():
    """grpo_fast.loss and token_loss take the loss options as ``**option_keywords: Unpack[LossOptionKeywords]`` (an
    IDE and a type checker see each keyword): the TypedDict's names, in order, and annotations are LossOptions'
    fields'; nothing else is taken by name."""
    keyword_types, field_types = typing.get_type_hints(LossOptionKeywords), typing.get_type_hints(LossOptions)
    assert list(keyword_types) == list(FIELD_NAMES) == [f.name for f in dataclasses.fields(LossOptions)]
    assert LossOptionKeywords.__total__ is False
    for name in FIELD_NAMES:
        assert keyword_types[name] == field_types[name], name
    for fn in (grpo_fast.loss, grpo_fast.token_loss):
        params = inspect.signature(fn).parameters
        keywords = [p for p in params.values() if p.kind is inspect.Parameter.VAR_KEYWORD]
        assert [(p.name, p.annotation) for p in keywords] == [("option_keywords", "Unpack[LossOptionKeywords]")]
        assert not set(params) & set(FIELD_NAMES), fn.__name__


@pytest.mark.parametrize(
    "override, error, message",
    [
        (dict(loss_type="ppo"), ValueError, "loss_type must be one of"),
        (dict(importance_sampling_level="batch"), ValueError, "importance_sampling_level"),
        (dict(epsilon=-0.1), ValueError, "epsilon and epsilon_high must be >= 0"),
        (dict(beta=float("nan")), ValueError, "beta must be a finite number"),
        (dict(max_completion_length=0), ValueError, "max_completion_length"),
        (dict(max_completion_length=True), ValueError, "max_completion_length"),
        (dict(use_bias_correction_kl=1), ValueError, "use_bias_correction_kl must be a bool"),
        (dict(top_entropy_quantile=1.5), ValueError, r"top_entropy_quantile must be a number in \[0, 1\]"),
        (dict(delta="2"), ValueError, "delta must be a finite number"),
    ],
)
def test_bad_options_raise_named_errors(override, error, message):
    with pytest.raises(error, match=message):
        LossOptions(**override)


def test_unknown_keyword_suggests_the_close_name():
    logp = torch.zeros(1, 2)
    for token_loss in (grpo_fast.token_loss, reference.token_loss):
        with pytest.raises(
            TypeError,
            match=r"token_loss\(\) got an unexpected keyword argument 'epsilon_hi' "
            r"\(did you mean 'epsilon_high'\?\)",
        ):
            token_loss(logp, torch.ones(1), torch.ones(1, 2), epsilon_hi=0.3)
    with pytest.raises(
        TypeError, match=r"loss\(\) got an unexpected keyword argument 'loss_typ' \(did you mean 'loss_type'\?\)"
    ):
        grpo_fast.loss(
            torch.zeros(1, 2, 3),
            torch.zeros(4, 3),
            torch.zeros(1, 2, dtype=torch.long),
            torch.ones(1),
            torch.ones(1, 2),
            loss_typ="grpo",
        )
    with pytest.raises(TypeError, match="options must be a grpo_fast.LossOptions"):
        grpo_fast.token_loss(logp, torch.ones(1), torch.ones(1, 2), options={"beta": 0.1})


def test_options_object_and_keywords_give_the_same_loss():
    g = torch.Generator().manual_seed(0)
    logp = -torch.rand(3, 5, generator=g)
    old = logp + 0.3 * torch.randn(3, 5, generator=g)
    adv, mask = torch.randn(3, generator=g), torch.ones(3, 5)
    kw = dict(loss_type="grpo", epsilon=0.01, epsilon_high=0.3)
    by_keywords, _ = grpo_fast.token_loss(logp, adv, mask, old_logprobs=old, **kw)
    by_object, _ = grpo_fast.token_loss(logp, adv, mask, old_logprobs=old, options=LossOptions(**kw))
    # keywords override the object's fields, a keyword at its default value too; the others keep the object's
    mixed, _ = grpo_fast.token_loss(logp, adv, mask, old_logprobs=old, options=LossOptions(**kw), epsilon=0.5)
    default_eps, _ = grpo_fast.token_loss(logp, adv, mask, old_logprobs=old, **dict(kw, epsilon=0.5))
    at_default, _ = grpo_fast.token_loss(logp, adv, mask, old_logprobs=old, options=LossOptions(**kw), epsilon=0.2)
    eps_default, _ = grpo_fast.token_loss(logp, adv, mask, old_logprobs=old, **dict(kw, epsilon=0.2))
    kept, _ = grpo_fast.token_loss(logp, adv, mask, old_logprobs=old, options=LossOptions(**kw), beta=0.0)
    assert by_keywords.item() == by_object.item() == kept.item()
    assert mixed.item() == default_eps.item() != by_keywords.item()
    assert at_default.item() == eps_default.item() != by_keywords.item()


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_denominator_is_trls_reduction(loss_type):
    options = LossOptions(loss_type=loss_type, max_completion_length=16)
    expected = {"grpo": 4, "sapo": 4, "luspo": 4, "bnpo": 10, "dr_grpo": 64, "dapo": 7, "cispo": 7, "vespo": 7}
    assert options.denominator(4, torch.tensor(10.0), 7) == expected[loss_type]
    assert options.denominator(4, 0.0, None) == {"bnpo": 1, "dapo": 1, "cispo": 1, "vespo": 1}.get(
        loss_type, expected[loss_type]
    )
    assert options.loss_type_record.row_mean == (loss_type in ("grpo", "sapo"))


def test_field_names_are_the_dataclass_fields():
    assert FIELD_NAMES == tuple(f.name for f in dataclasses.fields(LossOptions))
