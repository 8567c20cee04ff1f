"""Generation parameters: one frozen value that checks itself, so a bad value is refused where it is made
(widget, CLI or API) instead of deep inside a forward pass."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import Annotated

from engine.errors import ParameterError
from engine.fields import MAX_CONTEXT, MAX_VOCAB, Range

MAX_SEED = 2**63 - 1
DEVICES = ("auto", "cpu", "cuda", "mps")                             # where a model may load
DTYPES = ("auto", "float32", "bfloat16", "float16", "int8", "int4")  # how: a float, or int8 / int4 weights
FLOATS = ("float32", "bfloat16", "float16")
MAX_TEMPERATURE = 100.0
MIN_TEMPERATURE = 0.01      # below it logits / T overflows toward inf (NaN probabilities); 0 means greedy
MIN_TOP_P = 0.01            # below it the filter is argmax in all but name, and tiny values underflow


@dataclass(frozen=True)
class GenerationParams:
    """What one run does. ``temperature == 0`` means greedy; ``top_k == 0`` and ``top_p == 1`` mean "off";
    ``seed is None`` lets the session pick one and report it, so every run can be repeated."""

    max_new_tokens: Annotated[int, Range(1, MAX_CONTEXT)] = 128
    temperature: Annotated[float, Range(0.0, MAX_TEMPERATURE)] = 0.0
    top_k: Annotated[int, Range(0, MAX_VOCAB)] = 0
    top_p: Annotated[float, Range(MIN_TOP_P, 1.0)] = 1.0
    seed: Annotated[int, Range(0, MAX_SEED)] | None = None
    kv_cache: bool = True
    chat_template: bool = True
    static_cache: bool = False      # preallocate the cache for prompt + max_new_tokens (what compiling needs)
    compiled: bool = False          # decode through torch.compile (needs the static cache; for GPUs)
    capture_attention: bool = False  # record each pass's newest-token attention weights (costs time and space)

    def __post_init__(self) -> None:
        _check_int("max_new_tokens", self.max_new_tokens, low=1, high=MAX_CONTEXT)
        _check_float("temperature", self.temperature)
        if self.temperature != 0.0 and not MIN_TEMPERATURE <= self.temperature <= MAX_TEMPERATURE:
            raise ParameterError(f"temperature must be 0 (greedy) or between {MIN_TEMPERATURE:g} and "
                                 f"{MAX_TEMPERATURE:g}, got {self.temperature:g}")
        _check_int("top_k", self.top_k, low=0, high=MAX_VOCAB)
        _check_float("top_p", self.top_p)
        if not MIN_TOP_P <= self.top_p <= 1.0:
            raise ParameterError(f"top_p must be between {MIN_TOP_P:g} and 1 (1 = off), got {self.top_p:g}")
        if self.seed is not None:
            _check_int("seed", self.seed, low=0, high=MAX_SEED)
        for name in ("kv_cache", "chat_template", "static_cache", "compiled", "capture_attention"):
            if not isinstance(getattr(self, name), bool):
                raise ParameterError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.compiled and not (self.static_cache and self.kv_cache):
            raise ParameterError("compiled decode needs the static KV cache (static_cache=True, kv_cache=True)")
        if self.compiled and self.capture_attention:
            raise ParameterError("attention cannot be captured from a compiled decode: turn one of them off")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    def with_(self, **changes: object) -> GenerationParams:
        return replace(self, **changes)

    def describe(self) -> str:
        """A short label for legends: what distinguishes this run from its neighbours."""
        parts = ["greedy" if self.temperature == 0.0 else f"T={self.temperature:g}"]
        if self.temperature > 0.0:
            if self.top_k:
                parts.append(f"k={self.top_k}")
            if self.top_p < 1.0:
                parts.append(f"p={self.top_p:g}")
            parts.append(f"seed={self.seed}")
        parts.append(("KV static" if self.static_cache else "KV on") if self.kv_cache else "KV off")
        if self.compiled:
            parts.append("compiled")
        if self.capture_attention:
            parts.append("attention")
        if not self.chat_template:
            parts.append("raw")
        return ", ".join(parts)

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]


def _check_int(name: str, value: object, *, low: int, high: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ParameterError(f"{name} must be a whole number, got {value!r}")
    if value < low or (high is not None and value > high):
        bound = f"between {low} and {high:,}" if high is not None else f"at least {low}"
        raise ParameterError(f"{name} must be {bound}, got {value:,}")


def _check_float(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ParameterError(f"{name} must be a finite number, got {value!r}")
