"""KV-cache arithmetic over a model's facts: what each layer holds per position, the formula
``2 (K and V) x layers x kv_heads x head_dim x tokens x bytes`` with each layer's capacity honoured, the
full-context figure, and the words that explain them. No torch: the window uses it with no model loaded.

The facts themselves come from the cache the model really builds (``engine.model.kvcache.probe_layers``): a layer is
``full`` (every position), ``sliding`` (the last ``capacity``), ``latent`` (multi-head latent attention: one
compressed vector and one rope key per position, shared by every head), ``state`` (a fixed-size recurrent
state) or ``none`` (it reuses another layer's keys and values). A layer may also hold a fixed state beside its
keys and values (Falcon-H1's combined layers) and per-position extras (DeepSeek-V3.2's indexer keys).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from engine.facts.events import KVLayer, ModelFacts

FULL, SLIDING, LATENT, STATE, NONE = "full", "sliding", "latent", "state", "none"
HOLDS_POSITIONS = (FULL, SLIDING, LATENT)          # layers whose cache grows with the positions fed


def attention_layers(model: ModelFacts) -> list[KVLayer]:
    return [layer for layer in model.kv_layers if layer.kind in HOLDS_POSITIONS]


def has_kv_cache(model: ModelFacts) -> bool:
    return bool(attention_layers(model))


def state_layers(model: ModelFacts) -> list[KVLayer]:
    """Layers that keep a fixed-size state, on its own or beside their keys and values."""
    return [layer for layer in model.kv_layers if layer.state_bytes > 0]


def state_bytes(model: ModelFacts, batch: int = 1) -> int:
    """The fixed state every sequence holds whatever its length (SSM and convolution states)."""
    return sum(layer.state_bytes for layer in model.kv_layers) * batch


def latent_layers(model: ModelFacts) -> list[KVLayer]:
    return [layer for layer in model.kv_layers if layer.kind == LATENT]


def kv_heads(model: ModelFacts) -> int:
    """KV heads of the attention layers (the largest, if they differ); 0 for a model without any."""
    return max((layer.kv_heads for layer in attention_layers(model)), default=0)


def bytes_per_position(layer: KVLayer, batch: int = 1) -> int:
    """What one position costs in ``layer``: ``kv_heads x (k_dim + v_dim) x bytes`` plus any per-position
    extras (an indexer's keys)."""
    return (layer.kv_heads * (layer.k_dim + layer.v_dim) * layer.dtype_bytes + layer.extra_bytes) * batch


def held_positions(layer: KVLayer, positions: int) -> int:
    """Positions ``layer`` holds after the cache has been fed ``positions``."""
    if layer.kind in (FULL, LATENT):
        return positions
    if layer.kind == SLIDING:
        return min(positions, layer.capacity or positions)
    return 0


def bytes_per_token(model: ModelFacts, batch: int = 1) -> int:
    """What one more position costs across all layers while no sliding layer is full."""
    return sum(bytes_per_position(layer, batch) for layer in attention_layers(model))


def compressed_bytes(layer: KVLayer, positions: int, batch: int = 1) -> int:
    """What a layer's compressed series hold after ``positions``: an entry per ``rate`` positions, the positions
    since the last entry in a buffer, and a fixed overlap once the first entry exists."""
    total = 0
    for rate, entry, buffered, overlap in layer.compressed:
        entries, waiting = divmod(positions, max(rate, 1))
        total += entries * entry + waiting * buffered + (overlap if entries else 0)
    return total * batch


def predicted_kv_bytes_per_layer(model: ModelFacts, positions: int, batch: int = 1) -> list[int]:
    """The formula per layer (K + V and extras, and any compressed series) after ``positions`` positions, each
    layer's capacity honoured."""
    return [bytes_per_position(layer, batch) * held_positions(layer, positions) + compressed_bytes(layer, positions,
                                                                                                   batch)
            for layer in model.kv_layers]


def predicted_kv_bytes(model: ModelFacts, positions: int, batch: int = 1) -> int:
    return sum(predicted_kv_bytes_per_layer(model, positions, batch))


def held_bytes(per_layer: Sequence[Sequence[int]]) -> int:
    """What a cache's tensors hold, K and V over every layer: the one place an event's ``kv_bytes_per_layer``
    is added up."""
    return sum(k + v for k, v in per_layer)


def k_and_v_bytes(per_layer: Sequence[Sequence[int]]) -> tuple[int, int]:
    """The keys' bytes and the values' bytes over every layer (the heatmap's bars say them apart)."""
    return sum(k for k, _ in per_layer), sum(v for _, v in per_layer)


@dataclass(frozen=True)
class KVCheck:
    """A run's cache held to the formula, judged once for every view that says it (the heatmap's info, the KV
    scene, the CLI's report): ``held`` and ``allocated`` were read from the tensors (measured), ``predicted`` is
    the formula for the positions the cache has room for (a static cache's bytes cover all it allocated up
    front), and a cache kept smaller on purpose (``method`` other than ``full``) is judged by its share."""

    positions: int               # positions fed (the newest token is not fed back yet)
    held: int                    # bytes the tensors hold
    predicted: int               # the formula's bytes for those positions (a static cache: its allocation)
    allocated: int | None        # bytes the tensors' storages allocated, where that differs from ``held``
    method: str = "full"         # how the cache kept what it kept

    @property
    def full(self) -> bool:
        return self.method == "full"

    @property
    def equal(self) -> bool:
        """The tensors hold what the formula says (a cache kept smaller on purpose is never "equal")."""
        return self.full and self.held == self.predicted

    @property
    def share(self) -> float | None:
        """What it holds as a share of the formula's full-precision bytes."""
        return self.held / self.predicted if self.predicted else None


def check_kv(model: ModelFacts, held: int, positions: int, allocated: int | None = None, static_positions: int = 0,
             method: str = "full") -> KVCheck:
    """``held``: bytes the tensors hold (``held_bytes`` of an event); ``static_positions``: a static cache's
    positions allocated up front (0: the cache grows)."""
    predicted = predicted_kv_bytes(model, static_positions or positions)
    return KVCheck(positions, held, predicted, allocated if allocated and allocated != held else None, method)


def full_context_positions(model: ModelFacts) -> int:
    """The most a run can cache: the last token of a full context is produced but never fed back."""
    return max(model.max_context - 1, 0)


def full_context_kv_bytes(model: ModelFacts, batch: int = 1) -> int:
    """What the cache holds at full context (``max_context - 1`` positions), capacities honoured."""
    return predicted_kv_bytes(model, full_context_positions(model), batch)


def context_text(model: ModelFacts) -> str:
    """The full context in words: its positions, or that the model declares none (and the cap runs have here)."""
    if getattr(model, "context_declared", True):
        return f"{model.max_context:,}-position window, {full_context_positions(model):,} positions cached"
    return f"not declared by the model; runs here stop at {model.max_context:,} positions"


def formula_text(model: ModelFacts) -> str:
    """The formula with this model's numbers substituted, as shown in the report and the KV panel."""
    attention = attention_layers(model)
    if not attention:
        return "no attention KV cache"
    first = attention[0]
    uniform = all((a.kind, a.kv_heads, a.k_dim, a.v_dim, a.dtype_bytes, a.extra_bytes) ==
                  (first.kind, first.kv_heads, first.k_dim, first.v_dim, first.dtype_bytes, first.extra_bytes)
                  for a in attention)
    per_token = bytes_per_token(model)
    extra = f" + {first.extra_bytes:,} B indexer keys" if first.extra_bytes else ""
    if uniform and first.kind == LATENT:
        text = (f"{len(attention)} layers x ({first.k_dim} latent + {first.v_dim} rope-key dims) x "
                f"{first.dtype_bytes} B{extra} = {per_token:,} B/token")
    elif uniform and not first.v_dim and not first.extra_bytes:
        text = (f"{len(attention)} layers x {first.kv_heads} KV head{'s' if first.kv_heads > 1 else ''} x "
                f"{first.k_dim} dims x 1 (K = V, one tensor) x {first.dtype_bytes} B = {per_token:,} B/token")
    elif uniform and first.k_dim == first.v_dim and not first.extra_bytes:
        text = (f"{len(attention)} layers x {first.kv_heads} KV heads x {first.k_dim} dims x 2 (K,V) x "
                f"{first.dtype_bytes} B = {per_token:,} B/token")
    elif uniform:
        text = (f"{len(attention)} layers x ({first.kv_heads} KV heads x ({first.k_dim} K + {first.v_dim} V dims) x "
                f"{first.dtype_bytes} B{extra}) = {per_token:,} B/token")
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
    pure = [layer for layer in states if layer.kind == STATE]
    combined = [layer for layer in states if layer.kind != STATE]
    if pure:
        notes.append(f"{len(pure)} of {model.num_layers} layers are state-space layers with a fixed "
                     f"{format_bytes(sum(s.state_bytes for s in pure))} state instead of a KV cache")
    if combined:
        notes.append(f"{len(combined)} of {model.num_layers} layers also keep a fixed "
                     f"{format_bytes(sum(s.state_bytes for s in combined))} of convolution and SSM state per "
                     "sequence beside their keys and values")
    shared = [layer for layer in attention_layers(model) if layer.kv_heads and not layer.v_dim]
    if shared:
        notes.append(f"{len(shared)} layers keep keys and values as one tensor (shared-KV attention): counted once")
    series = [layer for layer in model.kv_layers if layer.compressed]
    if series:
        rates = sorted({rate for layer in series for rate, *_ in layer.compressed})
        notes.append(f"{len(series)} layers also condense the context into compressed entries, one every "
                     f"{' or '.join(str(r) for r in rates)} positions (plus the positions waiting for the next)")
    indexed = [layer for layer in model.kv_layers if layer.extra_bytes]
    if indexed:
        notes.append(f"{len(indexed)} layers also cache a sparse-attention indexer key "
                     f"({indexed[0].extra_bytes:,} B per position)")
    empty = [layer for layer in model.kv_layers if layer.kind == NONE]
    if empty:
        notes.append(f"{len(empty)} layers keep no keys or values of their own")
    return notes


def heads_text(model: ModelFacts) -> str:
    """Query heads vs what the cache keeps for them: GQA, MQA, a compressed latent, or one KV head each."""
    latent = latent_layers(model)
    if latent:
        layer = latent[0]
        cached = layer.k_dim + layer.v_dim
        ratio = f"; full multi-head K and V with these dims would hold {layer.mha_width / cached:,.0f}x more" \
            if layer.mha_width else ""
        return (f"compressed latent {layer.k_dim} + rope key {layer.v_dim} per token, shared by all "
                f"{model.num_heads} heads (multi-head latent attention){ratio}")
    kv = kv_heads(model)
    if not kv:
        return "no attention KV cache"
    if kv >= model.num_heads:
        return f"{model.num_heads} heads, each with its own K and V (no GQA){repeated_heads_text(model)}"
    share = model.num_heads // kv
    kind = "MQA: one KV head for all" if kv == 1 else f"GQA, {share} per KV head"
    return (f"{model.num_heads} query heads share {kv} KV head{'s' if kv > 1 else ''} ({kind}): the cache is "
            f"{model.num_heads / kv:g}x smaller than if every head kept its own{repeated_heads_text(model)}")


def repeated_heads_text(model: ModelFacts) -> str:
    """Where the cache holds K and V for more heads than the config's KV heads (a model's code repeats the
    shared heads before caching them, as Falcon's new decoder did up to transformers 5.24), why the figure is
    larger than the config says."""
    declared, held = getattr(model, "config_kv_heads", 0), kv_heads(model)
    if not declared or held <= declared:
        return ""
    return (f"; its config declares {declared} KV heads, but the cache holds K and V for {held}: this model's "
            f"transformers code repeats each shared head before caching it, so the cache is {held / declared:g}x "
            "what the config suggests (measured)")


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


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading ids two sequences share: what a cache holding ``a`` can give to ``b``."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


# --- what a model's cache allows ------------------------------------------------------------------------------
def batching_refusal(model: ModelFacts) -> str | None:
    """Why the rows of this model's cache cannot be padded and stacked, or None if they can. Judged by what
    each layer holds (a state, an indexer's keys, nothing), not by its label: a combined layer has a state too."""
    if state_layers(model) or any(layer.kind == NONE for layer in model.kv_layers):
        return ("this model has layers with a fixed state or without a per-position KV cache (state-space, "
                "combined or shared layers), so requests cannot join a running batch by padding their caches")
    if any(layer.extra_bytes for layer in model.kv_layers):
        return ("this model's layers also cache a sparse-attention indexer, which KVScope cannot pad and stack, "
                "so requests cannot join a running batch")
    if any(layer.compressed for layer in model.kv_layers):
        return ("this model's layers condense the context into compressed entries as it grows, which KVScope "
                "cannot pad and stack, so requests cannot join a running batch")
    return None


def rollback_refusal_for(model: ModelFacts, seen: int, length: int) -> str | None:
    """Why a cache fed ``seen`` positions cannot be cut back to ``length``, or None if it can."""
    if length >= seen:
        return None
    if state_layers(model):
        return "layers with a state-space state keep one running state, which cannot be rolled back to an " \
               "earlier position"
    if any(layer.compressed for layer in model.kv_layers):
        return "layers that condense the context into compressed entries cannot be rolled back to an earlier position"
    if any(layer.kind == SLIDING and seen > (layer.capacity or seen) for layer in model.kv_layers):
        return ("sliding-window layers past their window have already dropped the positions needed to roll back "
                "to where the conversation changed")
    return None


def speculative_refusal(model: ModelFacts) -> str | None:
    """Why rejected guesses could not be cut out of this model's cache, or None."""
    if state_layers(model):
        return "layers with a state-space state keep one running state, which cannot be rolled back past " \
               "rejected guesses"
    if any(layer.compressed for layer in model.kv_layers):
        return "layers that condense the context into compressed entries cannot be rolled back past rejected guesses"
    if any(layer.kind == SLIDING for layer in model.kv_layers):
        return "sliding-window layers drop old positions, so the cache cannot be rolled back past rejected guesses"
    return None

