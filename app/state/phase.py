"""What is known about a run or an experiment *now*, as one value every view reads, so no view composes its words
from whatever partial state it finds.

A run goes nothing yet → prefill running → decoding (token N) → stopped / finished (reason) / failed, or a
replayed trace ends first (incomplete). Its figures exist one at a time: TTFT with the first token, the
prefill's time when its pass has ended, a decode rate once one decode step is timed. ``RunFigures`` holds each
as a number or None, so a caption, a summary, a status label or a legend can only draw a figure that exists,
and "measured" is never attached to nothing. An experiment goes running (point k of n) → stopped after k of n
/ finished / failed; ``ExperimentPhase`` says so, with how many points were kept.

Plain Python: no Qt, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from app.state.store import ExperimentRecord, RunRecord
from engine.facts.events import RunFailed, RunFinished

NOTHING, PREFILL, PREFILLED, DECODING, PAUSED, STEPPING, STOPPED, FINISHED, FAILED, INCOMPLETE = (
    "nothing", "prefill", "prefilled", "decoding", "paused", "stepping", "stopped", "finished", "failed",
    "incomplete")
ENDED = (STOPPED, FINISHED, FAILED, INCOMPLETE)
LIVE = (PREFILL, PREFILLED, DECODING, PAUSED, STEPPING)


def plural(count: int, one: str, many: str | None = None) -> str:
    """``1 token``, ``2 tokens``, with thousands separators."""
    return f"{count:,} {one if count == 1 else (many or one + 's')}"


def rate(tok_s: float) -> str:
    """Tokens per second with about three significant digits: a slow rate is 0.0412, never "0.0"."""
    if tok_s >= 100:
        return f"{tok_s:,.0f}"
    if tok_s >= 10:
        return f"{tok_s:.1f}"
    if tok_s >= 1:
        return f"{tok_s:.2f}"
    return f"{tok_s:.3g}"


def per_token(ms: float) -> str:
    """Time per token as llama.cpp prints it beside the rate: ms, or seconds past a second."""
    return f"{ms / 1000:,.2f} s/token" if ms >= 1000 else f"{ms:,.1f} ms/token"


def decode_rate(tok_s: float) -> str:
    """``27.1 tok/s, 36.9 ms/token``: the rate and its reciprocal, so a slow one reads as what it is."""
    return f"{rate(tok_s)} tok/s, {per_token(1000.0 / tok_s)}" if tok_s > 0 else "no decode step timed"


def duration(ms: float) -> str:
    return f"{ms / 1000:,.1f} s" if ms >= 1000 else f"{ms:,.0f} ms"


@dataclass(frozen=True)
class RunFigures:
    """A run's figures that exist now; None for one that does not exist yet (or cannot: a server shows no
    prefill). ``decode_runs`` counts decode steps timed (the first token came from the prefill)."""

    ttft_ms: float | None = None
    prompt_tokens: int | None = None
    prefill_ms: float | None = None
    prefill_tok_s: float | None = None
    generated: int = 0
    decode_runs: int = 0
    decode_ms: float | None = None
    decode_tok_s: float | None = None
    kv_bytes: int | None = None
    cpu_share: float | None = None


def figures(run: RunRecord | None) -> RunFigures:
    if run is None:
        return RunFigures()
    s = run.summary(with_text=False)
    first = run.n_steps > 0
    prefilled = run.prefill is not None and not run.remote
    decoded = s.decode_runs > 0 and s.decode_ms > 0
    return RunFigures(
        ttft_ms=s.ttft_ms if first else None,
        prompt_tokens=s.prompt_tokens,
        prefill_ms=s.prefill_ms if prefilled else None,
        prefill_tok_s=s.prefill_tok_s if prefilled and s.prefill_ms else None,
        generated=s.generated_tokens, decode_runs=s.decode_runs,
        decode_ms=s.decode_ms if decoded else None,
        decode_tok_s=s.decode_tok_s if decoded else None,
        kv_bytes=s.kv_bytes if prefilled else None,
        cpu_share=s.cpu_share if run.finished else (run.steps[-1].cpu_share if run.steps else None))


FINISH_WORDS = {"eos": "the model ended its answer (end-of-sequence token)",
                "max_tokens": "reached the limit of {limit} new tokens",
                "context_full": "the context window is full ({context} positions)"}


@dataclass(frozen=True)
class RunPhase:
    """Where a run is. ``tokens``: generated so far (the first from the prefill); ``limit``: its max new tokens;
    ``reason``: a finished run's reason, a failed one's message; ``elapsed_ms``: since it started;
    ``released``: a failed run's memory was given back (its cache is gone); ``replayed``: the trace it was read
    from ("" for a run of this session)."""

    name: str
    tokens: int = 0
    limit: int = 0
    reason: str = ""
    elapsed_ms: float = 0.0
    prompt_tokens: int = 0
    context: int = 0
    released: bool = False
    replayed: str = ""
    prefill_ms: float | None = None
    steering: str = ""
    passes: str = "in one forward pass"     # how the prompt goes through (prefill_passes)

    @property
    def ended(self) -> bool:
        return self.name in ENDED

    @property
    def running(self) -> bool:
        return self.name in LIVE

    @property
    def held(self) -> bool:
        """Paused, or waiting for the next single step: no token comes until the user asks."""
        return self.name in (PAUSED, STEPPING)

    def words(self) -> str:
        """The phase in a few words, as a status line or a caption's end says it."""
        if self.name == NOTHING:
            return "no run yet"
        if self.name == PREFILL:
            then = {"paused": "; it pauses after its first token", "stepping": "; then one token per F10"}.get(
                self.steering, "")
            return (f"prefill running: {plural(self.prompt_tokens, 'prompt token')} {self.passes}, "
                    f"{elapsed(self.elapsed_ms)} so far{then}")
        if self.name == PREFILLED:
            return (f"prefill done in {duration(self.prefill_ms or 0.0)}: choosing the first token")
        if self.name == DECODING:
            return f"decoding: token {self.tokens:,} of at most {self.limit:,}"
        if self.name == PAUSED:
            return (f"paused after token {self.tokens:,} of at most {self.limit:,} (F9 resumes, F10 steps one "
                    "token)")
        if self.name == STEPPING:
            return (f"step by step: token {self.tokens:,} of at most {self.limit:,}, waiting for F10 (F9 runs "
                    "on)")
        if self.name == STOPPED:
            if not self.tokens:
                return "stopped during the prefill: nothing was measured"
            return f"stopped after {plural(self.tokens, 'token')}; its figures are kept"
        if self.name == FINISHED:
            why = FINISH_WORDS.get(self.reason, self.reason).format(limit=f"{self.limit:,}",
                                                                    context=f"{self.context:,}")
            return f"finished after {plural(self.tokens, 'token')}: {why}"
        if self.name == FAILED:
            return f"failed after {plural(self.tokens, 'token')}: {self.reason}"
        if self.name == INCOMPLETE:
            return f"the trace ends after {plural(self.tokens, 'token')}, before the run did"
        return self.name


