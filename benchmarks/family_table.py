"""The table of tiny transformers families x memkit features in ``docs/hf.md``, generated from the tests' own ids.

    python -m benchmarks.family_table            # collect the tests, rewrite the table region of docs/hf.md
    python -m benchmarks.family_table --liger    # first reread Liger-Kernel's patched model types (needs liger_kernel)
    python -m benchmarks.family_table --check    # exit 1 when docs/hf.md is out of date
    python -m benchmarks.family_table --print    # the region's lines on stdout, nothing written

The test ids come from ``pytest --collect-only`` of :data:`PATHS` in a subprocess (slow and CUDA tests are
collected too), with this module as a pytest plugin that also reads each test's ``xfail`` and ``skip`` marks.
Each test file, or function within it, belongs to one feature column (:data:`RULES`); each id names families
where a whole token of its function name or of its parameter ids is a member of ``TINY_HF_FAMILIES``
(``qwen3`` and ``qwen3_moe`` are told apart, ``hf_qwen3_moe_qlora`` names ``qwen3_moe``). A cell is:

- ``tested``: a test of that column names the family;
- ``refused``: only tests asserting a refusal (``refuse`` in the function name) name it;
- ``fails``: only ``xfail`` tests name it;
- ``n/a``: only tests skipped with a reason starting ``n/a:`` name it (the feature does not exist there);
- ``—``: no test of that column names it.

The refusing tests and the reasons of the ``fails`` and ``n/a`` cells are listed under the table.

The Liger-Kernel column is the key set of ``liger_kernel.transformers.monkey_patch.MODEL_TYPE_TO_APPLY_LIGER_FN``,
stored in :data:`LIGER_JSON` by ``--liger`` so that the table renders where Liger-Kernel is not installed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "hf.md"
LIGER_JSON = REPO / "benchmarks" / "liger_families.json"
PATHS = ("tests/hf", "tests/estimate/test_step.py", "tests/callbacks/test_memory_budget.py")
START, END = "<!-- family-table:start -->", "<!-- family-table:end -->"
LIGER_SOURCE = "liger_kernel.transformers.monkey_patch.MODEL_TYPE_TO_APPLY_LIGER_FN"
_OUT_ENV = "MEMKIT_FAMILY_TABLE_OUT"  # where the plugin writes the collected items (set by collect())

COLUMNS = ("ActivationCheckpointing", "FusedLinearCrossEntropy", "router aux loss (fused)", "QLoRA",
           "monitor / profiler / release", "memkit estimate", "MemoryBudget", "memkit_pipeline", "peft",
           "torch.compile")
#: (test file, function-name prefix, column): the first rule that matches a test decides its column
RULES = (
    ("tests/hf/test_families_features.py", "test_activation_checkpointing_", "ActivationCheckpointing"),
    ("tests/hf/test_families_features.py", "test_fused_loss_keeps_the_router_aux_loss", "router aux loss (fused)"),
    ("tests/hf/test_families_features.py", "test_fused_loss_refuses_output_router_logits", "router aux loss (fused)"),
    ("tests/hf/test_families_features.py", "test_fused_loss_", "FusedLinearCrossEntropy"),
    ("tests/hf/test_families_features.py", "test_qlora_", "QLoRA"),
    ("tests/hf/test_families_features.py", "test_estimate_", "memkit estimate"),
    ("tests/hf/test_families_features.py", "test_monitor_", "monitor / profiler / release"),
    ("tests/hf/test_activation_checkpointing_hf.py", "", "ActivationCheckpointing"),
    ("tests/hf/test_fused_loss_hf.py", "", "FusedLinearCrossEntropy"),
    ("tests/hf/test_qlora_hf.py", "", "QLoRA"),
    ("tests/hf/test_features_hf.py", "", "monitor / profiler / release"),
    ("tests/estimate/test_step.py", "", "memkit estimate"),
    ("tests/callbacks/test_memory_budget.py", "", "MemoryBudget"),
    ("tests/hf/test_pipeline_families.py", "", "memkit_pipeline"),
    ("tests/hf/test_pipeline_hf.py", "", "memkit_pipeline"),
    ("tests/hf/test_peft.py", "", "peft"),
    ("tests/hf/test_compile_hf.py", "", "torch.compile"),
)
#: collected files on purpose in no column, and why
UNMAPPED = {
    "tests/hf/test_hf_configs.py": "the example configs combine several features",
    "tests/hf/test_mxfp4_hf.py": "MXFP4 checkpoints exist for GPT-OSS only; its ids name no family",
    "tests/hf/test_family_table.py": "this table",
}
TESTED, REFUSED, FAILS, NA, NONE = "tested", "refused", "fails", "n/a", "—"


# -- collection ---------------------------------------------------------------------------------------------------
def records_of(items: Iterable) -> list[dict]:
    """Each collected test function of ``items`` (pytest items) as a record: id, file, function, params, marks."""
    records = []
    for item in items:
        function = getattr(item, "originalname", None)
        if function is None:  # not a test function (a doctest, say)
            continue
        callspec = getattr(item, "callspec", None)
        records.append({
            "nodeid": item.nodeid,
            "file": Path(str(item.path)).resolve().relative_to(REPO).as_posix(),
            "function": function,
            "params": callspec.id if callspec is not None else "",
            "xfail": [str(m.kwargs.get("reason", "")) for m in item.iter_markers("xfail")],
            "skip": [str(m.kwargs.get("reason", m.args[0] if m.args else "")) for m in item.iter_markers("skip")],
        })
    return records


def in_paths(record: dict, paths: Iterable[str] = PATHS) -> bool:
    """Whether ``record``'s file is one of ``paths`` (files or folders, relative to the repository)."""
    return any(record["file"] == p or record["file"].startswith(p.rstrip("/") + "/") for p in paths)


