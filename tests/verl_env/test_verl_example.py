"""examples/verl_gsm8k.sh on a CPU: its data step (verl's GSM8K parquet from the bundled copy, which verl's own
reward scores) and its configuration, composed with verl's own Hydra config as verl.trainer.main_ppo composes it.
The run itself needs a GPU (vLLM rollout, verl's FSDP engine)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import verl
from hydra import compose, initialize_config_dir
from verl.utils.reward_score import default_compute_score

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "verl_gsm8k.sh"


def script_overrides(**env):
    """The key=value arguments the script passes to verl.trainer.main_ppo, its variables set from ``env``."""
    text = SCRIPT.read_text()
    command = text[text.index("python3 -m verl.trainer.main_ppo") :].replace("\\\n", " ")
    words = command.split()[3:]
    assert words[-1] == '"$@"'
    return [re.sub(r"\$(\w+)", lambda m: env[m.group(1)], w) for w in words[:-1]]


@pytest.mark.slow
def test_data_step_writes_what_verl_scores(tmp_path):
    subprocess.run(
        [sys.executable, str(ROOT / "examples" / "verl_gsm8k_data.py"), "--local_save_dir", str(tmp_path)],
        check=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
    )
    train, test = (pd.read_parquet(tmp_path / f"{split}.parquet") for split in ("train", "test"))
    assert (len(train), len(test)) == (7473, 1319)
    row = test.iloc[0]
    assert row["data_source"] == "openai/gsm8k" and row["prompt"][0]["role"] == "user"
    assert row["prompt"][0]["content"].endswith('output the final answer after "####".')
    truth = row["reward_model"]["ground_truth"]
    assert truth == "18"  # Janet's ducks
    assert default_compute_score(row["data_source"], f"16 - 3 - 4 = 9 and 9 * 2 = 18\n#### {truth}", truth) == 1.0
    assert default_compute_score(row["data_source"], "#### 17", truth) == 0.0


def test_config_composes_with_verls():
    overrides = script_overrides(DATA="/data/gsm8k", MODEL="Qwen/Qwen2.5-1.5B-Instruct", NGPUS="1")
    with initialize_config_dir(config_dir=str(Path(verl.__file__).parent / "trainer" / "config"), version_base=None):
        config = compose(config_name="ppo_trainer", overrides=overrides)
    model = config.actor_rollout_ref.model
    assert model.use_fused_kernels is True and model.fused_kernel_options.impl_backend == "grpo_fast"
    assert config.actor_rollout_ref.actor.strategy == "fsdp2" and config.algorithm.adv_estimator == "grpo"
    assert config.data.train_files == "/data/gsm8k/train.parquet"
    assert config.actor_rollout_ref.actor.get("ulysses_sequence_parallel_size", 1) == 1
