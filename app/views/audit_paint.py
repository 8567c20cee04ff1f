"""What a screen paints rather than holds as widget text, read with where it lands: the marks a chart draws (bars),
its value labels, its tick labels and axis titles, its legend's markers and labels, and where a widget sits in the
scroll areas that hold it. The screen audit (``app.views.audit``) judges these readings; nothing here decides a verdict
beyond naming what collides, what is cut and what lacks a unit.

Every rectangle is in one coordinate system per check: a chart's in its graphics scene, a widget's in its window.
"""

from __future__ import annotations

import re

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import QPoint, QRect, QRectF
from PySide6.QtGui import QImage, QPainter
from PySide6.QtWidgets import QAbstractScrollArea, QTextEdit, QWidget

CROSSED, LEGEND, CUT, UNIT = "crossed", "legend", "cut", "unit"
SLACK_PX = 1.5                 # rounding between a text's box and a mark's edge is no collision

# A number that says what it counts: a unit or a counted noun after it, or a sign of what it is before it.
_NUMBER = re.compile(r"(?<![\w.#])(\d[\d,]*(?:\.\d+)?)(?![\d,.]*\w)")
_UNIT_AFTER = re.compile(
    r"\s?(%|x\b|×|B\b|KiB|MiB|GiB|TiB|bytes?\b|bits?\b|ms\b|µs\b|s\b|min\b|h\b|tok/s|tokens?\b|positions?\b|"
    r"blocks?\b|layers?\b|steps?\b|requests?\b|heads?\b|runs?\b|turns?\b|GB/s|GFLOP|TFLOP|FLOP|per\b|of\b|"
    r"k\b|M\b|nats?\b|dims?\b|slots?\b|pages?\b|prompts?\b|users?\b)")
_SIGN_BEFORE = re.compile(r"(#|×|\bstep |\blayer |\bT |\bk |\btop-k |\btop-p |\bp ?= ?|\bid |\bseed |\bx ?|/ ?|: ?1 ?:|"
                          r"\bbatch |\brun |\bturn |\brequest |\bn ?= ?|[A-Za-z]-)$")


def unitless_numbers(text: str) -> list[str]:
    """The numbers in a painted label that say neither their unit nor what they count ("1,536 (57%)")."""
    out = []
    for match in _NUMBER.finditer(text):
        before, after = text[:match.start()], text[match.end():]
        if _UNIT_AFTER.match(after) or _SIGN_BEFORE.search(before):
            continue
        out.append(match.group(1))
    return out


# --- charts ----------------------------------------------------------------------------------------------------
def bar_rects(box: pg.ViewBox) -> list[QRectF]:
    """Every bar a visible bar chart item in ``box`` draws, in scene coordinates."""
    out = []
    for item in box.addedItems:
        if not isinstance(item, pg.BarGraphItem) or not item.isVisible():
            continue
        x0, y0, x1, y1 = (np.atleast_1d(np.asarray(a, dtype=float)) for a in item._getNormalizedCoords())
        if x0.size == 0 or y0.size == 0:
            continue
        x0, y0, x1, y1 = np.broadcast_arrays(x0, y0, x1, y1)
        for a, b, c, d in zip(x0, y0, x1, y1):
            if np.isfinite([a, b, c, d]).all():
                out.append(item.mapRectToScene(QRectF(min(a, c), min(b, d), abs(c - a), abs(d - b))))
    return out


def value_labels(box: pg.ViewBox) -> list[tuple[str, QRectF]]:
    """The words drawn on a chart's data (a TextItem: a bar's value, a point's name), in scene coordinates."""
    return [(item.toPlainText().strip(), item.textItem.mapRectToScene(item.textItem.boundingRect()))
            for item in box.addedItems
            if isinstance(item, pg.TextItem) and item.isVisible() and item.toPlainText().strip()]


def tick_labels(axis: pg.AxisItem) -> list[tuple[str, QRectF]]:
    """The tick labels an axis prints, where it prints them (scene coordinates), as its own paint lays them out."""
    if not axis.isVisible() or not axis.style.get("showValues", True):
        return []
    image = QImage(1, 1, QImage.Format.Format_ARGB32)
    painter = QPainter(image)
    try:
        if axis.style.get("tickFont"):
            painter.setFont(axis.style["tickFont"])
        _axis_spec, _ticks, texts = axis.generateDrawSpecs(painter)
    finally:
        painter.end()
    return [(text, axis.mapRectToScene(rect)) for rect, _flags, text in texts if text]


def axis_titles(plot: pg.PlotItem) -> list[tuple[str, pg.AxisItem, QRectF]]:
    out = []
    for side in ("bottom", "left", "top", "right"):
        axis = plot.getAxis(side) if side in plot.axes else None
        if axis is not None and axis.isVisible() and axis.label.isVisible() and axis.label.toPlainText().strip():
            margin = axis.label.document().documentMargin()          # the text's own box, not its padding
            rect = axis.label.boundingRect().adjusted(margin, margin, -margin, -margin)
            out.append((axis.label.toPlainText().strip(), axis, axis.label.mapRectToScene(rect)))
    return out


def _overlap(a: QRectF, b: QRectF) -> bool:
    common = a.intersected(b)
    return common.width() > SLACK_PX and common.height() > SLACK_PX


def _crosses(text: QRectF, mark: QRectF) -> bool:
    """Part of ``text`` lies on ``mark`` and part off it: a label inside its bar, or clear of it, is fine."""
    return _overlap(text, mark) and not mark.adjusted(-SLACK_PX, -SLACK_PX, SLACK_PX, SLACK_PX).contains(text)


