"""Speculative decoding, measured: a cheap drafter guesses the next few tokens, the model checks all of them in
one forward pass, keeps the longest prefix it agrees with plus one token of its own, and the cache is cut back
past the rejected guesses.

Decode is limited by reading the weights, not by arithmetic, so one pass over ``1 + k`` tokens costs little more
than a pass over one: every accepted guess is a forward pass saved. Greedy only: the kept tokens are exactly
the model's own argmax choices, so the output must equal plain greedy decode (the experiment checks it).

Two drafters: prompt lookup (transformers' ``PromptLookupCandidateGenerator``: the continuation of the last
n-gram where it occurred earlier in the text; free, and right when the output repeats the input, as in editing
code) and a draft model sharing the tokenizer (a smaller model, or this model with int4 weights). Plain decode
is the same loop with no drafter, so both are timed by the same clock over the same work.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from engine import kvcache
from engine.errors import ModelSourceError, ParameterError
from engine.events import DraftPass, ExperimentFinished, HardwarePeaks
from engine.resources import SPECULATIVE_PROMPTS as PROMPTS
from engine.schema import MAX_DRAFT

PROMPT_LOOKUP, DRAFT_MODEL = "prompt lookup", "draft model"


class Drafter(Protocol):
    name: str

    def propose(self, ids: list[int], k: int) -> list[int]:
        """Up to ``k`` guesses for the tokens after ``ids`` (the prompt and every token kept so far)."""


class PromptLookup:
    """Guesses by n-gram lookup in the text so far: no model, no weights, a few microseconds."""

    name = "prompt lookup"

    def __init__(self, eos_ids: set[int], ngram: int = 3) -> None:
        self.eos = torch.tensor(sorted(eos_ids)) if eos_ids else None
        self.ngram = ngram

    def propose(self, ids: list[int], k: int) -> list[int]:
        from transformers.generation.candidate_generator import PromptLookupCandidateGenerator

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
        refusal = speculative_refusal(loaded.facts)
        if refusal:
            raise ParameterError(f"The draft model cannot be used: {refusal}")
        self.loaded, self.model, self.device = loaded, loaded.model, loaded.device
        self.name = f"draft model {loaded.facts.name}" + (f" ({label})" if label else "")
        self.cache: Any = None
        self.held: list[int] = []

    def propose(self, ids: list[int], k: int) -> list[int]:
        if self.cache is None:
            self.cache, self.held = kvcache.new_cache(self.model), []
        keep = min(kvcache.common_prefix(self.held, ids), len(ids) - 1)
        kvcache.crop_to(self.cache, keep)
        feed, guesses = ids[keep:], []
        for _ in range(k):
            out = self.model(input_ids=torch.tensor([feed], device=self.device), cache=self.cache, use_cache=True,
                             position_ids=torch.arange(keep, keep + len(feed), device=self.device)[None],
                             logits_to_keep=1)
            keep += len(feed)
            token = int(out.logits[0, -1].argmax())
            guesses.append(token)
            feed = [token]
        self.held = ids + guesses[:-1]                   # the last guess was never fed
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


def speculative_refusal(facts: Any) -> str | None:
    """Why rejected guesses could not be cut out of this model's cache, or None."""
    if kvcache.state_layers(facts):
        return "state-space layers keep one running state, which cannot be rolled back past rejected guesses"
    if any(layer.kind == kvcache.SLIDING for layer in facts.kv_layers):
        return "sliding-window layers drop old positions, so the cache cannot be rolled back past rejected guesses"
    return None


def decode(session: Any, ids: list[int], new_tokens: int, drafter: Drafter | None, k: int,
           cancel: threading.Event | None = None) -> Decoded:
    """Greedy decode of ``new_tokens`` after ``ids``: with a ``drafter``, ``k`` guesses verified per pass;
    without, one token per pass (plain decode through the same loop). Nothing is emitted inside the timed
    loop, so plain and speculative pay for the same work only; the passes come back in the result."""
    if not 0 <= k <= MAX_DRAFT:
        raise ParameterError(f"Guesses per pass must be between 0 and {MAX_DRAFT}, got {k}")
    refusal = speculative_refusal(session.facts)
    if refusal:
        raise ParameterError(f"Speculative decoding is not available for {session.facts.name}: {refusal}")
    limit = session.facts.max_context
    if len(ids) + new_tokens > limit:
        raise ParameterError(f"{len(ids):,} prompt tokens and {new_tokens:,} new ones do not fit the context of "
                             f"{limit:,}")
    model, device, clock, eos = session.model, session.device, session.clock, session._eos
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
            draft = drafter.propose(ids + tokens, room)[:room] if drafter is not None and room else []
            verify_start = clock.mark()
            fed = torch.tensor([[tokens[-1], *draft]], device=device)
            out = model(input_ids=fed, cache=cache, use_cache=True,
                        position_ids=torch.arange(position, position + fed.shape[1], device=device)[None])
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


