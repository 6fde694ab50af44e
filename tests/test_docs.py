"""The README as a product page, and the repository links in the READMEs: every relative link names a file or folder
that exists (the documentation site checks its own links: `mkdocs build --strict`)."""

import re
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
