"""Each decoder layer's wall time in a forward pass, for a model split across devices or disk: the offloaded
layers are the slow ones, and this shows by how much.

A forward pre-hook and a forward hook on every decoder layer mark its start and end (``StepClock``: the clock on a CPU,
CUDA events on a GPU, resolved once per step). accelerate's own hook that reads an offloaded layer's weights back runs
inside the layer's forward, so the reading is in that layer's time, as it is in the step's.
"""

from __future__ import annotations

from typing import Any

import torch

from engine.model.clock import StepClock
from engine.model.models import DECODER_LAYER


class LayerClock:
    """Each of ``modules``' wall time per forward pass (default: the decoder layers)."""

    def __init__(self, model: Any, device: torch.device, modules: list[Any] | None = None) -> None:
        self.layers = modules if modules is not None else [module for name, module in model.named_modules()
                                                           if DECODER_LAYER.fullmatch(name)]
        self.clock = StepClock(device)
        self._marks: list[list[tuple[Any, Any]]] = [[] for _ in self.layers]
        self._open: list[Any] = [None] * len(self.layers)
        self._handles: list[Any] = []
        for i, layer in enumerate(self.layers):
            self._handles.append(layer.register_forward_pre_hook(lambda _m, _a, i=i: self._start(i)))
            self._handles.append(layer.register_forward_hook(lambda _m, _a, _o, i=i: self._end(i)))

    def _start(self, i: int) -> None:
        self._open[i] = self.clock.mark()

    def _end(self, i: int) -> None:
        if self._open[i] is not None:
            self._marks[i].append((self._open[i], self.clock.mark()))
            self._open[i] = None

    def take(self) -> list[float]:
        """Each layer's milliseconds since the last ``take`` (one forward pass per step), and start afresh."""
        out = [sum(self.clock.elapsed_ms(a, b) for a, b in marks) for marks in self._marks]
        for marks in self._marks:
            marks.clear()
        return out

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles: list[Any] = []


def attention_modules(model: Any) -> list[Any]:
    """Each decoder layer's attention module (its child named ``self_attn``, ``attn`` or ``attention``): what a
    clock over them times is the part of a pass spent in attention, projections and the cache read included."""
    found = []
    for name, layer in model.named_modules():
        if DECODER_LAYER.fullmatch(name):
            child = next((m for n, m in layer.named_children() if n in ("self_attn", "attn", "attention",
                                                                         "self_attention")), None)
            if child is not None:
                found.append(child)
    return found
