import json

import pytest

from engine.facts.errors import TraceError
from engine.facts.events import Candidate, RunFinished, RunStarted, TokenStep
from engine.facts.params import GenerationParams
from engine.output.trace import VERSION, TraceWriter, read_trace, replay, write_trace
from engine.run.session import Session


@pytest.fixture(scope="module")
def run_events(tiny):
    events = []
    Session(tiny).run("The KV cache holds 😀 keys", GenerationParams(max_new_tokens=8, temperature=0.9, seed=3),
                      events.append)
    return events


def test_written_and_read_back_events_are_equal(run_events, tmp_path):
    path = write_trace(tmp_path / "run.jsonl", run_events)
    back = read_trace(path)
    assert back == run_events
    assert isinstance(back[0].params, GenerationParams) and back[0].params.seed == 3
    steps = [e for e in back if isinstance(e, TokenStep)]
    assert isinstance(steps[0].candidates[0], Candidate) and steps[0].candidates[0].text


def test_trace_writer_is_a_sink(tiny, tmp_path):
    writer = TraceWriter(tmp_path / "sink.jsonl")
    Session(tiny).run("hello", GenerationParams(max_new_tokens=3), writer)
    assert read_trace(writer.close()) == writer.events


def test_a_failed_write_leaves_the_existing_trace_intact(run_events, tmp_path):
    path = write_trace(tmp_path / "keep.jsonl", run_events)
    before = path.read_bytes()

    def broken():
        yield run_events[0]
        raise RuntimeError("crash mid-save")

    with pytest.raises(RuntimeError):
        write_trace(path, broken())
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["keep.jsonl"]


@pytest.mark.parametrize("content, fragment", [
    (b"", "is empty"),
    (b"not json at all\n", "not valid JSON"),
    (b'{"format": "something-else"}\n', "not a KVScope trace"),
    (b'{"format": "kvscope-trace", "version": 99}\n', "version 99"),
    (b"\xff\xfe\x00binary", "not UTF-8 text"),
    (b'{"format": "kvscope-trace", "version": %d}\n{"type": "Nope"}\n' % VERSION, "line 2 is not a valid event"),
    (b'{"format": "kvscope-trace", "version": %d}\n[1, 2]\n' % VERSION, "line 2 is not a valid event"),
    (b'{"format": "kvscope-trace", "version": %d}\n' % VERSION, "holds no run and no experiment"),
])
def test_bad_trace_files_give_a_clear_error(tmp_path, content, fragment):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(content)
    with pytest.raises(TraceError) as info:
        read_trace(path)
    assert fragment in str(info.value)


def test_truncated_trace_names_the_problem(run_events, tmp_path):
    path = write_trace(tmp_path / "t.jsonl", run_events)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 40])
    with pytest.raises(TraceError, match="truncated|not valid JSON"):
        read_trace(path)


def test_missing_file(tmp_path):
    with pytest.raises(TraceError, match="Cannot open trace"):
        read_trace(tmp_path / "nope.jsonl")


def test_a_trace_is_data_not_code(tmp_path):
    """A crafted field is kept as a string; nothing in it is evaluated."""
    path = tmp_path / "evil.jsonl"
    lines = [json.dumps({"format": "kvscope-trace", "version": VERSION})]
    run = {"type": "RunFinished", "run_id": "__import__('os').system('touch pwned')", "t_ms": 1.0,
           "reason": "eos", "summary": {"text": "${jndi}"}}
    lines.append(json.dumps(run))
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(TraceError, match="which has not started"):
        read_trace(path)
    assert not (tmp_path / "pwned").exists()


def test_replay_keeps_recorded_pace_scaled(run_events):
    slept = []
    out = list(replay(run_events, speed=2.0, sleep=slept.append))
    assert out == run_events
    recorded = (run_events[-1].t_ms - run_events[0].t_ms) / 1000.0
    assert sum(slept) == pytest.approx(recorded / 2.0, rel=1e-6)
    slept.clear()
    list(replay(run_events, speed=0, sleep=slept.append))
    assert slept == []


def test_replay_stops_when_cancelled(run_events):
    seen = []
    for e in replay(run_events, speed=0, cancelled=lambda: len(seen) >= 3):
        seen.append(e)
    assert len(seen) == 3
    assert isinstance(seen[0], RunStarted) and not any(isinstance(e, RunFinished) for e in seen)
    assert any(isinstance(e, TokenStep) for e in run_events)