def painted_faults(plot: pg.PlotItem, visible: QRectF) -> list[tuple[str, str]]:
    """(rule, detail) for what one chart paints wrong: a value label across a bar or over tick labels, tick labels
    over each other, an axis title longer than its axis or outside the view, a legend marker beside no label,
    a painted number without its unit. ``visible``: the part of the scene its view shows."""
    box = plot.getViewBox()
    out: list[tuple[str, str]] = []
    labels = value_labels(box)
    marks = bar_rects(box)
    printed = {side: tick_labels(plot.getAxis(side)) for side in ("bottom", "left", "top", "right")
               if side in plot.axes}
    ticks = [tick for side_ticks in printed.values() for tick in side_ticks]
    for text, rect in labels:
        for mark in marks:
            if _crosses(rect, mark):
                out.append((CROSSED, f"{text[:40]!r} drawn across a bar"))
                break
        for tick, tick_rect in ticks:
            if _overlap(rect, tick_rect):
                out.append((CROSSED, f"{text[:40]!r} drawn over the tick label {tick!r}"))
                break
        for number in unitless_numbers(text):
            out.append((UNIT, f"{number!r} in {text[:60]!r} has no unit"))
    for side, side_ticks in printed.items():
        for i, (tick, rect) in enumerate(side_ticks):
            clash = next((other for other, r in side_ticks[i + 1:] if _overlap(rect, r)), None)
            if clash is not None:
                out.append((CROSSED, f"{side} axis: tick labels {tick!r} and {clash!r} drawn over each other"))
                break
    for title, axis, rect in axis_titles(plot):
        length = axis.geometry().height() if axis.orientation in ("left", "right") else axis.geometry().width()
        along = rect.height() if axis.orientation in ("left", "right") else rect.width()
        if along > length + SLACK_PX or not visible.adjusted(-SLACK_PX, -SLACK_PX, SLACK_PX, SLACK_PX).contains(rect):
            out.append((CUT, f"axis title {title!r} needs {along:.0f} px, its axis has {length:.0f} px in view"))
    title = plot.titleLabel
    if title.isVisible() and title.text:
        rect = title.item.mapRectToScene(title.item.boundingRect())
        if not visible.adjusted(-SLACK_PX, -SLACK_PX, SLACK_PX, SLACK_PX).contains(rect):
            out.append((CUT, f"the chart's title {re.sub(r'<[^>]+>', '', title.text)[:60]!r} is cut by its view"))
    legend = plot.legend
    for sample, label in (legend.items if legend is not None and legend.isVisible() else []):
        if not sample.isVisible() or not label.isVisible():
            continue
        mark, words = sample.sceneBoundingRect(), label.sceneBoundingRect()
        if abs(mark.center().y() - words.center().y()) > max(3.0, words.height() / 3):
            out.append((LEGEND, f"the legend's marker for {label.text[:40]!r} sits "
                                f"{mark.center().y() - words.center().y():+.0f} px off its label"))
        for number in unitless_numbers(label.text):
            out.append((UNIT, f"{number!r} in the legend's {label.text[:60]!r} has no unit"))
    return out


# --- widgets in their scroll areas -----------------------------------------------------------------------------
def seen_rect(widget: QWidget) -> QRect:
    """The part of ``widget`` a user sees: cut by every scroll area that holds it and by its window (window
    coordinates)."""
    window = widget.window()
    rect = QRect(widget.mapTo(window, QPoint(0, 0)), widget.size())
    parent = widget.parentWidget()
    while parent is not None and parent is not window:
        if isinstance(parent, QAbstractScrollArea):
            port = parent.viewport()
            rect = rect.intersected(QRect(port.mapTo(window, QPoint(0, 0)), port.size()))
        parent = parent.parentWidget()
    return rect.intersected(window.rect())


def fully_seen(widget: QWidget) -> bool:
    return widget.isVisible() and seen_rect(widget).size() == widget.size()


def lines_shown(box: QTextEdit) -> float:
    """How many lines of its font a text box's visible part holds."""
    height = min(seen_rect(box.viewport()).height(), box.viewport().height())
    return max(height - 2 * box.document().documentMargin(), 0) / max(box.fontMetrics().lineSpacing(), 1)


def scrolled_boxes(root: QWidget) -> list[str]:
    """The scroll areas under ``root`` that show a scroll bar, or a text box whose text runs past its bottom: in a
    lecture scene everything a slide says is on it, whole."""
    out = []
    for area in root.findChildren(QAbstractScrollArea):
        if not area.isVisible() or area.width() <= 1 or isinstance(area, pg.GraphicsView):
            continue
        for bar, which in ((area.verticalScrollBar(), "vertical"), (area.horizontalScrollBar(), "horizontal")):
            if bar.isVisible() and bar.maximum() > bar.minimum():
                out.append(f"{_name(area)} shows a {which} scroll bar")
        if isinstance(area, QTextEdit) and area.toPlainText().strip():
            height = area.document().size().height()
            bar = area.verticalScrollBar()
            if height > area.viewport().height() + 1 and not bar.isVisible() and bar.value() < bar.maximum():
                out.append(f"{_name(area)}: its text is {height:.0f} px high in {area.viewport().height()} px, "
                           "the last line cut")       # (one that shows its newest lines shows its last line whole)
    return out


def _name(widget: QWidget) -> str:
    text = widget.toPlainText() if isinstance(widget, QTextEdit) else ""
    return f"the text box {text.strip()[:40]!r}" if text.strip() else f"a {type(widget).__name__}"
