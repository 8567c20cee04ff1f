"""llama.cpp at its best on this machine, for the bench's side-by-side: builds of llama-cpp-python with every
instruction set this CPU runs safely, tried in order, and the first that decodes every format kept.

On x86-64 the order is: ``native`` (``GGML_NATIVE``: everything the compiler sees, AMX tiles included), then
``native, AMX off`` (the same instruction sets named one by one, the AMX tiles left out: on a 2-vCPU Sapphire
Rapids VM the native build of llama-cpp-python 0.3.36 died with SIGSEGV at the first tile instruction of its own AMX
kernel, ``ldtilecfg`` in ``ggml_backend_amx_mul_mat``, while torch's oneDNN ran its AMX kernels there), then
``x86-64-v3`` (AVX2/FMA/F16C, which every x86 CPU since 2015 runs). Each build lives in a folder of its own under
``build/llama-cpp/`` (built once, kept while its flags stay the same); a probe process decodes a few tokens of
each GGUF format with it, and a build whose probe dies (a signal) or fails is passed over, saying why. Elsewhere
(ARM, ...) the native build is the only candidate.

``python -m tests.benchmarks.llama_builds`` (``make bench`` runs it first) builds, probes and writes the choice to
``build/llama-cpp/chosen.json``; the formats bench imports llama_cpp from the folder it names and labels every
row with the build. The choice itself (``candidates``, ``choose``) is plain Python, tested on any machine.
"""

from __future__ import annotations

import json
import os
import platform
import signal
import subprocess
import sys
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BUILDS = ROOT / "build" / "llama-cpp"
CHOSEN = BUILDS / "chosen.json"
PACKAGE = os.environ.get("LLAMA_CPP_PYTHON", "llama-cpp-python==0.3.36")
AMX = frozenset({"amx_tile", "amx_int8", "amx_bf16"})
# /proc/cpuinfo's flag -> the ggml option that turns it on (a build names only what the CPU reports)
GGML_OPTIONS = {"avx": "GGML_AVX", "avx2": "GGML_AVX2", "fma": "GGML_FMA", "f16c": "GGML_F16C", "bmi2": "GGML_BMI2",
                "avx_vnni": "GGML_AVX_VNNI", "avx512f": "GGML_AVX512", "avx512vbmi": "GGML_AVX512_VBMI",
                "avx512_vnni": "GGML_AVX512_VNNI", "avx512_bf16": "GGML_AVX512_BF16"}
V3 = ("avx", "avx2", "fma", "f16c", "bmi2")
PROBE_S = 600
RUNTIME_DEPS = ("diskcache>=5.6.1", "jinja2>=2.11.3")     # llama-cpp-python's own, besides numpy (torch's is used)


@dataclass(frozen=True)
class Build:
    """One way of building llama.cpp: its name (what a table says), its CMake arguments and why it is tried."""

    name: str
    cmake_args: str
    why: str

    @property
    def folder(self) -> Path:
        return BUILDS / self.name.replace(", ", "-").replace(" ", "-")


