"""Every ```python block of README.md and docs/*.md runs as written (a new page is covered automatically).

Every block runs alone, as if a reader pasted it into a fresh interpreter started in an empty directory:
one test per block (its id is the block's ``page:line``), its own globals (no name of an earlier block), its own
new working directory (no file of an earlier block) where only ``examples/`` is linked to the checkout's, so
``examples/configs/...`` paths work as from the repository root. So each block carries its own imports and
set-up. An HTML comment right before a block says how it runs:

- no comment: the block runs in this process (``run_alone``; a subprocess per block would pay the
  imports of torch, Lightning and transformers each time). What one block could leave behind in the process
  is put back before the next: the working directory, ``os.environ``, ``sys.path``, ``sys.argv``, torch's
  default dtype and device, grad mode, anomaly mode, deterministic algorithms and intra-op threads; the
  RNG is seeded (0) before it. ``test_blocks_run_alone`` checks that a block cannot see what an earlier one
  defined, wrote or changed. Modules stay imported, so a module attribute a block replaces and never puts
  back would stay replaced: memkit's own patches are scoped (a ``LivePeak`` left open fails the test).
- ``<!-- run: cuda -->``: needs a GPU; runs as above in a test marked ``cuda``, skipped without CUDA
  (earlier garbage collected, the CUDA cache emptied and the peak statistics reset before it).
- ``<!-- run: multiprocess -->``: starts processes of its own; written to a script file in its own new
  directory and run as ``python script`` in a process of its own (``ranks.start``), in a test marked ``slow``
  (``MEMKIT_RUN_SLOW=1``).
- ``<!-- not run: reason -->``: cannot run as written (a fragment of a method, a user's own checkpoint);
  the reason must be given.

A comment of this form that is not right before a ```python block, or any other ``run:`` value, fails
``test_markers_are_well_formed`` (one in backticks, as prose names a marker, is no marker).
"""

import contextlib
import gc
import os
import re
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import ranks
import torch

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
        quoted = text[marker.start() - 1 : marker.start()] == text[marker.end() : marker.end() + 1] == "`"
        if marker.start() not in attached and not quoted:  # `<!-- run: cuda -->` in prose names a marker
            line = text.count("\n", 0, marker.start()) + 1
            errors.append(f"{page}:{line}: marker {marker.group(0)!r} is not right before a ```python block")
    return blocks, errors


PARSED = {page: parse((ROOT / page).read_text(), page) for page in PAGES}
BLOCKS = [block for page in PAGES for block in PARSED[page][0]]
DEFAULT_BLOCKS = [b for b in BLOCKS if b.kind == "default"]
CUDA_BLOCKS = [b for b in BLOCKS if b.kind == "cuda"]
MULTIPROCESS_BLOCKS = [b for b in BLOCKS if b.kind == "multiprocess"]


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
    assert parse("Blocks marked `<!-- run: cuda -->` need a GPU.\n", "r.md") == ([], [])


def test_markers_are_well_formed():
    assert {"README.md", "docs/index.md"} <= {b.page for b in DEFAULT_BLOCKS}
    errors = [error for page in PAGES for error in PARSED[page][1]]
    assert errors == []


def scratch_dir(path: Path) -> Path:
    """``path``, created empty but for the repository folders of ``LINKED``, linked in."""
    path.mkdir(parents=True)
    for name in LINKED:
        (path / name).symlink_to(ROOT / name, target_is_directory=True)
    return path


def _set_environ(saved: dict[str, str]) -> None:
    os.environ.clear()
    os.environ.update(saved)


def _set_default_device(device: torch.device) -> None:
    torch.set_default_device(None if device == torch.device("cpu") else device)


# What a block may change in the process and a fresh interpreter would not have: (read, put back).
PROCESS_STATE: dict[str, tuple[Callable[[], Any], Callable[[Any], None]]] = {
    "working directory": (os.getcwd, os.chdir),
    "os.environ": (lambda: dict(os.environ), _set_environ),
    "sys.path": (lambda: list(sys.path), lambda saved: sys.path.__setitem__(slice(None), saved)),
    "sys.argv": (lambda: list(sys.argv), lambda saved: sys.argv.__setitem__(slice(None), saved)),
    "default dtype": (torch.get_default_dtype, torch.set_default_dtype),
    "default device": (torch.get_default_device, _set_default_device),
    "grad mode": (torch.is_grad_enabled, torch.set_grad_enabled),
    "anomaly mode": (torch.is_anomaly_enabled, torch.set_anomaly_enabled),
    "deterministic algorithms": (torch.are_deterministic_algorithms_enabled, torch.use_deterministic_algorithms),
    "intra-op threads": (torch.get_num_threads, torch.set_num_threads),
}


