"""transformers' KV cache, behind one adapter: the forward call every caller makes, the facts of what each
layer keeps, the bytes and positions a live cache holds, its content (norms), and the reshaping that chat
reuse, speculative decoding and continuous batching need. Every access to transformers' cache layout is in
this module, so a library upgrade touches one file; the arithmetic over the facts is in ``engine.facts.kvformula``.

The facts come from the cache the model builds, not from its config: :func:`probe_layers` runs one token
through the model and reads each cache layer (its class, heads, widths, dtype, state, extras), and pushes a
sliding layer past its window to see how many positions it keeps (transformers keeps ``window - 1``, not
``window``). Configs disagree with their caches often enough (Mistral-style ``sliding_window`` without
``layer_types``, Falcon's ``multi_query``, hybrids, compressed caches) that guessing from them gave wrong figures.
"""

from __future__ import annotations

import copy
import re
import weakref
from typing import Any

import torch

from engine.facts.events import KVLayer, ModelFacts
from engine.facts.kvformula import FULL, LATENT, NONE, SLIDING, STATE, held_positions, rollback_refusal_for

DECODER_LAYER = re.compile(r"(.*\.)?(layers|h|blocks)\.\d+")     # a decoder layer's module name


class CacheReshapeError(ValueError):
    """The cache cannot be reshaped this way (rolled back, padded, stacked); the message says why."""


# --- the forward call -------------------------------------------------------------------------------------------
def forward(model: Any, ids: torch.Tensor, cache: Any = None, *, positions: torch.Tensor | None = None,
            mask: torch.Tensor | None = None, logits_to_keep: int = 1, extra: dict | None = None) -> Any:
    """One forward pass, as every caller makes it (plain decode, speculative, batching, chat, probes): with
    ``cache`` it reads and extends the cache, without it it recomputes everything. ``logits_to_keep=1`` keeps
    the last position's logits only (0: all of them, as verifying guesses and likelihoods need)."""
    kwargs: dict[str, Any] = {"input_ids": ids, "cache": cache, "use_cache": cache is not None,
                              "logits_to_keep": logits_to_keep}
    if positions is not None:
        kwargs["position_ids"] = positions
    if mask is not None:
        kwargs["attention_mask"] = mask
    if extra:
        kwargs.update(extra)
    return model(**kwargs)


def new_cache(model: Any, static_positions: int = 0, offloading: bool = False) -> Any:
    """The cache a forward pass fills: transformers' ``DynamicCache`` laid out from the model's config, or with
    ``static_positions`` a ``StaticCache`` that allocates them all up front (what ``torch.compile`` needs).
    ``offloading``: each layer's keys and values go to the CPU between uses and come back just before (a GPU's
    memory then holds one layer's cache at a time; transformers does it with CUDA streams, so a GPU only)."""
    from transformers import DynamicCache, StaticCache

    if static_positions:
        return StaticCache(config=model.config, max_cache_len=static_positions, offloading=offloading)
    return DynamicCache(config=model.config, offloading=offloading)


def own_cache_class(model: Any) -> str | None:
    """The name of a cache class the model's own code defines and insists on (MiniMax's ``MiniMaxCache``, whose
    linear-attention state sits beside the per-layer cache), or None. KVScope builds, reads, crops and batches
    transformers' per-layer caches; a class of the model's own is none of those."""
    import sys

    from transformers.cache_utils import Cache

    module = sys.modules.get(type(model).__module__)
    for value in vars(module).values() if module else ():
        if isinstance(value, type) and issubclass(value, Cache) and value.__module__ == module.__name__:
            return value.__name__
    return None


