"""``make bench``: every benchmark in turn (each also runs alone: ``python -m tests.benchmarks.bench_engine``)."""

from tests.benchmarks import bench_engine, bench_experiments, bench_gui, bench_long

if __name__ == "__main__":
    print("== engine: instrumented session vs model.generate ==", flush=True)
    bench_engine.main([])
    print("\n== window: responsiveness while streaming, and what drawing costs the engine ==", flush=True)
    bench_gui.main([])
    print("\n== experiments on the real model (charts saved for README) ==", flush=True)
    bench_experiments.main([])
    print("\n== a run to the full context of the embedded model (about 10 minutes on 2 cores) ==", flush=True)
    bench_long.main([])
