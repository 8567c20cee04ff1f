"""Lesson: paged KV and prefix sharing, watched inside transformers' own continuous batching
(``engine.run.paged_serving``). Requests that share a system prompt arrive every few steps and are served from
one pool of fixed-size blocks, block sharing on (every step's block table is emitted) and off; then the same arrivals go
through KVScope's own scheduler. The result: blocks held at the peak with and without sharing (measured from
the block tables) beside what a contiguous cache would reserve for the same requests (computed: prompt plus
``reserve`` positions each, as a server reserves for a request's max_tokens), the prefix blocks shared, and
both schedulers' timings and tokens.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, ClassVar

from engine.facts import kvformula, prefix_misses
from engine.facts.errors import ParameterError
from engine.facts.events import ExperimentPoint, LessonResult, LessonSettings
from engine.facts.fields import MAX_REQUESTS, MAX_TEXT, Bytes, Column, Count, Key, Message, Number, Range, Setting, Text
from engine.facts.textstream import clean_text, pieces
from engine.facts.vocabulary import LessonPoint, of, table_lines
from engine.run.experiment import Counter, Experiment, Lesson, Span
from engine.run.model_session import ModelSession
from engine.serve.block_events import BlockTable, PrefixMiss
from engine.serve.workload import read_workload

SYSTEM = ("You are the support assistant of a library. Answer in one short sentence, politely, and never invent "
          "opening hours: the library opens at nine and closes at six on weekdays, and is closed on Sundays.")
QUESTIONS = ("When do you open on Monday?", "Are you open on Sunday?", "Can I return a book at seven?",
             "What time do you close on Friday?", "Do you open before nine?", "Is the library open on Saturday?",
             "Can I come at noon on Tuesday?", "When do you close on Wednesday?")


@dataclass(frozen=True)
class PagedSettings(LessonSettings):
    kind = "paged"

    requests: Annotated[int, Range(1, 64), Setting(
        "--requests", "Requests (one system prompt)", "how many requests arrive")] = 6
    arrive_every: Annotated[int, Range(0, 10_000), Setting(
        "--arrive-every", "A new request every", "decode steps between arrivals", "steps")] = 3
    new_tokens: Annotated[int, Range(1, 1024), Setting(
        "--tokens", "New tokens per request", "new tokens per request", "tokens"), Key("M", factor=2.0)] = 16
    page_size: Annotated[int, Range(4, 1024), Setting(
        "--page-size", "Block size", "positions per block", "positions")] = 16
    workload: Annotated[str, Text(4096), Setting(
        "--workload", "Workload file", "your own prompts, a JSON-lines file (prompt or messages, max_tokens: the "
        "same file as load --workload), served instead of the system-prompt questions, one arriving every "
        f"--arrive-every steps (arrival_s is not used here), at most {MAX_REQUESTS}; empty: KVScope's own")] = ""
    pool_blocks: Annotated[int, Range(0, 1 << 16), Setting(
        "--blocks", "Blocks in the pool", "blocks in the paged cache's pool; a small pool evicts cached blocks "
        "(0: room for every request at once)", "blocks", special="room for all")] = 0
    reserve: Annotated[int, Range(1, 1 << 20)] = 256
    compare: bool = True
    system: Message = SYSTEM

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.reserve < self.new_tokens:
            raise ParameterError(f"reserve ({self.reserve:,}) must be at least the new tokens ({self.new_tokens:,})")


@dataclass(frozen=True)
class PagedResult(LessonResult):
    kind = "paged"
    token_checks: ClassVar[tuple[str, ...]] = ("tokens_match_solo",)

    bytes_per_position: Bytes = 0
    bytes_per_block: Bytes = 0
    peak_blocks_shared: Count = 0
    peak_blocks_unshared: Count = 0
    peak_bytes_shared: Bytes = 0
    peak_bytes_unshared: Bytes = 0
    contiguous_bytes_at_peak: Bytes = 0
    used_bytes_at_peak: Bytes = 0
    shared_prefix_tokens: Count = 0
    shared_prefix_blocks: Count = 0
    sharing_saves: Number | None = None
    same_tokens_with_and_without_sharing: bool | None = None
    tokens_match_solo: bool | None = None
    reserve: Count = 0
    transformers_tok_s: Number | None = None
    transformers_mean_ttft_ms: Number | None = None
    transformers_mean_e2e_ms: Number | None = None
    ours_tok_s: Number | None = None
    ours_mean_ttft_ms: Number | None = None
    ours_mean_e2e_ms: Number | None = None
    same_tokens_as_ours: bool | None = None
    mean_ttft_spread: Number | None = None
    workload: Annotated[str, Text(300)] = ""    # the file's name, when the prompts were the user's

    def prefix_words(self) -> str:
        """What ``shared_prefix_tokens`` measures: the system prompt KVScope's requests share, or, for a workload,
        the longest prefix two consecutive requests share."""
        return ("the longest prefix two consecutive requests share" if self.workload
                else "the shared system prompt")


def _requests(session: ModelSession, settings: PagedSettings) -> list[tuple[list[int], int, str]]:
    """Each request's prompt ids, new tokens and what names it in a message (a workload's file and line)."""
    if not settings.workload:
        return [(_encode(session, settings.system, QUESTIONS[i % len(QUESTIONS)]), settings.new_tokens,
                 f"request {i}") for i in range(settings.requests)]
    workload = read_workload(settings.workload, MAX_REQUESTS)
    out = []
    for i, request in enumerate(workload.requests):
        messages = request.chat()
        ids = session.encode_chat(messages) if session.has_chat_template else \
            session.encode("\n".join(m["content"] for m in messages), chat_template=False)
        out.append((ids, request.max_tokens or settings.new_tokens,
                    f"{Path(settings.workload).name} request {i + 1}"))
    return out


def check(target: Any, settings: PagedSettings) -> None:
    from engine.run.paged_serving import check_transformers, paged_refusal  # transformers: only where a lesson runs

    refusal = paged_refusal(target.facts)
    if refusal:
        raise ParameterError(f"The paged cache lesson is not available for {target.facts.name}: {refusal}")
    check_transformers()
    for ids, new_tokens, named in _requests(target, settings):
        if not ids:
            raise ParameterError(f"{named} has an empty prompt")
        if len(ids) + new_tokens > target.facts.max_context:
            raise ParameterError(f"{named}: {len(ids):,} prompt tokens + {new_tokens:,} new ones do not fit the "
                                 f"context of {target.facts.max_context:,}")
        need = -(-(len(ids) + new_tokens) // settings.page_size)
        if settings.pool_blocks and need > settings.pool_blocks:
            raise ParameterError(f"{named} needs {need:,} blocks of {settings.page_size} positions; the pool holds "
                                 f"{settings.pool_blocks:,} (--blocks)")


@dataclass(frozen=True)
class PagedRequestPoint(LessonPoint):
    """One request through transformers' paged batching, with block sharing on or off (ms from its arrival)."""

    series = "request"

    sharing: Annotated[bool, Column("block sharing", words=("off", "on"))]
    index: Annotated[int, Column("request", "{:d}")]
    prompt_tokens: Annotated[int, Column("prompt", "{:,d}")]
    new_tokens: int
    queue_ms: Annotated[float, Column("waited ms", "{:,.1f}")]
    ttft_ms: Annotated[float, Column("TTFT ms", "{:,.1f}")]
    e2e_ms: Annotated[float, Column("end-to-end ms", "{:,.1f}")]
    cached_tokens: Annotated[int | None, Column("cached", "{:,d}")] = None     # recorded before this: absent
    computed_tokens: Annotated[int | None, Column("computed", "{:,d}")] = None


