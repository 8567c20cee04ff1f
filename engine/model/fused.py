"""Projections that read the same input, fused into one product per layer: the query, key and value projections
into one (``qkv_proj``, as wide as the three together) and the MLP's gate and up projections into one
(``gate_up_proj``).

A decode step is a couple of hundred matrix-vector products of one row each, and on a CPU each one costs a call,
a fork of the threads and a ragged edge of the weight it streams; fewer, wider products get nearer the memory
bandwidth. Measured over SmolLM2's shapes on a 2-vCPU Sapphire Rapids, one step's products (30 layers, distinct
weights, medians of interleaved rounds): bfloat16 through oneDNN 17.2 -> 14.4 ms, int8 weights 12.1 -> 10.9 ms,
float32 through ATen 20.3 -> 20.3 ms (already at the bandwidth). The arithmetic is the same products, so a
layer's outputs are those of the unfused layer up to the order of float sums.

Only layers whose code is transformers' Llama attention and MLP (compared by compiled code, with the functions
it calls) are fused: other architectures compute something else between the products. A model is kept fused only
if its logits on a probe agree with the unfused model's; otherwise it is put back as it was and the reason said.
"""

from __future__ import annotations

import functools
import inspect
import sys
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

PROBE_TOKENS = 6
AGREEMENT = {torch.float32: 1e-3}      # largest logit difference kept, as a share of the largest logit
AGREEMENT_HALF = 5e-2                  # bfloat16 / float16 round every product's output: sums in another order
#                                        move the last bits, which 30 layers carry on


def _attention_forward(self: Any, hidden_states: torch.Tensor,
                       position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
                       attention_mask: torch.Tensor | None = None, cache: Any = None,
                       **kwargs: Any) -> tuple[torch.Tensor, Any]:
    """transformers' Llama attention with the three projections read from one product."""
    if cache is None:
        cache = kwargs.pop("past_key_values", None)
    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, self.head_dim)
    query, key, value = self.qkv_proj(hidden_states).split(self.qkv_widths, dim=-1)
    query_states = query.view(hidden_shape).transpose(1, 2)
    key_states = key.view(hidden_shape).transpose(1, 2)
    value_states = value.view(hidden_shape).transpose(1, 2)
    cos, sin = position_embeddings
    query_states, key_states = self.rotary(query_states, key_states, cos, sin)
    if cache is not None:
        key_states, value_states = cache.update(key_states, value_states, self.layer_idx, kwargs=kwargs)
    attention_interface = self.attention_functions.get_interface(self.config._attn_implementation,
                                                                 self.eager_attention)
    attn_output, attn_weights = attention_interface(
        self, query_states, key_states, value_states, attention_mask,
        dropout=0.0 if not self.training else self.attention_dropout, scaling=self.scaling, **kwargs)
    attn_output = attn_output.reshape(*input_shape, -1).contiguous()
    return self.o_proj(attn_output), attn_weights


def _mlp_forward(self: Any, x: torch.Tensor) -> torch.Tensor:
    """transformers' Llama MLP with the gate and up projections read from one product."""
    gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
    return self.down_proj(self.act_fn(gate) * up)


_FUSED_CLASSES: dict[type, type] = {}


def _fused_class(cls: type, forward: Any, extra: dict[str, Any]) -> type:
    """A subclass of ``cls`` whose forward reads the fused product (one per class, so compiled graphs and the
    saved graphs' names see one class)."""
    if cls not in _FUSED_CLASSES:
        _FUSED_CLASSES[cls] = type(f"Fused{cls.__name__}", (cls,), {
            "forward": forward, "__module__": __name__, "__qualname__": f"Fused{cls.__name__}",
            **{name: staticmethod(f) for name, f in extra.items()}})
    return _FUSED_CLASSES[cls]


def _code_of(function: Any) -> Any:
    return inspect.unwrap(function).__code__


def same_code(first: Any, second: Any, depth: int = 3) -> bool:
    """Whether two functions compile to the same code and call functions (by the names they use) that do too:
    a model's copy of Llama's attention ("Copied from") is the same computation, a variant is not."""
    try:
        a, b = _code_of(first), _code_of(second)
    except AttributeError:
        return first is second
    if (a.co_code, a.co_names, a.co_varnames) != (b.co_code, b.co_names, b.co_varnames):
        return False
    consts_a = [c for c in a.co_consts if not hasattr(c, "co_code")]
    consts_b = [c for c in b.co_consts if not hasattr(c, "co_code")]
    if consts_a != consts_b:
        return False
    if depth == 0:
        return True
    globals_a = inspect.unwrap(first).__globals__
    globals_b = inspect.unwrap(second).__globals__
    for name in a.co_names:
        x, y = globals_a.get(name), globals_b.get(name)
        if x is y:
            continue
        if inspect.isfunction(x) and inspect.isfunction(y):
            if not same_code(x, y, depth - 1):
                return False
        elif x is not None or y is not None:
            if not (isinstance(x, type) and isinstance(y, type)) and type(x) is not type(y):
                return False
    return True


def _llama() -> Any:
    from transformers.models.llama import modeling_llama

    return modeling_llama


def _plain(*layers: Any) -> bool:
    """Plain linear layers on one device, in one dtype, none of them on the meta device (offloaded)."""
    if not all(type(layer) is nn.Linear for layer in layers):
        return False
    weights = [layer.weight for layer in layers]
    if len({(w.device, w.dtype, w.shape[1]) for w in weights}) != 1 or weights[0].device.type == "meta":
        return False
    return len({layer.bias is None for layer in layers}) == 1


