"""What the disaggregation lesson's prefill worker needs of the processes around it, torch-free so the lesson can
declare it without loading torch: its name as a worker (``python -m engine worker prefill-worker ...``, or the
bundled app's ``kvscope --worker prefill-worker ...``: the lesson registry dispatches it), the command that starts
it, and its fault phase (``handover:N:exit|oom|sleep=S``, read from ``KVSCOPE_FAULTS``)."""

from __future__ import annotations

import sys

from engine.run.faults import FaultPhase

WORKER = "prefill-worker"
HANDOVER = FaultPhase("handover", ("exit", "oom", "sleep"))     # request N's hand-over: dies, no room, silent


def command() -> list[str]:
    """How this process starts a prefill worker: the bundled app is its own interpreter (no ``-m``)."""
    if getattr(sys, "frozen", False):
        return [sys.executable, "--worker", WORKER]
    return [sys.executable, "-m", "engine", "worker", WORKER]