# --- facts from the cache the model builds ---------------------------------------------------------------------
def probe_layers(model: Any) -> list[KVLayer]:
    """Run one token through ``model`` with a fresh cache and describe what each layer keeps: in the cache
    object, and for a layer that keeps its recurrent state on its own modules instead (RecurrentGemma), that
    state, read from the modules after the pass."""
    cache = new_cache(model)
    device = model.get_input_embeddings().weight.device
    token = torch.zeros((1, 1), dtype=torch.long, device=device)
    with torch.inference_mode():
        out = forward(model, token, cache)
        cache = getattr(out, "cache", None) or cache
        latent = _latent_widths(model.config)
        described = [_describe(layer, latent) for layer in cache.layers]
        modules = [m for name, m in model.named_modules() if DECODER_LAYER.fullmatch(name)]
        if len(modules) == len(described):
            described = [_with_module_state(d, m) for d, m in zip(described, modules)]
        return described


def _with_module_state(layer: KVLayer, module: Any) -> KVLayer:
    """A layer that holds nothing in the cache object but keeps state tensors on its modules (attributes named
    ``…state`` or ``…states``, set by the forward pass, not parameters or buffers): a state layer of that size."""
    if layer.kind != NONE:                  # what the cache object holds is read from it, never twice
        return layer
    held = sum(int(v.nbytes) for m in module.modules() for name, v in vars(m).items()
               if isinstance(v, torch.Tensor) and name.rstrip("s").endswith("state") and not name.startswith("_"))
    return KVLayer(STATE, state_bytes=held) if held else layer


