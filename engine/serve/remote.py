"""A serving engine watched from outside: llama.cpp's ``llama-server``, vLLM, TGI or SGLang, through the
OpenAI-compatible streaming API and the Prometheus ``/metrics`` page.

A run streams ``/v1/chat/completions`` (or ``/v1/completions`` for raw text) with ``stream: true`` and emits the
events a local run emits, timed by this client's clock: ``RunStarted`` (the model is ``ServerFacts``), one
``TokenStep`` per token (or piece of text) as it arrives, ``RunFinished`` or ``RunFailed``. What only the engine
knows is absent, not zero: token ids, positions, forward times, per-layer KV; the probabilities come from
``logprobs`` when the server sends them, and the server's own figures (llama-server's ``timings``, ``usage``) go
into ``RunSummary.server_timings`` under the names the server used.

A server is data from anywhere, like a trace. Everything it sends is kept within the bounds the events declare,
at the source and visibly: a piece of text longer than a token may be is split, candidates beyond the most a
step keeps are cut to the likeliest (``TokenStep.candidates_cut``), figures no counter can hold are dropped
(``RunSummary.notes`` says which). The client enforces the run's ``max_new_tokens`` itself, an overall
deadline, and bounded lines, nesting and numbers; whatever ends a run, the tokens received so far are kept.
Credentials in the address (``http://user:pw@host``) are sent as HTTP basic authentication and never stored:
``ServerFacts.url`` and every message carry the address without them.

The requests themselves go through ``engine.serve.client`` (the standard library's ``http.client``, within
bounds): a run is one request and a load test a few dozen, and the errors (unreachable, 401, a dropped stream, a
malformed line) each become one line a user can act on.
"""

from __future__ import annotations

import http.client
import math
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from engine.facts.errors import PromptError
from engine.facts.events import (
    Candidate,
    RunFailed,
    RunFinished,
    RunStarted,
    RunSummary,
    ServerFacts,
    TokenStep,
)
from engine.facts.fields import MAX_CANDIDATES, MAX_CONTEXT, MAX_NUMBER, MAX_TEXT, MAX_VOCAB
from engine.facts.params import DEADLINE_S, GenerationParams
from engine.facts.tally import RunTally
from engine.facts.textstream import clean_text
from engine.serve import metrics, ollama
from engine.serve.client import (
    MAX_LINE,
    RemoteError,
    StreamDropped,
    address,
    address_of,
    get_json,
    get_text,
    loads,
    reason_of,
    remember_credentials,
    request,
    short,
    stream_line,
)

TOP_LOGPROBS = 5
MAX_FIGURES = 64                      # a server's own figures kept per run
UNSTATED_CONTEXT = 1 << 18            # tokens read from a server that states no context (memory stays bounded)
Sink = Callable[[object], None]


