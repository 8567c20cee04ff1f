"""Decode with the KV cache on vs off: each step's latency both ways (off climbing, on flat), the measured
speedup beside the cost model's FLOPs ratio, and the token check."""

from __future__ import annotations

import numpy as np
import pyqtgraph as pg

from app.state.store import ExperimentRecord
from app.views import theme as th
from app.views.lesson_view import CONTROLS_PROMPT, LessonView, Scene, WindowLesson, token_note
from engine.facts import costmodel
from engine.lessons import cache
from engine.lessons.cache import CachePoint, CacheResult


class CacheView(LessonView):
    lesson = cache.LESSON
    axes = ("decode step", None, "latency", "ms")
    point = CachePoint
    presets = {"prompt": [("the first sample prompt", None), ("the prompt in Controls", CONTROLS_PROMPT)]}

    def latencies(self, record: ExperimentRecord) -> dict[bool, np.ndarray]:
        runs = [r for r in (self.store.find(run_id) for run_id in record.run_ids) if r is not None]
        return {run.started.params.kv_cache: run.series["latency_ms"].values[1:] for run in runs}

    def draw(self, record: ExperimentRecord) -> None:
        for kv, lat in self.latencies(record).items():
            self.chart.add(pg.PlotDataItem(np.arange(1, len(lat) + 1), lat,
                                           pen=th.run_pen(th.run_colour(kv), self.theme.line_width * 1.5, not kv)),
                           f"KV cache {'on' if kv else 'off'} (measured)")

    def explanation(self, record: ExperimentRecord) -> str:
        r: CacheResult = record.result
        if r.decode_speedup is None:
            return ""
        latency = self.latencies(record)
        step = min(len(latency.get(True, [])), len(latency.get(False, [])))
        at_step = (f"At step {step}: <b>{latency[False][step - 1]:,.0f} ms vs {latency[True][step - 1]:,.0f} ms per "
                   f"step, {latency[False][step - 1] / latency[True][step - 1]:.1f}x</b> (measured). " if step else "")
        match = "identical ✓" if r.tokens_match else f"DIFFERENT ✗{token_note(r)}"
        backwards = cache.backwards_words(r)
        if backwards:
            return (f"{at_step}Tokens with and without the cache: <b>{match}</b>. <b>This result is {backwards}.</b> "
                    "Without the cache every step recomputes the whole sequence, so on a quiet machine its latency "
                    "grows with length while the cached steps stay flat.")
        return (f"{at_step}Tokens with and without the cache: <b>{match}</b>. Decode with the cache is "
                f"<b>{r.decode_speedup:.2f}x faster</b> (measured) for {r.generated} tokens after a {r.prompt_tokens}-"
                f"token prompt; the cost model says {r.flops_ratio:.1f}x fewer FLOPs (whole model, computed) and "
                f"{r.attention_flops_ratio:.0f}x fewer attention FLOPs (the seed's model). Without the cache every "
                "step recomputes the whole sequence, so its latency grows with length; with it, each step reads the "
                "cache and stays flat.")


def caption(record: ExperimentRecord | None, context: object = None) -> str:
    """The lecture scene's claim with its live number (plain text)."""
    r = record.result if record is not None else None
    if r is None or r.decode_speedup is None:
        return "press R to run the same prompt with the cache on and off"
    if cache.backwards_words(r):
        return cache.backwards_words(r)
    return (f"without the cache every step recomputes the whole sequence: decode {r.decode_speedup:.1f}x slower "
            f"(measured); the cost model counts {r.flops_ratio:.0f}x the FLOPs, the course's example "
            f"{costmodel.course_cache_reduction():.1f}x: that counts attention alone (100 + 50 tokens), while a "
            "small model's step is mostly reading its weights, which the cache does not save")


WINDOW = WindowLesson(
    lesson=cache.LESSON, view=CacheView, caption=caption,
    scene=Scene("cache", "KV cache on vs off", order=3, action="cache on vs off"))
