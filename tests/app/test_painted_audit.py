"""The screen audit reads what is painted: each rule shown catching a planted defect, and passing the same chart
drawn right."""

from __future__ import annotations

import pyqtgraph as pg
import pytest
from PySide6.QtWidgets import QTextEdit, QVBoxLayout, QWidget

from app.state.phase import RunPhase, figures, run_phase
from app.views import audit
from app.views.audit_paint import CROSSED, CUT, LEGEND, UNIT, painted_faults, scrolled_boxes, unitless_numbers


def chart(qtbot, size=(400, 300)) -> tuple[pg.PlotWidget, pg.PlotItem]:
    widget = pg.PlotWidget()
    widget.resize(*size)
    qtbot.addWidget(widget)
    widget.show()
    plot = widget.getPlotItem()
    plot.addItem(pg.BarGraphItem(x0=[0.0], y=[1.0], height=0.6, width=[10.0], brush="b"))
    plot.setXRange(0, 20, padding=0)
    plot.setYRange(0, 2, padding=0)
    return widget, plot


def faults(qtbot, widget: pg.PlotWidget, plot: pg.PlotItem) -> list[tuple[str, str]]:
    qtbot.wait(50)
    visible = widget.mapToScene(widget.viewport().rect()).boundingRect()
    return painted_faults(plot, visible)


def label(plot: pg.PlotItem, text: str, x: float, y: float, anchor=(0, 0.5)) -> pg.TextItem:
    item = pg.TextItem(text, anchor=anchor)
    plot.addItem(item)
    item.setPos(x, y)
    return item


def test_a_value_label_across_its_bars_end_is_found_and_one_beside_it_is_not(qtbot):
    widget, plot = chart(qtbot)
    across = label(plot, "128 KiB", 9.0, 1.0)                # starts inside the bar, ends outside it
    assert (CROSSED, "'128 KiB' drawn across a bar") in faults(qtbot, widget, plot)
    across.setPos(10.3, 1.0)                                   # just past the bar's end
    assert not [f for f in faults(qtbot, widget, plot) if f[0] == CROSSED]


def test_a_value_label_below_its_bar_and_across_it_is_found(qtbot):
    widget, plot = chart(qtbot)
    label(plot, "45.0 MiB", 2.0, 0.72, anchor=(0, 0))           # its top half on the bar's lower edge
    assert any(rule == CROSSED and "45.0 MiB" in detail for rule, detail in faults(qtbot, widget, plot))


def test_a_value_label_over_the_tick_labels_is_found(qtbot):
    widget, plot = chart(qtbot)
    plot.setYRange(0.3, 2, padding=0)
    label(plot, "45.0 MiB", 12.0, 0.3, anchor=(0, 0))          # hangs below the data area, over the bottom ticks
    plot.getViewBox().setFlag(plot.getViewBox().GraphicsItemFlag.ItemClipsChildrenToShape, False)
    assert any(rule == CROSSED and "tick label" in detail for rule, detail in faults(qtbot, widget, plot))


def test_tick_labels_printed_over_each_other_are_found(qtbot):
    widget, plot = chart(qtbot, size=(400, 120))
    plot.getAxis("left").setTicks([[(i / 15, str(i)) for i in range(30)]])
    assert any(rule == CROSSED and "tick labels" in detail for rule, detail in faults(qtbot, widget, plot))
    plot.getAxis("left").setTicks([[(0.0, "0"), (1.0, "1"), (2.0, "2")]])
    assert not [f for f in faults(qtbot, widget, plot) if "tick labels" in f[1]]


def test_an_axis_title_longer_than_its_axis_is_found(qtbot):
    widget, plot = chart(qtbot, size=(400, 110))
    plot.setLabel("left", "tokens generated so far in this run", units=None)
    assert any(rule == CUT and "tokens generated" in detail for rule, detail in faults(qtbot, widget, plot))
    plot.setLabel("left", "tokens")
    found = [f for f in faults(qtbot, widget, plot) if f[0] == CUT]
    assert found                   # pyqtgraph left the new title where the long one began: below the view
    plot.getAxis("left").resizeEvent()                  # what app.theme.label_axis does after every new title
    assert not [f for f in faults(qtbot, widget, plot) if f[0] == CUT]


def test_a_title_set_through_the_theme_is_centred_on_its_axis(qtbot):
    from app.views import theme as th

    widget, plot = chart(qtbot, size=(400, 110))
    axis = plot.getAxis("left")
    th.label_axis(axis, "tokens generated so far in this run", None, th.current_theme(False))
    qtbot.wait(20)
    th.label_axis(axis, "tokens", None, th.current_theme(False))
    assert not [f for f in faults(qtbot, widget, plot) if f[0] == CUT]


def test_a_legend_marker_below_its_label_is_found(qtbot):
    widget, plot = chart(qtbot)
    legend = plot.addLegend()
    plot.plot([0, 1], [0, 1], name="decode 21 steps")
    qtbot.wait(50)
    assert not [f for f in faults(qtbot, widget, plot) if f[0] == LEGEND]
    sample, _label = legend.items[0]
    sample.setPos(sample.pos().x(), sample.pos().y() + 14)        # planted: the marker a line lower
    assert any(rule == LEGEND and "decode 21 steps" in detail for rule, detail in faults(qtbot, widget, plot))


