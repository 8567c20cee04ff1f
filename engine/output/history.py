"""Every run remembered: each run, local or served, and each experiment is appended to a SQLite database (the
standard library's) in the user's data folder, so a decode speed measured last week can be set beside today's.

A row holds what a list and a chart need (when, model, engine, format, device, machine, settings, the headline
figures and whether the machine was busy) and, per step, the context depth, the step's latency and the KV bytes;
beside it the run's own events as a compressed trace, so any run opens again in every panel as a replay. The
database is bounded: past ``MAX_TRACE_BYTES`` of traces the oldest runs lose their trace (their figures stay),
past ``MAX_STEPS`` step rows the oldest runs keep every ``THIN_EVERY``-th step; each is said (``History.said``).

A database that cannot be read is never deleted: it is moved aside (``history.damaged-TIME.sqlite``) and a fresh
one started in its place; one held by another program for longer than ``BUSY_S`` leaves this session writing to a
fresh file beside it. Either is one line in ``History.problem``.
"""

from __future__ import annotations

import contextlib
import functools
import gzip
import io
import json
import logging
import os
import platform
import sqlite3
import time
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

from engine import lessons
from engine.facts.errors import EngineError
from engine.facts.events import (
    TRACE_EVENTS,
    ExperimentFailed,
    ExperimentFinished,
    ExperimentStarted,
    RunFailed,
    RunFinished,
    RunStarted,
    ServerFacts,
    TokenStep,
    plain,
    to_dict,
)
from engine.facts.kvformula import held_bytes
from engine.output.trace import TraceError, event_line, header, read_trace, write_trace

log = logging.getLogger(__name__)
FILE_NAME = "history.sqlite"
MAX_STEPS = 400_000                  # step rows kept before the oldest runs are thinned
THIN_EVERY = 8                       # a thinned run keeps every 8th step (and its last)
MAX_TRACE_BYTES = 256 << 20          # compressed traces kept, newest first
MAX_RUN_TRACE_BYTES = 16 << 20       # one run's compressed trace; a larger one keeps its figures only
BUSY_S = 2.0                         # how long a write waits for another program holding the database
SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (
    id INTEGER PRIMARY KEY, at TEXT NOT NULL, kind TEXT NOT NULL, title TEXT NOT NULL, engine TEXT NOT NULL,
    model TEXT NOT NULL, format TEXT NOT NULL, device TEXT NOT NULL, machine TEXT NOT NULL, settings TEXT NOT NULL,
    ended TEXT NOT NULL, prompt_tokens INTEGER, generated_tokens INTEGER, ttft_ms REAL, decode_tok_s REAL,
    kv_bytes INTEGER, cpu_share REAL, thinned INTEGER NOT NULL DEFAULT 0, trace BLOB);
CREATE TABLE IF NOT EXISTS steps (
    run INTEGER NOT NULL REFERENCES runs(id) ON DELETE CASCADE, step INTEGER NOT NULL, context INTEGER,
    latency_ms REAL NOT NULL, kv_bytes INTEGER);
