"""A CPU's prefill as an AOTInductor package: one graph for every short prompt, the weights folded in.

Why: a short prompt's prefill is a few hundred products and thousands of small operators around them, each
called from Python (SmolLM2-135M, 32 tokens: some 5,800 operator calls), and on two cores those calls cost as much
as the arithmetic. Compiled, the operators between the products are fused into a few dozen C++ kernels and the
products run inductor's own GEMM kernels over weights packed once, chosen by timing them (``max_autotune``); the
number of tokens stays symbolic, so one package serves every prompt from 2 to ``LONGEST`` tokens (a longer
one's products are large enough for ATen's GEMM, and it prefills eagerly).

Whether the package is faster than an eager prefill depends on the machine, so it is timed, not assumed: once
built or read, the package and the same function uncompiled each prefill a few prompt lengths (interleaved,
medians), and the package serves prompts up to the last length where it was faster; the verdict is kept in the
machine's cache beside the kernel choice. (SmolLM2 float32 on a 2-vCPU Sapphire Rapids, its kernels tuned at 8
rows: eager / package 63 / 68 ms at 32 tokens, 128 / 206 at 128, MKL's GEMM ahead of them; in bfloat16 the
package's AMX kernels were twice as fast as eager at both. Tuned at ``PROBE_TOKENS`` rows, float32's package too is
ahead there; a machine where it is not prefills eagerly.)

The package starts from an empty cache and returns the prompt's keys and values for every layer beside the last
position's logits; the caller writes them into the run's own cache with the cache's own ``update`` (a static
cache of any length, or a growing one), so one package serves every run. It is built after a compiled run's
decode graph, in the same thread (``engine.model.compiled``), and later runs prefill through it; what cannot be
packaged (a model a package does not hold, a cache whose layers keep only part of the prompt) prefills eagerly.
"""

from __future__ import annotations

import os
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from engine.facts.contention import LoadMeter, busy
from engine.model import compiled, kernels, kvcache, packaged, threads
from engine.store import machine_cache

SHORTEST = 2         # a one-token prompt prefills eagerly: export's symbolic sizes start at 2
# Longer prompts prefill eagerly: their products are large enough for ATen's GEMM, and the calls around them weigh
# little. Where the package stops being faster is timed per machine (below): SmolLM2 float32 on a 2-vCPU AMD EPYC,
# eager -> package tok/s, 128 tokens 205 -> 254, 512 tokens 339 -> 264, 4,096 tokens 204 -> 127; int4 on a
# 2-vCPU Sapphire Rapids, eager / package ms at 256 tokens 345 / 50 (torch's int4 kernel is made for a few rows).
LONGEST = 512
# A half float this CPU emulates: eager widens a prefill's products to float32 from ``kernels.WIDE_ROWS`` rows,
# while the package keeps the emulated ones, so only shorter prompts go through it (SmolLM2 bfloat16, 2-vCPU AVX2
# AMD EPYC, eager / package tok/s: 16 tokens 118 / 246, 24 tokens 239 / 256, 32 tokens 289 / 265, 128 tokens
# 473 / 267).
# The prompt a build traces, and a read package is called with once. Its length is the number of rows inductor
# times each product's kernels at (``max_autotune``), so it is a short prompt's, not a handful (SmolLM2 float32, a
# 2-vCPU Sapphire Rapids, eager / package ms traced at 8 tokens: 32 tokens 63 / 68, 128 tokens 128 / 206; traced
# at 32: 64 / 47 and 133 / 123; bfloat16, int8 and int4 within the machine's spread of each other).
PROBE_TOKENS = 32
TIMED_LENGTHS = (8, 32, 128, 256)     # prompt lengths the package is timed against eager at, with its longest
TIMED_ROUNDS = 3                      # interleaved rounds at each length; medians compared
ENV = "KVSCOPE_PREFILL_PACKAGE"       # "always": serve every length it takes, untimed (the tests' way); else timed
CACHE = "prefill_package.json"
_BUILDING = threading.Lock()     # one prefill build at a time in a process: another session's waits, then reads it


