"""The GSM8K reward functions (willccbb's grpo_demo.py values), answer extraction and the GSM8K loader."""

import json

import pytest
from gsm8k import data
from gsm8k.rewards import (
    DEFAULT_REWARDS,
    ONE_LINE_REWARDS,
    correctness_reward,
    count_xml,
    extract_xml_answer,
    int_reward,
    one_line_soft_format_reward,
    one_line_strict_format_reward,
    same_answer,
    soft_format_reward,
    strict_format_reward,
    xmlcount_reward,
)

PERFECT = "<reasoning>\nShe sold 48 + 24 = 72.\n</reasoning>\n<answer>\n72\n</answer>\n"
TRAILING = "<reasoning>\nx\n</reasoning>\n<answer>\n72\n</answer>\nThanks!"
NO_FINAL_NEWLINE = "<reasoning>\nx\n</reasoning>\n<answer>\n7\n</answer>"
ONE_LINE = "<reasoning>48 + 24</reasoning> <answer>72</answer>"
PLAIN = "The answer is 72."


def conv(text):
    return [{"role": "assistant", "content": text}]


def test_extract_xml_answer():
    assert extract_xml_answer(PERFECT) == "72"
    assert extract_xml_answer("<answer> 1 </answer> then <answer>\n2\n</answer> tail") == "2"  # the last one
    assert extract_xml_answer("  no tags  ") == "no tags"  # no tag: the whole text, stripped
    assert extract_xml_answer("<answer>\n5") == "5"  # unclosed tag


def test_gold_answer():
    assert data.extract_gold_answer("48/2 = <<48/2=24>>24\n#### 72") == "72"
    assert data.extract_gold_answer("so\n#### 1,234") == "1234"
    assert data.extract_gold_answer("#### $5") == "5"
    assert data.extract_gold_answer("no marker") is None


def test_same_answer_compares_numbers_as_numbers():
    assert same_answer("18.0", "18")
    assert same_answer("$1,000", "1000")
    assert same_answer(" 18 ", "18")
    assert not same_answer("18.5", "18")
    assert not same_answer("eighteen", "18")
    assert same_answer("abc", "abc") and not same_answer("abc", "ab")


def test_perfect_completion_gets_every_reward():
    comps = [conv(PERFECT)]
    assert correctness_reward(None, comps, ["72"]) == [2.0]
    assert int_reward(None, comps, ["72"]) == [0.5]
    assert strict_format_reward(None, comps, ["72"]) == [0.5]
    assert xmlcount_reward(None, comps, ["72"]) == [0.5]
    assert soft_format_reward(None, comps, ["72"]) == [0.5]  # re.DOTALL, as the demo: the newlines match


def test_format_rewards_match_across_lines_and_the_one_line_variant_does_not():
    multi_line = "<reasoning>\n48 + 24\n= 72\n</reasoning>\n<answer>\n72\n</answer>\n"
    comps = [PERFECT, multi_line, ONE_LINE, PLAIN]
    assert strict_format_reward(None, comps) == [0.5, 0.5, 0.0, 0.0]
    assert soft_format_reward(None, comps) == [0.5, 0.5, 0.5, 0.0]
    # without re.DOTALL: the strict format only with one-line reasoning, the soft one never after a newline
    assert one_line_strict_format_reward(None, comps) == [0.5, 0.0, 0.0, 0.0]
    assert one_line_soft_format_reward(None, comps) == [0.0, 0.0, 0.5, 0.0]
    assert one_line_soft_format_reward.__name__ == "one_line_soft_format_reward"  # TRL logs rewards by name
    assert list(ONE_LINE_REWARDS) == list(DEFAULT_REWARDS)
    assert [f.__name__ for f in ONE_LINE_REWARDS.values()] == [
        "xmlcount_reward",
        "one_line_soft_format_reward",
        "one_line_strict_format_reward",
        "int_reward",
        "correctness_reward",
    ]


