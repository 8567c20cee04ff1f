"""A run to the full context of the embedded model in the window (offscreen): how long it takes, what the KV
cache holds at the end, and whether process memory grows beyond what the cache and the stored run explain."""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

from tests.benchmarks.bench_gui import _pause, deep_size, open_window
from tests.benchmarks.common import machine, save

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default="embedded")
    p.add_argument("--tokens", type=int, default=0, help="new tokens (default: up to the full context)")
    args = p.parse_args(argv)
    os.environ.setdefault("KVSCOPE_SETTINGS", str(Path(tempfile.mkdtemp()) / "bench.ini"))
    from engine.facts.kvformula import format_bytes
    from engine.model.memory import process_rss_bytes

    window = open_window(args.model)
    context = window.client.model.model.max_context
    window.controls.prompt.setPlainText("Write a very long story about a dragon who learns to bake bread.")
    window.controls.max_tokens.setValue(args.tokens or context - 1)
    rss_before = process_rss_bytes()
    started = time.perf_counter()
    window.controller.run()
    peak = rss_before
    while not (window.store.current is not None and window.store.current.finished and window.client.busy is None):
        _pause(500)                                     # the event loop runs: the window draws as it would
        peak = max(peak, process_rss_bytes())
    seconds = time.perf_counter() - started
    run = window.store.current
    s = run.summary()
    rss_after = process_rss_bytes()
    trimmed = _malloc_trim()
    rss_trimmed = process_rss_bytes()
    result = {"machine": machine(), "model": run.model.name, "reason": run.reason, "seconds": seconds,
              "prompt_tokens": s.prompt_tokens, "generated_tokens": s.generated_tokens, "kv_tokens": s.kv_tokens,
              "kv_bytes": s.kv_bytes, "decode_tok_s": s.decode_tok_s, "rss_before": rss_before,
              "rss_peak": peak, "rss_after": rss_after, "rss_after_malloc_trim": rss_trimmed if trimmed else None,
              "store_run_bytes": deep_size(run)}
    print(f"{machine()}: {run.model.name}, {s.prompt_tokens} + {s.generated_tokens} tokens ({run.reason}) in "
          f"{seconds:.0f} s, decode {s.decode_tok_s:.1f} tok/s; KV cache at the end {format_bytes(s.kv_bytes)} "
          f"for {s.kv_tokens:,} positions")
    print(f"process memory: {format_bytes(rss_before)} before, peak {format_bytes(peak)}, {format_bytes(rss_after)} "
          f"after; {format_bytes(rss_trimmed)} once the C allocator returns freed pages (malloc_trim); "
          f"stored run {format_bytes(result['store_run_bytes'])}")
    window.close()
    save("long-run", result)
    return result


def _malloc_trim() -> bool:
    """Ask glibc to give freed heap pages back to the OS: what is left is what is really in use."""
    try:
        import ctypes

        return bool(ctypes.CDLL("libc.so.6").malloc_trim(0) or True)
    except (OSError, AttributeError):
        return False


if __name__ == "__main__":
    main()
