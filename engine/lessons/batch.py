"""Lesson: batch size against throughput and latency. Batches of 1, 2, 4, ... requests decode together:
aggregate tokens per second rises (every step reads the weights once, whatever the batch) while each request
waits longer per token: the throughput-latency trade-off serving systems tune.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated

from engine.facts.errors import ParameterError
from engine.facts.events import ExperimentPoint, LessonResult, LessonSettings
from engine.facts.fields import Column, Count, Items, Key, Number, PromptText, Range, Setting
from engine.facts.vocabulary import LessonPoint, of, table_lines
from engine.run.experiment import Experiment, Lesson
from engine.run.workloads import fitting, sample_texts


@dataclass(frozen=True)
class BatchSettings(LessonSettings):
    kind = "batch"

    sizes: Annotated[tuple[Annotated[int, Range(1, 1024)], ...], Items(32), Setting(
        "--sizes", "Batch sizes", "batch sizes, separated by commas")] = (1, 2, 4, 8, 16)
    new_tokens: Annotated[int, Range(2, 4096), Setting(
        "--tokens", "New tokens per request", "new tokens per request", "tokens"), Key("M", factor=2.0)] = 32
    prompts: Annotated[tuple[PromptText, ...], Items(64)] = ()          # empty: the sample prompts

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.sizes:
            raise ParameterError("sizes must name at least one batch size")


@dataclass(frozen=True)
class BatchResult(LessonResult):
    kind = "batch"

    points: Count = 0
    largest_batch: Count = 0
    throughput_gain: Number | None = None      # the largest batch's tok/s over a single request's (measured)
    latency_growth: Number | None = None       # its per-token latency over a single request's (measured)


@dataclass(frozen=True)
class BatchPoint(LessonPoint):
    """One batch size: its first token, its median decode step (every request's token), and the throughput of
    all of them."""

    series = "batch"

    batch: Annotated[int, Column("batch", "{:,d}")]
    ttft_ms: Annotated[float, Column("TTFT ms", "{:,.1f}")]
    prefill_ms: float
    step_ms: float | None
    per_token_ms: Annotated[float | None, Column("per-token ms")]
    decode_tok_s: Annotated[float, Column("decode tok/s (all requests)", "{:,.1f}")]
    request_latency_ms: Annotated[float, Column("request latency ms", "{:,.1f}")]
    padded_length: int


def run(experiment: Experiment, settings: BatchSettings) -> BatchResult:
    from engine.run.batch_generate import generate_batch  # torch: only where a lesson runs, never where it is read

    session = experiment.session
    texts = settings.prompts or sample_texts()
    encoded = fitting(session, [session.encode(t) for t in texts], settings.new_tokens)
    pad = session.tokenizer.pad_token_id
    pad = session.tokenizer.eos_token_id if pad is None else pad
    sizes, rows = settings.sizes, []
    for i, size in enumerate(sizes):
        if experiment.cancelled:
            break
        experiment.progress(i, len(sizes), f"batch of {size}: {settings.new_tokens} tokens per request")
        batch = [encoded[j % len(encoded)] for j in range(size)]
        generate_batch(session.model, batch, 2, pad, session.device, experiment.cancel)   # warm-up: its kernels
        r = generate_batch(session.model, batch, settings.new_tokens, pad, session.device, experiment.cancel)
        if r.stopped:
            break
        step = statistics.median(r.step_ms) if r.step_ms else None
        point = BatchPoint(batch=size, ttft_ms=r.ttft_ms, prefill_ms=r.prefill_ms, step_ms=step, per_token_ms=step,
                           decode_tok_s=size * 1000.0 / step if step else 0.0,
                           request_latency_ms=r.ttft_ms + sum(r.step_ms), padded_length=r.padded_length)
        experiment.point(point)
        rows.append(point)
    if not experiment.cancelled:
        experiment.progress(len(sizes), len(sizes), "done")
    if len(rows) < 2:
        return BatchResult(points=len(rows), incomplete=experiment.cancelled)
    return BatchResult(points=len(rows), largest_batch=rows[-1].batch,
                       throughput_gain=rows[-1].decode_tok_s / rows[0].decode_tok_s,
                       latency_growth=rows[-1].per_token_ms / rows[0].per_token_ms,
                       incomplete=experiment.cancelled)


def table(points: Sequence[ExperimentPoint], result: BatchResult) -> str:
    lines = table_lines(of(points, BatchPoint), BatchPoint)
    if result.throughput_gain is not None:
        lines += ["", f"batch {result.largest_batch}: {result.throughput_gain:.1f}x the tokens/s of batch 1, each "
                  f"token {latency_words(result.latency_growth)} per request (measured)"]
    return "\n".join(lines)


def latency_words(growth: float) -> str:
    """A per-token latency ratio in words that read the right way round: "2.1x slower" or "1.3x faster"."""
    return f"{growth:.2f}x slower" if growth >= 1 else f"{1 / growth:.2f}x faster"


LESSON = Lesson(kind="batch", title="Batch size", settings=BatchSettings, result=BatchResult, run=run,
                table=table, points=(BatchPoint,),
                quick={"sizes": (1, 2, 4), "new_tokens": 6},
                course={"sizes": (1, 2, 4, 8), "new_tokens": 24})
