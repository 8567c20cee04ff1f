"""File > Open / Save / Export: traces in and out, panels and data out. Composed into the window with its
dependencies named, not mixed in: it needs the store and view state (what to save), the controller (to open
a trace), a parent for dialogs, the settings (last folder) and somewhere to say what happened.

Exports render the whole panel widget, header numbers and captions included, to PNG or SVG: a chart without
the figures above it loses half its meaning, and rendering the widget keeps every plot clipped to its axes.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from PySide6.QtCore import QFileInfo, QSettings, QSortFilterProxyModel
from PySide6.QtGui import QIcon
from PySide6.QtWidgets import QFileDialog, QFileIconProvider, QInputDialog, QWidget

from app.lecture.lecture_file import is_lecture_file
from app.link.controller import Controller
from app.link.routing import Surface
from app.state.store import RunStore
from app.state.viewstate import ViewState
from app.views import export
from engine.facts.errors import TraceError
from engine.output.perfetto import write_perfetto
from engine.output.trace import write_checked
from engine.store.files import write_text

UNREADABLE_TREES = ("/proc/", "/sys/", "/dev/")


VIDEO_SIZES = ["1920x1080", "1280x720", "960x540"]


class RegularFilesOnly(QSortFilterProxyModel):
    """Hide what a trace cannot be: special files, and the kernel's pseudo-files, which can block a reader
    forever (``/proc/kmsg``) and looked like ordinary empty files to the dialog."""

    def filterAcceptsRow(self, row: int, parent) -> bool:  # noqa: N802 (Qt override)
        model = self.sourceModel()
        info = QFileInfo(model.filePath(model.index(row, 0, parent)))
        path = info.absoluteFilePath() + ("/" if info.isDir() else "")
        if any(path.startswith(tree) for tree in UNREADABLE_TREES):
            return False
        return info.isDir() or (info.isFile() and info.isReadable() and not info.isSymLink() or
                                info.isSymLink() and QFileInfo(info.symLinkTarget()).isFile())


class PlainIcons(QFileIconProvider):
    """Icons and type names by kind only. Qt's provider reads each file to guess its type (QMimeDatabase),
    and a read of ``/proc/kmsg`` never returns: the dialog froze the window for good."""

    def icon(self, what) -> QIcon:  # noqa: D102
        if isinstance(what, QFileInfo):
            what = QFileIconProvider.IconType.Folder if what.isDir() else QFileIconProvider.IconType.File
        return super().icon(what)

    def type(self, info: QFileInfo) -> str:  # noqa: A003, D102
        if info.isDir():
            return "Folder"
        return f"{info.suffix().upper()} file" if info.suffix() else "File"


class FileActions:
    def __init__(self, parent: QWidget, store: RunStore, state: ViewState, controller: Controller,
                 settings: QSettings, surface: Surface, current_kind: Callable[[], str]) -> None:
        self.parent, self.store, self.state, self.controller = parent, store, state, controller
        self.settings, self.surface, self.current_kind = settings, surface, current_kind
        self.present_lecture: Callable[..., bool] = lambda _path, _scene=None: False   # the window's lecture sets it

    def say(self, message: str, ms: int = 5000) -> None:
        self.surface.show_status(message, ms)

    def show_error(self, message: str) -> None:
        self.surface.show_error(message)

    def experiment(self):
        """The experiment File > Save / Export act on: the latest of the tab shown, else the latest of any."""
        return self.store.latest_experiment(self.current_kind()) or (
            self.store.experiments[-1] if self.store.experiments else None)

    # --- traces -------------------------------------------------------------------------------------------
    def open_trace_dialog(self) -> None:
        dialog = QFileDialog(self.parent, "Open a KVScope trace or lecture", self.last_dir(),
                             "KVScope traces and lectures (*.jsonl *.jsonl.gz *.json);;All files (*)")
        dialog.setFileMode(QFileDialog.FileMode.ExistingFile)
        dialog.setOption(QFileDialog.Option.DontUseNativeDialog, True)     # the filter below needs Qt's dialog
        dialog.setIconProvider(PlainIcons())
        dialog.setProxyModel(RegularFilesOnly(dialog))
        if dialog.exec() and dialog.selectedFiles():
            self.open_trace(dialog.selectedFiles()[0])

    def open_trace(self, *paths: str, scene: str | None = None) -> None:
        """Traces replay one after the other; a lecture file (alone) is presented scene by scene, from ``scene``
        where it has one."""
        lectures = [p for p in paths if is_lecture_file(p)]
        if lectures and len(paths) > 1:
            self.show_error("Open a lecture file on its own: it names its traces itself.")
            return
        opened = self.present_lecture(lectures[0], scene) if lectures else \
            paths and self.controller.open_traces(list(paths))
        if opened:
            self.remember_dir(paths[-1])

    def selected_run(self):
        return self.store.find(self.state.selected) if self.state.selected else None

    def save_trace_dialog(self) -> None:
        run = self.selected_run()
        if run is None:
            self.show_error("There is no run to save yet.")
            return
        path, _ = QFileDialog.getSaveFileName(self.parent, "Save run as trace", str(
            Path(self.last_dir()) / f"kvscope-run-{run.number}.kvscope.jsonl"), "KVScope traces (*.jsonl)")
        if path:
            self.save_trace(path)

    def save_trace(self, path: str, events: list | None = None) -> None:
        if events is None:
            run = self.selected_run()
            if run is None:
                self.show_error("There is no run to save yet.")
                return
            # The peaks the run was judged with go first, so its replay says what the live run said of them.
            events = ([run.peaks] if run.peaks is not None else []) + run.events
        try:
            written = write_checked(path, events)
        except (OSError, TraceError, ValueError) as exc:
            self.show_error(f"Could not save the trace to {path}: {getattr(exc, 'strerror', None) or exc}. "
                            "Any file that was there is unchanged.")
            return
        self.remember_dir(path)
        if written.note:
            self.surface.show_warning(f"Saved {written.events:,} events to {path}, but {written.note}")
        else:
            self.say(f"Saved {written.events:,} events to {path}", 5000)

    def save_experiment_trace_dialog(self, record) -> None:
        if record is None:
            self.show_error("There is no experiment to save yet.")
            return
        path, _ = QFileDialog.getSaveFileName(self.parent, "Save experiment as trace", str(
            Path(self.last_dir()) / f"kvscope-{record.kind}-experiment.kvscope.jsonl"), "KVScope traces (*.jsonl)")
        if path:
            self.save_trace(path, record.events)

    # --- exports ------------------------------------------------------------------------------------------
    def export_panel(self, name: str, widget: QWidget) -> None:
        path, _ = QFileDialog.getSaveFileName(self.parent, f"Export {name}", str(
            Path(self.last_dir()) / f"kvscope-{name.lower().replace(' ', '-')}.png"),
            "PNG image (*.png);;SVG drawing (*.svg)")
        if path:
            try:
                export.export_widget(widget, path)
                self.say(f"Exported {name} to {path}", 5000)
            except (OSError, ValueError) as exc:
                self.show_error(f"Could not export {name}: {getattr(exc, 'strerror', None) or exc}")

    def export_run(self, kind: str) -> None:
        run = self.selected_run()
        if run is None:
            self.show_error("There is no run to export yet.")
            return
        path, _ = QFileDialog.getSaveFileName(self.parent, f"Export run data as {kind.upper()}", str(
            Path(self.last_dir()) / f"kvscope-run-{run.number}.{kind}"), f"{kind.upper()} (*.{kind})")
        if path:
            try:
                write_text(path, export.run_csv(run) if kind == "csv" else export.run_json(run), "the export")
                self.say(f"Exported run #{run.number} to {path}", 5000)
            except OSError as exc:
                self.show_error(f"Could not write {path}: {exc.strerror or exc}. Any file that was there is "
                                "unchanged.")

    def export_experiment(self, record) -> None:
        if record is None:
            self.show_error("Run this experiment first: there is no data to export yet.")
            return
        path, _ = QFileDialog.getSaveFileName(self.parent, "Export experiment data as CSV", str(
            Path(self.last_dir()) / f"kvscope-{record.kind}-experiment.csv"), "CSV (*.csv)")
        if path:
            try:
                write_text(path, export.experiment_csv(record), "the export")
                self.say(f"Exported the {record.kind} experiment to {path}", 5000)
            except OSError as exc:
                self.show_error(f"Could not write {path}: {exc.strerror or exc}. Any file that was there is "
                                "unchanged.")

    def events_of(self, record) -> list | None:
        """What an export takes: ``record``'s events (an experiment), else the selected run's, else None."""
        if record is not None:
            return record.events
        run = self.selected_run()
        return run.events if run is not None else None

    def export_perfetto(self, record) -> None:
        """The selected run (``record`` None) or an experiment, as a Chrome/Perfetto trace."""
        events = self.events_of(record)
        if not events:
            self.show_error("There is nothing to export yet: run something first.")
            return
        path, _ = QFileDialog.getSaveFileName(self.parent, "Export as a Perfetto trace", str(
            Path(self.last_dir()) / "kvscope-perfetto.json"), "Perfetto / Chrome trace (*.json)")
        if path:
            try:
                write_perfetto(path, events)
                self.say(f"Exported {len(events):,} events to {path}: open it in ui.perfetto.dev", 8000)
            except OSError as exc:
                self.show_error(f"Could not write {path}: {exc.strerror or exc}")

    def export_otlp(self, record) -> None:
        """The selected run (``record`` None) or an experiment's runs (a load test's requests), as OpenTelemetry
        spans in OTLP/JSON, for the tracing a team already runs."""
        from engine.output.otlp import OTLPError, write_otlp

        events = self.events_of(record)
        if not events:
            self.show_error("There is nothing to export yet: run something first.")
            return
        path, _ = QFileDialog.getSaveFileName(self.parent, "Export as OpenTelemetry spans", str(
            Path(self.last_dir()) / "kvscope-spans.otlp.json"), "OTLP/JSON (*.json)")
        if path:
            try:
                target, count = write_otlp(path, events)
                self.say(f"Exported {count:,} spans to {target} (OTLP/JSON, GenAI attributes)", 8000)
            except OTLPError as exc:
                self.show_error(str(exc))
            except OSError as exc:
                self.show_error(f"Could not write {path}: {exc.strerror or exc}")

    def export_video(self, scene: str | None) -> None:
        """The scene shown (else scene 1) with the run or experiment it shows, as an MP4 or GIF."""
        from app.lecture.scenes import scene_lesson
        from app.lecture.video_export import VideoExport

        scene = scene or "prefill"
        kind = scene_lesson(scene)
        record = self.store.latest_experiment(kind) if kind else None
        events = self.events_of(record)
        if not events:
            self.show_error("There is nothing to render in this scene yet: run it first.")
            return
        path, chosen = QFileDialog.getSaveFileName(self.parent, "Export scene as video", str(
            Path(self.last_dir()) / f"kvscope-{scene}.mp4"), "MP4 video, H.264 (*.mp4);;GIF animation (*.gif)")
        if not path:
            return
        if Path(path).suffix.lower() not in (".mp4", ".gif"):
            path += ".gif" if "GIF" in chosen else ".mp4"
        size, ok = QInputDialog.getItem(self.parent, "Export scene as video", "Size:", VIDEO_SIZES, 0, False)
        if not ok:
            return
        self.remember_dir(path)
        try:
            VideoExport(self.parent, events, scene, path, size,
                        lambda message, done: self.say(message, 8000) if done else self.show_error(message))
        except (OSError, TraceError, ValueError) as exc:
            self.show_error(f"Could not start the export: {getattr(exc, 'strerror', None) or exc}")

    def last_dir(self) -> str:
        return self.settings.value("files/last_dir", str(Path.home()), str)

    def remember_dir(self, path: str) -> None:
        self.settings.setValue("files/last_dir", str(Path(path).parent))
