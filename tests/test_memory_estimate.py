"""python -m grpo_fast.memory and examples/memory_gsm8k.py: the step's categories against hand arithmetic on tiny
configs, the loss heads' [N, V] logits (the eager head holds them, grpo_fast's never does), the key / value cache's
arithmetic, the example's recipes against examples/train_gsm8k.py's preset, the command line's errors, the package
without TRL, and the report for another card. The real-size estimates (bench/results/memory-4090-*) are slow: one
0.5B run is in the slow tier."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from gsm8k.models import LORA_TARGETS
from helpers import out_of_range_cases, parser_actions

from grpo_fast import memory
from grpo_fast.memory import command
from grpo_fast.memory.step import generation_phase

ROOT = Path(__file__).resolve().parents[1]


def _example():
    """examples/memory_gsm8k.py, imported from its path (it puts the repository root on sys.path for bench)."""
    spec = importlib.util.spec_from_file_location("memory_gsm8k", ROOT / "examples" / "memory_gsm8k.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


example = _example()
# tiny: 2 layers, 4 heads of 16, 2 kv heads; a vocabulary much wider than the hidden size, so that [N, V] dominates
TINY = [
    "--hidden-size",
    "64",
    "--intermediate-size",
    "128",
    "--num-layers",
    "2",
    "--num-heads",
    "4",
    "--num-kv-heads",
    "2",
    "--vocab-size",
    "32768",
    "--micro-batch-size",
    "2",
    "--prompt-length",
    "16",
    "--completion-length",
    "64",
    "--prompts-per-step",
    "2",
    "--num-generations",
    "4",
    "--quiet",
]
D, FFN, L, KV_DIM, V, B, P, T = 64, 128, 2, 2 * 16, 32768, 2, 16, 64


def base_parameters():
    """Qwen2 by hand: embeddings (tied with the head), per layer q / k / v with biases, o, gate, up, down, two
    RMS norms; the final norm."""
    layer = (D * D + D) + 2 * (D * KV_DIM + KV_DIM) + D * D + 3 * D * FFN + 2 * D
    return V * D + L * layer + D


def lora_parameters(r):
    """PEFT's A [r, in] and B [out, r] on q, k, v, o, gate, up, down of every layer."""
    return L * r * ((D + D) + 2 * (D + KV_DIM) + (D + D) + 2 * (D + FFN) + (FFN + D))


