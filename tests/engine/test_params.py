import pytest

from engine.facts.errors import ParameterError
from engine.facts.params import MAX_SEED, GenerationParams


def test_defaults_are_valid_and_greedy():
    p = GenerationParams()
    assert p.greedy and p.kv_cache and p.chat_template


@pytest.mark.parametrize("changes, fragment", [
    ({"max_new_tokens": 0}, "max_new_tokens must be between 1 and 16,777,216, got 0"),
    ({"max_new_tokens": 2.5}, "whole number"),
    ({"temperature": -0.1}, "temperature must be 0 (greedy) or between 0.01 and 100"),
    ({"temperature": float("nan")}, "finite"),
    ({"temperature": 1e9}, "temperature must be 0 (greedy) or between 0.01 and 100"),
    ({"temperature": 1e-300}, "temperature must be 0 (greedy) or between 0.01 and 100, got 1e-300"),
    ({"temperature": 0.009}, "temperature must be 0 (greedy) or between 0.01"),
    ({"top_k": -1}, "top_k must be between 0 and 16,777,216, got -1"),
    ({"top_p": 0.0}, "top_p must be between 0.01 and 1"),
    ({"top_p": 1e-300}, "top_p must be between 0.01 and 1 (1 = off), got 1e-300"),
    ({"top_p": 1.5}, "top_p must be between 0.01 and 1"),
    ({"seed": -1}, "seed must be between 0"),
    ({"seed": MAX_SEED + 1}, "seed must be between 0"),
    ({"kv_cache": "yes"}, "kv_cache must be true or false"),
])
def test_out_of_range_values_are_refused_with_the_reason(changes, fragment):
    with pytest.raises(ParameterError) as info:
        GenerationParams(**changes)
    assert fragment in str(info.value)


def test_edges_that_are_allowed():
    GenerationParams(temperature=0.0, top_p=1.0, top_k=0, seed=0)
    GenerationParams(seed=MAX_SEED, top_p=0.01, temperature=100.0)
    GenerationParams(temperature=0.01, top_p=0.01, seed=1)


def test_top_k_one_counts_as_greedy_and_labels_differ():
    assert GenerationParams(temperature=0.7, top_k=1).greedy
    on = GenerationParams(temperature=0.7, seed=1).describe()
    off = GenerationParams(temperature=0.7, seed=1, kv_cache=False).describe()
    assert on != off and "KV off" in off and "T=0.7" in on
