"""The window under bad input, faults and long sessions: a clear message, a usable app, nothing lost."""

import os
import subprocess
import sys
import time

import pytest

from engine.facts.params import GenerationParams
from engine.model.memory import process_rss_bytes
from engine.output.trace import VERSION
from engine.run.faults import parse
from tests.app.conftest import close_and_dispose, make_window, run_and_wait, start_lesson, wait_idle


def test_out_of_memory_mid_run_keeps_the_numbers_and_the_next_run_works(qtbot, window):
    window.client.worker.session.fault_hook = parse("decode:3:oom")
    window.controls.max_tokens.setValue(10)
    failed = run_and_wait(qtbot, window)
    assert failed.reason == "failed" and failed.n_steps == 3
    assert window.banner.isVisible() and "Out of memory after 3 tokens" in window.banner.label.text()
    assert window.tokens.rendered_tokens() == failed.prompt_tokens + 3      # what was generated stays shown
    window.client.worker.session.fault_hook = None
    ok = run_and_wait(qtbot, window)
    assert ok.reason in ("max_tokens", "eos") and len(window.store.runs) == 2


@pytest.mark.parametrize("content, fragment", [
    (b"", "is empty"),
    (b'{"format": "kvscope-trace", "version": 7}\n', "version 7"),
    (b"<html>not a trace</html>\n", "not valid JSON"),
    (b'{"format": "kvscope-trace", "version": %d}\n{"type": "RunStarted", "run_id"' % VERSION, "truncated"),
])
def test_bad_trace_files_show_a_clear_message(qtbot, window, tmp_path, content, fragment):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(content)
    window.files.open_trace(str(path))
    wait_idle(qtbot, window)
    assert window.banner.isVisible() and fragment in window.banner.label.text()
    assert window.store.current is None
    window.controls.max_tokens.setValue(2)
    assert run_and_wait(qtbot, window).n_steps == 2


def test_stop_during_a_long_prefill_keeps_the_window_responsive(qtbot, window):
    window.client.worker.session.fault_hook = parse("prefill:0:sleep=2")
    window.controls.max_tokens.setValue(50)
    window.controller.run()
    qtbot.waitUntil(lambda: window.store.current is not None)
    ticks = []
    window.frames.timer.timeout.connect(lambda: ticks.append(1))
    window.controller.stop()
    wait_idle(qtbot, window, timeout=30_000)
    assert len(ticks) >= 10                     # the GUI kept refreshing during the 2 s the forward pass slept
    run = window.store.current
    assert run.reason == "stopped" and run.n_steps <= 1           # not the 50 tokens asked for
    window.client.worker.session.fault_hook = None
    assert run_and_wait(qtbot, window).reason in ("max_tokens", "eos")


def test_closing_during_an_experiment_stops_it_and_the_worker(qtbot, tiny_model_dir):
    w = make_window(qtbot, tiny_model_dir)
    start_lesson(w, "prefill", **{"max_length": 256, "repeats": 20})
    qtbot.waitUntil(lambda: (r := w.store.latest_experiment("prefill")) is not None and bool(r.points))
    w.close()
    record = w.store.latest_experiment("prefill")
    assert w.worker_stopped and w.client.thread.isFinished()
    assert record.end is None or record.end.reason == "stopped"          # not run to the end
    close_and_dispose(w)


CLOSE_WHILE_BUSY = """
import sys, time
import app.main as m
from PySide6.QtCore import QTimer
build = m.build
def patched(args):
    app, w = build(args)
    def close_when(busy=sys.argv[1]):
        if w.client.busy == busy and (busy != "run" or w.store.current is not None):
            QTimer.singleShot(300, lambda: (print(f"closing {{time.time():.3f}}", flush=True), w.close()))
        else:
            QTimer.singleShot(50, close_when)
    QTimer.singleShot(50, close_when)
    return app, w
m.build = patched
code = m.main(sys.argv[2:])
print(f"exited {{time.time():.3f}}", flush=True)
sys.exit(code)
"""


