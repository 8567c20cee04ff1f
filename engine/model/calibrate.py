"""Which float dtype is fastest here? Measured, not assumed: bfloat16 halves the bytes decode reads, but on a
CPU without native bf16 units torch emulates its GEMM, and a prefill's products run in float32 over the weights
widened per call instead (``kernels.widen_many_rows``), which costs the widening.

A short calibration times a decoder layer's matmuls (the model's own hidden and intermediate sizes) per
candidate dtype, as the model computes them: through the kernel its eager decode would take (``kernels.offered``),
one token at a time over distinct layers (decode: reading weights from memory, not from a cache) and 64 tokens
at once (prefill: arithmetic, widened where the model's are). The score is the time of a typical run, a 64-token
prefill plus 64 decode steps; ``auto`` takes the lowest, float32 on a tie, so it is never slower than float32 in
its own measurement. Cached per device, torch version, thread count and shape (a second or two the first time).
A measurement taken on a busy machine is not used: a stated rule (native bf16 units or not) decides and is
cached too, marked, and measured again at a later launch whose short probe finds the machine quiet (kept for
good, a first launch beside a busy install chose float32 for ever on a CPU where bfloat16 decodes twice as fast).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from engine.facts.contention import LoadMeter, busy
from engine.model import kernels
from engine.model.hardware import native_bf16
from engine.store import machine_cache

CANDIDATES = {"cpu": ("float32", "bfloat16"), "cuda": ("float32", "bfloat16", "float16"), "mps": ("float32", "float16")}
CACHE = "dtypes.json"
TIMING = 2                 # how a candidate is timed (2: distinct layers, a prefill widened as the model's is)
SAMPLE_BYTES = 128 << 20   # at least this much float32 weight is timed per candidate: beyond a CPU's last cache
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
                    "were timed, so the timing did not decide; measured again at a launch when it is quiet")
        native = f" ({native})" if native else ""
        if base is None or best is None or best.dtype == "float32":
            others = [t for t in self.timings if t.dtype != "float32"]
            slower = ", ".join(f"{t.dtype} {base.run_ms / t.run_ms:.2f}x" for t in others) if base else ""
            return (f"float32{of}: the others were slower here{native} ({slower} the speed in a layer's products, "
                    "measured)")
        return (f"{best.dtype}{of}: a layer's products {base.decode_ms / best.decode_ms:.1f}x as fast as float32's "
                f"in decode and {base.prefill_ms / best.prefill_ms:.1f}x in prefill{native} (measured)")


def _shapes(hidden: int, intermediate: int) -> list[tuple[int, int]]:
    """``(out, in)`` of one decoder layer's matmuls: q, k, v, o, then gate, up and down."""
    return [(hidden, hidden)] * 4 + [(intermediate, hidden)] * 2 + [(hidden, intermediate)]


def _layer(hidden: int, intermediate: int, dtype: torch.dtype, device: torch.device,
           kernel: kernels.Kernel | None = None) -> list[torch.nn.Module]:
    """One decoder layer's linear layers in ``dtype`` (q, k, v, o, then gate, up and down), as a model in that
    float computes them on a CPU: through ``kernel`` (``engine.model.kernels``), and where this CPU emulates a half
    float a prefill's rows widened (``widen_many_rows``, the model's own rule). Timed through ATen's emulated GEMM
    instead, bfloat16 was charged a prefill no model runs, and float32's decode ATen's one-thread product where the
    model's runs oneDNN's (a 2-vCPU AMD EPYC: 1.6 ms a layer against 1.2)."""
    linears = [torch.nn.Linear(i, o, bias=False, device=device, dtype=dtype) for o, i in _shapes(hidden, intermediate)]
    layer = torch.nn.ModuleList(linears if kernel is None else [kernels.PackedLinear(m, kernel) for m in linears])
    kernels.widen_many_rows(layer)
    return list(layer)


def _quantized_layer(fmt: str, hidden: int, intermediate: int, act: torch.dtype,
                     device: torch.device) -> list[torch.nn.Module]:
    """One decoder layer's matmuls with ``fmt`` weights, computing in ``act``: what a quantized model runs."""
    from engine.model.quantize import Int4Linear, Int8Linear

    make = Int8Linear if fmt == "int8" else Int4Linear
    return [make(torch.nn.Linear(i, o, bias=False, device=device), act) for o, i in _shapes(hidden, intermediate)]