def rope_buffer_bytes():
    return 2 * (16 // 2) * 4  # inv_freq and original_inv_freq, head_dim / 2 fp32 each


@pytest.fixture(scope="module")
def lora_report(tmp_path_factory):
    """The example's three heads (TRL's from bench, registered by the example) on a tiny LoRA r 4 recipe, through the
    command line (--out writes the three files)."""
    out = tmp_path_factory.mktemp("memory") / "tiny-lora"
    report = example.main(TINY + ["--lora-r", "4", "--out", str(out)])
    assert list(report["heads"]) == ["eager", "trl", "grpo_fast"]  # trl is a test dependency: never left out here
    return report, out


def test_lora_categories_match_hand_arithmetic(lora_report):
    report, _ = lora_report
    trainable = lora_parameters(4)
    for head, step in report["heads"].items():
        c = step["categories_bytes"]
        assert step["trainable_parameters"] == trainable, head
        assert step["parameters"] == base_parameters() + trainable, head
        # bf16 base weights, fp32 adapters (PEFT's autocast); RoPE's two fp32 buffers
        assert c["weights"] == base_parameters() * 2 + trainable * 4 + rope_buffer_bytes(), head
        assert c["reference weights"] == 0, head  # LoRA's reference is the base model: no copy
        assert c["gradients"] == trainable * 4, head
        # AdamW: two fp32 moments per trainable parameter and one fp32 step count per trainable tensor (14 a layer)
        assert step["optimizer_state_bytes"] == 2 * trainable * 4 + L * 7 * 2 * 4, head
        assert c["optimizer state"] == step["optimizer_state_bytes"], head
        assert sum(c.values()) == step["peak_bytes"], head


def test_eager_head_holds_the_logits_and_grpo_fast_never_does(lora_report):
    report, _ = lora_report
    N = B * T
    logits_fp32 = N * V * 4
    eager, trl, fused = (report["heads"][h] for h in ("eager", "trl", "grpo_fast"))
    # eager: the fp32 log-softmax it saves and its gradient are alive together in its backward, at the step's peak
    assert eager["loss_head_peak_bytes"] >= 2 * logits_fp32
    assert eager["peak_in"] == "loss head backward"
    assert eager["categories_bytes"]["loss head buffers"] == eager["loss_head_peak_bytes"]
    # grpo_fast: not even one bf16 [N, V] tensor at its own peak (its frozen-head workspace included)
    assert 0 < fused["loss_head_peak_bytes"] < N * V * 2
    # TRL as on a GPU: its [min(N, 4096), 32768] bf16 tile, allocated whatever the vocabulary, and no fp32 copy of
    # it (the CPU's torch twins would add several)
    assert N * 32768 * 2 <= trl["loss_head_peak_bytes"] < N * 32768 * 4
    assert fused["peak_bytes"] < eager["peak_bytes"]


def test_report_files(lora_report):
    report, out = lora_report
    written = json.loads(Path(f"{out}.json").read_text())
    assert written["heads"]["eager"]["peak_bytes"] == report["heads"]["eager"]["peak_bytes"]
    text = Path(f"{out}.md").read_text()
    assert text.splitlines()[5].startswith("python examples/memory_gsm8k.py --hidden-size 64")
    assert "What is estimated, what is not" in text
    assert "**RTX 4090 (23.99 GiB): fits with every head.**" in text
    assert Path(f"{out}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for head in report["heads"].values():
        assert head["fits"] and head["allowance_gib"] == pytest.approx(
            memory.ALLOWANCE["cuda_context_gib"] + memory.ALLOWANCE["fragmentation_fraction"] * head["peak_gib"],
            abs=2e-3,
        )


@pytest.mark.slow
def test_full_parameter_categories_and_reference_copy():
    report = memory.main(TINY + ["--lora-r", "0", "--heads", "grpo_fast", "--beta", "0.04"])
    step = report["heads"]["grpo_fast"]
    c = step["categories_bytes"]
    params = base_parameters()
    assert step["trainable_parameters"] == params
    assert c["weights"] == params * 2 + rope_buffer_bytes()
    assert c["reference weights"] == params * 2 + rope_buffer_bytes()  # the KL term's frozen copy
    # bf16 parameters: bf16 gradients and bf16 moments (torch's AdamW keeps the state in the parameter's dtype)
    n_tensors = 1 + L * 12 + 1  # embeddings, per layer q/k/v weights and biases, o, gate, up, down, 2 norms; norm
    assert step["optimizer_state_bytes"] == 2 * params * 2 + n_tensors * 4
    assert c["gradients"] in (0, params * 2)  # all of them at a forward / backward peak, none after zero_grad
    assert sum(c.values()) == step["peak_bytes"]


def test_kv_cache_arithmetic():
    qwen = memory.MODELS["qwen2.5-1.5b"]
    assert memory.kv_cache_bytes(qwen, 64, 1298, 2) == 28 * 2 * 2 * 128 * 64 * 1298 * 2 == 2_381_840_384
    recipe = example.RECIPES["qwen2.5-1.5b-lora"]
    step = {
        "categories_bytes": {"weights": 10, "reference weights": 0, "teacher weights": 5},
        "optimizer_state_bytes": 7,
    }
    generation = generation_phase(recipe, step)
    assert (generation["sequences"], generation["tokens"]) == (64, 1298)
    assert generation["parts_bytes"]["kv cache"] == 2_381_840_384
    assert generation["total_bytes"] == 2_381_840_384 + 22  # a distillation teacher's weights stay on the card too
    assert memory.kv_cache_bytes(memory.MODELS["qwen2.5-0.5b"], 3, 5, 4) == 24 * 2 * 2 * 64 * 3 * 5 * 4


def test_recipes_are_the_examples():
    """The example's two recipes are examples/train_gsm8k.py's GPU preset (and --lora-r 0) on its public model
    configs, with its LoRA targets."""
    spec = importlib.util.spec_from_file_location("train_gsm8k", ROOT / "examples" / "train_gsm8k.py")
    train = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train)
    preset = train.PRESETS["gpu"]
    defaults = train.parse_args(["--preset", "gpu"])
    for name, recipe in example.RECIPES.items():
        shape = train.MODEL_CONFIGS[recipe.model]
        assert (
            recipe.shape.hidden_size,
            recipe.shape.intermediate_size,
            recipe.shape.num_layers,
            recipe.shape.num_heads,
            recipe.shape.num_kv_heads,
            recipe.shape.vocab_size,
            recipe.shape.tie_word_embeddings,
        ) == (
            shape["hidden_size"],
            shape["intermediate_size"],
            shape["num_hidden_layers"],
            shape["num_attention_heads"],
            shape["num_key_value_heads"],
            shape["vocab_size"],
            shape["tie_word_embeddings"],
        ), name
        assert (
            recipe.micro_batch_size,
            recipe.completion_length,
            recipe.prompts_per_step,
            recipe.num_generations,
            recipe.gradient_checkpointing,
            recipe.beta,
            recipe.temperature,
        ) == (
            preset["micro_batch_size"],
            preset["max_completion_length"],
            preset["prompts_per_step"],
            preset["num_generations"],
            preset["gradient_checkpointing"],
            preset["beta"],
            preset["temperature"],
        )
        assert recipe.prompt_length == defaults.max_prompt_length
        assert (recipe.lora_alpha, recipe.weight_decay, recipe.max_grad_norm, recipe.epsilon) == (
            defaults.lora_alpha,
            defaults.weight_decay,
            defaults.max_grad_norm,
            defaults.epsilon,
        )
        assert recipe.lr == train.parse_args(["--preset", "gpu", "--lora-r", str(recipe.lora_r)]).lr
        assert recipe.lora_targets == tuple(LORA_TARGETS)
    assert example.RECIPES["qwen2.5-1.5b-lora"].lora_r == preset["lora_r"]
    assert example.RECIPES["qwen2.5-1.5b-lora"].model == "qwen2.5-1.5b"
    assert example.RECIPES["qwen2.5-0.5b-full"].lora_r == 0


def test_every_numeric_flag_out_of_range_is_one_line(capsys):
    actions = parser_actions(command.parse_args, ["--quiet"])
    assert {d for d, a in actions.items() if a.type in (int, float)} == set(command.RANGES)
    for dest, argv, message in out_of_range_cases(command.RANGES, actions):
        with pytest.raises(SystemExit) as raised:
            command.parse_args(argv + ["--quiet"])
        assert raised.value.code == 2, dest
        assert capsys.readouterr().err == f"python -m grpo_fast.memory: error: {message}\n", dest


def test_every_flag_says_what_it_is():
    """--help describes every flag (--lora-alpha, --gradient-checkpointing had none)."""
    actions = parser_actions(command.parse_args, ["--quiet"])
    assert [dest for dest, action in actions.items() if not action.help] == []


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--heads", "eager,logits"], "--heads eager,logits: expected distinct names among eager, grpo_fast"),
        (["--heads", "eager,trl"], "--heads eager,trl: expected distinct names among eager, grpo_fast"),
        (["--heads", "eager,eager"], "--heads eager,eager: expected distinct names"),
        (
            ["--hidden-size", "100", "--num-heads", "3", "--num-kv-heads", "1"],
            "hidden size 100 is not a multiple of the 3 attention heads",
        ),
        (["--num-heads", "12", "--num-kv-heads", "5"], "12 attention heads are not a multiple of the 5 kv heads"),
        (["--hidden-size", "36", "--num-heads", "4", "--num-kv-heads", "2"], "head dim 9 (hidden size / heads) is odd"),
    ],
)
def test_command_line_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as raised:
        command.recipe_from_args(command.parse_args(argv + ["--quiet"]))
    assert raised.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("python -m grpo_fast.memory: error: ") and message in err, err
    assert "Traceback" not in err


