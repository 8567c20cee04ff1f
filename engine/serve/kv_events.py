"""A serving engine's KV cache events, live: vLLM publishes every block its prefix cache stores or evicts over
ZMQ (``--kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": ...}'``), each
message msgpack ``[timestamp, [events]]`` with ``BlockStored`` (the blocks' hashes, their parent's hash, their
token ids), ``BlockRemoved`` and ``AllBlocksCleared``. This module subscribes and turns them into plain facts.

Where to listen comes from the address. vLLM binds a wildcard and an ``ipc://`` path and connects to a host, so
KVScope does the other: ``ipc:///tmp/vllm-events`` and ``tcp://127.0.0.1:5557`` connect to a vLLM that bound them
(``ipc://``: nothing listens beyond this machine), ``tcp://*:5557`` binds every interface for a vLLM given
``tcp://HOST:5557``, and ``bind:tcp://127.0.0.1:5557`` binds this machine only, for a vLLM given
``tcp://127.0.0.1:5557``. The batch's third element (vLLM's and SGLang's data-parallel rank) names the publisher,
and a block's ``medium`` (GPU, CPU, disk: where a tiered cache keeps it) is kept with it.

Everything a publisher sends is bounded like the rest of the server client: a message over
``MAX_MESSAGE`` bytes is refused by ZMQ itself, one that is not msgpack ``[timestamp, [events]]``, an event of a
type KVScope does not know, or a field out of its bounds is skipped and counted, and a publisher that floods is
read at most ``MAX_PER_SECOND`` messages in any second (a sliding window: a fixed one lets twice that through
across its edge), the rest dropped and counted; each kind of trouble is said in
one line. No torch here.
"""

from __future__ import annotations

import dataclasses
import re
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

from engine.facts.errors import EngineError

MAX_MESSAGE = 4 << 20            # bytes in one message: a batch of block events is kilobytes
QUEUED = 64                      # messages ZMQ holds for KVScope at most (64 x 4 MiB bounds its memory)
MAX_PER_SECOND = 2000            # messages read a second; beyond that a publisher floods
MAX_TOKENS = 4096                # token ids in one stored block
MAX_BLOCKS = 4096                # blocks in one event
ADDRESS = re.compile(r"^(?P<bind>bind:)?(?:tcp://(?P<host>\*|[A-Za-z0-9.\-]+|\[[0-9a-fA-F:]+\]):(?P<port>\d{1,5})"
                     r"|(?P<ipc>ipc://[A-Za-z0-9_./\-]{1,100}))$")
MEDIUMS = ("GPU", "CPU", "DISK", "LMCACHE")       # where a tiered cache says it keeps a block (shown as sent)


class KVEventsError(EngineError):
    """The address cannot be subscribed to (malformed, a port in use, no ZMQ here); one line."""


@dataclass(frozen=True)
class Stored:
    """Blocks the engine's cache stored, in order: each key's parent is the one before it, the first's is
    ``parent`` ("" for a block at the root); ``tokens[i]`` are block i's token ids."""

    keys: tuple[str, ...]
    parent: str
    tokens: tuple[tuple[int, ...], ...]
    block_size: int
    medium: str = ""             # where the engine keeps them ("": it did not say)
    publisher: str = ""          # the data-parallel rank that sent them ("": a server with one)


@dataclass(frozen=True)
class Removed:
    keys: tuple[str, ...]
    medium: str = ""
    publisher: str = ""


@dataclass(frozen=True)
class Cleared:
    publisher: str = ""


Fact = Stored | Removed | Cleared


