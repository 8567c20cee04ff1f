"""Runs and experiments as a Chrome / Perfetto trace (the JSON trace-event format), to open in
ui.perfetto.dev or chrome://tracing beside traces of anything else.

One process per run or experiment, one thread (track) per kind of work: the run's forward passes (prefill,
then each decode step), sampling (each step's time after its forward pass), waits (paused, stepping), and the
per-layer times of a split model; an experiment's runs each on their own track, and whatever its lesson adds
from its points (``Lesson.timeline``: continuous batching one track per request plus a counter of the batch
size, a load test the server's /metrics); paged KV as counters of blocks held, shared and free per step;
speculative decoding one track per repeat with each pass's drafting and verifying. Times are microseconds from
the start of each run or experiment, as recorded; every slice is a complete event (``"ph": "X"``) with a
duration. Speculative passes are reported together after their repeat, so they are laid out back to back from
their measured durations, ending when they were reported (said in each slice's args).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator
from pathlib import Path

from engine import lessons
from engine.facts.events import (
    ExperimentPoint,
    ExperimentStarted,
    LayerTimes,
    PrefillDone,
    RunFailed,
    RunFinished,
    RunStarted,
    TokenStep,
    plain,
)
from engine.facts.vocabulary import LessonEvent
from engine.run.experiment import Span
from engine.store.files import write_atomically

TRACKS = {"forward": 1, "sampling": 2, "waits": 3}
LAYERS = 4                 # the track of a split model's per-layer times, named when the first arrives


def trace_events(events: Iterable[object]) -> list[dict]:
    return list(stream_trace_events(events))


def stream_trace_events(events: Iterable[object]) -> Iterator[dict]:
    """The trace events of ``events`` as each is read: only what an experiment's lesson draws at its end (its
    points and own events) and each run's track numbers are kept."""
    out: list[dict] = []
    pids: dict[str, int] = {}
    run_track: dict[str, tuple[int, int]] = {}         # run id -> (pid, first tid) of its tracks
    experiments: dict[str, int] = {}
    kinds: dict[str, str] = {}                          # experiment id -> its lesson's kind
    lanes: dict[tuple[int, str], int] = {}              # (pid, track name) -> tid, for lessons' own tracks
    timed: set[tuple[int, int]] = set()                 # per-layer tracks named so far
    items: dict[str, list[object]] = {}                 # experiment id -> its points and own events, in order

    def process(key: str, name: str) -> int:
        pid = pids.setdefault(key, len(pids) + 1)
        out.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": name}})
        return pid

    def thread(pid: int, tid: int, name: str) -> None:
        out.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": name}})

    for event in events:
        yield from out
        out.clear()
        if isinstance(event, ExperimentStarted):
            pid = experiments[event.exp_id] = process(f"exp:{event.exp_id}", f"experiment: {event.kind}")
            kinds[event.exp_id] = event.kind
            out.append(_slice(pid, 0, "experiment", "experiment", 0.0, 0.0, {"settings": plain(event.settings)}))
        elif isinstance(event, RunStarted):
            owner = experiments.get(event.experiment)
            if owner is not None:                        # an experiment's run: a track of its own there
                base = 10 * (sum(1 for r in run_track.values() if r[0] == owner) + 1)
                run_track[event.run_id] = (owner, base)
                for name, offset in TRACKS.items():
                    thread(owner, base + offset, f"{event.label}: {name}")
            else:
                pid = process(f"run:{event.run_id}", f"run: {event.label}")
                run_track[event.run_id] = (pid, 0)
                for name, offset in TRACKS.items():
                    thread(pid, offset, name)
        elif isinstance(event, PrefillDone) and event.run_id in run_track:
            pid, base = run_track[event.run_id]
            start = event.t_ms - event.forward_ms
            out.append(_slice(pid, base + TRACKS["forward"], f"prefill ({event.n_tokens} tokens)", "prefill",
                              start, event.forward_ms, {"tokens": event.n_tokens, "reused": event.reused_tokens}))
        elif isinstance(event, TokenStep) and event.run_id in run_track and event.forward_ms is None:
            pid, base = run_track[event.run_id]             # a server's token: only the client's gap is known
            name = "waiting for the first token (client)" if event.step == 0 else f"token {event.step} (client)"
            out.append(_slice(pid, base + TRACKS["forward"], name, "remote", event.t_ms - event.latency_ms,
                              event.latency_ms, {"text": event.text}))
        elif isinstance(event, TokenStep) and event.run_id in run_track:
            pid, base = run_track[event.run_id]
            end = event.t_ms
            start = end - event.latency_ms
            if event.phase == "decode":
                out.append(_slice(pid, base + TRACKS["forward"], f"decode step {event.step}", "decode", start,
                                  event.forward_ms, {"position": event.position, "token_id": event.token_id}))
            out.append(_slice(pid, base + TRACKS["sampling"], "sample", "sampling", start + event.forward_ms,
                              max(event.latency_ms - event.forward_ms, 0.0), {"p": event.prob}))
            if event.waited_ms:
                out.append(_slice(pid, base + TRACKS["waits"], "waiting", "wait", start - event.waited_ms,
                                  event.waited_ms, {}))
        elif isinstance(event, (RunFinished, RunFailed)) and event.run_id in run_track:
            pid, base = run_track[event.run_id]
            name = event.reason if isinstance(event, RunFinished) else f"failed: {event.error}"
            out.append({"ph": "i", "name": name, "cat": "end", "pid": pid, "tid": base + TRACKS["forward"],
                        "ts": _us(event.t_ms), "s": "t"})
        elif isinstance(event, (ExperimentPoint, LessonEvent)) and event.exp_id in experiments:
            items.setdefault(event.exp_id, []).append(event)
        elif isinstance(event, LayerTimes) and event.run_id in run_track:
            pid, base = run_track[event.run_id]
            if (pid, base + LAYERS) not in timed:
                timed.add((pid, base + LAYERS))
                thread(pid, base + LAYERS, "layers (where each layer's weights were read from)")
            start = event.t_ms - sum(event.ms)
            for layer, (ms, device) in enumerate(zip(event.ms, event.devices)):
                out.append(_slice(pid, base + LAYERS, f"layer {layer} ({device})", device, start, ms,
                                  {"step": event.step}))
                start += ms
    yield from out
    out.clear()
    for exp_id, found in items.items():                 # what each lesson draws of its own (lanes, counters)
        lesson = lessons.BY_KIND.get(kinds[exp_id])
        pid = experiments[exp_id]
        for item in lesson.timeline(found) if lesson is not None and lesson.timeline is not None else ():
            if isinstance(item, Span):
                if (pid, item.track) not in lanes:
                    lanes[(pid, item.track)] = 1000 + len([k for k in lanes if k[0] == pid])
                    thread(pid, lanes[(pid, item.track)], item.track)
                out.append(_slice(pid, lanes[(pid, item.track)], item.name, item.category or item.name,
                                  item.start_ms, item.duration_ms, dict(item.args)))
            else:
                out.append({"ph": "C", "name": item.name, "pid": pid, "ts": _us(item.t_ms), "args": item.values})
    yield from out


def _slice(pid: int, tid: int, name: str, cat: str, start_ms: float, dur_ms: float, args: dict) -> dict:
    return {"ph": "X", "name": name, "cat": cat, "pid": pid, "tid": tid, "ts": _us(start_ms),
            "dur": round(dur_ms * 1000.0, 3), "args": args}


def _us(ms: float) -> float:
    return round(ms * 1000.0, 3)


def write_perfetto(path: str | os.PathLike, events: Iterable[object]) -> Path:
    """The JSON object form (``{"traceEvents": [...]}``), which Perfetto and chrome://tracing both open, written
    as the events come (a trace streamed from its file is never held whole) and atomically (a full disk, or a
    trace found broken part-way, leaves no file)."""
    def write(f) -> None:
        f.write('{"traceEvents": [')
        for i, item in enumerate(stream_trace_events(events)):
            f.write((", " if i else "") + json.dumps(item))
        f.write('], "displayTimeUnit": "ms", "otherData": {"producer": "KVScope"}}')

    return write_atomically(path, write, what="the Perfetto trace")
