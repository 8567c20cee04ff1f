"""Colours and fonts: one colour per idea, the same in every panel (Okabe-Ito, colour-blind safe), light and
dark following the platform, and lecture mode (large type, high contrast) overriding both."""

from __future__ import annotations

import re
from dataclasses import dataclass

import pyqtgraph as pg
from PySide6.QtCore import Qt
from PySide6.QtGui import QColor, QFont, QGuiApplication, QPalette
from PySide6.QtWidgets import QApplication

PREFILL = "#0072B2"      # blue
REUSED = "#56B4E9"       # sky blue: prefilled in an earlier turn, taken over from the cache
DECODE = "#D55E00"       # vermillion
CACHE_OFF = "#CC79A7"    # reddish purple
FORMULA = "#888888"      # grey: computed, not measured
CHOSEN = "#009E73"       # bluish green: the sampled token
WAITING = "#BBBBBB"      # light grey: time spent waiting (queued, paused), not computing
KV_BARS = "#4D4D4D"      # K solid, V hatched in the same dark grey: a pair, neither a phase nor a run
HEATMAP = "viridis"
LECTURE_PT = 15.0        # 20 px at 96 dpi on a 720-pixel-high screen: the smallest lecture text (ticks)
LECTURE_HEIGHT = 720     # the screen height LECTURE_PT is for; type scales with the height, so 1080p reads like 720p
LECTURE_TICK_DENSITY = 0.3   # at most about six labelled ticks per axis, whatever the screen


def run_colour(kv_cache: bool) -> str:
    return DECODE if kv_cache else CACHE_OFF


def run_pen(colour: str, width: float, dashed: bool):
    """A run's line: its own colour, dashed when its KV cache was off."""
    return pg.mkPen(colour, width=width, style=Qt.PenStyle.DashLine if dashed else Qt.PenStyle.SolidLine)


@dataclass(frozen=True)
class Theme:
    name: str
    dark: bool
    background: str
    foreground: str
    base_pt: float
    line_width: float

    @property
    def lecture(self) -> bool:
        return self.name == "lecture"

    @property
    def axis_font(self) -> QFont:
        font = QFont()
        font.setPointSizeF(self.base_pt)
        return font


def platform_is_dark() -> bool:
    hints = QGuiApplication.styleHints()
    scheme = getattr(hints, "colorScheme", None)
    if scheme is not None:
        return scheme() == Qt.ColorScheme.Dark
    return QGuiApplication.palette().color(QPalette.ColorRole.Window).lightness() < 128


def current_theme(lecture: bool, height: int = LECTURE_HEIGHT) -> Theme:
    """The workbench follows the platform; lecture mode's type and lines scale with the screen's ``height`` in
    pixels, so every text keeps its share of the screen from the back of a room (at most 3x; at least half: a
    360p render is the 720p screen at half size)."""
    if lecture:
        scale = min(max(height / LECTURE_HEIGHT, 0.5), 3.0)
        return Theme("lecture", False, "#FFFFFF", "#000000", round(LECTURE_PT * scale, 1), round(4.0 * scale, 1))
    if platform_is_dark():
        return Theme("dark", True, "#1E1E1E", "#DDDDDD", 9.5, 1.5)
    return Theme("light", False, "#FFFFFF", "#222222", 9.5, 1.5)


def apply(app: QApplication, theme: Theme) -> None:
    """Qt font/palette and pyqtgraph defaults. Plots created earlier are restyled by their panels."""
    pg.setConfigOptions(background=theme.background, foreground=theme.foreground, antialias=False,
                        imageAxisOrder="row-major")
    font = app.font()
    platform_pt = app.property("kvscope_platform_pt")
    if platform_pt is None:                   # the platform's size, before lecture mode ever changed it
        platform_pt = font.pointSizeF()
        app.setProperty("kvscope_platform_pt", platform_pt)
    font.setPointSizeF(theme.base_pt if theme.name == "lecture" else float(platform_pt))
    app.setFont(font)
    if theme.name == "lecture":
        pal = QPalette()
        pal.setColor(QPalette.ColorRole.Window, QColor("#FFFFFF"))
        pal.setColor(QPalette.ColorRole.WindowText, QColor("#000000"))
        pal.setColor(QPalette.ColorRole.Base, QColor("#FFFFFF"))
        pal.setColor(QPalette.ColorRole.Text, QColor("#000000"))
        pal.setColor(QPalette.ColorRole.Button, QColor("#F0F0F0"))
        pal.setColor(QPalette.ColorRole.ButtonText, QColor("#000000"))
        for role in (QPalette.ColorRole.ButtonText, QPalette.ColorRole.Text, QPalette.ColorRole.WindowText):
            pal.setColor(QPalette.ColorGroup.Disabled, role, QColor("#8A8A8A"))   # disabled must look disabled
        app.setPalette(pal)
    else:
        app.setPalette(app.style().standardPalette())


def style_plot(plot: pg.PlotItem, theme: Theme, x: str, x_unit: str | None, y: str, y_unit: str | None) -> None:
    """Axis labels with units, in the theme's font size. Every chart goes through here."""
    for side, label, unit in (("bottom", x, x_unit), ("left", y, y_unit)):
        axis = plot.getAxis(side)
        label_axis(axis, label, unit, theme)
        if unit == "ms":
            follow_time_range(plot, side, label, theme)
        axis.setTickFont(theme.axis_font)
        axis.setPen(theme.foreground)
        axis.setTextPen(theme.foreground)
        style_ticks(axis, theme)
    plot.showGrid(x=False, y=False)
    if plot.titleLabel.text:
        plot.setTitle(plot.titleLabel.text, size=f"{theme.base_pt + 1:.0f}pt", color=theme.foreground)


