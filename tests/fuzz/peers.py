"""Peers that misbehave, on 127.0.0.1: a server whose every answer is the fuzzed bytes (whole, or as the body of
a well-formed answer), and servers that drip each part of an answer or never answer at all."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

OK_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: %s\r\nContent-Length: %d\r\nConnection: close\r\n\r\n"


@dataclass
class Answer:
    """What the peer sends to each connection: ``parts`` in order, each after ``pause_s``, a byte at a time when
    ``drip``; nothing at all (the connection held open) when ``silent``."""

    parts: tuple[bytes, ...] = ()
    drip: tuple[bool, ...] = ()
    pause_s: float = 0.0
    silent: bool = False


def body(data: bytes, content_type: bytes = b"application/json") -> Answer:
    return Answer((OK_HEAD % (content_type, len(data)) + data,))


def raw(data: bytes) -> Answer:
    return Answer((data,))


class Peer:
    """A TCP server in a thread of this process, answering every connection with ``answer`` (changed between
    inputs). Connections are served one thread each so a silent one blocks nobody."""

    def __init__(self) -> None:
        self.answer = Answer()
        self.listener = socket.socket()
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(64)
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.stopping = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.stopping.is_set():
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn, self.answer), daemon=True).start()

    def _serve(self, conn: socket.socket, answer: Answer) -> None:
        try:
            conn.settimeout(30)
            _read_request(conn)
            if answer.silent:
                self.stopping.wait(30)
                return
            for i, part in enumerate(answer.parts):
                if answer.drip and answer.drip[i]:
                    for k in range(len(part)):
                        conn.sendall(part[k:k + 1])
                        time.sleep(answer.pause_s)
                else:
                    conn.sendall(part)
        except OSError:
            pass
        finally:
            conn.close()


def _read_request(conn: socket.socket) -> None:
    """The request's head and its body (by Content-Length), so the client is never cut off while sending."""
    data = b""
    while b"\r\n\r\n" not in data:
        piece = conn.recv(65536)
        if not piece:
            return
        data += piece
    head, _, rest = data.partition(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":", 1)[1])
    while len(rest) < length:
        piece = conn.recv(65536)
        if not piece:
            return
        rest += piece


def timed(call: Callable[[], object], most_s: float) -> object:
    """``call()``, which must end within ``most_s`` seconds whatever the peer does (a hang is the fault)."""
    started = time.monotonic()
    try:
        return call()
    finally:
        took = time.monotonic() - started
        if took > most_s:
            raise TimeoutError(f"the call took {took:.1f} s against a deadline of {most_s:g} s")
