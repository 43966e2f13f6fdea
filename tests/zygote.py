"""A process that imports torch, Lightning and transformers once, then forks a child per script to run: the ranks of
the multi-process tests start in a fraction of a second instead of importing all of it again (see ``ranks.py``).
``python zygote.py module ...`` imports those modules instead (the import checks: torch alone).

Protocol, one JSON line each way: a request ``{"argv": [...], "env": {...}, "cwd": ..., "out": path, "err": path,
"rc": path}`` is answered with ``{"pid": pid}``. The child runs ``python *argv`` (a script, ``-c`` code or
``-m`` module) as that command would, in the environment ``env``, its stdout going to ``out`` and its stderr to
``err``; its exit code (negative: the signal that killed it, as ``subprocess.Popen.returncode``) is written to
``rc`` when it ends. End of input: the children still running are killed and the zygote exits. Nothing here runs
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
import sys
import threading
import traceback
import types

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


def _fork(request: dict) -> int:
    """Fork a child for ``request``; in the child, run it and end as an interpreter does (see :func:`_exit`) with its
    exit code."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            code = _run_child(request)
        finally:
            _exit(code)
    return pid


def _reap(children: dict[int, str]) -> None:
    """Write the exit code of every child that has ended."""
    while children:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            return
        path = children.pop(pid, None)
        if path is not None:
            with open(path + ".tmp", "w") as f:
                f.write(str(os.waitstatus_to_exitcode(status)))
            os.replace(path + ".tmp", path)  # appears whole


def main() -> None:
    for name in sys.argv[1:] or PRELOAD:
        try:
            __import__(name)
        except ImportError:  # an optional dependency: the child imports what it needs itself
            pass
    gc.collect()
    gc.freeze()
    children: dict[int, str] = {}
    print(json.dumps({"ready": os.getpid()}), flush=True)
    pending = b""
    while True:
        readable, _, _ = select.select([0], [], [], 0.05)
        _reap(children)
        if not readable:
            continue
        chunk = os.read(0, 1 << 16)
        if not chunk:  # the test process is gone
            for pid in children:
                os.kill(pid, signal.SIGKILL)
            gc.unfreeze()  # the interpreter's shutdown collects everything, as without the freeze
            return
        *lines, pending = (pending + chunk).split(b"\n")
        for line in lines:
            request = json.loads(line)
            pid = _fork(request)
            children[pid] = request["rc"]
            print(json.dumps({"pid": pid}), flush=True)


if __name__ == "__main__":
    main()
