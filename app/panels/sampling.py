"""The sampling view: for the selected run's newest (or a clicked) step, the likeliest candidates, one bar each,
with their probability before (outline) and after (filled) temperature / top-k / top-p, the drawn token
starred, the tokens the filters cut greyed below a marked line, and how many tokens survived. "What if" filters
the same step's recorded candidates again with other settings (``engine.facts.what_if``), at once and with no
rerun, drawn beside what ran and marked exact or not.

Bars run horizontally so every candidate's text has a line of its own (labels under vertical bars overlap)."""

from __future__ import annotations

from html import escape

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import Qt
from PySide6.QtWidgets import QCheckBox, QHBoxLayout, QLabel, QPushButton, QVBoxLayout, QWidget

from app.panels.tokens import escaped
from app.state.phase import held_line, run_phase
from app.state.run_settings import param_shape
from app.state.store import RunStore
from app.state.viewstate import ViewState, WhatIfSettings
from app.views import theme as th
from app.views.chart import Chart
from app.views.setting_widgets import control, show
from engine.facts.events import TokenStep
from engine.facts.what_if import WhatIf, refilter

CUT = "#BBBBBB"
WHAT_IF = "#7B3294"          # purple: a what-if, not what ran
FILTERS = ("temperature", "top_k", "top_p")
EMPTY = "The candidates for the next token, before and after the filters, appear with the first token"


def candidate_rows(step: TokenStep) -> list[tuple[str, float, float, bool]]:
    """(label, p_raw, p_final, chosen) per bar; the drawn token is appended if it was not a top candidate."""
    if step.token_id is None or step.position is None:     # a server's run: matched by id if it sent one
        rows = [(c.text, c.p_raw, c.p_final, c.token_id == step.token_id if step.token_id is not None
                 else c.text == step.text) for c in step.candidates]
    else:
        rows = [(c.text, c.p_raw, c.p_final, c.token_id == step.token_id) for c in step.candidates]
    if not any(chosen for *_, chosen in rows) and step.prob is not None:
        rows.append((step.text, step.raw_prob if step.raw_prob is not None else step.prob, step.prob, True))
    return rows


