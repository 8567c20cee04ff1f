"""Lesson: prefill cost against prompt length. Prompt lengths double from ``start`` to the context (or
``max_length``); each is prefilled a few times after a warm-up, and the median time and TTFT are charted beside
the cost model's prediction. The fitted exponent says how time scales: short prompts are dominated by reading
the weights and fixed costs (below n), long ones by 2 x parameters FLOPs per token and then attention's n^2.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Any

from engine.facts import costmodel
from engine.facts.errors import ParameterError
from engine.facts.events import ExperimentPoint, LessonResult, LessonSettings
from engine.facts.fields import MAX_CONTEXT, Column, Count, Number, Range, Setting
from engine.facts.vocabulary import LessonPoint, of, table_lines
from engine.run.experiment import Experiment, Lesson
from engine.run.workloads import filler_ids

NOISY_SPREAD = 1.25      # a length whose slowest repeat took this much longer than its fastest is a noisy point


@dataclass(frozen=True)
class PrefillSettings(LessonSettings):
    kind = "prefill"

    max_length: Annotated[int, Range(2, MAX_CONTEXT), Setting(
        "--max-length", "Longest prompt", "longest prompt (default: the model's whole context)", "tokens")] | None \
        = 1024
    start: Annotated[int, Range(1, MAX_CONTEXT), Setting(
        "--start", "Shortest prompt", "shortest prompt", "tokens")] = 16
    repeats: Annotated[int, Range(1, 100), Setting(
        "--repeats", "Timed repeats per length", "timed repeats per length, after one warm-up")] = 3

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.max_length is not None and self.max_length < self.start:
            raise ParameterError(f"max_length ({self.max_length:,}) must be at least start ({self.start:,})")


@dataclass(frozen=True)
class PrefillResult(LessonResult):
    kind = "prefill"

    points: Count = 0
    exponent: Number | None = None              # time ~ n^exponent, all points (measured fit)
    exponent_short: Number | None = None        # the shorter half
    exponent_long: Number | None = None         # the longer half
    doubled_from: Count = 0                     # the last doubling: from this many tokens ...
    doubled_to: Count = 0                       # ... to this many
    last_doubling_x: Number | None = None       # how much longer it took (measured)
    flops_doubling_x: Number | None = None      # how many more FLOPs it needs (computed)
    predicted_exponent: Number | None = None    # the cost model's exponent over the same lengths
    largest_spread: Number | None = None        # the widest slowest/fastest repeat ratio of any length
    noisy: bool = False                         # some length's repeats spread more than NOISY_SPREAD
    widened_from: Count = 0                     # prompts this long or longer ran their products widened to
    #                                             float32 (a half float this CPU emulates); 0: none did


@dataclass(frozen=True)
class PrefillPoint(LessonPoint):
    """One prompt length: the medians of its timed repeats, their spread, and the cost model's figures."""

    series = "prefill"

    tokens: Annotated[int, Column("prompt tokens", "{:,d}")]
    prefill_ms: Annotated[float, Column("prefill ms (median)")]
    ttft_ms: Annotated[float, Column("TTFT ms")]
    prefill_ms_min: float
    prefill_ms_max: float
    flops: Annotated[float, Column("GFLOPs (computed)", "{:,.3g}", scale=1e-9)]
    attention_flops: float
    predicted_ms: Annotated[float | None, Column("predicted ms (computed)")] = None


def doubling_lengths(start: int, limit: int) -> list[int]:
    lengths, n = [], start
    while n <= limit:
        lengths.append(n)
        n *= 2
    return lengths