def test_a_painted_number_without_its_unit_is_found(qtbot):
    widget, plot = chart(qtbot)
    label(plot, "1,536 (57%)", 10.5, 1.0)
    assert (UNIT, "'1,536' in '1,536 (57%)' has no unit") in faults(qtbot, widget, plot)


@pytest.mark.parametrize("text, unitless", [
    ("1,536 (57%)", ["1,536"]), ("1,536 tokens (57%)", []), ("pool (34)", ["34"]), ("pool (34 blocks)", []),
    ("128 KiB", []), ("2.5x", []), ("#3 greedy", []), ("step 12", []), ("2,047 of 8,192", ["8,192"]),
    ("2,047 of 8,192 positions", []), ("45.0 MiB", []), ("p = 0.91", []), ("T 1.50", []), ("Q4_K", []),
    ("×4", [])])
def test_unitless_numbers_are_the_ones_that_say_neither_unit_nor_what_they_count(text, unitless):
    assert unitless_numbers(text) == unitless


def test_a_text_box_with_its_last_line_cut_or_a_scroll_bar_is_found_and_one_that_fits_is_not(qtbot):
    holder = QWidget()
    box = QTextEdit()
    box.setReadOnly(True)
    QVBoxLayout(holder).addWidget(box)
    qtbot.addWidget(holder)
    box.setFixedHeight(60)
    holder.show()
    box.setPlainText("\n".join(f"line {i}" for i in range(12)))
    qtbot.wait(50)
    assert any("vertical scroll bar" in text for text in scrolled_boxes(holder))
    box.setVerticalScrollBarPolicy(box.verticalScrollBarPolicy().ScrollBarAlwaysOff)
    qtbot.wait(50)
    assert any("the last line cut" in text for text in scrolled_boxes(holder))
    box.setPlainText("line 0")
    qtbot.wait(50)
    assert scrolled_boxes(holder) == []


def test_the_rules_turn_painted_faults_into_findings_only_where_they_apply():
    chart_reading = audit.ChartReading("KV bytes", True, (), (), (), painted=((UNIT, "'34' has no unit"),),
                                       area=(300, 200), seen=True)
    reading = audit.Reading("scene", audit.RUN, None, (), (chart_reading,), (), (),
                            scrolls=("the text box 'Measured' shows a vertical scroll bar",))
    known = audit.Known(run_phase(None), figures(None))
    findings = audit.judge([reading], known)
    assert [f.rule for f in findings] == [UNIT]                    # the workbench: a scroll bar is fine
    in_scene = audit.judge([reading], audit.Known(run_phase(None), figures(None), scene="kv"))
    assert sorted(f.rule for f in in_scene) == ["scroll bar", UNIT]
    assert isinstance(known.phase, RunPhase)


def test_a_title_too_long_for_its_axis_is_set_smaller_then_shortened_never_cut(qtbot):
    from app.views import theme as th

    widget, plot = chart(qtbot, size=(400, 300))
    axis = plot.getAxis("left")
    th.label_axis(axis, "tokens generated so far in this run", "tokens", th.current_theme(False))
    qtbot.wait(20)
    assert axis.labelText == "tokens generated so far in this run"            # room for all of it
    widget.resize(400, 110)
    qtbot.wait(50)
    assert not [f for f in faults(qtbot, widget, plot) if f[0] == CUT]
    assert axis.labelText.endswith("…") and axis.labelUnits == "tokens"       # shortened, its unit kept
    widget.resize(400, 300)
    qtbot.wait(50)
    assert axis.labelText == "tokens generated so far in this run"            # and whole again with room


def test_a_chart_title_wider_than_its_view_is_found(qtbot):
    widget, plot = chart(qtbot, size=(300, 200))
    plot.setTitle("Which positions each cache holds, in most of its layers: in full, quantized, dropped")
    assert any(rule == CUT and "chart's title" in detail for rule, detail in faults(qtbot, widget, plot))
    widget, plot = chart(qtbot, size=(300, 200))
    plot.setTitle("Which positions")
    assert not [f for f in faults(qtbot, widget, plot) if f[0] == CUT]


def test_a_chart_title_too_wide_is_set_smaller_then_shortened_its_kind_kept_and_whole_again_with_room(qtbot):
    from app.views.chart import Chart

    title = "Which positions each cache holds, in most of its layers: in full, quantized (measured)"
    widget = Chart(title, legend=False)
    qtbot.addWidget(widget)
    widget.resize(1100, 300)
    widget.show()
    qtbot.wait(50)
    shown = lambda: audit.plain(widget.plot.titleLabel.text)     # noqa: E731
    assert shown() == title
    widget.resize(320, 300)
    qtbot.wait(50)
    assert shown().endswith("… (measured)") and len(shown()) < len(title)
    visible = widget.mapToScene(widget.viewport().rect()).boundingRect()
    assert not [f for f in painted_faults(widget.plot, visible) if f[0] == CUT]
    widget.resize(1100, 300)
    qtbot.wait(50)
    assert shown() == title
