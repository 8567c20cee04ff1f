"""Hostile traces: every case that once reached a traceback, a hang or runaway memory is now a one-line
``TraceError`` naming the file, line and field, or a clean, marked replay. Plus a fuzz test over mutations."""

from __future__ import annotations

import json
import random

import pytest

from engine.facts.errors import TraceError
from engine.facts.events import RunFinished, TokenStep
from engine.facts.params import GenerationParams
from engine.output.trace import VERSION, ReplayGap, ReplayIncomplete, read_trace, replay
from engine.run.session import Session
from tests.traces import first_row, rows_of, write_rows


@pytest.fixture(scope="module")
def lines(tiny, tmp_path_factory) -> list[dict]:
    """A valid trace of a sampled run, as parsed JSON lines (header first)."""
    events: list = []
    Session(tiny).run("The KV cache <b>holds</b> & keys", GenerationParams(max_new_tokens=12, temperature=0.9, seed=3),
                      events.append)
    return rows_of(events, tmp_path_factory.mktemp("valid") / "run.jsonl")


def write(tmp_path, rows: list, raw_tail: str = "") -> object:
    return write_rows(tmp_path / "t.jsonl", rows, raw_tail)


def first(rows: list[dict], kind: str) -> int:
    return first_row(rows, kind)


def refused(tmp_path, rows, *fragments: str) -> str:
    with pytest.raises(TraceError) as info:
        read_trace(write(tmp_path, rows))
    message = str(info.value)
    assert "t.jsonl line" in message and "\n" not in message and len(message) < 400, message
    for fragment in fragments:
        assert fragment in message, message
    return message


def changed(rows: list[dict], kind: str, path: tuple, value: object) -> list[dict]:
    out = json.loads(json.dumps(rows))
    target = out[first(out, kind)]
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    return out


def test_the_valid_trace_reads(lines, tmp_path):
    events = read_trace(write(tmp_path, lines))
    assert isinstance(events[-1], RunFinished) and events.incomplete == []


def test_deep_nesting_is_refused_without_a_recursion_error(lines, tmp_path):
    refused(tmp_path, [lines[0], "[" * 100_000 + "]" * 100_000], "line 2", "nested too deeply")


def test_an_event_with_200k_unknown_keys_gives_a_short_message(lines, tmp_path):
    event = dict(lines[1], **{f"junk{i}": i for i in range(200_000)})
    refused(tmp_path, [lines[0], event, *lines[2:]], "RunStarted has no field(s) 'junk0'", "and 199,995 more")


@pytest.mark.parametrize("kind, path, value, fragment", [
    ("TokenStep", ("t_ms",), "12", "t_ms must be a number"),
    ("TokenStep", ("latency_ms",), "fast", "latency_ms must be a number"),
    ("TokenStep", ("kv_bytes_per_layer",), "lots", "kv_bytes_per_layer must be a list"),
    ("TokenStep", ("kv_bytes_per_layer", 0, 0), "512", "kv_bytes_per_layer[0][0] must be a whole number, not '512'"),
    ("TokenStep", ("position",), "3", "position must be a whole number"),
    ("TokenStep", ("text",), 42, "text must be a string"),
    ("RunStarted", ("model", "num_layers"), "2", "num_layers must be a whole number"),
    ("RunStarted", ("model", "max_context"), 0, "max_context must be between 1"),
    ("RunStarted", ("model", "num_layers"), 0, "num_layers must be between 1 and 4,096"),
    ("RunStarted", ("model", "num_layers"), -3, "num_layers must be between 1"),
    ("RunStarted", ("model", "dtype_bytes"), 0, "dtype_bytes must be between 1 and 16"),
    ("RunStarted", ("model", "kv_layers", 0, "kv_heads"), 0, "kv_layers[0]: kv_heads must be between 1"),
    ("RunStarted", ("model", "layer_devices"), ["<b>cpu</b>", "cpu", "x"], "layer_devices has 3 entries"),
    ("KVNorms", ("first_position",), 10**9, "first_position must be between 0 and"),
    ("TokenStep", ("position",), 10**8, "position must be between"),
    ("TokenStep", ("t_ms",), 1e308, "t_ms must be between 0 and"),
    ("TokenStep", ("kv_bytes_per_layer", 0), [-5, 5], "kv_bytes_per_layer[0][0] must be between 0 and"),
    ("TokenStep", ("kv_bytes_per_layer", 0), [10**30, 0], "kv_bytes_per_layer[0][0] must be between 0 and"),
    ("TokenStep", ("kv_bytes_per_layer", 0), [10**9, 0], "this layer holds at most"),
    ("TokenStep", ("kv_bytes_per_layer", 0), [5, 5, 5], "kv_bytes_per_layer[0] has 3 entries; at most 2"),
    ("TokenStep", ("candidates", 0, "p_raw"), 1.5, "candidates[0]: p_raw must be between 0 and 1, not 1.5"),
    ("TokenStep", ("step",), 5, "step must be between 0 and 0"),
])
def test_a_wrong_field_is_refused_by_name(lines, tmp_path, kind, path, value, fragment):
    refused(tmp_path, changed(lines, kind, path, value), fragment)


