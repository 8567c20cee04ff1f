"""Perfetto / Chrome trace export: valid trace-event JSON, one track per kind of work, slices that nest."""

from __future__ import annotations

import json
from collections import defaultdict

from engine import cli
from engine.facts.params import GenerationParams
from engine.output.trace import write_trace
from engine.run.session import Session
from tests.lessons import collect

PHASES = {"X", "M", "i", "C"}


def check_trace_event_format(doc: dict) -> list[dict]:
    """The JSON object form of the trace-event format, as Perfetto and chrome://tracing read it."""
    assert set(doc) >= {"traceEvents"} and isinstance(doc["traceEvents"], list)
    events = doc["traceEvents"]
    for e in events:
        assert e["ph"] in PHASES and isinstance(e["name"], str) and isinstance(e["pid"], int), e
        if e["ph"] == "M":
            assert e["name"] in ("process_name", "thread_name") and isinstance(e["args"]["name"], str)
        elif e["ph"] == "X":
            assert isinstance(e["tid"], int) and e["ts"] >= 0 and e["dur"] >= 0 and isinstance(e["args"], dict)
        elif e["ph"] == "C":
            assert all(isinstance(v, (int, float)) for v in e["args"].values())
        else:
            assert e["s"] in ("t", "p", "g") and e["ts"] >= 0
    slices = defaultdict(list)                 # complete events on one track must nest or be disjoint
    for e in events:
        if e["ph"] == "X":
            slices[(e["pid"], e["tid"])].append((e["ts"], e["ts"] + e["dur"]))
    for spans in slices.values():
        spans.sort()
        for (a0, a1), (b0, b1) in zip(spans, spans[1:]):
            assert b0 >= a1 - 1e-3 or b1 <= a1 + 1e-3, (a0, a1, b0, b1)
    return events


def test_a_run_becomes_forward_sampling_and_wait_tracks(tiny, tmp_path, capsys):
    events: list = []
    Session(tiny).run("hello world", GenerationParams(max_new_tokens=6), events.append,
                      before_step=lambda step: None)
    trace = write_trace(tmp_path / "run.jsonl", events)
    assert cli.main(["perfetto", str(trace), "--out", str(tmp_path / "run.json")]) == 0
    out = check_trace_event_format(json.loads((tmp_path / "run.json").read_text()))
    names = [e["name"] for e in out if e["ph"] == "X"]
    assert names.count("sample") == 6 and sum(n.startswith("decode step") for n in names) == 5
    assert sum(n.startswith("prefill") for n in names) == 1
    threads = {e["args"]["name"] for e in out if e["name"] == "thread_name"}
    assert threads == {"forward", "sampling", "waits"}


def test_experiments_give_a_track_per_run_and_per_request(tiny, tmp_path):
    events: list = []
    session = Session(tiny)
    collect("cache", session, events=events, new_tokens=4)
    collect("continuous", session, events=events, requests=3, arrive_every=1, new_tokens=(3, 4), check_solo=False)
    from engine.output.perfetto import write_perfetto

    out = check_trace_event_format(json.loads(write_perfetto(tmp_path / "exp.json", events).read_text()))
    threads = [e["args"]["name"] for e in out if e["name"] == "thread_name"]
    assert sum("request" in t for t in threads) == 6                   # 3 requests x 2 policies
    assert sum(t.endswith(": forward") for t in threads) == 2          # the cache experiment's two runs
    assert any(e["ph"] == "C" and e["name"].startswith("batch size") for e in out)


def test_every_shipped_course_trace_exports_to_perfetto(tmp_path) -> None:
    """The serving scene's trace holds KV-block events beside its points; the load lesson's timeline read them as
    points and the export died (found by the fuzz harness's export target, on its seeds)."""
    from pathlib import Path

    course = Path(__file__).resolve().parents[2] / "resources" / "course"
    for trace in sorted(course.glob("*.kvscope.jsonl.gz")):
        out = tmp_path / f"{trace.name}.json"
        assert cli.main(["perfetto", str(trace), "--out", str(out)]) == 0, trace.name
        check_trace_event_format(json.loads(out.read_text()))


def long_trace(path, runs: int, steps: int) -> int:
    """A trace of ``runs`` runs of ``steps`` decode steps each, made from the shipped run's own events; its size
    unpacked, in bytes."""
    import gzip
    from pathlib import Path

    course = Path(__file__).resolve().parents[2] / "resources" / "course" / "run.kvscope.jsonl.gz"
    head, *lines = gzip.decompress(course.read_bytes()).decode().splitlines()
    events = [json.loads(line) for line in lines]
    first = {e["type"]: e for e in reversed(events)}
    out = [head] + [json.dumps(e) for e in events if e["type"] == "HardwarePeaks"]
    for r in range(runs):
        rid = f"{r:012x}"
        out += [json.dumps({**first["RunStarted"], "run_id": rid}), json.dumps({**first["PrefillDone"], "run_id": rid})]
        t, gap = first["PrefillDone"]["t_ms"], first["TokenStep"]["latency_ms"] + 1.0    # steps one after another
        for i in range(steps):
            t += gap
            out.append(json.dumps({**first["TokenStep"], "run_id": rid, "step": i, "t_ms": t,
                                   "position": first["PrefillDone"]["n_tokens"] + i}))
        summary = {**first["RunFinished"]["summary"], "generated_tokens": steps}
        out.append(json.dumps({**first["RunFinished"], "run_id": rid, "t_ms": t + 1, "summary": summary}))
    data = ("\n".join(out) + "\n").encode()
    path.write_bytes(gzip.compress(data, 1))
    return len(data)


def test_an_export_streams_the_trace_and_a_window_refuses_one_larger_than_it_holds(tmp_path, monkeypatch):
    """A 6 MB compressed trace of 320,000 steps took 3.1 GB to export held whole; it is now read a line at a time,
    so the export's memory does not grow with the trace. The window, which holds a trace whole, refuses one past
    its bound in one line that names the export that streams it."""
    import tracemalloc

    from engine.output import trace as trace_module

    path = tmp_path / "long.kvscope.jsonl.gz"
    size = long_trace(path, runs=2, steps=3000)
    out = tmp_path / "long.json"
    tracemalloc.start()
    try:
        assert cli.main(["perfetto", str(path), "--out", str(out)]) == 0
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert size > 10 << 20 and peak < size / 4, f"{peak / 2**20:.1f} MiB traced exporting {size / 2**20:.1f} MiB"
    events = check_trace_event_format(json.loads(out.read_text()))
    assert sum(1 for e in events if e.get("cat") == "sampling") == 2 * 3000       # every step, written
    monkeypatch.setattr(trace_module, "MAX_HELD_BYTES", 1 << 20)
    import pytest

    with pytest.raises(trace_module.TraceError, match="holds more than 1 MiB of events, more than the window holds "
                                                      "at once; python -m engine perfetto and otlp export it"):
        trace_module.read_trace(path)
