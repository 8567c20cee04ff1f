"""Caches made smaller: quantized (transformers' ``QuantizedCache``: fp8 per tensor, the group-wise quanto and
HQQ backends when their packages are installed) or evicted (written here: StreamingLLM's attention sinks plus a
recent window, and H2O's heavy hitters, scored by the attention the model really paid), with what each holds
measured from its tensors.

A method is named as the CLI takes it: ``full``, ``fp8``, ``quanto4``, ``quanto2``, ``hqq4``, ``sinks:S+W``
(S first positions and the W most recent), ``h2o:N`` (N positions: the most attended half and the recent
half). Eviction keeps each kept key at its own position (its rotary phase was applied when it was written), so
every pass is given its positions explicitly.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any

import torch

from engine import kvcache
from engine.errors import ParameterError

QUANTIZED = {"fp8": ("fp8", {}), "quanto4": ("quanto", {"nbits": 4}), "quanto2": ("quanto", {"nbits": 2}),
             "hqq4": ("hqq", {"nbits": 4})}
PACKAGES = {"quanto": "optimum.quanto", "hqq": "hqq"}
SINKS = 4                               # StreamingLLM's attention sinks, kept by H2O too
FULL, QUANT, DROPPED = 2, 1, 0          # what a position is in a layer (the heatmap's three states)


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
            return (f"H2O: {self.budget:,} positions ({self.sinks} sinks, {self.heavy} most attended, "
                    f"{self.recent} recent)")
        return f"StreamingLLM: {self.sinks} sinks + {self.recent} recent"


def parse_method(text: str) -> Method:
    """A method from its name; one line naming what is wrong otherwise."""
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
        if name.startswith("h2o:"):
            budget = int(name.removeprefix("h2o:"))
            if budget < 2 * SINKS + 2:
                raise ValueError
            recent = (budget - SINKS) // 2
            return Method(name, "evicted", sinks=SINKS, recent=recent, heavy=budget - SINKS - recent)
    except ValueError:
        pass
    raise ParameterError(f"Unknown KV cache method {text!r}: use full, {', '.join(QUANTIZED)}, sinks:S,W (S sinks, "
                         f"W recent positions, W >= 1) or h2o:N (N >= {2 * SINKS + 2} positions)")


def available(method: Method) -> str | None:
    """Why ``method`` cannot run here (its package is not installed), or None."""
    module = PACKAGES.get(method.backend)
    if module is not None and importlib.util.find_spec(module.split(".")[0]) is None:
        return f"{method.name} needs the {module.split('.')[0]} package (pip install optimum-quanto hqq)"
    return None


def refusal(model: Any) -> str | None:
    """Why a model's cache cannot be compressed here: transformers quantizes only caches whose layers are all
    full attention, and eviction here assumes the same (a sliding layer already drops positions itself)."""
    config = model.config.get_text_config(decoder=True)
    types = set(getattr(config, "layer_types", None) or ["full_attention"])
    if types != {"full_attention"}:
        return (f"{type(model).__name__} has {', '.join(sorted(types - {'full_attention'}))} layers: transformers' "
                "quantized cache and this eviction take models whose every layer is full attention")
    return None


def new_cache(model: Any, method: Method) -> Any:
    if method.kind == "quantized":
        from transformers.cache_utils import QuantizedCache

        return QuantizedCache(method.backend, model.config, **dict(method.options))
    return kvcache.new_cache(model)


class Evictor:
    """Keeps an evicted cache within its budget after every pass: per layer, the absolute positions its keys
    hold and, for H2O, the attention each has received so far (summed over steps, averaged over heads)."""

    def __init__(self, method: Method, num_layers: int) -> None:
        self.method = method
        self.kept: list[list[int]] = [[] for _ in range(num_layers)]
        self.scores: list[torch.Tensor | None] = [None] * num_layers

    def after_pass(self, cache: Any, position: int, rows: dict[int, torch.Tensor] | None = None) -> None:
        """The pass wrote positions up to ``position`` (exclusive); ``rows``: each layer's newest attention row
        ``[heads, keys]`` over the keys it read (H2O's scores)."""
        m = self.method
        for i, layer in enumerate(cache.layers):
            kept = self.kept[i]
            held = layer.keys.shape[2]
            kept += list(range(position - (held - len(kept)), position))       # what this pass appended
            if m.heavy:
                row = rows.get(i) if rows else None
                weights = row.mean(dim=0).float() if row is not None else torch.zeros(held)
                old = self.scores[i]
                grown = torch.zeros(held)
                if old is not None:
                    grown[: len(old)] = old
                grown[: len(weights)] += weights[:held]
                self.scores[i] = grown
            if held <= m.budget:
                continue
            keep = self._choose(i, held)
            index = torch.tensor(keep, dtype=torch.long, device=layer.keys.device)
            layer.keys = layer.keys.index_select(2, index)
            layer.values = layer.values.index_select(2, index)
            self.kept[i] = [kept[j] for j in keep]
            if m.heavy:
                self.scores[i] = self.scores[i][index.cpu()]

    def _choose(self, layer: int, held: int) -> list[int]:
        m = self.method
        sinks = list(range(min(m.sinks, held)))
        recent = list(range(max(held - m.recent, len(sinks)), held))
        middle = [j for j in range(len(sinks), held - len(recent))]
        heavy: list[int] = []
        if m.heavy and middle:
            scores = self.scores[layer][middle]
            top = torch.topk(scores, min(m.heavy, len(middle))).indices.tolist()
            heavy = sorted(middle[j] for j in top)
        return sinks + heavy + recent


def tensor_bytes(value: Any) -> int:
    """The bytes a cache's stored value occupies: a plain tensor's elements, a quantized tensor's packed data
    and its scales (quanto's tensors say what they hold through ``__tensor_flatten__``), HQQ's metadata."""
    if isinstance(value, torch.Tensor):
        flatten = getattr(type(value), "__tensor_flatten__", None)
        if flatten is not None and type(value) is not torch.Tensor:
            names, _ = value.__tensor_flatten__()
            return sum(tensor_bytes(getattr(value, name)) for name in names)
        return value.numel() * value.element_size()
    if isinstance(value, (tuple, list)):
        return sum(tensor_bytes(v) for v in value)
    if isinstance(value, dict):
        return sum(tensor_bytes(v) for v in value.values())
    return 0


def _plain(layer: Any, name: str) -> int:
    t = getattr(layer, name, None)
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) and t.dim() == 4 else 0


