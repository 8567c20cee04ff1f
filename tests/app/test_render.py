"""Rendering scenes to video from traces: frames on the trace's clock whatever the machine, the frame count known
before the first, frames that change as the tokens arrive and while a prefill runs, long waits fast-forwarded and
said, cancel and errors leaving no file; the CLI; a lecture file presented in the window."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import av
import numpy as np
import pytest
from PySide6.QtCore import QRect

from app.lecture.lecture_file import LectureFileError, LectureScene, read_lecture, write_lecture
from app.lecture.render import Cancelled, Renderer, RenderError, RenderSettings, frame_count, plan_scenes, schedule
from app.lecture.video_export import VideoExport
from app.views import theme as th
from engine.facts.events import RunStarted, TokenStep
from engine.facts.params import GenerationParams
from engine.output.trace import read_trace, write_trace
from engine.run.session import Session
from tests.app.conftest import close_and_dispose, make_window, wait_idle

TOKENS = 8


def paced(events: list, prefill_ms: float, step_ms: float) -> list:
    """A real run's events with its clock set: the prompt's pass ends at ``prefill_ms``, then a token every
    ``step_ms`` (a tiny model decodes faster than a frame; a real one at this pace)."""
    out, t = [], prefill_ms                      # what comes before the first token ends the prompt's pass
    for event in events:
        if isinstance(event, TokenStep):
            t = prefill_ms + event.step * step_ms
            event = dataclasses.replace(event, t_ms=t, latency_ms=prefill_ms if event.step == 0 else step_ms)
        elif isinstance(event, RunStarted):
            event = dataclasses.replace(event, t_ms=0.0)     # the clock starts here, however long tokenizing took
        elif hasattr(event, "t_ms"):
            event = dataclasses.replace(event, t_ms=t)
        out.append(event)
    return out


@pytest.fixture(scope="module")
def run_events(tiny):
    events: list = []
    Session(tiny).run("hello world", GenerationParams(max_new_tokens=TOKENS), events.append)
    return events


def trace_file(tmp_path, events, name="run"):
    return write_trace(tmp_path / f"{name}.kvscope.jsonl", events)


def decoded(path) -> list[np.ndarray]:
    with av.open(str(path)) as container:
        return [frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)]


def changes(frames: list[np.ndarray]) -> list[int]:
    """The indices of the frames that differ from the one before."""
    return [i for i in range(1, len(frames)) if np.abs(frames[i].astype(int) - frames[i - 1]).mean() > 0.01]


def render(qtbot, scenes, path, **settings):
    window = make_window(qtbot)
    try:
        renderer = Renderer(window, RenderSettings(**settings), path)
        return renderer.render(scenes)
    finally:
        close_and_dispose(window)


def test_two_scenes_render_to_the_frames_predicted_and_change_as_each_token_arrives(qtbot, tmp_path, run_events):
    trace = trace_file(tmp_path, paced(run_events, prefill_ms=500, step_ms=300))
    scenes = [LectureScene("prefill", (trace,)), LectureScene("kv", (trace,))]
    settings = dict(width=640, height=360, fps=10, hold_s=1.0)
    plans = [schedule(read_trace(trace), RenderSettings(**settings))] * 2
    report = render(qtbot, scenes, tmp_path / "two.mp4", **settings)
    frames = decoded(report.path)
    assert len(frames) == report.frames == frame_count(plans, RenderSettings(**settings))
    assert frames[0].shape == (360, 640, 3)
    per_scene = len(frames) // 2
    assert report.scenes == ("prefill", "kv") and per_scene == round((0.5 + (TOKENS - 1) * 0.3 + 1.0) * 10)
    for first in (0, per_scene):                  # each token, 3 frames apart, changes the picture
        arrivals = [first + 5 + 3 * k for k in range(TOKENS)]
        changed = set(changes(frames[first:first + per_scene]))
        assert all(a - first in changed for a in arrivals[1:]), (sorted(changed), arrivals)
    assert not list(tmp_path.glob(".*partial*"))


def test_a_gif_holds_every_frame(qtbot, tmp_path, run_events):
    trace = trace_file(tmp_path, paced(run_events, prefill_ms=200, step_ms=200))
    report = render(qtbot, [LectureScene("kv", (trace,))], tmp_path / "kv.gif", width=640, height=360, fps=5,
                    hold_s=1.0)
    with av.open(str(report.path)) as container:
        assert container.streams.video[0].codec_context.name == "gif"
    assert len(decoded(report.path)) == report.frames == round((0.2 + (TOKENS - 1) * 0.2 + 1.0) * 5)


def freezes(path, seconds: float) -> list[tuple[float, float]]:
    """ffmpeg's freezedetect over the video (at its default noise, -60 dB): the frozen intervals of at least
    ``seconds``."""
    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        graph = av.filter.Graph()
        source = graph.add_buffer(template=stream)
        detect, sink = graph.add("freezedetect", f"n=-60dB:d={seconds}"), graph.add("buffersink")
        source.link_to(detect)
        detect.link_to(sink)
        graph.configure()
        starts, out = [], []
        for frame in container.decode(video=0):
            graph.push(frame)
            while True:
                try:
                    shown = graph.pull()
                except (av.error.BlockingIOError, av.error.EOFError):
                    break
                meta = shown.metadata
                if "lavfi.freezedetect.freeze_start" in meta:
                    starts.append(float(meta["lavfi.freezedetect.freeze_start"]))
                if "lavfi.freezedetect.freeze_end" in meta:
                    out.append((starts.pop(), float(meta["lavfi.freezedetect.freeze_end"])))
        out += [(start, math_inf) for start in starts]
    return out


math_inf = float("inf")


def test_a_long_prefill_never_freezes_the_prefill_scene(qtbot, tmp_path, run_events):
    trace = trace_file(tmp_path, paced(run_events, prefill_ms=4000, step_ms=100))
    report = render(qtbot, [LectureScene("prefill", (trace,))], tmp_path / "prefill.mp4", width=960, height=540,
                    fps=10, hold_s=1.0, max_wait_s=10)
    frozen = freezes(report.path, 0.5)
    assert not [f for f in frozen if f[0] < 4.0], frozen        # the last one is the held final state


def test_a_wait_longer_than_the_limit_is_fast_forwarded_and_the_frames_say_so(qtbot, tmp_path, run_events):
    events = paced(run_events, prefill_ms=20_000, step_ms=100)
    plan = schedule(events, RenderSettings(max_wait_s=2.0))
    long = [w for w, _ in plan if w.recorded_s > 10]
    assert len(long) == 1 and long[0].recorded_s == pytest.approx(20.0, abs=0.01) and long[0].shown_s == 2.0
    report = render(qtbot, [LectureScene("prefill", (trace_file(tmp_path, events),))], tmp_path / "ff.mp4",
                    width=640, height=360, fps=5, max_wait_s=2.0, hold_s=0.5)
    frames = decoded(report.path)
    assert len(frames) == round((2.0 + (TOKENS - 1) * 0.1 + 0.5) * 5)
    band = frames[5][-20:-14, -60:-20].reshape(-1, 3)        # the note's band, bottom right, during the wait
    grey = np.array([int(th.FORMULA[i:i + 2], 16) for i in (1, 3, 5)])
    assert (np.abs(band.astype(int) - grey).max(axis=1) < 40).mean() > 0.5
    assert not (np.abs(frames[-1][-20:-14, -60:-20].reshape(-1, 3).astype(int) - grey).max(axis=1) < 40).mean() > 0.5


def test_a_cancelled_render_leaves_no_file(qtbot, tmp_path, run_events):
    trace = trace_file(tmp_path, paced(run_events, prefill_ms=500, step_ms=300))
    out = tmp_path / "videos"
    out.mkdir()
    window = make_window(qtbot)
    counted = []
    try:
        renderer = Renderer(window, RenderSettings(640, 360, fps=10), out / "out.mp4",
                            progress=lambda done, total, scene: counted.append(done),
                            cancelled=lambda: len(counted) >= 3)
        with pytest.raises(Cancelled):
            renderer.render([LectureScene("prefill", (trace,))])
    finally:
        close_and_dispose(window)
    assert counted == [1, 2, 3] and list(out.iterdir()) == []


def test_a_still_that_cannot_be_written_fails_the_render_instead_of_being_listed(qtbot, tmp_path, run_events,
                                                                                 monkeypatch):
    """QImage.save's False was ignored: a stills folder on a full disk rendered to 100%, listed its stills and
    exited 0 with none written. The still is written like any file now; a full disk raises."""
    import errno

    import app.lecture.render as render_module

    def full(path, data, what="the file"):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(render_module, "write_bytes", full)
    trace = trace_file(tmp_path, paced(run_events, prefill_ms=50, step_ms=30))
    window = make_window(qtbot)
    try:
        renderer = Renderer(window, RenderSettings(640, 360, fps=5), tmp_path / "out.mp4", stills=tmp_path / "s")
        with pytest.raises(OSError, match="No space left on device"):
            renderer.render([LectureScene("prefill", (trace,))])
    finally:
        close_and_dispose(window)
    assert not (tmp_path / "out.mp4").exists() and list((tmp_path / "s").iterdir()) == []


@pytest.mark.parametrize(("settings", "words"), [(dict(width=641), "even width"), (dict(fps=0), "--fps"),
                                                 (dict(width=100), "from 320x240"), (dict(speed=0), "--speed")])
def test_settings_out_of_range_are_refused_in_words(settings, words):
    with pytest.raises(RenderError, match=words):
        RenderSettings(**settings)


def test_the_render_command_writes_a_video_and_refuses_bad_input_in_one_line(tmp_path, run_events, cache_root):
    trace = trace_file(tmp_path, paced(run_events, prefill_ms=200, step_ms=200))
    env = {**os.environ, "KVSCOPE_CACHE_DIR": str(cache_root)}
    env.pop("QT_QPA_PLATFORM", None)                            # the command sets its own offscreen screen
    out = tmp_path / "scene.gif"
    ok = subprocess.run([sys.executable, "-m", "app", "--render", str(out), "--scene", "kv", "--size", "640x360",
                         "--fps", "5", str(trace)], capture_output=True, text=True, timeout=180, env=env)
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert f"{out}: {len(decoded(out))} frames" in ok.stdout and "rendered in" in ok.stdout
    bad = subprocess.run([sys.executable, "-m", "app", "--render", str(tmp_path / "x.mp4"), "--size", "641x360",
                          str(trace)], capture_output=True, text=True, timeout=120, env=env)
    assert bad.returncode == 2 and bad.stderr.strip().splitlines() == [
        "kvscope: --size 641x360: H.264 needs an even width and height"]
    assert not (tmp_path / "x.mp4").exists()


PEAK_RSS = """
import sys
from app.main import main
try:
    code = main(sys.argv[1:])
