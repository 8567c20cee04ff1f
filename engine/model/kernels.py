"""Which kernel computes a model's matrix products on this CPU, measured once per machine and model shape.

A decode step is a hundred or more matrix-vector products, one per linear layer (121 for SmolLM2 once its
projections are fused, ``engine.model.fused``), and reads every weight once; how near it gets to the memory
bandwidth depends on the kernel. The candidates (``CANDIDATES``): ATen's ``linear`` (what ``nn.Linear``
calls), oneDNN's linear over weights reordered once into its blocked layout
(``torch.ops.mkldnn._linear_pointwise``, what inductor's weight prepacking uses) and, for float32, MKL's GEMM
over weights packed once for one row (``torch.ops.mkl._mkl_linear``). Which is fastest differs by CPU and dtype
(on a Sapphire Rapids VM, oneDNN took bfloat16 decode from 28.5 to 37.0 tok/s and float32 from 30.6 down to
24.9), so every candidate is timed at the model's own shapes, the fastest kept only if a short greedy probe gives
ATen's tokens, and the decision cached (``kernels.json``) per CPU, torch version, thread count, dtype and shapes.
``KVSCOPE_LINEAR=aten|onednn|mkl|auto`` overrides it (the tests pin ``aten``). Quantized weights keep their own
kernels (``engine.model.quantize``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from engine.facts.contention import LoadMeter, busy
from engine.store import machine_cache

ENV = "KVSCOPE_LINEAR"
CACHE = "kernels.json"
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
ROUNDS = 5                       # interleaved rounds of every candidate; the median of each is compared
PROBE_TOKENS = 8
TIMING = 2                       # how the candidates are timed: a new way makes old entries stale
MEASURED_BYTES = 512 << 20       # at most this much of the model's weights is timed (and packed twice meanwhile)
MEASURE_BOUND_S = 30.0           # the timing's rounds stop after this long (a busy laptop: fewer rounds, said)
QUIET_PROBE_S = 0.3              # a kept measurement from a busy machine is redone only if this probe is quiet
WIDE_ROWS = 24                   # from this many rows an emulated half float's product runs in float32 (below)


@dataclass(frozen=True)
class Kernel:
    """One way to compute ``x @ weight.T + bias``: ``pack`` turns a weight into the kernel's layout once, at
    load; ``product`` multiplies by it at every call."""

    name: str
    title: str
    dtypes: tuple[torch.dtype, ...]
    pack: Callable[[torch.Tensor], torch.Tensor]
    product: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]
    available: Callable[[], bool]


def _onednn_product(x: torch.Tensor, packed: torch.Tensor, _weight: torch.Tensor,
                    bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def _mkl_product(x: torch.Tensor, packed: torch.Tensor, weight: torch.Tensor,
                 bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkl._mkl_linear(x, packed, weight, bias, 1)     # other row counts multiply by ``weight``


CANDIDATES: dict[str, Kernel] = {k.name: k for k in (
    Kernel("aten", "ATen's linear", DTYPES, lambda w: w,
           lambda x, _packed, w, b: torch.nn.functional.linear(x, w, b), lambda: True),
    Kernel("onednn", "oneDNN with prepacked weights", DTYPES, torch.ops.mkldnn._reorder_linear_weight,
           _onednn_product, torch.backends.mkldnn.is_available),
    # MKL's packed GEMM, packed for one row: a decode step's shape (float32 only)
    Kernel("mkl", "MKL's packed GEMM", (torch.float32,), lambda w: torch.ops.mkl._mkl_reorder_linear_weight(w, 1),
           _mkl_product, torch.backends.mkl.is_available),
)}
KERNELS = tuple(CANDIDATES)


def eager_through(kernel: str, why: str) -> str:
    """The status line's words for eager decode's kernel: only eager's (a compiled step multiplies through
    inductor's own kernels, chosen when its graph is built)."""
    return f"eager products through {CANDIDATES[kernel].title} ({why})"


def candidates(dtype: torch.dtype) -> list[Kernel]:
    """The kernels this torch has for weights in ``dtype`` on this CPU, ATen's first."""
    return [k for k in CANDIDATES.values() if dtype in k.dtypes and k.available() and _packs(k.name, dtype)]


