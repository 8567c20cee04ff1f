"""The screen audit: what every view shows right now, read from its widgets as a user sees them, and the rules a
screen keeps whatever phase the run or the experiment is in.

A view joins the audit by being registered (``ScreenAudit.register``: the window registers its panels, the status
strip and the scene; every lesson's view is registered from the lesson registry), never by test code of its own.
A reading walks the view's visible widgets: every label, button, progress bar and read-only text, and every chart
(whether it draws data, whether its axes or colour bar print numbers, the words drawn on it); a label or a chart's
words that do not fit their room are *clipped*. The rules (``RULES``) judge the readings against what is known
(``Known``: the selected run's phase and figures from ``app.state.phase``, the experiments' phases, what the engine is
busy with, whether a setting differs from the run shown):

- ``before``: no TTFT, rate or KV figure of the run before it exists;
- ``measured``: "measured" only in a sentence that carries a number, and on a chart only while it draws data;
- ``one value``: one figure (TTFT, the prefill's time, the KV bytes, the context window) has one value on a screen;
- ``empty chart``: a chart without data prints no numbers;
- ``paused``: a paused or single-stepped run says so in every view of the run, and the Pause control says Resume;
- ``next run``: a control whose value differs from the run shown is marked "next run";
- ``ended``: an ended run is never described as still running;
- ``busy``: nothing invites "press R" while the engine is busy with something else;
- ``clipped``: nothing is cut off;
- ``painted`` (``app.views.audit_paint`` reads it): no value label across a bar or over tick labels, no tick labels over
  each other, no axis title longer than its axis, a legend's marker beside its label, a unit on every painted number;
- ``scroll bar``: a lecture scene shows no scroll bar and no text box with its last line cut;
- ``fits``: the workbench shows, unscrolled, each view's essentials (the prompt, Run, Stop, Step, Pause, five lines
  of the token stream) and one chart at a readable size;
- ``blank``: a blanked lecture screen shows nothing through it.

Plain reading: no torch, no engine calls; the tests drive the window (``tests/app/screen_audit.py``).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import pyqtgraph as pg
from PySide6.QtCore import QRect, QSize, Qt
from PySide6.QtGui import QTextDocumentFragment
from PySide6.QtWidgets import (
    QAbstractButton,
    QAbstractSpinBox,
    QComboBox,
    QGroupBox,
    QLabel,
    QPlainTextEdit,
    QProgressBar,
    QTextEdit,
    QWidget,
)

from app.state.phase import ENDED, PAUSED, STEPPING, ExperimentPhase, RunFigures, RunPhase
from app.views import audit_paint as paint
from app.views.chart import draws_data

RUN, EXPERIMENT, SETTINGS, OTHER = "run", "experiment", "settings", "other"
SQUEEZED_PX = 60             # a chart's data area smaller than this shows nothing readable


@dataclass(frozen=True)
class ChartReading:
    name: str
    has_data: bool
    numbers: tuple[str, ...]          # where it prints numbers: "bottom axis", "colour bar", ...
    words: tuple[str, ...]            # text drawn on it: its title, what will appear, labels, the legend
    clipped: tuple[str, ...]
    painted: tuple[tuple[str, str], ...] = ()     # (rule, detail): what it paints across, cut or without a unit
    area: tuple[int, int] = (0, 0)                # its data area, in pixels
    seen: bool = False                            # its data area whole on screen (not scrolled out or cut)


@dataclass(frozen=True)
class Reading:
    view: str
    about: str
    lesson: str | None
    texts: tuple[str, ...]
    charts: tuple[ChartReading, ...]
    controls: tuple[tuple[str, bool], ...]        # (text, enabled)
    clipped: tuple[str, ...]
    inside: str | None = None                     # another view it is shown within (a panel a scene borrowed)
    scrolls: tuple[str, ...] = ()                 # scroll bars shown, text boxes whose last line is cut
    unseen: tuple[str, ...] = ()                  # what the view must show whole and does not (scrolled out, cut)

    @property
    def words(self) -> list[str]:
        """Every piece of text the view shows, the charts' included."""
        return [*self.texts, *(w for c in self.charts for w in c.words), *(t for t, _ in self.controls)]