def _latent_widths(config: Any) -> tuple[int, int, int] | None:
    """(latent width, rope-key width, what full multi-head K and V would hold per position) for a model with
    multi-head latent attention (DeepSeek-V2/V3), else None."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    rank, rope = getattr(text, "kv_lora_rank", None), getattr(text, "qk_rope_head_dim", None)
    if not rank or not rope:
        return None
    heads = int(getattr(text, "num_attention_heads", 0) or 0)
    nope, value = int(getattr(text, "qk_nope_head_dim", 0) or 0), int(getattr(text, "v_head_dim", 0) or 0)
    return int(rank), int(rope), heads * (nope + rope + value)


def _describe(layer: Any, latent: tuple[int, int, int] | None) -> KVLayer:
    keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
    state = _state_bytes(layer)
    if not _held(keys):
        return KVLayer(STATE if state else NONE, state_bytes=state)
    heads, k_dim = int(keys.shape[1]), int(keys.shape[-1])
    v_dim = 0 if _shared(keys, values) else int(values.shape[-1])      # one tensor: counted once
    extra = _extra_bytes_per_position(layer)
    compressed = _series(layer)
    if latent is not None and heads == 1 and (k_dim, v_dim) == latent[:2]:
        return KVLayer(LATENT, kv_heads=1, k_dim=k_dim, v_dim=v_dim, dtype_bytes=int(keys.element_size()),
                       state_bytes=state, extra_bytes=extra, mha_width=latent[2])
    kind, capacity = FULL, None
    if getattr(layer, "is_sliding", False) or hasattr(layer, "sliding_window"):
        capacity = _measured_capacity(layer)
        kind = SLIDING if capacity is not None else FULL
    return KVLayer(kind, kv_heads=heads, k_dim=k_dim, v_dim=v_dim, dtype_bytes=int(keys.element_size()),
                   capacity=capacity, state_bytes=state, extra_bytes=extra, compressed=compressed)


def _shared(keys: Any, values: Any) -> bool:
    """Keys and values are one tensor (DeepSeek-V4's shared-KV attention): held once, not twice."""
    return values is keys or (_held(values) and values.untyped_storage().data_ptr() ==
                              keys.untyped_storage().data_ptr() and values.shape == keys.shape)


SERIES = ("compressed_kv", "buffer_kv", "buffer_gate", "overlap_kv", "overlap_gate")    # DeepSeek-V4's cache


def _series(layer: Any) -> list[list[int]]:
    """A layer's compressed series (DeepSeek-V4's compressor and indexer): per series its rate, the bytes of one
    entry, of one waiting position in its buffers (K and gate), and of its overlap (once the first entry
    exists: the last window's first halves, K and gate). Read from the cache layer after the probe's token."""
    rate = getattr(layer, "compress_rate", None)
    entries = getattr(layer, "compressed_kv", None)
    if not isinstance(rate, int) or not isinstance(entries, dict):
        return []
    out = []
    for name, entry in entries.items():
        waiting = [getattr(layer, f, {}).get(name) for f in ("buffer_kv", "buffer_gate")]
        if not isinstance(entry, torch.Tensor) or not all(isinstance(w, torch.Tensor) for w in waiting):
            continue
        size = int(entry.element_size())
        overlaps = isinstance(getattr(layer, "overlap_kv", None), dict) and name in layer.overlap_kv
        out.append([rate, int(entry.shape[-1]) * size, sum(int(w.shape[-1]) for w in waiting) * size,
                    2 * rate * int(entry.shape[-1]) * size if overlaps else 0])
    return out


def _series_bytes(layer: Any) -> int:
    return sum(int(t.nbytes) for name in SERIES if isinstance(getattr(layer, name, None), dict)
               for t in getattr(layer, name).values() if isinstance(t, torch.Tensor))


def _measured_capacity(layer: Any) -> int | None:
    """Push a copy of a sliding layer one position past its window and count what it keeps."""
    window = int(getattr(layer, "sliding_window", 0) or 0)
    if window <= 0:
        return None
    probe = copy.deepcopy(layer)
    k, v = probe.keys, probe.values
    more = window + 1
    probe.update(k.new_zeros(*k.shape[:2], more, k.shape[-1]), v.new_zeros(*v.shape[:2], more, v.shape[-1]))
    held = int(probe.keys.shape[-2])
    return held if held < k.shape[-2] + more else None


def _state_bytes(layer: Any) -> int:
    total = 0
    for name in ("conv_states", "recurrent_states"):
        states = getattr(layer, name, None)
        if isinstance(states, dict):
            total += sum(int(t.nbytes) for t in states.values() if t is not None)
    return total


def _extras(layer: Any) -> list[torch.Tensor]:
    """Per-position tensors a layer caches beside its keys and values (a sparse-attention indexer's keys,
    ``[batch, positions, width]``)."""
    extra = getattr(layer, "indexer_keys", None)
    return [extra] if _held(extra) else []


def _extra_bytes_per_position(layer: Any) -> int:
    return sum(int(t.shape[-1]) * int(t.element_size()) for t in _extras(layer))


def _held(tensor: Any) -> bool:
    return tensor is not None and bool(getattr(tensor, "numel", lambda: 0)())


# --- reading a live cache (metadata only) ----------------------------------------------------------------------
# A plain static cache's per-layer bytes, capacities and allocations, read once: allocated up front, they never
# change, only how far the cache is filled. Reading them again at every step took 0.6 ms of a 14-25 ms step.
_STATIC_LAYOUT: weakref.WeakKeyDictionary[Any, tuple[list[list[int]], list[int], list[int]]] = \
    weakref.WeakKeyDictionary()


def _static_layout(cache: Any) -> tuple[list[list[int]], list[int], list[int]] | None:
    """``(bytes per layer, capacity per layer, storage per layer)`` of a static cache whose every layer is laid
    out and holds nothing beside its keys and values; None for any other cache."""
    layout = _STATIC_LAYOUT.get(cache)
    if layout is not None:
        return layout
    layers = list(getattr(cache, "layers", ()))
    if not layers or not all(hasattr(layer, "max_cache_len") and _held(getattr(layer, "keys", None))
                             and _held(getattr(layer, "values", None)) and not _extras(layer)
                             and not _series(layer) and not _series_bytes(layer) for layer in layers):
        return None
    sizes = [[int(layer.keys.nbytes), 0 if _shared(layer.keys, layer.values) else int(layer.values.nbytes)]
             for layer in layers]
    capacities = [int(layer.keys.shape[-2]) for layer in layers]
    layout = (sizes, capacities, _allocated(cache))
    _STATIC_LAYOUT[cache] = layout
    return layout


def held_per_layer(cache: Any, num_layers: int) -> tuple[list[list[int]], list[int]]:
    """``[keys (and extras) bytes, values bytes]`` and positions per layer, read from the cache tensors'
    metadata in one pass (no device work): what attention reads. A dynamic cache grows by concatenation, so
    ``nbytes`` is exactly what is held, and a sliding layer stops growing at its capacity. No cache (KV off)
    holds nothing; neither does a state layer."""
    if cache is None:
        return [[0, 0] for _ in range(num_layers)], [0] * num_layers
    layout = _static_layout(cache)
    if layout is not None:
        seen = positions_seen(cache)
        return [list(pair) for pair in layout[0]], [min(seen, capacity) for capacity in layout[1]]
    sizes, positions = [], []
    seen = None
    for layer in cache.layers:
        keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
        if keys is not None and keys.numel():
            sizes.append([keys.nbytes + sum(t.nbytes for t in _extras(layer)) + _series_bytes(layer),
                          0 if _shared(keys, values) else values.nbytes])
            if hasattr(layer, "max_cache_len"):           # static: allocated up front, filled from the left
                seen = positions_seen(cache) if seen is None else seen
                positions.append(min(seen, keys.shape[-2]))
            else:
                positions.append(keys.shape[-2])
        else:
            sizes.append([0, 0])
            positions.append(0)
    return sizes, positions


def storage_per_layer(cache: Any, exposed: list[list[int]]) -> list[int]:
    """Bytes each layer has allocated (its tensors' distinct storages), where that differs anywhere from what
    the tensors expose: a sliding layer's keys are views into a larger buffer right after a long prefill or
    a decode step. Empty when every layer's allocation equals what it exposes (the usual case)."""
    if cache is None:
        return []
    layout = _static_layout(cache)
    allocated = list(layout[2]) if layout is not None else _allocated(cache)
    return allocated if any(a != k + v for a, (k, v) in zip(allocated, exposed)) else []


def _allocated(cache: Any) -> list[int]:
    """Each layer's distinct storages' bytes."""
    allocated = []
    for layer in cache.layers:
        seen: dict[int, int] = {}
        series = [t for name in SERIES if isinstance(getattr(layer, name, None), dict)
                  for t in getattr(layer, name).values() if isinstance(t, torch.Tensor)]
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None), *_extras(layer), *series):
            if t is not None and t.numel():
                storage = t.untyped_storage()
                seen[storage.data_ptr()] = storage.nbytes()
        allocated.append(sum(seen.values()))
    return allocated


