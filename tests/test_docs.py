"""Every ```python block of README.md and docs/*.md runs as written (a new page is covered automatically).

An HTML comment right before a block says how it runs:

- no comment: the block runs in this process, in a scratch directory (where ``examples/`` links to the
  checkout's, so ``examples/configs/...`` paths work as from the repository root). The blocks of one page run in page
  order in one shared namespace and directory, as a reader would run them: a later block may use the
  names and files of an earlier one (one test per page; a failure names the block's ``page:line``).
- ``<!-- run: cuda -->``: needs a GPU; runs alone (fresh namespace and directory) in a test marked
  ``cuda``, skipped without CUDA.
- ``<!-- run: multiprocess -->``: starts processes of its own; written to a script file and run with this
  Python in a subprocess, in a test marked ``slow`` (``MEMKIT_RUN_SLOW=1``). The multiprocess blocks of a
  page run in page order in one directory, so a later one can read what an earlier one wrote (a
  checkpoint).
- ``<!-- not run: reason -->``: cannot run as written (a fragment of a method, a user's own checkpoint);
  the reason must be given.

A comment of this form that is not right before a ```python block, or any other ``run:`` value, fails
``test_markers_are_well_formed``.
"""

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = ["README.md", *sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("*.md"))]
RUN_KINDS = ("cuda", "multiprocess")
FENCE = re.compile(r"^```python[ \t]*\n(.*?)^```", re.S | re.M)
MARKER = re.compile(r"<!--\s*(not run|run)\b\s*(:?)(.*?)-->", re.S)
MULTIPROCESS_TIMEOUT_S = 600
LINKED = ("examples",)  # repository folders the pages name by relative path


@dataclass(frozen=True)
class Block:
    page: str
    line: int  # 1-based line of the block's first code line
    code: str
    kind: str  # "default", "cuda", "multiprocess" or "not run"
    reason: str = ""

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


def parse(text: str, page: str) -> tuple[list[Block], list[str]]:
    """The python blocks of ``text`` and one message per malformed or misplaced marker."""
    blocks, errors, attached = [], [], set()
    for fence in FENCE.finditer(text):
        line = text.count("\n", 0, fence.start(1)) + 1
        before = text[: fence.start()].rstrip()
        marker = next((m for m in MARKER.finditer(before) if m.end() == len(before)), None)
        kind, reason = "default", ""
        if marker is not None:
            attached.add(marker.start())
            head, colon, value = marker.group(1), marker.group(2), marker.group(3).strip()
            if not colon:
                errors.append(f"{page}:{line}: marker {marker.group(0)!r} needs a colon: '<!-- {head}: ... -->'")
            elif head == "not run":
                kind, reason = "not run", value
                if not value:
                    errors.append(f"{page}:{line}: '<!-- not run: -->' gives no reason")
            elif value in RUN_KINDS:
                kind = value
            else:
                errors.append(f"{page}:{line}: unknown '<!-- run: {value} -->'; allowed: {', '.join(RUN_KINDS)}")
        code = fence.group(1)
        if kind in ("default", "cuda") and re.search(r"^if __name__ == .__main__.:", code, re.M):
            errors.append(f"{page}:{line}: the block runs only as a script ('if __name__ == \"__main__\"'): "
                          "mark it '<!-- run: multiprocess -->'")
        blocks.append(Block(page, line, code, kind, reason))
    for marker in MARKER.finditer(text):
        if marker.start() not in attached:
            line = text.count("\n", 0, marker.start()) + 1
            errors.append(f"{page}:{line}: marker {marker.group(0)!r} is not right before a ```python block")
    return blocks, errors


PARSED = {page: parse((ROOT / page).read_text(), page) for page in PAGES}
BLOCKS = [block for page in PAGES for block in PARSED[page][0]]
DEFAULT_PAGES = [page for page in PAGES if any(b.kind == "default" for b in PARSED[page][0])]
CUDA_BLOCKS = [b for b in BLOCKS if b.kind == "cuda"]
MULTIPROCESS_PAGES = [page for page in PAGES if any(b.kind == "multiprocess" for b in PARSED[page][0])]


