"""Every thing KVScope reads from outside itself, as a fuzz target, and ``READERS``: each module that opens a
file or a socket, with the targets that cover it (``test_fuzz`` fails on a module that opens one unregistered).

A target's seeds are real: the course's shipped traces, recorded server answers, the embedded GGUF's header,
the shipped workload and lecture files. The fault tables (odd files, slow peers, outputs) are in ``faults``.
"""

from __future__ import annotations

import functools
import gzip
import json
import os
import socket
from pathlib import Path

from tests.fuzz import faults, peers
from tests.fuzz.harness import Said, Target

ROOT = Path(__file__).resolve().parents[2]
COURSE = ROOT / "resources" / "course"
FIXTURES = ROOT / "tests" / "fixtures"


def _course_traces() -> list[bytes]:
    small = sorted(COURSE.glob("*.kvscope.jsonl.gz"), key=lambda p: p.stat().st_size)[:6]
    raw = [p.read_bytes() for p in small]
    plain = gzip.decompress(raw[0])
    cuts = [b"\n".join(plain.split(b"\n")[:n]) + b"\n" for n in (1, 2, 5)]        # cut at a line
    return raw + [gzip.decompress(raw[1]), (FIXTURES / "vllm_load.kvscope.jsonl").read_bytes()] + cuts


def _write(work: Path, name: str, data: bytes) -> Path:
    path = work / name
    path.write_bytes(data)
    return path


# ---- files ----------------------------------------------------------------------------------------------------

def _trace(data: bytes, work: Path) -> object:
    from engine.output.trace import read_trace

    return len(read_trace(_write(work, "t.kvscope.jsonl", data)))


def _export(data: bytes, work: Path) -> object:
    """What ``python -m engine perfetto`` and ``otlp`` do with a trace: read it, write the export."""
    trace = _write(work, "t.kvscope.jsonl", data)
    faults.cli(["perfetto", str(trace), "--out", str(work / "t.perfetto.json")])
    faults.cli(["otlp", str(trace), "--out", str(work / "t.otlp.json")])
    return None


def _workload(data: bytes, work: Path) -> object:
    from engine.serve.workload import read_workload

    return len(read_workload(_write(work, "w.jsonl", data), 64).requests)


def _lecture(data: bytes, work: Path) -> object:
    from app.lecture.lecture_file import read_lecture

    _write(work, "run.kvscope.jsonl.gz", (COURSE / "run.kvscope.jsonl.gz").read_bytes())
    return len(read_lecture(_write(work, "l.kvscope-lecture.json", data)))


def _config(data: bytes, work: Path) -> object:
    """A model folder's ``config.json``, read the ways KVScope reads one: its facts, the cost model, the
    refusal of what cannot run, and the config transformers builds from it."""
    from engine.facts import config_facts
    from engine.model import models

    folder = work / "fuzzed-folder"                        # a refusal names the folder or its config.json
    folder.mkdir()
    _write(folder, "config.json", data)
    cfg = config_facts.read(folder)
    config_facts.refusal(cfg)
    config_facts.model_facts(folder, cfg)
    models._read_config(str(folder), trust_remote_code=False)
    return None


def _config_seeds() -> list[bytes]:
    """SmolLM2-135M's config (the embedded model's shape), a grouped-query MoE's and a sliding-window one's."""
    smol = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 576,
            "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
            "max_position_embeddings": 8192, "vocab_size": 49152, "rms_norm_eps": 1e-05, "rope_theta": 100000.0,
            "tie_word_embeddings": True, "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2}
    moe = {**smol, "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "num_experts": 8,
           "num_experts_per_tok": 2, "moe_intermediate_size": 256, "head_dim": 64}
    window = {**smol, "architectures": ["MistralForCausalLM"], "model_type": "mistral", "sliding_window": 4096}
    return [json.dumps(c, indent=2).encode() for c in (smol, moe, window)]