def offered(dtype: torch.dtype) -> list[Kernel]:
    """The kernels a model in ``dtype`` may multiply by in eager decode here: the one ``KVSCOPE_LINEAR`` names (ATen
    where that one has nothing for the float), else every candidate, the choice (``choose``) taking the fastest."""
    wanted, here = os.environ.get(ENV, "auto").strip().lower(), candidates(dtype)
    if wanted in CANDIDATES:
        return [CANDIDATES[wanted] if CANDIDATES[wanted] in here else CANDIDATES["aten"]]
    return here


@functools.cache
def _packs(name: str, dtype: torch.dtype) -> bool:
    """Whether the kernel packs a weight in ``dtype`` on this CPU: oneDNN refuses bfloat16 without AVX-512 (BW,
    VL, DQ) or AVX-NE-CONVERT ("bf16 path needs the cpu support ..."), an AVX2-only AMD EPYC for one."""
    try:
        CANDIDATES[name].pack(torch.zeros((16, 16), dtype=dtype))
    except RuntimeError:
        return False
    return True


@dataclass(frozen=True)
class KernelChoice:
    kernel: str                                   # a name in CANDIDATES
    step_ms: dict[str, float] = field(default_factory=dict)   # one decode step's products, by kernel (measured)
    reason: str = ""
    cached: bool = False
    weight_bytes: int = 0                         # what those products read: every linear layer's weight once
    busy: bool = False                            # measured while the machine was busy (kept, marked)
    wide: str = ""                                # a prefill's products widened (``widen_many_rows``): how, why

    @property
    def wide_rows(self) -> int:
        """From how many rows a product runs widened to float32 (0: none does)."""
        return WIDE_ROWS if self.wide else 0

    def words(self) -> str:
        """For the model's status line (``eager_through``), with each kernel's measured time."""
        if not self.step_ms:
            return _joined(self.reason, self.wide)
        timing = ", ".join(f"{k} {v:.2f} ms" for k, v in sorted(self.step_ms.items()))
        how = "measured earlier on this machine" if self.cached else "measured"
        if self.busy:
            how += " while it was busy; measured again at a launch when it is quiet"
        return _joined(eager_through(self.kernel, f"{timing} a decode step's products, {how}"), self.reason,
                       self.wide)

    def reached_bytes_per_s(self) -> dict[str, float]:
        """Each candidate's bandwidth over the weights it reads, by kernel (achieved: bytes over a measured time)."""
        if not self.weight_bytes:
            return {}
        return {k: self.weight_bytes / (ms / 1000.0) for k, ms in self.step_ms.items() if ms > 0}


_LIBRARY = torch.library.Library("kvscope", "DEF")      # the operators below; kept for the process's life


def _graph_op(kernel: Kernel) -> Any:
    """``kernel``'s product as an operator of its own (``torch.ops.kvscope.<name>_linear``), for compiled graphs:
    inductor cannot lower oneDNN's linear over a weight packed outside the graph, but calls an operator it does
    not know as it is, so the graph fuses the small operators around the products and leaves the products to the
    kernel. Defined with ``torch.library.Library`` rather than ``custom_op``, whose wrapper cost 4 us a call
    against 1.5 (some 120 calls a step); eager calls skip it altogether."""
    name = f"{kernel.name}_linear"
    _LIBRARY.define(f"{name}(Tensor x, Tensor packed, Tensor weight, Tensor? bias) -> Tensor")
    _LIBRARY.impl(name, kernel.product, "CompositeExplicitAutograd")

    def shape(x: torch.Tensor, packed: torch.Tensor, weight: torch.Tensor,
              bias: torch.Tensor | None) -> torch.Tensor:
        return x.new_empty((*x.shape[:-1], weight.shape[0]))

    torch.library.register_fake(f"kvscope::{name}", shape, lib=_LIBRARY)
    return getattr(torch.ops.kvscope, name)


GRAPH_OPS = {name: _graph_op(k) for name, k in CANDIDATES.items() if name != "aten"}


_EXPORTING = threading.local()


@contextlib.contextmanager
def exporting() -> Iterator[None]:
    """While this thread exports a step: packed layers multiply by their plain weights, which the export traces and
    inductor packs for kernels of its own. Kept per thread, not read from torch's ``is_exporting`` (one flag for
    the whole process): the window decodes eagerly beside an export, and that decode's products must still go
    through the kernel chosen for them."""
    _EXPORTING.active = True
    try:
        yield
    finally:
        _EXPORTING.active = False


