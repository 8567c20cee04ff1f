"""Lesson: prefill and decode apart. The same arrivals of short and long prompts served two ways on this machine:
colocated (one worker, both phases: a long prefill holds back every running request's next token) and
disaggregated (a prefill worker in a process of its own hands each request's KV cache, its tensors' bytes, over a
Unix socket to the decode worker, which continues from it). Measured per request: TTFT, every inter-token gap,
the bytes handed over and how long it took; per mode: tokens/s and the p50 / p99 gaps. The tokens are greedy and
the same both ways and as a plain run of each prompt.

At this scale the two workers split one machine's cores (said on screen); on a GPU pair each has its own, and
the hand-over crosses a link instead of a socket: its cost for a 7B model is computed from published link rates.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, ClassVar

from engine.facts import kvformula
from engine.facts.contention import LoadMeter
from engine.facts.errors import ParameterError
from engine.facts.events import ExperimentPoint, LessonResult, LessonSettings
from engine.facts.fields import Bytes, Column, Count, Items, Key, Message, Number, Range, Setting
from engine.facts.vocabulary import LessonPoint, of, table_lines
from engine.run import prefill_worker
from engine.run.experiment import Experiment, Lesson
from engine.run.workloads import filler_ids, sample_texts

MODES = ("colocated", "disaggregated")
# A 7B-class model's cache per token: Llama-3.1-8B's config.json (32 layers, 8 KV heads of 128), bfloat16.
SEVEN_B = ("Llama-3.1-8B", 2 * 32 * 8 * 128 * 2)
LINKS = (("PCIe 4.0 x16", 31.5e9, "PCI-SIG: 16 GT/s x 16 lanes, one direction"),
         ("InfiniBand NDR", 50e9, "400 Gb/s, NVIDIA ConnectX-7"),
         ("NVLink 4", 450e9, "NVIDIA H100 SXM: 900 GB/s both directions"))



def _bytes_or_dash(value: float) -> str:
    return kvformula.format_bytes(int(value)) if value else "-"


@dataclass(frozen=True)
class ServedPoint(LessonPoint):
    """One request served in one mode: when it waited, was prefilled, handed over and decoded (ms from the first
    arrival), its inter-token gaps, and its hand-over's time and bytes (disaggregated only)."""

    series = "request"

    mode: Annotated[int, Column("mode", words=MODES)]
    index: Annotated[int, Column("request", "{:d}")]
    prompt_tokens: Annotated[int, Column("prompt", "{:,d}")]
    arrival_ms: float
    ttft_ms: Annotated[float, Column("TTFT ms", "{:,.1f}")]
    tokens: int
    p50_gap_ms: Annotated[float | None, Column("p50 gap ms", "{:,.1f}")]
    max_gap_ms: Annotated[float | None, Column("max gap ms", "{:,.1f}")]
    handover_ms: Annotated[float | None, Column("hand-over ms", "{:,.1f}")]
    transfer_ms: float | None
    handover_bytes: Annotated[int | None, Column("bytes handed over", show=_bytes_or_dash)]
    formula_bytes: int
    prefill_start_ms: float | None
    prefill_end_ms: float | None
    handover_ready_ms: float | None
    last_token_ms: float


@dataclass(frozen=True)
class GapPoint(LessonPoint):
    """The wait before one token of one request (``t_ms``: when it came)."""

    series = "gap"

    mode: int
    request: int
    token: int
    t_ms: float
    gap_ms: float

@dataclass(frozen=True)
class DisaggregationSettings(LessonSettings):
    kind = "disaggregation"

    requests: Annotated[int, Range(2, 64), Setting("--requests", "Requests", "how many requests arrive")] = 6
    arrive_every_ms: Annotated[int, Range(0, 60_000), Setting(
        "--arrive-every-ms", "A new request every", "milliseconds between arrivals", "ms")] = 250
    short_prompt: Annotated[int, Range(4, 4096), Setting(
        "--short", "Short prompts", "prompt tokens of the short requests", "tokens")] = 32
    long_prompt: Annotated[int, Range(16, 32_768), Setting(
        "--long", "Long prompts", "prompt tokens of the long requests", "tokens")] = 1536
    long_every: Annotated[int, Range(1, 64), Setting(
        "--long-every", "Every Nth is long", "which arrivals bring a long prompt: every Nth")] = 3
    new_tokens: Annotated[int, Range(2, 512), Setting(
        "--tokens", "New tokens", "greedy tokens each request decodes", "tokens"), Key("M", factor=2.0)] = 24
    silent_s: Annotated[int, Range(1, 600), Setting(
        "--silent-s", "A silent worker is stopped after", "seconds the prefill worker may say nothing while "
        "requests wait on it", "s")] = 120
    check_solo: bool = True


