"""A GGUF file's header and metadata, read within declared bounds before anything else parses it.

The ``gguf`` package (through transformers) reads every metadata entry, string and array into memory before it
checks a count: a file that claims millions of entries, or a string of terabytes, takes it as far as memory goes.
This reader walks the same structure with every count checked against a bound first and every length against
what the file holds, keeps small values only (an array is kept as its length, a long string cut), and so also
answers cheaply what a model list shows: architecture, context length, layers, heads, parameters.

The format: magic ``GGUF``, a version (1 to 3), the tensor count and the metadata count, then each metadata entry
(key, type, value; arrays typed and counted), then each tensor's name, dimensions, type and offset; the data
starts at the next multiple of ``general.alignment`` (32 unless said).
"""

from __future__ import annotations

import math
import os
import stat
import struct
from dataclasses import dataclass, field
from pathlib import Path

from engine.facts.errors import ModelSourceError

MAGIC = b"GGUF"
MAX_ENTRIES = 65_536                 # metadata entries (a real model has tens)
MAX_TENSORS = 100_000                # tensor infos (a real model has hundreds to a few thousand)
MAX_KEY = 4096                       # bytes of one key or tensor name
MAX_STRING = 4 << 20                 # bytes of one string value (a chat template is kilobytes)
MAX_ITEMS = 4 << 20                  # array items in all (a 262k vocabulary's tokens, scores and types, its merges)
MAX_DIMS = 8                         # dimensions of one tensor
MAX_DIM = 1 << 40                    # elements along one dimension
MAX_PARAMETERS = 1 << 44             # elements in all tensors (17.6 trillion)
KEPT_CHARS = 256                     # characters of a string value kept (the rest is checked, not held)
KEPT_ITEMS = 16                      # items of a numeric array kept

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


@dataclass
class GgufHeader:
    version: int
    tensor_count: int
    metadata: dict[str, object] = field(default_factory=dict)     # small values; arrays as ("array", length)
    parameters: int = 0
    data_offset: int = 0

    def value(self, name: str) -> object:
        return self.metadata.get(name)

    @property
    def architecture(self) -> str:
        arch = self.metadata.get("general.architecture")
        return arch if isinstance(arch, str) else ""

    def arch_value(self, name: str) -> object:
        """``{architecture}.{name}`` (``llama.context_length``)."""
        return self.metadata.get(f"{self.architecture}.{name}")


WINDOW = 1 << 20                     # bytes of the file read at a time: a header is parsed from memory
_LENGTH = struct.Struct("<Q")


