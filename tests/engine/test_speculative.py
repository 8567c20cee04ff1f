"""Speculative decoding: the verify-and-roll-back loop gives exactly plain greedy's tokens whatever the guesses
(all right, all wrong, from prompt lookup, from a draft model), counts passes and kept guesses correctly, is
refused where the cache cannot roll back, and its experiment saves and replays through the schema."""

from __future__ import annotations

import pytest

from engine.facts.errors import ParameterError
from engine.facts.events import ExperimentFinished
from engine.facts.params import GenerationParams
from engine.lessons.speculative import DraftPass
from engine.model.models import load
from engine.output.trace import read_trace, write_trace
from engine.run import speculative_decode as sp
from engine.run.session import Session
from tests.architectures import build
from tests.lessons import collect
from tests.traces import first_row, refused_with, rows_of

PROMPT = "hello world hello world hello world"
NEW = 24


class Oracle:
    """Guesses from a known answer: right when ``truthful``, always wrong (the next id) when not."""

    name = "oracle"

    def __init__(self, answer: list[int], prompt_len: int, truthful: bool) -> None:
        self.answer, self.prompt_len, self.truthful = answer, prompt_len, truthful

    def propose(self, ids: list[int], k: int, cancel=None) -> list[int]:
        done = len(ids) - self.prompt_len
        right = self.answer[done:done + k]
        return right if self.truthful else [(t + 1) % 500 for t in right]


@pytest.fixture(scope="module")
def session(tiny) -> Session:
    return Session(tiny)


@pytest.fixture(scope="module")
def plain(session) -> tuple[list[int], sp.Decoded]:
    ids = session.encode(PROMPT)
    return ids, sp.decode(session, ids, NEW, None, 0)


def test_the_plain_loop_is_the_sessions_greedy_decode(session, plain):
    ids, result = plain
    run = session.run(PROMPT, GenerationParams(max_new_tokens=NEW))
    assert result.tokens == run.summary.token_ids
    assert len(result.passes) == len(result.tokens) - 1 and result.drafted == 0


@pytest.mark.parametrize("k", [1, 3, 8])
def test_right_guesses_are_all_kept_and_save_passes(session, plain, k):
    ids, reference = plain
    result = sp.decode(session, ids, NEW, Oracle(reference.tokens, len(ids), True), k)
    assert result.tokens == reference.tokens
    assert result.accepted == result.drafted > 0
    assert len(result.passes) == -(-(len(reference.tokens) - 1) // (k + 1))     # ceil((n - 1) / (k + 1))


def test_wrong_guesses_are_all_rejected_and_rolled_back(session, plain):
    ids, reference = plain
    result = sp.decode(session, ids, NEW, Oracle(reference.tokens, len(ids), False), 4)
    assert result.tokens == reference.tokens                  # the cache lost every rejected guess
    assert result.accepted == 0 and len(result.passes) == len(reference.tokens) - 1


def test_prompt_lookup_and_a_draft_model_give_plain_greedys_tokens(session, plain, tiny):
    ids, reference = plain
    lookup = sp.decode(session, ids, NEW, sp.PromptLookup(session.eos_ids), 5)
    draft = sp.decode(session, ids, NEW, sp.DraftModel(tiny, tiny.tokenizer.get_vocab(), "itself"), 3)
    for result in (lookup, draft):
        assert result.tokens == reference.tokens
        kept = sum(p.accepted + 1 for p in result.passes)
        assert kept >= len(result.tokens) - 1 and all(p.accepted <= len(p.drafted) for p in result.passes)
    assert draft.accepted == draft.drafted                      # the same weights guess the same tokens


def test_a_draft_model_with_another_tokenizer_is_refused(tiny):
    other = dict(tiny.tokenizer.get_vocab())
    other["<an extra token>"] = len(other)
    with pytest.raises(ParameterError, match="different tokenizer"):
        sp.DraftModel(tiny, other)


def test_a_sliding_window_model_is_refused_before_any_compute(tmp_path):
    loaded = load(str(build("mistral-sliding", tmp_path / "m")), device="cpu", dtype="float32")
    with pytest.raises(ParameterError, match="sliding-window layers"):
        collect("speculative", loaded, prompt=PROMPT)


@pytest.fixture(scope="module")
def experiment(session) -> list:
    events, _finished = collect("speculative", session, prompt=PROMPT, new_tokens=16, repeats=2, draft_tokens=4)
    return events


def test_the_experiment_reports_passes_acceptance_and_the_same_tokens(experiment):
    end = experiment[-1]
    assert isinstance(end, ExperimentFinished)
    r = end.result
    passes = [e for e in experiment if isinstance(e, DraftPass)]
    last = [p for p in passes if p.repeat == 1]
    assert r.tokens_match and r.passes == len(last) and r.accepted == sum(p.accepted for p in last)
    assert r.drafted == sum(len(p.drafted) for p in last) and r.first_difference is None
    assert r.tokens_per_pass == pytest.approx((r.generated - 1) / r.passes)
    assert r.speedup == pytest.approx(r.plain_decode_ms / r.speculative_decode_ms)
    assert all(len(p.drafted_text) == len(p.drafted) for p in passes)


def test_the_experiment_saves_and_replays_and_hostile_passes_are_refused(experiment, tmp_path):
    path = write_trace(tmp_path / "s.jsonl", experiment)
    assert [e for e in read_trace(path) if isinstance(e, DraftPass)] == \
        [e for e in experiment if isinstance(e, DraftPass)]
    rows = rows_of(experiment, tmp_path / "valid.jsonl")
    index = first_row(rows, "DraftPass")
    for field, value, fragment in (("accepted", 99, "accepted must be between"),
                                   ("token_id", 10**9, "token_id must be between"),
                                   ("drafted", list(range(40)), "drafted has 40 entries")):
        refused_with(path, rows, index, {field: value}, fragment)


def test_perfetto_shows_each_pass_drafting_then_verifying_per_repeat(experiment):
    from engine.output.perfetto import trace_events
    from tests.engine.test_perfetto import check_trace_event_format

    out = check_trace_event_format({"traceEvents": trace_events(experiment)})
    passes = [e for e in experiment if isinstance(e, DraftPass)]
    threads = {e["args"]["name"] for e in out if e["name"] == "thread_name"}
    assert {"speculative repeat 1: draft, then verify", "speculative repeat 2: draft, then verify"} <= threads
    verify = [e for e in out if e["ph"] == "X" and e["cat"] == "verify"]
    assert len(verify) == len(passes) and [e["args"]["kept"] for e in verify] == [p.accepted for p in passes]
    assert sum(e["cat"] == "draft" for e in out if e["ph"] == "X") == len(passes)
    for tid in {e["tid"] for e in verify}:                              # per repeat: draft, verify, draft, ...
        track = sorted((e for e in out if e["ph"] == "X" and e["tid"] == tid), key=lambda e: e["ts"])
        assert [e["cat"] for e in track] == ["draft", "verify"] * (len(track) // 2)
