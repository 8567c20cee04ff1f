"""This machine's ceilings, measured: peak matmul FLOP/s and memory bandwidth, for the cost model's roofline.

Measured once per device, dtype, torch version and thread count, and cached (a few seconds the first time),
so every later launch shows the bounds at once. On CUDA both are measured on the GPU with CUDA events.
"""

from __future__ import annotations

import json
import platform
import time
from collections.abc import Callable
from pathlib import Path

import torch

from engine.costmodel import Device
from engine.events import HardwarePeaks
from engine.paths import cache_dir


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


def _key(device: torch.device, dtype: torch.dtype) -> str:
    return f"{device_name(device)}|{device.type}|{str(dtype).removeprefix('torch.')}|torch {torch.__version__}|" \
           f"threads {torch.get_num_threads()}"


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


def measure(device: torch.device, dtype: torch.dtype) -> Device:
    """Best of a few: a square matmul (2 n^3 FLOPs) and a large copy (read + write bytes)."""
    gpu = device.type == "cuda"
    n = 8192 if gpu else 1024
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    out = torch.empty(n, n, device=device, dtype=dtype)
    matmul_s = _best_seconds(lambda: torch.matmul(a, b, out=out), device, 10 if gpu else 5)
    elements = (1 << 30 if gpu else 256 << 20) // 4
    src = torch.ones(elements, device=device, dtype=torch.float32)
    dst = torch.empty_like(src)
    copy_s = _best_seconds(lambda: dst.copy_(src), device, 10 if gpu else 5)
    return Device(name=device_name(device), flops_per_s=2.0 * n**3 / matmul_s,
                  bytes_per_s=2.0 * src.nbytes / copy_s)


def peaks(device: torch.device, dtype: torch.dtype) -> tuple[Device, bool]:
    """The ceilings for ``device``/``dtype`` and whether they came from the cache."""
    path = cache_dir() / "hardware.json"
    key = _key(device, dtype)
    try:
        table = json.loads(path.read_text())
    except (OSError, ValueError):
        table = {}
    if isinstance(table.get(key), dict):
        d = table[key]
        return Device(d["name"], float(d["flops_per_s"]), float(d["bytes_per_s"])), True
    found = measure(device, dtype)
    table[key] = {"name": found.name, "flops_per_s": found.flops_per_s, "bytes_per_s": found.bytes_per_s,
                  "measured": time.strftime("%Y-%m-%d")}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(table, indent=1))
    tmp.replace(path)
    return found, False


def peaks_event(loaded) -> HardwarePeaks:
    """The ``HardwarePeaks`` event for a loaded model's device and dtype (measured once, then cached)."""
    dtype = loaded.model.dtype
    found, cached = peaks(loaded.device, dtype)
    return HardwarePeaks(device=found.name, dtype=str(dtype).removeprefix("torch."),
                         flops_per_s=found.flops_per_s, bytes_per_s=found.bytes_per_s, cached=cached)
