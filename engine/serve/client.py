"""Talking HTTP to a serving engine, within bounds: addresses (credentials sent as basic authentication, never
shown or stored), one request at a time over ``http.client`` with a timeout for the whole answer, JSON read with
bounded nesting and numbers, and every failure (unreachable, 401, a refused body) one ``RemoteError`` line a user
can act on. ``engine.serve.remote`` streams runs over it; the load test polls ``/metrics``, ``/slots`` and
``/tokenize`` with it."""

from __future__ import annotations

import base64
import contextlib
import http.client
import json
import os
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote, urlsplit

from engine.facts.errors import EngineError
from engine.facts.textstream import clean_text
from engine.serve import metrics

API_KEY_ENV = "KVSCOPE_API_KEY"       # read at request time, never stored
MAX_DIGITS = 40                       # digits of one whole number in a server's JSON
MAX_URL = 2048
MAX_LINE = 1 << 20                    # bytes in one line of an answer (an SSE line included)


class RemoteError(EngineError):
    """The server could not be used; one line a user can act on."""


class Unreachable(RemoteError):
    """Nothing answered: the connection was refused, the host unknown, or no connection was made in time."""


class TooSlow(RemoteError):
    """The server took a connection but did not answer (its headers, or its whole answer) within the deadline."""


class StreamDropped(RemoteError):
    """The stream ended before the server said it was done."""


# --- addresses and requests -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Address:
    """Where a server is (``url``: never with credentials) and the credentials the user typed in it, if any."""

    url: str
    user: str = ""
    password: str = ""

    def __repr__(self) -> str:                      # a log line or a traceback never shows the password
        return f"Address({self.url!r}{', with credentials' if self.user else ''})"


def address(text: str) -> Address:
    """``http(s)://[user:pw@]host[:port]`` with any trailing ``/`` or ``/v1`` removed; anything else is refused.
    The credentials are split off the address."""
    text = (text or "").strip()
    if len(text) > MAX_URL:
        raise RemoteError(f"The server address is {len(text):,} characters long: at most {MAX_URL:,} are allowed")
    parts = urlsplit(text)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise RemoteError(f"{without_credentials(text)!r} is not a server address: use http://host:port (e.g. "
                          "http://127.0.0.1:8080)")
    try:
        port = parts.port
    except ValueError:
        raise RemoteError(f"{without_credentials(text)!r} has a port that is not a number from 1 to 65535") from None
    path = parts.path.rstrip("/")
    if path.endswith("/v1"):
        path = path[:-3]
    host = parts.hostname if ":" not in parts.hostname else f"[{parts.hostname}]"
    netloc = host + (f":{port}" if port is not None else "")
    return Address(f"{parts.scheme}://{netloc}{path}", unquote(parts.username or ""), unquote(parts.password or ""))


def server_url(text: str) -> str:
    """The server's address as KVScope shows and keeps it: normalised, without credentials."""
    return address(text).url


def without_credentials(text: str) -> str:
    """``text`` with any ``user:password@`` removed (for settings, history and messages)."""
    parts = urlsplit((text or "").strip())
    if parts.username is None and parts.password is None:
        return (text or "").strip()
    netloc = parts.netloc.rsplit("@", 1)[-1]
    return parts._replace(netloc=netloc).geturl()


def is_server(spec: str) -> bool:
    return spec.strip().lower().startswith(("http://", "https://"))


def _headers(where: Address, extra: dict | None = None, api_key: bool = True) -> dict:
    """The request's headers: the address's own user and password, else the serving API key (``api_key``: never
    to a peer that is not the model server, such as a trace collector)."""
    headers = {"Accept": "application/json", "User-Agent": "KVScope"}
    if where.user or where.password:
        token = base64.b64encode(f"{where.user}:{where.password}".encode()).decode("ascii")
        headers["Authorization"] = f"Basic {token}"
    elif api_key:
        key = os.environ.get(API_KEY_ENV, "").strip()
        if key:
            if any(ord(c) < 32 or ord(c) == 127 for c in key):
                raise RemoteError(f"{API_KEY_ENV} holds a line break or another control character: set it to the "
                                  "key alone")
            headers["Authorization"] = f"Bearer {key}"
    return {**headers, **(extra or {})}


def _connect(url: str, timeout: float) -> tuple[http.client.HTTPConnection, str]:
    parts = urlsplit(url)
    cls = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    return cls(parts.hostname, parts.port, timeout=timeout), parts.path


@dataclass
class Exchange:
    """One request's connection, its answer, and the socket under both: a server that closes after its answer
    (HTTP/1.0) hands the socket to the answer and the connection forgets it, so whoever must cut the answer
    short (Stop, a deadline) holds the socket itself."""

    connection: http.client.HTTPConnection
    response: http.client.HTTPResponse
    sock: socket.socket | None

    def close(self) -> None:
        self.response.close()
        self.connection.close()


