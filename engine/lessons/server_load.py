"""Lesson: load you can watch on a real server. ``requests`` streamed runs, one starting every ``every_s``
seconds, each timed by this client (TTFT, tokens per second), while ``/metrics`` is polled every ``poll_s``
seconds for what the server says it is doing (requests running and queued, KV cache in use, prefix-cache hits).

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

from engine import metrics
from engine.events import ExperimentPoint, LessonResult, LessonSettings, RunFinished
from engine.experiment import SERVER, Counter, Experiment, Lesson, Span
from engine.fields import Count, Key, Number, Range, Setting, Text
from engine.params import GenerationParams
from engine.remote import RemoteError, get_text

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


def run(experiment: Experiment, settings: ServerLoadSettings) -> ServerLoadResult:
    session = experiment.session
    lock = threading.RLock()            # points are emitted while the figures they come from are held
    stop = threading.Event()
    count = settings.requests
    results: list[dict] = [{} for _ in range(count)]

    def locked(event: object) -> None:
        with lock:
            experiment.emit(event)

    def one(index: int) -> None:
        start, arrival = time.perf_counter(), experiment.ms()
        params = GenerationParams(max_new_tokens=settings.new_tokens, temperature=0.0, seed=index)
        result = session.run(PROMPTS[index % len(PROMPTS)], params, locked, stop)
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
    return summarize([r for r in results if r], count, seen, poll_error, poll_notes)


def summarize(done: list[dict], requested: int, seen: dict[str, list[float]],
              poll_error: list[str], poll_notes: list[str] = ()) -> ServerLoadResult:
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
    for quantity in ("cached_prompt_tokens", "prompt_tokens", "generated_tokens"):
        if len(seen.get(quantity, [])) >= 2:
            figures[f"{quantity}_during"] = seen[quantity][-1] - seen[quantity][0]
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
    return "\n".join(lines)


LESSON = Lesson(kind="server load", title="Server load", settings=ServerLoadSettings, result=ServerLoadResult,
                run=run, table=table, target=SERVER, timeline=timeline)