@dataclass(frozen=True)
class ModeFigures:
    mode: Message
    tok_s: Number                      # generated tokens over the first arrival to the last token (measured)
    mean_ttft_ms: Number
    p50_gap_ms: Number                 # inter-token gaps of every request (measured)
    p99_gap_ms: Number
    max_gap_ms: Number
    handover_ms: Number | None = None          # mean, the end of a prefill to its tensors ready for decode
    transfer_ms: Number | None = None          # mean, of that: the bytes read and made tensors
    handover_bytes: Bytes = 0                  # all requests
    transfer_bytes_per_s: Number | None = None  # handover_bytes over the summed transfer times (achieved)


@dataclass(frozen=True)
class DisaggregationResult(LessonResult):
    kind = "disaggregation"
    token_checks: ClassVar[tuple[str, ...]] = ("same_tokens_both_modes", "tokens_match_solo")

    modes: Annotated[tuple[ModeFigures, ...], Items(len(MODES))] = ()
    colocated_threads: Count = 0
    prefill_threads: Count = 0
    decode_threads: Count = 0
    same_tokens_both_modes: bool | None = None
    tokens_match_solo: bool | None = None
    handover_matches_formula: bool | None = None     # every hand-over's bytes = the formula x its prompt tokens
    bytes_per_token: Bytes = 0                       # the formula (computed)
    failure: Message = ""


def schedule(settings: DisaggregationSettings) -> list[tuple[int, bool, float]]:
    """(index, long?, arrival ms) of each request."""
    return [(i, i % settings.long_every == settings.long_every - 1 if settings.long_every > 1 else True,
             float(i * settings.arrive_every_ms)) for i in range(settings.requests)]


def check(target: object, settings: DisaggregationSettings) -> None:
    facts = target.facts
    if not str(facts.device).startswith("cpu") or len(set(facts.layer_devices)) > 1:
        raise ParameterError("Disaggregation runs its two workers on this machine's CPU: load the model on cpu, "
                             "whole (not split across devices or disk)")
    if not kvformula.has_kv_cache(facts):
        raise ParameterError(f"{facts.name} keeps no KV cache: there is nothing to hand over")
    refusal = kvformula.batching_refusal(facts)
    if refusal is not None:
        raise ParameterError(f"Disaggregation decodes in a batch, which {facts.name} cannot: {refusal}")
    from engine.model.kv_compress import refusal

    why = refusal(target.model)
    if why is not None:
        raise ParameterError(f"Disaggregation hands over full-attention caches: {why.split(': ', 1)[0]}")
    if settings.long_prompt + settings.new_tokens > facts.max_context:
        raise ParameterError(f"--long {settings.long_prompt:,} with {settings.new_tokens} new tokens is past "
                             f"{facts.name}'s context of {facts.max_context:,}")


def _percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))] if ordered else float("nan")


def _figures(mode: str, outcome: object) -> ModeFigures:
    served = [s for s in outcome.served if s.token_ms]
    gaps = [g for s in served for g in s.gaps_ms]
    tokens = sum(len(s.tokens) for s in served)
    span_ms = max(s.token_ms[-1] for s in served) - min(s.arrival_ms for s in served) if served else 0.0
    handed = [s for s in served if s.handover_ready_ms is not None]
    transfer = sum(s.transfer_ms or 0.0 for s in handed)
    moved = sum(s.handover_bytes for s in handed)
    return ModeFigures(
        mode=mode, tok_s=tokens / (span_ms / 1000.0) if span_ms > 0 else 0.0,
        mean_ttft_ms=statistics.fmean(s.ttft_ms for s in served) if served else 0.0,
        p50_gap_ms=_percentile(gaps, 0.5) if gaps else 0.0, p99_gap_ms=_percentile(gaps, 0.99) if gaps else 0.0,
        max_gap_ms=max(gaps) if gaps else 0.0,
        handover_ms=statistics.fmean(s.handover_ready_ms - s.prefill_end_ms for s in handed) if handed else None,
        transfer_ms=statistics.fmean(s.transfer_ms or 0.0 for s in handed) if handed else None,
        handover_bytes=moved, transfer_bytes_per_s=moved / (transfer / 1000.0) if transfer > 0 else None)