class _Reader:
    def __init__(self, f, size: int, name: str) -> None:
        self.f, self.size, self.name, self.at = f, size, name, 0
        self.items = 0
        self.buf, self.base = b"", 0     # the file's bytes [base, base + len(buf)), read ahead in windows

    def bad(self, why: str) -> ModelSourceError:
        return ModelSourceError(f"{self.name} is not a usable GGUF file: {why}")

    def _window(self, n: int) -> int:
        """Where the file's bytes [at, at + n) start in ``buf``, reading the next window when they are not in it."""
        if self.base <= self.at and self.at + n <= self.base + len(self.buf):
            return self.at - self.base
        self.f.seek(self.at)
        self.buf, self.base = self.f.read(min(max(n, WINDOW), self.size - self.at)), self.at
        if len(self.buf) < n:
            raise self.bad("it ended while it was being read")
        return 0

    def take(self, n: int) -> bytes:
        if n < 0 or self.at + n > self.size:
            raise self.bad(f"it ends inside its header (at byte {self.at:,} it needs {n:,} more of "
                           f"{self.size - self.at:,} left)")
        i = self._window(n)
        self.at += n
        return self.buf[i:i + n]

    def skip(self, n: int) -> None:
        if n < 0 or self.at + n > self.size:
            raise self.bad(f"a value at byte {self.at:,} runs past the end of the file")
        self.at += n

    def skip_strings(self, n: int) -> None:
        """``n`` strings passed over, each length checked: a vocabulary's 50,000 to 260,000 tokens, in one tight
        loop over the window (a call per token made the embedded model's header a 180 ms read)."""
        unpack, size = _LENGTH.unpack_from, self.size
        while n:
            self._window(8) if self.at + 8 <= size else self.take(8)
            buf, base, at = self.buf, self.base, self.at
            end = base + len(buf)
            while n and at + 8 <= end:
                (length,) = unpack(buf, at - base)
                if length > MAX_STRING:
                    self.at = at
                    raise self.bad(f"it claims {length:,} bytes in one string; KVScope reads at most "
                                   f"{MAX_STRING:,}")
                at += 8 + length
                if at > size:
                    self.at = at - 8 - length
                    raise self.bad(f"a value at byte {self.at:,} runs past the end of the file")
                n -= 1
            self.at = at

    def unpack(self, fmt: str) -> object:
        n = struct.calcsize(fmt)
        if self.at + n > self.size:
            self.take(n)                                    # says where it ends
        value = struct.unpack_from(fmt, self.buf, self._window(n))[0]
        self.at += n
        return value

    def count(self, fmt: str, most: int, what: str) -> int:
        n = self.unpack(fmt)
        if n > most:
            raise self.bad(f"it claims {n:,} {what}; KVScope reads at most {most:,}")
        return n

    def string(self, most: int, what: str, keep: bool = True) -> str:
        n = self.count("<Q", most, f"bytes in one {what}")
        if not keep or n > KEPT_CHARS * 4:
            data = self.take(min(n, KEPT_CHARS * 4)) if keep else b""
            self.skip(n - len(data))
            return data.decode("utf-8", "replace")[:KEPT_CHARS]
        return self.take(n).decode("utf-8", "replace")

    def value(self, kind: int, depth: int = 0) -> object:
        if kind in _SCALARS:
            value = self.unpack(_SCALARS[kind])
            return value if not isinstance(value, float) or math.isfinite(value) else None
        if kind == _STRING:
            return self.string(MAX_STRING, "string")
        if kind == _ARRAY:
            if depth >= 2:
                raise self.bad("it nests arrays more than two deep")
            item = self.unpack("<I")
            n = self.count("<Q", MAX_ITEMS - self.items, "array items")
            self.items += n
            if item in _SCALARS:
                width = struct.calcsize(_SCALARS[item])
                kept = [self.value(item) for _ in range(min(n, KEPT_ITEMS))]
                self.skip((n - len(kept)) * width)
                return kept if n <= KEPT_ITEMS else ("array", n)
            if item == _STRING:
                self.skip_strings(n)
                return ("array", n)
            if item == _ARRAY:
                for _ in range(n):
                    self.value(_ARRAY, depth + 1)
                return ("array", n)
            raise self.bad(f"an array of unknown type {item}")
        raise self.bad(f"a value of unknown type {kind}")


def read(path: str | Path) -> GgufHeader:
    """The header of the GGUF at ``path``, or ``ModelSourceError`` saying what is wrong with it in one line."""
    path = Path(path)
    name = path.name
    try:
        with path.open("rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode):
                raise ModelSourceError(f"{name} is not a regular file: pick a .gguf model file")
            return _read(_Reader(f, st.st_size, name))
    except OSError as exc:
        raise ModelSourceError(f"Cannot read {path}: {exc.strerror or exc}") from None


def _read(r: _Reader) -> GgufHeader:
    if r.size < 4 or r.take(4) != MAGIC:
        raise ModelSourceError(f"{r.name} is not a GGUF file (it does not start with the GGUF magic bytes)")
    version = r.unpack("<I")
    if version not in (1, 2, 3):
        raise r.bad(f"format version {version}; KVScope reads versions 1 to 3")
    counts = "<I" if version == 1 else "<Q"
    header = GgufHeader(version, r.count(counts, MAX_TENSORS, "tensors"))
    entries = r.count(counts, MAX_ENTRIES, "metadata entries")
    for _ in range(entries):
        key = r.string(MAX_KEY, "key")
        header.metadata[key] = r.value(r.unpack("<I"))
    for _ in range(header.tensor_count):
        r.string(MAX_KEY, "tensor name", keep=False)
        dims = r.count("<I", MAX_DIMS, "dimensions of a tensor")
        elements = 1
        for _ in range(dims):
            elements *= r.count("<Q", MAX_DIM, "elements along one dimension")
        r.unpack("<I")                                      # the tensor's type
        r.unpack("<Q")                                      # its offset in the data
        header.parameters += elements
        if header.parameters > MAX_PARAMETERS:
            raise r.bad(f"its tensors hold more than {MAX_PARAMETERS:,} numbers")
    alignment = header.metadata.get("general.alignment", 32)
    if not isinstance(alignment, int) or isinstance(alignment, bool) or not 1 <= alignment <= 1 << 20:
        raise r.bad(f"general.alignment is {alignment!r}, not a whole number of bytes up to 1 MiB")
    header.data_offset = -(-r.at // alignment) * alignment
    if header.tensor_count and header.data_offset > r.size:
        raise r.bad("it ends before its tensor data starts")
    return header
