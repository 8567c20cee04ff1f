"""The summary in llama.cpp's vocabulary, which users already read (``prompt eval time``, ``eval time``)."""

from __future__ import annotations

from engine import kvcache
from engine.events import ModelFacts, RunSummary


def timing_lines(s: RunSummary) -> list[str]:
    return [
        _line("prompt eval time", s.prefill_ms, s.prompt_tokens, "tokens"),
        _line("eval time", s.decode_ms, s.decode_runs, "runs  "),
        f"{'total time':>16} = {s.total_ms:10.2f} ms / {s.prompt_tokens + s.decode_runs:5d} tokens",
    ]


def _line(label: str, ms: float, count: int, unit: str) -> str:
    per = ms / count if count else 0.0
    rate = 1000.0 * count / ms if ms > 0 else 0.0
    return (f"{label:>16} = {ms:10.2f} ms / {count:5d} {unit} ({per:8.2f} ms per token, "
            f"{rate:8.2f} tokens per second)")


def kv_line(model: ModelFacts, tokens_held: int, bytes_held: int) -> str:
    """Formula per token, what the cache measured holding, and the formula at full context."""
    full = kvcache.full_context_kv_bytes(model)
    return (f"KV cache: {kvcache.formula_text(model)}; holds {tokens_held:,} tokens = "
            f"{kvcache.format_bytes(bytes_held)}; at full context ({model.max_context:,}) = "
            f"{kvcache.format_bytes(full)}")


def report(model: ModelFacts, s: RunSummary, kv_on: bool = True) -> str:
    lines = timing_lines(s)
    lines.append(f"TTFT = {s.ttft_ms:.2f} ms (tokenize {s.tokenize_ms:.2f} ms + prefill + first sample)")
    lines.append(kv_line(model, s.kv_tokens, s.kv_bytes) if kv_on else
                 f"KV cache: off (every step recomputed all {s.prompt_tokens + s.decode_runs:,} positions); "
                 f"{kvcache.formula_text(model)} if it were on")
    return "\n".join(lines)
