"""One chart: a plot, its title, and its legend in a row of its own above the data (a legend on the data hides
the data), styled by the theme. Charts are separate widgets so a lecture scene can take one and make it fill
the screen while the workbench keeps the others."""

from __future__ import annotations

import pyqtgraph as pg

from app import theme as th
from app.paint import TimedGraphics


class Chart(TimedGraphics):
    def __init__(self, title: str = "", legend: bool = True, legend_columns: int = 3) -> None:
        super().__init__()
        self.title = title
        self.legend: pg.LegendItem | None = None
        if legend:
            self.legend = pg.LegendItem(colCount=legend_columns, labelTextSize="9pt")
            self.addItem(self.legend, row=0, col=0)
        self.plot: pg.PlotItem = self.addPlot(row=1, col=0, title=title or None)
        self.plot.setMenuEnabled(False)
        self.ci.layout.setRowStretchFactor(1, 10)
        self.theme = th.current_theme(False)

    def style(self, theme: th.Theme, x: str, x_unit: str | None, y: str, y_unit: str | None) -> None:
        self.theme = theme
        self.setBackground(theme.background)
        th.style_plot(self.plot, theme, x, x_unit, y, y_unit)
        if self.legend is not None:
            self.legend.setLabelTextSize(f"{theme.base_pt:.0f}pt")
            for _sample, label in self.legend.items:
                label.setText(label.text, size=f"{theme.base_pt:.0f}pt", color=theme.foreground)

    def add(self, item: pg.GraphicsObject, name: str | None = None) -> pg.GraphicsObject:
        """Put ``item`` on the plot and, if named, in the legend (names are shown as rich text: escape them)."""
        self.plot.addItem(item)
        if name and self.legend is not None:
            self.legend.addItem(item, name)
            _, label = self.legend.items[-1]
            label.setText(label.text, size=f"{self.theme.base_pt:.0f}pt", color=self.theme.foreground)
        return item

    def remove(self, item: pg.GraphicsObject) -> None:
        self.plot.removeItem(item)
        if self.legend is not None:
            self.legend.removeItem(item)

    def clear_data(self) -> None:
        """Everything off the plot and out of the legend (not ``clear``: the layout widget owns that name)."""
        self.plot.clear()
        if self.legend is not None:
            self.legend.clear()

    def set_title_visible(self, visible: bool) -> None:
        """A lecture scene states the claim in its caption; its charts drop their titles for the room it takes."""
        if not (visible and self.title):
            self.plot.titleLabel.setText("")       # a hidden title still holds the layout as wide as its text
        self.plot.setTitle(self.title if visible and self.title else None)
        if visible and self.title:
            self.plot.setTitle(self.title, size=f"{self.theme.base_pt + 1:.0f}pt", color=self.theme.foreground)

    def legend_names(self) -> list[str]:
        return [label.text for _sample, label in self.legend.items] if self.legend is not None else []
