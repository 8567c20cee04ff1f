"""Lesson: speculative decoding, measured. Plain greedy decode and speculative decode of the same prompt,
interleaved a few times and timed by the same loop (``engine.run.speculative_decode``): medians of decode wall time,
every verification pass of the last speculative repeat with its guesses, the acceptance rate, tokens per
pass, and whether the two outputs are the same tokens (greedy: they must be).

Drafters: ``prompt lookup`` (n-grams of the text so far: free, and right when the answer repeats the prompt),
``self`` (this model with lighter weights, ``draft_dtype``) or a draft model sharing the tokenizer (a folder,
``.gguf`` file or hub id).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar

from engine.facts import kvformula
from engine.facts.contention import LoadMeter
from engine.facts.errors import ModelSourceError, ParameterError
from engine.facts.events import ExperimentPoint, LessonResult, LessonSettings
from engine.facts.fields import (
    MAX_CONTEXT,
    MAX_DRAFT,
    MAX_PROMPT,
    Column,
    Count,
    Items,
    Key,
    Ms,
    Number,
    Range,
    Setting,
    Text,
    TokenId,
    TokenText,
)
from engine.facts.validation import FieldError
from engine.facts.vocabulary import LessonEvent, LessonPoint, of, table_lines
from engine.run.experiment import Counter, Experiment, Lesson, Span
from engine.store.resources import SPECULATIVE_PROMPTS as PROMPTS

PROMPT_LOOKUP, SELF = "prompt lookup", "self"
DRAFT_FORMATS = ("int4", "int8", "bfloat16", "float16", "float32")


@dataclass(frozen=True)
class SpeculativeSettings(LessonSettings):
    kind = "speculative"

    prompt: Annotated[str, Text(MAX_PROMPT), Setting(
        "--prompt", "Prompt", "the prompt (default: one whose answer repeats it)")] = PROMPTS["repeats itself"]
    drafter: Annotated[str, Text(4096), Setting(
        "--drafter", "Drafter", "'prompt lookup', 'self' (this model, weights as --draft-dtype), or a draft model "
        "sharing the tokenizer: a folder, .gguf or hub id")] = PROMPT_LOOKUP
    draft_dtype: Annotated[str, Text(16, DRAFT_FORMATS), Setting(
        "--draft-dtype", "Draft weights", "the draft model's weights")] = "int4"
    draft_tokens: Annotated[int, Range(1, MAX_DRAFT), Setting(
        "--guesses", "Guesses per pass", "guesses per verification pass", "tokens")] = 8
    new_tokens: Annotated[int, Range(2, 4096), Setting(
        "--tokens", "New tokens", "new tokens to generate", "tokens"), Key("M", factor=2.0)] = 64
    repeats: Annotated[int, Range(1, 20), Setting(
        "--repeats", "Repeats", "how many times plain and speculative decode alternate")] = 2


@dataclass(frozen=True)
class SpeculativeResult(LessonResult):
    kind = "speculative"
    token_checks: ClassVar[tuple[str, ...]] = ("tokens_match",)

    drafter: Annotated[str, Text(4096)] = ""
    draft_tokens: Count = 0
    prompt_tokens: Count = 0
    first_text: TokenText = ""
    generated: Count = 0
    plain_decode_ms: Number | None = None       # medians of the repeats (measured)
    speculative_decode_ms: Number | None = None
    speedup: Number | None = None
    plain_passes: Count = 0
    passes: Count = 0
    drafted: Count = 0
    accepted: Count = 0
    acceptance: Number | None = None
    tokens_per_pass: Number | None = None
    draft_share: Number | None = None           # drafting's share of the speculative decode time
    tokens_match: bool = False
    first_difference: Count | None = None       # the first token where they part, if they do


def check(target: Any, settings: SpeculativeSettings) -> None:
    refusal = kvformula.speculative_refusal(target.facts)
    if refusal:
        raise ParameterError(f"Speculative decoding is not available for {target.facts.name}: {refusal}")
    if not settings.prompt.strip():
        raise ParameterError("The prompt is empty: pick a prompt or type one")
    ids = target.encode(settings.prompt)
    target.check_prompt(len(ids))
    if len(ids) + settings.new_tokens > target.facts.max_context:
        raise ParameterError(f"The prompt's {len(ids):,} tokens and {settings.new_tokens:,} new ones do not fit the "
                             f"context of {target.facts.max_context:,}: ask for fewer new tokens")


def _drafter(experiment: Experiment, settings: SpeculativeSettings):
    from engine.model.models import load  # torch: only where a lesson runs, never where it is read
    from engine.run.speculative_decode import DraftModel, PromptLookup

    session = experiment.session
    if settings.drafter == PROMPT_LOOKUP:
        return PromptLookup(session.eos_ids)
    source = session.facts.source if settings.drafter == SELF else settings.drafter
    experiment.progress(0, 2 * settings.repeats, f"loading the draft model ({source}, {settings.draft_dtype})")
    try:
        return DraftModel(load(source, str(session.device), settings.draft_dtype), session.tokenizer.get_vocab(),
                          settings.draft_dtype)
    except ModelSourceError as exc:
        raise ParameterError(f"The draft model could not be loaded: {exc}") from None


@dataclass(frozen=True)
class DecodePoint(LessonPoint):
    """One repeat of plain or speculative decode of the same prompt (its series says which)."""

    series = "plain"
    family = ("plain", "speculative")
    series_column = Column("decode")

    repeat: Annotated[int, Column("repeat", "{:,d}", shift=1)]        # from 0; shown from 1
    decode_ms: Annotated[float, Column("decode ms", "{:,.0f}")]
    prefill_ms: float
    generated: int
    passes: Annotated[int, Column("forward passes", "{:,d}")]
    drafted: Annotated[int, Column("guessed", "{:,d}")]
    accepted: Annotated[int, Column("kept", "{:,d}")]
    decode_tok_s: Annotated[float, Column("tok/s", "{:,.1f}")]


@dataclass(frozen=True)
class DraftPass(LessonEvent):
    """One verification pass of speculative decoding (repeat ``repeat`` of the experiment): the guesses
    (``drafted``, their text), how many the model kept (a prefix), and the token it chose after them (a
    correction where a guess was rejected, a bonus where all were kept). Times by the run's clock."""

    repeat: Annotated[int, Range(0, 1 << 10)]
    index: Count
    position: Annotated[int, Range(1, MAX_CONTEXT)]
    drafted: Annotated[list[TokenId], Items(MAX_DRAFT)]
    drafted_text: Annotated[list[TokenText], Items(MAX_DRAFT)]
    accepted: Annotated[int, Range(0, MAX_DRAFT)]
    token_id: TokenId
    text: TokenText
    draft_ms: Ms
    verify_ms: Ms

    def check(self, vocab_size: int, max_context: int) -> None:
        top = vocab_size - 1
        if any(t > top for t in self.drafted) or self.token_id > top:
            raise FieldError(f"drafted and token_id must be token ids from 0 to {top:,}")
        if len(self.drafted_text) != len(self.drafted):
            raise FieldError(f"drafted_text has {len(self.drafted_text):,} entries; drafted has "
                             f"{len(self.drafted):,}")
        if self.accepted > len(self.drafted):
            raise FieldError(f"accepted must be between 0 and {len(self.drafted):,}, not {self.accepted:,}")
        if self.position > max(max_context - 1, 1):
            raise FieldError(f"position must be between 1 and {max(max_context - 1, 1):,}")


