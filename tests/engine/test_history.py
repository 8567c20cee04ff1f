"""The run history: every run appended with its figures, steps and events; bounded; a damaged or busy database
set aside with one line, never deleted."""

from __future__ import annotations

import json
import sqlite3
import threading

import pytest

from engine import cli
from engine.facts.events import RunFinished, RunStarted, TokenStep
from engine.facts.params import GenerationParams
from engine.output import history as hist
from engine.output.history import History, HistoryRecorder
from engine.output.trace import read_trace
from engine.run.session import Session


def _run(tiny, recorder, prompt: str = "The cache holds", tokens: int = 6) -> list:
    events: list = []

    def sink(event: object) -> None:
        events.append(event)
        recorder(event)

    Session(tiny).run(prompt, GenerationParams(max_new_tokens=tokens, temperature=0.0), sink, threading.Event())
    return events


def test_a_run_is_remembered_with_its_figures_steps_and_own_events(tiny, tmp_path):
    history = History(tmp_path / "history.sqlite")
    events = _run(tiny, HistoryRecorder(history))
    [run] = history.runs()
    summary = next(e for e in events if isinstance(e, RunFinished)).summary
    steps = [e for e in events if isinstance(e, TokenStep)]
    assert (run.engine, run.model, run.device, run.format) == ("KVScope", tiny.facts.name, "cpu", "float32")
    assert (run.generated_tokens, run.ttft_ms, run.decode_tok_s) == (summary.generated_tokens, summary.ttft_ms,
                                                                     summary.decode_tok_s)
    assert run.settings["max_new_tokens"] == 6 and run.has_trace and not run.thinned
    remembered = history.steps(run.id)
    assert [(s.step, s.context, s.latency_ms) for s in remembered] == [(e.step, e.position, e.latency_ms)
                                                                      for e in steps]
    assert remembered[-1].kv_bytes > remembered[0].kv_bytes > 0
    replayed = read_trace(history.write_trace(run.id, tmp_path / "again.jsonl"))
    assert [type(e).__name__ for e in replayed] == [type(e).__name__ for e in events]
    assert next(e for e in replayed if isinstance(e, RunStarted)).run_id == events[0].run_id
    history.close()
    again = History(tmp_path / "history.sqlite")                   # the next launch
    assert [r.id for r in again.runs()] == [run.id] and again.problem == ""
    assert again.runs("tiny nothing-like-this") == [] and again.runs(since="2999-01-01") == []


def test_a_file_that_is_not_a_database_is_kept_aside_and_a_fresh_one_started(tiny, tmp_path):
    path = tmp_path / "history.sqlite"
    path.write_bytes(b"this is not a database, but it is someone's file" * 100)
    history = History(path)
    aside = [p for p in tmp_path.iterdir() if p.name.startswith("history.damaged-")]
    assert len(aside) == 1 and aside[0].read_bytes().startswith(b"this is not a database")
    assert history.problem.startswith(f"The run history {path} could not be read") and aside[0].name in history.problem
    _run(tiny, HistoryRecorder(history))
    assert len(history.runs()) == 1


def test_a_database_held_by_another_program_sends_this_sessions_runs_beside_it(tiny, tmp_path, monkeypatch):
    monkeypatch.setattr(hist, "BUSY_S", 0.2)
    path = tmp_path / "history.sqlite"
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("PRAGMA locking_mode = EXCLUSIVE")
    holder.execute("CREATE TABLE held (x)")
    holder.execute("BEGIN EXCLUSIVE")
    try:
        history = History(path)
        assert "is in use by another program" in history.problem and history.path == path
        _run(tiny, HistoryRecorder(history))
        assert len(history.runs()) == 1
        assert list(tmp_path.glob("history.*.sqlite"))                  # beside it; the held file untouched
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    assert History(path).runs() == []


def test_the_oldest_runs_lose_their_events_then_their_steps_are_thinned_and_it_is_said(tiny, tmp_path, monkeypatch):
    history = History(tmp_path / "history.sqlite")
    recorder = HistoryRecorder(history)
    _run(tiny, recorder, tokens=20)
    size = history.db.execute("SELECT LENGTH(trace) FROM runs").fetchone()[0]
    monkeypatch.setattr(hist, "MAX_TRACE_BYTES", int(size * 2.5))
    monkeypatch.setattr(hist, "MAX_STEPS", 50)
    for _ in range(3):
        _run(tiny, recorder, tokens=20)
    runs = {r.id: r for r in history.runs()}
    assert [runs[i].has_trace for i in sorted(runs)] == [False, False, True, True]
    assert runs[min(runs)].thinned and not runs[max(runs)].thinned
    assert [s.step for s in history.steps(min(runs))] == [0, 8, 16, 19]
    assert len(history.steps(max(runs))) == 20
    assert any("traces were dropped" in line for line in history.said)
    assert any("keep every 8th step" in line for line in history.said)
    with pytest.raises(Exception, match="events were not kept"):
        history.write_trace(min(runs), tmp_path / "gone.jsonl")


def test_the_cli_lists_the_history_prints_steps_and_writes_a_run_as_a_trace(tiny, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("KVSCOPE_DATA_DIR", str(tmp_path))
    history = History()
    _run(tiny, HistoryRecorder(history))
    history.close()
    assert cli.main(["history", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert listed["history"] == str(tmp_path / "history.sqlite") and len(listed["runs"]) == 1
    run = listed["runs"][0]["id"]
    assert cli.main(["history", "--steps", str(run), "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)["steps"]) == 6
    assert cli.main(["history", "--trace", str(run), str(tmp_path / "run.jsonl")]) == 0
    assert len(read_trace(tmp_path / "run.jsonl")) > 6
    capsys.readouterr()
    assert cli.main(["history", "--trace", "999", str(tmp_path / "none.jsonl")]) != 0
    assert "there is no run 999 in the history" in capsys.readouterr().err
    assert cli.main(["history", "--find", "no-such-model"]) == 0
    assert "no runs remembered yet" in capsys.readouterr().out


def test_a_cli_run_is_remembered_unless_told_not_to(tiny_model_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("KVSCOPE_DATA_DIR", str(tmp_path))
    base = ["--model", str(tiny_model_dir), "--device", "cpu", "--dtype", "float32", "--prompt", "hi",
            "--max-new-tokens", "3", "--raw"]
    assert cli.main(base) == 0 and cli.main([*base, "--no-history"]) == 0
    [run] = History().runs()
    assert (run.kind, run.generated_tokens, run.ended) == ("generate", 3, "max_tokens")


def test_a_history_that_cannot_be_opened_at_all_keeps_runs_in_memory_and_moves_nothing(tiny, tmp_path):
    path = tmp_path / "history.sqlite"
    path.mkdir()                                                     # a folder where the file would be
    history = History(path)
    assert history.problem.startswith(f"The run history cannot be kept at {path}")
    assert "until the window closes only" in history.problem
    _run(tiny, HistoryRecorder(history))
    assert len(history.runs()) == 1 and path.is_dir() and [p.name for p in tmp_path.iterdir()] == ["history.sqlite"]
