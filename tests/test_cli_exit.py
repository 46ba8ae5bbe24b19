"""The console entry's exit: its exit handlers run, its output (Python's and what C's stdio buffered) and exit codes
are intact, the interpreter's teardown is skipped, and a thread Python would wait for is waited for (the usual
exit)."""

import os
import subprocess
import sys

from tests.conftest import ROOT

# A process that runs the console entry with an exit handler and an object freed only by the interpreter's teardown.
ENTRY = """
import atexit, ctypes, sys, threading, time
atexit.register(lambda: print("exit handler ran", flush=True))
atexit.register(lambda: ctypes.CDLL(None).printf(b"printed by C\\n"))  # buffered by C's stdio: stdout is a pipe

class Teardown:
    def __del__(self):
        print("torn down", flush=True)

kept = Teardown()
sys.argv = ["embedpipe", *{args!r}]
from embedpipe.cli import main
if {thread!r}:  # still running when the command ends
    threading.Thread(target=lambda: (time.sleep(1.0), print("thread finished", flush=True))).start()
main()
"""


def _entry(*args: str, thread: bool = False) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # else C's stdio buffers nothing either
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-c", ENTRY.format(args=list(args), thread=thread)], capture_output=True,
                          text=True, timeout=120, cwd=ROOT, env=env)


def test_a_command_leaves_with_its_output_and_exit_handlers_and_without_the_teardown():
    done = _entry("--version")
    assert done.returncode == 0, done.stderr
    version, *rest = done.stdout.splitlines()  # C's buffer and Python's are flushed apart: their order is free
    assert version.startswith("embedpipe ") and sorted(rest) == ["exit handler ran", "printed by C"]  # no teardown


def test_an_error_keeps_its_exit_code_and_its_line():
    done = _entry("run", "/nonexistent/job.yaml")
    assert done.returncode == 2  # a job that cannot be loaded (embedpipe/errors.py)
    assert "does not exist" in done.stderr and done.stderr.count("\n") == 1
    assert sorted(done.stdout.splitlines()) == ["exit handler ran", "printed by C"]


def test_a_thread_python_waits_for_is_waited_for():
    done = _entry("--version", thread=True)
    assert done.returncode == 0, done.stderr
    assert sorted(done.stdout.splitlines()[1:]) == ["exit handler ran", "printed by C", "thread finished", "torn down"]
