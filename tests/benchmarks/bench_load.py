"""How long a launch waits for its model: a fresh interpreter importing KVScope's loader and loading the model
(``auto``: the conversion and calibration cached by an untimed first load), by the wall clock, as the window's
worker does. ``--ab`` alternates runs as shipped with runs where HQQ's quantizer is imported with transformers'
cache module, as it was before ``engine/model/hqq_deferred.py`` (HQQ's module compiles functions as it is
imported): the cost that module takes off every launch, measured in the same minutes."""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

from tests.benchmarks.common import machine

CHILD = """
import json, sys, time
started = time.perf_counter()
import engine.model
if sys.argv[2] == "hqq at import":
    from engine.model import hqq_deferred
    hqq_deferred.undo()
from engine.model.models import load
load(sys.argv[1], "cpu", "auto")
print(json.dumps({"s": time.perf_counter() - started, "hqq": "hqq.core.quantize" in sys.modules}))
"""


def timed(model: str, variant: str) -> dict:
    done = subprocess.run([sys.executable, "-c", CHILD, model, variant], capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default="embedded")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--ab", action="store_true", help="alternate with HQQ's quantizer imported with transformers")
    args = p.parse_args(argv)
    variants = ["as shipped", "hqq at import"] if args.ab else ["as shipped"]
    timed(args.model, "as shipped")                                 # conversion and calibration, untimed
    found: dict[str, list[float]] = {v: [] for v in variants}
    hqq: dict[str, set[bool]] = {v: set() for v in variants}
    for _ in range(args.runs):
        for variant in variants:
            run = timed(args.model, variant)
            found[variant].append(run["s"])
            hqq[variant].add(run["hqq"])
    print(machine())
    for variant in variants:
        s = found[variant]
        print(f"{variant:>14}: import and load {min(s):.2f}-{max(s):.2f} s, median {statistics.median(s):.2f} "
              f"({len(s)} fresh processes; HQQ imported: {' / '.join(map(str, sorted(hqq[variant])))})")
    return {"seconds": found}


if __name__ == "__main__":
    main()
