"""Why a prompt missed the prefix cache: the words put to what the allocator did (unit), and the paged lesson
serving a workload whose prompts diverge where the test says, through transformers' own paged cache (end to end)."""

from __future__ import annotations

import json
import threading

import pytest

from engine import lessons
from engine.facts import prefix_misses as pm
from engine.facts.kvformula import common_prefix
from engine.facts.prefix_misses import explain
from engine.run.experiment import run_lesson
from engine.serve.block_events import PrefixMiss

BASE = list(range(100, 140))                     # 40 tokens: blocks of 8 -> 4 readable blocks of 39 positions


def test_each_reason_is_said_from_what_was_observed():
    repeat = explain(BASE, 8, 32, [(0, BASE)], [pm.PRESENT] * 4)
    assert (repeat.reason, repeat.cached_tokens, repeat.computed_tokens) == (pm.PARTIAL, 32, 8)
    assert repeat.divergent_position is None                         # nothing diverged: the tail fills no block
    boundary = BASE[:16] + [7] * 24
    at_block = explain(boundary, 8, 16, [(0, BASE)], [pm.PRESENT, pm.PRESENT, pm.NEVER, pm.NEVER])
    assert (at_block.reason, at_block.divergent_position, at_block.request_token, at_block.cached_token) == \
        (pm.DIVERGED, 16, 7, 116)
    mid = BASE[:21] + [7] * 19
    inside = explain(mid, 8, 16, [(0, BASE)], [pm.PRESENT, pm.PRESENT, pm.NEVER, pm.NEVER])
    assert (inside.reason, inside.divergent_position) == (pm.PARTIAL, 21) and "those 5 shared tokens" in inside.words
    gone = explain(BASE, 8, 0, [(0, BASE)], [pm.GONE] * 4, "gone at step 9")
    assert gone.reason == pm.EVICTED and "gone at step 9" in gone.words
    early = explain(BASE, 8, 8, [(0, BASE)], [pm.PRESENT, pm.NEVER, pm.NEVER, pm.NEVER])
    assert early.reason == pm.NOT_YET and "still in its prefill" in early.words
    assert explain(BASE, 8, 0, [], [pm.NEVER] * 4).reason == pm.COLD
    assert explain(BASE, 8, 8, [(0, BASE)], [pm.PRESENT] * 4).reason == pm.UNKNOWN   # cached, not read: unsaid


@pytest.fixture(scope="module")
def served(tiny, tmp_path_factory):
    """Five requests through the paged lesson: a base prompt, its exact repeat, one leaving it at a block boundary,
    one leaving it inside a block, a long unrelated one that fills the small pool (evicting the cached blocks), and
    the base prompt again after it."""
    from engine.lessons.paged import _requests
    from engine.run.session import Session

    session = Session(tiny)
    folder = tmp_path_factory.mktemp("workload")
    words = "the cache keeps the keys and values of every token it has seen so far".split()
    texts = [" ".join(words), " ".join(words), " ".join(words[:6] + ["moon"] * 8), " ".join(words[:9] + ["sun"] * 5),
             " ".join(["unrelated"] * 12), " ".join(words)]
    path = folder / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in texts))
    lesson = lessons.lesson("paged")
    probe = lesson.settings(workload=str(path), page_size=4, new_tokens=2, compare=False)
    ids = [r[0] for r in _requests(session, probe)]
    page = common_prefix(ids[0], ids[2])                              # the boundary request leaves at a block's end
    assert 4 <= page and common_prefix(ids[0], ids[3]) % page != 0
    blocks = -(-(len(ids[4]) + 2) // page)                            # room for the longest request alone
    settings = lesson.settings(workload=str(path), page_size=page, new_tokens=2, arrive_every=6, compare=False,
                               pool_blocks=blocks)
    events: list = []
    finished = run_lesson(lesson, session, settings, events.append, threading.Event(), None)
    assert finished.reason == "done"
    return ids, page, {e.request: e for e in events if isinstance(e, PrefixMiss)}


def test_a_workloads_misses_get_exactly_their_reasons_and_positions(served):
    ids, page, miss = served
    readable = (len(ids[0]) - 1) // page * page
    assert miss[0].reason == pm.COLD and miss[0].cached_tokens == 0
    assert (miss[1].reason in (pm.NONE, pm.PARTIAL), miss[1].cached_tokens) == (True, readable)   # an exact repeat
    assert (miss[2].reason, miss[2].divergent_position, miss[2].cached_tokens) == (pm.DIVERGED, page, page)
    lcp = common_prefix(ids[0], ids[3])
    assert (miss[3].reason, miss[3].divergent_position, miss[3].cached_tokens) == \
        (pm.PARTIAL, lcp, lcp // page * page)
    assert (miss[3].request_token, miss[3].cached_token) == (ids[3][lcp], ids[0][lcp]) and miss[3].request_text
    assert miss[5].reason == pm.EVICTED and miss[5].cached_tokens == 0 and "gone at step" in miss[5].words
    for m in miss.values():
        assert m.cached_tokens + m.computed_tokens == m.prompt_tokens


def test_a_request_served_from_the_cache_is_counted_as_cached_not_as_a_fast_prefill(served):
    ids, page, miss = served
    assert miss[1].cached_tokens == (len(ids[1]) - 1) // page * page and miss[1].computed_tokens < page + 1


def test_the_cli_json_carries_each_requests_cached_computed_and_reason_and_refuses_bad_input(tiny_model_dir, tmp_path,
                                                                                            capsys):
    from engine import cli

    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"prompt": "keys and values of every token"}) + "\n"
                    + json.dumps({"prompt": "keys and values of every word"}) + "\n")
    base = ["sweep", "paged", "--model", str(tiny_model_dir), "--device", "cpu", "--dtype", "float32",
            "--workload", str(path), "--page-size", "4", "--tokens", "2", "--no-history"]
    assert cli.main([*base, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    requests = out["requests"]
    assert out["result"]["workload"] == "prompts.jsonl"                  # its prefix is not a system prompt
    from engine.lessons.paged import PagedResult

    assert PagedResult(workload="prompts.jsonl").prefix_words() == "the longest prefix two consecutive requests share"
    assert PagedResult().prefix_words() == "the shared system prompt"
    assert [r["request"] for r in requests] == [0, 1] and requests[0]["miss_reason"] == pm.COLD
    second = requests[1]
    assert second["cached_tokens"] + second["computed_tokens"] == second["prompt_tokens"]
    assert second["first_divergent_position"] >= second["cached_tokens"] and second["request_token"]["text"]
    assert cli.main([*base, "--blocks", "1"]) != 0
    err = capsys.readouterr().err
    assert "prompts.jsonl request 1 needs" in err and "the pool holds 1 (--blocks)" in err
    path.write_text(json.dumps({"prompt": "word " * 400}) + "\n")
    assert cli.main(base) != 0
    assert "prompts.jsonl request 1:" in capsys.readouterr().err
    path.write_text(json.dumps({"arrival_s": 1.0}) + "\n")
    assert cli.main(base) != 0
    assert "prompts.jsonl line 1" in capsys.readouterr().err
