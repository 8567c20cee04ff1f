"""A serving engine watched from outside: llama.cpp's ``llama-server``, vLLM, TGI or SGLang, through the
OpenAI-compatible streaming API and the Prometheus ``/metrics`` page.

A run streams ``/v1/chat/completions`` (or ``/v1/completions`` for raw text) with ``stream: true`` and emits the
events a local run emits, timed by this client's clock: ``RunStarted`` (the model is ``ServerFacts``), one
``TokenStep`` per token as it arrives, ``RunFinished`` or ``RunFailed``. What only the engine knows is absent, not
zero: token ids, positions, forward times, per-layer KV; the probabilities come from ``logprobs`` when the server
sends them, and the server's own figures (llama-server's ``timings``, ``usage``) go into
``RunSummary.server_timings`` under the names the server used.

Only the standard library talks HTTP (``http.client``): a run is one request and a load test a few dozen, and the
errors (unreachable, 401, a dropped stream, a malformed line) each become one line a user can act on.
"""

from __future__ import annotations

import http.client
import json
import math
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import datetime, timezone
from typing import Any
from urllib.parse import urlsplit

from engine import metrics
from engine.errors import EngineError, PromptError
from engine.events import (
    Candidate,
    RunFailed,
    RunFinished,
    RunStarted,
    RunSummary,
    ServerFacts,
    TokenStep,
)
from engine.params import GenerationParams
from engine.textstream import clean_text

API_KEY_ENV = "KVSCOPE_API_KEY"       # read at request time, never stored
TOP_LOGPROBS = 5
MAX_LINE = 1 << 20                    # bytes in one SSE line
MAX_TOKEN_ID = 1 << 24
Sink = Callable[[object], None]


class RemoteError(EngineError):
    """The server could not be used; one line a user can act on."""


class StreamDropped(RemoteError):
    """The stream ended before the server said it was done."""


# --- addresses and requests -------------------------------------------------------------------------------
def server_url(text: str) -> str:
    """``http(s)://host[:port]`` with any trailing ``/`` or ``/v1`` removed; anything else is refused."""
    text = (text or "").strip()
    parts = urlsplit(text)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise RemoteError(f"{text!r} is not a server address: use http://host:port (e.g. http://127.0.0.1:8080)")
    try:
        parts.port
    except ValueError:
        raise RemoteError(f"{text!r} has a port that is not a number from 1 to 65535") from None
    path = parts.path.rstrip("/")
    if path.endswith("/v1"):
        path = path[:-3]
    return f"{parts.scheme}://{parts.netloc}{path}"


def is_server(spec: str) -> bool:
    return spec.strip().lower().startswith(("http://", "https://"))


def _headers(extra: dict | None = None) -> dict:
    headers = {"Accept": "application/json", "User-Agent": "KVScope"}
    key = os.environ.get(API_KEY_ENV, "").strip()
    if key:
        headers["Authorization"] = f"Bearer {key}"
    return {**headers, **(extra or {})}


def _connect(url: str, timeout: float) -> tuple[http.client.HTTPConnection, str]:
    parts = urlsplit(url)
    cls = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    return cls(parts.hostname, parts.port, timeout=timeout), parts.path


def request(url: str, method: str, path: str, body: dict | None = None, timeout: float = 10.0
            ) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    """Send one request; raise ``RemoteError`` (one line) for anything but a 2xx answer."""
    connection, base = _connect(url, timeout)
    payload = json.dumps(body).encode() if body is not None else None
    headers = _headers({"Content-Type": "application/json"} if payload is not None else None)
    try:
        connection.request(method, base + path, body=payload, headers=headers)
        response = connection.getresponse()
    except (ConnectionRefusedError, socket.gaierror, socket.timeout, TimeoutError, OSError,
            http.client.HTTPException) as exc:
        connection.close()
        raise RemoteError(f"Cannot reach the server at {url}: {_reason(exc)}") from None
    if response.status >= 300:
        detail = _error_detail(response)
        connection.close()
        if response.status in (401, 403):
            raise RemoteError(f"The server at {url} refused the request ({response.status}): set the API key in "
                              f"the {API_KEY_ENV} environment variable{detail}")
        if response.status == 404:
            raise RemoteError(f"The server at {url} has no {path} ({response.status}): is it an OpenAI-compatible "
                              f"server?{detail}")
        raise RemoteError(f"The server at {url} answered {response.status} {response.reason}{detail}")
    return connection, response


