"""The events a prefix cache's blocks are drawn from, declared by the lessons that report them (the paged-KV
lesson's ``BlockTable`` and ``PrefixMiss``, the load test's ``KVBlocks`` and ``RequestBlocks``) and kept here,
beside the tree (``engine.serve.prefix_tree``) that reads the block events. Each checks itself against its experiment
(``engine.facts.vocabulary.LessonEvent``), so the trace schema knows them only through the lessons."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated

from engine.facts.fields import (
    MAX_BLOCKS,
    MAX_CONTEXT,
    MAX_REQUESTS,
    Count,
    Ident,
    Items,
    Message,
    Range,
    Text,
    TokenId,
    TokenText,
)
from engine.facts.prefix_misses import REASONS
from engine.facts.validation import FieldError
from engine.facts.vocabulary import LessonEvent

BlockIds = Annotated[list[Annotated[int, Range(0, 4 * MAX_BLOCKS - 1)]], Items(MAX_BLOCKS)]
Requests = Annotated[list[Annotated[int, Range(0, MAX_REQUESTS - 1)]], Items(MAX_REQUESTS)]
BlockKeys = Annotated[list[Ident], Items(MAX_BLOCKS)]


@dataclass(frozen=True)
class BlockTable(LessonEvent):
    """The paged KV cache after one step of transformers' continuous batching: for each running request (by
    index) its block ids in order and the positions it has written; the blocks two or more requests share with
    their reference counts; blocks no request holds but kept for their content (a later request with the same
    prefix reuses them); free blocks. Each block holds ``block_positions`` positions for every layer."""

    step: Annotated[int, Range(0, 1 << 30)]
    block_positions: Annotated[int, Range(1, 1 << 16)]
    total_blocks: Annotated[int, Range(1, MAX_BLOCKS)]
    running: Requests
    tables: Annotated[list[BlockIds], Items(MAX_REQUESTS)]
    positions: Annotated[list[Count], Items(MAX_REQUESTS)]
    waiting: Requests
    shared_blocks: BlockIds
    shared_refs: Annotated[list[Annotated[int, Range(2, MAX_REQUESTS)]], Items(MAX_BLOCKS)]
    cached_blocks: BlockIds
    free_blocks: Annotated[int, Range(0, MAX_BLOCKS)]

    def check(self, vocab_size: int, max_context: int) -> None:
        total, size = self.total_blocks, self.block_positions
        if len(self.tables) != len(self.running) or len(self.positions) != len(self.running):
            raise FieldError(f"tables and positions must give one entry for each of the {len(self.running):,} "
                             "running requests")
        if len(set(self.running)) != len(self.running) or len(set(self.waiting)) != len(self.waiting):
            raise FieldError("running and waiting must be distinct request numbers")
        ids = set()
        for table, held in zip(self.tables, self.positions):
            if len(table) > total:
                raise FieldError(f"tables must hold at most {total:,} block ids per request")
            if held > len(table) * size:
                raise FieldError("positions must fit in the request's blocks")
            ids.update(table)
        if len(self.shared_blocks) > total or len(self.cached_blocks) > total:
            raise FieldError(f"shared_blocks and cached_blocks hold at most {total:,} blocks")
        if len(self.shared_refs) != len(self.shared_blocks) or not all(b in ids for b in self.shared_blocks) \
                or any(n > len(self.running) for n in self.shared_refs):
            raise FieldError("shared_blocks must be blocks the running requests hold, each with 2 or more of them")
        if self.free_blocks > total:
            raise FieldError(f"free_blocks must be between 0 and {total:,}")


@dataclass(frozen=True)
class KVBlocks(LessonEvent):
    """What a serving engine's prefix cache did to its blocks (vLLM's KV events), as it published it: blocks
    ``stored`` (in order, each the child of the one before, the first the child of ``parent``; with each block's
    token ids and their text as the server decodes them), ``removed`` (evicted) or ``cleared`` (all at once).
    ``publisher``: which engine said it ("" for a server with one). Keys are the blocks' hashes, in hex."""

    action: Annotated[str, Text(16, ("stored", "removed", "cleared"))]
    keys: BlockKeys = field(default_factory=list)
    parent: Ident = ""
    tokens: Annotated[list[Annotated[list[TokenId], Items(4096)]], Items(MAX_BLOCKS)] = field(default_factory=list)
    texts: Annotated[list[Annotated[str, Text(4096)]], Items(MAX_BLOCKS)] = field(default_factory=list)
    publisher: Ident = ""
    medium: Annotated[str, Text(16)] = ""      # where a tiered cache keeps the blocks (GPU, CPU, ...; "": not said)

    def check(self, vocab_size: int, max_context: int) -> None:
        if self.action == "stored" and not (len(self.tokens) == len(self.keys) and
                                            len(self.texts) in (0, len(self.keys))):
            raise FieldError(f"tokens (and texts) must give one entry for each of the {len(self.keys):,} blocks")
        if self.action == "cleared" and self.keys:
            raise FieldError("a cleared event names no blocks")