@dataclass(frozen=True)
class AuditedView:
    name: str
    widget: Callable[[], QWidget | None]
    about: str | Callable[[], str]          # what its words describe (RUN, EXPERIMENT, ...), or who says now
    lesson: str | None = None
    texts: Callable[[], list[str]] | None = None     # words not held by a widget (a status bar's message)
    essentials: Callable[[], list[tuple[str, QWidget, int]]] | None = None   # (name, widget, lines) it must show


@dataclass(frozen=True)
class Known:
    """What is known when the screen is read: the selected run's phase and figures, each lesson's experiment
    phase, what the engine is busy with, the settings the controls hold that differ from the run shown, and the
    scene on screen (None: the workbench)."""

    phase: RunPhase
    figures: RunFigures
    experiments: dict[str, ExperimentPhase] = field(default_factory=dict)
    busy: str | None = None
    pending: tuple[str, ...] = ()
    scene: str | None = None
    lesson: str | None = None           # the lesson the scene on screen is about
    blank: bool = False                 # the lecture's screen is blanked (B)


@dataclass(frozen=True)
class Finding:
    view: str
    rule: str
    detail: str


class ScreenAudit:
    """The registry of audited views."""

    def __init__(self) -> None:
        self.views: dict[str, AuditedView] = {}

    def register(self, name: str, widget: QWidget | Callable[[], QWidget | None],
                 about: str | Callable[[], str] = OTHER, lesson: str | None = None,
                 texts: Callable[[], list[str]] | None = None,
                 essentials: Callable[[], list[tuple[str, QWidget, int]]] | None = None) -> None:
        getter = widget if callable(widget) and not isinstance(widget, QWidget) else (lambda w=widget: w)
        self.views[name] = AuditedView(name, getter, about, lesson, texts, essentials)

    def read(self) -> list[Reading]:
        """Every registered view that is on screen now."""
        shown = {}
        for view in self.views.values():
            widget = view.widget()
            if widget is not None and on_screen(widget):
                shown[view.name] = (view, widget)
        out = []
        for name, (view, widget) in shown.items():
            inside = next((other for other, (_v, holder) in shown.items()
                           if holder is not widget and holder.isAncestorOf(widget)), None)
            out.append(dataclasses.replace(read_view(view, widget), inside=inside))
        return out


# --- reading ---------------------------------------------------------------------------------------------------
def on_screen(widget: QWidget) -> bool:
    """Shown and inside its window: a dock tabbed behind another is "visible" to Qt but parked off the window."""
    if not widget.isVisible() or widget.width() <= 1 or widget.height() <= 1:
        return False
    window = widget.window()
    corner = widget.mapTo(window, widget.rect().topLeft())
    return window.rect().intersects(widget.rect().translated(corner))



def plain(text: str, rich: bool = True) -> str:
    """A label's text as the user reads it (rich text rendered to plain words)."""
    if rich and "<" in text:
        return QTextDocumentFragment.fromHtml(text).toPlainText()
    return text


def read_view(view: AuditedView, root: QWidget) -> Reading:
    about = view.about() if callable(view.about) else view.about
    if view.texts is not None:
        return Reading(view.name, about, view.lesson, tuple(t for t in view.texts() if t), (), (), ())
    texts: list[str] = []
    controls: list[tuple[str, bool]] = []
    charts: list[ChartReading] = []
    clipped: list[str] = []
    for widget in _visible(root):
        if isinstance(widget, pg.GraphicsView):
            charts.extend(read_charts(widget))
        elif isinstance(widget, QLabel):
            text = plain(widget.text(), widget.textFormat() != Qt.TextFormat.PlainText).strip()
            if text:
                texts.append(text)
                if _label_clipped(widget):
                    clipped.append(text[:80])
        elif isinstance(widget, QAbstractButton):
            if widget.text():
                controls.append((widget.text(), widget.isEnabled()))
                if widget.sizeHint().width() > widget.width() + 2:
                    clipped.append(widget.text())
        elif isinstance(widget, QGroupBox):
            if widget.title():
                texts.append(widget.title())
        elif isinstance(widget, QProgressBar):
            if widget.text():
                texts.append(widget.text())
        elif isinstance(widget, (QTextEdit, QPlainTextEdit)):
            if widget.isReadOnly():                   # what the window wrote; an input box holds the user's words
                texts.append(widget.toPlainText())
        elif isinstance(widget, QComboBox):
            controls.append((widget.currentText(), widget.isEnabled()))
        elif isinstance(widget, QAbstractSpinBox):
            controls.append((widget.text(), widget.isEnabled()))
    unseen = []
    for name, widget, lines in (view.essentials() if view.essentials is not None else []):
        if isinstance(widget, QTextEdit) and lines:
            shown = paint.lines_shown(widget)
            if shown < lines:
                unseen.append(f"{name}: {shown:.1f} lines shown, {lines} wanted")
        elif not paint.fully_seen(widget):
            seen = paint.seen_rect(widget)
            unseen.append(f"{name}: {seen.width()}x{max(seen.height(), 0)} of {widget.width()}x{widget.height()} "
                          "px on screen")
    return Reading(view.name, about, view.lesson, tuple(texts), tuple(charts), tuple(controls),
                   tuple(clipped), scrolls=tuple(paint.scrolled_boxes(root)), unseen=tuple(unseen))


