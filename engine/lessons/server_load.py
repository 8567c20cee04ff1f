"""Lesson: load you can watch on a real server. ``requests`` streamed runs, one starting every ``every_s``
seconds, each timed by this client (TTFT, tokens per second), while ``/metrics`` is polled every ``poll_s``
seconds for what the server says it is doing (requests running and queued, KV cache in use, prefix-cache hits).

With ``shared_prefix`` most requests share a system prompt of that many words (every fourth has one of its
own), so a prefix cache has something to reuse. The prompt tokens each request got from the server's cache are
the server's own answer (``usage.prompt_tokens_details.cached_tokens``, llama-server's ``timings.cache_n``).
With ``kv_events`` (a ZMQ address) the engine's KV events are subscribed to (``engine.serve.kv_events``), every block
it stores or evicts is recorded, and each request's prompt (the server's own tokens, from its ``/tokenize``) is
walked through the tree of blocks when it is sent: a *prediction*, shown as one beside the answer (a request
sent while another is still computing the blocks it needs is predicted short). The server's counters are read
before the first request and after the last, and what other clients moved in them is said.

Bounded in count and time: at most ``MAX_REQUESTS`` requests, and the whole test stops by itself after
``limit_s`` seconds (requests still streaming are cancelled, and their runs are kept, marked). It only talks to
the server the user gave.
"""

from __future__ import annotations

import dataclasses
import statistics
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, ClassVar

from engine.facts.events import ExperimentPoint, LessonResult, LessonSettings, RunFinished
from engine.facts.fields import Column, Count, Items, Key, Number, Range, Setting, Text
from engine.facts.params import GenerationParams
from engine.facts.vocabulary import LessonPoint, of
from engine.run.experiment import SERVER, Counter, Experiment, Lesson, Span
from engine.run.workloads import sample_texts
from engine.serve import client, kv_events, metrics, slots
from engine.serve.block_events import KVBlocks, RequestBlocks
from engine.serve.client import RemoteError, get_text
from engine.serve.prefix_tree import PrefixTree
from engine.serve.remote import server_phases
from engine.serve.workload import Workload, read_workload

MAX_REQUESTS = 64
MAX_RECORDED_BLOCKS = 20_000     # blocks whose events a test records (as many as the tree keeps); the rest counted
PROMPTS = ("Explain the KV cache of a transformer in three sentences.",
           "Write a short story about a lighthouse keeper, in five sentences.",
           "List five facts about the Moon, one per line.",
           "Describe how a bicycle gear works to a ten-year-old.")



@dataclass(frozen=True)
class ServedRequest(LessonPoint):
    """One request as this client saw it (sent, first token, end, in ms from the test's start) and what the
    server said of it: the prompt tokens it counted and served from its cache, its own timings (llama-server's
    ``timings``), and what the KV events predicted at send."""

    series = "request"

    index: Annotated[int, Column("request", "{:d}")]
    arrival_ms: Annotated[float, Column("sent at ms", "{:,.0f}")]
    ttft_ms: Annotated[float, Column("TTFT ms (client)", "{:,.1f}")]
    e2e_ms: Annotated[float, Column("end-to-end ms", "{:,.0f}")]
    generated: Annotated[int, Column("tokens", "{:,d}")]
    ok: bool
    decode_tok_s: Annotated[float, Column("tok/s (client)", "{:,.1f}")]
    server_prompt_ms: Annotated[float | None, Column("prompt ms (server)", "{:,.1f}")] = None
    prompt_tokens: Annotated[int | None, Column("prompt tokens (server)", "{:,d}")] = None
    cached_tokens: Annotated[int | None, Column("from its cache (server)", "{:,d}")] = None
    predicted_tokens: Annotated[int | None, Column("predicted at send (events)", "{:,d}")] = None
    server_predicted_ms: float | None = None
    server_prompt_n: int | None = None
    server_cache_n: int | None = None


@dataclass(frozen=True)
class MetricsPoint(LessonPoint):
    """One /metrics poll (``t_ms`` from the test's start): the quantities the server reported (absent: not
    reported), summed over its engines ("metrics"), or one engine's ("metrics engine <name>")."""

    series = "metrics"
    ENGINE: ClassVar[str] = "metrics engine "

    t_ms: float
    running: float | None = None
    waiting: float | None = None
    kv_usage: float | None = None
    prompt_tokens: float | None = None
    generated_tokens: float | None = None
    cached_prompt_tokens: float | None = None
    prefix_queries: float | None = None
    transferred_prompt_tokens: float | None = None

    @classmethod
    def matches(cls, series: str) -> bool:
        return series == cls.series or series.startswith(cls.ENGINE)


