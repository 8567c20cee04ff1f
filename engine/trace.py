"""A run on disk: JSON lines, a versioned header first, then one event per line.

Traces are data from anywhere, so reading one parses JSON (no NaN, no infinities, bounded lines, depth and
size) and checks every event against the schema in ``engine.schema``; nothing is evaluated. Writing goes to
a temporary file that replaces the target only when complete, so a crash mid-save never corrupts an existing
trace, and the file gets the permissions the user's umask gives any other file. No torch here: the app
replays traces with no model loaded.
"""

from __future__ import annotations

import contextlib
import gc
import json
import math
import os
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from engine import __version__
from engine.errors import TraceError
from engine.events import ExperimentStarted, RunFailed, RunFinished, RunStarted, to_dict
from engine.schema import Checker, SchemaError

FORMAT = "kvscope-trace"
VERSION = 2            # 2: per-layer KV facts from the cache (ModelFacts.kv_layers), waits and CPU share
MAX_FILE_BYTES = 4 << 30
MAX_LINE_BYTES = 256 << 20           # one event; a KV-norms batch of a 128k-token prefill is well below
MAX_EVENTS = 20_000_000
MAX_REPLAY_GAP_S = 3.0               # a longer pause in a recording is shortened, and the replay says so


def header() -> dict:
    return {"format": FORMAT, "version": VERSION, "kvscope": __version__,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


# --- writing ----------------------------------------------------------------------------------------------
def check_writable(path: str | os.PathLike) -> Path:
    """Refuse a path a trace cannot be written to, before any work is done for it."""
    target = Path(path).expanduser()
    if target.is_dir():
        raise TraceError(f"{target} is a folder: give a file name for the trace, e.g. {target / 'run.jsonl'}")
    folder = target.parent
    if not folder.is_dir():
        raise TraceError(f"Cannot write the trace to {target}: the folder {folder} does not exist")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise TraceError(f"Cannot write the trace to {target}: the folder {folder} is not writable")
    return target


def write_trace(path: str | os.PathLike, events: Iterable[object]) -> Path:
    """Write ``events`` atomically (temporary file in the same folder, then rename)."""
    target = check_writable(path)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o666 & ~_umask())                 # mkstemp makes 0600; a trace is an ordinary file
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(json.dumps(header()) + "\n")
            for event in events:
                f.write(event_line(event) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target


def event_line(event: object) -> str:
    """One event as a JSON line. Non-finite numbers (an experiment's ratio over a zero) become null, so every
    trace KVScope writes is one it can read."""
    data = to_dict(event)
    try:
        return json.dumps(data, ensure_ascii=False, allow_nan=False)
    except ValueError:
        return json.dumps(_finite(data), ensure_ascii=False, allow_nan=False)


def _finite(value: object) -> object:
    if type(value) is float and not math.isfinite(value):
        return None
    if type(value) is list:
        return [_finite(v) for v in value]
    if type(value) is dict:
        return {k: _finite(v) for k, v in value.items()}
    return value


def _umask() -> int:
    """The process umask, read without changing it (``os.umask`` sets it, which races with other threads)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return 0o022


class TraceWriter:
    """A sink that collects a run's events and writes them when the run ends (atomically, as above)."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = check_writable(path)
        self.events: list[object] = []

    def __call__(self, event: object) -> None:
        self.events.append(event)

    def close(self) -> Path:
        return write_trace(self.path, self.events)


# --- reading ----------------------------------------------------------------------------------------------
class Trace(list):
    """The events of a trace, in order; ``incomplete`` names the runs that never finished in it."""

    incomplete: list[str]


def read_trace(path: str | os.PathLike) -> Trace:
    """All events of a trace, checked. Anything that is not a complete, valid trace of a known version is a
    ``TraceError`` naming the file, the line and the field; a run that never finished is kept and named in
    ``Trace.incomplete``."""
    p = Path(path)
    try:
        size = p.stat().st_size
        if not p.is_file():
            raise TraceError(f"{p} is not a file: pick a KVScope trace (.jsonl)")
        if size > MAX_FILE_BYTES:
            raise TraceError(f"{p.name} is {size / 2**30:,.1f} GiB; KVScope reads traces up to "
                             f"{MAX_FILE_BYTES / 2**30:,.0f} GiB")
        with p.open("rb") as f, _no_cyclic_gc():
            return _read(f, p.name)
    except OSError as exc:
        raise TraceError(f"Cannot open trace {p}: {exc.strerror or exc}") from None


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


def _read(f, name: str) -> Trace:
    checker = Checker()
    events = Trace()
    number = 0
    last = b""
    while True:
        raw = f.readline(MAX_LINE_BYTES + 1)
        if not raw:
            break
        number += 1
        last = raw
        if len(raw) > MAX_LINE_BYTES:
            raise TraceError(f"{name} line {number} is longer than {MAX_LINE_BYTES >> 20} MiB: not a KVScope trace")
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise TraceError(f"{name} is not a KVScope trace (line {number} is not UTF-8 text)") from None
        if not line.strip():
            continue
        data = _parse(line, name, number)
        if number == 1:
            _check_header(data, name)
            continue
        if len(events) >= MAX_EVENTS:
            raise TraceError(f"{name} holds more than {MAX_EVENTS:,} events; KVScope reads at most that many")
        try:
            events.append(checker.event(data))
        except SchemaError as exc:
            raise TraceError(f"{name} line {number} is not a valid event: {exc}") from None
    if number == 0:
        raise TraceError(f"{name} is empty: there is no run in it")
    if not last.endswith(b"\n"):
        raise TraceError(f"{name} is truncated: its last line (line {number}) is incomplete")
    if not any(isinstance(e, (RunStarted, ExperimentStarted)) for e in events):
        raise TraceError(f"{name} holds no run and no experiment")
    events.incomplete = checker.unfinished_runs()
    return events


def _check_header(head: object, name: str) -> None:
    if not isinstance(head, dict) or head.get("format") != FORMAT:
        raise TraceError(f"{name} is not a KVScope trace (its first line is not a trace header)")
    version = head.get("version")
    if version != VERSION:
        shown = version if isinstance(version, int) else "unknown"
        raise TraceError(f"{name} is trace version {shown}; this KVScope reads version {VERSION}. Open it with "
                         "the KVScope that wrote it.")


def _parse(line: str, name: str, number: int) -> object:
    try:
        return _DECODER.decode(line)
    except json.JSONDecodeError as exc:
        raise TraceError(f"{name} line {number} is not valid JSON ({exc.msg}): the file is damaged or "
                         "truncated") from None
    except RecursionError:
        raise TraceError(f"{name} line {number} is nested too deeply to be a KVScope event") from None
    except ValueError as exc:
        raise TraceError(f"{name} line {number} is not valid: {exc}") from None


def _no_constant(token: str) -> object:
    raise ValueError(f"{token} is not a number a trace may hold")


_DECODER = json.JSONDecoder(parse_constant=_no_constant)      # one decoder: building one per line costs 2x


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


def replay(events: Iterable[object], speed: float = 1.0, sleep: Callable[[float], None] = time.sleep,
           cancelled: Callable[[], bool] = lambda: False, max_gap_s: float = MAX_REPLAY_GAP_S) -> Iterator[object]:
    """Yield ``events`` at their recorded pace (``t_ms``), ``speed`` times faster; ``speed <= 0`` means as fast
    as possible. A pause longer than ``max_gap_s`` (after scaling) is shortened to it, announced by a
    ``ReplayGap``; runs the trace leaves unfinished are announced at the end by ``ReplayIncomplete``. Stops
    early when ``cancelled()``."""
    last_t: float | None = None
    started: list[str] = []
    ended: set[str] = set()
    for event in events:
        t = getattr(event, "t_ms", None)
        if isinstance(event, (RunStarted, ExperimentStarted)):
            last_t = None
        if speed > 0 and t is not None:
            if last_t is not None and t > last_t:
                wait = (t - last_t) / 1000.0 / speed
                if wait > max_gap_s:
                    yield ReplayGap(t - last_t, max_gap_s * 1000.0)
                    wait = max_gap_s
                sleep(wait)
            last_t = t
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
