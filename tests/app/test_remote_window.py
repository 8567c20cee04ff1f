"""The window attached to a serving engine (a recorded llama-server, replayed locally): every panel says what a
client can and cannot see, and nothing pretends to be a tensor it never had."""

from __future__ import annotations

import pytest

from tests.app.conftest import close_and_dispose, load, make_window, run_and_wait, wait_idle
from tests.replay_server import ReplayServer, llamacpp_routes


@pytest.fixture
def server_window(qtbot, tmp_path, monkeypatch):
    monkeypatch.setenv("KVSCOPE_SETTINGS", str(tmp_path / "settings.ini"))
    with ReplayServer(llamacpp_routes()) as server:
        window = make_window(qtbot)
        load(window, server.url, "auto", "auto")
        qtbot.waitUntil(lambda: window.client.model is not None and window.client.busy is None, timeout=30_000)
        try:
            yield window, server
        finally:
            close_and_dispose(window)


def test_a_run_through_a_server_is_drawn_as_client_timed_and_the_heatmap_says_why_it_is_empty(server_window, qtbot):
    window, server = server_window
    assert window.controls.model_box.currentText() == server.url
    window.controls.max_tokens.setValue(24)
    run = run_and_wait(qtbot, window)
    assert run.remote and run.n_steps == 24
    assert not window.kv.graphics.isVisible() and "no per-layer tensors" in window.kv.info.text()
    assert not window.kv.mode_box.isVisible() and not window.kv.fit_button.isVisible()
    assert window.status.labels["prefill"].text() == "prefill: not visible from a client"
    assert window.status.labels["ttft"].text().endswith("ms (client)")
    assert "Server reported: prompt 41 tokens in 128.5 ms" in window.timing.summary.text()


def test_a_local_run_after_a_server_run_shows_the_heatmap_again(server_window, qtbot, tiny_model_dir):
    window, _server = server_window
    window.controls.max_tokens.setValue(4)
    run_and_wait(qtbot, window)
    assert not window.kv.graphics.isVisible()
    load(window, str(tiny_model_dir), "cpu", "float32")
    wait_idle(qtbot, window)
    run = run_and_wait(qtbot, window)
    assert not run.remote and window.kv.graphics.isVisible() and window.kv.mode_box.isVisible()


def test_the_server_load_view_tables_one_row_per_request_and_charts_the_metrics_polls(server_window, qtbot):
    window, _server = server_window
    view = window.experiments.views["server load"]
    view.form.set_value("requests", 3)
    view.run_button.click()
    wait_idle(qtbot, window, timeout=60_000)
    window.refresh(force=True)
    record = window.store.latest_experiment("server load")
    assert record.result.completed == 3 and any(p.series == "metrics" for p in record.points)
    assert view.table.rowCount() == 3
    assert view.metrics_chart.plot.listDataItems()                # the /metrics polls are on the chart
    assert view.slots_chart.isVisibleTo(view) and view.slots_chart.legend_names()[:2] == [
        "its context (n_ctx)", "held, idle"]                     # llama-server's /slots, in its own words
    ttft = [view.table.item(row, 2).text() for row in range(3)]
    assert all(text and float(text.replace(",", "")) > 0 for text in ttft)
    assert window.experiments.currentWidget() is view
    assert view.status.text().startswith("Finished. Ran with requests 3, one starts every 0.5 s, new tokens per "
                                         "request 48, poll /metrics every 0.5 s, stop after 300 s.")


def test_a_server_and_its_kv_events_on_the_command_line_start_a_watch_at_launch(qtbot, tmp_path, monkeypatch):
    """``kvscope --server URL --kv-events ADDR``: once the server answers, the load test runs with no requests of
    its own, watching every client's blocks, until Ctrl+. stops it."""
    import socket

    from app.main import parse_args, start

    monkeypatch.setenv("KVSCOPE_SETTINGS", str(tmp_path / "settings.ini"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with ReplayServer(llamacpp_routes()) as server:
        window = make_window(qtbot)
        try:
            start(window, parse_args(["--server", server.url, "--kv-events", f"tcp://127.0.0.1:{port}"]))
            qtbot.waitUntil(lambda: window.store.latest_experiment("server load") is not None, timeout=30_000)
            record = window.store.latest_experiment("server load")
            assert record.settings.requests == 0 and record.settings.kv_events == f"tcp://127.0.0.1:{port}"
            qtbot.waitUntil(lambda: record.progress is not None and "watching" in record.progress.message,
                            timeout=30_000)
            window.controller.stop()
            wait_idle(qtbot, window, timeout=30_000)
            assert record.end is not None and not [r for r in server.requests if r[1] == "/v1/chat/completions"]
        finally:
            close_and_dispose(window)