def _reason(exc: BaseException) -> str:
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused (is it running, on this port?)"
    if isinstance(exc, socket.gaierror):
        return "no such host"
    if isinstance(exc, (socket.timeout, TimeoutError)):
        return "no answer in time"
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__


def _error_detail(response: http.client.HTTPResponse) -> str:
    try:
        raw = response.read(4096).decode("utf-8", "replace")
        data = json.loads(raw)
        message = data.get("error", data) if isinstance(data, dict) else data
        if isinstance(message, dict):
            message = message.get("message", "")
        text = str(message).strip().splitlines()[0][:200] if str(message).strip() else ""
    except (ValueError, OSError, http.client.HTTPException):
        text = ""
    return f": {text}" if text else ""


def get_text(url: str, path: str, timeout: float = 5.0, limit: int = metrics.MAX_PAGE + 1) -> str:
    """A GET's body as text, at most ``limit`` bytes (a page larger than that is not what was asked for)."""
    connection, response = request(url, "GET", path, timeout=timeout)
    try:
        return response.read(limit).decode("utf-8", "replace")
    finally:
        connection.close()


def get_json(url: str, path: str, timeout: float = 5.0) -> Any:
    try:
        return json.loads(get_text(url, path, timeout, MAX_LINE))
    except ValueError:
        raise RemoteError(f"The server at {url} answered {path} with something that is not JSON") from None


# --- what the server reveals ------------------------------------------------------------------------------
def probe(url: str, timeout: float = 5.0) -> ServerFacts:
    """The model the server serves, which engine it is, its context if it says, and whether it has
    ``/metrics``. Unreachable or not OpenAI-compatible: ``RemoteError``."""
    url = server_url(url)
    models = get_json(url, "/v1/models", timeout)
    entries = models.get("data") if isinstance(models, dict) else None
    if not isinstance(entries, list) or not entries or not isinstance(entries[0], dict):
        raise RemoteError(f"The server at {url} lists no model at /v1/models: is it an OpenAI-compatible server?")
    first = entries[0]
    name = str(first.get("id", "model"))[:200]
    owner = str(first.get("owned_by", "")).lower()
    meta = first.get("meta") if isinstance(first.get("meta"), dict) else {}
    context = _int_or_none(first.get("max_model_len")) or _int_or_none(meta.get("n_ctx"))
    engine = {"llamacpp": "llama.cpp", "vllm": "vLLM", "sglang": "SGLang"}.get(owner, "")
    reveals = ["a token stream timed by this client"]
    try:
        props = get_json(url, "/props", timeout)
        settings = props.get("default_generation_settings", {}) if isinstance(props, dict) else {}
        context = context or _int_or_none(props.get("n_ctx")) or _int_or_none(settings.get("n_ctx"))
        engine = engine or ("llama.cpp" if "build_info" in props or settings else "")
    except RemoteError:
        pass
    has_metrics = False
    try:
        reading = metrics.read(get_text(url, "/metrics", timeout))
        engine, has_metrics = engine or reading.engine, True
        reveals.append(f"/metrics: {', '.join(sorted(reading.values)) or 'no quantity KVScope reads'}")
    except (RemoteError, metrics.MetricsError):
        pass
    if engine == "llama.cpp":
        reveals.append("its own prompt and decode timings per response (timings: prompt_ms, predicted_ms, cache_n)")
    return ServerFacts(name=name, url=url, engine=engine or "OpenAI-compatible server", context=context,
                       metrics=has_metrics, reveals=reveals)


def _int_or_none(value: object) -> int | None:
    return value if type(value) is int and value > 0 else None


# --- streaming ----------------------------------------------------------------------------------------------
def sse_payloads(response: Any) -> Iterator[str]:
    """The ``data:`` payloads of a server-sent event stream, joined per event; ``[DONE]`` ends it. An event the
    connection cut off before its closing blank line is incomplete and dropped (the caller sees the stream end
    without a finish and says the stream was dropped)."""
    data: list[str] = []
    while True:
        line = response.readline(MAX_LINE + 1)
        if not line or not line.endswith(b"\n"):
            return
        if len(line) > MAX_LINE:
            raise RemoteError(f"the server sent a stream line longer than {MAX_LINE:,} bytes")
        text = line.decode("utf-8", "replace").rstrip("\r\n")
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
            data.append(text[5:].lstrip(" "))
        elif text.startswith(("event:", "id:", "retry:")):
            continue
        else:
            raise RemoteError(f"the server sent a line that is not server-sent events: {text[:80]!r}")


