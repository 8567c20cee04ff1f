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
