"""This machine's ceilings, measured: peak matmul FLOP/s and memory bandwidth, for the cost model's roofline.

Measured once per device, dtype, torch version and thread count, and cached (a few seconds the first time),
so every later launch shows the bounds at once; a measurement taken on a busy machine is kept too, marked
busy, never replaces a quiet one and gives no ceiling; it is measured again only when the user asks. On CUDA
both are measured on the GPU with CUDA events.
"""

from __future__ import annotations

import dataclasses
import functools
import platform
import time
from collections.abc import Callable
from pathlib import Path

import torch

from engine.facts.contention import LoadMeter, busy
from engine.facts.costmodel import Cost, Device
from engine.facts.events import HardwarePeaks
from engine.store import machine_cache

CACHE = "hardware.json"


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# How the peak product is measured: in the layout a model's linear layers multiply in (activations times the
# transposed weight). Part of the cache key, so a peak measured another way is measured again, never compared.
PRODUCT = "x @ W.T"


def _key(device: torch.device, dtype: torch.dtype) -> str:
    return f"{device_name(device)}|{device.type}|{str(dtype).removeprefix('torch.')}|torch {torch.__version__}|" \
           f"threads {torch.get_num_threads()}|{PRODUCT}"


def _best_seconds(fn: Callable[[], None], device: torch.device, repeats: int) -> float:
    fn()                                                         # warm-up
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            best = min(best, start.elapsed_time(end) / 1000.0)
        else:
            t = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t)
    return best


def measure(device: torch.device, dtype: torch.dtype) -> tuple[Device, float | None]:
    """Best of a few: a square matmul (2 n^3 FLOPs) and a large copy (read + write bytes); with the share of
    the cores this process got meanwhile (``engine.facts.contention``; None on a GPU). The matmul multiplies by
    the transposed matrix, as ``nn.Linear`` does: on a CPU without bfloat16 units torch's bfloat16 product of
    two row-major matrices ran at 0.9 GFLOP/s and this one at 25 (float32: 136 and 127), so the ceiling was 27x
    below what every bfloat16 run achieved and was shown as "measured too low"."""
    gpu = device.type == "cuda"
    meter = LoadMeter()
    meter.start()
    n = 8192 if gpu else 1024
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    out = torch.empty(n, n, device=device, dtype=dtype)
    matmul_s = _best_seconds(lambda: torch.matmul(a, b.mT, out=out), device, 10 if gpu else 5)
    elements = (1 << 30 if gpu else 256 << 20) // 4
    src = torch.ones(elements, device=device, dtype=torch.float32)
    dst = torch.empty_like(src)
    copy_s = _best_seconds(lambda: dst.copy_(src), device, 10 if gpu else 5)
    meter.stop()
    found = Device(name=device_name(device), flops_per_s=2.0 * n**3 / matmul_s, bytes_per_s=2.0 * src.nbytes / copy_s)
    return found, None if gpu else meter.share()


def peaks(device: torch.device, dtype: torch.dtype, remeasure: bool = False,
          measuring: Callable[[], None] | None = None, may_measure: bool = True) -> HardwarePeaks | None:
    """The ceilings for ``device``/``dtype``: from the machine cache unless ``remeasure``. A measurement taken
    on a busy machine never replaces a quiet one (the quiet one is returned); with no quiet one it is kept,
    marked with the CPU share it got, so an always-busy machine is not measured at every launch, and no ceiling
    is computed from it (``HardwarePeaks.quiet``). ``measuring`` is called only when it measures (a cached
    figure needs no word); ``may_measure=False``: the cached figure or None, never a measurement (a lecture must
    not wait a minute for one)."""
    key = _key(device, dtype)
    cached = _cached(key, dtype)
    if cached is not None and not remeasure:
        return cached
    if not may_measure:
        return None
    if measuring is not None:
        measuring()
    found, share = measure(device, dtype)
    if busy(share) and cached is not None and cached.quiet:
        return cached
    today = time.strftime("%Y-%m-%d")
    machine_cache.remember(CACHE, key, {"name": found.name, "flops_per_s": found.flops_per_s,
                                        "bytes_per_s": found.bytes_per_s, "measured": today, "cpu_share": share})
    return HardwarePeaks(found.name, str(dtype).removeprefix("torch."), found.flops_per_s, found.bytes_per_s,
                         cached=False, cpu_share=share, measured=today)


def quiet_peaks(device: torch.device, dtype: torch.dtype, attempts: int = 3) -> HardwarePeaks | None:
    """Peaks a ceiling may be computed from: the quiet ones kept, or measured again (at most ``attempts`` times)
    until a measurement is quiet; None when the machine stayed busy throughout (no ceiling is then shown)."""
    found = peaks(device, dtype)
    for _ in range(attempts):
        if found is not None and found.quiet:
            return found
        found = peaks(device, dtype, remeasure=True)
    return found if found is not None and found.quiet else None


