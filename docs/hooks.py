"""mkdocs hook: the committed benchmark plots, served from bench/results/ without a copy in docs/."""

from pathlib import Path

from mkdocs.structure.files import File

RESULTS = Path(__file__).resolve().parent.parent / "bench"


def on_files(files, config):
    for png in sorted((RESULTS / "results").glob("*.png")):
        files.append(File(f"results/{png.name}", str(RESULTS), config["site_dir"], config["use_directory_urls"]))
    return files