# --- what the server reveals ------------------------------------------------------------------------------
def probe(url: str, timeout: float = 5.0, deadline_s: float = DEADLINE_S) -> ServerFacts:
    """The model the server serves, which engine it is, its context if it says, and whether it has
    ``/metrics``. Unreachable or not OpenAI-compatible: ``RemoteError``."""
    where = address(url)
    remember_credentials(where)
    models = get_json(where, "/v1/models", min(timeout, deadline_s))
    entries = models.get("data") if isinstance(models, dict) else None
    if not isinstance(entries, list) or not entries or not isinstance(entries[0], dict):
        raise RemoteError(f"The server at {where.url} lists no model at /v1/models: is it an OpenAI-compatible "
                          "server?")
    first = entries[0]
    name = clean_text(str(first.get("id", "model")))[0][:200]
    owner = str(first.get("owned_by", "")).lower()
    meta = first.get("meta") if isinstance(first.get("meta"), dict) else {}
    context = _context(first.get("max_model_len")) or _context(meta.get("n_ctx"))
    engine = {"llamacpp": "llama.cpp", "vllm": "vLLM", "sglang": "SGLang"}.get(owner, "")
    reveals = ["a token stream timed by this client"]
    own = _ollama_facts(where, name, timeout)
    if own is not None:
        engine, context = "Ollama", context or own
        reveals.append("its own prefill and decode split per answer (prompt_eval_count and prompt_eval_duration, "
                       "eval_count and eval_duration, load_duration)")
    studio = _lm_studio_facts(where, name, timeout) if own is None else None
    if studio is not None:
        engine, context = "LM Studio", context or studio
        reveals.append("its own stats per answer where its REST API sends them (stats: time_to_first_token, "
                       "generation_time, tokens_per_second)")
    try:
        props = get_json(where, "/props", timeout) if engine not in ("Ollama", "LM Studio") else None
        settings = props.get("default_generation_settings", {}) if isinstance(props, dict) else {}
        settings = settings if isinstance(settings, dict) else {}
        if isinstance(props, dict):
            context = context or _context(props.get("n_ctx")) or _context(settings.get("n_ctx"))
            engine = engine or ("llama.cpp" if "build_info" in props or settings else "")
    except RemoteError:
        pass
    has_metrics = False
    try:
        reading = metrics.read(get_text(where, "/metrics", timeout))
        engine, has_metrics = engine or reading.engine, True
        engines = f" from {len(reading.engines)} engines" if reading.engines else ""
        reveals.append(f"/metrics{engines}: {', '.join(sorted(reading.values)) or 'no quantity KVScope reads'}"[:512])
        reveals += [f"/metrics: {note}"[:512] for note in reading.notes[:4]]
    except metrics.MetricsError as exc:
        reveals.append(f"/metrics answered but was not read: {exc}"[:512])
    except RemoteError:
        pass
    if engine == "llama.cpp":
        reveals.append("its own prompt and decode timings per response (timings: prompt_ms, predicted_ms, cache_n)")
    return ServerFacts(name=name or "model", url=where.url, engine=engine or "OpenAI-compatible server",
                       context=context, metrics=has_metrics, reveals=reveals)


def _ollama_facts(where, name: str, timeout: float) -> int | None | bool:
    """None when the server is not Ollama (it answers ``/api/version`` with its version); else the context the
    model runs with when ``/api/ps`` says (it loads models on demand), or False."""
    try:
        version = get_json(where, "/api/version", timeout)
    except RemoteError:
        return None
    if not isinstance(version, dict) or not isinstance(version.get("version"), str):
        return None
    try:
        loaded = get_json(where, "/api/ps", timeout)
    except RemoteError:
        return False
    models = loaded.get("models") if isinstance(loaded, dict) else None
    for model in models if isinstance(models, list) else []:
        if isinstance(model, dict) and model.get("name") == name:
            return _context(model.get("context_length")) or False
    return False


def _lm_studio_facts(where, name: str, timeout: float) -> int | None | bool:
    """None when the server is not LM Studio (its REST API lists models with their ``state``); else the model's
    ``max_context_length`` when it says, or False."""
    try:
        listed = get_json(where, "/api/v0/models", timeout)
    except RemoteError:
        return None
    entries = listed.get("data") if isinstance(listed, dict) else None
    if not isinstance(entries, list) or not any(isinstance(m, dict) and "state" in m for m in entries):
        return None
    for model in entries:
        if isinstance(model, dict) and model.get("id") == name:
            return _context(model.get("max_context_length")) or False
    return False


def _context(value: object) -> int | None:
    return value if type(value) is int and 0 < value <= MAX_CONTEXT else None


# --- streaming ----------------------------------------------------------------------------------------------
def sse_payloads(response: Any) -> Iterator[str]:
    """The ``data:`` payloads of a server-sent event stream, joined per event; ``[DONE]`` ends it. An event the
    connection cut off before its closing blank line is incomplete and dropped (the caller sees the stream end
    without a finish and says the stream was dropped)."""
    data: list[str] = []
    while True:
        line = stream_line(response)
        if line is None:
            return
        text = line.rstrip("\r\n")
        if not text:
            if data:
                payload = "\n".join(data)
                data = []
                if payload.strip() == "[DONE]":
                    return
                yield payload
        elif text.startswith(":"):
            continue
        elif text.startswith("data:"):
            if sum(map(len, data)) + len(text) > MAX_LINE:
                raise RemoteError(f"the server sent a stream event longer than {MAX_LINE:,} bytes: not a token "
                                  "stream")
            data.append(text[5:].lstrip(" "))
        elif text.startswith(("event:", "id:", "retry:")):
            continue
        else:
            raise RemoteError(f"the server sent a line that is not server-sent events: {text[:80]!r}")


