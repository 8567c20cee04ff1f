"""Render, don't record: a lecture's scenes drawn offscreen frame by frame on a virtual clock taken from the
traces' own timestamps, and encoded to MP4 (H.264) or GIF, so every frame is on time however slow or busy the
machine that renders it.

The window is the real one (its scenes, panels and captions, in lecture mode, the frame's size); the events go
to its controller as a replay's would, but paced by the render: between two events the virtual clock advances
by the recorded wait, and the frames that fall in it are grabbed. A wait longer than ``max_wait_s`` (a long
prefill, an experiment's slow point) is fast-forwarded: its frames span the whole wait on the virtual clock
(elapsed clocks stay true) in ``max_wait_s`` of video, and the frame says so.

PyAV writes the video: its wheels carry FFmpeg with libx264 and the GIF encoder, so no system ffmpeg is needed,
and frames go to the encoder in-process with exact timestamps (imageio-ffmpeg pipes raw frames to an ffmpeg
executable instead). The file is written beside the target under a temporary name and renamed when complete: a
cancel or an error leaves no partial file.
"""

from __future__ import annotations

import math
import os
import tempfile
import time
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import IO

import numpy as np
from PySide6.QtCore import QBuffer, QByteArray, QIODevice, QRect, Qt
from PySide6.QtGui import QColor, QFont, QImage, QPainter
from PySide6.QtWidgets import QApplication

from app.lecture.lecture_file import LectureScene
from app.views import theme as th
from engine.facts.errors import EngineError
from engine.store.files import write_bytes

MIN_SIZE, MAX_SIZE = (320, 240), (3840, 2160)
FORMATS = {".mp4": "mp4", ".gif": "gif"}


class RenderError(EngineError):
    """A render that cannot be made, said in one line."""


@dataclass(frozen=True)
class RenderSettings:
    """``speed``: recorded time per video time (2: twice as fast); ``max_wait_s``: the longest wait shown at
    that pace (longer ones are fast-forwarded and said); ``lead_s`` / ``hold_s``: a scene before its first event
    and its final state after the last."""

    width: int = 1280
    height: int = 720
    fps: int = 30
    speed: float = 1.0
    max_wait_s: float = 3.0
    lead_s: float = 0.0
    hold_s: float = 2.5

    def __post_init__(self) -> None:
        if not (MIN_SIZE[0] <= self.width <= MAX_SIZE[0] and MIN_SIZE[1] <= self.height <= MAX_SIZE[1]):
            raise RenderError(f"--size {self.width}x{self.height}: from {MIN_SIZE[0]}x{MIN_SIZE[1]} to "
                              f"{MAX_SIZE[0]}x{MAX_SIZE[1]}")
        if self.width % 2 or self.height % 2:
            raise RenderError(f"--size {self.width}x{self.height}: H.264 needs an even width and height")
        if not 1 <= self.fps <= 60:
            raise RenderError(f"--fps {self.fps}: from 1 to 60")
        if self.speed == 0:
            raise RenderError("--speed 0 replays at once in the window; a video needs a pace: from 0.05 to 100 "
                              "(1: as recorded)")
        if not 0.05 <= self.speed <= 100:
            raise RenderError(f"--speed {self.speed:g}: from 0.05 to 100 for a render (1: as recorded)")
        if not 0.2 <= self.max_wait_s <= 600:
            raise RenderError(f"--max-wait {self.max_wait_s:g}: from 0.2 to 600 s")


def parse_size(text: str) -> tuple[int, int]:
    try:
        width, height = (int(part) for part in text.lower().split("x"))
    except ValueError:
        raise RenderError(f"--size {text!r}: write it as WIDTHxHEIGHT, e.g. 1920x1080") from None
    return width, height


def video_format(path: str | os.PathLike) -> str:
    suffix = Path(path).suffix.lower()
    if suffix not in FORMATS:
        raise RenderError(f"{path}: a render is an .mp4 (H.264) or a .gif")
    return FORMATS[suffix]


