"""Lesson: make the cache smaller, and see what it costs. The same prompt and continuation under each cache:
full precision (the reference), quantized (fp8; quanto and HQQ 2- and 4-bit where installed) and evicted
(StreamingLLM's sinks and window; H2O's most attended positions), measured per step teacher-forced on the
reference's tokens, so every cache sees the same context: the bytes it holds (read from its tensors: packed data
and scales, the full-precision residual counted as such), the KL divergence of its next-token distribution from
the reference's, whether its top token agrees; then, free-running, the first token where its answer departs.
Beside them, one layer's key channels (their outliers) and the 4-bit error with and without a Hadamard rotation.

The decode time of each is measured too, and is this CPU's: a quantized cache here is dequantized whole at every
step in Python, which a GPU kernel does not do; the time says nothing of what a fused kernel would cost.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Any

from engine.facts import kv_methods, kvformula
from engine.facts.errors import ParameterError
from engine.facts.events import ExperimentPoint, LessonResult, LessonSettings
from engine.facts.fields import MAX_PROMPT, Bytes, Column, Count, Items, Key, Number, Range, Setting, Text
from engine.facts.vocabulary import LessonPoint, SkippedPoint
from engine.run.experiment import Experiment, Lesson
from engine.run.model_session import ModelSession

METHODS = ("full", "fp8", "quanto4", "quanto2", "hqq4", "sinks:4+60", "h2o:64")
MAX_METHODS = 12
MAX_POSITIONS = 4096
NAME_WIDTH = 54


@dataclass(frozen=True)
class CompressionSettings(LessonSettings):
    kind = "kv-compression"

    methods: Annotated[tuple[Annotated[str, Text(32)], ...], Items(MAX_METHODS), Setting(
        "--methods", "Caches", "the caches to compare, separated by commas: full, fp8, quanto4, quanto2, hqq4, "
        "sinks:S+W, h2o:N")] = METHODS
    new_tokens: Annotated[int, Range(2, 512), Setting(
        "--tokens", "Steps compared", "tokens of the reference's continuation each cache is fed", "tokens"),
        Key("M", factor=2.0)] = 48
    prompt: Annotated[str, Text(MAX_PROMPT), Setting(
        "--prompt", "Text", "the text every cache is fed, as raw text (default: the sample long document)")] \
        | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.methods:
            raise ParameterError("methods must name at least one cache")
        for name in self.methods:
            kv_methods.parse_method(name)


@dataclass(frozen=True)
class MethodFigures:
    name: Annotated[str, Text(32)]
    words: Annotated[str, Text(128)]
    bytes: Bytes                         # held after the last step (measured from the tensors)
    ratio: Number                        # the reference's bytes over these
    kl_mean: Number                      # nats, per step (measured)
    kl_max: Number
    agreement: Number                    # share of steps whose top token is the reference's
    departure: Count | None              # free-running: the first token that differs (None: none did)
    decode_ms: Number                    # median teacher-forced step (measured, this CPU)
    full_share: Annotated[tuple[Number, ...], Items(MAX_POSITIONS)] = ()        # per position: layers holding it
    quantized_share: Annotated[tuple[Number, ...], Items(MAX_POSITIONS)] = ()   # in full / quantized


def _departure(position: float) -> str:
    return f"token {int(position) + 1}"


@dataclass(frozen=True)
class MethodPoint(LessonPoint):
    """One way of keeping the cache (``index``: its place in the settings' methods): the bytes it held, how much
    fewer than full, the KL it cost over the teacher-forced steps, the top-1 agreement, where free-running parted
    from the reference (None: never), and its decode step on this CPU."""

    series = "method"

    index: Annotated[int, Column("cache", "{:d}")]              # a table names it (``settings.methods[index]``)
    bytes: Annotated[int, Column("bytes held", show=kvformula.format_bytes)]
    ratio: Annotated[float, Column("fewer bytes", "{:,.2f}x")]
    kl_mean: Annotated[float, Column("KL mean (nats)", "{:.2e}")]
    kl_max: Annotated[float, Column("KL max", "{:.2e}")]
    agreement: Annotated[float, Column("top-1 agrees", "{:.1%}")]
    departure: Annotated[int | None, Column("free-running departs at", show=_departure)]
    decode_ms: Annotated[float, Column("ms/step (this CPU)", "{:,.1f}")]


@dataclass(frozen=True)
class StepPoint(LessonPoint):
    """One teacher-forced step of one method (``method``: its index): KL from the full cache, whether the top-1
    token agreed, and the bytes held."""

    series = "step"

    method: int
    step: int
    kl: float
    agree: bool
    bytes: int


@dataclass(frozen=True)
class ChannelPoint(LessonPoint):
    """One key channel of the watched layer: its largest |value| as written, and after a Hadamard rotation."""

    series = "channel"

    channel: int
    absmax: float
    absmax_rotated: float | None = None


@dataclass(frozen=True)
class CompressionResult(LessonResult):
    kind = "kv-compression"

    methods: Annotated[tuple[MethodFigures, ...], Items(MAX_METHODS)] = ()
    skipped: Annotated[tuple[Annotated[str, Text(512)], ...], Items(MAX_METHODS)] = ()
    prompt_tokens: Count = 0
    steps: Count = 0
    channel_layer: Count = 0
    int4_error_plain: Number | None = None      # 4-bit groups of 32 on that layer's keys: relative error
    int4_error_rotated: Number | None = None    # ... after a Hadamard rotation of each head's channels


def default_prompt() -> str:
    """A real document of a few hundred tokens: longer than the eviction budgets, so they evict."""
    from engine.store.resources import sample_prompts

    return dict(sample_prompts())["long document"]


def _log_probs(logits: Any) -> Any:
    import torch

    return torch.log_softmax(logits.float(), dim=-1)


def _kl(reference: Any, other: Any) -> float:
    """KL(reference || other) in nats, both log-probabilities over the vocabulary."""
    import torch

    return max(float(torch.sum(reference.exp() * (reference - other))), 0.0)


class _Pass:
    """Forward passes through one method's cache, positions given explicitly (eviction keeps keys at their own
    positions), eviction applied after each, attention captured for the methods that score by it."""

    def __init__(self, session: ModelSession, method: Any) -> None:
        from engine.model import kv_compress

        self.session, self.method = session, method
        self.cache = kv_compress.new_cache(session.model, method)
        self.evictor = (kv_compress.Evictor(method, session.facts.num_layers) if method.kind == "evicted" else None)
        self.capture = session.attention_capture() if method.heavy else None
        self.position = 0

    def feed(self, ids: list[int]) -> Any:
        import torch

        from engine.model import kvcache

        device = self.session.device
        positions = torch.arange(self.position, self.position + len(ids), device=device)[None]
        if self.capture is not None:
            self.capture.active = True
        try:
            out = kvcache.forward(self.session.model, torch.tensor([ids], device=device), self.cache,
                                  positions=positions)
        finally:
            if self.capture is not None:
                self.capture.active = False
        self.position += len(ids)
        if self.evictor is not None:
            rows = dict(self.capture.rows) if self.capture is not None else None
            if self.capture is not None:
                self.capture.rows.clear()
            self.evictor.after_pass(self.cache, self.position, rows)
        return out.logits[0, -1]


def run(experiment: Experiment, settings: CompressionSettings) -> CompressionResult:
    import torch

    from engine.facts.contention import LoadMeter
    from engine.model import kv_compress

    session = experiment.session
    prompt = session.encode(settings.prompt or default_prompt(), chat_template=False)
    steps = settings.new_tokens
    methods = [kv_methods.parse_method(name) for name in settings.methods]
    total = len(methods) + 1
    experiment.progress(0, total, f"the reference: {len(prompt):,} prompt tokens, then {steps} greedy tokens")
    meter = LoadMeter()
    meter.start()
    with torch.inference_mode():
        reference = _Pass(session, kv_methods.parse_method("full"))
        logits = reference.feed(prompt)
        tokens, ref_logp = [], []
        for _ in range(steps):
            if experiment.cancelled:
                return CompressionResult(incomplete=True)
            ref_logp.append(_log_probs(logits))
            tokens.append(int(torch.argmax(logits)))
            logits = reference.feed([tokens[-1]])
        ref_bytes = kv_compress.held_bytes(reference.cache)
        layer = session.facts.num_layers // 2
        keys = reference.cache.layers[layer].keys[0]                   # [kv heads, positions, head dim]
        rotation = kv_compress.hadamard(keys.shape[-1], keys.device) if keys.shape[-1] & (keys.shape[-1] - 1) == 0 \
            else None
        plain_error = kv_compress.int4_error(keys)
        rotated = keys.float() @ rotation if rotation is not None else None
        rotated_error = kv_compress.int4_error(rotated) if rotated is not None else None
        absmax = keys.float().abs().amax(dim=(0, 1))
        rotated_max = rotated.abs().amax(dim=(0, 1)) if rotated is not None else None
        for c in range(len(absmax)):
            experiment.point(ChannelPoint(channel=c, absmax=float(absmax[c]),
                                          absmax_rotated=float(rotated_max[c]) if rotated_max is not None else None))
        del reference
        figures: list[MethodFigures] = []
        skipped: list[str] = []
        for i, method in enumerate(methods):
            if experiment.cancelled:
                break
            why = kv_methods.available(method)
            if why is not None:
                skipped.append(why)
                experiment.point(SkippedPoint(index=i))
                continue
            experiment.progress(i + 1, total, f"{method.words}: {steps} steps on the reference's tokens")
            one = _measure(experiment, session, method, i, prompt, tokens, ref_logp, ref_bytes)
            if one is None:
                break
            figures.append(one)
    meter.stop()
    experiment.progress(total, total, "done")
    share = meter.share()
    return CompressionResult(methods=tuple(figures), skipped=tuple(skipped), prompt_tokens=len(prompt), steps=steps,
                             channel_layer=layer, int4_error_plain=plain_error, int4_error_rotated=rotated_error,
                             incomplete=len(figures) + len(skipped) < len(methods),
                             lowest_cpu_share=share)


def _measure(experiment: Experiment, session: ModelSession, method: Any, index: int, prompt: list[int],
             tokens: list[int], ref_logp: list[Any], ref_bytes: int) -> MethodFigures | None:
    """One method: teacher-forced over the reference's tokens, then free-running from the prompt; None if
    stopped (checked before every pass)."""
    import torch

    from engine.model import kv_compress

    clock = session.clock
    forced = _Pass(session, method)
    logits = forced.feed(prompt)
    kls, agree, times = [], [], []
    held = 0
    for step, token in enumerate(tokens):
        logp = _log_probs(logits)
        kls.append(_kl(ref_logp[step], logp))
        agree.append(int(torch.argmax(logp)) == int(torch.argmax(ref_logp[step])))
        if experiment.cancelled:
            return None
        start = clock.mark()
        logits = forced.feed([token])
        times.append(clock.elapsed_ms(start, clock.mark()))
        held = kv_compress.held_bytes(forced.cache)
        experiment.point(StepPoint(method=index, step=step, kl=kls[-1], agree=bool(agree[-1]), bytes=held))
    states = kv_compress.position_states(forced.cache, forced.position, forced.evictor)
    layers = max(len(states), 1)
    full_share = tuple(sum(row[p] == kv_compress.FULL for row in states) / layers for p in range(forced.position))
    quant_share = tuple(sum(row[p] == kv_compress.QUANT for row in states) / layers for p in range(forced.position))
    del forced
    free = _Pass(session, method)
    logits = free.feed(prompt)
    departure = None
    for step, token in enumerate(tokens):
        chosen = int(torch.argmax(logits))
        if chosen != token:
            departure = step
            break
        if experiment.cancelled:
            return None
        logits = free.feed([chosen])
    figures = MethodFigures(
        name=method.name, words=method.words, bytes=held, ratio=ref_bytes / held if held else 0.0,
        kl_mean=statistics.fmean(kls), kl_max=max(kls), agreement=sum(agree) / len(agree), departure=departure,
        decode_ms=statistics.median(times), full_share=full_share[:MAX_POSITIONS],
        quantized_share=quant_share[:MAX_POSITIONS])
    experiment.point(MethodPoint(index=index, bytes=held, ratio=figures.ratio, kl_mean=figures.kl_mean,
                                 kl_max=figures.kl_max, agreement=figures.agreement, departure=departure,
                                 decode_ms=figures.decode_ms))
    return figures


def check(target: Any, settings: CompressionSettings) -> None:
    from engine.model import kv_compress

    facts = target.facts
    if not kvformula.has_kv_cache(facts):
        raise ParameterError(f"{facts.name} keeps no KV cache: there is nothing to compress")
    refusal = kv_compress.refusal(target.model)
    if refusal:
        raise ParameterError(f"The KV compression lesson is not available for {facts.name}: {refusal}")
    prompt = target.encode(settings.prompt or default_prompt(), chat_template=False)
    if len(prompt) + settings.new_tokens + 1 > min(facts.max_context, MAX_POSITIONS):
        raise ParameterError(f"{len(prompt):,} prompt tokens and {settings.new_tokens} steps do not fit "
                             f"{min(facts.max_context, MAX_POSITIONS):,} positions: a shorter prompt or fewer steps")


def departure_text(f: MethodFigures, steps: int) -> str:
    return f"token {f.departure + 1}" if f.departure is not None else f"none in {steps}"


def table(points: Sequence[ExperimentPoint], result: CompressionResult) -> str:
    lines = [f"{'cache':<{NAME_WIDTH}} | bytes held | ratio | KL mean  | KL max   | top-1  | departs at  | ms/step",
             f"{'-' * NAME_WIDTH}-+------------+-------+----------+----------+--------+-------------+--------"]
    for f in result.methods:
        lines.append(f"{f.words[:NAME_WIDTH]:<{NAME_WIDTH}} | {kvformula.format_bytes(f.bytes):>10} | {f.ratio:5.2f} | "
                     f"{f.kl_mean:8.2e} | {f.kl_max:8.2e} | {f.agreement:6.1%} | "
                     f"{departure_text(f, result.steps):>11} | {f.decode_ms:7.1f}")
    lines.append("")
    lines.append(f"{result.prompt_tokens:,} prompt tokens, then {result.steps} steps teacher-forced on the full "
                 "cache's greedy tokens; bytes and KL measured; 'departs': free-running, the first token that "
                 "differs from the reference's")
    if result.int4_error_plain is not None:
        rotated = (f", {result.int4_error_rotated:.1%} after a Hadamard rotation"
                   if result.int4_error_rotated is not None else "")
        lines.append(f"layer {result.channel_layer}'s keys in 4-bit groups of 32: {result.int4_error_plain:.1%} "
                     f"relative error{rotated} (computed on the real keys)")
    for why in result.skipped:
        lines.append(f"skipped: {why}")
    lines.append("ms/step: this CPU dequantizes a quantized cache whole at every step; a GPU kernel would not")
    return "\n".join(lines)


LESSON = Lesson(kind="kv-compression", title="KV cache compression", settings=CompressionSettings,
                result=CompressionResult, run=run, table=table, check=check,
                points=(MethodPoint, StepPoint, ChannelPoint, SkippedPoint),
                quick={"prompt": " ".join(["The cache keeps what attention read."] * 4), "new_tokens": 6,
                       "methods": ("full", "fp8", "sinks:4+16", "h2o:24")},
                course={"new_tokens": 32})

