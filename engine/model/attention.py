"""What the cache is read for: the attention weights of the newest token over the cached positions, per layer
and head, taken from the real query and the cached keys of each step.

transformers' fast attention (``sdpa``) does not return its weights, and switching a model to ``eager``
attention for every step is slower and changes its arithmetic slightly. So for models whose attention goes
through transformers' ``AttentionInterface`` this module registers one attention function that runs ``sdpa``
unchanged and, only while a capture is on, also computes ``softmax(q k^T * scale + mask)`` for the newest query
row: one row per head, a few microseconds per layer. With the capture off its cost is one attribute read per
layer. Models that run eager attention (Gemma2) are asked for ``output_attentions`` on the passes that
capture, and the newest row is kept; any other model is refused with the reason. Everything that touches
transformers' attention internals is here, so an upgrade touches one file.

The same function reads grouped keys and values as they are on a CPU (``enable_gqa``): transformers' ``sdpa``
copies them out to one per query head whenever a mask is given (a compiled decode always gives one), which its
GPU kernels need and a CPU's do not. The copy was half of attention's time: 58 -> 24 us a layer in float32 at 256
cached positions, the same numbers out. ``use_grouped_sdpa`` puts a CPU model on it at load.

And in a compiled decode step on a CPU (one query) it computes attention as two small products and a softmax
(``one_query``) instead of calling torch's CPU flash attention, which is built for many queries and spent more on
its set-up than on one query's arithmetic: 195 us a layer of a 19.9 ms bfloat16 step at 256 cached positions
(SmolLM2, 2-vCPU Zen 4, inductor's kernel profile), 32 us this way. Tried and left: the scores as ``K q^T``, so
that inductor's GEMM kernel need not copy the keys into its blocked layout at every step (read in its generated
C++). Inductor turned that three-column product into sums over the head's dim: bfloat16 steps without autotuning
took 19 ms against 21.5 at 256 cached positions, but 31.4 against 27.2 at 2,048, and float32 40.9 against 39.5 at
256; with autotuning, two builds of one graph decoded at 82 and 110 tok/s, a spread that hid either way.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from engine.facts.events import ATTENTION_METHODS

NAME = "kvscope_sdpa"
HOOK, OUTPUTS = ATTENTION_METHODS   # the weights sdpa used, recomputed; the model's own attention returned them
_registered = False


class Capture:
    """The newest query's weights per layer, collected during one forward pass and taken as plain values."""

    def __init__(self, method: str, attention_layers: list[int], num_layers: int) -> None:
        self.method = method
        self.active = False
        self.attention_layers = attention_layers
        self.num_layers = num_layers
        self.rows: dict[int, torch.Tensor] = {}          # layer -> [heads, keys]
        self.spent_s = 0.0                               # time in the capture code since the last take()

    def forward_kwargs(self) -> dict[str, Any]:
        """Extra arguments for the model's forward on a pass that captures."""
        return {"output_attentions": True} if self.active and self.method == OUTPUTS else {}

    def collect(self, outputs: Any) -> None:
        """After a forward pass: keep the newest row of each attention map the model returned."""
        if not self.active or self.method != OUTPUTS:
            return
        started = time.perf_counter()
        maps = getattr(outputs, "attentions", None) or ()
        present = [m for m in maps if m is not None]
        layers = range(len(maps)) if len(maps) == self.num_layers else self.attention_layers
        if len(maps) != self.num_layers:
            maps = present
        for layer, weights in zip(layers, maps):
            if weights is not None:
                self.rows[layer] = weights[0, :, -1, :].float()
        self.spent_s += time.perf_counter() - started

    def take(self, position: int) -> tuple[list[int], list[int], list[list[list[float]]], float]:
        """``(layers, first key position per layer, weights [layers][heads][keys], ms spent capturing)`` for
        the query at ``position``. A static cache's unwritten slots (masked, weight 0) are cut off."""
        started = time.perf_counter()
        layers = sorted(self.rows)
        rows = [self.rows[i][:, : position + 1] for i in layers]
        firsts = [position + 1 - row.shape[-1] for row in rows]
        weights = [torch.round(row.double(), decimals=4).tolist() for row in rows]
        self.rows.clear()
        spent_ms = (self.spent_s + time.perf_counter() - started) * 1000.0
        self.spent_s = 0.0
        return layers, firsts, weights, spent_ms


def _sdpa(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
          attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
          **kwargs: Any) -> tuple[torch.Tensor, None]:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    capture: Capture | None = getattr(module, "_kvscope_capture", None)
    if capture is not None and capture.active:
        started = time.perf_counter()
        capture.rows[module.layer_idx] = newest_row(query, key, attention_mask, scaling)
        capture.spent_s += time.perf_counter() - started
    if (query.shape[-2] == 1 and torch.compiler.is_compiling() and _plain_on_cpu(query, key, value, kwargs)
            and (attention_mask is None or attention_mask.shape[1] == 1)):          # one mask for every head
        return one_query(query, key, value, attention_mask, scaling), None
    if _grouped_on_cpu(module, query, key, value, attention_mask, kwargs):
        out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask,
                                                               dropout_p=dropout, scale=scaling, enable_gqa=True)
        return out.transpose(1, 2).contiguous(), None
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  **kwargs)


