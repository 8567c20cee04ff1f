"""A local HTTP server for tests that plays back recorded answers of real serving engines (a stream, a
/metrics page) and the failures KVScope must survive: 401, a stream cut off mid-way, a malformed line, a
metrics page that is HTML; and servers that misbehave on purpose (a stream that never ends, one that drips a
byte at a time, nesting, endless lines, terminal escapes). It replays bytes; it computes nothing."""

from __future__ import annotations

import itertools
import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

FIXTURES = Path(__file__).parent / "fixtures"


@dataclass
class Route:
    status: int = 200
    body: bytes = b""
    content_type: str = "application/json"
    cut_after: int | None = None          # close the connection after this many bytes of the body
    stream: Callable[[Callable[[bytes], None]], None] | None = None   # writes the body itself, for as long as it likes


@dataclass
class ReplayServer:
    routes: dict[str, Route] = field(default_factory=dict)
    requests: list[tuple[str, str, bytes, dict]] = field(default_factory=list)   # method, path, body, headers

    def __enter__(self) -> ReplayServer:
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *_args) -> None:
                pass

            def _answer(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                owner.requests.append((self.command, self.path, body, dict(self.headers)))
                route = owner.routes.get(f"{self.command} {self.path}")
                if route is None:
                    self.send_response(404)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                self.send_response(route.status)
                self.send_header("Content-Type", route.content_type)
                if route.stream is not None:
                    self.end_headers()

                    def send(data: bytes) -> None:
                        self.wfile.write(data)
                        self.wfile.flush()

                    try:
                        route.stream(send)
                    except (BrokenPipeError, ConnectionResetError, OSError):
                        pass                                   # the client hung up: what a deadline does
                    self.close_connection = True
                    return
                if route.cut_after is None:
                    self.send_header("Content-Length", str(len(route.body)))
                self.end_headers()
                self.wfile.write(route.body if route.cut_after is None else route.body[: route.cut_after])
                self.wfile.flush()
                if route.cut_after is not None:
                    self.close_connection = True

            do_GET = do_POST = _answer

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()
        return self

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def __exit__(self, *_exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def fixture(name: str) -> bytes:
    return (FIXTURES / name).read_bytes()


def llamacpp_routes() -> dict[str, Route]:
    """A recorded llama-server: its model list, props, /metrics, /slots and one streamed chat completion."""
    return {"GET /v1/models": Route(body=fixture("llamacpp_models.json")),
            "GET /props": Route(body=fixture("llamacpp_props.json")),
            "GET /metrics": Route(body=fixture("llamacpp_metrics.txt"), content_type="text/plain"),
            "GET /slots": Route(body=fixture("llamacpp_slots.json")),
            "POST /v1/chat/completions": Route(body=fixture("llamacpp_stream.txt"), content_type="text/event-stream")}


def chunk(text: str) -> bytes:
    """One streamed token, as an OpenAI-compatible server sends it."""
    return b"data: " + json.dumps({"choices": [{"index": 0, "delta": {"content": text}}]}).encode() + b"\n\n"


def endless(send: Callable[[bytes], None]) -> None:
    """A stream that never says it is done."""
    while True:
        send(chunk("more "))


def drip(send: Callable[[bytes], None]) -> None:
    """A stream that sends its first token whole, then one byte every 20 ms, forever: a token now and then, never
    the end. (The first is whole so that however busy the machine, one token arrives before any deadline.)"""
    send(chunk("slow "))
    for byte in itertools.cycle(chunk("slow ")):
        send(bytes([byte]))
        time.sleep(0.02)


def endless_line(send: Callable[[bytes], None]) -> None:
    """One SSE line that never ends."""
    send(b"data: ")
    while True:
        send(b"a" * 65536)


def streaming(*, routes: dict[str, Route] | None = None, stream: Route) -> dict[str, Route]:
    """The recorded llama-server's routes with its chat stream replaced."""
    out = {**llamacpp_routes(), **(routes or {})}
    out["POST /v1/chat/completions"] = stream
    return out