class RemoteSession:
    """Runs and chat turns through a server, with the interface of ``engine.session.Session`` that the worker
    and the CLI use (``run``, ``chat``, ``facts``)."""

    def __init__(self, facts: ServerFacts, timeout: float = 60.0) -> None:
        self.facts = facts
        self.url = facts.url
        self.timeout = timeout
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
        if params.chat_template:
            return self._stream([{"role": "user", "content": prompt}], prompt, "generate", params, sink, cancel,
                                before_step)
        return self._stream(None, prompt, "generate", params, sink, cancel, before_step)

    def chat(self, messages: list[dict], params: GenerationParams, sink: Sink | None = None,
             cancel: threading.Event | None = None, before_step: Callable[[int], None] | None = None,
             reuse: bool = True) -> RunFinished | RunFailed:
        messages = [{"role": m.get("role", "user"), "content": clean_text(str(m.get("content", "")))[0]}
                    for m in messages]
        if not messages or not messages[-1]["content"].strip():
            raise PromptError("The message is empty: type something for the model to read")
        return self._stream(messages, messages[-1]["content"], "chat", params, sink, cancel, before_step,
                            cache_prompt=reuse)

    # --- one streamed request ---
    def _body(self, messages: list[dict] | None, prompt: str, params: GenerationParams, cache_prompt: bool) -> dict:
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

    def _stream(self, messages: list[dict] | None, prompt: str, kind: str, params: GenerationParams,
                sink: Sink | None, cancel: threading.Event | None, before_step: Callable[[int], None] | None,
                cache_prompt: bool = True) -> RunFinished | RunFailed:
        emit = sink or (lambda _e: None)
        run_id = uuid.uuid4().hex[:12]
        t0 = time.perf_counter()

        def since() -> float:
            return (time.perf_counter() - t0) * 1000.0

        emit(RunStarted(run_id=run_id, label=params.describe() + f" · {self.facts.engine}", model=self.facts,
                        params=params, prompt=prompt, prompt_ids=[], prompt_pieces=[],
                        started_at=datetime.now(timezone.utc).isoformat(timespec="seconds"), t_ms=0.0, kind=kind))
        path = "/v1/chat/completions" if messages is not None else "/v1/completions"
        tally = _Tally()
        try:
            connection, response = request(self.url, "POST", path, self._body(messages, prompt, params, cache_prompt),
                                           timeout=self.timeout)
        except RemoteError as exc:
            failed = RunFailed(run_id, since(), "unreachable", str(exc), tally.summary(since()))
            emit(failed)
            return failed
        reason = None
        try:
            last = since()
            for payload in sse_payloads(response):
                if cancel is not None and cancel.is_set():
                    reason = "stopped"
                    break
                try:
                    chunk = json.loads(payload)
                except ValueError:
                    raise RemoteError(f"the server sent a stream event that is not JSON: {payload[:80]!r}") from None
                if not isinstance(chunk, dict):
                    raise RemoteError(f"the server sent a stream event that is not an object: {payload[:80]!r}")
                if "error" in chunk:
                    message = chunk["error"].get("message", chunk["error"]) if isinstance(chunk["error"], dict) \
                        else chunk["error"]
                    raise RemoteError(f"the server reported an error mid-stream: {str(message)[:200]}")
                tally.absorb(chunk)
                for text, token_id, prob, candidates in _pieces(chunk):
                    now = since()
                    step = len(tally.texts)
                    if step == 0:
                        tally.ttft_ms = now
                    else:
                        tally.decode_ms += now - last
                    tally.texts.append(text)
                    emit(TokenStep(run_id=run_id, t_ms=now, step=step, position=None, token_id=token_id, text=text,
                                   special=False, phase="prefill" if step == 0 else "decode", latency_ms=now - last,
                                   forward_ms=None, prob=prob, raw_prob=None, candidates=candidates,
                                   kv_bytes_per_layer=[], kv_positions_per_layer=[]))
                    last = now
                    if before_step is not None:
                        before_step(step + 1)
                finish = _finish_reason(chunk)
                if finish is not None:
                    reason = finish
            if reason is None:
                raise StreamDropped("the server closed the stream before saying it was done "
                                    f"({len(tally.texts)} tokens arrived; they are kept)")
        except RemoteError as exc:
            failed = RunFailed(run_id, since(), "dropped" if isinstance(exc, StreamDropped) else "stream",
                               str(exc), tally.summary(since()))
            emit(failed)
            return failed
        except (OSError, http.client.HTTPException) as exc:
            failed = RunFailed(run_id, since(), "dropped", f"the connection broke mid-stream: {_reason(exc)} "
                               f"({len(tally.texts)} tokens arrived; they are kept)", tally.summary(since()))
            emit(failed)
            return failed
        finally:
            connection.close()
        finished = RunFinished(run_id, since(), reason, tally.summary(since()))
        emit(finished)
        return finished