class SamplingPanel(QWidget):
    def __init__(self, store: RunStore, state: ViewState) -> None:
        super().__init__()
        self.store, self.state = store, state
        self.theme = th.current_theme(False)
        self.caption = QLabel("The candidates for the next token appear here during a run.")
        self.caption.setWordWrap(True)
        self.caption.setTextFormat(Qt.TextFormat.RichText)
        self.chart = Chart(legend_columns=2)
        self.plot = self.chart.plot
        self.raw_bars = pg.BarGraphItem(x0=[], y=[], height=0.8, width=[], brush=None,
                                        pen=pg.mkPen(th.FORMULA, width=2))
        self.final_bars = pg.BarGraphItem(x0=[], y=[], height=0.5, width=[], brush=th.DECODE, pen=None)
        self.cut_bars = pg.BarGraphItem(x0=[], y=[], height=0.8, width=[], brush=CUT, pen=None)
        self.chosen = pg.ScatterPlotItem(symbol="star", size=18, brush=th.CHOSEN, pen=None)
        self.cut_line = pg.InfiniteLine(angle=0, pen=pg.mkPen(th.CACHE_OFF, width=2, style=Qt.PenStyle.DashLine),
                                        label="cut by the filters", labelOpts={"position": 0.75,
                                                                               "color": th.CACHE_OFF})
        self.chart.add(self.raw_bars, "before the filters")
        self.chart.add(self.final_bars, "after the filters")
        self.chart.add(self.cut_bars, "cut by the filters")
        self.chart.add(self.chosen, "token drawn")
        self.what_if_bars = pg.BarGraphItem(x0=[], y=[], height=0.22, width=[], brush=WHAT_IF, pen=None)
        self.chart.add(self.what_if_bars)                # in the legend only while a what-if is drawn
        self._what_if_named = False
        self.chart.add(self.cut_line)
        self.cut_line.setVisible(False)
        self.chart.set_empty(EMPTY)                      # no numbers on the axes before there is a step to show
        self.plot.invertY(True)
        self.plot.enableAutoRange(x=False)
        self.what_if = QCheckBox("What if")
        self.what_if.setToolTip("Filter this step's recorded candidates again with other settings, at once and "
                                "with no rerun (W in a lecture scene; there T, K and P change these)")
        self.filters = {name: control(param_shape(name)) for name in FILTERS}
        for name, box in self.filters.items():
            key = param_shape(name).key
            box.setPrefix(f"{key.short or key.letter} ")             # T 0.80, top-k 20, top-p 1.00
        self.reset = QPushButton("As it ran")
        row = QHBoxLayout()
        row.addWidget(self.what_if)
        for box in self.filters.values():
            row.addWidget(box)
            box.valueChanged.connect(lambda _v: self._write_what_if())
        row.addWidget(self.reset)
        row.addStretch(1)
        self.what_if_row = QWidget()
        self.what_if_row.setLayout(row)
        row.setContentsMargins(0, 0, 0, 0)
        self._writing = False
        self._show_what_if_values()
        self.what_if.toggled.connect(self._toggle_what_if)
        self.reset.clicked.connect(self._as_it_ran)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(4, 4, 4, 4)
        # The What-if controls above the words: under them, the row moved as the words re-wrapped at each value
        # typed into its boxes.
        layout.addWidget(self.what_if_row)
        layout.addWidget(self.caption)
        layout.addWidget(self.chart, 1)
        self._shown: tuple | None = None
        state.subscribe(lambda names: self._state_changed(names))
        self.set_theme(self.theme)

    def set_theme(self, theme: th.Theme) -> None:
        self.theme = theme
        self.chart.style(theme, "probability", None, "candidate token", None)
        self.plot.setXRange(0, 1.1, padding=0)
        self.plot.getAxis("left").setStyle(hideOverlappingLabels=False)
        self.cut_line.label.setFont(theme.axis_font)
        self._shown = None
        self.refresh()

    # --- what if ---------------------------------------------------------------------------------------------
    def _state_changed(self, names: set[str]) -> None:
        if "what_if" in names:
            self._show_what_if_values()
        if names & {"pinned", "what_if"}:
            self._shown = None
            self.refresh()

    def _ran(self) -> WhatIfSettings | None:
        step = self.current_step()
        run = self.store.find(step.run_id) if step is not None else None
        if run is None or run.started.params is None:
            return None
        p = run.started.params
        return WhatIfSettings(p.temperature, p.top_k, p.top_p)

    def _toggle_what_if(self, on: bool) -> None:
        self.state.set_what_if((self.state.what_if or self._ran() or WhatIfSettings(1.0, 0, 1.0)) if on else None)

    def _as_it_ran(self) -> None:
        ran = self._ran()
        if ran is not None and self.state.what_if is not None:
            self.state.set_what_if(ran)

    def _write_what_if(self) -> None:
        if self.state.what_if is None or self._writing:
            return
        self.state.set_what_if(WhatIfSettings(self.filters["temperature"].value(), self.filters["top_k"].value(),
                                              self.filters["top_p"].value()))

    def _show_what_if_values(self) -> None:
        """The boxes follow the state (a lecture key changes it too), without writing it back."""
        settings = self.state.what_if
        self._writing = True
        try:
            self.what_if.setChecked(settings is not None)
            for name, box in self.filters.items():
                box.setEnabled(settings is not None)
                if settings is not None:
                    # Only a value the box does not hold already: setting it again reformats the text under the
                    # cursor, and "1.5" typed after select-all became "T 15.00" (the "." landed on "1.00").
                    show(box, getattr(settings, name))
            self.reset.setEnabled(settings is not None)
        finally:
            self._writing = False

    def current_step(self) -> TokenStep | None:
        """The step pinned in the view state (a click in the token view, the arrow keys in a scene), else the
        newest."""
        run = self.store.find(self.state.selected) if self.state.selected else None
        index = self.state.shown_step(run.run_id, run.n_steps) if run is not None else None
        return run.steps[index] if index is not None else None

    def refresh(self) -> None:
        step = self.current_step()
        run = self.store.find(step.run_id) if step is not None else None
        key = (step.run_id, step.step, run_phase(run).name, self.state.what_if) if step is not None else None
        if key == self._shown:
            return
        self._shown = key
        self.what_if_row.setVisible(step is not None and step.position is not None)    # a local run's step
        if step is None:
            for bars in (self.raw_bars, self.final_bars, self.cut_bars, self.what_if_bars):
                bars.setOpts(x0=[], y=[], width=[])
            self.chosen.setData([], [])
            self.cut_line.setVisible(False)
            self.chart.set_empty(EMPTY)
            self.caption.setText("The candidates for the next token appear here during a run.")
            return
        self.chart.set_empty(None)
        self.plot.setXRange(0, 1.1, padding=0)          # probabilities: always the whole 0-1 scale
        rows = candidate_rows(step)
        y = np.arange(len(rows))
        raw = np.array([r[1] for r in rows])
        final = np.array([r[2] for r in rows])
        cut = final == 0.0
        run = self.store.find(step.run_id)
        params = run.started.params if run is not None else None
        sampled = params is not None and params.temperature > 0 and (params.top_k or params.top_p < 1.0)
        zeros = np.zeros(len(rows))
        self.raw_bars.setOpts(x0=zeros, y=y, width=raw, height=0.8)
        self.final_bars.setOpts(x0=zeros, y=y, width=final, height=0.5)
        shown_cut = cut if sampled else np.zeros(len(rows), dtype=bool)
        self.cut_bars.setOpts(x0=zeros[shown_cut], y=y[shown_cut], width=raw[shown_cut], height=0.8)
        first_cut = int(np.argmax(shown_cut)) if shown_cut.any() else None
        self.cut_line.setVisible(first_cut is not None)
        if first_cut is not None:
            self.cut_line.setValue(first_cut - 0.5)
        chosen = [i for i, r in enumerate(rows) if r[3]]
        self.chosen.setData([max(raw[i], final[i]) + 0.04 for i in chosen], chosen)
        self.plot.getAxis("left").setTicks([[(i, _label(r[0])) for i, r in enumerate(rows)]])
        self.plot.setYRange(-0.6, len(rows) - 0.4, padding=0)
        tried = self.what_if_result(step)
        if tried is not None:
            self.what_if_bars.setOpts(x0=zeros[:len(tried.probs)], y=y[:len(tried.probs)], width=list(tried.probs),
                                      height=0.22)
        else:
            self.what_if_bars.setOpts(x0=[], y=[], width=[])
        if (tried is not None) != self._what_if_named:
            self._what_if_named = tried is not None
            self.chart.remove(self.what_if_bars)
            self.chart.add(self.what_if_bars, "what if (no rerun)" if tried is not None else None)
        held_now = held_line(run_phase(run)) if run is not None else ""
        self.caption.setText((f"<b>Run #{run.number} {escape(held_now)}.</b> " if held_now else "")
                             + caption(step, params, getattr(run.model, "vocab_size", 0) if run is not None else 0)
                             + (what_if_caption(step, self.state.what_if, tried) if tried is not None else ""))

    def what_if_result(self, step: TokenStep) -> WhatIf | None:
        """The shown step's candidates filtered with the what-if settings (None when none are set, or for a
        server's step, whose candidates carry one probability each)."""
        settings = self.state.what_if
        if settings is None or step.position is None or not step.candidates:
            return None
        return refilter([c.p_raw for c in step.candidates], settings.temperature, settings.top_k, settings.top_p)