def close_while_busy(busy: str, args: list[str], env: dict) -> tuple[float, subprocess.CompletedProcess, float]:
    """Close the window once it is ``busy``; returns when it closed and when the process had ended (wall clock,
    both)."""
    r = subprocess.run([sys.executable, "-c", CLOSE_WHILE_BUSY.format(), busy, *args], capture_output=True,
                       text=True, timeout=400, env={**os.environ, "QT_QPA_PLATFORM": "offscreen", **env})
    closing = [float(line.split()[1]) for line in r.stdout.splitlines() if line.startswith("closing")]
    assert closing, (r.stdout, r.stderr)
    return closing[0], r, time.time()


def test_closing_during_a_forward_pass_that_cannot_be_interrupted_exits_without_waiting_for_it(tiny_model_dir,
                                                                                                tmp_path):
    closing, r, ended = close_while_busy("run", ["--model", str(tiny_model_dir), "--device", "cpu", "--run"],
                                         {"KVSCOPE_FAULTS": "prefill:0:sleep=600",
                                          "KVSCOPE_SETTINGS": str(tmp_path / "s.ini")})
    assert r.returncode == 0 and "Traceback" not in r.stderr
    assert ended - closing < 300                                  # long before the 600 s the forward pass sleeps


@pytest.mark.real
def test_closing_during_the_first_conversion_exits_cleanly(tmp_path):
    closing, r, _ended = close_while_busy("load", [], {"KVSCOPE_CACHE_DIR": str(tmp_path / "cache"),
                                               "KVSCOPE_SETTINGS": str(tmp_path / "s.ini")})
    assert r.returncode == 0 and "Traceback" not in r.stderr
    assert not any((tmp_path / "cache").rglob("*.safetensors"))    # nothing half-converted was published


def test_widgets_refuse_out_of_range_values(window):
    c = window.controls
    for box, value, expected in ((c.top_p, 0.0, 0.01), (c.top_p, 1.5, 1.0), (c.temperature, -1.0, 0.0),
                                 (c.seed, -5, 0), (c.top_k, -3, 0), (c.max_tokens, 0, 1),
                                 (c.max_tokens, 10**6, 255)):
        box.setValue(value)
        assert box.value() == pytest.approx(expected), box
    assert c.top_k.maximum() == window.client.model.model.vocab_size
    assert window.run_settings.params() == GenerationParams(max_new_tokens=255, temperature=0.0, top_k=0, top_p=1.0,
                                                            seed=0)


def test_allowing_model_code_is_per_model(window):
    c = window.controls
    c.trust_box.setChecked(True)
    c.model_box.setCurrentText("/some/other/model")
    assert not c.trust_box.isChecked()


def test_two_hundred_runs_keep_a_bounded_history_and_flat_memory(qtbot, window, capsys):
    window.controller.set_history(20)
    window.controls.max_tokens.setValue(8)
    window.controls.prompt.setPlainText("hello world")
    rss = {}
    for i in range(1, 201):
        run_and_wait(qtbot, window)
        if i in (50, 200):
            rss[i] = process_rss_bytes()
    assert len(window.store.runs) == 20 and window.store.runs[-1].number == 200
    growth = rss[200] - rss[50]
    with capsys.disabled():
        print(f"\n200 runs: RSS after run 50 {rss[50] / 2**20:.1f} MiB, after run 200 {rss[200] / 2**20:.1f} MiB, "
              f"growth {growth / 2**20:+.1f} MiB, {len(window.store.runs)} runs kept")
    assert growth < 40 * 2**20


def test_a_trace_from_another_model_replays_and_says_so(qtbot, window, tmp_path, tiny):
    import dataclasses

    from engine.output.trace import write_trace
    from engine.run.session import Session

    events = []
    Session(tiny).run("hello", GenerationParams(max_new_tokens=3), events.append)
    other = dataclasses.replace(events[0].model, name="SomeOtherModel-7B", device="cuda:0")
    events[0] = dataclasses.replace(events[0], model=other)
    path = write_trace(tmp_path / "other.jsonl", events)
    window.controller.replay_speed = 0.0
    window.files.open_trace(str(path))
    qtbot.waitUntil(lambda: "SomeOtherModel-7B" in window.status.currentMessage(), timeout=10_000)
    assert "not the loaded model" in window.status.currentMessage()
    wait_idle(qtbot, window)
    run = window.store.current
    assert run.model.name == "SomeOtherModel-7B" and not window.banner.isVisible()
    assert run.model.device == "cuda:0" and run.started.prompt == "hello" and run.n_steps == 3 and run.finished
