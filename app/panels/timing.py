"""Prefill vs decode timing, four charts: a timeline per run (the prefill bar, then the decode steps, TTFT
marked, waits drawn apart in grey), per-step latency, running tokens/s and cumulative tokens vs time.

The selected run is drawn with earlier main runs overlaid (chat turns and experiment runs have their own
views), each in the style it got when it started, so "KV cache on" and "off" are one click apart; the header
states the comparison in numbers."""

from __future__ import annotations

import math
from html import escape

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import Qt
from PySide6.QtWidgets import QCheckBox, QGridLayout, QHBoxLayout, QLabel, QSpinBox, QVBoxLayout, QWidget

from app.panels.details import Details
from app.state.glossary import tip
from app.state.phase import PREFILL, decode_rate, figures, plural, rate, run_phase
from app.state.store import RunRecord, RunStore
from app.state.viewstate import MAIN, ViewState
from app.views import theme as th
from app.views.chart import READABLE_DATA_PX, Chart
from engine.facts import contention
from engine.facts.costmodel import Device, ModelCost
from engine.facts.events import HardwarePeaks, RunSummary
from engine.serve.remote import server_phases

WAIT_GAP_MS = 1.0           # waits shorter than this are not drawn apart
WAIT_SAID_MS = 50.0         # waits shorter than this are not worth a word in the header ("0.0 s waiting")
TIMELINE_ROW_PX = 26            # each overlaid run keeps a readable row


class _RunItems:
    """The curves and bars one run contributes to the four charts."""

    def __init__(self, panel: TimingPanel, run: RunRecord, selected: bool) -> None:
        style = panel.state.style(run.run_id)
        width = panel.theme.line_width * (1.6 if selected else 1.0)
        pen = th.run_pen(style.colour, width, style.dashed)
        name = escape(f"#{run.number} {run.label}")                 # legends render HTML
        self.charts = (panel.latency, panel.rate, panel.cumulative)
        self.latency = panel.latency.add(pg.PlotCurveItem(pen=pen), name)
        self.rate = panel.rate.add(pg.PlotCurveItem(pen=pen), name)
        self.cumulative = panel.cumulative.add(pg.PlotCurveItem(pen=pen), name)
        # From a server the client sees only request-to-first-token (queue, prefill, network): drawn grey.
        self.prefill_bar = pg.BarGraphItem(x0=[], y=[], height=0.6, width=[],
                                           brush=th.WAITING if run.remote else th.PREFILL, pen=None)
        self.decode_bars = pg.BarGraphItem(x0=[], y=[], height=0.6, width=[], brush=style.colour, pen=None)
        self.wait_bars = pg.BarGraphItem(x0=[], y=[], height=0.25, width=[], brush=th.WAITING, pen=None)
        # Step boundaries as ticks over the decode bar: one bar per step reads the same and draws in one call
        # however long the run (thousands of separate bars made painting the slowest thing here).
        self.boundaries = pg.PlotCurveItem(pen=pg.mkPen(panel.theme.background, width=1), connect="pairs")
        self.ttft = pg.ScatterPlotItem(symbol="t", size=14, brush=th.CHOSEN, pen=None)
        # While the prompt's pass runs: its bar grows with the elapsed time, its edge moving, and says so.
        self.prefill_edge = pg.ScatterPlotItem(symbol="s", size=12, brush=th.PREFILL, pen=None)
        self.timeline_items = (self.prefill_bar, self.decode_bars, self.wait_bars, self.boundaries, self.ttft,
                               self.prefill_edge)
        for item in self.timeline_items:
            panel.timeline.add(item)
        self.panel = panel

    def remove(self) -> None:
        for chart, item in zip(self.charts, (self.latency, self.rate, self.cumulative)):
            chart.remove(item)
        for item in self.timeline_items:
            self.panel.timeline.remove(item)

    def update(self, run: RunRecord, row: int) -> None:
        n = run.n_steps
        lat = run.series["latency_ms"].values
        t = run.series["t_ms"].values
        steps = np.arange(n)
        self.latency.setData(steps[1:], lat[1:]) if n > 1 else self.latency.setData([], [])
        rate = run.token_rate()
        self.rate.setData(np.arange(1, len(rate) + 1), rate)
        self.cumulative.setData(t / 1000.0, np.arange(1, n + 1))
        phase = run_phase(run)
        running = phase.name == PREFILL and not run.remote
        if (run.prefill is not None or run.remote) and n:
            start = run.prefill.tokenize_ms if run.prefill is not None else 0.0
            self.prefill_bar.setOpts(x0=[start], y=[row], width=[max(t[0] - start, 0.0)], height=0.6)
            self.ttft.setData([t[0]], [row + 0.45])
        elif running:
            self.prefill_bar.setOpts(x0=[0.0], y=[row], width=[phase.elapsed_ms], height=0.6)
        self.prefill_edge.setData([phase.elapsed_ms] if running else [], [row] if running else [])
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


