"""The Python blocks of the docs pages listed here run as written (in a scratch directory).

A block right after an HTML comment ``<!-- not run: reason -->`` is skipped (several processes, a GPU).
"""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = ["docs/hf.md", "docs/nosave_bitsandbytes.md", "docs/mxfp4_loading.md", "docs/report.md"]
BLOCK = re.compile(r"(<!-- not run: [^>]*-->\s*)?```python\n(.*?)```", re.S)


def blocks(page: str) -> list[tuple[str, str]]:
    text = (ROOT / page).read_text()
    out = []
    for match in BLOCK.finditer(text):
        line = text[: match.start(2)].count("\n") + 1
        if match.group(1) is None:
            out.append((f"{page}:{line}", match.group(2)))
    return out


CASES = [case for page in PAGES for case in blocks(page)]


def test_pages_have_blocks():
    assert all(any(case[0].startswith(page) for case in CASES) for page in PAGES)


@pytest.mark.parametrize("where,code", CASES, ids=[c[0] for c in CASES])
def test_block_runs(where, code, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    exec(compile(code, where, "exec"), {"__name__": "__docs__"})
