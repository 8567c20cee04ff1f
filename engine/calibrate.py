"""Which float dtype is fastest here? Measured, not assumed: bfloat16 halves the bytes decode reads, but on a
CPU without native bf16 units its matmuls are emulated and prefill gets several times slower.

A short calibration times one decoder layer's worth of matmuls (the model's own hidden and intermediate
sizes) per candidate dtype: one token at a time (decode: reading weights) and 64 tokens at once (prefill:
arithmetic). The score is the time of a typical run, a 64-token prefill plus 64 decode steps; ``auto`` takes
the lowest, float32 on a tie, so it is never slower than float32 in its own measurement. Cached per device,
torch version, thread count and shape (a second or two the first time); not cached when the machine was busy.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from engine.load import LoadMeter, busy
from engine.paths import cache_dir

CANDIDATES = {"cpu": ("float32", "bfloat16"), "cuda": ("float32", "bfloat16", "float16"), "mps": ("float32", "float16")}
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

    def timing(self, dtype: str) -> Timing | None:
        return next((t for t in self.timings if t.dtype == dtype), None)

    def reason(self) -> str:
        """Why ``auto`` chose what it chose, in one line (shown beside the model)."""
        base, best = self.timing("float32"), self.timing(self.best)
        native = {True: "native bf16 on this CPU", False: "bf16 emulated on this CPU", None: ""}[self.native_bf16]
        native = f" ({native})" if native else ""
        if base is None or best is None or best.dtype == "float32":
            others = [t for t in self.timings if t.dtype != "float32"]
            slower = ", ".join(f"{t.dtype} {base.run_ms / t.run_ms:.2f}x" for t in others) if base else ""
            return f"float32: the others were slower here{native} ({slower} the speed, measured)"
        return (f"{best.dtype}: {base.decode_ms / best.decode_ms:.1f}x the decode and "
                f"{base.prefill_ms / best.prefill_ms:.1f}x the prefill speed of float32{native} (measured)")


def native_bf16(device: torch.device) -> bool | None:
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    if device.type != "cpu":
        return None
    try:
        flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")),
                     "")
    except OSError:
        return None
    return any(flag in flags.split() for flag in ("avx512_bf16", "amx_bf16"))


def _layer(hidden: int, intermediate: int, dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    """The weights of one decoder layer's matmuls: q, k, v, o, then gate, up and down."""
    shapes = [(hidden, hidden)] * 4 + [(intermediate, hidden)] * 2 + [(hidden, intermediate)]
    return [torch.randn(*shape, device=device, dtype=dtype) / shape[1] ** 0.5 for shape in shapes]


def _time_ms(weights: list[torch.Tensor], tokens: int, device: torch.device, repeats: int) -> float:
    hidden = weights[0].shape[1]
    x = torch.randn(tokens, hidden, device=device, dtype=weights[0].dtype)

    def once() -> None:
        q, k, v, o, gate, up, down = weights
        for w in (q, k, v, o, gate):
            torch.nn.functional.linear(x, w)
        torch.nn.functional.linear(torch.nn.functional.linear(x, up), down)
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


def measure(device: torch.device, hidden: int, intermediate: int) -> Calibration:
    meter = LoadMeter()
    meter.start()
    timings = []
    for name in CANDIDATES.get(device.type, ("float32",)):
        dtype = getattr(torch, name)
        try:
            weights = _layer(hidden, intermediate, dtype, device)
            timings.append(Timing(name, _time_ms(weights, PREFILL_TOKENS, device, 3),
                                  _time_ms(weights, 1, device, 7)))
        except (RuntimeError, TypeError):            # a dtype the device cannot compute in
            continue
    meter.stop()
    best = min(timings, key=lambda t: (round(t.run_ms, 6), t.dtype != "float32")).dtype
    return Calibration(best, timings, native_bf16(device), None if device.type != "cpu" else meter.share())


def calibrate(device: torch.device, hidden: int, intermediate: int, recalibrate: bool = False,
              measuring: Callable[[], None] = lambda: None) -> Calibration:
    """The cached calibration for this machine and shape, else a new measurement (``measuring`` is called first,
    so a progress line appears only when something is measured)."""
    from engine.hardware import device_name

    path = cache_dir() / "dtypes.json"
    key = f"{device_name(device)}|{device.type}|torch {torch.__version__}|threads {torch.get_num_threads()}|" \
          f"{hidden}x{intermediate}"
    try:
        table = json.loads(path.read_text())
    except (OSError, ValueError):
        table = {}
    entry = table.get(key) if isinstance(table, dict) else None
    if not recalibrate and isinstance(entry, dict):
        try:
            return Calibration(entry["best"], [Timing(**t) for t in entry["timings"]], entry.get("native_bf16"),
                               entry.get("cpu_share"), cached=True)
        except (KeyError, TypeError):
            pass
    measuring()
    found = measure(device, hidden, intermediate)
    if not busy(found.cpu_share):
        table = table if isinstance(table, dict) else {}
        table[key] = {**asdict(found), "measured": time.strftime("%Y-%m-%d")}
        table[key].pop("cached", None)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(table, indent=1))
        tmp.replace(path)
    return found