def round_span(ms: float) -> float:
    """The first of 1, 2, 5 x 10^k ms at or above ``ms``: the spans a prefill's bar grows into."""
    k = 10 ** math.floor(math.log10(max(ms, 1.0)))
    return next(m * k for m in (1, 2, 5, 10) if m * k >= ms)


class TimingPanel(QWidget):
    def __init__(self, store: RunStore, state: ViewState) -> None:
        super().__init__()
        self.store, self.state = store, state
        self._held_axis = False
        self.theme = th.current_theme(False)
        self.overlay = QCheckBox("Overlay earlier runs")
        self.overlay.setChecked(True)
        self.overlay_count = QSpinBox()
        self.overlay_count.setRange(1, 10)
        self.overlay_count.setValue(3)
        self.overlay.toggled.connect(lambda _v: self._invalidate())
        self.overlay_count.valueChanged.connect(lambda _v: self._invalidate())
        self.summary = QLabel()
        self.summary.setToolTip(tip("TTFT", "prefill", "decode", "bandwidth ceiling", "roofline"))
        self.summary.setTextFormat(Qt.TextFormat.RichText)
        self.summary.setWordWrap(True)
        self.summary.setVisible(False)                    # shown with its first words
        self.details = Details(rich=True)                 # ceilings, achieved FLOP/s, waits, the graph's build
        top = QHBoxLayout()
        top.addWidget(self.overlay)
        top.addWidget(self.overlay_count)
        top.addStretch(1)
        self.legend = QLabel()                  # one legend for the four charts: every run shown, its style
        self.legend.setTextFormat(Qt.TextFormat.RichText)
        self.legend.setWordWrap(True)
        self.timeline = Chart("Timeline: one prefill bar, then one bar per decode step", legend=False,
                              least_data_px=READABLE_DATA_PX)
        self.latency = Chart("Per-step latency", legend=False)
        self.rate = Chart("Decode throughput (last 8 steps)", legend=False)
        self.cumulative = Chart("Tokens generated vs time", legend=False)
        self.ttft_line = pg.InfiniteLine(angle=90, pen=pg.mkPen(th.CHOSEN, width=2, style=Qt.PenStyle.DashLine),
                                         label="TTFT", labelOpts={"position": 0.92, "color": th.CHOSEN})
        self.timeline.add(self.ttft_line)
        self.ttft_line.setVisible(False)                 # a marker at 0 ms with no run would be a false claim
        # Where decode became compiled (the graph was built beside the eager steps before it).
        compiled_pen = pg.mkPen(th.CHOSEN, width=2, style=Qt.PenStyle.DotLine)
        self.compiled_lines = (
            pg.InfiniteLine(angle=90, pen=compiled_pen, label="compiled", labelOpts={"position": 0.75,
                                                                                      "color": th.CHOSEN}),
            pg.InfiniteLine(angle=90, pen=compiled_pen, label="compiled", labelOpts={"position": 0.9,
                                                                                      "color": th.CHOSEN}))
        self.timeline.add(self.compiled_lines[0])
        self.latency.add(self.compiled_lines[1])
        self.charts = QWidget()
        self.grid = QGridLayout(self.charts)
        self.grid.setContentsMargins(0, 0, 0, 0)
        self._paired: bool | None = None
        self._place_charts(paired=True)

        layout = QVBoxLayout(self)
        layout.setContentsMargins(4, 4, 4, 4)
        layout.addLayout(top)
        layout.addWidget(self.summary)
        layout.addWidget(self.details)
        layout.addWidget(self.legend)
        layout.addWidget(self.charts, 1)
        self._items: dict[str, _RunItems] = {}
        self._shown: tuple | None = None
        self.set_theme(self.theme)

    def _place_charts(self, paired: bool) -> None:
        """The timeline on top (the most height: runs are told apart there); latency and throughput side by side
        (``paired``), or one above the other where the panel is narrower than the two need (at 720p the right one
        was cut, its axis title with it); tokens against time last."""
        if paired == self._paired:
            return
        self._paired = paired
        grid = self.grid
        for chart in (self.timeline, self.latency, self.rate, self.cumulative):
            grid.removeWidget(chart)
        grid.addWidget(self.timeline, 0, 0, 1, 2)
        grid.addWidget(self.latency, 1, 0, 1, 1 if paired else 2)
        grid.addWidget(self.rate, 1 if paired else 2, 1 if paired else 0, 1, 1 if paired else 2)
        grid.addWidget(self.cumulative, 2 if paired else 3, 0, 1, 2)
        for row, stretch in enumerate((3, 2, 2, 0 if paired else 2)):
            grid.setRowStretch(row, stretch)

    def resizeEvent(self, event) -> None:  # noqa: N802 (Qt override)
        super().resizeEvent(event)
        need = self.latency.content_width() + self.rate.content_width() + self.grid.horizontalSpacing()
        self._place_charts(paired=self.charts.width() >= need)

    def set_theme(self, theme: th.Theme) -> None:
        self.theme = theme
        self.timeline.style(theme, "time since run start", "ms", "run", None)
        self.ttft_line.label.setFont(theme.axis_font)
        for line in self.compiled_lines:
            line.label.setFont(theme.axis_font)
        self.latency.style(theme, "decode step", None, "latency", "ms")
        self.rate.style(theme, "decode step", None, "throughput", "tok/s")
        self.cumulative.style(theme, "time since run start", "s", "tokens generated", "tokens")
        self._invalidate()

    def show_at_least(self, runs: int) -> None:
        """Overlay at least ``runs`` runs (runs opened together from the history are drawn together)."""
        self.overlay.setChecked(True)
        if self.overlay_count.value() < runs - 1:
            self.overlay_count.setValue(min(runs - 1, self.overlay_count.maximum()))

    def selected(self) -> RunRecord | None:
        return self.store.find(self.state.selected) if self.state.selected else None

    def visible_runs(self) -> list[RunRecord]:
        """The selected run and, with the overlay on, the newest earlier main runs of the same recording (a trace's
        own, or this session's: a run recorded on another machine is never drawn beside one measured here, nor
        two traces' runs beside each other); oldest first."""
        selected = self.selected()
        if not self.overlay.isChecked():
            return [selected] if selected is not None else []
        source = selected.source if selected is not None else (self.store.runs[-1].source if self.store.runs else "")
        main = [r for r in self.store.runs if self.state.style(r.run_id).group == MAIN and r is not selected
                and r.source == source]
        runs = main[-self.overlay_count.value():] if selected is not None else main[-(self.overlay_count.value()
                                                                                        + 1):]
        return sorted(runs + ([selected] if selected is not None else []), key=lambda r: r.number)

    def _invalidate(self) -> None:
        for items in self._items.values():
            items.remove()
        self._items.clear()
        self._shown = None
        self.refresh()

    def refresh(self) -> None:
        selected = self.selected()
        phase = run_phase(selected)
        tick = round(phase.elapsed_ms / 100) if phase.name == PREFILL else None    # a prefill's bar grows
        key = (self.store.version, self.state.selected, tick)
        if key == self._shown:
            return
        if self._shown is not None and self._shown[1] != self.state.selected:
            self._shown = None                       # the thicker line moves to the new selection
            self._invalidate()
            return
        self._shown = key
        runs = self.visible_runs()
        wanted = {r.run_id for r in runs}
        for run_id in [k for k in self._items if k not in wanted]:
            self._items.pop(run_id).remove()
        selected = self.selected()
        for index, run in enumerate(runs):          # the newest run on the top row: in sight first, in any height
            items = self._items.get(run.run_id)
            if items is None:
                items = self._items[run.run_id] = _RunItems(self, run, run is selected)
            items.update(run, index)
        self.timeline.plot.getAxis("left").setTicks([[(i, f"#{r.number}") for i, r in enumerate(runs)]])
        self.legend.setText(legend_html(runs, self.state, selected))
        self.legend.setVisible(bool(runs))
        self.timeline.plot.setYRange(-0.6, max(len(runs), 1) - 0.4, padding=0.02)
        self._frame_prefill(selected, runs)
        self.timeline.set_least_data(max(READABLE_DATA_PX, TIMELINE_ROW_PX * len(runs)))
        self._empty_states(runs, selected)
        self.ttft_line.setVisible(selected is not None and bool(selected.n_steps))
        summary = selected.summary(with_text=False) if selected is not None else None
        self._mark_compiled(selected, summary.compiled_from_step if summary is not None else 0)
        if selected is not None and selected.n_steps:
            self.ttft_line.setValue(selected.steps[0].t_ms)
        self.refresh_summary()

    def refresh_summary(self) -> None:
        """The header in words: refreshed with the text views every frame (a chart waits its turn), so its
        figures and clock read the same as the status strip's and the caption's."""
        selected = self.selected()
        if selected is None:
            text = details = ""
        else:
            others = [r for r in self.visible_runs() if r is not selected]
            summary = selected.summary(with_text=False)
            text = self._summary_text(selected, summary, others)
            details = self._details_text(selected, summary)
        if self.summary.text() != text:
            self.summary.setText(text)
            self.summary.setVisible(bool(text))           # an empty header would keep its lines' height
        self.details.set_text(details)

    def _frame_prefill(self, selected: RunRecord | None, runs: list[RunRecord]) -> None:
        """While the prompt's pass runs, the time axis holds still (a round span the bar grows into, the next
        one when it gets there): an axis that followed the bar would keep it the same width, frame after frame,
        and the scene would look hung. Afterwards the axis follows the data again."""
        phase = run_phase(selected)
        if phase.name != PREFILL or selected is None or selected.remote:
            if self._held_axis:
                self._held_axis = False
                self.timeline.plot.enableAutoRange(axis="x")
            return
        others = [float(r.series["t_ms"].values[-1]) for r in runs if r is not selected and r.n_steps]
        span = max([round_span(phase.elapsed_ms * 1.25), *others])
        self.timeline.plot.setXRange(0, span, padding=0.02)
        self._held_axis = True

    def _empty_states(self, runs: list[RunRecord], selected: RunRecord | None) -> None:
        """A chart with nothing to draw yet shows no numbers on its axes and says what will appear."""
        timed = any(r.n_steps for r in runs) or (selected is not None and run_phase(selected).name == PREFILL
                                                    and not selected.remote)
        decoded = any(r.n_steps > 1 for r in runs)
        prefill = selected is not None and run_phase(selected).name == PREFILL
        first = ("Prefill running: its bar appears when the prompt's forward pass ends" if prefill else
                 "The first run draws here: one prefill bar, then one bar per decode step")
        self.timeline.set_empty(None if timed else first)
        self.cumulative.set_empty(None if any(r.n_steps for r in runs) else "Appears as tokens are generated")
        for chart in (self.latency, self.rate):
            chart.set_empty(None if decoded else "Appears with the first decode step")

    def _mark_compiled(self, run: RunRecord | None, first: int) -> None:
        """The step where decode became compiled (``first``): at its start on the timeline, at its number on the
        latency chart. Hidden when the selected run has none."""
        step = run.steps[first] if run is not None and 0 < first < run.n_steps else None
        for line in self.compiled_lines:
            line.setVisible(step is not None)
        if step is not None:
            self.compiled_lines[0].setValue(step.t_ms - step.latency_ms)
            self.compiled_lines[1].setValue(first)

    def _summary_text(self, run: RunRecord, s: RunSummary, others: list[RunRecord]) -> str:
        """The selected run in numbers, each figure only once it exists (``app.state.phase``), then where the run is."""
        phase, f = run_phase(run), figures(run)
        if run.remote:
            return remote_summary(run, s) + f" · {escape(phase.words())}"
        parts = []
        if f.ttft_ms is not None:
            parts.append(f"TTFT <b>{f.ttft_ms:,.0f} ms</b>")
        if f.prefill_ms is not None:
            passes = getattr(run.prefill, "passes", 1) if run.prefill is not None else 1
            compiled = " (compiled)" if getattr(run.prefill, "compiled", False) else ""
            parts.append(f"prefill{compiled} {plural(f.prompt_tokens, 'token')} in {f.prefill_ms:,.0f} ms "
                         f"({rate(f.prefill_tok_s)} tok/s)" + (f" in {passes} passes, so Stop could act between them "
                                                              "(one pass is what the prefill lesson times)"
                                                              if passes > 1 else "")
                         if f.prefill_tok_s is not None else "")
        if f.decode_tok_s is not None:
            parts.append(f"decode {plural(f.decode_runs, 'step')}, <b>{escape(decode_rate(f.decode_tok_s))}</b>")
        figures_text = " · ".join(p for p in parts if p) + " (measured)" if any(parts) else ""
        text = " · ".join(t for t in (f"<b>#{run.number}</b> {escape(run.label)}", figures_text,
                                      escape(phase.words())) if t)
        if s.compiled_from_step:
            text += f" · compiled from step {s.compiled_from_step:,}"
        if s.waited_ms >= WAIT_SAID_MS:
            text += f" · {s.waited_ms / 1000:,.1f} s waiting (grey) not counted"
        comparison = compare(run, others[-1]) if others else ""
        if comparison:
            text += f"<br><b>{escape(comparison)}</b>"
        note = contention.busy_note(f.cpu_share)
        if note:
            text += f"<br><b>Note:</b> {escape(note)}" + (" (so far)" if phase.running else "")
        return text

    def _details_text(self, run: RunRecord, s: RunSummary) -> str:
        """What the header's figures rest on: the compiled graph's build, the waits, the ceilings and the achieved
        FLOP/s, for who asks (the Details toggle)."""
        if run.remote:
            return ""
        parts = []
        if s.compiled_from_step and s.compile_ms:
            how = "built earlier, read" if s.compile_loaded else "built"
            parts.append(f"Compiled from step {s.compiled_from_step:,}: its graph {how} in "
                         f"{s.compile_ms / 1000:,.1f} s (not decode time)")
        if s.waited_ms >= WAIT_SAID_MS:
            parts.append(f"{s.waited_ms / 1000:,.1f} s waiting (grey in the timeline) not counted; a step after a "
                         "wait starts cold and is slower")
        if figures(run).prefill_ms:
            parts.append(bounds_text(run, s, run.peaks))
        return "<br>".join(parts)