def check_output(path: str | os.PathLike, inputs: Sequence[str | os.PathLike], force: bool = False) -> Path:
    """The file a render will write, checked before anything is drawn: an .mp4 or a .gif, in a folder that exists
    and takes a new file (a regular file's "folder", /proc, a read-only disk are named now, not after the frames),
    never one of the traces it draws, and not an existing file unless ``force`` (the old one is then replaced
    only when the new one is complete)."""
    from engine.store.files import WriteRefused, writable_target

    video_format(path)
    given = Path(path).expanduser()
    try:
        target = writable_target(given, "the video", "scene.mp4", inputs)
    except WriteRefused as exc:
        raise RenderError(str(exc)) from None
    if target.exists() and not force:
        raise RenderError(f"{given} exists: give another name, or --force to replace it (it is replaced only once "
                          "the new video is complete)")
    try:
        with tempfile.NamedTemporaryFile(dir=target.parent, prefix=f".{target.name}.", suffix=".probe"):
            pass
    except OSError as exc:
        raise RenderError(f"Cannot write the video to {given}: {exc.strerror or exc}") from None
    return target


def missing_data(scene: LectureScene) -> str | None:
    """Why ``scene`` has nothing to draw from its traces (one line naming the scene and the trace it needs), or
    None. Checked before the first frame: a scene without its data would render as an empty chart saying
    "press R"."""
    from app import lessons
    from app.lecture.scene_list import BY_NAME
    from engine import lessons as engine_lessons
    from engine.facts.events import ExperimentStarted, RunStarted
    from engine.output.trace import read_traces

    entry = BY_NAME[scene.scene]
    events = [e for trace in read_traces([str(t) for t in scene.traces]) for e in trace]
    if entry.lesson is not None:
        kinds = {entry.lesson} | {kind for name, (kind, _key) in lessons.joins().items() if name == scene.scene}
        if any(isinstance(e, ExperimentStarted) and e.kind in kinds for e in events):
            return None
        if lessons.BY_KIND[entry.lesson].dock == "chat" and any(isinstance(e, RunStarted) and e.kind == "chat"
                                                                for e in events):
            return None                                   # drawn in the Chat panel: a conversation's turns too
        titles = " or ".join(engine_lessons.lesson(k).title.lower() for k in sorted(kinds))
        return (f"scene {entry.key} ({entry.title}) has no {titles} experiment in its traces: record one (python "
                f"-m engine sweep {entry.lesson.replace(' ', '-')} --trace FILE, or R in the scene) and give "
                "that trace")
    runs = [e for e in events if isinstance(e, RunStarted) and not e.experiment and e.kind != "chat"]
    if scene.scene == "attention":
        runs = [e for e in runs if e.params.capture_attention]
        if not runs:
            return (f"scene {entry.key} ({entry.title}) has no run that recorded attention in its traces: record one "
                    "(python -m engine --attention --trace FILE) and give that trace")
    if not runs:
        return (f"scene {entry.key} ({entry.title}) has no plain run in its traces: record one (python -m engine "
                "--prompt TEXT --trace FILE) and give that trace")
    return None


def plan_scenes(paths: Sequence[str], scene: str | None) -> list[LectureScene]:
    """What ``--render`` draws: a lecture file's scenes (only ``scene`` when given: ``--course --scene kv`` is the
    course's KV scene, not all sixteen), or ``scene`` (default the first) over every trace given."""
    from app.lecture.lecture_file import is_lecture_file, read_lecture
    from app.lecture.scene_list import NAMES

    if not paths:
        raise RenderError("--render needs the traces to draw (TRACE ...) or a lecture file")
    lectures = [p for p in paths if is_lecture_file(p)]
    if lectures:
        if len(paths) > 1:
            raise RenderError("--render takes one lecture file, or traces: not both")
        scenes = read_lecture(lectures[0])
        if scene is None:
            return scenes
        chosen = [s for s in scenes if s.scene == scene]
        if not chosen:
            raise RenderError(f"the lecture {Path(lectures[0]).name} has no {scene} scene (it holds "
                              f"{', '.join(dict.fromkeys(s.scene for s in scenes))})")
        return chosen
    return [LectureScene(scene or NAMES[0], tuple(Path(p) for p in paths))]


class VirtualClock:
    """The render's "now", in seconds: what the runs' elapsed times read while their frames are drawn."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


@dataclass(frozen=True)
class Wait:
    """Between two events: ``recorded_s`` on the trace's clock, shown in ``shown_s`` of video."""

    recorded_s: float
    shown_s: float

    @property
    def fast_forward(self) -> bool:
        return self.shown_s > 0 and self.recorded_s / self.shown_s > 1.0 + 1e-6