finally:                    # VmHWM: this program's own peak (ru_maxrss keeps the parent's from before exec)
    peak = next(line for line in open("/proc/self/status") if line.startswith("VmHWM"))
    print("peak", peak.split()[1], file=sys.stderr)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the peak from Linux's /proc")
def test_a_gifs_memory_does_not_grow_with_its_frames(tmp_path, run_events, cache_root):
    """Three times the frames, the same peak memory (within a frame's worth of noise): frames are spooled to disk
    between the GIF's two passes, never held together (one palette over the clip in one pass held them all)."""
    env = {**os.environ, "KVSCOPE_CACHE_DIR": str(cache_root)}
    env.pop("QT_QPA_PLATFORM", None)
    peaks = []
    for step_ms in (100, 300):                                  # 3x the video's length at the same fps
        trace = trace_file(tmp_path, paced(run_events, prefill_ms=200, step_ms=step_ms), f"run{step_ms}")
        out = tmp_path / f"clip{step_ms}.gif"
        done = subprocess.run([sys.executable, "-c", PEAK_RSS, "--render", str(out), "--scene", "kv", "--size",
                               "1280x720", "--fps", "20", str(trace)], capture_output=True, text=True, timeout=300,
                              env=env)
        assert done.returncode == 0, done.stderr[-2000:]
        peaks.append(int(done.stderr.rsplit("peak", 1)[1]) * 1024)
        frames = int(done.stdout.split(": ", 1)[1].split(" frames")[0])
        assert len(decoded(out)) == frames
    frame = 1280 * 720 * 3
    assert peaks[1] - peaks[0] < 20 * frame, [p / 2**20 for p in peaks]      # 2x more frames: no 2x-frames growth