assert set(metrics.QUANTITIES) <= {f.name for f in dataclasses.fields(MetricsPoint)}, "a quantity without its field"


@dataclass(frozen=True)
class SlotsPoint(LessonPoint):
    """One /slots poll: how many slots, working and positions held in all, and per slot (in ``more``) its
    context (``ctx <id>``), the positions it holds (``held <id>``) and whether it works (``busy <id>``)."""

    series = "slots"

    t_ms: float
    slots: int
    busy: int
    held: int
    more: dict[str, float] = field(default_factory=dict)

@dataclass(frozen=True)
class ServerLoadSettings(LessonSettings):
    kind = "server load"

    requests: Annotated[int, Range(0, MAX_REQUESTS), Setting(
        "--requests", "Requests", "how many requests; 0: send none and watch (the KV events and /metrics of every "
        "client's requests, until stopped or the time limit)", special="watch")] = 4
    every_s: Annotated[float, Range(0.0, 60.0), Setting(
        "--every", "One starts every", "seconds between requests", "s")] = 0.5
    new_tokens: Annotated[int, Range(1, 4096), Setting(
        "--tokens", "New tokens per request", "new tokens per request", "tokens"), Key("M", factor=2.0)] = 48
    poll_s: Annotated[float, Range(0.1, 10.0), Setting(
        "--poll", "Poll /metrics every", "seconds between /metrics polls", "s")] = 0.5
    limit_s: Annotated[float, Range(1.0, 3600.0), Setting(
        "--limit", "Stop after", "stop the whole test after this many seconds", "s")] = 300.0
    shared_prefix: Annotated[int, Range(0, 4096), Setting(
        "--shared-prefix", "Shared system prompt", "words of a system prompt most requests share (every fourth "
        "has its own), so a prefix cache has something to reuse; 0: none", "words", special="none")] = 0
    kv_events: Annotated[str, Text(256), Setting(
        "--kv-events", "KV events from", "the engine's KV event publisher (vLLM's --kv-events-config endpoint): "
        "ipc:///PATH or tcp://HOST:PORT to connect to it, tcp://*:PORT or bind:tcp://127.0.0.1:PORT to bind for "
        "it; empty: none")] = ""
    workload: Annotated[str, Text(4096), Setting(
        "--workload", "Workload file", "your own requests, a JSON-lines file (prompt or messages, arrival_s, "
        "max_tokens: the shape of vLLM's bench serve datasets) sent instead of KVScope's prompts, at most "
        f"{MAX_REQUESTS}; empty: KVScope's own")] = ""


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
    peak_kv_usage: Number | None = None               # one engine's; several are each their own (below)
    engines: Annotated[tuple[Annotated[str, Text(64)], ...], Items(64)] = ()      # data-parallel engines' labels
    peak_kv_usage_by_engine: Annotated[tuple[Number, ...], Items(64)] = ()        # ... and each one's peak KV use
    cached_prompt_tokens_during: Number | None = None     # /metrics counters: after the last request less
    prompt_tokens_during: Number | None = None            # before the first (every client's requests)
    generated_tokens_during: Number | None = None
    metrics_polls: Count = 0
    metrics_failed: Count = 0                             # polls that got no page (slow, refused): retried
    metrics_error: Annotated[str, Text(300)] = ""         # the first failure's words
    prefix_queries_during: Number | None = None      # /metrics: prompt tokens looked up in the prefix cache
    own_prompt_tokens: Number | None = None          # this test's prompt tokens, as the server counted them
    other_prompt_tokens: Number | None = None        # what the counters moved beyond them: other clients
    server_cached_tokens: Count | None = None        # the server's answers: prompt tokens served from its cache
    server_prompt_tokens: Count | None = None        # ... of these prompt tokens
    server_answered: Count = 0                       # requests whose answers said
    kv_events: Count = 0                              # KV events received
    blocks_stored: Count = 0
    tree_reused_tokens: Count = 0                     # predicted at send, from the blocks the events had stored
    tree_prompt_tokens: Count = 0
    mispredicted_requests: Count = 0                  # requests whose answer differs from the prediction
    blocks_unrecorded: Count = 0                      # past MAX_RECORDED_BLOCKS: counted, not kept in the trace
    kv_messages_lost: Count = 0                       # numbered by the publisher, never arrived (ZMQ's queue full)
    kv_events_error: Annotated[str, Text(300)] = ""
    slots: Count | None = None                            # llama-server's /slots: how many
    slot_context: Count | None = None                     # ... positions each
    peak_busy_slots: Count | None = None                  # the most working at one poll
    peak_slot_held: Count | None = None                   # the most positions one slot held at one poll
    slots_polls: Count = 0
    slots_error: Annotated[str, Text(300)] = ""           # why /slots gave nothing, if it did not
    workload: Annotated[str, Text(300)] = ""              # the file's name, when the requests were the user's
    workload_note: Annotated[str, Text(300)] = ""         # requests in it that were left out, said