def style_ticks(axis: pg.AxisItem, theme: Theme) -> None:
    """Lecture mode labels only major ticks, few of them: a tick label the back row cannot read is noise."""
    axis.setTickDensity(LECTURE_TICK_DENSITY if theme.lecture else 1.0)
    axis.setStyle(maxTickLevel=0 if theme.lecture else 1, hideOverlappingLabels=True,
                  tickTextOffset=8 if theme.lecture else 5)


SECONDS_ABOVE_MS = 10_000.0


def follow_time_range(plot: pg.PlotItem, side: str, label: str, theme: Theme) -> None:
    """A time axis in milliseconds reads in seconds once its range passes 10 s ("150" s, not "150000" ms):
    the data stay in ms, the axis scales its labels and says which unit it shows."""
    axis = plot.getAxis(side)
    axis.time_label = (label, theme)                  # what the last styling asked for (theme changes restyle)
    axis.in_seconds = False
    axis.setScale(1.0)
    if getattr(axis, "follows_time", False):
        return
    axis.follows_time = True
    box = plot.getViewBox()

    def changed(_box: object, span: tuple[float, float]) -> None:
        seconds = max(abs(span[0]), abs(span[1])) > SECONDS_ABOVE_MS
        if seconds != axis.in_seconds:
            axis.in_seconds = seconds
            axis.setScale(0.001 if seconds else 1.0)
            label_axis(axis, axis.time_label[0], "s" if seconds else "ms", axis.time_label[1])

    (box.sigXRangeChanged if side == "bottom" else box.sigYRangeChanged).connect(changed)


def label_axis(axis: pg.AxisItem, label: str, unit: str | None, theme: Theme) -> None:
    """Quantity and unit, with plain numbers: memory is in binary units and counts are counts, never
    "ktokens". The title fits its axis whatever the chart's size (``fit_title``)."""
    axis.kv_title = (label, unit, theme.base_pt)
    axis.kv_title_room = None                   # the axis length the title was last fitted to
    if not getattr(axis, "kv_fits_title", False):
        axis.kv_fits_title = True
        axis.geometryChanged.connect(lambda: fit_title(axis))
    fit_title(axis)


TITLE_SHRINK = 0.85            # a title too long for its axis is first set this much smaller,
TITLE_SHRINK_MOST = 0.75       # then smaller still, then shortened from its end


def title_candidates(label: str, unit: str | None, pt: float) -> list[tuple[str, float]]:
    """The title as written, smaller, then shortened word by word from its end (the unit always kept): a title is
    never cut by its chart's edge ("rated (tokens)" was "tokens generated (tokens)" on a short axis)."""
    out = [(label, pt), (label, pt * TITLE_SHRINK), (label, pt * TITLE_SHRINK_MOST)]
    words = label.split()
    for keep in range(len(words) - 1, 0, -1):
        out.append((" ".join(words[:keep]).rstrip(",:;") + "…", pt * TITLE_SHRINK_MOST))
    return out


KIND_TAG = re.compile(r"\s\((?:measured|computed|achieved)[^()]*\)$")


def chart_title_candidates(title: str, pt: float) -> list[tuple[str, float]]:
    """A chart's title as written, smaller, then shortened from the end of its words, its closing "(measured)",
    "(computed)" or "(achieved)" always kept: the title is what promises what kind of figure the chart shows."""
    tag = KIND_TAG.search(title)
    words, tail = (title[:tag.start()], tag.group(0)) if tag else (title, "")
    return [(text + tail, size) for text, size in title_candidates(words, None, pt)]


def fit_title(axis: pg.AxisItem) -> None:
    """The first of ``title_candidates`` that, drawn by the axis itself, fits the axis's length (the last if none
    does); worked out again only when the length or the title changes."""
    label, unit, pt = axis.kv_title
    vertical = axis.orientation in ("left", "right")
    room = round(axis.geometry().height() if vertical else axis.geometry().width())
    if axis.kv_title_room == room:
        return
    axis.kv_title_room = room
    candidates = title_candidates(label, unit, pt)
    for text, size in candidates if room > 0 else candidates[:1]:
        _set_title(axis, text, unit, size)
        margin = axis.label.document().documentMargin()
        if axis.label.boundingRect().width() - 2 * margin <= room:
            return


def _set_title(axis: pg.AxisItem, text: str, unit: str | None, pt: float) -> None:
    """pyqtgraph 0.14 decides SI prefixes by enable ranges (``enableAutoSIPrefix(False)`` alone no longer stops
    it) and ``setLabel`` resets them, so both happen here, in this order."""
    axis.setLabel(text, units=unit, **{"font-size": f"{pt:.1f}pt"})
    axis.enableAutoSIPrefix(False)
    if hasattr(axis, "setSIPrefixEnableRanges"):
        axis.setSIPrefixEnableRanges(((0.0, 0.0),))
        axis.updateAutoSIPrefix()
    axis.resizeEvent()          # pyqtgraph centres a title only on a resize: a new one kept the old one's place