def test_unknown_recipe_is_argparse_error(capsys):
    with pytest.raises(SystemExit) as raised:
        command.parse_args(["--recipe", "qwen3-8b"], recipes=example.RECIPES, prog=example.PROG)
    assert raised.value.code == 2 and "invalid choice: 'qwen3-8b'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as raised:  # the package's own command has its default recipe, no --recipe
        command.parse_args(["--recipe", "qwen2.5-1.5b-lora"])
    assert raised.value.code == 2 and "unrecognized arguments: --recipe" in capsys.readouterr().err


@pytest.mark.slow
def test_qwen05b_full_parameter_step():
    """The committed 0.5B estimate's categories at full size: weights, reference copy, gradients and AdamW's state
    by the parameter count (494M, tied), and the eager head's logits far above grpo_fast's head."""
    report = example.main(["--recipe", "qwen2.5-0.5b-full", "--heads", "eager,grpo_fast", "--quiet"])
    params = 494_032_768
    for head in ("eager", "grpo_fast"):
        step = report["heads"][head]
        assert step["parameters"] == step["trainable_parameters"] == params
        assert step["categories_bytes"]["reference weights"] == params * 2 + 2 * 32 * 4
        assert step["optimizer_state_bytes"] == 2 * params * 2 + (2 + 24 * 12) * 4
    N, V = 4 * 786, 151936
    assert report["heads"]["eager"]["loss_head_peak_bytes"] >= 2 * N * V * 4
    assert report["heads"]["grpo_fast"]["loss_head_peak_bytes"] < N * V * 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="the error is for machines without CUDA")
