"""The course that ships: every scene of it has its data, renders on its trace's own clock, never stands still for
a second outside its declared hold, and ends with nothing clipped; ``--course`` and ``app.lecture.course`` around
it."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import pytest

from app.lecture.course import BUDGET_BYTES, LECTURE, SUFFIX, course_lecture, lecture_plan, recordings
from app.lecture.lecture_file import read_lecture
from app.lecture.render import Renderer, RenderSettings, frame_count, missing_data, schedule
from app.lecture.scene_list import SCENES
from app.views.audit import AuditedView, judge, read_view
from engine import lessons as engine_lessons
from engine.facts.events import ExperimentFinished, ExperimentStarted, RunFinished, RunStarted
from engine.output.trace import read_trace, read_traces, recorded
from tests.app.conftest import close_and_dispose, make_window

ROOT = Path(__file__).resolve().parents[2]
SETTINGS = RenderSettings(width=1280, height=720, fps=2, max_wait_s=1.0, lead_s=0.0, hold_s=1.0)
SHIPPED = read_lecture(course_lecture()) if course_lecture().is_file() else []


class Frames:
    """An encoder that keeps each frame's digest: what changed, and when, without encoding a video."""

    seen: list[bytes] = []

    def __init__(self, path, fmt, settings) -> None:
        self.path = path
        Frames.seen = []

    def __enter__(self) -> Frames:
        return self

    def __exit__(self, *exc) -> None:
        self.path.write_bytes(b"")                                 # the renderer renames it into place

    def add(self, image) -> None:
        Frames.seen.append(hashlib.blake2b(bytes(image.constBits()), digest_size=16).digest())


def test_the_course_ships_every_scene_each_from_its_own_recording_within_its_size_budget():
    assert [s.scene for s in SHIPPED] == [s.name for s in SCENES]
    folder = course_lecture().parent
    assert SHIPPED == lecture_plan(folder)                         # the lecture file lists what was recorded
    traces = sorted(folder.glob(f"*{SUFFIX}"))
    assert {t.name for t in traces} == {r.file for r in recordings()}
    assert sum(t.stat().st_size for t in traces) + (folder / LECTURE).stat().st_size <= BUDGET_BYTES
    for trace in traces:
        assert trace.read_bytes()[:2] == b"\x1f\x8b", f"{trace.name} is shipped compressed"
        assert recorded(read_trace(trace)).startswith("recorded 20")


def test_every_lesson_a_scene_draws_declares_settings_for_the_course_that_its_checks_accept():
    kinds = {r.kind for r in recordings()} - {"run", "attention"}
    for kind in kinds:
        lesson = engine_lessons.lesson(kind)
        settings = lesson.settings(**lesson.course)               # the declared ranges refuse a wrong one
        assert all(getattr(settings, k) == v for k, v in lesson.course.items())
        assert lesson.course or lesson.target == "server", f"{kind} records the course at its full defaults"


@pytest.mark.parametrize("entry", SHIPPED, ids=[s.scene for s in SHIPPED])
def test_each_shipped_scene_renders_from_its_data_on_its_clock_never_still_and_keeps_the_screen_rules(
        qtbot, monkeypatch, tmp_path, entry):
    import app.lecture.render as render

    assert missing_data(entry) is None                              # never "press R"
    traces = read_traces(entry.traces)
    plan = schedule([e for t in traces for e in t], SETTINGS)
    lengths = []
    for trace in traces:               # how long each recording ran, by its own start and end (a run's or a lesson's)
        start = next(e for e in trace if isinstance(e, (ExperimentStarted, RunStarted)))
        end = next(e for e in reversed(trace) if isinstance(e, (ExperimentFinished, RunFinished)))
        lengths.append((end.t_ms - start.t_ms) / 1000.0)
    assert sum(w.recorded_s for w, _ in plan) == pytest.approx(sum(lengths), abs=0.01)
    video_s = SETTINGS.lead_s + sum(min(w.recorded_s, SETTINGS.max_wait_s) for w, _ in plan) + SETTINGS.hold_s
    monkeypatch.setattr(render, "_Encoder", Frames)
    window = make_window(qtbot)
    readings = []
    total = frame_count([plan], SETTINGS)

    findings = []

    def progress(done: int, _total: int, _scene: str) -> None:
        if done == total:                                           # the final state, held
            readings.append(read_view(AuditedView("scene", lambda: window.scene_view, ""), window.scene_view))
            # the screen audit's rules, painted ones included, on the rendered frame's window as it was grabbed
            findings.extend(judge(window.audit.read(), window.known()))

    try:
        report = Renderer(window, SETTINGS, tmp_path / "scene.mp4", progress).render([entry])
    finally:
        close_and_dispose(window)
    assert report.frames == total == round(video_s * SETTINGS.fps)
    frames = Frames.seen
    held = round(SETTINGS.hold_s * SETTINGS.fps)
    still, longest = 0, 0
    for before, after in zip(frames[:-held - 1], frames[1:-held]):
        still = still + 1 if after == before else 0
        longest = max(longest, still)
    assert longest < SETTINGS.fps, f"{entry.scene}: {longest / SETTINGS.fps:.1f} s without a change"
    assert len(set(frames)) > len(frames) // 3                      # it moves: many distinct frames, not a few
    final = readings[0]
    assert not final.clipped and not [c for chart in final.charts for c in chart.clipped], final
    assert not findings, findings
    assert recorded(traces[0]) in " ".join(final.texts)             # whose figures they are, on screen


