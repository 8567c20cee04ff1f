"""A load test's prefix-cache figures come from the server's own answers: each request's cached prompt tokens as
its response's ``usage.prompt_tokens_details.cached_tokens`` said, the counters read before the first request and
after the last (what other clients moved in them said), a slow ``/metrics`` answer tried again at the next poll,
and the tree's send-time walk kept as a prediction beside the answer. A small engine in this file answers as vLLM
does, deciding the cached tokens itself; the real vLLM runs in ``tests/integration``."""

from __future__ import annotations

import json
import threading
import time

import msgpack
import pytest

from engine.facts.events import ExperimentPoint
from engine.lessons import server_load
from engine.output.trace import read_trace, write_trace
from engine.serve.block_events import RequestBlocks
from engine.serve.prefix_tree import PrefixTree, tree_of
from engine.serve.remote import RemoteSession, probe
from tests.lessons import collect
from tests.replay_server import ReplayServer, Route

PROMPT_TOKENS = 96


class Engine:
    """Answers chat completions as vLLM streams them, the first request with nothing from its cache and every later
    one with 64 prompt tokens from it; counts what it served on /metrics, and can answer a /metrics poll slowly or
    move its counters as if another client had sent a request."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.served = 0
        self.cached: list[int] = []
        self.counters = {"prompt": 0, "hits": 0, "queries": 0}
        self.slow_polls = 0

    def models(self) -> Route:
        return Route(body=json.dumps({"object": "list", "data": [{"id": "m", "owned_by": "vllm",
                                                                 "max_model_len": 2048}]}).encode())

    def chat(self, send) -> None:
        with self.lock:
            cached = 0 if self.served == 0 else 64
            self.served += 1
            self.cached.append(cached)
        self.answer(send, cached)

    def answer(self, send, cached: int) -> None:
        for word, finish in (("The", None), (" cache", None), (" keeps", "length")):
            chunk = {"choices": [{"index": 0, "delta": {"content": word}, "finish_reason": finish}]}
            send(b"data: " + json.dumps(chunk).encode() + b"\n\n")
            time.sleep(0.05)
        usage = {"prompt_tokens": PROMPT_TOKENS, "completion_tokens": 3, "total_tokens": PROMPT_TOKENS + 3,
                 "prompt_tokens_details": {"cached_tokens": cached}}
        send(b"data: " + json.dumps({"choices": [], "usage": usage}).encode() + b"\n\n")
        with self.lock:
            self.counters["prompt"] += PROMPT_TOKENS
            self.counters["queries"] += PROMPT_TOKENS
            self.counters["hits"] += cached
        send(b"data: [DONE]\n\n")

    def another_client(self) -> None:
        with self.lock:
            self.counters["prompt"] += 50
            self.counters["queries"] += 50

    def metrics(self, send) -> None:
        if self.slow_polls:
            self.slow_polls -= 1
            time.sleep(3.0)                          # past the poll's 2 s bound: this poll gets no page
        c = self.counters
        send(("# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 1\n"
              f"vllm:prompt_tokens_total {c['prompt']}\nvllm:prefix_cache_hits_total {c['hits']}\n"
              f"vllm:prefix_cache_queries_total {c['queries']}\n").encode())

    def routes(self) -> dict[str, Route]:
        return {"GET /v1/models": self.models(),
                "GET /metrics": Route(stream=self.metrics, content_type="text/plain"),
                "POST /v1/chat/completions": Route(stream=self.chat, content_type="text/event-stream")}


def test_each_requests_cached_tokens_are_the_servers_answer_and_the_counters_their_sum(tmp_path):
    engine = Engine()
    with ReplayServer(engine.routes()) as server:
        events, end = collect("server load", RemoteSession(probe(server.url)), requests=4, every_s=0.05,
                              new_tokens=3, poll_s=0.2, limit_s=60)
    r = end.result
    requests = sorted((p.values for p in events if isinstance(p, ExperimentPoint) and p.series == "request"),
                      key=lambda v: v["arrival_ms"])
    assert r.completed == 4 and [int(v["cached_tokens"]) for v in requests] == engine.cached == [0, 64, 64, 64]
    assert r.server_cached_tokens == 192 and r.server_prompt_tokens == 4 * PROMPT_TOKENS and r.server_answered == 4
    assert r.cached_prompt_tokens_during == 192 and r.prefix_queries_during == 4 * PROMPT_TOKENS
    assert r.own_prompt_tokens == 4 * PROMPT_TOKENS and r.other_prompt_tokens is None
    lines = server_load.prefix_lines(r)
    assert lines[0] == ("prefix cache, from the server's answers: 192 of 384 prompt tokens served from its cache "
                        "(50.0%, as 4 answers said)")
    assert lines[1].endswith("(50.0%, as reported); all of them this test's")
    table = server_load.table([p for p in events if isinstance(p, ExperimentPoint)], r)
    assert "cached (server)" in table.splitlines()[0] and "predicted at send" not in table
    replayed = read_trace(write_trace(tmp_path / "load.jsonl", events))
    assert [p.values.get("cached_tokens") for p in replayed if isinstance(p, ExperimentPoint)
            and p.series == "request"] == [p.values.get("cached_tokens") for p in events
                                           if isinstance(p, ExperimentPoint) and p.series == "request"]


def test_a_slow_metrics_answer_is_tried_again_and_counters_not_read_before_the_test_are_not_shown():
    engine = Engine()
    with ReplayServer(engine.routes()) as server:
        facts = probe(server.url)
        engine.slow_polls = 2                        # the first two polls of the test are slower than their bound
        _events, end = collect("server load", RemoteSession(facts), requests=3, every_s=1.5, new_tokens=3,
                               poll_s=0.2, limit_s=60)       # the last request is sent after both slow polls
    r = end.result
    assert r.metrics_failed == 2 and "no answer in time" in r.metrics_error
    assert r.metrics_polls >= 2                      # polling went on after the slow answers
    assert r.cached_prompt_tokens_during is None     # the counters before the first request were not read
    assert r.server_cached_tokens == 128             # the answers still say what was served


def test_other_clients_prompt_tokens_are_counted_apart_from_this_tests_own():
    engine = Engine()
    with ReplayServer(engine.routes()) as server:
        facts = probe(server.url)
        started = threading.Event()
        original = engine.chat

        def chat_and_another(send) -> None:
            if not started.is_set():
                started.set()
                engine.another_client()
            original(send)

        server.routes["POST /v1/chat/completions"] = Route(stream=chat_and_another, content_type="text/event-stream")
        _events, end = collect("server load", RemoteSession(facts), requests=2, every_s=0.1, new_tokens=3,
                               poll_s=0.2, limit_s=60)
    r = end.result
    assert r.own_prompt_tokens == 2 * PROMPT_TOKENS and r.other_prompt_tokens == 50
    assert server_load.prefix_lines(r)[-1].endswith("other clients sent 50 of them")


def test_a_request_the_tree_predicted_short_is_told_apart_from_the_servers_answer():
    tree = PrefixTree()
    tree.add(RequestBlocks("e", 1.0, 0, 96, 0, 32, ["a", "b"], server_cached_tokens=0))
    tree.add(RequestBlocks("e", 2.0, 1, 96, 0, 32, ["a", "b"], server_cached_tokens=64))     # sent too early
    tree.add(RequestBlocks("e", 3.0, 2, 96, 64, 32, ["a", "b"], server_cached_tokens=64))
    assert tree.hit_rate() == (64, 288) and tree.served() == (128, 288) and tree.mispredicted() == [1]
    assert PrefixTree().served() is None


class EventEngine(Engine):
    """An engine that also publishes its KV events (as vLLM does over ZMQ) and has vLLM's /tokenize: every prompt
    is 64 shared tokens and 32 of its own. The first request's blocks are published only once the second request
    has arrived, and the second is answered as served from them: the case where the tree's prediction at send
    (nothing stored yet) and the server's answer differ. /detokenize is slow, so a block's event is written
    after points that came later."""

    def __init__(self, publisher) -> None:
        super().__init__()
        self.publisher = publisher
        self.second = threading.Event()
        self.arrived = 0

    def tokens(self, content: str) -> list[int]:
        own = server_load.PROMPTS.index(content)
        return list(range(1, 65)) + [1000 + 32 * own + i for i in range(32)]

    def chat(self, send) -> None:
        with self.lock:
            order, self.arrived = self.arrived, self.arrived + 1
        if order == 1:
            self.second.set()
        else:
            self.second.wait(30)
        self.cached = [0, 64]                        # by arrival: the second is served from the first's blocks
        self.answer(send, self.cached[order])
        if order == 0:
            blocks = {"type": "BlockStored", "block_hashes": [11, 12, 13], "parent_block_hash": None,
                      "token_ids": self.tokens(server_load.PROMPTS[0]), "block_size": 32}
            for _ in range(3):                       # again, in case the subscriber joined late
                self.publisher.send_multipart([b"", b"\0" * 8, msgpack.packb([time.time(), [blocks]])])
                time.sleep(0.2)

    def routes(self) -> dict[str, Route]:
        engine = self

        def detokenize(send) -> None:
            time.sleep(0.3)
            send(json.dumps({"prompt": "a block's text"}).encode())

        out = super().routes()
        out["POST /detokenize"] = Route(stream=detokenize)
        out["POST /tokenize"] = Route(stream=lambda send: send(json.dumps({"tokens": engine.next_tokens()}).encode()))
        return out

    def next_tokens(self) -> list[int]:
        with self.lock:
            asked = getattr(self, "asked", 0)
            self.asked = asked + 1
        return self.tokens(server_load.PROMPTS[asked % len(server_load.PROMPTS)])


def test_a_load_tests_trace_replays_its_tree_and_a_request_predicted_short_is_marked(tmp_path):
    import zmq

    from tests.engine.test_kv_events import free_port

    port = free_port()
    pub = zmq.Context.instance().socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.bind(f"tcp://127.0.0.1:{port}")
    engine = EventEngine(pub)
    try:
        with ReplayServer(engine.routes()) as server:
            events, end = collect("server load", RemoteSession(probe(server.url)), requests=2, every_s=0.05,
                                  new_tokens=3, poll_s=0.2, limit_s=60, kv_events=f"tcp://127.0.0.1:{port}")
    finally:
        pub.close(0)
    r = end.result
    walked = sorted((e for e in events if isinstance(e, RequestBlocks)), key=lambda e: e.server_cached_tokens)
    assert [(w.server_cached_tokens, w.reused_tokens, w.mispredicted) for w in walked] == [(0, 0, False),
                                                                                           (64, 0, True)]
    assert r.mispredicted_requests == 1 and tree_of(events).mispredicted() == [walked[1].index]
    assert r.tree_reused_tokens == 0 and r.server_cached_tokens == 64
    replayed = read_trace(write_trace(tmp_path / "load.jsonl", events))     # the clock never goes back
    assert len(replayed) == len(events)
    assert tree_of(replayed).mispredicted() == [walked[1].index] and tree_of(replayed).blocks


FLOOD = """
import sys, time, msgpack, zmq
pub = zmq.Context.instance().socket(zmq.PUB)
pub.setsockopt(zmq.LINGER, 0)
pub.bind(sys.argv[1])
n = number = 0
tokens = [7] * (250 * 16)
while True:
    events = []
    for _ in range(60):
        events.append({"type": "BlockStored", "block_hashes": list(range(n, n + 250)), "parent_block_hash": None,
                       "token_ids": tokens, "block_size": 16})
        n += 250
    pub.send_multipart([b"", number.to_bytes(8, "big"), msgpack.packb([time.time(), events])])
    number += 1
