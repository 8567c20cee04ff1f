"""Lesson: load you can watch on a real server. ``requests`` streamed runs, one starting every ``every_s``
seconds, each timed by this client (TTFT, tokens per second), while ``/metrics`` is polled every ``poll_s``
seconds for what the server says it is doing (requests running and queued, KV cache in use, prefix-cache hits).

With ``shared_prefix`` most requests share a system prompt of that many words (every fourth has one of its
own), so a prefix cache has something to reuse; with ``kv_events`` (a ZMQ address) the engine's KV events are
subscribed to (``engine.kv_events``), every block it stores or evicts is recorded, and each request's prompt
(the server's own tokens, from its ``/tokenize``) is walked through the tree of blocks when it is sent: the
prefix hit rate weighted by tokens, from the events, beside the server's own prefix-cache counters.

Bounded in count and time: at most ``MAX_REQUESTS`` requests, and the whole test stops by itself after
``limit_s`` seconds (requests still streaming are cancelled, and their runs are kept, marked). It only talks to
the server the user gave.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated

from engine import kv_events, metrics, remote
from engine.events import ExperimentPoint, KVBlocks, LessonResult, LessonSettings, RequestBlocks, RunFinished
from engine.experiment import SERVER, Counter, Experiment, Lesson, Span
from engine.fields import Count, Key, Number, Range, Setting, Text
from engine.params import GenerationParams
from engine.prefix_tree import PrefixTree
from engine.remote import RemoteError, get_text
from engine.workloads import sample_texts

MAX_REQUESTS = 64
PROMPTS = ("Explain the KV cache of a transformer in three sentences.",
           "Write a short story about a lighthouse keeper, in five sentences.",
           "List five facts about the Moon, one per line.",
           "Describe how a bicycle gear works to a ten-year-old.")


@dataclass(frozen=True)
class ServerLoadSettings(LessonSettings):
    kind = "server load"

    requests: Annotated[int, Range(1, MAX_REQUESTS), Setting("--requests", "Requests", "how many requests")] = 4
    every_s: Annotated[float, Range(0.0, 60.0), Setting(
        "--every", "One starts every", "seconds between requests", "s")] = 0.5
    new_tokens: Annotated[int, Range(1, 4096), Setting(
        "--tokens", "New tokens per request", "new tokens per request", "tokens"), Key("M", factor=2.0)] = 48
    poll_s: Annotated[float, Range(0.1, 10.0), Setting(
        "--poll", "Poll /metrics every", "seconds between /metrics polls", "s")] = 0.5
    limit_s: Annotated[float, Range(1.0, 600.0), Setting(
        "--limit", "Stop after", "stop the whole test after this many seconds", "s")] = 300.0
    shared_prefix: Annotated[int, Range(0, 4096), Setting(
        "--shared-prefix", "Shared system prompt", "words of a system prompt most requests share (every fourth "
        "has its own), so a prefix cache has something to reuse; 0: none", "words", special="none")] = 0
    kv_events: Annotated[str, Text(256), Setting(
        "--kv-events", "KV events from", "the engine's KV event publisher (vLLM's --kv-events-config endpoint): "
        "tcp://HOST:PORT to connect to it, tcp://*:PORT to bind for it; empty: none")] = ""


@dataclass(frozen=True)
class ServerLoadResult(LessonResult):
    kind = "server load"

    requested: Count = 0
    completed: Count = 0
    failed: Count = 0
    mean_ttft_ms: Number | None = None               # client clock
    median_ttft_ms: Number | None = None
    mean_decode_tok_s: Number | None = None
    total_tok_s: Number | None = None
    mean_server_prompt_ms: Number | None = None      # the server's own timings, where it reports them
    mean_client_minus_server_ms: Number | None = None
    peak_running: Number | None = None               # /metrics
    peak_waiting: Number | None = None
    peak_kv_usage: Number | None = None
    cached_prompt_tokens_during: Number | None = None
    prompt_tokens_during: Number | None = None
    generated_tokens_during: Number | None = None
    metrics_polls: Count = 0
    metrics_error: Annotated[str, Text(300)] = ""
    prefix_queries_during: Number | None = None      # /metrics: prompt tokens looked up in the prefix cache
    kv_events: Count = 0                              # KV events received
    blocks_stored: Count = 0
    tree_reused_tokens: Count = 0                     # from the events: prompt tokens the tree already held
    tree_prompt_tokens: Count = 0
    kv_events_error: Annotated[str, Text(300)] = ""


def run(experiment: Experiment, settings: ServerLoadSettings) -> ServerLoadResult:
    session = experiment.session
    lock = threading.RLock()            # points are emitted while the figures they come from are held
    stop = threading.Event()
    count = settings.requests
    results: list[dict] = [{} for _ in range(count)]

    def locked(event: object) -> None:
        with lock:
            experiment.emit(event)

    tree = PrefixTree()
    events_seen = {"events": 0, "stored": 0, "block_size": 0}

    def one(index: int) -> None:
        start, arrival = time.perf_counter(), experiment.ms()
        params = GenerationParams(max_new_tokens=settings.new_tokens, temperature=0.0, seed=index)
        messages = conversation(settings, index, experiment.exp_id)
        prompt_ids = remote.tokenize(session.address, session.facts.name, messages) if subscriber else None
        with lock:
            size = events_seen["block_size"]
            reused = tree.reused_tokens(prompt_ids, size) if prompt_ids and size else 0
        result = session.chat(messages, params, locked, stop)
        if prompt_ids is not None:
            stop.wait(0.3)                                 # the engine publishes its blocks as it stores them
            with lock:
                size = events_seen["block_size"] or 1
                walked = RequestBlocks(experiment.exp_id, experiment.ms(), index, len(prompt_ids), reused, size,
                                       tree.walk(prompt_ids, size))
                tree.add(walked)
                locked(walked)
        s = result.summary
        decode_s = s.decode_ms / 1000.0
        results[index] = {
            "index": index, "arrival_ms": arrival, "ttft_ms": s.ttft_ms, "e2e_ms": (time.perf_counter() - start) * 1000,
            "generated": s.generated_tokens,
            "ok": float(isinstance(result, RunFinished) and result.reason != "stopped"),
            "decode_tok_s": s.decode_runs / decode_s if decode_s > 0 else 0.0,
            **{f"server_{k.split('.')[-1]}": v for k, v in s.server_timings.items()
               if k in ("timings.prompt_ms", "timings.predicted_ms", "timings.prompt_n", "timings.cache_n")}}
        with lock:
            experiment.point("request", **results[index])
            done = sum(1 for r in results if r)
        experiment.progress(done, count, f"{done} of {count} requests finished")

    poll_error: list[str] = []
    poll_notes: list[str] = []                          # what a page gave that could not be true, said once
    seen: dict[str, list[float]] = {}                   # quantity -> every value polled

    def poll() -> None:
        if not session.facts.metrics:
            return
        while not stop.is_set():
            try:
                reading = metrics.read(get_text(session.address, "/metrics", timeout=max(settings.poll_s, 2.0)))
                with lock:
                    now = experiment.ms()
                    experiment.point("metrics", t_ms=now, **reading.values)
                    for key, values in reading.engines.items():          # data-parallel engines: each apart
                        experiment.point(f"metrics engine {key}"[:64], t_ms=now, **values)
                    for note in reading.notes:
                        if note not in poll_notes:
                            poll_notes.append(note)
                    for quantity, value in reading.values.items():
                        seen.setdefault(quantity, []).append(value)
            except (RemoteError, metrics.MetricsError) as exc:
                poll_error.append(str(exc))
                experiment.progress(sum(1 for r in results if r), count, f"metrics stopped: {exc}")
                return
            stop.wait(settings.poll_s)

    subscriber = None
    events_error: list[str] = []
    if settings.kv_events:
        subscriber = kv_events.Subscriber(settings.kv_events)     # a bad address or a port in use: refused here

    def listen() -> None:
        """The engine's KV events, as they come: each recorded, the tree kept for the requests' walks."""
        while not stop.is_set():
            for fact in subscriber.read(0.2):
                event = _blocks_event(experiment, session, fact)
                with lock:
                    events_seen["events"] += 1
                    if isinstance(fact, kv_events.Stored):
                        events_seen["stored"] += len(fact.keys)
                        events_seen["block_size"] = fact.block_size
                    tree.add(event)
                    locked(event)

    listener = threading.Thread(target=listen, name="kvscope-kv-events", daemon=True) if subscriber else None
    if listener is not None:
        listener.start()
        time.sleep(0.3)                                   # a SUB socket misses what is sent before it joined
    poller = threading.Thread(target=poll, name="kvscope-metrics", daemon=True)
    poller.start()
    began = time.perf_counter()
    plural = "s" if count != 1 else ""
    experiment.progress(0, count, f"{count} request{plural} to {session.url}, one every {settings.every_s:g} s")
    threads = []
    for i in range(count):
        if experiment.cancelled:
            break
        thread = threading.Thread(target=one, args=(i,), name=f"kvscope-request-{i}", daemon=True)
        thread.start()
        threads.append(thread)
        if i + 1 < count:
            experiment.cancel.wait(settings.every_s)
    for thread in threads:
        remaining = settings.limit_s - (time.perf_counter() - began)
        while thread.is_alive() and remaining > 0 and not experiment.cancelled:
            thread.join(min(remaining, 0.2))
            remaining = settings.limit_s - (time.perf_counter() - began)
        if thread.is_alive():
            stop.set()                                  # over time or cancelled: the streams stop, runs are kept
            thread.join(10.0)
    stop.set()
    poller.join(max(settings.poll_s, 2.0) + 1.0)
    if session.facts.metrics and not poll_error:
        try:                                              # one more poll, so the counters cover the last request
            final = metrics.read(get_text(session.address, "/metrics", timeout=max(settings.poll_s, 2.0)))
            with lock:
                experiment.point("metrics", t_ms=experiment.ms(), **final.values)
                for quantity, value in final.values.items():
                    seen.setdefault(quantity, []).append(value)
        except (RemoteError, metrics.MetricsError):
            pass
    figures: dict = {}
    if subscriber is not None:
        listener.join(2.0)
        subscriber.close()
        reused, prompted = tree.hit_rate()
        figures = {"kv_events": events_seen["events"], "blocks_stored": events_seen["stored"],
                   "tree_reused_tokens": reused, "tree_prompt_tokens": prompted}
        events_error = subscriber.notes[:1] or events_error
        poll_notes.extend(subscriber.notes[1:4])
    return summarize([r for r in results if r], count, seen, poll_error, poll_notes, figures,
                     events_error[0][:300] if events_error else "")


def conversation(settings: ServerLoadSettings, index: int, test: str = "") -> list[dict]:
    """Request ``index``'s messages: its question, after the shared system prompt (every fourth request gets one
    of its own instead, so the tree branches) when there is one. The system prompt names the ``test``, so each
    test starts from blocks no earlier test left in the server's cache, and its record holds every block it
    reuses."""
    question = {"role": "user", "content": PROMPTS[index % len(PROMPTS)]}
    if not settings.shared_prefix:
        return [question]
    words = " ".join(sample_texts()).split()
    shared = index % 4 != 3
    start = 0 if shared else (7 * index) % max(len(words) - settings.shared_prefix, 1)
    chosen = [words[(start + i) % len(words)] for i in range(settings.shared_prefix)]
    system = (f"Test {test}. " + ("You are a careful assistant. " if shared else f"You are assistant number {index}. ")
              + " ".join(chosen))
    return [{"role": "system", "content": system}, question]


def _blocks_event(experiment: Experiment, session: object, fact: kv_events.Fact) -> KVBlocks:
    """A KV event as the trace keeps it, a stored block with the text the server makes of its tokens."""
    t = experiment.ms()
    if isinstance(fact, kv_events.Stored):
        texts = [remote.detokenize(session.address, session.facts.name, list(tokens), timeout=2.0)
                 for tokens in fact.tokens[:64]] if len(fact.tokens) <= 64 else []
        return KVBlocks(experiment.exp_id, t, "stored", list(fact.keys), fact.parent,
                        [list(tokens) for tokens in fact.tokens], texts)
    if isinstance(fact, kv_events.Removed):
        return KVBlocks(experiment.exp_id, t, "removed", list(fact.keys))
    return KVBlocks(experiment.exp_id, t, "cleared")


def summarize(done: list[dict], requested: int, seen: dict[str, list[float]],
              poll_error: list[str], poll_notes: list[str] = (), events: dict | None = None,
              events_error: str = "") -> ServerLoadResult:
    ok = [r for r in done if r["ok"]]
    figures: dict = {"requested": requested, "completed": len(ok), "failed": len(done) - len(ok)}
    if ok:
        span_s = (max(r["arrival_ms"] + r["e2e_ms"] for r in ok) - min(r["arrival_ms"] for r in ok)) / 1000.0
        figures.update(
            mean_ttft_ms=statistics.fmean(r["ttft_ms"] for r in ok),
            median_ttft_ms=statistics.median(r["ttft_ms"] for r in ok),
            mean_decode_tok_s=statistics.fmean(r["decode_tok_s"] for r in ok),
            total_tok_s=sum(r["generated"] for r in ok) / span_s if span_s > 0 else 0.0)
        server = [r for r in ok if "server_prompt_ms" in r]
        if server:
            figures["mean_server_prompt_ms"] = statistics.fmean(r["server_prompt_ms"] for r in server)
            figures["mean_client_minus_server_ms"] = statistics.fmean(r["ttft_ms"] - r["server_prompt_ms"]
                                                                      for r in server)
    for quantity in ("running", "waiting", "kv_usage"):
        if seen.get(quantity):
            figures[f"peak_{quantity}"] = max(seen[quantity])
    for quantity in ("cached_prompt_tokens", "prompt_tokens", "generated_tokens", "prefix_queries"):
        if len(seen.get(quantity, [])) >= 2:
            figures[f"{quantity}_during"] = seen[quantity][-1] - seen[quantity][0]
    figures.update(events or {})
    if events_error:
        figures["kv_events_error"] = events_error
    figures["metrics_polls"] = max((len(v) for v in seen.values()), default=0)
    if poll_error:
        figures["metrics_error"] = poll_error[0][:300]
    return ServerLoadResult(**figures, incomplete=len(done) < requested,
                            notes=tuple(note[:4096] for note in list(poll_notes)[:8]))


def timeline(point: ExperimentPoint) -> list[Span | Counter]:
    """What the server said on /metrics, as counters; each request as a lane (waiting, then streaming)."""
    v = point.values
    if point.series == "metrics" and "t_ms" in v:
        return [Counter(f"server {name}", v["t_ms"], {name: value}) for name, value in v.items() if name != "t_ms"]
    if point.series == "request" and "ttft_ms" in v:
        track, first = f"request {int(v['index'])} (client)", v["arrival_ms"] + v["ttft_ms"]
        return [Span(track, "waiting for the first token", v["arrival_ms"], v["ttft_ms"]),
                Span(track, "streaming", first, max(v["arrival_ms"] + v["e2e_ms"] - first, 0.0))]
    return []


def table(points: Sequence[ExperimentPoint], result: ServerLoadResult) -> str:
    lines = ["request | arrived ms | TTFT ms (client) | prompt ms (server) | tokens | decode tok/s | end-to-end ms",
             "--------+------------+------------------+--------------------+--------+--------------+--------------"]
    for p in (p for p in points if p.series == "request"):
        v = p.values
        server = f"{v['server_prompt_ms']:18.1f}" if "server_prompt_ms" in v else f"{'not reported':>18}"
        lines.append(f"{int(v['index']):7d} | {v['arrival_ms']:10.1f} | {v['ttft_ms']:16.1f} | {server} | "
                     f"{int(v['generated']):6d} | {v['decode_tok_s']:12.1f} | {v['e2e_ms']:13.1f}")
    r = result
    if r.mean_ttft_ms is not None:
        lines += ["", f"{r.completed} of {r.requested} requests completed; mean TTFT {r.mean_ttft_ms:,.1f} ms, median "
                  f"{r.median_ttft_ms:,.1f} ms (client); {r.total_tok_s:,.1f} tok/s in all, "
                  f"{r.mean_decode_tok_s:,.1f} tok/s per request (measured by this client)"]
        if r.mean_server_prompt_ms is not None:
            lines.append(f"server-reported prompt time: mean {r.mean_server_prompt_ms:,.1f} ms; client TTFT exceeds "
                         f"it by {r.mean_client_minus_server_ms:,.1f} ms on average (queueing, HTTP, the first decode "
                         "step)")
        peaks = [f"{q.replace('_', ' ')} {getattr(r, 'peak_' + q):g}" for q in ("running", "waiting", "kv_usage")
                 if getattr(r, "peak_" + q) is not None]
        if peaks:
            lines.append(f"/metrics ({r.metrics_polls} polls): peak " + ", ".join(peaks)
                         + (f"; {r.cached_prompt_tokens_during:g} prompt tokens from the prefix cache"
                            if r.cached_prompt_tokens_during is not None else ""))
    if r.metrics_error:
        lines.append(f"/metrics: {r.metrics_error}")
    lines += prefix_lines(r)
    return "\n".join(lines)


def prefix_lines(r: ServerLoadResult) -> list[str]:
    """The prefix cache two ways: from the KV events (the tree each request walked) and from the server's own
    counters over the same requests, both weighted by tokens."""
    lines = []
    if r.tree_prompt_tokens:
        lines.append(f"prefix cache, from the KV events ({r.kv_events:,} events, {r.blocks_stored:,} blocks stored): "
                     f"{r.tree_reused_tokens:,} of {r.tree_prompt_tokens:,} prompt tokens reused "
                     f"({r.tree_reused_tokens / r.tree_prompt_tokens:.1%}, measured)")
    if r.prefix_queries_during and r.cached_prompt_tokens_during is not None:
        lines.append(f"prefix cache, from the server's counters: {r.cached_prompt_tokens_during:,.0f} of "
                     f"{r.prefix_queries_during:,.0f} prompt tokens hit "
                     f"({r.cached_prompt_tokens_during / r.prefix_queries_during:.1%}, as reported)")
    if r.kv_events_error:
        lines.append(f"KV events: {r.kv_events_error}")
    return lines


LESSON = Lesson(kind="server load", title="Server load", settings=ServerLoadSettings, result=ServerLoadResult,
                run=run, table=table, target=SERVER, timeline=timeline)
