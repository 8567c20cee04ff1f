"""One chart: a plot, its title, and its legend in a row of its own above the data (a legend on the data hides
the data), styled by the theme. Charts are separate widgets so a lecture scene can take one and make it fill
the screen while the workbench keeps the others."""

from __future__ import annotations

import math
from html import escape

import pyqtgraph as pg
from PySide6.QtCore import QRectF, Qt, QTimer
from PySide6.QtGui import QFont, QFontMetricsF

from app.views import theme as th
from app.views.paint import TimedGraphics

MIN_DATA_PX = 100            # the least height of a chart's data area in the workbench (its dock scrolls below it)
READABLE_DATA_PX = 135       # the same for the one chart a short panel keeps readable
FRAME_PX = 90                # a title and an axis with its label, until the chart is laid out and measured
TITLE_MARGIN_PX = 8          # each side of a chart's title
READABLE_WIDTH_PX = 330      # 240 px of data beside an axis with its numbers and title


class Chart(TimedGraphics):
    def __init__(self, title: str = "", legend: bool = True, legend_columns: int = 3,
                 legend_beside: bool = False, least_data_px: int = MIN_DATA_PX) -> None:
        """``legend_beside``: the legend in a column right of the plot, not in a row above it (a short chart
        keeps its height for the data). ``least_data_px``: the least height of its data area; a panel's main
        chart asks for ``READABLE_DATA_PX``, so that where the panel scrolls, the chart on top is still read
        whole (at the least height of all, a 720p dock showed every chart's data 97 px tall)."""
        super().__init__()
        self.least_data_px = least_data_px
        self.setMinimumHeight(least_data_px + FRAME_PX)   # a short panel scrolls (its dock does): data not crushed
        self.title = title
        self.legend: pg.LegendItem | None = None
        self.legend_columns = 1 if legend_beside else legend_columns
        self.legend_beside = legend_beside
        if legend:
            self.legend = pg.LegendItem(colCount=self.legend_columns, labelTextSize="9pt")
            self.addItem(self.legend, row=1 if legend_beside else 0, col=1 if legend_beside else 0)
        self.plot: pg.PlotItem = self.add_plot(1, 0, title or None)
        self._title_wanted: str | None = title or None     # the title shown, before ``_fit_title`` fits it
        self._title_fitted: tuple[str, int] | None = None
        self.ci.layout.setRowStretchFactor(1, 10)
        self.theme = th.current_theme(False)
        self.empty_text = pg.TextItem(anchor=(0.5, 0.5))
        self.empty_message: str | None = None
        self.point_labels: list[tuple[pg.TextItem, float, float]] = []     # (label, x, y in view coordinates)
        self.label_gap = 9.0
        self.plot.getViewBox().sigRangeChanged.connect(self.place_point_labels)
        self.plot.getViewBox().sigResized.connect(self.place_point_labels)
        self._least_timer = QTimer(self)     # a new least height, set from inside a resize, resized the chart
        self._least_timer.setSingleShot(True)    # again within it, and pyqtgraph kept the first size's range
        self._least_timer.setInterval(0)
        self._least_timer.timeout.connect(self.hold_least)
        self.plot.getViewBox().sigResized.connect(self._least_timer.start)
        # The room a title has changes with the axes' and a legend's widths as well as the chart's own.
        for part in (self.plot.getViewBox(), self.plot.getAxis("left"), self.plot.getAxis("right"), self.legend):
            if part is not None:
                part.geometryChanged.connect(self._fit_title)

    def style(self, theme: th.Theme, x: str, x_unit: str | None, y: str, y_unit: str | None) -> None:
        self.theme = theme
        self.hold_least()
        self.setBackground(theme.background)
        th.style_plot(self.plot, theme, x, x_unit, y, y_unit)
        self._title_fitted = None                          # (styling set the title at the theme's size)
        self._fit_title()
        if self.empty_message is not None:                  # what will appear, said in this theme's type
            self._write_empty_text()
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
            self.fit_legend()
        return item

    def label_point(self, text: str, x: float, y: float, marker: float = 14.0) -> pg.TextItem:
        """A name beside a point, on the side where it hides no other label or point (re-placed when the view
        moves or resizes: overlap is a question of pixels, not of data)."""
        label = pg.TextItem(text, color=self.theme.foreground)
        label.setFont(self.theme.axis_font)
        label.setPos(x, y)
        self.plot.addItem(label, ignoreBounds=True)
        self.point_labels.append((label, x, y))
        self.label_gap = marker / 2 + 2
        self.place_point_labels()
        return label

    def place_point_labels(self, *_args: object) -> None:
        labels = getattr(self, "point_labels", None)       # (also called while the widget is made)
        if not labels:
            return
        box = self.plot.getViewBox()
        points = [box.mapViewToScene(pg.Point(x, y)) for _label, x, y in labels]
        pad = labels[0][0].textItem.document().documentMargin()     # the text's box is inside its padding
        full = [(label.textItem.boundingRect().width(), label.textItem.boundingRect().height())
                for label, _x, _y in labels]
        area = box.sceneBoundingRect()
        offsets = label_offsets([(p.x(), p.y()) for p in points], [(w - 2 * pad, h - 2 * pad) for w, h in full],
                                self.label_gap, (area.left(), area.top(), area.right(), area.bottom()))
        for (label, _x, _y), (w, h), (dx, dy) in zip(labels, full, offsets):
            label.setAnchor(((pad - dx) / w, (pad - dy) / h))

    def remove(self, item: pg.GraphicsObject) -> None:
        self.plot.removeItem(item)
        if self.legend is not None:
            self.legend.removeItem(item)

    def clear_data(self) -> None:
        """Everything off the plot and out of the legend (not ``clear``: the layout widget owns that name)."""
        self.plot.clear()
        self.point_labels = []
        if self.legend is not None:
            self.legend.clear()
            self.hold_least()
        if self.empty_message is not None:               # plot.clear() took the words off too
            self.plot.addItem(self.empty_text, ignoreBounds=True)

    def set_empty(self, message: str | None) -> None:
        """Nothing to draw yet: the axes keep their names and units but show no numbers (an axis running 0…1 with
        no data reads as a measurement), and ``message`` says what will appear. None: data again."""
        if message == self.empty_message:
            return
        was_empty, self.empty_message = self.empty_message is not None, message
        for side in ("bottom", "left"):
            self.plot.getAxis(side).setStyle(showValues=message is None)
        if self.title and self.plot.titleLabel.text:         # "(measured)" over empty axes would claim data
            self.set_title_visible(True)
        if message is None:
            self.plot.removeItem(self.empty_text)
            self.plot.enableAutoRange()
            return
        self._write_empty_text()
        if not was_empty:
            self.plot.addItem(self.empty_text, ignoreBounds=True)
        self._place_empty_text()

    def _write_empty_text(self) -> None:
        self.empty_text.setHtml(f"<div style='text-align:center; color:{self.theme.foreground}'>"
                                f"{escape(self.empty_message)}</div>")
        self.empty_text.setFont(self.theme.axis_font)
        self._place_empty_text()

    def _place_empty_text(self) -> None:
        """The words in the middle of the plot, wrapped to its width (the text ignores the view's scale)."""
        if getattr(self, "empty_message", None) is None:        # (also called while the widget is made)
            return
        box = self.plot.getViewBox()
        self.empty_text.setTextWidth(max(box.width() * 0.9, 80))
        x, y = box.viewRange()
        self.empty_text.setPos((x[0] + x[1]) / 2, (y[0] + y[1]) / 2)

    def content_width(self) -> int:
        """The width its title, legend and axes need (pyqtgraph's least width for them): given less, the view
        cuts its right side off."""
        return int(self.ci.effectiveSizeHint(Qt.SizeHint.MinimumSize).width()) + 1

    def resizeEvent(self, event) -> None:  # noqa: N802 (Qt override)
        super().resizeEvent(event)
        self._place_empty_text()
        self.fit_legend()
        self._fit_title()

    def _fit_title(self) -> None:
        """The title as written where it fits the chart's width, else smaller, else shortened (its kind kept):
        pyqtgraph cuts a long title at the view's edge ("Which positions each cache holds, in most of its layers:
        in t"), and holds the chart as wide as its text."""
        wanted = getattr(self, "_title_wanted", None)       # (also called while the widget is made)
        if not wanted or getattr(self, "closed", False) or self.centralWidget is None:      # (or closed)
            return
        beside = self.legend.boundingRect().width() if self.legend_beside and self.legend is not None else 0
        axes = sum(self.plot.getAxis(side).geometry().width() for side in ("left", "right")
                   if side in self.plot.axes and self.plot.getAxis(side).isVisible())
        room = int(self.width() - beside - axes) - 2 * TITLE_MARGIN_PX      # the title spans the data, not the axes
        if room <= 0 or (wanted, room) == self._title_fitted:
            return
        self._title_fitted = (wanted, room)
        label, shown = self.plot.titleLabel, self.plot.titleLabel.text
        for text, pt in th.chart_title_candidates(wanted, self.theme.base_pt + 1):
            self.plot.setTitle(text, size=f"{pt:.1f}pt", color=self.theme.foreground)
            if label.item.boundingRect().width() <= room:
                break
        if label.text == shown:             # the same title: the layout already has it (an axis grew, say)
            return
        # The layout stays as wide as the longer title held it until it is given the view's width again: given
        # the widget's own size, never ``self.range``, which lags a resize not yet delivered (a hidden tab's) and
        # set the layout back to an older, shorter size, its bottom axis below the view.
        for layout in (self.plot.layout, self.ci.layout):
            layout.invalidate()
        self.setRange(QRectF(0, 0, self.width(), self.height()), padding=0, disableAutoPixel=False)
        self.updateMatrix()

    def fit_legend(self) -> None:
        """As many legend entries in a row as fit the chart's width, the rest on rows below: a legend wider than
        its chart is cut at the edge ("the rest of the step (measur")."""
        legend = getattr(self, "legend", None)              # (also called while the widget is made)
        if legend is None or not legend.items:
            return
        room = self.width() - 16
        for columns in range(min(self.legend_columns, len(self.legend.items)), 0, -1):
            self.legend.setColumnCount(columns)
            widths = [sample.boundingRect().width() + label.item.boundingRect().width() + 24
                      for sample, label in self.legend.items]
            rows = [widths[i:i + columns] for i in range(0, len(widths), columns)]
            if max(sum(row) for row in rows) <= room:
                break
        self.hold_least()                                    # a legend row above the data: the chart grows by it

    def set_least_data(self, pixels: int) -> None:
        self.least_data_px = pixels
        self.hold_least()

    def hold_least(self) -> None:
        """The least height the workbench gives this chart: its data area's least height and everything else the
        chart draws as measured (title, axes, a legend row; a log axis's or a wrapped legend's extra), so the data
        keep their height whatever the frame. A lecture scene lays its charts out to fill its screen, so there
        the scene decides."""
        if getattr(self, "closed", False) or not hasattr(self, "theme"):     # (also called while it is made)
            return
        box = self.plot.getViewBox()
        # the layout's own height (more than the view's if squeezed; never less than the widget's: a layout given
        # an older, shorter size would make the frame look smaller than it is)
        laid_out = max(self.ci.geometry().height(), self.height())
        frame = laid_out - box.height() if laid_out > 0 and box.height() > 0 else FRAME_PX + (
            self.legend.layout.preferredHeight() if self.legend is not None and not self.legend_beside else 0)
        least = 0 if self.theme.lecture else int(self.least_data_px + frame + 0.5)
        if abs(self.minimumHeight() - least) > 1:
            self.setMinimumHeight(least)

    def shows_data(self) -> bool:
        """Whether anything on the plot is data (what decides that its axes may print numbers)."""
        return any(draws_data(item) for item in self.plot.items)

    def prune_legend(self) -> None:
        """Take out of the legend every series that has no data: "(measured)" never labels an empty line."""
        if self.legend is None:
            return
        for sample, _label in list(self.legend.items):
            if not has_data(sample.item):
                self.legend.removeItem(sample.item)

    def set_title_visible(self, visible: bool) -> None:
        """A lecture scene states the claim in its caption; its charts drop their titles for the room it takes.
        An empty chart's title leaves out "(measured)": there is nothing measured under it yet."""
        if not (visible and self.title):
            self.plot.titleLabel.setText("")       # a hidden title still holds the layout as wide as its text
        self.plot.setTitle(self.title if visible and self.title else None)
        self._title_wanted, self._title_fitted = None, None
        if visible and self.title:
            title = self.title.replace(" (measured)", "") if self.empty_message is not None else self.title
            self.plot.setTitle(title, size=f"{self.theme.base_pt + 1:.0f}pt", color=self.theme.foreground)
            self._title_wanted = title
            self._fit_title()

    def legend_names(self) -> list[str]:
        return [label.text for _sample, label in self.legend.items] if self.legend is not None else []