def pytest_collection_finish(session) -> None:
    """Plugin hook (``-p benchmarks.family_table``): write every collected test with its marks to ``$_OUT_ENV``."""
    out = os.environ.get(_OUT_ENV)
    if out:
        Path(out).write_text(json.dumps(records_of(session.items), indent=1))


def collect(paths: Iterable[str] = PATHS, timeout: float = 300) -> list[dict]:
    """Every test ``pytest --collect-only`` finds under ``paths`` (run from the repository root, in a subprocess)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "items.json"
        # the same ids as with the project's options (--doctest-modules finds no example in a test file), sooner
        cmd = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-p",
               "no:hypothesispytest", "-o", "addopts=", "-p", "benchmarks.family_table", *paths]
        env = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"} | {_OUT_ENV: str(out)}
        done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
        if done.returncode != 0 or not out.exists():
            raise RuntimeError(f"{' '.join(cmd[1:])} exited with {done.returncode}:\n{done.stdout[-3000:]}"
                               f"\n{done.stderr[-3000:]}")
        return json.loads(out.read_text())


# -- the table ----------------------------------------------------------------------------------------------------
def families_named(text: str, families: Iterable[str]) -> list[str]:
    """The families named in ``text`` by whole tokens, longest first (``qwen3_moe`` is not also ``qwen3``)."""
    parts_of = sorted((tuple(f.split("_")) for f in families), key=len, reverse=True)
    found: list[str] = []
    for word in re.findall(r"[A-Za-z0-9_]+", text.lower()):
        parts, i = word.split("_"), 0
        while i < len(parts):
            match = next((p for p in parts_of if tuple(parts[i:i + len(p)]) == p), None)
            if match is None:
                i += 1
                continue
            name = "_".join(match)
            if name not in found:
                found.append(name)
            i += len(match)
    return found


def column_of(record: dict) -> str | None:
    """The column of a collected test; ``None`` for a file of :data:`UNMAPPED`. Raises for an unknown file."""
    for file, prefix, column in RULES:
        if record["file"] == file and record["function"].startswith(prefix):
            return column
    if record["file"] in UNMAPPED:
        return None
    raise ValueError(f"{record['nodeid']}: no column for {record['file']}::{record['function']}; add a rule to "
                     "RULES or the file to UNMAPPED in benchmarks/family_table.py")


def status_of(record: dict) -> str:
    if any(reason.startswith("n/a") for reason in record["skip"]):
        return NA
    if record["xfail"]:
        return FAILS
    return REFUSED if "refuse" in record["function"] else TESTED


def cells(records: list[dict], families: Iterable[str]) -> tuple[dict, list[str]]:
    """``{(family, column): cell}`` and the notes under the table: why each ``refused``, ``fails`` or ``n/a`` cell
    is so (the refusing tests, the ``xfail`` and ``n/a`` reasons)."""
    families = list(families)
    seen: dict[tuple[str, str], set[str]] = {}
    reasons: dict[tuple[str, str], dict[str, list[str]]] = {}  # (family, column) -> status -> reasons
    for record in records:
        column = column_of(record)
        if column is None:
            continue
        status = status_of(record)
        why = {FAILS: record["xfail"], NA: [r for r in record["skip"] if r.startswith(NA)],
               REFUSED: [f"`{record['file']}::{record['function']}`"]}.get(status, [])
        for family in families_named(f"{record['function']} {record['params']}", families):
            seen.setdefault((family, column), set()).add(status)
            reasons.setdefault((family, column), {}).setdefault(status, []).extend(why)
    table = {key: next(s for s in (TESTED, REFUSED, FAILS, NA) if s in statuses) for key, statuses in seen.items()}
    grouped: dict[tuple[str, str, str], list[str]] = {}  # (column, status, reason) -> families, in table order
    for family in families:
        for column in COLUMNS:
            status = table.get((family, column))
            if status in (REFUSED, FAILS, NA):
                for reason in dict.fromkeys(reasons[(family, column)][status]) or [status]:
                    grouped.setdefault((column, status, reason.removeprefix(f"{NA}: ")), []).append(family)
    notes = [f"- {column}, {status} for {', '.join(f'`{f}`' for f in names)}: {reason}"
             for (column, status, reason), names in grouped.items()]
    return table, notes


def read_liger(path: Path = LIGER_JSON) -> dict:
    return json.loads(path.read_text())


def liger_from_installed() -> dict:
    """Liger-Kernel's patched model types, from the installed ``liger_kernel``."""
    from importlib.metadata import version

    from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN

    return {"source": LIGER_SOURCE, "liger_kernel": version("liger_kernel"),
            "command": "python -m benchmarks.family_table --liger",
            "model_types": sorted(MODEL_TYPE_TO_APPLY_LIGER_FN)}


