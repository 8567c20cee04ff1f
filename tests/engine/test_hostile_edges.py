"""The edges KVScope grew, tried as an attacker and as an unlucky user would: where traces are written, what a
server it does not control sends (forever, a byte at a time, nested, in one endless line, with terminal
escapes, with credentials in its address), signals mid-run, a full disk, and traces joined, BOM-marked or
holding numbers no event has. Each ends in one clear line with what was received kept."""

from __future__ import annotations

import base64
import dataclasses
import errno
import json
import os
import select
import signal
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import pytest

from engine import cli
from engine.facts.errors import TraceError
from engine.facts.events import RunFailed, RunFinished, RunStarted, TokenStep
from engine.facts.params import GenerationParams
from engine.output.trace import MAX_CONTAINERS, MAX_LINE_BYTES, VERSION, read_trace, write_trace
from engine.serve.client import API_KEY_ENV, RemoteError
from engine.serve.remote import RemoteSession, probe
from engine.store import files
from tests.replay_server import ReplayServer, Route, chunk, drip, endless, endless_line, llamacpp_routes, streaming

ROOT = Path(__file__).resolve().parents[2]
ESCAPES = "\x1b]0;owned\x07\x1b[2J\u202e\x00"          # set-title, clear-screen, bidi override, NUL


def stream_route(stream) -> Route:
    return Route(content_type="text/event-stream", stream=stream)


def run_cli(argv: list[str], capsys) -> tuple[int, str, str]:
    code = cli.main(argv)
    out, err = capsys.readouterr()
    return code, out, err


# --- where traces are written --------------------------------------------------------------------------------
@pytest.mark.parametrize("target, kind", [("/dev/null", "a device"), ("fifo", "a FIFO (named pipe)")])
def test_a_trace_onto_a_device_or_fifo_is_refused_before_the_run_and_the_node_is_left_alone(tmp_path, capsys,
                                                                                           target, kind):
    path = Path(target) if target.startswith("/") else tmp_path / target
    if target == "fifo":
        os.mkfifo(path)
    before = os.stat(path).st_mode
    code, _out, err = run_cli(["--model", "/no/such/model", "--prompt", "hi", "--trace", str(path)], capsys)
    assert code == 2 and f"{path} is {kind}: KVScope writes the trace only to an ordinary file" in err
    assert os.stat(path).st_mode == before and err.count("\n") == 1


def test_a_trace_through_a_symlink_replaces_the_file_it_points_to_and_keeps_the_link(tmp_path, tiny):
    real = tmp_path / "real.jsonl"
    real.write_text("old")
    link = tmp_path / "link.jsonl"
    link.symlink_to(real)
    events: list = []
    from engine.run.session import Session

    Session(tiny).run("hi", GenerationParams(max_new_tokens=2), events.append)
    write_trace(link, events)
    assert link.is_symlink() and os.readlink(link) == str(real)
    assert read_trace(real) == events


def test_a_full_disk_is_one_line_and_the_previous_trace_is_intact(tmp_path, capsys, monkeypatch):
    previous = tmp_path / "run.jsonl"
    previous.write_text("the previous trace")
    with ReplayServer(llamacpp_routes()) as server:
        def full(_fd):
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(files.os, "fsync", full)
        code, _out, err = run_cli(["--server", server.url, "--prompt", "hi", "--max-new-tokens", "4", "--trace",
                                   str(previous)], capsys)
    assert code == 2 and "could not write the trace to" in err and "No space left on device" in err
    assert "Traceback" not in err and previous.read_text() == "the previous trace"
    assert [p.name for p in tmp_path.iterdir()] == ["run.jsonl"]           # no temporary file left behind


def test_perfetto_export_is_atomic_on_a_full_disk_and_escapes_a_hostile_file_name(tmp_path, capsys, monkeypatch,
                                                                                  tiny):
    from engine.run.session import Session

    events: list = []
    Session(tiny).run("hi", GenerationParams(max_new_tokens=2), events.append)
    trace = write_trace(tmp_path / "run.jsonl", events)
    out = tmp_path / "run.perfetto.json"
    out.write_text("previous")
    monkeypatch.setattr(files.os, "fsync", lambda _fd: (_ for _ in ()).throw(OSError(errno.ENOSPC, "No space")))
    code, _o, err = run_cli(["perfetto", str(trace), "--out", str(out)], capsys)
    assert code != 0 and "No space" in err and out.read_text() == "previous" and "Traceback" not in err
    monkeypatch.undo()
    hostile = tmp_path / f"bad{ESCAPES.replace(chr(0), '')}.jsonl"
    code, _o, err = run_cli(["perfetto", str(hostile), "--out", str(tmp_path / "x.json")], capsys)
    assert code == 2 and "\x1b" not in err and "\u202e" not in err and "\\x1b" in err


