"""The KV cache methods by name, as the CLI, the lesson's settings and the window take them, checked without
torch: ``full``, ``fp8``, ``quanto4``, ``quanto2``, ``hqq4``, ``sinks:S+W`` (S first positions and the W most
recent), ``h2o:N`` (N positions: the most attended half and the recent half). The caches themselves are built in
``kv_compress``, which needs torch.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

from engine.errors import ParameterError

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
    """Why ``method`` cannot run here (its package is not installed), or None."""
    module = PACKAGES.get(method.backend)
    if module is not None and importlib.util.find_spec(module.split(".")[0]) is None:
        return f"{method.name} needs the {module.split('.')[0]} package (pip install optimum-quanto hqq)"
    return None