def check(_target: object, settings: ServerLoadSettings) -> None:
    """A workload file that cannot be read is refused before any request is sent."""
    if settings.workload:
        read_workload(settings.workload, MAX_REQUESTS)


def run(experiment: Experiment, settings: ServerLoadSettings) -> ServerLoadResult:
    return LoadTest(experiment, settings).run()


@dataclass
class BlocksSeen:
    """What the engine's KV events said so far (blocks ``recorded`` in the trace; past ``MAX_RECORDED_BLOCKS``,
    ``unrecorded``: counted, not kept)."""

    events: int = 0
    stored: int = 0
    block_size: int = 0
    recorded: int = 0
    unrecorded: int = 0


@dataclass
class SlotsSeen:
    """llama-server's /slots polls so far: running figures only."""

    ok: int = 0
    error: str = ""
    last: list | None = None
    busy: int = 0
    held: int = 0


class LoadTest:
    """One load test, its state in its fields: each request's answer (``served``), the server's polls, the engine's
    blocks and the prefix tree they build. The request threads, the poller and the KV-event listener share it
    under ``lock``: points are emitted while the figures they come from are held."""

    def __init__(self, experiment: Experiment, settings: ServerLoadSettings) -> None:
        self.experiment, self.settings, self.session = experiment, settings, experiment.session
        self.lock = threading.RLock()
        self.stop = threading.Event()
        self.workload = read_workload(settings.workload, MAX_REQUESTS) if settings.workload else None
        self.count = len(self.workload.requests) if self.workload else settings.requests
        self.served: list[ServedRequest | None] = [None] * self.count
        self.tree = PrefixTree()
        self.blocks = BlocksSeen()
        self.poll_error = ""
        self.poll_notes: list[str] = [line for line in self.session.facts.reveals   # why it is not polled, if so
                                      if line.startswith("/metrics answered but was not read")]
        self.seen: dict[str, list[float]] = {}              # quantity -> every value polled
        self.kv_by_engine: dict[str, float] = {}            # data-parallel engines: each one's peak KV use
        self.polls_failed = 0
        self.slots = SlotsSeen()
        self.by_slots = self.session.facts.engine == "llama.cpp"   # it says nothing of its cache on /metrics now
        # a bad address or a port in use: refused here, before any request
        self.subscriber = kv_events.Subscriber(settings.kv_events) if settings.kv_events else None

    def emit(self, event: object) -> None:
        with self.lock:
            self.experiment.emit(event)

    def done(self) -> list[ServedRequest]:
        return [r for r in self.served if r is not None]

    # --- one request -----------------------------------------------------------------------------------------
    def one(self, index: int) -> None:
        experiment, settings, session = self.experiment, self.settings, self.session
        start, arrival = time.perf_counter(), experiment.ms()
        asked = self.workload.requests[index] if self.workload else None
        params = GenerationParams(max_new_tokens=(asked and asked.max_tokens) or settings.new_tokens,
                                  temperature=0.0, seed=index)
        messages = asked.chat() if asked else conversation(settings, index, experiment.exp_id)
        prompt_ids = client.tokenize(session.address, session.facts.name, messages) if self.subscriber else None
        with self.lock:                     # what the blocks stored so far could give: a prediction, not the answer
            size = self.blocks.block_size
            predicted = self.tree.reused_tokens(prompt_ids, size) if prompt_ids and size else 0
        result = session.chat(messages, params, self.emit, self.stop)
        s = result.summary
        cached = s.server_cached_tokens                     # the server's own answer (None: it did not say)
        if prompt_ids is not None:
            self.stop.wait(0.3)                            # the engine publishes its blocks as it stores them
            with self.lock:
                size = self.blocks.block_size or 1
                walked = RequestBlocks(experiment.exp_id, experiment.ms(), index, len(prompt_ids), predicted, size,
                                       self.tree.walk(prompt_ids, size), cached)
                self.tree.add(walked)
                self.emit(walked)
        decode_s, timings = s.decode_ms / 1000.0, s.server_timings
        sent = prompt_size(timings)
        phases = server_phases(timings)               # the server's own split, whatever its engine calls it
        served = ServedRequest(
            index=index, arrival_ms=arrival, ttft_ms=s.ttft_ms, e2e_ms=(time.perf_counter() - start) * 1000,
            generated=s.generated_tokens, ok=isinstance(result, RunFinished) and result.reason != "stopped",
            decode_tok_s=s.decode_runs / decode_s if decode_s > 0 else 0.0,
            cached_tokens=cached, predicted_tokens=predicted if prompt_ids is not None else None,
            prompt_tokens=_whole(sent), server_prompt_ms=phases.prompt_ms if phases else None,
            server_predicted_ms=phases.generated_ms if phases else None,
            server_prompt_n=_whole(phases.prompt_tokens) if phases else None,
            server_cache_n=_whole(phases.cached_tokens) if phases else None)
        with self.lock:
            self.served[index] = served
            experiment.point(served)
            done = len(self.done())
        experiment.progress(done, self.count, f"{done} of {self.count} requests finished")

    # --- what the server says beside the answers ---------------------------------------------------------------
    def read_metrics(self) -> metrics.Reading | None:
        """One poll, recorded; a slow or broken answer is counted and said, and the next poll tries again."""
        experiment = self.experiment
        try:
            reading = metrics.read(get_text(self.session.address, "/metrics",
                                            timeout=max(self.settings.poll_s, 2.0)))
        except (RemoteError, metrics.MetricsError) as exc:
            with self.lock:
                self.polls_failed += 1
                self.poll_error = self.poll_error or str(exc)
            experiment.progress(len(self.done()), self.count,
                                f"a /metrics poll failed ({self.polls_failed:,} so far): {exc}; polling goes on")
            return None
        with self.lock:
            now = experiment.ms()
            experiment.point(MetricsPoint.from_values({"t_ms": now, **reading.values}))
            for key, values in reading.engines.items():          # data-parallel engines: each apart
                experiment.point(MetricsPoint.from_values({"t_ms": now, **values}), f"{MetricsPoint.ENGINE}{key}"[:64])
                if "kv_usage" in values:
                    self.kv_by_engine[key] = max(self.kv_by_engine.get(key, 0.0), values["kv_usage"])
            for note in reading.notes:
                if note not in self.poll_notes:
                    self.poll_notes.append(note)
            for quantity, value in reading.values.items():
                self.seen.setdefault(quantity, []).append(value)
        return reading

    def read_slots(self) -> None:
        """llama-server's slots, polled beside /metrics: a slow answer (a long prompt in progress) or a server
        started with --no-slots is said once, and polling goes on."""
        try:
            found, more = slots.read_slots(client.get_json(self.session.address, "/slots",
                                                            timeout=max(self.settings.poll_s, 2.0)))
        except (RemoteError, slots.SlotsError) as exc:
            self.slots.error = self.slots.error or str(exc)[:300]
            return
        with self.lock:
            seen = self.slots
            seen.ok += 1
            seen.last = found
            seen.busy = max(seen.busy, sum(s.processing for s in found))
            seen.held = max(seen.held, max(s.held for s in found))
            self.experiment.point(SlotsPoint.from_values({"t_ms": self.experiment.ms(), **slots.slot_values(found)}))
            if more:
                seen.error = f"the server has {len(found) + more} slots; the first {len(found)} are shown"

    def poll(self) -> None:
        while not self.stop.is_set():
            if self.session.facts.metrics:
                self.read_metrics()
            if self.by_slots:
                self.read_slots()
            self.stop.wait(self.settings.poll_s)

    def listen(self) -> None:
        """The engine's KV events, as they come: each recorded in the order received, the tree kept for the
        requests' walks. The blocks' text is asked of the server first; the event is stamped when it is written,
        so a trace's clock never goes back."""
        assert self.subscriber is not None
        seen = self.blocks
        while not self.stop.is_set():
            for fact in self.subscriber.read(0.2):
                blocks = len(getattr(fact, "keys", ()))
                with self.lock:
                    recording = seen.recorded + blocks <= MAX_RECORDED_BLOCKS or not blocks
                texts = _texts(self.session, fact) if recording else []
                with self.lock:
                    event = _blocks_event(self.experiment, fact, texts)
                    seen.events += 1
                    if isinstance(fact, kv_events.Stored):
                        seen.stored += len(fact.keys)
                        seen.block_size = fact.block_size
                    self.tree.add(event)                # bounded: it keeps MAX_NODES blocks
                    if recording:
                        seen.recorded += blocks
                        self.emit(event)
                    else:                               # a flood: counted, not kept (memory stays bounded)
                        seen.unrecorded += blocks

    # --- the test --------------------------------------------------------------------------------------------
    def run(self) -> ServerLoadResult:
        experiment, settings, session, count = self.experiment, self.settings, self.session, self.count
        listener = threading.Thread(target=self.listen, name="kvscope-kv-events", daemon=True) \
            if self.subscriber else None
        if listener is not None:
            listener.start()
            time.sleep(0.3)                               # a SUB socket misses what is sent before it joined
        before = self.read_metrics() if session.facts.metrics else None     # the counters before the first request
        poller = threading.Thread(target=self.poll, name="kvscope-metrics", daemon=True)
        if session.facts.metrics or self.by_slots:
            poller.start()
        began = time.perf_counter()
        plural = "s" if count != 1 else ""
        source = f"from {Path(settings.workload).name}" if self.workload else f"one every {settings.every_s:g} s"
        if count:
            experiment.progress(0, count, f"{count} request{plural} to {session.url}, {source}")
        else:
            self.watch()
        threads = []
        for i in range(count):
            due = arrival_s(self.workload, i, settings.every_s)
            experiment.cancel.wait(max(due - (time.perf_counter() - began), 0.0))     # when the request arrives
            if experiment.cancelled:
                break
            thread = threading.Thread(target=self.one, args=(i,), name=f"kvscope-request-{i}", daemon=True)
            thread.start()
            threads.append(thread)
        for thread in threads:
            remaining = settings.limit_s - (time.perf_counter() - began)
            while thread.is_alive() and remaining > 0 and not experiment.cancelled:
                thread.join(min(remaining, 0.2))
                remaining = settings.limit_s - (time.perf_counter() - began)
            if thread.is_alive():
                self.stop.set()                             # over time or cancelled: the streams stop, runs are kept
                thread.join(10.0)
        self.stop.set()
        if poller.is_alive():
            poller.join(max(settings.poll_s, 2.0) + 1.0)
        after = self.read_metrics() if session.facts.metrics else None      # ... and after the last one ended
        figures = self.figures(before, after, listener)
        return summarize(self.done(), count, self.seen, self.poll_notes, figures)

    def watch(self) -> None:
        """No requests of KVScope's own: every client's blocks, as the engine publishes them, until Ctrl+. or the
        time limit, with a word each second of how many arrived."""
        experiment, settings = self.experiment, self.settings
        began = time.perf_counter()
        while True:                                      # said at once, and once a second until it ends
            with self.lock:
                stored = self.blocks.stored
            experiment.progress(0, 0, f"watching {self.session.url}: {stored:,} blocks stored by its clients so "
                                      "far (Ctrl+. stops)")
            if experiment.cancelled or time.perf_counter() - began >= settings.limit_s:
                return
            experiment.cancel.wait(min(1.0, max(settings.limit_s - (time.perf_counter() - began), 0.0)))

    def figures(self, before: metrics.Reading | None, after: metrics.Reading | None,
                listener: threading.Thread | None) -> dict:
        """The result's figures beside the answers': the counters' movement, the KV events', the polls'."""
        figures: dict = counter_figures(before, after, self.done())
        if self.subscriber is not None and listener is not None:
            listener.join(2.0)
            self.subscriber.close()
            predicted, prompted = self.tree.hit_rate()
            seen = self.blocks
            figures.update(kv_events=seen.events, blocks_stored=seen.stored, tree_reused_tokens=predicted,
                           tree_prompt_tokens=prompted, mispredicted_requests=len(self.tree.mispredicted()),
                           blocks_unrecorded=seen.unrecorded, kv_messages_lost=self.subscriber.lost)
            if self.subscriber.notes:
                figures["kv_events_error"] = self.subscriber.notes[0][:300]
            self.poll_notes.extend(self.subscriber.notes[1:4])
        figures["metrics_polls"] = max((len(v) for v in self.seen.values()), default=0)
        if self.kv_by_engine:
            names = sorted(self.kv_by_engine)[:64]
            figures.update(engines=tuple(n[:64] for n in names),
                           peak_kv_usage_by_engine=tuple(self.kv_by_engine[n] for n in names))
        figures["metrics_failed"] = self.polls_failed
        if self.by_slots:
            figures.update(slots_polls=self.slots.ok, slots_error=self.slots.error)
            if self.slots.last:
                last = self.slots.last
                figures.update(slots=len(last), slot_context=max(s.n_ctx for s in last),
                               peak_busy_slots=self.slots.busy, peak_slot_held=self.slots.held)
        if self.workload is not None:
            figures.update(workload=Path(self.settings.workload).name[:300],
                           workload_note=self.workload.note(MAX_REQUESTS)[:300])
        if self.poll_error:
            figures["metrics_error"] = self.poll_error[:300]
        return figures