def copies(hidden: int, intermediate: int, layers: int | None = None) -> int:
    """How many distinct layers decode is timed over: as many as the model has (``layers``; None: unknown), up to
    ``SAMPLE_BYTES`` in float32. Decode reads each weight once a step: from memory when the model is larger than
    the CPU's cache, and one layer timed over and over is read from the cache (an int8 layer of SmolLM2's is 4 MB:
    on a 2-vCPU AMD EPYC its decode with bfloat16 activations timed 0.30 ms alone and 0.51 a layer over nine, and
    "10.8x float32's" became 6.3x); a model smaller than that decodes from the cache, and so is timed. A
    prefill's 64 rows are arithmetic over each weight it reads: one layer times it (float32 activations over int4
    weights took 0.3 s a pass of one layer)."""
    per_layer = 4 * sum(o * i for o, i in _shapes(hidden, intermediate))
    return max(1, min(-(-SAMPLE_BYTES // per_layer), layers or SAMPLE_BYTES))


def _time_ms(layers: list[list[torch.nn.Module]], tokens: int, device: torch.device, repeats: int,
             act: torch.dtype) -> float:
    """The best of ``repeats`` passes of ``tokens`` rows in ``act`` through every layer's linear layers, per
    layer."""
    x = torch.randn(tokens, layers[0][0].in_features, device=device, dtype=act)

    def once() -> None:
        for q, k, v, o, gate, up, down in layers:
            for w in (q, k, v, o, gate):
                w(x)
            down(up(x))
        if device.type == "cuda":
            torch.cuda.synchronize()

    with torch.inference_mode():
        once()
        best = float("inf")
        for _ in range(repeats):
            started = time.perf_counter()
            once()
            best = min(best, time.perf_counter() - started)
    return best * 1000.0 / len(layers)


def _timed(name: str, layers: list[list[torch.nn.Module]], device: torch.device, meter: LoadMeter) -> Timing:
    """A prefill over the first layer, then decode over them all, in ``name``'s float. ``meter`` reads the
    machine's load over the prefill alone: a one-row product may run in one thread (ATen's float32 product did),
    which would read as a machine half busy."""
    dtype = getattr(torch, name)
    meter.start()
    try:
        prefill_ms = _time_ms(layers[:1], PREFILL_TOKENS, device, 3, dtype)
    finally:
        meter.stop()
    return Timing(name, prefill_ms, _time_ms(layers, 1, device, 7, dtype))


def measure(device: torch.device, hidden: int, intermediate: int, weights: str = "",
            layers: int | None = None) -> Calibration:
    """Each candidate float timed over a layer's matmuls (decode over ``copies`` distinct layers, of the model's
    ``layers``); ``weights`` (int8 / int4): through that format's quantized kernel, the float being its
    activations' (the kernels' speed differs most there: torch's int8 weight-only product read 11 GB/s with
    bfloat16 activations and 2.8 with float32 ones on one machine)."""
    meter, count = LoadMeter(), copies(hidden, intermediate, layers)
    timings = []
    for name in CANDIDATES.get(device.type, ("float32",)):
        dtype = getattr(torch, name)
        ways = [None] if weights or device.type != "cpu" else kernels.offered(dtype)
        fastest: Timing | None = None
        for kernel in ways:                    # as ``kernels.choose`` does: the kernel of the fastest decode
            try:
                timing = _timed(name, [_quantized_layer(weights, hidden, intermediate, dtype, device) if weights
                                       else _layer(hidden, intermediate, dtype, device, kernel) for _ in range(count)],
                                device, meter)
            except (RuntimeError, TypeError, NotImplementedError):      # a dtype the device cannot compute in
                continue
            if fastest is None or timing.decode_ms < fastest.decode_ms:
                fastest = timing
        if fastest is not None:
            timings.append(fastest)
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
              measuring: Callable[[], None] = lambda: None, weights: str = "",
              layers: int | None = None) -> Calibration:
    """The cached decision for this machine and shape, else a new one (``measuring`` is called first, so a
    progress line appears only when something is measured). A measurement taken on a quiet machine decides; one
    taken on a busy machine is not used: the stated rule (:func:`rule`) decides, and that decision is kept too,
    so a machine that stays busy pays a 0.3 s probe at a launch (``kernels.quiet``), not a measurement; the first
    launch whose probe finds it quiet measures again."""
    from engine.model.hardware import device_name

    key = f"{device_name(device)}|{device.type}|torch {torch.__version__}|threads {torch.get_num_threads()}|" \
          f"{hidden}x{intermediate}|timed {TIMING} over {copies(hidden, intermediate, layers)}" + \
          (f"|{weights} weights" if weights else "")
    entry = None if recalibrate else machine_cache.entry(CACHE, key)
    if entry is not None and entry.get("by_rule") and kernels.quiet(torch.randn(intermediate, hidden,
                                                                                 device=device)):
        entry = None
    if entry is not None:
        try:
            return Calibration(entry["best"], [Timing(**t) for t in entry["timings"]], entry.get("native_bf16"),
                               entry.get("cpu_share"), cached=True, by_rule=bool(entry.get("by_rule")),
                               weights=weights)
        except (KeyError, TypeError):
            pass
    measuring()
    found = measure(device, hidden, intermediate, weights, layers)
    if busy(found.cpu_share):
        found = Calibration(rule(device), found.timings, found.native_bf16, found.cpu_share, by_rule=True,
                            weights=weights)
    record = asdict(found)
    record.pop("cached", None)
    record.pop("weights", None)
    machine_cache.remember(CACHE, key, record)
    return found