@pytest.mark.parametrize("command", ["perfetto", "otlp"])
@pytest.mark.parametrize("reach", ["the same name", "a symlink", "a hard link"])
def test_an_export_onto_one_of_its_own_traces_is_refused_and_the_trace_is_untouched(tmp_path, capsys, tiny,
                                                                                     command, reach):
    """Given its own input as its output (twice, or through a link), an export replaced the user's trace with its
    output and said it had written it."""
    from engine.run.session import Session

    events: list = []
    Session(tiny).run("hi", GenerationParams(max_new_tokens=2), events.append)
    trace = write_trace(tmp_path / "run.kvscope.jsonl", events)
    before = trace.read_bytes()
    out = {"the same name": trace, "a symlink": tmp_path / "link.json", "a hard link": tmp_path / "hard.json"}[reach]
    if reach == "a symlink":
        out.symlink_to(trace)
    elif reach == "a hard link":
        os.link(trace, out)
    code, printed, err = run_cli([command, str(trace), "--out", str(out)], capsys)
    assert code == 2 and "one of the files this command reads: KVScope never writes over its input" in err
    assert err.count("\n") == 1 and "wrote" not in printed and trace.read_bytes() == before


def test_a_load_tests_trace_onto_its_own_workload_is_refused_before_any_request(tmp_path, capsys):
    workload = tmp_path / "w.jsonl"
    workload.write_text('{"prompt": "hi"}\n')
    code, _out, err = run_cli(["load", "--server", "http://127.0.0.1:9", "--workload", str(workload),
                               "--trace", str(workload)], capsys)
    assert code == 2 and "one of the files this command reads" in err and workload.read_text() == '{"prompt": "hi"}\n'


# --- what a server sends -------------------------------------------------------------------------------------
def test_a_server_that_never_stops_is_cut_at_max_new_tokens_by_the_client(tmp_path):
    with ReplayServer(streaming(stream=stream_route(endless))) as server:
        events: list = []
        result = RemoteSession(probe(server.url)).run("hi", GenerationParams(max_new_tokens=50), events.append)
    assert isinstance(result, RunFinished) and result.reason == "max_tokens"
    assert result.summary.generated_tokens == 50 == sum(isinstance(e, TokenStep) for e in events)
    assert read_trace(write_trace(tmp_path / "endless.jsonl", events)) == events


def test_a_server_that_never_stops_is_cut_at_its_own_context_and_memory_stays_bounded(monkeypatch):
    """No answer is longer than the server's context (1,024 positions per slot in the recorded llama-server); a
    server that states none is read for at most ``UNSTATED_CONTEXT`` tokens."""
    from engine.serve import remote

    with ReplayServer(streaming(stream=stream_route(endless))) as server:
        facts = probe(server.url)
        result = RemoteSession(facts).run("hi", GenerationParams(max_new_tokens=1 << 24))
        assert result.reason == "context_full" and result.summary.generated_tokens == facts.context == 1024
        assert "ended by this client at the server's context (1,024 tokens)" in result.summary.notes[0]
        monkeypatch.setattr(remote, "UNSTATED_CONTEXT", 300)
        unstated = dataclasses.replace(facts, context=None)
        result = RemoteSession(unstated).run("hi", GenerationParams(max_new_tokens=1000))
    assert result.reason == "context_full" and result.summary.generated_tokens == 300
    assert "the most it reads from a server that states no context" in result.summary.notes[0]


