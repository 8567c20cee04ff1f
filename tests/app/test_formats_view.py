"""The formats lesson's words: a ceiling only where a quiet measurement gave one, and each candidate kernel's
bandwidth over the weights beside the copy."""

from __future__ import annotations

from app.lessons.formats import format_line

MEASURED = {"bytes_per_token": 270_000_000.0, "decode_tok_s": 43.6, "prefill_tok_s": 2228.0, "perplexity": 9.51,
            "diverges_at": 12.0}


def test_a_format_measured_on_a_busy_machine_shows_no_ceiling_and_says_why():
    line = format_line("bfloat16", MEASURED)
    assert "<b>43.6 tok/s</b> (no ceiling: the machine was busy when its bandwidth was measured)" in line
    assert "ceiling," not in line


def test_a_format_with_a_quiet_ceiling_and_timed_kernels_names_both():
    values = {**MEASURED, "decode_ceiling_tok_s": 90.6, "bandwidth_gb_s": 24.5, "products_gb_s_onednn": 16.6,
              "products_gb_s_aten": 11.4, "products_chosen_onednn": 1.0}
    line = format_line("bfloat16", values)
    assert "<b>43.6 tok/s</b> of a 91 tok/s ceiling" in line
    assert line.endswith("; a step&#x27;s products through oneDNN 16.6 GB/s (chosen), ATen 11.4 GB/s "
                         "(achieved) beside a 24.5 GB/s copy (measured)")
