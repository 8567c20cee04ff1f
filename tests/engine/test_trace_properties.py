"""Property tests of the trace format (hypothesis): whatever values the declarations allow, an event is built,
written and read back equal; a generated run or experiment of every lesson, written by the writer, always reads
back; and a value outside a declared bound is refused by the same check, naming the field."""

from __future__ import annotations

import dataclasses
import json
import math
import types
import typing
from typing import Annotated, Union, get_args, get_origin

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine import lessons
from engine.facts.events import (
    TRACE_EVENTS,
    Candidate,
    ExperimentFinished,
    ExperimentPoint,
    ExperimentStarted,
    KVLayer,
    KVNorms,
    ModelFacts,
    PrefillDone,
    RunFinished,
    RunStarted,
    RunSummary,
    TokenStep,
    to_dict,
)
from engine.facts.fields import Items, Range, Text
from engine.facts.params import MAX_SEED, GenerationParams
from engine.facts.validation import MISSING, FieldError, plan, shapes
from engine.facts.vocabulary import MORE
from engine.output.trace import read_trace, write_checked

FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
TEXT = st.text(st.characters(blacklist_categories=("Cs",)), max_size=40)     # any character but a lone surrogate


# --- strategies from the declarations -------------------------------------------------------------------------
def strategy(tp: object, metadata: tuple = ()) -> st.SearchStrategy:
    """Values of ``tp`` within its declared bounds, as JSON gives them (lists for tuples and lists)."""
    origin = get_origin(tp)
    if origin is Annotated:
        base, *extra = get_args(tp)
        return strategy(base, metadata + tuple(extra))
    span = next((m for m in metadata if isinstance(m, Range)), None)
    text = next((m for m in metadata if isinstance(m, Text)), None)
    items = next((m for m in metadata if isinstance(m, Items)), None)
    if origin in (Union, types.UnionType):
        options = [a for a in get_args(tp) if a is not type(None)]
        inner = st.one_of(*(strategy(o, metadata if len(options) == 1 else ()) for o in options))
        return st.none() | inner if type(None) in get_args(tp) else inner
    if tp is bool:
        return st.booleans()
    if tp is int:
        low, high = (int(span.low), int(span.high)) if span else (-(10**9), 10**9)
        return st.integers(low, high)
    if tp is float:
        low, high = (span.low, span.high) if span else (-1e9, 1e9)
        return st.floats(low, high, allow_nan=False, allow_infinity=False)
    if tp is str:
        if text is not None and text.choices:
            return st.sampled_from(text.choices)
        return st.text(st.characters(blacklist_categories=("Cs",)), max_size=min(text.limit if text else 40, 40))
    if origin in (list, tuple):
        return st.lists(strategy(get_args(tp)[0]), max_size=min(items.limit if items else 4, 4))
    if origin is dict:
        return st.dictionaries(st.text(min_size=1, max_size=12), strategy(get_args(tp)[1]), max_size=4)
    if dataclasses.is_dataclass(tp):
        return dataclass_dicts(tp)
    raise TypeError(tp)


def dataclass_dicts(cls: type) -> st.SearchStrategy:
    hints = typing.get_type_hints(cls, include_extras=True)
    fields = {f.name: strategy(hints[f.name]) for f in dataclasses.fields(cls) if f.init}
    return st.fixed_dictionaries(fields)


def json_round_trip(value: object) -> object:
    return json.loads(json.dumps(value, ensure_ascii=False))


# --- every field layer: built, written as JSON, read back equal ---------------------------------------------
FIELD_CLASSES = [cls for cls in (*TRACE_EVENTS, *lessons.lesson_events(), KVLayer, Candidate, RunSummary, ModelFacts)
                 if cls not in (ExperimentStarted, ExperimentFinished)]
LESSON_CLASSES = [cls for lesson in lessons.LESSONS for cls in (lesson.settings, lesson.result)]


