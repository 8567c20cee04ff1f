"""One lesson's tab, the same for every lesson: its settings form (built from the lesson's settings class),
Run / Cancel with progress, the chart that proves the claim, a few sentences on what the numbers show, and a
table of them. A lesson module (``app/lessons/<kind>.py``) subclasses :class:`LessonView` with its chart, its
words and its scene caption; everything else is here. A lecture scene shows the same widget, compact.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from html import escape
from typing import Any, ClassVar

from PySide6.QtCore import QPoint, QSize, Qt, Signal
from PySide6.QtGui import QShowEvent
from PySide6.QtWidgets import (
    QBoxLayout,
    QComboBox,
    QDoubleSpinBox,
    QFormLayout,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QLineEdit,
    QProgressBar,
    QPushButton,
    QScrollArea,
    QSpinBox,
    QTableWidget,
    QTableWidgetItem,
    QToolButton,
    QVBoxLayout,
    QWidget,
)

from app.state.phase import elapsed, experiment_phase, plural
from app.state.run_settings import LessonChoices
from app.state.store import ExperimentRecord, RunStore
from app.views import theme as th
from app.views.chart import READABLE_DATA_PX, READABLE_WIDTH_PX, Chart
from app.views.setting_widgets import control, int_range
from engine.facts import vocabulary
from engine.facts.contention import busy, busy_note
from engine.facts.errors import ParameterError
from engine.facts.events import LessonResult, LessonSettings
from engine.facts.validation import MISSING, FieldShape, shapes
from engine.facts.vocabulary import LessonPoint
from engine.run.experiment import Lesson


@dataclass(frozen=True)
class Scene:
    """A lecture scene: its ``name`` (``kvscope --scene NAME``), ``title``, place in the lecture (``order``), what
    R does there in words (``action``), ``key`` where it is not the number-row key of its place, and whether its
    panels stand side by side (``side_by_side``) or stacked. A lesson's scene runs that lesson on R; the registry
    fills in ``lesson``."""

    name: str
    title: str
    order: int
    action: str
    lesson: str | None = None
    key: str = ""
    side_by_side: bool = False


@dataclass(frozen=True)
class Joins:
    """A lesson shown in another lesson's scene beside it, started there by its own ``key``."""

    scene: str
    key: str
    words: str


@dataclass(frozen=True)
class WindowLesson:
    """A lesson's whole window side, one typed value (its module's ``WINDOW``): the engine lesson, its tab's view
    (None when another panel draws it), its scene's caption, its scene (or ``joins``: shown in another lesson's
    scene), the dock that draws it, a setting it takes from the window when it starts (``follows``: ``(field,
    "conversation")``), the panels its scene shows beside its view (``beside``), and whether the runs it makes are
    the ones the run panels show while it runs (``shows_runs``)."""

    lesson: Lesson
    view: type[LessonView] | None
    caption: Callable[..., str]
    scene: Scene | None = None
    joins: Joins | None = None
    dock: str = "experiments"
    follows: tuple[str, str] | None = None
    beside: tuple[str, ...] = ()
    shows_runs: bool = False

    @property
    def kind(self) -> str:
        return self.lesson.kind


CONTROLS_PROMPT = object()          # a preset that means "the prompt in Controls, when the lesson starts"


