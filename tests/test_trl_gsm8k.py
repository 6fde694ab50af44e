"""examples/trl_gsm8k.py offline: 2 steps of TRL's GRPOTrainer with grpo_fast inside, on a tiny random Qwen2 saved to
a local folder (with the byte tokenizer) and local GSM8K-format jsonl files. TRL's own head kernel may not run.
Nothing is downloaded."""

import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch
from gsm8k.tokenizer import byte_tokenizer
from helpers import out_of_range_cases, parser_actions
from trl_harness import tiny_qwen2
from trl_pairs import trl_kernel_forbidden

SCRIPT = Path(__file__).parents[1] / "examples" / "trl_gsm8k.py"
REWARDS = ("xmlcount_reward", "soft_format_reward", "strict_format_reward", "int_reward", "correctness_reward")

# the CPU recipe at toy sizes: no one-shot example, 2 completions of 8 tokens, 4 a generation
TOY_RUN = (
    "--no-one-shot --num-generations 2 --max-completion-length 8 --per-device-train-batch-size 2 "
    "--generation-batch-size 4 --learning-rate 1e-3"
).split()


def offline_argv(tmp_path, out, *flags):
    """The script's arguments for the CPU preset on ``offline_data_and_model``'s files, writing to ``out``."""
    files = ("--model", str(tmp_path / "model"), "--data", str(tmp_path / "data"), "--output-dir", str(out))
    return ["--preset", "cpu", *files, *flags]


