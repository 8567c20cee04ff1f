"""The trace schema: every event's fields checked from their declarations (``engine.facts.validation`` over the
dataclasses of ``engine.facts.events``), then each event checked against the run or experiment it belongs to
(positions within the model's context, bytes consistent with its KV facts, times that never go back), so that
anything :class:`Checker` accepts can be drawn.

A trace is data from anywhere: a file someone mailed, a file a fuzzer wrote. Refusing it with the line and the
field is better than drawing nonsense or running out of memory. The same checker runs when a trace is written
(``engine.output.trace``), so a trace KVScope writes is one it can read. Lessons' settings and results are typed by
their lesson; the checker is given their classes (it knows no lesson by name).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field

from engine.facts import kvformula
from engine.facts.events import (
    TRACE_EVENTS,
    AttentionStep,
    ExperimentFailed,
    ExperimentFinished,
    ExperimentPoint,
    ExperimentProgress,
    ExperimentStarted,
    HardwarePeaks,
    KVNorms,
    LayerTimes,
    LessonResult,
    LessonSettings,
    ModelFacts,
    PrefillDone,
    RunFailed,
    RunFinished,
    RunStarted,
    RunSummary,
    ServerFacts,
    TokenStep,
)
from engine.facts.fields import MAX_ATTENTION
from engine.facts.validation import FieldError, Plan, plan, short
from engine.facts.vocabulary import LessonEvent, LessonPoint, event_types

SchemaError = FieldError
BYTES_TOLERANCE = 0.05               # measured bytes may exceed the formula by this much before they are refused
ABSENT_ON_A_SERVER = ("prompt_tokens", "tokenize_ms", "prefill_ms", "kv_tokens", "kv_bytes", "reused_tokens")
PLANS: dict[str, Plan] = {cls.__name__: plan(cls) for cls in TRACE_EVENTS}


def layer_limits(facts: ModelFacts) -> list[tuple[float, int | None]]:
    """Per layer: the most bytes one position may take (the formula plus the tolerance) and the capacity."""
    limits = []
    for layer in facts.kv_layers:
        capacity = layer.capacity if layer.kind == kvformula.SLIDING else (
            None if layer.kind in (kvformula.FULL, kvformula.LATENT) else 0)
        limits.append((kvformula.bytes_per_position(layer) * (1 + BYTES_TOLERANCE), capacity))
    return limits


@dataclass
class _Run:
    facts: ModelFacts | ServerFacts
    prompt_tokens: int
    kv: bool
    limits: list[tuple[float, int | None]]
    t_ms: float = 0.0
    steps: int = 0
    prefilled: bool = False
    allocated: int = 0
    ended: bool = False
    norms_end: int = 0
    attention_step: int = -1
    timed_step: int = -1

    @property
    def remote(self) -> bool:
        return isinstance(self.facts, ServerFacts)


@dataclass
class _OpenExperiment:
    """An experiment the reader has seen start: its clock, and the model facts its events are checked against."""

    kind: str
    t_ms: float = 0.0
    ended: bool = False
    vocab_size: int = 0
    max_context: int = 0


@dataclass(frozen=True)
class LessonVocabulary:
    """What a lesson's experiment may hold in a trace: its settings and result classes, its points and its own
    events (``engine.lessons.vocabulary()`` builds one per lesson from the registry)."""

    settings: type[LessonSettings]
    result: type[LessonResult]
    points: tuple[type[LessonPoint], ...] = ()
    events: tuple[type[LessonEvent], ...] = ()


@dataclass
class Checker:
    """Turns parsed event dicts into events, in file order, refusing what cannot be drawn. ``lessons`` maps a
    lesson's kind to what its experiments may hold (``engine.lessons.vocabulary()``); the checker knows no lesson
    by name, and a lesson's own events only through it."""

    lessons: Mapping[str, LessonVocabulary] = field(default_factory=dict)
    runs: dict[str, _Run] = field(default_factory=dict)
    experiments: dict[str, _OpenExperiment] = field(default_factory=dict)

    def __post_init__(self) -> None:
        declared = event_types(e for v in self.lessons.values() for e in v.events)
        clash = declared.keys() & PLANS.keys()
        if clash:
            raise TypeError(f"a lesson's event has the name of a trace's own: {', '.join(sorted(clash))}")
        self.plans = {**PLANS, **{name: plan(cls) for name, cls in declared.items()}}

    def event(self, data: object) -> object:
        if type(data) is not dict:
            raise SchemaError(f"an event must be an object, not {short(data)}")
        kind = data.get("type")
        shape = self.plans.get(kind) if type(kind) is str else None
        if shape is None:
            raise SchemaError(f"unknown event type {short(kind)}")
        relate = _RELATIONS.get(kind, Checker.lesson_event)
        return relate(self, data, shape)

    def unfinished_runs(self) -> list[str]:
        return [run_id for run_id, run in self.runs.items() if not run.ended]

    # --- runs -------------------------------------------------------------------------------------------------
    def _run(self, event: object) -> _Run:
        return _advance(self.runs, event.run_id, event, "run")

    def run_started(self, data: dict, shape: Plan) -> RunStarted:
        event: RunStarted = shape.build(data)
        if event.run_id in self.runs:
            raise SchemaError(f"run {short(event.run_id)} starts twice")
        facts = event.model
        ids = event.prompt_ids
        if isinstance(facts, ServerFacts):                 # the server tokenizes: the ids are not known here
            if ids:
                raise SchemaError("prompt_ids has entries; a server's run has none")
            limits = []
        else:
            _check_facts(facts)
            if not all(i < facts.vocab_size for i in ids):
                raise SchemaError(f"prompt_ids must be token ids below the vocabulary size ({facts.vocab_size:,})")
            if not 0 < len(ids) < facts.max_context:
                raise SchemaError(f"prompt_ids must hold 1 to {facts.max_context - 1:,} tokens, not {len(ids):,}")
            limits = layer_limits(facts)
        if len(event.prompt_pieces) != len(ids):
            raise SchemaError(f"prompt_pieces has {len(event.prompt_pieces):,} entries; the prompt has {len(ids):,}")
        if event.experiment and event.experiment not in self.experiments:
            raise SchemaError(f"the run names experiment {short(event.experiment)}, which has not started")
        self.runs[event.run_id] = _Run(facts, len(ids), event.params.kv_cache, limits, event.t_ms)
        return event

    def prefill_done(self, data: dict, shape: Plan) -> PrefillDone:
        event: PrefillDone = shape.build(data)
        run = self._run(event)
        _local_only(run, "PrefillDone")
        if run.prefilled:
            raise SchemaError("a second PrefillDone for the same run")
        if event.reused_tokens > max(run.prompt_tokens - 1, 0):
            raise SchemaError(f"reused_tokens must be between 0 and {run.prompt_tokens - 1:,}, not "
                              f"{event.reused_tokens:,}")
        if event.reused_tokens + event.n_tokens != run.prompt_tokens:
            raise SchemaError(f"n_tokens + reused_tokens must equal the prompt's {run.prompt_tokens:,} tokens")
        if event.kv_allocated > run.facts.max_context:
            raise SchemaError(f"kv_allocated must be between 0 and {run.facts.max_context:,}")
        run.allocated = event.kv_allocated
        _kv(event, run.limits, run.prompt_tokens if run.kv else 0, run.allocated)
        run.prefilled = True
        return event

    def kv_norms(self, data: dict, shape: Plan) -> KVNorms:
        event: KVNorms = shape.build(data)
        run = self._run(event)
        _local_only(run, "KVNorms")
        seen = run.prompt_tokens + max(run.steps - 1, 0)
        first = event.first_position
        if first > seen:
            raise SchemaError(f"first_position must be between 0 and {seen:,}, not {first:,}")
        if first != run.norms_end:
            raise SchemaError(f"first_position must continue where the last KVNorms ended ({run.norms_end:,})")
        layers = run.facts.num_layers
        for name, rows in (("k_norms", event.k_norms), ("v_norms", event.v_norms)):
            span = len(rows[0]) if rows else -1
            if len(rows) != layers:
                raise SchemaError(f"{name} has {len(rows):,} entries; the model has {layers:,}")
            if span < 1 or first + span > seen:
                raise SchemaError(f"{name} must cover positions {first:,} to at most {seen:,}")
            if any(len(row) != span for row in rows):
                raise SchemaError(f"{name} must be {layers:,} rows of {span:,} norms (finite, at least 0)")
        run.norms_end = first + len(event.k_norms[0])
        return event

    def token_step(self, data: dict, shape: Plan) -> TokenStep:
        event: TokenStep = shape.build(data)
        run = self._run(event)
        if event.step != run.steps:
            raise SchemaError(f"step must be between {run.steps:,} and {run.steps:,}, not {event.step:,}")
        if run.remote:
            for name in ("position", "forward_ms", "raw_prob"):
                if getattr(event, name) is not None:
                    raise SchemaError(f"{name} must be absent (null) in a server's run")
            if event.kv_bytes_per_layer or event.kv_positions_per_layer:
                raise SchemaError("a server's run has no per-layer KV figures")
            run.steps += 1
            return event
        if not run.prefilled:
            raise SchemaError("a TokenStep before the run's PrefillDone")
        facts = run.facts
        expected = run.prompt_tokens + event.step
        if event.position != expected:
            raise SchemaError(f"position must be between {expected:,} and {expected:,}, not {short(event.position)}")
        if expected >= facts.max_context:
            raise SchemaError(f"position {expected:,} is outside the model's context ({facts.max_context:,})")
        for name in ("token_id", "forward_ms", "prob", "raw_prob"):
            if getattr(event, name) is None:
                raise SchemaError(f"{name} must be given in a local run")
        if event.token_id >= facts.vocab_size:
            raise SchemaError(f"token_id must be between 0 and {facts.vocab_size - 1:,}, not {event.token_id:,}")
        if not all(c.token_id is not None and c.token_id < facts.vocab_size for c in event.candidates):
            raise SchemaError(f"candidates must have token ids below the vocabulary size ({facts.vocab_size:,})")
        if event.kept > facts.vocab_size:
            raise SchemaError(f"kept must be between 1 and {facts.vocab_size:,}")
        _kv(event, run.limits, event.position if run.kv else 0, run.allocated)
        run.steps += 1
        return event

    def attention_step(self, data: dict, shape: Plan) -> AttentionStep:
        event: AttentionStep = shape.build(data)
        run = self._run(event)
        _local_only(run, "AttentionStep")
        if not run.steps or event.step != run.steps - 1 or event.step == run.attention_step:
            raise SchemaError("an AttentionStep must follow its own step's TokenStep, once")
        position = run.prompt_tokens - 1 + event.step
        if event.position != position:
            raise SchemaError(f"position must be between {position:,} and {position:,}, not {event.position:,}")
        facts = run.facts
        layers = event.layers
        if layers != sorted(set(layers)) or any(i >= facts.num_layers for i in layers):
            raise SchemaError(f"layers must be distinct layer numbers below {facts.num_layers:,}, in order")
        firsts = event.first_positions
        if len(firsts) != len(layers) or any(f > position for f in firsts):
            raise SchemaError(f"first_positions must give one position from 0 to {position:,} per layer")
        grids = event.weights
        heads = len(grids[0]) if grids else 0
        if len(grids) != len(layers) or (layers and not 1 <= heads <= facts.num_heads):
            raise SchemaError(f"weights must hold 1 to {facts.num_heads:,} heads for each of the {len(layers):,} "
                              "layers")
        if heads * sum(position + 1 - f for f in firsts) > MAX_ATTENTION:
            raise SchemaError(f"weights hold more than {MAX_ATTENTION:,} values")
        for grid, first in zip(grids, firsts):
            keys = position + 1 - first
            if len(grid) != heads or any(len(row) != keys for row in grid):
                raise SchemaError(f"weights must be {heads:,} rows of {keys:,} weights from 0 to 1 per layer")
        run.attention_step = event.step
        return event

    def layer_times(self, data: dict, shape: Plan) -> LayerTimes:
        event: LayerTimes = shape.build(data)
        run = self._run(event)
        _local_only(run, "LayerTimes")
        if not run.steps or event.step != run.steps - 1 or event.step == run.timed_step:
            raise SchemaError("a LayerTimes must follow its own step's TokenStep, once")
        layers = run.facts.num_layers
        if len(event.ms) != layers or len(event.devices) != layers:
            raise SchemaError(f"ms and devices must give one entry for each of the {layers:,} layers")
        run.timed_step = event.step
        return event

    def run_ended(self, data: dict, shape: Plan) -> RunFinished | RunFailed:
        """A run's last event, finished or failed alike: its summary checked against the run, the run closed."""
        event: RunFinished | RunFailed = shape.build(data)
        run = self._run(event)
        _summary(event.summary, run)
        run.ended = True
        summary = event.summary
        if run.remote and summary.server_cached_tokens is None and summary.reused_tokens is not None:
            # written before the server's figure had its own name: it was the server's run's reused_tokens
            summary = dataclasses.replace(summary, server_cached_tokens=summary.reused_tokens, reused_tokens=None)
            event = dataclasses.replace(event, summary=summary)
        return event

    # --- experiments and the machine ----------------------------------------------------------------------
    def peaks(self, data: dict, shape: Plan) -> HardwarePeaks:
        return shape.build(data)

    def _lesson(self, kind: object) -> LessonVocabulary:
        vocabulary = self.lessons.get(kind) if type(kind) is str else None
        if vocabulary is None:
            known = ", ".join(self.lessons) or "none"
            raise SchemaError(f"kind must be one of {known}, not {short(kind)}")
        return vocabulary

    def experiment_started(self, data: dict, shape: Plan) -> ExperimentStarted:
        settings_cls = self._lesson(data.get("kind")).settings
        settings = plan(settings_cls).build(data.get("settings"), "settings") if "settings" in data else None
        event: ExperimentStarted = shape.build({**data, "settings": settings} if settings is not None else data)
        if event.exp_id in self.experiments:
            raise SchemaError(f"experiment {short(event.exp_id)} starts twice")
        model = event.model
        self.experiments[event.exp_id] = _OpenExperiment(event.kind, event.t_ms,
                                                         vocab_size=getattr(model, "vocab_size", 0),
                                                         max_context=getattr(model, "max_context", 0) or 0)
        return event

    def _experiment(self, event: object) -> _OpenExperiment:
        return _advance(self.experiments, event.exp_id, event, "experiment")

    def experiment_progress(self, data: dict, shape: Plan) -> ExperimentProgress:
        event: ExperimentProgress = shape.build(data)
        self._experiment(event)
        if event.done > event.total:
            raise SchemaError(f"done must be between 0 and {event.total:,}, not {event.done:,}")
        return event

    def experiment_point(self, data: dict, shape: Plan) -> ExperimentPoint:
        """A point is one of the points its lesson declares (by its series), with that point's figures."""
        event: ExperimentPoint = shape.build(data)
        points = self.lessons[self._experiment(event).kind].points
        kind = next((p for p in points if p.matches(event.series)), None)
        if kind is None:
            raise SchemaError(f"series must be one of {', '.join(p.series for p in points)}, not "
                              f"{short(event.series)}")
        kind.check(event.values)
        return event

    def lesson_event(self, data: dict, shape: Plan) -> LessonEvent:
        """An event a lesson declares (``engine.facts.vocabulary.LessonEvent``): it belongs to an experiment of
        that lesson, and checks itself against the model the experiment runs."""
        event: LessonEvent = shape.build(data)
        experiment = self._experiment(event)
        vocabulary = self.lessons[experiment.kind]
        if type(event) not in vocabulary.events:
            raise SchemaError(f"a {experiment.kind} experiment reports no {type(event).__name__}")
        event.check(experiment.vocab_size, experiment.max_context)
        return event

    def experiment_finished(self, data: dict, shape: Plan) -> ExperimentFinished:
        exp_id = data.get("exp_id")
        open_one = self.experiments.get(exp_id) if type(exp_id) is str else None
        if open_one is None:
            return shape.build(data)        # the generic checks say what is wrong; _advance says it never started
        result_cls = self._lesson(open_one.kind).result
        result = plan(result_cls).build(data.get("result"), "result") if "result" in data else None
        event: ExperimentFinished = shape.build({**data, "result": result} if result is not None else data)
        self._experiment(event).ended = True
        return event

    def experiment_failed(self, data: dict, shape: Plan) -> ExperimentFailed:
        event: ExperimentFailed = shape.build(data)
        self._experiment(event).ended = True
        return event