def _visible(root: QWidget) -> Iterable[QWidget]:
    """The widgets under ``root`` a user sees (a child hidden, or inside a hidden parent, is not), graphics views
    read whole (their items are not widgets)."""
    stack = [root]
    while stack:
        widget = stack.pop()
        yield widget
        if isinstance(widget, pg.GraphicsView):
            continue
        for child in reversed(widget.findChildren(QWidget, options=Qt.FindChildOption.FindDirectChildrenOnly)):
            if child.isVisibleTo(root) and not child.isWindow():
                stack.append(child)


def _label_clipped(label: QLabel) -> bool:
    """The label's words need more room than it has (a wrapped one: more height; one line: more width)."""
    if not label.isVisible() or label.width() <= 1:
        return False
    if label.wordWrap():
        return label.heightForWidth(label.width()) > label.height() + 2
    return label.sizeHint().width() > label.width() + 2


def read_charts(view: pg.GraphicsView) -> list[ChartReading]:
    out = []
    items = view.scene().items() if view.scene() is not None else []
    bars = [i for i in items if isinstance(i, pg.ColorBarItem) and i.isVisible()]
    plots = [i for i in items if isinstance(i, pg.PlotItem) and not isinstance(i, pg.ColorBarItem) and i.isVisible()]
    visible = view.mapToScene(view.viewport().rect()).boundingRect()
    on_screen_px = paint.seen_rect(view.viewport())
    for plot in plots:
        reading = read_plot(plot, bars)
        area = plot.getViewBox().sceneBoundingRect()
        corner = view.mapFromScene(area.topLeft())
        where = QRect(view.viewport().mapTo(view.window(), corner), QSize(int(area.width()), int(area.height())))
        out.append(dataclasses.replace(reading, painted=tuple(paint.painted_faults(plot, visible)),
                                       area=(int(area.width()), int(area.height())),
                                       seen=on_screen_px.contains(where.adjusted(1, 1, -1, -1))))
    overlaps = overlapping_words([*plots, *bars])
    if overlaps and out:
        first = out[0]
        out[0] = dataclasses.replace(first, clipped=first.clipped + tuple(overlaps))
    return out


def _words_drawn(plot: pg.PlotItem) -> list[tuple[str, object]]:
    """The text items a plot draws outside its data (axis labels, its title) and on it (labels, what will
    appear), each with its graphics item."""
    out = []
    for side in ("bottom", "left", "top", "right"):
        axis = plot.getAxis(side) if side in plot.axes else None
        if axis is not None and axis.isVisible() and axis.label.isVisible() and axis.label.toPlainText().strip():
            out.append((axis.label.toPlainText().strip(), axis.label))
    if plot.titleLabel.isVisible() and plot.titleLabel.text:
        out.append((plain(plot.titleLabel.text), plot.titleLabel.item))
    for item in plot.getViewBox().addedItems:
        if isinstance(item, pg.TextItem) and item.isVisible() and item.toPlainText().strip():
            out.append((item.toPlainText().strip(), item.textItem))
    return out