def run(experiment: Experiment, settings: SpeculativeSettings) -> SpeculativeResult:
    from engine.run.speculative_decode import decode

    session = experiment.session
    ids = session.encode(settings.prompt)
    guesser = _drafter(experiment, settings)
    decode(session, ids, 4, guesser, settings.draft_tokens, experiment.cancel)  # warm-up, not measured
    runs: dict[str, list] = {"plain": [], "speculative": []}
    shares: list[float] = []
    total = 2 * settings.repeats
    for repeat in range(settings.repeats):
        for name, who, k in (("plain", None, 0), ("speculative", guesser, settings.draft_tokens)):
            if experiment.cancelled:
                break
            experiment.progress(len(runs["plain"]) + len(runs["speculative"]), total,
                                f"repeat {repeat + 1} of {settings.repeats}: {name} decode")
            meter = LoadMeter()
            meter.start()
            result = decode(session, ids, settings.new_tokens, who, k, experiment.cancel)
            meter.stop()
            if meter.share() is not None:
                shares.append(meter.share())
            runs[name].append(result)
            generated = len(result.tokens)
            experiment.point(DecodePoint(
                repeat=repeat, decode_ms=result.decode_ms, prefill_ms=result.prefill_ms, generated=generated,
                passes=len(result.passes), drafted=result.drafted, accepted=result.accepted,
                decode_tok_s=(generated - 1) / (result.decode_ms / 1000.0) if result.decode_ms else 0.0), name)
            if name == "speculative":
                _emit_passes(experiment, repeat, result)
    experiment.progress(total, total, "done")
    share = min(shares) if shares else None
    if not runs["plain"] or not runs["speculative"] or experiment.cancelled:
        return SpeculativeResult(incomplete=True, lowest_cpu_share=share)
    plain, spec = runs["plain"][-1], runs["speculative"][-1]
    plain_ms = statistics.median(r.decode_ms for r in runs["plain"])
    spec_ms = statistics.median(r.decode_ms for r in runs["speculative"])
    difference = next((i for i, (a, b) in enumerate(zip(plain.tokens, spec.tokens)) if a != b), None)
    if difference is None and len(plain.tokens) != len(spec.tokens):
        difference = min(len(plain.tokens), len(spec.tokens))
    return SpeculativeResult(
        drafter=guesser.name, draft_tokens=settings.draft_tokens, prompt_tokens=len(ids),
        first_text=session.token_text(spec.tokens[0]), generated=len(spec.tokens), plain_decode_ms=plain_ms,
        speculative_decode_ms=spec_ms, speedup=plain_ms / spec_ms if spec_ms else None,
        plain_passes=len(plain.passes), passes=len(spec.passes), drafted=spec.drafted, accepted=spec.accepted,
        acceptance=spec.accepted / spec.drafted if spec.drafted else 0.0,
        tokens_per_pass=(len(spec.tokens) - 1) / len(spec.passes) if spec.passes else 0.0,
        draft_share=sum(p.draft_ms for p in spec.passes) / spec.decode_ms if spec.decode_ms else 0.0,
        tokens_match=difference is None, first_difference=difference, lowest_cpu_share=share)