def _whole(value: float | None) -> int | None:
    return int(value) if value is not None else None


def arrival_s(workload: Workload | None, index: int, every_s: float) -> float:
    """When request ``index`` is sent, in seconds after the first: the workload's own time, else the spacing."""
    asked = workload.requests[index].arrival_s if workload is not None else None
    return asked if asked is not None else index * every_s


def prompt_size(timings: dict) -> float | None:
    """A request's whole prompt as the server counted it: vLLM's and SGLang's usage, or llama-server's evaluated
    plus cached tokens."""
    if "usage.prompt_tokens" in timings:
        return timings["usage.prompt_tokens"]
    if "timings.prompt_n" in timings:
        return timings["timings.prompt_n"] + timings.get("timings.cache_n", 0)
    return None


def counter_figures(before: metrics.Reading | None, after: metrics.Reading | None,
                    done: list[ServedRequest]) -> dict:
    """The server's counters over the test: what moved between a poll before the first request and one after the
    last ended (none when either could not be read: a figure not read is not shown), and how much of that this
    test's own requests account for (the rest came from other clients)."""
    if before is None or after is None:
        return {}
    out: dict = {}
    for quantity in ("cached_prompt_tokens", "prompt_tokens", "generated_tokens", "prefix_queries"):
        if quantity in before.values and quantity in after.values:
            out[f"{quantity}_during"] = after.values[quantity] - before.values[quantity]
    own = [r.prompt_tokens for r in done if r.prompt_tokens is not None]
    if own and len(own) == len(done):
        out["own_prompt_tokens"] = sum(own)
        moved = out.get("prefix_queries_during", out.get("prompt_tokens_during"))
        if moved is not None and moved > sum(own):
            out["other_prompt_tokens"] = moved - sum(own)
    return out


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


