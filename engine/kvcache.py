"""KV-cache memory: what the cache tensors hold right now, and what the formula predicts.

The formula is ``2 (K and V) x layers x kv_heads x head_dim x tokens x bytes``. Reading the live tensors and
computing the formula live side by side so each checks the other (the tests assert they agree).
All access to transformers' cache layout is here, so a library upgrade touches one file.
This module does not import torch: the app uses the formula with no model loaded.
"""

from __future__ import annotations

from typing import Any

from engine.events import ModelFacts

SLIDING = "sliding_attention"


def kv_bytes_per_layer(cache: Any, num_layers: int) -> list[list[int]]:
    """``[k_bytes, v_bytes]`` per layer, read from the cache tensors (``DynamicCache`` grows by
    concatenation, so ``nbytes`` is exactly what is held). No cache (KV off) holds nothing."""
    if cache is None:
        return [[0, 0] for _ in range(num_layers)]
    out = []
    for layer in cache.layers:
        keys = getattr(layer, "keys", None)
        values = getattr(layer, "values", None)
        out.append([_nbytes(keys), _nbytes(values)])
    return out


def kv_tokens_held(cache: Any) -> int:
    """Positions held by the cache (the longest layer; sliding layers may hold fewer)."""
    if cache is None:
        return 0
    return int(cache.get_seq_length())


def _nbytes(tensor: Any) -> int:
    return int(tensor.nbytes) if tensor is not None and getattr(tensor, "numel", lambda: 0)() else 0


def bytes_per_token_per_layer(model: ModelFacts, batch: int = 1) -> int:
    """K plus V bytes one token adds to one layer."""
    return 2 * model.num_kv_heads * model.head_dim * model.dtype_bytes * batch


def bytes_per_token(model: ModelFacts, batch: int = 1) -> int:
    """``2 x layers x kv_heads x head_dim x bytes``: what one more token costs across the whole model."""
    return model.num_layers * bytes_per_token_per_layer(model, batch)


def layer_capacity(model: ModelFacts, layer: int, tokens: int) -> int:
    """Positions layer ``layer`` holds after ``tokens`` tokens: sliding-window layers keep only the window."""
    if model.sliding_window and layer < len(model.layer_types) and model.layer_types[layer] == SLIDING:
        return min(tokens, model.sliding_window)
    return tokens


def predicted_kv_bytes_per_layer(model: ModelFacts, tokens: int, batch: int = 1) -> list[int]:
    """The formula, per layer (K + V), for ``tokens`` cached positions."""
    per = bytes_per_token_per_layer(model, batch)
    return [per * layer_capacity(model, i, tokens) for i in range(model.num_layers)]


def predicted_kv_bytes(model: ModelFacts, tokens: int, batch: int = 1) -> int:
    return sum(predicted_kv_bytes_per_layer(model, tokens, batch))


def full_context_kv_bytes(model: ModelFacts, batch: int = 1) -> int:
    """The most this model's cache can hold: the formula at ``max_context`` tokens."""
    return predicted_kv_bytes(model, model.max_context, batch)


def formula_text(model: ModelFacts) -> str:
    """The formula with this model's numbers substituted, as shown in the report and the KV panel."""
    return (f"{model.num_layers} layers x {model.num_kv_heads} KV heads x {model.head_dim} dims x 2 (K,V) x "
            f"{model.dtype_bytes} B = {bytes_per_token(model):,} B/token")


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
def crop_to(cache: Any, length: int) -> None:
    """Keep the first ``length`` positions (transformers 5.x ``crop`` takes a negative count to remove)."""
    held = kv_tokens_held(cache)
    if length < held:
        cache.crop(length - held)


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading ids two sequences share: what a cache holding ``a`` can give to ``b``."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def pad_left(cache: Any, columns: int) -> None:
    """Prepend ``columns`` zero positions to every row (they are masked out by the attention mask)."""
    if columns <= 0:
        return
    import torch

    for layer in cache.layers:
        for name in ("keys", "values"):
            t = getattr(layer, name)
            pad = t.new_zeros(t.shape[0], t.shape[1], columns, t.shape[3])
            setattr(layer, name, torch.cat([pad, t], dim=2))


def drop_left(cache: Any, columns: int) -> None:
    """Remove the first ``columns`` positions of every row (padding no row needs any more)."""
    if columns <= 0:
        return
    for layer in cache.layers:
        layer.keys = layer.keys[:, :, columns:]
        layer.values = layer.values[:, :, columns:]


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