def test_a_lecture_file_round_trips_and_is_refused_in_one_line_when_wrong(tmp_path, run_events):
    trace = trace_file(tmp_path, run_events)
    path = write_lecture(tmp_path / "talk.kvscope-lecture.json", [LectureScene("prefill", (trace,)),
                                                                   LectureScene("kv", (trace,))])
    assert read_lecture(path) == [LectureScene("prefill", (trace,)), LectureScene("kv", (trace,))]
    assert plan_scenes([str(path)], None) == read_lecture(path)
    for text, words in (('{"kvscope": "lecture", "version": 1, "scenes": [{"scene": "nope", "traces": ["a"]}]}',
                         "scene 1 is 'nope'"),
                        ('{"kvscope": "lecture", "version": 1, "scenes": [{"scene": "kv", "traces": ["gone.jsonl"]}]}',
                         "no trace at"),
                        ('{"kvscope": "lecture", "version": 2, "scenes": []}', "version 2"),
                        ("[1, 2", "not JSON")):
        (tmp_path / "bad.json").write_text(text)
        with pytest.raises(LectureFileError, match=words):
            read_lecture(tmp_path / "bad.json")


def test_the_window_presents_a_lecture_file_in_its_order_each_scene_on_its_own_traces_run(qtbot, tmp_path, tiny,
                                                                                         run_events):
    other: list = []
    Session(tiny).run("another prompt", GenerationParams(max_new_tokens=3), other.append)
    first, second = trace_file(tmp_path, run_events, "first"), trace_file(tmp_path, other, "second")
    path = write_lecture(tmp_path / "talk.kvscope-lecture.json",
                         [LectureScene("kv", (first,)), LectureScene("prefill", (second,)),
                          LectureScene("kv", (second,))])
    window = make_window(qtbot)
    try:
        window.files.open_trace(str(path))
        wait_idle(qtbot, window)
        ids = {r.source: r.run_id for r in window.store.runs}
        assert window.state.scene == "kv" and window.state.selected == ids[str(first)]
        window.lecture.step(1)
        assert window.state.scene == "prefill" and window.state.selected == ids[str(second)]
        window.lecture.step(1)                                   # the same scene again, the other trace's run
        assert window.state.scene == "kv" and window.state.selected == ids[str(second)]
        window.lecture.step(1)                                   # the end of the lecture: it stays
        assert window.state.scene == "kv"
        window.lecture.step(-2)
        assert window.state.scene == "kv" and window.state.selected == ids[str(first)]
    finally:
        close_and_dispose(window)