@dataclass(frozen=True)
class RequestBlocks(LessonEvent):
    """One request's prompt against the engine's prefix cache: the blocks it walks in the tree once it was
    answered (``keys``, from the root), how many of its ``prompt_tokens`` the tree's blocks held when it was sent
    (``reused_tokens``: a *prediction*, made before the server decided; a request sent while the blocks it needs
    are still being computed for another is predicted short), and how many the server says it served from its
    cache in its answer (``server_cached_tokens``: vLLM's and SGLang's ``usage.prompt_tokens_details
    .cached_tokens``, llama-server's ``timings.cache_n``; None when the answer did not say)."""

    index: Annotated[int, Range(0, MAX_REQUESTS - 1)]
    prompt_tokens: Count
    reused_tokens: Count
    block_size: Annotated[int, Range(1, 1 << 16)]
    keys: BlockKeys = field(default_factory=list)
    server_cached_tokens: Count | None = None

    @property
    def mispredicted(self) -> bool:
        """The server served a different number of cached tokens than the tree predicted at send."""
        return self.server_cached_tokens is not None and self.server_cached_tokens != self.reused_tokens

    def check(self, vocab_size: int, max_context: int) -> None:
        if self.reused_tokens > self.prompt_tokens:
            raise FieldError(f"reused_tokens must be at most the {self.prompt_tokens:,} prompt tokens")
        if self.server_cached_tokens is not None and self.server_cached_tokens > self.prompt_tokens:
            raise FieldError(f"server_cached_tokens must be at most the {self.prompt_tokens:,} prompt tokens")
        if len(self.keys) * self.block_size > self.prompt_tokens + self.block_size:
            raise FieldError("keys must be at most the blocks the prompt fills")


@dataclass(frozen=True)
class PrefixMiss(LessonEvent):
    """One request's prompt at admission: tokens the prefix cache served and tokens computed, and why the first
    computed block was not read (``engine.facts.prefix_misses``): its reason, a sentence, and for a divergence the
    position, the nearest earlier request and both tokens there (as ids and as text)."""

    request: Annotated[int, Range(0, MAX_REQUESTS - 1)]
    prompt_tokens: Count
    cached_tokens: Count
    computed_tokens: Count
    reason: Annotated[str, Text(32, REASONS)]
    words: Message
    divergent_position: Count | None = None
    nearest_request: Annotated[int, Range(0, MAX_REQUESTS - 1)] | None = None
    request_token: TokenId | None = None
    cached_token: TokenId | None = None
    request_text: TokenText = ""
    cached_text: TokenText = ""
    prompt_pieces: Annotated[list[TokenText], Items(MAX_CONTEXT)] = field(default_factory=list)    # each token, shown

    def check(self, vocab_size: int, max_context: int) -> None:
        if self.cached_tokens + self.computed_tokens != self.prompt_tokens:
            raise FieldError("cached_tokens and computed_tokens must add up to prompt_tokens")
        if self.prompt_pieces and len(self.prompt_pieces) != self.prompt_tokens:
            raise FieldError("prompt_pieces must give one piece for each prompt token")
        if self.divergent_position is not None and self.divergent_position >= self.prompt_tokens:
            raise FieldError("divergent_position must be inside the prompt")
        for token in (self.request_token, self.cached_token):
            if token is not None and vocab_size and token >= vocab_size:
                raise FieldError(f"token ids must be below the vocabulary's {vocab_size:,}")
