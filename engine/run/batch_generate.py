"""Greedy generation for several prompts at once: left padding, an attention mask and per-row positions, so
each row produces the tokens it would produce alone (checked against solo runs in the tests).

It generates exactly ``new_tokens`` per row (end of sequence does not stop a row): the batch experiment
measures throughput at a fixed amount of work, and equality with solo runs is checked token for token.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from engine.model import kvcache
from engine.model.clock import StepClock


@dataclass
class BatchResult:
    tokens: list[list[int]]        # [B][new_tokens]
    prefill_ms: float              # the batched prefill forward pass
    ttft_ms: float                 # prefill + first sample, for every row at once
    step_ms: list[float]           # each batched decode step (forward + argmax)
    padded_length: int
    stopped: bool = False

    @property
    def decode_ms(self) -> float:
        return sum(self.step_ms)


def left_pad(prompts: list[list[int]], pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``ids`` and ``attention_mask``, both ``[B, L]``, padding on the left so every row ends at column L-1."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = torch.tensor(prompt)
        mask[row, width - len(prompt):] = 1
    return ids.to(device), mask.to(device)


def generate_batch(model, prompts: list[list[int]], new_tokens: int, pad_id: int, device: torch.device,
                   cancel: threading.Event | None = None) -> BatchResult:
    clock = StepClock(device)
    ids, mask = left_pad(prompts, pad_id, device)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)                          # [B, L]
    cache = kvcache.new_cache(model)
    rows = len(prompts)
    with torch.inference_mode():
        start = clock.mark()
        out = kvcache.forward(model, ids, cache, positions=positions, mask=mask)
        forward_end = clock.mark()
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)                     # [B, 1]
        end = clock.mark()
        prefill_ms, ttft_ms = clock.elapsed_ms(start, forward_end), clock.elapsed_ms(start, end)
        tokens = [[t] for t in nxt[:, 0].tolist()]
        last = positions[:, -1:]
        step_ms: list[float] = []
        for _ in range(new_tokens - 1):
            if cancel is not None and cancel.is_set():
                return BatchResult(tokens, prefill_ms, ttft_ms, step_ms, ids.shape[1], stopped=True)
            mask = torch.cat([mask, mask.new_ones(rows, 1)], dim=1)         # the mask grows with the cache
            last = last + 1
            start = clock.mark()
            out = kvcache.forward(model, nxt, cache, positions=last, mask=mask)
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
            end = clock.mark()
            step_ms.append(clock.elapsed_ms(start, end))
            for row, t in enumerate(nxt[:, 0].tolist()):
                tokens[row].append(t)
    return BatchResult(tokens, prefill_ms, ttft_ms, step_ms, ids.shape[1])
