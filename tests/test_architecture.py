"""The package's layout rules, read from its own imports (AST): see docs/architecture.md.

- no import circle between modules (imports inside functions count too);
- no module imports another module's ``_private`` name;
- nothing imports ``lightning_memkit.cli`` (the ``memkit`` command sits on top) but ``cli`` itself;
- the core folders never import Lightning.
"""

from __future__ import annotations

import ast
import functools
from collections import defaultdict
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "lightning_memkit"
CORE = ("ops", "measure", "release", "recompute", "loading", "pipeline", "memory", "common", "offload", "optim",
        "sharding")
FOLDERS = ("callbacks", "cli", "common", "config", "demo", "estimate", "finetune", "hf", "loading", "measure", "memory",
           "offload", "optim", "ops", "pipeline", "plugins", "recompute", "release", "sharding", "strategies")


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@functools.cache
def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports(name: str, path: Path, known: set[str]) -> list[tuple[str, str | None, int]]:
    """``(module, imported name or None, line)`` of every import of ``path``, relative ones resolved."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(a.name, None, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, *([node.module] if node.module else [])])
            for a in node.names:
                sub = f"{base}.{a.name}"
                found.append((sub, None, node.lineno) if sub in known else (base, a.name, node.lineno))
    return found


@functools.cache
def all_imports() -> dict[str, list[tuple[str, str | None, int]]]:
    """Module -> its :func:`imports` (each file parsed once for all the tests here)."""
    mods = modules()
    return {name: imports(name, path, set(mods)) for name, path in mods.items()}


@functools.cache
def graph() -> tuple[dict[str, set[str]], list[str]]:
    """Module -> the package's modules it imports; and every import of another module's private name."""
    mods = modules()
    edges: dict[str, set[str]] = defaultdict(set)
    private = []
    for name, path in mods.items():
        for target, imported, line in all_imports()[name]:
            if target in mods and target != name:
                edges[name].add(target)
                if imported and imported.startswith("_") and not imported.startswith("__"):
                    private.append(f"{path.relative_to(PACKAGE.parent)}:{line}: {imported} from {target}")
    return edges, private


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_no_import_circle():
    assert cycles(graph()[0]) == []


def test_the_circle_finder_finds_one():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_module_imports_another_modules_private_name():
    assert graph()[1] == []


def test_nothing_but_the_command_imports_cli():
    edges, _ = graph()
    offenders = sorted(f"{m} -> {t}" for m, targets in edges.items() if not m.startswith("lightning_memkit.cli")
                       for t in targets if t.startswith("lightning_memkit.cli"))
    assert offenders == []


@pytest.mark.parametrize("folder", CORE)
def test_the_core_never_imports_lightning(folder):
    offenders = [f"{path.relative_to(PACKAGE.parent)}:{line}: {target}"
                 for name, path in modules().items() if name.startswith(f"lightning_memkit.{folder}")
                 for target, _, line in all_imports()[name]
                 if target.split(".")[0] in ("lightning", "pytorch_lightning")]
    assert offenders == []


def test_every_folder_states_its_idea_and_is_named_in_the_architecture_page():
    page = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    folders = sorted(p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file())
    assert folders == sorted(FOLDERS)
    for folder in folders:
        doc = ast.get_docstring(ast.parse((PACKAGE / folder / "__init__.py").read_text()))
        assert doc and len(doc) > 40, f"lightning_memkit/{folder}/__init__.py states no idea"
        assert f"`{folder}/`" in page, f"docs/architecture.md does not name {folder}/"
    assert not [p.name for p in PACKAGE.glob("*.py") if p.name != "__init__.py"]  # nothing loose at the top


def allowed_imports() -> dict[str, set[str]]:
    """The table of docs/architecture.md: folder -> the folders it may import."""
    page = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    rows = [line.split("|")[1:3] for line in page.splitlines() if line.startswith("| `")]
    return {cell.strip().strip("`/"): {f.strip() for f in allowed.split(",") if f.strip()} for cell, allowed in rows}


def test_folders_import_only_what_the_architecture_page_allows():
    edges, _ = graph()
    allowed = allowed_imports()
    assert sorted(allowed) == sorted(FOLDERS)
    found = sorted(f"{m} -> {t}" for m, targets in edges.items() for t in targets
                   if m.count(".") >= 1 and t.count(".") >= 1 and m.split(".")[1] != t.split(".")[1]
                   and t.split(".")[1] not in allowed[m.split(".")[1]])
    assert found == []
