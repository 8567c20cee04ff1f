"""A lecture as a file: the scenes in the speaker's order, each with the traces it shows. The window presents
it (PgDn / PgUp step through it, each scene showing its own trace's run) and the renderer turns it into one
video; ``make record-lecture`` writes one beside its screenshots.

::

    {"kvscope": "lecture", "version": 1,
     "scenes": [{"scene": "prefill", "traces": ["prefill.kvscope.jsonl"]},
                {"scene": "memory", "traces": ["depth.kvscope.jsonl"]}]}

Trace paths are relative to the file. Everything is checked before anything is shown: one line names what is
wrong and where.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from app.lecture.scene_list import NAMES
from engine.facts.bounded import read_bounded
from engine.facts.errors import EngineError
from engine.store.files import writable_target, write_text

MAX_BYTES = 1 << 20
MAX_SCENES = 64
MAX_TRACES = 16
SUFFIX = ".kvscope-lecture.json"


class LectureFileError(EngineError):
    """A lecture file that cannot be presented, said in one line."""


@dataclass(frozen=True)
class LectureScene:
    scene: str
    traces: tuple[Path, ...]


def is_lecture_file(path: str | os.PathLike) -> bool:
    """A lecture file by its name (``*.kvscope-lecture.json``), or a ``.json`` whose first bytes say so."""
    name = os.fspath(path)
    if name.endswith(SUFFIX):
        return True
    if not name.endswith(".json"):
        return False
    try:
        with open(name, "rb") as f:
            head = f.read(256)
    except OSError:
        return False
    return b'"kvscope"' in head and b'"lecture"' in head


def read_lecture(path: str | os.PathLike) -> list[LectureScene]:
    where = Path(path)
    try:
        data = json.loads(read_bounded(where, MAX_BYTES).decode("utf-8"))
    except OSError as exc:
        raise LectureFileError(f"Cannot read the lecture file {where}: {exc.strerror or exc}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise LectureFileError(f"{where} is not a lecture file (not JSON: {exc})") from None
    except ValueError:              # Python's own bound on the digits of a whole number (4,300 by default)
        raise LectureFileError(f"{where} is not a lecture file: it holds a number with thousands of digits") from None
    except RecursionError:
        raise LectureFileError(f"{where} is not a lecture file: it is nested too deeply to be one") from None
    if not isinstance(data, dict) or data.get("kvscope") != "lecture":
        raise LectureFileError(f'{where} is not a lecture file (no "kvscope": "lecture")')
    if data.get("version") != 1:
        raise LectureFileError(f"{where}: lecture file version {repr(data.get('version'))[:20]}; this KVScope "
                               "reads 1")
    scenes = data.get("scenes")
    if not isinstance(scenes, list) or not 1 <= len(scenes) <= MAX_SCENES:
        raise LectureFileError(f'{where}: "scenes" must be a list of 1 to {MAX_SCENES} scenes')
    out = []
    for i, entry in enumerate(scenes, 1):
        if not isinstance(entry, dict):
            raise LectureFileError(f"{where}: scene {i} must be an object with a scene and its traces")
        name, traces = entry.get("scene"), entry.get("traces")
        if name not in NAMES:
            raise LectureFileError(f"{where}: scene {i} is {name!r}; the scenes are {', '.join(NAMES)}")
        if (not isinstance(traces, list) or not 1 <= len(traces) <= MAX_TRACES
                or not all(isinstance(t, str) and t for t in traces)):
            raise LectureFileError(f'{where}: scene {i} ({name}): "traces" must list 1 to {MAX_TRACES} files')
        paths = tuple((where.parent / t) for t in traces)
        for trace in paths:
            if not trace.is_file():
                raise LectureFileError(f"{where}: scene {i} ({name}): no trace at {trace}")
        out.append(LectureScene(name, paths))
    return out


def write_lecture(path: str | os.PathLike, scenes: Sequence[LectureScene]) -> Path:
    """Written beside its traces (their paths relative to it), atomically; never over one of its traces."""
    traces = [t for s in scenes for t in s.traces]
    where = writable_target(path, "the lecture file", f"course{SUFFIX}", inputs=traces)
    entries = [{"scene": s.scene, "traces": [os.path.relpath(t, where.parent) for t in s.traces]} for s in scenes]
    text = json.dumps({"kvscope": "lecture", "version": 1, "scenes": entries}, indent=1) + "\n"
    return write_text(where, text, "the lecture file")
