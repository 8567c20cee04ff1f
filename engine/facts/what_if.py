"""What the filters would have done to a step already drawn: the step's recorded candidates (the likeliest
tokens, with their plain softmax probabilities) filtered again with another temperature, top-k or top-p, with no
model and no rerun.

The candidates are the top of the distribution, so a filter that keeps only tokens among them (top-k up to
their count, or top-p whose nucleus closes inside them) gives exactly the distribution the sampler would have
drawn from. Where the result depends on the tokens beyond them (a temperature other than 1 with no top-k to cut
the rest, or a nucleus wider than the candidates), their scores are not in the trace: the shares among the
candidates are still exact relative to each other, and ``exact`` says the absolute values are not.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class WhatIf:
    """Per recorded candidate, in their order: the probability after the filters (0: cut)."""

    probs: tuple[float, ...]
    kept: int                     # candidates that survive
    exact: bool                   # the sampler's distribution exactly, or only the candidates' relative shares
    why: str = ""                 # when not exact: what it would need

    def words(self) -> str:
        return "exact" if self.exact else self.why


def refilter(p_raw: Sequence[float], temperature: float, top_k: int = 0, top_p: float = 1.0) -> WhatIf:
    """The candidates' probabilities under ``temperature``, then ``top_k``, then ``top_p`` over what top-k left
    (the sampler's order and meaning: a token is kept while the tokens more likely than it hold less than p).
    ``p_raw``: the candidates' plain softmax probabilities, likeliest first."""
    n = len(p_raw)
    if n == 0:
        return WhatIf((), 0, False, "no candidates were recorded for this step")
    if temperature == 0.0:                       # greedy: the likeliest, always
        return WhatIf(tuple(1.0 if i == 0 else 0.0 for i in range(n)), 1, True)
    logs = [math.log(p) / temperature if p > 0 else -math.inf for p in p_raw]
    cut_by_k = 0 < top_k <= n
    if cut_by_k:                                 # only candidates survive: renormalise among them, exactly
        kept = logs[:top_k]
        top = max(kept)
        weights = [math.exp(v - top) for v in kept] + [0.0] * (n - top_k)
        total = sum(weights)
        probs = [w / total for w in weights]
        exact, why = True, ""
    elif temperature == 1.0:                     # the recorded probabilities are the whole distribution's
        probs = list(p_raw)
        exact, why = True, ""
    else:
        top = max(logs)
        weights = [math.exp(v - top) for v in logs]
        total = sum(weights)
        probs = [w / total for w in weights]
        exact = False
        why = (f"relative shares only: at T={temperature:g} with no top-k the other tokens' scores count too, "
               f"and only the {n} likeliest were recorded")
    if top_p < 1.0:
        more_likely, survivors = 0.0, []
        for p in probs:
            survivors.append(p if more_likely < top_p else 0.0)
            more_likely += p
        closes_inside = more_likely >= top_p     # the nucleus ends among the candidates
        if exact and not cut_by_k and not closes_inside:
            exact = False
            why = (f"top-p {top_p:g} reaches past the {n} recorded candidates (they hold {more_likely:.0%}): "
                   "the tokens beyond them are not in the trace")
        total = sum(survivors)
        probs = [p / total for p in survivors] if total > 0 else survivors
    return WhatIf(tuple(probs), sum(1 for p in probs if p > 0), exact, why)
