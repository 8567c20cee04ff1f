"""Lesson: when the model does not fit. The same prompt decoded with none, a quarter and half of the decoder
layers offloaded to disk (accelerate's device map and offload folder, the layers last in the model first): each
step reads every offloaded layer's weights back before using them. Measured: decode tokens per second, and each
layer's time per step (``LayerTimes``: the offloaded layers are the slow ones). Computed beside it: the all-in-
memory step time plus the offloaded bytes over the rate at which accelerate reads them from the offload folder
(measured through its own hooks, as a forward pass reads them), which predicts the slowdown.

The second half, offloading the KV cache (transformers moves each layer's keys and values to the CPU between
uses), moves bytes between a GPU and the CPU: on a machine without a GPU it is computed (what each token would
move at a given context), not measured.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Annotated, Any

from engine.facts import kvformula
from engine.facts.errors import ParameterError
from engine.facts.events import ExperimentPoint, LayerTimes, LessonResult, LessonSettings, RunFinished
from engine.facts.fields import MAX_LAYERS, MAX_PROMPT, Bytes, Column, Count, Items, Key, Number, Range, Setting, Text
from engine.facts.params import GenerationParams
from engine.facts.vocabulary import LessonPoint
from engine.run.experiment import Experiment, Lesson
from engine.run.model_session import ModelSession
from engine.run.workloads import sample_texts

KV_CONTEXTS = (4096, 32768)



def _rate(value: float) -> str:
    return f"{kvformula.format_bytes(value)}/s"


@dataclass(frozen=True)
class SplitPoint(LessonPoint):
    """One split of the layers between memory and disk: decode measured and predicted, the bytes read per token
    and how fast, and a layer's time in memory and on disk."""

    series = "split"

    disk_layers: Annotated[int, Column("layers on disk", "{:,d}")]
    decode_tok_s: Annotated[float, Column("decode tok/s (measured)", "{:,.1f}")]
    predicted_decode_tok_s: Annotated[float | None, Column("predicted tok/s", "{:,.1f}")]
    disk_bytes_per_token: Annotated[int, Column("read per token", show=kvformula.format_bytes)]
    read_bytes_per_s: Annotated[float | None, Column("read rate", show=_rate)]
    memory_layer_ms: Annotated[float | None, Column("layer in memory ms")]
    disk_layer_ms: Annotated[float | None, Column("layer on disk ms")]

@dataclass(frozen=True)
class OffloadSettings(LessonSettings):
    kind = "offload"

    disk_shares: Annotated[tuple[Annotated[float, Range(0.0, 1.0)], ...], Items(6), Setting(
        "--disk-shares", "Layers on disk", "shares of the decoder layers offloaded to disk, comma-separated "
        "(0 = all in memory)")] = (0.0, 0.25, 0.5)
    new_tokens: Annotated[int, Range(2, 1024), Setting(
        "--tokens", "New tokens", "tokens decoded at each split", "tokens"), Key("M", factor=2.0)] = 24
    prompt: Annotated[str, Text(MAX_PROMPT), Setting(
        "--prompt", "Prompt", "the prompt (default: the first sample prompt)")] | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.disk_shares:
            raise ParameterError("Give at least one share of layers on disk (0 = all in memory)")


@dataclass(frozen=True)
class SplitFigures:
    """One split: where each decoder layer's weights were read from and what decode cost."""

    disk_layers: Count
    budget: Bytes                                   # weights kept in memory
    layer_devices: Annotated[tuple[Annotated[str, Text(32)], ...], Items(MAX_LAYERS)]
    decode_tok_s: Number                            # measured
    predicted_decode_tok_s: Number | None           # computed from the all-in-memory step and the read rate
    disk_bytes_per_token: Bytes                     # the offloaded layers' weights, read at every step
    read_bytes_per_s: Number | None                 # measured: accelerate's loader over the offload folder
    memory_layer_ms: Number | None                  # median per step of a layer in memory (measured)
    disk_layer_ms: Number | None                    # ... and of a layer on disk
    tokens_match: bool                              # the same greedy tokens as all in memory


@dataclass(frozen=True)
class OffloadResult(LessonResult):
    kind = "offload"

    splits: Annotated[tuple[SplitFigures, ...], Items(6)] = field(default_factory=tuple)
    kv_positions: Annotated[tuple[Count, ...], Items(len(KV_CONTEXTS))] = field(default_factory=tuple)
    kv_moved_per_token: Annotated[tuple[Bytes, ...], Items(len(KV_CONTEXTS))] = field(default_factory=tuple)
    kv_offload_measured: bool = False               # False: computed only (no GPU here)
    kv_offload_decode_tok_s: Number | None = None   # a GPU: decode with the KV cache offloaded (measured)
    kv_offload_tokens_match: bool | None = None     # ... and whether its tokens equal the resident cache's


