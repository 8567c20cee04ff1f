"""What the cache is read for: the newest token's attention over the cached positions, per layer (the mean
over heads, top) and per head of one layer (bottom), for the selected run's newest step or a clicked token.

Three patterns show at once on a real model: the attention sink (a bright first column: most heads park most of
their weight on the first token), recent-token focus (brightness along the right edge) and, on sliding-window
layers, rows that start late because those layers no longer hold the early positions. Colours saturate at the
99th percentile so the sink does not flatten everything else; the caption prints the sink's share exactly.
"""

from __future__ import annotations

from html import escape

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import QRectF, Qt
from PySide6.QtWidgets import QHBoxLayout, QLabel, QSpinBox, QVBoxLayout, QWidget

from app.panels.tokens import escaped
from app.state.phase import held_line, run_phase
from app.state.store import RunRecord, RunStore
from app.state.viewstate import ViewState
from app.views import theme as th
from app.views.paint import TimedGraphics
from engine.facts.events import AttentionStep

HOW_BUSY = ("tick <b>record attention</b> under Generation and run once the work in progress is done: each step then "
            "keeps its newest token's weights over the cache")
RECENT = 8        # "recent" positions in the caption: the newest token and the seven before it
HOW = ("tick <b>record attention</b> under Generation (or press R in the attention scene) and run: each step then "
       "keeps its newest token's weights over the cache")


def empty_text(run: RunRecord | None, busy: str | None = None) -> str:
    """What the view says when it has no attention to draw, true to the run shown (or to there being none); while
    the engine is busy, no invitation to start something it would refuse."""
    how = HOW_BUSY if busy else HOW
    if run is None:
        return f"No run yet. To see attention here, {how}."
    if run.started.params.capture_attention and not run.finished:
        return "Recording attention: the first pass's weights appear when its forward pass ends."
    return f"Run #{run.number} did not record attention. To see it, {how}."


def layer_grid(step: AttentionStep, num_layers: int) -> tuple[np.ndarray, int]:
    """Mean over heads per layer, ``[num_layers, positions]`` from the earliest key any layer held to the
    query; positions a layer does not hold (a sliding window, a layer without attention) are NaN."""
    first = min(step.first_positions, default=step.position)
    grid = np.full((num_layers, step.position + 1 - first), np.nan, dtype=np.float32)
    for layer, start, heads in zip(step.layers, step.first_positions, step.weights):
        grid[layer, start - first:] = np.asarray(heads, dtype=np.float32).mean(axis=0)
    return grid, first


def head_grid(step: AttentionStep, layer: int) -> tuple[np.ndarray, int]:
    """One layer's heads, ``[heads, positions held]``, and the position of the first column."""
    index = step.layers.index(layer)
    return np.asarray(step.weights[index], dtype=np.float32), step.first_positions[index]


