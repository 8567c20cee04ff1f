"""A run on disk: JSON lines, a versioned header first, then one event per line.

Traces are data from anywhere, so reading one parses JSON (no NaN, no infinities, bounded lines, numbers,
containers and depth) and checks every event against the schema in ``engine.facts.schema``; nothing is evaluated.
Writing runs the same checks on every event before it is written, so a trace KVScope writes is one it can read:
an event that would not pass (a bug in a producer) ends the file there, and the writer says so. Writes are
atomic (``engine.store.files``). Several traces joined into one file (``cat a b > c``) read as one list of events.
No torch here: the app replays traces with no model loaded.
"""

from __future__ import annotations

import contextlib
import gc
import gzip
import io
import json
import os
import re
import time
import zlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from engine import __version__, lessons
from engine.facts.errors import TraceError
from engine.facts.events import (
    TRACE_EVENTS,
    ExperimentStarted,
    HardwarePeaks,
    RunFailed,
    RunFinished,
    RunStarted,
    ServerFacts,
    to_dict,
)
from engine.facts.schema import Checker, SchemaError
from engine.facts.textstream import clean_text
from engine.store.files import WriteRefused, writable_target, write_atomically

FORMAT = "kvscope-trace"
VERSION = 3            # 3: lessons' settings and results typed; per-layer storage; layer times
MAX_FILE_BYTES = 4 << 30             # unpacked, read a line at a time (an export)
MAX_HELD_BYTES = 512 << 20           # unpacked, held whole (the window, a replay): ~3x that in Python objects
GZIP_MAGIC = b"\x1f\x8b"
_DATE = re.compile(r"[0-9]{4}-[0-9]{2}-[0-9]{2}")
MAX_LINE_BYTES = 64 << 20            # one event; a KV-norms batch of a 128k-token prefill is about 61 MiB
MAX_CONTAINERS = 100_000             # lists and objects in one line (a legitimate event has a few thousand)
MAX_DIGITS = 40                      # digits of one whole number (the largest a trace holds has 19)
MAX_EVENTS = 20_000_000
MAX_REPLAY_GAP_S = 3.0               # a longer pause in a recording is shortened, and the replay says so
BOM = b"\xef\xbb\xbf"
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def header() -> dict:
    return {"format": FORMAT, "version": VERSION, "kvscope": __version__,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def checker() -> Checker:
    """The schema checker with what every lesson's experiments may hold (``engine.lessons``)."""
    return Checker(lessons.vocabulary())


# --- writing ----------------------------------------------------------------------------------------------
def check_writable(path: str | os.PathLike, inputs: Sequence[str | os.PathLike | None] = ()) -> Path:
    """Refuse a path a trace cannot be written to (or one of the command's ``inputs``), before any work is done
    for it."""
    try:
        return writable_target(path, "the trace", "run.kvscope.jsonl", inputs)
    except WriteRefused as exc:
        raise TraceError(str(exc)) from None


@dataclass(frozen=True)
class Written:
    """What ``write_trace`` wrote: the file, how many events, and what it left out (empty when nothing)."""

    path: Path
    events: int
    note: str = ""


def write_trace(path: str | os.PathLike, events: Iterable[object]) -> Path:
    """Write ``events`` atomically, checked (:func:`write_checked`); the file written."""
    return write_checked(path, events).path


def write_checked(path: str | os.PathLike, events: Iterable[object]) -> Written:
    """Write ``events`` atomically, each checked by the reader's own checks first. An event the reader would
    refuse ends the trace there (what came before reads back, its run marked incomplete), and ``note`` says
    which event and why. A name ending in ``.gz`` is written compressed (the reader knows it by its bytes)."""
    check_writable(path)
    check, written, note = checker(), 0, ""
    kept = TRACE_EVENTS + lessons.lesson_events()
    compressed = os.fspath(path).endswith(".gz")

    def write_to(binary) -> None:
        if not compressed:
            text = io.TextIOWrapper(binary, encoding="utf-8", write_through=True)
            write(text)
            text.detach()
            return
        with gzip.GzipFile(fileobj=binary, mode="wb", mtime=0) as packed:      # mtime 0: the same bytes each time
            text = io.TextIOWrapper(packed, encoding="utf-8")
            write(text)
            text.flush()
            text.detach()

    def write(f) -> None:
        nonlocal written, note
        f.write(json.dumps(header()) + "\n")
        for event in events:
            if not isinstance(event, kept):
                continue
            data = to_dict(event)
            try:
                check.event(data)
            except SchemaError as exc:
                note = (f"the trace stops before event {written + 1} ({type(event).__name__}), which its reader "
                        f"would refuse: {exc}")
                return
            f.write(event_line(data) + "\n")
            written += 1

    try:
        target = write_atomically(path, write_to, binary=True, what="the trace")
    except WriteRefused as exc:
        raise TraceError(str(exc)) from None
    return Written(target, written, note)


def event_line(data: dict) -> str:
    """One checked event as a JSON line: UTF-8 where it can be, escaped where it cannot (a lone surrogate from a
    trace someone else wrote reads back as the replacement character)."""
    text = json.dumps(data, ensure_ascii=False, allow_nan=False)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        text = json.dumps(data, ensure_ascii=True, allow_nan=False)
    return text


class TraceWriter:
    """A sink that collects a run's events and writes them when the run ends (atomically, as above)."""

    def __init__(self, path: str | os.PathLike, inputs: Sequence[str | os.PathLike | None] = ()) -> None:
        self.path = check_writable(path, inputs)
        self.events: list[object] = []
        self.note = ""

    def __call__(self, event: object) -> None:
        self.events.append(event)

    def close(self) -> Path:
        written = write_checked(self.path, self.events)
        self.note = written.note
        return written.path


# --- reading ----------------------------------------------------------------------------------------------
class Trace(list):
    """The events of a trace, in order; ``incomplete`` names the runs that never finished in it; ``created``: the
    date its header says it was written ("" when it says none)."""

    incomplete: list[str]
    created: str = ""


def short_name(device: str) -> str:
    """A processor's name as people say it: "Intel(R) Xeon(R) Processor" is an Intel Xeon."""
    words = re.sub(r"\((R|TM|tm|r)\)|\b(Processor|CPU)\b|@.*$", " ", device)
    return " ".join(words.split()) or device


def recorded(trace: Trace) -> str:
    """Where and when a trace was recorded, for a caption ("recorded 2026-12-02 on AMD EPYC 7B13, float32"): the
    machine its peaks name (else the device or the server), the model's float, the day its first run started.
    A replayed figure is another machine's: the screen must say whose."""
    peaks = next((e for e in trace if isinstance(e, HardwarePeaks)), None)
    peaks = peaks or next((e.peaks for e in trace if isinstance(e, ExperimentStarted) and e.peaks), None)
    facts = next((e.model for e in trace if isinstance(e, (RunStarted, ExperimentStarted))), None)
    day = next((e.started_at[:10] for e in trace if isinstance(e, RunStarted)
                and _DATE.fullmatch(e.started_at[:10])), trace.created)
    if isinstance(facts, ServerFacts):
        where = f"from {facts.engine} serving {facts.name}"
    else:
        machine = short_name(peaks.device) if peaks is not None else (facts.device if facts is not None else "")
        dtype = facts.dtype if facts is not None else ""
        where = ", ".join(p for p in (f"on {machine}" if machine else "", dtype) if p)
    return " ".join(p for p in ("recorded", day, where) if p)


def read_trace(path: str | os.PathLike) -> Trace:
    """All events of a trace, checked, held in memory (the window, a replay, a render): a trace that unpacks to
    more than ``MAX_HELD_BYTES`` is refused. Anything that is not a complete, valid trace of a known version is a
    ``TraceError`` naming the file, the line and the field; a run that never finished is kept and named in
    ``Trace.incomplete``."""
    events = Trace()
    with _no_cyclic_gc():
        events.extend(_stream(path, events, MAX_FILE_BYTES, held=MAX_HELD_BYTES))
    return events


def iter_trace(path: str | os.PathLike) -> Iterator[object]:
    """The events of a trace, checked as ``read_trace`` checks them, one at a time: an export holds none of them
    for longer than it takes to write it, so a trace of any length up to ``MAX_FILE_BYTES`` unpacked is exported
    in bounded memory (a 6 MB compressed trace of 320,000 steps took 3.1 GB held whole). The checks that need the
    whole file (truncated, no run in it) are made at its end, as a ``TraceError`` after the last event."""
    return _stream(path, Trace(), MAX_FILE_BYTES)


def read_traces(paths: Iterable[str | os.PathLike]) -> list[Trace]:
    """Several traces, each read and checked before any is used (a lecture prepared as several files)."""
    return [read_trace(path) for path in paths]


def _stream(path: str | os.PathLike, into: Trace, most: int, held: int | None = None) -> Iterator[object]:
    """``held``: the bound of a trace held whole, where it is lower than ``most``, the bound of any trace."""
    p = Path(path)
    if held is not None and held < most:
        most, why = held, "held"
    else:
        why = "read"
    try:
        size = p.stat().st_size
        if not p.is_file():
            raise TraceError(f"{p} is not a file: pick a KVScope trace (.jsonl)")
        if size > most:
            raise TraceError(_too_large(p.name, most, why))
        with p.open("rb") as raw:
            if raw.read(2) == GZIP_MAGIC:                  # a compressed trace (the course ships them so)
                raw.seek(0)
                with gzip.GzipFile(fileobj=raw) as unpacked:
                    yield from _read(_Bounded(unpacked, p.name, most, why), p.name, into)
                return
            raw.seek(0)
            yield from _read(_Bounded(raw, p.name, most, why), p.name, into)
    except (EOFError, gzip.BadGzipFile, zlib.error) as exc:
        raise TraceError(f"{p.name} is a damaged compressed trace ({exc})") from None
    except OSError as exc:
        raise TraceError(f"Cannot open trace {p}: {exc.strerror or exc}") from None


def _too_large(name: str, most: int, why: str) -> str:
    if why == "held":
        return (f"{name} holds more than {most >> 20:,} MiB of events, more than the window holds at once; "
                "python -m engine perfetto and otlp export it (they read it a line at a time)")
    return f"{name} unpacks to more than {most / 2**30:,.0f} GiB; KVScope reads traces up to that"


class _Bounded:
    """A trace read line by line, refused once it has unpacked to more than ``most`` bytes (a small compressed
    file that unpacks to terabytes is refused at the bound, not after filling memory)."""

    def __init__(self, f, name: str, most: int, why: str) -> None:
        self.f, self.name, self.most, self.why, self.read = f, name, most, why, 0

    def readline(self, limit: int = -1) -> bytes:
        line = self.f.readline(limit)
        self.read += len(line)
        if self.read > self.most:
            raise TraceError(_too_large(self.name, self.most, self.why))
        return line


@contextlib.contextmanager
def _no_cyclic_gc() -> Iterator[None]:
    """Events hold no reference cycles, but the collector would walk the growing list of them again and again
    (a third of the reading time of a large trace); reference counting frees them just the same."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _read(f, name: str, into: Trace) -> Iterator[object]:
    check = checker()
    number = count = 0
    last = b""
    started = False
    while True:
        raw = f.readline(MAX_LINE_BYTES + 1)
        if not raw:
            break
        number += 1
        last = raw
        if number == 1 and raw.startswith(BOM):
            raw = raw[len(BOM):]
        if len(raw) > MAX_LINE_BYTES:
            raise TraceError(f"{name} line {number} is longer than {MAX_LINE_BYTES >> 20} MiB: not a KVScope trace")
        if not raw.strip():
            continue
        data = _parse(raw, name, number)
        if number == 1 or _is_header(data):
            _check_header(data, name, number)
            created = str(data.get("created", ""))[:10]
            into.created = created if _DATE.fullmatch(created) else into.created
            continue
        if count >= MAX_EVENTS:
            raise TraceError(f"{name} holds more than {MAX_EVENTS:,} events; KVScope reads at most that many")
        try:
            event = check.event(data)
        except SchemaError as exc:
            raise TraceError(f"{name} line {number} is not a valid event: {exc}") from None
        count += 1
        started = started or isinstance(event, (RunStarted, ExperimentStarted))
        yield event
    if number == 0:
        raise TraceError(f"{name} is empty: there is no run in it")
    if not last.endswith(b"\n"):
        raise TraceError(f"{name} is truncated: its last line (line {number}) is incomplete")
    if not started:
        raise TraceError(f"{name} holds no run and no experiment")
    into.incomplete = check.unfinished_runs()


def _is_header(data: object) -> bool:
    return type(data) is dict and data.get("format") == FORMAT and "type" not in data


def _check_header(head: object, name: str, number: int) -> None:
    if not isinstance(head, dict) or head.get("format") != FORMAT:
        raise TraceError(f"{name} is not a KVScope trace (its first line is not a trace header)")
    version = head.get("version")
    if version != VERSION:
        shown = version if type(version) is int and abs(version) < 10**6 else "unknown"
        where = "" if number == 1 else f" (the trace joined to it at line {number:,})"
        raise TraceError(f"{name}{where} is trace version {shown}; this KVScope reads version {VERSION}. Open it "
                         "with the KVScope that wrote it.")


def _parse(raw: bytes, name: str, number: int) -> object:
    """One line as JSON, its size bounded before it is parsed in full: at most ``MAX_CONTAINERS`` lists and
    objects, so the peak memory of a line stays within about ten times ``MAX_LINE_BYTES``."""
    containers = raw.count(b"[") + raw.count(b"{")
    if containers > MAX_CONTAINERS:
        raise TraceError(f"{name} line {number} holds {containers:,} lists and objects; a KVScope event holds at "
                         f"most {MAX_CONTAINERS:,}: not a KVScope trace")
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise TraceError(f"{name} is not a KVScope trace (line {number} is not UTF-8 text)") from None
    try:
        data = _DECODER.decode(line)
    except json.JSONDecodeError as exc:
        raise TraceError(f"{name} line {number} is not valid JSON ({exc.msg}): the file is damaged or "
                         "truncated") from None
    except RecursionError:
        raise TraceError(f"{name} line {number} is nested too deeply to be a KVScope event") from None
    except ValueError as exc:
        raise TraceError(f"{name} line {number} is not valid: {exc}") from None
    if _SURROGATE_ESCAPE.search(raw):
        data = _without_surrogates(data)
    return data


def _no_constant(token: str) -> object:
    raise ValueError(f"{token} is not a number a trace may hold")


def _bounded_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_DIGITS:
        raise ValueError(f"it holds a whole number of {len(text):,} digits; a KVScope value has at most "
                         f"{MAX_DIGITS}")
    return int(text)


def _without_surrogates(value: object) -> object:
    """Strings with lone surrogates (valid escaped JSON, not valid text) with each replaced by U+FFFD."""
    if type(value) is str:
        return clean_text(value)[0]
    if type(value) is list:
        return [_without_surrogates(v) for v in value]
    if type(value) is dict:
        return {_without_surrogates(k): _without_surrogates(v) for k, v in value.items()}
    return value


_DECODER = json.JSONDecoder(parse_constant=_no_constant, parse_int=_bounded_int)   # one decoder: one per line costs 2x


# --- replaying --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ReplayGap:
    """The replay shortened a pause in the recording (``recorded_ms``) to ``shown_ms``."""

    recorded_ms: float
    shown_ms: float


@dataclass(frozen=True)
class ReplayIncomplete:
    """The trace ends before this run finished: it is shown as far as it goes, marked incomplete."""

    run_id: str


class OneClock:
    """A trace's events on one clock. A run times its events from its own start and an experiment from its own, and
    an experiment's runs (a server's requests: many at once) interleave with its events: each clock is placed
    where its start arrived, so the waits between events are the recorded ones however the clocks interleave.
    (Taken as one clock, the requests' small times and the experiment's large ones alternated, and a 5.8 s
    recording paced out to 114 s.)"""

    def __init__(self) -> None:
        self.now = 0.0                      # the latest moment reached, in ms since the trace began
        self._starts: dict[tuple[str, str], float] = {}

    def place(self, event: object) -> float | None:
        """``event``'s moment on the one clock (None for an event with no time of its own)."""
        t = getattr(event, "t_ms", None)
        run, exp = getattr(event, "run_id", None), getattr(event, "exp_id", None)
        key = ("run", run) if run is not None else ("exp", exp) if exp is not None else None
        if t is None or key is None:
            return None
        if isinstance(event, (RunStarted, ExperimentStarted)) or key not in self._starts:
            self._starts[key] = self.now - t
        self.now = max(self.now, self._starts[key] + t)
        return self._starts[key] + t


