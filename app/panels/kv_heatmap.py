"""The per-layer KV cache: layers x positions across the whole context window, filling live.

Grey is context not yet used; coloured cells are held in the cache. A strip above the layers marks which
positions came from the prefill (blue) and which from decode steps (vermillion). Beside it: K and V bytes per
layer, and the arithmetic: what the tensors hold (measured) next to the formula (computed).
"""

from __future__ import annotations

from html import escape

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import QRectF, Qt
from PySide6.QtGui import QBrush, QColor, QFont, QFontMetrics, QPen
from PySide6.QtWidgets import (
    QComboBox,
    QFrame,
    QGraphicsRectItem,
    QHBoxLayout,
    QLabel,
    QPushButton,
    QScrollArea,
    QSplitter,
    QVBoxLayout,
    QWidget,
)

from app.state.glossary import tip
from app.state.phase import held_line, run_phase
from app.state.store import RunRecord, RunStore
from app.state.viewstate import ViewState
from app.views import theme as th
from app.views.chart import fit_ticks
from app.views.paint import TimedGraphics
from engine.facts import kvformula
from engine.facts.events import ServerFacts

REMOTE = ("This run went through a server: it reveals no per-layer tensors, so there is no heatmap. Its KV cache "
          "in use, as the server reports it on /metrics, is in the Server load tab.")
MODES = {"memory": "Memory (bytes held)", "k": "Key norm", "v": "Value norm"}
BAR_LABEL = {"memory": ("bytes per position", "B"), "k": ("mean L2 norm of keys", None),
             "v": ("mean L2 norm of values", None)}


BARS_LABEL = "K solid, V hatched"
X_WORDS = ("position in the context window", "position")          # the heatmap's x axis, longest that fits