def label_offsets(points: list[tuple[float, float]], sizes: list[tuple[float, float]], gap: float,
                  bounds: tuple[float, float, float, float] | None = None) -> list[tuple[float, float]]:
    """For each point (in pixels, y down) where its label's box goes (its top-left corner from the point): of
    right, left, above, below and the four corners, the first side whose box overlaps no label placed before
    it, no point (a marker ``gap`` around it) and stays inside ``bounds`` (left, top, right, bottom); where every
    side fails, the side that fails least."""
    def box(point: tuple[float, float], size: tuple[float, float], side: int) -> tuple[float, float, float, float]:
        (x, y), (w, h) = point, size
        left, middle, right = (x - gap - w, x + gap), (x - w / 2, x + w / 2), (x + gap, x + gap + w)
        above, level, below = (y - gap - h, y - gap), (y - h / 2, y + h / 2), (y + gap, y + gap + h)
        (x0, x1), (y0, y1) = [(right, level), (left, level), (middle, above), (middle, below),
                              (right, above), (right, below), (left, above), (left, below)][side]
        return x0, y0, x1, y1

    def overlap(a: tuple[float, ...], b: tuple[float, ...]) -> float:
        return max(0.0, min(a[2], b[2]) - max(a[0], b[0])) * max(0.0, min(a[3], b[3]) - max(a[1], b[1]))

    markers = [(x - gap, y - gap, x + gap, y + gap) for x, y in points]
    placed: list[tuple[float, float, float, float]] = []
    anchors = []
    for point, size in zip(points, sizes):
        w, h = max(size[0], 1.0), max(size[1], 1.0)
        boxes = [box(point, (w, h), side) for side in range(8)]
        costs = [sum(overlap(b, other) for other in placed + markers)
                 + (w * h - overlap(b, bounds) if bounds is not None else 0.0) for b in boxes]
        side = min(range(8), key=lambda s: (costs[s] > 0, costs[s], s))
        x0, y0, x1, y1 = boxes[side]
        if bounds is not None:                  # never cut off at the edge: shifted inside, over a point if it must
            dx = max(bounds[0] - x0, 0.0) - max(x1 - bounds[2], 0.0)
            dy = max(bounds[1] - y0, 0.0) - max(y1 - bounds[3], 0.0)
            x0, y0, x1, y1 = x0 + dx, y0 + dy, x1 + dx, y1 + dy
        placed.append((x0, y0, x1, y1))
        anchors.append((x0 - point[0], y0 - point[1]))
    return anchors


