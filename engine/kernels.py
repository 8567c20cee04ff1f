"""Which kernel computes a model's matrix products on this CPU, measured once per machine and model shape.

A decode step is some two hundred matrix-vector products, one per linear layer, and reads every weight once;
how near it gets to the memory bandwidth depends on the kernel. Two candidates: ATen's ``linear`` (what
``nn.Linear`` calls) and oneDNN's linear over weights reordered once into its blocked layout
(``torch.ops.mkldnn._linear_pointwise``, what inductor's weight prepacking uses). Which is faster differs by CPU
and dtype (on a Sapphire Rapids VM, oneDNN took bfloat16 decode from 28.5 to 37.0 tok/s and float32 from 30.6
down to 24.9), so the choice is measured at the model's own shapes, the winner kept only if a short greedy probe
gives the same tokens as before, and the decision cached (``kernels.json``) per device, torch version, thread
count, dtype and shapes. ``KVSCOPE_LINEAR=aten|onednn|auto`` overrides it (the tests pin ``aten``).
"""

from __future__ import annotations

import os
import statistics
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from engine import machine_cache
from engine.contention import LoadMeter, busy

KERNELS = ("aten", "onednn")
ENV = "KVSCOPE_LINEAR"
CACHE = "kernels.json"
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
ROUNDS = 5                       # interleaved rounds of every candidate; the median of each is compared
PROBE_TOKENS = 8


@dataclass(frozen=True)
class KernelChoice:
    kernel: str                                   # "aten" or "onednn"
    step_ms: dict[str, float] = field(default_factory=dict)   # one decode step's products, by kernel (measured)
    reason: str = ""
    cached: bool = False

    def words(self) -> str:
        """For the model's status line."""
        if not self.step_ms:
            return self.reason
        timing = ", ".join(f"{k} {v:.2f} ms" for k, v in sorted(self.step_ms.items()))
        name = "oneDNN with prepacked weights" if self.kernel == "onednn" else "ATen's linear"
        how = "measured earlier on this machine" if self.cached else "measured"
        return f"products through {name} ({timing} a decode step's products, {how})"


class PackedLinear(nn.Module):
    """``nn.Linear``'s product through oneDNN over its weight reordered once. The original weight is kept: a
    compiled graph multiplies through it (inductor packs weights its own way), and the model's facts count it."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        self.register_buffer("packed", torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach()),
                             persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return torch.nn.functional.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def _linears(model: nn.Module) -> list[tuple[nn.Module, str, nn.Linear]]:
    return [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
            if type(child) is nn.Linear]


def usable(model: nn.Module) -> str | None:
    """Why oneDNN's packed linear cannot stand in for this model's layers, or None."""
    if not torch.backends.mkldnn.is_available():
        return "this torch has no oneDNN"
    linears = _linears(model)
    if not linears:
        return "no plain linear layers (quantized weights keep their own kernels)"
    devices = {child.weight.device.type for _p, _n, child in linears}
    if devices != {"cpu"}:
        return "its layers are not all on the CPU"
    if getattr(model, "hf_device_map", None) and len(set(model.hf_device_map.values())) > 1:
        return "it is split across devices or disk"
    if {child.weight.dtype for _p, _n, child in linears} - set(DTYPES):
        return "its weights are not in a float format"
    from engine.memory import available_bytes

    extra = sum(child.weight.nbytes for _p, _n, child in linears)
    free = available_bytes("cpu")
    if free is not None and extra > free // 4:
        return (f"the packed copy of its weights ({extra / 2**30:.1f} GiB) would take more than a quarter of the "
                "free memory")
    return None


def _step_ms(linears: list[tuple[nn.Module, str, nn.Linear]]) -> dict[str, float]:
    """One decode step's products at the model's shapes (each shape as often as the model has it), by kernel:
    candidates interleaved, the median of ``ROUNDS`` rounds each."""
    shapes = Counter((child.out_features, child.in_features, child.weight.dtype) for _p, _n, child in linears)
    cases = []
    for (out, inp, dtype), count in shapes.items():
        weight = torch.randn(out, inp, dtype=dtype)
        packed = torch.ops.mkldnn._reorder_linear_weight(weight)
        x = torch.randn(1, inp, dtype=dtype)
        cases.append((count, x, weight, packed))
    runs = {"aten": lambda x, w, p: torch.nn.functional.linear(x, w),
            "onednn": lambda x, w, p: torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "")}
    times: dict[str, list[float]] = {k: [] for k in runs}
    with torch.inference_mode():
        for count, x, w, p in cases:                         # warm each kernel at each shape
            for run in runs.values():
                run(x, w, p)
        for _ in range(ROUNDS):
            for name, run in runs.items():
                start = time.perf_counter()
                for count, x, w, p in cases:
                    for _ in range(count):
                        run(x, w, p)
                times[name].append((time.perf_counter() - start) * 1000.0)
    return {name: statistics.median(values) for name, values in times.items()}


def _probe(model: nn.Module) -> list[int]:
    """Greedy tokens from a fixed prompt, one forward pass each, with a fresh cache (the probe the choice keeps
    or rejects a kernel by)."""
    from engine import kvcache

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


def _swap(model: nn.Module) -> list[tuple[nn.Module, str, nn.Linear]]:
    """Every plain linear layer replaced by its packed form; returns what was replaced, to put back."""
    linears = _linears(model)
    for parent, name, child in linears:
        setattr(parent, name, PackedLinear(child))
    return linears


def _restore(replaced: list[tuple[nn.Module, str, nn.Linear]]) -> None:
    for parent, name, child in replaced:
        setattr(parent, name, child)


def choose(model: nn.Module, device_name: str, measuring: Any = lambda: None) -> KernelChoice:
    """Put the faster kernel in place for ``model`` (on a CPU, in a float format) and say which, and why;
    ``measuring`` is called before anything is measured (a cached decision measures nothing)."""
    wanted = os.environ.get(ENV, "auto").strip().lower()
    why = usable(model)
    if why is not None or wanted == "aten":
        return KernelChoice("aten", reason=f"products through ATen's linear ({why or f'{ENV}=aten'})")
    linears = _linears(model)
    if wanted == "onednn":
        _swap(model)
        return KernelChoice("onednn", reason=f"products through oneDNN with prepacked weights ({ENV}=onednn)")
    shapes = sorted({(c.out_features, c.in_features) for _p, _n, c in linears})
    dtype = str(linears[0][2].weight.dtype).removeprefix("torch.")
    key = f"{device_name}|torch {torch.__version__}|threads {torch.get_num_threads()}|{dtype}|{shapes}"
    entry = machine_cache.entry(CACHE, key)
    if entry is not None and entry.get("kernel") in KERNELS:
        if entry["kernel"] == "onednn":
            _swap(model)
        return KernelChoice(entry["kernel"], dict(entry.get("step_ms") or {}), entry.get("reason", ""), cached=True)
    measuring()
    meter = LoadMeter()
    meter.start()
    step_ms = _step_ms(linears)
    meter.stop()
    kernel, reason = "aten", ""
    if step_ms["onednn"] < step_ms["aten"]:
        before = _probe(model)
        replaced = _swap(model)
        if _probe(model) == before:
            kernel = "onednn"
        else:
            _restore(replaced)
            reason = "oneDNN was faster but its greedy tokens differed from ATen's: kept ATen's"
    choice = KernelChoice(kernel, step_ms, reason)
    if not busy(meter.share()):                      # a busy machine's comparison is not kept
        machine_cache.remember(CACHE, key, {"kernel": kernel, "step_ms": step_ms, "reason": reason})
    return choice
