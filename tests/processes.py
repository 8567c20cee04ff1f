"""Servers a test starts (llama-server, vLLM, a prefill worker's peer) end with the test, whatever ends it: the
fixture's finalizer stops them (registered before the wait for the server to answer, so a start that fails or
runs past pytest's timeout stops it too), and if the test process itself is killed the kernel sends them SIGTERM
(Linux's parent-death signal), so no server outlives its test as an orphan."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Sequence
from typing import Any

PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def start(argv: Sequence[str], finalizers: Callable[[Callable[[], None]], Any], **popen: Any) -> subprocess.Popen:
    """``argv`` started in a session of its own (its children stop with it); ``finalizers`` (a fixture's
    ``request.addfinalizer``) gets the stop at once."""
    process = subprocess.Popen(list(argv), start_new_session=True, preexec_fn=_die_with_parent, **popen)
    finalizers(lambda: stop(process))
    return process


def stop(process: subprocess.Popen, grace_s: float = 20.0) -> None:
    """SIGTERM to the server and everything it started, then SIGKILL after ``grace_s``."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            break
        try:
            process.wait(wait_s)
            break
        except subprocess.TimeoutExpired:
            continue
