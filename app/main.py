"""The composition root: ``QApplication``, the models (store, view state, conversation), the engine client,
the window and the controller between them, wired once.

The window shows before torch is imported (the worker imports the engine in its own thread), then the model
loads with progress in the status strip.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import tempfile
import time
from dataclasses import replace

from PySide6.QtCore import QEvent, QTimer, qInstallMessageHandler
from PySide6.QtGui import QIcon
from PySide6.QtWidgets import QApplication

from app import lessons as app_lessons
from app.lecture.scene_list import NAMES
from app.link.controller import Controller
from app.link.worker import EngineClient
from app.shell.menus import set_replay_speed
from app.shell.window import MainWindow
from app.shell.x11watch import WindowWatch
from app.state.run_settings import LessonChoices, ModelChoice, RunSettings
from app.state.store import RunStore
from app.state.viewstate import Conversation, ViewState
from app.views.resources import icon_path
from engine.terminal.command_line import add_load_flags


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="kvscope", description="See LLM inference live.")
    add_load_flags(p, ("model",), defaults=False, note=" (default: the last one used, else 'embedded')")
    p.add_argument("--server", metavar="URL",
                   help="watch a serving engine instead of loading a model (llama-server, vLLM, TGI, SGLang; an API "
                        "key is read from KVSCOPE_API_KEY)")
    p.add_argument("--kv-events", metavar="ADDRESS",
                   help="with --server: watch the engine's KV event publisher (vLLM's --kv-events-config "
                        "endpoint) from launch, every client's blocks drawn as a tree until Ctrl+.; ipc:///PATH or "
                        "tcp://HOST:PORT to connect, tcp://*:PORT or bind:tcp://127.0.0.1:PORT to bind")
    add_load_flags(p, ("device", "dtype"), defaults=False, note=" (default: the last one used, else auto)")
    p.add_argument("trace_files", nargs="*", metavar="TRACE",
                   help="KVScope traces (.jsonl, .jsonl.gz) to replay one after the other, instead of loading a model")
    p.add_argument("--trace", help="a trace to open and replay instead of loading a model (as TRACE)")
    p.add_argument("--speed", type=float, default=1.0,
                   help="replay speed: 1 as recorded, 2 twice as fast, 0 at once (default 1)")
    p.add_argument("--no-load", action="store_true", help="open the window without loading a model")
    p.add_argument("--run", action="store_true", help="run the prompt as soon as the model has loaded")
    p.add_argument("--lecture", action="store_true",
                   help="start in lecture mode: one scene at a time, large type, full screen")
    p.add_argument("--scene", choices=NAMES, help="lecture mode, opened on this scene (implies --lecture)")
    p.add_argument("--course", action="store_true",
                   help="the course that ships: every scene from traces recorded on the embedded model, presented "
                        "in lecture mode with no model loaded (Ctrl+L loads one to run a scene live); with --render, "
                        "every scene rendered")
    render = p.add_argument_group("rendering a video (no window; offscreen, on the traces' own clock)")
    render.add_argument("--render", metavar="OUT",
                        help="draw the scene (--scene) of the TRACE files, or a lecture file's scenes, into OUT: an "
                             ".mp4 (H.264) or a .gif; then exit")
    render.add_argument("--size", default="1280x720", help="the video's size, WIDTHxHEIGHT (default 1280x720)")
    render.add_argument("--fps", type=int, default=30, help="frames per second (default 30)")
    render.add_argument("--max-wait", type=float, default=3.0, metavar="S",
                        help="a wait longer than S seconds (at --speed) is fast-forwarded, and the frame says so "
                             "(default 3)")
    render.add_argument("--stills", metavar="FOLDER", help="also save each scene's final frame as a PNG here")
    render.add_argument("--force", action="store_true",
                        help="replace OUT if it exists (only once the new video is complete)")
    p.add_argument("--self-test", action="store_true",
                   help="offscreen: load the model, generate a few tokens, print the timing report, exit 0")
    return p.parse_args(argv)


def _quiet_platform_notes(mode, context, message: str) -> None:
    """Qt's offscreen platform notes that it cannot resize to hints; everything else goes to the log."""
    if "does not support propagateSizeHints" in message:
        return
    logging.getLogger("qt").warning(message)


