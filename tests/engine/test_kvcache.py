"""The formula over per-layer facts (no torch): full, sliding and state layers, GQA/MQA wording, byte units."""

from engine.facts import kvformula
from engine.facts.events import KVLayer, ModelFacts
from engine.model import kvcache

SMOL_LAYER = KVLayer("full", kv_heads=3, k_dim=64, v_dim=64, dtype_bytes=4)


def smol_facts(layers: list[KVLayer] | None = None, **changes) -> ModelFacts:
    """SmolLM2-135M's facts, or another model's with ``layers`` and ``changes``."""
    layers = layers if layers is not None else [SMOL_LAYER] * 30
    base = dict(name="smol", source="embedded", architecture="LlamaForCausalLM", num_layers=len(layers),
                num_heads=9, head_dim=64, hidden_size=576, vocab_size=49152, max_context=8192, dtype="float32",
                dtype_bytes=4, num_params=134515008, device="cpu", layer_devices=["cpu"] * len(layers),
                kv_layers=layers)
    base.update(changes)
    return ModelFacts(**base)


def test_formula_matches_the_issue_example():
    m = smol_facts()
    assert kvformula.bytes_per_token(m) == 46_080
    assert kvformula.formula_text(m) == "30 layers x 3 KV heads x 64 dims x 2 (K,V) x 4 B = 46,080 B/token"
    assert kvformula.full_context_positions(m) == 8191          # the last token is produced, never fed back
    assert kvformula.full_context_kv_bytes(m) == 46_080 * 8191
    assert kvformula.format_bytes(kvformula.full_context_kv_bytes(m)) == "360 MiB"
    assert kvformula.format_bytes(46_080 * 100) == "4.39 MiB"


def test_half_precision_halves_and_batch_multiplies():
    half = KVLayer("full", kv_heads=3, k_dim=64, v_dim=64, dtype_bytes=2)
    assert kvformula.bytes_per_token(smol_facts([half] * 30)) == 23_040
    assert kvformula.predicted_kv_bytes(smol_facts(), 10, batch=4) == 4 * 10 * 46_080


def test_a_sliding_layer_holds_its_measured_capacity_and_a_full_one_everything():
    sliding = KVLayer("sliding", kv_heads=2, k_dim=16, v_dim=16, dtype_bytes=4, capacity=15)
    full = KVLayer("full", kv_heads=2, k_dim=16, v_dim=16, dtype_bytes=4)
    m = smol_facts([sliding, full], max_context=256)
    per = kvformula.bytes_per_position(full)
    assert per == 256
    assert kvformula.predicted_kv_bytes_per_layer(m, 100) == [15 * per, 100 * per]
    assert kvformula.predicted_kv_bytes_per_layer(m, 10) == [10 * per, 10 * per]
    assert kvformula.full_context_kv_bytes(m) == (15 + 255) * per
    assert "1 of 2 layers slide and hold at most 15 positions" in kvformula.formula_text(m)


def test_state_layers_hold_no_positions_and_are_named():
    attention = KVLayer("full", kv_heads=2, k_dim=16, v_dim=16, dtype_bytes=4)
    state = KVLayer("state", state_bytes=6144)
    m = smol_facts([state, attention, state, attention])
    assert kvformula.predicted_kv_bytes_per_layer(m, 10) == [0, 2560, 0, 2560]
    assert kvformula.formula_text(m) == ("2 layers x 2 KV heads x 16 dims x 2 (K,V) x 4 B = 512 B/token; 2 of 4 layers "
                                       "are state-space layers with a fixed 12.0 KiB state instead of a KV cache")
    assert kvformula.batching_refusal(m) is not None
    assert kvformula.batching_refusal(smol_facts()) is None


def test_different_k_and_v_head_dims_are_written_out():
    layer = KVLayer("full", kv_heads=4, k_dim=192, v_dim=128, dtype_bytes=2)
    m = smol_facts([layer] * 2)
    assert kvformula.bytes_per_token(m) == 2 * 4 * (192 + 128) * 2
    assert "(192 K + 128 V dims)" in kvformula.formula_text(m)


def test_heads_text_says_gqa_mqa_or_none():
    assert "9 query heads share 3 KV heads (GQA, 3 per KV head)" in kvformula.heads_text(smol_facts())
    mqa = KVLayer("full", kv_heads=1, k_dim=16, v_dim=16, dtype_bytes=4)
    assert "share 1 KV head (MQA" in kvformula.heads_text(smol_facts([mqa] * 2, num_heads=4))
    mha = KVLayer("full", kv_heads=4, k_dim=16, v_dim=16, dtype_bytes=4)
    assert kvformula.heads_text(smol_facts([mha] * 2, num_heads=4)).endswith("(no GQA)")


def test_format_bytes_uses_binary_units():
    assert kvformula.format_bytes(512) == "512 B"
    assert kvformula.format_bytes(2048) == "2.00 KiB"
    assert kvformula.format_bytes(3 * 1024**3) == "3.00 GiB"


def test_no_cache_holds_nothing():
    assert kvcache.held_per_layer(None, 3) == ([[0, 0]] * 3, [0] * 3)
    assert kvcache.positions_seen(None) == 0


def test_a_static_caches_layout_is_read_once_and_reads_as_a_fresh_look_does(tiny, monkeypatch):
    import torch

    model, layers = tiny.model, tiny.facts.num_layers
    cache = kvcache.new_cache(model, 32)
    fresh = []
    with torch.inference_mode():
        kvcache.forward(model, torch.tensor([[5, 17, 42, 8]]), cache)
        for position in range(4, 8):
            kvcache.forward(model, torch.tensor([[7]]), cache, positions=torch.tensor([[position]]))
            assert kvcache._static_layout(cache) is not None              # read once, kept for the cache
            held = kvcache.held_per_layer(cache, layers)
            storage = kvcache.storage_per_layer(cache, held[0])
            with monkeypatch.context() as m:                              # the same, read afresh
                m.setattr(kvcache, "_static_layout", lambda _cache: None)
                fresh_held = kvcache.held_per_layer(cache, layers)
                fresh.append((fresh_held, kvcache.storage_per_layer(cache, fresh_held[0])))
            assert (held, storage) == fresh[-1]
    assert [positions for (_sizes, positions), _storage in fresh] == [[p + 1] * layers for p in range(4, 8)]
    assert kvcache._static_layout(kvcache.new_cache(model)) is None            # a dynamic cache: read every time