def _joined(layers: list[nn.Linear]) -> nn.Linear:
    first = layers[0]
    out = sum(layer.out_features for layer in layers)
    joined = nn.Linear(first.in_features, out, bias=first.bias is not None, device="meta")
    joined.weight = nn.Parameter(torch.cat([layer.weight.detach() for layer in layers]), requires_grad=False)
    if first.bias is not None:
        joined.bias = nn.Parameter(torch.cat([layer.bias.detach() for layer in layers]), requires_grad=False)
    return joined


@functools.cache
def _computes_as(cls: type, reference: str) -> bool:
    """Whether ``cls``'s forward is Llama's ``reference`` class's code (compared once per class, not per layer)."""
    return same_code(cls.forward, getattr(_llama(), reference).forward)


def _attention_parts(module: Any) -> list[nn.Linear] | None:
    """The query, key and value projections of a module that computes as Llama's attention does, or None."""
    if not _computes_as(type(module), "LlamaAttention"):
        return None
    parts = [getattr(module, name, None) for name in ("q_proj", "k_proj", "v_proj")]
    return parts if _plain(*parts) else None


def _mlp_parts(module: Any) -> list[nn.Linear] | None:
    """The gate and up projections of a module that computes as Llama's MLP does, or None."""
    if not _computes_as(type(module), "LlamaMLP"):
        return None
    parts = [getattr(module, name, None) for name in ("gate_proj", "up_proj")]
    return parts if _plain(*parts) and parts[0].out_features == parts[1].out_features else None


Before = tuple[type, dict[str, nn.Module]]


def _fuse_attention(module: Any, parts: list[nn.Linear]) -> Before:
    llama = _llama()
    own = sys.modules[type(module).__module__]
    rotary = getattr(own, "apply_rotary_pos_emb", llama.apply_rotary_pos_emb)
    eager = getattr(own, "eager_attention_forward", llama.eager_attention_forward)
    names = ("q_proj", "k_proj", "v_proj")
    before = (module.__class__, dict(zip(names, parts)))
    module.qkv_widths = tuple(p.out_features for p in parts)
    module.qkv_proj = _joined(parts)
    for name in names:
        delattr(module, name)
    module.attention_functions = llama.ALL_ATTENTION_FUNCTIONS
    module.__class__ = _fused_class(type(module), _attention_forward, {"rotary": rotary, "eager_attention": eager})
    return before


def _fuse_mlp(module: Any, parts: list[nn.Linear]) -> Before:
    names = ("gate_proj", "up_proj")
    before = (module.__class__, dict(zip(names, parts)))
    module.gate_up_proj = _joined(parts)
    for name in names:
        delattr(module, name)
    module.__class__ = _fused_class(type(module), _mlp_forward, {})
    return before


def _unfuse(module: Any, before: Before) -> None:
    cls, parts = before
    for name in ("qkv_proj", "gate_up_proj"):
        if name in module._modules:
            delattr(module, name)
    module.__class__ = cls
    for name, part in parts.items():
        setattr(module, name, part)


@dataclass(frozen=True)
class Fusion:
    attention: int = 0              # layers whose query, key and value are one product
    mlp: int = 0                    # layers whose gate and up are one product
    reason: str = ""                # why nothing was fused, when nothing was

    def words(self) -> str:
        if not (self.attention or self.mlp):
            return f"projections not fused ({self.reason})" if self.reason else ""
        return (f"query, key and value one product in {self.attention} layers, gate and up one in {self.mlp}")


def _probe_logits(model: Any) -> torch.Tensor:
    vocab = model.get_output_embeddings().out_features
    device = model.get_input_embeddings().weight.device
    ids = torch.tensor([[(11 + 37 * i) % vocab for i in range(PROBE_TOKENS)]], device=device)
    with torch.inference_mode():
        return model(input_ids=ids, use_cache=False).logits.float()


def fuse(model: Any) -> Fusion:
    """Fuse every layer that can be, in place, and keep it only if a probe's logits agree (see the module)."""
    if getattr(model, "hf_device_map", None) and len(set(model.hf_device_map.values())) > 1:
        return Fusion(reason="the model is split across devices or disk")
    if model.get_output_embeddings() is None:
        return Fusion(reason="the model has no output projection to probe")
    attention = [(m, p) for m in model.modules() if (p := _attention_parts(m)) is not None]
    mlp = [(m, p) for m in model.modules() if (p := _mlp_parts(m)) is not None]
    if not attention and not mlp:
        return Fusion(reason="no layer computes as transformers' Llama attention or MLP does")
    before = _probe_logits(model)
    done = [(m, _fuse_attention(m, p)) for m, p in attention] + [(m, _fuse_mlp(m, p)) for m, p in mlp]
    after = _probe_logits(model)
    dtype = next(model.parameters()).dtype
    allowed = AGREEMENT.get(dtype, AGREEMENT_HALF) * float(before.abs().max())
    difference = float((after - before).abs().max())
    if not difference <= allowed:
        for module, fused in reversed(done):
            _unfuse(module, fused)
        return Fusion(reason=f"the fused model's probe logits differed by {difference:.3g} (at most {allowed:.3g} "
                             "kept): left unfused")
    return Fusion(len(attention), len(mlp))
