"""File > Open / Save / Export for ``MainWindow``: traces in and out, charts and data out. A mixin, so the
window file stays about layout and wiring; it uses the window's store, client, settings, status and banner."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from PySide6.QtWidgets import QFileDialog

from app import export
from engine.trace import write_trace


class FileActions:
    def open_trace_dialog(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self, "Open a KVScope trace", self._last_dir(),
                                              "KVScope traces (*.jsonl);;All files (*)")
        if path:
            self.open_trace(path)

    def open_trace(self, path: str) -> None:
        if self.client.busy:
            self.show_error("Stop the current run before opening a trace.")
            return
        self._remember_dir(path)
        self.banner.hide()
        self._replaying = True
        self.client.open_trace(path, self.replay_speed)
        self._update_buttons()

    def save_trace_dialog(self) -> None:
        run = self.store.current
        if run is None:
            self.show_error("There is no run to save yet.")
            return
        path, _ = QFileDialog.getSaveFileName(self, "Save run as trace", str(Path(self._last_dir()) /
                                              f"kvscope-run-{run.number}.jsonl"), "KVScope traces (*.jsonl)")
        if path:
            self.save_trace(path)

    def save_trace(self, path: str, events: list | None = None) -> None:
        events = self.store.current.events if events is None else events
        try:
            write_trace(path, events)
            self._remember_dir(path)
            self.status.showMessage(f"Saved {len(events)} events to {path}", 5000)
        except OSError as exc:
            self.show_error(f"Could not save the trace to {path}: {exc.strerror or exc}")

    def current_experiment(self):
        kind = "chat" if self.docks["chat"].isVisible() and not self.docks["experiments"].isVisible() \
            else self.experiments.current.kind
        return self.store.latest_experiment(kind) or (self.store.experiments[-1] if self.store.experiments else None)

    def save_experiment_trace_dialog(self) -> None:
        record = self.current_experiment()
        if record is None:
            self.show_error("There is no experiment to save yet.")
            return
        path, _ = QFileDialog.getSaveFileName(self, "Save experiment as trace", str(Path(self._last_dir()) /
                                              f"kvscope-{record.kind}-experiment.jsonl"), "KVScope traces (*.jsonl)")
        if path:
            self.save_trace(path, record.events)

    def export_chart_of(self, name: str, item_of: Callable[[], object]) -> None:
        self.export_chart(name, item_of())

    def export_chart(self, name: str, item: object) -> None:
        path, _ = QFileDialog.getSaveFileName(self, f"Export {name}", str(Path(self._last_dir()) /
                                              f"kvscope-{name.lower().replace(' ', '-')}.png"),
                                              "PNG image (*.png);;SVG drawing (*.svg)")
        if path:
            try:
                export.export_chart(item, path)
                self.status.showMessage(f"Exported {name} to {path}", 5000)
            except (OSError, ValueError) as exc:
                self.show_error(f"Could not export {name}: {exc}")

    def export_run(self, kind: str) -> None:
        run = self.store.current
        if run is None:
            self.show_error("There is no run to export yet.")
            return
        path, _ = QFileDialog.getSaveFileName(self, f"Export run data as {kind.upper()}", str(
            Path(self._last_dir()) / f"kvscope-run-{run.number}.{kind}"), f"{kind.upper()} (*.{kind})")
        if path:
            try:
                export.write_text(path, export.run_csv(run) if kind == "csv" else export.run_json(run))
                self.status.showMessage(f"Exported run #{run.number} to {path}", 5000)
            except OSError as exc:
                self.show_error(f"Could not write {path}: {exc.strerror or exc}")

    def export_experiment(self) -> None:
        record = self.current_experiment()
        if record is None:
            self.show_error("Run this experiment first: there is no data to export yet.")
            return
        path, _ = QFileDialog.getSaveFileName(self, "Export experiment data as CSV", str(
            Path(self._last_dir()) / f"kvscope-{record.kind}-experiment.csv"), "CSV (*.csv)")
        if path:
            try:
                export.write_text(path, export.experiment_csv(record))
                self.status.showMessage(f"Exported the {record.kind} experiment to {path}", 5000)
            except OSError as exc:
                self.show_error(f"Could not write {path}: {exc.strerror or exc}")

    def _last_dir(self) -> str:
        return self.settings.value("files/last_dir", str(Path.home()), str)

    def _remember_dir(self, path: str) -> None:
        self.settings.setValue("files/last_dir", str(Path(path).parent))