class _Watchdog:
    """Ends a stream that must end (Stop pressed, or the deadline passed) even while a read is waiting for a
    server that sends nothing, or one byte a second: it shuts the socket, and the read fails at once."""

    def __init__(self, sock: socket.socket | None, cancel: threading.Event, deadline_s: float) -> None:
        self.sock, self.cancel = sock, cancel
        self.reason = ""                              # "stopped" or "deadline" once it acted
        self._done = threading.Event()
        self._deadline = time.monotonic() + deadline_s
        self._thread = threading.Thread(target=self._watch, name="kvscope-stream-watch", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._done.is_set():
            left = self._deadline - time.monotonic()
            if self.cancel.is_set() or left <= 0:
                self.reason = "stopped" if self.cancel.is_set() else "deadline"
                if self.sock is not None:
                    try:
                        self.sock.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass
                return
            self.cancel.wait(min(left, 0.05))

    def close(self) -> None:
        self._done.set()


class RemoteSession:
    """Runs and chat turns through a server, with the interface of ``engine.run.session.Session`` that the worker,
    the CLI and the load test use (``run``, ``chat``, ``facts``)."""

    def __init__(self, facts: ServerFacts, timeout: float = 60.0, deadline_s: float = DEADLINE_S) -> None:
        self.facts = facts
        self.url = facts.url
        self.address = address_of(facts.url)
        self.timeout = timeout
        self.deadline_s = deadline_s
        self.has_chat_template = True          # the server applies its own
        self.kept_tokens = 0

    def forget(self, reason: str = "") -> None:
        """The server keeps (or drops) its own prompt cache; nothing is held here."""

    def run(self, prompt: str, params: GenerationParams, sink: Sink | None = None,
            cancel: threading.Event | None = None, before_step: Callable[[int], None] | None = None
            ) -> RunFinished | RunFailed:
        prompt, _ = clean_text(prompt or "")
        if not prompt.strip():
            raise PromptError("The prompt is empty: type something for the model to read")
        messages = [{"role": "user", "content": prompt}] if params.chat_template else None
        return _Stream(self, messages, prompt, "generate", params, sink, cancel, before_step).run()

    def chat(self, messages: list[dict], params: GenerationParams, sink: Sink | None = None,
             cancel: threading.Event | None = None, before_step: Callable[[int], None] | None = None,
             reuse: bool = True) -> RunFinished | RunFailed:
        messages = [{"role": m.get("role", "user"), "content": clean_text(str(m.get("content", "")))[0]}
                    for m in messages]
        if not messages or not messages[-1]["content"].strip():
            raise PromptError("The message is empty: type something for the model to read")
        stream = _Stream(self, messages, messages[-1]["content"], "chat", params, sink, cancel, before_step)
        stream.cache_prompt = reuse
        return stream.run()

    def body(self, messages: list[dict] | None, prompt: str, params: GenerationParams, cache_prompt: bool) -> dict:
        body: dict[str, Any] = {"model": self.facts.name, "stream": True, "max_tokens": params.max_new_tokens,
                                "temperature": params.temperature, "top_p": params.top_p,
                                "stream_options": {"include_usage": True}, "logprobs": True}
        if params.top_k:
            body["top_k"] = params.top_k
        if params.seed is not None:
            body["seed"] = params.seed
        if messages is not None:
            body["messages"] = messages
            body["top_logprobs"] = TOP_LOGPROBS
        else:
            body["prompt"] = prompt
            body["logprobs"] = TOP_LOGPROBS
        if self.facts.engine == "llama.cpp":
            body["cache_prompt"] = cache_prompt
            body["timings_per_token"] = False
        return body


class _Stream:
    """One streamed request, from ``RunStarted`` to ``RunFinished`` or ``RunFailed``, tokens kept whatever ends it."""

    def __init__(self, session: RemoteSession, messages: list[dict] | None, prompt: str, kind: str,
                 params: GenerationParams, sink: Sink | None, cancel: threading.Event | None,
                 before_step: Callable[[int], None] | None) -> None:
        self.session, self.messages, self.prompt, self.kind, self.params = session, messages, prompt, kind, params
        self.emit_to = sink or (lambda _e: None)
        self.cancel = cancel or threading.Event()
        self.before_step = before_step
        self.cache_prompt = True
        self.run_id = uuid.uuid4().hex[:12]
        self.t0 = time.perf_counter()
        self.tally = RunTally()
        self.figures = _Figures(self.tally)
        self.last = 0.0
        # No answer is longer than the server's context: a stream that goes on past it (or past 262,144 tokens
        # from a server that states none) is ended here, so memory stays bounded whatever the server does.
        self.limit = min(params.max_new_tokens, session.facts.context or UNSTATED_CONTEXT)
        self.native = session.facts.engine == "Ollama"      # its own API: its own prefill and decode figures

    def since(self) -> float:
        return (time.perf_counter() - self.t0) * 1000.0

    def emit(self, event: object) -> None:
        self.tally.add(event)
        self.emit_to(event)

    def run(self) -> RunFinished | RunFailed:
        s, params = self.session, self.params
        self.emit(RunStarted(run_id=self.run_id, label=(params.describe() + f" · {s.facts.engine}")[:512],
                             model=s.facts, params=params, prompt=self.prompt, prompt_ids=[], prompt_pieces=[],
                             started_at=datetime.now(timezone.utc).isoformat(timespec="seconds"), t_ms=0.0,
                             kind=self.kind))
        if self.native:
            path, body = ollama.request(s.facts.name, self.messages, self.prompt, params)
        else:
            path = "/v1/chat/completions" if self.messages is not None else "/v1/completions"
            if s.facts.engine == "LM Studio":              # its REST API: the same stream, with its own stats
                path = "/api/v0" + path[3:]
            body = s.body(self.messages, self.prompt, params, self.cache_prompt)
        try:
            exchange = request(s.address, "POST", path, body, timeout=min(s.timeout, s.deadline_s))
        except RemoteError as exc:
            return self._failed("unreachable", str(exc))
        watchdog = _Watchdog(exchange.sock, self.cancel, max(s.deadline_s - self.since() / 1000.0, 0.0))
        try:
            self._check_stream(exchange.response)
            reason = self._read(exchange.response)
        except (RemoteError, OSError, http.client.HTTPException, ValueError) as exc:
            if watchdog.reason == "stopped":
                reason = "stopped"
            elif watchdog.reason == "deadline":
                return self._failed("deadline", f"the server was still streaming after the {s.deadline_s:g} s "
                                                 f"deadline ({self.tally.generated} tokens arrived; they are kept)")
            elif isinstance(exc, RemoteError):
                return self._failed("dropped" if isinstance(exc, StreamDropped) else "stream", str(exc))
            else:
                return self._failed("dropped", f"the connection broke mid-stream: {reason_of(exc)} "
                                               f"({self.tally.generated} tokens arrived; they are kept)")
        finally:
            watchdog.close()
            exchange.close()
        return self._finished(reason)

    def _check_stream(self, response: http.client.HTTPResponse) -> None:
        kind = (response.getheader("Content-Type") or "").split(";")[0].strip().lower()
        wanted = ollama.STREAM_TYPES if self.native else ("text/event-stream",)
        if kind and kind not in wanted:
            head = response.read(200).decode("utf-8", "replace")
            raise RemoteError(f"the server answered with {short(kind, 60)}, not a token stream ({wanted[0]}): "
                              f"{short(head, 80)!r}")

    def _read(self, response: http.client.HTTPResponse) -> str:
        """Tokens until the server says it is done, the run has its ``max_new_tokens``, or Stop."""
        reason = None
        self.last = self.since()
        for payload in (ollama.payloads if self.native else sse_payloads)(response):
            if self.cancel.is_set():
                return "stopped"
            try:
                chunk = loads(payload)
            except ValueError:
                raise RemoteError(f"the server sent a stream event that is not JSON: {payload[:80]!r}") from None
            if not isinstance(chunk, dict):
                raise RemoteError(f"the server sent a stream event that is not an object: {payload[:80]!r}")
            if "error" in chunk:
                message = chunk["error"].get("message", chunk["error"]) if isinstance(chunk["error"], dict) \
                    else chunk["error"]
                raise RemoteError(f"the server reported an error mid-stream: {short(message)}")
            self.figures.absorb(chunk)
            for text, token_id, prob, candidates, cut in (_native_pieces if self.native else _pieces)(chunk):
                if self.tally.generated >= self.limit:                  # more than it can or was asked to send
                    self.figures.note_cut_stream(self.limit, self._limit_words())
                    return "max_tokens" if self.limit == self.params.max_new_tokens else "context_full"
                self._token(text, token_id, prob, candidates, cut)
            finish = (ollama.finish_of if self.native else _finishreason_of)(chunk)
            if finish is not None:
                reason = finish
        if reason is None:
            raise StreamDropped("the server closed the stream before saying it was done "
                                f"({self.tally.generated} tokens arrived; they are kept)")
        return reason

    def _limit_words(self) -> str:
        if self.limit == self.params.max_new_tokens:
            return "max_new_tokens"
        return "the server's context" if self.session.facts.context else \
            "the most it reads from a server that states no context"

    def _token(self, text: str, token_id: int | None, prob: float | None, candidates: list[Candidate],
               cut: int) -> None:
        now = self.since()
        step = self.tally.generated
        self.emit(TokenStep(run_id=self.run_id, t_ms=now, step=step, position=None, token_id=token_id, text=text,
                            special=False, phase="prefill" if step == 0 else "decode", latency_ms=now - self.last,
                            forward_ms=None, prob=prob, raw_prob=None, candidates=candidates,
                            kv_bytes_per_layer=[], kv_positions_per_layer=[], candidates_cut=cut))
        self.last = now
        if self.before_step is not None:
            self.before_step(step + 1)

    def _finished(self, reason: str) -> RunFinished:
        self.figures.settle()
        event = RunFinished(self.run_id, self.since(), reason, self.tally.summary(self.since()))
        self.emit_to(event)
        return event

    def _failed(self, error: str, message: str) -> RunFailed:
        self.figures.settle()
        event = RunFailed(self.run_id, self.since(), error, message[:4096], self.tally.summary(self.since()))
        self.emit_to(event)
        return event


class _Figures:
    """What a server reports about a run (``usage``, llama-server's ``timings``), kept when a counter can hold
    it and dropped, with a note, when it cannot."""

    def __init__(self, tally: RunTally) -> None:
        self.tally = tally
        self.usage: dict = {}
        self.timings: dict = {}
        self.own: dict = {}                     # figures under the server's own API's names (Ollama's)
        self.split = 0
        self.cut_candidates = 0

    def absorb(self, chunk: dict) -> None:
        if isinstance(chunk.get("usage"), dict):
            self.usage = chunk["usage"]
        if isinstance(chunk.get("timings"), dict):
            self.timings = chunk["timings"]
        self.own.update(ollama.figures_of(chunk))
        for part in ("stats", "model_info"):                # LM Studio's REST API: its own stats per answer
            if isinstance(chunk.get(part), dict):
                self.own.update({f"lmstudio.{part}.{k}": v for k, v in chunk[part].items() if _number(v)})

    def note_cut_stream(self, limit: int, why: str) -> None:
        self.tally.notes.append(f"the stream was ended by this client at {why} ({limit:,} tokens): the server "
                                "kept sending")

    def settle(self) -> None:
        """Move the server's figures into the tally: numbers within bounds, counts as counts, the rest noted."""
        reported = {f"timings.{k}": v for k, v in self.timings.items()}
        reported.update({f"usage.{k}": v for k, v in self.usage.items() if not isinstance(v, dict)})
        reported.update(self.own)
        details = self.usage.get("prompt_tokens_details")
        if isinstance(details, dict) and "cached_tokens" in details:
            reported["usage.prompt_tokens_details.cached_tokens"] = details["cached_tokens"]
        kept, dropped = {}, []
        for key, value in reported.items():
            if not isinstance(key, str) or len(key) > 64 or len(kept) >= MAX_FIGURES:
                dropped.append(str(key)[:64])
            elif _number(value) and abs(value) <= MAX_NUMBER:
                kept[key] = value
            elif _number(value):
                dropped.append(f"{key} ({value:g})")
            elif value is not None and not isinstance(value, (str, bool, list)):
                dropped.append(key)
        self.tally.server_timings = kept
        prompt = kept.get("timings.prompt_n", kept.get("usage.prompt_tokens", kept.get("ollama.prompt_eval_count")))
        cached = kept.get("timings.cache_n", kept.get("usage.prompt_tokens_details.cached_tokens"))
        self.tally.server_prompt_tokens = _count(prompt, "prompt tokens", dropped)
        self.tally.server_cached_tokens = _count(cached, "cached prompt tokens", dropped)
        if dropped:
            self.tally.notes.append(f"dropped server figures no counter can hold: {', '.join(dropped[:8])}"[:4096])


def _count(value: object, what: str, dropped: list[str]) -> int | None:
    if value is None:
        return None
    if _number(value) and value == int(value) and 0 <= value <= MAX_CONTEXT:
        return int(value)
    dropped.append(f"{what} ({value:g})" if _number(value) else what)
    return None


def _number(value: object) -> bool:
    return (type(value) is int or type(value) is float) and math.isfinite(value)


def _finishreason_of(chunk: dict) -> str | None:
    choices = chunk.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        return None
    reason = choices[0].get("finish_reason")
    return {"stop": "eos", "length": "max_tokens"}.get(reason, "eos") if reason else None


Piece = tuple[str, int | None, float | None, list[Candidate], int]


def _pieces(chunk: dict) -> list[Piece]:
    """The tokens in one chunk: from ``logprobs.content`` when the server sent them (one entry per token, with
    probabilities, and the token id where the server adds one, as llama-server does), else the chunk's text,
    as pieces of at most ``MAX_TEXT`` characters. Each: text, id, probability, candidates, candidates cut."""
    choices = chunk.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        return []
    choice = choices[0]
    delta = choice.get("delta") if isinstance(choice.get("delta"), dict) else {}
    text = delta.get("content") if "delta" in choice else choice.get("text")
    logprobs = choice.get("logprobs") if isinstance(choice.get("logprobs"), dict) else {}
    content = logprobs.get("content") if isinstance(logprobs.get("content"), list) else None
    if content and all(isinstance(e, dict) and isinstance(e.get("token"), str) for e in content):
        out: list[Piece] = []
        for entry in content:
            top = entry.get("top_logprobs") if isinstance(entry.get("top_logprobs"), list) else []
            candidates = [Candidate(_token_id(c), clean_text(c["token"])[0][:MAX_TEXT], p, p) for c in top
                          if isinstance(c, dict) and isinstance(c.get("token"), str)
                          and (p := _prob(c.get("logprob"))) is not None]
            candidates.sort(key=lambda c: -c.p_final)
            cut = max(len(candidates) - MAX_CANDIDATES, 0)
            pieces = _split(clean_text(entry["token"])[0])
            first_id, prob = _token_id(entry), _prob(entry.get("logprob"))
            out.append((pieces[0], first_id, prob, candidates[:MAX_CANDIDATES], cut))
            out.extend((piece, None, None, [], 0) for piece in pieces[1:])
        return out
    if isinstance(text, str) and text:
        return [(piece, None, None, [], 0) for piece in _split(clean_text(text)[0])]
    return []


def _native_pieces(chunk: dict) -> list[Piece]:
    """The text of one chunk of Ollama's own stream, as pieces (it sends no probabilities there)."""
    text = ollama.text_of(chunk)
    return [(piece, None, None, [], 0) for piece in _split(clean_text(text)[0])] if text else []


def _split(text: str) -> list[str]:
    """Text in pieces a token's text may be (``MAX_TEXT`` characters); most are one piece."""
    return [text[i:i + MAX_TEXT] for i in range(0, len(text), MAX_TEXT)] or [""]


def _token_id(entry: dict) -> int | None:
    value = entry.get("id")
    return value if type(value) is int and 0 <= value < MAX_VOCAB else None


def _prob(logprob: object) -> float | None:
    if not _number(logprob) or logprob > 0:
        return None
    return min(1.0, math.exp(logprob))


@dataclass(frozen=True)
class ServerPhases:
    """A server's own prefill/decode split of one answer, in one shape whatever the engine called it: llama.cpp's
    ``timings`` (``prompt_n`` in ``prompt_ms``, ``predicted_n`` in ``predicted_ms``, ``cache_n``) or Ollama's
    (``prompt_eval_count`` in ``prompt_eval_duration``, ``eval_count`` in ``eval_duration``, nanoseconds)."""

    engine_words: str                   # whose names these were ("llama.cpp's timings", "Ollama's own figures")
    to_first_token: bool = False        # prompt_ms runs to the first token (LM Studio's), not to the prompt's end
    prompt_tokens: float | None = None
    prompt_ms: float = 0.0
    generated_tokens: float | None = None
    generated_ms: float | None = None
    cached_tokens: float | None = None
    load_ms: float | None = None
    total_ms: float | None = None

    def line(self) -> str:
        """One line, labelled as the server's ("as reported by the server")."""
        def rate(n: float | None, ms: float | None) -> str:
            return f" ({n / (ms / 1000.0):,.2f} tok/s)" if n and ms else ""

        parts = [f"prompt {_whole_words(self.prompt_tokens)} tokens, first token after {self.prompt_ms:,.1f} ms"
                 if self.to_first_token else f"prompt {_whole_words(self.prompt_tokens)} tokens in "
                 f"{self.prompt_ms:,.1f} ms{rate(self.prompt_tokens, self.prompt_ms)}"]
        if self.generated_ms is not None:
            parts.append(f"{_whole_words(self.generated_tokens)} tokens generated in {self.generated_ms:,.1f} ms"
                         f"{rate(self.generated_tokens, self.generated_ms)}")
        if self.cached_tokens is not None:
            parts.append(f"{_whole_words(self.cached_tokens)} prompt tokens from its cache")
        if self.load_ms is not None:
            parts.append(f"model load {self.load_ms:,.1f} ms")
        if self.total_ms is not None:
            parts.append(f"total {self.total_ms:,.1f} ms")
        return ", ".join(parts) + f" ({self.engine_words}, as reported by the server)"


def server_phases(t: dict[str, float]) -> ServerPhases | None:
    """The server's own split from ``RunSummary.server_timings``, or None when it reported none."""
    if "timings.prompt_ms" in t:
        return ServerPhases("llama.cpp's timings", False, t.get("timings.prompt_n"), t["timings.prompt_ms"],
                            t.get("timings.predicted_n"), t.get("timings.predicted_ms"), t.get("timings.cache_n", 0))
    if "ollama.prompt_eval_duration" in t:
        def ms(name: str) -> float | None:
            value = t.get(f"ollama.{name}")
            return value / ollama.NS_PER_MS if value is not None else None

        return ServerPhases("Ollama's own figures", False, t.get("ollama.prompt_eval_count"),
                            ms("prompt_eval_duration"), t.get("ollama.eval_count"), ms("eval_duration"), None,
                            ms("load_duration"), ms("total_duration"))
    if "lmstudio.stats.time_to_first_token" in t:        # seconds
        generation = t.get("lmstudio.stats.generation_time")
        return ServerPhases("LM Studio's stats", True, t.get("usage.prompt_tokens"),
                            t["lmstudio.stats.time_to_first_token"] * 1000.0, t.get("usage.completion_tokens"),
                            generation * 1000.0 if generation is not None else None)
    return None


def _whole_words(value: float | None) -> str:
    return "?" if value is None else f"{value:,.0f}"


def remote_report(s: RunSummary) -> str:
    """Client-side figures (measured here) and the server's own (as reported), never mixed."""
    rate = f"{s.decode_runs / (s.decode_ms / 1000.0):,.2f} tokens per second" if s.decode_ms > 0 else "n/a"
    lines = [f"client: TTFT {s.ttft_ms:,.1f} ms (request sent to first token arriving); {s.generated_tokens} tokens; "
             f"decode {s.decode_ms:,.1f} ms for {s.decode_runs} tokens after the first ({rate}); "
             f"total {s.total_ms:,.1f} ms (measured by this client's clock)"]
    t = s.server_timings
    phases = server_phases(t)
    if phases is not None:
        lines.append("server: " + phases.line())
    elif t:
        lines.append("server: " + ", ".join(f"{k} {v:,}" for k, v in sorted(t.items())) + " (as reported)")
    else:
        lines.append("server: reported no timings")
    lines += [f"note: {note}" for note in s.notes]
    return "\n".join(lines)