def remote_summary(run: RunRecord, s) -> str:
    """A server's run: what this client timed, then what the server said about itself; never mixed."""
    text = (f"<b>#{run.number}</b> {escape(run.label)} · TTFT <b>{s.ttft_ms:,.1f} ms</b> (client: request sent to "
            f"first token; grey bar) · decode {s.decode_runs} tokens, <b>{s.decode_tok_s:,.1f} tok/s</b> (client)")
    t = s.server_timings
    phases = server_phases(t)
    if phases is not None:
        text += f"<br>Server reported: {escape(phases.line())}"
    elif t:
        text += "<br>Server reported: " + escape(", ".join(f"{k} {v:,}" for k, v in sorted(t.items())))
    elif run.finished:
        text += "<br>The server reported no timings of its own."
    return text


def legend_html(runs: list[RunRecord], state: ViewState, selected: RunRecord | None) -> str:
    """Every run shown, newest first, in its own colour; dashed (KV off) runs marked; the selected one bold."""
    parts = []
    for run in reversed(runs):
        style = state.style(run.run_id)
        line = "╌╌" if style.dashed else "━━"
        text = escape(f"#{run.number} {run.label}")
        if run is selected:
            text = f"<b>{text}</b>"
        parts.append(f"<span style='color:{style.colour}'>{line}</span>&nbsp;{text}")
    return " &nbsp; ".join(parts)