@contextlib.contextmanager
def _process_state_kept() -> Iterator[None]:
    saved = {name: read() for name, (read, _) in PROCESS_STATE.items()}
    try:
        yield
    finally:
        for name, (read, put_back) in PROCESS_STATE.items():
            if read() != saved[name]:
                put_back(saved[name])


def run_alone(block: Block, directory: Path) -> None:
    """Run ``block`` as if pasted into a fresh interpreter started in ``directory``: new globals, that working
    directory, the RNG seeded; the process state it changes is put back afterwards (see the module doc)."""
    with _process_state_kept():
        os.chdir(directory)
        torch.manual_seed(0)
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            gc.collect()  # what earlier blocks left in reference cycles (a Trainer) is freed first (~0.4 s: GPU only)
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        exec(compile(block.code, block.where, "exec"), {"__name__": "__docs__"})


def test_blocks_run_alone(tmp_path):
    page = (
        "```python\nimport os, torch\nshared = 1\nopen('written.txt', 'w').write('x')\n"
        "torch.set_default_dtype(torch.float64)\nos.environ['MEMKIT_DOCS_TEST'] = '1'\n"
        "torch.set_grad_enabled(False)\n```\n"
        "```python\nshared\n```\n"
        "```python\nopen('written.txt')\n```\n"
        "```python\nimport torch\nos\n```\n"
        "```python\nimport os, torch\nassert torch.get_default_dtype() == torch.float32 and torch.is_grad_enabled()\n"
        "assert 'MEMKIT_DOCS_TEST' not in os.environ and os.listdir() == ['examples']\n```\n"
    )
    blocks, errors = parse(page, "alone.md")
    assert errors == [] and len(blocks) == 5
    cwd = os.getcwd()
    run_alone(blocks[0], scratch_dir(tmp_path / "0"))
    assert (tmp_path / "0" / "written.txt").exists() and os.getcwd() == cwd
    assert torch.get_default_dtype() == torch.float32 and torch.is_grad_enabled()
    with pytest.raises(NameError, match="'shared'"):
        run_alone(blocks[1], scratch_dir(tmp_path / "1"))
    with pytest.raises(FileNotFoundError, match="written.txt"):
        run_alone(blocks[2], scratch_dir(tmp_path / "2"))
    with pytest.raises(NameError, match="'os'"):  # an import of an earlier block is not there either
        run_alone(blocks[3], scratch_dir(tmp_path / "3"))
    run_alone(blocks[4], scratch_dir(tmp_path / "4"))
    assert os.getcwd() == cwd


@pytest.mark.parametrize("block", DEFAULT_BLOCKS, ids=[b.where for b in DEFAULT_BLOCKS])
def test_block_runs(block, tmp_path):
    run_alone(block, scratch_dir(tmp_path / "scratch"))


@pytest.mark.cuda
@pytest.mark.parametrize("block", CUDA_BLOCKS, ids=[b.where for b in CUDA_BLOCKS])
def test_cuda_block_runs(block, tmp_path):
    run_alone(block, scratch_dir(tmp_path / "scratch"))


@pytest.mark.slow
@pytest.mark.parametrize("block", MULTIPROCESS_BLOCKS, ids=[b.where for b in MULTIPROCESS_BLOCKS])
def test_multiprocess_block_runs(block, tmp_path):
    scratch = scratch_dir(tmp_path / "scratch")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    script = scratch / f"block_line{block.line}.py"
    script.write_text(block.code)
    proc = ranks.start([script.name], env, cwd=scratch)
    try:
        output, _ = proc.communicate(timeout=MULTIPROCESS_TIMEOUT_S)
    finally:
        proc.kill()
    assert proc.returncode == 0, f"{block.where} exited with {proc.returncode}:\n{output[-6000:]}"
