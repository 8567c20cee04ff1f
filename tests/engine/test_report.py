from engine.facts.events import RunSummary
from engine.facts.report import report, timing_lines
from tests.engine.test_kvcache import smol_facts


def test_llama_cpp_vocabulary_and_arithmetic():
    s = RunSummary(prompt_tokens=38, generated_tokens=64, decode_runs=63, prefill_ms=190.0, decode_ms=6300.0,
                   total_ms=6600.0, ttft_ms=200.0, kv_tokens=101, kv_bytes=101 * 46_080)
    lines = timing_lines(s)
    assert lines[0] == ("prompt eval time =     190.00 ms /    38 tokens (    5.00 ms per token,   "
                        "200.00 tokens per second)")
    assert lines[1] == ("       eval time =    6300.00 ms /    63 runs   (  100.00 ms per token,    "
                        "10.00 tokens per second)")
    assert lines[2] == "      total time =    6600.00 ms /   101 tokens"
    text = report(smol_facts(), s)
    assert ("KV cache: 30 layers x 3 KV heads x 64 dims x 2 (K,V) x 4 B = 46,080 B/token; after 101 positions the "
            "tensors hold 4.44 MiB (measured, = the formula); at full context (8,192-position window, 8,191 positions "
            "cached) = 360 MiB (computed)"
            ) in text


def test_a_disagreeing_measurement_is_reported_not_hidden():
    s = RunSummary(prompt_tokens=10, kv_tokens=10, kv_bytes=12345)
    assert "hold 12.1 KiB (measured, but the formula says 450 KiB)" in report(smol_facts(), s)


def test_zero_runs_do_not_divide_by_zero():
    assert "0.00 tokens per second" in timing_lines(RunSummary(prompt_tokens=3, prefill_ms=1.0))[1]
