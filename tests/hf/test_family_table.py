"""docs/hf.md's table of tiny families x features is what ``benchmarks/family_table.py`` renders from the tests."""

import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")  # without it the HF test modules collect nothing

REPO = str(Path(__file__).resolve().parents[2])  # holds the `benchmarks` package
if REPO not in sys.path:
    sys.path.insert(0, REPO)
from benchmarks import family_table as ft  # noqa: E402

FAMILIES = ["llama", "qwen3", "qwen3_moe", "gpt_oss", "gemma3_text"]


def record(function, params="", file="tests/hf/test_families_features.py", xfail=(), skip=()):
    return {"nodeid": f"{file}::{function}[{params}]", "file": file, "function": function, "params": params,
            "xfail": list(xfail), "skip": list(skip)}


def session_records(request) -> list[dict] | None:
    """The records of this session's own collection, when it collected every one of ``ft.PATHS`` whole (no -k, -m,
    --deselect or test id: a whole-suite run such as ``make test``); None otherwise."""
    config = request.config
    if config.option.keyword or config.option.markexpr or config.getoption("deselect", None):
        return None
    here = config.invocation_params.dir
    roots = [(here / arg).resolve() for arg in config.args if "::" not in arg]
    wanted = [(ft.REPO / path).resolve() for path in ft.PATHS]
    if not all(any(root == path or root in path.parents for root in roots) for path in wanted):
        return None
    records = [r for r in ft.records_of(request.session.items) if ft.in_paths(r)]
    # in the order a collection of ft.PATHS gives (this session collected its folders in the filesystem's order)
    return sorted(records, key=lambda r: next(i for i, path in enumerate(ft.PATHS) if ft.in_paths(r, [path])))


def test_the_docs_table_is_rendered_from_the_collected_tests_and_the_stored_liger_list(request):
    # a whole-suite run has collected these tests already; a run of fewer files collects them afresh
    records = session_records(request) or ft.collect()
    assert {r["file"] for r in records} >= {"tests/hf/test_families_features.py", "tests/estimate/test_step.py"}
    text = ft.DOC.read_text()
    assert ft.replace_region(text, ft.render(records, ft.read_liger())) == text, (
        "docs/hf.md's family table is out of date: run `python -m benchmarks.family_table`")


@pytest.mark.parametrize(("text", "named"), [
    ("test_x qwen3_moe", ["qwen3_moe"]),
    ("test_x False-qwen3", ["qwen3"]),
    ("test_budget_mode_on_qwen3_moe ", ["qwen3_moe"]),
    ("test_x hf_qwen3_moe_qlora", ["qwen3_moe"]),
    ("test_x gpt_oss: eager experts + checkpoint", ["gpt_oss"]),
    ("test_x llama-qwen3-gemma3_text", ["llama", "qwen3", "gemma3_text"]),
    ("test_gemma3_rotary tiny_lm: plain", []),
])
def test_families_are_whole_tokens_longest_first(text, named):
    assert ft.families_named(text, FAMILIES) == named


def test_cells_tested_wins_then_refused_fails_and_na_with_the_reasons_listed():
    records = [
        record("test_qlora_x", "llama"), record("test_qlora_is_refused", "llama"),
        record("test_qlora_is_refused", "qwen3"),
        record("test_qlora_x", "gpt_oss", xfail=["boom: RuntimeError"]),
        record("test_fused_loss_keeps_the_router_aux_loss_x", "qwen3", skip=["n/a: dense (no router)"]),
        record("test_fused_loss_keeps_the_router_aux_loss_x", "llama", skip=["n/a: dense (no router)"]),
        record("test_fused_loss_x", "qwen3_moe", skip=["long run: set MEMKIT_RUN_SLOW=1"]),
        record("test_x", "qwen3", file="tests/hf/test_hf_configs.py"),
    ]
    table, notes = ft.cells(records, FAMILIES)
    assert table == {("llama", "QLoRA"): "tested", ("qwen3", "QLoRA"): "refused", ("gpt_oss", "QLoRA"): "fails",
                     ("qwen3", "router aux loss (fused)"): "n/a", ("llama", "router aux loss (fused)"): "n/a",
                     ("qwen3_moe", "FusedLinearCrossEntropy"): "tested"}
    assert notes == ["- router aux loss (fused), n/a for `llama`, `qwen3`: dense (no router)",
                     "- QLoRA, refused for `qwen3`: `tests/hf/test_families_features.py::test_qlora_is_refused`",
                     "- QLoRA, fails for `gpt_oss`: boom: RuntimeError"]
    lines = ft.render(records, {"liger_kernel": "0.0", "source": "x", "model_types": ["llama", "bert"]}, FAMILIES)
    assert "| `llama` | — | — | n/a | tested | — | — | — | — | — | — | yes |" in lines
    assert lines[-1] == "Liger-Kernel 0.0 also patches 1 model types with no tiny model here: `bert`."


def test_a_test_file_without_a_column_is_named():
    with pytest.raises(ValueError, match=r"tests/hf/test_new.py::test_x\[\]: no column .* RULES or the file to "
                                         "UNMAPPED"):
        ft.cells([record("test_x", file="tests/hf/test_new.py")], FAMILIES)


def test_the_region_is_replaced_between_its_markers_only():
    text = f"a\n{ft.START}\nold\n{ft.END}\nb\n"
    assert ft.replace_region(text, ["new"]) == f"a\n{ft.START}\n\nnew\n\n{ft.END}\nb\n"
    with pytest.raises(ValueError, match="expected one"):
        ft.replace_region("a\n", ["new"])


@pytest.mark.slow  # importing liger_kernel takes seconds; CI has none installed
def test_the_stored_liger_list_is_the_installed_one():
    pytest.importorskip("liger_kernel")
    stored = ft.read_liger()
    assert stored == ft.liger_from_installed(), "run `python -m benchmarks.family_table --liger`"


@pytest.mark.slow
def test_this_sessions_collection_gives_the_records_of_a_fresh_one(request):
    here = session_records(request)
    if here is None:
        pytest.skip("this session did not collect every one of benchmarks.family_table.PATHS")
    assert here == ft.collect()
