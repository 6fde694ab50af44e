"""The version lives once (grpo_fast.__version__): pyproject.toml reads it, the CHANGELOG's latest release names it."""

import re
from importlib.metadata import version
from pathlib import Path

import grpo_fast

ROOT = Path(__file__).resolve().parent.parent


def test_pyproject_reads_the_version_from_the_package():
    pyproject = (ROOT / "pyproject.toml").read_text()
    project = pyproject.split("[project]", 1)[1].split("\n[", 1)[0]
    assert re.search(r'^dynamic = \[.*"version".*\]', project, re.M), "pyproject.toml: version must be dynamic"
    assert not re.search(r"^version\s*=", project, re.M), "pyproject.toml: a second, static version"
    assert 'version = { attr = "grpo_fast.__version__" }' in pyproject


def test_installed_metadata_matches_the_package():
    # an editable install writes its metadata when installed: reinstall after changing __version__
    assert version("grpo_fast") == grpo_fast.__version__


def test_changelog_latest_release_is_the_version():
    releases = re.findall(r"^## \[(\d[^\]]*)\]", (ROOT / "CHANGELOG.md").read_text(), re.M)
    assert releases, "CHANGELOG.md has no released section"
    assert releases[0] == grpo_fast.__version__
