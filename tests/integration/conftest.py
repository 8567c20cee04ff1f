"""A real llama.cpp ``llama-server`` on the embedded model's GGUF, on 127.0.0.1 and a free port, for the tests
that watch a serving engine. ``make test-integration`` builds the binary from llama.cpp's source (as vendored in
the llama-cpp-python sdist on PyPI) and names it in ``KVSCOPE_LLAMA_SERVER``; without it these tests fail and say
how to get it (they never skip: a skipped integration test proves nothing)."""

from __future__ import annotations

import os
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

SLOTS = 4                  # parallel requests the server decodes together
CONTEXT = 4096             # positions, shared by the slots


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def llama_server(tmp_path_factory):
    binary = os.environ.get("KVSCOPE_LLAMA_SERVER", "")
    if not binary or not Path(binary).is_file():
        pytest.fail("KVSCOPE_LLAMA_SERVER does not name a llama-server binary: run `make test-integration`, which "
                    "builds one and sets it", pytrace=False)
    from engine import embedded

    port = free_port()
    log = tmp_path_factory.mktemp("llama-server") / "server.log"
    with log.open("w") as out:
        process = subprocess.Popen([binary, "-m", str(embedded.embedded_gguf()), "--host", "127.0.0.1", "--port",
                                    str(port), "--metrics", "-c", str(CONTEXT), "-np", str(SLOTS), "-t", "2"],
                                   stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as answer:
                if answer.status == 200:
                    break
        except OSError:
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            pytest.fail(f"llama-server did not start: {log.read_text()[-2000:]}", pytrace=False)
        time.sleep(0.25)
    yield url
    process.terminate()
    try:
        process.wait(10)
    except subprocess.TimeoutExpired:
        process.kill()