def cpu_flags(cpuinfo: str | None = None) -> set[str]:
    """The instruction-set flags the kernel reports for the first CPU."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return set()
    line = next((line for line in cpuinfo.splitlines() if line.startswith("flags")), "")
    return set(line.partition(":")[2].split())


def explicit(flags: Iterable[str]) -> str:
    """CMake arguments that turn on exactly these instruction sets (native detection off)."""
    wanted = [GGML_OPTIONS[f] for f in GGML_OPTIONS if f in set(flags)]
    return " ".join(["-DGGML_NATIVE=OFF", *(f"-D{option}=ON" for option in wanted)])


def candidates(flags: set[str], machine: str) -> list[Build]:
    """The builds worth trying on this CPU, best first."""
    if machine not in ("x86_64", "AMD64"):
        return [Build("native", "-DGGML_NATIVE=ON", f"{machine}: the compiler's tuning for this CPU")]
    out = [Build("native", "-DGGML_NATIVE=ON", "every instruction set this CPU reports")]
    if flags & AMX:
        kept = sorted(f for f in flags if f in GGML_OPTIONS)
        out.append(Build("native, AMX off", explicit(kept),
                         f"the native build without the AMX tiles ({', '.join(sorted(kept))})"))
    out.append(Build("x86-64-v3", explicit(V3), "AVX2, FMA, F16C: what every x86 CPU since 2015 runs"))
    return out


def choose(builds: list[Build], probe: Callable[[Build], str | None]) -> tuple[Build | None, list[str]]:
    """The first build whose probe passes (``probe`` returns None, or why it failed), and a line per build passed
    over saying why."""
    notes = []
    for build in builds:
        failure = probe(build)
        if failure is None:
            return build, notes
        notes.append(f"{build.name}: {failure}")
    return None, notes


def probe_words(returncode: int, stderr: str, decoded: list[str] = ()) -> str | None:
    """A probe process's end in words (None: it decoded every format); ``decoded``: the formats it got through
    before it ended."""
    if returncode == 0:
        return None
    after = f" after decoding {', '.join(decoded)}" if decoded else " before decoding any format"
    if returncode < 0:
        number = -returncode
        name = signal.Signals(number).name if number in {s.value for s in signal.Signals} else f"signal {number}"
        return f"the probe died with {name}{after}"
    return f"the probe failed{after} ({_last_line(stderr) or f'exit {returncode}'})"


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1][:200] if lines else ""


# --- building and probing (minutes; only here, never in the test suite) ----------------------------------------
def build(b: Build) -> Path:
    """``b`` built into its own folder (kept while its CMake arguments stay the same), without its dependencies
    (a second numpy would shadow torch's): the two it needs beside numpy go into this environment."""
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", *RUNTIME_DEPS], check=True)
    stamp = b.folder / ".cmake-args"
    if stamp.exists() and stamp.read_text() == b.cmake_args:
        return b.folder
    b.folder.mkdir(parents=True, exist_ok=True)
    print(f"building llama-cpp-python ({b.name}: {b.cmake_args}); minutes", flush=True)
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-cache-dir", "--upgrade",
                    "--target", str(b.folder), PACKAGE], check=True,
                   env={**os.environ, "CMAKE_ARGS": b.cmake_args, "CMAKE_BUILD_PARALLEL_LEVEL": str(os.cpu_count())})
    stamp.write_text(b.cmake_args)
    return b.folder


PROBE = r"""
import sys
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from llama_cpp import Llama
from tests.benchmarks.bench_formats import gguf_variants
for name, path in gguf_variants(Path(sys.argv[2])).items():
    llm = Llama(model_path=str(path), n_ctx=256, n_threads=2, verbose=False)
    out = llm("The cache keeps", max_tokens=4, temperature=0.0)
    print(name, repr(out["choices"][0]["text"]), flush=True)
"""


def probe(b: Build) -> str | None:
    """Build ``b``, then in a process of its own make the bench's GGUFs (if missing) and decode a few tokens of
    each format with it."""
    try:
        folder = build(b)
    except subprocess.CalledProcessError as exc:
        return f"did not build (pip exit {exc.returncode})"
    (BUILDS / "ggufs").mkdir(parents=True, exist_ok=True)
    done = subprocess.run([sys.executable, "-c", PROBE, str(folder), str(BUILDS / "ggufs")], capture_output=True,
                          text=True, timeout=PROBE_S, cwd=ROOT)
    return probe_words(done.returncode, done.stderr, [line.split()[0] for line in done.stdout.splitlines() if line])


def chosen() -> dict | None:
    """The build the last ``python -m tests.benchmarks.llama_builds`` kept (None: none yet)."""
    try:
        return json.loads(CHOSEN.read_text())
    except (OSError, ValueError):
        return None


def main() -> int:
    flags = cpu_flags()
    builds = candidates(flags, platform.machine())
    best, notes = choose(builds, probe)
    for note in notes:
        print(f"passed over {note}")
    if best is None:
        print("no llama.cpp build ran every format here", file=sys.stderr)
        return 1
    record = {**asdict(best), "folder": str(best.folder), "passed_over": notes,
              "cpu_flags": sorted(f for f in flags if f in GGML_OPTIONS or f in AMX)}
    CHOSEN.write_text(json.dumps(record, indent=1))
    print(f"llama.cpp for the bench: {best.name} ({best.why})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