def layer_bytes(layer: Any) -> tuple[int, int]:
    """(bytes held in full precision, bytes held quantized) by one layer, read from its tensors."""
    full = _plain(layer, "keys") + _plain(layer, "values")
    packed = tensor_bytes(getattr(layer, "_quantized_keys", None)) + tensor_bytes(getattr(layer, "_quantized_values",
                                                                                          None))
    return full, packed


def held_bytes(cache: Any) -> int:
    return sum(sum(layer_bytes(layer)) for layer in cache.layers)


def position_states(cache: Any, positions: int, evictor: Evictor | None) -> list[list[int]]:
    """Per layer, per position so far: held in full (2), held quantized (1) or dropped (0)."""
    out = []
    for i, layer in enumerate(cache.layers):
        row = [DROPPED] * positions
        if evictor is not None:
            for p in evictor.kept[i]:
                if p < positions:
                    row[p] = FULL
        elif hasattr(layer, "_quantized_keys") and layer._quantized_keys is not None:
            residual = layer.keys.shape[2] if isinstance(layer.keys, torch.Tensor) and layer.keys.dim() == 4 else 0
            quantized = min(positions, getattr(layer, "cumulative_length", positions) - residual)
            row = [QUANT] * quantized + [FULL] * (positions - quantized)
        else:
            row = [FULL] * positions
        out.append(row)
    return out


def hadamard(n: int) -> torch.Tensor:
    """The orthonormal Hadamard matrix of size ``n`` (a power of two): the rotation applied to keys before
    quantizing them (llama.cpp PR #21038's idea), which spreads an outlier channel over all channels."""
    if n & (n - 1):
        raise ValueError(f"a Hadamard rotation needs a power-of-two width, not {n}")
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / n ** 0.5


def int4_error(keys: torch.Tensor, group: int = 32) -> float:
    """Relative error of round-to-nearest 4-bit quantization in groups of ``group`` along the head dimension
    (asymmetric, a scale and a zero per group): |dequantized - keys| / |keys|, over the whole tensor."""
    x = keys.float().reshape(-1, group)
    low, high = x.min(dim=1, keepdim=True).values, x.max(dim=1, keepdim=True).values
    scale = ((high - low) / 15).clamp(min=1e-8)
    q = torch.round((x - low) / scale).clamp(0, 15)
    back = q * scale + low
    return float((back - x).norm() / x.norm().clamp(min=1e-12))
