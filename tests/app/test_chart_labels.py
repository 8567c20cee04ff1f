"""Names beside points: each on a side where it hides no other name, no point and stays inside the plot."""

from __future__ import annotations

from PySide6.QtCore import QRect

from app.views.chart import label_offsets
from tests.app.conftest import close_and_dispose, open_replayed


def boxes(points, sizes, offsets):
    return [(x + dx, y + dy, x + dx + w, y + dy + h) for (x, y), (w, h), (dx, dy) in zip(points, sizes, offsets)]


def overlaps(a, b) -> bool:
    return min(a[2], b[2]) > max(a[0], b[0]) and min(a[3], b[3]) > max(a[1], b[1])


def test_names_of_points_close_together_take_sides_that_hide_nothing():
    points = [(100.0, 100.0), (100.0, 104.0), (130.0, 100.0), (60.0, 100.0)]       # two nearly on top
    sizes = [(50.0, 16.0)] * 4
    placed = boxes(points, sizes, label_offsets(points, sizes, gap=8.0, bounds=(0, 0, 400, 300)))
    markers = [(x - 8, y - 8, x + 8, y + 8) for x, y in points]
    for i, a in enumerate(placed):
        assert not any(overlaps(a, b) for b in placed[:i] + placed[i + 1:]), (i, placed)
        assert not any(overlaps(a, m) for m in markers), (i, a)


def test_a_name_at_the_plots_edge_goes_to_the_side_inside_it():
    points, sizes = [(390.0, 150.0)], [(60.0, 16.0)]
    (x0, _y0, x1, _y1), = boxes(points, sizes, label_offsets(points, sizes, gap=8.0, bounds=(0, 0, 400, 300)))
    assert x1 <= 400 and x1 <= 390 - 8                    # to the left: the right side would leave the plot


def test_the_compression_scenes_names_do_not_cover_each_other_at_720p(qtbot, lecture_trace):
    w = open_replayed(qtbot, lecture_trace, (1280, 720))
    w.lecture.area = QRect(0, 0, 1280, 720)
    try:
        w.lecture.enter("compression")
        w.refresh(force=True)
        qtbot.wait(50)
        chart = w.experiments.views["kv-compression"].chart
        chart.place_point_labels()
        rects = [label.textItem.sceneBoundingRect() for label, _x, _y in chart.point_labels]
        assert len(rects) == 4                    # fp8, sinks, H2O and the full cache's line
        pad = chart.point_labels[0][0].textItem.document().documentMargin()
        tight = [r.adjusted(pad, pad, -pad, -pad) for r in rects]
        for i, a in enumerate(tight):
            assert not any(a.intersects(b) for b in tight[:i] + tight[i + 1:]), [t.getCoords() for t in tight]
    finally:
        close_and_dispose(w)
