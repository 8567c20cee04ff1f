"""Lesson: memory grows with context, and decode slows with it. The cache is filled in steps, doubling, up to the
model's whole context; at each depth a few decode steps are timed, the bytes the cache holds are read from its
tensors (the formula beside them), and the share of each step spent in attention is timed by clocks on the
attention modules: what llama.cpp's ``llama-bench -d`` reports as numbers, measured on the model here.

Each depth is a real run of exactly that many prompt tokens (real text), prefilled in passes of
``PREFILL_CHUNK`` positions so a stop takes effect within one of them, its events the ones a plain run emits, so
the KV heatmap beside the curves fills as the depths grow.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated

from engine.facts import kvformula
from engine.facts.errors import ParameterError
from engine.facts.events import ExperimentPoint, LessonResult, LessonSettings, RunFinished, TokenStep
from engine.facts.fields import MAX_CONTEXT, Bytes, Column, Count, Items, Key, Number, Range, Setting
from engine.facts.params import GenerationParams
from engine.facts.vocabulary import LessonPoint
from engine.run.experiment import Experiment, Lesson
from engine.run.workloads import filler_ids

PREFILL_CHUNK = 512


@dataclass(frozen=True)
class DepthSettings(LessonSettings):
    kind = "depth"

    deepest: Annotated[int, Range(32, MAX_CONTEXT), Setting(
        "--deepest", "Deepest context", "fill the cache up to this many positions (default: the model's whole "
        "context)", "positions")] | None = None
    depths: Annotated[int, Range(2, 16), Setting(
        "--depths", "Depths", "how many depths, doubling up to the deepest")] = 6
    steps: Annotated[int, Range(1, 64), Setting(
        "--steps", "Decode steps per depth", "decode steps timed at each depth", "steps"), Key("M", factor=2.0)] = 8


@dataclass(frozen=True)
class DepthFigures:
    depth: Count                       # positions in the cache when the decode steps ran
    decode_ms: Number                  # median decode step (measured)
    attention_ms: Number | None        # of it, in the attention modules (measured)
    kv_bytes: Bytes                    # what the cache's tensors held after the steps (measured)
    kv_formula_bytes: Bytes            # the formula for those positions (computed)
    positions: Count                   # positions after the steps


@dataclass(frozen=True)
class DepthResult(LessonResult):
    kind = "depth"

    figures: Annotated[tuple[DepthFigures, ...], Items(16)] = ()
    slowdown: Number | None = None                 # decode ms at the deepest / at the shallowest (measured)
    attention_share_first: Number | None = None    # share of a step in attention, shallowest and deepest
    attention_share_last: Number | None = None
    full_context_bytes: Bytes = 0                  # the formula at the whole context (computed)


def depths(deepest: int, count: int, steps: int) -> list[int]:
    """Prompt lengths: the deepest that leaves room for the decode steps (the context filled to its end), and
    below it round powers of two, halving (what ``llama-bench -d`` is given), none under 16."""
    top = deepest - steps - 1
    if top < 16:
        return []
    power = 1 << (top - 1).bit_length() - 1 if top > 1 else 1
    rounds = [power >> i for i in range(count - 1) if power >> i >= 16 and power >> i < top]
    return sorted({top, *rounds})


def _bytes(value: float) -> str:
    return kvformula.format_bytes(int(value))


@dataclass(frozen=True)
class DepthPoint(LessonPoint):
    """One cache depth: the decode step's time and attention's part of it, and the cache measured and computed."""

    series = "depth"

    depth: Annotated[int, Column("depth (positions)", "{:,d}")]
    decode_ms: Annotated[float, Column("decode ms/step")]
    attention_ms: Annotated[float | None, Column("attention ms")]
    kv_bytes: Annotated[int, Column("KV held (measured)", show=_bytes)]
    kv_formula_bytes: Annotated[int, Column("KV formula (computed)", show=_bytes)]
    positions: int
    prefill_ms: Annotated[float, Column("prefill ms", "{:,.0f}")]


def run(experiment: Experiment, settings: DepthSettings) -> DepthResult:
    from engine.model.layer_clock import LayerClock, attention_modules
    from engine.run.session import RunOptions

    session = experiment.session
    facts = session.facts
    deepest = min(settings.deepest or facts.max_context, facts.max_context)
    lengths = depths(deepest, settings.depths, settings.steps)
    modules = attention_modules(session.model)
    clock = LayerClock(session.model, session.device, modules) if modules else None
    ids = filler_ids(session, lengths[-1])
    figures: list[DepthFigures] = []
    shares: list[float] = []
    try:
        for i, length in enumerate(lengths):
            if experiment.cancelled:
                break
            experiment.progress(i, len(lengths), f"{length:,} positions: filling the cache, then {settings.steps} "
                                                  "decode steps")
            attention: list[float] = []
            steps: list[float] = []

            def sink(event: object) -> None:
                if isinstance(event, TokenStep):
                    spent = sum(clock.take()) if clock is not None else None
                    if event.step > 0:
                        steps.append(event.latency_ms)
                        if spent is not None:
                            attention.append(spent)
                experiment.emit(event)

            if clock is not None:
                clock.take()
            result = session.run_ids(ids[:length], GenerationParams(max_new_tokens=settings.steps + 1), sink,
                                     experiment.cancel, RunOptions(prefill_chunk=PREFILL_CHUNK))
            if not isinstance(result, RunFinished) or result.reason == "stopped":
                break
            s = result.summary
            if s.cpu_share is not None:
                shares.append(s.cpu_share)
            if not steps:
                continue
            # Both medians over the same steps: a step's attention is inside that step, so its median is too (a
            # mean step beside a median attention read 8.29 ms against 8.36 in a test run with both cores in use).
            decode_ms = statistics.median(steps)
            attention_ms = statistics.median(attention) if attention else None
            figure = DepthFigures(depth=length, decode_ms=decode_ms, attention_ms=attention_ms,
                                  kv_bytes=s.kv_bytes, kv_formula_bytes=kvformula.predicted_kv_bytes(facts,
                                                                                                      s.kv_tokens),
                                  positions=s.kv_tokens)
            figures.append(figure)
            experiment.point(DepthPoint(depth=length, decode_ms=decode_ms, attention_ms=attention_ms,
                                        kv_bytes=s.kv_bytes, kv_formula_bytes=figure.kv_formula_bytes,
                                        positions=s.kv_tokens, prefill_ms=s.prefill_ms))
    finally:
        if clock is not None:
            clock.close()
    experiment.progress(len(figures), len(lengths), "done")
    first, last = (figures[0], figures[-1]) if figures else (None, None)

    def share(f: DepthFigures | None) -> float | None:
        return f.attention_ms / f.decode_ms if f is not None and f.attention_ms is not None and f.decode_ms else None

    return DepthResult(figures=tuple(figures), incomplete=len(figures) < len(lengths),
                       slowdown=last.decode_ms / first.decode_ms if len(figures) > 1 and first.decode_ms else None,
                       attention_share_first=share(first), attention_share_last=share(last),
                       full_context_bytes=kvformula.full_context_kv_bytes(facts),
                       lowest_cpu_share=min(shares) if shares else None)


def check(target: object, settings: DepthSettings) -> None:
    facts = target.facts
    if not kvformula.has_kv_cache(facts):
        raise ParameterError(f"{facts.name} keeps no KV cache: there is no depth to fill")
    deepest = min(settings.deepest or facts.max_context, facts.max_context)
    if not depths(deepest, settings.depths, settings.steps):
        raise ParameterError(f"--deepest {deepest:,} leaves no depth of at least 16 positions for {settings.steps} "
                             "decode steps: fill deeper, or take fewer steps")


def table(points: Sequence[ExperimentPoint], result: DepthResult) -> str:
    lines = ["   depth | decode ms/step | attention ms | attention share | KV held (measured) | formula",
             "---------+----------------+--------------+-----------------+--------------------+------------"]
    for f in result.figures:
        attention = f"{f.attention_ms:12.2f}" if f.attention_ms is not None else f"{'-':>12}"
        share = f"{f.attention_ms / f.decode_ms:15.0%}" if f.attention_ms is not None else f"{'-':>15}"
        lines.append(f"{f.depth:8,d} | {f.decode_ms:14.2f} | {attention} | {share} | "
                     f"{kvformula.format_bytes(f.kv_bytes):>18} | {kvformula.format_bytes(f.kv_formula_bytes):>10}")
    if result.slowdown is not None:
        first, last = result.figures[0], result.figures[-1]
        lines += ["", f"decode step {result.slowdown:.2f}x slower at {last.depth:,} positions than at "
                      f"{first.depth:,} (measured); the cache {kvformula.format_bytes(last.kv_bytes)} vs "
                      f"{kvformula.format_bytes(first.kv_bytes)}; at the whole context "
                      f"{kvformula.format_bytes(result.full_context_bytes)} (computed)"]
    return "\n".join(lines)


LESSON = Lesson(kind="depth", title="Decode vs depth", settings=DepthSettings, result=DepthResult, run=run,
                table=table, check=check, points=(DepthPoint,),
                quick={"deepest": 256, "depths": 3, "steps": 4},
                course={"deepest": 2048, "depths": 5, "steps": 8})
