"""Lecture scenes: one claim on the screen at a time, the chart that proves it filling the screen, and a caption
stating the claim with the live number.

Scenes are layouts over the panels the workbench already has, not copies: a scene borrows the widgets it shows
and gives them back when it ends, so a run, a replay or an experiment draws in the scene exactly as in the
workbench. Which scenes exist and in what order is ``app.lecture.scene_list``; a lesson's scene caption comes from its
module (``app.lessons``), the run scenes' captions from here. The footer shows the keys, the run settings a
speaker can change from the scene (T, P, K, M), what is running and how to stop it, and why a key was refused.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from html import escape, unescape

from PySide6.QtCore import Qt
from PySide6.QtGui import QFont, QFontDatabase, QFontMetrics
from PySide6.QtWidgets import (
    QAbstractScrollArea,
    QBoxLayout,
    QDockWidget,
    QGraphicsView,
    QGridLayout,
    QHBoxLayout,
    QLabel,
    QProgressBar,
    QScrollArea,
    QSizePolicy,
    QSplitter,
    QStackedWidget,
    QTabWidget,
    QTextEdit,
    QVBoxLayout,
    QWidget,
)

from app import lessons
from app.lecture.scene_list import BY_NAME, SCENES
from app.panels.attention import RECENT
from app.panels.attention import shares as attention_shares
from app.panels.sampling import caption as sampling_caption
from app.panels.sampling import what_if_caption
from app.state.phase import (
    FAILED,
    FINISHED,
    PREFILL,
    STOPPED,
    decode_rate,
    experiment_phase,
    figures,
    per_token,
    plural,
    prefill_passes,
    run_phase,
)
from app.state.run_settings import PARAMETER_LETTERS, LessonChoices, RunSettings, param_shape
from app.state.store import RunRecord, RunStore
from app.state.viewstate import Conversation, ViewState
from app.views import theme as th
from app.views.lesson_view import WindowLesson, busy_badge
from app.views.setting_widgets import setting_text
from engine import lessons as engine_lessons
from engine.facts import kvformula, report
from engine.facts.contention import busy
from engine.facts.what_if import refilter

RUN_SCENES = ("prefill", "kv", "sampling", "attention")
CAPTION_LINES = 2                     # a caption the back row reads at a glance; the rest goes below, smaller
_STRONG = re.compile(r"(?<=[;.·])\s+")           # between clauses ("1.4x" is not a boundary: no space)
_WEAK = re.compile(r"(?<=[;.·:,])\s+|\s+(?=\()")   # inside a long clause too


def split_caption(title: str, claim: str, fits: Callable[[str], bool]) -> tuple[str, str]:
    """The title and the longest head of ``claim`` that ``fits`` with it, cut between clauses (inside one only
    if the first is too long on its own), and the rest: the headline and its detail. The title is never cut."""
    for pattern in (_STRONG, _WEAK):
        pieces = [p for p in pattern.split(claim.strip()) if p]
        for n in range(len(pieces), 0, -1):
            head = f"{title}{' '.join(pieces[:n])}".rstrip(" ;·,:")
            if fits(head):
                return head, " ".join(pieces[n:])
    pieces = [p for p in _WEAK.split(claim.strip()) if p]
    return f"{title}{pieces[0] if pieces else ''}".rstrip(" ;·,:"), " ".join(pieces[1:])


@dataclass(frozen=True)
class Context:
    """What a caption may read besides its own record: the runs, what is shown, the chat, and each lesson's
    settings as its form holds them (what R starts in its scene)."""

    store: RunStore
    state: ViewState
    conversation: Conversation
    choices: LessonChoices = field(default_factory=LessonChoices)


class _Loan:
    """A widget taken from its place in the workbench, and how to put it back."""

    def __init__(self, widget: QWidget) -> None:
        self.widget = widget
        self._restore: Callable[[], None] = lambda: None
        self._show = True                 # a tab's page is shown by its tabs, never over the current one
        parent = widget.parentWidget()
        holder = parent.parentWidget() if parent is not None else None
        if isinstance(parent, QDockWidget):
            self._restore = lambda: parent.setWidget(widget)
        elif isinstance(holder, QScrollArea) and holder.widget() is widget:
            holder.takeWidget()
            self._restore = lambda: holder.setWidget(widget)
        elif isinstance(parent, QStackedWidget) and isinstance(parent.parentWidget(), QTabWidget):
            tabs = parent.parentWidget()
            index, label = tabs.indexOf(widget), tabs.tabText(tabs.indexOf(widget))
            current = tabs.currentIndex()
            tabs.removeTab(index)                     # taken out, so the tabs never draw a page they lent
            self._restore = lambda: (tabs.insertTab(index, widget, label), tabs.setCurrentIndex(current))
            self._show = False
        elif isinstance(parent, QSplitter):
            index, sizes = parent.indexOf(widget), parent.sizes()
            self._restore = lambda: (parent.insertWidget(index, widget), parent.setSizes(sizes))
        elif parent is not None and parent.layout() is not None:
            layout = parent.layout()
            index = layout.indexOf(widget)
            if isinstance(layout, QGridLayout):
                position = layout.getItemPosition(index)
                self._restore = lambda: layout.addWidget(widget, *position)
            elif isinstance(layout, QBoxLayout):
                stretch = layout.stretch(index)
                self._restore = lambda: layout.insertWidget(index, widget, stretch)
        self._bars = self._hide_scroll_bars(widget)

    @staticmethod
    def _hide_scroll_bars(widget: QWidget) -> list[tuple[QAbstractScrollArea, Qt.ScrollBarPolicy,
                                                            Qt.ScrollBarPolicy]]:
        """A slide shows no scroll bars: each text box the panel holds shows its newest lines (the token stream's
        reply, the chat's last turn), the scene gives it what room it has."""
        kept = []
        for area in widget.findChildren(QAbstractScrollArea):
            if isinstance(area, QGraphicsView):
                continue
            kept.append((area, area.verticalScrollBarPolicy(), area.horizontalScrollBarPolicy()))
            area.setVerticalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
            area.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
            if isinstance(area, QTextEdit):
                area.verticalScrollBar().setValue(area.verticalScrollBar().maximum())
        return kept

    def give_back(self) -> None:
        self._restore()
        off = Qt.ScrollBarPolicy.ScrollBarAlwaysOff
        for area, vertical, horizontal in self._bars:        # unless the panel set its own on leaving the scene
            if area.verticalScrollBarPolicy() == off:
                area.setVerticalScrollBarPolicy(vertical)
            if area.horizontalScrollBarPolicy() == off:
                area.setHorizontalScrollBarPolicy(horizontal)
        if self._show:
            self.widget.show()


class SceneView(QWidget):
    """The lecture screen: caption, the scene's panels, a footer with the keys, the settings and any progress;
    a black cover for B."""

    def __init__(self, context: Context, run_settings: RunSettings, arrangements: dict[str, list[tuple[QWidget, int]]],
                 on_enter: Callable[[str], None], on_leave: Callable[[str], None]) -> None:
        super().__init__()
        self.context, self.run_settings = context, run_settings
        self.arrangements, self.on_enter, self.on_leave = arrangements, on_enter, on_leave
        self.caption = QLabel()
        self.caption.setWordWrap(True)
        self.caption.setTextFormat(Qt.TextFormat.PlainText)
        self.detail = QLabel()                         # what did not fit the caption's two lines
        self.detail.setWordWrap(True)
        self.detail.setTextFormat(Qt.TextFormat.PlainText)
        self.detail.hide()
        self.body = QWidget()
        self.body.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Ignored)   # never widens the window
        self.body_layout = QHBoxLayout(self.body)
        self.body_layout.setContentsMargins(0, 0, 0, 0)
        self.console = QLabel()                        # scene 1: the run in llama.cpp's own lines
        self.console.setTextFormat(Qt.TextFormat.PlainText)
        self.console.hide()
        self.progress = QProgressBar()
        self.progress.setFormat("%v of %m")
        self.progress_label = QLabel()
        self.progress_label.setTextFormat(Qt.TextFormat.PlainText)
        progress_row = QHBoxLayout()
        progress_row.addWidget(self.progress)
        progress_row.addWidget(self.progress_label, 1)
        self.progress_box = QWidget()
        self.progress_box.setLayout(progress_row)
        self.progress_box.hide()
        self.source = QLabel()                         # a replay: where and when it was recorded
        self.source.setTextFormat(Qt.TextFormat.PlainText)
        self.source.hide()
        self.footer = QLabel()                         # the keys, then (below) the settings the next run takes
        self.footer.setTextFormat(Qt.TextFormat.RichText)
        self.footer.setWordWrap(True)
        self.next_run = QLabel()
        self.next_run.setTextFormat(Qt.TextFormat.RichText)
        self.next_run.setWordWrap(True)
        self.notice = ""                               # a refused key's reason, until the next scene
        self._notice_until_idle = False                # "Stopping…": said only while the work winds down
        layout = QVBoxLayout(self)
        layout.setContentsMargins(12, 6, 12, 6)
        layout.setSpacing(2)                         # at 720p every pixel row goes to the chart
        layout.addWidget(self.caption)
        layout.addWidget(self.detail)
        layout.addWidget(self.body, 1)
        layout.addWidget(self.console)
        layout.addWidget(self.progress_box)
        self.bottom = QGridLayout()                    # the credit beside a footer line: no chart gives up a line
        self.bottom.setContentsMargins(0, 0, 0, 0)
        self.bottom.setVerticalSpacing(0)
        self.bottom.addWidget(self.footer, 0, 0, 1, 2)
        self.bottom.addWidget(self.next_run, 1, 0, 1, 2)
        self.bottom.addWidget(self.source, 0, 1, Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter)
        self.bottom.setColumnStretch(0, 1)
        self._credit_row: int | None = None            # where the credit was last placed
        layout.addLayout(self.bottom)
        self.cover = QWidget(self)
        self.cover.setStyleSheet("background: black;")
        self.cover.hide()
        self._loans: list[_Loan] = []
        self.shown: str | None = None
        context.state.subscribe(self._state_changed)
        run_settings.subscribe(lambda _names: self.refresh())

    # --- showing a scene ---
    def show_scene(self, name: str | None) -> None:
        self.release()
        self.shown, self.notice = name, ""
        if name is None:
            return
        self.on_enter(name)
        # The holder is in the scene before any panel moves into it: a panel is never without a parent on the
        # way, which would make it a window of its own for a moment (and take the keyboard from the lecture).
        holder = QWidget(self.body)
        self.body_layout.addWidget(holder)
        inner = QHBoxLayout(holder) if BY_NAME[name].side_by_side else QVBoxLayout(holder)
        inner.setContentsMargins(0, 0, 0, 0)
        for widget, stretch in self.arrangements[name]:
            self._loans.append(_Loan(widget))
            inner.addWidget(widget, stretch)
            widget.show()
        self.refresh()
        self.cover.setVisible(self.context.state.blank)
        self.cover.raise_()

    def release(self) -> None:
        """Give every borrowed panel back to the workbench."""
        if self.shown is not None:
            self.on_leave(self.shown)
        for loan in reversed(self._loans):
            loan.give_back()
        self._loans = []
        while self.body_layout.count():
            item = self.body_layout.takeAt(0)
            if item.widget() is not None:
                item.widget().deleteLater()

    def _state_changed(self, names: set[str]) -> None:
        if "blank" in names:
            self.cover.setVisible(self.context.state.blank)
            self.cover.raise_()
        if "selected" in names or "pinned" in names:
            self.refresh()                            # a caption describes the step its chart shows

    def resizeEvent(self, event) -> None:  # noqa: N802 (Qt override)
        self.cover.setGeometry(self.rect())
        super().resizeEvent(event)
        if event.size().width() != event.oldSize().width():
            self.refresh()                            # the caption's two lines hold more or less now

    def set_theme(self, theme: th.Theme) -> None:
        font = QFont(self.font())
        font.setPointSizeF(theme.base_pt * 1.3)
        font.setBold(True)
        self.caption.setFont(font)
        credit = QFont(self.font())                    # a slide's credit line: smaller than what it credits
        credit.setPointSizeF(theme.base_pt * 0.85)
        self.source.setFont(credit)
        mono = QFontDatabase.systemFont(QFontDatabase.SystemFont.FixedFont)
        mono.setPointSizeF(theme.base_pt * 0.9)
        self.console.setFont(mono)
        self.refresh()

    def claim(self) -> str:
        """The whole caption as shown: the headline, its detail and whose figures they are."""
        return " ".join(t for t in (self.caption.text(), self.detail.text(),
                                    self.source.text() if self.source.isVisibleTo(self) else "") if t)

    def say(self, notice: str, until_idle: bool = False) -> None:
        """A refused key's reason, in the footer where the speaker looks; ``until_idle``: only while the work in
        progress winds down ("Stopping…" goes when the stop has taken effect)."""
        self.notice, self._notice_until_idle = notice, until_idle
        self.refresh()

    def work_ended(self) -> None:
        if self._notice_until_idle:
            self.notice, self._notice_until_idle = "", False
            self.refresh()

    # --- the words ---
    def refresh(self) -> None:
        if self.shown is None:
            return
        scene = BY_NAME[self.shown]
        claim = scene_claim(self.shown, self.context)
        self._set_caption(f"{scene.key} · {scene.title}: ", claim)
        source = scene_source(self.shown, self.context)
        self.source.setText(source)
        self.source.setVisible(bool(source))
        run = self.context.store.find(self.context.state.selected) if self.context.state.selected else None
        lines = console_lines(run) if self.shown == "prefill" else []
        self.console.setText("\n".join(lines))
        self.console.setVisible(bool(lines))
        self._progress()
        keys, settings = self._footer(scene)
        self.footer.setText(keys)
        self.next_run.setText(settings)
        self._place_credit()

    def _set_caption(self, title: str, claim: str) -> None:
        """The claim in at most ``CAPTION_LINES`` lines of large type at this width; what does not fit goes to
        the detail line below in the body's size."""
        margins = self.layout().contentsMargins()
        width = max(self.width() - margins.left() - margins.right(), 200)
        most = self.caption.fontMetrics().lineSpacing() * CAPTION_LINES + 2

        def fits(head: str) -> bool:
            self.caption.setText(head)
            return self.caption.heightForWidth(width) <= most

        head, detail = split_caption(title, claim, fits)
        self.caption.setText(head)
        self.detail.setText(detail)
        self.detail.setVisible(bool(detail))

    def _progress(self) -> None:
        """What is running in this scene, how far, and how to stop it."""
        store = self.context.store
        kind = scene_lesson(self.shown)
        record = store.latest_experiment(kind) if kind else None
        joined = lessons.joins().get(self.shown)
        if joined is not None:
            other = store.latest_experiment(joined[0])
            if other is not None and not other.finished and (record is None or record.finished):
                record = other
        run = self.context.store.find(self.context.state.selected) if self.context.state.selected else None
        if record is not None and not record.finished and record.progress is not None:
            p = record.progress
            self.progress.setRange(0, max(p.total, 1))
            self.progress.setValue(p.done)
            mine = run is not None and run.run_id in record.run_ids and run_phase(run).name == PREFILL
            clock = f" · {run_phase(run).elapsed_ms / 1000:,.1f} s into its prefill" if mine else ""
            self.progress_label.setText(f"{p.message}{clock} · Ctrl+. stops")
            self._show_progress()
            return
        if self.shown in RUN_SCENES and run is not None and not run.finished:
            done, total = run.n_steps, run.started.params.max_new_tokens
            self.progress.setRange(0, max(total, 1))
            self.progress.setValue(min(done, total))
            phase = run_phase(run)
            where = (f"prefill: {plural(run.prompt_tokens, 'prompt token')} {prefill_passes(run, forward=False)}, "
                     f"{phase.elapsed_ms / 1000:,.1f} s" if phase.name == PREFILL else f"token {done:,}")
            self.progress_label.setText(f"{where} · Ctrl+. stops")
            self._show_progress()
            return
        self.progress_box.hide()

    def _show_progress(self) -> None:
        """The bar as wide as its words ("41 of 128") in the type it has now: a fixed width squeezed them onto two
        clipped lines at lecture size (1920x1080)."""
        metrics = self.progress.fontMetrics()
        width = metrics.horizontalAdvance(f" {self.progress.maximum():,} of {self.progress.maximum():,} ")
        self.progress.setFixedWidth(max(width + 4 * metrics.height(), 160))
        self.progress_box.show()

    def _place_credit(self) -> None:
        """The credit goes beside whichever footer line leaves it room (the keys in most scenes, the settings in
        the batch scene), else on a line of its own below them."""
        if not self.source.text():
            return
        room = self.width() - self.layout().contentsMargins().left() - self.layout().contentsMargins().right()
        needed = QFontMetrics(self.source.font()).horizontalAdvance(self.source.text()) + 24

        def used(label: QLabel) -> int:
            bold = QFont(label.font())
            bold.setBold(True)                          # the keys are bold in places: measure as if all were
            return QFontMetrics(bold).horizontalAdvance(plain_text(label.text()))

        lines = (self.footer, self.next_run)
        row = next((i for i, line in enumerate(lines) if used(line) + needed <= room), 2)
        if row == self._credit_row:
            return                                      # refreshed every frame: lay out only when it moves
        self._credit_row = row
        for widget in (*lines, self.source):
            self.bottom.removeWidget(widget)
        for i, line in enumerate(lines):                # a line the credit is not beside spans both columns
            self.bottom.addWidget(line, i, 0, 1, 1 if i == row else 2)
        self.bottom.addWidget(self.source, row, 1 if row < 2 else 0, 1, 1 if row < 2 else 2,
                              Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter)

    def footer_text(self) -> str:
        """The footer's two lines as shown (rich text): the keys, and what the next run takes."""
        return f"{self.footer.text()}<br>{self.next_run.text()}"

    def _footer(self, scene) -> tuple[str, str]:
        keys = "".join(f"<b>{s.key}</b>" if s.name == scene.name else s.key for s in SCENES)
        joined = lessons.joins().get(scene.name)
        extra = f" · <b>{joined[1].key}</b> {escape(joined[1].words)}" if joined else ""
        settings = escape(self._keys_text(scene))
        letters = "".join(letter for letter, _name in PARAMETER_LETTERS)
        settings = re.sub(rf"\b([{letters}]) ", r"<b>\1</b> ", settings)
        notice = f" · <b>{escape(self.notice)}</b>" if self.notice else ""
        tried = self.context.state.what_if
        if scene.lesson is None and tried is not None:           # T, P, K filter the shown step again
            return (f"{keys} · <b>R</b> {escape(scene.action)} · Ctrl+. stop · B blank · Esc back",
                    f"<b>what if</b> {escape(tried.text())} (T P K change it, no rerun) · <b>W</b> back to what ran · "
                    f"←/→ tokens{notice}")
        what_if = " · <b>W</b> what if" if scene.lesson is None else ""
        return (f"{keys} · <b>R</b> {escape(scene.action)}{extra} · Ctrl+. stop · B blank · Esc back",
                f"next run: {settings}{what_if} · ←/→ tokens{notice}")


    def _keys_text(self, scene) -> str:
        """What T, P, K and M change in this scene, with the values R will run: the run settings in a run scene;
        in an experiment scene the lesson's own settings those keys are declared on, the rest said not to apply."""
        if scene.lesson is None:
            c = self.run_settings.choices
            parts = [f"{letter} {setting_text(param_shape(name), getattr(c, name), short=True)}"
                     for letter, name in PARAMETER_LETTERS]
            return " · ".join(parts) + " (Shift lowers)"
        lesson = lessons.BY_KIND[scene.lesson].lesson
        settings = self.context.choices.settings.get(scene.lesson) or lesson.settings()
        keyed = [(letter, self.context.choices.keyed(scene.lesson, lesson.settings, letter))
                 for letter, _name in PARAMETER_LETTERS]
        parts = [f"{letter} {setting_text(shape, getattr(settings, shape.name), short=True)}"
                 for letter, shape in keyed if shape is not None]
        idle = [letter for letter, shape in keyed if shape is None]
        if not parts:
            return f"{'/'.join(idle)}: not in this scene (its tab sets the experiment)"
        return " · ".join(parts) + " (Shift lowers)" + (f" · {'/'.join(idle)}: not in this scene" if idle else "")