def overlapping_words(plots: list[pg.PlotItem]) -> list[str]:
    """Pairs of words drawn over each other on one graphics view ("… (tokens)" under "KiB")."""
    drawn = [(text, item.mapRectToScene(item.boundingRect())) for plot in plots for text, item in _words_drawn(plot)]
    out = []
    for i, (text, rect) in enumerate(drawn):
        for other, other_rect in drawn[i + 1:]:
            common = rect.intersected(other_rect)
            if common.width() > 3 and common.height() > 3:
                out.append(f"{text[:40]!r} drawn over {other[:40]!r}")
    return out


def read_plot(plot: pg.PlotItem, bars: list[pg.ColorBarItem]) -> ChartReading:
    box = plot.getViewBox()
    data = [i for i in box.addedItems if i.isVisible() and draws_data(i)]
    numbers = [side + " axis" for side in ("bottom", "left") if plot.getAxis(side).isVisible()
               and plot.getAxis(side).style.get("showValues", True)]
    for bar in bars:
        images = bar.img_list if hasattr(bar, "img_list") else []
        if any(draws_data(ref()) for ref in images if ref() is not None and ref() in box.addedItems):
            continue
        if any(ref() is not None and ref() in box.addedItems for ref in images):
            axis = bar.getAxis("right")
            if axis.isVisible() and axis.style.get("showValues", True):
                numbers.append("colour bar")
    words, clipped = [], []
    area = box.sceneBoundingRect()
    if min(area.width(), area.height()) < SQUEEZED_PX:
        clipped.append(f"its data area is squeezed to {area.width():.0f}x{area.height():.0f} px")
    title = plot.titleLabel.text if plot.titleLabel.isVisible() else ""
    if title:
        words.append(plain(title))
    for item in box.addedItems:
        if isinstance(item, pg.TextItem) and item.isVisible() and item.toPlainText().strip():
            words.append(item.toPlainText().strip())
            rect = item.sceneBoundingRect()
            if not area.adjusted(-2, -2, 2, 2).contains(rect):
                clipped.append(f"{item.toPlainText().strip()[:80]} ({rect.width():.0f}x{rect.height():.0f} px in "
                               f"{area.width():.0f}x{area.height():.0f})")
        elif isinstance(item, pg.InfiniteLine) and item.isVisible() and getattr(item, "label", None) is not None:
            words.append(item.label.toPlainText())
    legend = plot.legend if plot.legend is not None else None
    for _sample, label in (legend.items if legend is not None else []):
        words.append(plain(label.text))
    name = plain(title) or plot.getAxis("left").labelText or "chart"
    return ChartReading(name, bool(data), tuple(numbers), tuple(words), tuple(clipped))


# --- the rules -------------------------------------------------------------------------------------------------
NUMBER = r"[\d][\d,]*(?:\.\d+)?"
TTFT = re.compile(rf"TTFT\D{{0,24}}?({NUMBER})\s*(ms|s)\b")
RATE = re.compile(rf"({NUMBER})\s*tok/s")
KV_BYTES = re.compile(rf"\bKV ({NUMBER}) (B|KiB|MiB|GiB)\b|\bMeasured\b[^:]*: ({NUMBER}) (B|KiB|MiB|GiB)\b|"
                      rf"\bcache (?:holds|held) ({NUMBER}) (B|KiB|MiB|GiB)\b")
CONTEXT = re.compile(rf"\bof ({NUMBER})(?: positions)?\b.*?context|context\D{{0,16}}?\bof ({NUMBER})\b|"
                     rf"({NUMBER})-position (?:context )?window")
PREFILL_ELAPSED = re.compile(rf"prefill running\D{{0,60}}?({NUMBER}) (s|ms)\b")
NEGATED = re.compile(r"\b(not|never|nothing was|nothing is|none|no figure|be|been|unmeasured|when)\b[\w\s,]{0,24}$",
                     re.IGNORECASE)
