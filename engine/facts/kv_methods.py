"""The KV cache methods by name, as the CLI, the lesson's settings and the window take them, checked without
torch: ``full``, ``fp8``, ``quanto4``, ``quanto2``, ``hqq4``, ``sinks:S+W`` (S first positions and the W most
recent), ``h2o:N`` (N positions: the most attended half and the recent half). The caches themselves are built in
``kv_compress``, which needs torch.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import shutil
from dataclasses import dataclass
from pathlib import Path

from engine.facts.errors import ParameterError

QUANTIZED = {"fp8": ("fp8", {}), "quanto4": ("quanto", {"nbits": 4}), "quanto2": ("quanto", {"nbits": 2}),
             "hqq4": ("hqq", {"nbits": 4})}
PACKAGES = {"quanto": "optimum.quanto", "hqq": "hqq"}
RUN_CHOICES = ("full", "fp8", "quanto4", "quanto2", "hqq4", "sinks:4+252")    # what the window offers a run
SINKS = 4                               # StreamingLLM's attention sinks, kept by H2O too


@dataclass(frozen=True)
class Method:
    name: str                           # as given: "fp8", "sinks:4+60", "h2o:64"
    kind: str                           # "full", "quantized" or "evicted"
    backend: str = ""                   # quantized: fp8, quanto, hqq
    options: tuple[tuple[str, int], ...] = ()
    sinks: int = 0                      # evicted: positions kept from the start
    recent: int = 0                     # evicted: the most recent positions kept
    heavy: int = 0                      # evicted: positions kept by the attention they received (H2O)

    @property
    def budget(self) -> int:
        return self.sinks + self.recent + self.heavy

    @property
    def words(self) -> str:
        if self.kind == "full":
            return "full precision (the reference)"
        if self.kind == "quantized":
            bits = dict(self.options).get("nbits")
            return f"{self.backend} {bits}-bit" if bits else f"{self.backend} (per tensor)"
        if self.heavy:
            return f"H2O: {self.budget:,} ({self.sinks} sinks, {self.heavy} most attended, {self.recent} recent)"
        return f"StreamingLLM: {self.sinks} sinks + {self.recent} recent"


def parse_method(text: str, for_run: bool = False) -> Method:
    """A method from its name; one line naming what is wrong otherwise. ``for_run``: what a run can keep its
    cache as (H2O needs the attention every step paid, which only the compression lesson records), so a refusal
    never offers what the run would refuse next."""
    name = text.strip().lower()
    if name == "full":
        return Method(name, "full")
    if name in QUANTIZED:
        backend, options = QUANTIZED[name]
        return Method(name, "quantized", backend, tuple(options.items()))
    try:
        if name.startswith("sinks:"):
            sinks, recent = (int(v) for v in name.removeprefix("sinks:").split("+"))
            if sinks < 0 or recent < 1:
                raise ValueError
            return Method(name, "evicted", sinks=sinks, recent=recent)
        if name.startswith("h2o:") and not for_run:
            budget = int(name.removeprefix("h2o:"))
            if budget < 2 * SINKS + 2:
                raise ValueError
            recent = (budget - SINKS) // 2
            return Method(name, "evicted", sinks=SINKS, recent=recent, heavy=budget - SINKS - recent)
    except ValueError:
        pass
    if for_run and name.startswith("h2o:"):
        raise ParameterError(f"{text.strip()} keeps the positions attention paid most for, which a run does not "
                             f"record: compare it in the KV compression lesson; a run keeps its cache as full, "
                             f"{', '.join(QUANTIZED)} or sinks:S+W")
    evicted = ("sinks:S+W (S sinks, W recent positions, W >= 1)" if for_run else
               f"sinks:S+W (S sinks, W recent positions, W >= 1) or h2o:N (N >= {2 * SINKS + 2} positions)")
    raise ParameterError(f"Unknown KV cache method {text!r}: use full, {', '.join(QUANTIZED)}"
                         + (f" or {evicted}" if for_run else f", {evicted}"))


def available(method: Method) -> str | None:
    """Why ``method`` cannot run here (its package is not installed, or quanto's C++ extension cannot be built
    or is locked by a build that was killed), or None. Never waits: a refusal is one line, and the lesson's
    other methods run."""
    module = PACKAGES.get(method.backend)
    if module is not None and importlib.util.find_spec(module.split(".")[0]) is None:
        return f"{method.name} needs the {module.split('.')[0]} package (pip install optimum-quanto hqq)"
    if method.backend == "quanto":
        return quanto_extension_problem()
    return None


def quanto_build_folder() -> Path | None:
    """Where quanto builds its C++ extension the first time it is used (inside its own package), or None."""
    spec = importlib.util.find_spec("optimum.quanto")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(spec.submodule_search_locations[0]) / "library" / "extensions" / "cpp" / "build"


def quanto_extension_problem() -> str | None:
    """Why quanto's CPU extension would not be ready without a silent wait, or None: built for this torch already,
    or buildable now (a C++ compiler is here and no build holds the lock). A build that was killed leaves its
    lock, on which every later build would wait forever; a double-clicked app has no compiler to build with."""
    folder = quanto_build_folder()
    if folder is None:
        return None
    built = folder / "pytorch_version.txt"
    try:
        ready = built.read_text().strip() == importlib.metadata.version("torch") and any(folder.glob("*.so"))
    except (OSError, importlib.metadata.PackageNotFoundError):
        ready = False
    if ready:
        return None
    lock = folder / "lock"
    if lock.exists():
        return (f"quanto's C++ extension is being built by another process, or a build that was stopped left its "
                f"lock ({lock}): if no other KVScope is running, delete that file (make setup builds it once)")
    if not any(shutil.which(c) for c in ("c++", "g++", "clang++", "cl")):
        return ("quanto builds a C++ extension the first time it is used, and this machine has no C++ compiler "
                "(install one, e.g. g++; make setup builds it once)")
    return None