def test_measure_needs_cuda(capsys):
    with pytest.raises(SystemExit) as raised:
        command.parse_args(["--measure"])
    assert raised.value.code == 2 and "--measure runs the step on a CUDA GPU" in capsys.readouterr().err


# The package's own command where trl does not import: `import trl` raises ImportError, as without the package
WITHOUT_TRL = """
import runpy, sys
sys.modules["trl"] = None
import grpo_fast.memory
loaded = sorted(name for name in ("transformers", "peft", "trl", "matplotlib") if sys.modules.get(name) is not None)
print("loaded by the import:", ",".join(loaded), file=sys.stderr)
runpy.run_module("grpo_fast.memory", run_name="__main__")
"""


def test_package_estimates_without_trl(lora_report, tmp_path):
    """python -m grpo_fast.memory with trl unimportable: importing the estimator loads neither transformers nor trl,
    and the run estimates eager's and grpo_fast's heads, to the byte of the run beside TRL's (same recipe)."""
    out = tmp_path / "no-trl"
    argv = TINY + ["--lora-r", "4", "--beta", "0.04", "--out", str(out)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, "-c", WITHOUT_TRL, *argv], capture_output=True, text=True, env=env, cwd=ROOT)
    assert run.returncode == 0, run.stderr
    assert "loaded by the import: \n" in run.stderr
    report = json.loads(out.with_suffix(".json").read_text())
    assert list(report["heads"]) == ["eager", "grpo_fast"]
    assert report["versions"].keys() == {"torch", "transformers", "peft"}
    assert report["command"].startswith("python -m grpo_fast.memory --hidden-size 64")
    beside_trl, _ = lora_report
    for head in ("eager", "grpo_fast"):
        for key in ("peak_bytes", "categories_bytes", "loss_head_peak_bytes", "peak_in"):
            assert report["heads"][head][key] == beside_trl["heads"][head][key], (head, key)


def test_package_command_takes_the_peers_heads(lora_report, tmp_path):
    """python -m grpo_fast.memory --peer-heads bench.memory_peers:peer_heads from the checkout: TRL's fused head
    beside eager's and grpo_fast's, each to the byte of the example's run of the same recipe (its preset's beta)."""
    out = tmp_path / "peers"
    argv = TINY + ["--lora-r", "4", "--beta", "0.04", "--peer-heads", command.TRL_PEER_HEADS, "--out", str(out)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, "-m", "grpo_fast.memory", *argv], capture_output=True, text=True, env=env)
    assert run.returncode == 0, run.stderr
    report = json.loads(out.with_suffix(".json").read_text())
    assert list(report["heads"]) == ["eager", "trl", "grpo_fast"]
    example_report, _ = lora_report
    for head in ("eager", "trl", "grpo_fast"):
        for key in ("peak_bytes", "categories_bytes", "loss_head_peak_bytes"):
            assert report["heads"][head][key] == example_report["heads"][head][key], (head, key)


