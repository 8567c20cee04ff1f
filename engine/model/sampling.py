"""Choosing the next token: greedy, temperature, top-k, top-p, seeded. Pure functions over a logits vector.

The filters mean what they mean in ``generate()`` (temperature, then top-k, then top-p over what top-k left;
top-p keeps a token while the tokens more likely than it hold less than ``p``). Besides the chosen token we
return the most likely candidates with their probability before and after the filters: that difference is
what the sampling view teaches. The work stays small per step: one pass over the vocabulary for the
normaliser, one top-k, and filters applied to the kept tokens only, never a full sort when avoidable.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from engine.facts.errors import NonFiniteLogits
from engine.facts.params import GenerationParams

N_CANDIDATES = 10
TOP_P_WINDOW = 1024   # top-p looks at this many likeliest tokens first; the full sort is the fallback


@dataclass(frozen=True)
class Choice:
    token_id: int
    prob: float          # after the filters: the distribution the token was drawn from
    raw_prob: float      # plain softmax of the logits
    candidate_ids: list[int]
    candidate_raw: list[float]
    candidate_final: list[float]
    kept: int = 1        # tokens with a probability above 0 after the filters (what the draw chose among)


def kept_tokens(scores: torch.Tensor, params: GenerationParams) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The tokens top-k and top-p keep, most likely first, with their renormalised probabilities
    (``[n]`` ids, ``[n]`` probs; dropped ones get probability 0). None when neither filter is on.
    ``scores`` are logits already divided by the temperature, ``[V]``."""
    vocab = scores.size(-1)
    if not params.top_k and params.top_p >= 1.0:
        return None
    if params.top_k:
        values, ids = torch.topk(scores, min(params.top_k, vocab))          # sorted, descending
        log_z = torch.logsumexp(values, -1)                                 # renormalise over the top k
    else:
        log_z = torch.logsumexp(scores, -1)
        values, ids = torch.topk(scores, min(TOP_P_WINDOW, vocab))
        if vocab > TOP_P_WINDOW and float((values - log_z).exp().sum()) < params.top_p:
            values, ids = torch.sort(scores, descending=True)               # a flat distribution: sort all
    probs = (values - log_z).exp()
    if params.top_p < 1.0:
        more_likely = probs.cumsum(-1) - probs                              # mass of the tokens ranked above
        probs = probs.masked_fill(more_likely >= params.top_p, 0.0)         # the first is always kept
    return ids, probs / probs.sum()


def choose(logits: torch.Tensor, params: GenerationParams, generator: torch.Generator | None,
           n_candidates: int = N_CANDIDATES) -> Choice:
    """Pick the next token from ``logits`` (``[V]``). Temperature 0 is argmax (``generate`` refuses T=0; a
    lecturer expects "greedy"). Two small device-to-host copies per call, nothing proportional to V."""
    logits = logits.float()
    log_z = torch.logsumexp(logits, -1)
    top_logits, top_ids = torch.topk(logits, min(n_candidates, logits.size(-1)))
    if params.temperature == 0.0:
        # Greedy needs no tensor work beyond the top-k: two small copies to the host, the rest in Python (a
        # dozen tiny tensor ops cost more than the arithmetic). argmax semantics: among tied maxima (common in
        # bf16) the lowest id, as generate() picks; topk's order among equal values is unspecified.
        *values, z = torch.cat([top_logits, log_z.view(1)]).tolist()
        _check_finite(z)
        ids = top_ids.tolist()
        token = min(i for v, i in zip(values, ids) if v == values[0])
        raw = [math.exp(v - z) for v in values]
        return Choice(token_id=token, prob=1.0, raw_prob=raw[ids.index(token)], candidate_ids=ids,
                      candidate_raw=raw, candidate_final=[1.0 if i == token else 0.0 for i in ids], kept=1)
    _check_finite(float(log_z))
    top_raw = (top_logits - log_z).exp()
    scores = logits / params.temperature if params.temperature != 1.0 else logits
    kept = kept_tokens(scores, params)
    if kept is None:
        final = scores.softmax(-1)                                          # [V]
        token = torch.multinomial(final, 1, generator=generator)            # [1]
        survivors = torch.count_nonzero(final).view(1)
    else:
        kept_ids, kept_probs = kept
        token = kept_ids[torch.multinomial(kept_probs, 1, generator=generator)]
        final = torch.zeros_like(logits).scatter_(0, kept_ids, kept_probs)  # [V], zero where filtered
        survivors = torch.count_nonzero(kept_probs).view(1)
    ids = torch.cat([token, top_ids, survivors]).tolist()
    probs = torch.cat([(logits[token] - log_z).exp(), final[token], top_raw, final[top_ids]]).tolist()
    k = len(ids) - 2
    return Choice(token_id=ids[0], raw_prob=probs[0], prob=probs[1], candidate_ids=ids[1:1 + k],
                  candidate_raw=probs[2:2 + k], candidate_final=probs[2 + k:], kept=ids[-1])


def _check_finite(log_z: float) -> None:
    """The normaliser of the scores: NaN when any score is NaN, infinite when one is +inf or all are -inf. One
    number checked, so no token is ever drawn from, or compared among, scores that are not numbers."""
    if not math.isfinite(log_z):
        raise NonFiniteLogits("the model's next-token scores are not all numbers (NaN or infinity)")


def make_generator(device: torch.device, seed: int) -> torch.Generator:
    """A per-run generator: reproducible even when another thread touches the global RNG."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return gen
