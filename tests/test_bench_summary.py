"""bench.summary: the README's picture and table come from committed results files, and the committed table is the
one the command writes from them."""

from pathlib import Path

from bench import summary


def test_every_panel_has_its_numbers():
    table = summary.rows()
    assert {r["panel"] for r in table} == {p.title for p in summary.PANELS}
    for r in table:
        assert r["ms"] > 0 and r["mib"] > 0 and r["error"] > 0, r
        assert Path(summary.RESULTS.parent.parent, r["file"]).is_file()


def test_committed_table_is_regenerated(tmp_path):
    summary.main(["--out", str(tmp_path), "--no-plot"])
    committed = (summary.RESULTS / "summary.md").read_text()
    assert (tmp_path / "summary.md").read_text() == committed, "run `python -m bench.summary` and commit its output"
