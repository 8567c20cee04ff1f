"""Fused projections: a Llama layer's query, key and value (and its MLP's gate and up) become one product each,
the model computes what it did, and what cannot be fused, or does not agree after fusing, is left as it was."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine.model import fused
from engine.model.models import load


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return model(input_ids=ids, use_cache=False).logits


def _greedy(model, ids: torch.Tensor, steps: int) -> list[int]:
    from transformers import DynamicCache

    cache, tokens = DynamicCache(config=model.config), []
    with torch.inference_mode():
        out = model(input_ids=ids, cache=cache, use_cache=True)
        for _ in range(steps):
            token = int(out.logits[0, -1].argmax())
            tokens.append(token)
            out = model(input_ids=torch.tensor([[token]]), cache=cache, use_cache=True)
    return tokens


def test_loaded_llama_has_one_product_per_group_and_computes_the_same(tiny_model_dir) -> None:
    plain = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()
    loaded = load(str(tiny_model_dir), device="cpu", dtype="float32")
    attention, mlp = loaded.model.model.layers[0].self_attn, loaded.model.model.layers[0].mlp
    assert not hasattr(attention, "q_proj") and not hasattr(mlp, "gate_proj")
    config = plain.config
    head_dim = config.hidden_size // config.num_attention_heads
    assert attention.qkv_proj.out_features == (config.num_attention_heads + 2 * config.num_key_value_heads) * head_dim
    assert mlp.gate_up_proj.out_features == 2 * config.intermediate_size
    assert "query, key and value one product in 2 layers, gate and up one in 2" in loaded.dtype_reason
    ids = torch.tensor([[5, 17, 42, 8, 99, 3, 61]])
    assert torch.allclose(_logits(loaded.model, ids), _logits(plain, ids), atol=1e-5)
    assert _greedy(loaded.model, ids, 12) == _greedy(plain, ids, 12)
    assert sum(p.numel() for p in loaded.model.parameters()) == sum(p.numel() for p in plain.parameters())


def test_attention_with_other_code_is_left_unfused_and_its_llama_mlp_fused(tmp_path) -> None:
    from tests.architectures import build

    folder = build("qwen3-head-dim", tmp_path / "qwen3")          # q and k norms between the products
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    ids = torch.tensor([[5, 17, 42, 8]])
    before = _logits(model, ids)
    result = fused.fuse(model)
    attention = model.model.layers[0].self_attn
    assert hasattr(attention, "q_proj") and not hasattr(attention, "qkv_proj")
    assert type(attention).__module__.startswith("transformers.")
    assert (result.attention, result.mlp) == (0, 2)                  # Qwen3's MLP is Llama's code
    assert not hasattr(model.model.layers[0].mlp, "gate_proj")
    assert torch.allclose(_logits(model, ids), before, atol=1e-5)


def test_fusion_whose_probe_disagrees_is_undone(tiny_model_dir, monkeypatch: pytest.MonkeyPatch) -> None:
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()
    ids = torch.tensor([[5, 17, 42, 8]])
    before = _logits(model, ids)

    def swapped(self, x):                     # gate and up read the wrong way round
        up, gate = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(self.act_fn(gate) * up)

    monkeypatch.setattr(fused, "_FUSED_CLASSES", {})
    monkeypatch.setattr(fused, "_mlp_forward", swapped)
    result = fused.fuse(model)
    assert (result.attention, result.mlp) == (0, 0)
    assert "differed" in result.reason and "left unfused" in result.words()
    layer = model.model.layers[0]
    assert hasattr(layer.self_attn, "q_proj") and hasattr(layer.mlp, "gate_proj")
    assert not hasattr(layer.self_attn, "qkv_proj") and not hasattr(layer.mlp, "gate_up_proj")
    assert type(layer.mlp).__name__ == "LlamaMLP"
    assert torch.equal(_logits(model, ids), before)


def test_same_code_tells_a_copy_from_a_variant() -> None:
    from transformers.models.llama import modeling_llama
    from transformers.models.mistral import modeling_mistral
    from transformers.models.qwen3 import modeling_qwen3

    assert fused.same_code(modeling_llama.LlamaMLP.forward, modeling_mistral.MistralMLP.forward)
    assert not fused.same_code(modeling_llama.LlamaAttention.forward, modeling_qwen3.Qwen3Attention.forward)
