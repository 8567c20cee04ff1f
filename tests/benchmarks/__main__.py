"""``make bench``: the benchmarks in turn (each also runs alone: ``python -m tests.benchmarks.bench_engine``).
The full-context run (about 18 minutes on 2 cores) is ``make bench-long``."""

import time

from tests.benchmarks import (
    bench_contention,
    bench_engine,
    bench_experiments,
    bench_formats,
    bench_gui,
    bench_load,
    bench_prefill_passes,
    bench_profile,
    bench_stop,
    bench_trace,
)

PARTS = (
    ("a launch's wait for its model: import and load in fresh processes, HQQ deferred or not", bench_load, ["--ab"]),
    ("engine: the instrumented session vs model.generate, whole runs by the wall clock", bench_engine, []),
    ("engine, compiled: the session's sinks vs the compiled forward alone", bench_engine, ["--compiled"]),
    ("traces: reading with validation, and the window opening a full-context run", bench_trace, []),
    ("window: responsiveness while streaming, what drawing costs the engine, the chat path, a compiled run",
     bench_gui, []),
    ("weight formats: KVScope eager and compiled beside llama.cpp, decode and prefill, and compile times",
     bench_formats, []),
    ("a busy machine: decode and prefill beside one and two CPU-bound programs, threads fixed or following the load",
     bench_contention, []),
    ("where a decode step's time goes, eager and compiled (bfloat16)", bench_profile, []),
    ("a long prompt in one prefill pass vs in passes (what Stop within a second costs)", bench_prefill_passes, []),
    ("how long Stop takes in every lesson and in a long prefill", bench_stop, []),
    ("experiments on the real model, through the window", bench_experiments, []),
)

if __name__ == "__main__":
    for title, module, args in PARTS:
        started = time.perf_counter()
        print(f"\n== {title} ==", flush=True)
        module.main(args)
        print(f"(this part took {time.perf_counter() - started:,.0f} s)", flush=True)