def positions_seen(cache: Any) -> int:
    """Positions the cache has been fed (the context so far); a sliding layer may hold fewer of them."""
    if cache is None:
        return 0
    return int(cache.get_seq_length())         # a static cache answers with a 0-d tensor


def norms(cache: Any, first: int, end: int) -> tuple[list[list[float]], list[list[float]]]:
    """Mean over KV heads of the L2 norm of each cached key and value, positions ``first:end``, one reduction
    per layer and one copy to the host. Keys and values may differ in width (a latent layer's compressed vector
    and rope key): each is reduced over its own last dimension. A layer whose tensor is at least ``end`` long holds
    position p at index p (a dynamic cache's exactly, a static cache's buffer with its unwritten end after it); a
    sliding layer holding fewer keeps the last ones, and is left-padded with 0; a layer with no keys (a state-space
    layer) is all 0. Layers on different devices (an offloaded cache) are each reduced where they are."""
    span = end - first
    tensors = [t for layer in cache.layers for t in (getattr(layer, "keys", None), getattr(layer, "values", None))]
    if all(t is not None and t.numel() and t.shape[2] >= end for t in tensors) and \
            len({t.shape[1:2] + t.shape[3:] for t in tensors}) == 1 and len({t.device for t in tensors}) == 1:
        values = torch.stack([t[0, :, first:end] for t in tensors]).float().norm(dim=-1).mean(dim=1).tolist()
        return values[0::2], values[1::2]
    rows: list[torch.Tensor | None] = []
    for layer in cache.layers:
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):  # [1, kv_heads, held, dim]
            held = t.shape[2] if t is not None and t.numel() else 0
            if held >= end:                                                      # position p at index p
                window = t[0, :, first:end]
            else:                                                                # a sliding layer: the last
                take = max(min(held, span), 0)                                   # `held` positions only
                window = t[0, :, held - take:] if take else None
            rows.append(window.float().norm(dim=-1).mean(dim=0).cpu() if window is not None else None)   # [n]
    present = [r for r in rows if r is not None]
    flat = torch.cat(present).tolist() if present else []
    values, at = [], 0
    for r in rows:
        n = 0 if r is None else r.shape[0]
        values.append([0.0] * (span - n) + flat[at:at + n])
        at += n
    return values[0::2], values[1::2]


