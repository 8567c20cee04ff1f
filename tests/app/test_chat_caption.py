"""A chat comparison timed once per turn says so: "(median of 1)" read as a statistic it was not."""

from __future__ import annotations

from types import SimpleNamespace

from app.lessons import chat as chat_view
from engine.lessons.chat import ChatResult, TurnFigures

TURN = TurnFigures(turn=2, on_ms=40.0, off_ms=90.0, on_range=(40.0, 40.0), off_range=(90.0, 90.0), clear=True)


def test_a_comparison_run_once_says_one_run_each_and_a_repeated_one_says_its_median():
    once = SimpleNamespace(result=ChatResult(tokens_match=True, repeats=1, per_turn=(TURN,)))
    thrice = SimpleNamespace(result=ChatResult(tokens_match=True, repeats=3, per_turn=(TURN,)))
    assert "(one run each)" in chat_view.caption(once) and "median" not in chat_view.caption(once)
    assert "(median of 3 repeats)" in chat_view.caption(thrice)