def caption(step: TokenStep, params, vocab: int) -> str:
    if step.position is None:                                # a server's run
        if not step.candidates:
            return (f"<b>Step {step.step}</b> · \"{escape(escaped(step.text))}\" · the server sent no probabilities "
                    "(no logprobs), so there are no candidates to show")
        return (f"<b>Step {step.step}</b> ({escape(step.phase)}) · \"{escape(escaped(step.text))}\" · the top "
                f"{len(step.candidates)} candidates with the probabilities the server reported (logprobs); a server "
                "reports one probability per token, so before and after the filters are the same bars")
    if params is None or params.temperature == 0:
        how = "greedy: the likeliest token, always"
    else:
        filters = [f"T={params.temperature:g}"] + ([f"top-k {params.top_k}"] if params.top_k else []) + \
            ([f"top-p {params.top_p:g}"] if params.top_p < 1.0 else []) + [f"seed {params.seed}"]
        how = f"{', '.join(filters)}: <b>{step.kept:,} of {vocab:,}</b> tokens survive the filters"
    return (f"<b>Step {step.step}</b> ({escape(step.phase)}) · drew <b>\"{escape(escaped(step.text))}\"</b> "
            f"(id {step.token_id}) with p = {step.prob:.3f} after the filters, {step.raw_prob:.3f} before · {how}")


def what_if_caption(step: TokenStep, settings: WhatIfSettings, tried: WhatIf, short: bool = False) -> str:
    """What the what-if says, beside what ran: the survivors, and the drawn token's probability both ways.
    ``short``: as a scene's caption says it, in few words."""
    drawn = next((i for i, c in enumerate(step.candidates) if c.token_id == step.token_id), None)
    exact = "exact" if tried.exact else escape(tried.why.split(":")[0] if short else tried.why)
    if short:
        would = f", \"{escape(escaped(step.text))}\" p = {tried.probs[drawn]:.3f}" if drawn is not None else ""
        return (f"<b>what if {escape(settings.text())}</b>: {tried.kept} of {len(tried.probs)} survive{would} "
                f"({exact})")
    would = (f"\"{escape(escaped(step.text))}\" would have had p = {tried.probs[drawn]:.3f} ({step.prob:.3f} as it "
             "ran)" if drawn is not None else "the drawn token was not among the recorded candidates")
    return (f"<br><span style='color:{WHAT_IF}'><b>What if {escape(settings.text())}</b> (no rerun): "
            f"{tried.kept} of the {len(tried.probs)} recorded candidates survive; {would} · {exact}</span>")


SPACE = "␣"          # a token's leading or trailing space, drawn: " of" and "of" are two tokens


def _label(text: str) -> str:
    """A candidate's axis label: the token as written, with the spaces at its ends made visible (an axis label
    drops them, and scene 6 listed "of" twice: " of" and "of")."""
    shown = escaped(text) if text else "▫"
    core = shown.strip(" ")
    if core != shown:
        lead, trail = len(shown) - len(shown.lstrip(" ")), len(shown) - len(shown.rstrip(" "))
        shown = SPACE * lead + core + SPACE * trail if core else SPACE * len(shown)
    return shown if len(shown) <= 24 else shown[:23] + "…"      # a whole token; only a freak one is cut