def check(target: Any, settings: OffloadSettings) -> None:
    facts = target.facts
    if facts.weight_format not in ("float32", "bfloat16", "float16"):
        raise ParameterError(f"Offloading reads float weights from disk: load {facts.name} as float32 or bfloat16 "
                             f"(it is loaded as {facts.weight_format})")
    if len(set(facts.layer_devices)) > 1:
        raise ParameterError("The loaded model is already split across devices: load it whole to compare splits")


def read_rate(model: Any) -> tuple[int, float | None]:
    """Bytes of the offloaded weights and the rate at which accelerate's own hooks bring them in for a forward pass
    and drop them after (one warm-up pass, then the best of two): what every decode step pays for the layers on
    disk, without their arithmetic."""
    hooked = [(m, m._hf_hook) for m in model.modules()
              if getattr(getattr(m, "_hf_hook", None), "offload", False) and m._hf_hook.weights_map is not None]
    if not hooked:
        return 0, None
    loaders = {id(h.weights_map.dataset): h.weights_map.dataset for _m, h in hooked}
    total = sum(loader[key].nbytes for loader in loaders.values() for key in loader.index)
    timings = []
    for attempt in range(3):
        started = time.perf_counter()
        for module, hook in hooked:
            hook.pre_forward(module)
            hook.post_forward(module, None)
        if attempt:                                   # the first pass warms up
            timings.append(time.perf_counter() - started)
    best = min(timings)
    return total, total / best if best > 0 else None


def run(experiment: Experiment, settings: OffloadSettings) -> OffloadResult:
    from engine.model.models import Offload, load, remove_offloaded
    from engine.run.session import Session

    session = experiment.session
    facts = session.facts
    prompt = settings.prompt or sample_texts()[0]
    layers = facts.num_layers
    counts = sorted({round(share * layers) for share in settings.disk_shares})
    if counts[0] != 0:
        counts = [0, *counts]                      # the all-in-memory run is the baseline every prediction needs
    splits: list[SplitFigures] = []
    baseline_ms: float | None = None
    baseline_ids: list[int] = []
    shares: list[float] = []
    for i, count in enumerate(counts):
        if experiment.cancelled:
            break
        experiment.progress(i, len(counts), f"{count} of {layers} layers on disk: loading")
        loaded = session.loaded if count == 0 else load(facts.source, str(session.device), facts.dtype,
                                                        offload=Offload(disk_layers=count))
        disk_bytes, rate = read_rate(loaded.model) if count else (0, None)
        experiment.progress(i, len(counts), f"{count} of {layers} layers on disk: decoding {settings.new_tokens} "
                                            "tokens")
        times: list[LayerTimes] = []

        def sink(event: object, times: list = times) -> None:
            if isinstance(event, LayerTimes):
                times.append(event)
            experiment.emit(event)

        runner = Session(loaded) if count else session       # a split model's session times its layers itself
        try:                                                  # the baseline's layers too, for comparison
            result = runner.run(prompt, GenerationParams(max_new_tokens=settings.new_tokens), sink,
                                experiment.cancel, options=replace(runner.options, time_layers=True))
        finally:
            if count:
                remove_offloaded(loaded)
        if not isinstance(result, RunFinished) or result.reason == "stopped":
            break
        s = result.summary
        if s.cpu_share is not None:
            shares.append(s.cpu_share)
        step_ms = s.decode_ms / s.decode_runs if s.decode_runs else None
        if count == 0:
            baseline_ms, baseline_ids = step_ms, s.token_ids
        predicted = None
        if count and baseline_ms and rate:
            predicted = 1000.0 / (baseline_ms + disk_bytes / rate * 1000.0)
        devices = tuple(loaded.facts.layer_devices)
        decode = [t for t in times if t.step > 0]
        memory_ms = [ms for t in decode for ms, d in zip(t.ms, t.devices) if d != "disk"]
        disk_ms = [ms for t in decode for ms, d in zip(t.ms, t.devices) if d == "disk"]
        figures = SplitFigures(
            disk_layers=count, budget=max(facts.weight_bytes - disk_bytes, 0), layer_devices=devices,
            decode_tok_s=s.decode_tok_s, predicted_decode_tok_s=predicted, disk_bytes_per_token=disk_bytes,
            read_bytes_per_s=rate, memory_layer_ms=statistics.median(memory_ms) if memory_ms else None,
            disk_layer_ms=statistics.median(disk_ms) if disk_ms else None,
            tokens_match=s.token_ids == baseline_ids)
        splits.append(figures)
        experiment.point(SplitPoint(disk_layers=count, decode_tok_s=s.decode_tok_s, predicted_decode_tok_s=predicted,
                                    disk_bytes_per_token=disk_bytes, read_bytes_per_s=rate,
                                    memory_layer_ms=figures.memory_layer_ms, disk_layer_ms=figures.disk_layer_ms))
        del runner, loaded
    kv = _offloaded_cache_run(experiment, session, prompt, settings, baseline_ids) \
        if session.device.type == "cuda" and splits and not experiment.cancelled else None
    experiment.progress(len(splits), len(counts), "done")
    positions = tuple(sorted({min(c, kvformula.full_context_positions(facts)) for c in KV_CONTEXTS}))
    moved = tuple(2 * kvformula.predicted_kv_bytes(facts, n) for n in positions)
    return OffloadResult(splits=tuple(splits), kv_positions=positions, kv_moved_per_token=moved,
                         incomplete=len(splits) < len(counts),
                         lowest_cpu_share=min(shares) if shares else None, kv_offload_measured=kv is not None,
                         kv_offload_decode_tok_s=kv[0] if kv else None, kv_offload_tokens_match=kv[1] if kv else None)