class PackedLinear(nn.Module):
    """``nn.Linear``'s product through another kernel over its weight packed once (ATen's packs nothing: the
    layer is here to widen, ``widen_many_rows``). The original weight is kept: MKL's kernel multiplies a
    prefill's many rows by it, the model's facts count it, and an exported step (a package,
    ``engine.model.packaged``) multiplies by it so that inductor packs it for kernels of its own. The packed copy
    is no buffer of the module, so an export never meets it. ``wide``: the float a product of ``WIDE_ROWS`` rows
    or more runs in, over the weight widened for that call (None: the layer's own)."""

    def __init__(self, linear: nn.Linear, kernel: Kernel, wide: torch.dtype | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        self.kernel = kernel
        self.packed = kernel.pack(linear.weight.detach())
        self.wide = wide

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if getattr(_EXPORTING, "active", False):
            return torch.nn.functional.linear(x, self.weight, self.bias)
        if torch.compiler.is_compiling():
            if self.kernel.name not in GRAPH_OPS:
                return torch.nn.functional.linear(x, self.weight, self.bias)
            return GRAPH_OPS[self.kernel.name](x, self.packed, self.weight, self.bias)
        if self.wide is not None and x.numel() >= WIDE_ROWS * self.in_features:
            bias = None if self.bias is None else self.bias.to(self.wide)
            return torch.nn.functional.linear(x.to(self.wide), self.weight.to(self.wide), bias).to(x.dtype)
        return self.kernel.product(x, self.packed, self.weight, self.bias)


def _linears(model: nn.Module, kinds: tuple[type, ...] = (nn.Linear,)) -> list[tuple[nn.Module, str, nn.Module]]:
    """Every layer of exactly one of ``kinds`` (a subclass is another kernel's), with its parent and name."""
    return [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
            if type(child) in kinds]


NO_OTHER = "this torch has no other kernel for its format on this CPU"


def _not_one_cpu_float(model: nn.Module, layers: list[tuple[nn.Module, str, nn.Module]]) -> str | None:
    """Why ``layers`` cannot change how they multiply all together (a kernel, a widening), or None: each must be
    on the CPU, in one float format, in a model not split across devices."""
    if {child.weight.device.type for _p, _n, child in layers} != {"cpu"}:
        return "its layers are not all on the CPU"
    if getattr(model, "hf_device_map", None) and len(set(model.hf_device_map.values())) > 1:
        return "it is split across devices or disk"
    dtypes = {child.weight.dtype for _p, _n, child in layers}
    if dtypes - set(DTYPES) or len(dtypes) > 1:
        return "its weights are not all in one float format"
    return None


def usable(model: nn.Module) -> str | None:
    """Why no other kernel can stand in for ATen's in this model's layers, or None."""
    linears = _linears(model)
    if not linears:
        return "no plain linear layers (quantized weights keep their own kernels)"
    why = _not_one_cpu_float(model, linears)
    if why is not None:
        return why
    if len(candidates(linears[0][2].weight.dtype)) < 2:
        return NO_OTHER
    from engine.model.memory import copy_refused

    return copy_refused("the packed copy of its weights", sum(child.weight.nbytes for _p, _n, child in linears))


def _step_ms(linears: list[tuple[nn.Module, str, nn.Linear]], kernels: list[Kernel]) -> dict[str, float]:
    """One decode step's products by kernel, over the model's own weights: candidates interleaved, the median
    of ``ROUNDS`` rounds each. Distinct weights, as decode reads them: one weight per shape multiplied many
    times stays in the CPU's cache and times the cache, not the memory (it put float32's products at 64 GB/s
    here, three times the copy bandwidth). A model larger than ``MEASURED_BYTES`` is timed on every k-th layer
    and the time scaled by the bytes."""
    total = sum(child.weight.nbytes for _p, _n, child in linears)
    stride = max(1, -(-total // MEASURED_BYTES))
    sample = [child for _p, _n, child in linears][::stride]
    scale = total / sum(child.weight.nbytes for child in sample)
    cases = [(torch.randn(1, child.in_features, dtype=child.weight.dtype), child.weight.detach(),
              {k.name: k.pack(child.weight.detach()) for k in kernels}) for child in sample]
    times: dict[str, list[float]] = {k.name: [] for k in kernels}
    bound = time.perf_counter() + MEASURE_BOUND_S
    with torch.inference_mode():
        for x, w, packed in cases[:8]:                       # warm each kernel
            for k in kernels:
                k.product(x, packed[k.name], w, None)
        for done in range(ROUNDS):
            if done and time.perf_counter() > bound:         # a slow (busy) machine: the rounds it had time for
                break
            for k in kernels:
                start = time.perf_counter()
                for x, w, packed in cases:
                    k.product(x, packed[k.name], w, None)
                times[k.name].append((time.perf_counter() - start) * 1000.0 * scale)
    return {name: statistics.median(values) for name, values in times.items()}


def _probe(model: nn.Module) -> list[int]:
    """Greedy tokens from a fixed prompt, one forward pass each, with a fresh cache (the probe the choice keeps
    or rejects a kernel by)."""
    from engine.model import kvcache

    vocab = model.get_output_embeddings().out_features
    ids = torch.tensor([[(7 + 31 * i) % vocab for i in range(24)]])
    cache, tokens = kvcache.new_cache(model), []
    with torch.inference_mode():
        out = kvcache.forward(model, ids, cache)
        for _ in range(PROBE_TOKENS):
            token = int(out.logits[0, -1].argmax())
            tokens.append(token)
            out = kvcache.forward(model, torch.tensor([[token]]), cache)
    return tokens


def _swap(model: nn.Module, kernel: Kernel) -> list[tuple[nn.Module, str, nn.Linear]]:
    """Every plain linear layer replaced by its packed form for ``kernel``; returns what was replaced, to put
    back."""
    linears = _linears(model)
    for parent, name, child in linears:
        setattr(parent, name, PackedLinear(child, kernel))
    return linears


def _restore(replaced: list[tuple[nn.Module, str, nn.Linear]]) -> None:
    for parent, name, child in replaced:
        setattr(parent, name, child)


def choose(model: nn.Module, device_name: str, measuring: Any = lambda: None) -> KernelChoice:
    """Put the fastest kernel that keeps the greedy tokens in place for ``model`` (on a CPU, in a float format)
    and say which, and why; ``measuring`` is called before anything is measured (a cached decision measures
    nothing). A prefill's products widen where this CPU emulates the model's float (``widen_many_rows``)."""
    choice = _chosen(model, device_name, measuring)
    wide = widen_many_rows(model)
    return dataclasses.replace(choice, wide=wide) if wide else choice


def widen_many_rows(model: nn.Module) -> str:
    """Where the model's float is a half float this CPU has no units for (``hardware.gemm_dtype``), every linear
    layer multiplies ``WIDE_ROWS`` rows or more in float32 over its weight widened for the call, and a decode
    step's one row through its own kernel; what was done, for the status line ("" when nothing was). torch
    emulates such a float's GEMM: SmolLM2's eager bfloat16 prefill on a 2-vCPU AVX2 AMD EPYC ran 89 / 100 / 97
    tok/s at 32 / 128 / 512 tokens, widened 138 / 242 / 315. At one row the emulated kernel reads half the
    bytes and wins (12.5 against 56 ms for a step's products); the two cross between 16 and 24 rows. The widened
    weight is a temporary of one layer's size; nothing is kept."""
    from engine.model.hardware import gemm_dtype

    layers = _linears(model, (nn.Linear, PackedLinear))
    if not layers or _not_one_cpu_float(model, layers) is not None:
        return ""
    dtype = layers[0][2].weight.dtype
    wide = gemm_dtype(dtype, "cpu")
    if wide == dtype:
        return ""
    for parent, name, child in layers:
        if type(child) is nn.Linear:
            child = PackedLinear(child, CANDIDATES["aten"])
            setattr(parent, name, child)
        child.wide = wide
    float_name, wide_name = (str(d).removeprefix("torch.") for d in (dtype, wide))
    return (f"a prefill's products ({WIDE_ROWS} rows or more) in {wide_name} over the weights widened per call: "
            f"this CPU has no {float_name} units, so torch emulates {float_name}'s GEMM")


def widened(model: nn.Module) -> bool:
    """Whether ``widen_many_rows`` widened this model's products of many rows."""
    return any(isinstance(m, PackedLinear) and m.wide is not None for m in model.modules())


def _chosen(model: nn.Module, device_name: str, measuring: Any) -> KernelChoice:
    wanted = os.environ.get(ENV, "auto").strip().lower()
    unknown = ""
    if wanted not in CANDIDATES and wanted != "auto":
        unknown = f"{ENV}={wanted[:20]} is not one of {', '.join(CANDIDATES)} or auto: chosen as auto"
        wanted = "auto"
    not_here = f"{ENV}={wanted}: that kernel has nothing for this format here"
    why = usable(model)
    if why == NO_OTHER and wanted in CANDIDATES and wanted != "aten":
        why = not_here
    if why is not None or wanted == "aten":
        return KernelChoice("aten", reason=_joined(eager_through("aten", why or f"{ENV}=aten"), unknown))
    linears = _linears(model)
    weight_bytes = sum(child.weight.nbytes for _p, _n, child in linears)
    offered = candidates(linears[0][2].weight.dtype)
    if wanted in CANDIDATES:
        if CANDIDATES[wanted] not in offered:
            return KernelChoice("aten", reason=eager_through("aten", not_here))
        _swap(model, CANDIDATES[wanted])
        return KernelChoice(wanted, reason=eager_through(wanted, f"{ENV}={wanted}"))
    shapes = sorted({(c.out_features, c.in_features) for _p, _n, c in linears})
    dtype = str(linears[0][2].weight.dtype).removeprefix("torch.")
    key = (f"{device_name}|torch {torch.__version__}|threads {torch.get_num_threads()}|{dtype}|{shapes}"
           f"|timed {TIMING}")
    entry = _kept(machine_cache.entry(CACHE, key), {k.name for k in offered})
    if entry is not None and not (entry["busy"] and quiet(linears[0][2].weight)):
        if entry["kernel"] != "aten":
            _swap(model, CANDIDATES[entry["kernel"]])
        return KernelChoice(entry["kernel"], entry["step_ms"], _joined(entry["reason"], unknown), cached=True,
                            weight_bytes=weight_bytes, busy=entry["busy"])
    measuring()
    meter = LoadMeter()
    meter.start()
    step_ms = _step_ms(linears, offered)
    meter.stop()
    kernel, refused = "aten", []
    faster = sorted((k for k in offered if step_ms[k.name] < step_ms["aten"]), key=lambda k: step_ms[k.name])
    if faster:
        before = _probe(model)
        for candidate in faster:                     # the fastest whose greedy tokens are ATen's
            replaced = _swap(model, candidate)
            if _probe(model) == before:
                kernel = candidate.name
                break
            _restore(replaced)
            refused.append(candidate.title)
    reason = (f"{' and '.join(refused)} {'was' if len(refused) == 1 else 'were'} faster but gave other greedy "
              "tokens than ATen's: not used") if refused else ""
    loaded = busy(meter.share())          # a busy machine's comparison is kept, marked, and redone when quiet
    machine_cache.remember(CACHE, key, {"kernel": kernel, "step_ms": step_ms, "reason": reason, "busy": loaded})
    return KernelChoice(kernel, step_ms, _joined(reason, unknown), weight_bytes=weight_bytes, busy=loaded)


def _joined(*parts: str) -> str:
    return "; ".join(p for p in parts if p)


def _kept(entry: dict | None, names: set[str]) -> dict | None:
    """A cached decision as it must be to be used: its kernel one of the candidates here, a time for each of them
    (another KVScope's entry timed other candidates), every field of its kind; else None (measured again)."""
    if entry is None:
        return None
    step_ms = entry.get("step_ms")
    if not (entry.get("kernel") in names and isinstance(step_ms, dict) and set(step_ms) == names
            and all(isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < 1e9 for v in step_ms.values())
            and isinstance(entry.get("reason", ""), str) and isinstance(entry.get("busy", False), bool)):
        return None
    return {"kernel": entry["kernel"], "step_ms": {k: float(v) for k, v in step_ms.items()},
            "reason": entry.get("reason", ""), "busy": entry.get("busy", False)}


def quiet(weight: torch.Tensor) -> bool:
    """Whether the machine is quiet now: ``QUIET_PROBE_S`` of one-row products through ``weight`` (a model's own,
    or one of its shape), and this process's share of the CPU over them. A decision kept from a busy machine is
    redone only after this says yes, so a machine that stays busy pays the probe, not the measurement."""
    x = torch.randn(1, weight.shape[1], dtype=weight.dtype)
    meter = LoadMeter()
    meter.start()
    end = time.perf_counter() + QUIET_PROBE_S
    with torch.inference_mode():
        while time.perf_counter() < end:
            torch.nn.functional.linear(x, weight)
    meter.stop()
    return not busy(meter.share())
