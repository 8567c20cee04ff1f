"""The three faults beside bad bytes, each a table of cases over every reader, client and writer:

- ``odd-files``: every path KVScope opens, as a FIFO, a link to ``/dev/zero``, a sparse file of 8 GiB, a folder,
  an unreadable file, a dangling link and another user's file: a result or a one-line refusal naming the path,
  within the time cap (a FIFO read whole never ends; ``/dev/zero`` never ends and fills memory).
- ``slow-peers``: every client of a server or a collector against a peer that drips its status line, its headers
  or its body a byte at a time, one that never answers, one that sends a body of 256 MiB and one that closes
  early: each call ends within its deadline (plus ``SLACK_S``) from the first byte sent.
- ``outputs``: every command that writes a file, given as output one of its inputs, a symbolic or hard link to one,
  an existing file, a folder, a missing folder and a full disk: inputs never touched, and nothing reported written
  that was not.
"""

from __future__ import annotations

import contextlib
import io
import os
import resource
import shutil
from collections.abc import Callable
from pathlib import Path

from tests.fuzz import peers
from tests.fuzz.harness import Said, Target

ROOT = Path(__file__).resolve().parents[2]
COURSE = ROOT / "resources" / "course"
DEADLINE_S = 0.5
SLACK_S = 2.0
SPARSE = 8 << 30


def cli(argv: list[str]) -> str:
    """``python -m engine ARGV`` in this process: its output, or ``Said`` with what it printed to stderr."""
    from engine import cli as engine_cli

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = engine_cli.main(argv)
    if code:
        raise Said(err.getvalue().strip())
    return out.getvalue()


def ended(end: object) -> str:
    """A run's end: a failed run's message is what the user reads, judged like a refusal."""
    from engine.facts.events import RunFailed

    if isinstance(end, RunFailed):
        raise Said(end.message)
    return type(end).__name__


# ---- odd files ------------------------------------------------------------------------------------------------

def _read_trace(path: Path) -> object:
    from engine.output.trace import read_trace

    return read_trace(path)


def _read_workload(path: Path) -> object:
    from engine.serve.workload import read_workload

    return read_workload(path, 8)


def _read_lecture(path: Path) -> object:
    from app.lecture.lecture_file import read_lecture

    return read_lecture(path)


def _read_config(path: Path) -> object:
    from engine.facts import config_facts

    path.parent.mkdir(exist_ok=True)
    return config_facts.read(path.parent)


def _read_gguf(path: Path) -> object:
    from engine.model import gguf_header, models

    models.resolve_source(str(path))
    return gguf_header.read(path)


def _read_sealed(path: Path) -> object:
    from engine.store import sealed

    (path.parent / (path.name + ".seal")).write_text("0" * 64)
    return sealed.read_sealed(path, "KVScope's record", aside=False)


def _read_seal(path: Path) -> object:
    from engine.store import sealed

    data = path.with_name(path.name.removesuffix(".seal"))
    data.write_text("{}")
    return sealed.read_sealed(data, "KVScope's record", aside=False)


def _read_key(path: Path) -> object:
    """The seal key, where ``KVSCOPE_CONFIG_DIR`` says it is."""
    from engine.store import sealed

    os.chmod(path.parent, 0o700)                      # private, as KVScope makes it: the odd file is what is tried
    os.environ["KVSCOPE_CONFIG_DIR"] = str(path.parent)
    try:
        return len(sealed._key())
    finally:
        del os.environ["KVSCOPE_CONFIG_DIR"]


def _read_settings(path: Path) -> object:
    from app.shell.settings import open_settings

    os.environ["KVSCOPE_SETTINGS"] = str(path)
    try:
        settings, problem = open_settings()
        return settings.allKeys(), problem
    finally:
        del os.environ["KVSCOPE_SETTINGS"]


OPENERS: dict[str, tuple[str, Callable[[Path], object]]] = {
    "trace": ("odd.kvscope.jsonl", _read_trace),
    "workload": ("odd.jsonl", _read_workload),
    "lecture": ("odd.kvscope-lecture.json", _read_lecture),
    "config": ("odd/config.json", _read_config),
    "gguf": ("odd.gguf", _read_gguf),
    "sealed": ("odd.json", _read_sealed),
    "seal": ("odd.json.seal", _read_seal),
    "settings": ("odd.ini", _read_settings),
    "key": ("odd/seal.key", _read_key),
}
ODD = ("fifo", "dev-zero", "sparse", "folder", "unreadable", "dangling", "other-user")


