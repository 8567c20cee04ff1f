"""One run's forward passes, as facts: the prompt prefilled (in passes sized to stop within a second where the
window asks for it), then one decode step each time the consumer asks, through the compiled graph once one is
ready. ``Passes.steps`` yields ``Prefilled``, each ``Step`` and what a compiled graph says (``GraphSaid``); it keeps
no tally and starts no meter: the session's observer does both. Split from ``engine.run.session``, which is the
loaded model's API (prompts, runs, chats) and the run's events."""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.facts.errors import NonFiniteLogits
from engine.facts.params import GenerationParams
from engine.model import kvcache
from engine.model.compiled import Graph, cache_length
from engine.model.compiled_prefill import refused
from engine.model.layer_clock import LayerClock
from engine.model.sampling import Choice, choose, make_generator
from engine.run.model_session import PassingSession
from engine.run.options import RunOptions

Sink = Callable[[object], None]
Waiter = Callable[[int], None]
STOPPABLE = -1       # RunOptions.prefill_chunk: passes sized to stop within a second (see RunOptions)
PASS_S = 0.5         # the longest a prefill pass may take when the run must stop within a second
FIRST_PASS = 32      # a stoppable prefill's first pass on a session that has measured no prefill yet
UNCHUNKED = 64       # ...and the longest prompt it sends in one pass before it has measured one


@dataclass
class RunState:
    """What a run's loop finds out and changes as it goes (its cache and where it came from, the prefill's passes,
    the compiled graph's progress), in one object the loop owns; what was asked for stays frozen beside it."""

    layer_clock: LayerClock | None = None
    reused: int = 0
    cache: Any = None
    cache_note: str = ""
    allocated: int = 0
    tokenize_ms: float = 0.0
    prefill_chunk: int = 0          # this run's first prefill pass, in positions (0: the prompt in one pass)
    graph_started: bool = False     # this run started building its compiled graph
    graph_noted: bool = False       # the run has said why it decodes eagerly
    evictor: Any = None             # a cache kept as sinks:S+W: what it keeps after every pass
    switched: bool = False          # decode has gone through the compiled graph
    prefill_read_ms: float | None = None    # the compiled prefill package read for this run (an earlier launch's)
    prefill_packaged: bool = False  # the prompt's first pass went through the compiled prefill package


@dataclass(frozen=True)
class RunRequest:
    """One run as asked: the ids to prefill (all of them; ``state.reused`` come from a kept cache), where events
    go, how to stop, and the clock it started on. Frozen: what the run finds out as it goes is ``state``."""

    ids: list[int]
    prompt: str
    kind: str
    params: GenerationParams
    emit: Sink
    cancelled: Callable[[], bool]
    before_step: Waiter | None
    t0: float
    options: RunOptions = field(default_factory=RunOptions)
    state: RunState = field(default_factory=RunState)


@dataclass
class Step:
    """One forward pass and its token: step 0 from the prefill's last position, then one per decode step."""

    index: int
    position: int                  # where the chosen token will sit in the cache
    choice: Choice
    forward_ms: float
    latency_ms: float
    kv: list[list[int]]
    held: list[int]
    storage: list[int] = field(default_factory=list)
    compiled: bool = False         # decoded through the compiled graph


@dataclass
class Prefilled:
    """The prompt's forward pass has ended (before its first token is chosen): what the cache holds now."""

    forward_ms: float
    kv: list[list[int]]
    held: list[int]
    storage: list[int]
    passes: int = 1
    compiled: bool = False      # the first pass went through the compiled prefill package


@dataclass
class GraphSaid:
    """What the run's compiled graph said, as the steps meet it: how long its build was waited for (or took
    beside the decode), whether it was read from an earlier launch, and notes for the run (eager steps and why)."""

    compile_ms: float | None = None
    loaded: bool | None = None
    notes: list[str] = field(default_factory=list)


