"""Start the ranks of a multi-process test as processes and collect them (imported by the tests as ``ranks``).

Each rank is ``python script *args`` with Lightning's environment variables (``LOCAL_RANK``, ``NODE_RANK``,
``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``) and this checkout first on ``PYTHONPATH``; :func:`wait` kills
every rank and fails the test if they take longer than the budget (a hang), and returns each exit code and output.

A rank is forked by ``zygote.py``, which has imported torch, Lightning and transformers once: a process of its own
that starts in a fraction of a second. One zygote serves every test process of an xdist run (``conftest.py`` starts
it in the controller, :func:`serve_shared`); a test process of a run without xdist starts its own.
``MEMKIT_TEST_ZYGOTE=0`` (the default off Linux) starts each rank as a fresh interpreter instead.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
PYPATH = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))  # keep what is installed


def free_port() -> int:
    """A TCP port free on this machine now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Forked:
    """A process forked by the zygote, with the part of ``subprocess.Popen`` the tests use."""

    def __init__(self, pid: int, out: str, err: str, rc: str) -> None:
        self.pid, self.returncode, self._out, self._err, self._rc = pid, None, out, err, rc

    def poll(self) -> int | None:
        if self.returncode is None and os.path.exists(self._rc):
            self.returncode = int(Path(self._rc).read_text())
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        end = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if end is not None and time.monotonic() > end:
                raise subprocess.TimeoutExpired(self._out, timeout)
            time.sleep(0.02)
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[str, str | None]:
        """Stdout (with stderr when they go together) and stderr (None then), once the process has ended."""
        self.wait(timeout)
        out = Path(self._out).read_text(errors="replace")
        return out, None if self._err == self._out else Path(self._err).read_text(errors="replace")

    def kill(self) -> None:
        if self.poll() is None:  # not reaped yet: the pid is still this process's
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


SHARED = "MEMKIT_TEST_ZYGOTE_SOCKET"  # set by conftest.py in the xdist controller: the socket of the run's zygote
ZYGOTE = Path(__file__).with_name("zygote.py")


def zygote_enabled() -> bool:
    """Whether processes are forked from a zygote: ``MEMKIT_TEST_ZYGOTE=0`` (the default off Linux) starts fresh
    interpreters instead."""
    return os.environ.get("MEMKIT_TEST_ZYGOTE", "1" if sys.platform == "linux" else "0") != "0"


class Zygote:
    """A ``zygote.py`` process importing ``preload`` (default: its own list, torch, Lightning and transformers), started
    on first use and ended when this process exits (or at :meth:`close`); :meth:`start` forks a process from it.
    The default one is the run's shared zygote where the xdist controller started one (``$MEMKIT_TEST_ZYGOTE_SOCKET``):
    this process connects to it instead."""

    def __init__(self, preload: tuple[str, ...] = ()) -> None:
        self.preload, self.proc, self.conn, self.io, self.dir, self.n = preload, None, None, None, "", 0

    def _channel(self) -> tuple[Any, Any]:
        """Where requests go and answers come from (text streams): this process's connection to the shared zygote,
        or a zygote of its own, started now if need be."""
        if not self.dir:
            self.dir = tempfile.mkdtemp(prefix="memkit-ranks-")
            atexit.register(shutil.rmtree, self.dir, ignore_errors=True)  # the outputs and exit codes
        shared = os.environ.get(SHARED) if not self.preload else None
        if shared:
            if self.conn is None:
                self.conn = socket.socket(socket.AF_UNIX)
                self.conn.connect(shared)  # bound before the zygote's imports: it answers once they are done
                self.io = self.conn.makefile("rw", encoding="utf-8")
            return self.io, self.io
        if self.proc is None or self.proc.poll() is not None:
            self.proc = subprocess.Popen([sys.executable, str(ZYGOTE), *self.preload], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, env=dict(os.environ, PYTHONPATH=PYPATH), text=True)
            ready = self.proc.stdout.readline()
            assert ready.startswith('{"ready"'), f"the zygote did not start: {ready!r}"
        return self.proc.stdin, self.proc.stdout

    def start(self, argv: list, env: dict[str, str], stderr_to_stdout: bool = True, cwd: Path | None = None,
              ) -> Forked | subprocess.Popen:
        """``python *argv`` (a script and its arguments; ``-c``, code, arguments; or ``-m``, module, arguments) in the
        environment ``env`` (exactly), in ``cwd`` (default: this process's); with ``stderr_to_stdout``, its stderr
        goes with its stdout. ``MEMKIT_TEST_ZYGOTE=0`` (the default off Linux): a fresh interpreter instead."""
        if not zygote_enabled():
            return subprocess.Popen([sys.executable, *map(str, argv)], env=env, stdout=subprocess.PIPE, text=True,
                                    stderr=subprocess.STDOUT if stderr_to_stdout else subprocess.PIPE, cwd=cwd)
        requests, answers = self._channel()
        self.n += 1
        base = os.path.join(self.dir, str(self.n))
        request = {"argv": [str(a) for a in argv], "env": env, "cwd": str(cwd or os.getcwd()), "out": base + ".out",
                   "err": base + (".out" if stderr_to_stdout else ".err"), "rc": base + ".rc"}
        requests.write(json.dumps(request) + "\n")
        requests.flush()
        answer = answers.readline()
        assert answer.startswith('{"pid"'), f"the zygote did not answer: {answer!r}"
        return Forked(json.loads(answer)["pid"], request["out"], request["err"], request["rc"])

    def close(self) -> None:
        """End the zygote (the processes it forked that still run are killed); from a shared one, disconnect."""
        if self.conn is not None:
            self.io.close()
            self.conn.close()
            self.conn = self.io = None
        if self.proc is not None:
            self.proc.stdin.close()
            self.proc.wait()
            self.proc.stdout.close()
            self.proc = None