CROSS_FIELD_RULES = {lesson.settings for lesson in lessons.LESSONS} | {RunStarted}   # rules across fields too


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_any_values_within_the_declared_bounds_build_and_read_back_equal(data):
    """Every event's, result's and settings class's fields: what the declarations allow builds (settings may
    refuse a combination, by their own rule), and the JSON of what was built builds the same value again."""
    for cls in FIELD_CLASSES + LESSON_CLASSES:
        try:
            built = plan(cls).build(data.draw(dataclass_dicts(cls), label=cls.__name__))
        except FieldError:
            if cls in CROSS_FIELD_RULES:
                continue
            raise
        again = plan(cls).build(json_round_trip(to_dict(built)))
        assert again == built, cls


@FAST
@given(st.data())
def test_a_value_past_its_bound_is_refused_naming_the_field(data):
    cls = data.draw(st.sampled_from([TokenStep, PrefillDone, KVNorms, ExperimentPoint]))
    plan_ = plan(cls)
    good = to_dict(plan_.build(data.draw(dataclass_dicts(cls))))
    name = data.draw(st.sampled_from(["t_ms"]))
    bad = {**good, name: data.draw(st.sampled_from([-1.0, 1e300, "12", None, [], float("nan")]))}
    try:
        plan_.build(bad)
    except FieldError as exc:
        assert name in str(exc)
    else:
        raise AssertionError(f"{cls.__name__} accepted {bad[name]!r} for {name}")


