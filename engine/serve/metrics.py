"""Serving engines' Prometheus ``/metrics`` pages, read into the few quantities KVScope plots.

Each engine names the same ideas differently and renames them between releases, so every name KVScope reads
is in ``ENGINES`` and nowhere else: per engine, per quantity, the names to try in order (newest first). A test
per engine reads a recorded page, so a renamed metric fails a test instead of silently drawing nothing.
A quantity an engine does not report stays absent (never zero).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from engine.facts.errors import EngineError

# quantity -> what it means (the load panel's legend)
QUANTITIES = {
    "running": "requests being decoded",
    "waiting": "requests queued",
    "kv_usage": "KV cache in use (share of its capacity)",
    "prompt_tokens": "prompt tokens processed (total)",
    "generated_tokens": "tokens generated (total)",
    "cached_prompt_tokens": "prompt tokens served from the prefix cache (total)",
    "prefix_queries": "prompt tokens looked up in the prefix cache (total)",
    "transferred_prompt_tokens": "prompt tokens whose KV another instance computed and handed over (total)",
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
        "transferred_prompt_tokens": ("vllm:external_prefix_cache_hits_total",),     # a KV connector's loads
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
_LABEL = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*,?')
ENGINE_LABELS = ("engine", "dp_rank", "engine_id")   # how a data-parallel server tells its engines apart
SHARES = ("kv_usage",)                               # fractions of a capacity: one engine's, never summed


class MetricsError(EngineError):
    """The page is not Prometheus text, or not from an engine KVScope knows; one line."""


@dataclass(frozen=True)
class Reading:
    """One poll: the engine that answered and the quantities it reported (absent ones are not in ``values``).
    ``values`` is the server as a whole: counts summed over its engines, a share (KV use) only when it has one
    engine; ``engines``: each engine's own values where the page has several (vLLM's data-parallel engines, told
    apart by their ``engine`` label); ``notes``: what was refused as absent, and why."""

    engine: str
    values: dict[str, float]
    engines: dict[str, dict[str, float]] = field(default_factory=dict)
    notes: tuple[str, ...] = ()


Samples = dict[str, dict[str, list[float]]]         # metric name -> engine key -> every value its lines gave


def parse(text: str) -> Samples:
    """Metric name -> engine (its label, "" for a server with one) -> the values the page gives for it, one per
    line: label sets beyond the engine (a model's name, a GPU) are summed by the reader, duplicates are kept as
    such so the reader can refuse them. Raises ``MetricsError`` for anything that is not Prometheus text."""
    if len(text) > MAX_PAGE:
        raise MetricsError(f"the metrics page is {len(text) / 2**20:,.1f} MiB, larger than the "
                           f"{MAX_PAGE / 2**20:,.0f} MiB a metrics page may be: not read")
    samples: Samples = {}
    seen: dict[tuple[str, str], int] = {}
    bad = lines = 0
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
        labels = _labels(match.group(2) or "{}")
        if labels is None:
            bad += 1
            continue
        lines += 1
        if not math.isfinite(value):
            continue
        key = next((labels[k] for k in ENGINE_LABELS if k in labels), "")
        seen[(match.group(1), match.group(2) or "")] = seen.get((match.group(1), match.group(2) or ""), 0) + 1
        per_engine = samples.setdefault(match.group(1), {})
        per_engine.setdefault(key, []).append(value if seen[(match.group(1), match.group(2) or "")] == 1 else
                                              math.nan)          # a duplicate line: marked, for the reader
    if not samples or bad > lines:
        first = next((ln.strip() for ln in text.splitlines() if ln.strip()), "")[:60]
        raise MetricsError(f"the metrics page is not Prometheus text (it starts {first!r})")
    return samples


def _labels(block: str) -> dict[str, str] | None:
    """``{name="value",...}`` read left to right, each pair where the last ended: linear in the line (a search
    for pairs anywhere in it retried from every character, and a 70 KB line took 27 s), None if malformed."""
    inner, at, labels = block[1:-1], 0, {}
    while at < len(inner):
        pair = _LABEL.match(inner, at)
        if pair is None or pair.end() == at:
            return None
        labels[pair.group(1)] = pair.group(2)
        at = pair.end()
    return labels


def detect(samples: Samples) -> str:
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


MOST = {"running": 1e7, "waiting": 1e7}             # requests in flight at once: past this, not a real server
MOST_TOKENS = 1e18                                   # a token counter past this is not one either


def _possible(quantity: str, value: float) -> bool:
    if value < 0:
        return False
    if quantity in SHARES:
        return value <= 1.0
    return value <= MOST.get(quantity, MOST_TOKENS)


def read(text: str, engine: str | None = None) -> Reading:
    """The quantities of ``ENGINES`` found on the page (the engine detected unless given), per engine and for the
    server as a whole; a quantity given twice for the same labels, or a value it cannot take (a negative count,
    a share above 1), is refused as absent with a note."""
    samples = parse(text)
    engine = engine or detect(samples)
    names = ENGINES.get(engine)
    if names is None:
        raise MetricsError(f"KVScope does not know the metrics of {engine}")
    per_engine: dict[str, dict[str, float]] = {}
    notes: list[str] = []
    for quantity, candidates in names.items():
        name = next((n for n in candidates if n in samples), None)
        if name is None:
            continue
        found = samples[name]
        if any(math.isnan(v) for values in found.values() for v in values):
            repeats = sum(len(values) for values in found.values())
            notes.append(f"{name} is given {repeats:,} times for the same labels: not read")
            continue
        totals = {key: sum(values) for key, values in found.items()}
        wrong = next((v for v in totals.values() if not _possible(quantity, v)), None)
        if wrong is not None:
            what = ("a share of 0 to 1" if quantity in SHARES else
                    f"a count of 0 to {MOST.get(quantity, MOST_TOKENS):g}")
            notes.append(f"{name} is {wrong:g}, which it cannot be ({what}): not read")
            continue
        for key, value in totals.items():
            per_engine.setdefault(key, {})[quantity] = value
    values: dict[str, float] = {}
    for quantity in names:
        given = [v[quantity] for v in per_engine.values() if quantity in v]
        if not given:
            continue
        if quantity in SHARES and len(given) > 1:
            notes.append(f"{quantity.replace('_', ' ')}: {len(given)} engines, each with its own cache: shown apart")
            continue
        values[quantity] = sum(given)
    engines = per_engine if len(per_engine) > 1 else {}
    return Reading(engine, values, engines, tuple(notes))
