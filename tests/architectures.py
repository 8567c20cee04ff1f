"""Tiny random models of the cache shapes KVScope must get right, saved as Hugging Face folders so tests go
through the real loading path: GQA, MQA two ways, an explicit head_dim, a Mistral-style sliding window on every
layer, Gemma2's alternating sliding and full layers, GPT-2, hybrids with state-space or linear-attention layers,
latent and compressed caches, shared KV, and models KVScope must refuse with a message (Mamba: no attention cache;
MiniMax: a cache class of its own; T5: encoder-decoder)."""

from __future__ import annotations

from pathlib import Path

WINDOW = 16                 # sliding layers: short, so a test runs well past the window
CONTEXT = 64                # max positions: short, so a full-context forward is cheap

# Multi-head latent attention (DeepSeek-V2/V3): a compressed KV latent of kv_lora_rank and one rope key of
# qk_rope_head_dim per position, shared by all heads; a dense first layer and a small MoE after it.
MLA = dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
           num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
           first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16,
           v_head_dim=16, n_group=1, topk_group=1)
# name -> (config class, model class, config keywords, what the cache must hold per layer)
SHAPES: dict[str, tuple[str, str, dict]] = {
    "llama-gqa": ("LlamaConfig", "LlamaForCausalLM", dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)),
    "llama-1kv": ("LlamaConfig", "LlamaForCausalLM", dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1)),
    "falcon-mqa": ("FalconConfig", "FalconForCausalLM", dict(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, multi_query=True, new_decoder_architecture=False)),
    "qwen3-head-dim": ("Qwen3Config", "Qwen3ForCausalLM", dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32)),
    "mistral-sliding": ("MistralConfig", "MistralForCausalLM", dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        sliding_window=WINDOW)),
    "gemma2-alternating": ("Gemma2Config", "Gemma2ForCausalLM", dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, sliding_window=WINDOW)),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", dict(n_embd=64, n_layer=2, n_head=4)),
    "jamba-hybrid": ("JambaConfig", "JambaForCausalLM", dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1, num_experts=2,
        mamba_d_state=8, mamba_expand=2)),
    "mamba": ("MambaConfig", "MambaForCausalLM", dict(hidden_size=64, num_hidden_layers=2, state_size=8)),
    # MiniMax: lightning-attention layers whose state its own cache class keeps (refused, saying so)
    "minimax": ("MiniMaxConfig", "MiniMaxForCausalLM", dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, num_local_experts=2, num_experts_per_tok=1, block_size=16)),
    "deepseek-v3-mla": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(MLA)),
    "deepseek-v32-indexer": ("DeepseekV32Config", "DeepseekV32ForCausalLM",
                             dict(MLA, index_head_dim=32, index_n_heads=2, index_topk=8)),
    "falcon-h1-combined": ("FalconH1Config", "FalconH1ForCausalLM", dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, mamba_d_state=8, mamba_n_heads=4, mamba_d_head=16, mamba_d_ssm=64, mamba_n_groups=1,
        mamba_expand=1)),
    # MPT names its context max_seq_len (no max_position_embeddings)
    "mpt": ("MptConfig", "MptForCausalLM", dict(d_model=64, n_heads=4, n_layers=2, expansion_ratio=2)),
    # Falcon's new decoder: 2 KV heads in the config (num_kv_heads, not num_key_value_heads), multi_query ignored
    "falcon-new-decoder": ("FalconConfig", "FalconForCausalLM", dict(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_kv_heads=2, new_decoder_architecture=True)),
    # RecurrentGemma: two recurrent layers whose state lives on their modules, outside the cache object, and one
    # local-attention layer; no maximum context declared
    "recurrentgemma": ("RecurrentGemmaConfig", "RecurrentGemmaForCausalLM", dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=1,
        head_dim=16, lru_width=64, attention_window_size=WINDOW, block_types=["recurrent", "recurrent", "attention"])),
    # DeepSeek-V4: sliding shared-KV attention (keys and values one tensor) on every layer, and layers that condense
    # the context into compressed entries, one every 4 (with an indexer) or every 8 positions, with buffers
    "deepseek-v4-compressed": ("DeepseekV4Config", "DeepseekV4ForCausalLM", dict(
        hidden_size=64, moe_intermediate_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=1,
        head_dim=32, q_lora_rank=32, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
        sliding_window=WINDOW, o_groups=2, o_lora_rank=16, index_n_heads=2, index_head_dim=16, index_topk=4,
        hc_mult=2, layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                                "compressed_sparse_attention"],
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8})),
    # Qwen3-Next: three gated-DeltaNet layers (a fixed state, no KV) to one full-attention layer, experts in all
    "qwen3-next-hybrid": ("Qwen3NextConfig", "Qwen3NextForCausalLM", dict(
        hidden_size=64, intermediate_size=128, moe_intermediate_size=32, shared_expert_intermediate_size=32,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4,
        num_experts_per_tok=2, linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
        linear_value_head_dim=16)),
    # Bailing hybrid (Ling/Ring linear): lightning-attention layers with a fixed state between MLA layers
    "bailing-hybrid": ("BailingHybridConfig", "BailingHybridForCausalLM", dict(
        hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=16,
        v_head_dim=16, head_dim=16, num_experts=4, num_experts_per_token=2, n_group=1, topk_group=1, layer_group_size=2,
        linear_head_dim=16, linear_num_heads=4, first_k_dense_replace=1)),
    # Gemma 3n: a per-layer MLP width, and its last layers reuse the keys and values of earlier ones
    "gemma3n-shared-kv": ("Gemma3nTextConfig", "Gemma3nForCausalLM", dict(
        hidden_size=64, intermediate_size=[128, 96, 128, 96], num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, sliding_window=WINDOW, num_kv_shared_layers=2, laurel_rank=8,
        hidden_size_per_layer_input=16, altup_num_inputs=2,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"])),
}
CONTEXT_KEY = {"gpt2": "n_positions", "mpt": "max_seq_len", "mamba": None, "recurrentgemma": None}
REFUSED = ("mamba", "minimax")
# (kind, kv_heads, k_dim, capacity) per layer, as the cache must report it
EXPECTED = {
    "llama-gqa": [("full", 2, 16, None)] * 2,
    "llama-1kv": [("full", 1, 16, None)] * 2,
    "falcon-mqa": [("full", 1, 16, None)] * 2,
    "qwen3-head-dim": [("full", 2, 32, None)] * 2,
    "mistral-sliding": [("sliding", 2, 16, WINDOW - 1)] * 2,
    "gemma2-alternating": [("sliding", 2, 16, WINDOW - 1), ("full", 2, 16, None)] * 2,
    "gpt2": [("full", 4, 16, None)] * 2,
    "jamba-hybrid": [("state", 0, 0, None), ("full", 2, 16, None)] * 2,
    "deepseek-v3-mla": [("latent", 1, 16, None)] * 2,
    "deepseek-v32-indexer": [("latent", 1, 16, None)] * 2,
    "falcon-h1-combined": [("full", 2, 16, None)] * 2,
    "mpt": [("full", 4, 16, None)] * 2,
    "falcon-new-decoder": [("full", 2, 16, None)] * 2,
    "deepseek-v4-compressed": [("sliding", 1, 32, WINDOW - 1)] * 4,
    "qwen3-next-hybrid": [("state", 0, 0, None)] * 3 + [("full", 2, 16, None)],
    "bailing-hybrid": [("state", 0, 0, None), ("latent", 1, 16, None)] * 2,
    "gemma3n-shared-kv": [("sliding", 2, 16, WINDOW - 1), ("full", 2, 16, None), ("none", 0, 0, None),
                          ("none", 0, 0, None)],
}


def build(name: str, folder: Path) -> Path:
    import torch
    import transformers

    from tests.tiny_model import build_tokenizer

    config_class, model_class, keywords = SHAPES[name]
    tokenizer = build_tokenizer()
    keywords = dict(keywords)
    key = CONTEXT_KEY.get(name, "max_position_embeddings")
    if key is not None:
        keywords[key] = CONTEXT
    if name == "gemma3n-shared-kv":
        keywords["vocab_size_per_layer_input"] = len(tokenizer)
    config = getattr(transformers, config_class)(
        vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, **keywords)
    torch.manual_seed(0)
    model = getattr(transformers, model_class)(config).eval()
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def build_encoder_decoder(folder: Path) -> Path:
    import transformers

    from tests.tiny_model import build_tokenizer

    tokenizer = build_tokenizer()
    config = transformers.T5Config(vocab_size=len(tokenizer), d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4,
                                   decoder_start_token_id=tokenizer.pad_token_id, pad_token_id=tokenizer.pad_token_id)
    transformers.T5ForConditionalGeneration(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
