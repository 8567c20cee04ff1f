"""Chat mode in the window: turns reuse the cache, the view says how much, and reuse on/off compare."""

import re

from tests.app.conftest import start_lesson, wait_idle


def send(qtbot, window, text):
    window.chat.input.setPlainText(text)
    window.chat.send_button.click()
    wait_idle(qtbot, window)
    window.refresh(force=True)


def test_turns_reuse_the_cache_and_the_view_says_so(qtbot, window):
    window.controls.max_tokens.setValue(6)
    send(qtbot, window, "hello there")
    send(qtbot, window, "and again")
    chat = window.chat
    assert [m["role"] for m in window.conversation.messages] == ["user", "assistant", "user", "assistant"]
    second = window.store.find(window.conversation.turn_runs[1])
    assert second.started.kind == "chat" and second.reused_tokens > 0
    assert f"reused {second.reused_tokens:,} (cache_n)" in chat.view.toHtml()
    assert second.kv_tokens == len(second.started.prompt_ids) + second.n_steps - 1   # the whole conversation
    assert "earlier turns (reused)" in window.kv.strip_label.text()
    assert len(chat.plot.listDataItems()[0].getData()[0]) == 2                      # TTFT of both turns
    assert chat.chart.legend_names() == ["this conversation (measured)"]


def test_compare_runs_the_conversation_both_ways(qtbot, window):
    window.controls.max_tokens.setValue(5)
    send(qtbot, window, "hello there")
    send(qtbot, window, "tell me more")
    window.chat.compare_button.click()
    wait_idle(qtbot, window, timeout=120_000)
    window.refresh(force=True)
    record = window.store.latest_experiment("chat")
    assert record.result.tokens_match is True
    assert record.settings.turns == ("hello there", "tell me more")
    names = window.chat.chart.legend_names()
    assert "reuse on (measured, median of repeats)" in names and "reuse off (measured, median of repeats)" in names
    assert "the same tokens ✓" in window.chat.explain.text()


def test_empty_message_is_not_sent_and_new_conversation_clears(qtbot, window):
    window.chat.input.setPlainText("   ")
    window.chat.send_button.click()
    assert window.client.busy is None
    window.controls.max_tokens.setValue(3)
    send(qtbot, window, "hi")
    window.chat.new_button.click()
    window.refresh(force=True)                       # the transcript is drawn at the next refresh
    assert window.conversation.messages == [] and "Start a conversation" in window.chat.view.toHtml()


def test_a_plain_run_between_turns_says_why_nothing_was_reused(qtbot, window):
    from tests.app.conftest import run_and_wait

    window.controls.max_tokens.setValue(4)
    send(qtbot, window, "hello there")
    run_and_wait(qtbot, window)
    send(qtbot, window, "and again")
    second = window.store.find(window.conversation.turn_runs[1])
    assert second.reused_tokens == 0
    assert "nothing reused: a plain run since the last turn replaced the conversation" in window.chat.view.toHtml()


def test_a_replayed_comparison_shows_its_conversation_as_the_transcript(qtbot, window, tmp_path):
    window.controls.max_tokens.setValue(4)
    start_lesson(window, "chat", **{"turns": ["hello there", "tell me more"]})
    wait_idle(qtbot, window, timeout=120_000)
    record = window.store.latest_experiment("chat")
    path = tmp_path / "chat.jsonl"
    window.files.save_trace(str(path), record.events)
    window.chat.new_button.click()
    window.controller.clear_runs()
    window.controller.replay_speed = 0.0
    window.files.open_trace(str(path))
    wait_idle(qtbot, window)
    window.refresh(force=True)
    text = window.chat.view.toPlainText()
    assert "The comparison's last conversation with the cache kept" in text
    assert text.count("You: ") == 2 and "You: tell me more" in text and text.count("Assistant: ") == 2
    reused = [int(line.split("reused ")[1].split(" ")[0]) for line in text.splitlines() if "reused " in line]
    assert reused[0] == 0 and reused[1] > 0                       # turn 2 came from the kept cache


def test_the_comparison_draws_each_turn_as_it_is_measured_not_at_the_end(qtbot, tiny):
    from app.views.chart import has_data
    from engine.facts.events import ExperimentPoint
    from engine.run.session import Session
    from tests.app.conftest import close_and_dispose, make_window
    from tests.lessons import collect

    events, _ = collect("chat", Session(tiny), turns=("hi", "and then?"), new_tokens=4, repeats=1)
    first = next(i for i, e in enumerate(events) if isinstance(e, ExperimentPoint))
    w = make_window(qtbot)
    try:
        w.lecture.enter("chat")
        w.controller.begin_replay()
        w.controller.on_events(events[:first])
        w.frames.refresh(force=True)
        assert not [i for i in w.chat.chart.plot.listDataItems() if has_data(i)]
        w.controller.on_events([events[first]])                  # turn 1, reuse on: measured
        w.frames.refresh(force=True)
        drawn = [i for i in w.chat.chart.plot.listDataItems() if has_data(i)]
        assert drawn and w.chat.chart.legend_names() == ["reuse on (measured, median of repeats)"]
        assert re.search(r"running for [0-9.]+ s: 0 of 4", w.scene_view.claim())
    finally:
        close_and_dispose(w)