@pytest.mark.parametrize("stream", [endless, drip], ids=["endless", "drip"])
def test_a_server_past_the_deadline_is_ended_and_what_arrived_is_kept(tmp_path, stream):
    with ReplayServer(streaming(stream=stream_route(stream))) as server:
        events: list = []
        tracemalloc.start()
        facts = dataclasses.replace(probe(server.url), context=None)        # no context to stop it at
        result = RemoteSession(facts, deadline_s=1.5).run("hi", GenerationParams(max_new_tokens=1 << 24), events.append)
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    assert isinstance(result, RunFailed) and result.error == "deadline"
    assert "still streaming after the 1.5 s deadline" in result.message and "they are kept" in result.message
    steps = sum(isinstance(e, TokenStep) for e in events)
    assert steps >= 1 and result.summary.generated_tokens == steps
    assert peak < 512 << 20, peak                                        # 1.5 s of tokens, not unbounded
    assert len(read_trace(write_trace(tmp_path / "cut.jsonl", events))) == len(events)


def test_a_model_list_dripped_a_byte_at_a_time_is_given_up_on_in_time():
    models = json.dumps({"data": [{"id": "m"}]}).encode() + b" " * 1_000_000
    with ReplayServer({**llamacpp_routes(), "GET /v1/models": Route(
            stream=lambda send: [send(models[i:i + 1]) or time.sleep(0.02) for i in range(len(models))])}) as server:
        with pytest.raises(RemoteError, match=r"took more than 1 s to answer /v1/models"):
            probe(server.url, timeout=1.0)


def test_a_status_line_and_headers_dripped_a_byte_at_a_time_are_given_up_on_at_the_deadline():
    """The socket's timeout is per read: a server sending its headers a byte every 0.2 s was waited on for ever."""
    import socket as sockets
    import threading

    listener = sockets.create_server(("127.0.0.1", 0))
    head = b"HTTP/1.1 200 OK\r\n" + b"X-Slow: " + b"a" * 60 + b"\r\n\r\n"     # ~17 s at this pace

    def serve() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.recv(65536)
            try:
                for i in range(len(head)):
                    conn.sendall(head[i:i + 1])
                    time.sleep(0.2)
            except OSError:
                pass                                   # the client gave up: what this test waits for

    threading.Thread(target=serve, daemon=True).start()
    try:
        with pytest.raises(RemoteError, match=r"took more than 1 s to send its answer's status line and headers"):
            probe(f"http://127.0.0.1:{listener.getsockname()[1]}", timeout=1.0)
    finally:
        listener.close()


def test_an_endless_line_is_refused_by_its_length_not_called_a_closed_stream():
    with ReplayServer(streaming(stream=stream_route(endless_line))) as server:
        result = RemoteSession(probe(server.url)).run("hi", GenerationParams(max_new_tokens=8))
    assert isinstance(result, RunFailed) and "stream line longer than 1,048,576 bytes" in result.message


def test_a_chunk_size_past_two_to_the_63_is_one_line_not_a_traceback():
    import http.client
    import io

    from engine.serve.remote import sse_payloads

    class Socket:                          # what http.client reads an answer from
        def __init__(self, data: bytes) -> None:
            self.file = io.BufferedReader(io.BytesIO(data))

        def makefile(self, *_args, **_kwargs):
            return self.file

    answer = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
              + b"F" * 20 + b"\r\ndata: {}\r\n\r\n")
    response = http.client.HTTPResponse(Socket(answer))
    response.begin()
    with pytest.raises(RemoteError, match="chunk size needs more than 63 bits"):
        list(sse_payloads(response))


def test_a_page_that_is_not_a_stream_says_what_it_was():
    page = Route(body=b"<html><body>Welcome to nginx</body></html>", content_type="text/html")
    with ReplayServer(streaming(stream=page)) as server:
        result = RemoteSession(probe(server.url)).run("hi", GenerationParams(max_new_tokens=8))
    assert isinstance(result, RunFailed)
    assert "answered with text/html, not a token stream" in result.message and "nginx" in result.message


NESTED = b"[" * 200_000 + b"]" * 200_000


def test_deeply_nested_json_is_one_line_from_the_model_list_and_mid_stream(capsys):
    with ReplayServer({**llamacpp_routes(), "GET /v1/models": Route(body=NESTED)}) as server:
        with pytest.raises(RemoteError, match="nested too deeply"):
            probe(server.url)
        code, _out, err = run_cli(["--server", server.url, "--prompt", "hi"], capsys)
        assert code == 2 and "nested too deeply" in err and "Traceback" not in err and err.count("\n") == 1
    nested_event = stream_route(lambda send: (send(chunk("kept ")), send(b"data: " + NESTED + b"\n\n")))
    with ReplayServer(streaming(stream=nested_event)) as server:
        events: list = []
        result = RemoteSession(probe(server.url)).run("hi", GenerationParams(max_new_tokens=8), events.append)
    assert isinstance(result, RunFailed) and "nested too deeply" in result.message
    assert [e.text for e in events if isinstance(e, TokenStep)] == ["kept "]


