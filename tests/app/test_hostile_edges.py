"""The window's edges under hostile input: a settings file from anywhere, a server that never stops or nests its
answers or puts a password in its address, a token that is not valid text, and a prompt of 100k tokens with no
space in it. Each ends in a clear note or banner with nothing lost, and the window keeps working."""

from __future__ import annotations

import dataclasses

import pytest
from PySide6.QtCore import QSettings

from app.panels.tokens import BLOCK_CHARS, BREAK, BREAK_AFTER, TOKENS_PER_REFRESH, TokensPanel
from app.state.store import RunStore
from app.state.viewstate import ViewState
from engine.facts.events import RunFailed, TokenStep
from engine.facts.params import GenerationParams
from engine.output.trace import read_trace
from engine.run.session import Session
from tests.app.conftest import close_and_dispose, load, make_window, run_and_wait, wait_idle
from tests.replay_server import ReplayServer, Route, chunk, drip, endless, llamacpp_routes, streaming

HUGE = {"run/seed": 2**31, "run/max_new_tokens": 10**12, "run/top_k": 2**40, "run/slow_ms": 2**31,
        "run/temperature": "nan", "run/top_p": "-1"}


@pytest.mark.parametrize("max_runs", ["0", "abc", str(2**63)])
def test_settings_out_of_range_fall_back_to_defaults_with_a_note_and_the_window_opens(qtbot, tmp_path, monkeypatch,
                                                                                     max_runs):
    path = tmp_path / "settings.ini"
    stored = QSettings(str(path), QSettings.Format.IniFormat)
    for key, value in {**HUGE, "history/max_runs": max_runs}.items():
        stored.setValue(key, value)
    stored.sync()
    monkeypatch.setenv("KVSCOPE_SETTINGS", str(path))
    window = make_window(qtbot)
    try:
        c = window.run_settings.choices
        assert (c.max_new_tokens, c.top_k, c.slow_ms, c.temperature, c.top_p) == (128, 0, 0, 0.0, 1.0)
        assert window.controls.max_tokens.value() == 128 and window.store.max_runs == 20
        note = window.banner.label.text()
        assert note.startswith("Some remembered settings were out of range and were reset to their defaults")
        for name in ("seed", "max_new_tokens", "top_k", "slow_ms", "temperature", "top_p", "history/max_runs"):
            assert name in note, (name, note)
    finally:
        close_and_dispose(window)


@pytest.fixture
def server_window(qtbot, tmp_path, monkeypatch):
    """A window attached to a replayed server whose chat stream the test chooses; returns (window, server)."""
    monkeypatch.setenv("KVSCOPE_SETTINGS", str(tmp_path / "settings.ini"))
    opened = []

    def attach(stream_route: Route, address=lambda url: url):
        server = ReplayServer(streaming(stream=stream_route)).__enter__()
        window = make_window(qtbot)
        opened.append((window, server))
        load(window, address(server.url))
        qtbot.waitUntil(lambda: window.client.busy is None)
        return window, server

    yield attach
    for window, server in opened:
        close_and_dispose(window)
        server.__exit__(None, None, None)


def test_a_server_that_never_stops_is_cut_at_max_tokens_in_the_window(qtbot, server_window):
    window, _server = server_window(Route(content_type="text/event-stream", stream=endless))
    window.controls.max_tokens.setValue(40)
    run = run_and_wait(qtbot, window)
    assert run.finished and run.n_steps == 40 and run.reason == "max_tokens"


def test_a_dripping_server_is_ended_at_the_deadline_with_its_tokens_kept(qtbot, server_window):
    window, _server = server_window(Route(content_type="text/event-stream", stream=drip))
    window.controls.deadline.setValue(2)
    window.controller.load_model(window.controls.model_request())    # Load model: the deadline applies from here
    wait_idle(qtbot, window)
    window.controls.max_tokens.setValue(4096)
    run = run_and_wait(qtbot, window)
    assert isinstance(run.end, RunFailed) and run.end.error == "deadline" and run.n_steps >= 1
    assert "deadline" in window.banner.label.text() and "they are kept" in window.banner.label.text()