class _Tokenizer:
    name_or_path = "fuzzed-model"
    special_tokens_map = {"bos_token": "<s>", "eos_token": "</s>"}

    def __init__(self, template: str) -> None:
        self.chat_template = template


def _template(data: bytes, work: Path) -> object:
    from engine.model import chat_template

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a KV cache?"}]
    return len(chat_template.render(_Tokenizer(data.decode("utf-8", "replace")), messages, "fuzzed-model"))


def _settings(data: bytes, work: Path) -> object:
    """The settings file as the window reads it back: QSettings' INI, every run setting restored and checked."""
    from PySide6.QtCore import QSettings

    from app.state.run_settings import RunSettings

    settings = QSettings(str(_write(work, "settings.ini", data)), QSettings.Format.IniFormat)
    stored = {key.removeprefix("run/"): settings.value(key) for key in settings.allKeys() if key.startswith("run/")}
    run_settings = RunSettings()
    run_settings.restore(stored)
    return run_settings.notes


def _sealed(data: bytes, work: Path) -> object:
    """A cache file whose seal is the fuzzed bytes: refused, naming the file, whatever the seal holds."""
    from engine.store import sealed

    folder = sealed.private_folder(work / "cache")
    good = folder / "table.json"
    sealed.write_sealed(good, "KVScope's record", b'{"a": 1}')
    _write(folder, "table.json.seal", data)
    return sealed.read_sealed(good, "KVScope's record")


def _key(data: bytes, work: Path) -> object:
    """The user's key file fuzzed: any content is a key or a refusal naming it."""
    from engine.store import paths, sealed

    folder = paths.config_dir()
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    key = folder / sealed.KEY_FILE
    key.unlink(missing_ok=True)
    _write(folder, sealed.KEY_FILE, data)
    os.chmod(key, 0o600)
    return len(sealed._key())


def _gguf(data: bytes, work: Path) -> object:
    """A ``.gguf`` file as KVScope meets one: resolved as a model source, its metadata read within bounds
    before anything converts it."""
    from engine.model import gguf_header, models

    path = _write(work, "m.gguf", data)
    models.resolve_source(str(path))
    return len(gguf_header.read(path).metadata)


@functools.cache
def _gguf_header_bytes() -> bytes:
    from engine.model import embedded, gguf_header

    source = embedded.embedded_gguf()
    with source.open("rb") as f:
        return f.read(gguf_header.read(source).data_offset)


def _gguf_seeds() -> list[bytes]:
    from engine.model import embedded, gguf_header

    source = embedded.embedded_gguf()
    with source.open("rb") as f:
        head = f.read(gguf_header.read(source).data_offset)
    return [head, head[:4096], head[:24]]


def _ollama_manifest(data: bytes, work: Path) -> object:
    """An Ollama manifest, fuzzed, beside a blob of the embedded GGUF's header: listed, skipped or described."""
    from engine.model import found

    root = work / "ollama"
    manifest = root / "manifests" / "registry.ollama.ai" / "library" / "m" / "latest"
    manifest.parent.mkdir(parents=True)
    manifest.write_bytes(data)
    (root / "blobs").mkdir()
    (root / "blobs" / f"sha256-{'a' * 64}").write_bytes(_gguf_header_bytes())
    return [m.as_dict() for m in found._ollama(root, "bfloat16")]


def _history_error() -> type[Exception]:
    from engine.output.history import HistoryError

    return HistoryError


def _one_recorded_run() -> list[object]:
    """The first run of the recorded vLLM load test, after its experiment's start: a real run's events, as the
    history stores them."""
    from engine.facts.events import ExperimentStarted, RunFinished, RunStarted
    from engine.output.trace import read_trace

    events = list(read_trace(FIXTURES / "vllm_load.kvscope.jsonl"))
    first = next(e for e in events if isinstance(e, RunStarted))
    mine = [e for e in events if getattr(e, "run_id", None) == first.run_id]
    assert isinstance(mine[-1], RunFinished)
    return [next(e for e in events if isinstance(e, ExperimentStarted)), *mine]


