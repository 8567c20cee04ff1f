"""A server a test starts ends with the test, whatever ends it: the fixture's finalizer, or the test process
itself killed."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from tests import processes


def gone(pid: int, within_s: float = 10.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        try:                                     # a zombie that was ours: reap it
            if os.waitpid(pid, os.WNOHANG)[0] == pid:
                return True
        except ChildProcessError:
            pass
        time.sleep(0.1)
    return False


def in_session(sid: int) -> list[int]:
    """The processes of session ``sid``, from /proc (field 6 of a process's stat line)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue                                             # it ended while we looked
        if int(fields[3]) == sid:
            found.append(int(stat.parent.name))
    return found


def test_the_finalizer_registered_at_start_stops_the_server_and_what_it_started():
    finalizers: list = []
    server = processes.start([sys.executable, "-c", "import subprocess, time; subprocess.Popen(['sleep', '600']); "
                              "time.sleep(600)"], finalizers.append)
    assert len(finalizers) == 1 and server.poll() is None       # registered before anyone waits for it to answer
    time.sleep(0.5)
    children = in_session(server.pid)
    assert len(children) == 2                                   # the server and the child it started
    finalizers[0]()
    assert server.poll() is not None and all(gone(int(pid)) for pid in children)


def test_a_server_dies_with_the_test_process_killed_before_any_finalizer(tmp_path: Path):
    """What pytest-timeout's thread method and a CI kill do: the test process ends at once, no teardown runs."""
    pid_file = tmp_path / "server.pid"
    test_process = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; sys.path.insert(0, sys.argv[1]); from tests import processes; "
        "s = processes.start(['sleep', '600'], lambda stop: None); open(sys.argv[2], 'w').write(str(s.pid)); "
        "time.sleep(600)"), str(Path(__file__).resolve().parents[1]), str(pid_file)])
    deadline = time.monotonic() + 30
    while not pid_file.exists() or not pid_file.read_text():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    server = int(pid_file.read_text())
    os.kill(server, 0)                                          # running
    test_process.kill()
    test_process.wait()
    assert gone(server)
