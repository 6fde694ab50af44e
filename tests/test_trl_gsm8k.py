"""examples/trl_gsm8k.py offline: 2 steps of TRL's GRPOTrainer with grpo_fast inside, on a tiny random Qwen2 saved to
a local folder (with the byte tokenizer) and local GSM8K-format jsonl files. TRL's own head kernel may not run."""

import importlib.util
import json
from pathlib import Path

from grpo_fast.gsm8k.tokenizer import byte_tokenizer
from trl_harness import tiny_qwen2
from trl_pairs import trl_kernel_forbidden

SCRIPT = Path(__file__).parents[1] / "examples" / "trl_gsm8k.py"
REWARDS = ("xmlcount_reward", "soft_format_reward", "strict_format_reward", "int_reward", "correctness_reward")


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

    spec = importlib.util.spec_from_file_location("trl_gsm8k", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    with trl_kernel_forbidden():
        trainer = script.main(["--model", str(tmp_path / "model"), "--data", str(tmp_path / "data"),
                               "--output-dir", str(tmp_path / "out"), "--max-steps", "2", "--num-generations", "2",
                               "--max-completion-length", "8", "--per-device-train-batch-size", "2",
                               "--gradient-accumulation-steps", "1", "--generation-batch-size", "4",
                               "--learning-rate", "1e-3"])
    steps = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert [entry["step"] for entry in steps] == [1, 2]
    assert all(f"rewards/{name}/mean" in steps[0] for name in REWARDS)  # one generation batch feeds both steps
    assert all("entropy" in entry and entry["grad_norm"] >= 0 for entry in steps)
    assert trainer.model.forward.__func__.__code__.co_filename.endswith("grpo_fast/trl.py")
