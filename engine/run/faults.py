"""Fault injection, so failure handling can be tested on a CPU and shown on stage.

``KVSCOPE_FAULTS`` lists faults as ``phase:step:action`` separated by commas. A run's own phases are ``prefill``,
``first`` (after the prefill's pass, before its token is chosen) and ``decode``, with the step at which to fire (0
for the prefill) and the action ``oom`` (raise the out-of-memory error of the device: ``MemoryError`` on CPU),
``error`` (a generic ``RuntimeError``) or ``sleep=SECONDS`` (a forward pass that takes that long). Example:
``KVSCOPE_FAULTS=decode:3:oom`` fails every run at its third decode step.

A lesson whose processes have phases of their own declares them (``Lesson.faults``: a ``FaultPhase`` with its
actions); the lesson registry declares them here (``declare``), and the process reads its items with
``actions(phase)``. Any other phase is refused, naming the phases there are.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass

from engine.facts.errors import ParameterError

FaultHook = Callable[[str, int], None]


@dataclass(frozen=True)
class FaultPhase:
    """A phase of ``KVSCOPE_FAULTS``: its name and the actions it takes (``sleep`` stands for ``sleep=S``)."""

    name: str
    actions: tuple[str, ...]

    def grammar(self) -> str:
        words = [f"{self.name}:N:{'sleep=S' if a == 'sleep' else a}" for a in self.actions]
        return ", ".join(words[:-1]) + f" or {words[-1]}" if len(words) > 1 else words[0]

    def admits(self, action: str) -> bool:
        return action in self.actions or ("sleep" in self.actions and action.startswith("sleep=")
                                          and _seconds(action) is not None)


RUN_PHASES = tuple(FaultPhase(name, ("oom", "error", "sleep")) for name in ("prefill", "first", "decode"))
_DECLARED: dict[str, FaultPhase] = {}


def declare(*phases: FaultPhase) -> None:
    """Phases a lesson's processes read (the lesson registry declares every lesson's)."""
    for phase in phases:
        _DECLARED[phase.name] = phase


def _items(spec: str) -> list[tuple[FaultPhase, int, str]]:
    """Every item of ``spec``, checked against its phase: ``(phase, step, action)``."""
    known = {p.name: p for p in RUN_PHASES} | _DECLARED
    out = []
    for item in filter(None, (part.strip() for part in spec.split(","))):
        name, step, action = (item.split(":", 2) + ["", ""])[:3]
        phase = known.get(name)
        if phase is None or not step.isdigit() or not phase.admits(action):
            run = "prefill|first|decode"
            others = "; " + "; ".join(p.grammar() for p in _DECLARED.values()) if _DECLARED else ""
            raise ParameterError(f"KVSCOPE_FAULTS: {item[:60]!r} is not phase:step:action (phase is {run}, action "
                                 f"oom|error|sleep=S{others})")
        out.append((phase, int(step), action))
    return out


def parse(spec: str) -> FaultHook | None:
    """The hook a session calls at each phase and step, for the run's own phases of ``spec`` (None: none)."""
    faults = {(phase.name, step): action for phase, step, action in _items(spec) if phase in RUN_PHASES}
    if not faults:
        return None

    def hook(phase: str, step: int) -> None:
        action = faults.get((phase, step))
        if action == "oom":
            raise MemoryError(f"injected out-of-memory at {phase} step {step}")
        if action == "error":
            raise RuntimeError(f"injected failure at {phase} step {step}")
        if action and action.startswith("sleep="):
            time.sleep(_seconds(action))

    return hook


def actions(phase: FaultPhase) -> dict[int, str]:
    """A declared phase's items in ``KVSCOPE_FAULTS``, by step (a ``sleep=S`` is slept by ``act``)."""
    return {step: action for p, step, action in _items(os.environ.get("KVSCOPE_FAULTS", "")) if p == phase}


def act(action: str | None) -> str | None:
    """Carry out a ``sleep=S`` (returning None); any other action is the caller's to carry out."""
    if action and action.startswith("sleep="):
        time.sleep(_seconds(action))
        return None
    return action


def _seconds(action: str) -> float | None:
    try:
        return float(action.split("=", 1)[1])
    except ValueError:
        return None


def from_env() -> FaultHook | None:
    spec = os.environ.get("KVSCOPE_FAULTS", "")
    return parse(spec) if spec else None
