"""Lesson: decode with the KV cache on vs off. The same greedy run both ways: without the cache every step
recomputes the whole sequence, so its latency grows with length; with it, each step reads the cache and stays
flat. The measured speedup sits beside the cost model's FLOPs ratio, and the tokens must be the same.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, ClassVar

from engine.facts import costmodel
from engine.facts.contention import busy
from engine.facts.errors import ParameterError
from engine.facts.events import ExperimentPoint, LessonResult, LessonSettings, RunFinished
from engine.facts.fields import MAX_PROMPT, Column, Count, Key, Number, Range, Setting, Text
from engine.facts.params import GenerationParams
from engine.facts.vocabulary import LessonPoint, of, table_lines
from engine.run.experiment import Experiment, Lesson
from engine.run.workloads import sample_texts


@dataclass(frozen=True)
class CacheSettings(LessonSettings):
    kind = "cache"

    new_tokens: Annotated[int, Range(2, 4096), Setting(
        "--tokens", "New tokens (both runs)", "new tokens in each run", "tokens"), Key("M", factor=2.0)] = 48
    prompt: Annotated[str, Text(MAX_PROMPT), Setting(
        "--prompt", "Prompt", "the prompt (default: the first sample prompt)")] | None = None


@dataclass(frozen=True)
class CacheResult(LessonResult):
    kind = "cache"
    token_checks: ClassVar[tuple[str, ...]] = ("tokens_match",)

    tokens_match: bool = False
    generated: Count = 0
    prompt_tokens: Count = 0
    decode_speedup: Number | None = None          # decode ms without / with (measured)
    total_speedup: Number | None = None
    flops_ratio: Number | None = None              # whole model, computed
    attention_flops_ratio: Number | None = None    # the seed's attention-only model, computed


@dataclass(frozen=True)
class CachePoint(LessonPoint):
    """One of the two runs, with the cache on or off."""

    series = "run"

    kv_cache: Annotated[bool, Column("KV cache", words=("off", "on"))]
    ttft_ms: Annotated[float, Column("TTFT ms", "{:,.1f}")]
    decode_ms: Annotated[float, Column("decode ms", "{:,.1f}")]
    total_ms: Annotated[float, Column("total ms", "{:,.1f}")]
    decode_tok_s: Annotated[float, Column("decode tok/s")]
    generated: Annotated[int, Column("tokens", "{:,d}")]
    prompt_tokens: int


def run(experiment: Experiment, settings: CacheSettings) -> CacheResult:
    session = experiment.session
    prompt = settings.prompt or sample_texts()[0]
    session.run(prompt, GenerationParams(max_new_tokens=2), cancel=experiment.cancel)   # warm-up, not shown
    results = {}
    for i, kv in enumerate((True, False)):
        experiment.progress(i, 2, f"{settings.new_tokens} tokens with the KV cache {'on' if kv else 'off'}")
        result = session.run(prompt, GenerationParams(max_new_tokens=settings.new_tokens, kv_cache=kv),
                             experiment.emit, experiment.cancel)
        if not isinstance(result, RunFinished) or result.reason == "stopped":
            return CacheResult(incomplete=True)
        s = result.summary
        results[kv] = s
        experiment.point(CachePoint(kv_cache=kv, ttft_ms=s.ttft_ms, decode_ms=s.decode_ms, total_ms=s.total_ms,
                                    decode_tok_s=s.decode_tok_s, generated=s.generated_tokens,
                                    prompt_tokens=s.prompt_tokens))
    on, off = results[True], results[False]
    generated, hidden = on.generated_tokens, session.facts.hidden_size
    flops_on = experiment.cost.decode_total(on.prompt_tokens, generated, cache=True).flops
    flops_off = experiment.cost.decode_total(on.prompt_tokens, generated, cache=False).flops
    seed_on = costmodel.decode_flops_with_cache(on.prompt_tokens, generated - 1, hidden)
    seed_off = costmodel.decode_flops_no_cache(on.prompt_tokens, generated - 1, hidden)
    experiment.progress(2, 2, "done")
    shares = [s.cpu_share for s in (on, off) if s.cpu_share is not None]
    return CacheResult(
        tokens_match=on.token_ids == off.token_ids, generated=generated, prompt_tokens=on.prompt_tokens,
        decode_speedup=off.decode_ms / on.decode_ms if on.decode_ms else None,
        total_speedup=off.total_ms / on.total_ms if on.total_ms else None,
        flops_ratio=flops_off / flops_on if flops_on else None,
        attention_flops_ratio=seed_off / seed_on if seed_on else None,
        lowest_cpu_share=min(shares) if shares else None)


def backwards_words(result: CacheResult) -> str:
    """What a result that contradicts the lesson says ("" when it does not): cache-on decode measured slower
    than cache-off. A cache never makes a step do more work, so the clock measured something else: other
    programs taking the cores during one of the two runs (a screen recorder, a browser). Shown wherever the
    speedup is, with how to measure it again."""
    if result.decode_speedup is None or result.decode_speedup >= 1.0:
        return ""
    cause = ("the machine was busy while it measured (other programs took the cores), not the cache"
             if busy(result.lowest_cpu_share) else
             "other programs taking the cores during one of the two runs is the likely cause, not the cache")
    return (f"backwards: decode with the cache measured {1 / result.decode_speedup:.1f}x slower than without it, "
            f"the opposite of what a cache does; {cause}. Close or pause other programs and run it again")


def check(target: object, settings: CacheSettings) -> None:
    if settings.prompt is not None and not settings.prompt.strip():
        raise ParameterError("The prompt is empty: give one, or leave it out for the first sample prompt")


def table(points: Sequence[ExperimentPoint], result: CacheResult) -> str:
    lines = table_lines(of(points, CachePoint), CachePoint)
    if result.decode_speedup is not None:
        lines += ["", f"tokens identical with and without the cache: {'yes' if result.tokens_match else 'NO'}",
                  f"decode speedup with the cache: {result.decode_speedup:.2f}x measured; "
                  f"{result.flops_ratio:.1f}x fewer FLOPs (computed, whole model); "
                  f"{result.attention_flops_ratio:.1f}x fewer attention FLOPs (computed, the seed's model)"]
    if backwards_words(result):
        lines.append(f"note: {backwards_words(result)}")
    return "\n".join(lines)


LESSON = Lesson(kind="cache", title="KV cache on vs off", settings=CacheSettings, result=CacheResult, run=run,
                table=table, check=check, points=(CachePoint,),
                quick={"new_tokens": 12},
                course={"new_tokens": 32})