def test_one_line_format_gets_soft_only():
    comps = [ONE_LINE]  # plain strings work as well as conversational completions
    assert soft_format_reward(None, comps) == [0.5]
    assert strict_format_reward(None, comps) == [0.0]
    assert xmlcount_reward(None, comps) == [0.0]  # no tag on its own line
    assert correctness_reward(None, comps, ["72"]) == [2.0]
    assert int_reward(None, comps) == [0.5]


def test_trailing_text_penalty():
    # 7 characters after "\n</answer>\n", 8 after "\n</answer>" (minus 1): 0.5 - 0.007 - 0.007
    assert count_xml(TRAILING) == pytest.approx(0.486, abs=1e-12)
    assert strict_format_reward(None, [TRAILING]) == [0.0]
    # no newline after </answer>: "\n</answer>\n" is absent, so the demo charges the whole text (47 chars)
    # on the third tag, and -(0 - 1) * 0.001 on the fourth: 0.5 - 0.047 + 0.001
    assert len(NO_FINAL_NEWLINE) == 47
    assert count_xml(NO_FINAL_NEWLINE) == pytest.approx(0.454, abs=1e-12)
    assert count_xml("<reasoning>\nonly the opening tag") == 0.125
    assert count_xml("<reasoning>\n<reasoning>\n") == 0.0  # a tag twice counts nothing


def test_answers_and_numbers():
    comps = [
        conv(f"<reasoning>\nr\n</reasoning>\n<answer>\n{a}\n</answer>\n") for a in ["18.0", "18", "-3", "x", "1,000"]
    ]
    gold = ["18", "18", "-3", "18", "1000"]
    assert correctness_reward(None, comps, gold) == [2.0, 2.0, 2.0, 0.0, 2.0]
    assert int_reward(None, comps, gold) == [0.0, 0.5, 0.0, 0.0, 0.0]  # str.isdigit, as the demo
    assert correctness_reward(None, [conv(PLAIN)], ["72"]) == [0.0]


def test_default_rewards_have_trl_signature():
    prompts = [[{"role": "user", "content": "q"}]] * 2
    comps = [conv(PERFECT), conv(PLAIN)]
    totals = [
        sum(v)
        for v in zip(
            *(f(prompts=prompts, completions=comps, answer=["72", "72"], extra=1) for f in DEFAULT_REWARDS.values())
        )
    ]
    assert totals == pytest.approx([2.0 + 0.5 + 0.5 + 0.5 + 0.5, 0.0])


def test_load_local_jsonl(tmp_path):
    rows = [{"question": "What is 1+1?", "answer": "1+1=2\n#### 2"}, {"question": "Q2", "answer": "#### 1,500"}]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    loaded = data.load_gsm8k("train", str(tmp_path))
    assert [d["answer"] for d in loaded] == ["2", "1500"]
    assert loaded[0]["prompt"] == [
        {"role": "system", "content": data.SYSTEM_PROMPT},
        {"role": "user", "content": "What is 1+1?"},
    ]
    with pytest.raises(FileNotFoundError, match="test.jsonl"):
        data.load_gsm8k("test", str(tmp_path))


def test_load_real_gsm8k_files():
    """The GSM8K files grpo_fast ships (examples/gsm8k/files/), read as a folder like any other."""
    assert {p.name for p in data.BUNDLED_DIR.iterdir()} >= {"train.jsonl.gz", "test.jsonl.gz", "LICENSE"}
    train = data.load_gsm8k("train", str(data.BUNDLED_DIR))
    test = data.load_gsm8k("test", str(data.BUNDLED_DIR))
    assert data.load_gsm8k("test") == test  # the default data
    assert (len(train), len(test)) == (7473, 1319)
    assert train[0]["answer"] == "72" and train[1]["answer"] == "10"
    assert all(d["answer"] is not None and "," not in d["answer"] for d in train + test)
    assert all(same_answer(d["answer"], d["answer"]) for d in test)
