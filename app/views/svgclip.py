"""Data cut to its axes before a chart is written as SVG.

On screen a plot's view box clips what lies outside its axes. An SVG keeps that only as ``clip-path``, which
many renderers ignore (Qt's own ``QSvgRenderer`` among them), and then every curve of a zoomed chart runs over
the axes, the labels and the legend. So for the export the geometry itself is cut to the view: line segments
at the edges, bars to their visible part, points and labels outside hidden, an image cropped; everything is
put back afterwards.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import QRectF
from PySide6.QtWidgets import QGraphicsRectItem, QGraphicsView, QWidget


@contextlib.contextmanager
def cut_to_axes(widget: QWidget) -> Iterator[None]:
    undo: list = []
    try:
        for plot in _plots(widget):
            box = plot.getViewBox()
            (x0, x1), (y0, y1) = box.viewRange()
            for item in list(box.addedItems):
                _cut(item, x0, x1, y0, y1, undo)
        yield
    finally:
        for restore in reversed(undo):
            restore()


def _plots(widget: QWidget) -> list[pg.PlotItem]:
    views = [widget] if isinstance(widget, QGraphicsView) else []
    views += widget.findChildren(QGraphicsView)
    plots = []
    for view in views:
        scene = view.scene()
        if scene is not None:
            plots += [item for item in scene.items() if isinstance(item, pg.PlotItem)]
    return plots


def _cut(item, x0: float, x1: float, y0: float, y1: float, undo: list) -> None:
    if not item.isVisible():
        return
    if isinstance(item, pg.PlotDataItem):
        _cut(item.curve, x0, x1, y0, y1, undo)
        _cut(item.scatter, x0, x1, y0, y1, undo)
    elif isinstance(item, pg.PlotCurveItem):
        _cut_curve(item, x0, x1, y0, y1, undo)
    elif isinstance(item, pg.ScatterPlotItem):
        x, y = item.getData()
        if len(x):
            inside = (x >= x0) & (x <= x1) & (y >= y0) & (y <= y1)
            before = item.data["visible"].copy()
            item.setPointsVisible(inside & before)
            undo.append(lambda: item.setPointsVisible(before))
    elif isinstance(item, pg.BarGraphItem):
        _cut_bars(item, x0, x1, y0, y1, undo)
    elif isinstance(item, pg.ImageItem):
        _cut_image(item, x0, x1, y0, y1, undo)
    elif isinstance(item, QGraphicsRectItem):
        rect = item.rect()
        cut = rect.intersected(QRectF(x0, y0, x1 - x0, y1 - y0))
        item.setRect(cut)
        undo.append(lambda: item.setRect(rect))
    elif isinstance(item, pg.TextItem):
        if not x0 <= item.pos().x() <= x1 or not y0 <= item.pos().y() <= y1:
            item.setVisible(False)
            undo.append(lambda: item.setVisible(True))


def _cut_curve(item: pg.PlotCurveItem, x0: float, x1: float, y0: float, y1: float, undo: list) -> None:
    x, y = item.getData()
    if x is None or len(x) < 2:
        return
    connect = item.opts.get("connect", "all")
    if connect == "pairs":
        ax, ay, bx, by = x[0::2], y[0::2], x[1::2], y[1::2]
    else:
        ax, ay, bx, by = x[:-1], y[:-1], x[1:], y[1:]
    keep, cx0, cy0, cx1, cy1 = clip_segments(ax, ay, bx, by, x0, x1, y0, y1)
    if not keep.any():                 # an empty path is written as d="", which renderers refuse
        item.setVisible(False)
        undo.append(lambda: item.setVisible(True))
        return
    seg_x = np.column_stack([cx0[keep], cx1[keep]]).ravel()
    seg_y = np.column_stack([cy0[keep], cy1[keep]]).ravel()
    original = (x.copy(), y.copy(), connect)
    item.setData(x=seg_x, y=seg_y, connect="pairs")
    undo.append(lambda: item.setData(x=original[0], y=original[1], connect=original[2]))


def clip_segments(ax, ay, bx, by, x0: float, x1: float, y0: float, y1: float):
    """Liang-Barsky on every segment at once: which survive, and their clipped end points."""
    dx, dy = bx - ax, by - ay
    t0, t1 = np.zeros(len(ax)), np.ones(len(ax))
    keep = np.isfinite(ax) & np.isfinite(ay) & np.isfinite(bx) & np.isfinite(by)
    with np.errstate(divide="ignore", invalid="ignore"):
        for p, q in ((-dx, ax - x0), (dx, x1 - ax), (-dy, ay - y0), (dy, y1 - ay)):
            parallel = p == 0
            keep &= ~(parallel & (q < 0))
            r = np.where(parallel, 0.0, q / np.where(parallel, 1.0, p))
            entering, leaving = (p < 0) & ~parallel, (p > 0) & ~parallel
            t0 = np.where(entering, np.maximum(t0, r), t0)
            t1 = np.where(leaving, np.minimum(t1, r), t1)
    keep &= t0 <= t1
    return keep, ax + t0 * dx, ay + t0 * dy, ax + t1 * dx, ay + t1 * dy


def _cut_bars(item: pg.BarGraphItem, x0: float, x1: float, y0: float, y1: float, undo: list) -> None:
    opts = dict(item.opts)
    rects = item._getNormalizedCoords() if hasattr(item, "_getNormalizedCoords") else None
    if rects is None:
        return
    left, bottom, right, top = np.broadcast_arrays(*(np.atleast_1d(np.asarray(a, dtype=float)) for a in rects))
    left, right = np.minimum(left, right), np.maximum(left, right)
    bottom, top = np.minimum(bottom, top), np.maximum(bottom, top)
    cl, cr = np.clip(left, x0, x1), np.clip(right, x0, x1)
    cb, ct = np.clip(bottom, y0, y1), np.clip(top, y0, y1)
    shown = (cr > cl) & (ct > cb)
    item.setOpts(x=None, x0=cl[shown], x1=None, width=(cr - cl)[shown], y=None, y0=cb[shown], y1=None,
                 height=(ct - cb)[shown])
    undo.append(lambda: (item.opts.clear(), item.setOpts(**opts)))


def _cut_image(item: pg.ImageItem, x0: float, x1: float, y0: float, y1: float, undo: list) -> None:
    image = item.image
    if image is None or not image.size:
        return
    rect = item.mapRectToParent(item.boundingRect())
    rows, cols = image.shape[:2] if item.axisOrder == "row-major" else image.shape[1::-1]
    c0 = int(np.clip(np.floor((x0 - rect.left()) / rect.width() * cols), 0, cols))
    c1 = int(np.clip(np.ceil((x1 - rect.left()) / rect.width() * cols), 0, cols))
    r0 = int(np.clip(np.floor((y0 - rect.top()) / rect.height() * rows), 0, rows))
    r1 = int(np.clip(np.ceil((y1 - rect.top()) / rect.height() * rows), 0, rows))
    if (c0, c1, r0, r1) == (0, cols, 0, rows):
        return
    levels = item.getLevels()
    cropped = image[r0:r1, c0:c1] if item.axisOrder == "row-major" else image[c0:c1, r0:r1]
    cell_w, cell_h = rect.width() / cols, rect.height() / rows
    item.setImage(cropped, levels=levels, autoLevels=False)
    item.setRect(QRectF(rect.left() + c0 * cell_w, rect.top() + r0 * cell_h, (c1 - c0) * cell_w,
                        (r1 - r0) * cell_h))
    undo.append(lambda: (item.setImage(image, levels=levels, autoLevels=False), item.setRect(rect)))
