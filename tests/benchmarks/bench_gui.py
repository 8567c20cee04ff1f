"""Is the window responsive while a model streams as fast as it can, and what does drawing cost the engine?

1. The tiny model streams a 4096-token run into the window; a 10 ms ``QTimer`` records how late it fires
   (the GUI event loop's latency), and we count text and chart refreshes per second and the store's memory.
2. The embedded model decodes with the window shown and hidden, with torch's default thread count and with
   one thread, so the thread count can be set from a measurement rather than a guess.
3. A compiled run in the window on a fresh graph cache: the run decodes eagerly while its graph is built beside
   it (Python's lock is shared with the build), then switches; how long the build took, how fast each part
   decoded, and how late the same timer fired meanwhile.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from tests.app.conftest import load
from tests.benchmarks.common import machine, save

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")


def deep_size(obj: object, seen: set[int] | None = None) -> int:
    """Bytes held by ``obj`` and everything it references (numpy arrays by their buffers)."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return 0
    seen.add(id(obj))
    if isinstance(obj, np.ndarray):
        return obj.nbytes + sys.getsizeof(obj)
    size = sys.getsizeof(obj)
    if isinstance(obj, dict):
        size += sum(deep_size(k, seen) + deep_size(v, seen) for k, v in obj.items())
    elif isinstance(obj, (list, tuple, set, frozenset)):
        size += sum(deep_size(v, seen) for v in obj)
    elif hasattr(obj, "__dict__"):
        size += deep_size(vars(obj), seen)
    elif hasattr(obj, "__slots__"):
        size += sum(deep_size(getattr(obj, s), seen) for s in obj.__slots__ if hasattr(obj, s))
    return size


def _pause(ms: int) -> None:
    from PySide6.QtCore import QEventLoop, QTimer

    loop = QEventLoop()
    QTimer.singleShot(ms, loop.quit)
    loop.exec()


def _wait(cond, timeout_s: float = 600) -> None:
    deadline = time.time() + timeout_s
    while not cond() and time.time() < deadline:
        _pause(20)
    if not cond():
        raise TimeoutError("benchmark step did not finish in time")


def open_window(model: str, dtype: str = "float32"):
    from app.main import build, parse_args

    _app, window = build(parse_args(["--no-load"]))
    window.show()
    load(window, model, "cpu", dtype)
    _wait(lambda: window.client.model is not None and window.client.busy is None)
    return window


def run_once(window, tokens: int):
    window.controls.max_tokens.setValue(tokens)
    window.controller.run()
    _wait(lambda: window.store.current is not None and window.store.current.finished
          and window.client.busy is None)
    return window.store.current


class Lateness:
    """How late a 10 ms timer fires in the GUI's event loop (its latency), from ``start`` to ``stop``."""

    def __init__(self) -> None:
        from PySide6.QtCore import QElapsedTimer, Qt, QTimer

        self.values: list[float] = []
        self.clock = QElapsedTimer()
        self.timer = QTimer()
        self.timer.setTimerType(Qt.TimerType.PreciseTimer)
        self.timer.setInterval(10)
        self.timer.timeout.connect(self._tick)

    def _tick(self) -> None:
        self.values.append(max(self.clock.nsecsElapsed() / 1e6 - 10.0, 0.0))
        self.clock.restart()

    def start(self) -> None:
        self.clock.start()
        self.timer.start()

    def stop(self) -> dict:
        self.timer.stop()
        return {"timer_lateness_ms_p50": float(np.percentile(self.values, 50)),
                "timer_lateness_ms_p99": float(np.percentile(self.values, 99)),
                "timer_lateness_ms_max": float(np.max(self.values)), "timer_ticks": len(self.values)}


def compiled_in_window(model: str, dtype: str, tokens: int) -> dict:
    """One compiled run in the window, its graph built from an empty graph cache (a machine's first launch)."""
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="kvscope-bench-compile-")
    window = open_window(model, dtype)
    window.controls.static_box.setChecked(True)
    window.controls.compile_box.setChecked(True)
    lateness = Lateness()
    lateness.start()
    run = run_once(window, tokens)
    result = lateness.stop()
    s = run.summary()
    steps = run.steps[1:]
    switch = s.compiled_from_step or len(run.steps)

    def rate(part: list) -> float:
        seconds = sum(step.latency_ms for step in part) / 1000.0
        return len(part) / seconds if seconds else 0.0

    result.update({"dtype": dtype, "tokens": run.n_steps, "compile_ms": s.compile_ms,
                   "compiled_from_step": s.compiled_from_step,
                   "eager_beside_build_tok_s": rate(steps[:switch - 1]), "compiled_tok_s": rate(steps[switch - 1:]),
                   "reason": run.reason})
    window.close()
    return result


def responsiveness(tokens: int) -> dict:
    from tests.tiny_model import build_tiny_model

    folder = build_tiny_model(Path(tempfile.mkdtemp(prefix="kvscope-bench-")), max_positions=tokens + 512)
    window = open_window(str(folder))
    window.controls.prompt.setPlainText("hello world")
    run_once(window, 8)                                   # warm-up
    lateness = Lateness()
    frames0, charts0 = window.frames.frames, window.frames.chart_frames
    lateness.start()
    started = time.perf_counter()
    run = run_once(window, tokens)
    seconds = time.perf_counter() - started
    result = {
        "tokens": run.n_steps, "seconds": seconds, "decode_tok_s": run.summary().decode_tok_s, **lateness.stop(),
        "text_refresh_per_s": (window.frames.frames - frames0) / seconds,
        "chart_refresh_per_s": (window.frames.chart_frames - charts0) / seconds,
        "store_run_bytes": deep_size(run), "events": len(run.events),
    }
    window.close()
    return result