def compare(run: RunRecord, other: RunRecord) -> str:
    """The comparison two overlaid runs invite, in numbers: per-step latency at the last step both reached."""
    a, b = run.series["latency_ms"].values, other.series["latency_ms"].values
    step = min(len(a), len(b)) - 1
    if step < 1:
        return ""
    fast, slow = (run, other) if a[step] <= b[step] else (other, run)
    lat = {run.run_id: a[step], other.run_id: b[step]}
    ratio = lat[slow.run_id] / lat[fast.run_id] if lat[fast.run_id] > 0 else float("inf")
    how = "KV off" if not slow.started.params.kv_cache and fast.started.params.kv_cache else f"#{slow.number}"
    return (f"#{run.number} vs #{other.number}, step latency at step {step}: {lat[run.run_id]:,.0f} ms vs "
            f"{lat[other.run_id]:,.0f} ms; {how} is {ratio:.1f}x slower per step (measured)")


def bounds_text(run: RunRecord, s: RunSummary, peaks: HardwarePeaks | None) -> str:
    """Measured rates beside the ceilings the cost model computes from this machine's peaks, each ceiling with
    the bound that applies and its own arithmetic. The prefill FLOP/s is *achieved*: the cost model's FLOPs
    divided by the measured prefill time. No ceiling from peaks measured on a busy machine (they sit below what
    runs achieve), and none below a rate this run measured: that says the peaks are wrong, and so it says."""
    cost = ModelCost(run.model)
    prefill = cost.prefill_after(s.reused_tokens, s.prompt_tokens)
    evaluated = prefill.flops
    prefill_flops = evaluated / (s.prefill_ms / 1000.0)
    achieved = (f"prefill {prefill_flops / 1e9:,.1f} GFLOP/s achieved ({evaluated / 1e9:,.2f} GFLOP computed ÷ "
                f"{s.prefill_ms:,.1f} ms measured)")
    if peaks is None:
        return (f"{achieved} · ceilings: none, the peaks of the machine that ran it were not measured (for a run "
                "here: Run > Measure this machine)")
    if not peaks.quiet:
        return (f"{achieved} · ceilings: not shown, this machine was busy when its peaks were taken "
                "(Run > Measure this machine again, when nothing else runs)")
    device = Device.of(peaks)
    parts = []
    if run.started.params.kv_cache and s.decode_runs:
        position = s.reused_tokens + s.prompt_tokens + max(s.generated_tokens - 1, 0)
        step = cost.decode(position)
        ceiling = cost.decode_bound_tok_s(position, device)
        if step.bound(device) == "bandwidth":
            how = f"{peaks.bytes_per_s / 1e9:,.1f} GB/s ÷ {step.bytes / 2**20:,.0f} MiB read per token"
        else:
            how = f"{peaks.flops_per_s / 1e9:,.1f} GFLOP/s ÷ {step.flops / 1e9:,.2f} GFLOP per token"
        if s.decode_tok_s > ceiling:
            parts.append(f"decode {rate(s.decode_tok_s)} tok/s measured, above the {rate(ceiling)} tok/s the peaks "
                         f"allow ({how}): the measured peaks are too low for this machine (Run > Measure this "
                         "machine again)")
        else:
            parts.append(f"decode {rate(s.decode_tok_s)} tok/s measured vs ceiling <b>{rate(ceiling)} tok/s</b> "
                         f"computed, {step.bound(device)}-bound ({how})")
    elif not run.started.params.kv_cache:
        parts.append("decode without cache: every step is a prefill")
    peak = prefill.peak_flops_per_s(device)
    matmul = (f"measured matmul in float32: products of {device.wide_rows}+ rows run widened to it here"
              if device.widens(prefill.rows) else "measured matmul")
    if prefill_flops > peak:
        parts.append(f"{achieved}, above the peak of {peak / 1e9:,.0f} GFLOP/s ({matmul}): the peak is too low for "
                     "this machine")
    else:
        parts.append(f"{achieved} vs peak {peak / 1e9:,.0f} GFLOP/s ({matmul})")
    return " · ".join(parts)
