"""The trace schema, enforced on read: every field of every event checked for type, finiteness and bounds, and
events checked against the run they belong to (positions within the model's context, bytes consistent with its
KV facts, times that never go back), so that anything :func:`read_events` accepts can be drawn.

A trace is data from anywhere: a file someone mailed, a file a fuzzer wrote. Refusing it with the line and the
field is better than drawing nonsense or running out of memory. The checks are plain comparisons on the parsed
JSON (no reflection per event), so reading stays fast: ``make bench`` measures the rate.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from engine import kvcache
from engine.errors import ParameterError
from engine.events import (
    ATTENTION_METHODS,
    FINISH_REASONS,
    AttentionStep,
    BlockTable,
    Candidate,
    DraftPass,
    ExperimentFailed,
    ExperimentFinished,
    ExperimentPoint,
    ExperimentProgress,
    ExperimentStarted,
    HardwarePeaks,
    KVLayer,
    KVNorms,
    ModelFacts,
    PrefillDone,
    RunFailed,
    RunFinished,
    RunStarted,
    RunSummary,
    ServerFacts,
    TokenStep,
)
from engine.params import GenerationParams

MAX_LAYERS = 4096
MAX_CONTEXT = 1 << 24                # positions: 16.7 million
MAX_VOCAB = 1 << 24
MAX_HEADS = 4096
MAX_HEAD_DIM = 1 << 16
MAX_MS = 30 * 24 * 3600 * 1000.0     # a run longer than 30 days is not a run
MAX_TEXT = 1024                      # characters in one token's text
MAX_STRING = 1 << 20                 # any other string (a prompt is at most MAX_CONTEXT ids, its text 64 MiB)
MAX_PROMPT = 64 << 20
MAX_CANDIDATES = 100
MAX_VALUES = 256                     # numbers in one experiment point or summary
MAX_ATTENTION = 1 << 22              # weights in one AttentionStep (4 million: 30 layers x 9 heads x 15k keys)
MAX_BYTES = 1 << 50                  # 1 PiB: no single figure in a trace is larger
BYTES_TOLERANCE = 0.05               # measured bytes may exceed the formula by this much before they are refused
KINDS_OF_RUN = ("generate", "chat")
KINDS_OF_EXPERIMENT = ("prefill", "cache", "batch", "chat", "continuous", "dtype", "speculative", "paged",
                       "server load")
MAX_BLOCKS = 1 << 20                 # blocks in one paged cache
MAX_REQUESTS = 4096                  # requests in one batching experiment
MAX_DRAFT = 16                       # guesses in one speculative pass
LAYER_KINDS = (kvcache.FULL, kvcache.SLIDING, kvcache.STATE, kvcache.NONE)


class SchemaError(ValueError):
    """One field is wrong; the message names it (the reader adds the file and line)."""


# --- scalar checks ----------------------------------------------------------------------------------------
def _int(data: dict, name: str, low: int = 0, high: int = MAX_BYTES) -> int:
    value = data.get(name, _MISSING)
    if type(value) is not int:
        raise SchemaError(_wrong(name, value, "a whole number"))
    if not low <= value <= high:
        raise SchemaError(f"{name} must be between {low:,} and {high:,}, not {value:,}")
    return value


def _num(data: dict, name: str, low: float = 0.0, high: float = MAX_MS) -> float:
    value = data.get(name, _MISSING)
    if type(value) is int:
        value = float(value)
    elif type(value) is not float:
        raise SchemaError(_wrong(name, value, "a number"))
    if not low <= value <= high:                          # NaN fails both comparisons
        raise SchemaError(f"{name} must be between {low:g} and {high:g}, not {value!r}")
    return value


def _str(data: dict, name: str, limit: int = MAX_STRING, choices: tuple[str, ...] | None = None) -> str:
    value = data.get(name, _MISSING)
    if type(value) is not str:
        raise SchemaError(_wrong(name, value, "a string"))
    if len(value) > limit:
        raise SchemaError(f"{name} is {len(value):,} characters long; at most {limit:,} are allowed")
    if choices is not None and value not in choices:
        raise SchemaError(f"{name} must be one of {', '.join(choices)}, not {_short(value)}")
    return value


def _bool(data: dict, name: str) -> bool:
    value = data.get(name, _MISSING)
    if type(value) is not bool:
        raise SchemaError(_wrong(name, value, "true or false"))
    return value


def _list(data: dict, name: str, length: int | None = None, limit: int = MAX_CONTEXT) -> list:
    value = data.get(name, _MISSING)
    if type(value) is not list:
        raise SchemaError(_wrong(name, value, "a list"))
    if length is not None and len(value) != length:
        raise SchemaError(f"{name} has {len(value):,} entries; the model has {length:,}")
    if len(value) > limit:
        raise SchemaError(f"{name} has {len(value):,} entries; at most {limit:,} are allowed")
    return value


def _object(data: dict, name: str) -> dict:
    value = data.get(name, _MISSING)
    if type(value) is not dict:
        raise SchemaError(_wrong(name, value, "an object"))
    return value


def _fields(data: dict, cls: type, required: tuple[str, ...]) -> None:
    """No unknown fields (named, at most five, each shortened) and every required one present."""
    allowed = _FIELDS[cls]
    if len(data) > len(allowed) + 1 or not data.keys() <= allowed | {"type"}:
        unknown = [k for k in data if k not in allowed and k != "type"]
        shown = ", ".join(_short(k, 40) for k in unknown[:5]) + (f" and {len(unknown) - 5:,} more"
                                                                  if len(unknown) > 5 else "")
        raise SchemaError(f"{cls.__name__} has no field(s) {shown}")
    for name in required:
        if name not in data:
            raise SchemaError(f"{cls.__name__} is missing {name}")


class _Missing:
    def __repr__(self) -> str:
        return "nothing"


_MISSING = _Missing()


def _wrong(name: str, value: object, expected: str) -> str:
    if value is _MISSING:
        return f"{name} is missing"
    return f"{name} must be {expected}, not {_short(value)}"


def _short(value: object, limit: int = 60) -> str:
    text = repr(value) if not isinstance(value, (list, dict)) else f"a {type(value).__name__}"
    return text if len(text) <= limit else text[: limit - 1] + "…"


# --- nested values ----------------------------------------------------------------------------------------
def model_facts(data: dict) -> ModelFacts:
    _fields(data, ModelFacts, ("name", "num_layers", "kv_layers", "max_context", "vocab_size"))
    layers = _int(data, "num_layers", 1, MAX_LAYERS)
    kv_layers = [_kv_layer(item, i) for i, item in enumerate(_list(data, "kv_layers", layers))]
    devices = _list(data, "layer_devices", layers)
    if any(type(d) is not str or len(d) > 64 for d in devices):
        raise SchemaError("layer_devices must be device names (short strings)")
    context = _int(data, "max_context", 1, MAX_CONTEXT)
    if any(layer.capacity is not None and layer.capacity > context for layer in kv_layers):
        raise SchemaError("a sliding layer's capacity exceeds the model's context")
    return ModelFacts(
        name=_str(data, "name", 256), source=_str(data, "source", 4096), architecture=_str(data, "architecture", 256),
        num_layers=layers, num_heads=_int(data, "num_heads", 1, MAX_HEADS),
        head_dim=_int(data, "head_dim", 1, MAX_HEAD_DIM), hidden_size=_int(data, "hidden_size", 1, 1 << 20),
        vocab_size=_int(data, "vocab_size", 1, MAX_VOCAB), max_context=context, dtype=_str(data, "dtype", 32),
        dtype_bytes=_int(data, "dtype_bytes", 1, 16), num_params=_int(data, "num_params", 0, 1 << 50),
        device=_str(data, "device", 64), layer_devices=list(devices), kv_layers=kv_layers,
        tied_embeddings=_bool(data, "tied_embeddings") if "tied_embeddings" in data else False,
        weights=_str(data, "weights", 256) if "weights" in data else "",
        weight_bytes=_int(data, "weight_bytes", 0, MAX_BYTES) if "weight_bytes" in data else 0)


def server_facts(data: dict) -> ServerFacts:
    _fields(data, ServerFacts, ("name", "url", "engine"))
    reveals = _list(data, "reveals", limit=32) if "reveals" in data else []
    if not all(type(r) is str and len(r) <= 512 for r in reveals):
        raise SchemaError("reveals must be short strings")
    context = data.get("context")
    return ServerFacts(name=_str(data, "name", 256), url=_str(data, "url", 2048), engine=_str(data, "engine", 64),
                       context=None if context is None else _int(data, "context", 1, MAX_CONTEXT),
                       metrics=_bool(data, "metrics") if "metrics" in data else False, reveals=list(reveals))


def any_facts(data: dict) -> ModelFacts | ServerFacts:
    """A local model's facts, or a server's (they have a ``url``)."""
    return server_facts(data) if "url" in data else model_facts(data)


def _kv_layer(data: object, index: int) -> KVLayer:
    if type(data) is not dict:
        raise SchemaError(f"kv_layers[{index}] must be an object")
    try:
        _fields(data, KVLayer, ("kind",))
        kind = _str(data, "kind", 16, LAYER_KINDS)
        capacity = data.get("capacity")
        if capacity is not None:
            capacity = _int(data, "capacity", 1, MAX_CONTEXT)
        if (kind == kvcache.SLIDING) != (capacity is not None):
            raise SchemaError("capacity must be given for a sliding layer and only for one")
        low = 1 if kind in (kvcache.FULL, kvcache.SLIDING) else 0        # an attention layer holds something
        return KVLayer(kind, kv_heads=_int(data, "kv_heads", low, MAX_HEADS),
                       k_dim=_int(data, "k_dim", low, MAX_HEAD_DIM), v_dim=_int(data, "v_dim", low, MAX_HEAD_DIM),
                       dtype_bytes=_int(data, "dtype_bytes", low, 16), capacity=capacity,
                       state_bytes=_int(data, "state_bytes", 0, 1 << 40))
    except SchemaError as exc:
        raise SchemaError(f"kv_layers[{index}]: {exc}") from None


def params(data: dict) -> GenerationParams:
    _fields(data, GenerationParams, ())
    try:
        return GenerationParams(**data)
    except (ParameterError, TypeError) as exc:
        raise SchemaError(f"params: {exc}") from None


ABSENT_ON_A_SERVER = ("prompt_tokens", "tokenize_ms", "prefill_ms", "kv_tokens", "kv_bytes", "reused_tokens")


def _summary(data: dict, facts: ModelFacts | ServerFacts) -> RunSummary:
    _fields(data, RunSummary, ())
    remote = isinstance(facts, ServerFacts)
    ms = ("tokenize_ms", "prefill_ms", "ttft_ms", "decode_ms", "total_ms", "waited_ms", "compile_ms")
    counts = ("prompt_tokens", "generated_tokens", "decode_runs", "kv_tokens", "reused_tokens")
    present = {k: v for k, v in data.items() if not (remote and v is None and k in ABSENT_ON_A_SERVER)}
    absent = {k: None for k in data if k not in present}
    values: dict = {name: _num(present, name) for name in ms if name in present}
    values.update({name: _int(present, name, 0, MAX_CONTEXT) for name in counts if name in present})
    values.update(absent)
    if "kv_bytes" in present:
        values["kv_bytes"] = _int(present, "kv_bytes", 0, MAX_BYTES)
    if "server_timings" in data:
        values["server_timings"] = _plain(_object(data, "server_timings"), "server_timings")
    if "text" in data:
        values["text"] = _str(data, "text", MAX_PROMPT)
    if "token_ids" in data:
        values["token_ids"] = _token_ids(data, "token_ids", facts) if not remote else _list(data, "token_ids", 0)
    if data.get("cpu_share") is not None:
        values["cpu_share"] = _num(data, "cpu_share", 0.0, 1e3)
    return RunSummary(**values)


def _token_ids(data: dict, name: str, facts: ModelFacts) -> list[int]:
    ids = _list(data, name)
    vocab = facts.vocab_size
    if not all(type(i) is int and 0 <= i < vocab for i in ids):
        raise SchemaError(f"{name} must be token ids below the vocabulary size ({vocab:,})")
    return ids


def _candidates(data: dict, facts: ModelFacts | ServerFacts) -> list[Candidate]:
    items = _list(data, "candidates", limit=MAX_CANDIDATES)
    remote = isinstance(facts, ServerFacts)
    vocab = 0 if remote else facts.vocab_size
    try:
        out = [Candidate(c["token_id"], c["text"], c["p_raw"], c["p_final"]) for c in items if len(c) == 4]
    except (KeyError, TypeError):
        out = []
    if len(out) != len(items) or not all(
            (c.token_id is None or type(c.token_id) is int and 0 <= c.token_id < MAX_VOCAB if remote
             else type(c.token_id) is int and 0 <= c.token_id < vocab)
            and type(c.text) is str and len(c.text) <= MAX_TEXT
            and _probability(c.p_raw) and _probability(c.p_final) for c in out):
        raise SchemaError("candidates must be objects with a token id in the vocabulary, a short text and "
                          "probabilities p_raw and p_final in [0, 1]")
    return out


def _probability(value: object) -> bool:
    return (type(value) is float or type(value) is int) and 0.0 <= value <= 1.0


def _kv(data: dict, limits: list[tuple[float, int | None]], positions: int,
        allocated: int = 0) -> tuple[list[list[int]], list[int]]:
    """Per-layer [k, v] bytes and positions held: whole numbers, never more than the layer can hold. One pass
    of plain comparisons: a full-context trace has a few hundred thousand of these."""
    sizes = _list(data, "kv_bytes_per_layer", len(limits))
    held = data.get("kv_positions_per_layer", [])
    if type(held) is not list or (held and len(held) != len(limits)):
        raise SchemaError(f"kv_positions_per_layer must list {len(limits):,} layers")
    room = max(positions, allocated)                      # a static cache holds its allocation from the start
    most = [per * (room if cap is None else min(room, cap)) for per, cap in limits]
    if not all(type(pair) is list and len(pair) == 2 and type(pair[0]) is int and type(pair[1]) is int
               and pair[0] >= 0 and pair[1] >= 0 and pair[0] + pair[1] <= m for pair, m in zip(sizes, most)):
        for i, (pair, m) in enumerate(zip(sizes, most)):         # the slow path, only to name the field
            if type(pair) is not list or len(pair) != 2 or type(pair[0]) is not int or type(pair[1]) is not int \
                    or pair[0] < 0 or pair[1] < 0:
                raise SchemaError(f"kv_bytes_per_layer[{i}] must be two whole numbers of bytes (K, V), at least 0")
            if pair[0] + pair[1] > m:
                raise SchemaError(f"kv_bytes_per_layer[{i}] says {pair[0] + pair[1]:,} bytes; this layer holds at "
                                  f"most {int(m):,} after {positions:,} positions")
    if held and not all(type(h) is int and 0 <= h <= positions for h in held):
        raise SchemaError(f"kv_positions_per_layer must be whole numbers between 0 and {positions:,}")
    return sizes, held


def layer_limits(facts: ModelFacts) -> list[tuple[float, int | None]]:
    """Per layer: the most bytes one position may take (the formula plus the tolerance) and the capacity."""
    limits = []
    for layer in facts.kv_layers:
        capacity = layer.capacity if layer.kind == kvcache.SLIDING else (None if layer.kind == kvcache.FULL else 0)
        limits.append((kvcache.bytes_per_position(layer) * (1 + BYTES_TOLERANCE), capacity))
    return limits


# --- the reader: events in order, each checked against its run --------------------------------------------
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

    @property
    def remote(self) -> bool:
        return isinstance(self.facts, ServerFacts)


@dataclass
class _Experiment:
    t_ms: float = 0.0
    ended: bool = False
    vocab_size: int = 0
    max_context: int = 0


@dataclass
class Checker:
    """Turns parsed event dicts into events, in file order, refusing what cannot be drawn."""

    runs: dict[str, _Run] = field(default_factory=dict)
    experiments: dict[str, _Experiment] = field(default_factory=dict)

    def event(self, data: object) -> object:
        if type(data) is not dict:
            raise SchemaError(f"an event must be an object, not {_short(data)}")
        kind = data.get("type")
        build = _BUILDERS.get(kind) if type(kind) is str else None
        if build is None:
            raise SchemaError(f"unknown event type {_short(kind)}")
        return build(self, data)

    def unfinished_runs(self) -> list[str]:
        return [run_id for run_id, run in self.runs.items() if not run.ended]

    # --- runs ---
    def _run(self, data: dict) -> tuple[str, _Run]:
        return _advance(self.runs, data, "run_id", "run")

    def run_started(self, data: dict) -> RunStarted:
        _fields(data, RunStarted, ("run_id", "model", "params", "prompt_ids"))
        run_id = _str(data, "run_id", 64)
        if run_id in self.runs:
            raise SchemaError(f"run {_short(run_id)} starts twice")
        facts = any_facts(_object(data, "model"))
        settings = params(_object(data, "params"))
        if isinstance(facts, ServerFacts):                 # the server tokenizes: the ids are not known here
            ids = _list(data, "prompt_ids", 0)
        else:
            ids = _token_ids(data, "prompt_ids", facts)
            if not 0 < len(ids) < facts.max_context:
                raise SchemaError(f"prompt_ids must hold 1 to {facts.max_context - 1:,} tokens, not {len(ids):,}")
        pieces = _list(data, "prompt_pieces", len(ids))
        if not all(type(p) is str and len(p) <= MAX_TEXT for p in pieces):
            raise SchemaError("prompt_pieces must be short strings")
        event = RunStarted(
            run_id=run_id, label=_str(data, "label", 512), model=facts, params=settings,
            prompt=_str(data, "prompt", MAX_PROMPT), prompt_ids=ids, prompt_pieces=pieces,
            started_at=_str(data, "started_at", 64), t_ms=_num(data, "t_ms") if "t_ms" in data else 0.0,
            kind=_str(data, "kind", 16, KINDS_OF_RUN) if "kind" in data else "generate",
            experiment=_str(data, "experiment", 64) if "experiment" in data else "")
        if event.experiment and event.experiment not in self.experiments:
            raise SchemaError(f"the run names experiment {_short(event.experiment)}, which has not started")
        limits = [] if isinstance(facts, ServerFacts) else layer_limits(facts)
        self.runs[run_id] = _Run(facts, len(ids), settings.kv_cache, limits, event.t_ms)
        return event

    def prefill_done(self, data: dict) -> PrefillDone:
        _fields(data, PrefillDone, ("run_id", "t_ms", "n_tokens", "kv_bytes_per_layer"))
        run_id, run = self._run(data)
        self._local_only(run, "PrefillDone")
        if run.prefilled:
            raise SchemaError("a second PrefillDone for the same run")
        reused = _int(data, "reused_tokens", 0, run.prompt_tokens - 1) if "reused_tokens" in data else 0
        n = _int(data, "n_tokens", 0, run.prompt_tokens)
        if reused + n != run.prompt_tokens:
            raise SchemaError(f"n_tokens + reused_tokens must equal the prompt's {run.prompt_tokens:,} tokens")
        run.allocated = _int(data, "kv_allocated", 0, run.facts.max_context) if "kv_allocated" in data else 0
        sizes, held = _kv(data, run.limits, run.prompt_tokens if run.kv else 0, run.allocated)
        run.prefilled = True
        return PrefillDone(run_id, run.t_ms, n, _num(data, "tokenize_ms"), _num(data, "forward_ms"), sizes, reused,
                           held, _str(data, "cache_note", 1024) if "cache_note" in data else "", run.allocated)

    def kv_norms(self, data: dict) -> KVNorms:
        _fields(data, KVNorms, ("run_id", "t_ms", "first_position", "k_norms", "v_norms"))
        run_id, run = self._run(data)
        self._local_only(run, "KVNorms")
        seen = run.prompt_tokens + max(run.steps - 1, 0)
        first = _int(data, "first_position", 0, seen)
        if first != run.norms_end:
            raise SchemaError(f"first_position must continue where the last KVNorms ended ({run.norms_end:,})")
        layers = run.facts.num_layers
        grids = []
        for name in ("k_norms", "v_norms"):
            rows = _list(data, name, layers)
            span = len(rows[0]) if rows and type(rows[0]) is list else -1
            if span < 1 or first + span > seen:
                raise SchemaError(f"{name} must cover positions {first:,} to at most {seen:,}")
            for row in rows:
                if type(row) is not list or len(row) != span or not all(
                        (type(v) is float or type(v) is int) and 0.0 <= v < 1e30 for v in row):
                    raise SchemaError(f"{name} must be {layers:,} rows of {span:,} norms (finite, at least 0)")
            grids.append(rows)
        run.norms_end = first + span
        return KVNorms(run_id, run.t_ms, first, grids[0], grids[1])

    @staticmethod
    def _local_only(run: _Run, kind: str) -> None:
        if run.remote:
            raise SchemaError(f"a server's run has no {kind}: the server does not reveal it")

    def token_step(self, data: dict) -> TokenStep:
        _fields(data, TokenStep, ("run_id", "t_ms", "step", "position", "token_id", "kv_bytes_per_layer"))
        run_id, run = self._run(data)
        if run.remote:
            return self._server_token(data, run_id, run)
        if not run.prefilled:
            raise SchemaError("a TokenStep before the run's PrefillDone")
        step = _int(data, "step", run.steps, run.steps)
        position = _int(data, "position", run.prompt_tokens + step, run.prompt_tokens + step)
        if position >= run.facts.max_context:
            raise SchemaError(f"position {position:,} is outside the model's context ({run.facts.max_context:,})")
        facts = run.facts
        token = _int(data, "token_id", 0, facts.vocab_size - 1)
        sizes, held = _kv(data, run.limits, position if run.kv else 0, run.allocated)
        run.steps += 1
        return TokenStep(
            run_id=run_id, t_ms=run.t_ms, step=step, position=position, token_id=token,
            text=_str(data, "text", MAX_TEXT), special=_bool(data, "special"),
            phase=_str(data, "phase", 16, ("prefill", "decode")), latency_ms=_num(data, "latency_ms"),
            forward_ms=_num(data, "forward_ms"), prob=_num(data, "prob", 0.0, 1.0),
            raw_prob=_num(data, "raw_prob", 0.0, 1.0), candidates=_candidates(data, facts), kv_bytes_per_layer=sizes,
            kv_positions_per_layer=held, waited_ms=_num(data, "waited_ms") if "waited_ms" in data else 0.0,
            kept=_int(data, "kept", 1, facts.vocab_size) if "kept" in data else 1)

    def attention_step(self, data: dict) -> AttentionStep:
        _fields(data, AttentionStep, ("run_id", "t_ms", "step", "position", "layers", "first_positions", "weights",
                                      "capture_ms", "method"))
        run_id, run = self._run(data)
        self._local_only(run, "AttentionStep")
        step = _int(data, "step", run.steps - 1, run.steps - 1) if run.steps else -1
        if step < 0 or step == run.attention_step:
            raise SchemaError("an AttentionStep must follow its own step's TokenStep, once")
        position = _int(data, "position", run.prompt_tokens - 1 + step, run.prompt_tokens - 1 + step)
        facts = run.facts
        layers = _list(data, "layers", limit=facts.num_layers)
        if not all(type(i) is int for i in layers) or layers != sorted(set(layers)) or (
                layers and not 0 <= layers[0] <= layers[-1] < facts.num_layers):
            raise SchemaError(f"layers must be distinct layer numbers below {facts.num_layers:,}, in order")
        firsts = _list(data, "first_positions", len(layers))
        if len(firsts) != len(layers) or not all(type(f) is int and 0 <= f <= position for f in firsts):
            raise SchemaError(f"first_positions must give one position from 0 to {position:,} per layer")
        grids = _list(data, "weights", len(layers))
        heads = len(grids[0]) if grids and type(grids[0]) is list else 0
        if len(grids) != len(layers) or (layers and not 1 <= heads <= facts.num_heads):
            raise SchemaError(f"weights must hold 1 to {facts.num_heads:,} heads for each of the {len(layers):,} "
                              "layers")
        if heads * sum(position + 1 - f for f in firsts) > MAX_ATTENTION:
            raise SchemaError(f"weights hold more than {MAX_ATTENTION:,} values")
        for grid, first in zip(grids, firsts):
            keys = position + 1 - first
            if type(grid) is not list or len(grid) != heads or not all(
                    type(row) is list and len(row) == keys and all(
                        (type(w) is float or type(w) is int) and 0.0 <= w <= 1.0 for w in row) for row in grid):
                raise SchemaError(f"weights must be {heads:,} rows of {keys:,} weights from 0 to 1 per layer")
        run.attention_step = step
        return AttentionStep(run_id, run.t_ms, step, position, layers, firsts, grids, _num(data, "capture_ms"),
                             _str(data, "method", 32, ATTENTION_METHODS))

    def _server_token(self, data: dict, run_id: str, run: _Run) -> TokenStep:
        """A token from a server: the client's times and text; what only the engine knows must be absent."""
        step = _int(data, "step", run.steps, run.steps)
        for name in ("position", "forward_ms", "raw_prob"):
            if data.get(name) is not None:
                raise SchemaError(f"{name} must be absent (null) in a server's run")
        token = data.get("token_id")
        if token is not None:                            # some servers (llama-server) send the id with logprobs
            token = _int(data, "token_id", 0, MAX_VOCAB - 1)
        if data.get("kv_bytes_per_layer") or data.get("kv_positions_per_layer"):
            raise SchemaError("a server's run has no per-layer KV figures")
        prob = data.get("prob")
        run.steps += 1
        return TokenStep(
            run_id=run_id, t_ms=run.t_ms, step=step, position=None, token_id=token, text=_str(data, "text", MAX_TEXT),
            special=_bool(data, "special"), phase=_str(data, "phase", 16, ("prefill", "decode")),
            latency_ms=_num(data, "latency_ms"), forward_ms=None,
            prob=None if prob is None else _num(data, "prob", 0.0, 1.0), raw_prob=None,
            candidates=_candidates(data, run.facts), kv_bytes_per_layer=[], kv_positions_per_layer=[],
            waited_ms=_num(data, "waited_ms") if "waited_ms" in data else 0.0, kept=1)

    def run_finished(self, data: dict) -> RunFinished:
        _fields(data, RunFinished, ("run_id", "t_ms", "reason", "summary"))
        run_id, run = self._run(data)
        event = RunFinished(run_id, run.t_ms, _str(data, "reason", 32, FINISH_REASONS),
                            _summary(_object(data, "summary"), run.facts))
        run.ended = True
        return event

    def run_failed(self, data: dict) -> RunFailed:
        _fields(data, RunFailed, ("run_id", "t_ms", "error", "message", "summary"))
        run_id, run = self._run(data)
        event = RunFailed(run_id, run.t_ms, _str(data, "error", 128), _str(data, "message", 4096),
                          _summary(_object(data, "summary"), run.facts))
        run.ended = True
        return event

    # --- experiments and the machine ---
    def peaks(self, data: dict) -> HardwarePeaks:
        _fields(data, HardwarePeaks, ("device", "dtype", "flops_per_s", "bytes_per_s"))
        share = data.get("cpu_share")
        return HardwarePeaks(_str(data, "device", 256), _str(data, "dtype", 32),
                             _num(data, "flops_per_s", 1.0, 1e20), _num(data, "bytes_per_s", 1.0, 1e18),
                             _bool(data, "cached") if "cached" in data else False,
                             None if share is None else _num(data, "cpu_share", 0.0, 1e3),
                             _str(data, "measured", 32) if "measured" in data else "")

    def _experiment(self, data: dict) -> tuple[str, _Experiment]:
        return _advance(self.experiments, data, "exp_id", "experiment")

    def experiment_started(self, data: dict) -> ExperimentStarted:
        _fields(data, ExperimentStarted, ("exp_id", "t_ms", "kind", "model", "settings"))
        exp_id = _str(data, "exp_id", 64)
        if exp_id in self.experiments:
            raise SchemaError(f"experiment {_short(exp_id)} starts twice")
        peaks = data.get("peaks")
        event = ExperimentStarted(exp_id, _num(data, "t_ms"), _str(data, "kind", 32, KINDS_OF_EXPERIMENT),
                                  any_facts(_object(data, "model")), _plain(_object(data, "settings"), "settings"),
                                  None if peaks is None else self.peaks(_object(data, "peaks")))
        model = event.model
        self.experiments[exp_id] = _Experiment(event.t_ms, vocab_size=getattr(model, "vocab_size", 0),
                                               max_context=getattr(model, "max_context", 0) or 0)
        return event

    def experiment_progress(self, data: dict) -> ExperimentProgress:
        _fields(data, ExperimentProgress, ("exp_id", "t_ms", "done", "total", "message"))
        exp_id, experiment = self._experiment(data)
        total = _int(data, "total", 0, 1 << 20)
        return ExperimentProgress(exp_id, experiment.t_ms, _int(data, "done", 0, total), total,
                                  _str(data, "message", 1024))

    def experiment_point(self, data: dict) -> ExperimentPoint:
        _fields(data, ExperimentPoint, ("exp_id", "t_ms", "series", "values"))
        exp_id, experiment = self._experiment(data)
        values = _object(data, "values")
        if len(values) > MAX_VALUES or not all(
                type(k) is str and len(k) <= 64 and (type(v) is int or type(v) is float) and math.isfinite(v)
                and abs(v) < 1e30 for k, v in values.items()):
            raise SchemaError(f"values must be at most {MAX_VALUES} named finite numbers")
        return ExperimentPoint(exp_id, experiment.t_ms, _str(data, "series", 64), values)

    def draft_pass(self, data: dict) -> DraftPass:
        _fields(data, DraftPass, ("exp_id", "t_ms", "repeat", "index", "position", "drafted", "drafted_text",
                                  "accepted", "token_id", "text", "draft_ms", "verify_ms"))
        exp_id, experiment = self._experiment(data)
        top = experiment.vocab_size - 1
        drafted = _list(data, "drafted", limit=MAX_DRAFT)
        if not all(type(t) is int and 0 <= t <= top for t in drafted):
            raise SchemaError(f"drafted must hold token ids from 0 to {top:,}")
        texts = _list(data, "drafted_text", len(drafted))
        if not all(type(t) is str and len(t) <= MAX_TEXT for t in texts):
            raise SchemaError("drafted_text must be short strings")
        return DraftPass(exp_id, experiment.t_ms, _int(data, "repeat", 0, 1 << 10), _int(data, "index", 0, MAX_CONTEXT),
                         _int(data, "position", 1, max(experiment.max_context - 1, 1)), drafted, texts,
                         _int(data, "accepted", 0, len(drafted)), _int(data, "token_id", 0, top),
                         _str(data, "text", MAX_TEXT), _num(data, "draft_ms"), _num(data, "verify_ms"))

    def block_table(self, data: dict) -> BlockTable:
        _fields(data, BlockTable, ("exp_id", "t_ms", "step", "block_positions", "total_blocks", "running", "tables",
                                   "positions", "waiting", "shared_blocks", "shared_refs", "cached_blocks",
                                   "free_blocks"))
        exp_id, experiment = self._experiment(data)
        total = _int(data, "total_blocks", 1, MAX_BLOCKS)
        size = _int(data, "block_positions", 1, 1 << 16)
        running = _indices(data, "running", MAX_REQUESTS)
        tables = _list(data, "tables", len(running))
        positions = _list(data, "positions", len(running))
        ids = set()
        for table, held in zip(tables, positions):
            if type(table) is not list or len(table) > total or not all(type(b) is int and 0 <= b < 4 * MAX_BLOCKS
                                                                        for b in table):
                raise SchemaError(f"tables must hold at most {total:,} block ids per request")
            if type(held) is not int or not 0 <= held <= len(table) * size:
                raise SchemaError("positions must fit in the request's blocks")
            ids.update(table)
        shared = _list(data, "shared_blocks", limit=total)
        refs = _list(data, "shared_refs", len(shared))
        if not all(type(b) is int and b in ids for b in shared) or not all(
                type(n) is int and 2 <= n <= len(running) for n in refs):
            raise SchemaError("shared_blocks must be blocks the running requests hold, each with 2 or more of them")
        cached = _list(data, "cached_blocks", limit=total)
        if not all(type(b) is int and 0 <= b < 4 * MAX_BLOCKS for b in cached):
            raise SchemaError("cached_blocks must be block ids")
        return BlockTable(exp_id, experiment.t_ms, _int(data, "step", 0, 1 << 30), size, total, running, tables,
                          positions, _indices(data, "waiting", MAX_REQUESTS), shared, refs, cached,
                          _int(data, "free_blocks", 0, total))

    def experiment_finished(self, data: dict) -> ExperimentFinished:
        _fields(data, ExperimentFinished, ("exp_id", "t_ms", "reason", "summary"))
        exp_id, experiment = self._experiment(data)
        experiment.ended = True
        return ExperimentFinished(exp_id, experiment.t_ms, _str(data, "reason", 32, ("done", "stopped")),
                                  _plain(_object(data, "summary"), "summary"))

    def experiment_failed(self, data: dict) -> ExperimentFailed:
        _fields(data, ExperimentFailed, ("exp_id", "t_ms", "error", "message"))
        exp_id, experiment = self._experiment(data)
        experiment.ended = True
        return ExperimentFailed(exp_id, experiment.t_ms, _str(data, "error", 128), _str(data, "message", 4096))


