"""The README as a product page, and the repository links in the READMEs: every relative link names a file or folder
that exists (the documentation site checks its own links: `mkdocs build --strict`)."""

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


@pytest.mark.parametrize("readme", ["README.md", "examples/README.md", "bench/README.md"])
def test_relative_links_resolve(readme):
    path = ROOT / readme
    missing = [
        target
        for target in LINK.findall(path.read_text())
        if "://" not in target and not (path.parent / target).exists()
    ]
    assert not missing, f"{readme}: links to missing paths {missing}"


def test_readme_calls_the_loss_early():
    lines = (ROOT / "README.md").read_text().splitlines()
    first_call = next(i for i, line in enumerate(lines, 1) if "grpo_fast.loss(" in line)
    assert first_call <= 60, f"the first grpo_fast.loss( call is on line {first_call}"
    assert 150 <= len(lines) <= 250, f"README.md has {len(lines)} lines"


# how a GPU run was obtained (a machine's loan, its calls and their limits) is not the project's business
NOT_THE_PROJECTS_WORDS = re.compile(
    r"\bleases?\b|\blent (GPU|CUDA|machine)|device (tool|calls?|time)|budget_left|gpu_lease", re.IGNORECASE
)


def test_tracked_files_speak_of_the_project_only():
    """The docs, tools and results say what ran and what it found, never how the machine was obtained."""
    if not (ROOT / ".git").exists() or shutil.which("git") is None:
        pytest.skip("not a git checkout")
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True, check=True)
    hits = []
    for name in files.stdout.split("\0"):
        path = ROOT / name
        if not name or path == Path(__file__) or not path.is_file() or path.suffix in (".png", ".gz", ".gguf"):
            continue
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if NOT_THE_PROJECTS_WORDS.search(line):
                hits.append(f"{name}:{number}: {line.strip()[:100]}")
    assert not hits, "words about how a GPU was obtained:\n" + "\n".join(hits)
