"""Continuous batching: requests join and leave a running batch, and each gets its solo tokens."""

import copy
from types import SimpleNamespace

import pytest
import torch

from engine.facts.events import ExperimentPoint
from engine.run.batch_generate import generate_batch
from engine.run.scheduler import ScheduledRequest, serve
from engine.run.session import Session
from tests.lessons import collect

PROMPTS = ("hello world", "The KV cache holds keys and values for decode and more of it", "日本語 😀",
           "Temperature, top-k and top-p change which token is chosen", "hi")


def on(model, facts):
    """What ``serve`` runs on: a model, where it runs, and its facts (a float64 copy in some tests)."""
    return SimpleNamespace(model=model, device=torch.device("cpu"), facts=facts)


def make_requests(session, lengths=(6, 9, 4, 7, 5), every=2):
    return [ScheduledRequest(i, session.encode(p, chat_template=False), n, i * every)
            for i, (p, n) in enumerate(zip(PROMPTS, lengths))]


@pytest.mark.parametrize("policy", ["continuous", "static"])
def test_each_request_gets_its_solo_tokens(tiny, policy):
    """In float64, so padding, masks and per-row positions must be exactly right."""
    model = copy.deepcopy(tiny.model).to(torch.float64)
    session = Session(tiny)
    requests = make_requests(session)
    sizes = []
    assert serve(on(model, tiny.facts), requests, policy, on_step=lambda t, b: sizes.append(b))
    for r in requests:
        solo = generate_batch(model, [r.ids], r.new_tokens, 0, torch.device("cpu")).tokens[0]
        assert r.tokens == solo, r.index
        assert r.arrival_ms <= r.admitted_ms <= r.first_token_ms <= r.done_ms
    assert max(sizes) >= 2                                         # requests did share the batch


def test_continuous_admits_at_once_static_waits_for_the_batch(tiny):
    session = Session(tiny)
    cont, stat = make_requests(session), make_requests(session)
    serve(session, cont, "continuous")
    serve(session, stat, "static")
    # request 1 arrives while request 0 is still decoding: continuous admits it at once, static makes it wait
    assert cont[1].admitted_ms - cont[1].arrival_ms < stat[1].admitted_ms - stat[1].arrival_ms
    assert stat[1].admitted_ms >= stat[0].done_ms
    assert [r.tokens for r in cont] == [r.tokens for r in stat]


def test_cancel_stops_serving(tiny):
    import threading

    cancel = threading.Event()
    cancel.set()
    requests = make_requests(Session(tiny))
    assert serve(Session(tiny), requests, "continuous", cancel=cancel) is False


def test_the_experiment_reports_lanes_batch_sizes_and_the_token_check(tiny):
    events, finished = collect("continuous", tiny, requests=5, arrive_every=2, new_tokens=(5, 8), prompts=PROMPTS)
    r = finished.result
    assert r.tokens_match_solo is True and r.same_tokens_both_policies is True
    requests = [e.values for e in events if isinstance(e, ExperimentPoint) and e.series == "request"]
    assert len(requests) == 10 and {r["policy"] for r in requests} == {0.0, 1.0}
    cont = [r for r in requests if r["policy"] == 1.0]
    stat = [r for r in requests if r["policy"] == 0.0]
    # the schedule, not the clock: request 1 arrives while request 0 decodes; continuous admits it at once,
    # static only once request 0 has finished
    assert cont[1]["admitted_ms"] < cont[0]["done_ms"]
    assert stat[1]["admitted_ms"] >= stat[0]["done_ms"]
    sizes = [e.values["batch_size"] for e in events if isinstance(e, ExperimentPoint) and e.series == "batch"]
    assert max(sizes) >= 2 and sizes[-1] == 0