def _indices(data: dict, name: str, limit: int) -> list[int]:
    values = _list(data, name, limit=limit)
    if not all(type(v) is int and 0 <= v < limit for v in values) or len(set(values)) != len(values):
        raise SchemaError(f"{name} must be distinct request numbers below {limit:,}")
    return values


def _plain(values: dict, name: str) -> dict:
    """Settings and summaries: a bounded object of names to finite numbers, booleans, short strings and lists
    of those (no deeper nesting)."""
    if len(values) > MAX_VALUES:
        raise SchemaError(f"{name} has more than {MAX_VALUES} entries")
    for key, value in values.items():
        items = value if type(value) is list else [value]
        if type(key) is not str or len(key) > 64 or len(items) > 4096 or not all(_scalar(v) for v in items):
            raise SchemaError(f"{name}.{_short(key, 40)} must be a number, true/false, a short string or a list of "
                              "those")
    return values


def _scalar(value: object) -> bool:
    if value is None or type(value) is bool:
        return True
    if type(value) is int or type(value) is float:
        return math.isfinite(value) and abs(value) < 1e30
    return type(value) is str and len(value) <= 4096


def _advance(owners: dict, data: dict, key: str, what: str):
    """The run or experiment an event belongs to, which must have started and not ended, its clock moved to
    the event's time (which may not go back)."""
    ident = _str(data, key, 64)
    owner = owners.get(ident)
    if owner is None:
        raise SchemaError(f"{data.get('type')} belongs to {what} {_short(ident)}, which has not started")
    if owner.ended:
        raise SchemaError(f"{data.get('type')} comes after {what} {_short(ident)} ended")
    t = _num(data, "t_ms")
    if t < owner.t_ms:
        raise SchemaError(f"t_ms goes back in time ({t:g} ms after {owner.t_ms:g} ms)")
    owner.t_ms = t
    return ident, owner