CREATE INDEX IF NOT EXISTS steps_by_run ON steps(run);
"""


def history_path() -> Path:
    """``KVSCOPE_DATA_DIR`` (tests), else the user's data folder, chosen the platform's way."""
    override = os.environ.get("KVSCOPE_DATA_DIR")
    if override:
        return Path(override) / FILE_NAME
    import platformdirs

    return Path(platformdirs.user_data_dir("kvscope", appauthor=False)) / FILE_NAME


@dataclass(frozen=True)
class HistoryRun:
    """One remembered run or experiment, as a list shows it."""

    id: int
    at: str                          # when it started, ISO 8601 in UTC
    kind: str                        # "generate", "chat", ... or "experiment: <lesson kind>"
    title: str
    engine: str                      # "KVScope" for a local run, else the server's engine
    model: str
    format: str
    device: str
    machine: str
    settings: dict
    ended: str                       # "done", "length", "stopped", "failed: ..."
    prompt_tokens: int | None
    generated_tokens: int | None
    ttft_ms: float | None
    decode_tok_s: float | None       # achieved: decode steps over their measured time
    kv_bytes: int | None
    cpu_share: float | None          # below 0.9: measured while other programs competed for the cores
    thinned: bool
    has_trace: bool

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class StepRow:
    step: int
    context: int | None              # positions in the cache when the step ran
    latency_ms: float
    kv_bytes: int | None


class HistoryError(EngineError):
    """The history could not be read as it is (a page damaged after it opened), in one line naming its file."""


class History:
    def __init__(self, path: str | os.PathLike | None = None) -> None:
        self.path = Path(path) if path is not None else history_path()
        self.problem = ""                      # one line when the database could not be used as it was
        self.said: list[str] = []              # what bounding the database dropped, newest last
        self.db = self._open()

    # --- opening ------------------------------------------------------------------------------------------
    def _open(self) -> sqlite3.Connection:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            return self._connect(self.path)
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) and "busy" not in str(exc):
                return self._in_memory(exc)          # it could not be opened at all: nothing there to set aside
            beside = self.path.with_name(f"history.{os.getpid()}.sqlite")
            self.problem = (f"The run history {self.path} is in use by another program: this session's runs "
                            f"are remembered in {beside} instead")
            try:
                return self._connect(beside)
            except sqlite3.Error as again:
                return self._in_memory(again)
        except sqlite3.DatabaseError as exc:         # it opened, and what is there is not a database
            return self._aside(exc)
        except (OSError, ValueError) as exc:         # not a folder, not writable, a name no file can have
            return self._in_memory(exc)

    def _in_memory(self, exc: Exception) -> sqlite3.Connection:
        why = getattr(exc, "strerror", None) or exc
        self.problem = (f"The run history cannot be kept at {self.path} ({why}): runs are remembered until the "
                        "window closes only")
        return self._connect(":memory:")

    def _aside(self, exc: Exception) -> sqlite3.Connection:
        stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
        aside = self.path.with_name(f"history.damaged-{stamp}.sqlite")
        try:
            self.path.rename(aside)
        except OSError as moved:
            self.problem = (f"The run history {self.path} could not be read ({exc}) nor moved aside "
                            f"({moved.strerror or moved}): runs are remembered until the window closes only")
            return self._connect(":memory:")
        self.problem = (f"The run history {self.path} could not be read ({exc}): it is kept as {aside.name} and a "
                        "fresh one started")
        return self._connect(self.path)

    @staticmethod
    def _connect(where: str | os.PathLike) -> sqlite3.Connection:
        db = sqlite3.connect(os.fspath(where), timeout=BUSY_S, isolation_level=None)
        try:
            db.execute("PRAGMA foreign_keys = ON")
            check = db.execute("PRAGMA quick_check").fetchone()
            if check is None or check[0] != "ok":
                raise sqlite3.DatabaseError(f"its own check says {check[0] if check else 'nothing'}")
            db.executescript(SCHEMA)
            if where != ":memory:":
                db.execute("PRAGMA journal_mode = WAL")     # a reader (the History view) never waits for a writer
        except BaseException:
            db.close()
            raise
        return db

    def close(self) -> None:
        self.db.close()

    # --- writing ------------------------------------------------------------------------------------------
    def record(self, events: list[object]) -> int | None:
        """Append one run's events (``RunStarted`` to its end) or one experiment's (``ExperimentStarted`` to its
        end, its runs inside). Returns the row's id; None for events that hold neither."""
        first = next((e for e in events if isinstance(e, (RunStarted, ExperimentStarted))), None)
        if first is None:
            return None
        row = _run_row(first, events)
        steps = [] if isinstance(first, ExperimentStarted) else [
            (e.step, e.position, e.latency_ms, held_bytes(e.kv_bytes_per_layer) if e.kv_bytes_per_layer else None)
            for e in events if isinstance(e, TokenStep) and e.run_id == first.run_id]
        trace = _packed(events)
        try:
            self.db.execute("BEGIN IMMEDIATE")
            cursor = self.db.execute(
                "INSERT INTO runs (at, kind, title, engine, model, format, device, machine, settings, ended, "
                "prompt_tokens, generated_tokens, ttft_ms, decode_tok_s, kv_bytes, cpu_share, trace) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", (*row, trace))
            run = cursor.lastrowid
            self.db.executemany("INSERT INTO steps (run, step, context, latency_ms, kv_bytes) VALUES (?, ?, ?, ?, ?)",
                                [(run, *s) for s in steps])
            self.db.execute("COMMIT")
        except sqlite3.Error:
            if self.db.in_transaction:
                self.db.execute("ROLLBACK")
            raise
        if trace is None and events:
            self.said.append(f"run {run}'s trace is larger than {MAX_RUN_TRACE_BYTES >> 20} MiB compressed: its "
                             "figures are kept, not its events")
        self._bound()
        return run

    def _bound(self) -> None:
        """Oldest first: traces beyond ``MAX_TRACE_BYTES`` dropped, steps beyond ``MAX_STEPS`` thinned."""
        total = self.db.execute("SELECT COALESCE(SUM(LENGTH(trace)), 0) FROM runs").fetchone()[0]
        if total > MAX_TRACE_BYTES:
            dropped = 0
            for run, size in self.db.execute("SELECT id, LENGTH(trace) FROM runs WHERE trace IS NOT NULL "
                                             "ORDER BY id").fetchall():
                if total <= MAX_TRACE_BYTES:
                    break
                self.db.execute("UPDATE runs SET trace = NULL WHERE id = ?", (run,))
                total -= size
                dropped += 1
            self.said.append(f"the oldest {dropped:,} runs' traces were dropped to keep the history under "
                             f"{MAX_TRACE_BYTES >> 20} MiB of traces (their figures are kept)")
        count = self.db.execute("SELECT COUNT(*) FROM steps").fetchone()[0]
        if count > MAX_STEPS:
            thinned = 0
            for (run,) in self.db.execute("SELECT id FROM runs WHERE thinned = 0 ORDER BY id").fetchall():
                if count <= MAX_STEPS * 3 // 4:
                    break
                last = self.db.execute("SELECT MAX(step) FROM steps WHERE run = ?", (run,)).fetchone()[0]
                count -= self.db.execute("DELETE FROM steps WHERE run = ? AND step % ? != 0 AND step != ?",
                                         (run, THIN_EVERY, last)).rowcount
                self.db.execute("UPDATE runs SET thinned = 1 WHERE id = ?", (run,))
                thinned += 1
            self.said.append(f"the oldest {thinned:,} runs keep every {THIN_EVERY}th step only, to keep the history "
                             f"under {MAX_STEPS:,} steps")

    # --- reading ------------------------------------------------------------------------------------------
    def runs(self, text: str = "", since: str = "", limit: int = 500) -> list[HistoryRun]:
        """The newest runs first; ``text``: words each found in the model, engine, kind or title; ``since``: an
        ISO date or time (runs at or after it)."""
        query = ("SELECT id, at, kind, title, engine, model, format, device, machine, settings, ended, "
                 "prompt_tokens, generated_tokens, ttft_ms, decode_tok_s, kv_bytes, cpu_share, thinned, "
                 "trace IS NOT NULL FROM runs WHERE at >= ?")
        args: list[object] = [since]
        for word in text.lower().split():
            query += " AND instr(lower(model || ' ' || engine || ' ' || kind || ' ' || title), ?) > 0"
            args.append(word)
        with self._reading():
            rows = self.db.execute(query + " ORDER BY id DESC LIMIT ?", (*args, max(1, limit))).fetchall()
            return [HistoryRun(*r[:9], _settings(r[9]), *r[10:17], bool(r[17]), bool(r[18])) for r in rows]

    def steps(self, run: int) -> list[StepRow]:
        with self._reading():
            rows = self.db.execute("SELECT step, context, latency_ms, kv_bytes FROM steps WHERE run = ? "
                                   "ORDER BY step", (run,)).fetchall()
            return [StepRow(*r) for r in rows]

    @contextlib.contextmanager
    def _reading(self) -> Iterator[None]:
        """What a damaged page, a value of the wrong type or a locked file does to a read: one line."""
        try:
            yield
        except (sqlite3.Error, TypeError, ValueError, OverflowError) as exc:
            raise HistoryError(f"The run history {self.path} could not be read: {exc}"[:400]) from None

    def write_trace(self, runs: int | list[int], path: str | os.PathLike) -> Path:
        """The runs' events as one trace file at ``path`` (read back through the trace reader's own checks), in
        the order given: one recording, so a replay draws them side by side."""
        events: list[object] = []
        for run in [runs] if isinstance(runs, int) else runs:
            with self._reading():
                row = self.db.execute("SELECT trace FROM runs WHERE id = ?", (run,)).fetchone()
            if row is not None and not isinstance(row[0], (bytes, type(None))):
                raise TraceError(f"run {run}'s events in the history are not a stored trace")
            if row is None:
                raise TraceError(f"there is no run {run} in the history")
            if row[0] is None:
                raise TraceError(f"run {run}'s events were not kept (the history keeps the newest runs' traces): "
                                 "its figures are all there is")
            packed = _unpacked(row[0], path)
            try:
                events += read_trace(packed)
            except TraceError as exc:
                raise TraceError(f"run {run}'s events in the run history could not be read back: "
                                 f"{str(exc).replace(packed.name, 'they')}"[:400]) from None
            finally:
                packed.unlink(missing_ok=True)
        return write_trace(path, events)


