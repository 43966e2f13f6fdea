"""The test processes' zygote (``zygote.py``, ``ranks.py``): a forked process behaves as ``python -c`` would, and one
zygote serves every test process of a run, each disconnecting one's running processes killed."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import ranks

pytestmark = pytest.mark.skipif(not ranks.zygote_enabled(), reason="fresh interpreters instead of a zygote")

EXITING = """
import atexit, os, sys, threading, time
print("cwd", os.getcwd(), "var", os.environ.get("ZYGOTE_TEST_VAR"), "home" in os.environ)
print("to stderr", file=sys.stderr)
atexit.register(lambda: print("atexit ran", flush=True))
late = open("late.txt", "w")  # never closed: a global of the -c script, written out as the interpreter ends
late.write("written")
threading.Thread(target=lambda: (time.sleep(0.3), open("thread.txt", "w").write("joined"))).start()
sys.exit(3)
"""


def test_a_forked_process_ends_as_python_does(tmp_path: Path) -> None:
    """Its environment exactly, its directory, its streams apart; at its end the thread joined, atexit run, an
    unclosed file written, the exit code kept."""
    zygote = ranks.Zygote(("json",))
    try:
        proc = zygote.start(["-c", EXITING], {"ZYGOTE_TEST_VAR": "x", "PATH": os.environ["PATH"]},
                            stderr_to_stdout=False, cwd=tmp_path)
        out, err = proc.communicate(timeout=60)
    finally:
        zygote.close()
    assert proc.returncode == 3, err
    assert out.splitlines() == [f"cwd {tmp_path} var x False", "atexit ran"] and err == "to stderr\n"
    assert (tmp_path / "late.txt").read_text() == "written" and (tmp_path / "thread.txt").read_text() == "joined"


def test_one_zygote_serves_every_test_process_and_kills_what_a_gone_one_left(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ranks.SHARED, "")  # put back as it was (this run's shared zygote, say) when the test ends
    server = ranks.serve_shared(tmp_path, preload=("json",))
    try:
        first, second = ranks.Zygote(), ranks.Zygote()  # two test processes' connections
        code = "import os, sys, time; print(os.getppid()); sys.stdout.flush(); time.sleep(float(sys.argv[1]))"
        env = {"PATH": os.environ["PATH"]}
        left = first.start(["-c", code, "60"], env)
        done = second.start(["-c", code, "0"], env)
        assert done.wait(timeout=60) == 0
        first.close()  # its test process is gone: the process it left is killed
        assert left.wait(timeout=30) == -9
        assert left.communicate()[0].split()[0] == done.communicate()[0].split()[0] == str(server.pid)
        again = second.start(["-c", code, "0"], env)  # the other still served
        assert again.wait(timeout=60) == 0
    finally:
        server.stdin.close()
        server.wait(timeout=30)
    assert server.returncode == 0