def bars_label(model, state: bool, allocated: bool) -> str:
    """What the side bars' styles mean for this model, as the axis label."""
    words = "latent solid, rope key hatched" if kvformula.latent_layers(model) else BARS_LABEL
    return words + (", state dotted" if state else "") + (", allocated dashed" if allocated else "")


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
    def __init__(self, store: RunStore, state: ViewState) -> None:
        super().__init__()
        self.store, self.state = store, state
        self.mode = "memory"
        self.whole_window_only = False     # the "memory" lecture scene shows the whole context, always
        self.theme = th.current_theme(False)
        self.mode_box = QComboBox()
        for key, label in MODES.items():
            self.mode_box.addItem(label, key)
        self.mode_box.currentIndexChanged.connect(lambda _i: state.set_kv_mode(self.mode_box.currentData()))
        self.fit_button = QPushButton("Zoom to used positions")
        self.fit_button.setCheckable(True)
        self.fit_button.setChecked(state.heatmap_fit)
        self.fit_button.setToolTip("On: the used positions and some headroom fill the chart. Off: the whole "
                                   "context window (remembered)")
        self.fit_button.toggled.connect(state.set_heatmap_fit)
        state.subscribe(self._state_changed)
        top = QHBoxLayout()
        show = QLabel("Show:")
        top.addWidget(show)
        top.addWidget(self.mode_box)
        top.addWidget(self.fit_button)
        self._controls = (show, self.mode_box, self.fit_button)
        self._controls_wanted = True
        top.addStretch(1)

        self.graphics = TimedGraphics()
        self.plot: pg.PlotItem = self.graphics.add_plot(0, 0)
        self._x_words = X_WORDS[0]
        self.plot.getViewBox().sigResized.connect(lambda *_: self._fit_x_label())
        self.empty = QGraphicsRectItem()
        self.empty.setPen(QPen(Qt.PenStyle.NoPen))
        self.plot.addItem(self.empty)
        # Row-major (layers x positions) set here, not from pyqtgraph's global option: the panel exists before
        # the theme sets that option, and a transposed grid looks right only while every cell is equal.
        self.image = pg.ImageItem(axisOrder="row-major")
        self.image.setColorMap(pg.colormap.get(th.HEATMAP))
        self.plot.addItem(self.image)
        self.allocation = QGraphicsRectItem()          # a static cache: everything allocated, used or not
        self.allocation.setPen(pg.mkPen(th.CACHE_OFF, width=2, style=Qt.PenStyle.DashLine, cosmetic=True))
        self.allocation.setBrush(QBrush(Qt.BrushStyle.NoBrush))
        self.plot.addItem(self.allocation)
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
        # What the strip above the layers shows, in words with its colours: a label of its own, so it wraps on a
        # narrow panel instead of running off the plot's edge.
        self.strip_label = QLabel()
        self.strip_label.setTextFormat(Qt.TextFormat.RichText)
        self.strip_label.setWordWrap(True)
        # The per-layer bars sit right beside the heatmap, each layer's bar level with its row (the plots share
        # the y range and have no titles, so their data areas are the same height); the colour bar, which keys
        # the heatmap's cells, stands at the far right.
        self.bars_plot: pg.PlotItem = self.graphics.add_plot(0, 1)
        self.bars_plot.setYLink(self.plot)
        self.bars_plot.hideAxis("left")
        self.bars_key = BARS_LABEL
        self.colorbar = pg.ColorBarItem(colorMap=pg.colormap.get(th.HEATMAP), interactive=False, width=14)
        self.colorbar.setImageItem(self.image)
        self.graphics.addItem(self.colorbar, row=0, col=2)
        self.graphics.ci.layout.setColumnStretchFactor(0, 4)
        self.graphics.ci.layout.setColumnStretchFactor(1, 1)
        self.k_bars = pg.BarGraphItem(x0=[], y=[], height=0.4, width=[], brush=QBrush(QColor(th.KV_BARS)),
                                      pen=pg.mkPen(th.KV_BARS))
        self.v_bars = pg.BarGraphItem(x0=[], y=[], height=0.4, width=[],
                                      brush=QBrush(QColor(th.KV_BARS), Qt.BrushStyle.BDiagPattern),
                                      pen=pg.mkPen(th.KV_BARS))
        self.state_bars = pg.BarGraphItem(x0=[], y=[], height=0.27, width=[],
                                          brush=QBrush(QColor(th.KV_BARS), Qt.BrushStyle.Dense5Pattern),
                                          pen=pg.mkPen(th.KV_BARS))
        self.allocated_bars = pg.BarGraphItem(x0=[], y=[], height=0.9, width=[], brush=QBrush(Qt.BrushStyle.NoBrush),
                                              pen=pg.mkPen(th.CACHE_OFF, width=2, style=Qt.PenStyle.DashLine))
        for item in (self.k_bars, self.v_bars, self.state_bars, self.allocated_bars):
            self.bars_plot.addItem(item)
        self.info = QLabel(no_run_text(None))
        self.info.setToolTip(tip("KV cache", "GQA", "MQA", "MLA", "sliding window"))
        self.info.setWordWrap(True)
        self.info.setTextFormat(Qt.TextFormat.RichText)
        self.info.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.info.setAlignment(Qt.AlignmentFlag.AlignTop | Qt.AlignmentFlag.AlignLeft)
        # The arithmetic scrolls where the panel is short (a 720p workbench), never cut off mid-line.
        self.info_box = QScrollArea()
        self.info_box.setWidgetResizable(True)
        self.info_box.setFrameShape(QFrame.Shape.NoFrame)
        self.info_box.setWidget(self.info)
        split = self.split = QSplitter(Qt.Orientation.Vertical)
        split.addWidget(self.graphics)
        split.addWidget(self.info_box)
        split.setStretchFactor(0, 3)
        split.setStretchFactor(1, 1)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(4, 4, 4, 4)
        layout.addLayout(top)
        layout.addWidget(self.strip_label)
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
        self._x_words = X_WORDS[0]
        self._fit_x_label()
        th.style_plot(self.bars_plot, theme, "B", None, "", None)
        bar_axis = self.colorbar.getAxis("right")
        bar_axis.setWidth(None)                         # fits the tick labels at the theme's font size
        bar_axis.setTickFont(theme.axis_font)
        bar_axis.setPen(theme.foreground)
        bar_axis.setTextPen(theme.foreground)
        th.style_ticks(bar_axis, theme)
        bar_axis.setStyle(hideOverlappingLabels=False)  # its three labels sit at the ends: keep them
        self.empty.setBrush(QBrush(QColor("#3A3A3A" if theme.dark else "#E4E4E4")))
        self._shown = None
        self.refresh()

    def selected(self) -> RunRecord | None:
        return self.store.find(self.state.selected) if self.state.selected else None

    def _fit_x_label(self) -> None:
        """The position axis's words in full where they fit under the heatmap, shorter where not: centred under a
        narrow heatmap (a scene at 720p), the full words ran into the bars' unit beside it."""
        if getattr(self, "theme", None) is None:
            return                                      # styled later; the theme says the type's size
        font = QFont(self.font())
        font.setPointSizeF(self.theme.base_pt)
        room = self.plot.getViewBox().width()
        words = next((w for w in X_WORDS if QFontMetrics(font).horizontalAdvance(f"{w} (tokens)") < room * 0.9),
                     X_WORDS[-1])
        if words != self._x_words:
            self._x_words = words
            th.label_axis(self.plot.getAxis("bottom"), words, "tokens", self.theme)

    def refresh(self) -> None:
        run = self.selected()
        key = (run.run_id if run else None, self.store.version, id(self.store.loaded))
        if key == self._shown:
            return
        self._shown = key
        remote = run is not None and run.remote
        drawn = run is not None and not remote          # a server shows no tensors, and before a run there are none:
        for widget in self._controls:                   # no empty axes pretending to be data, nor modes and zoom
            widget.setVisible(self._controls_wanted and drawn)
        if drawn and self.graphics.isHidden():
            self.graphics.setVisible(True)
            self.split.setSizes([3000, 1000])           # a splitter shows a child it hid at no height at all
        else:
            self.graphics.setVisible(drawn)
        self.strip_label.setVisible(drawn)
        if run is None or remote:
            self.image.setVisible(False)
            self.info.setText(REMOTE if remote else no_run_text(self.store.loaded))
            return
        self._draw(run)

    def set_controls_visible(self, visible: bool) -> None:
        """A lecture scene shows the heatmap and its arithmetic; the mode and zoom buttons stay behind."""
        self._controls_wanted = visible
        self._shown = None
        self.refresh()
        self._fit_info()

    def _fit_info(self) -> None:
        """In the workbench the arithmetic scrolls where the panel is short; in a lecture scene it is shown whole
        (the brief form), the heatmap giving up the height: a slide with a scroll bar and a half line was cut."""
        whole = not self._controls_wanted
        policy = Qt.ScrollBarPolicy.ScrollBarAlwaysOff if whole else Qt.ScrollBarPolicy.ScrollBarAsNeeded
        self.info_box.setVerticalScrollBarPolicy(policy)
        width = self.info_box.viewport().width()
        self.info_box.setMinimumHeight(self.info.heightForWidth(width) + 2 if whole and width > 0 else 0)

    def resizeEvent(self, event) -> None:  # noqa: N802 (Qt override)
        super().resizeEvent(event)
        if not self._controls_wanted:
            self._fit_info()

    def refresh_range(self) -> None:
        self._apply_range(force=True)

    def _state_changed(self, names: set[str]) -> None:
        if "kv_mode" in names:
            self.set_mode(self.state.kv_mode)
        if "heatmap_fit" in names:
            self.fit_button.blockSignals(True)
            self.fit_button.setChecked(self.state.heatmap_fit)
            self.fit_button.blockSignals(False)
            self._apply_range(force=True)

    def grid(self, run: RunRecord) -> np.ndarray:
        return run.memory_grid() if self.mode == "memory" else run.norm_grid(self.mode)

    # --- drawing ------------------------------------------------------------------------------------------
    def _draw(self, run: RunRecord) -> None:
        m = run.model
        layers, context, used = m.num_layers, m.max_context, run.kv_tokens
        self.empty.setRect(QRectF(0, 0, context, layers))
        self.allocation.setRect(QRectF(0, 0, run.kv_allocated, layers))
        self.allocation.setVisible(bool(run.kv_allocated))
        grid = self.grid(run)
        drawn = bool(grid.shape[1]) and bool(np.isfinite(grid).any())
        for axis in (self.plot.getAxis("bottom"), self.plot.getAxis("left"), self.colorbar.getAxis("right"),
                     self.bars_plot.getAxis("bottom")):
            axis.setStyle(showValues=drawn)       # no numbers on axes with nothing drawn against them
        if drawn:
            high = float(np.nanmax(grid)) if np.isfinite(grid).any() else 0.0
            high = high or 1.0
            self.image.setImage(grid, levels=(0.0, high), autoLevels=False)
            self.image.setRect(QRectF(0, 0, grid.shape[1], layers))
            self.image.setVisible(True)
            self.colorbar.setLevels((0.0, high))
            fmt = "{:,.0f}" if high >= 100 else "{:.2f}"     # three labels: readable at any size, even in a scene
            self.colorbar.getAxis("right").setTicks([[(v, fmt.format(v)) for v in (0.0, high / 2, high)], []])
        else:
            self.image.setVisible(False)
        label, unit = BAR_LABEL[self.mode]
        th.label_axis(self.colorbar.getAxis("right"), label, unit, self.theme)
        n_prompt = min(run.prompt_tokens, used) if used else 0
        reused = min(run.reused_tokens, n_prompt)
        strip = min(0.6, max(0.15, layers * 0.04))
        self.strip_reused.setRect(QRectF(0, layers + 0.2, reused, strip))
        self.strip_prefill.setRect(QRectF(reused, layers + 0.2, n_prompt - reused, strip))
        self.strip_decode.setRect(QRectF(n_prompt, layers + 0.2, max(used - n_prompt, 0), strip))
        self.boundary.setValue(n_prompt)
        self.boundary.setVisible(used > 0)
        decoded = max(used - n_prompt, 0)
        newest = newest_words(run, used)
        if used:
            pending = " (the newest token not yet)" if newest else ""
            parts = ([(th.REUSED, f"earlier turns (reused) {reused:,}")] if reused else []) + [
                (th.PREFILL, f"prefill {n_prompt - reused:,}"), (th.DECODE, f"decode {decoded:,} positions{pending}")]
            caption = " &nbsp; ".join(f"<span style='color:{colour}'>■</span> {words}" for colour, words in parts)
        elif run.started.params.kv_cache and not run.finished:
            caption = "prefill running: the cache fills when the prompt's forward pass ends"
        elif run.started.params.kv_cache:
            caption = "the cache held nothing this run could show"
        else:
            caption = "KV cache off: nothing is held; every step recomputes all positions"
        if self.strip_label.text() != caption:
            self.strip_label.setText(caption)
        fit_ticks(self.plot.getAxis("left"), [(i + 0.5, str(i)) for i in range(layers)], most=10)
        self._draw_bars(run)
        self._apply_range()
        self.info.setText(self._info_html(run, newest, brief=not self._controls_wanted))
        self._fit_info()

    def _draw_bars(self, run: RunRecord) -> None:
        """Per layer: keys (or a latent layer's compressed vector, with any indexer keys) solid, values (or its
        rope key) hatched, a state-space state dotted where the layer keeps one, and what the tensors'
        storages have allocated as a dashed outline where that is more than they expose."""
        kv = np.asarray(run.kv_bytes_per_layer, dtype=float).reshape(-1, 2)
        layers = run.model.kv_layers if len(run.model.kv_layers) == len(kv) else []
        state = np.array([layer.state_bytes for layer in layers], dtype=float) if layers else np.zeros(len(kv))
        storage = np.asarray(run.kv_storage_per_layer, dtype=float) if len(run.kv_storage_per_layer) == len(kv) \
            else np.zeros(0)
        largest = max(float(kv.sum(axis=1).max()) if len(kv) else 0.0, float(state.max()) if len(state) else 0.0,
                      float(storage.max()) if len(storage) else 0.0)
        factor, unit = binary_scale(largest)
        y = np.arange(len(kv)) + 0.5
        zero = np.zeros(len(kv))
        if state.any():                                   # three bars per layer
            self.k_bars.setOpts(x0=zero, y=y - 0.27, height=0.27, width=kv[:, 0] / factor)
            self.v_bars.setOpts(x0=zero, y=y, height=0.27, width=kv[:, 1] / factor)
            self.state_bars.setOpts(x0=zero, y=y + 0.27, height=0.27, width=state / factor)
        else:
            self.k_bars.setOpts(x0=zero, y=y - 0.2, height=0.4, width=kv[:, 0] / factor)
            self.v_bars.setOpts(x0=zero, y=y + 0.2, height=0.4, width=kv[:, 1] / factor)
            self.state_bars.setOpts(x0=[], y=[], width=[])
        if len(storage):
            self.allocated_bars.setOpts(x0=zero, y=y, height=0.9, width=storage / factor)
        else:
            self.allocated_bars.setOpts(x0=[], y=[], width=[])
        # The bars' column is narrow: its axis says only the unit and labels two ticks (the words, "K solid, V
        # hatched", ran under the colour bar as its label and stand in the panel's text instead).
        th.label_axis(self.bars_plot.getAxis("bottom"), unit, None, self.theme)
        top = largest / factor if largest else 1.0
        self.bars_plot.getAxis("bottom").setTicks([[(0.0, "0"), (top, f"{top:.3g}")], []])
        self.bars_plot.setXRange(0, top * 1.3, padding=0)         # room for the top tick's label
        self.bars_key = bars_label(run.model, bool(state.any()), bool(len(storage)))

    def _apply_range(self, force: bool = False) -> None:
        """Zoomed: the used positions plus a quarter more (the run grows into it); else the whole context."""
        run = self.selected()
        if run is None or run.remote:
            return
        fit = self.state.heatmap_fit and not self.whole_window_only
        if force or fit or self._range_for != run.run_id:
            self._range_for = run.run_id
            right = min(max(run.kv_tokens, 16) * 1.25, run.model.max_context) if fit else run.model.max_context
            self.plot.setXRange(0, right, padding=0.01)
            layers = run.model.num_layers
            self.plot.setYRange(0, layers + min(0.6, max(0.15, layers * 0.04)) + layers * 0.12 + 0.3, padding=0)

    def _info_html(self, run: RunRecord, newest: str, brief: bool = False) -> str:
        """What was read, the formula it is held to and, unless ``brief`` (a lecture scene shows that much whole),
        the full context, the heads and the devices. ``newest``: ``newest_words`` for this run."""
        m = run.model
        fmt = kvformula.format_bytes
        k_total, v_total = kvformula.k_and_v_bytes(run.kv_bytes_per_layer)
        kv = run.kv_check()
        held, seen, predicted = kv.held, kv.positions, kv.predicted
        full = kvformula.full_context_positions(m)
        if not run.started.params.kv_cache:
            measured = "<b>Measured</b>: 0 B: the KV cache is off for this run (every step recomputes all positions)"
        elif run.prefill is None and not run.finished:
            measured = ("<b>Not measured yet</b>: the prefill is running; the cache fills when the prompt's forward "
                        "pass ends")
        elif run.prefill is None:
            measured = "<b>Not measured</b>: the run ended before its prompt's forward pass did"
        else:
            if not kv.full:                     # smaller on purpose: what it keeps, against the full cache
                kept = max(run.kv_positions_per_layer, default=0)
                agree = (f"— kept as {escape(kv.method)}: {kv.share:.0%} of the {fmt(predicted)} the formula "
                         "gives these positions in full precision" if kv.share is not None
                         else f"— kept as {escape(kv.method)}")
                if kept < seen:
                    agree += f"; {kept:,} of the {seen:,} positions held (the first and the most recent)"
            else:
                agree = ("✓ equals the formula" if kv.equal else
                         f"✗ the formula says {fmt(predicted)} for these positions")
            static = (f" — a static cache: all {run.kv_allocated:,} positions allocated up front, "
                      f"{seen:,} in use" if run.kv_allocated else "")
            allocated = (f"<br><b>Allocated</b> (the tensors' storages, measured): {fmt(kv.allocated)} — more "
                         "than they expose: a sliding layer's keys and values are views into a larger buffer"
                         if kv.allocated else "")
            parts = ("latent", "rope key") if kvformula.latent_layers(m) else ("K", "V")
            measured = (f"<b>Measured</b> (read from the cache tensors): {fmt(held)} after {seen:,} positions"
                        f"{newest} ({parts[0]} {fmt(k_total)} + {parts[1]} {fmt(v_total)}; the bars "
                        f"per layer: {escape(self.bars_key)}) {agree}{static}{allocated}")
        if run_phase(run).released:
            measured += "<br><b>Released</b>: the run failed and its cache's memory was given back"
        held_now = held_line(run_phase(run))
        if held_now:
            measured = f"<b>Run #{run.number} {escape(held_now)}</b><br>{measured}"
        formula = (f"{measured}<br><b>Formula</b> (computed): {escape(kvformula.formula_text(m))}; for "
                   f"{run.kv_allocated or seen:,} positions {fmt(predicted)}")
        if brief:
            return formula
        notes = "".join(f"<br>{escape(note)}" for note in kvformula.layer_notes(m))
        notes += f"<br>{escape(concurrency_text(m))}"
        context = (f"<b>Full context</b> ({escape(kvformula.context_text(m))}, computed): "
                   f"{fmt(kvformula.full_context_kv_bytes(m))} — {seen / max(full, 1):.1%} used"
                   if m.context_declared else f"<b>Full context</b>: {escape(kvformula.context_text(m))}")
        return (f"{formula}<br>{context}<br>{escape(kvformula.heads_text(m))}{notes}<br>Devices: "
                f"{escape(layer_ranges(m.layer_devices))} · dtype {escape(m.dtype)}")


