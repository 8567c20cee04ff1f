"""Caches made smaller: quantized (transformers' ``QuantizedCache``: fp8 per tensor, the group-wise quanto and
HQQ backends when their packages are installed) or evicted (written here: StreamingLLM's attention sinks plus a
recent window, and H2O's heavy hitters, scored by the attention the model really paid), with what each holds
measured from its tensors.

Methods are named and parsed in ``kv_methods`` (no torch there, so the window can check a name). Eviction
keeps each kept key at its own position (its rotary phase was applied when it was written), so every pass is
given its positions explicitly.
"""

from __future__ import annotations

from typing import Any

import torch

from engine.facts.kv_methods import Method
from engine.model import hqq_deferred, kvcache

FULL, QUANT, DROPPED = 2, 1, 0          # what a position is in a layer (the heatmap's three states)


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

        if method.backend == "hqq":
            hqq_deferred.hand_over()
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
                # [keys]; kept on the CPU, where the scores are summed and chosen from (a GPU's row comes over)
                weights = row.mean(dim=0).float().cpu() if row is not None else torch.zeros(held)
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


def held_per_layer(cache: Any) -> list[list[int]]:
    """A quantized cache's ``[keys bytes, values bytes]`` per layer: the packed data and its scales and zeros
    plus the full-precision residual (the heatmap's bytes, as ``kvcache.held_per_layer`` gives a plain cache's)."""
    return [[_plain(layer, "keys") + tensor_bytes(getattr(layer, "_quantized_keys", None)),
             _plain(layer, "values") + tensor_bytes(getattr(layer, "_quantized_values", None))]
            for layer in cache.layers]


def layer_positions(layer: Any) -> int:
    """Positions a quantized layer holds, quantized or in its residual."""
    return int(getattr(layer, "cumulative_length", 0) or 0)


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


def hadamard(n: int, device: torch.device | str | None = None) -> torch.Tensor:
    """The orthonormal Hadamard matrix of size ``n`` (a power of two): the rotation applied to keys before
    quantizing them (llama.cpp PR #21038's idea), which spreads an outlier channel over all channels. Built on
    the keys' ``device``: made on the CPU, it could not multiply a GPU's keys."""
    if n & (n - 1):
        raise ValueError(f"a Hadamard rotation needs a power-of-two width, not {n}")
    h = torch.ones(1, 1, device=device)
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


def build_extensions() -> str:
    """Build quanto's C++ extension now (what ``make setup`` does), so no run waits on it; what happened, in a line."""
    from engine.facts.kv_methods import quanto_build_folder, quanto_extension_problem

    if quanto_build_folder() is None:
        return "quanto is not installed: nothing to build"
    problem = quanto_extension_problem()
    if problem is not None:
        return problem
    from optimum.quanto.library.extensions import get_extension

    get_extension("quanto_cpp").lib                  # builds it once for this torch (a minute), or loads it
    return "quanto's C++ extension is built"


if __name__ == "__main__":
    print(build_extensions())
