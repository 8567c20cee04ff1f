"""Prefill vs decode timing: a timeline per run (the prefill bar, then one bar per decode step, TTFT marked),
per-step latency, running tokens/s and cumulative tokens vs time. Earlier runs can be overlaid, so "KV cache
on" and "off" are one click apart; the legend names each run's settings."""

from __future__ import annotations

from html import escape

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import Qt
from PySide6.QtWidgets import QCheckBox, QHBoxLayout, QLabel, QSpinBox, QVBoxLayout, QWidget

from app import theme as th
from app.paint import TimedGraphics
from app.store import RunRecord, RunStore
from engine import load
from engine.costmodel import Device, ModelCost

WAIT_GAP_MS = 1.0           # waits shorter than this are not drawn apart


class _RunItems:
    """The curves and bars one run contributes to the four charts."""

    def __init__(self, panel: TimingPanel, run: RunRecord, colour: str, width: float) -> None:
        pen = pg.mkPen(colour, width=width)
        name = escape(f"#{run.number} {run.label}")             # legends render HTML
        self.latency = panel.latency.plot([], [], pen=pen, name=name)
        self.rate = panel.rate.plot([], [], pen=pen, name=name)
        self.cumulative = panel.cumulative.plot([], [], pen=pen, name=name)
        self.prefill_bar = pg.BarGraphItem(x0=[], y=[], height=0.6, width=[], brush=th.PREFILL, pen=None)
        self.decode_bars = pg.BarGraphItem(x0=[], y=[], height=0.6, width=[], brush=colour, pen=None)
        self.wait_bars = pg.BarGraphItem(x0=[], y=[], height=0.25, width=[], brush=th.WAITING, pen=None)
        # Step boundaries as white ticks over the decode bar: one bar per step reads the same and draws in
        # one call however long the run (thousands of separate bars made painting the slowest thing here).
        self.boundaries = pg.PlotCurveItem(pen=pg.mkPen(panel.theme.background, width=1), connect="pairs")
        self.ttft = pg.ScatterPlotItem(symbol="t", size=12, brush=th.CHOSEN, pen=None)
        for item in (self.prefill_bar, self.decode_bars, self.wait_bars, self.boundaries, self.ttft):
            panel.timeline.addItem(item)
        self.items = [self.latency, self.rate, self.cumulative]
        self.panel = panel

    def remove(self) -> None:
        for plot, item in ((self.panel.latency, self.latency), (self.panel.rate, self.rate),
                           (self.panel.cumulative, self.cumulative)):
            plot.removeItem(item)
        for item in (self.prefill_bar, self.decode_bars, self.wait_bars, self.boundaries, self.ttft):
            self.panel.timeline.removeItem(item)

    def update(self, run: RunRecord, row: int) -> None:
        n = run.n_steps
        lat = run.series["latency_ms"].values
        t = run.series["t_ms"].values
        steps = np.arange(n)
        self.latency.setData(steps[1:], lat[1:]) if n > 1 else self.latency.setData([], [])
        rate = run.token_rate()
        self.rate.setData(np.arange(1, len(rate) + 1), rate)
        self.cumulative.setData(t / 1000.0, np.arange(1, n + 1))
        if run.prefill is not None and n:
            start = run.prefill.tokenize_ms
            self.prefill_bar.setOpts(x0=[start], y=[row], width=[max(t[0] - start, 0.0)], height=0.6)
            self.ttft.setData([t[0]], [row + 0.45])
        if n > 1:
            ends, starts = t[1:], t[1:] - lat[1:]
            waited = run.series["waited_ms"].values[1:]
            # A wait (paused, single-stepped, slow motion) splits the decode bar: the gap is drawn apart, in
            # grey, and is not decode time.
            breaks = np.nonzero(waited > WAIT_GAP_MS)[0]
            first = np.unique(np.concatenate([[0], breaks]))
            last = np.concatenate([first[1:] - 1, [len(ends) - 1]])
            self.decode_bars.setOpts(x0=starts[first], y=np.full(len(first), row), width=ends[last] - starts[first],
                                     height=0.6)
            self.wait_bars.setOpts(x0=starts[breaks] - waited[breaks], y=np.full(len(breaks), row),
                                   width=waited[breaks], height=0.25)
            edges = np.repeat(t[1:-1], 2)                                  # one vertical tick per step end
            ys = np.tile([row - 0.3, row + 0.3], n - 2)
            self.boundaries.setData(edges, ys)
        else:
            self.decode_bars.setOpts(x0=[], y=[], width=[], height=0.6)
            self.wait_bars.setOpts(x0=[], y=[], width=[], height=0.25)
            self.boundaries.setData([], [])


