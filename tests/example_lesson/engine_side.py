"""Lesson: the same prompt run a few times, its time to first token each time, and its words counted by a process
of the lesson's own (an example, not shipped: it exists to prove that a lesson's module, its window module and
its helper module, listed in the registries, are all a lesson needs, a worker and a fault phase included)."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Any

from engine.facts.events import ExperimentPoint, LessonResult, LessonSettings, RunFinished
from engine.facts.fields import Column, Count, Number, Range, Setting, Text
from engine.facts.params import GenerationParams
from engine.facts.validation import FieldError
from engine.facts.vocabulary import LessonEvent, LessonPoint, of, table_lines
from engine.run import example_counter
from engine.run.experiment import Experiment, Lesson

PROMPT = "The cache keeps what attention has already read."


@dataclass(frozen=True)
class ExampleSettings(LessonSettings):
    kind = "example"

    repeats: Annotated[int, Range(1, 20), Setting("--repeats", "Repeats", "how many times to run the prompt")] = 3
    new_tokens: Annotated[int, Range(1, 64), Setting("--tokens", "New tokens", "tokens per run", "tokens")] = 4


@dataclass(frozen=True)
class ExampleResult(LessonResult):
    kind = "example"

    runs: Count = 0
    median_ttft_ms: Number | None = None
    counter_error: Annotated[str, Text(300)] = ""       # why the word counter stopped the runs, if it did


@dataclass(frozen=True)
class ExamplePoint(LessonPoint):
    """One run of the prompt."""

    series = "repeat"

    repeat: Annotated[int, Column("repeat", "{:d}", shift=1)]
    ttft_ms: Annotated[float, Column("TTFT ms (example)", "{:,.1f}")]
    generated: Annotated[int, Column("tokens (example)", "{:d}")]


@dataclass(frozen=True)
class ExampleMark(LessonEvent):
    """The prompt's length, said once per run: an event of this lesson's own (``words``: as its counter
    process counted them)."""

    repeat: Count
    prompt_tokens: Count
    words: Count = 0

    def check(self, vocab_size: int, max_context: int) -> None:
        if max_context and self.prompt_tokens >= max_context:
            raise FieldError(f"prompt_tokens must be below the model's context ({max_context:,})")


def run(experiment: Experiment, settings: ExampleSettings) -> ExampleResult:
    ttfts: list[float] = []
    error = ""
    for repeat in range(settings.repeats):
        if experiment.cancelled:
            break
        experiment.progress(repeat, settings.repeats, f"run {repeat + 1} of {settings.repeats}")
        try:
            words = example_counter.count_words(PROMPT, repeat + 1)
        except example_counter.CounterFailed as exc:       # what was measured is kept; the result says why
            error = str(exc)
            break
        result = experiment.session.run(PROMPT, GenerationParams(max_new_tokens=settings.new_tokens),
                                        experiment.emit, experiment.cancel)
        if not isinstance(result, RunFinished) or result.reason == "stopped":
            break
        s = result.summary
        experiment.emit(ExampleMark(experiment.exp_id, experiment.ms(), repeat, s.prompt_tokens, words))
        experiment.point(ExamplePoint(repeat=repeat, ttft_ms=s.ttft_ms, generated=s.generated_tokens))
        ttfts.append(s.ttft_ms)
    experiment.progress(len(ttfts), settings.repeats, "done")
    return ExampleResult(runs=len(ttfts), median_ttft_ms=statistics.median(ttfts) if ttfts else None,
                         incomplete=len(ttfts) < settings.repeats, counter_error=error)


def table(points: Sequence[ExperimentPoint], result: ExampleResult) -> str:
    lines = table_lines(of(points, ExamplePoint), ExamplePoint)
    if result.median_ttft_ms is not None:
        lines += ["", f"median TTFT over {result.runs} runs: {result.median_ttft_ms:,.1f} ms (measured)"]
    if result.counter_error:
        lines.append(f"stopped: {result.counter_error}")
    return "\n".join(lines)


def check(target: Any, settings: ExampleSettings) -> None:
    return None


LESSON = Lesson(kind="example", title="Example: the same prompt again", settings=ExampleSettings,
                result=ExampleResult, run=run, table=table, check=check, points=(ExamplePoint,),
                events=(ExampleMark,), quick={"repeats": 2, "new_tokens": 2},
                faults=(example_counter.COUNTING,), workers={example_counter.WORKER: example_counter.counter_entry})
