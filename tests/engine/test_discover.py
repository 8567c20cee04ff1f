"""The serving engines on this computer are told by their own endpoints, never by their port. Each engine's answers
here are shaped from its API's documented examples (Ollama's /api/version and /api/ps, LM Studio's /api/v0/models,
TGI's /info, SGLang's /get_server_info) or from the recorded llama-server answers in tests/fixtures."""

from __future__ import annotations

import json
import socket
import threading

import pytest

from engine import cli
from engine.serve import client
from engine.serve.discover import find_servers
from tests.replay_server import ReplayServer, Route

FIXTURES = __import__("pathlib").Path(__file__).resolve().parents[1] / "fixtures"


def js(value: object) -> Route:
    return Route(body=json.dumps(value).encode())


ENGINES = {
    "Ollama": {"GET /api/version": js({"version": "0.5.7"}),
               "GET /api/ps": js({"models": [{"name": "llama3.2:latest", "size": 5137025024,
                                              "size_vram": 5137025024, "context_length": 4096}]}),
               "GET /v1/models": js({"object": "list", "data": [{"id": "llama3.2:latest", "owned_by": "library"}]})},
    "LM Studio": {"GET /api/v0/models": js({"object": "list", "data": [
                      {"id": "qwen2-vl-7b-instruct", "type": "vlm", "state": "not-loaded"},
                      {"id": "meta-llama-3.1-8b-instruct", "type": "llm", "state": "loaded"}]}),
                  "GET /v1/models": js({"data": [{"id": "meta-llama-3.1-8b-instruct",
                                                   "owned_by": "organization_owner"}]})},
    "TGI": {"GET /info": js({"model_id": "HuggingFaceTB/SmolLM2-135M-Instruct", "version": "3.0.1",
                             "max_input_tokens": 4095, "router": "text-generation-router"})},
    "SGLang": {"GET /get_server_info": js({"model_path": "HuggingFaceTB/SmolLM2-135M-Instruct", "version": "0.4.1"}),
               "GET /v1/models": js({"data": [{"id": "smollm2", "owned_by": "sglang"}]})},
    "llama.cpp": {"GET /props": Route(body=(FIXTURES / "llamacpp_props.json").read_bytes()),
                  "GET /v1/models": Route(body=(FIXTURES / "llamacpp_models.json").read_bytes())},
    "vLLM": {"GET /version": js({"version": "0.32.0"}),
             "GET /v1/models": js({"data": [{"id": "smollm2", "owned_by": "vllm"}]})},
    "OpenAI-compatible server": {"GET /v1/models": js({"data": [{"id": "m", "owned_by": "someone"}]})},
    "not a known engine": {"GET /": Route(body=b"<html>Welcome to nginx</html>", content_type="text/html")},
}


def port_of(server: ReplayServer) -> int:
    return int(server.url.rsplit(":", 1)[1])


def test_each_engine_is_told_by_its_own_endpoints_and_only_openai_ones_are_attachable():
    servers = {name: ReplayServer(routes) for name, routes in ENGINES.items()}
    with servers["Ollama"], servers["LM Studio"], servers["TGI"], servers["SGLang"], servers["llama.cpp"], \
            servers["vLLM"], servers["OpenAI-compatible server"], servers["not a known engine"]:
        closed = socket.socket()
        closed.bind(("127.0.0.1", 0))
        nobody = closed.getsockname()[1]
        closed.close()                                         # a port nothing listens on: left out
        ports = {port_of(s): name for name, s in servers.items()}
        found = {f.port: f for f in find_servers([*ports, nobody])}
    assert set(found) == set(ports)
    assert {ports[p]: f.engine for p, f in found.items()} == {name: name for name in ENGINES}
    by = {f.engine: f for f in found.values()}
    assert (by["Ollama"].version, by["Ollama"].models) == ("0.5.7", ("llama3.2:latest",))
    assert by["Ollama"].loaded == ("llama3.2:latest, 4.78 GiB in memory, 100% of it in GPU memory, loaded with a "
                                   "4,096-position context (as Ollama reports)",)
    assert by["LM Studio"].models == ("meta-llama-3.1-8b-instruct",)
    assert (by["TGI"].version, by["TGI"].models) == ("3.0.1", ("HuggingFaceTB/SmolLM2-135M-Instruct",))
    assert by["vLLM"].version == "0.32.0" and by["SGLang"].models == ("smollm2",)
    assert {f.engine for f in found.values() if f.attachable} == {"Ollama", "LM Studio", "SGLang", "llama.cpp",
                                                                  "vLLM", "OpenAI-compatible server"}
    assert not by["not a known engine"].attachable and "not as any serving engine" in by["not a known engine"].notes[0]


@pytest.mark.parametrize("first", ["the headers' deadline", "the socket's timeout"])
def test_a_port_that_takes_a_connection_and_never_answers_is_said_within_the_deadline(capsys, monkeypatch, first):
    """Both clocks end at the deadline; on a busy machine either may be seen first, and the verdict is the same."""
    if first == "the socket's timeout":                        # the headers' timer as late as a busy machine makes it
        monkeypatch.setattr(client._HeadsDeadline, "__init__",
                            lambda self, seconds: (setattr(self, "seconds", seconds + 5.0),
                                                   setattr(self, "passed", False)) and None)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        listener.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(listener.accept()[0])
            except OSError:
                continue

    threading.Thread(target=accept, daemon=True).start()
    port = listener.getsockname()[1]
    try:
        assert cli.main(["servers", "--ports", str(port), "--json"]) == 0
    finally:
        stop.set()
        listener.close()
    (silent,) = json.loads(capsys.readouterr().out)["servers"]
    assert silent["engine"] == "not a known engine" and not silent["attachable"]
    assert "did not answer within 1.5 s" in silent["notes"][0]