"""


def test_a_flood_of_kv_events_is_counted_not_kept_and_memory_stays_bounded(monkeypatch):
    """A publisher in a process of its own sending valid BlockStored batches as fast as it can (60 events of 250
    blocks a message, as a large engine's cache would) while a load test runs: the tree and the recorded events
    stay bounded, the rest is counted and said, and the messages ZMQ could not queue are counted from their
    numbers."""
    import subprocess
    import sys
    import tracemalloc

    from engine.serve.block_events import KVBlocks
    from tests.engine.test_kv_events import free_port

    monkeypatch.setattr(server_load, "MAX_RECORDED_BLOCKS", 2_000)
    port = free_port()
    publisher = subprocess.Popen([sys.executable, "-c", FLOOD, f"tcp://127.0.0.1:{port}"])
    engine = Engine()
    routes = engine.routes()
    answer = routes["POST /v1/chat/completions"].stream

    def chat_for_a_while(send) -> None:
        time.sleep(3.0)                                # the flood runs meanwhile
        answer(send)

    routes["POST /v1/chat/completions"] = Route(stream=chat_for_a_while, content_type="text/event-stream")
    tracemalloc.start()
    try:
        with ReplayServer(routes) as server:
            events, end = collect("server load", RemoteSession(probe(server.url)), requests=2, every_s=0.5,
                                  new_tokens=3, poll_s=0.2, limit_s=60, kv_events=f"tcp://127.0.0.1:{port}")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
        publisher.kill()
        publisher.wait()
    r = end.result
    recorded = sum(len(e.keys) for e in events if isinstance(e, KVBlocks))
    print(f"\nflood: {r.blocks_stored:,} blocks stored, {recorded:,} recorded, {r.kv_messages_lost:,} messages lost, "
          f"peak {peak / 2**20:.0f} MiB")
    assert r.blocks_stored > 10 * 2_000 and recorded <= 2_000 and r.blocks_unrecorded == r.blocks_stored - recorded
    said = "\n".join(server_load.prefix_lines(r))
    assert "more blocks were counted, not kept" in said
    assert r.kv_messages_lost == 0 or "messages the publisher numbered never arrived" in said
    assert peak < 400 << 20, f"{peak / 2**20:.0f} MiB"


def test_a_message_larger_than_the_bound_is_said_not_silently_lost():
    import zmq

    from engine.serve import kv_events
    from tests.engine.test_kv_events import free_port

    port = free_port()
    pub = zmq.Context.instance().socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.bind(f"tcp://127.0.0.1:{port}")
    subscriber = kv_events.Subscriber(f"tcp://127.0.0.1:{port}")
    try:
        deadline = time.monotonic() + 30
        while not subscriber.cut_off and time.monotonic() < deadline:
            pub.send_multipart([b"", b"\0" * 8, b"x" * (kv_events.MAX_MESSAGE + 1)])
            list(subscriber.read(0.3))
        assert subscriber.cut_off and "larger than 4 MiB" in subscriber.notes[0]
    finally:
        subscriber.close()
        pub.close(0)


@pytest.mark.parametrize("page, said", [
    ("vllm:num_requests_running 1\n# " + "x" * (37 << 20) + "\n", "larger than the 8 MiB a metrics page may be"),
    ("vllm:num_requests_running 1\nvllm:num_requests_waiting 1e300\n",
     "vllm:num_requests_waiting is 1e+300, which it cannot be (a count of 0 to 1e+07): not read"),
    ("vllm:num_requests_running 1\n" * 5000, "vllm:num_requests_running is given 5,000 times for the same labels"),
], ids=["37 MiB", "1e300", "one gauge 5,000 times"])
def test_a_metrics_page_that_cannot_be_true_is_said_in_the_result_and_its_table(page, said):
    engine = Engine()
    routes = engine.routes()
    routes["GET /metrics"] = Route(body=page.encode(), content_type="text/plain")
    with ReplayServer(routes) as server:
        points, end = collect("server load", RemoteSession(probe(server.url)), requests=1, every_s=0.0,
                              new_tokens=3, poll_s=0.2, limit_s=60)
    r = end.result
    table = server_load.table([p for p in points if isinstance(p, ExperimentPoint)], r)
    assert said in table and r.completed == 1
    assert "1e+300" not in str(r.peak_waiting)


def test_two_data_parallel_engines_each_nearly_full_are_each_given_a_figure():
    page = ('vllm:num_requests_running{engine="0"} 2\nvllm:num_requests_running{engine="1"} 2\n'
            'vllm:kv_cache_usage_perc{engine="0"} 0.9\nvllm:kv_cache_usage_perc{engine="1"} 0.9\n')
    engine = Engine()
    routes = engine.routes()
    routes["GET /metrics"] = Route(body=page.encode(), content_type="text/plain")
    with ReplayServer(routes) as server:
        points, end = collect("server load", RemoteSession(probe(server.url)), requests=1, every_s=0.0,
                              new_tokens=3, poll_s=0.2, limit_s=60)
    r = end.result
    assert r.peak_kv_usage is None and r.engines == ("0", "1") and r.peak_kv_usage_by_engine == (0.9, 0.9)
    table = server_load.table([p for p in points if isinstance(p, ExperimentPoint)], r)
    assert "KV usage of engine 0 90%, KV usage of engine 1 90%" in table and "peak running 4" in table