class _Tally:
    """What a streamed run measured (client clock) and what the server reported."""

    def __init__(self) -> None:
        self.texts: list[str] = []
        self.ttft_ms = 0.0
        self.decode_ms = 0.0
        self.usage: dict = {}
        self.timings: dict = {}

    def absorb(self, chunk: dict) -> None:
        if isinstance(chunk.get("usage"), dict):
            self.usage = chunk["usage"]
        if isinstance(chunk.get("timings"), dict):
            self.timings = chunk["timings"]

    def summary(self, total_ms: float) -> RunSummary:
        reported = {f"timings.{k}": v for k, v in self.timings.items() if _number(v)}
        reported.update({f"usage.{k}": v for k, v in self.usage.items() if _number(v)})
        details = self.usage.get("prompt_tokens_details")
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        if _number(cached):
            reported["usage.prompt_tokens_details.cached_tokens"] = cached
        prompt = self.timings.get("prompt_n", self.usage.get("prompt_tokens"))
        reused = self.timings.get("cache_n", cached)
        generated = len(self.texts)
        return RunSummary(
            prompt_tokens=int(prompt) if _number(prompt) else None, generated_tokens=generated,
            decode_runs=max(generated - 1, 0), tokenize_ms=None, prefill_ms=None, ttft_ms=self.ttft_ms,
            decode_ms=self.decode_ms, total_ms=total_ms, kv_tokens=None, kv_bytes=None, text="".join(self.texts),
            token_ids=[], reused_tokens=int(reused) if _number(reused) else None, server_timings=reported)


def _number(value: object) -> bool:
    return (type(value) is int or type(value) is float) and math.isfinite(value)


def _finish_reason(chunk: dict) -> str | None:
    choices = chunk.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        return None
    reason = choices[0].get("finish_reason")
    return {"stop": "eos", "length": "max_tokens"}.get(reason, "eos") if reason else None


def _pieces(chunk: dict) -> list[tuple[str, int | None, float | None, list[Candidate]]]:
    """The tokens in one chunk: from ``logprobs.content`` when the server sent them (one entry per token, with
    probabilities, and the token id where the server adds one, as llama-server does), else the chunk's text as
    one piece."""
    choices = chunk.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        return []
    choice = choices[0]
    delta = choice.get("delta") if isinstance(choice.get("delta"), dict) else {}
    text = delta.get("content") if "delta" in choice else choice.get("text")
    logprobs = choice.get("logprobs") if isinstance(choice.get("logprobs"), dict) else {}
    content = logprobs.get("content") if isinstance(logprobs.get("content"), list) else None
    if content and all(isinstance(e, dict) and isinstance(e.get("token"), str) for e in content):
        out = []
        for entry in content:
            prob = _prob(entry.get("logprob"))
            top = entry.get("top_logprobs") if isinstance(entry.get("top_logprobs"), list) else []
            candidates = [Candidate(_token_id(c), str(c["token"])[:1024], p, p) for c in top if isinstance(c, dict)
                          and isinstance(c.get("token"), str) and (p := _prob(c.get("logprob"))) is not None]
            out.append((clean_text(entry["token"])[0], _token_id(entry), prob, candidates))
        return out
    if isinstance(text, str) and text:
        return [(clean_text(text)[0], None, None, [])]
    return []


def _token_id(entry: dict) -> int | None:
    value = entry.get("id")
    return value if type(value) is int and 0 <= value < MAX_TOKEN_ID else None


def _prob(logprob: object) -> float | None:
    if not _number(logprob) or logprob > 0:
        return None
    return min(1.0, math.exp(logprob))