def _texts(session: object, fact: kv_events.Fact) -> list[str]:
    """Each stored block's tokens as the server's own tokenizer decodes them (the slow part, outside any lock)."""
    if not isinstance(fact, kv_events.Stored) or len(fact.tokens) > 64:
        return []
    return [client.detokenize(session.address, session.facts.name, list(tokens), timeout=2.0) for tokens in fact.tokens]


def _blocks_event(experiment: Experiment, fact: kv_events.Fact, texts: list[str]) -> KVBlocks:
    """A KV event as the trace keeps it, stamped now (the caller writes it at once), a stored block with its
    text."""
    t = experiment.ms()
    if isinstance(fact, kv_events.Stored):
        return KVBlocks(experiment.exp_id, t, "stored", list(fact.keys), fact.parent,
                        [list(tokens) for tokens in fact.tokens], texts, fact.publisher, fact.medium)
    if isinstance(fact, kv_events.Removed):
        return KVBlocks(experiment.exp_id, t, "removed", list(fact.keys), publisher=fact.publisher,
                        medium=fact.medium)
    return KVBlocks(experiment.exp_id, t, "cleared", publisher=fact.publisher)


def summarize(done: list[ServedRequest], requested: int, seen: dict[str, list[float]],
              poll_notes: Sequence[str] = (), figures: dict | None = None) -> ServerLoadResult:
    ok = [r for r in done if r.ok]
    out: dict = {"requested": requested, "completed": len(ok), "failed": len(done) - len(ok)}
    if ok:
        span_s = (max(r.arrival_ms + r.e2e_ms for r in ok) - min(r.arrival_ms for r in ok)) / 1000.0
        out.update(
            mean_ttft_ms=statistics.fmean(r.ttft_ms for r in ok),
            median_ttft_ms=statistics.median(r.ttft_ms for r in ok),
            mean_decode_tok_s=statistics.fmean(r.decode_tok_s for r in ok),
            total_tok_s=sum(r.generated for r in ok) / span_s if span_s > 0 else 0.0)
        server = [(r.ttft_ms, r.server_prompt_ms) for r in ok if r.server_prompt_ms is not None]
        if server:
            out["mean_server_prompt_ms"] = statistics.fmean(prompt for _ttft, prompt in server)
            out["mean_client_minus_server_ms"] = statistics.fmean(ttft - prompt for ttft, prompt in server)
    told = [(r.cached_tokens, r.prompt_tokens) for r in done
            if r.cached_tokens is not None and r.prompt_tokens is not None]
    if told:
        out["server_cached_tokens"] = sum(cached for cached, _prompt in told)
        out["server_prompt_tokens"] = sum(prompt for _cached, prompt in told)
        out["server_answered"] = len(told)
    for quantity in ("running", "waiting", "kv_usage"):
        if seen.get(quantity):
            out[f"peak_{quantity}"] = max(seen[quantity])
    out.update(figures or {})
    return ServerLoadResult(**out, incomplete=len(done) < requested,
                            notes=tuple(note[:4096] for note in list(poll_notes)[:8]))


