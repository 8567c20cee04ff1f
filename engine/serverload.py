"""Load you can watch on a real server: ``requests`` streamed runs, one starting every ``every_s`` seconds, each
timed by this client (TTFT, tokens per second), while ``/metrics`` is polled every ``poll_s`` seconds for what
the server says it is doing (requests running and queued, KV cache in use, prefix-cache hits).

Bounded in count and time: at most ``MAX_REQUESTS`` requests, and the whole test stops by itself after
``limit_s`` seconds (requests still streaming are cancelled, and their runs are kept, marked). It only talks to
the server the user gave.
"""

from __future__ import annotations

import statistics
import threading
import time
from typing import Any

from engine import metrics
from engine.errors import ParameterError
from engine.events import ExperimentFinished, HardwarePeaks, RunFinished
from engine.params import GenerationParams
from engine.remote import RemoteError, RemoteSession, get_text

MAX_REQUESTS = 64
PROMPTS = ("Explain the KV cache of a transformer in three sentences.",
           "Write a short story about a lighthouse keeper, in five sentences.",
           "List five facts about the Moon, one per line.",
           "Describe how a bicycle gear works to a ten-year-old.")


def server_load(session: RemoteSession, emit: Any, cancel: threading.Event | None = None, *, requests: int = 4,
                every_s: float = 0.5, new_tokens: int = 48, poll_s: float = 0.5, limit_s: float = 300.0,
                peaks: HardwarePeaks | None = None) -> ExperimentFinished:
    from engine.experiments import _Experiment

    if not isinstance(session, RemoteSession):
        raise ParameterError("The load test runs against a server: start KVScope with --server URL (or type the "
                             "server's address as the model)")
    if not 1 <= requests <= MAX_REQUESTS or not 0 <= every_s <= 60 or not 1 <= new_tokens <= 4096 \
            or not 0.1 <= poll_s <= 10 or not 1 <= limit_s <= 600:
        raise ParameterError(f"The load test needs 1 to {MAX_REQUESTS} requests, 0 to 60 s between them, 1 to 4,096 "
                             "new tokens, polling every 0.1 to 10 s and a limit of 1 to 600 s")
    lock = threading.RLock()            # points are emitted while the figures they come from are held

    def locked(event: object) -> None:
        with lock:
            emit(event)

    settings = {"requests": requests, "every_s": every_s, "new_tokens": new_tokens, "poll_s": poll_s,
                "limit_s": limit_s, "url": session.url}
    x = _Experiment("server load", session, settings, locked, cancel, peaks)
    stop = threading.Event()
    results: list[dict] = [{} for _ in range(requests)]

    def one(index: int) -> None:
        start = time.perf_counter()
        arrival = x.ms()
        params = GenerationParams(max_new_tokens=new_tokens, temperature=0.0, seed=index)
        result = session.run(PROMPTS[index % len(PROMPTS)], params, locked, stop)
        s = result.summary
        decode_s = s.decode_ms / 1000.0
        results[index] = {
            "index": index, "arrival_ms": arrival, "ttft_ms": s.ttft_ms,
            "e2e_ms": (time.perf_counter() - start) * 1000,
            "generated": s.generated_tokens,
            "ok": float(isinstance(result, RunFinished) and result.reason != "stopped"),
            "decode_tok_s": s.decode_runs / decode_s if decode_s > 0 else 0.0,
            **{f"server_{k.split('.')[-1]}": v for k, v in s.server_timings.items()
               if k in ("timings.prompt_ms", "timings.predicted_ms", "timings.prompt_n", "timings.cache_n")}}
        with lock:
            x.point("request", **results[index])
            done = sum(1 for r in results if r)
        x.progress(done, requests, f"{done} of {requests} requests finished")

    poll_error: list[str] = []
    seen: dict[str, list[float]] = {}                   # quantity -> every value polled

    def poll() -> None:
        if not session.facts.metrics:
            return
        while not stop.is_set():
            try:
                reading = metrics.read(get_text(session.url, "/metrics", timeout=max(poll_s, 2.0)))
                with lock:
                    x.point("metrics", t_ms=x.ms(), **reading.values)
                    for quantity, value in reading.values.items():
                        seen.setdefault(quantity, []).append(value)
            except (RemoteError, metrics.MetricsError) as exc:
                poll_error.append(str(exc))
                x.progress(sum(1 for r in results if r), requests, f"metrics stopped: {exc}")
                return
            stop.wait(poll_s)

    poller = threading.Thread(target=poll, name="kvscope-metrics", daemon=True)
    poller.start()
    threads = []
    began = time.perf_counter()
    plural = "s" if requests != 1 else ""
    x.progress(0, requests, f"{requests} request{plural} to {session.url}, one every {every_s:g} s")
    for i in range(requests):
        if x.cancel.is_set():
            break
        thread = threading.Thread(target=one, args=(i,), name=f"kvscope-request-{i}", daemon=True)
        thread.start()
        threads.append(thread)
        if i + 1 < requests:
            x.cancel.wait(every_s)
    for thread in threads:
        remaining = limit_s - (time.perf_counter() - began)
        while thread.is_alive() and remaining > 0 and not x.cancel.is_set():
            thread.join(min(remaining, 0.2))
            remaining = limit_s - (time.perf_counter() - began)
        if thread.is_alive():
            stop.set()                                  # over time or cancelled: the streams stop, runs are kept
            thread.join(10.0)
    stop.set()
    poller.join(max(poll_s, 2.0) + 1.0)
    return x.finish(_summary([r for r in results if r], requests, seen, poll_error))


def _summary(done: list[dict], requested: int, seen: dict[str, list[float]], poll_error: list[str]) -> dict:
    ok = [r for r in done if r["ok"]]
    summary: dict = {"requested": requested, "completed": len(ok), "failed": len(done) - len(ok)}
    if ok:
        span_s = (max(r["arrival_ms"] + r["e2e_ms"] for r in ok) - min(r["arrival_ms"] for r in ok)) / 1000.0
        summary.update(
            mean_ttft_ms=statistics.fmean(r["ttft_ms"] for r in ok),
            median_ttft_ms=statistics.median(r["ttft_ms"] for r in ok),
            mean_decode_tok_s=statistics.fmean(r["decode_tok_s"] for r in ok),
            total_tok_s=sum(r["generated"] for r in ok) / span_s if span_s > 0 else 0.0)
        server = [r for r in ok if "server_prompt_ms" in r]
        if server:
            summary["mean_server_prompt_ms"] = statistics.fmean(r["server_prompt_ms"] for r in server)
            summary["mean_client_minus_server_ms"] = statistics.fmean(r["ttft_ms"] - r["server_prompt_ms"]
                                                                      for r in server)
    for quantity in ("running", "waiting", "kv_usage"):
        if seen.get(quantity):
            summary[f"peak_{quantity}"] = max(seen[quantity])
    for quantity in ("cached_prompt_tokens", "prompt_tokens", "generated_tokens"):
        if len(seen.get(quantity, [])) >= 2:
            summary[f"{quantity}_during"] = seen[quantity][-1] - seen[quantity][0]
    summary["metrics_polls"] = max((len(v) for v in seen.values()), default=0)
    if poll_error:
        summary["metrics_error"] = poll_error[0][:300]
    return summary