def test_where_trl_imports_the_command_says_how_to_add_its_head(capsys, monkeypatch):
    """Without --quiet and without --peer-heads, the package command names the flag where trl imports, and says
    nothing of it where trl does not (a module set to None in sys.modules: no crash)."""
    argv = [a for a in TINY if a != "--quiet"] + ["--lora-r", "0", "--heads", "grpo_fast"]
    hint = f"--peer-heads {command.TRL_PEER_HEADS}"
    memory.main(argv)
    assert hint in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "trl", None)
    memory.main(argv)
    assert hint not in capsys.readouterr().err


@pytest.mark.parametrize(
    "spec, message",
    [
        ("bench.memory_peers", "expected MODULE:FUNCTION"),
        ("no_such_module_here:heads", "No module named 'no_such_module_here'"),
        ("bench.memory_peers:no_such_function", "no_such_function"),
        ("bench.memory_peers:TrlHead", "TrlHead() raised TypeError"),
        ("bench.memory_peers:trl_gpu_path", "must return {name: LossHead subclass}"),
    ],
)
def test_peer_heads_errors(spec, message, capsys):
    with pytest.raises(SystemExit) as raised:
        command.parse_args(["--peer-heads", spec, "--quiet"])
    assert raised.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("python -m grpo_fast.memory: error: --peer-heads ") and message in err, err


def test_package_default_recipe():
    recipe = command.recipe_from_args(command.parse_args(["--quiet"]))
    assert recipe == memory.DEFAULT_RECIPE
    assert recipe.describe() == (
        "qwen2.5-1.5b, LoRA r 16 (alpha 32), bfloat16, AdamW, micro-batch 4 x (512 prompt + 1024 completion tokens), "
        "gradient checkpointing on, beta 0; rollout 8 x 8 completions"
    )
    assert command.gpu_from_args(command.parse_args(["--quiet"])) == memory.RTX_4090
    assert memory.RTX_4090.memory_gib * 1024 == 24564


def test_report_for_another_card(lora_report, tmp_path):
    """A 1.02 GiB card of an A100's architecture: the verdicts, margins and wording are that card's, and the LoRA
    step's bytes do not change (the frozen head's workspaces do not depend on the architecture)."""
    out = tmp_path / "card"
    card = ["--gpu-name", "test card", "--gpu-memory-gib", "1.02", "--gpu-compute-capability", "80"]
    report = memory.main(TINY + ["--lora-r", "4", "--beta", "0.04", "--out", str(out)] + card)
    assert report["card"] == {
        "name": "test card",
        "gib": 1.02,
        "compute_capability": 80,
    }
    beside_trl, _ = lora_report
    eager, fused = report["heads"]["eager"], report["heads"]["grpo_fast"]
    for head in ("eager", "grpo_fast"):
        assert report["heads"][head]["peak_bytes"] == beside_trl["heads"][head]["peak_bytes"]
    # eager: 1 GiB of context + 15 % of its 0.05 GiB peak is over the card; grpo_fast's 0.008 GiB is not
    assert eager["with_allowance_gib"] == pytest.approx(1 + 1.15 * eager["peak_bytes"] / 2**30, abs=1e-3)
    assert not eager["fits"] and eager["margin_gib"] == pytest.approx(1.02 - eager["with_allowance_gib"], abs=1e-3)
    assert fused["fits"] and fused["margin_gib"] == pytest.approx(1.02 - fused["with_allowance_gib"], abs=1e-3)
    assert report["generation"]["fits"]
    text = out.with_suffix(".md").read_text()
    assert "The card: test card, 1.02 GiB (1044 MiB)." in text
    assert "**test card (1.02 GiB): does not fit with every head.**" in text
    margins = f"**no**, margin {eager['margin_gib']:+.2f} | yes, margin {fused['margin_gib']:+.2f}"
    assert f"| fits 1.02 GiB? | {margins} |" in text
    assert "sized for the test card's sm_80" in " ".join(text.split())  # in a wrapped paragraph
    assert "4090" not in text
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ----------------------------------------------------------------------------------------------- the model's input
TINY_SHAPE_FLAGS = TINY[: TINY.index("--micro-batch-size")]
TINY_RUN = TINY[TINY.index("--micro-batch-size") :]


