"""``python -m tests.fuzz [--budget S] [--seed N] [TARGET ...]``: every target (or those named) for ``budget``
seconds each, one line per target: inputs tried, refused, failures, peak memory above the warm child. A failing
input is saved under ``tests/fuzz/found/``, where the suite replays it. Exit status 1 when any input failed."""

from __future__ import annotations

import argparse
import os
import sys

from tests.fuzz.runner import run_target
from tests.fuzz.targets import TARGETS


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.fuzz", description=__doc__)
    p.add_argument("targets", nargs="*", help=f"targets to run (default: all of {', '.join(TARGETS)})")
    p.add_argument("--budget", type=float, default=float(os.environ.get("FUZZ_BUDGET", 60)),
                   help="seconds per target (default FUZZ_BUDGET or 60)")
    p.add_argument("--seed", type=int, default=int(os.environ.get("FUZZ_SEED", 0)))
    args = p.parse_args(argv)
    unknown = [t for t in args.targets if t not in TARGETS]
    if unknown:
        p.error(f"unknown target(s) {', '.join(unknown)}; the targets are {', '.join(TARGETS)}")
    failed = 0
    for name in args.targets or list(TARGETS):
        tally = run_target(name, args.budget, args.seed)
        print(tally.line(), flush=True)
        for outcome in tally.failed[:10]:
            print(f"    input {outcome.index} ({outcome.kind}, {outcome.digest}): {outcome.why}", flush=True)
        failed += len(tally.failed)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
