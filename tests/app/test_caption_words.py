"""Words a scene shows where a number needs its kind: a chat comparison timed once, a predicted count of tokens."""

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



def test_the_serving_scenes_predicted_count_names_its_unit():
    """Scene V read "predicted at send from its KV events: 1,536 (57%)": 1,536 of what."""
    from app.lessons import server_load

    result = SimpleNamespace(mean_ttft_ms=120.0, completed=8, server_cached_tokens=1_500, server_prompt_tokens=2_700,
                             tree_prompt_tokens=2_700, tree_reused_tokens=1_536, mispredicted_requests=0,
                             total_tok_s=40.0)
    record = SimpleNamespace(result=result, started=SimpleNamespace(model=SimpleNamespace(engine="vLLM")))
    assert "predicted at send from its KV events: 1,536 tokens (57%)" in server_load.caption(record)