def _history_seeds() -> list[bytes]:
    """A real run history holding one run with its steps and its events (written through History itself)."""
    import sqlite3
    import tempfile

    from engine.output import history

    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "history.sqlite"
        db = history.History(path).db
        db.execute("INSERT INTO runs (at, kind, title, engine, model, format, device, machine, settings, ended, "
                   "prompt_tokens, generated_tokens, ttft_ms, decode_tok_s, kv_bytes, cpu_share, trace) VALUES "
                   "('2026-12-07T10:00:00+00:00', 'generate', 'greedy', 'KVScope', 'tiny', 'float32', 'cpu', 'vm', "
                   "'{\"max_new_tokens\": 4}', 'max_tokens', 5, 4, 12.5, 80.0, 4096, 1.0, ?)",
                   (history._packed(_one_recorded_run()),))
        db.executemany("INSERT INTO steps (run, step, context, latency_ms, kv_bytes) VALUES (1, ?, ?, ?, ?)",
                       [(i, 5 + i, 12.5, 1024 * (5 + i)) for i in range(4)])
        db.execute("PRAGMA journal_mode = DELETE")            # one file: what a copy of it holds
        db.close()
        assert isinstance(db, sqlite3.Connection)
        return [path.read_bytes()]


def _history(data: bytes, work: Path) -> object:
    """A run history file, fuzzed: listed, its first run's steps and events read, or set aside with one line."""
    from engine.facts.errors import TraceError
    from engine.output.history import History

    path = work / "history.sqlite"
    path.write_bytes(data)
    history = History(path)
    try:
        runs = history.runs()
        steps = history.steps(runs[0].id) if runs else []
        if runs and runs[0].has_trace:
            try:
                history.write_trace(runs[0].id, work / "run.jsonl")
            except TraceError as exc:
                return f"{len(runs)} runs, {len(steps)} steps; its trace refused: {exc}"
        return f"{len(runs)} runs, {len(steps)} steps; {history.problem}"
    finally:
        history.close()


# ---- what servers and collectors answer ------------------------------------------------------------------------

def _metrics(data: bytes, work: Path) -> object:
    from engine.serve import metrics

    return len(metrics.read(data.decode("utf-8", "replace")).values)


def _slots(data: bytes, work: Path) -> object:
    """llama-server's ``/slots``, served: read as the load test's poll reads it."""
    from engine.serve import client, slots

    answer = client.get_json(client.address(_Answers.url(peers.body(data))), "/slots", timeout=2.0)
    found, _ = slots.read_slots(answer)
    return slots.slot_values(found)


def _kv_events(data: bytes, work: Path) -> object:
    """One ZMQ payload: vLLM's tagged maps or SGLang's arrays in msgpack, as facts, as the trace's events, in the
    prefix tree."""
    from engine.lessons import server_load
    from engine.serve import kv_events
    from engine.serve.prefix_tree import PrefixTree

    facts, skipped, why = kv_events.decode(data)
    if skipped and not facts:                 # what the subscriber notes for the user, judged as a refusal is
        raise Said(f"{why[0]} from tcp://127.0.0.1:5557: skipped")
    tree = PrefixTree()
    clock = type("Clock", (), {"exp_id": 1, "ms": staticmethod(lambda: 1.0)})()
    for fact in facts:
        event = server_load._blocks_event(clock, fact, [])
        event.check(1 << 20, 1 << 20)
        tree.add(event)
    tree.hit_rate()
    return len(tree.live_blocks())