def block_key(value: object) -> str | None:
    """A block's hash as KVScope names it: hex, whether vLLM sent an int or bytes."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int) and 0 <= value < 1 << 256:
        return f"{value:x}"
    if isinstance(value, (bytes, bytearray)) and 0 < len(value) <= 32:
        return bytes(value).hex()
    return None


def decode(payload: bytes) -> tuple[list[Fact], int, list[str]]:
    """One message's facts, how many events were skipped, and what about them (malformed, unknown type)."""
    import msgpack

    try:
        if len(payload) > MAX_MESSAGE:
            return [], 1, [f"a message of more than {MAX_MESSAGE:,} bytes"]
        message = msgpack.unpackb(payload, raw=False, strict_map_key=False, max_array_len=1 << 16,
                                  max_map_len=1 << 10, max_str_len=1 << 16, max_bin_len=1 << 16)
    except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError,
            msgpack.UnpackValueError):                      # a malformed message, in any of msgpack's ways
        return [], 1, ["a message that is not msgpack"]
    if not (isinstance(message, (list, tuple)) and len(message) >= 2 and isinstance(message[1], (list, tuple))):
        return [], 1, ["a message that is not [timestamp, [events]]"]
    facts: list[Fact] = []
    skipped, why = 0, []
    rank = message[2] if len(message) > 2 else None
    publisher = f"rank {rank}" if isinstance(rank, int) and not isinstance(rank, bool) and 0 <= rank < 1024 else ""
    for event in message[1]:
        fact, problem = _fact(event)
        if fact is not None:
            facts.append(dataclasses.replace(fact, publisher=publisher) if publisher else fact)
        else:
            skipped += 1
            why.append(problem)
    return facts, skipped, why


FIELDS = {"BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium"),
          "BlockRemoved": ("block_hashes", "medium"), "AllBlocksCleared": ()}


def _fields(event: object) -> tuple[str, dict]:
    """An event's type and fields: vLLM since 0.26 sends maps with a ``type``; SGLang and older vLLM send arrays
    tagged with the type, the fields in their declared order (``FIELDS``; a later field may be left out)."""
    if isinstance(event, dict):
        return str(event.get("type", "")), event
    if isinstance(event, (list, tuple)) and event and isinstance(event[0], str):
        return event[0], dict(zip(FIELDS.get(event[0], ()), event[1:]))
    return "", {}


def _medium(data: dict) -> str:
    medium = data.get("medium")
    return medium if isinstance(medium, str) and medium.upper() in MEDIUMS else ""


def _fact(event: object) -> tuple[Fact | None, str]:
    kind, data = _fields(event)
    if kind == "AllBlocksCleared":
        return Cleared(), ""
    if kind not in ("BlockStored", "BlockRemoved"):
        return None, f"an event of a type KVScope does not know ({kind[:40] or 'none'})"
    hashes = data.get("block_hashes")
    if not isinstance(hashes, (list, tuple)) or not 0 < len(hashes) <= MAX_BLOCKS:
        return None, f"a {kind} without a bounded list of block hashes"
    keys = tuple(block_key(h) for h in hashes)
    if None in keys:
        return None, f"a {kind} with a block hash that is not a number or bytes"
    if kind == "BlockRemoved":
        return Removed(keys, _medium(data)), ""
    size = data.get("block_size")
    tokens = data.get("token_ids")
    if not (isinstance(size, int) and 0 < size <= MAX_TOKENS and isinstance(tokens, (list, tuple))
            and len(tokens) == size * len(keys) and all(isinstance(t, int) and 0 <= t < 1 << 24 for t in tokens)):
        return None, "a BlockStored whose token ids do not fill its blocks"
    parent = data.get("parent_block_hash")
    parent_key = "" if parent is None else block_key(parent)
    if parent_key is None:
        return None, "a BlockStored with a parent hash that is not a number or bytes"
    chunks = tuple(tuple(tokens[i * size:(i + 1) * size]) for i in range(len(keys)))
    return Stored(keys, parent_key, chunks, size, _medium(data)), ""


