"""Lesson: weight formats. Halve the bytes decode reads per token and decode nearly doubles, while prefill,
which is arithmetic, does not. Per format (float32, bfloat16, int8, int4 weights), on the loaded model:

- bytes read per token (the weights as stored plus the KV cache) and measured decode tok/s beside the ceiling
  this machine's measured bandwidth allows for those bytes (only from a measurement on a quiet machine);
- for the float formats, each candidate kernel's bandwidth over the weights in a decode step's products (timed
  at load, ``engine.model.kernels``), so the lesson shows which kernel this CPU uses and how near the copy it gets;
- prefill tok/s on a longer prompt beside the ceiling the measured matmul peak allows;
- TTFT, the first step where greedy tokens leave float32's, and the mean negative log-likelihood (and
  perplexity) of a held paragraph, so what the smaller bytes cost in quality is on the same screen.

Each format is a fresh load of the same model (then released); medians of a few repeats.
"""

from __future__ import annotations

import gc
import math
import statistics
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Annotated

from engine.facts.costmodel import Device, ModelCost
from engine.facts.errors import ModelSourceError, ParameterError
from engine.facts.events import ExperimentPoint, LessonResult, LessonSettings
from engine.facts.fields import Column, Items, Key, Number, Range, Setting, Text
from engine.facts.params import GenerationParams
from engine.facts.vocabulary import LessonPoint, SkippedPoint
from engine.run.experiment import Experiment, Lesson
from engine.run.workloads import filler_ids

FORMATS = ("float32", "bfloat16", "int8", "int4")
KERNEL_NAMES = {"aten": "ATen", "onednn": "oneDNN", "mkl": "MKL"}      # engine.model.kernels' candidates, for words
PROMPT = "Explain in three sentences why decoding one token at a time is limited by memory bandwidth."
HELD_PARAGRAPH = ("The cache keeps the keys and values of every token the model has already read, so that each new "
                  "token attends to them without computing them again. Its size grows with the length of the "
                  "conversation, with the number of layers, and with the width of each key and value. When many "
                  "users are served at once, the memory the caches take, not the arithmetic, decides how many of "
                  "them fit on one machine.")


@dataclass(frozen=True)
class FormatsSettings(LessonSettings):
    kind = "dtype"

    formats: Annotated[tuple[Annotated[str, Text(16, FORMATS)], ...], Items(4), Setting(
        "--formats", "Weight formats", "weight formats to compare, separated by commas")] = FORMATS
    new_tokens: Annotated[int, Range(2, 1024), Setting(
        "--tokens", "New tokens per run", "new tokens per run", "tokens"), Key("M", factor=2.0)] = 48
    repeats: Annotated[int, Range(1, 20), Setting("--repeats", "Repeats", "timed runs per format")] = 3
    prefill_tokens: Annotated[int, Range(8, 8192)] = 256

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.formats:
            raise ParameterError(f"formats must name some of {', '.join(FORMATS)}")


@dataclass(frozen=True)
class FormatFigures:
    """One format, as measured (decode, prefill, TTFT, likelihood) and computed (bytes and ceilings)."""

    name: Annotated[str, Text(16, FORMATS)]
    bytes_per_token: Number
    decode_tok_s: Number
    decode_x: Number | None = None         # over float32's, when float32 was measured
    bytes_x: Number | None = None


def _diverges(step: float) -> str:
    return "never" if step < 0 else f"step {int(step)}"


@dataclass(frozen=True)
class FormatPoint(LessonPoint):
    """One weight format, measured (``index``: its place in the settings' formats): bytes and speed, the
    ceilings where the machine was quiet, perplexity, the step its greedy tokens leave float32's (-1: never),
    and in ``more`` each candidate kernel's products bandwidth (``products_gb_s_<kernel>``, achieved) and the
    chosen one (``products_chosen_<kernel>``)."""

    series = "format"

    index: Annotated[int, Column("weights", "{:d}")]        # a table names it (``settings.formats[index]``)
    weight_bytes: float
    bytes_per_token: Annotated[float, Column("MiB/token", "{:,.1f}", scale=2**-20)]
    decode_tok_s: Annotated[float, Column("decode tok/s", "{:,.1f}")]
    decode_ceiling_tok_s: Annotated[float | None, Column("ceiling (computed)", "{:,.0f}")]
    prefill_tok_s: Annotated[float, Column("prefill tok/s", "{:,.0f}")]
    ttft_ms: Annotated[float, Column("TTFT ms", "{:,.0f}")]
    diverges_at: Annotated[int, Column("tokens leave fp32 at", show=_diverges)]
    nll: float
    perplexity: Annotated[float, Column("perplexity")]
    prefill_ceiling_tok_s: float | None = None
    bandwidth_gb_s: float | None = None
    peak_gflop_s: float | None = None
    more: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class FormatsResult(LessonResult):
    kind = "dtype"

    measured: Annotated[tuple[FormatFigures, ...], Items(4)] = ()
    skipped: Annotated[tuple[Annotated[str, Text(512)], ...], Items(4)] = ()