def _kv_event_seeds() -> list[bytes]:
    import base64

    import msgpack

    recorded = json.loads((FIXTURES / "vllm_kv_events.json").read_text())
    sglang = [1765000000.0, [["BlockStored", [101, 102], None, list(range(32)), 16, None, "GPU"],
                             ["BlockRemoved", [101], "GPU"], ["AllBlocksCleared"]], 0]       # SGLang's tagged arrays
    return [base64.b64decode(p) for p in recorded["payloads"][:12]] + [msgpack.packb(sglang)]


class _Frames:
    """A real ZMQ publisher and KVScope's subscriber, bound on this machine: the fuzzed bytes are cut into frames
    (the topic, the sequence number and the payload vLLM sends, or any other count) and published."""

    def __init__(self) -> None:
        import zmq

        from engine.serve import kv_events

        with socket.socket() as probe:              # a free port (ZMQ binds a given one)
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        self.subscriber = kv_events.Subscriber(f"bind:tcp://127.0.0.1:{port}")
        self.publisher = zmq.Context.instance().socket(zmq.PUB)
        self.publisher.setsockopt(zmq.LINGER, 0)
        self.publisher.connect(self.subscriber.listening())
        import time

        time.sleep(0.3)                     # ZMQ's slow joiner: the subscription reaches the publisher

    def feed(self, data: bytes, work: Path) -> object:
        frames = data.split(b"\x00\xfe", 7) if data else [b""]
        before = self.subscriber.skipped + self.subscriber.dropped + self.subscriber.lost
        self.publisher.send_multipart(frames)
        facts = list(self.subscriber.read(0.02))
        if self.subscriber.skipped + self.subscriber.dropped + self.subscriber.lost > before:
            raise Said(self.subscriber.notes[-1] if self.subscriber.notes else "skipped without a note")
        return len(facts)


_frames: list[_Frames] = []


def _zmq(data: bytes, work: Path) -> object:
    if not _frames:
        _frames.append(_Frames())
    return _frames[0].feed(data, work)


class _Answers:
    """One peer for the server readers: every path answers with the fuzzed bytes, well framed."""

    peer: peers.Peer | None = None

    @classmethod
    def url(cls, answer: peers.Answer) -> str:
        if cls.peer is None:
            cls.peer = peers.Peer()
        cls.peer.answer = answer
        return cls.peer.url


def _probe(data: bytes, work: Path) -> object:
    """``/v1/models``, ``/props`` and ``/metrics`` from a server, all the fuzzed answer (KVScope's probe)."""
    from engine.serve import remote

    return remote.probe(_Answers.url(peers.body(data)), timeout=2.0, deadline_s=2.0).engine


def _discover(data: bytes, work: Path) -> object:
    """Every endpoint of a server answering with the fuzzed bytes: told apart, or said to be no known engine."""
    from engine.serve import discover

    url = _Answers.url(peers.body(data))
    found = discover.identify(url, int(url.rsplit(":", 1)[1]), deadline_s=2.0)
    return found.as_dict() if found else None


def _facts():
    from engine.serve.remote import ServerFacts

    return ServerFacts(name="m", url=_Answers.peer.url if _Answers.peer else "http://127.0.0.1:9", engine="vLLM",
                       context=4096, metrics=False, reveals=[])


def _stream(data: bytes, work: Path) -> object:
    """A streamed completion: the fuzzed bytes are the server-sent events of the answer."""
    from engine.facts.params import GenerationParams
    from engine.serve import remote

    _Answers.url(peers.body(data, b"text/event-stream"))
    session = remote.RemoteSession(_facts(), timeout=2.0, deadline_s=3.0)
    return faults.ended(session.run("What is a KV cache?", GenerationParams(max_new_tokens=8, seed=1)))


def _framing(data: bytes, work: Path) -> object:
    """The whole HTTP answer fuzzed (status line, headers, chunk sizes), to a GET and to a stream."""
    from engine.facts.params import GenerationParams
    from engine.serve import client, remote

    url = _Answers.url(peers.raw(data))
    try:
        client.get_json(client.address(url), "/v1/models", timeout=2.0)
    except client.RemoteError:
        pass
    session = remote.RemoteSession(_facts(), timeout=2.0, deadline_s=3.0)
    return faults.ended(session.run("What is a KV cache?", GenerationParams(max_new_tokens=8, seed=1)))


