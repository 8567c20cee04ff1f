"""The experiments that prove the lesson, each measured on the loaded model next to what the cost model
predicts: prefill cost vs prompt length, decode with vs without the KV cache, batch size vs throughput.

Each runs in the caller's thread, emits ``Experiment*`` events (which traces save and the window draws), checks
``cancel`` between measurements, and returns its ``ExperimentFinished``.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import threading
import time
import uuid
from collections.abc import Callable

import torch

from engine import costmodel
from engine.batch import generate_batch
from engine.costmodel import Device, ModelCost
from engine.errors import ParameterError
from engine.events import (
    ExperimentFailed,
    ExperimentFinished,
    ExperimentPoint,
    ExperimentProgress,
    ExperimentStarted,
    HardwarePeaks,
    ModelFacts,
    RunFinished,
    RunStarted,
)
from engine.params import GenerationParams
from engine.resources import sample_prompts
from engine.sampling import choose
from engine.session import Session

Sink = Callable[[object], None]
FILLER = ("Every request to a language model passes through two stages. In the prefill stage the whole prompt "
          "is read in one forward pass, and its keys and values are stored in the cache. In the decode stage "
          "the model produces one token per forward pass, attending to everything already cached. ")
KINDS = ("prefill", "cache", "batch", "chat", "continuous", "dtype", "speculative", "paged", "server load")
SERVER_KINDS = ("server load",)      # what runs against a server (the others run the model in KVScope)
CONVERSATION = [
    "hey, what is continuous batching?",
    "How is that different from static batching?",
    "Give me a one-line summary of both.",
    "Thanks! Now explain the KV cache in one sentence.",
]


class _Experiment:
    """The bookkeeping every experiment shares: ids, clock, progress, cancel."""

    def __init__(self, kind: str, session: Session, settings: dict, emit: Sink,
                 cancel: threading.Event | None, peaks: HardwarePeaks | None) -> None:
        self.exp_id = uuid.uuid4().hex[:12]
        self.kind, self.session, self.emit = kind, session, emit
        self.cancel = cancel or threading.Event()
        self.t0 = time.perf_counter()
        self.peaks = peaks
        self.device = Device(peaks.device, peaks.flops_per_s, peaks.bytes_per_s) if peaks else None
        self.cost = ModelCost(session.facts) if isinstance(session.facts, ModelFacts) else None   # a server: none
        emit(ExperimentStarted(self.exp_id, 0.0, kind, session.facts, settings, peaks))

    def ms(self) -> float:
        return (time.perf_counter() - self.t0) * 1000.0

    def progress(self, done: int, total: int, message: str) -> None:
        self.emit(ExperimentProgress(self.exp_id, self.ms(), done, total, message))

    def point(self, series: str, **values: float) -> None:
        self.emit(ExperimentPoint(self.exp_id, self.ms(), series, values))

    def finish(self, summary: dict) -> ExperimentFinished:
        reason = "stopped" if self.cancel.is_set() else "done"
        note = rounding_note(self.session.facts, summary)
        if note:
            summary = {**summary, "tokens_note": note}
        event = ExperimentFinished(self.exp_id, self.ms(), reason, summary)
        self.emit(event)
        return event

    def predicted_ms(self, cost: costmodel.Cost) -> float | None:
        return cost.predicted_s(self.device) * 1000.0 if self.device else None


TOKEN_CHECKS = ("tokens_match", "tokens_match_solo")


def rounding_note(facts: object, summary: dict) -> str:
    """Why greedy tokens part in a 16-bit float, where they do: a forward pass over several tokens (prefill
    without the cache, a padded batch, verified guesses) sums in another order than one token at a time, and
    a near-tie between two tokens can flip. Said beside the check, so a lecture never shows a bare "different"."""
    dtype = getattr(facts, "dtype", "float32")
    failed = any(summary.get(k) is False for k in TOKEN_CHECKS) and not summary.get("incomplete")
    if not failed or dtype == "float32":
        return ""
    return (f"in {dtype}, a pass over several tokens rounds differently from one token at a time, so greedy "
            "choices between near-tied tokens can part; run it in float32 to compare token for token")


def doubling_lengths(start: int, limit: int) -> list[int]:
    lengths, n = [], start
    while n <= limit:
        lengths.append(n)
        n *= 2
    return lengths


def fitted_exponent(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of log(y) against log(x): time ~ n^slope."""
    lx, ly = [math.log(x) for x in xs], [math.log(y) for y in ys]
    mx, my = statistics.fmean(lx), statistics.fmean(ly)
    den = sum((a - mx) ** 2 for a in lx)
    return sum((a - mx) * (b - my) for a, b in zip(lx, ly)) / den if den else float("nan")


