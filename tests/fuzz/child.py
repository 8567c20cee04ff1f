"""One target's inputs, run in this process under the caps (``python -m tests.fuzz.child JOB``, JOB a JSON object:
target, seed, deadline as a Unix time, skip, work, only). One JSON line per input on stdout; before each input
its bytes are written to ``work/current.bin`` so that a parent that finds this process dead can keep it."""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path

from tests.fuzz import harness
from tests.fuzz.harness import Target

# typing compiles the string annotations of KVScope's own classes (``from __future__ import annotations``) the
# first time a class's hints are read: code from the source tree, never from an input.
ALWAYS_COMPILES = ("typing",)


MARK = "\x1efuzz "          # a record's prefix: a reader's own prints on stdout are not records


class Overtime(BaseException):
    """The input ran past its time cap (a BaseException: no reader's ``except Exception`` swallows it)."""


class Canary:
    """The audit hook: what an input may not make KVScope do. Armed once the target is warm."""

    def __init__(self, target: Target, work: Path) -> None:
        self.target = target
        self.work = os.path.realpath(work)
        self.armed = True               # files: from the start (a warm-up writes nowhere else either)
        self.code_checked = False       # imports, compile and exec: once warm (importing KVScope does all three)
        self.allowed_imports: set[str] = set()
        self.tripped: list[str] = []

    def check_imports(self) -> None:
        self.allowed_imports = set(sys.modules)
        self.code_checked = True

    def __call__(self, event: str, args: tuple) -> None:
        if not self.armed or (event in ("import", "exec", "compile") and not self.code_checked):
            return
        if event == "import":
            name = args[0]
            if name not in self.allowed_imports and not name.startswith(self.target.imports or ("\x00",)):
                self._trip(f"imported {name}")
        elif event in ("exec", "compile"):
            if not self._from(self.target.exec_from + ALWAYS_COMPILES):
                self._trip(f"{event} outside an allowed module")
        elif event in ("subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork"):
            self._trip(f"{event}")
        elif event == "open":
            path, mode, flags = args
            writes = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
                isinstance(flags, int) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT))
            if writes and isinstance(path, (str, bytes, os.PathLike)) and not self._inside(path):
                self._trip(f"opened {os.fsdecode(path)} to write")
        elif event in ("os.remove", "os.rename", "os.rmdir", "shutil.rmtree", "os.truncate", "os.chmod"):
            path, dir_fd = args[0], args[-1] if len(args) > 1 and isinstance(args[-1], int) else None
            if isinstance(path, (str, bytes, os.PathLike)) and not self._inside(path, dir_fd, the_link=True):
                self._trip(f"{event} {os.fsdecode(path)}")

    def _inside(self, path, dir_fd: int | None = None, the_link: bool = False) -> bool:
        """Whether ``path`` lies in the work folder: the file a write reaches (links followed), or for a removal
        the entry itself (removing a link to ``/dev/zero`` removes the link)."""
        path = os.fsdecode(path)
        if dir_fd is not None and not os.path.isabs(path):          # shutil.rmtree removes by folder descriptor
            path = os.path.join(os.readlink(f"/proc/self/fd/{dir_fd}"), path)
        real = (os.path.join(os.path.realpath(os.path.dirname(os.path.abspath(path))), os.path.basename(path))
                if the_link else os.path.realpath(path))
        return real == self.work or real.startswith(self.work + os.sep) or real == os.devnull

    def _from(self, modules: tuple[str, ...]) -> bool:
        if not modules:
            return False
        frame = sys._getframe(2)
        while frame is not None:
            if str(frame.f_globals.get("__name__", "")).startswith(modules):
                return True
            frame = frame.f_back
        return False

    def _trip(self, what: str) -> None:
        self.tripped.append(what)
        self.armed = False              # the report below must not trip it again
        raise PermissionError(f"fuzz canary: {what}")


def _overtime(signum, frame) -> None:
    raise Overtime


