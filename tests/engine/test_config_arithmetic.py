"""The arithmetic a folder holding only ``config.json`` is enough for, on the real configs of 2025 models no test
can build at size: every expert counted in the weights (so a memory-budget verdict is not off by 20x), only the
attention layers of a hybrid counted in the cache, and the context the config itself declares."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine import cli
from engine.facts import config_facts, kvformula

# Published configs (the fields the arithmetic reads), with the parameter count each model card states.
PUBLISHED = {
    "DeepSeek-V3": ({
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 7168,
        "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
        "num_attention_heads": 128, "num_key_value_heads": 128, "n_routed_experts": 256, "n_shared_experts": 1,
        "num_experts_per_tok": 8, "first_k_dense_replace": 3, "moe_layer_freq": 1, "kv_lora_rank": 512,
        "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
        "vocab_size": 129280, "max_position_embeddings": 163840, "tie_word_embeddings": False, "n_group": 8,
        "topk_group": 4}, 671e9),
    "Qwen3-30B-A3B": ({
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048,
        "intermediate_size": 6144, "moe_intermediate_size": 768, "num_hidden_layers": 48, "num_attention_heads": 32,
        "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8,
        "decoder_sparse_step": 1, "mlp_only_layers": [], "vocab_size": 151936, "max_position_embeddings": 40960,
        "tie_word_embeddings": False}, 30.5e9),
    "gpt-oss-20b": ({
        "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "hidden_size": 2880,
        "intermediate_size": 2880, "num_hidden_layers": 24, "num_attention_heads": 64, "num_key_value_heads": 8,
        "head_dim": 64, "num_local_experts": 32, "num_experts_per_tok": 4, "vocab_size": 201088,
        "sliding_window": 128, "layer_types": ["sliding_attention", "full_attention"] * 12,
        "max_position_embeddings": 131072, "tie_word_embeddings": False}, 20.9e9),
    "Qwen3-Next-80B-A3B": ({
        "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "hidden_size": 2048,
        "intermediate_size": 5120, "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
        "num_hidden_layers": 48, "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256,
        "num_experts": 512, "num_experts_per_tok": 10, "decoder_sparse_step": 1, "full_attention_interval": 4,
        "linear_num_value_heads": 32, "linear_num_key_heads": 16, "linear_key_head_dim": 128,
        "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "vocab_size": 151936,
        "max_position_embeddings": 262144, "tie_word_embeddings": False}, 80e9),
}


def config_folder(tmp_path: Path, cfg: dict) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(cfg), encoding="utf-8")
    return tmp_path


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_parameter_estimate_is_within_two_percent_of_the_published_count(name, tmp_path):
    cfg, published = PUBLISHED[name]
    estimate = config_facts.sizes(config_facts.read(config_folder(tmp_path, cfg))).parameters()
    assert abs(estimate - published) / published < 0.02, f"{estimate / 1e9:.2f}B vs {published / 1e9:.1f}B"


def test_qwen3_next_config_counts_only_its_twelve_attention_layers_in_the_cache(tmp_path):
    folder = config_folder(tmp_path, PUBLISHED["Qwen3-Next-80B-A3B"][0])
    facts = config_facts.model_facts(folder, config_facts.read(folder), "bfloat16")
    assert [layer.kind for layer in facts.kv_layers].count("full") == 12
    assert kvformula.bytes_per_token(facts) == 2 * 12 * 2 * 256 * 2           # 24,576 B, not 98,304
    assert kvformula.full_context_kv_bytes(facts) == 24_576 * 262_143           # 6.00 GiB, not 24.0


def test_bailing_config_declares_its_context_as_model_max_length(tmp_path):
    cfg = {"architectures": ["BailingHybridForCausalLM"], "model_type": "bailing_hybrid", "hidden_size": 64,
           "intermediate_size": 128, "moe_intermediate_size": 32, "num_hidden_layers": 4, "num_attention_heads": 4,
           "num_key_value_heads": 4, "kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16,
           "v_head_dim": 16, "head_dim": 16, "num_experts": 4, "num_experts_per_token": 2, "layer_group_size": 2,
           "linear_head_dim": 16, "linear_num_heads": 4, "first_k_dense_replace": 1, "vocab_size": 256,
           "model_max_length": 131072}
    folder = config_folder(tmp_path, cfg)
    facts = config_facts.model_facts(folder, config_facts.read(folder), "bfloat16")
    assert facts.context_declared and facts.max_context == 131072
    assert kvformula.full_context_positions(facts) == 131071


def test_costmodel_memory_budget_counts_every_expert(tmp_path, capsys):
    folder = config_folder(tmp_path, PUBLISHED["Qwen3-30B-A3B"][0])
    assert cli.main(["costmodel", "--model", str(folder), "--memory-budget", "4GiB", "--context", "4096"]) == 0
    out = capsys.readouterr().out
    assert "about 30.53B parameters" in out            # every expert: counting one would say 3.34B and "fits"
    budget_lines = [line for line in out.splitlines() if line.startswith("memory budget")]
    assert budget_lines and all(line.endswith("does not fit") for line in budget_lines)


@pytest.mark.parametrize("token", ["NaN", "Infinity", "-Infinity"])
def test_a_config_with_a_number_that_is_not_one_is_refused_naming_the_file(tmp_path, token):
    """Python's JSON reader takes NaN; a model loaded with a NaN rope_theta ran and its scores were not numbers,
    which the run then blamed on the weights or the dtype."""
    from engine.facts import config_facts
    from engine.facts.errors import ModelSourceError

    (tmp_path / "config.json").write_text('{"model_type": "llama", "rope_theta": %s}' % token)
    with pytest.raises(ModelSourceError, match=f"config.json holds {token} where a number belongs"):
        config_facts.read(tmp_path)


@pytest.mark.parametrize("field, value", [("rms_norm_eps", '"tiny"'), ("bos_token_id", "0.5"),
                                          ("torch_dtype", '"bflo!t16' + "9" * 5000 + '"')])
def test_a_value_transformers_refuses_in_a_config_is_one_short_line(tmp_path, field, value):
    """transformers' typed configs raise huggingface_hub's validation errors (not ValueError) and look a dtype
    name up on torch (AttributeError): each was a traceback; the value quoted back is cut short."""
    from engine.facts.errors import ModelSourceError
    from engine.model import models

    (tmp_path / "config.json").write_text('{"model_type": "llama", "num_hidden_layers": 2, "%s": %s}'
                                          % (field, value))
    with pytest.raises(ModelSourceError) as refused:
        models._read_config(str(tmp_path), trust_remote_code=False)
    message = str(refused.value)
    assert "config.json holds a value transformers refuses" in message and "\n" not in message
    assert len(message) < 600