class TimingPanel(QWidget):
    def __init__(self, store: RunStore) -> None:
        super().__init__()
        self.store = store
        self.theme = th.current_theme(False)
        self.overlay = QCheckBox("Overlay previous runs")
        self.overlay.setChecked(True)
        self.overlay_count = QSpinBox()
        self.overlay_count.setRange(1, 10)
        self.overlay_count.setValue(3)
        self.overlay.toggled.connect(lambda _v: self._invalidate())
        self.overlay_count.valueChanged.connect(lambda _v: self._invalidate())
        self.summary = QLabel()
        self.summary.setTextFormat(Qt.TextFormat.RichText)
        self.summary.setWordWrap(True)
        top = QHBoxLayout()
        top.addWidget(self.overlay)
        top.addWidget(self.overlay_count)
        top.addWidget(self.summary, 1)
        self.graphics = TimedGraphics()
        self.timeline: pg.PlotItem = self.graphics.addPlot(row=0, col=0, colspan=2,
                                                           title="Timeline: prefill bar, then one bar per decode step")
        self.latency: pg.PlotItem = self.graphics.addPlot(row=1, col=0, title="Per-step latency")
        self.rate: pg.PlotItem = self.graphics.addPlot(row=1, col=1, title="Decode throughput (last 8 steps)")
        self.cumulative: pg.PlotItem = self.graphics.addPlot(row=2, col=0, colspan=2,
                                                             title="Tokens generated vs time")
        for plot in (self.latency, self.rate, self.cumulative):
            plot.addLegend(offset=(-10, 10))
        self.ttft_line = pg.InfiniteLine(angle=90, pen=pg.mkPen(th.CHOSEN, width=2, style=Qt.PenStyle.DashLine),
                                         label="TTFT", labelOpts={"position": 0.9, "color": th.CHOSEN})
        self.timeline.addItem(self.ttft_line)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(4, 4, 4, 4)
        layout.addLayout(top)
        layout.addWidget(self.graphics, 1)
        self._items: dict[str, _RunItems] = {}
        self._shown_version = -1
        self.set_theme(self.theme)

    def set_theme(self, theme: th.Theme) -> None:
        self.theme = theme
        self.graphics.setBackground(theme.background)
        if self.latency.legend is not None:
            self.latency.legend.setLabelTextSize(f"{theme.base_pt:.0f}pt")
        if self.rate.legend is not None:
            self.rate.legend.setLabelTextSize(f"{theme.base_pt:.0f}pt")
        if self.cumulative.legend is not None:
            self.cumulative.legend.setLabelTextSize(f"{theme.base_pt:.0f}pt")
        th.style_plot(self.timeline, theme, "time since run start", "ms", "run", None)
        th.style_plot(self.latency, theme, "decode step", None, "latency", "ms")
        th.style_plot(self.rate, theme, "decode step", None, "throughput", "tok/s")
        th.style_plot(self.cumulative, theme, "time since run start", "s", "tokens generated", "tokens")
        self._invalidate()

    def visible_runs(self) -> list[RunRecord]:
        runs = self.store.runs
        if not runs:
            return []
        if not self.overlay.isChecked():
            return [runs[-1]]
        return runs[-(self.overlay_count.value() + 1):]

    def _invalidate(self) -> None:
        for items in self._items.values():
            items.remove()
        self._items.clear()
        self._shown_version = -1
        self.refresh()

    def refresh(self) -> None:
        if self.store.version == self._shown_version:
            return
        self._shown_version = self.store.version
        runs = self.visible_runs()
        wanted = {r.run_id for r in runs}
        for run_id in [k for k in self._items if k not in wanted]:
            self._items.pop(run_id).remove()
        current = runs[-1] if runs else None
        for index, run in enumerate(reversed(runs)):          # row 0 = the newest run
            items = self._items.get(run.run_id)
            if items is None:
                colour = th.run_colour(run.started.params.kv_cache) if run is current else \
                    th.OVERLAY[run.number % len(th.OVERLAY)]
                items = self._items[run.run_id] = _RunItems(self, run, colour,
                                                            self.theme.line_width * (1.5 if run is current else 1))
            items.update(run, index)
        self.timeline.getAxis("left").setTicks([[(i, f"#{r.number}") for i, r in enumerate(reversed(runs))]])
        if current is not None:
            self._update_summary(current)

    def _update_summary(self, run: RunRecord) -> None:
        s = run.summary(with_text=False)
        if run.n_steps:
            self.ttft_line.setValue(run.steps[0].t_ms)
        text = (f"<b>#{run.number}</b> {escape(run.label)} · TTFT <b>{s.ttft_ms:,.1f} ms</b> · prefill "
                f"{s.prompt_tokens} tokens in {s.prefill_ms:,.1f} ms ({s.prefill_tok_s:,.0f} tok/s) · decode "
                f"{s.decode_runs} steps, <b>{s.decode_tok_s:,.1f} tok/s</b> (measured)")
        if s.waited_ms:
            text += (f" · {s.waited_ms / 1000:,.1f} s waiting (grey in the timeline) not counted; a step after a wait "
                     "starts cold and is slower")
        note = load.busy_note(s.cpu_share)
        if note:
            text += f"<br><b>Note:</b> {escape(note)}"
        peaks = self.store.peaks
        if peaks is not None and s.prefill_ms > 0:
            text += "<br>" + bounds_text(run, s, peaks)
        self.summary.setText(text)


