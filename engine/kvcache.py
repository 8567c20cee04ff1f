"""KV-cache memory: what the model's cache really holds, layer by layer, and what the formula predicts.

The facts come from the cache the model builds, not from its config: :func:`probe_layers` runs one token
through the model and reads each cache layer (its class, heads, head dims, dtype), and pushes a sliding layer
past its window to see how many positions it keeps (transformers keeps ``window - 1``, not ``window``).
Configs disagree with their caches often enough (Mistral-style ``sliding_window`` without ``layer_types``,
Falcon's ``multi_query``, hybrids with state-space layers) that guessing from them gave wrong figures.

The formula, ``2 (K and V) x layers x kv_heads x head_dim x tokens x bytes`` per attention layer with each
layer's capacity honoured, sits beside the bytes read from the live tensors so each checks the other. Every
access to transformers' cache layout is in this module, so a library upgrade touches one file. The functions
over ``ModelFacts`` need no torch: the app uses them with no model loaded.
"""

from __future__ import annotations

import copy
from typing import Any

from engine.events import KVLayer, ModelFacts

FULL, SLIDING, STATE, NONE = "full", "sliding", "state", "none"


class CacheReshapeError(ValueError):
    """The cache cannot be reshaped this way (rolled back, padded, stacked); the message says why."""


# --- facts from the cache the model builds (torch) --------------------------------------------------------
def probe_layers(model: Any) -> list[KVLayer]:
    """Run one token through ``model`` with a fresh cache and describe what each layer keeps."""
    import torch

    cache = new_cache(model)
    device = model.get_input_embeddings().weight.device
    token = torch.zeros((1, 1), dtype=torch.long, device=device)
    with torch.inference_mode():
        out = model(input_ids=token, cache=cache, use_cache=True, logits_to_keep=1)
        cache = getattr(out, "cache", None) or cache
        return [_describe(layer) for layer in cache.layers]


def new_cache(model: Any, static_positions: int = 0) -> Any:
    """The cache a forward pass fills: transformers' ``DynamicCache`` laid out from the model's config, or with
    ``static_positions`` a ``StaticCache`` that allocates them all up front (what ``torch.compile`` needs)."""
    from transformers import DynamicCache, StaticCache

    if static_positions:
        return StaticCache(config=model.config, max_cache_len=static_positions)
    return DynamicCache(config=model.config)


def _describe(layer: Any) -> KVLayer:
    keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
    state = _state_bytes(layer)
    if not _held(keys):
        return KVLayer(STATE if state else NONE, state_bytes=state)
    kind, capacity = FULL, None
    if getattr(layer, "is_sliding", False) or hasattr(layer, "sliding_window"):
        capacity = _measured_capacity(layer)
        kind = SLIDING if capacity is not None else FULL
    return KVLayer(kind, kv_heads=int(keys.shape[1]), k_dim=int(keys.shape[-1]), v_dim=int(values.shape[-1]),
                   dtype_bytes=int(keys.element_size()), capacity=capacity, state_bytes=state)


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


def _held(tensor: Any) -> bool:
    return tensor is not None and bool(getattr(tensor, "numel", lambda: 0)())


# --- reading a live cache (torch tensors, metadata only) --------------------------------------------------
def held_per_layer(cache: Any, num_layers: int) -> tuple[list[list[int]], list[int]]:
    """``[k_bytes, v_bytes]`` and positions per layer, read from the cache tensors' metadata in one pass (no
    device work). A dynamic cache grows by concatenation, so ``nbytes`` is exactly what is held, and a sliding
    layer stops growing at its capacity. No cache (KV off) holds nothing; neither does a state layer."""
    if cache is None:
        return [[0, 0] for _ in range(num_layers)], [0] * num_layers
    sizes, positions = [], []
    seen = None
    for layer in cache.layers:
        keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
        if keys is not None and keys.numel():
            sizes.append([keys.nbytes, values.nbytes])
            if hasattr(layer, "max_cache_len"):           # static: allocated up front, filled from the left
                seen = positions_seen(cache) if seen is None else seen
                positions.append(min(seen, keys.shape[-2]))
            else:
                positions.append(keys.shape[-2])
        else:
            sizes.append([0, 0])
            positions.append(0)
    return sizes, positions


