"""What the lessons feed the model: real text of any length, prompt sets that fit the context, a conversation.
Shared by several lessons, so none of them imports another. No torch here."""

from __future__ import annotations

from engine.facts.errors import ParameterError
from engine.run.model_session import ModelSession
from engine.store.resources import sample_prompts

FILLER = ("Every request to a language model passes through two stages. In the prefill stage the whole prompt "
          "is read in one forward pass, and its keys and values are stored in the cache. In the decode stage "
          "the model produces one token per forward pass, attending to everything already cached. ")
CONVERSATION = (
    "hey, what is continuous batching?",
    "How is that different from static batching?",
    "Give me a one-line summary of both.",
    "Thanks! Now explain the KV cache in one sentence.",
)


def filler_ids(session: ModelSession, n: int) -> list[int]:
    """``n`` real-text token ids (no template), so prefill runs on language, not on one repeated token."""
    chunk = session.encode(FILLER, chat_template=False)
    return (chunk * (n // len(chunk) + 1))[:n]


def sample_texts() -> list[str]:
    return [text for _title, text in sample_prompts()]


def fitting(session: ModelSession, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """The prompts that fit the context with ``new_tokens`` more; refused before any compute if none do."""
    limit = session.facts.max_context
    fit = [ids for ids in prompts if len(ids) + new_tokens <= limit]
    if not fit:
        raise ParameterError(f"No prompt fits the context of {limit:,} tokens with {new_tokens} new tokens: use "
                             "shorter prompts or fewer tokens")
    return fit
