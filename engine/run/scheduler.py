"""Continuous batching you can watch: requests arrive on a schedule and join a running batch between decode
steps; finished ones leave and free their rows. Static batching, for comparison, admits waiting requests only
when the whole batch has finished.

The batch is one left-padded KV cache with an attention mask and a position per row, so every request produces
the greedy tokens it would produce alone. A newcomer is prefilled on its own, then its cache is padded or the
batch's is, and the rows are stacked; leaving rows are dropped, and columns that are padding in every remaining
row are trimmed. Rows stay right-aligned, so a sliding-window layer's last positions are the same for every row
(``engine.model.kvcache`` keeps each layer within the capacity the model really has).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.facts import kvformula
from engine.facts.errors import ParameterError
from engine.facts.events import ModelFacts
from engine.model import kvcache
from engine.run.model_session import ModelSession

POLICIES = ("continuous", "static")


@dataclass
class ScheduledRequest:
    index: int
    ids: list[int]
    new_tokens: int
    arrival_step: int
    tokens: list[int] = field(default_factory=list)
    arrival_ms: float = 0.0
    admitted_ms: float = 0.0
    first_token_ms: float = 0.0
    done_ms: float = 0.0

    @property
    def done(self) -> bool:
        return len(self.tokens) >= self.new_tokens


class BatchedDecoder:
    """The running batch: rows, their cache, mask and next positions."""

    def __init__(self, model, device: torch.device, facts: ModelFacts) -> None:
        self.model, self.device, self.facts = model, device, facts
        self.rows: list[ScheduledRequest] = []
        self.cache = None
        self.mask: torch.Tensor | None = None          # [B, L] 1 = real position, 0 = padding
        self.positions: list[int] = []                 # next position of each row

    def admit(self, request: ScheduledRequest) -> None:
        """Prefill ``request`` alone, take its first token, and stack its cache under the batch's."""
        ids = torch.tensor([request.ids], device=self.device)
        cache = kvcache.new_cache(self.model)
        with torch.inference_mode():
            out = kvcache.forward(self.model, ids, cache)
        self.join(request, cache, int(out.logits[0, -1].argmax()))

    def join(self, request: ScheduledRequest, cache: Any, first_token: int) -> None:
        """Stack ``request``'s prefilled cache under the batch's, its first token taken (prefilled here, or by
        another worker and handed over)."""
        request.tokens.append(first_token)
        n = len(request.ids)
        mask = torch.ones((1, n), dtype=torch.long, device=self.device)
        if self.cache is None:
            self.cache, self.mask = cache, mask
        else:
            width = self.mask.shape[1]
            if n < width:
                kvcache.pad_left(cache, width - n, self.facts)
                mask = torch.cat([mask.new_zeros(1, width - n), mask], dim=1)
            elif n > width:
                kvcache.pad_left(self.cache, n - width, self.facts)
                self.mask = torch.cat([self.mask.new_zeros(len(self.rows), n - width), self.mask], dim=1)
            kvcache.append_rows(self.cache, cache)
            self.mask = torch.cat([self.mask, mask], dim=0)
        self.rows.append(request)
        self.positions.append(n)

    def step(self) -> None:
        """One decode step for every row: feed each row's last token at its own position."""
        rows = len(self.rows)
        tokens = torch.tensor([[r.tokens[-1]] for r in self.rows], device=self.device)      # [B, 1]
        self.mask = torch.cat([self.mask, self.mask.new_ones(rows, 1)], dim=1)
        positions = torch.tensor([[p] for p in self.positions], device=self.device)        # [B, 1]
        with torch.inference_mode():
            out = kvcache.forward(self.model, tokens, self.cache, positions=positions, mask=self.mask)
        for row, token in zip(self.rows, out.logits[:, -1].argmax(-1).tolist()):
            row.tokens.append(token)
        self.positions = [p + 1 for p in self.positions]

    def release_finished(self) -> list[ScheduledRequest]:
        finished = [r for r in self.rows if r.done]
        if not finished:
            return []
        keep = [i for i, r in enumerate(self.rows) if not r.done]
        if not keep:
            self.rows, self.cache, self.mask, self.positions = [], None, None, []
            return finished
        kvcache.select_rows(self.cache, keep)
        self.mask = self.mask[keep]
        self.rows = [self.rows[i] for i in keep]
        self.positions = [self.positions[i] for i in keep]
        unused = int((self.mask.sum(dim=0) == 0).long().cumprod(0).sum())    # leading all-padding columns
        if unused:
            kvcache.drop_left(self.cache, unused)
            self.mask = self.mask[:, unused:]
        return finished


def serve(session: ModelSession, requests: list[ScheduledRequest], policy: str,
          on_step: Callable[[float, int], None] | None = None, cancel: threading.Event | None = None) -> bool:
    """Run ``requests`` (arrival times in decode steps) on ``session``'s model to completion under ``policy``;
    fills their timings (ms since start) and tokens. ``on_step(t_ms, batch_size)`` after every decode step.
    False if cancelled. On a GPU each time is read after the device finished (a sync)."""
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}")
    model, device, facts = session.model, session.device, session.facts
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    t0 = time.perf_counter()

    def now() -> float:
        sync()
        return (time.perf_counter() - t0) * 1000.0

    upcoming = sorted(requests, key=lambda r: (r.arrival_step, r.index))
    waiting: list[ScheduledRequest] = []
    refusal = kvformula.batching_refusal(facts)
    if refusal is not None:
        raise ParameterError(f"Continuous batching is not available for {facts.name}: {refusal}")
    batch = BatchedDecoder(model, device, facts)
    step = 0
    while upcoming or waiting or batch.rows:
        if cancel is not None and cancel.is_set():
            return False
        if not waiting and not batch.rows and upcoming:
            step = max(step, upcoming[0].arrival_step)         # nothing to do until the next request arrives
        while upcoming and upcoming[0].arrival_step <= step:
            request = upcoming.pop(0)
            request.arrival_ms = now()
            waiting.append(request)
        if waiting and (policy == "continuous" or not batch.rows):
            for request in waiting:
                request.admitted_ms = now()
                batch.admit(request)
                request.first_token_ms = now()
            waiting = []
            for request in batch.release_finished():            # asked for a single token
                request.done_ms = request.first_token_ms
        if batch.rows:
            batch.step()
            step += 1
            t = now()
            for request in batch.release_finished():
                request.done_ms = t
            if on_step is not None:
                on_step(t, len(batch.rows))
        else:
            step += 1
    return True