def replay(events: Iterable[object], speed: float = 1.0, sleep: Callable[[float], None] = time.sleep,
           cancelled: Callable[[], bool] = lambda: False, max_gap_s: float = MAX_REPLAY_GAP_S) -> Iterator[object]:
    """Yield ``events`` at their recorded pace (``t_ms``), ``speed`` times faster; ``speed <= 0`` means as fast
    as possible. A pause longer than ``max_gap_s`` (after scaling) is shortened to it, announced by a
    ``ReplayGap``; runs the trace leaves unfinished are announced at the end by ``ReplayIncomplete``. Stops
    early when ``cancelled()``."""
    clock = OneClock()
    started: list[str] = []
    ended: set[str] = set()
    for event in events:
        before = clock.now
        t = clock.place(event)
        if speed > 0 and t is not None and t > before:
            wait = (t - before) / 1000.0 / speed
            if wait > max_gap_s:
                yield ReplayGap(t - before, max_gap_s * 1000.0)
                wait = max_gap_s
            sleep(wait)
        if isinstance(event, RunStarted):
            started.append(event.run_id)
        elif isinstance(event, (RunFinished, RunFailed)):
            ended.add(event.run_id)
        if cancelled():
            return
        yield event
    for run_id in started:
        if run_id not in ended:
            yield ReplayIncomplete(run_id)