def _check_facts(facts: ModelFacts) -> None:
    layers = facts.num_layers
    if len(facts.layer_devices) != layers:
        raise SchemaError(f"layer_devices has {len(facts.layer_devices):,} entries; the model has {layers:,}")
    if len(facts.kv_layers) != layers:
        raise SchemaError(f"kv_layers has {len(facts.kv_layers):,} entries; the model has {layers:,}")
    for i, layer in enumerate(facts.kv_layers):
        if (layer.kind == kvformula.SLIDING) != (layer.capacity is not None):
            raise SchemaError(f"kv_layers[{i}]: capacity must be given for a sliding layer and only for one")
        if layer.capacity is not None and layer.capacity > facts.max_context:
            raise SchemaError("a sliding layer's capacity exceeds the model's context")
        if layer.kind in kvformula.HOLDS_POSITIONS:                # an attention layer holds something
            for name in ("kv_heads", "k_dim", "v_dim", "dtype_bytes"):
                if getattr(layer, name) < 1:
                    raise SchemaError(f"kv_layers[{i}]: {name} must be between 1 and its limit, not 0")


def _local_only(run: _Run, kind: str) -> None:
    if run.remote:
        raise SchemaError(f"a server's run has no {kind}: the server does not reveal it")


def _summary(summary: RunSummary, run: _Run) -> None:
    if run.remote:
        if summary.token_ids:
            raise SchemaError("a server's summary has no token ids")
        return
    for name in ABSENT_ON_A_SERVER:
        if getattr(summary, name) is None:
            raise SchemaError(f"summary.{name} must be given in a local run")
    vocab = run.facts.vocab_size
    if not all(i < vocab for i in summary.token_ids):
        raise SchemaError(f"token_ids must be token ids below the vocabulary size ({vocab:,})")