def fit_ticks(axis: pg.AxisItem, ticks: list[tuple[float, str]], most: int | None = None) -> None:
    """Explicit tick labels, every k-th one printed so that none is drawn over the next (along a horizontal axis
    their widths, along a vertical one a line and a half) whatever the chart's size, and no more than ``most``;
    chosen again as the axis resizes or its range changes."""
    axis.kv_ticks = (ticks, most)
    if not getattr(axis, "kv_fits_ticks", False):
        axis.kv_fits_ticks = True
        axis.geometryChanged.connect(lambda: _thin_ticks(axis))
        view = axis.linkedView()
        if view is not None:
            changed = view.sigYRangeChanged if axis.orientation in ("left", "right") else view.sigXRangeChanged
            changed.connect(lambda *_: _thin_ticks(axis))
    _thin_ticks(axis)


def _thin_ticks(axis: pg.AxisItem) -> None:
    ticks, most = axis.kv_ticks
    vertical = axis.orientation in ("left", "right")
    low, high = axis.range
    length = axis.geometry().height() if vertical else axis.geometry().width()
    step = max(1, math.ceil(len(ticks) / most)) if most else 1
    if len(ticks) > 1 and high > low and length > 0:
        metrics = QFontMetricsF(axis.style.get("tickFont") or QFont())
        room = (1.5 * metrics.height() if vertical
                else max(metrics.horizontalAdvance(text) for _v, text in ticks) + 10)
        spacing = min(abs(b[0] - a[0]) for a, b in zip(ticks, ticks[1:])) * length / (high - low)
        step = max(step, math.ceil(room / max(spacing, 1e-9)))
    axis.setTicks([ticks[::step], []])


def draws_data(item: object) -> bool:
    """Whether a plot item shows data: an image with pixels, or a visible series with points or bars (an axis line
    or a label is not data)."""
    if isinstance(item, pg.ImageItem):
        return item.isVisible() and item.image is not None and item.image.size > 0
    if isinstance(item, (pg.BarGraphItem, pg.PlotDataItem, pg.PlotCurveItem, pg.ScatterPlotItem)):
        return item.isVisible() and has_data(item)
    return False


def has_data(item: pg.GraphicsObject) -> bool:
    """Whether a chart item draws any point or bar (an item with no data of its kind, a line or a label, does)."""
    if isinstance(item, pg.BarGraphItem):
        arrays = [item.opts.get(k) for k in ("x0", "x", "y0", "y", "width", "height")]
        arrays = [v for v in arrays if v is not None and hasattr(v, "__len__")]     # a scalar height is no data
        return not arrays or all(len(v) > 0 for v in arrays)
    if isinstance(item, (pg.PlotDataItem, pg.PlotCurveItem, pg.ScatterPlotItem)):
        x = item.getData()[0]
        return x is not None and len(x) > 0
    return True
