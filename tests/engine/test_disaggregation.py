"""Prefill and decode apart: the same tokens both ways and as plain runs, each hand-over exactly the cache's bytes,
and a prefill worker that dies, falls silent, finds no memory or is stopped never outlives the lesson."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from engine.facts import kvformula
from engine.facts.errors import ParameterError
from engine.facts.events import ExperimentPoint
from engine.lessons import disaggregation
from tests.lessons import collect

SMALL = {"requests": 4, "short_prompt": 8, "long_prompt": 96, "long_every": 2, "new_tokens": 5,
         "arrive_every_ms": 20}


def prefill_workers(marker: str = "", parent: int | None = None) -> list[int]:
    """Running prefill workers (not zombies) whose command line holds ``marker``, children of ``parent`` if
    given."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            stat = (proc / "stat").read_text().rsplit(")", 1)[1].split()
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:
            continue
        if b"worker prefill-worker" in cmdline and marker.encode() in cmdline and stat[0] != "Z" \
                and (parent is None or int(stat[1]) == parent):
            found.append(int(proc.name))
    return found


def workers_alive() -> list[int]:
    return prefill_workers(parent=os.getpid())


def points(events, series):
    return [e.values for e in events if isinstance(e, ExperimentPoint) and e.series == series]


def test_both_modes_give_each_request_the_tokens_of_its_plain_run_and_hand_over_exactly_its_cache(tiny):
    events, finished = collect("disaggregation", tiny, **SMALL)
    r = finished.result
    assert finished.reason == "done" and not r.incomplete and not r.failure
    assert r.same_tokens_both_modes is True and r.tokens_match_solo is True
    assert [f.mode for f in r.modes] == ["colocated", "disaggregated"]
    requests = points(events, "request")
    handed = [q for q in requests if q["mode"] == 1]
    assert len(handed) == SMALL["requests"]
    per_token = kvformula.bytes_per_token(tiny.facts)
    for q in handed:                                       # the cache's own tensors, no more, no less
        assert q["handover_bytes"] == per_token * q["prompt_tokens"]
        assert q["prefill_end_ms"] <= q["handover_ready_ms"]
    assert {q["prompt_tokens"] for q in handed} == {8, 96}
    assert r.handover_matches_formula is True
    assert sum(q["handover_bytes"] for q in handed) == r.modes[1].handover_bytes
    colocated = [q for q in requests if q["mode"] == 0]
    assert all("handover_bytes" not in q for q in colocated)
    gaps = points(events, "gap")
    assert len([g for g in gaps if g["mode"] == 0]) == SMALL["requests"] * (SMALL["new_tokens"] - 1)
    assert workers_alive() == []


def test_the_table_prints_every_request_in_both_modes_and_the_hand_over_of_a_seven_b_model(tiny):
    events, finished = collect("disaggregation", tiny, **SMALL)
    text = disaggregation.table([e for e in events if isinstance(e, ExperimentPoint)], finished.result)
    assert text.count("colocated     |") == SMALL["requests"] and text.count("disaggregated |") == SMALL["requests"]
    assert "tokens: the same in both modes, equal to a plain run of each" in text
    assert "Llama-3.1-8B's cache for a 96-token prompt: 12.0 MiB" in text        # 128 KiB a token x 96
    assert "over PCIe 4.0 x16" in text


@pytest.mark.parametrize("fault, words", [
    ("handover:1:exit", "the prefill worker ended during a hand-over"),
    ("handover:1:oom", "more than the 0 B of free memory a hand-over needs"),
])
def test_a_prefill_worker_that_dies_or_finds_no_memory_ends_the_lesson_with_one_line_and_no_process(
        tiny, monkeypatch, fault, words):
    monkeypatch.setenv("KVSCOPE_FAULTS", fault)
    events, finished = collect("disaggregation", tiny, **SMALL)
    r = finished.result
    assert r.incomplete and words in r.failure and "\n" not in r.failure
    assert len(r.modes) == 2 and r.modes[0].mode == "colocated"     # what was measured is kept
    assert r.same_tokens_both_modes is None                          # no comparison over a part
    assert workers_alive() == []


def test_a_silent_prefill_worker_is_stopped_after_the_settings_seconds(tiny, monkeypatch):
    monkeypatch.setenv("KVSCOPE_FAULTS", "handover:0:sleep=600")
    _events, finished = collect("disaggregation", tiny, **{**SMALL, "silent_s": 1})
    assert "said nothing for 1 s" in finished.result.failure and finished.result.incomplete
    assert workers_alive() == []


def test_a_stop_during_the_disaggregated_run_ends_both_workers(tiny, monkeypatch):
    from engine.facts.events import ExperimentProgress
    from engine.run.experiment import run_lesson
    from engine.run.session import Session

    monkeypatch.setenv("KVSCOPE_FAULTS", "handover:2:sleep=600")     # still at it whenever the stop comes
    cancel = threading.Event()

    def stop_soon_after_the_disaggregated_run_begins(event):
        if isinstance(event, ExperimentProgress) and event.message.startswith("disaggregated"):
            threading.Timer(0.5, cancel.set).start()

    lesson = disaggregation.LESSON
    finished = run_lesson(lesson, Session(tiny), lesson.settings(**SMALL),
                          stop_soon_after_the_disaggregated_run_begins, cancel)
    assert finished.reason == "stopped" and finished.result.incomplete and not finished.result.failure
    assert workers_alive() == []


