"""A process that imports torch, Lightning and transformers once, then forks a child per script to run: the ranks of
the multi-process tests start in a fraction of a second instead of importing all of it again (see ``ranks.py``).
``python zygote.py module ...`` imports those modules instead (the import checks: torch alone).
``python zygote.py --socket PATH [module ...]`` serves every test process that connects to the Unix socket
``PATH`` (the test processes of one pytest-xdist run share one zygote, see ``conftest.py``) until its stdin ends.

Protocol, one JSON line each way: a request ``{"argv": [...], "env": {...}, "cwd": ..., "out": path, "err": path,
"rc": path}`` is answered with ``{"pid": pid}``. The child runs ``python *argv`` (a script, ``-c`` code or
``-m`` module) as that command would, in the environment ``env``, its stdout going to ``out`` and its stderr to
``err``; its exit code (negative: the signal that killed it, as ``subprocess.Popen.returncode``) is written to
``rc`` when it ends. End of input: the children still running are killed and the zygote exits; a test process
that disconnects from a shared zygote has its children still running killed. Nothing here runs
a torch op before forking (no thread pool to inherit). What the imports made is frozen out of the garbage
collector's sight (``gc.freeze``): a child's full collections walk its own objects only, and leave the inherited
pages unwritten.
"""

from __future__ import annotations

import atexit
import gc
import json
import os
import runpy
import select
import signal
import socket
import sys
import threading
import traceback
import types
from collections.abc import Callable

#: third-party packages only: a module of this package made per-process state at import (a run id, say) that
#: forked children would share, where fresh interpreters each make their own
PRELOAD = ("torch", "torch.distributed", "torch.distributed.pipelining", "torch.distributed.checkpoint",
           "lightning.pytorch", "transformers")
RANK_VARIABLES = ("RANK", "LOCAL_RANK", "SLURM_PROCID", "JSM_NAMESPACE_RANK")  # what Lightning reads at import