CLAUSE = re.compile(r"\s·\s|\n|(?<=[.!?])\s+(?=[A-Z])")        # an item or a sentence
STILL_RUNNING = re.compile(r"prefill running|decode starts|so far|decoding: token|running: ")
PRESS_R = re.compile(r"\bpress R\b", re.IGNORECASE)
UNITS = {"ms": 1.0, "s": 1000.0, "B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}


def _number(text: str) -> tuple[float, float]:
    """A printed number and half its last digit's place (how far off the value it stands for may be)."""
    digits = text.replace(",", "")
    places = len(digits.split(".")[1]) if "." in digits else 0
    return float(digits), 0.5 * 10 ** -places


def _run_views(readings: list[Reading]) -> list[Reading]:
    return [r for r in readings if r.about == RUN]


def before(readings: list[Reading], known: Known) -> list[Finding]:
    """No figure of the run before it exists."""
    out = []
    f = known.figures
    for r in _run_views(readings):
        for text in r.words:
            if f.ttft_ms is None and TTFT.search(text):
                out.append(Finding(r.view, "before", f"TTFT before the first token: {text[:120]!r}"))
            for match in RATE.finditer(text):
                lead = text[max(match.start() - 48, 0):match.start()]
                exists = f.prefill_tok_s if "prefill" in lead else f.decode_tok_s
                if exists is None and "computed" not in text[match.end():match.end() + 60] \
                        and "ceiling" not in lead:
                    out.append(Finding(r.view, "before", f"a rate before one was timed: {text[:120]!r}"))
            if f.kv_bytes is None and KV_BYTES.search(text):
                out.append(Finding(r.view, "before", f"KV bytes before the cache was read: {text[:120]!r}"))
    return out


def measured(readings: list[Reading], known: Known) -> list[Finding]:
    """"measured" only in a sentence that carries a number (or says the figure was not measured); on a chart, only
    while it draws data (a title "(measured)" over empty axes claims what is not there)."""
    out = []
    for r in readings:
        texts = [*r.texts, *(t for t, _ in r.controls), *(w for c in r.charts if not c.has_data for w in c.words)]
        for text in texts:
            for clause in CLAUSE.split(text):
                for match in re.finditer(r"\bmeasured\b", clause, re.IGNORECASE):
                    lead = clause[:match.start()]
                    if NEGATED.search(lead) or re.search(r"\d", clause):
                        continue
                    out.append(Finding(r.view, "measured", f"'measured' beside no figure: {clause[:120]!r}"))
    return out


def one_value(readings: list[Reading], known: Known) -> list[Finding]:
    """One figure, one value, on one screen: every view of the run that prints it prints the same number (within
    the precision each prints it with)."""
    seen: dict[str, list[tuple[float, float, str]]] = {}

    def note(kind: str, value: float, slack: float, where: str) -> None:
        seen.setdefault(kind, []).append((value, slack, where))

    for r in _run_views(readings):
        for text in r.words:
            for m in TTFT.finditer(text):
                value, slack = _number(m.group(1))
                note("TTFT", value * UNITS[m.group(2)], slack * UNITS[m.group(2)], r.view)
            for m in PREFILL_ELAPSED.finditer(text):
                value, slack = _number(m.group(1))
                note("prefill's time so far", value * UNITS[m.group(2)], slack * UNITS[m.group(2)], r.view)
            for m in KV_BYTES.finditer(text):
                number, unit = next((m.group(i), m.group(i + 1)) for i in (1, 3, 5) if m.group(i))
                value, slack = _number(number)
                note("KV bytes", value * UNITS[unit], slack * UNITS[unit], r.view)
            for m in CONTEXT.finditer(text):
                number = next(g for g in m.groups() if g)
                value, slack = _number(number)
                note("context window", value, slack, r.view)
    out = []
    for kind, values in seen.items():
        low = min(values, key=lambda v: v[0])
        high = max(values, key=lambda v: v[0])
        if high[0] - low[0] > low[1] + high[1] + 1e-9:
            out.append(Finding(f"{low[2]} / {high[2]}", "one value",
                               f"{kind}: {low[0]:,.6g} in {low[2]}, {high[0]:,.6g} in {high[2]}"))
    return out


def empty_chart(readings: list[Reading], known: Known) -> list[Finding]:
    return [Finding(r.view, "empty chart", f"{c.name!r} draws no data but prints numbers ({', '.join(c.numbers)})")
            for r in readings for c in r.charts if not c.has_data and c.numbers]


def paused(readings: list[Reading], known: Known) -> list[Finding]:
    if known.phase.name not in (PAUSED, STEPPING):
        return []
    word = "paused" if known.phase.name == PAUSED else "step by step"
    out = [Finding(r.view, "paused", f"a {word} run, not said: {' | '.join(r.texts)[:160]!r}")
           for r in _run_views(readings) if r.texts and r.inside is None and not any(word in t for t in r.words)]
    for r in readings:
        for text, _enabled in r.controls:
            if text.startswith("Pause"):
                out.append(Finding(r.view, "paused", f"the control offers {text!r} to a {word} run"))
    return out


def next_run(readings: list[Reading], known: Known) -> list[Finding]:
    if not known.pending:
        return []
    return [Finding(r.view, "next run", f"{', '.join(known.pending)} differ from the run shown, unmarked")
            for r in readings if r.about == SETTINGS and not any("next run" in w for w in r.words)]


def ended(readings: list[Reading], known: Known) -> list[Finding]:
    if known.phase.name not in ENDED:
        return []
    return [Finding(r.view, "ended", f"a {known.phase.name} run described as running: {text[:120]!r}")
            for r in _run_views(readings) for text in r.words if STILL_RUNNING.search(text)]


def busy(readings: list[Reading], known: Known) -> list[Finding]:
    """While the engine is busy, nothing invites R (the footer would refuse it) unless R is what is running."""
    if not known.busy:
        return []
    return [Finding(r.view, "busy", f"invites R while {known.busy} is in progress: {text[:120]!r}")
            for r in readings for text in r.texts if PRESS_R.search(text)]


def clipped(readings: list[Reading], known: Known) -> list[Finding]:
    out = [Finding(r.view, "clipped", text) for r in readings for text in r.clipped]
    out += [Finding(r.view, "clipped", f"{c.name}: {text}") for r in readings for c in r.charts for text in c.clipped]
    return out


def painted(readings: list[Reading], known: Known) -> list[Finding]:
    """What a chart paints: no label across a bar or over tick labels, no tick labels over each other, no axis
    title longer than its axis, a legend's marker beside its label, a unit on every painted number."""
    return [Finding(r.view, rule, f"{c.name}: {detail}") for r in readings for c in r.charts
            for rule, detail in c.painted]


def scroll_bars(readings: list[Reading], known: Known) -> list[Finding]:
    """A lecture scene shows what it says whole: no scroll bar, no text box whose last line is cut."""
    if known.scene is None:
        return []
    return [Finding(r.view, "scroll bar", text) for r in readings for text in r.scrolls]


READABLE_PX = (240, 120)       # a chart's data area at least this big can be read from a seat


def fits(readings: list[Reading], known: Known) -> list[Finding]:
    """The workbench shows, unscrolled, what a run needs (each view's essentials: the prompt, Run, Stop, Step,
    Pause, five lines of the token stream) and one chart at a readable size."""
    if known.scene is not None or known.blank:
        return []
    out = [Finding(r.view, "fits", text) for r in readings for text in r.unseen]
    charts = [c for r in readings for c in r.charts]
    if charts and not any(c.seen and c.area[0] >= READABLE_PX[0] and c.area[1] >= READABLE_PX[1] for c in charts):
        largest = max(charts, key=lambda c: c.area[0] * c.area[1] if c.seen else 0)
        out.append(Finding("workbench", "fits", f"no chart readable whole on screen (the largest seen: "
                                                f"{largest.name!r}, {largest.area[0]}x{largest.area[1]} px)"))
    return out


def blank(readings: list[Reading], known: Known) -> list[Finding]:
    """A blanked screen shows nothing: no view but the covered scene is on screen."""
    if not known.blank:
        return []
    return [Finding(r.view, "blank", f"on screen while blanked: {' | '.join(r.words)[:100]!r}")
            for r in readings if r.view != "scene" and r.inside != "scene" and r.words]


RULES: dict[str, Callable[[list[Reading], Known], list[Finding]]] = {
    "before": before, "measured": measured, "one value": one_value, "empty chart": empty_chart,
    "paused": paused, "next run": next_run, "ended": ended, "busy": busy, "clipped": clipped, "painted": painted,
    "scroll bar": scroll_bars, "fits": fits, "blank": blank}


def judge(readings: list[Reading], known: Known) -> list[Finding]:
    return [finding for rule in RULES.values() for finding in rule(readings, known)]