def run(experiment: Experiment, settings: DisaggregationSettings) -> DisaggregationResult:
    import torch  # only where a lesson runs, never where it is read

    from engine.run import kv_handover as dg

    session = experiment.session
    facts = session.facts
    texts = [session.encode(t, chat_template=False) for t in sample_texts()]
    long_ids = filler_ids(session, settings.long_prompt)
    requests = []
    for i, is_long, arrival in schedule(settings):
        ids = long_ids if is_long else (texts[i % len(texts)] * settings.short_prompt)[: settings.short_prompt]
        requests.append(dg.ArrivingRequest(i, list(ids), arrival, settings.new_tokens))
    threads = torch.get_num_threads()
    prefill_threads = max(1, threads // 2)
    decode_threads = max(1, threads - prefill_threads)
    per_token = kvformula.bytes_per_token(facts)
    steps = 3 + int(settings.check_solo)
    experiment.progress(0, steps, f"starting the prefill worker ({prefill_threads} of {threads} threads; "
                                  "it loads the model in its own process)")
    worker = dg.PrefillWorker(facts.source, facts.dtype, prefill_threads)
    outcomes: dict[str, object] = {}
    failure, share = "", None
    try:
        failure = worker.wait_ready(experiment.cancel, idle_s=settings.silent_s)
        if failure == "stopped":
            failure = ""
        if not failure and not experiment.cancelled:
            experiment.progress(1, steps, f"colocated: one worker, {threads} threads, prefill and decode")
            session.prefill(torch.tensor([requests[0].ids[:8]]), use_cache=True)                # warm-up
            meter = LoadMeter()
            meter.start()
            outcomes["colocated"] = dg.colocated(session, requests, experiment.cancel)
            meter.stop()
            share = meter.share(outcomes["colocated"].idle_ms)
        if not failure and not experiment.cancelled:
            experiment.progress(2, steps, f"disaggregated: prefill worker {prefill_threads} thread(s), decode "
                                          f"worker {decode_threads}, the cache handed over a Unix socket")
            torch.set_num_threads(decode_threads)
            try:
                outcome = dg.disaggregated(session, worker, requests, experiment.cancel, settings.silent_s)
            finally:
                torch.set_num_threads(threads)
            outcomes["disaggregated"] = outcome
            failure = outcome.failure
    finally:
        worker.close()
    for m, mode in enumerate(MODES):
        outcome = outcomes.get(mode)
        if outcome is None:
            continue
        for s in outcome.served:
            if not s.token_ms:
                continue
            gaps = s.gaps_ms
            experiment.point(ServedPoint(
                mode=m, index=s.index, prompt_tokens=s.prompt_tokens, arrival_ms=s.arrival_ms, ttft_ms=s.ttft_ms,
                tokens=len(s.tokens), p50_gap_ms=statistics.median(gaps) if gaps else None,
                max_gap_ms=max(gaps) if gaps else None,
                handover_ms=s.handover_ready_ms - s.prefill_end_ms if s.handover_ready_ms is not None else None,
                transfer_ms=s.transfer_ms, handover_bytes=s.handover_bytes or None,
                formula_bytes=per_token * s.prompt_tokens, prefill_start_ms=s.prefill_start_ms,
                prefill_end_ms=s.prefill_end_ms, handover_ready_ms=s.handover_ready_ms,
                last_token_ms=s.token_ms[-1]))
            for k, (t, gap) in enumerate(zip(s.token_ms[1:], gaps)):
                experiment.point(GapPoint(mode=m, request=s.index, token=k + 1, t_ms=t, gap_ms=gap))
    figures = tuple(_figures(mode, outcomes[mode]) for mode in MODES if mode in outcomes)
    complete = all(mode in outcomes and outcomes[mode].complete for mode in MODES) and not failure
    tokens = {mode: {s.index: s.tokens for s in outcomes[mode].served} for mode in outcomes}
    same = tokens.get("colocated") == tokens.get("disaggregated") if complete else None
    solo = None
    if complete and settings.check_solo and not experiment.cancelled:
        experiment.progress(3, steps, "each prompt as a plain run, for its tokens")
        from engine.run.batch_generate import generate_batch

        solo = [generate_batch(session.model, [r.ids], r.new_tokens, 0, session.device).tokens[0]
                for r in requests] == [tokens["colocated"][r.index] for r in requests]
    handed = [s for s in outcomes["disaggregated"].served if s.handover_bytes] if "disaggregated" in outcomes else []
    matches = all(s.handover_bytes == per_token * s.prompt_tokens for s in handed) if handed else None
    experiment.progress(steps, steps, "done" if complete else failure or "stopped")
    return DisaggregationResult(modes=figures, incomplete=not complete, colocated_threads=threads,
                                prefill_threads=prefill_threads, decode_threads=decode_threads,
                                same_tokens_both_modes=same, tokens_match_solo=solo,
                                handover_matches_formula=matches, bytes_per_token=per_token, failure=failure,
                                lowest_cpu_share=share)


def seven_b_lines(prompt_tokens: int) -> list[str]:
    """A 7B-class model's hand-over at ``prompt_tokens``, over published link rates (computed, a lower bound:
    the rate alone, no setup)."""
    name, per_token = SEVEN_B
    size = per_token * prompt_tokens
    lines = [f"{name}'s cache for a {prompt_tokens:,}-token prompt: {kvformula.format_bytes(size)} (computed, "
             "bfloat16)"]
    for link, rate, source in LINKS:
        lines.append(f"  over {link} ({rate / 1e9:,.1f} GB/s, {source}): {size / rate * 1000:,.1f} ms")
    return lines


def table(points: Sequence[ExperimentPoint], result: DisaggregationResult) -> str:
    served = of(points, ServedPoint)
    lines = table_lines(served, ServedPoint) + [""]
    for f in result.modes:
        extra = ""
        if f.handover_ms is not None:
            rate = (f", transfer {kvformula.format_bytes(f.transfer_bytes_per_s)}/s (achieved)"
                    if f.transfer_bytes_per_s else "")
            extra = (f"; hand-over mean {f.handover_ms:.1f} ms ({f.transfer_ms:.1f} ms reading the bytes), "
                     f"{kvformula.format_bytes(f.handover_bytes)} in all{rate}")
        lines.append(f"{f.mode}: {f.tok_s:.1f} tok/s, mean TTFT {f.mean_ttft_ms:.0f} ms, inter-token gap p50 "
                     f"{f.p50_gap_ms:.1f} / p99 {f.p99_gap_ms:.1f} / max {f.max_gap_ms:.1f} ms{extra}")
    lines.append(f"threads: colocated {result.colocated_threads}; disaggregated: prefill worker "
                 f"{result.prefill_threads}, decode worker {result.decode_threads} (one machine split in two)")
    if result.same_tokens_both_modes is not None:
        lines.append(f"tokens: {'the same' if result.same_tokens_both_modes else 'DIFFERENT'} in both modes"
                     + ("" if result.tokens_match_solo is None else
                        f", {'equal to' if result.tokens_match_solo else 'DIFFERENT from'} a plain run of each"))
    if result.handover_matches_formula is not None:
        lines.append(f"hand-over bytes {'=' if result.handover_matches_formula else '!='} the formula "
                     f"({kvformula.format_bytes(result.bytes_per_token)} a token) x each prompt's tokens")
    longest = max((p.prompt_tokens for p in served), default=0)
    if longest:
        lines += [""] + seven_b_lines(longest)
    if result.failure:
        lines.append(f"ended early: {result.failure}")
    return "\n".join(lines)


def run_prefill_worker(argv: Sequence[str]) -> None:
    """The prefill worker's process: SOURCE DTYPE THREADS FD (the socket's end it was given)."""
    from engine.run.kv_handover import worker_entry  # torch: only in the worker's own process

    worker_entry(argv)


LESSON = Lesson(kind="disaggregation", title="Prefill and decode apart", settings=DisaggregationSettings,
                result=DisaggregationResult, run=run, table=table, check=check, points=(ServedPoint, GapPoint),
                faults=(prefill_worker.HANDOVER,), workers={prefill_worker.WORKER: run_prefill_worker},
                quick={"requests": 4, "short_prompt": 8, "long_prompt": 96, "long_every": 2, "new_tokens": 5,
                       "arrive_every_ms": 20},
                course={"long_prompt": 1024})
