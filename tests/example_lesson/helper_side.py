"""The example lesson's word counter: a process of its own that reads the prompt on its standard input and writes
how many words it holds, torch-free, with its fault phase (``example:N:exit`` ends it before its N-th answer).
The example has it to show how a lesson declares a helper module, a worker and a fault phase of its own."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence

from engine.run import faults

WORKER = "example-counter"
COUNTING = faults.FaultPhase("example", ("exit", "sleep"))


class CounterFailed(RuntimeError):
    """The counter ended without an answer; ``str`` is the sentence a user reads."""


def command() -> list[str]:
    """How this process starts the counter: the bundled app is its own interpreter (no ``-m``)."""
    if getattr(sys, "frozen", False):
        return [sys.executable, "--worker", WORKER]
    return [sys.executable, "-m", "engine", "worker", WORKER]


def count_words(text: str, run: int, timeout_s: float = 120.0) -> int:
    """The words of ``text`` as the counter process counts them (``run``: which of the lesson's runs asks, the
    fault phase's step, from 1)."""
    try:
        done = subprocess.run([*command(), str(run)], input=text, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise CounterFailed(f"the word counter gave no answer in {timeout_s:g} s at run {run}") from None
    answer = done.stdout.strip()
    if done.returncode != 0 or not answer.isdigit():
        raise CounterFailed(f"the word counter ended without an answer at run {run} (exit {done.returncode})")
    return int(answer)


def counter_entry(argv: Sequence[str]) -> None:
    """``python -m engine worker example-counter RUN``: the words on standard input, counted."""
    run = int(argv[0]) if argv and argv[0].isdigit() else 0
    if faults.act(faults.actions(COUNTING).get(run)) == "exit":
        os._exit(3)
    print(len(sys.stdin.read().split()), flush=True)