def one_query(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
              scaling: float | None) -> torch.Tensor:
    """``sdpa`` for a single query, ``[batch, 1, heads, dim]`` as transformers' attention functions return it.
    Two small batched products, one per KV head with its group of query heads as the rows (read through a
    reshape, never a copy of the keys), and a softmax in float32 between them: a compiled graph gives the
    products to its GEMM kernels, whose inputs are computed once. (Written as sums over the keys, inductor fused
    the query's rotary embedding into the scores' loop and computed its sines and cosines again for every key:
    71 us a layer against 32 this way.)"""
    batch, heads, _one, dim = query.shape
    kv_heads = key.shape[1]
    q = query.reshape(batch, kv_heads, heads // kv_heads, dim)
    scale = scaling if scaling is not None else dim ** -0.5
    scores = torch.matmul(q, key.transpose(-1, -2)).float() * scale                # [batch, kv, group, keys]
    if mask is not None:
        row = mask[:, :, -1, : key.shape[-2]].reshape(mask.shape[0], 1, 1, -1)
        scores = scores.masked_fill(~row, float("-inf")) if row.dtype == torch.bool else scores + row.float()
    weights = torch.softmax(scores, dim=-1).to(value.dtype)
    return torch.matmul(weights, value).reshape(batch, 1, heads, value.shape[-1])   # [batch, kv, group, dim]


def _plain_on_cpu(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kwargs: dict[str, Any]) -> bool:
    """On a CPU, with nothing of ``sdpa``'s beyond a mask in play (a position bias, a soft cap, weights asked
    for)."""
    return (query.device.type == "cpu" and key.shape[-1] == value.shape[-1] and kwargs.get("position_bias") is None
            and kwargs.get("softcap") is None and not kwargs.get("output_attentions", False))


def _grouped_on_cpu(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    mask: torch.Tensor | None, kwargs: dict[str, Any]) -> bool:
    """Whether transformers would copy the grouped keys out (a mask given) where a CPU's kernel reads them as
    they are."""
    return (mask is not None and getattr(module, "num_key_value_groups", 1) > 1
            and _plain_on_cpu(query, key, value, kwargs))


def _register() -> None:
    global _registered
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    if not _registered:
        AttentionInterface.register(NAME, _sdpa)
        ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)
        _registered = True


def use_grouped_sdpa(model: Any) -> bool:
    """Put a CPU model that runs transformers' ``sdpa`` on this module's (the same kernel, grouped keys read as
    they are); whether it now is."""
    if getattr(model.config, "_attn_implementation", None) != "sdpa" or model.device.type != "cpu":
        return False
    return _switched(model)


def _switched(model: Any) -> bool:
    """Put ``model`` on this module's attention function; whether it now is (a model may refuse)."""
    _register()
    try:
        model.set_attn_implementation(NAME)
    except (ValueError, NotImplementedError):
        return False
    return getattr(model.config, "_attn_implementation", None) == NAME


def newest_row(query: torch.Tensor, key: torch.Tensor, mask: torch.Tensor | None,
               scaling: float | None) -> torch.Tensor:
    """Attention weights of the last query over every key, ``[heads, keys]`` (batch row 0), as ``sdpa``
    computes them: query heads share KV heads in groups (GQA, MQA), the mask row removes what the query may not
    see (the future, positions outside a sliding window)."""
    q = query[0, :, -1:, :].float()                                         # [heads, 1, dim]
    groups = q.shape[0] // key.shape[1]
    k = key[0].float().repeat_interleave(groups, dim=0)                     # [heads, keys, dim]
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    scores = (q @ k.transpose(-1, -2))[:, 0, :] * scale                    # [heads, keys]
    if mask is not None:
        row = mask[0, 0, -1, : scores.shape[-1]]
        scores = scores.masked_fill(~row, float("-inf")) if row.dtype == torch.bool else scores + row.float()
    return torch.softmax(scores, dim=-1)


# What a compiled graph traces of this module: its code is in a saved graph's name (``engine.model.compiled``),
# so a graph traced through an earlier version of it is not read.
TRACED = (_sdpa, one_query, _plain_on_cpu, _grouped_on_cpu)


def attach(model: Any, num_layers: int) -> Capture:
    """A capture for ``model``: through the capturing ``sdpa`` where the model can switch to it (the same
    arithmetic as before); for a model that runs eager attention, through the weights it computes anyway
    (``output_attentions`` on the passes that capture). Raises ``ValueError`` for any other model: asking
    a model on another kernel for ``output_attentions`` can change its arithmetic (Falcon's own attention in
    transformers 5.24, on ``sdpa``, then added its boolean mask as numbers and attended to the future), and the
    view must show what the model did."""
    if any("indexer" in type(m).__name__.lower() for m in model.modules()):
        raise ValueError(f"attention cannot be recorded for {type(model).__name__}: its indexer picks which cached "
                         "positions each query reads (sparse attention), and the recording would show every "
                         "position as read")
    modules = [m for m in model.modules() if isinstance(getattr(m, "layer_idx", None), int)
               and "attention" in type(m).__name__.lower()]
    layers = sorted({m.layer_idx for m in modules})
    implementation = getattr(model.config, "_attn_implementation", None)
    if implementation == "eager":
        return Capture(OUTPUTS, layers, num_layers)
    if implementation in ("sdpa", NAME):
        if _switched(model):
            capture = Capture(HOOK, layers, num_layers)
            for module in modules:
                module._kvscope_capture = capture
            return capture
    raise ValueError(f"attention cannot be recorded for {type(model).__name__}: it runs {implementation} "
                     "attention, which KVScope records only as eager or sdpa, and asking it for its weights would "
                     "change what it computes")
