"""examples/distill_gsm8k.py offline: 2 steps of grpo_fast.trl's DistillationTrainer on a tiny random Qwen2 teacher
(saved to a local folder with the byte tokenizer) and its pruned student, on local GSM8K-format jsonl files. TRL's
own divergence kernel may not run. Nothing is downloaded."""

import importlib.util
import json
import math
from pathlib import Path

import pytest
from gsm8k.tokenizer import byte_tokenizer
from test_trl_distill import trl_divergence_forbidden
from trl_harness import tiny_qwen2

SCRIPT = Path(__file__).parents[1] / "examples" / "distill_gsm8k.py"


def load_script():
    spec = importlib.util.spec_from_file_location("distill_gsm8k", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


@pytest.mark.slow
def test_two_steps_offline(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    (tmp_path / "data").mkdir()
    with open(tmp_path / "data" / "train.jsonl", "w") as f:
        for q, a in [("What is 2 plus 3?", "5"), ("Half of 18?", "9"), ("What is 6 times 7?", "42")]:
            f.write(json.dumps({"question": q, "answer": f"Some steps.\n#### {a}"}) + "\n")
    teacher = tiny_qwen2(max_position_embeddings=1024, num_hidden_layers=4)  # the system prompt is ~100 byte tokens
    teacher.save_pretrained(tmp_path / "model")
    byte_tokenizer().save_pretrained(tmp_path / "model")

    script = load_script()
    with trl_divergence_forbidden():
        trainer = script.main(
            [
                "--model",
                str(tmp_path / "model"),
                "--data",
                str(tmp_path / "data"),
                "--output-dir",
                str(tmp_path / "out"),
                "--max-steps",
                "2",
                "--max-completion-length",
                "8",
                "--per-device-train-batch-size",
                "2",
            ]
        )
    assert trainer.model.config.num_hidden_layers == 2 and len(trainer.model.model.layers) == 2
    assert trainer.teacher_model.config.num_hidden_layers == 4
    steps = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert [entry["step"] for entry in steps] == [1, 2]
    for entry in steps:
        assert math.isfinite(entry["loss"]) and entry["loss"] > 0 and "entropy" in entry and entry["grad_norm"] > 0

    out = tmp_path / "out"
    assert sorted(p.name for p in out.iterdir()) == ["metrics.jsonl", "metrics.png"]
    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["loss"] for r in logged if "loss" in r] == [e["loss"] for e in steps]
    assert (out / "metrics.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_flag_out_of_range_is_one_line(capsys):
    with pytest.raises(SystemExit) as stop:
        load_script().parse_args(["--beta", "1.5"])
    assert stop.value.code == 2 and "--beta" in capsys.readouterr().err
