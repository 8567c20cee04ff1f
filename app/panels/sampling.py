"""The sampling view: for the selected run's newest (or a clicked) step, the likeliest candidates, one bar each,
with their probability before (outline) and after (filled) temperature / top-k / top-p, the drawn token
starred, the tokens the filters cut greyed below a marked line, and how many tokens survived.

Bars run horizontally so every candidate's text has a line of its own (labels under vertical bars overlap)."""

from __future__ import annotations

from html import escape

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import Qt
from PySide6.QtWidgets import QLabel, QVBoxLayout, QWidget

from app import theme as th
from app.chart import Chart
from app.panels.tokens import escaped
from app.phase import held_line, run_phase
from app.store import RunStore
from app.viewstate import ViewState
from engine.facts.events import TokenStep

CUT = "#BBBBBB"
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
        self.chart.add(self.cut_line)
        self.cut_line.setVisible(False)
        self.chart.set_empty(EMPTY)                      # no numbers on the axes before there is a step to show
        self.plot.invertY(True)
        self.plot.enableAutoRange(x=False)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(4, 4, 4, 4)
        layout.addWidget(self.caption)
        layout.addWidget(self.chart, 1)
        self._shown: tuple | None = None
        state.subscribe(lambda names: self.refresh() if "pinned" in names else None)
        self.set_theme(self.theme)

    def set_theme(self, theme: th.Theme) -> None:
        self.theme = theme
        self.chart.style(theme, "probability", None, "candidate token", None)
        self.plot.setXRange(0, 1.1, padding=0)
        self.plot.getAxis("left").setStyle(hideOverlappingLabels=False)
        self.cut_line.label.setFont(theme.axis_font)
        self._shown = None
        self.refresh()

    def current_step(self) -> TokenStep | None:
        """The step pinned in the view state (a click in the token view, the arrow keys in a scene), else the
        newest."""
        run = self.store.find(self.state.selected) if self.state.selected else None
        index = self.state.shown_step(run.run_id, run.n_steps) if run is not None else None
        return run.steps[index] if index is not None else None

    def refresh(self) -> None:
        step = self.current_step()
        run = self.store.find(step.run_id) if step is not None else None
        key = (step.run_id, step.step, run_phase(run).name) if step is not None else None
        if key == self._shown:
            return
        self._shown = key
        if step is None:
            for bars in (self.raw_bars, self.final_bars, self.cut_bars):
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
        held_now = held_line(run_phase(run)) if run is not None else ""
        self.caption.setText((f"<b>Run #{run.number} {escape(held_now)}.</b> " if held_now else "")
                             + caption(step, params, getattr(run.model, "vocab_size", 0) if run is not None else 0))


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


def _label(text: str) -> str:
    shown = escaped(text) if text else "▫"
    return shown if len(shown) <= 24 else shown[:23] + "…"      # a whole token; only a freak one is cut