def plain_text(rich: str) -> str:
    """What a rich-text label reads as, its tags and entities gone (for measuring its width)."""
    return unescape(re.sub(r"<[^>]+>", "", rich))


def scene_lesson(name: str | None) -> str | None:
    scene = BY_NAME.get(name) if name else None
    return scene.lesson if scene is not None else None


def scene_claim(name: str, context: Context) -> str:
    """The scene's claim with its live number (plain text, shown as text)."""
    kind = scene_lesson(name)
    if kind is not None:
        record = context.store.latest_experiment(kind)
        window_lesson = lessons.BY_KIND[kind]
        parts = [lesson_claim(window_lesson, record, context)]
        joined = lessons.joins().get(name)
        if joined is not None:
            other = context.store.latest_experiment(joined[0])
            parts = [p for p in (parts[0], lesson_claim(lessons.BY_KIND[joined[0]], other, context)) if p] or [
                f"press R for the {window_lesson.lesson.title.lower()}, {joined[1].key} for {joined[1].words}"]
        return "; ".join(p for p in parts if p)
    run = context.store.find(context.state.selected) if context.state.selected else None
    return run_claim(name, run, context.state, context.store.activity)


def scene_source(name: str, context: Context) -> str:
    """Whose figures the scene shows, when they are not this machine's now: a replayed run or experiment says
    where and when it was recorded ("recorded 2026-12-02 on …, float32"), as a slide credits its data."""
    kind = scene_lesson(name)
    if kind is not None:
        joined = lessons.joins().get(name)
        records = [context.store.latest_experiment(k) for k in (kind, *(joined[:1] if joined else ()))]
    else:
        records = [context.store.find(context.state.selected) if context.state.selected else None]
    words = list(dict.fromkeys(r.recorded for r in records if r is not None and r.recorded))
    return "; ".join(words)