def held_line(phase: RunPhase) -> str:
    """A held run's state in the words every view of it uses (empty for any other phase): a panel that shows a
    step or the cache of a paused run says it is paused, as the strip and the captions do."""
    return phase.words() if phase.held else ""


def elapsed(ms: float) -> str:
    """A running clock's reading, always in tenths of a second, so it reads the same wherever it is shown."""
    return f"{ms / 1000:,.1f} s"


def prefill_passes(run: RunRecord, forward: bool = True) -> str:
    """How the prompt goes through the model: in one pass (the lesson's prefill), or, a prompt too long for one
    pass that a stop could interrupt within a second, in several into one cache, said as such."""
    one = "in one forward pass" if forward else "in one pass"
    if run.prefill is not None:
        passes = getattr(run.prefill, "passes", 1)
        if getattr(run.prefill, "compiled", False):       # the first pass through the compiled prefill package
            one = "in one compiled forward pass" if forward else "in one compiled pass"
            return one if passes <= 1 else f"in {passes} passes, the first compiled (so Stop works between them)"
        return one if passes <= 1 else f"in {passes} passes (so Stop works between them)"
    if getattr(run.started, "prefill_chunk", 0):
        return "in passes of half a second or less (Stop works between them)"
    return one


def run_phase(run: RunRecord | None, now: float | None = None) -> RunPhase:
    """The phase of ``run`` (None: nothing yet). ``now``: the run's clock by default, for the elapsed time."""
    if run is None:
        return RunPhase(NOTHING)
    params = run.started.params
    context = getattr(run.model, "max_context", None) or getattr(run.model, "context", None) or 0
    prefill_ms = run.prefill.forward_ms if run.prefill is not None and not run.remote else None
    base = dict(tokens=run.n_steps, limit=params.max_new_tokens, prompt_tokens=run.prompt_tokens, context=context,
                replayed=run.source, prefill_ms=prefill_ms, steering=run.steering, passes=prefill_passes(run))
    if run.incomplete:
        return RunPhase(INCOMPLETE, **base)
    end = run.end
    if isinstance(end, RunFailed):
        released = end.error == "out_of_memory" or "Memory was released" in end.message
        return RunPhase(FAILED, reason=end.message, elapsed_ms=end.t_ms, released=released, **base)
    if isinstance(end, RunFinished):
        name = STOPPED if end.reason == "stopped" else FINISHED
        return RunPhase(name, reason=end.reason, elapsed_ms=end.t_ms, **base)
    elapsed_ms = ((now if now is not None else run.clock()) - run.arrived) * 1000.0 + run.started.t_ms
    if not run.n_steps:
        name = PREFILLED if run.prefill is not None else PREFILL
    elif run.steering == "paused":
        name = PAUSED
    elif run.steering == "stepping":
        name = STEPPING
    else:
        name = DECODING
    return RunPhase(name, elapsed_ms=elapsed_ms, **base)


