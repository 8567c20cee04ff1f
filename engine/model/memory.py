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


def release_freed_heap() -> int:
    """Hand the C heap's free pages back to the OS (glibc's ``malloc_trim``); the bytes the process's resident
    set fell by, 0 where there is no glibc. A load frees far more than it keeps: the calibration's sample layers,
    a conversion's copy, a previous model; glibc keeps freed blocks below the heap's top resident, and the status
    strip would show them as the model's memory (SmolLM2 loaded with ``auto`` and a first calibration: 947-974 MB
    resident, 709-711 after)."""
    if not sys.platform.startswith("linux"):
        return 0
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):          # musl and other C libraries have no malloc_trim
        return 0
    before = process_rss_bytes()
    trim(0)
    return max(before - process_rss_bytes(), 0)


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