def test_a_token_that_is_not_valid_text_saves_and_reads_back(qtbot, server_window, tmp_path):
    lone = b'data: {"choices": [{"delta": {"content": "a\\ud800b"}}]}\n\n'
    done = b'data: {"choices": [{"delta": {}, "finish_reason": "stop"}]}\n\ndata: [DONE]\n\n'
    window, _server = server_window(Route(content_type="text/event-stream", body=chunk("x ") + lone + done))
    run = run_and_wait(qtbot, window)
    assert run.n_steps == 2
    path = tmp_path / "saved.jsonl"
    window.files.save_trace(str(path))
    assert not window.banner.isVisible(), window.banner.label.text()
    steps = [e for e in read_trace(path) if isinstance(e, TokenStep)]
    assert [s.text for s in steps] == ["x ", "a\ufffdb"]


def test_a_password_in_the_servers_address_is_used_never_stored_or_shown(qtbot, server_window, tmp_path):
    window, server = server_window(Route(body=(tmp_path / "x").as_posix().encode()),
                                   address=lambda url: url.replace("http://", "http://ada:s3cret-pw@"))
    assert window.client.model is not None, window.banner.label.text()
    assert server.requests[0][3].get("Authorization", "").startswith("Basic ")
    window.save_settings()
    assert "s3cret-pw" not in (tmp_path / "settings.ini").read_text()
    assert "s3cret-pw" not in window.controls.model_box.currentText() + window.status.currentMessage()
    assert "s3cret-pw" not in window.windowTitle()


def test_a_server_that_nests_its_model_list_is_one_line_in_the_banner(qtbot, tmp_path, monkeypatch):
    monkeypatch.setenv("KVSCOPE_SETTINGS", str(tmp_path / "settings.ini"))
    nested = b"[" * 200_000 + b"]" * 200_000
    with ReplayServer({**llamacpp_routes(), "GET /v1/models": Route(body=nested)}) as server:
        window = make_window(qtbot)
        try:
            load(window, server.url)
            wait_idle(qtbot, window)
            text = window.banner.label.text()
            assert "nested too deeply" in text and "RecursionError" not in text and window.client.model is None
        finally:
            close_and_dispose(window)


def test_a_100k_token_prompt_without_spaces_is_laid_out_in_batches_with_a_break_every_few_tokens(qtbot, tiny):
    """Qt lays out a paragraph with nowhere to wrap in time that grows with its square (30k tokens: 42 s); the
    token view gives it a zero-width break at a token boundary every ``BREAK_AFTER`` characters and a new
    paragraph every ``BLOCK_CHARS``, and nothing else changes in the text; it lays out a batch of tokens per
    refresh, so the window answers in between (the time to open such a trace is measured in ``make bench``)."""
    events: list = []
    Session(tiny).run("hi", GenerationParams(max_new_tokens=2), events.append)
    pieces = ["QUJD", "REVG", "R0hJ"] * 33_334                        # base64, 100,002 tokens
    started = dataclasses.replace(events[0], prompt_ids=[1] * len(pieces), prompt_pieces=pieces)
    store, state = RunStore(), ViewState()
    store.add(started)
    store.add(events[-1])                                 # its end: a trace opened, not a prefill still running
    state.select(started.run_id, "test")
    panel = TokensPanel(store, state)
    qtbot.addWidget(panel)
    panel.refresh()
    refreshes = 1
    while panel.behind:                                   # a batch per refresh, the window answering in between
        assert panel.rendered_tokens() == min(refreshes * TOKENS_PER_REFRESH, len(pieces))
        panel.refresh()
        refreshes += 1
    assert refreshes == -(-len(pieces) // TOKENS_PER_REFRESH)
    text = panel.text.toPlainText()
    paragraphs = text.split("\n")                       # a paragraph ends at a token boundary past BLOCK_CHARS
    assert "".join(paragraphs).replace(BREAK, "") == "".join(pieces)
    assert all(len(p) <= BLOCK_CHARS + BREAK_AFTER for p in paragraphs) and len(paragraphs) > 1
    assert max(len(run) for p in paragraphs for run in p.split(BREAK)) <= BREAK_AFTER + 4
    assert panel.rendered_tokens() == len(pieces)