def build(args: argparse.Namespace) -> tuple[QApplication, MainWindow]:
    app = QApplication.instance() or QApplication(sys.argv[:1])
    app.setApplicationName("KVScope")
    app.setOrganizationName("KVScope")
    app.setDesktopFileName("kvscope")
    icon = icon_path()
    if icon.is_file():
        app.setWindowIcon(QIcon(str(icon)))
    store, state, conversation = RunStore(), ViewState(NAMES, app_lessons.followed()), Conversation()
    run_settings, choices, model_choice = RunSettings(), LessonChoices(app_lessons.follows()), ModelChoice()
    client = EngineClient()
    window = MainWindow(store, state, conversation, client, run_settings, choices, model_choice)
    controller = Controller(store, state, conversation, client, run_settings, choices, window.surface,
                            model_choice)
    window.attach(controller)
    client.setParent(window)          # deleted with the window, after its thread has been joined
    return app, window


def main(argv: list[str] | None = None) -> int:
    started = time.perf_counter()
    args = parse_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.WARNING if args.self_test else logging.INFO,
                        format="%(levelname)s %(name)s: %(message)s")
    if args.self_test:
        return self_test(args, started)
    refused = course_refused(args)
    if refused is not None:
        print(f"kvscope: {refused}", file=sys.stderr)
        return 2
    if args.render:
        return render_video(args)
    app, window = build(args)
    window.show()
    window.raise_()
    window.activateWindow()
    stop_on_signals(app, window)
    WindowWatch(lambda: int(window.winId()), gone=lambda: (window.close(), app.quit()), parent=window)
    start(window, args)
    code = app.exec()
    if not window.worker_stopped:
        # A forward pass outlived the close timeout; it cannot be interrupted, and waiting would hang the
        # exit. Settings are saved already, so end the process now rather than abort on a running QThread.
        logging.getLogger(__name__).warning("engine busy in a forward pass at exit; ending the process")
        os._exit(code)
    dispose(app, window)
    return code


def start(window: MainWindow, args: argparse.Namespace) -> None:
    """What the command line asks for once the window shows: a scene, a run when loaded, traces or a model."""
    if args.kv_events:
        from engine import lessons as engine_lessons

        lesson = engine_lessons.server_lesson()
        choices = window.controller.choices
        current = choices.settings.get(lesson.kind) or lesson.settings()
        choices.set(replace(current, kv_events=args.kv_events, requests=0))       # watch every client's blocks
        window.controller.start_when_loaded(lesson.kind)
    if args.lecture or args.scene or args.course:
        window.lecture.enter(args.scene)
    if args.run:
        window.controller.run_when_loaded()
    QTimer.singleShot(0, window.lookups.search_at_start)
    traces = given_traces(args)
    if traces:
        set_replay_speed(window.controller, window.actions_by_name, max(args.speed, 0.0))
        QTimer.singleShot(0, lambda: window.files.open_trace(*traces, scene=args.scene))
    if not traces and not args.no_load:
        gone = None if args.model or args.server else window.controls.forget_missing_model()
        if gone:
            window.surface.show_warning(f"The model last used, {gone}, is no longer there: loading the built-in "
                                        "model instead (Model > Source, Folder… or .gguf… picks another).")
        request = window.controller.model_choice.asked
        request = replace(request, model=args.server or args.model or request.model,
                          device=args.device or request.device, dtype=args.dtype or request.dtype)
        QTimer.singleShot(0, lambda: window.controller.load_model(request))


def given_traces(args: argparse.Namespace) -> list[str]:
    """The traces (or the one lecture file) the command line names; ``--course``: the shipped course's lecture."""
    traces = ([args.trace] if args.trace else []) + args.trace_files
    if args.course:
        from app.lecture.course import course_lecture

        return [str(course_lecture())]
    return traces


def course_refused(args: argparse.Namespace) -> str | None:
    """Why ``--course`` cannot be shown, in one line, before any window opens."""
    if not args.course:
        return None
    from app.lecture.course import course_lecture

    if args.trace or args.trace_files:
        return "--course presents the shipped course: give it without traces"
    if not course_lecture().is_file():
        return f"no course at {course_lecture()}: record one with make course (python -m app.lecture.course)"
    return None


def stop_on_signals(app: QApplication, window: MainWindow) -> None:
    """SIGTERM (logout, ``kill``), SIGINT and SIGHUP close the window as a click would: settings saved, the
    worker joined."""
    def close(*_args) -> None:
        QTimer.singleShot(0, window.close)

    for name in ("SIGTERM", "SIGINT", "SIGHUP"):
        if hasattr(signal, name):
            signal.signal(getattr(signal, name), close)
    # Python runs signal handlers only when it gets control: a timer hands it control a few times a second.
    app._signal_timer = QTimer(app)
    app._signal_timer.start(250)
    app._signal_timer.timeout.connect(lambda: None)