# --- whole runs and experiments, through the writer --------------------------------------------------------------
@st.composite
def runs(draw) -> list[object]:
    """A local run that makes sense: a model, a prompt in its vocabulary, steps at consecutive positions with
    KV bytes the formula allows, norms, and a summary."""
    layers = draw(st.integers(1, 4))
    heads, dim, vocab, context = draw(st.integers(1, 4)), draw(st.integers(1, 16)), draw(st.integers(8, 500)), 64
    kv = [KVLayer("full", heads, dim, dim, 4) for _ in range(layers)]
    facts = ModelFacts("m", "src", "Arch", layers, heads, dim, heads * dim, vocab, context, "float32", 4, 1000, "cpu",
                       ["cpu"] * layers, kv)
    prompt = draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=10))
    pieces = [draw(TEXT) for _ in prompt]
    params = GenerationParams(max_new_tokens=draw(st.integers(1, 8)), seed=draw(st.integers(0, MAX_SEED)))
    per = 2 * heads * dim * 4
    events: list[object] = [RunStarted("r1", draw(TEXT), facts, params, draw(TEXT), prompt, pieces, "now")]
    t = draw(st.floats(0, 10))
    n = len(prompt)
    events.append(PrefillDone("r1", t, n, 0.1, draw(st.floats(0, 5)), [[per * n // 2, per * n // 2]] * layers, 0,
                              [n] * layers))
    events.append(KVNorms("r1", t, 0, [[draw(st.floats(0, 100))] * n] * layers, [[1.0] * n] * layers))
    steps = draw(st.integers(1, params.max_new_tokens))
    for step in range(steps):
        t += draw(st.floats(0, 10))
        position = n + step
        token = draw(st.integers(0, vocab - 1))
        candidates = [Candidate(draw(st.integers(0, vocab - 1)), draw(TEXT), p, p)
                      for p in draw(st.lists(st.floats(0, 1), max_size=5))]
        events.append(TokenStep("r1", t, step, position, token, draw(TEXT), draw(st.booleans()),
                                "prefill" if step == 0 else "decode", draw(st.floats(0, 50)), draw(st.floats(0, 50)),
                                draw(st.floats(0, 1)), draw(st.floats(0, 1)), candidates,
                                [[per * position // 2, per * position // 2]] * layers, [position] * layers))
    events.append(RunFinished("r1", t + 1, draw(st.sampled_from(("eos", "max_tokens", "stopped"))),
                              RunSummary(prompt_tokens=n, generated_tokens=steps, text=draw(TEXT))))
    return events


@FAST
@given(runs())
def test_a_generated_run_written_always_reads_back(tmp_path_factory, events):
    path = tmp_path_factory.mktemp("prop") / "run.kvscope.jsonl"
    written = write_checked(path, events)
    assert written.note == "" and written.events == len(events)
    assert read_trace(path) == events


@st.composite
def declared_points(draw, lesson) -> tuple[str, dict[str, float]]:
    """A point of one of the lesson's declared kinds: its series, every required figure, some optional ones, and
    figures named at run time where the kind keeps them (``more``)."""
    kind = draw(st.sampled_from(lesson.points))
    names = {shape.name for shape in shapes(kind)}
    values: dict[str, float] = {}
    for shape in shapes(kind):
        if shape.name == MORE:
            values.update(draw(st.dictionaries(st.text(min_size=1, max_size=10).filter(lambda k: k not in names),
                                               st.floats(-1e9, 1e9), max_size=3)))
        elif (shape.optional or shape.default is not MISSING) and draw(st.booleans()):
            continue
        elif shape.base is bool:
            values[shape.name] = float(draw(st.booleans()))
        elif shape.base is int:
            values[shape.name] = float(draw(st.integers(-10**6, 10**6)))
        else:
            values[shape.name] = draw(st.floats(-1e9, 1e9))
    return draw(st.sampled_from((kind.series, *kind.family))), values


@st.composite
def experiments(draw) -> list[object]:
    """An experiment of any lesson: settings and a result generated within their declarations, points between."""
    lesson = draw(st.sampled_from(lessons.LESSONS))
    facts = ModelFacts("m", "src", "Arch", 1, 1, 4, 4, 100, 64, "float32", 4, 10, "cpu", ["cpu"], [KVLayer(
        "full", 1, 4, 4, 4)])
    while True:
        try:
            settings_ = plan(lesson.settings).build(draw(dataclass_dicts(lesson.settings)))
            break
        except FieldError:
            continue
    result = plan(lesson.result).build(draw(dataclass_dicts(lesson.result)))
    points = [ExperimentPoint("e1", float(i), *draw(declared_points(lesson))) for i in range(3)]
    return [ExperimentStarted("e1", 0.0, lesson.kind, facts, settings_), *points,
            ExperimentFinished("e1", 5.0, draw(st.sampled_from(("done", "stopped"))), result)]


@FAST
@given(experiments())
def test_a_generated_experiment_of_any_lesson_written_always_reads_back(tmp_path_factory, events):
    path = tmp_path_factory.mktemp("prop") / "exp.kvscope.jsonl"
    written = write_checked(path, events)
    assert written.note == "" and read_trace(path) == events


@settings(max_examples=10, deadline=None)
@given(runs())
def test_the_writer_stops_before_an_event_its_reader_would_refuse_and_says_so(tmp_path_factory, events):
    tmp_path = tmp_path_factory.mktemp("cut")
    finished = events[-1]
    broken = dataclasses.replace(finished, summary=dataclasses.replace(finished.summary, token_ids=[10**9]))
    written = write_checked(tmp_path / "t.jsonl", [*events[:-1], broken])
    assert written.events == len(events) - 1 and "RunFinished" in written.note and "token_ids" in written.note
    back = read_trace(tmp_path / "t.jsonl")
    assert back.incomplete == ["r1"] and back == events[:-1]        # what came before reads back, marked


def test_non_finite_values_never_reach_a_trace(tmp_path):
    assert not math.isfinite(float("nan"))
    point = ExperimentPoint("e1", 1.0, "s", {"ratio": float("nan")})
    try:
        plan(ExperimentPoint).build(to_dict(point))
    except FieldError as exc:
        assert "values.ratio" in str(exc)
    else:
        raise AssertionError("NaN passed")
