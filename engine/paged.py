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

from engine import kvcache

TESTED_WITH = "5.24"       # the transformers release whose private fields this module reads


@dataclass
class PagedRequest:
    index: int
    ids: list[int]
    new_tokens: int
    arrival_step: int
    tokens: list[int] = field(default_factory=list)
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
    if kvcache.state_layers(facts):
        return "state-space layers keep a running state, not pages of keys and values"
    if any(layer.kind != kvcache.FULL for layer in facts.kv_layers):
        return ("only full-attention layers are shown as a block table (transformers pages sliding-window layers "
                "separately, without sharing)")
    return None


def check_transformers() -> None:
    """Fail loudly, naming what moved, if transformers no longer has what this adapter reads."""
    from transformers.generation.configuration_utils import ContinuousBatchingConfig
    from transformers.generation.continuous_batching import continuous_api, scheduler
    from transformers.generation.continuous_batching.cache_allocators import cache_allocator

    needed = [(continuous_api.ContinuousBatchingManager, ("_create_batch_processor", "_generation_loop_body",
                                                          "add_request", "get_result")),
              (cache_allocator.CacheAllocator, ("_before_cache_tensor_init",)),
              (cache_allocator.BlockLedger, ("acquire", "release")),
              (scheduler.FIFOScheduler, ("reset",))]
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