class HistoryRecorder:
    """A sink: collects each run's (or experiment's) events and appends them to the history when it ends. A
    failure to write is said once (``problem``), never raised into the run."""

    def __init__(self, history: History) -> None:
        self.history = history
        self.open: list[object] = []
        self.problem = history.problem

    def __call__(self, event: object) -> None:
        if isinstance(event, (RunStarted, ExperimentStarted)) and not self.open:
            self.open = [event]
            return
        if not self.open:
            return
        self.open.append(event)
        first = self.open[0]
        ends_run = isinstance(event, (RunFinished, RunFailed)) and isinstance(first, RunStarted) \
            and event.run_id == first.run_id
        ends_experiment = isinstance(event, (ExperimentFinished, ExperimentFailed)) \
            and isinstance(first, ExperimentStarted) and event.exp_id == first.exp_id
        if ends_run or ends_experiment:
            events, self.open = self.open, []
            try:
                self.history.record(events)
            except Exception as exc:  # noqa: BLE001 (remembering a run must never fail the run)
                log.exception("run history")
                self.problem = (f"This run could not be added to the run history {self.history.path}: "
                                f"{type(exc).__name__}: {exc}")[:400]


def _run_row(first: RunStarted | ExperimentStarted, events: list[object]) -> tuple:
    facts = first.model
    served = isinstance(facts, ServerFacts)
    engine = facts.engine if served else "KVScope"
    fmt = "" if served else facts.dtype
    device = facts.device
    at = _when(getattr(first, "started_at", ""))
    if isinstance(first, ExperimentStarted):
        ended = next((e for e in events if isinstance(e, (ExperimentFinished, ExperimentFailed))), None)
        words = "stopped early" if ended is None else ended.reason if isinstance(ended, ExperimentFinished) \
            else f"failed: {ended.message}"[:200]
        share = getattr(ended.result, "lowest_cpu_share", None) if isinstance(ended, ExperimentFinished) else None
        runs = sum(1 for e in events if isinstance(e, RunStarted))
        return (at, f"experiment: {first.kind}", f"{first.kind} ({runs} runs)", engine, facts.name, fmt, device,
                _machine(), _json(plain(first.settings)), words, None, None, None, None, None, share)
    ended = next((e for e in events if isinstance(e, (RunFinished, RunFailed)) and e.run_id == first.run_id), None)
    summary = ended.summary if ended is not None else None
    words = "stopped early" if ended is None else ended.reason if isinstance(ended, RunFinished) \
        else f"failed: {ended.message}"[:200]
    decode = summary.decode_tok_s if summary is not None and summary.decode_runs else None
    return (at, first.kind, first.label or first.prompt[:80], engine, facts.name, fmt, device, _machine(),
            _json(plain(first.params)), words, summary.prompt_tokens if summary else None,
            summary.generated_tokens if summary else None, summary.ttft_ms if summary else None, decode,
            summary.kv_bytes if summary else None, summary.cpu_share if summary else None)