def _write_config(folder: Path, model_type: str) -> Path:
    """A tiny decoder's config.json of ``model_type`` (transformers' own config class writes it), TINY's sizes."""
    from transformers import AutoConfig

    config = AutoConfig.for_model(
        model_type,
        hidden_size=D,
        intermediate_size=FFN,
        num_hidden_layers=L,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=V,
        tie_word_embeddings=False,
    )
    config.save_pretrained(folder)
    return folder / "config.json"


@pytest.mark.parametrize("as_folder", [False, True], ids=["config.json", "folder"])
def test_model_from_a_local_config(tmp_path, as_folder):
    """--model takes a config.json or its folder: its sizes, and the model built from its own architecture (Llama:
    no q / k / v biases, an untied head), counted to the parameter by hand."""
    path = _write_config(tmp_path, "llama")
    report = memory.main(
        ["--model", str(tmp_path if as_folder else path), "--lora-r", "0", "--heads", "grpo_fast"] + TINY_RUN
    )
    assert report["recipe"]["shape"] | {"config_path": None} == {
        "hidden_size": D,
        "intermediate_size": FFN,
        "num_layers": L,
        "num_heads": 4,
        "num_kv_heads": 2,
        "vocab_size": V,
        "tie_word_embeddings": False,
        "config_path": None,
        "explicit_head_dim": None,
    }
    assert report["recipe"]["shape"]["config_path"] == str(path.resolve())
    layer = 2 * D * D + 2 * D * KV_DIM + 3 * D * FFN + 2 * D  # Llama: q, k, v, o without biases; the MLP; 2 norms
    step = report["heads"]["grpo_fast"]
    assert step["parameters"] == 2 * V * D + L * layer + D  # embeddings and an untied head


def test_unknown_model_is_one_line_naming_the_presets_and_a_local_config(capsys, tmp_path):
    with pytest.raises(SystemExit) as raised:
        command.recipe_from_args(command.parse_args(["--model", "Qwen/Qwen3-4B", "--quiet"]))
    assert raised.value.code == 2
    err = capsys.readouterr().err
    assert err == (
        "python -m grpo_fast.memory: error: Qwen/Qwen3-4B: not a preset (qwen2.5-0.5b, qwen2.5-1.5b) nor a local "
        "config.json or folder holding one (the estimator reads no hub: download the model's config.json and pass "
        "its path)\n"
    )
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(SystemExit):
        command.recipe_from_args(command.parse_args(["--model", str(tmp_path), "--quiet"]))
    assert "transformers cannot read it" in capsys.readouterr().err
    _write_config(tmp_path, "t5")
    with pytest.raises(SystemExit):  # an encoder-decoder: no causal LM to build
        command.recipe_from_args(command.parse_args(["--model", str(tmp_path), "--quiet"]))
    assert "a t5 config, which transformers builds no causal LM of" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # a folder without a config.json
        command.recipe_from_args(command.parse_args(["--model", str(tmp_path / "x"), "--quiet"]))
    assert "not a preset" in capsys.readouterr().err


def test_teacher_flags_need_their_heads_and_the_students_vocabulary(capsys, tmp_path):
    with pytest.raises(SystemExit):
        command.parse_args(["--teacher-top-k", "4", "--quiet"])
    assert "--teacher-top-k describes the teacher of --heads served_distillation" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        command.parse_args(["--teacher-model", "qwen2.5-0.5b", "--heads", "served_distillation", "--quiet"])
    assert "--teacher-model describes the teacher of --heads distillation,rl_distillation" in capsys.readouterr().err
    argv = TINY + ["--heads", "distillation", "--teacher-model", "qwen2.5-0.5b"]
    with pytest.raises(SystemExit):
        command.recipe_from_args(command.parse_args(argv))
    assert "--teacher-model qwen2.5-0.5b: vocabulary 151936, the student's is 32768" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------- distillation heads
