from engine import kvcache
from engine.events import ModelFacts


def smol_facts(**changes) -> ModelFacts:
    base = dict(name="smol", source="embedded", architecture="LlamaForCausalLM", num_layers=30, num_heads=9,
                num_kv_heads=3, head_dim=64, hidden_size=576, vocab_size=49152, max_context=8192,
                dtype="float32", dtype_bytes=4, num_params=134515008, device="cpu", layer_devices=["cpu"] * 30,
                layer_types=["full_attention"] * 30)
    base.update(changes)
    return ModelFacts(**base)


def test_formula_matches_the_issue_example():
    m = smol_facts()
    assert kvcache.bytes_per_token(m) == 46_080
    assert kvcache.formula_text(m) == "30 layers x 3 KV heads x 64 dims x 2 (K,V) x 4 B = 46,080 B/token"
    assert kvcache.full_context_kv_bytes(m) == 46_080 * 8192
    assert kvcache.format_bytes(kvcache.full_context_kv_bytes(m)) == "360 MiB"
    assert kvcache.format_bytes(46_080 * 100) == "4.39 MiB"


def test_half_precision_halves_and_batch_multiplies():
    assert kvcache.bytes_per_token(smol_facts(dtype="bfloat16", dtype_bytes=2)) == 23_040
    assert kvcache.predicted_kv_bytes(smol_facts(), 10, batch=4) == 4 * 10 * 46_080


def test_sliding_window_layers_hold_only_the_window():
    m = smol_facts(num_layers=2, layer_devices=["cpu"] * 2, layer_types=["sliding_attention", "full_attention"],
                   sliding_window=16)
    per = kvcache.bytes_per_token_per_layer(m)
    assert kvcache.predicted_kv_bytes_per_layer(m, 100) == [16 * per, 100 * per]
    assert kvcache.predicted_kv_bytes_per_layer(m, 10) == [10 * per, 10 * per]


def test_format_bytes_uses_binary_units():
    assert kvcache.format_bytes(512) == "512 B"
    assert kvcache.format_bytes(2048) == "2.00 KiB"
    assert kvcache.format_bytes(3 * 1024**3) == "3.00 GiB"


def test_no_cache_holds_nothing():
    assert kvcache.kv_bytes_per_layer(None, 3) == [[0, 0]] * 3
    assert kvcache.kv_tokens_held(None) == 0
