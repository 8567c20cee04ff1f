"""Do two greedy runs of one model agree, and where they do not, is it rounding or a bug?

A compiled graph computes the same arithmetic as eager in another order (other kernels, fused operators), so its
logits differ in the last bits. Where eager's two likeliest tokens are that close, the other run may pick the
second: rounding, not a wrong graph. Where eager's first choice was well ahead and the other run still picked
something else, the graph computes something else: a bug. The line between them is ``TIE_NATS`` per float: a
gap between the top two logits that the float's rounding over a whole forward pass can close.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from engine.facts.events import TokenStep

# The largest top-two logit gap (nats) rounding can close, by the float the products run in: float32's 24-bit
# mantissa leaves differences around 1e-5 of a logit; bfloat16's 8 bits (and int8 / int4 weights multiplied in
# bfloat16 or float32 after dequantizing) around 1e-2, summed over 30 layers.
TIE_NATS = {"float32": 0.01, "float16": 0.25, "bfloat16": 0.25, "int8": 0.25, "int4": 0.25}


@dataclass(frozen=True)
class Divergence:
    """Where two greedy runs first chose different tokens: the step (0: the prefill's token), each run's token,
    eager's top-two logit gap there (nats; None when the step's candidates did not include two), and whether
    that gap is within rounding for the float."""

    step: int
    eager_token: int
    other_token: int
    margin: float | None
    near_tie: bool

    def words(self) -> str:
        gap = f"eager's top two {self.margin:.3f} nats apart" if self.margin is not None else "no second candidate"
        verdict = "within rounding" if self.near_tie else "not a tie: the graph computes something else"
        return (f"first differs at token {self.step + 1:,} (eager {self.eager_token}, compiled "
                f"{self.other_token}; {gap}, {verdict})")


def margin(step: TokenStep) -> float | None:
    """The gap between the step's two likeliest tokens before any filter, in nats (a logit difference)."""
    probs = sorted((c.p_raw for c in step.candidates), reverse=True)
    if len(probs) < 2 or probs[1] <= 0:
        return None
    return math.log(probs[0]) - math.log(probs[1])


def first_divergence(eager: Sequence[TokenStep], other: Sequence[TokenStep], dtype: str) -> Divergence | None:
    """The first step at which ``other`` chose another token than ``eager`` (greedy runs of one prompt), or None
    where every step both ran agrees."""
    tie = TIE_NATS.get(dtype, TIE_NATS["bfloat16"])
    for ours, theirs in zip(eager, other):
        if ours.token_id != theirs.token_id:
            gap = margin(ours)
            return Divergence(ours.step, ours.token_id, theirs.token_id, gap, gap is not None and gap <= tie)
    return None
