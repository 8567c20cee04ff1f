"""Shared bits of the benchmarks: the machine description and the results folder."""

from __future__ import annotations

import json
import os
import platform
import statistics
from pathlib import Path

RESULTS = Path(os.environ.get("KVSCOPE_BENCH_DIR") or os.environ.get("OUT") or "bench-results")


def machine() -> str:
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    desc = f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__} ({torch.get_num_threads()} threads)"
    if torch.cuda.is_available():
        desc += f", GPU {torch.cuda.get_device_name()}"
        return desc
    return f"{desc}, {cpu_flags()}"


def cpu_flags() -> str:
    """The instruction sets a CPU figure depends on: torch's dispatch level and the vector and matrix flags."""
    import torch

    wanted = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "avx_vnni", "amx_bf16", "amx_int8", "asimd", "sve")
    try:
        flags = next((line.split(":", 1)[1].split() for line in Path("/proc/cpuinfo").read_text().splitlines()
                      if line.startswith(("flags", "Features"))), [])
    except OSError:
        flags = []
    have = [f for f in wanted if f in flags]
    return f"torch dispatches {torch.backends.cpu.get_cpu_capability()}; flags {' '.join(have) or 'unknown'}"


def copy_words(reached_gb_s: float, copy_gb_s: float | None) -> str:
    """A bandwidth reached as a share of the copy bandwidth, for a table (never above 100%, none without a quiet
    copy measurement)."""
    from engine.model.hardware import share_of_ceiling

    share = share_of_ceiling(reached_gb_s, copy_gb_s)
    return f"{share} of {copy_gb_s:.1f} GB/s" if copy_gb_s and share.endswith("%") else share


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def save(name: str, data: dict) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(data, indent=2))
    return path
