"""Why a prompt's tokens were computed rather than read from a prefix cache, from what was observed, never a
guess called a reason.

A block-hash prefix cache (vLLM's, SGLang's, transformers' paged cache) keys each *full* block of a prompt by its
tokens and its parent's key, and matches a new prompt block by block from the start; the prompt's last token is
always computed (its logits are the answer). So for a prompt of ``L`` tokens in blocks of ``B`` at most
``(L - 1) // B`` blocks can be read, and the rest of the prompt is computed. When fewer were read, the first block
not read says why: its key was never registered (no earlier request had written that block: the prompts diverge
before its end, or the request sharing it had not finished its prefill yet), or it was registered and evicted
before this request came. The caller observes the matched length and each block's state; this module only puts
words to them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from engine.facts.kvformula import common_prefix

NONE, DIVERGED, PARTIAL, EVICTED, NOT_YET, COLD, UNKNOWN = (
    "none", "first divergent token", "partial block", "evicted", "not yet cached", "nothing earlier", "unknown")
REASONS = (NONE, DIVERGED, PARTIAL, EVICTED, NOT_YET, COLD, UNKNOWN)
PRESENT, GONE, NEVER = "present", "evicted", "never"      # a block's key when the request was admitted


@dataclass(frozen=True)
class Miss:
    cached_tokens: int
    computed_tokens: int
    reason: str                        # one of REASONS: why the first computed block was not read
    words: str                         # the sentence
    divergent_position: int | None = None
    nearest_request: int | None = None  # the earlier request sharing the longest prefix
    request_token: int | None = None   # the token at the divergent position in this prompt ...
    cached_token: int | None = None    # ... and in the nearest earlier one


def explain(prompt: Sequence[int], block: int, matched: int, earlier: Sequence[tuple[int, Sequence[int]]],
            states: Sequence[str], evicted_words: str = "") -> Miss:
    """``matched``: tokens the cache served; ``earlier``: (request, prompt) admitted before this one; ``states``:
    for each block of the prompt that could be read (``(L - 1) // block`` of them), its key at admission
    (``PRESENT``, ``GONE`` or ``NEVER``); ``evicted_words``: when and by what the first evicted block went."""
    length = len(prompt)
    readable = (length - 1) // block
    computed = length - matched
    nearest, shared = None, 0
    for index, other in earlier:
        n = common_prefix(prompt, other)
        if n > shared or nearest is None:
            nearest, shared = index, n
    diverged = shared < length and nearest is not None
    where = dict(divergent_position=shared if diverged else None, nearest_request=nearest,
                 request_token=prompt[shared] if diverged else None,
                 cached_token=next((o[shared] for i, o in earlier if i == nearest and shared < len(o)), None)
                 if diverged else None)
    first = matched // block
    if first >= readable:                          # everything that could be read was
        tail = length - readable * block
        return Miss(matched, computed, NONE if computed <= 1 else PARTIAL,
                    f"{matched:,} of {length:,} prompt tokens read from the cache; the last {tail:,} fill no whole "
                    f"block of {block} (a cache keeps whole blocks, and the last token is always computed)", **where)
    state = states[first] if first < len(states) else NEVER
    if state == GONE:
        return Miss(matched, computed, EVICTED,
                    f"block {first + 1} of this prompt was cached earlier and evicted before this request came"
                    + (f" ({evicted_words})" if evicted_words else ""), **where)
    if state == PRESENT:
        return Miss(matched, computed, UNKNOWN, f"block {first + 1} was in the cache but not read: the events do "
                    "not say why", **where)
    if nearest is None:
        return Miss(matched, computed, COLD, "no request came before this one: nothing was cached to read", **where)
    if shared >= (first + 1) * block:              # an earlier prompt holds this whole block: not written yet
        return Miss(matched, computed, NOT_YET,
                    f"request {nearest} shares {shared:,} tokens with it, but had not finished writing block "
                    f"{first + 1} when this one was admitted (still in its prefill)", **where)
    if shared % block == 0:
        return Miss(matched, computed, DIVERGED,
                    f"the prompt leaves request {nearest}'s at position {shared:,}, a block boundary", **where)
    lost = shared - first * block
    return Miss(matched, computed, PARTIAL,
                f"the prompt shares {shared:,} tokens with request {nearest}'s, leaving it at position {shared:,} "
                f"inside block {first + 1}: a cache keeps whole blocks of {block}, so those {lost:,} shared tokens "
                "were computed again", **where)