def shown_vs_hidden(model: str, tokens: int, runs: int) -> list[dict]:
    import torch

    window = open_window(model)
    default_threads = torch.get_num_threads()
    rows = []
    for threads in sorted({default_threads, 1}, reverse=True):
        torch.set_num_threads(threads)
        for shown in (True, False):
            window.setVisible(shown)
            run_once(window, 8)
            rates = [run_once(window, tokens).summary().decode_tok_s for _ in range(runs)]
            rows.append({"threads": threads, "window": "shown" if shown else "hidden",
                         "decode_tok_s": float(np.median(rates)), "runs": rates})
    torch.set_num_threads(default_threads)
    window.close()
    return rows


TURNS = ["hey, what is continuous batching?", "How is that different from static batching?",
         "Give me a one-line summary of both."]


def chat_path(model: str, rounds: int, tokens: int) -> dict:
    """Does anything on the window's chat path (transcript, charts, painting) slow the worker? The same three
    turns with reuse, through the window and through a bare session in the same process, alternating; a
    second between turns both ways, as a person takes to read the reply (the window finishes drawing it)."""
    from engine.facts.params import GenerationParams
    from engine.run.session import Session

    window = open_window(model)
    window.controls.max_tokens.setValue(tokens)
    bare = Session(window.client.worker.session.loaded)
    params = GenerationParams(max_new_tokens=tokens)
    ttft: dict[str, list[list[float]]] = {"window": [], "bare": []}
    for r in range(rounds):
        for path in (("window", "bare") if r % 2 == 0 else ("bare", "window")):
            turns = []
            if path == "window":
                window.conversation.clear()
                for text in TURNS:
                    window.controller.send_chat(text, True)
                    _wait(lambda: window.client.busy is None)
                    turns.append(window.store.find(window.conversation.turn_runs[-1]).summary().ttft_ms)
                    _pause(1000)
            else:
                bare.forget()
                messages: list[dict] = []
                for text in TURNS:
                    messages.append({"role": "user", "content": text})
                    s = bare.chat(messages, params, reuse=True).summary
                    messages.append({"role": "assistant", "content": s.text})
                    turns.append(s.ttft_ms)
                    _pause(1000)
            ttft[path].append(turns)
    window.close()
    return {path: [float(np.median([t[i] for t in runs])) for i in range(len(TURNS))]
            for path, runs in ttft.items()}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--model", default="embedded")
    p.add_argument("--model-tokens", type=int, default=48)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--compiled-tokens", type=int, default=1000)
    p.add_argument("--only-compiled", action="store_true", help="part 3 alone")
    args = p.parse_args(argv)
    os.environ.setdefault("KVSCOPE_SETTINGS", str(Path(tempfile.mkdtemp()) / "bench.ini"))

    if args.only_compiled:
        comp = compiled_in_window(args.model, "bfloat16", args.compiled_tokens)
        print(comp)
        return comp
    resp = responsiveness(args.tokens)
    print(f"machine: {machine()}  (Qt platform: {os.environ['QT_QPA_PLATFORM']})")
    print(f"tiny model, {resp['tokens']} tokens in {resp['seconds']:.1f} s ({resp['decode_tok_s']:,.0f} tok/s decode)")
    print(f"GUI event loop: 10 ms timer late by p50 {resp['timer_lateness_ms_p50']:.1f} ms, "
          f"p99 {resp['timer_lateness_ms_p99']:.1f} ms, max {resp['timer_lateness_ms_max']:.1f} ms "
          f"({resp['timer_ticks']} ticks)")
    print(f"refresh: token text {resp['text_refresh_per_s']:.1f}/s, charts {resp['chart_refresh_per_s']:.1f}/s; "
          f"store for this run: {resp['store_run_bytes'] / 2**20:.1f} MiB ({resp['events']} events)")
    rows = shown_vs_hidden(args.model, args.model_tokens, args.runs)
    print(f"{args.model}: decode tok/s (median of {args.runs} runs of {args.model_tokens} tokens)")
    print("| torch threads | window | decode (tok/s) |")
    print("|---:|---|---:|")
    for r in rows:
        print(f"| {r['threads']} | {r['window']} | {r['decode_tok_s']:.2f} |")
    chat = chat_path(args.model, args.runs, 24)
    print(f"chat with reuse, TTFT per turn (ms, median of {args.runs}): through the window "
          + ", ".join(f"{t:,.0f}" for t in chat["window"]) + "; bare session "
          + ", ".join(f"{t:,.0f}" for t in chat["bare"]))
    comp = compiled_in_window(args.model, "bfloat16", args.compiled_tokens)
    print(f"{args.model}, bfloat16, a compiled run of {comp['tokens']} tokens in the window, empty graph cache: "
          f"graph built in {comp['compile_ms'] / 1000:,.1f} s beside {comp['compiled_from_step'] - 1} eager steps "
          f"({comp['eager_beside_build_tok_s']:.1f} tok/s), then compiled at {comp['compiled_tok_s']:.1f} tok/s; "
          f"10 ms timer late by p50 {comp['timer_lateness_ms_p50']:.1f} ms, p99 {comp['timer_lateness_ms_p99']:.0f} "
          f"ms, max {comp['timer_lateness_ms_max']:,.0f} ms over the run")
    result = {"machine": machine(), "responsiveness": resp, "shown_vs_hidden": rows, "chat_path": chat,
              "compiled_in_window": comp}
    save("gui", result)
    return result


if __name__ == "__main__":
    main()
