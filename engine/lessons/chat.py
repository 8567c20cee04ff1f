"""Lesson: a conversation with and without reusing the KV cache across turns. With reuse only the new turn is
prefilled and TTFT stays flat; without, every turn prefills the whole conversation again and TTFT grows. Run
greedy, several times with the order alternating, so a machine busy for a moment cannot decide the
comparison: each turn's median TTFT both ways with the spread, and a difference called clear only where the
spreads do not overlap.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any, ClassVar

from engine.facts.errors import ParameterError
from engine.facts.events import ExperimentPoint, LessonResult, LessonSettings
from engine.facts.fields import Column, Count, Items, Key, Positive, PromptText, Range, Setting
from engine.facts.params import GenerationParams
from engine.facts.vocabulary import LessonPoint, of, table_lines
from engine.run.experiment import Experiment, Lesson
from engine.run.workloads import CONVERSATION

MAX_TURNS = 32


@dataclass(frozen=True)
class ChatSettings(LessonSettings):
    kind = "chat"

    turns: Annotated[tuple[PromptText, ...], Items(MAX_TURNS)] = CONVERSATION
    new_tokens: Annotated[int, Range(1, 4096), Setting(
        "--tokens", "New tokens per turn", "new tokens per reply", "tokens"), Key("M", factor=2.0)] = 48
    repeats: Annotated[int, Range(1, 20), Setting(
        "--repeats", "Repeats", "how many times the comparison runs, order alternating")] = 3

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.turns or not all(t.strip() for t in self.turns):
            raise ParameterError("The chat comparison needs turns, none of them empty")


@dataclass(frozen=True)
class TurnFigures:
    """One turn of the comparison: median TTFT with and without reuse, the range of the repeats, and whether
    the two ranges are apart (a difference beyond the noise)."""

    turn: Annotated[int, Range(1, MAX_TURNS)]
    on_ms: Positive
    off_ms: Positive
    on_range: Annotated[tuple[Positive, ...], Items(2)]
    off_range: Annotated[tuple[Positive, ...], Items(2)]
    clear: bool


@dataclass(frozen=True)
class ChatResult(LessonResult):
    kind = "chat"
    token_checks: ClassVar[tuple[str, ...]] = ("tokens_match",)

    tokens_match: bool = False
    repeats: Count = 0
    per_turn: Annotated[tuple[TurnFigures, ...], Items(MAX_TURNS)] = field(default_factory=tuple)

    @property
    def turns(self) -> int:
        return len(self.per_turn)


def check(target: Any, settings: ChatSettings) -> None:
    """Refused before it starts when the whole conversation cannot fit: every turn, and up to ``new_tokens``
    of reply after each, must fit the context at the last turn."""
    messages: list[dict] = []
    for turn in settings.turns:
        messages += [{"role": "user", "content": turn}, {"role": "assistant", "content": ""}]
    needed = len(target.encode_chat(messages[:-1])) + len(settings.turns) * settings.new_tokens
    context = target.facts.max_context
    if needed > context:
        raise ParameterError(f"The conversation's {len(settings.turns)} turns with up to {settings.new_tokens} new "
                             f"tokens each need about {needed:,} positions by the last turn, but "
                             f"{target.facts.name}'s context holds {context:,}: fewer turns or fewer new tokens")


@dataclass(frozen=True)
class TurnPoint(LessonPoint):
    """One turn of one repeat, with the cache reused between turns or not."""

    series = "turn"

    repeat: Annotated[int, Column("repeat", "{:d}")]
    reuse: Annotated[bool, Column("reuse", words=("off", "on"))]
    turn: Annotated[int, Column("turn", "{:d}")]
    reused_tokens: Annotated[int, Column("reused (cache_n)", "{:,d}")]
    prefilled_tokens: Annotated[int, Column("prefilled", "{:,d}")]
    conversation_tokens: Annotated[int, Column("conversation", "{:,d}")]
    prefill_ms: Annotated[float, Column("prefill ms", "{:,.1f}")]
    ttft_ms: Annotated[float, Column("TTFT ms", "{:,.1f}")]
    generated: int


def run(experiment: Experiment, settings: ChatSettings) -> ChatResult:
    session = experiment.session
    turns, repeats = settings.turns, settings.repeats
    params = GenerationParams(max_new_tokens=settings.new_tokens)
    replies: dict[bool, list[list[int]]] = {}
    ttft: dict[tuple[bool, int], list[float]] = {}
    shares: list[float] = []
    total, done = 2 * len(turns) * repeats, 0
    for r in range(repeats):
        for reuse in ((True, False) if r % 2 == 0 else (False, True)):
            session.forget("a new conversation started")
            messages: list[dict] = []
            conversation_replies = []
            for i, turn in enumerate(turns):
                if experiment.cancelled:
                    return ChatResult(incomplete=True)
                experiment.progress(done, total, f"repeat {r + 1}: turn {i + 1} with reuse {'on' if reuse else 'off'}")
                messages.append({"role": "user", "content": turn})
                s = session.chat(messages, params, experiment.emit, experiment.cancel, reuse=reuse).summary
                done += 1
                conversation_replies.append(s.token_ids)
                messages.append({"role": "assistant", "content": s.text})
                ttft.setdefault((reuse, i + 1), []).append(s.ttft_ms)
                if s.cpu_share is not None:
                    shares.append(s.cpu_share)
                experiment.point(TurnPoint(repeat=r + 1, reuse=reuse, turn=i + 1, reused_tokens=s.reused_tokens,
                                           prefilled_tokens=s.prompt_tokens,
                                           conversation_tokens=s.reused_tokens + s.prompt_tokens,
                                           prefill_ms=s.prefill_ms, ttft_ms=s.ttft_ms, generated=s.generated_tokens))
            if replies.setdefault(reuse, conversation_replies) != conversation_replies:
                replies[reuse] = []                         # greedy replies must repeat exactly
    session.forget("a new conversation started")
    experiment.progress(total, total, "done")
    per_turn = []
    for i in range(1, len(turns) + 1):
        on, off = ttft[(True, i)], ttft[(False, i)]
        per_turn.append(TurnFigures(i, statistics.median(on), statistics.median(off), (min(on), max(on)),
                                    (min(off), max(off)), max(on) < min(off) or max(off) < min(on)))
    return ChatResult(tokens_match=replies[True] == replies[False] and bool(replies[True]), repeats=repeats,
                      per_turn=tuple(per_turn), lowest_cpu_share=min(shares) if shares else None)


def turn_line(t: TurnFigures, repeats: int) -> str:
    """One turn of the comparison: medians, spreads, and whether the difference stands out of the noise."""
    verdict = (f"reuse {t.off_ms / t.on_ms:.1f}x faster" if t.on_ms < t.off_ms else
               f"reuse {t.on_ms / t.off_ms:.1f}x slower") if t.clear else "no clear difference: the spreads overlap"
    return (f"turn {t.turn}: TTFT median {t.on_ms:,.0f} ms with reuse ({t.on_range[0]:,.0f}-{t.on_range[1]:,.0f}), "
            f"{t.off_ms:,.0f} ms without ({t.off_range[0]:,.0f}-{t.off_range[1]:,.0f}) over {repeats} repeats: "
            f"{verdict}")


def table(points: Sequence[ExperimentPoint], result: ChatResult) -> str:
    lines = table_lines(of(points, TurnPoint), TurnPoint)
    if result.per_turn:
        lines += ["", f"replies identical with and without reuse: {'yes' if result.tokens_match else 'NO'}"]
        lines += [turn_line(t, result.repeats) for t in result.per_turn]
    return "\n".join(lines)


LESSON = Lesson(kind="chat", title="Chat: cache reuse", settings=ChatSettings, result=ChatResult, run=run,
                table=table, check=check, points=(TurnPoint,),
                quick={"turns": ("hi", "and then?"), "new_tokens": 6, "repeats": 2},
                course={"new_tokens": 32, "repeats": 1})