def _kv(event: PrefillDone | TokenStep, limits: list[tuple[float, int | None]], positions: int,
        allocated: int = 0) -> None:
    """Per-layer [k, v] bytes and positions held: one per layer, never more than the layer can hold. One pass of
    plain comparisons: a full-context trace has a few hundred thousand of these."""
    sizes, held = event.kv_bytes_per_layer, event.kv_positions_per_layer
    if len(sizes) != len(limits):
        raise SchemaError(f"kv_bytes_per_layer has {len(sizes):,} entries; the model has {len(limits):,}")
    if held and len(held) != len(limits):
        raise SchemaError(f"kv_positions_per_layer must list {len(limits):,} layers")
    if event.kv_storage_per_layer and len(event.kv_storage_per_layer) != len(limits):
        raise SchemaError(f"kv_storage_per_layer must list {len(limits):,} layers")
    room = max(positions, allocated)                      # a static cache holds its allocation from the start
    most = [per * (room if cap is None else min(room, cap)) for per, cap in limits]
    if not all(len(pair) == 2 and pair[0] + pair[1] <= m for pair, m in zip(sizes, most)):
        for i, (pair, m) in enumerate(zip(sizes, most)):         # the slow path, only to name the field
            if len(pair) != 2:
                raise SchemaError(f"kv_bytes_per_layer[{i}] must be two whole numbers of bytes (K, V), at least 0")
            if pair[0] + pair[1] > m:
                raise SchemaError(f"kv_bytes_per_layer[{i}] says {pair[0] + pair[1]:,} bytes; this layer holds at "
                                  f"most {int(m):,} after {positions:,} positions")
    if held and any(h > positions for h in held):
        raise SchemaError(f"kv_positions_per_layer must be whole numbers between 0 and {positions:,}")