def share_of_ceiling(rate: float, ceiling: float | None) -> str:
    """``rate`` as a share of ``ceiling`` for a table: never above 100% (a rate above its ceiling shows the
    ceiling is wrong, and says so instead), and nothing where there is no ceiling."""
    if ceiling is None or ceiling <= 0:
        return "no quiet ceiling"
    if rate > ceiling:
        return "above the ceiling (ceiling wrong)"
    return f"{rate / ceiling:.0%}"


def _cached(key: str, dtype: torch.dtype) -> HardwarePeaks | None:
    entry = machine_cache.entry(CACHE, key)
    if entry is None:
        return None
    try:
        return HardwarePeaks(str(entry["name"]), str(dtype).removeprefix("torch."), float(entry["flops_per_s"]),
                             float(entry["bytes_per_s"]), cached=True, cpu_share=entry.get("cpu_share"),
                             measured=str(entry.get("measured", "")))
    except (KeyError, TypeError, ValueError):
        return None                                 # a damaged entry is measured again


def peaks_event(loaded, remeasure: bool = False, measuring: Callable[[], None] | None = None,
                may_measure: bool = True) -> HardwarePeaks | None:
    """The ``HardwarePeaks`` event for a loaded model's device and dtype (measured once, then cached)."""
    return model_peaks(loaded, lambda dtype: peaks(loaded.device, dtype, remeasure, measuring, may_measure))


def model_peaks(loaded, find: Callable[[torch.dtype], HardwarePeaks | None]) -> HardwarePeaks | None:
    """The peaks for ``loaded``'s products, each found by ``find``: its dtype's and, where its products of many
    rows run widened to float32 (``kernels.widen_many_rows``: a half float this CPU emulates), float32's for
    those. Each product is held to the peak of the arithmetic it runs in: SmolLM2's bfloat16 prefill of 38 tokens
    on an AVX2 VM achieved 31 GFLOP/s, above bfloat16's emulated 26 and far below float32's 132, and was shown as
    "the peak was measured too low". None where either peak is missing (no ceiling rather than a wrong one)."""
    found = find(loaded.model.dtype)
    rows = getattr(loaded.kernel, "wide_rows", 0)                # a KernelChoice on a CPU, else None
    if found is None or not rows:
        return found
    wide = find(torch.float32)
    if wide is None:
        return None
    shares = [share for share in (found.cpu_share, wide.cpu_share) if share is not None]
    return dataclasses.replace(found, cached=found.cached and wide.cached, cpu_share=min(shares) if shares else None,
                               wide_rows=rows, wide_flops_per_s=wide.flops_per_s)


def implausible(peaks: HardwarePeaks, achieved_flops_per_s: float, achieved_bytes_per_s: float = 0.0,
                cost: Cost | None = None) -> bool:
    """A run that achieved more than a ceiling shows the ceiling is wrong (measured while busy, or the
    machine changed): time to measure it again. ``cost``: what achieved it (a prefill), held to the peak of the
    arithmetic its products ran in (``Cost.peak_flops_per_s``)."""
    peak = cost.peak_flops_per_s(Device.of(peaks)) if cost is not None else peaks.flops_per_s
    return achieved_flops_per_s > 1.1 * peak or achieved_bytes_per_s > 1.1 * peaks.bytes_per_s


# The CPU flags of units that compute each half float natively; without them torch emulates it in float32.
HALF_UNITS = {torch.bfloat16: ("avx512_bf16", "amx_bf16"), torch.float16: ("avx512_fp16", "amx_fp16")}


def native_bf16(device: torch.device) -> bool | None:
    """Whether ``device`` computes bfloat16 natively (a CPU: AVX512_BF16 or AMX units; else it is emulated)."""
    return native_float(device, torch.bfloat16)


def native_float(device: torch.device, dtype: torch.dtype) -> bool | None:
    """Whether ``device`` has units for the half float ``dtype`` (``HALF_UNITS`` on a CPU); None where nobody can
    tell (a CPU whose flags cannot be read, a device other than a CPU or a CUDA GPU)."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported() if dtype == torch.bfloat16 else True
    if device.type != "cpu":
        return None
    flags = _cpu_flags()
    return None if flags is None else any(flag in flags for flag in HALF_UNITS.get(dtype, ()))


@functools.cache
def _cpu_flags() -> frozenset[str] | None:
    """Read once: a product asks at every call, and /proc/cpuinfo took 100 us a read on a 2-vCPU VM."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    line = next((line for line in text.splitlines() if line.startswith("flags")), "")
    return frozenset(line.partition(":")[2].split())


def gemm_dtype(dtype: torch.dtype, device_type: str) -> torch.dtype:
    """The float a product of many rows runs in: ``dtype`` itself, except a half float on a CPU not known to have
    units for it, where torch's GEMM emulates it and float32 over the weights widened for the call is faster
    (2-vCPU AVX2 AMD EPYC: SmolLM2's eager bfloat16 prefill of 512 tokens 97 -> 315 tok/s; int8's codes, 32 x 576
    x 1,536, bfloat16 3.9 ms, float32 1.9). The caller puts the result back in ``dtype``."""
    if device_type == "cpu" and dtype in HALF_UNITS and not native_float(torch.device("cpu"), dtype):
        return torch.float32
    return dtype