def timeline(items: Sequence[object]) -> list[Span | Counter]:
    """What the server said on /metrics, as counters; each request as a lane (waiting, then streaming)."""
    out: list[Span | Counter] = []
    for m in of(items, MetricsPoint):
        if m.series == MetricsPoint.series:                 # the server's sum (each engine's is in the trace)
            out += [Counter(f"server {name}", m.t_ms, {name: value}) for name, value in m.values().items()
                    if name != "t_ms"]
    for r in of(items, ServedRequest):
        track, first = f"request {r.index} (client)", r.arrival_ms + r.ttft_ms
        out += [Span(track, "waiting for the first token", r.arrival_ms, r.ttft_ms),
                Span(track, "streaming", first, max(r.arrival_ms + r.e2e_ms - first, 0.0))]
    return out


def table(points: Sequence[ExperimentPoint], result: ServerLoadResult) -> str:
    rows = [p.values for p in points if p.series == "request"]
    cached = any("cached_tokens" in v for v in rows)
    predicted = any("predicted_tokens" in v for v in rows)
    head = ("request | arrived ms | TTFT ms (client) | prompt ms (server) | tokens | decode tok/s | end-to-end ms"
            + (" | prompt | cached (server)" if cached else "") + (" | predicted at send" if predicted else ""))
    lines = [head, "-" * len(head)]
    for v in rows:
        server = f"{v['server_prompt_ms']:18.1f}" if "server_prompt_ms" in v else f"{'not reported':>18}"
        line = (f"{int(v['index']):7d} | {v['arrival_ms']:10.1f} | {v['ttft_ms']:16.1f} | {server} | "
                f"{int(v['generated']):6d} | {v['decode_tok_s']:12.1f} | {v['e2e_ms']:13.1f}")
        if cached:
            line += (f" | {int(v['prompt_tokens']):6d} | {int(v['cached_tokens']):15d}" if "cached_tokens" in v
                     and "prompt_tokens" in v else f" | {'':6} | {'not reported':>15}")
        if predicted:
            differs = " ≠" if "cached_tokens" in v and v["cached_tokens"] != v.get("predicted_tokens") else ""
            line += f" | {int(v.get('predicted_tokens', 0)):16d}{differs}"
        lines.append(line)
    r = result
    if r.workload:
        lines += ["", f"the requests of {r.workload}" + (f" ({r.workload_note})" if r.workload_note else "")]
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
        peaks += [f"KV usage of engine {name} {value:.0%}" for name, value in zip(r.engines,
                                                                                 r.peak_kv_usage_by_engine)]
        if peaks:
            lines.append(f"/metrics ({r.metrics_polls} polls): peak " + ", ".join(peaks))
    lines += [f"/metrics: {note}" for note in r.notes]
    if r.metrics_error:
        lines.append(f"/metrics: {r.metrics_failed:,} poll(s) failed, each tried again at the next; the first: "
                     f"{r.metrics_error}")
    if r.slots is not None:
        lines.append(f"/slots ({r.slots_polls} polls, the server's own words): {r.slots} slots of "
                     f"{r.slot_context:,} positions; at most {r.peak_busy_slots} working at once, and one held at most "
                     f"{r.peak_slot_held:,} positions")
    if r.slots_error:
        lines.append(f"/slots: {r.slots_error}")
    lines += prefix_lines(r)
    return "\n".join(lines)


