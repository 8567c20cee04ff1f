"""A lesson's vocabulary is declared on it and checked everywhere: the trace schema takes a lesson's points and
events from the registry and refuses what the lesson does not declare; a point's table comes from its columns."""

from __future__ import annotations

import pytest

from engine import lessons
from engine.facts.events import ExperimentPoint, ExperimentStarted, KVLayer, ModelFacts
from engine.facts.schema import SchemaError
from engine.facts.vocabulary import LessonPoint, of, table_lines
from engine.lessons.batch import BatchPoint
from engine.lessons.speculative import DraftPass
from engine.output.trace import checker
from engine.run.experiment import Experiment
from engine.serve.block_events import KVBlocks

FACTS = ModelFacts("m", "src", "Arch", 1, 1, 4, 4, 100, 64, "float32", 4, 10, "cpu", ["cpu"],
                   [KVLayer("full", 1, 4, 4, 4)])
BATCH = {"batch": 2.0, "ttft_ms": 10.0, "prefill_ms": 8.0, "step_ms": 5.0, "per_token_ms": 5.0,
         "decode_tok_s": 400.0, "request_latency_ms": 30.0, "padded_length": 12.0}


def read(*events: object) -> list[object]:
    check = checker()
    return [check.event(e) for e in events]


def started(kind: str = "batch") -> dict:
    from engine.facts.events import to_dict

    return to_dict(ExperimentStarted("e1", 0.0, kind, FACTS, lessons.lesson(kind).settings()))


def point(series: str, values: dict) -> dict:
    return {"type": "ExperimentPoint", "exp_id": "e1", "t_ms": 1.0, "series": series, "values": values}


def test_a_declared_point_reads_back_typed_and_an_undeclared_one_is_refused_by_name():
    first, stored = read(started(), point("batch", BATCH))
    assert BatchPoint.read(stored).batch == 2 and isinstance(BatchPoint.read(stored).batch, int)
    with pytest.raises(SchemaError, match="series must be one of batch, not 'prefill'"):
        read(started(), point("prefill", BATCH))
    with pytest.raises(SchemaError, match="has no figure.s. tokens"):
        read(started(), point("batch", {**BATCH, "tokens": 3.0}))
    missing = {k: v for k, v in BATCH.items() if k != "ttft_ms"}
    with pytest.raises(SchemaError, match="missing ttft_ms"):
        read(started(), point("batch", missing))


def test_a_lessons_own_event_is_read_only_inside_that_lessons_experiment_and_checks_itself():
    from engine.facts.events import to_dict

    drafted = to_dict(DraftPass("e1", 1.0, 0, 0, 5, [1, 2], ["a", "b"], 1, 3, "c", 1.0, 2.0))
    read(started("speculative"), drafted)                                   # its own lesson: read
    with pytest.raises(SchemaError, match="a batch experiment reports no DraftPass"):
        read(started(), drafted)
    beyond = {**drafted, "token_id": 100}                                   # the model has 100 tokens
    with pytest.raises(SchemaError, match="token ids from 0 to 99"):
        read(started("speculative"), beyond)
    cleared = to_dict(KVBlocks("e1", 1.0, "cleared", ["ab"]))
    with pytest.raises(SchemaError, match="a cleared event names no blocks"):
        read(started("server load"), cleared)


def test_an_experiment_reports_only_the_points_its_lesson_declares():
    lesson = lessons.lesson("batch")
    emitted: list[object] = []

    class Target:
        facts = FACTS

    experiment = Experiment(lesson, Target(), emitted.append, None, None)
    experiment.point(BatchPoint(**{k: (int(v) if k in ("batch", "padded_length") else v) for k, v in BATCH.items()}))
    assert emitted[-1].series == "batch" and emitted[-1].values == BATCH

    class Stray(LessonPoint):
        series = "stray"

    with pytest.raises(TypeError, match="declares no Stray point"):
        experiment.point(Stray())


def test_a_points_table_takes_its_headers_and_formats_from_the_declared_columns():
    stored = [ExperimentPoint("e1", 1.0, "batch", {**BATCH, "batch": float(b), "per_token_ms": 5.0 * b})
              for b in (1, 16)]
    lines = table_lines(of(stored, BatchPoint), BatchPoint)
    assert lines[0].split(" | ") == ["batch", "TTFT ms", "per-token ms", "decode tok/s (all requests)",
                                     "request latency ms"]
    assert lines[2].split(" | ")[0] == "    1" and lines[3].split(" | ")[2].strip() == "80.00"
    assert len({len(line) for line in lines}) == 1                  # every row as wide as the header
