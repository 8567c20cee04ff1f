"""Readers with a fault planted in each, so the harness's tests see it catch every kind it claims to."""

from __future__ import annotations

import os
import time
from pathlib import Path

from tests.fuzz.harness import Target


class Refusal(Exception):
    pass


def _fine(data: bytes, work: Path) -> object:
    if b"!" in data:
        raise Refusal(f"in.txt holds a '!' ({len(data)} bytes)")
    return len(data)


def _hangs(data: bytes, work: Path) -> object:
    while True:
        time.sleep(0.01)


def _unbounded(data: bytes, work: Path) -> object:
    held = []
    while True:
        held.append(bytearray(64 << 20))


def _crashes(data: bytes, work: Path) -> object:
    return data.decode("ascii") + 1


def _writes_outside(data: bytes, work: Path) -> object:
    with open(work.parents[1] / "kvscope-fuzz-planted.txt", "wb") as f:          # beside the run's own folder
        f.write(data)


def _runs_code(data: bytes, work: Path) -> object:
    return eval("1 + 1")  # noqa: S307 - the fault planted


def _imports(data: bytes, work: Path) -> object:
    import antigravity  # noqa: F401 - the fault planted


def _rambles(data: bytes, work: Path) -> object:
    raise Refusal("first line\nsecond line")


def _dies(data: bytes, work: Path) -> object:
    os._exit(3)


_SEEDS = lambda: [b"hello", b"a!b"]  # noqa: E731
PLANTED = {t.name: t for t in (
    Target("planted:fine", "refuses a '!' in one line naming in.txt", _SEEDS, _fine, (Refusal,), "in.txt"),
    Target("planted:hangs", "never returns", _SEEDS, _hangs, (Refusal,), time_cap_s=1.0, mutate=False,
           warm_seeds=False),
    Target("planted:unbounded", "holds memory without end", _SEEDS, _unbounded, (Refusal,),
           mutate=False, warm_seeds=False),
    Target("planted:crashes", "a TypeError", _SEEDS, _crashes, (Refusal,),
           mutate=False, warm_seeds=False),
    Target("planted:writes-outside", "writes beside the home folder", _SEEDS, _writes_outside, (Refusal,),
           mutate=False, warm_seeds=False),
    Target("planted:runs-code", "evaluates a string", _SEEDS, _runs_code, (Refusal,),
           mutate=False, warm_seeds=False),
    Target("planted:imports", "imports a module", _SEEDS, _imports, (Refusal,),
           mutate=False, warm_seeds=False),
    Target("planted:rambles", "refuses in two lines", _SEEDS, _rambles, (Refusal,),
           mutate=False, warm_seeds=False),
    Target("planted:dies", "ends the process", _SEEDS, _dies, (Refusal,),
           mutate=False, warm_seeds=False),
)}