@pytest.mark.parametrize("field, literal", [("prob", "NaN"), ("latency_ms", "Infinity"), ("forward_ms", "-Infinity")])
def test_non_finite_numbers_are_refused(lines, tmp_path, field, literal):
    import re

    rows: list = list(lines)
    i = first(lines, "TokenStep")
    rows[i] = re.sub(f'"{field}": [^,]+', f'"{field}": {literal}', json.dumps(lines[i]), count=1)
    refused(tmp_path, rows, f"line {i + 1}", f"{literal} is not a number a trace may hold")


def test_times_that_go_back_are_refused(lines, tmp_path):
    rows = json.loads(json.dumps(lines))
    steps = [i for i, r in enumerate(rows) if r.get("type") == "TokenStep"]
    rows[steps[3]]["t_ms"] = rows[steps[2]]["t_ms"] - 1.0
    refused(tmp_path, rows, "t_ms goes back in time")


def test_a_run_without_its_end_is_kept_and_marked_incomplete(lines, tmp_path):
    events = read_trace(write(tmp_path, lines[:-3]))
    assert events.incomplete == [events[0].run_id]
    replayed = list(replay(events, speed=0))
    assert replayed[-1] == ReplayIncomplete(events[0].run_id)


def test_a_long_pause_in_a_recording_is_shortened_and_announced(lines, tmp_path):
    rows = json.loads(json.dumps(lines))
    for i in range(first(rows, "TokenStep") + 2, len(rows)):
        rows[i]["t_ms"] = rows[i]["t_ms"] + 1e9                      # an 11-day pause mid-run
    events = read_trace(write(tmp_path, rows))
    slept: list[float] = []
    out = list(replay(events, speed=1.0, sleep=slept.append))
    gaps = [e for e in out if isinstance(e, ReplayGap)]
    assert len(gaps) == 1 and gaps[0].recorded_ms > 1e9 and gaps[0].shown_ms == 3000.0
    assert sum(slept) < 10.0


def test_limits_are_stated(tmp_path, monkeypatch):
    import engine.output.trace as trace

    monkeypatch.setattr(trace, "MAX_LINE_BYTES", 1000)
    path = tmp_path / "long.jsonl"
    path.write_text(json.dumps({"format": "kvscope-trace", "version": VERSION}) + "\n" + "x" * 5000 + "\n")
    with pytest.raises(TraceError, match="line 2 is longer than"):
        read_trace(path)


# --- the fuzz test: mutated valid traces give a TraceError or a clean replay, fast and within memory ----------
MUTATIONS = ("type", "value", "drop", "truncate", "nest", "swap", "duplicate")


def mutate(rows: list[dict], rng: random.Random) -> str:
    rows = json.loads(json.dumps(rows))
    kind = rng.choice(MUTATIONS)
    i = rng.randrange(1, len(rows))
    row = rows[i]
    if kind in ("type", "value", "drop"):
        key = rng.choice(sorted(row))
        if kind == "drop":
            del row[key]
        elif kind == "type":
            row[key] = rng.choice(["1", None, [], {}, True, 1.5, -1, "<b>x</b>"])
        else:
            row[key] = _nudge(row[key], rng)
    elif kind == "nest":
        row[rng.choice(sorted(row))] = json.loads("[" * 50 + "1" + "]" * 50)
    elif kind == "swap":
        j = rng.randrange(1, len(rows))
        rows[i], rows[j] = rows[j], rows[i]
    elif kind == "duplicate":
        rows.insert(i, json.loads(json.dumps(row)))
    text = "\n".join(json.dumps(r) for r in rows) + "\n"
    if kind == "truncate":
        text = text[: rng.randrange(1, len(text))]
    return text


def _nudge(value: object, rng: random.Random) -> object:
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        return rng.choice([0, -1, 10**9, 10**18, value * 1000, -value, 2**63])
    if isinstance(value, str):
        return rng.choice(["", "x" * 5000, "<script>", value * 3])
    if isinstance(value, list):
        return rng.choice([[], value[:1], value * 3, [value]])
    if isinstance(value, dict):
        return {k: _nudge(v, rng) for k, v in value.items()}
    return value


def test_fuzzed_traces_are_refused_or_replay_cleanly(lines, tmp_path):
    """300 mutations, seed 7: each case (read, replay, derived figures) allocates under 64 MiB at its peak;
    what is accepted replays into the store and every derived figure is finite."""
    import tracemalloc

    from app.state.store import RunStore

    rng = random.Random(7)
    tracemalloc.start()
    accepted = refused_count = 0
    for case in range(300):
        path = tmp_path / f"fuzz{case}.jsonl"
        path.write_text(mutate(lines, rng))
        tracemalloc.reset_peak()
        try:
            events = read_trace(path)
        except TraceError:
            refused_count += 1
        else:
            accepted += 1
            store = RunStore()
            for event in replay(events, speed=0):
                if isinstance(event, ReplayIncomplete):
                    store.mark_incomplete(event.run_id)
                elif not isinstance(event, ReplayGap):
                    store.add(event)
            for run in store.runs:
                run.memory_grid(), run.norm_grid("k"), run.token_rate()
                s = run.summary()
                assert s.prefill_tok_s >= 0 and s.decode_tok_s >= 0
        assert tracemalloc.get_traced_memory()[1] < 64 << 20, case
    tracemalloc.stop()
    assert refused_count > 100 and accepted >= 10         # the mutations exercise both outcomes
    assert any(isinstance(e, TokenStep) for e in read_trace(write(tmp_path, lines)))