def test_an_experiment_trace_reads_back(tiny, tmp_path):
    from tests.lessons import collect

    events, _finished = collect("cache", tiny, new_tokens=4, prompt="hello")
    back = read_trace(write_trace(tmp_path / "exp.jsonl", events))
    assert back == events and back[-1].result == events[-1].result      # the typed result, field for field


def test_a_trace_named_gz_is_written_compressed_the_same_bytes_each_time_and_reads_back_equal(run_events, tmp_path):
    import gzip

    packed = write_trace(tmp_path / "run.kvscope.jsonl.gz", run_events)
    plain = write_trace(tmp_path / "run.kvscope.jsonl", run_events)
    assert packed.read_bytes()[:2] == b"\x1f\x8b" and plain.read_bytes()[:1] == b"{"
    assert gzip.decompress(packed.read_bytes()) == plain.read_bytes()
    assert packed.stat().st_size < plain.stat().st_size / 2
    again = write_trace(tmp_path / "again.kvscope.jsonl.gz", run_events)
    assert again.read_bytes() == packed.read_bytes()                # no time stamp in the header
    assert read_trace(packed) == run_events


def test_a_damaged_compressed_trace_is_refused_with_its_name(run_events, tmp_path):
    packed = write_trace(tmp_path / "run.kvscope.jsonl.gz", run_events).read_bytes()
    cut = tmp_path / "cut.kvscope.jsonl.gz"
    cut.write_bytes(packed[: len(packed) // 2])
    with pytest.raises(TraceError, match="cut.kvscope.jsonl.gz is a damaged compressed trace"):
        read_trace(cut)
    flipped = tmp_path / "flipped.kvscope.jsonl.gz"
    flipped.write_bytes(packed[:40] + bytes(b ^ 0xFF for b in packed[40:60]) + packed[60:])
    with pytest.raises(TraceError, match="flipped.kvscope.jsonl.gz"):
        read_trace(flipped)


def test_a_small_compressed_file_that_unpacks_past_the_bound_is_refused_at_the_bound(run_events, tmp_path,
                                                                                     monkeypatch):
    import gzip

    import engine.output.trace as trace

    header = write_trace(tmp_path / "run.kvscope.jsonl", run_events).read_bytes().split(b"\n")[0] + b"\n"
    bomb = tmp_path / "bomb.kvscope.jsonl.gz"
    bomb.write_bytes(gzip.compress(header + (b" " * 1000 + b"\n") * 20_000))     # blank lines: 20 MB unpacked
    assert bomb.stat().st_size < 200_000
    monkeypatch.setattr(trace, "MAX_FILE_BYTES", 1 << 20)
    with pytest.raises(TraceError, match="bomb.kvscope.jsonl.gz unpacks to more than"):
        read_trace(bomb)
    monkeypatch.setattr(trace, "MAX_FILE_BYTES", 64 << 20)
    with pytest.raises(TraceError, match="holds no run and no experiment"):     # under it: read to the end
        read_trace(bomb)


def test_a_servers_interleaved_requests_replay_at_their_recorded_pace():
    """Twelve requests in flight at once, each timed from its own start, between the experiment's events timed from
    the experiment's: the replay's waits add up to the recording's length, not to the clocks' zigzag."""
    from pathlib import Path

    from engine.facts.events import ExperimentFinished

    events = read_trace(Path(__file__).resolve().parents[1] / "fixtures" / "vllm_load.kvscope.jsonl")
    assert len({e.run_id for e in events if isinstance(e, RunStarted)}) == 12
    waits: list[float] = []
    assert list(replay(events, 1.0, sleep=waits.append, max_gap_s=float("inf"))) == list(events)
    finished = next(e for e in events if isinstance(e, ExperimentFinished))
    assert sum(waits) == pytest.approx(finished.t_ms / 1000.0, abs=0.01)
    assert max(waits) < 0.5                                           # no wait the recording did not have


def test_a_trace_says_when_and_where_it_was_recorded(run_events, tmp_path):
    from engine.facts.events import HardwarePeaks
    from engine.output.trace import recorded

    peaks = HardwarePeaks("Test CPU 9000", "float32", flops_per_s=1e11, bytes_per_s=1e10)
    back = read_trace(write_trace(tmp_path / "run.kvscope.jsonl.gz", [peaks, *run_events]))
    day = run_events[0].started_at[:10]
    assert recorded(back) == f"recorded {day} on Test 9000, float32"
    assert recorded(read_trace(write_trace(tmp_path / "plain.jsonl", run_events))) == f"recorded {day} on cpu, float32"