def _address_space() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmSize:"):
            return int(line.split()[1]) * 1024
    return 0


def _rss_peak() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def judge(target: Target, run) -> tuple[str, str]:
    """``(verdict, why)`` for one call of ``run``."""
    try:
        run()
    except Overtime:
        return "failed", f"hang: over {target.time_cap_s:g} s"
    except MemoryError:
        return "failed", f"unbounded: over the {harness.MEMORY_CAP >> 20} MiB memory cap"
    except target.errors as exc:
        problem = harness.clear_message(str(exc), target.names)
        if problem:
            return "failed", f"unclear {type(exc).__name__}: {problem}: {str(exc)[:300]!r}"
        return "refused", str(exc)[:200]
    except RecursionError:
        return "failed", "crash: RecursionError"
    except Exception as exc:                                # noqa: BLE001 - the verdict is the point
        where = traceback.extract_tb(exc.__traceback__)[-1]
        return "failed", f"crash: {type(exc).__name__}: {str(exc)[:200]} at {Path(where.filename).name}:{where.lineno}"
    return "result", ""


def main(job: dict) -> None:
    from tests.fuzz.targets import target_named

    target = target_named(job["target"])
    root = Path(job["work"])
    canary = Canary(target, root)
    sys.addaudithook(canary)
    target.warm()
    signal.signal(signal.SIGALRM, _overtime)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)           # a write past the cap is an error (EFBIG), not a kill
    resource.setrlimit(resource.RLIMIT_FSIZE, (harness.FILE_CAP, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    # Warm the reader on its seeds before the caps are tight: lazy imports and first-call caches are not the
    # input's doing. Under a looser cap all the same (a reader may hang or grow on a seed too).
    hard = resource.getrlimit(resource.RLIMIT_AS)[1]
    resource.setrlimit(resource.RLIMIT_AS, (_address_space() + 2 * harness.MEMORY_CAP, hard))
    for data in target.seeds()[:4] if target.warm_seeds else ():
        work = Path(tempfile.mkdtemp(dir=root))
        signal.setitimer(signal.ITIMER_REAL, target.time_cap_s)
        try:
            judge(target, lambda: target.feed(data, work))
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
        shutil.rmtree(work, ignore_errors=True)
    if canary.tripped:
        raise SystemExit(f"the warm-up itself touched a file outside {root}: {canary.tripped[0]}")
    canary.check_imports()
    canary.armed = False
    base_rss = _rss_peak()
    resource.setrlimit(resource.RLIMIT_AS, (_address_space() + harness.MEMORY_CAP, hard))
    print(MARK + json.dumps({"ready": True, "base_rss": base_rss}), flush=True)
    if job.get("only") is not None:
        source = [("found", Path(p).read_bytes()) for p in job["only"]]
    else:
        source = harness.inputs(target, job["seed"])
    for index, (kind, data) in enumerate(source):
        if job.get("limit") is not None and index >= job["limit"]:
            break
        if time.time() > job["deadline"] and target.mutate:     # a fault table runs every case, whatever the budget
            break
        if index < job["skip"]:
            continue
        (root / "current.bin").write_bytes(data)
        work = Path(tempfile.mkdtemp(dir=root))
        canary.armed = True
        canary.tripped.clear()
        started = time.monotonic()
        signal.setitimer(signal.ITIMER_REAL, target.time_cap_s)
        try:
            verdict, why = judge(target, lambda: target.feed(data, work))
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            canary.armed = False                # the harness's own work between inputs is not the reader's
        if canary.tripped:
            verdict, why = "failed", f"code run or file touched: {canary.tripped[0]}"
        if verdict == "failed":
            (root / f"failed-{index}.bin").write_bytes(data)
        shutil.rmtree(work, ignore_errors=True)
        record = {"i": index, "kind": kind, "verdict": verdict, "why": why, "digest": harness.digest(data),
                  "s": round(time.monotonic() - started, 3), "peak": _rss_peak() - base_rss}
        print(MARK + json.dumps(record), flush=True)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
