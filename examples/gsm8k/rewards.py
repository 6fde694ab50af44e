"""GSM8K reward functions of willccbb's ``grpo_demo.py``, with the same values, in TRL's calling convention.

Every reward function is a plain callable ``f(prompts, completions, answer, **kwargs) -> list[float]``, one float
per completion, as TRL's ``GRPOTrainer`` calls them, so a user can pass their own next to these. A completion is
either a string or a conversational completion ``[{"role": "assistant", "content": text}]``.

| function                     | value                                                                  |
|------------------------------|------------------------------------------------------------------------|
| ``correctness_reward``       | 2.0 when the text inside ``<answer>`` equals the gold answer           |
| ``int_reward``               | 0.5 when the text inside ``<answer>`` is all digits (``str.isdigit``)  |
| ``strict_format_reward``     | 0.5 for ``^<reasoning>\\n.*?\\n</reasoning>\\n<answer>\\n.*?\\n</answer>\\n$``  |
| ``soft_format_reward``       | 0.5 for ``<reasoning>.*?</reasoning>\\s*<answer>.*?</answer>`` at the start |
| ``xmlcount_reward``          | 0.125 per well-placed tag, minus 0.001 per character after the answer  |

As in the demo, the format regexes are matched with ``re.match(pattern, text, flags=re.DOTALL)``: ``.`` matches a
newline too, so the reasoning and the answer may span lines. Without ``re.DOTALL`` the soft format could never
match the answer format the demo's system prompt asks for (``<reasoning>`` then a newline); ``ONE_LINE_REWARDS``
has the patterns without it (``one_line_soft_format_reward``, ``one_line_strict_format_reward``: the reasoning and
the answer each on one line; ``train_gsm8k.py --one-line-format``).

One change from the demo, on purpose: the answer is compared **as a number** when both sides parse as one
(after removing commas, a leading ``$`` and surrounding spaces), so ``"18.0"``, ``"$18"`` and ``"18"`` all
equal the gold ``"18"``; otherwise the strings are compared exactly, as the demo does.
"""

from __future__ import annotations

import functools
import re

__all__ = [
    "extract_xml_answer",
    "completion_text",
    "same_answer",
    "count_xml",
    "correctness_reward",
    "int_reward",
    "strict_format_reward",
    "soft_format_reward",
    "one_line_strict_format_reward",
    "one_line_soft_format_reward",
    "xmlcount_reward",
    "DEFAULT_REWARDS",
    "ONE_LINE_REWARDS",
    "with_completion_prefix",
]

STRICT_PATTERN = r"^<reasoning>\n.*?\n</reasoning>\n<answer>\n.*?\n</answer>\n$"
SOFT_PATTERN = r"<reasoning>.*?</reasoning>\s*<answer>.*?</answer>"
STRICT_FORMAT, SOFT_FORMAT = re.compile(STRICT_PATTERN, re.DOTALL), re.compile(SOFT_PATTERN, re.DOTALL)
ONE_LINE_STRICT_FORMAT, ONE_LINE_SOFT_FORMAT = re.compile(STRICT_PATTERN), re.compile(SOFT_PATTERN)


def completion_text(completion) -> str:
    """The text of one completion: a string, or the last message's content of a conversational completion."""
    if isinstance(completion, str):
        return completion
    return completion[-1]["content"]


def extract_xml_answer(text: str) -> str:
    """The text between the last ``<answer>`` and the next ``</answer>``, stripped (the whole text if no tag)."""
    answer = text.split("<answer>")[-1]
    answer = answer.split("</answer>")[0]
    return answer.strip()


def _as_number(text: str) -> float | None:
    text = text.strip().replace(",", "")
    if text.startswith("$"):
        text = text[1:]
    try:
        return float(text)
    except ValueError:
        return None


def same_answer(predicted: str, gold: str) -> bool:
    """``predicted == gold`` as numbers when both parse as numbers, else as strings."""
    a, b = _as_number(predicted), _as_number(gold)
    if a is not None and b is not None:
        return a == b
    return predicted == gold