def row_ticks(rows: int, most: int = 8) -> list[tuple[float, str]]:
    """Row labels at the rows' centres (row ``i`` spans ``[i, i + 1)``), at most ``most`` of them, always the
    first and the last."""
    every = max(1, -(-rows // most))
    picked = [i for i in range(0, rows, every) if rows - 1 - i >= every / 2] + [rows - 1]
    return [(i + 0.5, str(i)) for i in picked]


def shares(step: AttentionStep) -> tuple[float | None, float]:
    """Mean over layers and heads of the weight on position 0 (None when no layer still holds it) and on the
    newest ``RECENT`` positions."""
    sink, recent = [], []
    for start, heads in zip(step.first_positions, step.weights):
        weights = np.asarray(heads, dtype=np.float64)
        if start == 0:
            sink.append(weights[:, 0].mean())
        recent.append(weights[:, -RECENT:].sum(axis=1).mean())
    return (float(np.mean(sink)) if sink else None), (float(np.mean(recent)) if recent else 0.0)


def caption(step: AttentionStep, run: RunRecord) -> str:
    token = run.steps[step.step] if step.step < run.n_steps else None
    word = f"“{escaped(token.text)}”" if token is not None else f"step {step.step}"
    sink, recent = shares(step)
    windows = sorted({step.position + 1 - f for f in step.first_positions if f > 0})
    parts = [f"Choosing {word} (step {step.step}), the query at position {step.position:,} read "
             f"{step.position + 1 - min(step.first_positions, default=step.position):,} cached positions in "
             f"{len(step.layers)} layers."]
    if sink is not None:
        parts.append(f"The first token holds <b>{sink:.0%}</b> of the weight (mean over layers and heads): the "
                     "attention sink.")
    parts.append(f"The newest {RECENT} positions hold {recent:.0%}.")
    if windows:
        parts.append(f"Sliding layers read only their last {', '.join(f'{w:,}' for w in windows)} positions.")
    cost = f"Recording cost {step.capture_ms:,.2f} ms on this pass"
    if token is not None and token.latency_ms > 0:
        cost += f" ({step.capture_ms / token.latency_ms:.1%} of its {token.latency_ms:,.1f} ms)"
    parts.append(f"<i>{cost}, measured by the wall clock ({escape(step.method)}).</i>")
    return " ".join(parts)


class AttentionPanel(QWidget):
    def __init__(self, store: RunStore, state: ViewState) -> None:
        super().__init__()
        self.store, self.state = store, state
        self.theme = th.current_theme(False)
        state.subscribe(lambda names: self.refresh() if "pinned" in names else None)
        self.caption = QLabel(empty_text(None))
        self.caption.setWordWrap(True)
        self.caption.setTextFormat(Qt.TextFormat.RichText)
        self.layer_box = QSpinBox()
        self.layer_box.setPrefix("layer ")
        self.layer_box.setToolTip("Which layer's heads the lower chart shows")
        self.layer_box.valueChanged.connect(self._layer_chosen)
        self.chosen_layer: int | None = None      # None: the last layer, until the user picks one
        top = QHBoxLayout()
        self.heads_label = QLabel("Heads of")
        top.addWidget(self.heads_label)
        top.addWidget(self.layer_box)
        top.addStretch(1)
        self._controls = (self.heads_label, self.layer_box)
        self.graphics = TimedGraphics()
        self.layers_plot: pg.PlotItem = self.graphics.add_plot(0, 0)
        self.heads_plot: pg.PlotItem = self.graphics.add_plot(1, 0)
        for plot in (self.layers_plot, self.heads_plot):
            plot.invertY(True)
        self.heads_plot.setXLink(self.layers_plot)
        cmap = pg.colormap.get(th.HEATMAP)
        self.layers_image = pg.ImageItem(axisOrder="row-major")
        self.heads_image = pg.ImageItem(axisOrder="row-major")
        for plot, image in ((self.layers_plot, self.layers_image), (self.heads_plot, self.heads_image)):
            image.setColorMap(cmap)
            plot.addItem(image)
        self.layer_mark = pg.InfiniteLine(angle=0, pen=pg.mkPen(th.CHOSEN, width=2))
        self.layers_plot.addItem(self.layer_mark)
        self.colorbar = pg.ColorBarItem(colorMap=cmap, interactive=False, width=14)
        self.colorbar.setImageItem([self.layers_image, self.heads_image])
        self.graphics.addItem(self.colorbar, row=0, col=1, rowspan=2)
        self.graphics.ci.layout.setRowStretchFactor(0, 3)
        self.graphics.ci.layout.setRowStretchFactor(1, 2)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(4, 4, 4, 4)
        layout.addWidget(self.caption)
        layout.addLayout(top)
        layout.addWidget(self.graphics, 1)
        self._shown: tuple | None = None
        self.set_theme(self.theme)

    # --- public -------------------------------------------------------------------------------------------
    def set_theme(self, theme: th.Theme) -> None:
        self.theme = theme
        self.graphics.setBackground(theme.background)
        th.style_plot(self.layers_plot, theme, "key position", "tokens", "layer", None)
        th.style_plot(self.heads_plot, theme, "key position", "tokens", "head", None)
        for plot in (self.layers_plot, self.heads_plot):         # few row labels, the edge ones matter most
            plot.getAxis("left").setStyle(hideOverlappingLabels=False)
        bar_axis = self.colorbar.getAxis("right")
        bar_axis.setWidth(None)                         # fits the tick labels at the theme's font size
        bar_axis.setTickFont(theme.axis_font)
        bar_axis.setPen(theme.foreground)
        bar_axis.setTextPen(theme.foreground)
        th.label_axis(bar_axis, "attention weight (share of 1)", None, theme)
        self._shown = None
        self.refresh()

    def set_controls_visible(self, visible: bool) -> None:
        """A lecture scene shows the charts; its own caption carries the claim, so the panel's steps back."""
        for widget in (*self._controls, self.caption):
            widget.setVisible(visible)

    def current(self) -> tuple[RunRecord | None, AttentionStep | None]:
        run = self.store.find(self.state.selected) if self.state.selected else None
        if run is None or not run.attention:
            return run, None
        return run, run.attention[self.state.shown_step(run.run_id, len(run.attention))]

    def refresh(self) -> None:
        run, step = self.current()
        key = (run.run_id if run else None, step.step if step else None, run is not None and run.finished,
               self.theme.lecture, self.store.activity, run_phase(run).name)
        if key == self._shown:
            return
        self._shown = key
        self._redraw()

    def _layer_chosen(self, layer: int) -> None:
        self.chosen_layer = layer
        self._redraw()

    # --- drawing ------------------------------------------------------------------------------------------
    def _redraw(self) -> None:
        run, step = self.current()
        visible = step is not None and bool(step.layers)
        for item in (self.layers_image, self.heads_image, self.layer_mark):
            item.setVisible(visible)
        for plot in (self.layers_plot, self.heads_plot):       # no numbers on axes with nothing drawn against them
            for side in ("bottom", "left"):
                plot.getAxis(side).setStyle(showValues=visible)
        self.colorbar.getAxis("right").setStyle(showValues=visible)
        held_now = held_line(run_phase(run)) if run is not None else ""
        held_words = f"<b>Run #{run.number} {escape(held_now)}.</b> " if held_now else ""
        if not visible:
            self.heads_plot.setTitle(None)
            self.caption.setText(held_words + empty_text(run, self.store.activity))
            return
        layers = run.model.num_layers
        grid, first = layer_grid(step, layers)
        finite = grid[np.isfinite(grid)]
        high = max(float(np.percentile(finite, 99)) if finite.size else 1.0, 1e-3)
        self.layers_image.setImage(grid, levels=(0.0, high), autoLevels=False)
        self.layers_image.setRect(QRectF(first, 0, grid.shape[1], layers))
        wanted = step.layers[-1] if self.chosen_layer is None else self.chosen_layer
        layer = min(step.layers, key=lambda i: abs(i - wanted))          # hybrids skip layers
        self.layer_box.blockSignals(True)
        self.layer_box.setRange(step.layers[0], step.layers[-1])
        self.layer_box.setValue(layer)
        self.layer_box.blockSignals(False)
        heads, head_first = head_grid(step, layer)
        self.heads_image.setImage(heads, levels=(0.0, high), autoLevels=False)
        self.heads_image.setRect(QRectF(head_first, 0, heads.shape[1], heads.shape[0]))
        self.layer_mark.setValue(layer + 0.5)
        self.layers_plot.setXRange(first, step.position + 1, padding=0)
        self.layers_plot.setYRange(0, layers, padding=0)
        self.heads_plot.setYRange(0, heads.shape[0], padding=0)
        self.heads_plot.setTitle(f"heads of layer {layer}", size=f"{self.theme.base_pt:.0f}pt",
                                 color=self.theme.foreground)
        self.colorbar.setLevels((0.0, high))
        self.colorbar.getAxis("right").setTicks([[(v, f"{v:.2f}") for v in (0.0, high / 2, high)]])
        self.layers_plot.getAxis("left").setTicks([row_ticks(layers)])
        self.heads_plot.getAxis("left").setTicks([row_ticks(heads.shape[0])])
        self.caption.setText(held_words + caption(step, run))
