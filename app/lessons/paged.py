"""Paged KV: one row per running request, one cell per block in its table (shared prefix blocks with how many
requests point at them, the request's own blocks, the unwritten part of its last block), the pool below; a
slider scrubs through the steps, opening on the step that held the most."""

from __future__ import annotations

from html import escape

import pyqtgraph as pg
from PySide6.QtCore import Qt
from PySide6.QtWidgets import QComboBox, QSlider, QTextBrowser

from app.state.store import ExperimentRecord
from app.views.lesson_view import LessonView, Scene, WindowLesson, fold_button, token_note
from app.views.prefix_chart import PrefixChart
from engine.facts import kvformula
from engine.lessons import paged
from engine.lessons.paged import PagedRequestPoint, PagedResult
from engine.serve.block_events import BlockTable, PrefixMiss
from engine.serve.prefix_tree import tree_of

SHARED, PRIVATE, CACHED, FREE = "#CC79A7", "#0072B2", "#56B4E9", "#DDDDDD"
DIVERGED = "#D55E00"        # the token where a prompt left the nearest earlier one
MISS_PX = 150               # the list of requests and the chosen one's prompt and reason


class PagedView(LessonView):
    lesson = paged.LESSON
    axes = ("block in the request's table", None, "request", None)
    point = PagedRequestPoint

    def build(self) -> None:
        self.chosen_step: int | None = None
        self.step_slider = QSlider(Qt.Orientation.Horizontal)
        self.step_slider.setToolTip("Which step's block table to show (it starts at the step that held most)")
        self.step_slider.valueChanged.connect(self._step_chosen)
        self.charts_layout.addWidget(self.step_slider)
        # The same view the real server's KV events draw (the server-load tab), from this cache's block tables
        self.tree_chart = PrefixChart("The same blocks as a prefix tree (as a serving engine's are drawn)")
        self.tree_chart.set_least_data(110)
        self.charts_layout.addWidget(self.tree_chart, 2)
        self.share_labels: list[pg.TextItem] = []
        self.plot.getViewBox().sigResized.connect(lambda *_: self._fit_share_labels())
        # Why each request's computed prompt tokens were not read from the cache: pick one, see its prompt
        self.miss_box = QComboBox()
        self.miss_box.setToolTip("A request: its prompt with the span read from the cache, where it left the nearest "
                                 "earlier prompt, and why the rest was computed")
        self.miss_box.currentIndexChanged.connect(lambda _i: self._show_miss())
        self.miss_text = QTextBrowser()
        self.miss_text.setMaximumHeight(MISS_PX - 30)
        self.misses: list[PrefixMiss] = []
        # Below the explanation, above the table; on a short dock it folds behind a click, as the table does
        layout = self.layout()
        for widget in (self.miss_box, self.miss_text):
            layout.insertWidget(layout.indexOf(self.table), widget)
            widget.hide()                       # until a run says why its requests missed
        self.miss_fold = fold_button("Why each request missed")
        self.miss_fold.toggled.connect(lambda _on: self._fold())
        self.folds.layout().addWidget(self.miss_fold)

    def _fit_share_labels(self) -> None:
        """A shared block's "×N" (how many requests hold it) is drawn inside its cell where the cell is large
        enough to hold it, and not at all where it is not: across the cell's edge it read as belonging to the next
        block (a 720p scene). The legend and the step's words say which blocks are shared."""
        x_units, y_units = self.plot.getViewBox().viewPixelSize()
        for label in self.share_labels:
            box = label.textItem.boundingRect()
            label.setVisible(box.width() * abs(x_units) <= 0.9 and box.height() * abs(y_units) <= 0.8)

    def style_charts(self, theme) -> None:
        super().style_charts(theme)
        self.tree_chart.style_tree(theme)

    def set_compact(self, compact: bool) -> None:
        """The scene shows the block tables (its claim); the tree, for comparing with a real server, stays in the
        tab."""
        super().set_compact(compact)
        self.tree_chart.setVisible(not compact)

    def _fold(self) -> None:
        super()._fold()
        if not hasattr(self, "miss_fold"):
            return                              # (the base class folds once before this view is built)
        folded = self._short and not self._scene
        shown = bool(self.misses) and not self._scene and (not folded or self.miss_fold.isChecked())
        self.miss_fold.setVisible(folded and bool(self.misses))
        self.miss_box.setVisible(shown)
        self.miss_text.setVisible(shown)

    def _table_height(self) -> int:
        """The table and, once there are requests to explain, the list that says why each missed (both fold
        together on a short dock)."""
        return super()._table_height() + (MISS_PX if getattr(self, "misses", None) else 0)

    def _step_chosen(self, index: int) -> None:
        self.chosen_step = index
        self._shown = self._drawn = None
        self.refresh()

    def draw(self, record: ExperimentRecord) -> None:
        tables = record.of(BlockTable)
        if not tables:
            return
        peak = max(range(len(tables)), key=lambda i: len({b for t in tables[i].tables for b in t}))
        self.step_slider.blockSignals(True)
        self.step_slider.setRange(0, len(tables) - 1)
        index = peak if self.chosen_step is None or self.chosen_step >= len(tables) else self.chosen_step
        self.step_slider.setValue(index)
        self.step_slider.blockSignals(False)
        table = tables[index]
        refs = dict(zip(table.shared_blocks, table.shared_refs))
        cells: dict[str, list[tuple[float, float, float]]] = {"shared": [], "own": [], "unwritten": []}
        labels = []
        for row, (blocks, held) in enumerate(zip(table.tables, table.positions)):
            for slot, block in enumerate(blocks):
                cells["shared" if block in refs else "own"].append((slot, row, 1.0))
                if block in refs and slot == 0:
                    labels.append((slot, row, f"×{refs[block]}"))
            spare = len(blocks) * table.block_positions - held
            if spare > 0 and blocks:
                fraction = spare / table.block_positions
                cells["unwritten"].append((len(blocks) - fraction, row, fraction))
        pool_row = len(table.running) + 0.5
        held = len({b for t in table.tables for b in t})
        pool = (("held", 0.0, held, PRIVATE), ("cached", held, len(table.cached_blocks), CACHED),
                ("free", held + len(table.cached_blocks), table.free_blocks, FREE))
        for name, colour in (("shared", SHARED), ("own", PRIVATE), ("unwritten", FREE)):
            if cells[name]:
                self.chart.add(pg.BarGraphItem(x0=[c[0] for c in cells[name]], y=[c[1] for c in cells[name]],
                                               width=[c[2] for c in cells[name]], height=0.8, brush=colour,
                                               pen=pg.mkPen(self.theme.background)),
                               {"shared": "shared prefix block", "own": "the request's own block",
                                "unwritten": "allocated, not yet written"}[name])
        for name, start, count, colour in pool:
            if count:
                self.chart.add(pg.BarGraphItem(x0=[start], y=[pool_row], width=[count], height=0.8, brush=colour,
                                               pen=None), "pool: kept for reuse" if name == "cached" else None)
        self.share_labels = []
        for x, y, text in labels:
            label = pg.TextItem(text, color="#FFFFFF", anchor=(0, 0.5))
            label.setFont(self.theme.axis_font)
            label.setPos(x + 0.05, y)
            self.chart.add(label)
            self.share_labels.append(label)
        self._fit_share_labels()
        ticks = [(row, f"#{request}") for row, request in enumerate(table.running)]
        self.plot.getAxis("left").setTicks([ticks + [(pool_row, f"pool ({table.total_blocks:,} blocks)")], []])
        self.plot.invertY(True)
        self.step_words = step_words(table, index, len(tables), peak)
        sharing = [t for t in tables[:index + 1] if t.exp_id == table.exp_id]
        self.tree_chart.show(tree_of([sharing[-1]]) if sharing else tree_of([]))
        self._list_misses(record.of(PrefixMiss))

    def _list_misses(self, misses: list[PrefixMiss]) -> None:
        if [m.request for m in misses] == [m.request for m in self.misses] and misses == self.misses:
            return
        chosen = self.miss_box.currentIndex()
        self.misses = misses
        self.miss_box.blockSignals(True)
        self.miss_box.clear()
        for m in misses:
            self.miss_box.addItem(f"Request {m.request}: {m.cached_tokens:,} of {m.prompt_tokens:,} prompt tokens "
                                  f"from the cache, {m.computed_tokens:,} computed ({m.reason})")
        self.miss_box.setCurrentIndex(min(max(chosen, 0), len(misses) - 1) if misses else -1)
        self.miss_box.blockSignals(False)
        self._fold_when_short()
        self._fold()
        self._show_miss()

    def _show_miss(self) -> None:
        i = self.miss_box.currentIndex()
        self.miss_text.setHtml(miss_html(self.misses[i]) if 0 <= i < len(self.misses) else "")

    def explanation(self, record: ExperimentRecord) -> str:
        r: PagedResult = record.result
        words = getattr(self, "step_words", "")
        if not r.peak_blocks_shared:
            return words
        mib = 2**20
        same = "identical ✓" if r.same_tokens_as_ours else "different"
        solo = "each request's tokens equal its solo run ✓" if r.tokens_match_solo else \
            f"tokens DIFFER from solo runs ✗{token_note(r)}"
        ours = (f" Same arrivals through KVScope's own scheduler: {r.ours_tok_s:,.0f} tok/s, mean TTFT "
                f"{r.ours_mean_ttft_ms:,.0f} ms (measured); transformers' paged batching {r.transformers_tok_s:,.0f} "
                f"tok/s, {r.transformers_mean_ttft_ms:,.0f} ms; tokens {same}." if r.ours_tok_s is not None else "")
        return (f"{words} At the peak the paged cache held <b>{r.peak_bytes_shared / mib:,.1f} MiB</b> with sharing "
                f"and {r.peak_bytes_unshared / mib:,.1f} MiB without (measured block counts × "
                f"{r.bytes_per_block / 1024:,.0f} KiB per block, computed); a contiguous cache reserving prompt + "
                f"{r.reserve} positions per request would hold {r.contiguous_bytes_at_peak / mib:,.1f} MiB (computed) "
                f"for {r.used_bytes_at_peak / mib:,.1f} MiB of written positions. {r.prefix_words().capitalize()} is "
                f"{r.shared_prefix_tokens} tokens ({r.shared_prefix_blocks} full blocks); {solo}.{ours}")


