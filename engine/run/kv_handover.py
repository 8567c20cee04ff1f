"""Prefill and decode served apart on one machine: a prefill worker in a process of its own hands each request's
KV cache (the cache's own tensors, their bytes) over a Unix socket to the decode worker, which continues from it;
beside it, one worker doing both, where a long prefill holds back every running request's next token.

Both serve the same arrival schedule on the wall clock. A scheduler iteration is either a prefill (a request
that has arrived, one pass) or one batched decode step of every running request (``engine.run.scheduler``'s batch:
each row's tokens are its solo run's), prefill first, as a colocated engine without chunked prefill does. Times
on both sides come from ``time.perf_counter`` (CLOCK_MONOTONIC on Linux: one clock for every process), so a
hand-over is timed from the end of its prefill in one process to its tensors ready in the other.

Faults for tests (``KVSCOPE_FAULTS``, the phase ``engine.run.prefill_worker.HANDOVER``): ``handover:N:exit`` ends
the prefill worker half-way through request N's bytes; ``handover:N:sleep=S`` makes it silent for S seconds before
sending it; ``handover:N:oom`` finds no free memory for request N's hand-over.
"""

from __future__ import annotations

import json
import os
import queue
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from multiprocessing import BufferTooShort
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch

from engine.model import kvcache
from engine.run.model_session import ModelSession
from engine.run.prefill_worker import HANDOVER, command
from engine.run.scheduler import BatchedDecoder, ScheduledRequest

READY_TIMEOUT_S = 180.0           # loading the model in the worker (torch's import and the weights)
POLL_S = 0.02
GRACE_S = 0.3                # a stopped worker's time to end on its own before it is terminated
MAX_MESSAGE = 1 << 22             # bytes of one message between the two processes (a 4k-token prompt's ids)
DTYPES = ("float32", "bfloat16", "float16", "float8_e4m3fn", "int8", "uint8")
SHAPES = {"ready": (int,), "failed": (str,), "stop": (), "prefill": (int, list, float),
          "prefilled": (int, int, float, float, list, int)}


class BadMessage(ValueError):
    """What arrived on the socket between KVScope's two processes is not one of their messages."""


def say(channel: Connection, *message: object) -> None:
    """One message to the other process, as JSON: data that cannot run code. (A pickle runs whatever the other end,
    or anything else that reached the socket, put in it.)"""
    channel.send_bytes(json.dumps(message).encode())


def heard(channel: Connection) -> tuple:
    """The next message, checked against the few KVScope's two processes send (``SHAPES``); anything else raises
    ``BadMessage`` with one line."""
    try:
        message = json.loads(channel.recv_bytes(MAX_MESSAGE))
    except (ValueError, UnicodeDecodeError):
        raise BadMessage("something that is not one of its messages arrived on its socket") from None
    except OSError as exc:
        if "bad message length" in str(exc):
            raise BadMessage(f"a message of more than {MAX_MESSAGE:,} bytes arrived on its socket") from None
        raise
    word = message[0] if isinstance(message, list) and message and isinstance(message[0], str) else None
    shape = SHAPES.get(word)
    if shape is None or len(message) != len(shape) + 1 or not all(
            isinstance(v, t) or (t is float and isinstance(v, int)) for v, t in zip(message[1:], shape)):
        raise BadMessage(f"a message it does not know arrived on its socket ({str(message)[:60]})")
    if word == "prefill" and not all(isinstance(i, int) and 0 <= i < 1 << 24 for i in message[2]):
        raise BadMessage("a prompt that is not token ids arrived on its socket")
    if word == "prefilled" and not all(_layer(entry) for entry in message[5]):
        raise BadMessage("a hand-over whose tensors are not described arrived on its socket")
    return tuple(message)


def _layer(entry: object) -> bool:
    return (isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], list) and len(entry[0]) <= 8
            and all(isinstance(n, int) and 0 <= n < 1 << 31 for n in entry[0]) and entry[1] in DTYPES)