def bounds_text(run: RunRecord, s, peaks) -> str:
    """Measured rates beside the ceilings the cost model computes from this machine's measured peaks. The
    prefill FLOP/s is *achieved*: the cost model's FLOPs divided by the measured prefill time."""
    cost = ModelCost(run.model)
    device = Device(peaks.device, peaks.flops_per_s, peaks.bytes_per_s)
    position = s.reused_tokens + s.prompt_tokens + max(s.generated_tokens - 1, 0)
    step = cost.decode(position)
    evaluated = cost.prefill(s.reused_tokens + s.prompt_tokens).flops - (cost.prefill(s.reused_tokens).flops
                                                                         if s.reused_tokens else 0.0)
    prefill_flops = evaluated / (s.prefill_ms / 1000.0)
    ceiling = cost.decode_bound_tok_s(position, device)
    decode = (f"decode {s.decode_tok_s:,.1f} tok/s measured vs ceiling <b>{ceiling:,.1f}"
              f" tok/s</b> computed ({peaks.bytes_per_s / 1e9:,.1f} GB/s ÷ {step.bytes / 2**20:,.0f} MiB read per "
              f"token)" if run.started.params.kv_cache else "decode without cache: every step is a prefill")
    busy = " (peaks measured on a busy machine)" if load.busy(peaks.cpu_share) else ""
    return (f"{decode} · prefill {prefill_flops / 1e9:,.1f} GFLOP/s achieved ({evaluated / 1e9:,.2f} GFLOP computed "
            f"÷ {s.prefill_ms:,.1f} ms measured) vs peak {peaks.flops_per_s / 1e9:,.0f} GFLOP/s (measured matmul)"
            f"{busy}")
