"""Which float dtype is fastest here? Measured, not assumed: bfloat16 halves the bytes decode reads, but on a
CPU without native bf16 units its matmuls are emulated and prefill gets several times slower.

A short calibration times one decoder layer's worth of matmuls (the model's own hidden and intermediate
sizes) per candidate dtype: one token at a time (decode: reading weights) and 64 tokens at once (prefill:
arithmetic). The score is the time of a typical run, a 64-token prefill plus 64 decode steps; ``auto`` takes
the lowest, float32 on a tie, so it is never slower than float32 in its own measurement. Cached per device,
torch version, thread count and shape (a second or two the first time). A measurement taken on a busy machine
is not used: a stated rule (native bf16 units or not) decides, the same at every launch, and is cached too.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from engine.facts.contention import LoadMeter, busy
from engine.model.hardware import native_bf16
from engine.store import machine_cache

CANDIDATES = {"cpu": ("float32", "bfloat16"), "cuda": ("float32", "bfloat16", "float16"), "mps": ("float32", "float16")}
CACHE = "dtypes.json"
PREFILL_TOKENS = 64
DECODE_STEPS = 64


@dataclass(frozen=True)
class Timing:
    dtype: str
    prefill_ms: float          # 64 tokens through the layer's matmuls
    decode_ms: float           # one token through them

    @property
    def run_ms(self) -> float:
        return self.prefill_ms + DECODE_STEPS * self.decode_ms


@dataclass(frozen=True)
class Calibration:
    best: str
    timings: list[Timing]
    native_bf16: bool | None
    cpu_share: float | None = None
    cached: bool = False
    by_rule: bool = False          # the machine was busy while measuring: the stated rule decided, not the timings
    weights: str = ""              # int8 / int4: the float chosen is the quantized weights' activations'

    def timing(self, dtype: str) -> Timing | None:
        return next((t for t in self.timings if t.dtype == dtype), None)

    def reason(self) -> str:
        """Why ``auto`` chose what it chose, in one line (shown beside the model and in ``--json``)."""
        base, best = self.timing("float32"), self.timing(self.best)
        native = {True: "native bf16 on this CPU", False: "bf16 emulated on this CPU", None: ""}[self.native_bf16]
        of = f" activations for {self.weights} weights" if self.weights else ""
        if self.by_rule:
            return (f"{self.best}{of} by rule, {native or 'for this device'}: the machine was busy when the floats "
                    "were timed, so the timing did not decide")
        native = f" ({native})" if native else ""
        if base is None or best is None or best.dtype == "float32":
            others = [t for t in self.timings if t.dtype != "float32"]
            slower = ", ".join(f"{t.dtype} {base.run_ms / t.run_ms:.2f}x" for t in others) if base else ""
            return f"float32{of}: the others were slower here{native} ({slower} the speed, measured)"
        return (f"{best.dtype}{of}: {base.decode_ms / best.decode_ms:.1f}x the decode and "
                f"{base.prefill_ms / best.prefill_ms:.1f}x the prefill speed of float32{native} (measured)")


def _layer(hidden: int, intermediate: int, dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    """The weights of one decoder layer's matmuls: q, k, v, o, then gate, up and down."""
    shapes = [(hidden, hidden)] * 4 + [(intermediate, hidden)] * 2 + [(hidden, intermediate)]
    return [torch.randn(*shape, device=device, dtype=dtype) / shape[1] ** 0.5 for shape in shapes]


def _quantized_layer(fmt: str, hidden: int, intermediate: int, act: torch.dtype,
                     device: torch.device) -> list[torch.nn.Module]:
    """One decoder layer's matmuls with ``fmt`` weights, computing in ``act``: what a quantized model runs."""
    from engine.model.quantize import Int4Linear, Int8Linear

    make = Int8Linear if fmt == "int8" else Int4Linear
    shapes = [(hidden, hidden)] * 4 + [(intermediate, hidden)] * 2 + [(hidden, intermediate)]
    return [make(torch.nn.Linear(i, o, bias=False, device=device), act) for o, i in shapes]


