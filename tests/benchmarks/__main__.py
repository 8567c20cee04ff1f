"""``make bench``: every benchmark in turn (each also runs alone: ``python -m tests.benchmarks.bench_engine``)."""

import sys

from tests.benchmarks import bench_engine

if __name__ == "__main__":
    print("== engine: instrumented session vs model.generate ==", flush=True)
    bench_engine.main(sys.argv[1:])
