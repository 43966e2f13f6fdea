"""Start the ranks of a multi-process test as subprocesses and collect them (imported by the tests as ``ranks``).

Each rank is ``python script *args`` with Lightning's environment variables (``LOCAL_RANK``, ``NODE_RANK``,
``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``) and this checkout first on ``PYTHONPATH``; :func:`wait` kills
every rank and fails the test if they take longer than the budget (a hang), and returns each exit code and output.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PYPATH = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))  # keep what is installed


def free_port() -> int:
    """A TCP port free on this machine now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(script: Path, args: list[str], world: int, **env: str) -> list[subprocess.Popen]:
    """``world`` processes running ``script`` as ranks 0..world-1 of one job (extra ``env`` variables added)."""
    port = str(free_port())
    return [
        subprocess.Popen(
            [sys.executable, str(script), *args],
            env=dict(os.environ, LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                     MASTER_PORT=port, PYTHONPATH=PYPATH, **env),
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for rank in range(world)
    ]


def wait(procs: list[subprocess.Popen], budget: float, what: str = "run") -> list[tuple[int, str]]:
    """Each process's exit code and output; kill every process and fail if they take over ``budget`` seconds."""
    t0, done = time.monotonic(), []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=max(1.0, budget - (time.monotonic() - t0)))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail(f"the {len(procs)}-process {what} did not finish in {budget:.0f} s (hang)")
        done.append((p.returncode, out))
    return done