def render(records: list[dict], liger: dict, families: Iterable[str] | None = None) -> list[str]:
    """The lines between the markers: one line saying what the table is, the table, what Liger-Kernel adds."""
    if families is None:
        from lightning_memkit.demo.hf_models import TINY_HF_FAMILIES as families
    families = list(families)
    table, notes = cells(records, families)
    patched = set(liger["model_types"])
    lines = [
        "Generated by `python -m benchmarks.family_table` from the test ids `pytest --collect-only` lists for "
        f"{', '.join(f'`{p}`' for p in PATHS)} (slow and CUDA tests included): *tested* where a test of the "
        "feature names the family in its id, *refused* where such tests only assert a refusal, *n/a* where the "
        "feature does not exist for the family, — where no test names it. Liger-Kernel column: the model types "
        f"Liger-Kernel {liger['liger_kernel']} patches (`{liger['source']}`, reread with `--liger`).",
        "",
        "| family | " + " | ".join(COLUMNS) + " | Liger-Kernel patches |",
        "| --- " * (len(COLUMNS) + 2) + "|",
    ]
    for family in families:
        row = [table.get((family, column), NONE) for column in COLUMNS]
        lines.append(f"| `{family}` | " + " | ".join(row) + f" | {'yes' if family in patched else NONE} |")
    lines.append("")
    lines += notes + ([""] if notes else [])
    others = sorted(patched - set(families))
    lines.append(f"Liger-Kernel {liger['liger_kernel']} also patches {len(others)} model types with no tiny model "
                 f"here: {', '.join(f'`{m}`' for m in others)}.")
    return lines


def replace_region(text: str, body: list[str], where: str = "docs/hf.md") -> str:
    lines = text.split("\n")
    starts = [i for i, line in enumerate(lines) if line.strip() == START]
    ends = [i for i, line in enumerate(lines) if line.strip() == END]
    if len(starts) != 1 or len(ends) != 1 or ends[0] < starts[0]:
        raise ValueError(f"{where}: expected one {START} line followed by one {END} line; found {len(starts)} "
                         f"and {len(ends)}")
    return "\n".join([*lines[:starts[0] + 1], "", *body, "", *lines[ends[0]:]])


def region(text: str) -> list[str]:
    """The lines strictly between the markers of ``text``."""
    lines = text.split("\n")
    return lines[lines.index(START) + 1:lines.index(END)]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--liger", action="store_true", help=f"rewrite {LIGER_JSON.name} from the installed liger_kernel")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true", help="exit 1 when docs/hf.md is out of date; write nothing")
    mode.add_argument("--print", action="store_true", help="print the region's lines; write nothing")
    args = p.parse_args(argv)
    if args.liger:
        if args.check or args.print:
            raise SystemExit("--liger writes its file: not with --check or --print")
        LIGER_JSON.write_text(json.dumps(liger_from_installed(), indent=2) + "\n")
        print(f"[family-table] wrote {LIGER_JSON.relative_to(REPO)}")
    body = render(collect(), read_liger())
    if args.print:
        print("\n".join(body))
        return
    text = DOC.read_text()
    new = replace_region(text, body)
    if args.check:
        if new != text:
            raise SystemExit("[family-table] docs/hf.md is out of date: run `python -m benchmarks.family_table`")
        print("[family-table] docs/hf.md is up to date")
        return
    if new != text:
        DOC.write_text(new)
        print(f"[family-table] wrote {DOC.relative_to(REPO)}")
    else:
        print("[family-table] docs/hf.md is up to date")


if __name__ == "__main__":
    main()
