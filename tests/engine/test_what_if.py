"""What-if sampling: a drawn step's recorded candidates filtered again equal, where the filters keep only
candidates, the distribution the sampler itself would have drawn from with those settings; where they do not,
the result says it is not exact."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.facts.params import GenerationParams
from engine.facts.what_if import refilter
from engine.model.sampling import N_CANDIDATES, choose


def sampler(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> tuple[list[float], list[float]]:
    """(the candidates' plain probabilities, what the sampler drew from for them), as a run records them."""
    params = GenerationParams(temperature=temperature, top_k=top_k, top_p=top_p)
    drawn = choose(logits, params, torch.Generator().manual_seed(0))
    return drawn.candidate_raw, drawn.candidate_final


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), temperature=st.sampled_from([0.3, 0.7, 1.0, 1.5, 3.0]),
       top_k=st.integers(1, N_CANDIDATES), top_p=st.sampled_from([1.0, 0.9, 0.5, 0.2]))
def test_with_top_k_among_the_candidates_the_refiltered_distribution_is_the_samplers(seed, temperature, top_k,
                                                                                      top_p):
    logits = torch.randn(500, generator=torch.Generator().manual_seed(seed)) * 3
    raw, _ran = sampler(logits, 1.0, 0, 1.0)                       # what the trace holds: T=1, no filters
    _raw, wanted = sampler(logits, temperature, top_k, top_p)       # what those settings would have drawn from
    result = refilter(raw, temperature, top_k, top_p)
    assert result.exact
    assert result.probs == pytest.approx(wanted, abs=1e-5)
    assert result.kept == sum(1 for p in wanted if p > 0)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), top_p=st.sampled_from([1.0, 0.95, 0.8, 0.5, 0.1]))
def test_at_temperature_one_a_nucleus_that_closes_among_the_candidates_is_exact(seed, top_p):
    logits = torch.randn(500, generator=torch.Generator().manual_seed(seed)) * 4
    raw, _ = sampler(logits, 1.0, 0, 1.0)
    _raw, wanted = sampler(logits, 1.0, 0, top_p)
    result = refilter(raw, 1.0, 0, top_p)
    if top_p == 1.0 or sum(raw) >= top_p:
        assert result.exact and result.probs == pytest.approx(wanted, abs=1e-5)
    else:
        assert not result.exact and "reaches past" in result.why


def test_a_temperature_without_top_k_is_marked_relative_and_keeps_the_candidates_ratios():
    logits = torch.randn(500, generator=torch.Generator().manual_seed(1)) * 2
    raw, _ = sampler(logits, 1.0, 0, 1.0)
    _raw, wanted = sampler(logits, 0.5, 0, 1.0)
    result = refilter(raw, 0.5, 0, 1.0)
    assert not result.exact and "relative shares only" in result.why
    assert result.probs[1] / result.probs[0] == pytest.approx(wanted[1] / wanted[0], rel=1e-4)


def test_greedy_keeps_the_likeliest_alone():
    assert refilter([0.5, 0.3, 0.2], 0.0).probs == (1.0, 0.0, 0.0)