def test_terminal_escapes_from_a_server_reach_the_terminal_visible_not_acted_on(capsys):
    models = json.dumps({"data": [{"id": f"evil{ESCAPES}model"}]}).encode()
    stream = stream_route(lambda send: (send(chunk(f"a{ESCAPES}b")),
                                        send(b'data: {"choices": [{"delta": {}, "finish_reason": "stop"}]}\n\n'),
                                        send(b"data: [DONE]\n\n")))
    with ReplayServer(streaming(routes={"GET /v1/models": Route(body=models)}, stream=stream)) as server:
        code, out, err = run_cli(["--server", server.url, "--prompt", "hi", "--max-new-tokens", "4"], capsys)
    assert code == 0, err
    for raw in ("\x1b", "\x07", "\u202e", "\x00"):
        assert raw not in out and raw not in err, repr(raw)
    assert "\\x1b]0;owned\\x07" in out and "\\u202e" in out and "evil\\x1b" in err


def test_credentials_in_the_address_are_sent_as_basic_auth_and_never_written_or_printed(tmp_path, capsys):
    trace = tmp_path / "run.jsonl"
    with ReplayServer(llamacpp_routes()) as server:
        url = server.url.replace("http://", "http://ada:s3cret-pw@")
        code, out, err = run_cli(["--server", url, "--prompt", "hi", "--max-new-tokens", "4", "--trace",
                                  str(trace), "--json"], capsys)
    assert code == 0, err
    expected = "Basic " + base64.b64encode(b"ada:s3cret-pw").decode()
    assert all(headers.get("Authorization") == expected for _m, _p, _b, headers in server.requests)
    assert "s3cret-pw" not in trace.read_text() and "s3cret-pw" not in out + err
    assert read_trace(trace)[0].model.url == server.url                          # the address, less the password


def test_an_api_key_with_a_line_break_is_named_not_called_malformed_json(monkeypatch):
    monkeypatch.setenv(API_KEY_ENV, "sk-one\nInjected: header")
    with ReplayServer(llamacpp_routes()) as server:
        with pytest.raises(RemoteError, match=f"{API_KEY_ENV} holds a line break or another control character"):
            probe(server.url)
        assert not server.requests                                            # nothing was sent with it


