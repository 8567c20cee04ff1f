"""Paged KV through transformers' continuous batching: the adapter fails loudly when the private fields it
reads move, block tables add up (blocks per request, shared prefixes counted by reference, nothing held at the
end), tokens equal solo greedy runs, the model's attention is given back, and the experiment replays."""

from __future__ import annotations

import pytest

from engine.facts.errors import ParameterError
from engine.facts.events import ExperimentFinished
from engine.lessons import paged as paged_lesson
from engine.model.models import load
from engine.output.trace import read_trace, write_trace
from engine.run import paged_serving
from engine.run.batch_generate import generate_batch
from engine.run.session import Session
from engine.serve.block_events import BlockTable
from tests.architectures import build
from tests.lessons import collect
from tests.traces import first_row, refused_with, rows_of

PAGE = 16


def requests_for(session: Session, n: int = 4, new: int = 6, every: int = 2) -> list[paged_serving.PagedRequest]:
    return [paged_serving.PagedRequest(i, paged_lesson._encode(session, paged_lesson.SYSTEM, q), new, i * every)
            for i, q in enumerate(paged_lesson.QUESTIONS[:n])]


def test_the_adapter_names_the_private_field_that_moved(monkeypatch):
    from transformers.generation.continuous_batching import continuous_api

    paged_serving.check_transformers()
    monkeypatch.delattr(continuous_api.ContinuousBatchingManager, "_generation_loop_body")
    with pytest.raises(RuntimeError, match="ContinuousBatchingManager._generation_loop_body is gone"):
        paged_serving.check_transformers()


@pytest.fixture(scope="module")
def shared_run(tiny):
    session = Session(tiny)
    batch, snaps = requests_for(session), []
    pool = paged_serving.Pool(PAGE, 64, sharing=True)
    assert paged_serving.serve_paged(tiny.model, batch, pool, on_step=snaps.append)
    return session, batch, snaps


def test_tokens_equal_each_request_alone(tiny, shared_run):
    _session, batch, _snaps = shared_run
    solo = [generate_batch(tiny.model, [r.ids], r.new_tokens, 0, tiny.device).tokens[0] for r in batch]
    assert [r.tokens for r in batch] == solo
    assert all(r.arrival_ms <= r.admitted_ms <= r.first_token_ms <= r.done_ms for r in batch)


def test_block_tables_add_up_and_the_shared_prefix_is_counted_by_reference(shared_run):
    _session, batch, snaps = shared_run
    prefix_blocks = paged_serving.kvformula.common_prefix(batch[0].ids, batch[1].ids) // PAGE
    assert prefix_blocks >= 1
    for snap in snaps:
        for table, held in zip(snap.tables, snap.positions):
            assert len(table) == -(-max(held, 1) // PAGE) or len(table) == -(-(held + 1) // PAGE)
        first = {t[0] for t in snap.tables}
        if len(snap.running) >= 2:
            assert len(first) == 1 and snap.shared[next(iter(first))] == len(snap.running)
        held = {b for t in snap.tables for b in t}
        assert len(held) + len(snap.cached) + snap.free == snap.total
    assert snaps[-1].running == [] and len(snaps[-1].cached) >= prefix_blocks        # kept for a later request


def test_without_sharing_no_block_is_shared_and_more_are_held(tiny, shared_run):
    session, shared_batch, shared_snaps = shared_run
    batch, snaps = requests_for(session), []
    paged_serving.serve_paged(tiny.model, batch, paged_serving.Pool(PAGE, 64, sharing=False), on_step=snaps.append)
    assert all(not s.shared for s in snaps)
    peak = max(len({b for t in s.tables for b in t}) for s in snaps)
    peak_shared = max(len({b for t in s.tables for b in t}) for s in shared_snaps)
    assert peak > peak_shared
    assert [r.tokens for r in batch] == [r.tokens for r in shared_batch]


def test_the_models_attention_is_given_back(tiny):
    session = Session(tiny)
    session.attention_capture()                              # switches the model to the capturing sdpa
    before = tiny.model.config._attn_implementation
    paged_serving.serve_paged(tiny.model, requests_for(session, n=2, new=2), paged_serving.Pool(PAGE, 32, sharing=True))
    assert tiny.model.config._attn_implementation == before == "kvscope_sdpa"


def test_a_sliding_window_model_is_refused_with_the_reason(tmp_path):
    loaded = load(str(build("mistral-sliding", tmp_path / "m")), device="cpu", dtype="float32")
    with pytest.raises(ParameterError, match="only full-attention layers"):
        collect("paged", loaded)


@pytest.fixture(scope="module")
def experiment(tiny) -> list:
    events, _finished = collect("paged", tiny, requests=4, new_tokens=6, arrive_every=2)
    return events


def test_the_experiment_measures_sharing_against_no_sharing_and_both_schedulers(experiment):
    end = experiment[-1]
    assert isinstance(end, ExperimentFinished) and end.reason == "done"
    r = end.result
    assert r.peak_blocks_shared < r.peak_blocks_unshared
    assert r.peak_bytes_shared == r.peak_blocks_shared * r.bytes_per_block
    assert r.contiguous_bytes_at_peak > r.used_bytes_at_peak
    assert r.tokens_match_solo and r.same_tokens_as_ours and r.same_tokens_with_and_without_sharing
    assert r.ours_tok_s > 0 and r.transformers_tok_s > 0
    tables = [e for e in experiment if isinstance(e, BlockTable)]
    assert tables and max(len({b for t in e.tables for b in t}) for e in tables) == r.peak_blocks_shared


def test_the_experiment_replays_and_a_hostile_block_table_is_refused(experiment, tmp_path):
    path = write_trace(tmp_path / "p.jsonl", experiment)
    assert [e for e in read_trace(path) if isinstance(e, BlockTable)] == \
        [e for e in experiment if isinstance(e, BlockTable)]
    rows = rows_of(experiment, tmp_path / "valid.jsonl")
    index = first_row(rows, "BlockTable", lambda r: r["shared_blocks"])
    for field, value, fragment in (("positions", [10**6] * len(rows[index]["running"]), "positions must fit"),
                                   ("shared_blocks", [10**6] * len(rows[index]["shared_blocks"]),
                                    "shared_blocks must be blocks"),
                                   ("running", [0, 0], "distinct request numbers")):
        refused_with(path, rows, index, {field: value}, fragment)


def test_perfetto_counts_blocks_held_shared_and_free_at_every_step(experiment):
    from engine.output.perfetto import trace_events
    from tests.engine.test_perfetto import check_trace_event_format

    out = check_trace_event_format({"traceEvents": trace_events(experiment)})
    tables = [e for e in experiment if isinstance(e, BlockTable)]
    counters = [e for e in out if e["ph"] == "C" and e["name"] == "paged KV blocks"]
    assert len(counters) == len(tables) > 0
    assert [c["args"]["free"] for c in counters] == [t.free_blocks for t in tables]
    assert [c["args"]["held"] for c in counters] == [len({b for row in t.tables for b in row}) for t in tables]
    assert max(c["args"]["shared"] for c in counters) > 0                # the system prompt's blocks