def _offloaded_cache_run(experiment: Experiment, session: ModelSession, prompt: str, settings: OffloadSettings,
                         baseline_ids: list[int]) -> tuple[float, bool] | None:
    """On a GPU: the same decode with each layer's KV cache moved to the CPU between uses (measured)."""
    result = session.run(prompt, GenerationParams(max_new_tokens=settings.new_tokens), experiment.emit,
                         experiment.cancel, options=replace(session.options, offload_kv=True))
    if not isinstance(result, RunFinished) or result.reason == "stopped":
        return None
    return result.summary.decode_tok_s, result.summary.token_ids == baseline_ids


def split_line(split: SplitFigures, base: SplitFigures | None) -> str:
    fmt = kvformula.format_bytes
    if not split.disk_layers or base is None:
        return f"all {len(split.layer_devices)} layers in memory: decode {split.decode_tok_s:,.1f} tok/s (measured)"
    slower = base.decode_tok_s / split.decode_tok_s if split.decode_tok_s else 0.0
    predicted = (f", predicted {base.decode_tok_s / split.predicted_decode_tok_s:,.1f}x" if
                 split.predicted_decode_tok_s else "")
    rate = f" at {fmt(split.read_bytes_per_s)}/s" if split.read_bytes_per_s else ""
    return (f"{split.disk_layers} of {len(split.layer_devices)} layers on disk: decode {slower:,.1f}x slower "
            f"(measured){predicted}: each token reads {fmt(split.disk_bytes_per_token)}{rate}")


def table(points: Sequence[ExperimentPoint], result: OffloadResult) -> str:
    fmt = kvformula.format_bytes
    lines = ["layers on disk | in memory  | decode tok/s | predicted | read per token | read rate    | "
             "layer in memory | layer on disk | tokens",
             "---------------+------------+--------------+-----------+----------------+--------------+"
             "-----------------+---------------+-------"]
    for s in result.splits:
        predicted = f"{s.predicted_decode_tok_s:9.1f}" if s.predicted_decode_tok_s else f"{'-':>9}"
        rate = f"{fmt(s.read_bytes_per_s)}/s" if s.read_bytes_per_s else "-"
        memory = f"{s.memory_layer_ms:.2f} ms" if s.memory_layer_ms is not None else "-"
        disk = f"{s.disk_layer_ms:.2f} ms" if s.disk_layer_ms is not None else "-"
        lines.append(f"{s.disk_layers:>6} of {len(s.layer_devices):<5} | {fmt(s.budget):>10} | "
                     f"{s.decode_tok_s:12.1f} | {predicted} | {fmt(s.disk_bytes_per_token):>14} | {rate:>12} | "
                     f"{memory:>15} | {disk:>13} | {'same' if s.tokens_match else 'DIFFER':>6}")
    base = result.splits[0] if result.splits else None
    lines += [""] + [split_line(s, base) for s in result.splits if s.disk_layers]
    if result.kv_moved_per_token:
        moved = " · ".join(f"at {n:,} positions {fmt(b)}" for n, b in zip(result.kv_positions,
                                                                         result.kv_moved_per_token))
        measured = (f"; measured with the cache offloaded: decode {result.kv_offload_decode_tok_s:,.1f} tok/s, "
                    f"tokens {'the same' if result.kv_offload_tokens_match else 'DIFFERENT'}"
                    if result.kv_offload_measured else "; measuring it needs a GPU")
        lines.append(f"offloading the KV cache moves, per token (computed: each layer's cache to the CPU and "
                     f"back): {moved}{measured}")
    lines.append("read rate: accelerate's own hooks bringing the offloaded weights in and dropping them, as a "
                 "forward pass does (the OS page cache included: a cold disk reads slower)")
    return "\n".join(lines)


LESSON = Lesson(kind="offload", title="Offloading: when the model does not fit", settings=OffloadSettings,
                result=OffloadResult, run=run, table=table, check=check, points=(SplitPoint,),
                quick={"disk_shares": (0.0, 0.5), "new_tokens": 4},
                course={"new_tokens": 12})