class Passes:
    """The forward passes of the session's runs, one run at a time."""

    def __init__(self, session: PassingSession) -> None:
        # An engine.run.session.Session (its model, clock, compiled graphs, faults), which owns this object. Held
        # weakly: a strong reference back made a cycle, so a replaced session, with its model, waited for the
        # garbage collector, and the window freezes the collector's view after each load (every model ever
        # loaded stayed resident).
        self.session = weakref.proxy(session)

    def first_pass(self, request: RunRequest) -> int:
        """How many positions the prompt's first pass takes (0: all of them, one pass). Chunks need the KV cache
        and a cache that keeps every position (eviction between passes would move them); attention is recorded
        over one pass."""
        chunk, params = request.options.prefill_chunk, request.params
        left = len(request.ids) - request.state.reused
        if not chunk or not params.kv_cache or params.capture_attention or params.kv_method.startswith(
                ("sinks", "h2o")):
            return 0
        if chunk != STOPPABLE:
            return chunk if chunk < left else 0
        return self.stoppable_pass(left)

    def stoppable_pass(self, left: int) -> int:
        """A pass that takes at most ``PASS_S`` at the measured rate (a power of two, at least 16), or 0 when the
        rest of the prompt fits in one such pass."""
        if self.session.prefill_rate is None:
            return 0 if left <= UNCHUNKED else FIRST_PASS
        fits = self.session.prefill_rate * PASS_S
        if left <= fits:
            return 0
        return max(16, 1 << max(int(fits).bit_length() - 1, 0))

    def steps(self, request: RunRequest) -> Iterator[Prefilled | Step | GraphSaid]:
        """Prefill (``Prefilled`` once its pass ends, then step 0: its token), then one decode step each time the
        consumer asks for the next token: forward, sample, read the cache; what a compiled graph says comes as a
        ``GraphSaid`` before the step it concerns. Facts only: the consumer (``_Observer``) keeps the tally and the
        CPU meter. ``request.state.cache`` is the live cache throughout (the observer reads norms from it)."""
        state = request.state
        params, clock, ids, reused = request.params, self.session.clock, request.ids, state.reused
        generator = make_generator(self.session.device, params.seed)
        sequence = torch.tensor([ids], device=self.session.device)                 # [1, n]
        self.fault("prefill", 0)
        needed = min(len(ids) + params.max_new_tokens, self.session.facts.max_context)
        if params.compiled:
            needed = cache_length(needed, self.session.facts.max_context)    # runs share a graph per length
        state.allocated = needed if params.static_cache and params.kv_cache and state.cache is None else 0
        compressed = params.kv_method != "full"
        if compressed:                                      # quantized or evicted: its own cache from the start
            state.cache, state.evictor = self.compressed_cache(params.kv_method)
        chunk, first, passes, packaged = state.prefill_chunk, reused, 0, False
        if params.compiled and self.session.compiled_prefill is not None and state.cache is None:
            state.prefill_read_ms = self.session.compiled_prefill.read_saved()    # saved by an earlier launch
        self.threads_for_load()
        start = clock.mark()
        while first < len(ids):
            if passes and request.cancelled():
                return                                      # stopped between two passes of a long prompt
            last = min(first + chunk, len(ids)) if chunk else len(ids)
            began = clock.mark()
            if state.cache is None and not compressed and self.session.prefill_packaged(
                    last - first, params, request.options.offload_kv, state.layer_clock is not None):
                logits, state.cache = self.session.packaged_prefill(sequence[:, first:last], state.allocated)
                packaged = state.prefill_packaged = True
            else:
                logits, state.cache = self.session.prefill(sequence[:, first:last], params.kv_cache,
                                                             state.cache, state.allocated,
                                                             request.options.offload_kv)
            took_ms = clock.elapsed_ms(began, clock.mark())
            if took_ms > 0:
                self.session.prefill_rate = (last - first) / (took_ms / 1000.0)
            first, passes = last, passes + 1
            if chunk and request.options.prefill_chunk == STOPPABLE:     # the next pass from this one's time
                chunk = self.stoppable_pass(len(ids) - first) or len(ids) - first
        if state.evictor is not None:
            state.evictor.after_pass(state.cache, len(ids))
        forward_end = clock.mark()
        cached = self.read_cache(state.cache)
        yield Prefilled(clock.elapsed_ms(start, forward_end), *cached, passes=passes,   # measured, whatever follows
                        compiled=packaged)
        self.fault("first", 0)
        choice = choose(logits, params, generator)
        end = clock.mark()
        position = len(ids)
        yield Step(0, position, choice, clock.elapsed_ms(start, forward_end), clock.elapsed_ms(start, end), *cached)
        graph = None
        if params.compiled:
            graph, waited_ms = self.compiled_graph(request)
            if waited_ms is not None:
                yield GraphSaid(compile_ms=waited_ms, notes=self.prefill_notes(request))
        index = 0
        while True:
            token = torch.tensor([choice.token_id], device=self.session.device)
            if state.cache is None:
                sequence = torch.cat([sequence, token.view(1, 1)], dim=1)     # [1, position + 1]
            index += 1
            self.fault("decode", index)
            compiled_now, said = self.decode_compiled(graph, index, request) if graph is not None else (False, None)
            if said is not None:
                yield said
            self.threads_for_load()
            start = clock.mark()
            logits = self.session.decode_step(token, position, state.cache, sequence,
                                      graph if compiled_now else None)
            if state.evictor is not None:
                state.evictor.after_pass(state.cache, position + 1)
            forward_end = clock.mark()
            refused = None
            try:
                choice = choose(logits, params, generator)      # checks the scores are numbers before drawing
            except NonFiniteLogits:
                if not compiled_now:
                    raise
                logits, refused = self.eager_instead(graph, index, token, position, request)
                compiled_now = False
                forward_end = clock.mark()                     # the step's forward is both passes
                choice = choose(logits, params, generator)
            end = clock.mark()
            if refused is not None:
                yield refused
            position += 1
            yield Step(index, position, choice, clock.elapsed_ms(start, forward_end), clock.elapsed_ms(start, end),
                       *self.read_cache(state.cache), compiled=compiled_now)

    def eager_instead(self, graph: Graph, index: int, token: torch.Tensor, position: int,
                      request: RunRequest) -> tuple[torch.Tensor, GraphSaid]:
        """Decode step ``index`` again, eagerly, after the compiled ``graph`` gave scores that were not numbers:
        the position it wrote is taken back first. The graph is refused for good (``CompiledDecode.refuse``:
        this process decodes eagerly from here, a later launch does not read it); what happened, in the run's
        notes. If eager's scores are not numbers either, the run fails as any other would, naming the dtype."""
        kvcache.crop_to(request.state.cache, position)
        logits = self.session.decode_step(token, position, request.state.cache, None, None)
        finite = bool(torch.isfinite(logits).all())
        why = (f"the compiled graph gave scores that were not numbers (NaN or infinity) at decode step {index:,}"
               + (", where the eager step's were numbers" if finite else ", and so did the eager step"))
        kept = self.session.compiled.refuse(graph, why) if finite else ""
        request.state.graph_noted = True                      # the run says this, not "could not be built"
        words = f"{why}: decoded eagerly from that step on" + (f" ({kept})" if kept else "")
        return logits, GraphSaid(notes=[words])

    def threads_for_load(self) -> None:
        """Fewer compute threads while other programs hold cores, all again once they let go
        (``engine.model.threads``): between passes, outside every timed one."""
        if self.session.threads is not None:
            self.session.threads.adjust()

    def compiled_graph(self, request: RunRequest) -> tuple[Graph, float | None]:
        """The compiled graph for this run's cache length: built already, built now or waited for (compile
        time, outside every step), or being built beside the decode (``RunOptions.compile_in_background``), which
        stays eager until it is ready; and how long this run waited for it (None: it did not build or wait)."""
        started = time.perf_counter()
        background = request.options.compile_in_background
        then = self.session.compiled_prefill.build if self.session.compiled_prefill is not None else None
        graph, request.state.graph_started = self.session.compiled.graph(request.state.allocated, background, then)
        waited = not background and not graph.ready.is_set()
        if waited:
            graph.ready.wait()
        read = request.state.prefill_read_ms or 0.0           # the prefill package, read before the prompt's pass
        if graph.ready.is_set() and (request.state.graph_started or waited):
            return graph, (time.perf_counter() - started) * 1000.0 + read
        return graph, read or None

    def prefill_notes(self, request: RunRequest) -> list[str]:
        """What a run that waited for its compiled graph says of the prefill package: read before its prompt
        went through, or read or built after the graph in the wait (part of the compile time), or why there is
        none."""
        prefill = self.session.compiled_prefill
        package = prefill.graph if prefill is not None else None
        if prefill is None or package is None or not package.ready.is_set():
            return []
        served = prefill.serving_words()
        if request.state.prefill_read_ms is not None:
            read = (f"the compiled prefill package, saved by an earlier launch, was read in "
                    f"{request.state.prefill_read_ms / 1000:,.1f} s (compile time)")
            if request.state.prefill_packaged:
                return [f"{read}; the prompt went through it"]
            return [f"{read}; this prompt prefilled eagerly" + (f": the package {served}" if served else "")]
        if not request.state.graph_started or request.options.compile_in_background:
            return []
        if package.step is None:
            return [f"prefill stays eager: no compiled prefill package ({package.error})"]
        how = "read (saved by an earlier launch)" if package.loaded else "built"
        return [f"the compiled prefill package was {how} in {package.compile_ms / 1000:,.1f} s after the decode graph "
                "(compile time); " + (f"it {served}" if served else "later compiled runs prefill through it")]

    def decode_compiled(self, graph: Graph, index: int, request: RunRequest) -> tuple[bool, GraphSaid | None]:
        """Whether decode step ``index`` goes through the compiled graph (from the first step boundary after it
        is built), and what the run is told, once: why it decoded eagerly (a failed build) or partly eagerly."""
        if not graph.ready.is_set():
            return False, None
        if graph.error is not None:
            if request.state.graph_noted:
                return False, None
            request.state.graph_noted = True
            if graph.refused:
                return False, GraphSaid(notes=[f"the compiled graph is not used ({graph.refused}): decoded eagerly"])
            return False, GraphSaid(notes=[f"the compiled graph could not be built ({graph.error}): decoded eagerly"])
        said = None
        if not request.state.switched:                        # the first compiled step: what the run says of its graph
            said = GraphSaid(loaded=graph.loaded and request.state.graph_started,
                             notes=[graph.note] if graph.note else [])
            if index > 1:
                said.notes.append(
                    f"steps 1-{index - 1:,} decoded eagerly while the compiled graph was built beside them, on the "
                    f"same cores (slower than a quiet eager run); compiled from step {index:,}")
                if request.state.graph_started:
                    said.compile_ms = graph.compile_ms
            if request.state.graph_started and request.options.compile_in_background and self.prefill_builds_beside():
                said.notes.append(f"from step {index:,} the compiled prefill package was built beside the decode "
                                  "(after its graph, in the same thread), on the same cores: steps slower than a "
                                  "quiet run's until it is done")
        request.state.switched = True
        return True, said

    def prefill_builds_beside(self) -> bool:
        """Whether the build that made the decode graph goes on with the prefill package (not built, not read
        already, and one the model can have)."""
        package = self.session.compiled_prefill
        return package is not None and (package.graph is None or not package.graph.ready.is_set()) \
            and refused(package.model) is None and not package.saved()

    def compressed_cache(self, name: str) -> tuple[Any, Any]:
        """A run's cache kept as ``name`` (``GenerationParams.kv_method``), and its evictor (None: quantized)."""
        from engine.facts.kv_methods import parse_method
        from engine.model import kv_compress

        method = parse_method(name)
        evictor = kv_compress.Evictor(method, self.session.facts.num_layers) if method.kind == "evicted" else None
        return kv_compress.new_cache(self.session.model, method), evictor

    def read_cache(self, cache: Any) -> tuple[list[list[int]], list[int], list[int]]:
        if cache is not None and type(cache).__name__ == "QuantizedCache":
            from engine.model import kv_compress

            return (kv_compress.held_per_layer(cache), [kv_compress.layer_positions(layer) for layer in cache.layers],
                    [])
        kv, held = kvcache.held_per_layer(cache, self.session.facts.num_layers)
        return kv, held, kvcache.storage_per_layer(cache, kv)

    def fault(self, phase: str, step: int) -> None:
        if self.session.fault_hook is not None:
            self.session.fault_hook(phase, step)