def _advance(owners: dict, ident: str, event: object, what: str):
    """The run or experiment an event belongs to, which must have started and not ended, its clock moved to
    the event's time (which may not go back)."""
    owner = owners.get(ident)
    kind = type(event).__name__
    if owner is None:
        raise SchemaError(f"{kind} belongs to {what} {short(ident)}, which has not started")
    if owner.ended:
        raise SchemaError(f"{kind} comes after {what} {short(ident)} ended")
    t = event.t_ms
    if t < owner.t_ms:
        raise SchemaError(f"t_ms goes back in time ({t:g} ms after {owner.t_ms:g} ms)")
    owner.t_ms = t
    return owner


_RELATIONS = {
    "RunStarted": Checker.run_started, "PrefillDone": Checker.prefill_done, "KVNorms": Checker.kv_norms,
    "TokenStep": Checker.token_step, "AttentionStep": Checker.attention_step, "LayerTimes": Checker.layer_times,
    "RunFinished": Checker.run_ended, "RunFailed": Checker.run_ended, "HardwarePeaks": Checker.peaks,
    "ExperimentStarted": Checker.experiment_started, "ExperimentProgress": Checker.experiment_progress,
    "ExperimentPoint": Checker.experiment_point,
    "ExperimentFinished": Checker.experiment_finished,
    "ExperimentFailed": Checker.experiment_failed,
}
assert _RELATIONS.keys() == PLANS.keys(), "every event of the trace's own has its checks"
