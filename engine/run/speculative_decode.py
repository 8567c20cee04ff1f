"""Speculative decoding, measured: a cheap drafter guesses the next few tokens, the model checks all of them in
one forward pass, keeps the longest prefix it agrees with plus one token of its own, and the cache is cut back
past the rejected guesses.

Decode is limited by reading the weights, not by arithmetic, so one pass over ``1 + k`` tokens costs little more
than a pass over one: every accepted guess is a forward pass saved. Greedy only: the kept tokens are exactly
the model's own argmax choices, so the output must equal plain greedy decode (the experiment checks it).

This module is the mechanism (drafters and the verify-and-roll-back loop); the lesson that measures it is
``engine.lessons.speculative``. Two drafters: prompt lookup (transformers' ``PromptLookupCandidateGenerator``:
the continuation of the last n-gram where it occurred earlier in the text; free, and right when the output
repeats the input, as in editing code) and a draft model sharing the tokenizer (a smaller model, or this model
with int4 weights). Plain decode is the same loop with no drafter, so both are timed by the same clock over the
same work.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from transformers.generation.candidate_generator import PromptLookupCandidateGenerator

from engine.facts import kvformula
from engine.facts.errors import ParameterError
from engine.facts.fields import MAX_DRAFT
from engine.model import kvcache
from engine.run.model_session import ModelSession


class Drafter(Protocol):
    name: str

    def propose(self, ids: list[int], k: int, cancel: threading.Event | None = None) -> list[int]:
        """Up to ``k`` guesses for the tokens after ``ids`` (the prompt and every token kept so far)."""


class PromptLookup:
    """Guesses by n-gram lookup in the text so far: no model, no weights, a few microseconds."""

    name = "prompt lookup"

    def __init__(self, eos_ids: set[int], ngram: int = 3) -> None:
        self.eos = torch.tensor(sorted(eos_ids)) if eos_ids else None
        self.ngram = ngram

    def propose(self, ids: list[int], k: int, cancel: threading.Event | None = None) -> list[int]:
        lookup = PromptLookupCandidateGenerator(eos_token_id=self.eos, num_output_tokens=k,
                                                max_matching_ngram_size=self.ngram, max_length=len(ids) + k + 1)
        candidates, _ = lookup.get_candidates(torch.tensor([ids]))
        return candidates[0, len(ids):].tolist()


class DraftModel:
    """Guesses greedily with a second model that shares the tokenizer, keeping its own cache in step with the
    text: each call feeds only what it has not seen and cuts back what the target rejected."""

    def __init__(self, loaded: Any, target_vocab: dict[str, int], label: str = "") -> None:
        if loaded.tokenizer.get_vocab() != target_vocab:
            raise ParameterError(f"The draft model {loaded.facts.name} has a different tokenizer: its guesses would "
                                 "be other tokens. Pick a model of the same family")
        refusal = kvformula.speculative_refusal(loaded.facts)
        if refusal:
            raise ParameterError(f"The draft model cannot be used: {refusal}")
        self.loaded, self.model, self.device = loaded, loaded.model, loaded.device
        self.name = f"draft model {loaded.facts.name}" + (f" ({label})" if label else "")
        self.cache: Any = None
        self.held: list[int] = []

    def propose(self, ids: list[int], k: int, cancel: threading.Event | None = None) -> list[int]:
        if self.cache is None:
            self.cache, self.held = kvcache.new_cache(self.model), []
        keep = min(kvformula.common_prefix(self.held, ids), len(ids) - 1)
        kvcache.crop_to(self.cache, keep)
        feed, guesses = ids[keep:], []
        for _ in range(k):
            if cancel is not None and cancel.is_set():
                break                                    # a stop takes effect within one of the draft's passes
            out = kvcache.forward(self.model, torch.tensor([feed], device=self.device), self.cache,
                                  positions=torch.arange(keep, keep + len(feed), device=self.device)[None])
            keep += len(feed)
            token = int(out.logits[0, -1].argmax())
            guesses.append(token)
            feed = [token]
        self.held = ids + guesses[:-1]                   # the last guess was never fed
        if len(guesses) < k:
            self.cache = None                            # stopped part-way: start afresh next time
        return guesses


@dataclass(frozen=True)
class Pass:
    """One verification pass: what was guessed, how many guesses the model kept, its own next token."""

    index: int
    position: int                 # where the first guess would go
    drafted: list[int]
    accepted: int
    token_id: int                 # the model's choice after the kept guesses (a correction, or a bonus)
    draft_ms: float
    verify_ms: float


@dataclass
class Decoded:
    tokens: list[int]
    prefill_ms: float
    decode_ms: float              # wall clock from the first token to the last, drafting included
    passes: list[Pass] = field(default_factory=list)

    @property
    def drafted(self) -> int:
        return sum(len(p.drafted) for p in self.passes)

    @property
    def accepted(self) -> int:
        return sum(p.accepted for p in self.passes)


def decode(session: ModelSession, ids: list[int], new_tokens: int, drafter: Drafter | None, k: int,
           cancel: threading.Event | None = None) -> Decoded:
    """Greedy decode of ``new_tokens`` after ``ids``: with a ``drafter``, ``k`` guesses verified per pass;
    without, one token per pass (plain decode through the same loop). Nothing is emitted inside the timed
    loop, so plain and speculative pay for the same work only; the passes come back in the result."""
    if not 0 <= k <= MAX_DRAFT:
        raise ParameterError(f"Guesses per pass must be between 0 and {MAX_DRAFT}, got {k}")
    refusal = kvformula.speculative_refusal(session.facts)
    if refusal:
        raise ParameterError(f"Speculative decoding is not available for {session.facts.name}: {refusal}")
    limit = session.facts.max_context
    if len(ids) + new_tokens > limit:
        raise ParameterError(f"{len(ids):,} prompt tokens and {new_tokens:,} new ones do not fit the context of "
                             f"{limit:,}")
    model, device, clock, eos = session.model, session.device, session.clock, session.eos_ids
    with torch.inference_mode():
        start = clock.mark()
        logits, cache = session.prefill(torch.tensor([ids], device=device), use_cache=True)
        tokens = [int(logits.argmax())]
        prefill_ms = clock.elapsed_ms(start, clock.mark())
        result = Decoded(tokens, prefill_ms, 0.0)
        began = time.perf_counter()
        while len(tokens) < new_tokens and tokens[-1] not in eos and not (cancel and cancel.is_set()):
            position = len(ids) + len(tokens) - 1          # where the last kept token goes in the cache
            draft_start = clock.mark()
            room = min(k, new_tokens - len(tokens))
            draft = drafter.propose(ids + tokens, room, cancel)[:room] if drafter is not None and room else []
            if cancel is not None and cancel.is_set():
                break
            verify_start = clock.mark()
            fed = torch.tensor([[tokens[-1], *draft]], device=device)
            out = kvcache.forward(model, fed, cache, logits_to_keep=0,
                                  positions=torch.arange(position, position + fed.shape[1], device=device)[None])
            choices = out.logits[0].argmax(-1).tolist()
            end = clock.mark()
            accepted = 0
            while accepted < len(draft) and draft[accepted] == choices[accepted]:
                accepted += 1
            kvcache.crop_to(cache, position + 1 + accepted)     # the rejected guesses leave the cache
            step = Pass(len(result.passes), position + 1, draft, accepted, choices[accepted],
                        clock.elapsed_ms(draft_start, verify_start), clock.elapsed_ms(verify_start, end))
            result.passes.append(step)
            for token in (*draft[:accepted], choices[accepted]):
                tokens.append(token)
                if token in eos or len(tokens) >= new_tokens:
                    break
        result.decode_ms = (time.perf_counter() - began) * 1000.0
    return result
