"""The course that ships: every scene's data recorded on a real model by the real engine, as compressed traces and
one lecture file, so ``kvscope --course`` presents (and ``kvscope --render OUT --course`` renders) every scene with
no model loaded and nothing recorded first.

``python -m app.lecture.course --out resources/course`` (``make course``) records it again on this machine, on the
embedded model or ``--model``: the run scenes from one plain run and one that records attention, each lesson's
scene from its lesson with the settings the lesson declares for the course (``Lesson.course``: minutes on a
two-core laptop, not hours). The serving scene needs a server (``--server URL`` records the server lesson against
it); without one its trace is kept as it is. Every trace is written atomically, so a stopped recording leaves the
scenes already recorded whole, and the lecture file lists only scenes whose trace exists.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from app import lessons
from app.lecture.lecture_file import LectureScene, write_lecture
from app.lecture.scene_list import SCENES

LECTURE = "course.kvscope-lecture.json"
SUFFIX = ".kvscope.jsonl.gz"
PROMPT = "Explain in two sentences why decode reads the whole KV cache."
RUN = {"max_new_tokens": 48, "temperature": 0.7, "top_k": 40, "top_p": 0.95, "seed": 7}
ATTENTION = {"max_new_tokens": 24, "temperature": 0.0, "capture_attention": True}
BUDGET_BYTES = 8 << 20          # the whole course, compressed: what it may add to the wheel


@dataclass(frozen=True)
class Recording:
    """One trace of the course: ``file`` under the course folder, made by ``kind`` (``run``, ``attention``, or a
    lesson's kind) and drawn by ``scenes``."""

    file: str
    kind: str
    scenes: tuple[str, ...]


def recordings() -> tuple[Recording, ...]:
    """What the course records, from the scene list: one plain run for the run scenes, one that records attention,
    and each lesson a scene draws (the scene's own, and one joined to it)."""
    runs = tuple(s.name for s in SCENES if s.lesson is None and s.name != "attention")
    out = [Recording(f"run{SUFFIX}", "run", runs),
           Recording(f"attention{SUFFIX}", "attention", ("attention",))]
    joined = lessons.joins()
    for scene in SCENES:
        if scene.lesson is None:
            continue
        out.append(Recording(f"{scene.name}{SUFFIX}", scene.lesson, (scene.name,)))
        if scene.name in joined:
            kind = joined[scene.name][0]
            out.append(Recording(f"{scene.name}-{kind}{SUFFIX}", kind, (scene.name,)))
    return tuple(out)


def course_folder() -> Path:
    from engine.store.resources import resources_dir

    return resources_dir() / "course"


def course_lecture() -> Path:
    """The shipped course's lecture file (it may be missing from a checkout that never recorded one)."""
    return course_folder() / LECTURE


def lecture_plan(folder: Path) -> list[LectureScene]:
    """Every scene in the lecture's order with the course traces that exist for it."""
    by_scene: dict[str, list[Path]] = {}
    for rec in recordings():
        if (folder / rec.file).is_file():
            for scene in rec.scenes:
                by_scene.setdefault(scene, []).append(folder / rec.file)
    return [LectureScene(s.name, tuple(by_scene[s.name])) for s in SCENES if s.name in by_scene]


def record(folder: Path, model: str = "embedded", only: Sequence[str] = (), server: str | None = None,
           say: Callable[[str], None] = print) -> Path:
    """Record the course's traces into ``folder`` (``only``: these scenes), then write its lecture file."""
    from engine import lessons as engine_lessons
    from engine.facts.params import GenerationParams
    from engine.model.hardware import peaks_event
    from engine.model.models import load
    from engine.output.trace import write_checked
    from engine.run.experiment import run_lesson
    from engine.run.session import Session

    folder.mkdir(parents=True, exist_ok=True)
    wanted = [r for r in recordings() if not only or set(r.scenes) & set(only)]
    local = [r for r in wanted if r.kind in ("run", "attention") or engine_lessons.lesson(r.kind).target != "server"]
    session = peaks = None
    if local:
        say(f"loading {model}")
        loaded = load(model)
        session, peaks = Session(loaded), peaks_event(loaded)
    for rec in wanted:
        started = time.perf_counter()
        events: list[object] = []
        if rec.kind in ("run", "attention"):
            settings = RUN if rec.kind == "run" else ATTENTION
            if peaks is not None:                    # the replay's ceilings: this machine's, not the viewer's
                events.append(peaks)
            session.run(PROMPT, GenerationParams(**settings), events.append, threading.Event())
        else:
            lesson = engine_lessons.lesson(rec.kind)
            if lesson.target == "server":
                if server is None:
                    say(f"{rec.file}: kept as it is (the serving scene records against a server: --server URL)")
                    continue
                from engine.serve.remote import RemoteSession, probe

                target, lesson_peaks = RemoteSession(probe(server)), None
            else:
                target, lesson_peaks = session, peaks
            run_lesson(lesson, target, lesson.settings(**lesson.course), events.append, None, lesson_peaks)
        written = write_checked(folder / rec.file, events)
        size = written.path.stat().st_size
        say(f"{rec.file}: {len(events):,} events, {size / 1024:,.0f} KiB, recorded in "
            f"{time.perf_counter() - started:,.1f} s" + (f" ({written.note})" if written.note else ""))
    return write_lecture(folder / LECTURE, lecture_plan(folder))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m app.lecture.course", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=None, help="the course folder (default: the shipped one)")
    p.add_argument("--model", default="embedded", help="the model to record on (default: the embedded one)")
    p.add_argument("--scene", action="append", default=[], choices=[s.name for s in SCENES],
                   help="record only this scene (repeatable)")
    p.add_argument("--server", metavar="URL", help="a server to record the serving scene against")
    args = p.parse_args(argv)
    folder = args.out or course_folder()
    from engine.facts.errors import EngineError

    try:
        lecture = record(folder, args.model, args.scene, args.server,
                         lambda line: print(line, file=sys.stderr, flush=True))
    except EngineError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:          # a full disk, a folder that went away: one line, the scenes written so far kept
        print(f"error: {exc.strerror or exc}{f' ({exc.filename})' if exc.filename else ''}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted: the scenes recorded so far are kept", file=sys.stderr)
        return 130
    total = sum(p.stat().st_size for p in folder.glob(f"*{SUFFIX}"))
    print(f"{lecture}: {len(lecture_plan(folder))} scenes, {total / 2**20:,.2f} MiB of traces")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