def fitting(session: Session, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """The prompts that fit the context with ``new_tokens`` more; refused before any compute if none do."""
    limit = session.facts.max_context
    fit = [ids for ids in prompts if len(ids) + new_tokens <= limit]
    if not fit:
        raise ParameterError(f"No prompt fits the context of {limit:,} tokens with {new_tokens} new tokens: use "
                             "shorter prompts or fewer tokens")
    return fit


def filler_ids(session: Session, n: int) -> list[int]:
    """``n`` real-text token ids (no template), so prefill runs on language, not on one repeated token."""
    chunk = session.encode(FILLER, chat_template=False)
    return (chunk * (n // len(chunk) + 1))[:n]


# --- 1. prefill sweep -------------------------------------------------------------------------------------
def prefill_sweep(session: Session, emit: Sink, cancel: threading.Event | None = None, *,
                  max_length: int | None = None, start: int = 16, repeats: int = 3, warmup: int = 1,
                  peaks: HardwarePeaks | None = None) -> ExperimentFinished:
    """Prompt lengths doubling from ``start`` to the context (or ``max_length``): median prefill time and
    TTFT per length, next to the cost model's prediction; the fitted exponent says how time scales."""
    limit = min(max_length or session.facts.max_context, session.facts.max_context - 1)
    if start < 1 or limit < start or repeats < 1:
        raise ParameterError(f"The sweep needs 1 <= shortest prompt ({start:,}) <= longest ({limit:,}) and at "
                             f"least one repeat ({repeats})")
    lengths = doubling_lengths(start, limit)
    x = _Experiment("prefill", session, {"lengths": lengths, "repeats": repeats, "warmup": warmup}, emit,
                    cancel, peaks)
    ids = filler_ids(session, lengths[-1])
    clock, measured = session.clock, []
    params = GenerationParams()
    for i, n in enumerate(lengths):
        x.progress(i, len(lengths), f"prefill of {n:,} tokens ({repeats} repeats)")
        prompt = torch.tensor([ids[:n]], device=session.device)
        forward, ttft = [], []
        for r in range(warmup + repeats):
            if x.cancel.is_set():
                return x.finish(_prefill_summary(measured))
            with torch.inference_mode():
                a = clock.mark()
                logits, cache = session.prefill(prompt, use_cache=True)
                b = clock.mark()
                choose(logits, params, None)
                c = clock.mark()
            del cache
            if r >= warmup:
                forward.append(clock.elapsed_ms(a, b))
                ttft.append(clock.elapsed_ms(a, c))
        cost = x.cost.prefill(n)
        values = {"tokens": n, "prefill_ms": statistics.median(forward), "ttft_ms": statistics.median(ttft),
                  "prefill_ms_min": min(forward), "prefill_ms_max": max(forward), "flops": cost.flops,
                  "attention_flops": costmodel.attention_flops(n, session.facts.hidden_size)}
        predicted = x.predicted_ms(cost)
        if predicted is not None:
            values["predicted_ms"] = predicted
        x.point("prefill", **values)
        measured.append(values)
    x.progress(len(lengths), len(lengths), "done")
    return x.finish(_prefill_summary(measured))


def _prefill_summary(points: list[dict]) -> dict:
    if len(points) < 2:
        return {"points": len(points)}
    n = [p["tokens"] for p in points]
    t = [p["prefill_ms"] for p in points]
    half = len(points) // 2
    summary = {"points": len(points), "exponent": fitted_exponent(n, t),
               "exponent_short": fitted_exponent(n[: half + 1], t[: half + 1]),
               "exponent_long": fitted_exponent(n[half:], t[half:]),
               "last_doubling": f"{n[-2]}->{n[-1]}", "last_doubling_x": t[-1] / t[-2],
               "flops_doubling_x": points[-1]["flops"] / points[-2]["flops"]}
    if "predicted_ms" in points[-1]:
        summary["predicted_exponent"] = fitted_exponent(n, [p["predicted_ms"] for p in points])
    return summary


# --- 2. KV cache on vs off --------------------------------------------------------------------------------
def cache_comparison(session: Session, emit: Sink, cancel: threading.Event | None = None, *,
                     prompt: str | None = None, new_tokens: int = 32,
                     peaks: HardwarePeaks | None = None) -> ExperimentFinished:
    """The same greedy run with the cache and without: latency per step (flat vs growing), total time, the
    measured speedup next to the cost model's FLOPs ratio. The two runs' own events go to ``emit`` too, so
    the timing panel overlays them."""
    if new_tokens < 2:
        raise ParameterError(f"The cache comparison needs at least 2 new tokens (got {new_tokens}): one token has "
                             "no decode step to compare")
    prompt = prompt or sample_prompts()[0][1]
    x = _Experiment("cache", session, {"prompt": prompt, "new_tokens": new_tokens}, emit, cancel, peaks)
    session.run(prompt, GenerationParams(max_new_tokens=2))                 # warm-up, not measured or shown
    results = {}
    for i, kv in enumerate((True, False)):
        x.progress(i, 2, f"{new_tokens} tokens with the KV cache {'on' if kv else 'off'}")
        result = session.run(prompt, GenerationParams(max_new_tokens=new_tokens, kv_cache=kv), emit, x.cancel)
        if not isinstance(result, RunFinished) or result.reason == "stopped":
            return x.finish({"tokens_match": False, "incomplete": True})
        s = result.summary
        results[kv] = s
        x.point("run", kv_cache=float(kv), ttft_ms=s.ttft_ms, decode_ms=s.decode_ms, total_ms=s.total_ms,
                decode_tok_s=s.decode_tok_s, generated=s.generated_tokens, prompt_tokens=s.prompt_tokens)
    on, off = results[True], results[False]
    generated = on.generated_tokens
    flops_on = x.cost.decode_total(on.prompt_tokens, generated, cache=True).flops
    flops_off = x.cost.decode_total(on.prompt_tokens, generated, cache=False).flops
    seed_on = costmodel.decode_flops_with_cache(on.prompt_tokens, generated - 1, session.facts.hidden_size)
    seed_off = costmodel.decode_flops_no_cache(on.prompt_tokens, generated - 1, session.facts.hidden_size)
    x.progress(2, 2, "done")
    return x.finish({
        "tokens_match": on.token_ids == off.token_ids, "generated": generated, "prompt_tokens": on.prompt_tokens,
        "decode_speedup": off.decode_ms / on.decode_ms if on.decode_ms else float("nan"),
        "total_speedup": off.total_ms / on.total_ms if on.total_ms else float("nan"),
        "flops_ratio": flops_off / flops_on if flops_on else float("nan"),
        "attention_flops_ratio": seed_off / seed_on if seed_on else float("nan")})


# --- 3. batch size vs throughput and latency --------------------------------------------------------------
def batch_sweep(session: Session, emit: Sink, cancel: threading.Event | None = None, *,
                sizes: tuple[int, ...] = (1, 2, 4, 8, 16), new_tokens: int = 32,
                prompts: list[str] | None = None, peaks: HardwarePeaks | None = None) -> ExperimentFinished:
    """Batches of 1, 2, 4, ... requests decoding together: aggregate tokens/s rises while each request's
    per-token latency grows, the throughput-latency trade-off serving systems tune."""
    if not sizes or min(sizes) < 1 or new_tokens < 2:
        raise ParameterError(f"The batch sweep needs batch sizes of at least 1 (got {list(sizes)}) and at least "
                             f"2 new tokens per request (got {new_tokens}): one token has no decode step to time")
    texts = prompts or [text for _title, text in sample_prompts()]
    encoded = [session.encode(t) for t in texts]
    pad = session.tokenizer.pad_token_id
    pad = session.tokenizer.eos_token_id if pad is None else pad
    encoded = fitting(session, encoded, new_tokens)
    x = _Experiment("batch", session, {"sizes": list(sizes), "new_tokens": new_tokens}, emit, cancel, peaks)
    rows = []
    for i, size in enumerate(sizes):
        if x.cancel.is_set():
            break
        x.progress(i, len(sizes), f"batch of {size}: {new_tokens} tokens per request")
        batch = [encoded[j % len(encoded)] for j in range(size)]
        generate_batch(session.model, batch, 2, pad, session.device)            # warm-up: this shape's kernels
        r = generate_batch(session.model, batch, new_tokens, pad, session.device, x.cancel)
        if r.stopped:
            break
        step = statistics.median(r.step_ms) if r.step_ms else float("nan")
        values = {"batch": size, "ttft_ms": r.ttft_ms, "prefill_ms": r.prefill_ms, "step_ms": step,
                  "per_token_ms": step, "decode_tok_s": size * 1000.0 / step if step else 0.0,
                  "request_latency_ms": r.ttft_ms + sum(r.step_ms), "padded_length": r.padded_length}
        x.point("batch", **values)
        rows.append(values)
    if not x.cancel.is_set():
        x.progress(len(sizes), len(sizes), "done")
    summary = {"points": len(rows)}
    if len(rows) >= 2:
        summary.update(throughput_gain=rows[-1]["decode_tok_s"] / rows[0]["decode_tok_s"],
                       latency_growth=rows[-1]["per_token_ms"] / rows[0]["per_token_ms"],
                       largest_batch=rows[-1]["batch"])
    return x.finish(summary)


# --- 4. a conversation with and without reusing the cache across turns --------------------------------------
def chat_reuse(session: Session, emit: Sink, cancel: threading.Event | None = None, *,
               turns: list[str] | None = None, new_tokens: int = 48, repeats: int = 3,
               peaks: HardwarePeaks | None = None) -> ExperimentFinished:
    """The same conversation with the cache kept between turns (only the new turn is prefilled; TTFT stays
    flat) and re-prefilled every turn (TTFT grows with the conversation), greedy, ``repeats`` times with the
    order alternating, so a machine busy for a moment cannot decide the comparison. The summary gives each
    turn's median TTFT both ways with the spread, and calls the difference clear only where the spreads do
    not overlap."""
    turns = turns or CONVERSATION
    if repeats < 1 or new_tokens < 1 or not turns:
        raise ParameterError(f"The chat comparison needs turns, at least one repeat (got {repeats}) and at least "
                             f"one new token (got {new_tokens})")
    x = _Experiment("chat", session, {"turns": turns, "new_tokens": new_tokens, "repeats": repeats}, emit, cancel,
                    peaks)
    params = GenerationParams(max_new_tokens=new_tokens)
    replies: dict[bool, list[list[int]]] = {}
    ttft: dict[tuple[bool, int], list[float]] = {}
    shares: list[float] = []
    total = 2 * len(turns) * repeats
    done = 0
    for r in range(repeats):
        for reuse in ((True, False) if r % 2 == 0 else (False, True)):
            session.forget("a new conversation started")
            messages: list[dict] = []
            conversation_replies = []
            for i, turn in enumerate(turns):
                if x.cancel.is_set():
                    return x.finish({"tokens_match": False, "incomplete": True})
                x.progress(done, total, f"repeat {r + 1}: turn {i + 1} with reuse {'on' if reuse else 'off'}")
                messages.append({"role": "user", "content": turn})
                s = session.chat(messages, params, emit, x.cancel, reuse=reuse).summary
                done += 1
                conversation_replies.append(s.token_ids)
                messages.append({"role": "assistant", "content": s.text})
                ttft.setdefault((reuse, i + 1), []).append(s.ttft_ms)
                if s.cpu_share is not None:
                    shares.append(s.cpu_share)
                x.point("turn", reuse=float(reuse), turn=i + 1, repeat=r + 1, reused_tokens=s.reused_tokens,
                        prefilled_tokens=s.prompt_tokens, conversation_tokens=s.reused_tokens + s.prompt_tokens,
                        prefill_ms=s.prefill_ms, ttft_ms=s.ttft_ms, generated=s.generated_tokens)
            if replies.setdefault(reuse, conversation_replies) != conversation_replies:
                replies[reuse] = []                         # greedy replies must repeat exactly
    session.forget("a new conversation started")
    x.progress(total, total, "done")
    summary: dict = {"tokens_match": replies[True] == replies[False] and bool(replies[True]), "turns": len(turns),
                     "repeats": repeats, "lowest_cpu_share": min(shares) if shares else None}
    for i in range(1, len(turns) + 1):
        on, off = ttft[(True, i)], ttft[(False, i)]
        summary[f"turn{i}_on_ms"], summary[f"turn{i}_off_ms"] = statistics.median(on), statistics.median(off)
        summary[f"turn{i}_on_range"], summary[f"turn{i}_off_range"] = [min(on), max(on)], [min(off), max(off)]
        summary[f"turn{i}_clear"] = max(on) < min(off) or max(off) < min(on)
    return x.finish(summary)


# --- 5. continuous vs static batching on the same arrival schedule ------------------------------------------
def continuous_batching(session: Session, emit: Sink, cancel: threading.Event | None = None, *,
                        requests: int = 8, arrive_every: int = 4, new_tokens: tuple[int, ...] = (16, 24, 32),
                        prompts: list[str] | None = None, check_solo: bool = True,
                        peaks: HardwarePeaks | None = None) -> ExperimentFinished:
    """Requests arrive every ``arrive_every`` decode steps with different prompts and lengths. Continuous
    batching admits each into the running batch at the next step; static batching makes it wait for the
    whole batch to finish. Per request: waiting, prefill, decode, done; per step: the batch size."""
    from engine.scheduler import POLICIES, Request, serve

    if requests < 1 or arrive_every < 0 or not new_tokens or min(new_tokens) < 1:
        raise ParameterError(f"Continuous batching needs at least one request (got {requests}), arrivals every 0 or "
                             f"more steps (got {arrive_every}) and at least one new token per request")
    texts = prompts or [text for _title, text in sample_prompts()]
    usable = fitting(session, [session.encode(t) for t in texts], max(new_tokens))
    encoded = [usable[i % len(usable)] for i in range(requests)]
    lengths = [new_tokens[i % len(new_tokens)] for i in range(requests)]
    x = _Experiment("continuous", session, {"requests": requests, "arrive_every": arrive_every,
                                            "new_tokens": list(new_tokens)}, emit, cancel, peaks)
    sync = torch.cuda.synchronize if session.device.type == "cuda" else (lambda: None)
    generate_batch(session.model, encoded[:1], 2, 0, session.device)             # warm-up
    results: dict[str, list] = {}
    for p, policy in enumerate(POLICIES):
        x.progress(p, len(POLICIES) + int(check_solo), f"{requests} requests, {policy} batching")
        batch = [Request(i, ids, n, i * arrive_every) for i, (ids, n) in enumerate(zip(encoded, lengths))]
        finished = serve(session.model, session.device, session.facts, batch, policy,
                         on_step=lambda t, size, pol=p: x.point("batch", policy=float(pol == 0), t_ms=t,
                                                                 batch_size=size),
                         cancel=x.cancel, sync=sync)
        if not finished:
            return x.finish({"incomplete": True})
        for r in batch:
            x.point("request", policy=float(p == 0), index=r.index, prompt_tokens=len(r.ids),
                    new_tokens=r.new_tokens, arrival_ms=r.arrival_ms, admitted_ms=r.admitted_ms,
                    first_token_ms=r.first_token_ms, done_ms=r.done_ms, ttft_ms=r.first_token_ms - r.arrival_ms,
                    e2e_ms=r.done_ms - r.arrival_ms, queue_ms=r.admitted_ms - r.arrival_ms)
        results[policy] = batch
    summary = {}
    for policy, batch in results.items():
        span = max(r.done_ms for r in batch) - min(r.arrival_ms for r in batch)
        summary[f"{policy}_tok_s"] = sum(r.new_tokens for r in batch) / (span / 1000.0) if span else 0.0
        summary[f"{policy}_mean_ttft_ms"] = statistics.fmean(r.first_token_ms - r.arrival_ms for r in batch)
        summary[f"{policy}_mean_e2e_ms"] = statistics.fmean(r.done_ms - r.arrival_ms for r in batch)
    summary["same_tokens_both_policies"] = [r.tokens for r in results["continuous"]] == \
        [r.tokens for r in results["static"]]
    if check_solo:
        x.progress(len(POLICIES), len(POLICIES) + 1, "each request alone, for the token check")
        solo = [generate_batch(session.model, [ids], n, 0, session.device).tokens[0]
                for ids, n in zip(encoded, lengths)]
        summary["tokens_match_solo"] = solo == [r.tokens for r in results["continuous"]]
    x.progress(len(POLICIES) + int(check_solo), len(POLICIES) + int(check_solo), "done")
    return x.finish(summary)


def run_experiment(kind: str, session: Session, emit: Sink, cancel: threading.Event | None = None,
                   peaks: HardwarePeaks | None = None, **settings) -> ExperimentFinished:
    """Run one experiment. Runs it makes are tagged with its id (``RunStarted.experiment``), and if it breaks
    after it started, ``ExperimentFailed`` closes its record before the error goes on to the caller."""
    from engine.formats import weight_formats
    from engine.paged import paged_kv
    from engine.remote import RemoteSession
    from engine.serverload import server_load
    from engine.speculative import speculative_decoding

    runners = {"prefill": prefill_sweep, "cache": cache_comparison, "batch": batch_sweep, "chat": chat_reuse,
               "continuous": continuous_batching, "dtype": weight_formats, "speculative": speculative_decoding,
               "paged": paged_kv, "server load": server_load}
    if kind not in runners:
        raise ParameterError(f"Unknown experiment {kind!r}: use one of {', '.join(KINDS)}")
    if isinstance(session, RemoteSession) != (kind in SERVER_KINDS):
        raise ParameterError("This experiment runs the model inside KVScope: load a local model for it (against a "
                             "server, use the load test)" if kind not in SERVER_KINDS else
                             "The load test runs against a server: start KVScope with --server URL")
    tagged = _Tagged(emit)
    try:
        return runners[kind](session, tagged, cancel, peaks=peaks, **settings)
    except BaseException as exc:
        tagged.fail(exc)
        raise


class _Tagged:
    """The experiment's sink: tags the runs it starts and knows whether it is still open."""

    def __init__(self, emit: Sink) -> None:
        self.emit = emit
        self.open: str | None = None
        self.t0 = time.perf_counter()

    def __call__(self, event: object) -> None:
        if isinstance(event, ExperimentStarted):
            self.open, self.t0 = event.exp_id, time.perf_counter()
        elif isinstance(event, RunStarted) and self.open is not None:
            event = dataclasses.replace(event, experiment=self.open)
        elif isinstance(event, (ExperimentFinished, ExperimentFailed)):
            self.open = None
        self.emit(event)

    def fail(self, exc: BaseException) -> None:
        if self.open is None:
            return
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        self(ExperimentFailed(self.open, (time.perf_counter() - self.t0) * 1000.0, type(exc).__name__, message))
