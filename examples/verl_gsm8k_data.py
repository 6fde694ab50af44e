"""GSM8K as verl's parquet files, from the copy bundled with the examples (no hub): the rows verl's own
examples/data_preprocess/gsm8k.py writes (data_source "openai/gsm8k", the question as one user message asking for the
answer after "####", the gold number as the rule reward's ground truth), which verl's default reward scores.

    python examples/verl_gsm8k_data.py --local_save_dir ~/data/gsm8k     # train.parquet (7473), test.parquet (1319)
"""

import argparse
import os

from gsm8k.data import HUB_ID, load_gsm8k

# verl's instruction for GSM8K: its reward (verl.utils.reward_score.gsm8k) reads the number after "####"
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'


def verl_rows(split, data=None):
    """GSM8K ``split`` in verl's RL dataset layout (``data``: as gsm8k.data.load_gsm8k takes it)."""
    return [
        {
            "data_source": HUB_ID,
            "prompt": [{"role": "user", "content": f"{example['question']} {INSTRUCTION}"}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": example["answer"]},
            "extra_info": {"split": split, "index": index, "question": example["question"]},
        }
        for index, example in enumerate(load_gsm8k(split, data))
    ]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--local_save_dir", default="~/data/gsm8k", help="where train.parquet and test.parquet go")
    parser.add_argument(
        "--data",
        default=None,
        help=f"GSM8K's source: the bundled copy (default), a folder of its jsonl files, or {HUB_ID} (the hub)",
    )
    args = parser.parse_args()
    import pandas as pd  # a dependency of verl

    out = os.path.expanduser(args.local_save_dir)
    os.makedirs(out, exist_ok=True)
    for split in ("train", "test"):
        rows = verl_rows(split, args.data)
        pd.DataFrame(rows).to_parquet(os.path.join(out, f"{split}.parquet"))
        print(f"{os.path.join(out, split)}.parquet: {len(rows)} rows")


if __name__ == "__main__":
    main()
