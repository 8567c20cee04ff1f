"""A run on disk: JSON lines, a versioned header first, then one event per line.

Traces are data: reading one parses JSON and builds dataclasses, nothing is evaluated. Writing goes to a
temporary file that replaces the target only when complete, so a crash mid-save never corrupts an existing
trace. No torch here: the app replays traces with no model loaded.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from engine import __version__
from engine.errors import TraceError
from engine.events import ExperimentStarted, RunStarted, from_dict, to_dict

FORMAT = "kvscope-trace"
VERSION = 2            # 2: per-layer KV facts from the cache (ModelFacts.kv_layers), waits and CPU share


def header() -> dict:
    return {"format": FORMAT, "version": VERSION, "kvscope": __version__,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def write_trace(path: str | os.PathLike, events: Iterable[object]) -> Path:
    """Write ``events`` atomically (temporary file in the same folder, then rename)."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(json.dumps(header()) + "\n")
            for event in events:
                f.write(json.dumps(to_dict(event), ensure_ascii=False) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target


class TraceWriter:
    """A sink that collects a run's events and writes them when the run ends (atomically, as above)."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.events: list[object] = []

    def __call__(self, event: object) -> None:
        self.events.append(event)

    def close(self) -> Path:
        return write_trace(self.path, self.events)


def read_trace(path: str | os.PathLike) -> list[object]:
    """All events of a trace. Anything that is not a complete trace of a known version is a ``TraceError``
    naming the file and, where it applies, the line."""
    p = Path(path)
    try:
        raw = p.read_bytes()
    except OSError as exc:
        raise TraceError(f"Cannot open trace {p}: {exc.strerror or exc}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise TraceError(f"{p.name} is not a KVScope trace (it is not text)") from None
    lines = text.splitlines()
    if not lines or not lines[0].strip():
        raise TraceError(f"{p.name} is empty: there is no run in it")
    head = _parse(lines[0], p, 1)
    if not isinstance(head, dict) or head.get("format") != FORMAT:
        raise TraceError(f"{p.name} is not a KVScope trace (its first line is not a trace header)")
    if head.get("version") != VERSION:
        raise TraceError(f"{p.name} is trace version {head.get('version')!r}; this KVScope reads version "
                         f"{VERSION}. Open it with the KVScope that wrote it.")
    if not text.endswith("\n"):
        raise TraceError(f"{p.name} is truncated: its last line (line {len(lines)}) is incomplete")
    events = []
    for number, line in enumerate(lines[1:], start=2):
        if not line.strip():
            continue
        data = _parse(line, p, number)
        try:
            events.append(from_dict(data) if isinstance(data, dict) else _not_event(data))
        except (ValueError, TypeError) as exc:
            raise TraceError(f"{p.name} line {number} is not a valid event: {exc}") from None
    if not any(isinstance(e, (RunStarted, ExperimentStarted)) for e in events):
        raise TraceError(f"{p.name} holds no run and no experiment")
    return events


def _parse(line: str, path: Path, number: int) -> object:
    try:
        return json.loads(line)
    except json.JSONDecodeError as exc:
        raise TraceError(f"{path.name} line {number} is not valid JSON ({exc.msg}): the file is damaged or "
                         "truncated") from None


def _not_event(data: object) -> object:
    raise ValueError(f"expected an object, got {type(data).__name__}")


def replay(events: Iterable[object], speed: float = 1.0, sleep: Callable[[float], None] = time.sleep,
           cancelled: Callable[[], bool] = lambda: False) -> Iterator[object]:
    """Yield ``events`` at their recorded pace (``t_ms``), ``speed`` times faster; ``speed <= 0`` means as
    fast as possible. Stops early when ``cancelled()``."""
    last_t: float | None = None
    for event in events:
        t = getattr(event, "t_ms", None)
        if speed > 0 and t is not None:
            if last_t is not None and t > last_t:
                sleep((t - last_t) / 1000.0 / speed)
            last_t = t
        if isinstance(event, (RunStarted, ExperimentStarted)):
            last_t = event.t_ms
        if cancelled():
            return
        yield event