class SettingsForm(QWidget):
    """A field per user-settable setting, its range and default from the settings class. Every edit builds the
    settings object (which checks itself) and hands it to ``LessonChoices``; a refused value says why in
    ``status`` and keeps the last good settings."""

    def __init__(self, lesson: Lesson, choices: LessonChoices, presets: dict[str, list[tuple[str, object]]],
                 status: Callable[[str], None]) -> None:
        super().__init__()
        self.lesson, self.choices, self.status = lesson, choices, status
        self.readers: dict[str, Callable[[], object]] = {}
        self.follows: dict[str, Callable[[], bool]] = {}
        self.widgets: dict[str, QWidget] = {}
        self.labels: dict[str, str] = {}
        layout = QFormLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        for shape in shapes(lesson.settings):
            if shape.setting is None:
                continue
            widget = self.widgets[shape.name] = self._widget(shape, presets.get(shape.name))
            widget.setToolTip(shape.setting.help)
            self.labels[shape.name] = shape.setting.label
            layout.addRow(shape.setting.label, widget)
        self.write()
        choices.subscribe(lambda kinds: self.follow() if lesson.kind in kinds else None)

    def follow(self) -> None:
        """Show the settings ``LessonChoices`` holds when something else changed them (a lecture key), so the tab
        shows what R will run; the widgets are set without writing back."""
        settings = self.choices.settings.get(self.lesson.kind)
        if settings is None:
            return
        for name, widget in self.widgets.items():
            value = getattr(settings, name)
            widget.blockSignals(True)
            if isinstance(widget, (QSpinBox, QDoubleSpinBox)) and value is not None and widget.value() != value:
                widget.setValue(value)
            elif isinstance(widget, QLineEdit) and isinstance(value, str) and widget.text() != value:
                widget.setText(value)
            widget.blockSignals(False)

    def _widget(self, shape: FieldShape, presets: list[tuple[str, object]] | None) -> QWidget:
        default = None if shape.default is MISSING else shape.default
        if presets:
            box = _combo()
            for label, value in presets:
                box.addItem(label, value)
            index = next((i for i, (_l, v) in enumerate(presets) if v == default), 0)
            box.setCurrentIndex(index)
            box.currentIndexChanged.connect(self.write)
            self.readers[shape.name] = lambda b=box: None if b.currentData() is CONTROLS_PROMPT else b.currentData()
            self.follows[shape.name] = lambda b=box: b.currentData() is CONTROLS_PROMPT
            return box
        if shape.base is int:
            box = control(shape, "the model's whole context" if shape.optional else "")
            box.valueChanged.connect(self.write)
            self.readers[shape.name] = lambda b=box, opt=shape.optional, lo=int_range(shape)[0]: \
                None if opt and b.value() < lo else b.value()
            return box
        if shape.base is float:
            box = control(shape)
            box.valueChanged.connect(self.write)
            self.readers[shape.name] = box.value
            return box
        if shape.base is str and shape.text is not None and shape.text.choices:
            box = _combo()
            box.addItems(list(shape.text.choices))
            box.setCurrentText(str(default))
            box.currentTextChanged.connect(self.write)
            self.readers[shape.name] = box.currentText
            return box
        edit = QLineEdit(", ".join(str(v) for v in default) if shape.base is tuple else str(default or ""))
        edit.editingFinished.connect(self.write)
        self.readers[shape.name] = lambda e=edit, s=shape: _parse_text(e.text(), s)
        return edit

    def summary(self) -> str:
        """The values set, in the words the fields show ("48 tokens · the first sample prompt"): what a folded
        form says it holds."""
        words = []
        for name, widget in self.widgets.items():
            if isinstance(widget, QComboBox):
                words.append(widget.currentText())
            elif isinstance(widget, QLineEdit):
                words.append(widget.text())
            elif isinstance(widget, (QSpinBox, QDoubleSpinBox)):
                special = widget.value() == widget.minimum() and widget.specialValueText()
                text = widget.specialValueText() if special else widget.text()
                words.append(text if special or widget.suffix().strip() else f"{self.labels[name]} {text}")
        return " · ".join(w for w in words if w)

    def set_value(self, name: str, value: object) -> None:
        """Set one field as a user would (a spin box's number, a text, a choice's value), then write."""
        widget = self.widgets[name]
        if isinstance(widget, QComboBox):
            index = widget.findData(value)
            widget.setCurrentIndex(index if index >= 0 else widget.findText(str(value)))
        elif isinstance(widget, QLineEdit):
            widget.setText(", ".join(str(v) for v in value) if isinstance(value, tuple) else str(value))
            widget.editingFinished.emit()
        else:
            widget.setValue(value)

    def write(self) -> None:
        try:
            values = {name: read() for name, read in self.readers.items()}
            settings = self.lesson.settings(**{k: v for k, v in values.items() if v is not None or
                                               self._optional(k)})
        except (ParameterError, ValueError) as exc:
            self.status(str(exc))
            return
        self.choices.set(settings)
        follow = next((name for name, follows in self.follows.items() if follows()), None)
        self.choices.follow_prompt(self.lesson.kind, follow)

    def _optional(self, name: str) -> bool:
        return next(s.optional for s in shapes(self.lesson.settings) if s.name == name)