@dataclass
class ArrivingRequest:
    index: int
    ids: list[int]
    arrival_ms: float                    # after the schedule's start
    new_tokens: int


@dataclass
class Served:
    """One request as served: its tokens with their times (ms since the schedule's start), and its hand-over."""

    index: int
    prompt_tokens: int
    arrival_ms: float
    prefill_start_ms: float = 0.0
    prefill_end_ms: float = 0.0
    tokens: list[int] = field(default_factory=list)
    token_ms: list[float] = field(default_factory=list)
    handover_ready_ms: float | None = None          # disaggregated: the tensors ready in the decode worker
    handover_bytes: int = 0
    transfer_ms: float | None = None                # of the hand-over, the bytes read and made tensors

    @property
    def ttft_ms(self) -> float:
        return self.token_ms[0] - self.arrival_ms if self.token_ms else float("nan")

    @property
    def gaps_ms(self) -> list[float]:
        return [b - a for a, b in zip(self.token_ms, self.token_ms[1:])]


@dataclass
class Outcome:
    served: list[Served]
    complete: bool
    failure: str = ""                    # one line: why it ended early (a worker died, fell silent, ...)
    idle_ms: float = 0.0                 # waiting on purpose for the next arrival


def _ms(t0: float) -> float:
    return (time.perf_counter() - t0) * 1000.0


def _decode_step(batch: BatchedDecoder, served: dict[int, Served], t0: float) -> None:
    """One batched decode step for every running request, their token times, the finished ones released."""
    batch.step()
    t = _ms(t0)
    for row in batch.rows:
        served[row.index].token_ms.append(t)
    batch.release_finished()


def _batch_request(request: ArrivingRequest, served: Served) -> Any:
    """The scheduler's request for ``request``, sharing ``served``'s token list (one list, both see it)."""
    row = ScheduledRequest(request.index, request.ids, request.new_tokens, 0)
    row.tokens = served.tokens
    return row


def colocated(session: ModelSession, requests: Sequence[ArrivingRequest], cancel: threading.Event) -> Outcome:
    """One worker, both phases: prefill every request that has arrived, else one batched decode step."""
    pending = sorted(requests, key=lambda r: r.arrival_ms)
    batch = BatchedDecoder(session.model, session.device, session.facts)
    served = {r.index: Served(r.index, len(r.ids), r.arrival_ms) for r in requests}
    idle_ms = 0.0
    t0 = time.perf_counter()
    with torch.inference_mode():
        while (pending or batch.rows) and not cancel.is_set():
            now = _ms(t0)
            if pending and pending[0].arrival_ms <= now:
                request = pending.pop(0)
                s = served[request.index]
                s.prefill_start_ms = _ms(t0)
                batch.admit(_batch_request(request, s))
                s.prefill_end_ms = _ms(t0)
                s.token_ms.append(s.prefill_end_ms)
                batch.release_finished()
            elif batch.rows:
                _decode_step(batch, served, t0)
            else:
                waited = time.perf_counter()
                cancel.wait(min(POLL_S, max(pending[0].arrival_ms - now, 0.0) / 1000.0))
                idle_ms += (time.perf_counter() - waited) * 1000.0
    return Outcome(list(served.values()), complete=not (pending or batch.rows), idle_ms=idle_ms)


# --- the prefill worker, in its own process -------------------------------------------------------------------