def _packed(events: Iterable[object]) -> bytes | None:
    """The events as a compressed trace (the trace file's own lines), or None past ``MAX_RUN_TRACE_BYTES``."""
    kept = TRACE_EVENTS + lessons.lesson_events()
    buffer = io.BytesIO()
    with gzip.GzipFile(fileobj=buffer, mode="wb", mtime=0) as packed:
        packed.write((json.dumps(header()) + "\n").encode())
        for event in events:
            if isinstance(event, kept):
                packed.write((event_line(to_dict(event)) + "\n").encode("utf-8", "replace"))
            if buffer.tell() > MAX_RUN_TRACE_BYTES:
                return None
    data = buffer.getvalue()
    return data if len(data) <= MAX_RUN_TRACE_BYTES else None


def _unpacked(data: bytes, beside: str | os.PathLike) -> Path:
    """The stored trace as a temporary ``.gz`` file next to where it will be written (read, then removed)."""
    path = Path(beside).with_name(f".{Path(beside).name}.{os.getpid()}.{time.monotonic_ns()}.gz")
    path.write_bytes(data)
    return path


@functools.cache
def _machine() -> str:
    cpu = ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{platform.node() or 'this machine'}, {cpu or platform.processor() or platform.machine()}, " \
           f"{os.cpu_count() or 0} cores"


def _when(started_at: str) -> str:
    """A run's own start time when it says one (ISO 8601), else now."""
    try:
        return datetime.fromisoformat(started_at).astimezone(timezone.utc).isoformat(timespec="seconds")
    except (TypeError, ValueError):
        return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _json(value: object) -> str:
    return json.dumps(value, allow_nan=False, default=str)


def _settings(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}