def count_xml(text: str) -> float:
    """The demo's XML tag count: 0.125 for each tag present once, minus 0.001 per character after the answer."""
    count = 0.0
    if text.count("<reasoning>\n") == 1:
        count += 0.125
    if text.count("\n</reasoning>\n") == 1:
        count += 0.125
    if text.count("\n<answer>\n") == 1:
        count += 0.125
        count -= len(text.split("\n</answer>\n")[-1]) * 0.001
    if text.count("\n</answer>") == 1:
        count += 0.125
        count -= (len(text.split("\n</answer>")[-1]) - 1) * 0.001
    return count


def correctness_reward(prompts, completions, answer, **kwargs) -> list[float]:
    """2.0 when the extracted answer equals the gold answer (numerically where both parse), else 0.0."""
    extracted = [extract_xml_answer(completion_text(c)) for c in completions]
    return [2.0 if same_answer(r, a) else 0.0 for r, a in zip(extracted, answer, strict=True)]


def int_reward(prompts, completions, answer=None, **kwargs) -> list[float]:
    """0.5 when the extracted answer is a non-negative integer written with digits only."""
    extracted = [extract_xml_answer(completion_text(c)) for c in completions]
    return [0.5 if r.isdigit() else 0.0 for r in extracted]


def strict_format_reward(prompts, completions, answer=None, **kwargs) -> list[float]:
    """0.5 when the whole completion is ``<reasoning>\\n..\\n</reasoning>\\n<answer>\\n..\\n</answer>\\n``."""
    return [0.5 if STRICT_FORMAT.match(completion_text(c)) else 0.0 for c in completions]


def soft_format_reward(prompts, completions, answer=None, **kwargs) -> list[float]:
    """0.5 when the completion starts with ``<reasoning>...</reasoning>`` then ``<answer>...</answer>``."""
    return [0.5 if SOFT_FORMAT.match(completion_text(c)) else 0.0 for c in completions]


def one_line_strict_format_reward(prompts, completions, answer=None, **kwargs) -> list[float]:
    """``strict_format_reward`` without ``re.DOTALL``: the reasoning and the answer each on one line."""
    return [0.5 if ONE_LINE_STRICT_FORMAT.match(completion_text(c)) else 0.0 for c in completions]


def one_line_soft_format_reward(prompts, completions, answer=None, **kwargs) -> list[float]:
    """``soft_format_reward`` without ``re.DOTALL``: no newline inside the reasoning or the answer, so
    ``<reasoning>`` followed by a newline, the demo's own answer format, never matches."""
    return [0.5 if ONE_LINE_SOFT_FORMAT.match(completion_text(c)) else 0.0 for c in completions]


def xmlcount_reward(prompts, completions, answer=None, **kwargs) -> list[float]:
    """``count_xml`` of each completion."""
    return [count_xml(completion_text(c)) for c in completions]


# name -> function, in the demo's order; the training script weights them (all 1.0 by default)
DEFAULT_REWARDS = {
    "xmlcount": xmlcount_reward,
    "soft_format": soft_format_reward,
    "strict_format": strict_format_reward,
    "int": int_reward,
    "correctness": correctness_reward,
}
# the same with the format patterns matched without re.DOTALL (train_gsm8k.py --one-line-format)
ONE_LINE_REWARDS = {
    **DEFAULT_REWARDS,
    "soft_format": one_line_soft_format_reward,
    "strict_format": one_line_strict_format_reward,
}


def with_completion_prefix(reward, prefix: str):
    """``reward`` scoring ``prefix`` + each completion, for prompts that end with the start of the answer (priming:
    the prompt ends with ``prefix``, the model continues it), so that the reward sees the whole answer. The name
    stays ``reward``'s (TRL logs rewards by name)."""

    def whole(completion):
        if isinstance(completion, str):
            return prefix + completion
        return [*completion[:-1], {**completion[-1], "content": prefix + completion[-1]["content"]}]

    @functools.wraps(reward)
    def scored(prompts, completions, *args, **kwargs):
        return reward(prompts, [whole(c) for c in completions], *args, **kwargs)

    return scored