def first_divergence(reference: list[int], tokens: list[int]) -> int | None:
    """The first step where ``tokens`` leave ``reference`` (None if they never do, over the shorter)."""
    return next((i for i, (a, b) in enumerate(zip(reference, tokens)) if a != b), None)


def run(experiment: Experiment, settings: FormatsSettings) -> FormatsResult:
    from engine.model.models import load  # torch: only where a lesson runs, never where it is read
    from engine.run.session import Session

    session, facts = experiment.session, experiment.session.facts
    reference: list[int] | None = None
    rows: list[tuple[str, dict]] = []
    skipped: list[str] = []
    shares: list[float] = []
    formats = settings.formats
    for i, fmt in enumerate(formats):
        if experiment.cancelled:
            break
        experiment.progress(i, len(formats), f"{fmt}: loading {facts.name} and measuring")
        try:
            loaded = load(facts.source, str(session.device), fmt)
        except ModelSourceError as exc:                     # e.g. no int4 kernel for this device
            experiment.point(SkippedPoint(index=i))
            skipped.append(f"{fmt}: {exc}"[:512])
            experiment.progress(i, len(formats), f"{fmt}: skipped ({exc})")
            continue
        measured_here = _measure(Session(loaded), settings, experiment.cancel)
        if measured_here is None:                           # stopped part-way through this format
            break
        values, tokens, share = measured_here
        if share is not None:
            shares.append(share)
        reference = tokens if fmt == "float32" or reference is None else reference
        divergence = first_divergence(reference, tokens)
        values["diverges_at"] = float(divergence) if divergence is not None else -1.0
        values["index"] = float(i)
        experiment.point(FormatPoint.read(ExperimentPoint("", 0.0, FormatPoint.series, values)))
        rows.append((fmt, values))
        del loaded
        gc.collect()
    experiment.progress(len(formats), len(formats), "done")
    base = next((v for fmt, v in rows if fmt == "float32"), None)
    measured = tuple(FormatFigures(
        fmt, v["bytes_per_token"], v["decode_tok_s"],
        decode_x=v["decode_tok_s"] / base["decode_tok_s"] if base else None,
        bytes_x=v["bytes_per_token"] / base["bytes_per_token"] if base else None) for fmt, v in rows)
    return FormatsResult(measured=measured, skipped=tuple(skipped), incomplete=experiment.cancelled,
                         lowest_cpu_share=min(shares) if shares else None)


