"""Paged KV and prefix sharing, watched inside transformers' own continuous batching.

``ContinuousBatchingManager`` keeps every request's cache in fixed-size blocks of one shared pool (a
``PagedAttentionCache``): a request holds a list of block ids (its block table), grows one block at a time, and
requests whose prompts start alike point at the same blocks for that prefix (``allow_block_sharing``), counted by
reference. A finished request's full blocks stay in the pool, hashed, for a later request with the same prefix.

The manager runs its loop in a background thread and exposes none of this. This adapter drives the same loop one
step at a time on the calling thread and, after each step, reads the block tables, reference counts, cached and
free blocks. Those are private fields: every one of them is read here and nowhere else, and
``check_transformers()`` (called before anything runs, and by a test) fails loudly with the field that moved when
an upgrade changes them.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import GenerationConfig
from transformers.generation.configuration_utils import ContinuousBatchingConfig

from engine.facts import kvformula

TESTED_WITH = "5.25"       # the transformers release whose private fields this module reads


@dataclass
class PagedRequest:
    index: int
    ids: list[int]
    new_tokens: int
    arrival_step: int
    tokens: list[int] = field(default_factory=list)
    cached_tokens: int = 0          # prompt tokens the prefix cache served at admission (the allocator's match)
    block_states: list[str] = field(default_factory=list)     # each readable block's key at admission
    evicted_words: str = ""         # when the first of its blocks that had been cached went, and by what
    admitted_step: int = -1
    arrival_ms: float = -1.0
    admitted_ms: float = -1.0
    first_token_ms: float = -1.0
    done_ms: float = -1.0


@dataclass(frozen=True)
class Snapshot:
    """The pool after one step: per request (by index) its block ids and the positions it holds."""

    step: int
    t_ms: float
    running: list[int]
    tables: list[list[int]]
    positions: list[int]
    waiting: list[int]
    shared: dict[int, int]          # block id -> requests referencing it (2 or more)
    cached: list[int]               # blocks no request holds, kept for their content
    free: int
    total: int


def paged_refusal(facts: Any) -> str | None:
    """Why this model's cache cannot be paged here, or None."""
    if kvformula.state_layers(facts):
        return "state-space layers keep a running state, not pages of keys and values"
    if any(layer.kind != kvformula.FULL for layer in facts.kv_layers):
        return ("only full-attention layers are shown as a block table (transformers pages sliding-window layers "
                "separately, without sharing)")
    return None


def check_transformers() -> None:
    """Fail loudly, naming what moved, if transformers no longer has what this adapter reads."""
    from transformers.generation.continuous_batching import cache as cache_module
    from transformers.generation.continuous_batching import continuous_api, scheduler
    from transformers.generation.continuous_batching.cache_allocators import cache_allocator

    needed = [(continuous_api.ContinuousBatchingManager, ("_create_batch_processor", "_generation_loop_body",
                                                          "add_request", "get_result")),
              (cache_allocator.CacheAllocator, ("_before_cache_tensor_init",)),
              (cache_allocator.BlockLedger, ("acquire", "release")),
              (cache_allocator.CacheAllocator, ("match_prefix_blocks",)),
              (cache_module.PagedAttentionCache, ("search_prefix_match",)),
              (scheduler.FIFOScheduler, ("reset",))]
    if not hasattr(cache_allocator, "compute_block_hash"):
        raise RuntimeError(f"transformers changed: compute_block_hash is gone (this view was written against "
                           f"transformers {TESTED_WITH})")
    for owner, names in needed:
        for name in names:
            if not hasattr(owner, name):
                raise RuntimeError(f"transformers changed: {owner.__name__}.{name} is gone (this view was written "
                                   f"against transformers {TESTED_WITH})")
    fields = ContinuousBatchingConfig.__dataclass_fields__
    for name in ("page_size", "num_blocks", "allow_block_sharing", "use_cuda_graph", "auto_switch_to_flash"):
        if name not in fields:
            raise RuntimeError(f"transformers changed: ContinuousBatchingConfig.{name} is gone (this view was "
                               f"written against transformers {TESTED_WITH})")


@dataclass(frozen=True)
class Pool:
    """The paged cache: ``num_blocks`` blocks of ``page_size`` positions, prefix blocks shared or not."""

    page_size: int
    num_blocks: int
    sharing: bool


def serve_paged(model: Any, requests: list[PagedRequest], pool: Pool, on_step: Callable[[Snapshot], None] | None = None,
                cancel: threading.Event | None = None, max_steps: int = 100_000) -> bool:
    """Serve ``requests`` (each joins at its ``arrival_step``) through transformers' continuous batching with
    ``pool``; greedy, and every request makes exactly its ``new_tokens`` (no end-of-text stop, as in KVScope's
    own scheduler, so both serve the same work and tokens compare one to one). Fills each request's tokens and
    times (ms since the first step); returns False if cancelled."""
    check_transformers()
    original = model.config._attn_implementation
    if original not in ("sdpa", "eager", "paged|eager"):
        model.set_attn_implementation("sdpa")            # e.g. KVScope's capturing sdpa: same arithmetic
    generation = GenerationConfig(do_sample=False, max_new_tokens=max(r.new_tokens for r in requests),
                                  eos_token_id=-1, pad_token_id=0)
    config = ContinuousBatchingConfig(page_size=pool.page_size, num_blocks=pool.num_blocks,
                                      allow_block_sharing=pool.sharing,
                                      max_batch_tokens=max(len(r.ids) for r in requests) + len(requests),
                                      use_cuda_graph=False, use_async_batching=False, auto_switch_to_flash=False)
    manager = model.init_continuous_batching(generation_config=generation, continuous_batching_config=config)
    try:
        with torch.inference_mode():
            return _drive(manager, requests, on_step, cancel, max_steps)
    finally:
        del manager
        model.destroy_cached_continuous_batching_manager()
        if model.config._attn_implementation != original:
            model.set_attn_implementation(original)


