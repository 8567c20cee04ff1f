"""The summary in llama.cpp's vocabulary, which users already read (``prompt eval time``, ``eval time``)."""

from __future__ import annotations

from engine.facts import kvformula
from engine.facts.contention import busy_note
from engine.facts.events import ModelFacts, RunSummary


def quantity(v: float) -> str:
    """A large count in a table: ``1.23 G``, ``45.60 M``, ``789.0``."""
    if abs(v) >= 1e9:
        return f"{v / 1e9:,.2f} G"
    if abs(v) >= 1e6:
        return f"{v / 1e6:,.2f} M"
    return f"{v:,.1f}"


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


def kv_line(model: ModelFacts, check: kvformula.KVCheck) -> str:
    """Formula per token, what the cache tensors held (measured) beside the formula for those positions, what
    their storages have allocated where that is more, and the formula at full context. A cache kept quantized
    or evicted is smaller on purpose: its share of the formula is said instead."""
    fmt, full = kvformula.format_bytes, kvformula.full_context_kv_bytes(model)
    if not check.full:
        check_words = (f"kept as {check.method}: {check.share:.0%} of the formula's {fmt(check.predicted)} in full "
                       f"precision" if check.share is not None else f"kept as {check.method}")
    elif check.equal:
        check_words = "= the formula"
    else:
        check_words = f"but the formula says {fmt(check.predicted)}"
    storage = (f"; their storages have {fmt(check.allocated)} allocated (measured: a sliding layer's keys and values "
               "are views into a larger buffer)" if check.allocated else "")
    return (f"KV cache: {kvformula.formula_text(model)}; after {check.positions:,} positions the tensors hold "
            f"{fmt(check.held)} (measured, {check_words}){storage}; " + (
                f"at full context ({kvformula.context_text(model)}) = {fmt(full)} (computed)"
                if model.context_declared else f"full context: {kvformula.context_text(model)}"))


def report(model: ModelFacts, s: RunSummary, kv_on: bool = True, kv_method: str = "full") -> str:
    lines = timing_lines(s)
    lines.append(f"TTFT = {s.ttft_ms:.2f} ms (tokenize {s.tokenize_ms:.2f} ms + prefill + first sample)")
    check = kvformula.check_kv(model, s.kv_bytes or 0, s.kv_tokens or 0, s.kv_allocated_bytes, method=kv_method)
    lines.append(kv_line(model, check) if kv_on else
                 f"KV cache: off (every step recomputed all {s.prompt_tokens + s.decode_runs:,} positions); "
                 f"{kvformula.formula_text(model)} if it were on")
    if s.compile_ms:
        where = ("beside the eager steps before it" if s.compiled_from_step > 1 else "before the first decode step")
        what = ("reading the compiled decode graph built earlier" if s.compile_loaded else
                "building the compiled decode graph")
        lines.append(f"compile: {what} took {s.compile_ms:,.0f} ms, {where} (not in eval time)")
    if s.compiled_from_step:
        lines.append(f"decode compiled from step {s.compiled_from_step:,}")
    if s.waited_ms:
        lines.append(f"waited {s.waited_ms:,.0f} ms paused, stepping or in slow motion "
                     "(in total time, not in eval time)")
    note = busy_note(s.cpu_share)
    if note:
        lines.append(f"note: {note}")
    lines += [f"note: {note}" for note in s.notes]
    return "\n".join(lines)