def _run_child(request: dict) -> int:
    """In the forked child: become ``python argv...`` with ``env``; the exit code."""
    out = os.open(request["out"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    err = out if request["err"] == request["out"] else os.open(request["err"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC,
                                                                   0o644)
    os.dup2(out, 1)
    os.dup2(err, 2)
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    os.chdir(request["cwd"])
    if "multiprocessing.process" in sys.modules:  # the start directory, as a process started here would record
        sys.modules["multiprocessing.process"].ORIGINAL_DIR = os.getcwd()
    os.environ.clear()
    os.environ.update(request["env"])
    rank_zero = sys.modules.get("lightning_utilities.core.rank_zero")
    if rank_zero is not None:  # Lightning set its rank from the environment at import: as it would have from this one
        rank_zero.rank_zero_only.rank = next((int(os.environ[k]) for k in RANK_VARIABLES if k in os.environ), 0)
    if "OMP_NUM_THREADS" in request["env"]:  # read by the OpenMP runtime at load: this process loaded it already
        import torch

        torch.set_num_threads(int(request["env"]["OMP_NUM_THREADS"]))
    argv = request["argv"]
    try:
        if argv[0] == "-m":  # python -m module args: the working directory first on sys.path
            sys.argv, sys.path[0] = [argv[1], *argv[2:]], os.getcwd()
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        elif argv[0] == "-c":  # python -c code args
            sys.argv, sys.path[0] = ["-c", *argv[2:]], ""
            main = types.ModuleType("__main__")
            sys.modules["__main__"] = main
            exec(compile(argv[1], "<string>", "exec"), main.__dict__)
        else:  # python script args: the script's folder first on sys.path
            sys.argv, sys.path[0] = list(argv), os.path.dirname(os.path.abspath(argv[0]))
            runpy.run_path(os.path.abspath(argv[0]), run_name="__main__")  # its __file__ absolute, as python's
    except SystemExit as exit_:
        if exit_.code is None or isinstance(exit_.code, int):
            return exit_.code or 0
        print(exit_.code, file=sys.stderr)
        return 1
    except BaseException:
        traceback.print_exc()
        return 1
    return 0


def _exit(code: int) -> None:
    """End the child as the interpreter's own exit does, up to its teardown of the modules: the threads that are not
    daemons joined, the ``atexit`` handlers run, the garbage the child made collected (its finalizers run, its files
    closed), the standard streams flushed. The teardown of the objects inherited from the zygote is skipped: it
    would write their pages, about a second of each child's time."""
    try:
        threading._shutdown()  # what Py_FinalizeEx does first
        atexit._run_exitfuncs()
        sys.modules.pop("__main__", None)  # a -c script's globals: collected with the rest
        gc.collect()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


def _fork(request: dict, sockets: list[socket.socket | None]) -> int:
    """Fork a child for ``request``; in the child (``sockets``, the zygote's own, closed), run it and end as an
    interpreter does (see :func:`_exit`) with its exit code."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            for sock in sockets:
                if sock is not None:
                    sock.close()
            code = _run_child(request)
        finally:
            _exit(code)
    return pid


def _reap(children: dict[int, tuple[str, int]]) -> None:
    """Write the exit code of every child that has ended."""
    while children:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            return
        path, _ = children.pop(pid, (None, None))
        if path is not None:
            with open(path + ".tmp", "w") as f:
                f.write(str(os.waitstatus_to_exitcode(status)))
            os.replace(path + ".tmp", path)  # appears whole


class _Client:
    """A test process sending requests: ``write`` is where answers go (its socket, or stdout), ``conn`` its socket,
    ``pending`` the start of a request not read whole yet."""

    def __init__(self, write: int, conn: socket.socket | None = None) -> None:
        self.write, self.conn, self.pending = write, conn, b""


def _serve(listener: socket.socket | None) -> None:
    """Answer requests until the end of input (stdin): from stdin, or from every test process that connects to
    ``listener``; a child still running when its test process disconnects is killed."""
    clients = {0: _Client(1)} if listener is None else {}
    watched: list = [0] if listener is None else [0, listener]
    children: dict[int, tuple[str, int]] = {}  # pid: (exit-code path, the client's read descriptor)
    while True:
        readable, _, _ = select.select([*watched, *(fd for fd in clients if fd != 0)], [], [], 0.05)
        _reap(children)
        for fd in readable:
            if fd is listener:
                conn, _ = listener.accept()
                clients[conn.fileno()] = _Client(conn.fileno(), conn)
                continue
            try:
                chunk = os.read(fd, 1 << 16)
            except OSError:  # a connection reset: as its end
                chunk = b""
            if not chunk and fd == 0:  # the end of input: every child killed, and the zygote ends
                _kill(children, lambda owner: True)
                gc.unfreeze()  # the interpreter's shutdown collects everything, as without the freeze
                return
            client = clients.get(fd)
            if client is None:  # a shared zygote's input carries nothing but its end
                continue
            if not chunk:  # a test process is gone
                _kill(children, lambda owner, fd=fd: owner == fd)
                client.conn.close()
                del clients[fd]
                continue
            *lines, client.pending = (client.pending + chunk).split(b"\n")
            for line in lines:
                request = json.loads(line)
                pid = _fork(request, [c.conn for c in clients.values() if c.conn is not None] + [listener])
                children[pid] = (request["rc"], fd)
                try:
                    os.write(client.write, (json.dumps({"pid": pid}) + "\n").encode())
                except OSError:  # the test process went away while asking: its disconnection kills the child
                    pass


def _kill(children: dict[int, tuple[str, int]], whose: Callable[[int], bool]) -> None:
    """Kill the running children whose client ``whose`` accepts (they are reaped later)."""
    for pid, (_, owner) in children.items():
        if whose(owner):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def main() -> None:
    args, listener = sys.argv[1:], None
    if args[:1] == ["--socket"]:  # bound before the imports: a test process may connect at once (and wait)
        listener = socket.socket(socket.AF_UNIX)
        listener.bind(args[1] + ".binding")
        listener.listen(16)
        os.rename(args[1] + ".binding", args[1])  # the path appears listening: a connect is never refused
        args = args[2:]
    for name in args or PRELOAD:
        try:
            __import__(name)
        except ImportError:  # an optional dependency: the child imports what it needs itself
            pass
    gc.collect()
    gc.freeze()
    print(json.dumps({"ready": os.getpid()}), flush=True)
    _serve(listener)


if __name__ == "__main__":
    main()