def _collector(data: bytes, work: Path) -> object:
    """An OTLP collector's answer to the spans sent (its status and body fuzzed)."""
    from engine.output import otlp

    url = _Answers.url(peers.raw(data))
    return otlp.send_spans(url + "/v1/traces", [], timeout_s=2.0)


def _http_seeds(name: str) -> list[bytes]:
    body = (FIXTURES / name).read_bytes()
    return [peers.OK_HEAD % (b"application/json", len(body)) + body,
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + b"%x\r\n" % len(body) + body + b"\r\n0\r\n\r\n",
            b"HTTP/1.0 500 Internal Server Error\r\n\r\n{\"error\": \"no\"}", b"HTTP/1.1 200 OK\r\n\r\n"]


# ---- the environment ------------------------------------------------------------------------------------------

ENVIRONMENT = {
    "KVSCOPE_THREADS": lambda: __import__("engine.model.threads", fromlist=["x"]).ThreadGovernor().enabled,
    "KVSCOPE_LINEAR": lambda: __import__("engine.model.kernels", fromlist=["x"]).offered(__import__("torch").float32),
    "KVSCOPE_CACHE_DIR": lambda: __import__("engine.store.paths", fromlist=["x"]).cache_dir(),
    "KVSCOPE_CONFIG_DIR": lambda: __import__("engine.store.paths", fromlist=["x"]).config_dir(),
    "KVSCOPE_DATA_DIR": lambda: _history_at_env(),
    "KVSCOPE_FAULTS": lambda: __import__("engine.run.faults", fromlist=["x"]).from_env(),
    "KVSCOPE_EMBEDDED_GGUF": lambda: __import__("engine.model.models", fromlist=["x"]).resolve_source("embedded"),
    "KVSCOPE_PACKAGE_AUTOTUNE": lambda: __import__("engine.model.packaged", fromlist=["x"]).options(),
    "KVSCOPE_API_KEY": lambda: __import__("engine.serve.client", fromlist=["x"])._headers(
        __import__("engine.serve.client", fromlist=["x"]).address("http://127.0.0.1:9")),
    "KVSCOPE_PREFILL_PACKAGE": lambda: None,
    "OLLAMA_MODELS": lambda: __import__("engine.model.found", fromlist=["x"]).find_models()[1],
    "LLAMA_CACHE": lambda: __import__("engine.model.found", fromlist=["x"]).find_models()[1],
    "HF_HUB_CACHE": lambda: __import__("engine.model.found", fromlist=["x"]).find_models()[1],
}


MAX_ARG_STRLEN = 128 * 1024
FOLDERS = ("KVSCOPE_CACHE_DIR", "KVSCOPE_CONFIG_DIR", "KVSCOPE_DATA_DIR", "OLLAMA_MODELS", "LLAMA_CACHE",
           "HF_HUB_CACHE")


def _history_at_env() -> str:
    """The run history where the variable says: opened, one run's worth of nothing read back, closed."""
    from engine.output.history import History

    history = History()
    try:
        return f"{len(history.runs())} runs; {history.problem}"
    finally:
        history.close()


def _environment(data: bytes, work: Path) -> object:
    """One variable KVScope reads, set to the fuzzed value as a program can receive it: a NUL cannot be in an
    environment (dropped), and no value longer than Linux's ``MAX_ARG_STRLEN`` (128 KiB) reaches a program it
    starts (cut there: a 70 MiB value set in-process left 70 MiB of the child's address space mapped each time)."""
    names = sorted(ENVIRONMENT)
    name, _, value = data.partition(b"=")
    value = value[:MAX_ARG_STRLEN - 1]
    key = name.decode("utf-8", "replace")
    key = key if key in ENVIRONMENT else names[len(name) % len(names)]
    text = value.replace(b"\x00", b"").decode("utf-8", "surrogateescape")
    if key in FOLDERS and not os.path.isabs(text):
        text = str(work / text)                    # a relative folder is made where the test is
    elif key == "KVSCOPE_DATA_DIR":                # opening the history makes its folder: under the test's, too
        text = str(work / text.lstrip("/"))
    saved = os.environ.get(key)
    os.environ[key] = text
    try:
        return ENVIRONMENT[key]()
    finally:
        if saved is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = saved