def request(where: Address, method: str, path: str, body: dict | None = None, timeout: float = 10.0,
            data: bytes | None = None, content_type: str = "application/json", api_key: bool = True) -> Exchange:
    """Send one request (a JSON ``body``, or ``data`` as it is); raise ``RemoteError`` (one line) for anything but
    a 2xx answer."""
    url = where.url
    connection, base = _connect(url, timeout)
    payload = json.dumps(body).encode() if body is not None else data
    headers = _headers(where, {"Content-Type": content_type} if payload is not None else None, api_key)
    heads = _HeadsDeadline(timeout)
    try:
        connection.connect()
    except (OSError, http.client.HTTPException, ValueError) as exc:      # refused, no such host, no answer to SYN
        connection.close()
        raise Unreachable(f"Cannot reach the server at {url}: {reason_of(exc)}") from None
    try:
        connection.request(method, base + path, body=payload, headers=headers)
        sock = connection.sock
        with heads.watching(sock):
            response = connection.getresponse()
        if heads.passed:        # the socket was shut mid-headers: http.client took the cut as their end
            raise TimeoutError("the headers' deadline passed")
    except (ConnectionRefusedError, socket.gaierror, socket.timeout, TimeoutError, OSError,
            http.client.HTTPException, ValueError) as exc:
        connection.close()
        # It took the connection: a wait past the deadline is the server's slowness, whichever clock saw it first
        # (the socket's own timeout and the headers' deadline end together, and a busy machine picks either).
        if heads.passed or isinstance(exc, (socket.timeout, TimeoutError)):
            raise TooSlow(f"The server at {url} took more than {timeout:g} s to send its answer's status line "
                              "and headers") from None
        raise Unreachable(f"Cannot reach the server at {url}: {reason_of(exc)}") from None
    if response.status >= 300:
        detail = _error_detail(response)
        connection.close()
        if response.status in (401, 403):
            how = "check the user and password in the address" if where.user else \
                f"set the API key in the {API_KEY_ENV} environment variable"
            raise RemoteError(f"The server at {url} refused the request ({response.status}): {how}{detail}")
        if response.status == 404:
            raise RemoteError(f"The server at {url} has no {path} ({response.status}): is it an OpenAI-compatible "
                              f"server?{detail}")
        raise RemoteError(f"The server at {url} answered {response.status} {short(response.reason)}{detail}")
    return Exchange(connection, response, sock)


class _HeadsDeadline:
    """A deadline for an answer's status line and headers as a whole: the socket's timeout is per read, so a
    server sending them a byte at a time was waited on for ever (``--deadline`` included, which starts once the
    headers are in). When it passes, the socket is shut and the wait ends."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.passed = False

    @contextlib.contextmanager
    def watching(self, sock: socket.socket | None) -> Iterator[None]:
        def shut() -> None:
            self.passed = True
            with contextlib.suppress(OSError):
                if sock is not None:
                    sock.shutdown(socket.SHUT_RDWR)

        timer = threading.Timer(self.seconds, shut)
        timer.daemon = True
        timer.start()
        try:
            yield
        finally:
            timer.cancel()


def reason_of(exc: BaseException) -> str:
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused (is it running, on this port?)"
    if isinstance(exc, socket.gaierror):
        return "no such host"
    if isinstance(exc, (socket.timeout, TimeoutError)):
        return "no answer in time"
    return short(exc) or type(exc).__name__


def short(value: object, limit: int = 200) -> str:
    text = str(value).strip()
    return text.splitlines()[0][:limit] if text else ""


def _error_detail(response: http.client.HTTPResponse) -> str:
    try:
        data = loads(response.read(4096).decode("utf-8", "replace"))
        message = data.get("error", data) if isinstance(data, dict) else data
        if isinstance(message, dict):
            message = message.get("message", "")
        text = short(message)
    except (ValueError, OSError, http.client.HTTPException, RemoteError):
        text = ""
    return f": {text}" if text else ""


def loads(text: str) -> Any:
    """A server's JSON, bounded: numbers of at most ``MAX_DIGITS`` digits, nesting the decoder can follow."""
    try:
        return _DECODER.decode(text)
    except RecursionError:
        raise RemoteError("the server sent JSON nested too deeply to be an answer") from None


def _bounded_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_DIGITS:
        raise ValueError(f"a whole number of {len(text):,} digits")
    return int(text)


_DECODER = json.JSONDecoder(parse_int=_bounded_int)