def serve_shared(folder: Path, preload: tuple[str, ...] = ()) -> subprocess.Popen:
    """Start the zygote that every test process of this run shares (its socket in ``folder``, named in
    ``$MEMKIT_TEST_ZYGOTE_SOCKET`` for the processes started from here on); it ends when its stdin is closed."""
    path = folder / "zygote.sock"
    proc = subprocess.Popen([sys.executable, str(ZYGOTE), "--socket", str(path), *preload], stdin=subprocess.PIPE,
                            stdout=subprocess.DEVNULL, env=dict(os.environ, PYTHONPATH=PYPATH))
    end = time.monotonic() + 30
    while not path.exists():  # bound first thing: a test process connecting later finds it
        assert proc.poll() is None and time.monotonic() < end, "the shared zygote did not start"
        time.sleep(0.01)
    os.environ[SHARED] = str(path)
    return proc


_DEFAULT = Zygote()


def start(argv: list, env: dict[str, str], stderr_to_stdout: bool = True, cwd: Path | None = None,
          ) -> Forked | subprocess.Popen:
    """``python *argv`` forked by this test process's zygote (see :meth:`Zygote.start`)."""
    return _DEFAULT.start(argv, env, stderr_to_stdout, cwd)


def in_fork(fn: Callable[[], None], timeout: float = 120) -> None:
    """Call ``fn`` in a fork of this test process and fail the test with its traceback if it raises: for a test that
    changes what no test may change for the others (the garbage collector's frozen objects, say)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never back into pytest
        os.close(read)
        code = 0
        try:
            fn()
        except BaseException:  # noqa: BLE001 - reported to the parent
            os.write(write, traceback.format_exc().encode())
            code = 1
        os._exit(code)
    os.close(write)
    end = time.monotonic() + timeout
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0:
        if time.monotonic() > end:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail(f"the forked call did not finish in {timeout:.0f} s")
        time.sleep(0.01)
    with os.fdopen(read, "rb") as f:
        report = f.read().decode()
    code = os.waitstatus_to_exitcode(done[1])
    if report or code:
        pytest.fail(f"in the forked process (exit code {code}):\n{report}", pytrace=False)


def run(argv: list, timeout: float, cwd: Path | None = None, drop: tuple[str, ...] = (), zygote: Zygote | None = None,
        **env: str) -> subprocess.CompletedProcess:
    """``python *argv`` to its end in ``cwd``, with this checkout first on ``PYTHONPATH``, the variables ``drop`` names
    removed and ``env`` added (as ``subprocess.run(..., capture_output=True, text=True)``), forked by ``zygote``
    (default: this process's); fails the test after ``timeout`` seconds."""
    environ = {k: v for k, v in os.environ.items() if k not in drop}
    proc = (zygote or _DEFAULT).start(argv, dict(environ, PYTHONPATH=PYPATH, **env), stderr_to_stdout=False, cwd=cwd)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"python {' '.join(map(str, argv))[:200]} did not finish in {timeout:.0f} s")
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def launch(script: Path | str, args: list[str], world: int, **env: str) -> list[Forked | subprocess.Popen]:
    """``world`` processes running ``python script *args`` (``script`` may be ``"-c"``, ``args`` the code) as ranks
    0..world-1 of one job (extra ``env`` variables added)."""
    port = str(free_port())
    return [
        start([str(script), *args], dict(os.environ, LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world),
                                         MASTER_ADDR="127.0.0.1", MASTER_PORT=port, PYTHONPATH=PYPATH, **env))
        for rank in range(world)
    ]


def wait(procs: list[Forked | subprocess.Popen], budget: float, what: str = "run") -> list[tuple[int, str]]:
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


def collect(script: Path | str, out: Path, world: int, budget: float, what: str, **env: str) -> list[dict]:
    """Run ``python script out`` as ``world`` ranks (one intra-op thread each), fail the test on a non-zero exit or
    a hang, and return what each rank wrote to ``out/rank{r}.json``."""
    for code, log in wait(launch(script, [str(out)], world, OMP_NUM_THREADS="1", **env), budget, what):
        assert code == 0, log[-4000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]