def schedule(events: Sequence[object], settings: RenderSettings) -> list[tuple[Wait, object]]:
    """Each event with the wait before it, as the replay paces them (``engine.output.trace.replay``), and how long the
    video shows that wait."""
    from engine.output.trace import replay

    waits: list[float] = []
    out: list[tuple[Wait, object]] = []
    for event in replay(events, 1.0, sleep=waits.append, max_gap_s=math.inf):
        recorded = waits.pop() if waits else 0.0
        out.append((Wait(recorded, min(recorded / settings.speed, settings.max_wait_s)), event))
    return out


def frame_count(plans: Sequence[list[tuple[Wait, object]]], settings: RenderSettings) -> int:
    """The frames a render makes, known before the first (the progress bar's total)."""
    frames = 0
    for plan in plans:
        video = settings.lead_s + sum(w.shown_s for w, _ in plan) + settings.hold_s
        frames += max(1, round(video * settings.fps))
    return frames


@dataclass(frozen=True)
class RenderReport:
    path: Path
    frames: int
    video_s: float
    scenes: tuple[str, ...]
    stills: tuple[Path, ...] = ()
    seconds: tuple[float, ...] = ()           # each scene's time to render, by the wall clock


class Cancelled(Exception):
    pass


class Renderer:
    """Draws ``window``'s lecture scenes into ``path``. ``progress(done, total, scene)`` after each frame;
    ``cancelled()`` is asked between frames."""

    def __init__(self, window, settings: RenderSettings, path: str | os.PathLike,
                 progress: Callable[[int, int, str], None] = lambda *_: None,
                 cancelled: Callable[[], bool] = lambda: False, stills: str | os.PathLike | None = None) -> None:
        self.window, self.settings, self.path = window, settings, Path(path)
        self.format = video_format(self.path)
        self.progress, self.cancelled = progress, cancelled
        self.stills_dir = Path(stills) if stills else None
        self.clock = VirtualClock()
        self.frames = self.total = 0
        self._note = ""
        self._stills = 0

    def render(self, scenes: Sequence[LectureScene]) -> RenderReport:
        from engine.output.trace import read_traces, recorded

        if not scenes:
            raise RenderError("nothing to render: name a scene and its traces")
        plans, provenance = [], []
        for entry in scenes:                           # every file read and checked before the first frame
            traces = read_traces(entry.traces)
            plans.append(schedule([e for trace in traces for e in trace], self.settings))
            provenance.append("; ".join(dict.fromkeys(recorded(trace) for trace in traces)))
        self.total = frame_count(plans, self.settings)
        partial = self.path.with_name(f".{self.path.name}.partial")
        stills: list[Path] = []
        seconds: list[float] = []
        self._prepare()
        try:
            with _Encoder(partial, self.format, self.settings) as encoder:
                for entry, plan, words in zip(scenes, plans, provenance):
                    self.window.store.recorded = words         # each scene's caption says whose figures they are
                    began = time.perf_counter()
                    stills += self._scene(entry.scene, plan, encoder)
                    seconds.append(time.perf_counter() - began)
            os.replace(partial, self.path)
        except BaseException:
            partial.unlink(missing_ok=True)
            raise
        finally:
            self._restore()
        return RenderReport(self.path, self.frames, self.frames / self.settings.fps,
                            tuple(s.scene for s in scenes), tuple(stills), tuple(seconds))

    # --- one scene ----------------------------------------------------------------------------------------
    def _prepare(self) -> None:
        w = self.window
        self._clock_before = w.store.clock
        w.store.clock = self.clock
        w.lecture.area = QRect(0, 0, self.settings.width, self.settings.height)

    def _restore(self) -> None:
        self.window.store.clock = self._clock_before
        self.window.store.recorded = ""
        self.window.lecture.area = None

    def _scene(self, scene: str, plan: list[tuple[Wait, object]], encoder: _Encoder) -> list[Path]:
        w = self.window
        w.controller.clear_runs()
        w.lecture.show(scene)
        w.controller.begin_replay()
        budget = max(1, round((self.settings.lead_s + sum(x.shown_s for x, _ in plan) + self.settings.hold_s)
                              * self.settings.fps))
        fps = self.settings.fps
        video = virtual = 0.0
        shown = 0                                     # frames of this scene so far

        def frames_until(video_end: float, virtual_end: float, rate: float) -> None:
            nonlocal shown
            while shown < budget and shown / fps < video_end - 1e-9:
                self.clock.t = virtual + (shown / fps - video) * rate
                self._frame(scene, encoder)
                shown += 1

        frames_until(self.settings.lead_s, 0.0, 0.0)
        video = self.settings.lead_s
        for wait, event in plan:
            if wait.shown_s > 0:
                rate = wait.recorded_s / wait.shown_s
                self._note = (f"fast-forward: {_seconds(wait.recorded_s)} of the recording shown in "
                              f"{_seconds(wait.shown_s)}" if wait.fast_forward else "")
                frames_until(video + wait.shown_s, virtual + wait.recorded_s, rate)
                video += wait.shown_s
                virtual += wait.recorded_s
            self._note = ""
            self.clock.t = virtual
            w.controller.on_events([event])
        w.controller.end_replay()
        while shown < budget:                         # the final state, held
            self._frame(scene, encoder)
            shown += 1
        if self.stills_dir is None:
            return []
        self.stills_dir.mkdir(parents=True, exist_ok=True)
        self._stills += 1
        still = self.stills_dir / f"{self._stills:02d}-{scene}.png"            # the lecture's order, overwritten
        data = QByteArray()
        buffer = QBuffer(data)
        buffer.open(QIODevice.OpenModeFlag.WriteOnly)
        if not self._grab().save(buffer, "PNG"):
            raise OSError(f"the still of scene {scene} could not be made into a PNG")
        write_bytes(still, bytes(data), "the still")        # a full disk raises: never reported as written
        return [still]

    def _frame(self, scene: str, encoder: _Encoder) -> None:
        if self.cancelled():
            raise Cancelled()
        encoder.add(self._grab())
        self.frames += 1
        self.progress(self.frames, self.total, scene)

    def _grab(self) -> QImage:
        w = self.window
        w.frames.refresh(force=True)
        QApplication.processEvents()
        image = w.grab().toImage().convertToFormat(QImage.Format.Format_RGB888)
        if image.width() != self.settings.width or image.height() != self.settings.height:
            image = image.scaled(self.settings.width, self.settings.height, Qt.AspectRatioMode.IgnoreAspectRatio,
                                 Qt.TransformationMode.SmoothTransformation)
        if self._note:
            _say(image, self._note)
        return image


