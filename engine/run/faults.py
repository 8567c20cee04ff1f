"""Fault injection, so failure handling can be tested on a CPU and shown on stage.

``KVSCOPE_FAULTS`` lists faults as ``phase:step:action`` separated by commas: phase ``prefill``, ``first`` (after
the prefill's pass, before its token is chosen) or ``decode``, the step at which to fire (0 for the prefill),
and the action ``oom`` (raise the out-of-memory error of the device: ``MemoryError`` on CPU), ``error`` (a
generic ``RuntimeError``) or ``sleep=SECONDS`` (a forward pass that takes that long). Example:
``KVSCOPE_FAULTS=decode:3:oom`` fails every run at its third decode step.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

from engine.facts.errors import ParameterError

FaultHook = Callable[[str, int], None]


def parse(spec: str) -> FaultHook | None:
    faults: dict[tuple[str, int], str] = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        if item.startswith("handover:"):               # the disaggregation lesson's worker reads these
            continue
        try:
            phase, step, action = item.split(":", 2)
            key = (phase, int(step))
        except ValueError:
            raise ParameterError(f"KVSCOPE_FAULTS: {item!r} is not phase:step:action") from None
        if phase not in ("prefill", "first", "decode") or not (action in ("oom", "error")
                                                              or action.startswith("sleep=")):
            raise ParameterError(f"KVSCOPE_FAULTS: {item!r}: phase is prefill|first|decode, action "
                                 "oom|error|sleep=S")
        faults[key] = action
    if not faults:
        return None

    def hook(phase: str, step: int) -> None:
        action = faults.get((phase, step))
        if action == "oom":
            raise MemoryError(f"injected out-of-memory at {phase} step {step}")
        if action == "error":
            raise RuntimeError(f"injected failure at {phase} step {step}")
        if action and action.startswith("sleep="):
            time.sleep(float(action.split("=", 1)[1]))

    return hook


def handover_hook() -> Callable[[int], str | None] | None:
    """The disaggregation lesson's prefill worker: ``handover:N:exit`` (the worker dies half-way through request
    N's bytes), ``handover:N:oom`` (no free memory for them) or ``handover:N:sleep=S`` (silent S seconds before
    sending them), from ``KVSCOPE_FAULTS``."""
    actions: dict[int, str] = {}
    for item in filter(None, (part.strip() for part in os.environ.get("KVSCOPE_FAULTS", "").split(","))):
        phase, _, rest = item.partition(":")
        if phase != "handover":
            continue
        step, _, action = rest.partition(":")
        if not step.isdigit() or not (action in ("exit", "oom") or action.startswith("sleep=")):
            raise ParameterError(f"KVSCOPE_FAULTS: {item!r}: handover:N:exit, handover:N:oom or handover:N:sleep=S")
        actions[int(step)] = action
    if not actions:
        return None

    def hook(index: int) -> str | None:
        action = actions.get(index)
        if action and action.startswith("sleep="):
            time.sleep(float(action.split("=", 1)[1]))
            return None
        return action

    return hook


def from_env() -> FaultHook | None:
    spec = os.environ.get("KVSCOPE_FAULTS", "")
    return parse(spec) if spec else None