def lesson_claim(window_lesson: WindowLesson, record, context: Context) -> str:
    """A lesson's caption, true to where its experiment is: a stopped or failed one says so and how far it got
    first; "measured on a busy machine" only beside something measured."""
    if record is None:
        busy_now = elsewhere(context.store)
        if busy_now:                              # R would be refused: say what runs instead of inviting it
            return f"{busy_now}; R starts {window_lesson.lesson.title.lower()} when it is done"
        return window_lesson.caption(None, context)
    return _finished_claim(window_lesson, record, context)


def elsewhere(store: RunStore) -> str:
    """What the engine is busy with, in words, naming a running experiment and how far it is ("" when idle)."""
    if store.activity == "experiment":
        running = next((e for e in reversed(store.experiments) if not e.finished), None)
        if running is not None:
            title = engine_lessons.lesson(running.kind).title
            return f"{title} is running ({experiment_phase(running, store.now()).words()}; Ctrl+. stops it)"
    return BUSY_WORDS.get(store.activity, store.activity or "")


def _finished_claim(window_lesson: WindowLesson, record, context: Context) -> str:
    phase = experiment_phase(record, context.store.now())
    if record.result is None:                 # running: where it is, never the "press R" of no experiment
        return phase.words()
    caption = window_lesson.caption(record, context)
    if phase.name in (STOPPED, FAILED):
        caption = f"{phase.words()}" + (f"; {caption}" if caption else "")
    badge = busy_badge(record.result) if phase.measured else ""
    return caption + badge


