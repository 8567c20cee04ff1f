"""The sampling view: for the newest (or hovered) step, the likeliest candidates with their probability
before (outline) and after (filled) temperature / top-k / top-p, and the token that was drawn marked."""

from __future__ import annotations

from html import escape

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import Qt
from PySide6.QtWidgets import QLabel, QVBoxLayout, QWidget

from app import theme as th
from app.paint import TimedGraphics
from app.panels.tokens import escaped
from app.store import RunStore
from engine.events import TokenStep


def candidate_rows(step: TokenStep) -> list[tuple[str, float, float, bool]]:
    """(label, p_raw, p_final, chosen) per bar; the drawn token is appended if it was not a top candidate."""
    rows = [(c.text, c.p_raw, c.p_final, c.token_id == step.token_id) for c in step.candidates]
    if not any(chosen for *_, chosen in rows):
        rows.append((step.text, step.raw_prob, step.prob, True))
    return rows


class SamplingPanel(QWidget):
    def __init__(self, store: RunStore) -> None:
        super().__init__()
        self.store = store
        self.theme = th.current_theme(False)
        self.pinned: tuple[str, int] | None = None      # (run id, step) chosen in the token view
        self.caption = QLabel("The candidates for the next token appear here during a run.")
        self.caption.setWordWrap(True)
        self.caption.setTextFormat(Qt.TextFormat.RichText)
        self.graphics = TimedGraphics()
        self.plot: pg.PlotItem = self.graphics.addPlot()
        self.plot.addLegend(offset=(-10, 10))
        self.raw_bars = pg.BarGraphItem(x=[], height=[], width=0.8, brush=None, pen=pg.mkPen(th.FORMULA, width=2),
                                        name="before filters (softmax of logits)")
        self.final_bars = pg.BarGraphItem(x=[], height=[], width=0.5, brush=th.DECODE, pen=None,
                                          name="after temperature / top-k / top-p")
        self.chosen = pg.ScatterPlotItem(symbol="star", size=18, brush=th.CHOSEN, pen=None, name="token drawn")
        for item in (self.raw_bars, self.final_bars, self.chosen):
            self.plot.addItem(item)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(4, 4, 4, 4)
        layout.addWidget(self.caption)
        layout.addWidget(self.graphics, 1)
        self._shown: tuple | None = None
        self.set_theme(self.theme)

    def set_theme(self, theme: th.Theme) -> None:
        self.theme = theme
        self.graphics.setBackground(theme.background)
        if self.plot.legend is not None:
            self.plot.legend.setLabelTextSize(f"{theme.base_pt:.0f}pt")
        th.style_plot(self.plot, theme, "candidate token", None, "probability", None)
        self.plot.setYRange(0, 1.05, padding=0)
        self._shown = None
        self.refresh()

    def show_step(self, run_id: str, step: int) -> None:
        """Pin a step (from the token view); ``step < 0`` follows the newest again."""
        self.pinned = (run_id, step) if step >= 0 else None
        self.refresh()

    def current_step(self) -> TokenStep | None:
        if self.pinned is not None:
            run = self.store.find(self.pinned[0])
            if run is not None and self.pinned[1] < run.n_steps:
                return run.steps[self.pinned[1]]
        run = self.store.current
        return run.steps[-1] if run is not None and run.steps else None

    def refresh(self) -> None:
        step = self.current_step()
        key = (step.run_id, step.step) if step is not None else None
        if key == self._shown:
            return
        self._shown = key
        if step is None:
            for bars in (self.raw_bars, self.final_bars):
                bars.setOpts(x=[], height=[])
            self.chosen.setData([], [])
            return
        rows = candidate_rows(step)
        x = np.arange(len(rows))
        self.raw_bars.setOpts(x=x, height=[r[1] for r in rows], width=0.8)
        self.final_bars.setOpts(x=x, height=[r[2] for r in rows], width=0.5)
        chosen = [i for i, r in enumerate(rows) if r[3]]
        self.chosen.setData(chosen, [max(rows[i][1], rows[i][2]) + 0.04 for i in chosen])
        self.plot.getAxis("bottom").setTicks([[(i, _label(r[0])) for i, r in enumerate(rows)]])
        run = self.store.find(step.run_id)
        params = run.started.params if run is not None else None
        how = "greedy (argmax)" if params is not None and params.temperature == 0 else (
            f"T={params.temperature:g}, top-k={params.top_k or 'off'}, top-p={params.top_p:g}, seed {params.seed}"
            if params is not None else "")
        self.caption.setText(
            f"<b>Step {step.step}</b> ({escape(step.phase)}) · drew <b>\"{escape(escaped(step.text))}\"</b> "
            f"(id {step.token_id}) "
            f"with p = {step.prob:.3f} after filters, {step.raw_prob:.3f} before · {how}")


def _label(text: str) -> str:
    shown = escaped(text) if text else "▫"
    return shown if len(shown) <= 10 else shown[:9] + "…"