def serve_paged(model: Any, requests: list[PagedRequest], *, page_size: int, num_blocks: int, sharing: bool,
                eos_ids: set[int], on_step: Callable[[Snapshot], None] | None = None,
                cancel: threading.Event | None = None, max_steps: int = 100_000) -> bool:
    """Serve ``requests`` (each joins at its ``arrival_step``) through transformers' continuous batching with
    a paged cache of ``num_blocks`` blocks of ``page_size`` positions; greedy. Fills each request's tokens and
    times (ms since the first step); returns False if cancelled."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    check_transformers()
    original = model.config._attn_implementation
    if original not in ("sdpa", "eager", "paged|eager"):
        model.set_attn_implementation("sdpa")            # e.g. KVScope's capturing sdpa: same arithmetic
    generation = GenerationConfig(do_sample=False, max_new_tokens=max(r.new_tokens for r in requests),
                                  eos_token_id=sorted(eos_ids) or -1, pad_token_id=0)
    config = ContinuousBatchingConfig(page_size=page_size, num_blocks=num_blocks, allow_block_sharing=sharing,
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


def _free_blocks(allocator: Any) -> int:
    """Blocks neither held by a request nor kept for their content."""
    held = {b for table in allocator.block_table.values() for b in table} | set(allocator.ledger.cached_blocks)
    return int(allocator.num_blocks) - len(held)


# --- the experiment ---------------------------------------------------------------------------------------
SYSTEM = ("You are the support assistant of a library. Answer in one short sentence, politely, and never invent "
          "opening hours: the library opens at nine and closes at six on weekdays, and is closed on Sundays.")
QUESTIONS = ("When do you open on Monday?", "Are you open on Sunday?", "Can I return a book at seven?",
             "What time do you close on Friday?", "Do you open before nine?", "Is the library open on Saturday?",
             "Can I come at noon on Tuesday?", "When do you close on Wednesday?")


def paged_kv(session: Any, emit: Any, cancel: threading.Event | None = None, *, requests: int = 6,
             arrive_every: int = 3, new_tokens: int = 16, page_size: int = 16, system: str = SYSTEM,
             reserve: int = 256, compare: bool = True, peaks: Any = None) -> Any:
    """Requests that share a system prompt arrive every ``arrive_every`` steps and run through transformers'
    continuous batching with a paged cache, block sharing on (every step's block table is emitted) and off;
    then the same arrivals through KVScope's own scheduler. Summary: blocks held at the peak with and without
    sharing (measured from the block tables) next to what a contiguous cache would reserve for the same requests
    (computed: prompt + ``reserve`` positions each, as a server reserves for a request's max_tokens), the
    prefix blocks shared, and timings and tokens of both schedulers."""
    import statistics

    from engine.batch import generate_batch
    from engine.errors import ParameterError
    from engine.events import BlockTable
    from engine.experiments import _Experiment
    from engine.scheduler import Request, serve

    if not 1 <= requests <= 64 or arrive_every < 0 or not 1 <= new_tokens <= 1024 or not 4 <= page_size <= 1024 \
            or reserve < new_tokens:
        raise ParameterError("The paged cache lesson needs 1 to 64 requests, arrivals every 0 or more steps, 1 to "
                             "1,024 new tokens, blocks of 4 to 1,024 positions and a reservation of at least the new "
                             "tokens")
    refusal = paged_refusal(session.facts)
    if refusal:
        raise ParameterError(f"The paged cache lesson is not available for {session.facts.name}: {refusal}")
    check_transformers()
    prompts = [_encode(session, system, QUESTIONS[i % len(QUESTIONS)]) for i in range(requests)]
    longest = max(len(p) for p in prompts) + new_tokens
    if longest > session.facts.max_context:
        raise ParameterError(f"A request of {longest:,} positions does not fit the context of "
                             f"{session.facts.max_context:,}")
    per_request = -(-longest // page_size)
    num_blocks = requests * per_request + 4                 # room for every request without sharing
    settings = {"requests": requests, "arrive_every": arrive_every, "new_tokens": new_tokens,
                "page_size": page_size, "system": system, "num_blocks": num_blocks, "reserve": reserve}
    x = _Experiment("paged", session, settings, emit, cancel, peaks)
    total_steps = 3 if compare else 2
    model = session.model          # every request makes exactly new_tokens (no end-of-text stop), as in KVScope's
                                   # own scheduler, so both serve the same work and tokens compare one to one

    def arrivals() -> list[PagedRequest]:
        return [PagedRequest(i, ids, new_tokens, i * arrive_every) for i, ids in enumerate(prompts)]

    peaks_by_sharing: dict[bool, dict] = {}
    runs: dict[bool, list[PagedRequest]] = {}
    for done, sharing in enumerate((True, False)):
        x.progress(done, total_steps, f"transformers' continuous batching, block sharing {'on' if sharing else 'off'}")
        batch, peak = arrivals(), {"blocks": 0, "reserved": 0, "used": 0}

        def step(snap: Snapshot, sharing: bool = sharing, peak: dict = peak, batch: list = batch) -> None:
            held = len({b for table in snap.tables for b in table})
            if held > peak["blocks"]:
                reserved = sum(len(batch[i].ids) + reserve for i in snap.running)
                peak.update(blocks=held, reserved=reserved, used=sum(snap.positions), step=snap.step)
            if sharing:
                x.emit(BlockTable(x.exp_id, x.ms(), snap.step, page_size, snap.total, snap.running, snap.tables,
                                  snap.positions, snap.waiting, sorted(snap.shared), [snap.shared[b] for b in
                                                                                     sorted(snap.shared)],
                                  snap.cached, snap.free))

        if not serve_paged(model, batch, page_size=page_size, num_blocks=num_blocks, sharing=sharing, eos_ids=set(),
                           on_step=step, cancel=x.cancel):
            return x.finish({"incomplete": True})
        peaks_by_sharing[sharing], runs[sharing] = peak, batch
        for r in batch:
            x.point("request", sharing=float(sharing), index=r.index, prompt_tokens=len(r.ids),
                    new_tokens=len(r.tokens), ttft_ms=r.first_token_ms - r.arrival_ms,
                    e2e_ms=r.done_ms - r.arrival_ms, queue_ms=r.admitted_ms - r.arrival_ms)
    summary = {**_paged_summary(session, runs, peaks_by_sharing, page_size, prompts), "reserve": reserve}
    solo = [generate_batch(model, [ids], new_tokens, 0, session.device).tokens[0] for ids in prompts]
    summary["tokens_match_solo"] = solo == [r.tokens for r in runs[True]]
    if compare:
        x.progress(2, total_steps, "the same arrivals through KVScope's own scheduler")
        ours = [Request(i, ids, new_tokens, i * arrive_every) for i, ids in enumerate(prompts)]
        if not serve(model, session.device, session.facts, ours, "continuous", cancel=x.cancel):
            return x.finish({"incomplete": True, **summary})
        theirs = runs[True]
        summary.update(_timings("ours", ours), same_tokens_as_ours=[r.tokens for r in ours] ==
                       [r.tokens for r in theirs])
    summary.update(_timings("transformers", runs[True]))
    summary["mean_ttft_spread"] = statistics.pstdev(r.first_token_ms - r.arrival_ms for r in runs[True])
    x.progress(total_steps, total_steps, "done")
    return x.finish(summary)


def _encode(session: Any, system: str, question: str) -> list[int]:
    if session.has_chat_template:
        messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
        return list(session.tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False))
    return session.encode(f"{system}\n{question}\n", chat_template=False)


def _paged_summary(session: Any, runs: dict, peaks_by_sharing: dict, page_size: int, prompts: list) -> dict:
    per_position = kvcache.bytes_per_token(session.facts)
    on, off = peaks_by_sharing[True], peaks_by_sharing[False]
    shared_prefix = 0
    for a, b in zip(prompts, prompts[1:]):
        shared_prefix = max(shared_prefix, kvcache.common_prefix(a, b))
    return {
        "bytes_per_position": per_position, "bytes_per_block": per_position * page_size,
        "peak_blocks_shared": on["blocks"], "peak_blocks_unshared": off["blocks"],
        "peak_bytes_shared": on["blocks"] * page_size * per_position,
        "peak_bytes_unshared": off["blocks"] * page_size * per_position,
        "contiguous_bytes_at_peak": off["reserved"] * per_position,
        "used_bytes_at_peak": off["used"] * per_position,
        "shared_prefix_tokens": shared_prefix, "shared_prefix_blocks": shared_prefix // page_size,
        "sharing_saves": 1.0 - on["blocks"] / off["blocks"] if off["blocks"] else 0.0,
        "same_tokens_with_and_without_sharing": [r.tokens for r in runs[True]] == [r.tokens for r in runs[False]]}


def _timings(prefix: str, batch: list) -> dict:
    import statistics

    span = max(r.done_ms for r in batch) - min(r.arrival_ms for r in batch)
    return {f"{prefix}_tok_s": sum(len(r.tokens) for r in batch) / (span / 1000.0) if span else 0.0,
            f"{prefix}_mean_ttft_ms": statistics.fmean(r.first_token_ms - r.arrival_ms for r in batch),
            f"{prefix}_mean_e2e_ms": statistics.fmean(r.done_ms - r.arrival_ms for r in batch)}