def run_claim(name: str, run: RunRecord | None, state: ViewState, activity: str | None = None) -> str:
    """A run scene's claim from what is known now (``app.state.phase``): nothing before the prefill ends, "measured"
    only beside a measured figure, a run that is held or has ended said so, and the step the scene's chart shows.
    ``activity``: what the engine is busy with (no run to show: R waits for it)."""
    if run is None:
        if activity:
            return f"{BUSY_WORDS.get(activity, activity)}: R runs the prompt when it is done"
        return "press R (or Ctrl+Enter) to run the prompt"
    phase, f = run_phase(run), figures(run)
    where = f" · {phase.words()}" if phase.name != FINISHED else ""
    if run.remote:
        if f.ttft_ms is None:
            return f"through {run.model.engine}: {phase.words()}"
        rate_text = f" and {decode_rate(f.decode_tok_s)}" if f.decode_tok_s is not None else ""
        return (f"through {run.model.engine}: TTFT {f.ttft_ms:,.0f} ms{rate_text} as this client measured them; a "
                f"server reveals no per-layer cache, no prefill pass, no attention{where}")
    if phase.name == PREFILL or (phase.ended and not run.prefilled):
        return phase.words()
    busy_words = f" · {busy_clause(f.cpu_share, phase.running)}" if busy(f.cpu_share) else ""
    if name == "prefill":
        ttft = f", TTFT {f.ttft_ms:,.0f} ms" if f.ttft_ms is not None else ""
        prefill = (f"prefill read {plural(f.prompt_tokens, 'prompt token')} {prefill_passes(run, forward=False)} "
                   f"({f.prefill_ms:,.0f} ms"
                   f"{ttft}, measured)")
        if f.decode_runs and f.decode_ms:
            decode = (f"; decode made {plural(f.decode_runs, 'token')} one pass each, "
                      f"{per_token(f.decode_ms / f.decode_runs)} (measured)")
        elif phase.running and f.ttft_ms is not None:
            decode = "; decode follows, one pass per token"
        elif phase.ended:
            decode = "; no decode step ran"
        else:
            decode = ""
        return f"{prefill}{decode}{busy_words}{where}"
    if name == "kv":
        if not run.started.params.kv_cache:
            return f"this run kept no KV cache: every step recomputed all positions{where}"
        kv, fmt = run.kv_check(), kvformula.format_bytes
        if not kv.full:
            check = (f"kept as {kv.method}: {kv.share:.0%} of the formula's {fmt(kv.predicted)}"
                     if kv.share is not None else f"kept as {kv.method}")
        else:
            check = "= the formula ✓" if kv.equal else f"≠ the formula's {fmt(kv.predicted)} ✗"
        storage = f"; {fmt(kv.allocated)} allocated" if kv.allocated else ""
        released = "; released when the run failed" if phase.released else ""
        positions = (f"{run.kv_allocated:,} positions allocated up front ({kv.positions:,} in use)"
                     if run.kv_allocated else f"{kv.positions:,} positions")
        return (f"{kvformula.bytes_per_token(run.model):,} B per position (formula) × {positions}: "
                f"the cache held {fmt(kv.held)} (measured) {check}{storage}{released}{where}")
    if name == "sampling":
        index = state.shown_step(run.run_id, run.n_steps)
        if index is None:
            return f"the candidates appear with the first token{where}"
        step = run.steps[index]
        tried = state.what_if
        result = refilter([c.p_raw for c in step.candidates], tried.temperature, tried.top_k, tried.top_p) \
            if tried is not None and step.position is not None and step.candidates else None
        said = _plain(sampling_caption(step, run.started.params, getattr(run.model, "vocab_size", 0))) + where
        return said + ("; " + _plain(what_if_caption(step, tried, result, short=True)) if result is not None else "")
    if name == "attention":
        if not run.attention:
            if phase.ended:
                return f"this run did not record attention: press R to run the prompt recording it{where}"
            return f"the attention appears with the first recorded pass{where}"
        step = run.attention[state.shown_step(run.run_id, len(run.attention))]
        sink, recent = attention_shares(step)
        sink_text = f"{sink:.0%} of its attention on the first token (the sink), " if sink is not None else ""
        costs = [a.capture_ms for a in run.attention]
        mean = sum(costs) / len(costs)
        return (f"the newest token reads all {step.position + 1:,} cached positions: {sink_text}{recent:.0%} on the "
                f"newest {RECENT}; recording costs {mean:,.1f} ms per pass ({min(costs):,.1f}-{max(costs):,.1f} over "
                f"{len(costs)} passes, measured){where}")
    return ""


