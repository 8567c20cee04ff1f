"""The per-layer KV cache: layers x positions across the whole context window, filling live.

Grey is context not yet used; coloured cells are held in the cache. A strip above the layers marks which
positions came from the prefill (blue) and which from decode steps (vermillion). Beside it: K and V bytes per
layer, and the arithmetic: what the tensors hold (measured) next to the formula (computed).
"""

from __future__ import annotations

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import QRectF, Qt
from PySide6.QtGui import QBrush, QColor, QPen
from PySide6.QtWidgets import (
    QComboBox,
    QGraphicsRectItem,
    QHBoxLayout,
    QLabel,
    QPushButton,
    QSplitter,
    QVBoxLayout,
    QWidget,
)

from app import theme as th
from app.paint import TimedGraphics
from app.store import RunRecord, RunStore
from engine import kvcache

MODES = {"memory": "Memory (bytes held)", "k": "Key norm", "v": "Value norm"}
BAR_LABEL = {"memory": ("bytes per position", "B"), "k": ("mean L2 norm of keys", None),
             "v": ("mean L2 norm of values", None)}


def binary_scale(max_bytes: float) -> tuple[float, str]:
    for factor, unit in ((1024**3, "GiB"), (1024**2, "MiB"), (1024, "KiB")):
        if max_bytes >= factor:
            return factor, unit
    return 1.0, "B"


def layer_ranges(devices: list[str]) -> str:
    """``["cpu", "cpu", "cuda:0"]`` -> ``layers 0-1 on cpu; layer 2 on cuda:0``."""
    parts, start = [], 0
    for i in range(1, len(devices) + 1):
        if i == len(devices) or devices[i] != devices[start]:
            span = f"layer {start}" if i - 1 == start else f"layers {start}–{i - 1}"
            parts.append(f"{span} on {devices[start]}")
            start = i
    return "; ".join(parts)