def test_traces_opened_one_after_the_other_leave_scene_one_on_its_own_run(qtbot, tmp_path, tiny, run_events):
    attention: list = []
    Session(tiny).run("hello", GenerationParams(max_new_tokens=3, capture_attention=True), attention.append)
    plain, recorded = trace_file(tmp_path, run_events, "plain"), trace_file(tmp_path, attention, "attention")
    window = make_window(qtbot)
    try:
        window.lecture.enter("prefill")
        window.controller.replay_speed = 0.0
        window.files.open_trace(str(plain), str(recorded))
        wait_idle(qtbot, window)
        assert window.store.find(window.state.selected).source == str(plain)
    finally:
        close_and_dispose(window)


@pytest.mark.parametrize("scene", ["prefill", "sampling"])
def test_lecture_type_is_sized_from_the_screen_height(qtbot, scene):
    """Every text of a scene at 1080 pixels high is 1.5 times its height at 720: the same share of the screen."""
    window = make_window(qtbot)
    heights = {}
    try:
        for height in (720, 1080):
            window.lecture.area = QRect(0, 0, height * 16 // 9, height)
            window.lecture.enter(scene)
            qtbot.wait(20)
            view = window.scene_view
            chart = window.timing.timeline if scene == "prefill" else window.sampling.chart
            axis = chart.plot.getAxis("bottom")
            fonts = {"caption": view.caption.font(), "detail": view.detail.font(), "footer": view.footer.font(),
                     "ticks": axis.style.get("tickFont") or axis.font(), "axis label": axis.label.font()}
            heights[height] = {name: pixel_cap_height(font) for name, font in fonts.items()}
            window.lecture.leave()
    finally:
        close_and_dispose(window)
    for name in heights[720]:
        assert heights[1080][name] / heights[720][name] == pytest.approx(1.5, rel=0.12), (name, heights)
    assert heights[720]["ticks"] >= 13                           # readable at 720 already


def pixel_cap_height(font) -> int:
    """The height in pixels of a capital drawn in ``font``, counted from the rendered glyph."""
    from PySide6.QtGui import QColor, QImage, QPainter

    image = QImage(200, 200, QImage.Format.Format_RGB888)
    image.fill(QColor("white"))
    painter = QPainter(image)
    painter.setFont(font)
    painter.setPen(QColor("black"))
    painter.drawText(10, 150, "H")
    painter.end()
    pixels = np.frombuffer(image.constBits(), dtype=np.uint8, count=image.bytesPerLine() * 200)
    rows = pixels.reshape(200, image.bytesPerLine())[:, :600].reshape(200, 200, 3).min(axis=(1, 2)) < 128
    return int(rows.sum())



def export_from_the_window(qtbot, tmp_path, run_events, monkeypatch, cancel: bool, step_ms: float = 300):
    from PySide6.QtWidgets import QFileDialog, QInputDialog

    out = tmp_path / "videos" / "scene.mp4"
    out.parent.mkdir()
    monkeypatch.setattr(QFileDialog, "getSaveFileName", lambda *a, **k: (str(out), "MP4 video, H.264 (*.mp4)"))
    monkeypatch.setattr(QInputDialog, "getItem", lambda *a, **k: ("960x540", True))
    monkeypatch.delenv("QT_QPA_PLATFORM", raising=False)       # the renderer sets its own offscreen screen
    window = make_window(qtbot)
    said: list[str] = []
    try:
        window.controller.replay_speed = 0.0
        window.files.open_trace(str(trace_file(tmp_path, paced(run_events, prefill_ms=300, step_ms=step_ms))))
        wait_idle(qtbot, window)
        window.lecture.enter("kv")
        monkeypatch.setattr(window.files, "say", lambda message, ms=0: said.append(message))
        monkeypatch.setattr(window.files, "show_error", said.append)
        window.files.export_video(window.state.scene)
        if cancel:
            export = window.findChild(VideoExport)
            qtbot.waitUntil(lambda: export.dialog.maximum() > 0, timeout=60_000)     # frames are being drawn
            export.dialog.canceled.emit()                            # its Cancel button
        qtbot.waitUntil(lambda: bool(said), timeout=120_000)
    finally:
        close_and_dispose(window)
    return out, said


def test_export_scene_as_video_renders_the_scene_shown_with_progress(qtbot, tmp_path, run_events, monkeypatch):
    out, said = export_from_the_window(qtbot, tmp_path, run_events, monkeypatch, cancel=False)
    assert said == [f"Exported the scene as video to {out}"]
    frames = decoded(out)
    assert frames[0].shape == (540, 960, 3) and len(frames) == round((0.3 + (TOKENS - 1) * 0.3 + 2.5) * 30)


def test_export_scene_as_video_cancelled_leaves_no_file(qtbot, tmp_path, run_events, monkeypatch):
    out, said = export_from_the_window(qtbot, tmp_path, run_events, monkeypatch, cancel=True, step_ms=3000)
    assert said == ["The export was cancelled; no file was written."]
    assert list(out.parent.iterdir()) == []


def test_an_output_that_cannot_or_must_not_be_written_and_a_scene_without_data_are_refused_before_any_frame(
        tmp_path, run_events, cache_root):
    trace = trace_file(tmp_path, paced(run_events, prefill_ms=200, step_ms=200))
    env = {**os.environ, "KVSCOPE_CACHE_DIR": str(cache_root)}
    env.pop("QT_QPA_PLATFORM", None)

    def kvscope(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "app", "--render", *args], capture_output=True, text=True,
                              timeout=120, env=env)

    (tmp_path / "a file").write_text("x")
    existing = tmp_path / "earlier.mp4"
    existing.write_bytes(b"an earlier video")
    for out, words in ((tmp_path / "a file" / "x.mp4", "Not a directory"),
                       (tmp_path / "missing" / "x.mp4", "does not exist"),
                       (Path("/proc") / "x.mp4", "Cannot write the video to /proc/x.mp4"),
                       (existing, "exists: give another name, or --force to replace it"),
                       (trace, "a render is an .mp4")):
        done = kvscope(str(out), "--scene", "kv", str(trace))
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2 and len(lines) == 1 and words in lines[0] and str(out) in lines[0], lines
    assert existing.read_bytes() == b"an earlier video" and not (tmp_path / "missing").exists()
    same = tmp_path / "run.mp4"                                          # drawn from itself: never
    trace.rename(same)
    done = kvscope(str(same), "--force", "--scene", "kv", str(same))
    assert done.returncode == 2 and "one of the files this command reads" in done.stderr
    same.rename(trace)
    done = kvscope(str(tmp_path / "x.mp4"), "--scene", "cache", str(trace))
    assert done.returncode == 2 and done.stderr.strip().splitlines() == [
        "kvscope: scene 3 (KV cache on vs off) has no kv cache on vs off experiment in its traces: record one "
        "(python -m engine sweep cache --trace FILE, or R in the scene) and give that trace"]
    done = kvscope(str(tmp_path / "x.mp4"), "--scene", "attention", str(trace))
    assert done.returncode == 2 and "no run that recorded attention" in done.stderr
    done = kvscope(str(tmp_path / "x.mp4"), "--speed", "0", "--scene", "kv", str(trace))
    assert done.returncode == 2 and "--speed 0 replays at once in the window" in done.stderr
    assert not (tmp_path / "x.mp4").exists()
    done = kvscope(str(existing), "--force", "--scene", "kv", "--size", "640x360", "--fps", "5", str(trace))
    assert done.returncode == 0 and existing.read_bytes() != b"an earlier video"