def miss_html(m: PrefixMiss) -> str:
    """The prompt token by token: the span read from the cache on its colour, the token where it left the nearest
    earlier prompt marked, then why (the allocator's observations in words)."""
    out = []
    for position, piece in enumerate(m.prompt_pieces):
        text = escape(piece).replace("\n", "↵")
        if position == m.divergent_position:
            out.append(f'<b style="color:{DIVERGED}; text-decoration: underline">{text}</b>')
        elif position < m.cached_tokens:
            out.append(f'<span style="background:{CACHED}">{text}</span>')
        else:
            out.append(text)
    where = ""
    if m.divergent_position is not None:
        where = (f" At position {m.divergent_position:,} it has {escape(repr(m.request_text))} where request "
                 f"{m.nearest_request} had {escape(repr(m.cached_text))}.")
    return (f"<p>{''.join(out)}</p><p><b>{m.cached_tokens:,} cached</b> (blue), {m.computed_tokens:,} computed "
            f"(measured by the allocator): <b>{escape(m.reason)}</b>: {escape(m.words)}.{where}</p>")


def step_words(table, index: int, count: int, peak: int) -> str:
    held = len({b for t in table.tables for b in t})
    shared = f", {len(table.shared_blocks)} of them shared by up to {max(table.shared_refs)} requests" \
        if table.shared_blocks else ""
    waiting = f"; {len(table.waiting)} waiting" if table.waiting else ""
    which = " (the most held)" if index == peak else ""
    return (f"Step {table.step}{which}, {index + 1} of {count}: {len(table.running)} requests hold "
            f"<b>{held} blocks</b> of {table.block_positions} positions{shared}{waiting}; "
            f"{len(table.cached_blocks)} kept for reuse, {table.free_blocks} free.")


def caption(record: ExperimentRecord | None, context: object = None) -> str:
    """The lecture scene's claim with its live number (plain text)."""
    r = record.result if record is not None else None
    if r is None or not r.peak_blocks_shared:
        return "press R: requests sharing a system prompt arrive and are served from one pool of blocks"
    size = kvformula.format_bytes
    shared = "shared-prefix" if r.workload else "system-prompt"
    return (f"{r.shared_prefix_blocks} {shared} blocks held once for every request: "
            f"{size(r.peak_bytes_shared)} at the peak instead of {size(r.peak_bytes_unshared)} unshared "
            f"(measured); a contiguous cache would reserve {size(r.contiguous_bytes_at_peak)} (computed)")


WINDOW = WindowLesson(
    lesson=paged.LESSON, view=PagedView, caption=caption,
    scene=Scene("paged", "Paged KV and prefix sharing", order=11, action="serve the requests"))