@pytest.fixture(scope="module")
def distillation_report():
    """The three distillation heads beside grpo_fast's on the tiny LoRA recipe, the teacher of the student's shape."""
    return memory.main(TINY + ["--lora-r", "4", "--heads", "grpo_fast," + ",".join(memory.DISTILLATION_HEADS)])


def test_distillation_heads_hold_their_teacher_and_buffers(distillation_report):
    from grpo_fast.kernels.divergence_loss import loss_chunk_rows

    heads = distillation_report["heads"]
    assert list(heads) == ["grpo_fast", "distillation", "rl_distillation", "served_distillation"]
    N = B * T
    teacher = base_parameters() * 2 + rope_buffer_bytes()  # the base model in bf16, no adapters
    for name in ("distillation", "rl_distillation"):
        step = heads[name]
        assert step["categories_bytes"]["teacher weights"] == teacher, name
        assert sum(step["categories_bytes"].values()) == step["peak_bytes"], name
        # the fused loss's chunk buffers (both models' fp32 products of half a chunk, g in bf16) and dH fp32 at least
        rows = loss_chunk_rows(N, D)
        assert step["loss_head_peak_bytes"] >= 2 * (rows // 2) * V * 4 + rows * V * 2 + N * D * 4, name
        assert step["loss_head_peak_bytes"] < N * V * 2, name  # never one bf16 [N, V] tensor
        assert step["peak_bytes"] > heads["grpo_fast"]["peak_bytes"] + teacher, name
    served = heads["served_distillation"]
    assert served["categories_bytes"]["teacher weights"] == 0  # a served teacher: its top-k only
    assert 0 < served["loss_head_peak_bytes"] < N * V * 2
    K = memory.DEFAULT_RECIPE.teacher_top_k
    assert served["peak_bytes"] >= heads["grpo_fast"]["peak_bytes"] + N * K * (8 + 4)  # ids int64, log-probs fp32
    generation = distillation_report["generation"]
    assert generation["parts_bytes"]["teacher weights"] == teacher  # the teacher stays on the card while generating


def test_models_are_built_once_per_estimate(monkeypatch):
    from grpo_fast.memory import step as step_module

    built = []
    real = step_module.build_model
    monkeypatch.setattr(step_module, "build_model", lambda *a, **k: built.append(k.get("shape")) or real(*a, **k))
    memory.main(TINY + ["--lora-r", "4", "--beta", "0.04", "--heads", "eager,grpo_fast,distillation,rl_distillation"])
    assert len(built) == 2  # the policy once, the teacher once (LoRA's reference is the base model: no copy)


# ----------------------------------------------------------------------------------------------- the printed report
def test_default_output_is_the_table_and_three_lines(lora_report, capsys):
    memory.main(TINY + ["--lora-r", "4", "--heads", "eager,grpo_fast"])
    text = capsys.readouterr().out
    lines = text.splitlines()
    table = [i for i, line in enumerate(lines) if line.startswith("|")]
    assert table == list(range(table[0], table[-1] + 1))  # one table
    after = [line for line in lines[table[-1] + 1 :] if line.strip()]
    assert len(after) == 3, after
    assert after[0].startswith("**RTX 4090 (23.99 GiB): fits with every head.**")
    assert after[2].startswith("--explain: ")
    assert "What is estimated, what is not" not in text
    assert "| the peak falls in | loss head backward |" in text
    assert "| model activations held at the peak |" in text and "| activations |" not in text
    memory.main(TINY + ["--lora-r", "4", "--heads", "eager,grpo_fast", "--explain"])
    explained = capsys.readouterr().out
    assert "What is estimated, what is not" in explained and "--explain: " not in explained
    assert explained.count("\n") > 2 * text.count("\n")
