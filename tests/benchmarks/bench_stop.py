"""How long Stop takes: every lesson that runs on a model here, at the settings it declares for the course, and one
run on a long prompt, each stopped part way (``--at`` seconds in, a run 0.3 s into its prefill) the way the
window stops them (the cancel event, a session that prefills in passes of at most half a second), timed by the
wall clock from the stop to the moment the lesson or run has returned. The tests count a stop in passes; this says
what that is in seconds on this machine."""

from __future__ import annotations

import argparse
import os
import threading
import time

from tests.benchmarks.common import machine


def stopped_after(work, at_s: float) -> tuple[float, bool]:
    """``work(cancel)`` in a thread, cancelled ``at_s`` in: ms from the stop to its return, and whether it had
    already ended on its own."""
    cancel = threading.Event()
    thread = threading.Thread(target=work, args=(cancel,), daemon=True)
    thread.start()
    thread.join(at_s)
    if not thread.is_alive():
        return 0.0, True
    began = time.perf_counter()
    cancel.set()
    thread.join()
    return (time.perf_counter() - began) * 1000.0, False


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default="embedded")
    p.add_argument("--at", type=float, default=3.0, help="seconds into each lesson to stop it (default 3)")
    args = p.parse_args(argv)
    from engine import lessons
    from engine.facts.params import GenerationParams
    from engine.model.hardware import peaks_event
    from engine.model.models import load
    from engine.run.experiment import run_lesson
    from engine.run.session import STOPPABLE, RunOptions, Session

    loaded = load(args.model, device="cpu", dtype="float32")
    session = Session(loaded, RunOptions(prefill_chunk=STOPPABLE))
    peaks = peaks_event(loaded)
    long_prompt = " ".join(["The KV cache keeps the keys and values of every position already read."] * 120)
    session.run("warm up", GenerationParams(max_new_tokens=2), lambda _e: None)
    rows: dict[str, dict] = {}
    load_before = os.getloadavg()[0]      # the bench itself idles while it waits: a CPU share would say "busy"
    print(f"{loaded.facts.name}, {loaded.facts.dtype} on {machine()}; each stopped {args.at:g} s in; load "
          f"average before: {load_before:.2f}")
    print("what | stop took ms")
    print("-----+-------------")

    def plain(cancel: threading.Event) -> None:
        session.run(long_prompt, GenerationParams(max_new_tokens=8, chat_template=False), lambda _e: None, cancel)

    ms, ended = stopped_after(plain, 0.3)
    rows["a run, 0.3 s into a long prefill"] = {"ms": ms, "ended": ended}
    for lesson in lessons.sweeps():
        if lesson.target != "model" or not lesson.course:
            continue

        def work(cancel: threading.Event, lesson=lesson) -> None:
            run_lesson(lesson, session, lesson.settings(**lesson.course), lambda _e: None, cancel, peaks)

        ms, ended = stopped_after(work, args.at)
        rows[lesson.kind] = {"ms": ms, "ended": ended}
    for what, row in rows.items():
        print(f"{what} | " + ("ended before the stop" if row["ended"] else f"{row['ms']:,.0f}"))
    return {"machine": machine(), "rows": rows, "load_average_before": load_before}


if __name__ == "__main__":
    main()
