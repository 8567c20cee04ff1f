"""Memory figures for the status strip: the process's resident memory and, on a GPU, what torch holds."""

from __future__ import annotations

import os
import sys


def process_rss_bytes() -> int:
    """Resident set size now (Linux ``/proc``), else the peak (``getrusage``), else 0."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        pass
    try:
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024
    except (ImportError, OSError):
        return 0


def device_memory_bytes(device: str) -> tuple[int, int] | None:
    """``(allocated, reserved)`` on a CUDA device; None elsewhere. Imports torch only if already loaded."""
    if not device.startswith("cuda") or "torch" not in sys.modules:
        return None
    import torch

    return int(torch.cuda.memory_allocated(device)), int(torch.cuda.memory_reserved(device))


def available_bytes(device: str = "cpu") -> int | None:
    """Memory a model could still take: free GPU memory on a CUDA device, else what the OS reports available
    (``MemAvailable``, which counts reclaimable caches); None when it cannot be read."""
    if device.startswith("cuda") and "torch" in sys.modules:
        import torch

        return int(torch.cuda.mem_get_info(device)[0])
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except (ImportError, OSError):
        pass
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def total_bytes() -> int | None:
    """The machine's memory in all (a memory budget larger than it is a mistake)."""
    try:
        import psutil

        return int(psutil.virtual_memory().total)
    except (ImportError, OSError):
        try:
            return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError, AttributeError):
            return None


def copy_refused(what: str, nbytes: int) -> str | None:
    """Why a second copy of ``nbytes`` (a kernel's packed weights, a package's) is not made, or None: it would take
    more than a quarter of the free memory."""
    free = available_bytes("cpu")
    if free is not None and nbytes > free // 4:
        return f"{what} ({nbytes / 2**30:.1f} GiB) would take more than a quarter of the free memory"
    return None