# --- signals ---------------------------------------------------------------------------------------------------
def _interruptible() -> None:
    """In the child: SIGINT handled as a user's terminal has it. A suite started in the background by a shell
    without job control ignores SIGINT, and a child inherits that (Python then never raises KeyboardInterrupt)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def started_subprocess(args: list[str], env: dict) -> subprocess.Popen:
    """``python -m engine ARGS``, returned once it has written generated text to stdout: the run is under way
    (a test that signals it earlier would be testing the load, not the run)."""
    process = subprocess.Popen([sys.executable, "-m", "engine", *args], cwd=ROOT, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, env={**os.environ, **env}, preexec_fn=_interruptible)
    ready, _, _ = select.select([process.stdout], [], [], 300)
    assert ready, "the run never started"
    assert os.read(process.stdout.fileno(), 1), process.stderr.read()
    return process


def signalled(process: subprocess.Popen, sig: str) -> str:
    process.send_signal(getattr(signal, sig))
    _out, err = process.communicate(timeout=120)
    return err.decode("utf-8", "replace")


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGHUP", "SIGINT"])
def test_a_signal_during_a_local_run_keeps_the_partial_trace(tiny_model_dir, cache_root, tmp_path, sig):
    trace = tmp_path / "run.jsonl"
    process = started_subprocess(["--model", str(tiny_model_dir), "--device", "cpu", "--prompt", "hi",
                                  "--max-new-tokens", "50", "--trace", str(trace)],
                                 {"KVSCOPE_FAULTS": "decode:2:sleep=600", "KVSCOPE_CACHE_DIR": str(cache_root)})
    err = signalled(process, sig)
    assert process.returncode == 130 and "interrupted" in err and "Traceback" not in err
    events = read_trace(trace)
    assert isinstance(events[0], RunStarted) and events.incomplete == [events[0].run_id]


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_a_signal_during_a_server_run_keeps_the_partial_trace(tmp_path, sig):
    trace = tmp_path / "run.jsonl"
    with ReplayServer(streaming(stream=stream_route(drip))) as server:
        process = started_subprocess(["--server", server.url, "--prompt", "hi", "--trace", str(trace)], {})
        err = signalled(process, sig)
    assert process.returncode == 130 and "Traceback" not in err
    events = read_trace(trace)
    assert isinstance(events[0], RunStarted) and events.incomplete == [events[0].run_id]


def test_a_signal_during_a_sweep_keeps_the_partial_trace(tiny_model_dir, cache_root, tmp_path):
    trace = tmp_path / "sweep.jsonl"
    process = subprocess.Popen([sys.executable, "-m", "engine", "sweep", "cache", "--model", str(tiny_model_dir),
                                "--device", "cpu", "--tokens", "40", "--trace", str(trace)], cwd=ROOT,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               env={**os.environ, "KVSCOPE_FAULTS": "decode:5:sleep=600",
                                    "KVSCOPE_CACHE_DIR": str(cache_root)})
    seen = b""
    while b"[0/2]" not in seen:                           # progress: the experiment has started
        line = process.stderr.readline()
        assert line, seen
        seen += line
    err = signalled(process, "SIGTERM")
    assert process.returncode == 130 and "Traceback" not in err
    kinds = [type(e).__name__ for e in read_trace(trace)]
    assert kinds[0] == "ExperimentStarted" and "ExperimentFinished" not in kinds


# --- traces as they arrive ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def lines(tiny, tmp_path_factory) -> list[bytes]:
    from engine.run.session import Session

    events: list = []
    Session(tiny).run("hi", GenerationParams(max_new_tokens=3), events.append)
    return write_trace(tmp_path_factory.mktemp("t") / "t.jsonl", events).read_bytes().splitlines(keepends=True)


def test_a_utf8_bom_is_accepted(lines, tmp_path):
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + b"".join(lines))
    assert isinstance(read_trace(path)[0], RunStarted)


def test_two_traces_joined_with_cat_replay_as_two_runs(lines, tmp_path):
    other = [line.replace(b'"run_id": "', b'"run_id": "b') for line in lines]
    path = tmp_path / "joined.jsonl"
    path.write_bytes(b"".join(lines) + b"".join(other))
    runs = [e.run_id for e in read_trace(path) if isinstance(e, RunStarted)]
    assert len(runs) == 2 and runs[1] == "b" + runs[0]


def test_a_5000_digit_number_says_so(lines, tmp_path):
    path = tmp_path / "digits.jsonl"
    path.write_bytes(lines[0] + lines[1].replace(b'"t_ms": ', b'"t_ms": ' + b"9" * 5000 + b", \"x\": ", 1))
    with pytest.raises(TraceError, match="a whole number of 5,000 digits; a KVScope value has at most 40"):
        read_trace(path)


def test_a_line_of_empty_lists_is_refused_before_it_is_parsed_with_memory_bounded(tmp_path):
    path = tmp_path / "lists.jsonl"
    header = b'{"format": "kvscope-trace", "version": %d}\n' % VERSION
    path.write_bytes(header + b"[" + b"[]," * ((MAX_LINE_BYTES - 8) // 3) + b"[]]\n")
    tracemalloc.start()
    with pytest.raises(TraceError, match=f"lists and objects; a KVScope event holds at most {MAX_CONTAINERS:,}"):
        read_trace(path)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 3 * MAX_LINE_BYTES, peak                         # the line itself, read once; never parsed


def test_an_interrupted_run_ends_its_streamed_line_so_interrupted_stands_on_its_own(tiny_model_dir, cache_root):
    process = started_subprocess(["--model", str(tiny_model_dir), "--device", "cpu", "--prompt", "hi",
                                  "--max-new-tokens", "50"],
                                 {"KVSCOPE_FAULTS": "decode:3:sleep=600", "KVSCOPE_CACHE_DIR": str(cache_root)})
    process.send_signal(signal.SIGINT)
    out, err = process.communicate(timeout=120)
    assert process.returncode == 130 and out.endswith(b"\n") and err.decode().splitlines()[-1] == "interrupted"
