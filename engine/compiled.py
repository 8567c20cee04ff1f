"""Compiled decode graphs: one per static-cache length, built on a twin cache so decode never waits for one.

``torch.compile`` specialises a graph on the static cache's length, and building one took 30-90 s on a 2-core
CPU the first time (11 s on a later launch, from torch's caches). Two choices follow from that. Lengths are
rounded up to a power of two (at least 256), so runs with different prompts share a graph instead of each
compiling its own. And a graph is built by one call of the
compiled forward on a *twin* cache of the same length, not on the run's cache: the run can decode eagerly
while the graph is built beside it (the window does this on a CPU) and switch at the first step boundary after
it is ready, or wait for it before its first decode step (the CLI and benchmarks do, so every decode step of
theirs is compiled). The build's wall time is the compile time; it is never inside a decode step.

Freezing (inductor folding the weights into the graph as constants) is off: on one 2-core machine it decoded
2-6% faster in bfloat16 (two runs), on another 24%, but it keeps inductor's caches from holding the graph, so
every later launch built for 28 s instead of 11 s; ``freezing`` turns it on (the benchmarks compare
both). On a GPU the graph is built in the calling thread (CUDA graphs are recorded per thread), with CUDA graphs
replaying a decode step as one launch. The graphs are cached in KVScope's cache folder.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from engine import kvcache
from engine.paths import compiled_graphs_dir

SHORTEST = 256          # the smallest static cache a compiled run allocates
# One graph per length: with powers of two from 256 a 128k-token context needs 10, past dynamo's default of 8
# (beyond which it silently decodes eagerly).
RECOMPILE_LIMIT = 32


def cache_length(needed: int, max_context: int) -> int:
    """The static cache a compiled run allocates for ``needed`` positions: the next power of two (at least
    ``SHORTEST``), never past the model's context."""
    if needed >= max_context:
        return max_context
    length = SHORTEST
    while length < needed:
        length *= 2
    return min(length, max_context)


@dataclass
class Graph:
    """A compiled decode graph for one cache length: ``ready`` is set once it is built or its build failed."""

    length: int
    ready: threading.Event = field(default_factory=threading.Event)
    compile_ms: float = 0.0
    error: str | None = None        # why the build failed (decode then stays eager), first line


class CompiledDecode:
    """The model's forward compiled once, and the graphs built for it, by cache length."""

    def __init__(self, model: Any, device: torch.device) -> None:
        self.model, self.device = model, device
        self.freezing = False                   # a CPU's weights folded into the graph as constants
        self._forward: Any = None
        self._graphs: dict[int, Graph] = {}
        self._lock = threading.Lock()           # guards _graphs
        self.build_lock = threading.Lock()      # one build at a time (held while a graph is built)

    def forward(self) -> Any:
        if self._forward is None:
            os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(compiled_graphs_dir()))
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
            if self.device.type == "cuda":
                self._forward = torch.compile(self.model.forward, mode="reduce-overhead", dynamic=False)
            else:
                self._forward = torch.compile(self.model.forward, dynamic=False,
                                              options={"freezing": self.freezing})
        return self._forward

    def graph(self, length: int, background: bool) -> tuple[Graph, bool]:
        """The graph for ``length``, and whether this call started its build. A new one is built now, or
        beside the caller when ``background`` on a CPU (CUDA graphs are recorded per thread)."""
        with self._lock:
            graph = self._graphs.get(length)
            if graph is not None:
                return graph, False
            graph = self._graphs[length] = Graph(length)
        if background and self.device.type == "cpu":
            threading.Thread(target=self._build, args=(graph,), name=f"kvscope-compile-{length}",
                             daemon=True).start()
        else:
            self._build(graph)
        return graph, True

    def graphs(self) -> list[Graph]:
        """The graphs built or being built, shortest cache first."""
        with self._lock:
            return [self._graphs[length] for length in sorted(self._graphs)]

    def _build(self, graph: Graph) -> None:
        """One compiled decode step on a twin cache of the graph's length (laid out by an eager first step),
        with the arguments every compiled decode step passes, so the run's own calls find the graph built."""
        with self.build_lock:
            started = time.perf_counter()
            try:
                with torch.inference_mode():
                    twin = kvcache.new_cache(self.model, graph.length)
                    token = torch.zeros((1, 1), dtype=torch.long, device=self.device)
                    kvcache.forward(self.model, token, twin)
                    kvcache.forward(self.forward(), token, twin, positions=torch.ones((1, 1), dtype=torch.long,
                                    device=self.device), logits_to_keep=0)
                    del twin
            except Exception as exc:  # noqa: BLE001  (a failed build leaves decode eager; the run says why)
                lines = str(exc).strip().splitlines()
                graph.error = f"{type(exc).__name__}: {lines[0] if lines else ''}"[:300]
            finally:
                graph.compile_ms = (time.perf_counter() - started) * 1000.0
                graph.ready.set()