def prefill(model: Any, ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """What the package computes: ``ids`` (``[1, n]``) through ``model`` from an empty cache; the last
    position's logits (``[1, 1, V]``), then each layer's keys and values (``[1, kv_heads, n, head_dim]``)."""
    cache = kvcache.new_cache(model)
    logits = kvcache.forward(model, ids, cache).logits
    return (logits, *[t for layer in cache.layers for t in (layer.keys, layer.values)])


def refused(model: Any) -> str | None:
    """Why ``model``'s prefill cannot be packaged here, or None."""
    from transformers.cache_utils import DynamicLayer

    why = packaged.usable(model, widened=_widened_bytes(model))
    if why is not None:
        return why
    kinds = {type(layer) for layer in kvcache.new_cache(model).layers}
    if kinds != {DynamicLayer}:
        return f"its cache's layers ({', '.join(sorted(k.__name__ for k in kinds))}) keep other than every position"
    return None


def serves_up_to(times: dict[int, tuple[float, float]]) -> int:
    """The longest prompt the package serves, from ``times`` (length -> eager ms, package ms): the last length,
    counting up, before the first where eager was as fast; ``SHORTEST - 1`` when eager won at the shortest. A
    length between two timed ones is served only if the package won at the longer one too."""
    longest = SHORTEST - 1
    for n in sorted(times):
        eager_ms, package_ms = times[n]
        if package_ms >= eager_ms:
            break
        longest = n
    return longest


def timed_lengths(longest: int) -> list[int]:
    return sorted({n for n in TIMED_LENGTHS if SHORTEST <= n < longest} | {longest})


def time_both(model: Any, step: Callable[[torch.Tensor], Any], lengths: list[int]) -> dict[int, tuple[float, float]]:
    """Each length's prefill, eager (``prefill`` uncompiled) and through ``step``: one warm-up each, then
    ``TIMED_ROUNDS`` interleaved rounds; the medians in ms."""
    vocab = model.get_input_embeddings().num_embeddings
    out = {}
    with torch.inference_mode():
        for n in lengths:
            ids = torch.tensor([[(7 + 31 * i) % vocab for i in range(n)]])
            eager, package = [], []
            prefill(model, ids)
            step(ids)
            for _ in range(TIMED_ROUNDS):
                for run, kept in ((lambda: prefill(model, ids), eager), (lambda: step(ids), package)):
                    started = time.perf_counter()
                    run()
                    kept.append((time.perf_counter() - started) * 1000.0)
            out[n] = (statistics.median(eager), statistics.median(package))
    return out


def _widened_bytes(model: Any) -> int:
    """What the package's copy holds beyond the model's weights: int8 products go through the float GEMM in a
    prefill (``engine.model.quantize``), so the package folds in their weights widened to the activations'
    float."""
    from engine.model.quantize import Int8Linear

    return sum(m.weight_int8.numel() * (m.scales.element_size() - 1) for m in model.modules()
               if isinstance(m, Int8Linear))


class CompiledPrefill:
    """The model's prefill package: ``graph`` is built once (``build``, in the thread that builds decode graphs)
    and, once ready without error, ``run`` prefills through it."""

    def __init__(self, model: Any, longest: int = LONGEST) -> None:
        self.model = model
        self.longest = min(longest, kernels.WIDE_ROWS - 1) if kernels.widened(model) else longest
        self.graph: compiled.Graph | None = None      # None: never asked for
        self.times: dict[int, tuple[float, float]] = {}    # length -> eager ms, package ms (empty: untimed)
        self.times_busy = False                        # timed while other programs competed for the cores
        self.timed_ms = 0.0                            # how long this process spent timing it (0: a kept verdict)
        self._lock = threading.Lock()                  # guards graph: a run's thread and a build's may ask at once

    @property
    def serving(self) -> int:
        """The longest prompt the package serves: its bound until it is timed, then where it stopped winning."""
        return serves_up_to(self.times) if self.times else self.longest

    def ready(self, n_tokens: int) -> bool:
        """Whether a prompt of ``n_tokens`` can prefill through the package now."""
        graph = self.graph
        return (graph is not None and graph.ready.is_set() and graph.step is not None
                and SHORTEST <= n_tokens <= self.serving)

    def read_saved(self) -> float | None:
        """Read the package if an earlier launch saved it and this session has not asked for it yet, so a run's
        prefill can go through it before any graph is built: the time it took (ms), or None (nothing read)."""
        if self.graph is not None or refused(self.model) is not None:
            return None
        configured = compiled.configure()
        if not self.saved():
            return None
        graph = self.build(configured)
        return graph.compile_ms if graph.step is not None else None

    def saved(self) -> bool:
        """Whether the package was read or built in this process, or saved by an earlier launch."""
        return compiled.known(self.key()) or compiled.saved_graph(self.key()).exists()

    @property
    def probe_tokens(self) -> int:
        """The rows the package is traced and tuned at: ``PROBE_TOKENS``, or its longest prompt where that is
        shorter (a CPU emulating the model's half float serves only ``kernels.WIDE_ROWS - 1`` tokens: traced at
        32 there, export refused the build, and the refusal was kept, so no later launch tried again)."""
        return min(PROBE_TOKENS, self.longest)

    def key(self) -> str:
        return compiled.graph_key(self.model, self.longest, package=True, step=prefill,
                                  tuned_rows=self.probe_tokens)

    def build(self, note: str = "") -> compiled.Graph:
        """Read or build the package (once per session; a later call returns what the first found)."""
        with self._lock:
            if self.graph is not None:
                return self.graph
            graph = self.graph = compiled.Graph(0)
        started = time.perf_counter()
        try:
            with torch.inference_mode(), threads.governor().building():
                note = note or compiled.configure()
                why = refused(self.model)
                if why is not None:
                    graph.error = why
                    return graph
                key = self.key()
                ids = torch.zeros((1, self.probe_tokens), dtype=torch.long)
                with _BUILDING:
                    step, graph.loaded, said = compiled.saved_package(
                        key, lambda path: packaged.build_prefill(prefill, self.model, ids, self.longest, path,
                                                                 compiled.inductor_dir()),
                        lambda runner: runner, lambda runner: runner(ids))
                    if step is not None:
                        self._time(key, step)
                if step is None:
                    graph.error = said
                else:
                    graph.step, graph.note = step, "; ".join(n for n in (note, said) if n)
            compiled.seal_inductor_cache()
        except Exception as exc:  # noqa: BLE001  (a failed build leaves prefill eager; the run says why)
            graph.step, graph.error = None, compiled.first_line(exc)
        finally:
            graph.compile_ms = (time.perf_counter() - started) * 1000.0
            graph.ready.set()
        return graph

    def _time(self, key: str, step: Callable[[torch.Tensor], Any]) -> None:
        """Time the package against eager on this machine, which sets ``serving`` (kept between launches; a
        verdict from a busy machine is kept marked and timed again once a probe finds the machine quiet)."""
        if os.environ.get(ENV, "").strip().lower() == "always":
            return
        key = f"{key}|threads {torch.get_num_threads()}|rounds {TIMED_ROUNDS}"
        lengths = timed_lengths(self.longest)
        entry = _kept(machine_cache.entry(CACHE, key), lengths)
        weight = self.model.get_input_embeddings().weight
        if entry is None or (entry["busy"] and kernels.quiet(weight)):
            meter = LoadMeter()
            meter.start()
            times = time_both(self.model, step, lengths)
            meter.stop()
            self.timed_ms = meter.wall_s * 1000.0
            entry = {"times": times, "busy": busy(meter.share())}
            machine_cache.remember(CACHE, key, {"times": {str(n): list(t) for n, t in times.items()},
                                                "busy": entry["busy"]})
        self.times, self.times_busy = entry["times"], entry["busy"]

    def serving_words(self) -> str:
        """Which prompts the package serves and why, from its timing ("" when it was not timed)."""
        if not self.times:
            return ""
        rates = ", ".join(f"{n} tokens {e:,.0f} / {p:,.0f} ms" for n, (e, p) in sorted(self.times.items()))
        busy_words = ", timed on a busy machine" if self.times_busy else ""
        if self.timed_ms:        # part of the build's or read's time, said apart
            busy_words += f"; timed in {self.timed_ms / 1000:,.1f} s"
        if self.serving < SHORTEST:
            return f"was slower than an eager prefill at every length timed here (eager / package: {rates}{busy_words})"
        return (f"serves prompts of {SHORTEST}-{self.serving:,} tokens, where it was timed faster than an eager "
                f"prefill (eager / package: {rates}{busy_words})")

    def run(self, ids: torch.Tensor, cache: Any) -> torch.Tensor:
        """``ids`` (``[1, n]``, the prompt's first pass: ``cache`` holds nothing yet) through the package, its
        keys and values written into ``cache``; the last position's logits ``[V]``."""
        assert self.graph is not None and self.graph.step is not None, "the package is not built"
        logits, *kv = self.graph.step(ids)
        for layer in range(len(kv) // 2):
            cache.update(kv[2 * layer], kv[2 * layer + 1], layer)
        return logits[0, -1]


def _kept(entry: dict | None, lengths: list[int]) -> dict | None:
    """A kept verdict as it must be to be used (a time pair for each length timed here), else None."""
    if entry is None or not isinstance(entry.get("busy"), bool) or not isinstance(entry.get("times"), dict):
        return None
    times = {}
    for n in lengths:
        pair = entry["times"].get(str(n))
        if not (isinstance(pair, list) and len(pair) == 2
                and all(isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < 1e9 for v in pair)):
            return None
        times[n] = (float(pair[0]), float(pair[1]))
    return {"times": times, "busy": entry["busy"]}
