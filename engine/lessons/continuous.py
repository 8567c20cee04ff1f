"""Lesson: continuous against static batching, on the same arrivals. Requests arrive every few decode steps
with different prompts and lengths; continuous batching admits each into the running batch at the next step,
static batching makes it wait for the whole batch to finish. Per request: waiting, prefill, decode; per step:
the batch size; every request's tokens equal its solo run.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar

from engine.facts import kvformula
from engine.facts.errors import ParameterError
from engine.facts.events import ExperimentPoint, LessonResult, LessonSettings
from engine.facts.fields import Column, Items, Number, PromptText, Range, Setting
from engine.facts.vocabulary import LessonPoint, of, table_lines
from engine.run.experiment import Counter, Experiment, Lesson, Span
from engine.run.workloads import fitting, sample_texts

POLICIES = ("continuous", "static")


@dataclass(frozen=True)
class ContinuousSettings(LessonSettings):
    kind = "continuous"

    requests: Annotated[int, Range(1, 256), Setting("--requests", "Requests", "how many requests arrive")] = 8
    arrive_every: Annotated[int, Range(0, 10_000), Setting(
        "--arrive-every", "A new request every", "decode steps between arrivals", "decode steps")] = 4
    new_tokens: Annotated[tuple[Annotated[int, Range(1, 4096)], ...], Items(16)] = (16, 24, 32)
    check_solo: bool = True
    prompts: Annotated[tuple[PromptText, ...], Items(64)] = ()          # empty: the sample prompts


@dataclass(frozen=True)
class ContinuousResult(LessonResult):
    kind = "continuous"
    token_checks: ClassVar[tuple[str, ...]] = ("tokens_match_solo",)

    continuous_tok_s: Number | None = None
    continuous_mean_ttft_ms: Number | None = None
    continuous_mean_e2e_ms: Number | None = None
    static_tok_s: Number | None = None
    static_mean_ttft_ms: Number | None = None
    static_mean_e2e_ms: Number | None = None
    same_tokens_both_policies: bool | None = None
    tokens_match_solo: bool | None = None


def check(target: Any, settings: ContinuousSettings) -> None:
    refusal = kvformula.batching_refusal(target.facts)
    if refusal is not None:
        raise ParameterError(f"Continuous batching is not available for {target.facts.name}: {refusal}")


POLICY_WORDS = ("static", "continuous")       # a point's ``continuous`` flag in words


@dataclass(frozen=True)
class RequestPoint(LessonPoint):
    """One request under one policy: when it arrived, was admitted, had its first token and ended (ms from the
    first arrival)."""

    series = "request"

    policy: Annotated[bool, Column("policy", words=POLICY_WORDS)]      # True: continuous batching
    index: Annotated[int, Column("request", "{:d}")]
    prompt_tokens: Annotated[int, Column("prompt", "{:,d}")]
    new_tokens: Annotated[int, Column("new", "{:,d}")]
    arrival_ms: Annotated[float, Column("arrived ms", "{:,.1f}")]
    admitted_ms: float
    first_token_ms: float
    done_ms: float
    queue_ms: Annotated[float, Column("waited ms", "{:,.1f}")]
    ttft_ms: Annotated[float, Column("TTFT ms", "{:,.1f}")]
    e2e_ms: Annotated[float, Column("end-to-end ms", "{:,.1f}")]


@dataclass(frozen=True)
class BatchSizePoint(LessonPoint):
    """The rows one decode step of a policy ran, at ``t_ms`` from the first arrival."""

    series = "batch"

    policy: bool                   # True: continuous batching
    t_ms: float
    batch_size: int


def run(experiment: Experiment, settings: ContinuousSettings) -> ContinuousResult:
    from engine.run.batch_generate import generate_batch  # torch: only where a lesson runs, never where it is read
    from engine.run.scheduler import ScheduledRequest, serve

    session = experiment.session
    usable = fitting(session, [session.encode(t) for t in settings.prompts or sample_texts()], max(settings.new_tokens))
    encoded = [usable[i % len(usable)] for i in range(settings.requests)]
    lengths = [settings.new_tokens[i % len(settings.new_tokens)] for i in range(settings.requests)]
    steps = len(POLICIES) + int(settings.check_solo)
    generate_batch(session.model, encoded[:1], 2, 0, session.device, experiment.cancel)   # warm-up
    results = {}
    for p, policy in enumerate(POLICIES):
        experiment.progress(p, steps, f"{settings.requests} requests, {policy} batching")
        batch = [ScheduledRequest(i, ids, n, i * settings.arrive_every)
                 for i, (ids, n) in enumerate(zip(encoded, lengths))]

        def step(t: float, size: int, pol: int = p) -> None:
            experiment.point(BatchSizePoint(policy=pol == 0, t_ms=t, batch_size=size))

        if not serve(session, batch, policy, on_step=step, cancel=experiment.cancel):
            return ContinuousResult(incomplete=True)
        for r in batch:
            experiment.point(RequestPoint(
                policy=p == 0, index=r.index, prompt_tokens=len(r.ids), new_tokens=r.new_tokens,
                arrival_ms=r.arrival_ms, admitted_ms=r.admitted_ms, first_token_ms=r.first_token_ms, done_ms=r.done_ms,
                queue_ms=r.admitted_ms - r.arrival_ms, ttft_ms=r.first_token_ms - r.arrival_ms,
                e2e_ms=r.done_ms - r.arrival_ms))
        results[policy] = batch
    figures: dict[str, float] = {}
    for policy, batch in results.items():
        span = max(r.done_ms for r in batch) - min(r.arrival_ms for r in batch)
        figures[f"{policy}_tok_s"] = sum(r.new_tokens for r in batch) / (span / 1000.0) if span else 0.0
        figures[f"{policy}_mean_ttft_ms"] = statistics.fmean(r.first_token_ms - r.arrival_ms for r in batch)
        figures[f"{policy}_mean_e2e_ms"] = statistics.fmean(r.done_ms - r.arrival_ms for r in batch)
    same = [r.tokens for r in results["continuous"]] == [r.tokens for r in results["static"]]
    solo_match = None
    if settings.check_solo:
        experiment.progress(len(POLICIES), steps, "each request alone, for the token check")
        solo = [generate_batch(session.model, [ids], n, 0, session.device).tokens[0]
                for ids, n in zip(encoded, lengths)]
        solo_match = solo == [r.tokens for r in results["continuous"]]
    experiment.progress(steps, steps, "done")
    return ContinuousResult(**figures, same_tokens_both_policies=same, tokens_match_solo=solo_match)


def timeline(items: Sequence[object]) -> list[Span | Counter]:
    """A lane per request (waiting, prefill, decode) and the batch size as a counter, per policy."""
    out: list[Span | Counter] = []
    for r in of(items, RequestPoint):
        track = f"{POLICY_WORDS[r.policy]}: request {r.index}"
        spans = (("waiting", r.arrival_ms, r.admitted_ms), ("prefill", r.admitted_ms, r.first_token_ms),
                 ("decode", r.first_token_ms, r.done_ms))
        out += [Span(track, name, start, max(end - start, 0.0)) for name, start, end in spans]
    out += [Counter(f"batch size ({POLICY_WORDS[b.policy]})", b.t_ms, {"rows": b.batch_size})
            for b in of(items, BatchSizePoint)]
    return out


def table(points: Sequence[ExperimentPoint], result: ContinuousResult) -> str:
    lines = table_lines(of(points, RequestPoint), RequestPoint)
    if result.continuous_tok_s is not None:
        for policy in POLICIES:
            lines.append(f"{policy:10}: {getattr(result, policy + '_tok_s'):8.1f} tok/s in all, mean TTFT "
                         f"{getattr(result, policy + '_mean_ttft_ms'):8.1f} ms, mean end-to-end "
                         f"{getattr(result, policy + '_mean_e2e_ms'):8.1f} ms (measured)")
        lines.insert(len(lines) - 2, "")
        lines.append(f"each request's tokens equal its solo run: {'yes' if result.tokens_match_solo else 'NO'}")
    return "\n".join(lines)


LESSON = Lesson(kind="continuous", title="Continuous batching", settings=ContinuousSettings,
                result=ContinuousResult, run=run, table=table, check=check, timeline=timeline,
                points=(RequestPoint, BatchSizePoint),
                quick={"requests": 3, "arrive_every": 2, "new_tokens": (4, 6)},
                course={"requests": 6})