BUSY_WORDS = {"load": "a model is loading", "run": "a run is in progress", "experiment": "an experiment is running",
              "replay": "a trace is replaying", "peaks": "this machine's peaks are being measured"}


def busy_clause(cpu_share: float, running: bool) -> str:
    """The busy note beside figures, with the share that makes it one: "so far" while the run goes on."""
    return f"on a busy machine ({cpu_share:.0%} CPU{' so far' if running else ''})"


def console_lines(run: RunRecord | None) -> list[str]:
    """The run as llama.cpp prints it (``prompt eval time``, ``eval time``, ``total time``), each line once its
    figures are measured: the prompt's once the prefill has ended, decode's from its first step, the total at the
    end. A server's run has no prefill pass of its own to report."""
    if run is None or run.remote or not run.prefilled:
        return []
    s = run.summary(with_text=False)
    lines = report.timing_lines(s)
    shown = [lines[0]] + ([lines[1]] if s.decode_runs else []) + ([lines[2]] if run.finished else [])
    return shown


def scene_run(name: str, store: RunStore, sources: tuple[str, ...] = ()) -> str | None:
    """The run a run scene shows when it opens: the newest one that recorded attention for the attention scene,
    the newest plain run (not an experiment's, not one recording attention) for the others, so a lecture
    replayed from several traces shows each scene's own run; with ``sources``, only runs replayed from those
    traces (a lecture file's scene and its own traces) or run here since (a live run replaces the shipped one)."""
    if name not in RUN_SCENES:
        return None
    own = [r for r in store.runs if not r.started.experiment and r.started.kind != "chat"
           and (not sources or r.source in sources or not r.source)]
    wanted = [r for r in own if (name == "attention") == r.started.params.capture_attention]
    return wanted[-1].run_id if wanted else None


def cutting_step(run: RunRecord) -> int | None:
    """The step where the filters cut the most candidates while leaving a choice (several survivors), if any:
    where the sampling scene opens, so the lesson (filters removing candidates) shows."""
    best, most = None, 0
    for step in run.steps:
        cut = sum(1 for c in step.candidates if c.p_raw > 0 and c.p_final == 0.0)
        if cut > most and step.kept > 1:
            best, most = step.step, cut
    return best


def _plain(rich: str) -> str:
    """Rich text from a panel's caption, as plain words for a scene caption."""
    return unescape(re.sub(r"<[^>]+>", "", rich))