def _time_ms(weights: list, tokens: int, device: torch.device, repeats: int,
             act: torch.dtype | None = None) -> float:
    """The best of ``repeats`` passes of ``tokens`` through one layer's matmuls: weight tensors (``linear``) or
    quantized modules (called, in ``act``)."""
    modules = not isinstance(weights[0], torch.Tensor)
    hidden = weights[0].in_features if modules else weights[0].shape[1]
    x = torch.randn(tokens, hidden, device=device, dtype=act if modules else weights[0].dtype)
    apply = (lambda w, t: w(t)) if modules else (lambda w, t: torch.nn.functional.linear(t, w))

    def once() -> None:
        q, k, v, o, gate, up, down = weights
        for w in (q, k, v, o, gate):
            apply(w, x)
        apply(down, apply(up, x))
        if device.type == "cuda":
            torch.cuda.synchronize()

    with torch.inference_mode():
        once()
        best = float("inf")
        for _ in range(repeats):
            started = time.perf_counter()
            once()
            best = min(best, time.perf_counter() - started)
    return best * 1000.0


def measure(device: torch.device, hidden: int, intermediate: int, weights: str = "") -> Calibration:
    """Each candidate float timed over one layer's matmuls; ``weights`` (int8 / int4): through that format's
    quantized kernel, the float being its activations' (the kernels' speed differs most there: torch's int8
    weight-only product read 11 GB/s with bfloat16 activations and 2.8 with float32 ones on one machine)."""
    meter = LoadMeter()
    meter.start()
    timings = []
    for name in CANDIDATES.get(device.type, ("float32",)):
        dtype = getattr(torch, name)
        try:
            if weights:
                layer, act = _quantized_layer(weights, hidden, intermediate, dtype, device), dtype
            else:
                layer, act = _layer(hidden, intermediate, dtype, device), None
            timings.append(Timing(name, _time_ms(layer, PREFILL_TOKENS, device, 3, act),
                                  _time_ms(layer, 1, device, 7, act)))
        except (RuntimeError, TypeError, NotImplementedError):      # a dtype the device cannot compute in
            continue
    meter.stop()
    best = min(timings, key=lambda t: (round(t.run_ms, 6), t.dtype != "float32")).dtype
    return Calibration(best, timings, native_bf16(device), None if device.type != "cpu" else meter.share(),
                       weights=weights)


def rule(device: torch.device) -> str:
    """The dtype ``auto`` takes when it cannot trust a measurement (the machine was busy while measuring): on a
    CPU bfloat16 only with native bf16 units (AVX512_BF16 or AMX), on a GPU bfloat16 where supported, else
    float32. The same answer at every launch on the same machine."""
    if device.type == "cuda":
        return "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
    return "bfloat16" if device.type == "cpu" and native_bf16(device) else "float32"


def calibrate(device: torch.device, hidden: int, intermediate: int, recalibrate: bool = False,
              measuring: Callable[[], None] = lambda: None, weights: str = "") -> Calibration:
    """The cached decision for this machine and shape, else a new one (``measuring`` is called first, so a
    progress line appears only when something is measured). A measurement taken on a quiet machine decides; one
    taken on a busy machine is not used: the stated rule (:func:`rule`) decides, and that decision is kept too,
    so a machine that is always busy is not measured at every launch."""
    from engine.model.hardware import device_name

    key = f"{device_name(device)}|{device.type}|torch {torch.__version__}|threads {torch.get_num_threads()}|" \
          f"{hidden}x{intermediate}" + (f"|{weights} weights" if weights else "")
    entry = None if recalibrate else machine_cache.entry(CACHE, key)
    if entry is not None:
        try:
            return Calibration(entry["best"], [Timing(**t) for t in entry["timings"]], entry.get("native_bf16"),
                               entry.get("cpu_share"), cached=True, by_rule=bool(entry.get("by_rule")),
                               weights=weights)
        except (KeyError, TypeError):
            pass
    measuring()
    found = measure(device, hidden, intermediate, weights)
    if busy(found.cpu_share):
        found = Calibration(rule(device), found.timings, found.native_bf16, found.cpu_share, by_rule=True,
                            weights=weights)
    record = asdict(found)
    record.pop("cached", None)
    record.pop("weights", None)
    machine_cache.remember(CACHE, key, record)
    return found
