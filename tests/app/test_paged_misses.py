"""The Paged KV tab says why each request missed the cache: pick a request, see its prompt with the cached span
and where it left the nearest earlier prompt."""

from __future__ import annotations

from tests.app.conftest import start_lesson, wait_idle


def test_each_request_is_listed_with_its_cached_span_and_why(qtbot, window):
    view = window.experiments.views["paged"]
    assert view.miss_box.isHidden()                                  # nothing run: nothing said
    assert start_lesson(window, "paged", requests=3, new_tokens=4, compare=False)
    wait_idle(qtbot, window, timeout=120_000)
    window.refresh(force=True)
    assert view.miss_box.count() == 3
    if view._short:                                                  # a short dock folds it behind a click
        assert view.miss_box.isHidden() and not view.miss_fold.isHidden()
        view.miss_fold.setChecked(True)
    assert not view.miss_box.isHidden() and not view.miss_text.isHidden()
    assert view.miss_box.itemText(0).startswith("Request 0: 0 of ")
    view.miss_box.setCurrentIndex(1)
    first, second = view.misses[0], view.misses[1]
    assert second.cached_tokens > 0 and first.reason == "nothing earlier"
    text = view.miss_text.toPlainText()
    assert text.startswith("".join(second.prompt_pieces).replace("\n", "↵")[:40])    # the prompt, token by token
    assert f"{second.cached_tokens:,} cached (blue), {second.computed_tokens:,} computed" in text
    assert f"{second.reason}: {second.words}" in text
    html = view.miss_text.toHtml().replace(" ", "").lower()
    assert "background-color:#56b4e9" in html                        # the cached span, on the cached colour