def load_script():
    spec = importlib.util.spec_from_file_location("trl_gsm8k", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


def letters_reward(prompts, completions, **kwargs):
    """A dense reward for a random model (the demo's stay 0 on random text): the fraction of ASCII letters."""
    texts = [c[-1]["content"] for c in completions]
    return [sum(ch.isascii() and ch.isalpha() for ch in t) / max(len(t), 1) for t in texts]


def offline_data_and_model(tmp_path, monkeypatch):
    """No hub: three GSM8K-style questions in tmp_path/data, a tiny random Qwen2 and the byte tokenizer in
    tmp_path/model."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    (tmp_path / "data").mkdir()
    with open(tmp_path / "data" / "train.jsonl", "w") as f:
        for q, a in [("What is 2 plus 3?", "5"), ("Half of 18?", "9"), ("What is 6 times 7?", "42")]:
            f.write(json.dumps({"question": q, "answer": f"Some steps.\n#### {a}"}) + "\n")
    model = tiny_qwen2(max_position_embeddings=1024)  # the system prompt is ~100 byte tokens
    model.save_pretrained(tmp_path / "model")
    byte_tokenizer().save_pretrained(tmp_path / "model")


@pytest.mark.slow
def test_two_steps_offline(tmp_path, monkeypatch, capsys):
    offline_data_and_model(tmp_path, monkeypatch)

    script = load_script()
    monkeypatch.setattr(script, "xmlcount_reward", letters_reward)  # the first of the five: a non-zero signal
    with trl_kernel_forbidden():
        # the CPU recipe (no warm-up, no checkpoints) at toy sizes
        trainer = script.main(
            offline_argv(tmp_path, tmp_path / "out", *TOY_RUN, "--max-steps", "2", "--gradient-accumulation-steps", "1")
        )
    steps = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert [entry["step"] for entry in steps] == [1, 2]
    assert all(f"rewards/{name}/mean" in steps[0] for name in REWARDS[1:])  # one generation batch feeds both steps
    assert 0 < steps[0]["rewards/letters_reward/mean"] < 1
    for entry in steps:  # every step trains: a gradient from a non-zero advantage, at a learning rate above 0
        assert "entropy" in entry and math.isfinite(entry["loss"])
        assert entry["grad_norm"] > 0 and entry["learning_rate"] > 0
    assert trainer.model.forward.__func__.__code__.co_filename.endswith("grpo_fast/integrations/trl.py")
    assert not list((tmp_path / "out").glob("checkpoint-*"))  # the CPU recipe saves none

    # what TRL users expect in the output folder: the logged metrics, a plot, the trained weights (and their size)
    out = tmp_path / "out"
    assert sorted(p.name for p in out.iterdir()) == ["metrics.jsonl", "metrics.png", "model"]
    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged if "loss" in r] == [1, 2] and logged[-1]["step"] == 2
    assert [r["loss"] for r in logged if "loss" in r] == [e["loss"] for e in steps]
    assert (out / "metrics.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "metrics.png").stat().st_size > 10_000
    from safetensors.torch import load_file

    saved = load_file(out / "model" / "model.safetensors")
    trained = trainer.model.state_dict()
    assert saved and all(torch.equal(saved[k], trained[k]) for k in saved)
    assert (out / "model" / "tokenizer_config.json").exists()
    stdout = capsys.readouterr().out
    assert "saving the trained weights..." in stdout
    last = stdout.strip().splitlines()[-1]
    assert last.startswith(
        f"done: this run wrote {out}/: metrics.jsonl (2 steps), metrics.png, model/ (weights and tokenizer, "
    ) and last.endswith(" kB)")

    # a second run into the same folder is refused before anything slow, and the first run's files stay
    with pytest.raises(SystemExit) as exit_info:
        script.main(offline_argv(tmp_path, out))
    assert exit_info.value.code == 2 and "holds an earlier run (metrics.jsonl, metrics.png, model/)" in str(
        exit_info.value
    )
    assert sorted(p.name for p in out.iterdir()) == ["metrics.jsonl", "metrics.png", "model"]


@pytest.mark.slow
def test_a_failed_run_keeps_only_its_finished_steps_logs(tmp_path, monkeypatch):
    """A reward that fails in the second generation: TRL's error goes up; the folder keeps the first generation's
    steps in metrics.jsonl beside FAILED.txt, and no plot or model."""
    offline_data_and_model(tmp_path, monkeypatch)
    calls = []

    def fails_in_the_second_generation(prompts, completions, **kwargs):
        calls.append(1)
        if len(calls) > 1:
            raise RuntimeError("reward server down")
        return letters_reward(prompts, completions)

    script = load_script()
    monkeypatch.setattr(script, "xmlcount_reward", fails_in_the_second_generation)
    out = tmp_path / "out"
    with pytest.raises(RuntimeError, match="reward server down"):
        script.main(offline_argv(tmp_path, out, *TOY_RUN, "--max-steps", "4"))
    assert sorted(p.name for p in out.iterdir()) == ["FAILED.txt", "metrics.jsonl"]
    assert [r["step"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())] == [1, 2]
    assert "stopped after 2 finished step(s): RuntimeError: reward server down" in (out / "FAILED.txt").read_text()


def test_cpu_recipe_and_bad_input(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    script = load_script()
    args = script.parse_args(["--preset", "cpu"])
    assert (args.model, args.one_shot, args.warmup_ratio, args.save_steps) == ("smollm2-135m", True, 0.0, 0)
    assert args.max_completion_length >= 128  # room for the tags to close (at 64 every reward was 0)
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    for argv, message in [
        (["--model", "nope"], "--model nope: not a local folder and not a hub id"),
        (["--model", str(tmp_path)], "the folder has no config.json"),
        (["--model", str(tmp_path / "model"), "--data", str(tmp_path)], "no train.jsonl (or train.jsonl.gz) there"),
        (["--model", "someone/some-model"], "HF_HUB_OFFLINE is set"),
    ]:
        with pytest.raises(SystemExit) as exit_info:
            script.main(["--preset", "cpu", *argv])
        text = str(exit_info.value)
        assert exit_info.value.code == 2
        assert text.startswith("trl_gsm8k.py: error: ") and message in text and "\n" not in text


def test_every_numeric_flag_is_checked_before_anything_slow(monkeypatch, capsys):
    """Each numeric flag just outside its range, and batch sizes TRL would reject: one line naming the flag, the
    value and the range, exit status 2, before TRL or a model loads; --help says what each flag accepts."""
    script = load_script()
    monkeypatch.setattr(script.models, "load_model_and_tokenizer", lambda *a, **k: pytest.fail("loaded a model"))
    actions = parser_actions(script.parse_args, ["--preset", "cpu"])
    assert {d for d, a in actions.items() if a.type in (int, float)} == set(script.RANGES)
    ranged = [(argv, message) for _, argv, message in out_of_range_cases(script.RANGES, actions)]
    batch_sizes = [
        (["--generation-batch-size", "6"], "--generation-batch-size 6: expected a multiple of --num-generations (4)"),
        (
            ["--generation-batch-size", "12", "--num-generations", "6", "--per-device-train-batch-size", "8"],
            "--generation-batch-size 12: expected a multiple of --per-device-train-batch-size (8)",
        ),
    ]
    for argv, message in ranged + batch_sizes:
        with pytest.raises(SystemExit) as exit_info:
            script.main(["--preset", "cpu", *argv])
        assert exit_info.value.code == 2 and str(exit_info.value) == f"trl_gsm8k.py: error: {message}", argv
        assert capsys.readouterr().err == f"trl_gsm8k.py: error: {message}\n"
    for dest, accepted in script.RANGES.items():
        assert "accepts " + accepted.describe(actions[dest].type is int) in actions[dest].help, dest
    for preset in ("cpu", "gpu"):  # the recipes' own values pass
        script.parse_args(["--preset", preset])


def test_step_progress_names_the_phase_and_ticks():
    """The per-step bar says what the model runs (from its decoder's calls) and is redrawn while nothing else moves."""
    import io
    import time
    from types import SimpleNamespace

    from gsm8k.callbacks import StepProgress

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    model = tiny_qwen2()
    screen = Terminal()
    progress = StepProgress(model, refresh_s=0.05, file=screen)
    state = SimpleNamespace(global_step=2, max_steps=8)
    progress.on_step_begin(None, state, None)
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        model(ids)
    assert progress.phase == "scoring log-probs"
    with torch.no_grad():
        model.generate(ids, max_new_tokens=2, do_sample=False, pad_token_id=0)
    assert progress.phase == "sampling"
    model(ids).logits.sum().backward()
    assert progress.phase == "forward / backward"
    time.sleep(0.3)
    assert "optimizer step 3/8: forward / backward" in screen.getvalue()
    progress.on_train_end(None, state, None)
    model(ids)
    assert progress.bar is None and progress.phase == "forward / backward"  # the hook is gone


def test_step_progress_off_a_terminal_is_one_line_a_step():
    """Written to a file or a pipe, the per-step bar draws nothing while the step runs and one line when it ends."""
    import io
    from types import SimpleNamespace

    from gsm8k.callbacks import StepProgress

    model = tiny_qwen2()
    log = io.StringIO()
    progress = StepProgress(model, refresh_s=0.01, file=log)
    for step in range(2):
        state = SimpleNamespace(global_step=step, max_steps=8)
        progress.on_step_begin(None, state, None)
        model(torch.tensor([[1, 2, 3]])).logits.sum().backward()
        progress.on_step_end(None, state, None)
    progress.on_train_end(None, state, None)
    lines = log.getvalue().splitlines()
    assert [line.split(" in ")[0] for line in lines] == [
        "optimizer step 1/8: 1/1 step",
        "optimizer step 2/8: 1/1 step",
    ]
    assert "\r" not in log.getvalue()