def get_text(where: Address | str, path: str, timeout: float = 5.0, limit: int = metrics.MAX_PAGE + 1) -> str:
    """A GET's body as text, at most ``limit`` bytes (a page larger than that is not what was asked for)."""
    where = where if isinstance(where, Address) else address(where)
    return _body(request(where, "GET", path, timeout=timeout), where, path, timeout, limit).decode("utf-8",
                                                                                                 "replace")


def _body(exchange: Exchange, where: Address, path: str, timeout: float, limit: int) -> bytes:
    """An answer's body, at most ``limit`` bytes, within ``timeout`` for the whole of it: a server may drip it a
    byte at a time, and each read's own timeout would then never fire."""
    deadline = time.monotonic() + timeout
    pieces: list[bytes] = []
    size = 0
    try:
        while size < limit:
            if time.monotonic() > deadline:
                raise TooSlow(f"The server at {where.url} took more than {timeout:g} s to answer {path}")
            piece = exchange.response.read1(min(1 << 16, limit - size))
            if not piece:
                break
            pieces.append(piece)
            size += len(piece)
    except (OSError, http.client.HTTPException) as exc:
        raise RemoteError(f"The server at {where.url} broke off its answer to {path}: {reason_of(exc)}") from None
    finally:
        exchange.close()
    return b"".join(pieces)


def get_json(where: Address, path: str, timeout: float = 5.0) -> Any:
    try:
        return loads(get_text(where, path, timeout, MAX_LINE))
    except ValueError:
        raise RemoteError(f"The server at {where.url} answered {path} with something that is not JSON") from None


def post_bytes(where: Address, path: str, data: bytes, content_type: str, timeout: float = 5.0,
               limit: int = 1 << 16, api_key: bool = True) -> bytes:
    """A POST of ``data``; its answer's body, bounded in size and time like every other answer."""
    exchange = request(where, "POST", path, timeout=timeout, data=data, content_type=content_type, api_key=api_key)
    return _body(exchange, where, path, timeout, limit)


def post_json(where: Address, path: str, body: dict, timeout: float = 5.0) -> Any:
    """A POST's JSON answer, bounded in size and time like every other answer."""
    data = _body(request(where, "POST", path, body, timeout=timeout), where, path, timeout, MAX_LINE)
    try:
        return loads(data.decode("utf-8", "replace"))
    except ValueError:
        raise RemoteError(f"The server at {where.url} answered {path} with something that is not JSON") from None


def tokenize(where: Address, model: str, messages: list[dict], timeout: float = 5.0) -> list[int] | None:
    """The prompt ids the server makes of ``messages`` with its own chat template (vLLM's ``/tokenize``), or None
    where the server has no such endpoint or answers with something else."""
    try:
        data = post_json(where, "/tokenize", {"model": model, "messages": messages, "add_generation_prompt": True},
                         timeout)
    except RemoteError:
        return None
    tokens = data.get("tokens") if isinstance(data, dict) else None
    if isinstance(tokens, list) and len(tokens) <= MAX_LINE and all(isinstance(t, int) and t >= 0 for t in tokens):
        return tokens
    return None


def detokenize(where: Address, model: str, tokens: list[int], timeout: float = 5.0) -> str:
    """The text the server makes of ``tokens`` (vLLM's ``/detokenize``), or "" where it cannot say."""
    try:
        data = post_json(where, "/detokenize", {"model": model, "tokens": tokens}, timeout)
    except RemoteError:
        return ""
    text = data.get("prompt") if isinstance(data, dict) else None
    return clean_text(text)[0][:4096] if isinstance(text, str) else ""



_CREDENTIALS: dict[str, Address] = {}          # url -> the address with credentials, this process only


def remember_credentials(where: Address) -> None:
    """Keep the credentials of a server the user named, in memory only, so later requests to the same address
    (a load test, the next run) authenticate too."""
    if where.user or where.password:
        _CREDENTIALS[where.url] = where


def address_of(url: str) -> Address:
    return _CREDENTIALS.get(url) or Address(url)


def stream_line(response: Any) -> str | None:
    """The next line of a streamed answer (server-sent events, newline-delimited JSON), at most ``MAX_LINE`` bytes;
    None at the end, and for a last line the connection cut before its newline (incomplete: dropped)."""
    try:
        line = response.readline(MAX_LINE + 1)
    except OverflowError:           # http.client took a chunk size past 2^63 as given, and could not hold it
        raise RemoteError("the server sent a chunk of the stream larger than any answer (its chunk size "
                          "needs more than 63 bits): not a token stream") from None
    if len(line) > MAX_LINE:
        raise RemoteError(f"the server sent a stream line longer than {MAX_LINE:,} bytes: not a token stream")
    if not line or not line.endswith(b"\n"):
        return None
    return line.decode("utf-8", "replace")