def test_a_scene_named_beside_a_lecture_file_renders_that_scene_alone(tmp_path, run_events):
    """``--render kv.mp4 --course --scene kv`` rendered all sixteen scenes into kv.mp4."""
    trace = trace_file(tmp_path, run_events)
    path = write_lecture(tmp_path / "talk.kvscope-lecture.json", [LectureScene("prefill", (trace,)),
                                                                   LectureScene("kv", (trace,))])
    assert plan_scenes([str(path)], "kv") == [LectureScene("kv", (trace,))]
    with pytest.raises(RenderError, match="talk.kvscope-lecture.json has no memory scene \\(it holds prefill, kv\\)"):
        plan_scenes([str(path)], "memory")


def test_a_lecture_opened_with_a_scene_named_opens_on_that_scene(qtbot, tmp_path, run_events):
    """``kvscope --course --scene memory`` opened the course on scene 1."""
    trace = trace_file(tmp_path, run_events)
    path = write_lecture(tmp_path / "talk.kvscope-lecture.json", [LectureScene("prefill", (trace,)),
                                                                   LectureScene("kv", (trace,))])
    window = make_window(qtbot)
    try:
        window.lecture.enter("prefill")                  # as --scene puts the window in lecture mode first
        window.files.open_trace(str(path), scene="kv")
        assert window.state.scene == "kv" and window.lecture.position == 1     # PgDn / PgUp go on from there
    finally:
        close_and_dispose(window)
