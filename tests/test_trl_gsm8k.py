"""examples/trl_gsm8k.py offline: 2 steps of TRL's GRPOTrainer with grpo_fast inside, on a tiny random Qwen2 saved to
a local folder (with the byte tokenizer) and local GSM8K-format jsonl files. TRL's own head kernel may not run.
Nothing is downloaded."""

import importlib.util
import json
import math
from pathlib import Path

import pytest

from grpo_fast.gsm8k.tokenizer import byte_tokenizer
from trl_harness import tiny_qwen2
from trl_pairs import trl_kernel_forbidden

SCRIPT = Path(__file__).parents[1] / "examples" / "trl_gsm8k.py"
REWARDS = ("xmlcount_reward", "soft_format_reward", "strict_format_reward", "int_reward", "correctness_reward")


def load_script():
    spec = importlib.util.spec_from_file_location("trl_gsm8k", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


def letters_reward(prompts, completions, **kwargs):
    """A dense reward for a random model (the demo's stay 0 on random text): the fraction of ASCII letters."""
    texts = [c[-1]["content"] for c in completions]
    return [sum(ch.isascii() and ch.isalpha() for ch in t) / max(len(t), 1) for t in texts]


def test_two_steps_offline(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    (tmp_path / "data").mkdir()
    with open(tmp_path / "data" / "train.jsonl", "w") as f:
        for q, a in [("What is 2 plus 3?", "5"), ("Half of 18?", "9"), ("What is 6 times 7?", "42")]:
            f.write(json.dumps({"question": q, "answer": f"Some steps.\n#### {a}"}) + "\n")
    tokenizer = byte_tokenizer()
    model = tiny_qwen2(max_position_embeddings=1024)  # the system prompt is ~100 byte tokens
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")

    script = load_script()
    monkeypatch.setattr(script, "xmlcount_reward", letters_reward)  # the first of the five: a non-zero signal
    with trl_kernel_forbidden():
        # the CPU recipe (no warm-up, no checkpoints) at toy sizes
        trainer = script.main(["--preset", "cpu", "--model", str(tmp_path / "model"), "--data", str(tmp_path / "data"),
                               "--no-one-shot", "--output-dir", str(tmp_path / "out"), "--max-steps", "2",
                               "--num-generations", "2", "--max-completion-length", "8",
                               "--per-device-train-batch-size", "2", "--gradient-accumulation-steps", "1",
                               "--generation-batch-size", "4", "--learning-rate", "1e-3"])
    steps = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert [entry["step"] for entry in steps] == [1, 2]
    assert all(f"rewards/{name}/mean" in steps[0] for name in REWARDS[1:])  # one generation batch feeds both steps
    assert 0 < steps[0]["rewards/letters_reward/mean"] < 1
    for entry in steps:  # every step trains: a gradient from a non-zero advantage, at a learning rate above 0
        assert "entropy" in entry and math.isfinite(entry["loss"])
        assert entry["grad_norm"] > 0 and entry["learning_rate"] > 0
    assert trainer.model.forward.__func__.__code__.co_filename.endswith("grpo_fast/trl.py")
    assert not list((tmp_path / "out").glob("checkpoint-*"))  # the CPU recipe saves none


def test_cpu_recipe_and_bad_input(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    script = load_script()
    args = script.parse_args(["--preset", "cpu"])
    assert (args.model, args.one_shot, args.warmup_ratio, args.save_steps) == ("smollm2-135m", True, 0.0, 0)
    assert args.max_completion_length >= 128  # room for the tags to close (at 64 every reward was 0)
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    for argv, message in [(["--model", "nope"], "--model nope: not a local folder and not a hub id"),
                          (["--model", str(tmp_path)], "the folder has no config.json"),
                          (["--model", str(tmp_path / "model"), "--data", str(tmp_path)],
                           "no train.jsonl (or train.jsonl.gz) there"),
                          (["--model", "someone/some-model"], "HF_HUB_OFFLINE is set")]:
        with pytest.raises(SystemExit) as exit_info:
            script.main(["--preset", "cpu", *argv])
        text = str(exit_info.value.code)
        assert text.startswith("trl_gsm8k.py: error: ") and message in text and "\n" not in text
