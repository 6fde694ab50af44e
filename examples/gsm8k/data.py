"""GSM8K for GRPO: loading (the copy bundled with the examples, a local folder or the hub), chat prompts, gold answers.

GSM8K's original release files (OpenAI, MIT licence) are bundled with the examples in ``BUNDLED_DIR``
(``train.jsonl.gz``, ``test.jsonl.gz`` and the ``LICENSE``): the default everywhere, no network needed.

Each example becomes ``{"prompt": [system, user messages], "answer": gold number as a string, "question": ...}``,
the layout TRL's GRPOTrainer expects; ``answer`` is passed on to the reward functions.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

__all__ = [
    "SYSTEM_PROMPT",
    "ONE_SHOT",
    "extract_gold_answer",
    "make_prompt",
    "load_gsm8k",
    "find_split",
    "describe",
    "HUB_ID",
    "BUNDLED",
    "BUNDLED_DIR",
]

HUB_ID = "openai/gsm8k"
BUNDLED = "bundled"  # the name of the default data source: the files in BUNDLED_DIR
# GSM8K's original release (github.com/openai/grade-school-math, MIT): train.jsonl.gz (7473), test.jsonl.gz (1319)
BUNDLED_DIR = Path(__file__).parent / "files"

# willccbb's grpo_demo.py system prompt
SYSTEM_PROMPT = """
Respond in the following format:
<reasoning>
...
</reasoning>
<answer>
...
</answer>
"""

# A worked example in the exact format, for --one-shot: a question (written for this, not from GSM8K) and an
# assistant answer that earns every format reward; it goes before the real question as one earlier exchange.
ONE_SHOT = [
    {"role": "user", "content": "Tom has 3 apples and buys 2 more. How many apples does he have?"},
    {
        "role": "assistant",
        "content": "<reasoning>\nTom has 3 apples and buys 2 more, so 3 + 2 = 5.\n</reasoning>\n"
        "<answer>\n5\n</answer>\n",
    },
]


def extract_gold_answer(answer: str) -> str | None:
    """The number after ``####`` in a GSM8K answer, with commas and ``$`` removed (None if there is no ``####``)."""
    if "####" not in answer:
        return None
    return answer.split("####")[1].strip().replace(",", "").replace("$", "")


def make_prompt(question: str, system_prompt: str = SYSTEM_PROMPT, one_shot: bool = False) -> list[dict]:
    """The chat messages of one question: the format-asking system prompt, (``one_shot``: the worked example
    ``ONE_SHOT`` as an earlier user / assistant exchange,) then the question."""
    return [
        {"role": "system", "content": system_prompt},
        *(ONE_SHOT if one_shot else []),
        {"role": "user", "content": question},
    ]


def find_split(folder, split: str) -> Path | None:
    """``{split}.jsonl`` or ``{split}.jsonl.gz`` in ``folder``, or None when neither is there."""
    for name in (f"{split}.jsonl", f"{split}.jsonl.gz"):
        if (Path(folder) / name).is_file():
            return Path(folder) / name
    return None


def describe(data: str | None) -> str:
    """One line naming the data source ``data`` (as ``load_gsm8k`` takes it), for a script's first lines."""
    if data is None or data == BUNDLED:
        return "GSM8K bundled with the examples (7473 train / 1319 test questions, no network)"
    if data == HUB_ID:
        return f"GSM8K from the hub ({HUB_ID}, main)"
    return f"GSM8K files in {data}"


def _rows_from_jsonl(path: Path) -> list[dict]:
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def load_gsm8k(
    split: str = "train", data: str | None = None, system_prompt: str = SYSTEM_PROMPT, one_shot: bool = False
) -> list[dict]:
    """GSM8K ``split`` ("train" or "test") as a list of ``{"prompt", "answer", "question"}`` dicts.

    ``data``: None or ``"bundled"`` (the default): the original release files bundled in ``BUNDLED_DIR``; a folder
    holding ``{split}.jsonl`` or ``{split}.jsonl.gz`` in the original release format (one ``{"question",
    "answer"}`` per line, the answer ending with ``#### <number>``); or ``"openai/gsm8k"``: the hub's ``main``
    configuration through ``datasets``. ``one_shot``: put the worked example ``ONE_SHOT`` before each question.
    """
    if data == HUB_ID:
        import datasets

        rows = datasets.load_dataset(HUB_ID, "main", split=split)
    else:
        folder = BUNDLED_DIR if data is None or data == BUNDLED else Path(data)
        path = find_split(folder, split)
        if path is None:
            raise FileNotFoundError(
                f"--data {data}: no {split}.jsonl (or {split}.jsonl.gz) there; pass a folder with GSM8K's original "
                f"jsonl files, leave --data out for the bundled copy, or pass --data {HUB_ID} for the hub"
            )
        rows = _rows_from_jsonl(path)
    return [
        {
            "prompt": make_prompt(r["question"], system_prompt, one_shot),
            "answer": extract_gold_answer(r["answer"]),
            "question": r["question"],
        }
        for r in rows
    ]
