"""A comparison that contradicts its own lesson says so, and names the machine, not the cache, as the likely
cause: the KV cache on vs off measured backwards (cache-on slower) on a busy machine drew cache-on above cache-off
and said only "Finished"."""

from __future__ import annotations

from types import SimpleNamespace

from app.lessons import cache as cache_view
from engine.lessons import cache
from engine.lessons.cache import CacheResult

RESULT = dict(tokens_match=True, generated=32, prompt_tokens=40, total_speedup=0.8, flops_ratio=6.0,
              attention_flops_ratio=30.0)


def test_a_backwards_result_on_a_busy_machine_says_so_in_the_table_and_the_scene_caption():
    backwards = CacheResult(decode_speedup=1 / 1.4, lowest_cpu_share=0.4, **RESULT)
    words = cache.backwards_words(backwards)
    assert words.startswith("backwards: decode with the cache measured 1.4x slower than without it")
    assert "the machine was busy" in words and "not the cache" in words and "run it again" in words
    assert f"note: {words}" in cache.table([], backwards)
    assert "busy" in cache.LESSON.report([], backwards).split(words)[1]  # the lessons' busy note follows it
    assert cache_view.caption(SimpleNamespace(result=backwards)) == words


def test_a_backwards_result_on_a_machine_that_looked_quiet_still_names_other_programs_as_the_likely_cause():
    words = cache.backwards_words(CacheResult(decode_speedup=0.9, lowest_cpu_share=0.95, **RESULT))
    assert "other programs taking the cores during one of the two runs is the likely cause" in words


def test_a_result_that_holds_its_lesson_says_nothing_more():
    right = CacheResult(decode_speedup=1.4, lowest_cpu_share=0.95, **RESULT)
    assert cache.backwards_words(right) == "" and "backwards" not in cache.table([], right)
    assert "1.4x slower (measured)" in cache_view.caption(SimpleNamespace(result=right))
