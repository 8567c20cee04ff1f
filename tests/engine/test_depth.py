"""The depth lesson on the tiny model: the cache filled to the context's end in steps, its bytes equal to the
formula at every depth, attention timed inside each step; and the chunked prefill it relies on: the same tokens as
one pass, stopped between two chunks."""

import os
import statistics
import subprocess
import sys
import threading

import pytest
import torch

from engine.facts import kvformula
from engine.facts.errors import ParameterError
from engine.facts.events import ExperimentFinished, RunFinished, TokenStep
from engine.facts.params import GenerationParams
from engine.lessons import depth
from engine.lessons.depth import DepthResult, DepthSettings
from engine.run.session import RunOptions, Session
from engine.run.workloads import filler_ids
from tests.lessons import collect


def test_depths_are_round_powers_of_two_below_the_context_filled_to_its_end():
    assert depth.depths(8192, 6, 8) == [256, 512, 1024, 2048, 4096, 8183]
    assert depth.depths(2048, 3, 8) == [512, 1024, 2039]
    assert depth.depths(256, 6, 8) == [16, 32, 64, 128, 247]          # none under 16
    assert depth.depths(24, 6, 8) == []                                 # no room for 16 positions and 8 steps


def test_each_depth_holds_the_formulas_bytes_and_spends_part_of_its_step_in_attention(tiny):
    events, finished = collect("depth", tiny, deepest=256, depths=3, steps=4)
    r: DepthResult = finished.result
    assert isinstance(finished, ExperimentFinished) and not r.incomplete
    assert [f.depth for f in r.figures] == [64, 128, 251]
    facts = Session(tiny).facts
    steps = [e for e in events if isinstance(e, TokenStep)]
    runs: list[list[float]] = []
    for e in steps:
        if e.step == 0:
            runs.append([])
        else:
            runs[-1].append(e.latency_ms)
    assert [len(run) for run in runs] == [4, 4, 4]
    for f, run in zip(r.figures, runs, strict=True):
        assert f.positions == f.depth + 4                   # the prompt, then 4 decoded tokens' keys and values
        assert f.kv_bytes == f.kv_formula_bytes == kvformula.predicted_kv_bytes(facts, f.positions)
        assert f.decode_ms == statistics.median(run)        # the median step, as the attention's is the median
        assert f.decode_ms > 0 and 0 < f.attention_ms < f.decode_ms
    assert r.full_context_bytes == kvformula.full_context_kv_bytes(facts)
    assert r.slowdown == pytest.approx(r.figures[-1].decode_ms / r.figures[0].decode_ms)
    table = depth.table([], r)
    assert "     251 |" in table and "KV held (measured)" in table
    assert max(max(e.kv_positions_per_layer) for e in steps) == 255     # the heatmap beside the curves: to the end


def test_a_depth_that_leaves_no_room_is_refused_before_any_compute(tiny):
    with pytest.raises(ParameterError, match="no depth of at least 16 positions"):
        depth.check(Session(tiny), DepthSettings(deepest=32, steps=32))


def test_a_chunked_prefill_gives_the_tokens_of_one_pass(tiny):
    session = Session(tiny)
    ids = filler_ids(session, 100)
    params = GenerationParams(max_new_tokens=6)
    tokens: dict[int, list[int]] = {0: [], 16: []}
    for chunk, out in tokens.items():
        result = session.run_ids(ids, params, lambda e, out=out: out.append(e.token_id)
                                 if isinstance(e, TokenStep) else None, options=RunOptions(prefill_chunk=chunk))
        assert isinstance(result, RunFinished) and result.summary.kv_tokens == 105
    assert len(tokens[0]) == 6 and tokens[16] == tokens[0]


def test_a_stop_during_a_chunked_prefill_takes_effect_before_the_next_chunk(tiny, monkeypatch):
    session = Session(tiny)
    cancel = threading.Event()
    passes: list[int] = []
    prefill = session.prefill

    def counted(sequence: torch.Tensor, *args, **kwargs):
        passes.append(sequence.shape[1])
        cancel.set()                                    # the stop key, pressed during the first chunk
        return prefill(sequence, *args, **kwargs)

    monkeypatch.setattr(session, "prefill", counted)
    result = session.run_ids(filler_ids(session, 200), GenerationParams(max_new_tokens=4), cancel=cancel,
                             options=RunOptions(prefill_chunk=32))
    assert passes == [32]
    assert isinstance(result, RunFinished) and result.reason == "stopped"


def test_sweep_depth_prints_its_table_from_the_cli(tiny_model_dir, cache_root):
    r = subprocess.run([sys.executable, "-m", "engine", "sweep", "depth", "--model", str(tiny_model_dir),
                        "--deepest", "128", "--depths", "2", "--steps", "2"], capture_output=True, text=True,
                       timeout=300, env={**os.environ, "KVSCOPE_CACHE_DIR": str(cache_root)})
    assert r.returncode == 0, r.stderr
    rows = [line for line in r.stdout.splitlines() if line.strip()[:1].isdigit()]
    assert [int(row.split("|")[0].replace(",", "")) for row in rows] == [64, 125]
    assert "slower at 125 positions than at 64 (measured)" in r.stdout