def _emit_passes(experiment: Experiment, repeat: int, result: Any) -> None:
    text = experiment.session.token_text
    for p in result.passes:
        experiment.emit(DraftPass(experiment.exp_id, experiment.ms(), repeat, p.index, p.position, list(p.drafted),
                                  [text(t) for t in p.drafted], p.accepted, p.token_id, text(p.token_id), p.draft_ms,
                                  p.verify_ms))


def timeline(items: Sequence[object]) -> list[Span | Counter]:
    """Each repeat's verification passes on a track of its own, draft then verify, back to back from their
    measured durations (the last ending when they were reported)."""
    by_repeat: dict[int, list[DraftPass]] = {}
    for p in items:
        if isinstance(p, DraftPass):
            by_repeat.setdefault(p.repeat, []).append(p)
    out: list[Span | Counter] = []
    laid = {"layout": "back to back from measured durations"}
    for repeat, done in by_repeat.items():
        track = f"speculative repeat {repeat + 1}: draft, then verify"
        start = max(done[0].t_ms - sum(p.draft_ms + p.verify_ms for p in done), 0.0)
        for p in done:
            out.append(Span(track, f"draft {len(p.drafted)}", start, p.draft_ms, "draft", laid))
            out.append(Span(track, f"verify: kept {p.accepted} of {len(p.drafted)}", start + p.draft_ms,
                            p.verify_ms, "verify", {**laid, "kept": p.accepted, "guessed": "".join(p.drafted_text)}))
            start += p.draft_ms + p.verify_ms
    return out


def table(points: Sequence[ExperimentPoint], result: SpeculativeResult) -> str:
    lines = table_lines(of(points, DecodePoint), DecodePoint)
    if result.speedup is not None:
        lines += ["", f"{result.drafter}: {result.accepted} of {result.drafted} guesses kept "
                  f"({result.acceptance:.0%}), {result.tokens_per_pass:.2f} tokens per forward pass, decode "
                  f"{result.speedup:.2f}x as fast (median of the repeats, measured; drafting "
                  f"{result.draft_share:.0%} of the speculative time)",
                  "same tokens as plain greedy decode: " + ("yes" if result.tokens_match else
                                                            f"NO, from token {result.first_difference}")]
    return "\n".join(lines)


LESSON = Lesson(kind="speculative", title="Speculative decoding", settings=SpeculativeSettings,
                result=SpeculativeResult, run=run, table=table, check=check, points=(DecodePoint,),
                events=(DraftPass,), timeline=timeline,
                quick={"new_tokens": 12, "repeats": 1, "prompt": "The cache keeps what attention has already read."},
                course={"new_tokens": 48, "repeats": 1})