def positions_seen(cache: Any) -> int:
    """Positions the cache has been fed (the context so far); a sliding layer may hold fewer of them."""
    if cache is None:
        return 0
    return int(cache.get_seq_length())         # a static cache answers with a 0-d tensor


# --- the formula, from the facts (no torch) ---------------------------------------------------------------
def attention_layers(model: ModelFacts) -> list[KVLayer]:
    return [layer for layer in model.kv_layers if layer.kind in (FULL, SLIDING)]


def has_kv_cache(model: ModelFacts) -> bool:
    return bool(attention_layers(model))


def state_layers(model: ModelFacts) -> list[KVLayer]:
    return [layer for layer in model.kv_layers if layer.kind == STATE]


def kv_heads(model: ModelFacts) -> int:
    """KV heads of the attention layers (the largest, if they differ); 0 for a model without any."""
    return max((layer.kv_heads for layer in attention_layers(model)), default=0)


def bytes_per_position(layer: KVLayer, batch: int = 1) -> int:
    """K plus V bytes one position costs in ``layer``: ``kv_heads x (k_dim + v_dim) x bytes``."""
    return layer.kv_heads * (layer.k_dim + layer.v_dim) * layer.dtype_bytes * batch


def held_positions(layer: KVLayer, positions: int) -> int:
    """Positions ``layer`` holds after the cache has been fed ``positions``."""
    if layer.kind == FULL:
        return positions
    if layer.kind == SLIDING:
        return min(positions, layer.capacity or positions)
    return 0


def bytes_per_token(model: ModelFacts, batch: int = 1) -> int:
    """What one more position costs across all layers while no sliding layer is full."""
    return sum(bytes_per_position(layer, batch) for layer in attention_layers(model))


def predicted_kv_bytes_per_layer(model: ModelFacts, positions: int, batch: int = 1) -> list[int]:
    """The formula per layer (K + V) after ``positions`` positions, each layer's capacity honoured."""
    return [bytes_per_position(layer, batch) * held_positions(layer, positions) for layer in model.kv_layers]


def predicted_kv_bytes(model: ModelFacts, positions: int, batch: int = 1) -> int:
    return sum(predicted_kv_bytes_per_layer(model, positions, batch))


def full_context_positions(model: ModelFacts) -> int:
    """The most a run can cache: the last token of a full context is produced but never fed back."""
    return max(model.max_context - 1, 0)


def full_context_kv_bytes(model: ModelFacts, batch: int = 1) -> int:
    """What the cache holds at full context (``max_context - 1`` positions), capacities honoured."""
    return predicted_kv_bytes(model, full_context_positions(model), batch)


def formula_text(model: ModelFacts) -> str:
    """The formula with this model's numbers substituted, as shown in the report and the KV panel."""
    attention = attention_layers(model)
    if not attention:
        return "no attention KV cache"
    first = attention[0]
    uniform = all((a.kv_heads, a.k_dim, a.v_dim, a.dtype_bytes) == (first.kv_heads, first.k_dim, first.v_dim,
                                                                     first.dtype_bytes) for a in attention)
    per_token = bytes_per_token(model)
    if uniform and first.k_dim == first.v_dim:
        text = (f"{len(attention)} layers x {first.kv_heads} KV heads x {first.k_dim} dims x 2 (K,V) x "
                f"{first.dtype_bytes} B = {per_token:,} B/token")
    elif uniform:
        text = (f"{len(attention)} layers x {first.kv_heads} KV heads x ({first.k_dim} K + {first.v_dim} V dims) x "
                f"{first.dtype_bytes} B = {per_token:,} B/token")
    else:
        text = f"the sum over {len(attention)} layers of kv_heads x (K + V dims) x bytes = {per_token:,} B/token"
    return text + "".join(f"; {note}" for note in layer_notes(model))