def _environment_seeds() -> list[bytes]:
    values = {"KVSCOPE_THREADS": b"fixed", "KVSCOPE_LINEAR": b"aten", "KVSCOPE_CACHE_DIR": b"cache",
              "KVSCOPE_CONFIG_DIR": b"config", "KVSCOPE_DATA_DIR": b"data",
              "KVSCOPE_FAULTS": b"decode:3:fail,prefill:1:sleep=0.01",
              "KVSCOPE_EMBEDDED_GGUF": b"/nonexistent/model.gguf", "KVSCOPE_PACKAGE_AUTOTUNE": b"0",
              "KVSCOPE_API_KEY": b"sk-123", "KVSCOPE_PREFILL_PACKAGE": b"always", "OLLAMA_MODELS": b"ollama",
              "LLAMA_CACHE": b"llama", "HF_HUB_CACHE": b"hub"}
    return [k.encode() + b"=" + v for k, v in values.items()]


def _warm_history() -> None:
    import sqlite3  # noqa: F401

    import engine.output.history  # noqa: F401
    import engine.output.trace  # noqa: F401


def _warm_torch() -> None:
    import torch  # noqa: F401

    import engine.model.models  # noqa: F401


def _warm_environment() -> None:
    _warm_torch()
    for module in ("engine.model.threads", "engine.model.kernels", "engine.store.paths", "engine.run.faults",
                   "engine.model.packaged", "engine.serve.client", "engine.model.found",
                   "engine.output.history", "sqlite3", "huggingface_hub.errors", "transformers.integrations.ggml"):
        __import__(module)
    from huggingface_hub import constants, scan_cache_dir  # noqa: F401 - imported on first use