def test_parse_reads_markers_lines_and_errors():
    text = (
        "# Page\n\n```python\na = 1\n```\n\n<!-- run: cuda -->\n```python\nb = 2\n```\n"
        "<!-- run: multiprocess -->\n\n```python\nif __name__ == \"__main__\":\n    pass\n```\n"
        "<!-- not run: needs your checkpoint -->\n```python\nc = 3\n```\n"
        "<!-- not run:  -->\n```python\nd = 4\n```\n<!-- run: tpu -->\n```python\ne = 5\n```\n"
        "<!-- run: cuda -->\n```bash\nls\n```\n```python\nif __name__ == '__main__':\n    f = 6\n```\n"
    )
    blocks, errors = parse(text, "p.md")
    assert [(b.line, b.kind, b.reason, b.code) for b in blocks] == [
        (4, "default", "", "a = 1\n"),
        (9, "cuda", "", "b = 2\n"),
        (14, "multiprocess", "", "if __name__ == \"__main__\":\n    pass\n"),
        (19, "not run", "needs your checkpoint", "c = 3\n"),
        (23, "not run", "", "d = 4\n"),
        (27, "default", "", "e = 5\n"),
        (34, "default", "", "if __name__ == '__main__':\n    f = 6\n"),
    ]
    assert errors == [
        "p.md:23: '<!-- not run: -->' gives no reason",
        "p.md:27: unknown '<!-- run: tpu -->'; allowed: cuda, multiprocess",
        "p.md:34: the block runs only as a script ('if __name__ == \"__main__\"'): "
        "mark it '<!-- run: multiprocess -->'",
        "p.md:29: marker '<!-- run: cuda -->' is not right before a ```python block",
    ]
    assert parse("<!-- not run -->\n```python\nx = 1\n```\n", "q.md")[1] == [
        "q.md:3: marker '<!-- not run -->' needs a colon: '<!-- not run: ... -->'"
    ]


def test_markers_are_well_formed():
    assert "README.md" in DEFAULT_PAGES and "docs/index.md" in DEFAULT_PAGES
    errors = [error for page in PAGES for error in PARSED[page][1]]
    assert errors == []


@pytest.fixture
def scratch(tmp_path, monkeypatch) -> Path:
    """An empty working directory with the repository folders of ``LINKED`` linked in."""
    for name in LINKED:
        (tmp_path / name).symlink_to(ROOT / name, target_is_directory=True)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _exec_blocks(blocks: list[Block]) -> None:
    namespace = {"__name__": "__docs__"}
    for block in blocks:
        exec(compile(block.code, block.where, "exec"), namespace)


@pytest.mark.parametrize("page", DEFAULT_PAGES)
def test_page_blocks_run(page, scratch):
    _exec_blocks([b for b in PARSED[page][0] if b.kind == "default"])


@pytest.mark.cuda
@pytest.mark.parametrize("block", CUDA_BLOCKS, ids=[b.where for b in CUDA_BLOCKS])
def test_cuda_block_runs(block, scratch):
    _exec_blocks([block])


@pytest.mark.slow
@pytest.mark.parametrize("page", MULTIPROCESS_PAGES)
def test_multiprocess_blocks_run(page, scratch):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    for block in (b for b in PARSED[page][0] if b.kind == "multiprocess"):
        script = scratch / f"block_line{block.line}.py"
        script.write_text(block.code)
        proc = subprocess.run([sys.executable, script.name], cwd=scratch, env=env, capture_output=True, text=True,
                              timeout=MULTIPROCESS_TIMEOUT_S)
        output = (proc.stdout + proc.stderr)[-6000:]
        assert proc.returncode == 0, f"{block.where} exited with {proc.returncode}:\n{output}"
