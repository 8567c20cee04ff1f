"""llama-server's slots, in its own words: ``GET /slots`` lists each slot (a sequence the server decodes in
parallel) with its context (``n_ctx``), whether it is working (``is_processing``) and, once it has served a request,
the prompt it holds (``n_prompt_tokens``, of which ``n_prompt_tokens_cache`` came from its cache) and the tokens it
decoded (``next_token[0].n_decoded``). llama-server no longer exports a KV metric on /metrics; its slots and each
answer's ``timings.cache_n`` are what it says about its cache. Everything is read within bounds; a field it does
not send is absent, never zero. No torch here.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.facts.errors import EngineError

MAX_SLOTS = 64                 # slots read; a server with more is read up to here and said
MAX_POSITIONS = 1 << 24


class SlotsError(EngineError):
    """A /slots answer that is not llama-server's list of slots, in one line."""


@dataclass(frozen=True)
class Slot:
    id: int
    n_ctx: int
    processing: bool
    prompt_tokens: int | None = None       # the prompt it holds (None: it has served nothing yet)
    cached_tokens: int | None = None       # ... of which came from its cache
    decoded: int | None = None             # tokens it generated for its current or last request

    @property
    def held(self) -> int:
        """Positions of its context its cache holds: the prompt and what it decoded, at most its context."""
        return min((self.prompt_tokens or 0) + (self.decoded or 0), self.n_ctx)


def _count(value: object, most: int = MAX_POSITIONS) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= most:
        return None
    return value


def read_slots(answer: object) -> tuple[list[Slot], int]:
    """The slots in ``answer`` (the first ``MAX_SLOTS``) and how many more there were."""
    if not isinstance(answer, list) or not answer:
        raise SlotsError("/slots did not answer with a list of slots (llama-server with --slots, the default)")
    out: list[Slot] = []
    for entry in answer[:MAX_SLOTS]:
        if not isinstance(entry, dict):
            raise SlotsError("/slots answered with something that is not a slot")
        ident, n_ctx = _count(entry.get("id"), 1 << 16), _count(entry.get("n_ctx"))
        if ident is None or not n_ctx:
            raise SlotsError("/slots answered with a slot without its id and context")
        tokens = entry.get("next_token")
        decoded = _count(tokens[0].get("n_decoded")) if isinstance(tokens, list) and tokens and isinstance(
            tokens[0], dict) else None
        out.append(Slot(ident, n_ctx, entry.get("is_processing") is True, _count(entry.get("n_prompt_tokens")),
                        _count(entry.get("n_prompt_tokens_cache")), decoded))
    return out, max(len(answer) - MAX_SLOTS, 0)


def slot_values(slots: list[Slot]) -> dict[str, float]:
    """One poll as a point's values: the totals, and each slot's context, held positions and state."""
    values: dict[str, float] = {"slots": len(slots), "busy": sum(s.processing for s in slots),
                                "held": sum(s.held for s in slots)}
    for s in slots:
        values[f"ctx {s.id}"] = s.n_ctx
        values[f"held {s.id}"] = s.held
        values[f"busy {s.id}"] = float(s.processing)
    return values