def _targets() -> dict[str, Target]:
    from engine.facts.errors import EngineError
    from engine.model.chat_template import PromptError

    clear = (EngineError, Said)
    template_seeds = [json.loads(p.read_text()).get("chat_template", "").encode()
                      for p in sorted((ROOT / "tests").glob("**/tokenizer_config.json"))][:3]
    template_seeds += [b"{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}<|assistant|>",
                       b"{{ bos_token }}{% for m in messages %}{{ m['content'] | trim }}{% endfor %}"]
    targets = [
        Target("trace", "a trace file (.kvscope.jsonl, .gz), whole or cut", _course_traces, _trace, clear,
               "t.kvscope.jsonl", json_lines=True),
        Target("export", "a trace exported to Perfetto and OTLP files", _course_traces, _export, (Said,),
               "t.kvscope.jsonl", json_lines=True, warm=faults.warm_sdk),
        Target("workload", "a workload JSONL file", lambda: [(ROOT / "resources/workloads/three-assistants.jsonl")
                                                              .read_bytes()], _workload, clear, "w.jsonl",
               json_lines=True),
        Target("lecture", "a lecture file", lambda: [(COURSE / "course.kvscope-lecture.json").read_bytes(),
                                                     b'{"kvscope": "lecture", "version": 1, "scenes": [{"scene": '
                                                     b'"prefill", "traces": ["run.kvscope.jsonl.gz"]}]}'],
               _lecture, clear, "l.kvscope-lecture.json", json_lines=True),
        Target("config", "a model folder's config.json", _config_seeds, _config, clear,
               ("config.json", "fuzzed-folder"), json_lines=True, warm=_warm_torch),
        Target("chat-template", "a model's chat template", lambda: template_seeds, _template, (PromptError,),
               "fuzzed-model", exec_from=("jinja2",), imports=("jinja2",)),
        Target("settings", "the settings file (INI)", lambda: [
            b"[run]\ntemperature=0.7\ntop_k=50\ntop_p=0.9\nseed=42\nmax_new_tokens=64\ndtype=bfloat16\n"
            b"[history]\nmax_runs=20\n"], _settings, (), refuses=False),
        Target("sealed", "a cache file's seal", lambda: [b"0" * 64, b"", b"\xff" * 100], _sealed,
               clear, "table.json", accepts=False),               # a seal not made with this user's key: never taken
        Target("key", "the user's cache key", lambda: [os.urandom(32), b"", b"short"], _key, clear, "key"),
        Target("gguf", "a GGUF file's header and metadata", _gguf_seeds, _gguf, clear, "m.gguf",
               warm=_warm_torch),
        Target("ollama-manifest", "an Ollama manifest naming a model's GGUF blob", lambda: [json.dumps({"layers": [
            {"mediaType": "application/vnd.ollama.image.model", "digest": "sha256:" + "a" * 64}]}).encode()],
               _ollama_manifest, clear, json_lines=True, refuses=False, warm=_warm_environment),
        Target("history", "the run history (a SQLite file)", _history_seeds, _history, (_history_error(),),
               "history.sqlite", refuses=False, warm=_warm_history),
        Target("metrics", "a /metrics page (Prometheus text)", lambda: [(FIXTURES / n).read_bytes() for n in (
            "vllm_metrics.txt", "llamacpp_metrics.txt", "tgi_metrics.txt", "vllm_pd_decode_metrics.txt")],
               _metrics, clear),
        Target("slots", "llama-server's /slots answer", lambda: [(FIXTURES / "llamacpp_slots.json").read_bytes()],
               _slots, clear, json_lines=True),
        Target("kv-events", "a KV-event payload (msgpack)", _kv_event_seeds, _kv_events, clear),
        Target("kv-frames", "ZMQ frames around KV events", lambda: [b"kv@1\x00\xfe" + (1).to_bytes(8, "big")
                                                                    + b"\x00\xfe" + p for p in _kv_event_seeds()[:4]],
               _zmq, clear),
        Target("probe", "a server's /v1/models, /props and /metrics answers",
               lambda: [(FIXTURES / n).read_bytes() for n in ("llamacpp_models.json", "llamacpp_props.json")],
               _probe, clear, json_lines=True),
        Target("discover", "what a port answers when KVScope looks for engines", lambda: [
            b'{"version": "0.5.7"}', b'{"models": [{"name": "llama3.2:latest"}]}', b'{"model_id": "m", "router": "r"}',
            (FIXTURES / "llamacpp_props.json").read_bytes(), (FIXTURES / "llamacpp_models.json").read_bytes()],
               _discover, clear, json_lines=True, refuses=False),
        Target("stream", "a server's streamed answer (SSE)", lambda: [(FIXTURES / n).read_bytes() for n in (
            "vllm_stream.txt", "llamacpp_stream.txt", "vllm_stream_recorded.txt")], _stream, clear),
        Target("http", "HTTP framing: status line, headers, chunk sizes", lambda: _http_seeds("llamacpp_models.json"),
               _framing, clear, accepts=False),
        Target("collector", "an OTLP collector's answer", lambda: _http_seeds("llamacpp_props.json"), _collector,
               clear, warm=faults.warm_sdk),
        Target("environment", "the environment variables KVScope reads", _environment_seeds, _environment, clear,
               warm=_warm_environment),
    ]
    targets += faults.targets()
    return {t.name: t for t in targets}