def run(experiment: Experiment, settings: PagedSettings) -> PagedResult:
    from engine.run.batch_generate import generate_batch
    from engine.run.paged_serving import PagedRequest, Pool, Snapshot, serve_paged
    from engine.run.scheduler import ScheduledRequest, serve

    session, page = experiment.session, settings.page_size
    requests = _requests(session, settings)
    prompts = [ids for ids, _, _ in requests]
    per_request = -(-max(len(ids) + new for ids, new, _ in requests) // page)
    num_blocks = settings.pool_blocks or len(requests) * per_request + 4   # room for every request without sharing
    total_steps = 3 if settings.compare else 2
    peaks: dict[bool, dict] = {}
    runs: dict[bool, list] = {}
    for done, sharing in enumerate((True, False)):
        experiment.progress(done, total_steps,
                            f"transformers' continuous batching, block sharing {'on' if sharing else 'off'}")
        batch = [PagedRequest(i, ids, new, i * settings.arrive_every) for i, (ids, new, _) in enumerate(requests)]
        peak = {"blocks": 0, "reserved": 0, "used": 0}

        def step(snap: Snapshot, sharing: bool = sharing, peak: dict = peak, batch: list = batch) -> None:
            held = len({b for table in snap.tables for b in table})
            if held > peak["blocks"]:
                peak.update(blocks=held, used=sum(snap.positions),
                            reserved=sum(len(batch[i].ids) + settings.reserve for i in snap.running))
            if sharing:
                shared = sorted(snap.shared)
                experiment.emit(BlockTable(experiment.exp_id, experiment.ms(), snap.step, page, snap.total,
                                           snap.running, snap.tables, snap.positions, snap.waiting, shared,
                                           [snap.shared[b] for b in shared], snap.cached, snap.free))

        if not serve_paged(session.model, batch, Pool(page, num_blocks, sharing), on_step=step,
                           cancel=experiment.cancel):
            return PagedResult(incomplete=True)
        peaks[sharing], runs[sharing] = peak, batch
        if sharing:
            for r in batch:
                experiment.emit(_miss(experiment, session, r, batch, page))
        for r in batch:
            experiment.point(PagedRequestPoint(
                sharing=sharing, index=r.index, prompt_tokens=len(r.ids), new_tokens=len(r.tokens),
                cached_tokens=r.cached_tokens if sharing else 0,
                computed_tokens=len(r.ids) - (r.cached_tokens if sharing else 0),
                queue_ms=r.admitted_ms - r.arrival_ms, ttft_ms=r.first_token_ms - r.arrival_ms,
                e2e_ms=r.done_ms - r.arrival_ms))
    figures = {**_block_figures(session, runs, peaks, page, prompts), "reserve": settings.reserve,
               "workload": Path(settings.workload).name[:300] if settings.workload else ""}
    solo = []
    for ids, new, _ in requests:                         # each alone, for the token check; stopped between passes
        alone = generate_batch(session.model, [ids], new, 0, session.device, experiment.cancel)
        if alone.stopped:
            return PagedResult(incomplete=True)
        solo.append(alone.tokens[0])
    figures["tokens_match_solo"] = solo == [r.tokens for r in runs[True]]
    figures.update(_timings("transformers", runs[True]))
    figures["mean_ttft_spread"] = statistics.pstdev(r.first_token_ms - r.arrival_ms for r in runs[True])
    if settings.compare:
        experiment.progress(2, total_steps, "the same arrivals through KVScope's own scheduler")
        ours = [ScheduledRequest(i, ids, new, i * settings.arrive_every) for i, (ids, new, _) in enumerate(requests)]
        if not serve(session, ours, "continuous", cancel=experiment.cancel):
            return PagedResult(incomplete=True, **figures)
        figures.update(_timings("ours", ours), same_tokens_as_ours=[r.tokens for r in ours] ==
                       [r.tokens for r in runs[True]])
    experiment.progress(total_steps, total_steps, "done")
    return PagedResult(**figures)


def _miss(experiment: Experiment, session: ModelSession, r: Any, batch: list, page: int) -> PrefixMiss:
    """Why ``r``'s computed prompt tokens were not read from the cache, from what the allocator did at its admission
    (``engine.facts.prefix_misses``); earlier: the requests admitted before it."""
    earlier = [(o.index, o.ids) for o in batch if 0 <= o.admitted_step < r.admitted_step
               or (o.admitted_step == r.admitted_step and o.index < r.index)]
    miss = prefix_misses.explain(r.ids, page, r.cached_tokens, earlier, r.block_states, r.evicted_words)
    def text(token: int | None) -> str:
        return clean_text(session.loaded.tokenizer.decode([token]))[0][:MAX_TEXT] if token is not None else ""

    return PrefixMiss(experiment.exp_id, experiment.ms(), r.index, len(r.ids), miss.cached_tokens,
                      miss.computed_tokens, miss.reason, miss.words[:4096], miss.divergent_position,
                      miss.nearest_request, miss.request_token, miss.cached_token,
                      text(miss.request_token), text(miss.cached_token),
                      [clean_text(piece)[0][:MAX_TEXT] for piece in pieces(session.loaded.tokenizer, r.ids)])


def _encode(session: ModelSession, system: str, question: str) -> list[int]:
    if session.has_chat_template:
        return session.encode_chat([{"role": "system", "content": system}, {"role": "user", "content": question}])
    return session.encode(f"{system}\n{question}\n", chat_template=False)


def _block_figures(session: ModelSession, runs: dict, peaks: dict, page: int, prompts: list) -> dict:
    per_position = kvformula.bytes_per_token(session.facts)
    on, off = peaks[True], peaks[False]
    shared_prefix = max((kvformula.common_prefix(a, b) for a, b in zip(prompts, prompts[1:])), default=0)
    return {
        "bytes_per_position": per_position, "bytes_per_block": per_position * page,
        "peak_blocks_shared": on["blocks"], "peak_blocks_unshared": off["blocks"],
        "peak_bytes_shared": on["blocks"] * page * per_position,
        "peak_bytes_unshared": off["blocks"] * page * per_position,
        "contiguous_bytes_at_peak": off["reserved"] * per_position, "used_bytes_at_peak": off["used"] * per_position,
        "shared_prefix_tokens": shared_prefix, "shared_prefix_blocks": shared_prefix // page,
        "sharing_saves": 1.0 - on["blocks"] / off["blocks"] if off["blocks"] else 0.0,
        "same_tokens_with_and_without_sharing": [r.tokens for r in runs[True]] == [r.tokens for r in runs[False]]}


def _timings(prefix: str, batch: list) -> dict:
    span = max(r.done_ms for r in batch) - min(r.arrival_ms for r in batch)
    return {f"{prefix}_tok_s": sum(len(r.tokens) for r in batch) / (span / 1000.0) if span else 0.0,
            f"{prefix}_mean_ttft_ms": statistics.fmean(r.first_token_ms - r.arrival_ms for r in batch),
            f"{prefix}_mean_e2e_ms": statistics.fmean(r.done_ms - r.arrival_ms for r in batch)}


def timeline(items: Sequence[object]) -> list[Span | Counter]:
    """The blocks held, shared and free after every step, as counters."""
    return [Counter("paged KV blocks", t.t_ms, {"held": len({b for row in t.tables for b in row}),
                                                "shared": len(t.shared_blocks), "free": t.free_blocks})
            for t in items if isinstance(t, BlockTable)]


def table(points: Sequence[ExperimentPoint], result: PagedResult) -> str:
    lines = table_lines(of(points, PagedRequestPoint), PagedRequestPoint)
    if result.peak_blocks_shared:
        mib = 2**20
        r = result
        lines += ["", f"blocks of {r.bytes_per_block:,} B (computed); at the peak: {r.peak_blocks_shared} blocks = "
                  f"{r.peak_bytes_shared / mib:.2f} MiB with sharing, {r.peak_blocks_unshared} = "
                  f"{r.peak_bytes_unshared / mib:.2f} MiB without (measured block counts)",
                  f"a contiguous cache reserving prompt + {r.reserve} positions per request: "
                  f"{r.contiguous_bytes_at_peak / mib:.2f} MiB (computed) for {r.used_bytes_at_peak / mib:.2f} MiB "
                  "written",
                  f"{r.prefix_words()}: {r.shared_prefix_tokens} tokens = {r.shared_prefix_blocks} full blocks; "
                  f"tokens equal solo runs: {'yes' if r.tokens_match_solo else 'NO'}"]
        if r.ours_tok_s is not None:
            lines.append(f"same arrivals: transformers' paged batching {r.transformers_tok_s:.1f} tok/s, mean TTFT "
                         f"{r.transformers_mean_ttft_ms:.0f} ms; KVScope's scheduler {r.ours_tok_s:.1f} tok/s, "
                         f"{r.ours_mean_ttft_ms:.0f} ms (measured); tokens "
                         f"{'identical' if r.same_tokens_as_ours else 'different'}")
    return "\n".join(lines)


LESSON = Lesson(kind="paged", title="Paged KV", settings=PagedSettings, result=PagedResult, run=run, table=table,
                check=check, points=(PagedRequestPoint,), events=(BlockTable, PrefixMiss), timeline=timeline,
                quick={"requests": 3, "new_tokens": 4},
                course={"new_tokens": 12})
