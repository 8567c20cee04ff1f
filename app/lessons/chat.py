"""The chat comparison (cache reuse on vs off, several repeats): drawn in the Chat panel beside the user's own
conversation, so it has no tab of its own. Medians per turn as lines, every repeat as a dot, and a difference
called only where the spreads of the repeats do not overlap."""

from __future__ import annotations

import html

import pyqtgraph as pg

from app.state.store import ExperimentRecord
from app.views import theme as th
from app.views.chart import Chart
from app.views.lesson_view import Scene, WindowLesson
from engine.facts import contention
from engine.lessons import chat
from engine.lessons.chat import ChatResult, TurnPoint


def draw(chart: Chart, record: ExperimentRecord, width: float) -> None:
    for reuse, colour in ((True, th.DECODE), (False, th.CACHE_OFF)):
        points = [p for p in record.typed(TurnPoint) if p.reuse == reuse]
        if not points:
            continue
        by_turn: dict[int, list[float]] = {}
        for p in points:
            by_turn.setdefault(p.turn, []).append(p.ttft_ms)
        turns = sorted(by_turn)
        medians = [sorted(v)[len(v) // 2] for v in (by_turn[t] for t in turns)]
        chart.add(pg.PlotDataItem(turns, medians, pen=th.run_pen(colour, width, not reuse)),
                  f"reuse {'on' if reuse else 'off'} (measured, median of repeats)")
        chart.add(pg.ScatterPlotItem([p.turn for p in points], [p.ttft_ms for p in points], size=8,
                                     brush=colour, pen=None))


def explanation(r: ChatResult) -> str:
    """What the repeats show, and only what they show; a busy machine is named."""
    if not r.per_turn or r.incomplete:
        return ""
    note = f" ({html.escape(r.tokens_note)})" if r.tokens_note else ""
    match = "the same tokens ✓" if r.tokens_match else f"DIFFERENT tokens ✗{note}"
    last = r.per_turn[-1]
    if last.clear:
        verdict = (f"with reuse TTFT is <b>{last.off_ms / last.on_ms:.1f}x lower</b>" if last.on_ms < last.off_ms
                   else f"with reuse TTFT is {last.on_ms / last.off_ms:.1f}x <b>higher</b>")
    else:
        verdict = "the difference is <b>within the noise</b> (the spreads overlap)"
    clear = sum(t.clear for t in r.per_turn)
    text = (f"Both ways gave {match}. Turn {last.turn}, {repeats_words(r.repeats)}: {last.on_ms:,.0f} ms with "
            f"reuse ({last.on_range[0]:,.0f}–{last.on_range[1]:,.0f}) vs {last.off_ms:,.0f} ms without "
            f"({last.off_range[0]:,.0f}–{last.off_range[1]:,.0f}): {verdict}. {clear} of {r.turns} turns differ "
            "beyond the spread of the repeats.")
    busy = contention.busy_note(r.lowest_cpu_share)
    return text + (f" <b>Note:</b> some turns were {html.escape(busy)}." if busy else "")


def repeats_words(repeats: int) -> str:
    """How a turn's time was taken: "median of 3 repeats", or "one run each" (a median of one is no median)."""
    return "one run each" if repeats == 1 else f"median of {repeats:,} repeats"


def caption(record: ExperimentRecord | None, context: object = None) -> str:
    """The comparison in one line; before there is one, the last turn of the user's own conversation."""
    r = record.result if record is not None else None
    if r is not None and r.per_turn and not r.incomplete:
        last = r.per_turn[-1]
        if last.clear:
            verdict = (f"reuse {last.off_ms / last.on_ms:.1f}x faster" if last.on_ms < last.off_ms else
                       f"reuse {last.on_ms / last.off_ms:.1f}x slower")
        else:
            verdict = "within the noise of the repeats"
        same = "same replies" if r.tokens_match else "replies differ" + (" (16-bit rounding)" if r.tokens_note
                                                                         else " ✗")
        return (f"turn {last.turn} TTFT {last.on_ms:,.0f} ms with the cache kept vs {last.off_ms:,.0f} ms "
                f"re-prefilled ({repeats_words(r.repeats)}): {verdict}; {same}")
    conversation, store = getattr(context, "conversation", None), getattr(context, "store", None)
    if conversation is not None and conversation.turn_runs and store is not None:
        last_run = store.find(conversation.turn_runs[-1])
        if last_run is not None and last_run.prefilled and not last_run.remote:
            t = last_run.summary(with_text=False)
            return (f"turn {len(conversation.turn_runs)}: {t.reused_tokens:,} positions reused from the cache, "
                    f"{t.prompt_tokens:,} prefilled, TTFT {t.ttft_ms:,.0f} ms (measured)")
    return "type a message below (Ctrl+Shift+Enter sends it); R compares reuse on vs off"


WINDOW = WindowLesson(
    lesson=chat.LESSON, view=None, caption=caption, scene=Scene("chat", "Conversations", order=7,
                                                                action="compare reuse on vs off"),
    dock="chat",                          # drawn in the Chat panel, beside the user's own conversation
    follows=("turns", "conversation"))    # the conversation's turns, when there is one
