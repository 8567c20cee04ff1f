import math

import pytest
import torch

from engine.facts.params import GenerationParams
from engine.model.sampling import TOP_P_WINDOW, choose, kept_tokens, make_generator

LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])


def test_greedy_picks_argmax_with_probability_one_after_filters():
    c = choose(LOGITS, GenerationParams(), None)
    assert c.token_id == 0 and c.prob == 1.0
    assert c.raw_prob == pytest.approx(torch.softmax(LOGITS, -1)[0].item())
    assert c.candidate_ids[:3] == [0, 1, 2]
    assert sum(c.candidate_final) == pytest.approx(1.0)


def test_same_seed_same_tokens_different_seed_differs():
    logits = torch.randn(500, generator=torch.Generator().manual_seed(1))
    p = GenerationParams(temperature=1.5)

    def draw(seed):
        gen = make_generator(torch.device("cpu"), seed)
        return [choose(logits, p, gen).token_id for _ in range(40)]

    assert draw(7) == draw(7)
    assert draw(7) != draw(8)


def test_top_k_one_equals_greedy_for_any_seed_and_temperature():
    logits = torch.randn(300, generator=torch.Generator().manual_seed(2))
    for seed in range(5):
        gen = make_generator(torch.device("cpu"), seed)
        assert choose(logits, GenerationParams(temperature=5.0, top_k=1), gen).token_id == int(logits.argmax())


def kept_set(logits, **params):
    ids, probs = kept_tokens(logits, GenerationParams(temperature=1.0, **params))
    return {i for i, p in zip(ids.tolist(), probs.tolist()) if p > 0}


def test_top_k_keeps_exactly_k_tokens():
    assert kept_set(LOGITS, top_k=3) == {0, 1, 2}


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs = torch.softmax(LOGITS, -1).tolist()           # 0.55, 0.20, 0.12, 0.07, 0.03, 0.003
    for p in (0.5, 0.6, 0.8, 0.9, 0.99):
        n = len(kept_set(LOGITS, top_p=p))
        assert kept_set(LOGITS, top_p=p) == set(range(n))
        assert sum(probs[:n]) >= p - 1e-6                 # the kept set reaches p ...
        assert n == 1 or sum(probs[:n - 1]) < p           # ... and is the smallest that does


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("vocab, scale", [(50, 1.0), (5000, 4.0), (5000, 0.05)])
def test_filters_keep_the_same_tokens_as_transformers(seed, vocab, scale):
    """Against transformers' own warpers, including a flat distribution that needs more than the window."""
    from transformers.generation.logits_process import (
        LogitsProcessorList,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(seed)) * scale
    for temperature, top_k, top_p in [(0.7, 0, 0.9), (1.3, 40, 0.8), (1.0, 7, 1.0), (0.5, 0, 0.5)]:
        warpers = [TemperatureLogitsWarper(temperature)]
        if top_k:
            warpers.append(TopKLogitsWarper(top_k))
        warpers.append(TopPLogitsWarper(top_p))
        hf = LogitsProcessorList(warpers)(None, logits[None].clone())[0]
        expected = set(torch.isfinite(hf).nonzero().flatten().tolist())
        ours = kept_set(logits / temperature, top_k=top_k, top_p=top_p)
        assert ours == expected
        ids, probs = kept_tokens(logits / temperature, GenerationParams(temperature=1.0, top_k=top_k, top_p=top_p))
        hf_probs = hf.softmax(-1)[ids]
        assert torch.allclose(probs, hf_probs, atol=1e-6)


def test_flat_distribution_falls_back_to_the_full_sort():
    from transformers.generation.logits_process import TopPLogitsWarper

    flat = torch.randn(TOP_P_WINDOW * 4, generator=torch.Generator().manual_seed(0)) * 0.01
    expected = torch.isfinite(TopPLogitsWarper(0.9)(None, flat[None].clone())[0]).sum().item()
    kept = kept_set(flat, top_p=0.9)
    assert len(kept) == expected and len(kept) > TOP_P_WINDOW


def test_temperature_sharpens_and_flattens():
    def top_prob(t):
        gen = make_generator(torch.device("cpu"), 0)
        return choose(LOGITS, GenerationParams(temperature=t), gen).candidate_final[0]

    base = torch.softmax(LOGITS, -1)[0].item()
    assert top_prob(0.5) > base > top_prob(2.0)
    assert top_prob(1.0) == pytest.approx(base)


def test_sampled_token_comes_only_from_the_filtered_set():
    gen = make_generator(torch.device("cpu"), 0)
    p = GenerationParams(temperature=10.0, top_k=2)
    seen = {choose(LOGITS, p, gen).token_id for _ in range(200)}
    assert seen == {0, 1}


def test_candidates_report_before_and_after_filters():
    c = choose(LOGITS, GenerationParams(temperature=1.0, top_k=2), make_generator(torch.device("cpu"), 0))
    assert c.candidate_final[2:] == [0.0] * (len(c.candidate_final) - 2)
    assert c.candidate_raw[2] > 0
    assert math.isclose(sum(c.candidate_final), 1.0, rel_tol=1e-5)


def test_greedy_breaks_ties_like_argmax():
    """bf16 logits tie exactly more often than one would think; greedy must pick what argmax picks."""
    logits = torch.tensor([0.5, 3.0, 1.0, 3.0, 3.0, -2.0])
    c = choose(logits, GenerationParams(), None)
    assert c.token_id == int(logits.argmax()) == 1
    assert c.candidate_final[c.candidate_ids.index(1)] == 1.0 and sum(c.candidate_final) == 1.0


def test_the_number_of_tokens_that_survive_the_filters_is_reported():
    logits = torch.randn(1000, generator=torch.Generator().manual_seed(3)) * 3
    gen = make_generator(torch.device("cpu"), 0)
    assert choose(logits, GenerationParams(), None).kept == 1
    assert choose(logits, GenerationParams(temperature=0.8, top_k=40), gen).kept == 40
    assert choose(logits, GenerationParams(temperature=1.0), gen).kept == 1000
    top_p = choose(logits, GenerationParams(temperature=1.0, top_p=0.5), gen)
    probs = torch.softmax(logits, -1).sort(descending=True).values
    assert top_p.kept == int((probs.cumsum(-1) - probs < 0.5).sum())


@pytest.mark.parametrize("params", [GenerationParams(temperature=0.01, seed=1),
                                    GenerationParams(temperature=100.0, seed=1),
                                    GenerationParams(temperature=1.0, top_p=0.01, seed=1),
                                    GenerationParams(temperature=0.01, top_p=0.01, top_k=1, seed=1)])
def test_the_edges_of_the_parameter_ranges_sample_a_valid_token(params):
    logits = torch.randn(49152, generator=torch.Generator().manual_seed(2)) * 30
    choice = choose(logits, params, make_generator(torch.device("cpu"), 1))
    assert 0 <= choice.token_id < 49152 and 0 < choice.prob <= 1 and math.isfinite(choice.raw_prob)
