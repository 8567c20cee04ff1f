"""Token ids to text, one token at a time, never splitting a multi-byte character.

Decoding each id alone breaks UTF-8 characters spread over several byte-level tokens ("日本語 😀" comes out
as '\ufffd' pieces). A token that ends in the middle of a character gets the empty string and the token that
completes it carries the whole character, so the pieces always join to ``tokenizer.decode(ids)``.
"""

from __future__ import annotations

import re
from typing import Any

_LONE_SURROGATE = re.compile("[\ud800-\udc7f\udd00-\udfff]")
# C0 controls but newline and tab, DEL, C1 controls, and the bidirectional embedding/override/isolate marks.
_UNSAFE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def safe(text: object) -> str:
    """``text`` with every character a terminal would act on shown as an escape (``\\x1b``, ``\\u202e``): text
    from outside KVScope (a server's tokens, a model folder's chat template) is shown, never obeyed."""
    return _UNSAFE.sub(lambda m: f"\\x{ord(m.group()):02x}" if ord(m.group()) < 0x100 else f"\\u{ord(m.group()):04x}",
                       str(text))


def safe_line(text: object) -> str:
    """As :func:`safe`, and on one line: newlines and tabs escaped too (messages, names, paths)."""
    return safe(text).replace("\n", "\\n").replace("\t", "\\t")


class TextStream:
    def __init__(self, tokenizer: Any, skip_special_tokens: bool = False) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._backend = backend
        self._stream = None
        if backend is not None:
            from tokenizers.decoders import DecodeStream

            self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self._ids: list[int] = []
        self._emitted = ""

    def step(self, token_id: int) -> str:
        if self._stream is not None:
            return self._stream.step(self._backend, token_id) or ""
        return self._step_slow(token_id)

    def _step_slow(self, token_id: int) -> str:
        """Fallback for tokenizers without a fast backend: decode everything, hold back a broken tail."""
        self._ids.append(token_id)
        text = self._tokenizer.decode(self._ids, skip_special_tokens=self._skip)
        if text.endswith("\ufffd") or not text.startswith(self._emitted):
            return ""
        piece, self._emitted = text[len(self._emitted):], text
        return piece


def pieces(tokenizer: Any, ids: list[int]) -> list[str]:
    """The display text of each token in ``ids`` (special tokens included, characters unbroken)."""
    stream = TextStream(tokenizer)
    return [stream.step(i) for i in ids]


def clean_text(text: str) -> tuple[str, int]:
    """``text`` as valid Unicode, and how many characters had to be replaced with U+FFFD. Bytes that were not
    UTF-8 (a shell passes them to Python as surrogate escapes) and lone surrogates have no tokens; a tokenizer
    given them raises deep inside, so they are replaced here, where the caller can say so."""
    try:
        text.encode("utf-8")
        return text, 0
    except UnicodeEncodeError:
        pass
    fixed = _LONE_SURROGATE.sub("\ufffd", text).encode("utf-8", "surrogateescape").decode("utf-8", "replace")
    return fixed, fixed.count("\ufffd") - text.count("\ufffd")