RUNNING_EXPERIMENT = "running"
STOPPED_BEFORE_ANYTHING = "stopped before its first measurement: nothing was measured"
STOPPED_PART_WAY = "stopped before its first point: what it recorded until then is drawn, unfinished"


@dataclass(frozen=True)
class ExperimentPhase:
    """Where an experiment is: ``done`` of ``total`` by its last progress report, ``points`` measured,
    ``observations``: the lesson's own events (its view draws them before any point: the paged lesson's block
    tables), so a stop before the first point never says "nothing" over a drawn chart."""

    name: str
    done: int = 0
    total: int = 0
    points: int = 0
    message: str = ""
    elapsed_ms: float = 0.0      # since it started, by the window's clock (running: a clock that moves)
    observations: int = 0

    @property
    def ended(self) -> bool:
        return self.name in ENDED

    @property
    def measured(self) -> bool:
        """Something was measured: a "measured" label or a busy note may be shown."""
        return self.points > 0

    def words(self) -> str:
        if self.name == NOTHING:
            return "not run yet"
        if self.name == RUNNING_EXPERIMENT:
            # No total yet: starting, unless its message says what it does (a watch has no count to reach).
            where = f"{self.done:,} of {self.total:,}" if self.total else "" if self.message else "starting"
            return f"running for {elapsed(self.elapsed_ms)}: " + " · ".join(p for p in (where, self.message) if p)
        if self.name == STOPPED:
            if not self.points:
                return STOPPED_PART_WAY if self.observations else STOPPED_BEFORE_ANYTHING
            return f"stopped after {self.done:,} of {self.total:,}; {plural(self.points, 'point')} measured, kept"
        if self.name == FAILED:
            return f"failed: {self.message}"
        return "finished"


def experiment_phase(record: ExperimentRecord | None, now: float | None = None) -> ExperimentPhase:
    """Where ``record`` is; ``now``: the window's clock for a running one's elapsed time (its own by default)."""
    if record is None:
        return ExperimentPhase(NOTHING)
    progress = record.progress
    done, total = (progress.done, progress.total) if progress is not None else (0, 0)
    points = len([p for p in record.points if p.series != "skipped"])
    end = record.end
    if end is None:
        ran = ((now if now is not None else record.clock()) - record.arrived) * 1000.0
        return ExperimentPhase(RUNNING_EXPERIMENT, done, total, points, progress.message if progress else "",
                               max(ran, 0.0))
    if not hasattr(end, "reason"):
        return ExperimentPhase(FAILED, done, total, points, getattr(end, "message", ""))
    stopped = end.reason == "stopped" or (record.result is not None and record.result.incomplete)
    return ExperimentPhase(STOPPED if stopped else FINISHED, done, total, points,
                           observations=record.observations)


def run_line(run: RunRecord | None) -> str:
    """The line under a reply, as LM Studio writes it: TTFT, the decode rate with ms per token, and how the run
    ended (or where it is), with only the figures that exist."""
    if run is None:
        return ""
    phase, f = run_phase(run), figures(run)
    client = " (client)" if run.remote else ""
    parts = []
    if f.ttft_ms is not None:
        parts.append(f"TTFT {f.ttft_ms:,.0f} ms{client}")
    if f.decode_tok_s is not None:
        parts.append(f"decode {decode_rate(f.decode_tok_s)}{client}")
    if parts:
        parts[-1] += " (measured)"
    return " · ".join([*parts, phase.words()])
