"""Generation parameters: one frozen value that checks itself, so a bad value is refused where it is made
(widget, CLI or API) instead of deep inside a forward pass."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import Annotated

from engine.facts.errors import ParameterError
from engine.facts.fields import MAX_BYTES, MAX_CONTEXT, MAX_VOCAB, Key, Range, Setting, Text
from engine.facts.kv_methods import RUN_CHOICES, parse_method
from engine.facts.validation import shape_of, shapes

MAX_SEED = 2**31 - 1        # what every control holds, and the range a random seed is drawn from
DEFAULT_SEED = 42           # the window's and the CLI's: the same settings give the same text everywhere
DEVICES = ("auto", "cpu", "cuda", "mps")                             # where a model may load
DTYPES = ("auto", "float32", "bfloat16", "float16", "int8", "int4")  # how: a float, or int8 / int4 weights
FLOATS = ("float32", "bfloat16", "float16")
MAX_TEMPERATURE = 100.0
MIN_TEMPERATURE = 0.01      # below it logits / T overflows toward inf (NaN probabilities); 0 means greedy
MIN_TOP_P = 0.01            # below it the filter is argmax in all but name, and tiny values underflow
TOP_K_LADDER = (0, 1, 5, 10, 20, 40, 100, 1000)
DEADLINE_S = 600.0          # a server run that takes longer (a server that never stops, or drips) is ended
MAX_DEADLINE_S = 86_400.0


@dataclass(frozen=True)
class GenerationParams:
    """What one run does. ``temperature == 0`` means greedy; ``top_k == 0`` and ``top_p == 1`` mean "off";
    ``seed is None`` lets the session pick one and report it, so every run can be repeated.

    Each field declares, once, what every surface shows of it: its range (``Range``; the limits that depend on
    the model, the vocabulary for top-k and the context for max tokens, come from the loaded model), its CLI
    flag, label, help and unit (``Setting``), and the lecture key that changes it (``Key``). The CLI's flags,
    the window's controls, the settings file's checks and the lecture keys are built from these declarations."""

    max_new_tokens: Annotated[int, Range(1, MAX_CONTEXT), Setting(
        "--max-new-tokens", "Max new tokens", "how many tokens to generate at most (the model's context caps it)",
        "tokens"), Key("M", factor=2.0)] = 128
    temperature: Annotated[float, Range(0.0, MAX_TEMPERATURE, least=MIN_TEMPERATURE), Setting(
        "--temperature", "Temperature", f"divides the logits before sampling; 0 = greedy (the likeliest token), "
        f"otherwise {MIN_TEMPERATURE:g} to {MAX_TEMPERATURE:g}", special="0 (greedy)", step=0.1), Key("T")] = 0.0
    top_k: Annotated[int, Range(0, MAX_VOCAB), Setting(
        "--top-k", "Top-k", "sample only among the k likeliest tokens; 0 = off", special="off", step=1),
        Key("K", ladder=TOP_K_LADDER, short="top-k")] = 0
    top_p: Annotated[float, Range(MIN_TOP_P, 1.0), Setting(
        "--top-p", "Top-p", "sample only among the likeliest tokens whose probabilities add up to p; 1 = off",
        step=0.05), Key("P", short="top-p")] = 1.0
    seed: Annotated[int, Range(0, MAX_SEED), Setting(
        "--seed", "Seed", "the sampler's random seed, so a sampled run can be repeated; 'random' draws a new one "
        "each run (reported)", none="random")] | None = DEFAULT_SEED
    kv_cache: Annotated[bool, Setting(
        "--no-kv-cache", "KV cache", "keep each layer's keys and values between steps; without the cache every "
        "decode step recomputes the whole sequence (watch the latency grow)")] = True
    static_cache: Annotated[bool, Setting(
        "--static-cache", "static", "allocate the KV cache for prompt + new tokens up front (what compiled "
        "decode needs)")] = False
    compiled: Annotated[bool, Setting(
        "--compile", "compiled", "decode through torch.compile over the static cache, rounded up to a "
        "power of two (CUDA graphs on a GPU; implies --static-cache); the graph's build time is reported apart "
        "from decode. On a CPU decoding starts at once, eagerly, while the graph is built beside it, and switches "
        "to it at the next step: the timing charts mark where; after the graph a prefill package is built, and "
        "later compiled runs' prompts of the lengths it was timed faster than eager at prefill through it",
        needs="static_cache")] = False
    capture_attention: Annotated[bool, Setting(
        "--attention", "record attention", "record each step's newest-token attention over the cache (its cost "
        "per pass is reported)")] = False
    chat_template: Annotated[bool, Setting(
        "--raw", "Chat template", "wrap the prompt as a user message with the model's chat template (without "
        "it the prompt is raw text)")] = True
    kv_method: Annotated[str, Text(32), Setting(
        "--kv-cache", "KV cache as", "full precision (full), quantized (fp8, quanto4, quanto2, hqq4) or "
        "evicted to its S first and W most recent positions (sinks:S+W); the heatmap shows what it holds",
        offered=RUN_CHOICES)] = "full"

    def __post_init__(self) -> None:
        for shape in shapes(GenerationParams):          # the declared ranges, checked with words a user acts on
            value = getattr(self, shape.name)
            if shape.base is bool:
                if not isinstance(value, bool):
                    raise ParameterError(f"{shape.name} must be true or false, got {value!r}")
            elif shape.base is int and not (value is None and shape.optional):
                _check_int(shape.name, value, low=int(shape.span.low), high=int(shape.span.high))
            elif shape.base is float:
                _check_float(shape.name, value)
                if shape.span is not None and shape.span.least is not None and not shape.span.admits(value):
                    raise ParameterError(f"{shape.name} must be {shape.span.words(shape.setting.special)}, got "
                                         f"{value:g}")
            elif shape.base is str and not isinstance(value, str):
                raise ParameterError(f"{shape.name} must be text, got {value!r}")
        if not MIN_TOP_P <= self.top_p <= 1.0:
            raise ParameterError(f"top_p must be between {MIN_TOP_P:g} and 1 (1 = off), got {self.top_p:g}")
        if self.compiled and not (self.static_cache and self.kv_cache):
            raise ParameterError("compiled decode needs the static KV cache (static_cache=True, kv_cache=True)")
        if self.compiled and self.capture_attention:
            raise ParameterError("attention cannot be captured from a compiled decode: turn one of them off")
        method = parse_method(self.kv_method, for_run=True)           # H2O refused here, in one line
        object.__setattr__(self, "kv_method", method.name)           # one spelling: "FP8 " is "fp8"
        if method.kind != "full" and (not self.kv_cache or self.static_cache or self.compiled):
            raise ParameterError(f"a cache kept as {method.name} is a dynamic one: not with the KV cache off, the "
                                 "static cache or compiled decode")

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
        if self.kv_method != "full":
            parts.append(f"KV {self.kv_method}")
        if not self.chat_template:
            parts.append("raw")
        return ", ".join(parts)

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    @classmethod
    def admits(cls, name: str, value: object) -> bool:
        """Whether one setting may hold ``value`` by every rule its declaration and this class's own checks set (a
        remembered value is checked here), with what it ``needs`` on and the rest at their defaults."""
        setting = shape_of(cls, name).setting
        needs = setting.needs if setting is not None else ""
        try:
            cls(**{name: value, **({needs: True} if needs else {})})
        except (ParameterError, TypeError):
            return False
        return True


def _check_int(name: str, value: object, *, low: int, high: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ParameterError(f"{name} must be a whole number, got {value!r}")
    if value < low or (high is not None and value > high):
        bound = f"between {low} and {high:,}" if high is not None else f"at least {low}"
        raise ParameterError(f"{name} must be {bound}, got {value:,}")


def _check_float(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ParameterError(f"{name} must be a finite number, got {value!r}")


@dataclass(frozen=True)
class LoadSettings:
    """What a load takes, declared once like the run settings: the CLI's flags (``python -m engine`` and the
    window's command line), the Model box in Controls (labels, tooltips, choices, ranges), the window's load
    request (``app.requests.Load`` adds to it) and the settings file's checks read these fields.
    ``memory_budget`` is bytes (the CLI takes ``300MiB``; Controls shows GiB). It does not check itself when made:
    a source is whatever the user typed, judged by the loader with a message of its own."""

    model: Annotated[str, Text(4096), Setting(
        "--model", "Source", "'embedded' (SmolLM2-135M-Instruct), a Hugging Face folder, a .gguf file, a hub id "
        "such as HuggingFaceTB/SmolLM2-360M-Instruct, or a serving engine's address such as http://127.0.0.1:8080 "
        "(llama-server, vLLM, TGI, SGLang)")] = "embedded"
    device: Annotated[str, Text(8, DEVICES), Setting(
        "--device", "Device", "where the model runs: auto takes a GPU when there is one, else the CPU")] = "auto"
    dtype: Annotated[str, Text(8, DTYPES), Setting(
        "--dtype", "dtype", "the weights' format: auto measures which float is fastest here (once, then cached); "
        "int8 and int4 quantize the weights")] = "auto"
    trust_remote_code: Annotated[bool, Setting(
        "--trust-remote-code", "Allow this model's own code", "trust_remote_code: runs Python shipped with the "
        "model. Allowed per model: the window clears it when the source changes and never remembers it")] = False
    memory_budget: Annotated[int, Range(0, MAX_BYTES), Setting(
        "--memory-budget", "Memory budget", "at most this much of the weights in memory (per tier: the GPU, the "
        "CPU); the rest is offloaded to disk and read back at every step (the offloading lesson)", unit="bytes",
        special="no limit")] = 0
    deadline_s: Annotated[float, Range(1.0, MAX_DEADLINE_S), Setting(
        "--deadline", "Server deadline", "give up on a server run after this long, keeping what arrived",
        unit="s", step=1.0)] = DEADLINE_S