class KVHeatmapPanel(QWidget):
    def __init__(self, store: RunStore) -> None:
        super().__init__()
        self.store = store
        self.mode = "memory"
        self.theme = th.current_theme(False)
        self.mode_box = QComboBox()
        for key, label in MODES.items():
            self.mode_box.addItem(label, key)
        self.mode_box.currentIndexChanged.connect(lambda _i: self.set_mode(self.mode_box.currentData()))
        self.fit_button = QPushButton("Zoom to used positions")
        self.fit_button.setCheckable(True)
        self.fit_button.toggled.connect(lambda _on: self._apply_range(force=True))
        top = QHBoxLayout()
        top.addWidget(QLabel("Show:"))
        top.addWidget(self.mode_box)
        top.addWidget(self.fit_button)
        top.addStretch(1)

        self.graphics = TimedGraphics()
        self.plot: pg.PlotItem = self.graphics.addPlot(row=0, col=0)
        self.plot.setMenuEnabled(False)
        self.empty = QGraphicsRectItem()
        self.empty.setPen(QPen(Qt.PenStyle.NoPen))
        self.plot.addItem(self.empty)
        self.image = pg.ImageItem()
        self.image.setColorMap(pg.colormap.get(th.HEATMAP))
        self.plot.addItem(self.image)
        self.strip_reused = QGraphicsRectItem()
        self.strip_prefill = QGraphicsRectItem()
        self.strip_decode = QGraphicsRectItem()
        for item, colour in ((self.strip_reused, th.REUSED), (self.strip_prefill, th.PREFILL),
                             (self.strip_decode, th.DECODE)):
            item.setBrush(QBrush(QColor(colour)))
            item.setPen(QPen(Qt.PenStyle.NoPen))
            self.plot.addItem(item)
        self.boundary = pg.InfiniteLine(angle=90, pen=pg.mkPen(th.PREFILL, width=2, style=Qt.PenStyle.DashLine))
        self.plot.addItem(self.boundary)
        self.boundary.setVisible(False)
        self.strip_text = pg.TextItem(anchor=(0, 1))
        self.plot.addItem(self.strip_text)
        self.colorbar = pg.ColorBarItem(colorMap=pg.colormap.get(th.HEATMAP), interactive=False, width=14)
        self.colorbar.setImageItem(self.image)
        self.graphics.addItem(self.colorbar, row=0, col=1)
        self.bars_plot: pg.PlotItem = self.graphics.addPlot(row=0, col=2)
        self.bars_plot.setMenuEnabled(False)
        self.bars_plot.setYLink(self.plot)
        self.bars_plot.hideAxis("left")
        self.graphics.ci.layout.setColumnStretchFactor(0, 5)
        self.graphics.ci.layout.setColumnStretchFactor(2, 1)
        self.k_bars = pg.BarGraphItem(x0=[], y=[], height=0.4, width=[], brush=th.PREFILL)
        self.v_bars = pg.BarGraphItem(x0=[], y=[], height=0.4, width=[], brush=th.DECODE)
        self.bars_plot.addItem(self.k_bars)
        self.bars_plot.addItem(self.v_bars)
        self.info = QLabel("Load a model and run a prompt to see the cache fill.")
        self.info.setWordWrap(True)
        self.info.setTextFormat(Qt.TextFormat.RichText)
        self.info.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.info.setAlignment(Qt.AlignmentFlag.AlignTop | Qt.AlignmentFlag.AlignLeft)
        split = QSplitter(Qt.Orientation.Vertical)
        split.addWidget(self.graphics)
        split.addWidget(self.info)
        split.setStretchFactor(0, 3)
        split.setStretchFactor(1, 1)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(4, 4, 4, 4)
        layout.addLayout(top)
        layout.addWidget(split, 1)
        self._shown: tuple[str, int] | None = None
        self._range_for: str | None = None
        self.plot.setXRange(0, 1024)
        self.plot.setYRange(0, 30)
        self.set_theme(self.theme)

    # --- public -------------------------------------------------------------------------------------------
    def set_mode(self, mode: str) -> None:
        if mode in MODES:
            self.mode = mode
            self.mode_box.setCurrentIndex(list(MODES).index(mode))
            self._shown = None
            self.refresh()

    def set_theme(self, theme: th.Theme) -> None:
        self.theme = theme
        self.graphics.setBackground(theme.background)
        th.style_plot(self.plot, theme, "position in the context window", "tokens", "layer", None)
        th.style_plot(self.bars_plot, theme, "per layer", "B", "", None)
        self.bars_plot.setTitle("K (blue), V (red)", size=f"{theme.base_pt:.0f}pt")
        self.colorbar.getAxis("right").setTickFont(theme.axis_font)
        self.empty.setBrush(QBrush(QColor("#3A3A3A" if theme.dark else "#E4E4E4")))
        self.strip_text.setColor(theme.foreground)
        self._shown = None
        self.refresh()

    def refresh(self) -> None:
        run = self.store.current
        if run is None:
            return
        key = (run.run_id, self.store.version)
        if key == self._shown:
            return
        self._shown = key
        self._draw(run)

    def grid(self, run: RunRecord) -> np.ndarray:
        return run.memory_grid() if self.mode == "memory" else run.norm_grid(self.mode)

    # --- drawing ------------------------------------------------------------------------------------------
    def _draw(self, run: RunRecord) -> None:
        m = run.model
        layers, context, used = m.num_layers, m.max_context, run.kv_tokens
        self.empty.setRect(QRectF(0, 0, context, layers))
        grid = self.grid(run)
        if grid.shape[1]:
            high = float(grid.max()) or 1.0
            self.image.setImage(grid, levels=(0.0, high), autoLevels=False)
            self.image.setRect(QRectF(0, 0, grid.shape[1], layers))
            self.image.setVisible(True)
            self.colorbar.setLevels((0.0, high))
        else:
            self.image.setVisible(False)
        label, unit = BAR_LABEL[self.mode]
        th.label_axis(self.colorbar.getAxis("right"), label, unit, self.theme)
        n_prompt = min(run.prompt_tokens, used) if used else 0
        reused = min(run.reused_tokens, n_prompt)
        strip = max(0.6, layers * 0.04)
        self.strip_reused.setRect(QRectF(0, layers + 0.2, reused, strip))
        self.strip_prefill.setRect(QRectF(reused, layers + 0.2, n_prompt - reused, strip))
        self.strip_decode.setRect(QRectF(n_prompt, layers + 0.2, max(used - n_prompt, 0), strip))
        self.boundary.setValue(n_prompt)
        self.boundary.setVisible(used > 0)
        earlier = f"earlier turns (reused): {reused:,}   " if reused else ""
        decoded = max(used - n_prompt, 0)
        self.strip_text.setText(f"{earlier}prefill: {n_prompt - reused:,} positions   decode: {decoded:,}"
                                if used else "KV cache off: nothing is held; every step recomputes all positions")
        self.strip_text.setPos(0, layers + 0.3 + strip)
        self.plot.getAxis("left").setTicks([[(i + 0.5, str(i)) for i in range(0, layers, max(1, layers // 10))]])
        self._draw_bars(run)
        self._apply_range()
        self.info.setText(self._info_html(run))

    def _draw_bars(self, run: RunRecord) -> None:
        kv = np.asarray(run.kv_bytes_per_layer, dtype=float).reshape(-1, 2)
        factor, unit = binary_scale(float(kv.sum(axis=1).max()) if len(kv) else 0.0)
        y = np.arange(len(kv)) + 0.5
        self.k_bars.setOpts(x0=np.zeros(len(kv)), y=y - 0.2, height=0.4, width=kv[:, 0] / factor)
        self.v_bars.setOpts(x0=np.zeros(len(kv)), y=y + 0.2, height=0.4, width=kv[:, 1] / factor)
        th.label_axis(self.bars_plot.getAxis("bottom"), "per layer", unit, self.theme)

    def _apply_range(self, force: bool = False) -> None:
        run = self.store.current
        if run is None:
            return
        fit = self.fit_button.isChecked()
        if force or fit or self._range_for != run.run_id:
            self._range_for = run.run_id
            right = max(run.kv_tokens, 16) * 1.05 if fit else run.model.max_context
            self.plot.setXRange(0, right, padding=0.01)
            self.plot.setYRange(0, run.model.num_layers * 1.12 + 1, padding=0)

    def _info_html(self, run: RunRecord) -> str:
        m = run.model
        kv = run.kv_bytes_per_layer
        k_total, v_total = sum(k for k, _ in kv), sum(v for _, v in kv)
        held = k_total + v_total
        predicted = kvcache.predicted_kv_bytes(m, run.kv_tokens)
        agree = "✓ equals the formula" if held == predicted else f"✗ formula says {kvcache.format_bytes(predicted)}"
        ratio = m.num_heads // max(m.num_kv_heads, 1)
        heads = (f"{m.num_heads} query heads share {m.num_kv_heads} KV heads (GQA, {ratio} per KV head): the cache "
                 f"is {ratio}x smaller than if every head kept its own" if m.num_kv_heads < m.num_heads else
                 f"{m.num_heads} heads, each with its own K and V (no GQA)")
        fmt = kvcache.format_bytes
        measured = (f"<b>Measured</b> (read from the cache tensors): {fmt(held)} in {run.kv_tokens:,} positions "
                    f"(K {fmt(k_total)} + V {fmt(v_total)}) {agree}" if run.kv_tokens else
                    "<b>Measured</b>: 0 B: the KV cache is off for this run")
        return (f"{measured}<br><b>Formula</b> (computed): {kvcache.formula_text(m)} × {run.kv_tokens:,} tokens = "
                f"{fmt(predicted)}<br><b>Full context</b> ({m.max_context:,} tokens, computed): "
                f"{fmt(kvcache.full_context_kv_bytes(m))} — {run.kv_tokens / m.max_context:.1%} used<br>"
                f"{heads}<br>Devices: {layer_ranges(m.layer_devices)} · dtype {m.dtype} ({m.dtype_bytes} B)")