def _drive(manager: Any, requests: list[PagedRequest], on_step: Callable[[Snapshot], None] | None,
           cancel: threading.Event | None, max_steps: int) -> bool:
    processor = manager._create_batch_processor()
    manager.batch_processor, manager.current_batch = processor, 0
    cache = processor.cache
    allocator = cache.cache_allocators[next(iter(cache.cache_allocators))]
    by_id = {f"r{r.index}": r for r in requests}
    pending = sorted(requests, key=lambda r: (r.arrival_step, r.index))
    keys = _KeyWatch(allocator)
    search = cache.search_prefix_match

    def admitted(request_id: str, prompt_ids: list[int]) -> int:
        """The allocator's own prefix match, and what each block's key was as it matched (read, never changed)."""
        r = by_id[request_id]
        r.block_states, r.evicted_words = keys.states(prompt_ids)
        r.cached_tokens, r.admitted_step = search(request_id, prompt_ids), step
        return r.cached_tokens

    cache.search_prefix_match = admitted
    t0 = time.perf_counter()
    step = 0
    while step < max_steps:
        if cancel is not None and cancel.is_set():
            return False
        while pending and pending[0].arrival_step <= step:
            r = pending.pop(0)
            r.arrival_ms = (time.perf_counter() - t0) * 1000.0
            manager.add_request(r.ids, request_id=f"r{r.index}", max_new_tokens=r.new_tokens, record_timestamps=True)
        manager._generation_loop_body(processor, bootstrapping=False)
        keys.after(step, [by_id[rid].index for rid in processor.scheduler.active_requests
                          if by_id[rid].admitted_step == step])
        step += 1
        now = (time.perf_counter() - t0) * 1000.0
        active = processor.scheduler.active_requests
        for request_id, state in active.items():
            r = by_id[request_id]
            if r.admitted_ms < 0:
                r.admitted_ms = now
            if state.generated_tokens and r.first_token_ms < 0:
                r.first_token_ms = now
        while (out := manager.get_result(timeout=0.0)) is not None:
            r = by_id[out.request_id]
            if out.error:
                raise RuntimeError(f"transformers' continuous batching failed request {r.index}: {out.error}")
            r.tokens, r.done_ms = list(out.generated_tokens), now
            r.admitted_ms = now if r.admitted_ms < 0 else r.admitted_ms
            r.first_token_ms = now if r.first_token_ms < 0 else r.first_token_ms
        if on_step is not None:
            on_step(_snapshot(step, now, allocator, cache, active, processor.scheduler.waiting_requests, by_id))
        if not pending and not processor.has_pending_requests() and all(r.done_ms >= 0 for r in requests):
            return True
    raise RuntimeError(f"transformers' continuous batching did not finish within {max_steps:,} steps")


def _snapshot(step: int, now: float, allocator: Any, cache: Any, active: dict, waiting: dict,
              by_id: dict[str, PagedRequest]) -> Snapshot:
    running = [rid for rid in active if rid in allocator.block_table]
    ledger = allocator.ledger
    return Snapshot(
        step=step, t_ms=now, running=[by_id[rid].index for rid in running],
        tables=[list(allocator.block_table[rid]) for rid in running],
        positions=[int(active[rid].position_offset) for rid in running],
        waiting=[by_id[rid].index for rid in waiting if rid in by_id],
        shared={int(b): int(n) for b, n in ledger.shared_ref_counts.items()},
        cached=[int(b) for b in ledger.cached_blocks], free=_free_blocks(allocator), total=int(allocator.num_blocks))


class _KeyWatch:
    """The keys (content hashes) of the allocator's full blocks, step by step: which were ever registered, and the
    step each went (evicted when the pool needed free blocks), so an admitted prompt's blocks can be told apart:
    cached now, cached once and evicted, or never written."""

    def __init__(self, allocator: Any) -> None:
        from transformers.generation.continuous_batching.cache_allocators.cache_allocator import compute_block_hash

        self.allocator, self.hash = allocator, compute_block_hash
        self.seen: set[int] = set()
        self.gone: dict[int, str] = {}
        self.held: set[int] = set()

    def states(self, prompt: list[int]) -> tuple[list[str], str]:
        from engine.facts.prefix_misses import GONE, NEVER, PRESENT

        page, now = int(self.allocator.tokens_per_page), self.allocator.ledger.hash_to_block
        out, words, parent = [], "", None
        for b in range((len(prompt) - 1) // page):
            parent = self.hash(parent, prompt[b * page:(b + 1) * page])
            state = PRESENT if parent in now else GONE if parent in self.seen else NEVER
            if state == GONE and not words:
                words = self.gone.get(parent, "")
            out.append(state)
        return out, words

    def after(self, step: int, admitted: list[int]) -> None:
        now = set(self.allocator.ledger.hash_to_block)
        why = f"gone at step {step}, as the pool found free blocks" + (
            f" for request {', '.join(map(str, admitted))} admitted then" if admitted else " for running requests")
        for key in self.held - now:
            self.gone[key] = why
        self.seen |= now
        self.held = now


def _free_blocks(allocator: Any) -> int:
    """Blocks neither held by a request nor kept for their content."""
    held = {b for table in allocator.block_table.values() for b in table} | set(allocator.ledger.cached_blocks)
    return int(allocator.num_blocks) - len(held)
