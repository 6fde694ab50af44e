"""GSM8K for GRPO: loading (the hub or local jsonl files), chat prompts and the gold answer.

Each example becomes ``{"prompt": [system, user messages], "answer": gold number as a string, "question": ...}``,
the layout TRL's GRPOTrainer expects; ``answer`` is passed on to the reward functions.
"""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["SYSTEM_PROMPT", "ONE_SHOT", "extract_gold_answer", "make_prompt", "load_gsm8k", "HUB_ID"]

HUB_ID = "openai/gsm8k"

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
    {"role": "assistant", "content": "<reasoning>\nTom has 3 apples and buys 2 more, so 3 + 2 = 5.\n</reasoning>\n"
                                     "<answer>\n5\n</answer>\n"},
]


def extract_gold_answer(answer: str) -> str | None:
    """The number after ``####`` in a GSM8K answer, with commas and ``$`` removed (None if there is no ``####``)."""
    if "####" not in answer:
        return None
    return answer.split("####")[1].strip().replace(",", "").replace("$", "")


def make_prompt(question: str, system_prompt: str = SYSTEM_PROMPT, one_shot: bool = False) -> list[dict]:
    """The chat messages of one question: the format-asking system prompt, (``one_shot``: the worked example
    ``ONE_SHOT`` as an earlier user / assistant exchange,) then the question."""
    return [{"role": "system", "content": system_prompt}, *(ONE_SHOT if one_shot else []),
            {"role": "user", "content": question}]


def _rows_from_jsonl(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def load_gsm8k(split: str = "train", data: str | None = None, system_prompt: str = SYSTEM_PROMPT,
               one_shot: bool = False) -> list[dict]:
    """GSM8K ``split`` ("train" or "test") as a list of ``{"prompt", "answer", "question"}`` dicts.

    ``data``: a folder holding ``{split}.jsonl`` in the original release format (one ``{"question", "answer"}``
    per line, the answer ending with ``#### <number>``); None or ``"openai/gsm8k"`` loads the hub's ``main``
    configuration with ``datasets``. ``one_shot``: put the worked example ``ONE_SHOT`` before each question.
    """
    if data is None or data == HUB_ID:
        import datasets

        rows = datasets.load_dataset(HUB_ID, "main", split=split)
    else:
        path = Path(data) / f"{split}.jsonl"
        if not path.is_file():
            raise FileNotFoundError(f"--data {data}: no {split}.jsonl there (GSM8K's original jsonl files)")
        rows = _rows_from_jsonl(path)
    return [{"prompt": make_prompt(r["question"], system_prompt, one_shot),
             "answer": extract_gold_answer(r["answer"]), "question": r["question"]} for r in rows]