def layer_notes(model: ModelFacts) -> list[str]:
    """What differs from "every layer holds every position", in words."""
    notes = []
    sliding = [layer for layer in model.kv_layers if layer.kind == SLIDING]
    if sliding:
        caps = sorted({layer.capacity for layer in sliding})
        held = " or ".join(f"{c:,}" for c in caps)
        notes.append(f"{len(sliding)} of {model.num_layers} layers slide and hold at most {held} positions")
    states = state_layers(model)
    if states:
        notes.append(f"{len(states)} of {model.num_layers} layers are state-space layers with a fixed "
                     f"{format_bytes(sum(s.state_bytes for s in states))} state instead of a KV cache")
    empty = [layer for layer in model.kv_layers if layer.kind == NONE]
    if empty:
        notes.append(f"{len(empty)} layers keep no keys or values of their own")
    return notes


def heads_text(model: ModelFacts) -> str:
    """Query heads vs KV heads: GQA, MQA or one KV head per query head."""
    kv = kv_heads(model)
    if not kv:
        return "no attention KV cache"
    if kv >= model.num_heads:
        return f"{model.num_heads} heads, each with its own K and V (no GQA)"
    share = model.num_heads // kv
    kind = "MQA: one KV head for all" if kv == 1 else f"GQA, {share} per KV head"
    return (f"{model.num_heads} query heads share {kv} KV head{'s' if kv > 1 else ''} ({kind}): the cache is "
            f"{model.num_heads / kv:g}x smaller than if every head kept its own")


def format_bytes(n: float) -> str:
    """Binary units with about three significant digits: ``46,080 B``, ``4.4 MiB``, ``360 MiB``."""
    if abs(n) < 1024:
        return f"{int(n):,} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        n /= 1024.0
        if abs(n) < 1024 or unit == "TiB":
            break
    if abs(n) >= 100:
        return f"{n:,.0f} {unit}"
    return f"{n:.1f} {unit}" if abs(n) >= 10 else f"{n:.2f} {unit}"


# --- reshaping a live cache (multi-turn reuse, continuous batching) ---------------------------------------
def rollback_refusal(model: ModelFacts, cache: Any, length: int) -> str | None:
    """Why the cache cannot be cut back to ``length`` positions, or None if it can."""
    if length >= positions_seen(cache):
        return None
    if state_layers(model):
        return "state-space layers keep one running state, which cannot be rolled back to an earlier position"
    seen = positions_seen(cache)
    if any(layer.kind == SLIDING and seen > (layer.capacity or seen) for layer in model.kv_layers):
        return ("sliding-window layers past their window have already dropped the positions needed to roll back "
                "to where the conversation changed")
    return None


def crop_to(cache: Any, length: int) -> None:
    """Keep the first ``length`` positions (transformers 5.x ``crop`` takes a negative count to remove)."""
    held = positions_seen(cache)
    if length < held:
        try:
            cache.crop(length - held)
        except (RuntimeError, ValueError) as exc:
            raise CacheReshapeError(str(exc)) from None


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading ids two sequences share: what a cache holding ``a`` can give to ``b``."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def batching_refusal(model: ModelFacts) -> str | None:
    """Why the rows of this model's cache cannot be padded and stacked, or None if they can."""
    if state_layers(model) or any(layer.kind == NONE for layer in model.kv_layers):
        return ("this model has layers without a per-position KV cache (state-space or shared layers), so "
                "requests cannot join a running batch by padding their caches")
    return None


def pad_left(cache: Any, columns: int, model: ModelFacts) -> None:
    """Prepend ``columns`` zero positions to every row (masked out by the attention mask). A sliding layer
    keeps its capacity: what the padding pushes past the window falls off the left."""
    if columns <= 0:
        return
    import torch

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
    import torch

    for mine, theirs in zip(cache.layers, other.layers):
        mine.keys = torch.cat([mine.keys, theirs.keys], dim=0)
        mine.values = torch.cat([mine.values, theirs.values], dim=0)


def select_rows(cache: Any, rows: list[int]) -> None:
    """Keep only ``rows`` (finished sequences leave the batch)."""
    import torch

    index = torch.tensor(rows, dtype=torch.long, device=cache.layers[0].keys.device)
    for layer in cache.layers:
        layer.keys = layer.keys.index_select(0, index)
        layer.values = layer.values.index_select(0, index)


def _advance(layer: Any, columns: int) -> None:
    """A sliding layer counts the positions it has seen (its mask depends on it); padding counts too."""
    if hasattr(layer, "cumulative_length"):
        layer.cumulative_length += columns
