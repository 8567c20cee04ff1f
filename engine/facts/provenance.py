"""Where every figure of a run comes from, in one table: each is measured here (read from this machine by the wall
clock or from the tensors themselves), reported by a server (its own words, under its own names), computed (a
formula over known sizes), achieved (a formula over a measured time) or estimated. The window's "Where these
figures come from" view and ``python -m engine --json`` show the same rows, so a label is a promise kept in one
place."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from engine.facts import kvformula
from engine.facts.contention import busy
from engine.facts.events import HardwarePeaks, ModelFacts, RunSummary, ServerFacts
from engine.facts.kvformula import format_bytes

MEASURED, REPORTED, COMPUTED, ACHIEVED, ESTIMATED = (
    "measured here", "reported by the server", "computed", "achieved", "estimated")
KINDS = (MEASURED, REPORTED, COMPUTED, ACHIEVED, ESTIMATED)


@dataclass(frozen=True)
class FigureSource:
    figure: str
    value: str
    kind: str                # one of KINDS
    source: str              # from what, in words
    busy: bool = False       # measured while other programs competed for the cores

    def as_dict(self) -> dict:
        return asdict(self)


def run_sources(model: ModelFacts | ServerFacts, s: RunSummary, peaks: HardwarePeaks | None = None,
                kv_on: bool = True) -> list[FigureSource]:
    """The figures a run shows, each with its kind and source; a figure the run does not have is not listed."""
    if isinstance(model, ServerFacts):
        return _served(model, s)
    hot = busy(s.cpu_share)
    rows = [FigureSource("time to first token", f"{s.ttft_ms:,.1f} ms", MEASURED,
                         "the wall clock in this process, from the prompt handed to the engine to the first token "
                         "handed to the window (tokenize + prefill + first sample)", hot)]
    if s.prompt_tokens is not None:
        rows.append(FigureSource("prompt tokens", f"{s.prompt_tokens:,}", MEASURED, "the tokenizer's count"))
    if s.reused_tokens:
        rows.append(FigureSource("prompt tokens reused from an earlier turn", f"{s.reused_tokens:,}", MEASURED,
                                 "positions kept in the cache from the previous turn"))
    if s.prefill_ms:
        rows.append(FigureSource("prefill time", f"{s.prefill_ms:,.1f} ms", MEASURED,
                                 "the wall clock around the prompt's forward pass(es)", hot))
        if s.prefill_tok_s:
            rows.append(FigureSource("prefill speed", f"{s.prefill_tok_s:,.1f} tok/s", ACHIEVED,
                                     "prompt tokens / the measured prefill time", hot))
    if s.decode_runs and s.decode_ms > 0:
        rows.append(FigureSource("decode time", f"{s.decode_ms:,.1f} ms", MEASURED,
                                 "the wall clock around each decode step (forward + sampling), summed; time paused "
                                 "or single-stepped is not in it", hot))
        rows.append(FigureSource("decode speed", f"{s.decode_tok_s:,.2f} tok/s", ACHIEVED,
                                 "decode steps / the measured decode time", hot))
    if s.compile_ms:
        rows.append(FigureSource("compile time", f"{s.compile_ms / 1000:,.1f} s", MEASURED,
                                 "the wall clock around building (or reading) the compiled graph, never in decode"))
    if kv_on and s.kv_bytes:
        rows.append(FigureSource("KV cache held", format_bytes(s.kv_bytes), MEASURED,
                                 "the cache's key and value tensors, their sizes read from their metadata"))
    if kv_on and model.kv_layers:
        rows.append(FigureSource("KV cache at full context", format_bytes(kvformula.full_context_kv_bytes(model)),
                                 COMPUTED, "2 x layers x KV heads x head dim x positions x bytes, over the model's "
                                 f"{kvformula.full_context_positions(model):,}-position window"))
    if s.cpu_share is not None:
        rows.append(FigureSource("CPU share", f"{s.cpu_share:.0%}", MEASURED,
                                 "this process's CPU time over the wall clock's, per compute thread: below 90%, other "
                                 "programs competed for the cores"))
    if peaks is not None:
        rows += _peaks(peaks)
    return rows


def _peaks(peaks: HardwarePeaks) -> list[FigureSource]:
    hot = busy(peaks.cpu_share)
    when = f" (measured {peaks.measured})" if peaks.measured else ""
    return [FigureSource("peak compute", f"{peaks.flops_per_s / 1e9:,.0f} GFLOP/s", MEASURED,
                         f"a matrix product at the model's shapes on this {peaks.device}{when}", hot),
            FigureSource("memory bandwidth", f"{peaks.bytes_per_s / 1e9:,.1f} GB/s", MEASURED,
                         f"a large copy on this {peaks.device}{when}", hot),
            FigureSource("decode and prefill ceilings", "in the timing panel", COMPUTED,
                         "the model's bytes and operations per token over the measured peaks (a roofline)")]


def _served(model: ServerFacts, s: RunSummary) -> list[FigureSource]:
    rows = [FigureSource("time to first token", f"{s.ttft_ms:,.1f} ms", MEASURED,
                         f"this client's clock, from the request sent to {model.engine} to the first piece arriving "
                         "(queueing, HTTP and the server's prefill together)")]
    if s.decode_runs and s.decode_ms > 0:
        rows.append(FigureSource("decode speed", f"{s.decode_tok_s:,.2f} tok/s", ACHIEVED,
                                 "pieces after the first / the time between their arrivals, on this client's clock"))
    if s.prompt_tokens is not None:
        rows.append(FigureSource("prompt tokens", f"{s.prompt_tokens:,}", REPORTED,
                                 f"{model.engine}'s own count in its answer"))
    if s.server_cached_tokens is not None:
        rows.append(FigureSource("prompt tokens from its prefix cache", f"{s.server_cached_tokens:,}", REPORTED,
                                 f"{model.engine}'s answer"))
    for name, value in sorted(s.server_timings.items()):
        rows.append(FigureSource(name, f"{value:,}", REPORTED, f"{model.engine}'s answer, under its own name"))
    return rows
