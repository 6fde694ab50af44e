"""GSM8K for GRPO: loading (the hub or local jsonl files), chat prompts and the gold answer.

Each example becomes ``{"prompt": [system, user messages], "answer": gold number as a string, "question": ...}``,
the layout TRL's GRPOTrainer expects; ``answer`` is passed on to the reward functions.
"""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["SYSTEM_PROMPT", "extract_gold_answer", "make_prompt", "load_gsm8k", "HUB_ID"]

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


def extract_gold_answer(answer: str) -> str | None:
    """The number after ``####`` in a GSM8K answer, with commas and ``$`` removed (None if there is no ``####``)."""
    if "####" not in answer:
        return None
    return answer.split("####")[1].strip().replace(",", "").replace("$", "")


def make_prompt(question: str, system_prompt: str = SYSTEM_PROMPT) -> list[dict]:
    """The chat messages of one question: the format-asking system prompt, then the question."""
    return [{"role": "system", "content": system_prompt}, {"role": "user", "content": question}]


def _rows_from_jsonl(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def load_gsm8k(split: str = "train", data: str | None = None, system_prompt: str = SYSTEM_PROMPT) -> list[dict]:
    """GSM8K ``split`` ("train" or "test") as a list of ``{"prompt", "answer", "question"}`` dicts.

    ``data``: a folder holding ``{split}.jsonl`` in the original release format (one ``{"question", "answer"}``
    per line, the answer ending with ``#### <number>``); None or ``"openai/gsm8k"`` loads the hub's ``main``
    configuration with ``datasets``.
    """
    if data is None or data == HUB_ID:
        import datasets

        rows = datasets.load_dataset(HUB_ID, "main", split=split)
    else:
        path = Path(data) / f"{split}.jsonl"
        if not path.is_file():
            raise FileNotFoundError(f"--data {data}: no {split}.jsonl there (GSM8K's original jsonl files)")
        rows = _rows_from_jsonl(path)
    return [{"prompt": make_prompt(r["question"], system_prompt), "answer": extract_gold_answer(r["answer"]),
             "question": r["question"]} for r in rows]