def self_test(args: argparse.Namespace, started: float) -> int:
    """Offscreen, with throwaway settings, so a check never changes what the user sees next time."""
    from app.shell.selftest import run_self_test

    os.environ["QT_QPA_PLATFORM"] = "offscreen"
    qInstallMessageHandler(_quiet_platform_notes)
    with tempfile.TemporaryDirectory(prefix="kvscope-self-test-") as tmp:
        os.environ["KVSCOPE_SETTINGS"] = os.path.join(tmp, "settings.ini")
        app, window = build(args)
        window.show()
        code = run_self_test(app, window, started, args.model or "embedded", args.device or "auto",
                             args.dtype or "auto")
        window.close()
        if not window.worker_stopped:
            os._exit(code)
        dispose(app, window)
    return code


def render_video(args: argparse.Namespace) -> int:
    """``--render``: offscreen, on a screen the video's size (so lecture type is sized as on that screen), with
    throwaway settings; progress on stderr; one line and exit 2 for what cannot be rendered, 130 when stopped."""
    from app.lecture.render import (
        Cancelled,
        Renderer,
        RenderError,
        RenderSettings,
        check_output,
        missing_data,
        parse_size,
        plan_scenes,
    )
    from engine.facts.errors import EngineError

    stop = []
    for name in ("SIGTERM", "SIGINT"):
        signal.signal(getattr(signal, name), lambda *_: stop.append(True))
    with tempfile.TemporaryDirectory(prefix="kvscope-render-") as tmp:
        try:
            width, height = parse_size(args.size)
            settings = RenderSettings(width, height, args.fps, args.speed, args.max_wait)
            inputs = given_traces(args)
            scenes = plan_scenes(inputs, args.scene)
            check_output(args.render, [*inputs, *(t for s in scenes for t in s.traces)], args.force)
            for scene in scenes:                          # before the window: a scene without data is one line
                why = missing_data(scene)
                if why is not None:
                    raise RenderError(why)
        except EngineError as exc:
            print(f"kvscope: {exc}", file=sys.stderr)
            return 2
        screen = os.path.join(tmp, "screen.json")
        with open(screen, "w") as f:
            f.write(json.dumps({"screens": [{"name": "render", "x": 0, "y": 0, "width": width, "height": height,
                                             "logicalDpi": 96, "logicalBaseDpi": 96, "dpr": 1}]}))
        os.environ["QT_QPA_PLATFORM"] = f"offscreen:configfile={screen}"
        os.environ["KVSCOPE_SETTINGS"] = os.path.join(tmp, "settings.ini")
        qInstallMessageHandler(_quiet_platform_notes)
        app, window = build(parse_args(["--no-load"]))
        window.show()
        shown = [-1]

        def progress(done: int, total: int, scene: str) -> None:
            percent = done * 100 // max(total, 1)
            if percent != shown[0]:
                shown[0] = percent
                print(f"[{done}/{total}] {percent}% · scene {scene}", file=sys.stderr, flush=True)

        started = time.perf_counter()
        code = 0
        try:
            report = Renderer(window, settings, args.render, progress, lambda: bool(stop), args.stills).render(scenes)
            took = time.perf_counter() - started
            print(f"{report.path}: {report.frames:,} frames, {report.video_s:,.1f} s of video at {settings.fps} fps, "
                  f"{width}x{height}, scenes {', '.join(report.scenes)}; rendered in {took:,.1f} s", flush=True)
            if len(report.scenes) > 1:
                print("rendered in: " + ", ".join(f"{scene} {took:,.1f} s"
                                                  for scene, took in zip(report.scenes, report.seconds)), flush=True)
            for still in report.stills:
                print(still)
        except Cancelled:
            print("kvscope: the render was stopped; no file was written", file=sys.stderr)
            code = 130
        except (EngineError, OSError) as exc:
            print(f"kvscope: the render failed: {getattr(exc, 'strerror', None) or exc}; no file was written",
                  file=sys.stderr)
            code = 2
        window.close()
        if not window.worker_stopped:
            os._exit(code)
        dispose(app, window)
    return code


def dispose(app: QApplication, window: MainWindow) -> None:
    """Delete the window's C++ side while the application still exists. Left to the interpreter's exit, the
    order is arbitrary, and a widget outliving ``QApplication`` crashed the process about half the time."""
    window.deleteLater()
    app.sendPostedEvents(None, QEvent.Type.DeferredDelete.value)