_BUILDERS = {
    "RunStarted": Checker.run_started, "PrefillDone": Checker.prefill_done, "KVNorms": Checker.kv_norms,
    "TokenStep": Checker.token_step, "AttentionStep": Checker.attention_step, "RunFinished": Checker.run_finished,
    "RunFailed": Checker.run_failed,
    "HardwarePeaks": Checker.peaks, "ExperimentStarted": Checker.experiment_started,
    "ExperimentProgress": Checker.experiment_progress, "ExperimentPoint": Checker.experiment_point,
    "DraftPass": Checker.draft_pass, "BlockTable": Checker.block_table,
    "ExperimentFinished": Checker.experiment_finished, "ExperimentFailed": Checker.experiment_failed,
}
_FIELDS: dict[type, frozenset[str]] = {
    cls: frozenset(cls.__dataclass_fields__) for cls in (
        ModelFacts, KVLayer, ServerFacts, GenerationParams, RunSummary, RunStarted, PrefillDone, KVNorms, TokenStep,
        AttentionStep, RunFinished, RunFailed, HardwarePeaks, ExperimentStarted, ExperimentProgress, ExperimentPoint,
        DraftPass, BlockTable, ExperimentFinished, ExperimentFailed)}


def read_events(parsed: Iterable[tuple[int, object]]) -> Iterator[tuple[int, object]]:
    """``(line, dict)`` in, ``(line, event)`` out; a ``SchemaError`` names the first bad field."""
    checker = Checker()
    for number, data in parsed:
        yield number, checker.event(data)
