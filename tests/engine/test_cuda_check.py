"""The GPU check's verdict, read on any machine: one row per check its report allows, a mismatch fails the run
and a goal never does (the GPU run itself needs a lent GPU: ``python -m tests.benchmarks.cuda_check``)."""

from __future__ import annotations

from tests.benchmarks.cuda_check import check_table, checks


def report(compiled_same: bool = True, instruments: float = 1.004) -> dict:
    modes = {"dynamic": {"decode_tok_s": 100.0}, "static": {"decode_tok_s": 110.0, "same_tokens_as_dynamic": True},
             "compiled": {"decode_tok_s": 620.0, "same_tokens_as_dynamic": compiled_same}}
    return {"gpu": "a GPU", "torch": "2.13",
            "parity_bf16": {"kv_on_equal": True, "kv_on_tokens": 32, "kv_off_equal": True, "kv_off_tokens": 32},
            "kv_memory_bf16": {"tokens": 1024, "read_from_tensors": 23_592_960, "formula": 23_592_960,
                               "cuda_allocated_delta": 23_592_960},
            "decode_modes_bf16": modes, "instruments": {"bfloat16": instruments}}


EXPERIMENTS = {"offload": {"result": {"splits": [{"disk_layers": 0, "decode_tok_s": 90.0, "tokens_match": True},
                                                 {"disk_layers": 8, "decode_tok_s": 9.0, "tokens_match": True}],
                                      "kv_offload_tokens_match": True, "kv_offload_decode_tok_s": 60.0}}}


def test_a_report_that_agrees_everywhere_has_no_mismatch_and_its_goal_is_only_reported():
    rows = checks(report(), EXPERIMENTS)
    assert len(rows) == 11 and not any(r.ok is False for r in rows)
    [goal] = [r for r in rows if r.ok is None]
    assert goal.figure == "6.20x" and "5x eager" in goal.name
    assert check_table(rows).splitlines()[-1] == "11 of 11 rows ok or reported; no mismatch"


def test_compiled_tokens_that_differ_or_costly_instruments_are_mismatches():
    rows = checks(report(compiled_same=False, instruments=0.9), EXPERIMENTS)
    failed = [r.name for r in rows if r.ok is False]
    assert failed == ["bf16: compiled over the static cache, CUDA graphs: tokens vs the dynamic cache's",
                      "bfloat16: the instruments' ratio, session / generate() decode"]
    assert check_table(rows).splitlines()[-1] == "9 of 11 rows ok or reported; 2 MISMATCH"


def test_a_cache_allocation_past_the_allocators_rounding_is_a_mismatch():
    bad = report()
    bad["kv_memory_bf16"]["cuda_allocated_delta"] += 3 << 20
    rows = checks(bad, {})
    assert [r.name for r in rows if r.ok is False] == ["bf16: torch.cuda.memory_allocated growth vs the formula"]
