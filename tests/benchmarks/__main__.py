"""``make bench``: the benchmarks in turn (each also runs alone: ``python -m tests.benchmarks.bench_engine``).
The full-context run (about 18 minutes on 2 cores) is ``make bench-long``."""

import time

from tests.benchmarks import bench_engine, bench_experiments, bench_formats, bench_gui, bench_trace

PARTS = (
    ("engine: the instrumented session vs model.generate, whole runs by the wall clock", bench_engine),
    ("traces: reading with validation, and the window opening a full-context run", bench_trace),
    ("window: responsiveness while streaming, what drawing costs the engine, the chat path", bench_gui),
    ("weight formats: KVScope float32 / bfloat16 / int8 / int4 beside llama.cpp", bench_formats),
    ("experiments on the real model, through the window", bench_experiments),
)

if __name__ == "__main__":
    for title, module in PARTS:
        started = time.perf_counter()
        print(f"\n== {title} ==", flush=True)
        module.main([])
        print(f"(this part took {time.perf_counter() - started:,.0f} s)", flush=True)