# --- the experiment ---------------------------------------------------------------------------------------
def speculative_decoding(session: Any, emit: Any, cancel: threading.Event | None = None, *,
                         prompt: str = PROMPTS["repeats itself"], drafter: str = PROMPT_LOOKUP,
                         draft_model: str = "", draft_dtype: str = "int4", draft_tokens: int = 8,
                         new_tokens: int = 64, repeats: int = 2,
                         peaks: HardwarePeaks | None = None) -> ExperimentFinished:
    """Plain greedy decode and speculative decode of the same prompt, interleaved ``repeats`` times, timed by
    the same loop: medians of decode wall time, every pass of the last speculative repeat with its guesses,
    the acceptance rate, tokens per pass, and whether the two outputs are the same tokens."""
    import statistics

    from engine.experiments import _Experiment
    from engine.load import LoadMeter
    from engine.models import load

    if drafter not in (PROMPT_LOOKUP, DRAFT_MODEL) or not 1 <= draft_tokens <= MAX_DRAFT or new_tokens < 2 \
            or not 1 <= repeats <= 20:
        raise ParameterError(f"Speculative decoding needs a drafter ({PROMPT_LOOKUP} or {DRAFT_MODEL}), 1 to "
                             f"{MAX_DRAFT} guesses per pass, at least 2 new tokens and 1 to 20 repeats")
    refusal = speculative_refusal(session.facts)
    if refusal:
        raise ParameterError(f"Speculative decoding is not available for {session.facts.name}: {refusal}")
    ids = session.encode(prompt)
    session.check_prompt(len(ids))
    if len(ids) + new_tokens > session.facts.max_context:
        raise ParameterError(f"The prompt's {len(ids):,} tokens and {new_tokens:,} new ones do not fit the "
                             f"context of {session.facts.max_context:,}: ask for fewer new tokens")
    settings = {"prompt": prompt, "drafter": drafter, "draft_tokens": draft_tokens, "new_tokens": new_tokens,
                "repeats": repeats}
    if drafter == DRAFT_MODEL:
        settings.update(draft_model=draft_model or session.facts.source, draft_dtype=draft_dtype)
    x = _Experiment("speculative", session, settings, emit, cancel, peaks)
    if drafter == DRAFT_MODEL:
        x.progress(0, 2 * repeats, f"loading the draft model ({settings['draft_model']}, {draft_dtype})")
        try:
            guesser: Drafter = DraftModel(load(settings["draft_model"], str(session.device), draft_dtype),
                                          session.tokenizer.get_vocab(), draft_dtype)
        except ModelSourceError as exc:
            raise ParameterError(f"The draft model could not be loaded: {exc}") from None
    else:
        guesser = PromptLookup(session._eos)
    decode(session, ids, 4, guesser, draft_tokens)                       # warm-up, not measured
    runs: dict[str, list[Decoded]] = {"plain": [], "speculative": []}
    shares: list[float] = []
    for repeat in range(repeats):
        for name, who, k in (("plain", None, 0), ("speculative", guesser, draft_tokens)):
            if x.cancel.is_set():
                break
            x.progress(len(runs["plain"]) + len(runs["speculative"]), 2 * repeats,
                       f"repeat {repeat + 1} of {repeats}: {name} decode")
            meter = LoadMeter()
            meter.start()
            result = decode(session, ids, new_tokens, who, k, x.cancel)
            meter.stop()
            share = meter.share()
            if share is not None:
                shares.append(share)
            runs[name].append(result)
            generated = len(result.tokens)
            x.point(name, repeat=repeat, decode_ms=result.decode_ms, prefill_ms=result.prefill_ms,
                    generated=generated, passes=len(result.passes), drafted=result.drafted, accepted=result.accepted,
                    decode_tok_s=(generated - 1) / (result.decode_ms / 1000.0) if result.decode_ms else 0.0)
            if name == "speculative":
                _emit_passes(x, session, repeat, result)
    x.progress(2 * repeats, 2 * repeats, "done")
    if not runs["plain"] or not runs["speculative"] or x.cancel.is_set():
        return x.finish({"incomplete": True, "tokens_match": False})
    plain, spec = runs["plain"][-1], runs["speculative"][-1]
    plain_ms = statistics.median(r.decode_ms for r in runs["plain"])
    spec_ms = statistics.median(r.decode_ms for r in runs["speculative"])
    difference = next((i for i, (a, b) in enumerate(zip(plain.tokens, spec.tokens)) if a != b), None)
    if difference is None and len(plain.tokens) != len(spec.tokens):
        difference = min(len(plain.tokens), len(spec.tokens))
    return x.finish({
        "drafter": guesser.name, "draft_tokens": draft_tokens, "prompt_tokens": len(ids),
        "first_text": session._piece(spec.tokens[0]),
        "generated": len(spec.tokens),
        "plain_decode_ms": plain_ms, "speculative_decode_ms": spec_ms,
        "speedup": plain_ms / spec_ms if spec_ms else float("nan"),
        "plain_passes": len(plain.passes), "passes": len(spec.passes), "drafted": spec.drafted,
        "accepted": spec.accepted, "acceptance": spec.accepted / spec.drafted if spec.drafted else 0.0,
        "tokens_per_pass": (len(spec.tokens) - 1) / len(spec.passes) if spec.passes else 0.0,
        "draft_share": sum(p.draft_ms for p in spec.passes) / spec.decode_ms if spec.decode_ms else 0.0,
        "tokens_match": difference is None, "first_difference": -1 if difference is None else difference,
        "lowest_cpu_share": min(shares, default=-1.0)})


def _emit_passes(x: Any, session: Any, repeat: int, result: Decoded) -> None:
    piece = session._piece
    for p in result.passes:
        x.emit(DraftPass(x.exp_id, x.ms(), repeat, p.index, p.position, list(p.drafted),
                         [piece(t) for t in p.drafted], p.accepted, p.token_id, piece(p.token_id), p.draft_ms,
                         p.verify_ms))