def _worker_main(source: str, dtype: str, threads: int, channel: Connection) -> None:
    """The prefill worker: load the model, then for each request sent (ids, arrival on the shared clock) wait
    for its arrival, prefill it, and send its first token and its cache's tensors."""
    inbox = outbox = channel
    torch.set_num_threads(threads)
    from engine.model import memory
    from engine.model.models import load
    from engine.run import faults

    try:
        model = load(source, device="cpu", dtype=dtype).model
    except Exception as exc:                                # noqa: BLE001  (said to the lesson, one line)
        say(outbox, "failed", f"the prefill worker could not load the model: {exc}")
        return
    handovers = faults.actions(HANDOVER)
    say(outbox, "ready", threads)
    with torch.inference_mode():
        while True:
            try:
                message = heard(inbox)
            except (EOFError, OSError):                      # the lesson's process is gone: so are we
                return
            except BadMessage as exc:                        # not the lesson: said once, and this worker ends
                say(outbox, "failed", f"the prefill worker stopped: {exc}")
                return
            if message[0] == "stop":
                return
            _, index, ids, start_at = message
            delay = start_at - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            began = time.perf_counter()
            cache = kvcache.new_cache(model)                 # the pass the batch's own admission makes
            token = int(kvcache.forward(model, torch.tensor([ids]), cache).logits[0, -1].argmax())
            ended = time.perf_counter()
            tensors = [t for layer in cache.layers for t in (layer.keys, layer.values)]
            size = sum(t.numel() * t.element_size() for t in tensors)
            action = faults.act(handovers.get(index))       # (a test's fault: silent, dying, no room)
            free = 0 if action == "oom" else memory.available_bytes("cpu")
            if free is not None and size > free:
                say(outbox, "failed", f"request {index}'s cache is {size:,} B, more than the {free:,} B of free "
                                      "memory a hand-over needs")
                return
            layout = [[list(t.shape), str(t.dtype).removeprefix("torch.")] for t in tensors]
            payload = torch.cat([t.contiguous().view(-1).view(torch.uint8) for t in tensors]) if tensors else None
            say(outbox, "prefilled", index, token, began, ended, layout, size)
            if action == "exit":                            # half-way through the bytes
                outbox.send_bytes(payload.numpy()[: size // 2].tobytes())
                os._exit(3)
            outbox.send_bytes(payload.numpy() if payload is not None else b"")


def _receive_cache(model: Any, layout: list[list], buffer: bytearray) -> Any:
    """The handed-over bytes as the decode worker's own cache (its tensors are views of them, no copy)."""
    cache = kvcache.new_cache(model)
    offset, tensors = 0, []
    for shape, dtype in layout:
        kind = getattr(torch, dtype)
        count = 1
        for n in shape:
            count *= n
        tensors.append(torch.frombuffer(buffer, dtype=kind, count=count, offset=offset).view(shape))
        offset += count * torch.empty((), dtype=kind).element_size()
    for layer, (keys, values) in enumerate(zip(tensors[::2], tensors[1::2])):
        cache.update(keys, values, layer)
    return cache


class PrefillWorker:
    """The prefill worker's process and its two pipes; always ended by ``close`` (terminated if it does not stop
    when asked), so no process outlives the lesson."""

    def __init__(self, source: str, dtype: str, threads: int) -> None:
        mine, theirs = socket.socketpair()
        self._stderr = tempfile.TemporaryFile()         # a file, not a pipe: a chatty worker never blocks on it
        # A fresh interpreter, not multiprocessing's spawn: spawn imports the parent's main module again (the
        # window's, Qt and all) in the child.
        self.process = subprocess.Popen(
            [*command(), source, dtype, str(threads), str(theirs.fileno())],
            pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            preexec_fn=_die_with_parent, stderr=self._stderr, env={**os.environ, "PYTHONPATH": _package_root()})
        theirs.close()
        self.channel = Connection(mine.detach())
        self.inbox = self.channel

    def wait_ready(self, cancel: threading.Event, timeout_s: float = READY_TIMEOUT_S, idle_s: float = 0.0) -> str:
        """'' when the worker has loaded the model; else why not, in one line. ``idle_s``: a worker that has used
        no CPU for this long while loading is not loading (stopped, or stuck): it is given up on then, not at
        ``timeout_s`` (a loading worker keeps a core busy)."""
        deadline = time.monotonic() + timeout_s
        busy_at, ticks = time.monotonic(), _cpu_ticks(self.process.pid)
        while time.monotonic() < deadline and not cancel.is_set():
            now_ticks = _cpu_ticks(self.process.pid)
            if now_ticks is None or now_ticks != ticks:
                busy_at, ticks = time.monotonic(), now_ticks
            elif idle_s and time.monotonic() - busy_at > idle_s:
                return (f"the prefill worker used no CPU for {idle_s:g} s while loading the model (stopped or "
                        "stuck): given up on")
            if self.inbox.poll(POLL_S * 5):
                try:
                    message = heard(self.inbox)
                except (EOFError, OSError):
                    return f"the prefill worker ended while loading the model{self.said()}"
                except BadMessage as exc:
                    return f"the prefill worker's socket: {exc}"
                return "" if message[0] == "ready" else message[1]
            if self.process.poll() is not None:
                return f"the prefill worker ended while loading the model{self.said()}"
        return "stopped" if cancel.is_set() else f"the prefill worker did not load the model in {timeout_s:.0f} s"

    def alive(self) -> bool:
        return self.process.poll() is None

    def said(self) -> str:
        """The worker's exit code and the last line it wrote, for a failure's one line."""
        code = self.process.poll()
        if code is None:
            return ""
        self._stderr.seek(0)
        lines = [line for line in self._stderr.read()[-4096:].decode(errors="replace").splitlines() if line]
        tail = f": {lines[-1][:300]}" if lines else ""
        return f" (exit code {code}{tail})"

    def send(self, request: ArrivingRequest, start_at: float) -> None:
        say(self.channel, "prefill", request.index, list(request.ids), start_at)

    def close(self) -> None:
        """Asked to stop, then ended: a worker in the middle of a long prompt's pass would hear "stop" only after
        it (1.6 s for 1,024 positions on two busy cores), and nothing it holds is kept, so it gets ``GRACE_S``."""
        try:
            say(self.channel, "stop")
        except (BrokenPipeError, OSError):
            pass
        try:
            self.process.wait(timeout=GRACE_S)
        except subprocess.TimeoutExpired:
            self.process.terminate()
            try:
                self.process.wait(timeout=2.0)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.channel.close()
        self._stderr.close()


def _cpu_ticks(pid: int) -> int | None:
    """The CPU time a process has used, in clock ticks (Linux's /proc); None where it cannot be read."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])                    # utime, stime
    except (OSError, IndexError, ValueError):
        return None


def _die_with_parent() -> None:
    """In the worker, before it runs: Linux ends it when the thread that started it ends, however that ended (a
    window killed mid-run leaves no worker behind; the lesson runs in the engine's thread, which lives as long as
    the window). Elsewhere the closed socket ends it at its next read."""
    if sys.platform.startswith("linux"):
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)      # PR_SET_PDEATHSIG


def _package_root() -> str:
    """The folder that holds ``engine``, first on the worker's path (the same code as this process runs)."""
    import engine

    root = os.path.dirname(os.path.dirname(os.path.abspath(engine.__file__)))
    rest = os.environ.get("PYTHONPATH", "")
    return root + (os.pathsep + rest if rest else "")


class _Receiver:
    """Reads hand-overs off the socket in a thread of its own, so decode goes on while bytes arrive (the socket's
    reads release the GIL), as a serving engine's KV connector loads in the background. Each item: a message
    from the worker, or ("ended", why) when the socket closed."""

    def __init__(self, worker: PrefillWorker) -> None:
        self.worker = worker
        self.items: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._read, name="kvscope-handover-receiver", daemon=True)
        self.thread.start()

    def _read(self) -> None:
        channel = self.worker.inbox
        while True:
            try:
                message = heard(channel)
            except (EOFError, OSError):
                self.items.put(("ended", ""))
                return
            except BadMessage as exc:
                self.items.put(("ended", f"the prefill worker's socket: {exc}"))
                return
            if message[0] != "prefilled":
                self.items.put(message)
                if message[0] == "failed":
                    return
                continue
            index, size = message[1], message[6]
            buffer = bytearray(size)
            reading = time.perf_counter()
            try:
                got = channel.recv_bytes_into(buffer)
            except (EOFError, OSError):
                self.items.put(("ended", f"request {index}'s bytes did not arrive"))
                return
            except BufferTooShort:
                self.items.put(("ended", f"request {index}'s bytes were more than its {size:,} B"))
                return
            if got != size:
                self.items.put(("ended", f"request {index}'s bytes arrived short ({got:,} of {size:,} B)"))
                return
            self.items.put((*message, buffer, reading, time.perf_counter()))


def disaggregated(session: ModelSession, worker: PrefillWorker, requests: Sequence[ArrivingRequest],
                  cancel: threading.Event, silent_s: float) -> Outcome:
    """The decode worker (this process): take each hand-over as it comes, then one decode round of everything
    running. ``silent_s``: how long the prefill worker may say nothing while requests wait on it."""
    by_index = {r.index: r for r in requests}
    served = {r.index: Served(r.index, len(r.ids), r.arrival_ms) for r in requests}
    batch = BatchedDecoder(session.model, session.device, session.facts)
    waiting = {r.index for r in requests}
    t0 = time.perf_counter() + 0.05                        # the schedule starts once every request is sent
    for r in sorted(requests, key=lambda r: r.arrival_ms):
        worker.send(r, t0 + r.arrival_ms / 1000.0)
    last_heard = time.perf_counter()
    failure = ""

    def ms(t: float) -> float:
        return (t - t0) * 1000.0

    receiver = _Receiver(worker)
    with torch.inference_mode():
        while (waiting or batch.rows) and not cancel.is_set():
            try:
                item = receiver.items.get_nowait() if batch.rows else receiver.items.get(timeout=POLL_S)
            except queue.Empty:
                item = None
            if item is not None:
                if item[0] in ("failed", "ended"):
                    if item[0] == "ended":
                        try:
                            worker.process.wait(timeout=2.0)
                        except subprocess.TimeoutExpired:
                            pass
                    failure = item[1] if item[0] == "failed" else \
                        f"the prefill worker ended{' during a hand-over' if item[1] else ''}{worker.said()}" + \
                        (f"; {item[1]}" if item[1] else "")
                    break
                _, index, token, began, ended, layout, size, buffer, reading, read = item
                cache = _receive_cache(session.model, layout, buffer)
                ready = time.perf_counter()
                last_heard = ready
                s = served[index]
                s.prefill_start_ms, s.prefill_end_ms = ms(began), ms(ended)
                s.token_ms.append(ms(ended))                # the first token leaves with the prefill
                s.handover_ready_ms, s.handover_bytes = ms(ready), size
                s.transfer_ms = (read - reading) * 1000.0
                waiting.discard(index)
                batch.join(_batch_request(by_index[index], s), cache, token)
                batch.release_finished()
                continue
            if batch.rows:
                _decode_step(batch, served, t0)
            elif waiting:
                due = min(by_index[i].arrival_ms for i in waiting)
                if ms(time.perf_counter()) > due and time.perf_counter() - last_heard > silent_s:
                    failure = f"the prefill worker said nothing for {silent_s:g} s with {len(waiting)} request(s) " \
                              "waiting: stopped"
                    break
    complete = not (waiting or batch.rows) and not failure
    return Outcome(list(served.values()), complete, failure)


def worker_entry(argv: Sequence[str]) -> None:
    """The prefill worker's command line: SOURCE DTYPE THREADS FD (the socket's end it was given)."""
    _worker_main(argv[0], argv[1], int(argv[2]), Connection(int(argv[3])))

