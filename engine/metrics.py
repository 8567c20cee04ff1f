"""Serving engines' Prometheus ``/metrics`` pages, read into the few quantities KVScope plots.

Each engine names the same ideas differently and renames them between releases, so every name KVScope reads
is in ``ENGINES`` and nowhere else: per engine, per quantity, the names to try in order (newest first). A test
per engine reads a recorded page, so a renamed metric fails a test instead of silently drawing nothing.
A quantity an engine does not report stays absent (never zero).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from engine.errors import EngineError

# quantity -> what it means (the load panel's legend)
QUANTITIES = {
    "running": "requests being decoded",
    "waiting": "requests queued",
    "kv_usage": "KV cache in use (share of its capacity)",
    "prompt_tokens": "prompt tokens processed (total)",
    "generated_tokens": "tokens generated (total)",
    "cached_prompt_tokens": "prompt tokens served from the prefix cache (total)",
    "prefix_queries": "prompt tokens looked up in the prefix cache (total)",
}

ENGINES: dict[str, dict[str, tuple[str, ...]]] = {
    "llama.cpp": {
        "running": ("llamacpp:requests_processing",),
        "waiting": ("llamacpp:requests_deferred",),
        "kv_usage": ("llamacpp:kv_cache_usage_ratio",),          # older releases only
        "prompt_tokens": ("llamacpp:prompt_tokens_total",),
        "generated_tokens": ("llamacpp:tokens_predicted_total",),
        "cached_prompt_tokens": ("llamacpp:prompt_tokens_cached_total",),
    },
    "vLLM": {
        "running": ("vllm:num_requests_running",),
        "waiting": ("vllm:num_requests_waiting",),
        "kv_usage": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
        "prompt_tokens": ("vllm:prompt_tokens_total",),
        "generated_tokens": ("vllm:generation_tokens_total",),
        "cached_prompt_tokens": ("vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total"),
        "prefix_queries": ("vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries_total"),
    },
    "TGI": {
        "running": ("tgi_batch_current_size",),
        "waiting": ("tgi_queue_size",),
        "prompt_tokens": ("tgi_request_input_length_sum",),
        "generated_tokens": ("tgi_request_generated_tokens_sum",),
    },
    "SGLang": {
        "running": ("sglang:num_running_reqs",),
        "waiting": ("sglang:num_queue_reqs",),
        "kv_usage": ("sglang:token_usage",),
        "prompt_tokens": ("sglang:prompt_tokens_total",),
        "generated_tokens": ("sglang:generation_tokens_total",),
        "cached_prompt_tokens": ("sglang:cached_tokens_total",),
    },
}
PREFIXES = {"llamacpp:": "llama.cpp", "vllm:": "vLLM", "tgi_": "TGI", "sglang:": "SGLang"}
MAX_PAGE = 8 << 20                  # bytes: a metrics page larger than this is not one
_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)(\s+\S+)?$")


class MetricsError(EngineError):
    """The page is not Prometheus text, or not from an engine KVScope knows; one line."""


@dataclass(frozen=True)
class Reading:
    """One poll: the engine that answered and the quantities it reported (absent ones are not in ``values``)."""

    engine: str
    values: dict[str, float]


def parse(text: str) -> dict[str, float]:
    """Metric name -> value, summed over label sets (one engine, several GPUs or models, count as one server).
    Raises ``MetricsError`` for anything that is not Prometheus text exposition."""
    if len(text) > MAX_PAGE:
        raise MetricsError(f"the metrics page is {len(text) / 2**20:,.1f} MiB: not a Prometheus page")
    samples: dict[str, float] = {}
    bad = 0
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        match = _LINE.match(line)
        if match is None:
            bad += 1
            continue
        try:
            value = float(match.group(3))
        except ValueError:
            bad += 1
            continue
        if math.isfinite(value):
            samples[match.group(1)] = samples.get(match.group(1), 0.0) + value
    if not samples or bad > len(samples):
        first = next((ln.strip() for ln in text.splitlines() if ln.strip()), "")[:60]
        raise MetricsError(f"the metrics page is not Prometheus text (it starts {first!r})")
    return samples


def detect(samples: dict[str, float]) -> str:
    """Which engine wrote the page, by its metric prefix."""
    counts: dict[str, int] = {}
    for name in samples:
        for prefix, engine in PREFIXES.items():
            if name.startswith(prefix):
                counts[engine] = counts.get(engine, 0) + 1
    if not counts:
        raise MetricsError("the metrics page names none of the engines KVScope knows (llama.cpp, vLLM, TGI, "
                           "SGLang)")
    return max(counts, key=counts.__getitem__)


def read(text: str, engine: str | None = None) -> Reading:
    """The quantities of ``ENGINES`` found on the page (the engine detected unless given)."""
    samples = parse(text)
    engine = engine or detect(samples)
    names = ENGINES.get(engine)
    if names is None:
        raise MetricsError(f"KVScope does not know the metrics of {engine}")
    values = {}
    for quantity, candidates in names.items():
        found = next((samples[n] for n in candidates if n in samples), None)
        if found is not None:
            values[quantity] = found
    return Reading(engine, values)