def make_odd(path: Path, case: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if case == "fifo":
        os.mkfifo(path)
    elif case == "dev-zero":
        os.symlink("/dev/zero", path)
    elif case == "sparse":
        with open(path, "wb") as f:
            f.truncate(SPARSE)
    elif case == "folder":
        path.mkdir()
    elif case == "unreadable":
        path.write_bytes(b'{"a": 1}\n')
        os.chmod(path, 0)
    elif case == "dangling":
        os.symlink(path.parent / "nowhere", path)
    elif case == "other-user":
        path.write_bytes(b'{"a": 1}\n')
        with contextlib.suppress(PermissionError):
            os.chown(path, 65534, 65534)


def _odd_file(data: bytes, work: Path) -> object:
    reader, _, case = data.decode().partition(":")
    name, read = OPENERS[reader]
    path = work / name
    with _file_size_cap(SPARSE + 1):
        make_odd(path, case)
    return read(path)


# ---- slow peers -----------------------------------------------------------------------------------------------

def _probe(url: str) -> object:
    from engine.serve import remote

    return remote.probe(url, timeout=DEADLINE_S, deadline_s=DEADLINE_S)


def _metrics_poll(url: str) -> object:
    from engine.serve import client

    return client.get_text(client.address(url), "/metrics", timeout=DEADLINE_S)


def _slots_poll(url: str) -> object:
    from engine.serve import client

    return client.get_json(client.address(url), "/slots", timeout=DEADLINE_S)


def _tokenize(url: str) -> object:
    from engine.serve import client

    return client.tokenize(client.address(url), "m", [{"role": "user", "content": "hi"}], timeout=DEADLINE_S)


def _stream(url: str) -> object:
    from engine.facts.params import GenerationParams
    from engine.serve import remote

    facts = remote.ServerFacts(name="m", url=url, engine="vLLM", context=4096, metrics=False, reveals=[])
    session = remote.RemoteSession(facts, timeout=DEADLINE_S, deadline_s=DEADLINE_S)
    return ended(session.run("What is a KV cache?", GenerationParams(max_new_tokens=4, seed=1)))


def _collector(url: str) -> object:
    from engine.output import otlp

    return otlp.send_spans(url + "/v1/traces", [], timeout_s=DEADLINE_S)


def _discover(url: str) -> object:
    from engine.serve import discover

    found = discover.identify(url, int(url.rsplit(":", 1)[1]), deadline_s=DEADLINE_S)
    return found.engine if found else None


CLIENTS: dict[str, Callable[[str], object]] = {"probe": _probe, "metrics": _metrics_poll, "slots": _slots_poll,
                                               "tokenize": _tokenize, "stream": _stream, "collector": _collector,
                                               "discover": _discover}
_OK = b'{"data": [{"id": "m"}]}'
PEERS = {
    "drip-status": peers.Answer((b"HTTP/1.1 200 OK\r\n", b"Content-Length: 2\r\n\r\n{}"), (True, False), 0.2),
    "drip-headers": peers.Answer((b"HTTP/1.1 200 OK\r\n", b"Content-Type: application/json\r\nX-Slow: "
                                  + b"y" * 40 + b"\r\n\r\n"), (False, True), 0.1),
    "drip-body": peers.Answer((peers.OK_HEAD % (b"application/json", len(_OK) + 60), _OK + b" " * 60),
                              (False, True), 0.1),
    "drip-stream": peers.Answer((b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n\r\n",
                                 b'data: {"choices": [{"delta": {"content": "a"}}]}\n\n' * 20), (False, True), 0.02),
    "silent": peers.Answer(silent=True),
    "huge-body": peers.Answer((b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n\r\n", b"[" * (256 << 20))),
    "close-early": peers.Answer((b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n{\"da",)),
}
_peer: list[peers.Peer] = []


def _slow_peer(data: bytes, work: Path) -> object:
    client, _, case = data.decode().partition(":")
    if not _peer:
        _peer.append(peers.Peer())
    _peer[0].answer = PEERS[case]
    return peers.timed(lambda: CLIENTS[client](_peer[0].url), DEADLINE_S + SLACK_S)


# ---- outputs --------------------------------------------------------------------------------------------------

def _perfetto(out: Path, given: Path) -> str:
    return cli(["perfetto", str(given), "--out", str(out)])


def _otlp(out: Path, given: Path) -> str:
    return cli(["otlp", str(given), "--out", str(out)])


def _trace(out: Path, given: Path) -> str:
    """The window's Save run as trace: what it says on a failure (``FileActions.save_trace``)."""
    from engine.output.trace import read_trace, write_checked

    events = list(read_trace(given))
    try:
        return str(write_checked(out, events).path)
    except OSError as exc:
        raise Said(f"Could not save the trace to {out}: {exc.strerror or exc}. Any file that was there is "
                   "unchanged.") from None


def _lecture(out: Path, given: Path) -> str:
    """The course's lecture file, written after its traces (``python -m app.lecture.course``: an OSError is one
    line there)."""
    from app.lecture.lecture_file import LectureScene, write_lecture

    try:
        return str(write_lecture(out, [LectureScene("prefill", (given,))]))
    except OSError as exc:
        raise Said(f"error: {exc.strerror or exc} ({out})") from None


def _export(out: Path, given: Path) -> str:
    """The window's Export run data (``FileActions.export_run``: what it says on a failure)."""
    from engine.store.files import write_text

    try:
        return str(write_text(out, "run,1\n", "the export"))
    except OSError as exc:
        raise Said(f"Could not write {out}: {exc.strerror or exc}. Any file that was there is unchanged.") from None


# name -> (write, whether it reads inputs): a writer of what it holds in memory has no input to protect.
WRITERS: dict[str, tuple[Callable[[Path, Path], str], bool]] = {
    "perfetto": (_perfetto, True), "otlp": (_otlp, True), "lecture": (_lecture, True), "trace": (_trace, False),
    "export": (_export, False)}
OUTPUT_CASES = ("input", "link", "hardlink", "existing", "folder", "missing-folder", "full-disk")
INPUT_CASES = ("input", "link", "hardlink")


@contextlib.contextmanager
def _file_size_cap(most: int):
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (most, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


def _output(data: bytes, work: Path) -> object:
    writer, _, case = data.decode().partition(":")
    given = work / "in.kvscope.jsonl.gz"
    shutil.copyfile(COURSE / "run.kvscope.jsonl.gz", given)
    before = given.read_bytes()
    out = {"input": given, "link": work / "link.json", "hardlink": work / "hard.json", "existing": work / "old.json",
           "folder": work / "folder", "missing-folder": work / "no" / "out.json",
           "full-disk": work / "out.json"}[case]
    if case == "link":
        os.symlink(given, out)
    elif case == "hardlink":
        os.link(given, out)
    elif case in ("existing", "full-disk"):
        out.write_bytes(b"the user's own file\n")
    elif case == "folder":
        out.mkdir()
    existing = out.read_bytes() if out.is_file() else None
    try:
        with _file_size_cap(0 if case == "full-disk" else 256 << 20):
            said = WRITERS[writer][0](out, given)
    except BaseException:
        _check(given, before, out, existing, written=False)
        raise
    _check(given, before, out, existing, written=True)
    if case in ("input", "link", "hardlink", "folder", "missing-folder", "full-disk"):
        raise AssertionError(f"{writer} to {case} reported success: {said.strip()[:200]}")
    return said


def _check(given: Path, before: bytes, out: Path, existing: bytes | None, written: bool) -> None:
    if given.read_bytes() != before:
        raise AssertionError("the command wrote over its input")
    if written:
        if not out.is_file() or out.stat().st_size == 0:
            raise AssertionError(f"reported written, but {out.name} is missing or empty")
    elif existing is not None and out.is_file() and out.read_bytes() != existing:
        raise AssertionError(f"failed, but changed the file that was at {out.name}")


def warm_sdk() -> None:
    """What the writers and the collector's client import on first use (the OTLP SDK, its HTTP exporter)."""
    import opentelemetry.exporter.otlp.proto.http.trace_exporter  # noqa: F401
    import opentelemetry.sdk.trace.export  # noqa: F401
    from google.protobuf import json_format  # noqa: F401

    import app.lecture.lecture_file  # noqa: F401
    import engine.cli  # noqa: F401
    import engine.serve.discover  # noqa: F401
    from engine.output import otlp
    from engine.output.trace import read_trace

    otlp._sdk()
    read_trace(COURSE / "run.kvscope.jsonl.gz")


def _warm_readers() -> None:
    import torch  # noqa: F401

    import app.lecture.lecture_file  # noqa: F401
    import app.shell.settings  # noqa: F401
    import engine.facts.config_facts  # noqa: F401
    import engine.model.gguf_header  # noqa: F401
    import engine.model.models  # noqa: F401
    import engine.serve.workload  # noqa: F401
    import engine.store.sealed  # noqa: F401


def targets() -> list[Target]:
    from engine.facts.errors import EngineError
    from engine.store.files import WriteRefused

    clear = (EngineError, WriteRefused, Said)
    return [
        Target("odd-files", "every opened path as a FIFO, /dev/zero, a sparse 8 GiB file, a folder, ...",
               lambda: [f"{r}:{c}".encode() for r in OPENERS for c in ODD], _odd_file, clear, "odd", mutate=False,
               time_cap_s=5.0, warm=_warm_readers),
        Target("slow-peers", "every client against dripping, silent, huge and early-closing peers",
               lambda: [f"{c}:{p}".encode() for c in CLIENTS for p in PEERS], _slow_peer, clear, mutate=False,
               time_cap_s=DEADLINE_S + SLACK_S + 2.0,
               warm=warm_sdk),
        Target("outputs", "every written output as its input, a link, a folder, a full disk, ...",
               lambda: [f"{w}:{c}".encode() for w, (_, reads) in WRITERS.items() for c in OUTPUT_CASES
                        if reads or c not in INPUT_CASES], _output, clear, mutate=False, warm=warm_sdk),
    ]