def newest_words(run: RunRecord, cached: int) -> str:
    """The cache's positions against the run's tokens (the status strip's "context"): one fewer once decode has
    begun, because the newest token is fed back only at the next step; said, so two counts of one context never
    stand unexplained."""
    s = run.summary(with_text=False)
    tokens = s.reused_tokens + s.prompt_tokens + s.generated_tokens
    if tokens == cached + 1:
        return f" of the {tokens:,} tokens (the newest is not fed back yet)"
    return ""


def no_run_text(model: object) -> str:
    """What the panel says before there is a run to draw, true to whether a model is loaded."""
    if model is None:
        return "No model is loaded yet: load one (Ctrl+L), then run a prompt to see its cache fill."
    if isinstance(model, ServerFacts):
        return REMOTE
    return (f"No run yet: run the prompt (Ctrl+Enter) to see {escape(model.name)}'s cache fill, layer by layer, "
            f"{kvformula.bytes_per_token(model):,} B per position by the formula (computed).")


GPU_GIB = (24, 80)


def concurrency_text(m) -> str:
    """What full-context caches mean for serving: how many fit on common GPUs beside the weights (computed)."""
    full = kvformula.full_context_kv_bytes(m)
    if not full:
        return ""
    weights = m.num_params * m.dtype_bytes
    fits = [f"{max(int((gib * 2**30 - weights) // full), 0):,} on {gib} GiB" for gib in GPU_GIB]
    return (f"Requests at full context that fit beside the weights ({kvformula.format_bytes(weights)}), computed: "
            + ", ".join(fits))