def _parse_text(text: str, shape: FieldShape) -> object:
    if shape.base is not tuple:
        return text
    parts = [p.strip() for p in text.replace(";", ",").split(",") if p.strip()]
    if shape.element is int:
        if not all(p.isdigit() for p in parts):
            raise ValueError(f"{shape.setting.label} must be whole numbers separated by commas (e.g. 1, 2, 4)")
        return tuple(int(p) for p in parts)
    if shape.element is float:
        try:
            return tuple(float(p) for p in parts)
        except ValueError:
            raise ValueError(f"{shape.setting.label} must be numbers separated by commas (e.g. 0, 0.25, 0.5)") \
                from None
    return tuple(parts)


TABLE_PX = 170          # the table's most height: a few rows, then it scrolls
SHELL_PX = 90           # the progress bar, the status line and the spaces between


def fold_button(text: str) -> QToolButton:
    """A toggle that shows what a short dock folds away (a form, a table, a lesson's own details)."""
    button = QToolButton()
    button.setText(text)
    button.setCheckable(True)
    button.setArrowType(Qt.ArrowType.RightArrow)
    button.setToolButtonStyle(Qt.ToolButtonStyle.ToolButtonTextBesideIcon)
    button.setAutoRaise(True)
    button.toggled.connect(lambda on: button.setArrowType(Qt.ArrowType.DownArrow if on else Qt.ArrowType.RightArrow))
    return button


def _combo() -> QComboBox:
    """A choice box as wide as its room, its longest choice elided: at their full width the speculative lesson's
    choices held its tab wider than a 720p dock, its Run button scrolled off."""
    box = QComboBox()
    box.setSizeAdjustPolicy(QComboBox.SizeAdjustPolicy.AdjustToMinimumContentsLengthWithIcon)
    box.setMinimumContentsLength(12)
    return box


_NOTHING_SHOWN = object()   # what ``refresh`` last drew before its first call: unlike "no record", never equal


