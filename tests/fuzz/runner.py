"""Run one target's child under a watchdog, again after each death, until its budget is spent."""

from __future__ import annotations

import json
import os
import selectors
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.fuzz import harness
from tests.fuzz.harness import Outcome, Tally

MARK = b"\x1efuzz "

ROOT = Path(__file__).resolve().parents[2]
WARM_S = 180.0                   # a child's imports and warm-up (a tokenizer, Qt) before its first input


def run_target(name: str, budget_s: float | None, seed: int = 0, only: list[Path] | None = None,
               keep: bool = True, limit: int | None = None) -> Tally:
    """Feed ``name`` inputs for ``budget_s`` seconds, or its first ``limit`` inputs whatever the time (the suite's
    way: the same inputs on a busy machine as on a quiet one), or exactly the files ``only``; a failing input is
    saved under ``found/`` when ``keep``."""
    from tests.fuzz.targets import target_named

    target = target_named(name)
    tally = Tally(name)
    started = time.monotonic()
    deadline = time.time() + (budget_s if budget_s is not None else 1e9)
    skip = 0
    with tempfile.TemporaryDirectory(prefix=f"kvscope-fuzz-{name}-") as root:
        while True:
            job = {"target": name, "seed": seed, "deadline": deadline, "skip": skip, "work": root, "limit": limit,
                   "only": [str(p) for p in only] if only is not None else None}
            last, died = _one_child(job, target.time_cap_s, tally)
            if keep and only is None:
                for outcome in tally.failed:
                    kept = Path(root) / f"failed-{outcome.index}.bin"
                    if kept.exists():
                        harness.save_found(name, kept.read_bytes(), outcome.why)
                        kept.unlink()
            if died is None:
                break
            index = skip if last is None else last + 1
            data = (Path(root) / "current.bin").read_bytes() if (Path(root) / "current.bin").exists() else b""
            outcome = Outcome(index, "?", "failed", died, digest=harness.digest(data))
            tally.tried += 1
            tally.failed.append(outcome)
            if keep and only is None:
                harness.save_found(name, data, died)
            skip = index + 1
            if ((time.time() > deadline and target.mutate) or (only is not None and skip >= len(only))
                    or (limit is not None and skip >= limit)):
                break
    tally.seconds = time.monotonic() - started
    return tally


def _one_child(job: dict, time_cap_s: float, tally: Tally) -> tuple[int | None, str | None]:
    """Run a child to its end; ``(last index reported, why it died or None)``."""
    env = {**os.environ, "MALLOC_ARENA_MAX": "2", "OMP_NUM_THREADS": "1", "QT_QPA_PLATFORM": "offscreen",
           "KVSCOPE_CACHE_DIR": str(Path(job["work"]) / "cache"),
           "KVSCOPE_CONFIG_DIR": str(Path(job["work"]) / "config"), "KVSCOPE_DATA_DIR": str(Path(job["work"]) / "data"),
           "HOME": str(Path(job["work"]) / "home"),
           "XDG_CONFIG_HOME": str(Path(job["work"]) / "home" / ".config"), "PYTHONDONTWRITEBYTECODE": "1",
           "TMPDIR": job["work"],
           "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    child = subprocess.Popen([sys.executable, "-m", "tests.fuzz.child", json.dumps(job)], cwd=ROOT, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    selector = selectors.DefaultSelector()
    selector.register(child.stdout, selectors.EVENT_READ)
    last: int | None = None
    ready = False
    buffer = b""
    try:
        while True:
            wait = (time_cap_s + 10.0) if ready else WARM_S
            if not selector.select(wait):
                child.kill()
                return last, (f"hang: no answer within {wait:g} s (killed)" if ready
                              else f"the target did not start within {WARM_S:g} s")
            chunk = os.read(child.stdout.fileno(), 1 << 16)
            if not chunk:
                break
            buffer += chunk
            *lines, buffer = buffer.split(b"\n")
            for line in lines:
                if not line.startswith(MARK):
                    continue
                record = json.loads(line[len(MARK):])
                if "ready" in record:
                    ready = True
                    continue
                last = record["i"]
                tally.tried += 1
                tally.peak_bytes = max(tally.peak_bytes, record["peak"])
                if record["verdict"] == "refused":
                    tally.refused += 1
                elif record["verdict"] == "failed":
                    tally.failed.append(Outcome(record["i"], record["kind"], "failed", record["why"],
                                                record["s"], record["digest"]))
    finally:
        code = child.wait()
        err = child.stderr.read().decode("utf-8", "replace")
        selector.close()
    if code == 0:
        return last, None
    if not ready:
        raise RuntimeError(f"the fuzz target {job['target']} failed to start:\n{err[-3000:]}")
    tail = err.strip().splitlines()[-1:]
    return last, f"died: {tail[0][:200]} (exit status {code})" if tail else f"died: exit status {code}"