def _say(image: QImage, note: str) -> None:
    """A fast-forward said on the frame: a band at the bottom right (the caption is at the top, the footer's keys
    at the left), in the lecture's type."""
    painter = QPainter(image)
    font = QFont()
    font.setPixelSize(max(14, image.height() // 40))
    font.setBold(True)
    painter.setFont(font)
    metrics = painter.fontMetrics()
    text = f">> {note}"
    width, height = metrics.horizontalAdvance(text) + 24, metrics.height() + 12
    box = QRect(image.width() - width - 12, image.height() - height - 12, width, height)
    painter.fillRect(box, QColor(th.FORMULA))
    painter.setPen(QColor("#FFFFFF"))
    painter.drawText(box, Qt.AlignmentFlag.AlignCenter, text)
    painter.end()


def _seconds(s: float) -> str:
    return f"{s:,.1f} s" if s < 120 else f"{s / 60:,.1f} min"


class _Encoder:
    """Frames into an MP4 (H.264, yuv420p: what every player and slide tool opens) or a GIF: one palette made from
    every frame (a UI's few colours come out clean, the file small), in two passes so memory holds one frame, not
    the clip. The first pass counts every frame's colours (palettegen keeps a histogram) and spools the frame to a
    temporary file, compressed; the second reads them back through the palette into the GIF. (One palette filter
    over the clip in one pass held every frame until the end: 5 GiB by frame 797 of a 1080p render.)"""

    def __init__(self, path: Path, fmt: str, settings: RenderSettings) -> None:
        self.path, self.format, self.settings = path, fmt, settings
        self._colours = None                  # the first pass's palettegen (a GIF)
        self._spool: IO[bytes] | None = None
        self._pts = 0

    def __enter__(self) -> _Encoder:
        import av

        self._av = av
        self.container = av.open(str(self.path), "w", format=self.format)
        s = self.settings
        if self.format == "mp4":
            self.stream = self.container.add_stream("libx264", rate=s.fps,
                                                    options={"crf": "20", "preset": "veryfast"})
            self.stream.pix_fmt = "yuv420p"
        else:
            self.stream = self.container.add_stream("gif", rate=s.fps)
            self.stream.pix_fmt = "pal8"
            self._colours, _source = self._graph(("palettegen", "stats_mode=full"))
            self._spool = tempfile.TemporaryFile(prefix="kvscope-render-")
        self.stream.width, self.stream.height = s.width, s.height
        return self

    def _graph(self, *filters: tuple[str, str], palette: object | None = None) -> tuple[object, object]:
        """A filter graph from rgb24 frames through ``filters`` (and, for paletteuse, a second input: ``palette``),
        and its source."""
        av, s = self._av, self.settings
        graph = av.filter.Graph()
        source = graph.add_buffer(width=s.width, height=s.height, format="rgb24", time_base=Fraction(1, s.fps))
        chain = [graph.add(name, args) for name, args in filters]
        sink = graph.add("buffersink")
        for a, b in zip([source, *chain], [*chain, sink]):
            a.link_to(b, 0, 0)
        if palette is not None:
            side = graph.add_buffer(width=palette.width, height=palette.height, format=palette.format.name,
                                    time_base=Fraction(1, s.fps))
            side.link_to(chain[0], 0, 1)
            graph.configure()
            palette.pts, palette.time_base = 0, Fraction(1, s.fps)
            side.push(palette)
            side.push(None)
        else:
            graph.configure()
        return graph, source

    def add(self, image: QImage) -> None:
        pixels = _pixels(image)
        frame = self._frame(pixels, self._pts)
        self._pts += 1
        if self._colours is not None:
            self._colours.push(frame)
            for _nothing in self._pulled(self._colours):        # drives the graph: the frame is counted, let go
                pass
            packed = zlib.compress(pixels.tobytes(), 1)
            self._spool.write(len(packed).to_bytes(8, "little") + packed)
            return
        for packet in self.stream.encode(frame):
            self.container.mux(packet)

    def _frame(self, pixels: np.ndarray, pts: int) -> object:
        frame = self._av.VideoFrame.from_ndarray(pixels, format="rgb24")
        frame.pts, frame.time_base = pts, Fraction(1, self.settings.fps)
        return frame

    def _pulled(self, graph: object) -> Iterator[object]:
        av = self._av
        while True:
            try:
                yield graph.pull()
            except (av.error.EOFError, av.error.BlockingIOError):
                return

    def _write_gif(self) -> None:
        """The second pass: every spooled frame through the one palette, one at a time."""
        self._colours.push(None)
        palette = next(self._pulled(self._colours))
        graph, source = self._graph(("paletteuse", "dither=none:new=0"), palette=palette)
        s = self.settings
        self._spool.seek(0)
        for pts in range(self._pts):
            size = int.from_bytes(self._spool.read(8), "little")
            pixels = np.frombuffer(zlib.decompress(self._spool.read(size)), dtype=np.uint8)
            source.push(self._frame(pixels.reshape(s.height, s.width, 3), pts))
            self._mux(self._pulled(graph))
        source.push(None)
        self._mux(self._pulled(graph))

    def _mux(self, frames: Iterator[object]) -> None:
        for frame in frames:
            for packet in self.stream.encode(frame):
                self.container.mux(packet)

    def __exit__(self, kind, value, traceback) -> None:
        try:
            if kind is None:
                if self._colours is not None and self._pts:
                    self._write_gif()
                for packet in self.stream.encode():
                    self.container.mux(packet)
        finally:
            self.container.close()
            if self._spool is not None:
                self._spool.close()


def _pixels(image: QImage) -> np.ndarray:
    """The image's RGB bytes as a height x width x 3 array (rows padded to 4 bytes by Qt are cut)."""
    width, height, stride = image.width(), image.height(), image.bytesPerLine()
    data = np.frombuffer(image.constBits(), dtype=np.uint8, count=stride * height).reshape(height, stride)
    return np.ascontiguousarray(data[:, : width * 3].reshape(height, width, 3))
