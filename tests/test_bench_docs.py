"""The benchmark figures in the docs are generated from ``benchmarks/results/*.json`` and match them."""

import json
import sys
import types
from pathlib import Path

import pytest

REPO = str(Path(__file__).resolve().parents[1])  # holds the `benchmarks` package
if REPO not in sys.path:
    sys.path.insert(0, REPO)
from benchmarks import run  # noqa: E402
from benchmarks.common import record  # noqa: E402

FEATURE_PAGES = sorted(p for p in run.DOCS.glob("*.md") if p.name != run.DOC.name)


def regions(text: str) -> list[tuple[str, str]]:
    """(result file stem, selector) of every region opened in ``text``."""
    found = []
    for line in text.split("\n"):
        m = run.OPEN.fullmatch(line.strip())
        if m:
            found.append((m["key"], m["selector"] or ""))
    return found


def test_benchmark_page_is_rendered_from_the_results():
    assert run.DOC.read_text() == run.render()


@pytest.mark.parametrize("page", FEATURE_PAGES, ids=[p.name for p in FEATURE_PAGES])
def test_feature_page_regions_match_the_results(page):
    text = page.read_text()
    assert run.render_regions(text, where=page.name) == text, (
        f"{page.name} is out of date: run `python -m benchmarks.run --render-only`")


def test_every_result_file_and_unfavourable_entry_is_on_a_feature_page():
    shown = [r for page in FEATURE_PAGES for r in regions(page.read_text())]
    for path in sorted(run.RESULTS.glob("*.json")):
        assert any(key == path.stem for key, _ in shown), f"{path.name} is on no feature page"
        for e in json.loads(path.read_text())["entries"]:
            if e.get("met") is False:
                title = f"{e['benchmark']}: {e['case']}"
                assert any(key == path.stem and sel in title for key, sel in shown), (
                    f"{path.name}: unfavourable entry {title!r} is on no feature page")


@pytest.fixture
def results(tmp_path):
    d = tmp_path / "results"
    d.mkdir()
    rows = [{"impl": "base", "bytes": 2048, "ratio": 1.0}, {"impl": "ours", "bytes": 1024, "ratio": 0.5}]
    payload = {
        "name": "toy", "device": "cpu", "machine": "CPU test", "date": "2026-01-02",
        "command": "python -m benchmarks.run --only toy --device cpu",
        "entries": [record("toy", "small case", "base", rows, goal="half", met=True),
                    record("toy", "large case", "base", rows[:1], goal="", met=None)],
    }
    (d / "toy-cpu.json").write_text(json.dumps(payload))
    return d


def test_region_is_rendered_from_its_result_file(results):
    text = "intro\n<!-- bench: toy-cpu small -->\nstale 1.23x\n<!-- /bench -->\nafter\n"
    assert run.render_regions(text, results) == (
        "intro\n"
        "<!-- bench: toy-cpu small -->\n"
        "\n"
        f"*Generated from `{results / 'toy-cpu.json'}` by `python -m benchmarks.run --render-only`; do not edit.*\n"
        "Machine: CPU test; date: 2026-01-02.\n"
        "Reproduce: `python -m benchmarks.run --only toy --device cpu`.\n"
        "\n"
        "**toy: small case**\n"
        "\n"
        "Baseline: base.\n"
        "\n"
        "| impl | bytes | ratio |\n"
        "| --- | --- | --- |\n"
        "| base | 2,048 | 1 |\n"
        "| ours | 1,024 | 0.5 |\n"
        "\n"
        "Goal: half -> **met**.\n"
        "\n"
        "<!-- /bench -->\n"
        "after\n"
    )


def test_region_without_selector_shows_every_entry(results):
    out = run.render_regions("<!-- bench: toy-cpu -->\n<!-- /bench -->", results)
    assert "**toy: small case**" in out and "**toy: large case**" in out
    assert out.endswith("| base | 2,048 | 1 |\n\n<!-- /bench -->")


def test_an_entry_s_verbatim_text_is_a_code_block_after_its_table(results):
    payload = json.loads((results / "toy-cpu.json").read_text())
    payload["entries"][0]["text"] = "trainer:\n  precision: bf16-true\n"
    (results / "toy-cpu.json").write_text(json.dumps(payload))
    out = run.render_regions("<!-- bench: toy-cpu small -->\n<!-- /bench -->", results)
    assert "| ours | 1,024 | 0.5 |\n\n```\ntrainer:\n  precision: bf16-true\n```\n\nGoal: half -> **met**." in out


def test_region_naming_a_missing_result_file(results):
    with pytest.raises(run.RegionError, match=r"^page\.md:2: no result file .*toy-cuda\.json for region "
                                              r"'toy-cuda'; available: \['toy-cpu'\]$"):
        run.render_regions("x\n<!-- bench: toy-cuda -->\n<!-- /bench -->\n", results, where="page.md")


def test_region_whose_selector_matches_nothing(results):
    with pytest.raises(run.RegionError, match=r"^page\.md:1: no entry of .*toy-cpu\.json contains 'medium'; "
                                              r"entries: \['toy: small case', 'toy: large case'\]$"):
        run.render_regions("<!-- bench: toy-cpu medium -->\n<!-- /bench -->\n", results, where="page.md")


def test_unclosed_region(results):
    with pytest.raises(run.RegionError, match=r"^page\.md:2: region 'toy-cpu' is not closed by <!-- /bench -->$"):
        run.render_regions("a\n<!-- bench: toy-cpu -->\nb\n", results, where="page.md")
    with pytest.raises(run.RegionError, match=r"^page\.md:1: region 'toy-cpu' is not closed by <!-- /bench --> "
                                              r"before line 3$"):
        run.render_regions("<!-- bench: toy-cpu -->\n\n<!-- bench: toy-cpu -->\n<!-- /bench -->\n", results,
                           where="page.md")