def _measure(session, settings: FormatsSettings,
             cancel: threading.Event) -> tuple[dict, list[int], float | None] | None:
    """One format's figures; None once ``cancel`` is set (checked before every pass, and by the runs between
    their steps)."""
    from engine.model import hardware

    facts = session.facts
    peaks = hardware.model_peaks(                                # None: only busy ones
        session.loaded, lambda dtype: hardware.quiet_peaks(session.device, dtype, attempts=1))
    cost = ModelCost(facts)
    params = GenerationParams(max_new_tokens=settings.new_tokens)
    session.run(PROMPT, GenerationParams(max_new_tokens=4), cancel=cancel)        # warm-up
    runs = []
    for _ in range(settings.repeats):
        if cancel.is_set():
            return None
        runs.append(session.run(PROMPT, params, cancel=cancel).summary)
    ids = filler_ids(session, settings.prefill_tokens)
    timed = []
    for _ in range(settings.repeats + 1):                                        # the first: a warm-up
        if cancel.is_set():
            return None
        timed.append(session.timed_prefill(ids)[0])
    prefill_ms = statistics.median(timed[1:])
    step = cost.decode(runs[0].prompt_tokens + settings.new_tokens // 2)
    if cancel.is_set():
        return None
    nll = session.negative_log_likelihood(HELD_PARAGRAPH)
    values = {"weight_bytes": float(facts.weight_bytes), "bytes_per_token": step.bytes,
              "decode_tok_s": statistics.median(s.decode_tok_s for s in runs),
              "ttft_ms": statistics.median(s.ttft_ms for s in runs),
              "prefill_tok_s": settings.prefill_tokens / (prefill_ms / 1000.0),
              "nll": nll, "perplexity": math.exp(nll)}
    if peaks is not None:                       # ceilings only from a quiet machine's measurement
        device = Device.of(peaks)
        values.update({"decode_ceiling_tok_s": device.bytes_per_s / step.bytes,
                       "prefill_ceiling_tok_s":
                           settings.prefill_tokens / cost.prefill(settings.prefill_tokens).compute_s(device),
                       "bandwidth_gb_s": peaks.bytes_per_s / 1e9,
                       "peak_gflop_s": device.product_flops_per_s(settings.prefill_tokens) / 1e9})
    values.update(_kernel_values(session.loaded.kernel))
    shares = [s.cpu_share for s in runs if s.cpu_share is not None]
    return values, runs[0].token_ids, min(shares) if shares else None


def _kernel_values(choice) -> dict:
    """The products' kernels timed at load (``engine.model.kernels``): each candidate's bandwidth over the weights
    (achieved) as ``products_gb_s_<kernel>``, and which was chosen (``products_chosen_<kernel>`` = 1)."""
    if choice is None or not choice.step_ms:
        return {}
    out = {f"products_gb_s_{k}": v / 1e9 for k, v in choice.reached_bytes_per_s().items()}
    out[f"products_chosen_{choice.kernel}"] = 1.0
    return out


def kernel_figures(values: dict) -> list[tuple[str, float, bool]]:
    """(kernel, achieved GB/s, chosen) per candidate timed for a format, fastest first."""
    found = [(key.removeprefix("products_gb_s_"), v) for key, v in values.items() if key.startswith("products_gb_s_")]
    return [(k, v, f"products_chosen_{k}" in values) for k, v in sorted(found, key=lambda kv: -kv[1])]


def kernel_words(values: dict) -> str:
    """One format's products by kernel, for a table or a caption; empty where none were timed (quantized)."""
    figures = kernel_figures(values)
    if not figures:
        return ""
    parts = ", ".join(f"{KERNEL_NAMES.get(k, k)} {v:,.1f} GB/s{' (chosen)' if chosen else ''}"
                      for k, v, chosen in figures)
    copy = values.get("bandwidth_gb_s")
    beside = f" beside a {copy:,.1f} GB/s copy (measured)" if copy else ""
    return f"a step's products through {parts} (achieved){beside}"


def table(points: Sequence[ExperimentPoint], result: FormatsResult) -> str:
    lines = ["weights | bytes/token | decode tok/s | ceiling | prefill tok/s | ceiling | TTFT ms | diverges "
             "| NLL (ppl)",
             "--------+-------------+--------------+---------+---------------+---------+---------+----------"
             "+----------"]
    for p, figures in zip((p for p in points if p.series == "format"), result.measured):
        v = p.values
        diverges = "never" if v["diverges_at"] < 0 else f"step {int(v['diverges_at'])}"
        lines.append(f"{figures.name:>7} | {v['bytes_per_token'] / 2**20:8.1f} MiB | "
                     f"{v['decode_tok_s']:12.1f} | {_ceiling(v, 'decode_ceiling_tok_s')} | "
                     f"{v['prefill_tok_s']:13.0f} | {_ceiling(v, 'prefill_ceiling_tok_s')} | {v['ttft_ms']:7.1f} | "
                     f"{diverges:>8} | {v['nll']:.3f} ({v['perplexity']:.1f})")
    kernels = [(f.name, kernel_words(p.values)) for p, f in
               zip((p for p in points if p.series == "format"), result.measured)]
    lines += [f"{name}: {words}" for name, words in kernels if words]
    compared = [f for f in result.measured if f.name != "float32" and f.bytes_x is not None]
    if compared:
        lines += ["", *(f"{f.name}: {f.bytes_x:.2f}x the bytes per token of float32, {f.decode_x:.2f}x its decode "
                        "tok/s (measured)" for f in compared),
                  "ceilings: this machine's measured bandwidth over the bytes read per token (decode) and its "
                  "measured matmul peak over the FLOPs per token (prefill), computed; none where the machine was "
                  "busy whenever they were measured"]
    lines += [f"skipped {s}" for s in result.skipped]
    return "\n".join(lines)


def _ceiling(values: dict, key: str) -> str:
    return f"{values[key]:7.0f}" if key in values else "      -"


LESSON = Lesson(kind="dtype", title="Weight formats", settings=FormatsSettings, result=FormatsResult, run=run,
                table=table, points=(FormatPoint, SkippedPoint),
                quick={"formats": ("float32", "int8"), "new_tokens": 6, "repeats": 1})
