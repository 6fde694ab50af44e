#!/usr/bin/env python
"""pip install -e ".[EXTRAS]" with the torch build for this machine: the README's install step, on a CPU or a GPU.

    python tools/install.py train          # the GSM8K example's extra (README command 1)
    python tools/install.py test           # the tests' (README command 2); several: train,trl
    python tools/install.py --dry-run      # print the pip commands, run nothing

pip's default torch wheel on Linux is a CUDA build of several GB, which a machine without an NVIDIA GPU never uses.
Where no NVIDIA GPU answers (``nvidia-smi -L``), torch comes first from PyTorch's CPU wheel index, in the range that
grpo_fast declares (``pyproject.toml``); a torch already installed in that range stays as it is (pip then changes
nothing and needs no network). With an NVIDIA GPU pip installs its default (CUDA) torch with the package, as
``pip install -e .`` does. ``--torch cpu`` or ``--torch default`` overrides the detection. Standard library only:
it runs before torch is there.
"""

from __future__ import annotations

import argparse
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def torch_requirement(pyproject: Path = ROOT / "pyproject.toml") -> str:
    """The torch requirement of grpo_fast's dependencies, as pyproject.toml declares it (e.g. "torch>=2.11,<2.14")."""
    found = re.search(r'^\s*"(torch[<>=!~][^"]*)"', pyproject.read_text(), re.MULTILINE)
    if found is None:
        raise SystemExit(f"install.py: no torch requirement in {pyproject}")
    return found.group(1)


def has_nvidia_gpu() -> bool:
    """Whether ``nvidia-smi -L`` lists a GPU (False without the driver's tool)."""
    tool = shutil.which("nvidia-smi")
    if tool is None:
        return False
    try:
        listed = subprocess.run([tool, "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return False
    return listed.returncode == 0 and "GPU" in listed.stdout


def pip_commands(extras: str, cpu: bool, python: str = sys.executable) -> list[list[str]]:
    """The pip commands that install grpo_fast (``extras``: "train", "train,trl", "" for none) for a CPU machine
    (``cpu``: the CPU torch wheel first) or a GPU one."""
    pip = [python, "-m", "pip", "install"]
    target = f"{ROOT}[{extras}]" if extras else str(ROOT)
    commands = [[*pip, torch_requirement(), "--index-url", CPU_INDEX]] if cpu else []
    return [*commands, [*pip, "-e", target]]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("extras", nargs="?", default="", help="pyproject.toml extras, comma-separated (default: none)")
    p.add_argument(
        "--torch",
        choices=["auto", "cpu", "default"],
        default="auto",
        help="auto: the CPU wheel where no NVIDIA GPU answers, pip's default elsewhere",
    )
    p.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    args = p.parse_args(argv)
    cpu = args.torch == "cpu" or (args.torch == "auto" and not has_nvidia_gpu())
    print(
        "install.py: "
        + (f"no NVIDIA GPU here: torch from {CPU_INDEX}" if cpu else "torch from pip's default index (CUDA builds)")
        + (" (--torch)" if args.torch != "auto" else ""),
        flush=True,
    )
    for command in pip_commands(args.extras, cpu):
        print("$ " + shlex.join(command), flush=True)
        if not args.dry_run:
            done = subprocess.run(command)
            if done.returncode != 0:
                return done.returncode
    return 0


if __name__ == "__main__":
    sys.exit(main())
