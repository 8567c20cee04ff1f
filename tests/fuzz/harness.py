"""The fuzz harness: every thing KVScope reads from outside itself is a ``Target``, fed bad bytes (its real seeds
mutated byte by byte, their JSON shapes with hostile values drawn by hypothesis, and cases built to hurt: huge
counts, deep nesting, long lines, repeated lines), odd files, slow peers and outputs that are its inputs.

Each target runs in a child process of its own (``tests.fuzz.child``) under caps: address space (``RLIMIT_AS``,
``MEMORY_CAP`` above what the child holds once warm), time per input (``TIME_CAP_S``, by a timer inside the child
and a watchdog outside it) and file size written (``RLIMIT_FSIZE``). An input passes when it ends in a result or in
one of the target's own errors whose message is one line and names the input; it fails on a traceback, a cap hit,
or the canary: an audit hook that flags any import not allowed, any ``exec``/``compile`` outside an allowed
module (the chat-template sandbox), a subprocess, and any file written or removed outside the input's temporary
folder. A failing input is saved under ``found/`` and replayed by the suite from then on.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import random
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

FOUND = Path(__file__).with_name("found")
MEMORY_CAP = 1 << 30            # bytes a target may add to what its warm child holds
TIME_CAP_S = 10.0               # seconds one input may take
FILE_CAP = 256 << 20            # bytes one file written may grow to
GROWN_MOST = 96 << 20          # bytes of one grown input (its making must fit under the child's cap)
MESSAGE_LIMIT = 600             # characters of a clear error (a paragraph is not one line of trouble)

# Values a valid shape may carry that no writer of it would: the edges of every number type, and text that is
# empty, huge, control characters or lone surrogates.
HOSTILE_NUMBERS = (float("nan"), float("inf"), float("-inf"), 1e308, -1e308, 5e-324, 2**64, 2**63, -2**63 - 1,
                   -1, 0, 10**7, 10**30, 0.5, -0.0)
HOSTILE_TEXT = ("", "\x00", "\ud800", "\u202e", "\n\n", "{{", "%s%n", "../../etc/passwd", "a" * 5000)
HOSTILE_TOKENS = (b"NaN", b"Infinity", b"-Infinity", b"1e308", b"-1", b"18446744073709551616", b"9" * 5000,
                  b"[" * 20000, b"{" * 20000, b'"' + b"x" * 70_000 + b'"', b"\x00", b"\xff\xfe", b"\r", b"null",
                  b"true", b"[]", b"{}", b"1e-400", b"-0", b"0x10", b"\xed\xa0\x80")


class Said(Exception):
    """What the product told the user instead of raising: a command's stderr, a failed run's message. Judged as
    a refusal is: one line, naming the input."""


@dataclass(frozen=True)
class Target:
    """One reader. ``feed(data, work)`` hands ``data`` to it as its users would (written to a file under ``work``,
    served by a peer, parsed from text) and returns what it returned; ``errors`` are its clear refusals;
    ``names`` is text each refusal must contain, so the user knows which input it is about."""

    name: str
    what: str
    seeds: Callable[[], list[bytes]]
    feed: Callable[[bytes, Path], object]
    errors: tuple[type[BaseException], ...]
    names: str | tuple[str, ...] | None = None     # text a refusal names the input by (any one of them)
    mutate: bool = True                     # False: the seeds are the whole set of cases (a fault table)
    json_lines: bool = False                # structured mutation applies: each line is JSON
    exec_from: tuple[str, ...] = ()         # modules allowed to compile and exec (a template sandbox)
    imports: tuple[str, ...] = ()           # modules a refusal may import lazily
    warm: Callable[[], None] = lambda: None  # imports done once before the caps are set
    accepts: bool = True                    # False: no input ends in a result (a model list is never a stream)
    refuses: bool = True                    # False: it reports bad values as notes and never refuses (settings)
    warm_seeds: bool = True                 # run the first seeds once, uncounted, before the caps are set
    time_cap_s: float = TIME_CAP_S


@dataclass
class Outcome:
    index: int
    kind: str                 # how the input was made: seed, bytes, shape, grown, case
    verdict: str              # result, refused, failed
    why: str = ""
    seconds: float = 0.0
    digest: str = ""


@dataclass
class Tally:
    target: str
    tried: int = 0
    refused: int = 0
    failed: list[Outcome] = field(default_factory=list)
    peak_bytes: int = 0
    seconds: float = 0.0

    def line(self) -> str:
        return (f"{self.target:<28} {self.tried:>6,} inputs  {self.refused:>6,} refused  {len(self.failed):>3} failed  "
                f"peak {self.peak_bytes / 2**20:7.1f} MiB  {self.seconds:5.1f} s")


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


def save_found(target: str, data: bytes, why: str) -> Path:
    """A failing input, kept for the suite: ``found/<target>-<digest>.bin`` and its reason beside it."""
    FOUND.mkdir(exist_ok=True)
    stem = f"{target}-{digest(data)}"
    path = FOUND / f"{stem}.bin"
    if len(data) > 4 << 20:                      # a grown input is kept compressed (the suite unpacks it)
        path = FOUND / f"{stem}.bin.gz"
        path.write_bytes(gzip.compress(data, 6))
    else:
        path.write_bytes(data)
    (FOUND / f"{stem}.why").write_text(why + "\n")
    return path


def found_inputs(target: str) -> list[tuple[Path, bytes]]:
    out = []
    for path in sorted(FOUND.glob(f"{target}-*.bin*")):
        data = path.read_bytes()
        out.append((path, gzip.decompress(data) if path.name.endswith(".gz") else data))
    return out


# ---- inputs ----------------------------------------------------------------------------------------------------

def inputs(target: Target, seed: int) -> Iterator[tuple[str, bytes]]:
    """Every seed as is, then rounds of byte mutations, JSON shapes with hostile values and grown inputs, without
    end (the caller stops at its budget). The same seed gives the same inputs, so a failure can be made again."""
    seeds = target.seeds()
    for data in seeds:
        yield ("seed" if target.mutate else "case"), data
    if not target.mutate:
        return
    rng = random.Random(seed)
    shapes = _shapes(seeds) if target.json_lines else None
    round_ = 0
    while True:
        round_ += 1
        for _ in range(24):
            yield "bytes", mutate_bytes(rng, rng.choice(seeds), seeds)
        if shapes:
            for value in shaped_values(shapes, seed * 1000 + round_, 16):
                yield "shape", value
        for _ in range(2):
            yield "grown", grow(rng, rng.choice(seeds), target.json_lines)


def mutate_bytes(rng: random.Random, data: bytes, seeds: list[bytes]) -> bytes:
    """One to four edits: flip, insert, delete, duplicate, cut at a line, splice another seed, a hostile token."""
    out = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        op = rng.randrange(8)
        at = rng.randrange(len(out) + 1)
        if op == 0 and out:
            out[min(at, len(out) - 1)] ^= 1 << rng.randrange(8)
        elif op == 1:
            out[at:at] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 8)))
        elif op == 2 and out:
            del out[at:at + rng.randint(1, 64)]
        elif op == 3 and out:
            start = rng.randrange(len(out))
            out[at:at] = out[start:start + rng.randint(1, 256)] * rng.randint(1, 16)
        elif op == 4:
            lines = out.split(b"\n")
            out = bytearray(b"\n".join(lines[:rng.randint(0, len(lines))]))
        elif op == 5:
            other = rng.choice(seeds)
            out = out[:at] + other[rng.randrange(len(other) + 1):]
        elif op == 6:
            token = rng.choice(HOSTILE_TOKENS)
            numbers = [m.span() for m in re.finditer(rb"-?[0-9][0-9.eE+-]*", bytes(out[:200_000]))]
            if numbers and rng.random() < 0.7:
                start, end = rng.choice(numbers)
                out[start:end] = token
            else:
                out[at:at] = token
        else:
            out = out[:at]
    return bytes(out)


def grow(rng: random.Random, data: bytes, json_lines: bool) -> bytes:
    """An input made large the way a hostile one would be: one line repeated hundreds of thousands of times (a
    long trace, compressed it is small), a list with millions of items, nesting thousands deep, a line of MiBs."""
    lines = [line for line in data.split(b"\n") if line.strip()] or [data]
    op = rng.randrange(4)
    if op == 0:
        body = min(lines[1:] or lines, key=len) + b"\n"            # a step's line, the shortest a trace has
        out = lines[0] + b"\n" + body * min(rng.choice((10_000, 300_000)), GROWN_MOST // len(body))
        return gzip.compress(out, 1) if rng.random() < 0.5 else out
    if op == 1 and json_lines:
        return lines[0] + b"\n" + b'{"type": "x", "items": [' + b"0," * 2_000_000 + b"0]}\n"
    if op == 2:
        depth = rng.choice((1000, 100_000))
        return lines[0] + b"\n" + b"[" * depth + b"]" * depth + b"\n"
    return lines[0] + b"\n" + b'{"text": "' + b"x" * rng.choice((1 << 20, 70 << 20)) + b'"}\n'


def _shapes(seeds: list[bytes]) -> list[object]:
    shapes: list[object] = []
    for data in seeds:
        for line in data.split(b"\n"):
            try:
                value = json.loads(line)
            except ValueError:
                continue
            if isinstance(value, (dict, list)):
                shapes.append(value)
    return shapes[:200]


def shaped_values(shapes: list[object], seed: int, count: int) -> list[bytes]:
    """``count`` JSON documents drawn by hypothesis: a real line's shape with some of its leaves replaced by
    hostile values (NaN, 1e308, 2^64, negative sizes, huge text), a list grown, a key dropped or duplicated."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as seeded
    from hypothesis import strategies as st

    leaf = st.one_of(st.sampled_from(HOSTILE_NUMBERS), st.sampled_from(HOSTILE_TEXT), st.integers(),
                     st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=40), st.none(), st.booleans())

    def like(value: object, depth: int = 0) -> st.SearchStrategy:
        if isinstance(value, dict) and depth < 8:
            return st.fixed_dictionaries({k: st.one_of(st.just(v), like(v, depth + 1)) for k, v in value.items()})
        if isinstance(value, list) and value and depth < 8:
            return st.one_of(st.lists(like(value[0], depth + 1), max_size=6), st.just(value),
                             st.just(value * 50))
        return st.one_of(st.just(value), leaf)

    out: list[bytes] = []

    @seeded(seed)
    @settings(max_examples=count, database=None, deadline=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(st.integers(0, len(shapes) - 1).flatmap(lambda i: st.tuples(st.just(i), like(shapes[i]))))
    def draw(pair: tuple[int, object]) -> None:
        index, value = pair
        head = shapes[0] if index else None
        text = json.dumps(value, allow_nan=True)
        out.append(((json.dumps(head) + "\n") if head is not None else "").encode() + text.encode("utf-8",
                                                                                                   "surrogatepass")
                   + b"\n")

    draw()
    return out[:count]


def clear_message(message: str, names: str | tuple[str, ...] | None) -> str:
    """Why a refusal's message is not clear, or ''."""
    if not message.strip():
        return "an empty message"
    if "\n" in message.strip():
        return "a message of several lines"
    if len(message) > MESSAGE_LIMIT:
        return f"a message of {len(message):,} characters"
    if "Traceback" in message:
        return "a traceback in the message"
    accepted = (names,) if isinstance(names, str) else names or ()
    if accepted and not any(n in message for n in accepted):
        return f"a message that does not name the input ({' or '.join(accepted)})"
    return ""