def test_course_opens_the_shipped_lecture_and_is_refused_with_traces_or_without_a_course(tmp_path, monkeypatch):
    from app import main

    args = main.parse_args(["--course"])
    assert main.given_traces(args) == [str(course_lecture())] and main.course_refused(args) is None
    assert "without traces" in main.course_refused(main.parse_args(["--course", "run.kvscope.jsonl"]))
    monkeypatch.setattr("app.lecture.course.course_folder", lambda: tmp_path)
    assert "make course" in main.course_refused(args)


def test_the_recorder_writes_the_scenes_asked_for_and_a_lecture_of_what_exists(tmp_path, tiny_model_dir):
    out = subprocess.run([sys.executable, "-m", "app.lecture.course", "--out", str(tmp_path),
                          "--model", str(tiny_model_dir), "--scene", "prefill", "--scene", "paged"],
                         capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert out.returncode == 0, out.stderr
    assert sorted(p.name for p in tmp_path.glob(f"*{SUFFIX}")) == [f"paged{SUFFIX}", f"run{SUFFIX}"]
    plan = read_lecture(tmp_path / LECTURE)
    assert [s.scene for s in plan] == ["prefill", "kv", "sampling", "paged"]
    assert missing_data(plan[-1]) is None and missing_data(plan[0]) is None


def test_a_scene_credits_its_recording_until_a_live_run_replaces_it(qtbot, window, tmp_path, tiny):
    from app.lecture.lecture_file import LectureScene, write_lecture
    from engine.facts.params import GenerationParams
    from engine.output.trace import write_trace
    from engine.run.session import Session
    from tests.app.conftest import run_and_wait, wait_idle

    events: list = []
    Session(tiny).run("hello", GenerationParams(max_new_tokens=3), events.append)
    trace = write_trace(tmp_path / f"run{SUFFIX}", events)
    credit = recorded(read_trace(trace))
    lecture = write_lecture(tmp_path / LECTURE, [LectureScene("prefill", (trace,)), LectureScene("kv", (trace,))])
    window.files.open_trace(str(lecture))
    wait_idle(qtbot, window)
    window.refresh(force=True)
    assert window.state.scene == "prefill" and credit in window.scene_view.claim()
    window.controls.max_tokens.setValue(2)
    live = run_and_wait(qtbot, window)
    window.lecture.step(1)                                   # the next scene of the course shows the live run
    assert window.state.scene == "kv" and window.state.selected == live.run_id
    window.refresh(force=True)
    assert "recorded" not in window.scene_view.claim()       # this machine, now: nothing to credit


def test_the_timeline_never_draws_a_recorded_run_beside_another_recording_or_a_live_one(qtbot, window, tmp_path,
                                                                                       tiny):
    from engine.facts.params import GenerationParams
    from engine.output.trace import write_trace
    from engine.run.session import Session
    from tests.app.conftest import run_and_wait, wait_idle

    paths = []
    for name in ("first", "second"):
        events: list = []
        Session(tiny).run(f"{name} prompt", GenerationParams(max_new_tokens=3), events.append)
        paths.append(str(write_trace(tmp_path / f"{name}{SUFFIX}", events)))
    window.controller.replay_speed = 0.0
    window.files.open_trace(*paths)
    wait_idle(qtbot, window)
    first, second = window.store.runs
    window.state.select(first.run_id, "test")
    assert [r.run_id for r in window.timing.visible_runs()] == [first.run_id]      # not the other trace's run
    window.controls.max_tokens.setValue(2)
    live = run_and_wait(qtbot, window)
    assert [r.run_id for r in window.timing.visible_runs()] == [live.run_id]       # not the recordings
    window.state.select(second.run_id, "test")
    assert [r.run_id for r in window.timing.visible_runs()] == [second.run_id]