class _Lazy(dict):
    def _load(self) -> None:
        if not super().__len__():
            self.update(_targets())

    def __getitem__(self, key: str) -> Target:
        self._load()
        return super().__getitem__(key)

    def __iter__(self):
        self._load()
        return super().__iter__()

    def __len__(self) -> int:
        self._load()
        return super().__len__()

    def keys(self):
        self._load()
        return super().keys()

    def values(self):
        self._load()
        return super().values()

    def items(self):
        self._load()
        return super().items()


TARGETS: dict[str, Target] = _Lazy()


def target_named(name: str) -> Target:
    """A target of ``TARGETS``, or one of the harness's own planted faults (``planted:...``, its tests)."""
    if name.startswith("planted:"):
        from tests.fuzz.planted import PLANTED

        return PLANTED[name]
    return TARGETS[name]

# Each module of the product that opens a file or a socket, and the targets that feed it bad input (or, for one
# that reads only what KVScope wrote itself or the machine's own files, why it needs none).
READERS = {
    "engine/output/trace.py": ("trace", "export", "odd-files", "outputs"),
    "engine/facts/bounded.py": ("lecture", "config", "odd-files"),
    "engine/output/perfetto.py": ("export", "outputs"),
    "engine/output/otlp.py": ("export", "collector", "slow-peers", "outputs"),
    "engine/serve/workload.py": ("workload", "odd-files"),
    "app/lecture/lecture_file.py": ("lecture", "odd-files", "outputs"),
    "engine/facts/config_facts.py": ("config", "odd-files"),
    "engine/model/models.py": ("config", "gguf", "environment", "odd-files"),
    "engine/model/gguf.py": ("gguf", "odd-files"),
    "engine/model/gguf_header.py": ("gguf", "odd-files"),
    "engine/model/found.py": ("ollama-manifest", "gguf", "environment"),
    "engine/model/chat_template.py": ("chat-template",),
    "app/shell/settings.py": ("settings", "environment"),
    "engine/store/sealed.py": ("sealed", "key", "odd-files"),
    "engine/store/paths.py": ("environment",),
    "engine/store/files.py": ("outputs",),
    "engine/serve/metrics.py": ("metrics", "probe"),
    "engine/serve/slots.py": ("slots",),
    "engine/serve/kv_events.py": ("kv-events", "kv-frames"),
    "engine/serve/client.py": ("probe", "stream", "http", "slow-peers", "environment"),
    "engine/serve/remote.py": ("probe", "stream", "http", "slow-peers"),
    "engine/serve/discover.py": ("discover", "slow-peers"),
    "engine/model/threads.py": ("environment",),
    "engine/model/kernels.py": ("environment",),
    "engine/model/packaged.py": ("environment",),
    "engine/model/embedded.py": ("environment",),
    "engine/run/faults.py": ("environment",),
    "engine/output/history.py": ("history", "environment"),
    "app/views/export.py": ("outputs",),
    "app/shell/file_actions.py": ("outputs",),
    "app/lecture/render.py": ("outputs",),
    # Read only what KVScope itself wrote, or the machine's own files: no input from anyone else.
    "engine/model/compiled.py": "its compile cache folder, under the sealed cache",
    "engine/model/compiled_prefill.py": "KVSCOPE_PREFILL_PACKAGE, a switch compared with one word",
    "engine/run/kv_handover.py": "messages from its own child process over a pipe it made (bounded: MAX_MESSAGE)",
    "engine/facts/contention.py": "/proc/stat, the kernel's own counters",
    "engine/facts/kv_methods.py": "a text shipped inside the package",
    "engine/model/hardware.py": "/proc/cpuinfo and /sys, the kernel's own",
    "engine/model/memory.py": "/proc/meminfo and /proc/self/status, the kernel's own",
    "engine/store/resources.py": "files shipped inside the package",
    "app/main.py": "sets its own environment for the self-test and screenshots",
    "app/shell/selftest.py": "the self-test's own temporary files",
    "app/shell/window.py": "the ZMQ context it closes at exit",
}