def test_closing_marker_without_region_and_malformed_marker(results):
    with pytest.raises(run.RegionError, match=r"^page\.md:2: <!-- /bench --> without an open region$"):
        run.render_regions("a\n<!-- /bench -->\n", results, where="page.md")
    with pytest.raises(run.RegionError, match=r"^page\.md:1: malformed marker '<!-- bench:toy-cpu -->'"):
        run.render_regions("<!-- bench:toy-cpu -->\n<!-- /bench -->\n", results, where="page.md")


def test_markers_in_code_blocks_are_left_alone(results):
    text = "```\n<!-- bench: nowhere-cpu -->\n```\n"
    assert run.render_regions(text, results) == text


def test_update_pages_writes_nothing_when_a_page_fails(tmp_path, results):
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.md").write_text("<!-- bench: toy-cpu -->\nstale\n<!-- /bench -->\n")
    (docs / "b.md").write_text("<!-- bench: gone-cpu -->\n<!-- /bench -->\n")
    (docs / "benchmarks.md").write_text("<!-- bench: gone-cpu -->\n")
    with pytest.raises(run.RegionError, match=r"b\.md:1: no result file"):
        run.update_pages(docs, results)
    assert (docs / "a.md").read_text() == "<!-- bench: toy-cpu -->\nstale\n<!-- /bench -->\n"
    (docs / "b.md").write_text("no regions\n")
    assert run.update_pages(docs, results) == [docs / "a.md"]
    assert "| ours | 1,024 | 0.5 |" in (docs / "a.md").read_text()
    assert (docs / "benchmarks.md").read_text() == "<!-- bench: gone-cpu -->\n"


@pytest.fixture
def fake_tree(tmp_path, monkeypatch, results):
    """A fake ``bench_fake`` module and a results/docs tree in ``tmp_path`` standing in for the committed one."""
    mod = types.ModuleType("benchmarks.bench_fake")
    mod.run = lambda device, quick: [record("fake", f"quick={quick}", "a", [{"impl": "a", "bytes": 1}])]
    monkeypatch.setitem(sys.modules, "benchmarks.bench_fake", mod)
    monkeypatch.setattr(run, "available", lambda: ["fake"])
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "feature.md").write_text("<!-- bench: toy-cpu -->\nstale\n<!-- /bench -->\n")
    (docs / "benchmarks.md").write_text("stale\n")
    monkeypatch.setattr(run, "RESULTS", results)
    monkeypatch.setattr(run, "DOCS", docs)
    monkeypatch.setattr(run, "DOC", docs / "benchmarks.md")
    monkeypatch.setattr(run, "QUICK_OUT", tmp_path / "quick")
    return tmp_path


def snapshot(*dirs):
    return {p: p.read_bytes() for d in dirs for p in sorted(d.rglob("*")) if p.is_file()}


def test_quick_writes_only_to_the_scratch_directory(fake_tree, capsys):
    before = snapshot(fake_tree / "results", fake_tree / "docs")
    run.main(["--quick", "--only", "fake"])
    assert snapshot(fake_tree / "results", fake_tree / "docs") == before
    data = json.loads((fake_tree / "quick" / "fake-cpu.json").read_text())
    assert data["command"] == "python -m benchmarks.run --only fake --device cpu --quick"
    assert [e["case"] for e in data["entries"]] == ["quick=True"]
    page = (fake_tree / "quick" / "benchmarks.md").read_text()
    assert "## fake (cpu)" in page and "## toy" not in page
    assert f"[bench] wrote {fake_tree / 'quick' / 'benchmarks.md'}" in capsys.readouterr().out


def test_out_without_quick_writes_there(fake_tree):
    before = snapshot(fake_tree / "results", fake_tree / "docs")
    run.main(["--only", "fake", "--out", str(fake_tree / "elsewhere")])
    assert snapshot(fake_tree / "results", fake_tree / "docs") == before
    data = json.loads((fake_tree / "elsewhere" / "fake-cpu.json").read_text())
    assert data["command"] == "python -m benchmarks.run --only fake --device cpu"
    assert [e["case"] for e in data["entries"]] == ["quick=False"]
    assert not (fake_tree / "quick").exists()


def test_full_run_writes_results_and_regenerates_the_pages(fake_tree):
    run.main(["--only", "fake"])
    data = json.loads((fake_tree / "results" / "fake-cpu.json").read_text())
    assert [e["case"] for e in data["entries"]] == ["quick=False"]
    assert (fake_tree / "docs" / "benchmarks.md").read_text() == run.render(fake_tree / "results")
    feature = (fake_tree / "docs" / "feature.md").read_text()
    assert "stale" not in feature and "**toy: small case**" in feature


def test_default_quick_directory_is_ignored_scratch():
    assert run.QUICK_OUT == run.REPO / "runs" / "bench-quick"
    assert "/runs/" in (run.REPO / ".gitignore").read_text().split()


def test_render_only_with_a_broken_region_exits_with_the_error(fake_tree):
    page = fake_tree / "docs" / "feature.md"
    page.write_text("<!-- bench: toy-cpu -->\n")
    with pytest.raises(SystemExit) as exc:
        run.main(["--render-only"])
    assert str(exc.value) == f"[bench] {page}:1: region 'toy-cpu' is not closed by <!-- /bench -->"