def test_a_model_off_the_cpu_or_a_prompt_past_the_context_is_refused_before_anything_starts(tiny):
    from dataclasses import replace
    from types import SimpleNamespace

    settings = disaggregation.DisaggregationSettings(**SMALL)
    on_gpu = SimpleNamespace(facts=replace(tiny.facts, device="cuda:0"), model=tiny.model)
    with pytest.raises(ParameterError, match="CPU"):
        disaggregation.check(on_gpu, settings)
    with pytest.raises(ParameterError, match="past"):
        disaggregation.check(tiny, replace(settings, long_prompt=tiny.facts.max_context))


def test_the_workers_socket_carries_data_never_code_and_anything_else_is_one_line(tmp_path):
    """A pickle that would write a file if it were unpickled arrives on the socket: it is refused as a message,
    nothing runs."""
    import pickle
    import socket
    from multiprocessing.connection import Connection

    from engine.run import kv_handover as dg

    class Planted:
        def __reduce__(self):
            return (open, (str(tmp_path / "ran"), "w"))

    mine, theirs = socket.socketpair()
    ours, other = Connection(mine.detach()), Connection(theirs.detach())
    try:
        for garbage in (pickle.dumps(("ready", Planted())), b"\x00\xff not json", b'["ready", "two"]',
                        b'["prefilled", 0, 1, 0.0, 1.0, [[[2, 3], "load"]], 24]', b'{"ready": 1}'):
            other.send_bytes(garbage)
            with pytest.raises(dg.BadMessage) as refused:
                dg.heard(ours)
            assert "\n" not in str(refused.value) and "socket" in str(refused.value)
        assert not (tmp_path / "ran").exists()
        dg.say(other, "prefill", 3, [1, 2, 3], 1.5)
        assert dg.heard(ours) == ("prefill", 3, [1, 2, 3], 1.5)
    finally:
        ours.close()
        other.close()


def test_a_worker_stopped_while_it_loads_is_given_up_on_after_the_silent_seconds(tiny):
    import signal
    import time

    from engine.run import kv_handover as dg

    worker = dg.PrefillWorker(tiny.facts.source, tiny.facts.dtype, 1)
    try:
        os.kill(worker.process.pid, signal.SIGSTOP)
        began = time.monotonic()
        said = worker.wait_ready(threading.Event(), idle_s=1)
        assert "used no CPU for 1 s while loading the model" in said
        assert time.monotonic() - began < dg.READY_TIMEOUT_S / 2        # not the fixed bound
    finally:
        worker.close()
    assert workers_alive() == []


def test_the_cli_exits_non_zero_when_a_worker_ended_the_lesson_early(tiny_model_dir, monkeypatch, capsys):
    from engine import cli

    monkeypatch.setenv("KVSCOPE_FAULTS", "handover:1:exit")
    code = cli.main(["sweep", "disaggregation", "--model", str(tiny_model_dir), "--device", "cpu", "--dtype",
                     "float32", "--requests", "4", "--short", "8", "--long", "96", "--long-every", "2", "--tokens",
                     "5", "--arrive-every-ms", "20"])
    out = capsys.readouterr().out
    assert code == 1 and "ended early: the prefill worker ended during a hand-over" in out
    assert workers_alive() == []


def test_the_prefill_worker_runs_as_the_lessons_declared_worker_and_the_finder_sees_it(tiny_model_dir):
    """The worker starts through the lesson registry (``python -m engine worker prefill-worker``), and the
    process finder the tests above rely on finds it while it lives: their "none left" is not vacuous."""
    from engine.run.kv_handover import PrefillWorker

    worker = PrefillWorker(str(tiny_model_dir), "float32", 1)
    try:
        assert worker.process.pid in prefill_workers(str(tiny_model_dir), parent=os.getpid())
        assert worker.process.args[1:4] == ["-m", "engine", "worker"]
    finally:
        worker.close()
    assert worker.process.pid not in prefill_workers(str(tiny_model_dir))


def test_the_hand_over_fault_grammar_is_the_lessons_declaration_read_through_the_registry(monkeypatch):
    from engine import lessons  # noqa: F401  (the registry declares every lesson's fault phases)
    from engine.facts.errors import ParameterError
    from engine.run import faults
    from engine.run.prefill_worker import HANDOVER

    assert HANDOVER in lessons.lesson("disaggregation").faults
    monkeypatch.setenv("KVSCOPE_FAULTS", "handover:2:exit,decode:1:error")
    assert faults.actions(HANDOVER) == {2: "exit"} and faults.from_env() is not None
    monkeypatch.setenv("KVSCOPE_FAULTS", "handover:2:explode")
    with pytest.raises(ParameterError, match="handover:N:exit, handover:N:oom or handover:N:sleep=S"):
        faults.actions(HANDOVER)