@dataclass
class Subscriber:
    """Subscribed to one publisher's KV events. ``read(timeout_s)`` gives the facts that arrived; ``notes`` what
    was skipped or dropped, said once per kind (with counts in ``skipped`` and ``dropped``)."""

    address: str
    bind: bool = False
    skipped: int = 0
    dropped: int = 0
    cut_off: int = 0                  # times ZMQ dropped the publisher's connection (a message over MAX_MESSAGE)
    lost: int = 0                     # messages the publisher numbered that never arrived (a queue that was full)
    notes: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        try:
            import zmq
        except ImportError:
            raise KVEventsError("KV events need pyzmq (pip install pyzmq msgpack)") from None
        match = ADDRESS.match(self.address.strip())
        if match is None or (match["port"] is not None and not 0 < int(match["port"]) < 65536):
            raise KVEventsError(f"{self.address!r} is not a ZMQ address: write ipc:///PATH or tcp://HOST:PORT "
                                "(KVScope connects to a vLLM that binds it), tcp://*:PORT (KVScope binds every "
                                "interface) or bind:tcp://127.0.0.1:PORT (KVScope binds this machine only)")
        self.bind = bool(match["bind"]) or match["host"] == "*"
        self._endpoint = self.address.strip().removeprefix("bind:")
        self._context = zmq.Context.instance()
        self._socket = self._context.socket(zmq.SUB)
        self._socket.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE)
        self._socket.setsockopt(zmq.RCVHWM, QUEUED)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.SUBSCRIBE, b"")
        try:
            (self._socket.bind if self.bind else self._socket.connect)(self._endpoint)
        except zmq.ZMQError as exc:
            self._socket.close(0)
            reason = "the port is in use" if exc.errno == zmq.EADDRINUSE else str(exc)
            raise KVEventsError(f"Cannot {'bind' if self.bind else 'connect'} {self.address} for KV events: "
                                f"{reason}") from None
        # ZMQ refuses a message over MAXMSGSIZE by dropping the connection, and says so only to a monitor.
        self._monitor = self._socket.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._read_at: deque[float] = deque()      # when each message of the last second was read

    def listening(self) -> str:
        """Where KVScope listens ("": it connects): README and the window say what is open to whom."""
        import zmq

        return self._socket.getsockopt_string(zmq.LAST_ENDPOINT) if self.bind else ""

    def read(self, timeout_s: float) -> Iterator[Fact]:
        """The facts of the messages that arrive within ``timeout_s`` (at most ``MAX_PER_SECOND`` in any second)."""
        import zmq

        deadline = time.monotonic() + timeout_s
        self._watch()
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not self._socket.poll(max(int(left * 1000), 1)):
                return
            parts = self._socket.recv_multipart(zmq.NOBLOCK)
            now = time.monotonic()
            while self._read_at and now - self._read_at[0] >= 1.0:
                self._read_at.popleft()
            if len(self._read_at) >= MAX_PER_SECOND:
                self.dropped += 1
                self._say(f"the publisher at {self.address} sent more than {MAX_PER_SECOND:,} messages a second: "
                          "the rest were dropped")
                continue
            self._read_at.append(now)
            self._count_gap(parts)
            facts, skipped, why = decode(parts[-1])
            self.skipped += skipped
            for problem in why:
                self._say(f"{problem} from {self.address}: skipped")
            yield from facts

    def _count_gap(self, parts: list[bytes]) -> None:
        """vLLM numbers its messages (topic, an 8-byte sequence number, the payload): a number skipped is a message
        ZMQ dropped because KVScope's queue was full (``QUEUED``), counted and said once."""
        if len(parts) < 3 or len(parts[-2]) != 8:
            return
        number = int.from_bytes(parts[-2], "big")
        last = getattr(self, "_last", None)
        if last is not None and number > last + 1:
            self.lost += number - last - 1
            self._say(f"the publisher at {self.address} sent faster than KVScope reads: messages it numbered never "
                      f"arrived (ZMQ keeps {QUEUED} waiting at most); the tree misses their blocks")
        self._last = number

    def _watch(self) -> None:
        """Count the times ZMQ cut the publisher off, and say why once."""
        import zmq

        while self._monitor.poll(0):
            try:
                event = self._monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.ZMQError:
                return
            if int.from_bytes(event[0][:2], "little") == zmq.EVENT_DISCONNECTED:
                self.cut_off += 1
                self._say(f"ZMQ dropped the connection to the publisher at {self.address}: it does that when a "
                          f"message is larger than {MAX_MESSAGE // 2**20} MiB (KVScope's bound), and what was in "
                          "flight is lost until the publisher is connected again")

    def _say(self, note: str) -> None:
        if note not in self.notes and len(self.notes) < 16:
            self.notes.append(note)

    def close(self) -> None:
        self._socket.disable_monitor()
        self._monitor.close(0)
        self._socket.close(0)