def prefix_lines(r: ServerLoadResult) -> list[str]:
    """The prefix cache three ways, weighted by tokens: what the server said it served in each answer (the
    figure), what the tree of its KV events predicted when each request was sent (a prediction: the server had
    not decided yet), and what its counters moved over the test (every client's requests, said when others
    moved them too)."""
    lines = []
    if r.server_cached_tokens is not None and r.server_prompt_tokens:
        lines.append(f"prefix cache, from the server's answers: {r.server_cached_tokens:,} of "
                     f"{r.server_prompt_tokens:,} prompt tokens served from its cache "
                     f"({r.server_cached_tokens / r.server_prompt_tokens:.1%}, as {r.server_answered:,} answers said)")
    if r.tree_prompt_tokens:
        differ = (f"; {r.mispredicted_requests:,} request(s) differ from the server's answer (sent before the blocks "
                  "they needed were stored)" if r.mispredicted_requests else "")
        lines.append(f"prefix cache, predicted at send from the KV events ({r.kv_events:,} events, "
                     f"{r.blocks_stored:,} blocks stored; the blocks stored then): {r.tree_reused_tokens:,} of "
                     f"{r.tree_prompt_tokens:,} prompt tokens ({r.tree_reused_tokens / r.tree_prompt_tokens:.1%})"
                     f"{differ}")
    if r.prefix_queries_during and r.cached_prompt_tokens_during is not None:
        others = (f"; other clients sent {r.other_prompt_tokens:,.0f} of them" if r.other_prompt_tokens else
                  "; all of them this test's" if r.own_prompt_tokens is not None else "")
        lines.append(f"prefix cache, from the server's counters over the test: {r.cached_prompt_tokens_during:,.0f} "
                     f"of {r.prefix_queries_during:,.0f} prompt tokens hit "
                     f"({r.cached_prompt_tokens_during / r.prefix_queries_during:.1%}, as reported){others}")
    elif r.cached_prompt_tokens_during is not None:
        others = f" (other clients' requests among them: {r.other_prompt_tokens:,.0f} prompt tokens)" \
            if r.other_prompt_tokens else ""
        lines.append(f"prefix cache, from the server's counters over the test: {r.cached_prompt_tokens_during:,.0f} "
                     f"prompt tokens from its cache{others}")
    if r.blocks_unrecorded:
        lines.append(f"KV events: the first {MAX_RECORDED_BLOCKS:,} blocks' events are kept in the trace and drawn; "
                     f"{r.blocks_unrecorded:,} more blocks were counted, not kept (memory stays bounded)")
    if r.kv_messages_lost:
        lines.append(f"KV events: {r.kv_messages_lost:,} messages the publisher numbered never arrived (it sent "
                     "faster than they were read): the tree misses their blocks")
    if r.kv_events_error:
        lines.append(f"KV events: {r.kv_events_error}")
    return lines


LESSON = Lesson(kind="server load", title="Server load", settings=ServerLoadSettings, result=ServerLoadResult,
                run=run, table=table, target=SERVER, timeline=timeline, check=check,
                points=(ServedRequest, MetricsPoint, SlotsPoint), events=(KVBlocks, RequestBlocks),
                quick={"requests": 3, "every_s": 0.5})