# --- reshaping a live cache (multi-turn reuse, speculative decoding, continuous batching) ---------------------
def rollback_refusal(model: ModelFacts, cache: Any, length: int) -> str | None:
    """Why the cache cannot be cut back to ``length`` positions, or None if it can."""
    return rollback_refusal_for(model, positions_seen(cache), length)


def crop_to(cache: Any, length: int) -> None:
    """Keep the first ``length`` positions (transformers 5.x ``crop`` takes a negative count to remove)."""
    held = positions_seen(cache)
    if length < held:
        try:
            cache.crop(length - held)
        except (RuntimeError, ValueError) as exc:
            raise CacheReshapeError(str(exc)) from None


def pad_left(cache: Any, columns: int, model: ModelFacts) -> None:
    """Prepend ``columns`` zero positions to every row (masked out by the attention mask). A sliding layer
    keeps its capacity: what the padding pushes past the window falls off the left."""
    if columns <= 0:
        return
    for layer, facts in zip(cache.layers, model.kv_layers):
        for name in ("keys", "values"):
            t = getattr(layer, name)
            padded = torch.cat([t.new_zeros(t.shape[0], t.shape[1], columns, t.shape[3]), t], dim=2)
            setattr(layer, name, padded[:, :, -held_positions(facts, padded.shape[2]):])
        _advance(layer, columns)


def drop_left(cache: Any, columns: int) -> None:
    """Remove the first ``columns`` positions of every row (padding no row needs any more). A sliding layer
    that holds fewer positions than remain keeps them all."""
    if columns <= 0:
        return
    seen = positions_seen(cache)
    for layer in cache.layers:
        keep = min(layer.keys.shape[2], seen - columns)
        layer.keys = layer.keys[:, :, layer.keys.shape[2] - keep:]
        layer.values = layer.values[:, :, layer.values.shape[2] - keep:]
        _advance(layer, -columns)


def append_rows(cache: Any, other: Any) -> None:
    """Stack ``other``'s rows under ``cache``'s (both already the same length)."""
    for mine, theirs in zip(cache.layers, other.layers):
        mine.keys = torch.cat([mine.keys, theirs.keys], dim=0)
        mine.values = torch.cat([mine.values, theirs.values], dim=0)


def select_rows(cache: Any, rows: list[int]) -> None:
    """Keep only ``rows`` (finished sequences leave the batch)."""
    index = torch.tensor(rows, dtype=torch.long, device=cache.layers[0].keys.device)
    for layer in cache.layers:
        layer.keys = layer.keys.index_select(0, index)
        layer.values = layer.values.index_select(0, index)


def _advance(layer: Any, columns: int) -> None:
    """A sliding layer counts the positions it has seen (its mask depends on it); padding counts too."""
    if hasattr(layer, "cumulative_length"):
        layer.cumulative_length += columns