class LessonView(QWidget):
    """The shell every lesson's tab shares. Subclasses set ``lesson`` and ``axes`` (x quantity, x unit, y
    quantity, y unit) and ``point`` (the lesson's point type its table lists: the columns are its declared
    ``Column``s), and implement ``draw`` (the chart from the record) and ``explanation`` (rich text from the typed
    result). The scene's one-line claim is the lesson module's ``caption(record, context)``."""

    run_requested = Signal(str)
    cancel_requested = Signal()
    lesson: ClassVar[Lesson]
    axes: ClassVar[tuple[str, str | None, str, str | None]] = ("", None, "", None)
    point: ClassVar[type[LessonPoint] | None] = None           # what the table lists (None: no table rows)
    presets: ClassVar[dict[str, list[tuple[str, object]]]] = {}
    in_tabs: ClassVar[bool] = True          # the chat comparison lives in the Chat panel instead
    scene_charts: ClassVar[tuple[str, ...]] = ("chart",)     # the charts its scene is read by, as attributes

    def read_charts(self) -> list:
        """The charts a lecture's audience reads in this lesson's scene (what must stay large enough there)."""
        return [getattr(self, name) for name in self.scene_charts]

    def __init__(self, store: RunStore, choices: LessonChoices) -> None:
        super().__init__()
        self.store, self.choices = store, choices
        self.theme = th.current_theme(False)
        self.status = QLabel("Not run yet.")
        self.status.setTextFormat(Qt.TextFormat.PlainText)
        self.status.setWordWrap(True)
        self.form = SettingsForm(self.lesson, choices, self.presets, self.status.setText)
        self.run_button = QPushButton("Run experiment")
        self.cancel_button = QPushButton("Cancel")
        self.run_button.clicked.connect(lambda: self.run_requested.emit(self.lesson.kind))
        self.cancel_button.clicked.connect(self.cancel_requested)
        self.progress = QProgressBar()
        self.progress.setFormat("%p%  %v of %m")
        # Folded where the dock is short (see ``_fold_when_short``): the form and the table behind a click each,
        # the values the form holds said in one line, so the chart keeps a readable height.
        self.settings_fold = fold_button("Settings")
        self.table_fold = fold_button("Table")
        self.form_summary = QLabel()
        self.form_summary.setTextFormat(Qt.TextFormat.PlainText)
        self.form_summary.setWordWrap(True)
        self.folds = QWidget()
        folds = QVBoxLayout(self.folds)
        folds.setContentsMargins(0, 0, 0, 0)
        folds.setSpacing(2)
        for widget in (self.settings_fold, self.form_summary, self.table_fold):
            folds.addWidget(widget)
        self.settings_fold.toggled.connect(lambda _on: self._fold())
        self.table_fold.toggled.connect(lambda _on: self._fold())
        choices.subscribe(lambda kinds: self._say_form() if self.lesson.kind in kinds else None)
        self._short = False                      # the dock is too short for the form, the chart and the table
        self._scene = False                      # a lecture scene shows this view
        row = QHBoxLayout()
        row.addWidget(self.folds, 1)
        row.addWidget(self.form, 1)
        buttons = QVBoxLayout()
        buttons.addWidget(self.run_button)
        buttons.addWidget(self.cancel_button)
        buttons.addStretch(1)
        row.addLayout(buttons)
        self.settings_box = QWidget()
        self.settings_box.setLayout(row)
        self.chart = Chart(self.lesson.title, least_data_px=READABLE_DATA_PX)
        self.plot = self.chart.plot
        self.plot.getViewBox().setDefaultPadding(0.08)       # room for point labels at the edges
        self.charts = QWidget()
        # No height of its own: each chart's least height adds up here, and a short dock scrolls instead of
        # squashing them (a fixed minimum below their sum squeezed a three-chart tab to nothing).
        self.charts_layout = QVBoxLayout(self.charts)
        self.charts_layout.setContentsMargins(0, 0, 0, 0)
        self.charts_layout.addWidget(self.chart, 3)
        self.explain = QLabel()
        self.explain.setWordWrap(True)
        self.explain.setTextFormat(Qt.TextFormat.RichText)
        self.columns = vocabulary.columns(self.point) if self.point is not None else []
        self.table = QTableWidget(0, len(self.columns))
        self.table.setHorizontalHeaderLabels([column.label for _name, column in self.columns])
        self.table.verticalHeader().setVisible(False)
        self.table.horizontalHeader().setSectionResizeMode(QHeaderView.ResizeMode.ResizeToContents)
        self.table.setMaximumHeight(TABLE_PX)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(4, 4, 4, 4)
        layout.addWidget(self.settings_box)
        layout.addWidget(self.progress)
        layout.addWidget(self.status)
        layout.addWidget(self.charts, 1)
        layout.addWidget(self.explain)
        layout.addWidget(self.table)
        self.rows: list[QBoxLayout] = []          # charts side by side that go one above the other when narrow
        self.build()
        if self.charts_layout.direction() == QBoxLayout.Direction.LeftToRight:
            self.rows.append(self.charts_layout)
        self._shown: object = _NOTHING_SHOWN
        self._drawn: object = _NOTHING_SHOWN     # what the charts were last drawn from
        self._styled = False                     # whether the charts wear ``self.theme`` (see ``set_theme``)
        self.set_busy(False)
        self._say_form()
        self._fold()

    # --- hooks a lesson's view fills in ---------------------------------------------------------------------
    def build(self) -> None:
        """Add what this lesson's view needs beyond one chart (a second chart, a text, a slider)."""

    def draw(self, record: ExperimentRecord) -> None:
        """Draw the record's points on the chart(s)."""

    def explanation(self, record: ExperimentRecord) -> str:
        """A few sentences (rich text, escaped) on what the finished result shows."""
        return ""

    def cell(self, record: ExperimentRecord, point: Any, name: str) -> str | None:
        """The words shown in the table for figure ``name`` of the typed ``point`` where its declared format
        cannot say them (an index into the result's names); None: the declared format."""
        return None

    def style_charts(self, theme: th.Theme) -> None:
        x, xu, y, yu = self.axes
        self.chart.style(theme, x, xu, y, yu)

    # --- the shell -----------------------------------------------------------------------------------------
    def set_compact(self, compact: bool) -> None:
        """A lecture scene shows the chart, the caption states what it means; settings, progress, the explanation
        and the table stay behind (the numbers are in the caption and on the axes, the scene's footer shows
        progress), and the charts drop their titles."""
        self._scene = compact
        for widget in (self.settings_box, self.progress, self.status, self.explain):
            widget.setVisible(not compact)
        self._fold()
        for chart in self.findChildren(Chart):
            chart.set_title_visible(not compact)

    def resizeEvent(self, event) -> None:  # noqa: N802 (Qt override)
        super().resizeEvent(event)
        room = self._room()
        self._stack_when_narrow(room)
        self._fold_when_short(room)

    def _fold_when_short(self, room: QSize | None = None) -> None:
        """Where the dock shows less height than the form, the table and a readable chart need (a 720p
        projector's, or a desktop's dock shared with another panel), the form and the table fold behind a click
        each: unfolded there, the chart's data was 97 px tall. Judged by the dock's room, not this view's own
        height, which the folding itself changes."""
        room = room or self._room()
        words = self.explain.heightForWidth(room.width()) if self.explain.text() else 0
        need = self.form.sizeHint().height() + self._table_height() + words + self.chart.minimumHeight() + SHELL_PX
        short = room.height() < need
        if short != self._short:
            self._short = short
            self._fold()

    def _table_height(self) -> int:
        """What the table takes unfolded: its header and rows, up to ``TABLE_PX`` (then it scrolls)."""
        table = self.table
        rows = sum(table.rowHeight(row) for row in range(table.rowCount()))
        return min(TABLE_PX, table.horizontalHeader().sizeHint().height() + rows + 2 * table.frameWidth() + 4)

    def _fold(self) -> None:
        folded = self._short and not self._scene
        self.folds.setVisible(folded)
        self.form.setVisible(not folded or self.settings_fold.isChecked())
        self.table.setVisible(not self._scene and (not folded or self.table_fold.isChecked()))

    def _say_form(self) -> None:
        self.form_summary.setText(self.form.summary())
        rows = self.table.rowCount()
        self.table_fold.setText(f"Table ({plural(rows, 'row')})" if rows else "Table")

    def _stack_when_narrow(self, room: QSize) -> None:
        """Charts a lesson sets side by side (``rows``: its chart layout turned left to right, or a row it
        added) go one above the other where the panel is narrower than they need, each at least readable (a 560
        px dock): side by side there, each was cut at its right edge, an axis title's end with it, or, titles
        fitted, drawn 190 px wide."""
        for layout in self.rows:
            charts = [layout.itemAt(i).widget() for i in range(layout.count())]
            shown = [chart for chart in charts if isinstance(chart, Chart) and not chart.isHidden()]
            need = (sum(max(chart.content_width(), READABLE_WIDTH_PX) for chart in shown)
                    + layout.spacing() * max(len(shown) - 1, 0))
            wanted = (QBoxLayout.Direction.LeftToRight if room.width() >= need
                      else QBoxLayout.Direction.TopToBottom)
            if layout.direction() != wanted:
                layout.setDirection(wanted)

    def _room(self) -> QSize:
        """The charts' width and the view's height, or less where a scroll area (the dock) shows less of the
        panel: side by side, the charts' least widths held the panel wider than the dock, which then scrolled
        instead of stacking them."""
        area = self.parentWidget()
        while area is not None and not isinstance(area, QScrollArea):
            area = area.parentWidget()
        if area is None or area.widget() is None:
            return QSize(self.charts.width(), self.height())
        top = self.mapTo(area.widget(), QPoint(0, 0)).y()
        return QSize(min(self.charts.width(), area.viewport().width() - (self.width() - self.charts.width())),
                     area.viewport().height() - top)

    def set_busy(self, busy: bool, mine: bool = False) -> None:
        self.run_button.setEnabled(not busy)
        self.cancel_button.setEnabled(busy and mine)

    def set_theme(self, theme: th.Theme) -> None:
        """A view off screen is restyled when it is next shown: a lecture-mode switch restyled every lesson's
        view for the one a scene shows (entering lecture mode took 118 ms with that, 89 ms without)."""
        self.theme = theme
        self._styled = False
        if self.isVisible():
            self._restyle()

    def showEvent(self, event: QShowEvent) -> None:
        if not self._styled:
            self._restyle()
        super().showEvent(event)

    def _restyle(self) -> None:
        self._styled = True
        self.style_charts(self.theme)
        self._shown = self._drawn = _NOTHING_SHOWN
        self.refresh()

    def latest(self) -> ExperimentRecord | None:
        return self.store.latest_experiment(self.lesson.kind)

    def refresh(self) -> None:
        record = self.latest()
        running = record is not None and not record.finished
        # The charts are drawn again when the record or its runs' steps change; while it runs, the words move
        # with its clock between reports (in tenths of a second), so the screen is never still while it works.
        steps = sum(run.n_steps for run in map(self.store.find, record.run_ids) if run is not None) if running else 0
        key = (record.exp_id, len(record.events), steps) if record else None
        phase = experiment_phase(record, self.store.now())
        clock = (key, int(phase.elapsed_ms // 100)) if running else key
        if clock == self._shown:
            return
        self._shown = clock
        charts = self.findChildren(Chart)
        if record is None:
            for chart in charts:
                chart.set_empty("Not run yet: Run experiment (or R in its lecture scene) fills this chart, point by "
                                "point, as each is measured")
            return
        self.status.setText(end_text(record) if record.finished else phase.words()[:1].upper() + phase.words()[1:])
        if key != self._drawn:
            self._drawn = key
            if record.progress is not None:
                self.progress.setRange(0, max(record.progress.total, 1))
                self.progress.setValue(record.progress.done)
            for chart in charts:
                chart.clear_data()
            self.draw(record)
            words = self.explanation(record) if record.result is not None else ""
            note = busy_note(record.result.lowest_cpu_share) if record.result is not None else ""
            if record.result is not None and record.result.threads_note:
                note = "; ".join(n for n in (note, record.result.threads_note) if n)
            self.explain.setText(words + (f" <i>Note: {escape(note)}.</i>" if note else ""))
            self._fold_when_short()
            self._fill_table(record)
        for chart in charts:                    # each chart's axes print numbers only where it draws data
            chart.prune_legend()
            chart.set_empty(None if chart.shows_data() else f"Measuring the first point: {elapsed(phase.elapsed_ms)} "
                            "so far" + (f" · {phase.message}" if phase.message else "") if not phase.ended else
                            phase.words()[:1].upper() + phase.words()[1:])

    def _fill_table(self, record: ExperimentRecord) -> None:
        points = record.typed(self.point) if self.point is not None else []
        self.table.setRowCount(len(points))
        for row, point in enumerate(points):
            for col, (name, column) in enumerate(self.columns):
                words = self.cell(record, point, name)
                value = getattr(point, name)
                text = words if words is not None else "" if value is None else column.cell(value)
                self.table.setItem(row, col, QTableWidgetItem(text))
        self.table.resizeColumnsToContents()
        self._say_form()

    def result(self) -> LessonResult | None:
        record = self.latest()
        return record.result if record is not None else None


def end_text(record: ExperimentRecord) -> str:
    """How it ended, and the settings it ran with (a replayed experiment's are not the form's)."""
    end = record.end
    if hasattr(end, "reason"):
        phase = experiment_phase(record)
        text = ("Finished." if end.reason == "done" else
                f"Stopped: {plural(phase.points, 'point')} so far, kept." if phase.points else
                phase.words()[:1].upper() + phase.words()[1:] + ".")
    else:
        text = f"Failed: {getattr(end, 'message', '')}"
    shown = settings_words(record.started.settings)
    return text + (f" Ran with {shown}." if shown else "")


def settings_words(settings: LessonSettings) -> str:
    out = []
    for shape in shapes(type(settings)):
        if shape.setting is None or shape.name == "prompt":
            continue
        value = getattr(settings, shape.name)
        off = shape.setting.special and shape.span is not None and value == shape.span.low
        if value == "" or off:                        # a setting left off says nothing about the run
            continue
        shown = "/".join(str(v) for v in value) if isinstance(value, tuple) else (
            "the whole context" if value is None else f"{value:g}" if isinstance(value, float) else str(value))
        unit = shape.setting.unit if shape.setting.unit not in shape.setting.label.split() else ""
        out.append(f"{shape.setting.label.lower()} {shown}{' ' + unit if unit and value is not None else ''}")
    return ", ".join(out)


def token_note(result: object) -> str:
    """The engine's reason why tokens differ (a 16-bit float's rounding), escaped, or nothing."""
    note = getattr(result, "tokens_note", "")
    return f" ({escape(note)})" if note else ""


def busy_badge(result: LessonResult | None) -> str:
    """What a scene caption adds when its numbers were measured on a busy machine."""
    if result is None or not busy(result.lowest_cpu_share):
        return ""
    return f" · on a busy machine (down to {result.lowest_cpu_share:.0%} CPU)"


def add_labels(chart: Chart, points: list[tuple[float, float, str]]) -> None:
    """Short labels beside points (``B=4``), each on a side where it covers no other label or point and stays
    inside the plot."""
    for x, y, text in points:
        chart.label_point(text, x, y, marker=8.0)