def fitted_exponent(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Least-squares slope of log(y) against log(x): time ~ n^slope."""
    lx, ly = [math.log(x) for x in xs], [math.log(y) for y in ys]
    mx, my = statistics.fmean(lx), statistics.fmean(ly)
    den = sum((a - mx) ** 2 for a in lx)
    return sum((a - mx) * (b - my) for a, b in zip(lx, ly)) / den if den else float("nan")


def _limit(target: Any, settings: PrefillSettings) -> int:
    context = target.facts.max_context
    return min(settings.max_length or context, context - 1)


def check(target: Any, settings: PrefillSettings) -> None:
    limit = _limit(target, settings)
    if limit < settings.start:
        raise ParameterError(f"The sweep needs 1 <= shortest prompt ({settings.start:,}) <= longest ({limit:,}, the "
                             "model's context less one)")


def run(experiment: Experiment, settings: PrefillSettings) -> PrefillResult:
    session = experiment.session
    lengths = doubling_lengths(settings.start, _limit(session, settings))
    ids = filler_ids(session, lengths[-1])
    wide_rows = getattr(session.loaded.kernel, "wide_rows", 0)       # a KernelChoice on a CPU, else None
    measured: list[PrefillPoint] = []
    for i, n in enumerate(lengths):
        forward, ttft = [], []
        for r in range(1 + settings.repeats):               # one warm-up, then the timed repeats
            if experiment.cancelled:
                return summarize(measured, wide_rows)
            experiment.progress(i, len(lengths), f"prefill of {n:,} tokens: "          # each pass says which
                                + (f"repeat {r} of {settings.repeats}" if r else "warm-up"))
            forward_ms, ttft_ms = session.timed_prefill(ids[:n])
            if r:
                forward.append(forward_ms)
                ttft.append(ttft_ms)
        cost = experiment.cost.prefill(n)
        point = PrefillPoint(tokens=n, prefill_ms=statistics.median(forward), ttft_ms=statistics.median(ttft),
                             prefill_ms_min=min(forward), prefill_ms_max=max(forward), flops=cost.flops,
                             attention_flops=costmodel.attention_flops(n, session.facts.hidden_size),
                             predicted_ms=experiment.predicted_ms(cost))
        experiment.point(point)
        measured.append(point)
    experiment.progress(len(lengths), len(lengths), "done")
    return summarize(measured, wide_rows)


def summarize(points: list[PrefillPoint], widened_from: int = 0) -> PrefillResult:
    """``widened_from``: the rows from which the model's products run widened (``KernelChoice.wide_rows``): said
    only where the sweep crossed it, since time and the roofline both step down there."""
    if not points:
        return PrefillResult(incomplete=True)
    spread = max(p.prefill_ms_max / p.prefill_ms_min for p in points if p.prefill_ms_min > 0)
    crossed = widened_from if points[0].tokens < widened_from <= points[-1].tokens else 0
    if len(points) < 2:
        return PrefillResult(points=len(points), largest_spread=spread, noisy=spread > NOISY_SPREAD)
    n = [p.tokens for p in points]
    t = [p.prefill_ms for p in points]
    half = len(points) // 2
    predicted = [p.predicted_ms for p in points if p.predicted_ms is not None]
    return PrefillResult(
        points=len(points), exponent=fitted_exponent(n, t),
        exponent_short=fitted_exponent(n[: half + 1], t[: half + 1]),
        exponent_long=fitted_exponent(n[half:], t[half:]), doubled_from=n[-2], doubled_to=n[-1],
        last_doubling_x=t[-1] / t[-2], flops_doubling_x=points[-1].flops / points[-2].flops,
        predicted_exponent=fitted_exponent(n, predicted) if len(predicted) == len(points) else None,
        largest_spread=spread, noisy=spread > NOISY_SPREAD, widened_from=crossed)


def table(points: Sequence[ExperimentPoint], result: PrefillResult) -> str:
    lines = table_lines(of(points, PrefillPoint), PrefillPoint)
    if result.exponent is not None:
        lines += ["", f"time ~ n^{result.exponent:.2f} overall (n^{result.exponent_short:.2f} for short prompts, "
                  f"n^{result.exponent_long:.2f} for long ones), measured",
                  f"Doubling {result.doubled_from:,}->{result.doubled_to:,}: {result.last_doubling_x:.1f}x measured, "
                  f"{result.flops_doubling_x:.1f}x FLOPs (computed)"]
    if result.widened_from:
        lines.append(f"note: from {result.widened_from:,} tokens the products ran in float32 over the widened weights "
                     "(this CPU emulates the model's half float below that): time and roofline step down there")
    if result.noisy:
        lines.append(f"note: the repeats of one length spread up to {result.largest_spread:.2f}x: the fitted "
                     "exponents are rough (a busy or noisy machine); run again on a quiet one")
    return "\n".join(lines)


LESSON = Lesson(kind="prefill", title="Prefill vs prompt length", settings=PrefillSettings, result=PrefillResult,
                run=run, table=table, check=check, points=(PrefillPoint,),
                quick={"max_length": 128, "repeats": 1},
                course={"max_length": 1024, "repeats": 2})
