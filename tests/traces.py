"""Traces as rows in a test: a recording's parsed JSON lines, and rows (changed by the test) written back as a file,
so a test that checks what the reader refuses says only which field it broke."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.facts.errors import TraceError
from engine.output.trace import read_trace, write_trace


def rows_of(events: list, path: Path) -> list[dict]:
    """``events`` written as a trace at ``path`` and read back as parsed JSON lines (header first)."""
    written = write_trace(path, events)
    return [json.loads(line) for line in written.read_text().splitlines()]


def write_rows(path: Path, rows: list, raw_tail: str = "") -> Path:
    """``rows`` (dicts, or strings written as they are) as a trace file, then ``raw_tail`` unchanged."""
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n" + raw_tail)
    return path


def first_row(rows: list[dict], kind: str, where=lambda row: True) -> int:
    """The index of the first row of event type ``kind`` that ``where`` accepts."""
    return next(i for i, r in enumerate(rows) if r.get("type") == kind and where(r))


def refused_with(path: Path, rows: list[dict], index: int, changes: dict, fragment: str) -> TraceError:
    """Row ``index`` changed by ``changes``, written to ``path``: the reader must refuse it naming ``fragment``,
    in one line that names the file and line."""
    bad = json.loads(json.dumps(rows))
    bad[index].update(changes)
    write_rows(path, bad)
    with pytest.raises(TraceError, match=fragment) as info:
        read_trace(path)
    assert f"{path.name} line" in str(info.value) and "\n" not in str(info.value)
    return info.value
