"""Help > About (versions, device, model, where files live, clearing the cache) and the first-run dialog
that explains the one-time conversion of the built-in model while it happens."""

from __future__ import annotations

import platform
import time
from html import escape
from importlib import metadata

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import (
    QDialog,
    QDialogButtonBox,
    QHeaderView,
    QLabel,
    QProgressBar,
    QPushButton,
    QTableWidget,
    QTableWidgetItem,
    QVBoxLayout,
)

from engine import __version__
from engine.facts.events import HardwarePeaks, ModelLoaded, ServerFacts
from engine.facts.kvformula import format_bytes
from engine.facts.provenance import run_sources
from engine.store.paths import cache_dir, converted_models_dir, folder_bytes, offloaded_models_dir

PACKAGES = ("torch", "transformers", "accelerate", "tokenizers", "PySide6", "pyqtgraph", "numpy")


def package_versions() -> dict[str, str]:
    """Installed versions, read from package metadata: nothing is imported (the window never loads torch)."""
    out = {"Python": platform.python_version()}
    for name in PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "not installed"
    return out


class AboutDialog(QDialog):
    clear_cache = Signal()

    def __init__(self, parent, model: ModelLoaded | None, peaks: HardwarePeaks | None, settings_file: str,
                 busy: bool) -> None:
        super().__init__(parent)
        self.setWindowTitle("About KVScope")
        versions = " · ".join(f"{k} {v}" for k, v in package_versions().items())
        if model is not None and isinstance(model.model, ServerFacts):
            m = model.model
            model_text = escape(f"{m.name} served by {m.engine} at {m.url} (it reveals: {'; '.join(m.reveals)})")
        elif model is not None:
            m = model.model
            model_text = escape(f"{m.name} ({m.architecture}, {m.num_params / 1e6:,.1f}M parameters) on {m.device}, "
                                f"{m.dtype}; source: {m.source}")
        else:
            model_text = "no model loaded"
        device_text = escape(peaks_words(peaks) if peaks is not None else "not measured yet")
        converted, offloaded = converted_models_dir(), offloaded_models_dir()
        self.label = QLabel(
            f"<h3>KVScope {__version__}</h3><p>See LLM inference live: tokens, the KV cache, prefill and decode.</p>"
            f"<p><b>Model:</b> {model_text}<br><b>Device:</b> {device_text}</p>"
            f"<p><b>Versions:</b> {versions}</p>"
            f"<p><b>Files:</b><br>cache: {escape(str(cache_dir()))}<br>converted models: {escape(str(converted))} "
            f"({format_bytes(folder_bytes(converted))})<br>offloaded layers: {escape(str(offloaded))} "
            f"({format_bytes(folder_bytes(offloaded))})<br>settings: {escape(settings_file)}</p>")
        self.label.setTextFormat(Qt.TextFormat.RichText)
        self.label.setWordWrap(True)
        self.label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.clear_button = QPushButton("Clear converted models")
        self.clear_button.setToolTip("Delete the converted copies and offloaded layers; the built-in model converts "
                                     "again on next load")
        self.clear_button.setEnabled(not busy and (converted.exists() or offloaded.exists()))
        self.clear_button.clicked.connect(self._clear)
        buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Close)
        buttons.rejected.connect(self.reject)
        layout = QVBoxLayout(self)
        layout.addWidget(self.label)
        layout.addWidget(self.clear_button)
        layout.addWidget(buttons)
        self.resize(640, 420)

    def _clear(self) -> None:
        self.clear_cache.emit()
        self.clear_button.setEnabled(False)


class FirstRunDialog(QDialog):
    """Shown only while the built-in model is converted (the first launch); later launches never see it."""

    cancel_requested = Signal()

    def __init__(self, parent) -> None:
        super().__init__(parent)
        self.setWindowTitle("Preparing the built-in model")
        self.explain = QLabel(
            "KVScope ships SmolLM2-135M-Instruct as a compressed GGUF file. The first time, it is unpacked into "
            f"plain weights in <code>{escape(str(converted_models_dir()))}</code> and checked against the original, "
            "so later launches skip this step. It happens once; the bar shows how far it has got (how long it "
            "takes depends on the machine and on what else it is doing).")
        self.explain.setWordWrap(True)
        self.explain.setTextFormat(Qt.TextFormat.RichText)
        self.started = time.monotonic()
        self.step = QLabel("Starting…")
        self.step.setTextFormat(Qt.TextFormat.PlainText)
        self.bar = QProgressBar()
        self.bar.setRange(0, 1000)
        cancel = QPushButton("Cancel")
        cancel.clicked.connect(self.cancel_requested)
        layout = QVBoxLayout(self)
        layout.addWidget(self.explain)
        layout.addWidget(self.step)
        layout.addWidget(self.bar)
        layout.addWidget(cancel, alignment=Qt.AlignmentFlag.AlignRight)
        self.resize(520, 200)

    def update_progress(self, message: str, fraction: float | None) -> None:
        self.step.setText(f"{message} · {time.monotonic() - self.started:,.0f} s so far")
        if fraction is None:
            self.bar.setRange(0, 0)
        else:
            self.bar.setRange(0, 1000)
            self.bar.setValue(int(fraction * 1000))


def peaks_words(peaks: HardwarePeaks) -> str:
    """The measured peaks, each with the float it was measured in (a widening model's products of many rows run
    at float32's)."""
    wide = (f", {peaks.wide_flops_per_s / 1e9:,.0f} in float32 (its products of {peaks.wide_rows}+ rows run "
            "widened)" if peaks.wide_flops_per_s else "")
    return (f"{peaks.device}: {peaks.flops_per_s / 1e9:,.0f} GFLOP/s in {peaks.dtype}{wide}, "
            f"{peaks.bytes_per_s / 1e9:,.1f} GB/s (measured)")


class SourcesDialog(QDialog):
    """Where the shown run's figures come from: each measured here, reported by a server, computed, achieved or
    estimated, and from what (``engine.facts.provenance``, the table ``python -m engine --json`` prints too)."""

    def __init__(self, parent, run) -> None:
        super().__init__(parent)
        self.setWindowTitle("Where these figures come from")
        self.resize(1000, 460)
        layout = QVBoxLayout(self)
        if run is None:
            layout.addWidget(QLabel("No run is shown yet: run a prompt (or open a trace) and ask again."))
            rows = []
        else:
            rows = run_sources(run.model, run.summary(with_text=False), run.peaks,
                               kv_on=bool(run.started.params.kv_cache))
            replayed = f" (replayed from {run.source})" if run.source else ""
            layout.addWidget(QLabel(f"Run #{run.number}{replayed}: {len(rows)} figures"))
        self.table = QTableWidget(len(rows), 4)
        self.table.setHorizontalHeaderLabels(["Figure", "Value", "Kind", "From what"])
        self.table.verticalHeader().setVisible(False)
        self.table.setWordWrap(True)
        for r, row in enumerate(rows):
            kind = row.kind + (" (busy machine)" if row.busy else "")
            for c, text in enumerate((row.figure, row.value, kind, row.source)):
                self.table.setItem(r, c, QTableWidgetItem(text))
        header = self.table.horizontalHeader()
        for c in range(3):
            header.setSectionResizeMode(c, QHeaderView.ResizeMode.ResizeToContents)
        header.setSectionResizeMode(3, QHeaderView.ResizeMode.Stretch)
        self.table.resizeRowsToContents()
        layout.addWidget(self.table, 1)
        buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Close)
        buttons.rejected.connect(self.reject)
        layout.addWidget(buttons)
