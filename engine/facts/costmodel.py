"""Analytic cost: how many FLOPs and bytes prefill and decode need, and what that predicts on a device.

Two models. The seed's attention-only model (``attention_flops``) reproduces the course module's worked
example exactly, numbers the lecture already uses. The whole-model estimate adds what dominates a real model:
every weight is used once per token (2 FLOPs per weight: a multiply and an add), and every decode step
reads all the weights plus the cached keys and values. Dividing by a device's peak FLOP/s and bandwidth gives
the two bounds of a roofline; the larger is the prediction. Everything here is computed, never measured.
No torch here: the window uses it with no model loaded.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.facts import kvformula
from engine.facts.events import HardwarePeaks, ModelFacts

SEED_D_MODEL = 64
SEED_LENGTHS = (50, 100, 200, 400, 800)


# --- the seed's attention-only model (002_32e53dcadf2ec574.txt, section 8) --------------------------------
def attention_flops(seq_len: int, d_model: int) -> int:
    """Core QK^T + softmax@V cost of one pass over ``seq_len`` tokens."""
    return 2 * seq_len * seq_len * d_model


def decode_flops_no_cache(prompt_len: int, num_new_tokens: int, d_model: int) -> int:
    """Every step recomputes attention over the whole sequence so far."""
    return sum(attention_flops(prompt_len + i + 1, d_model) for i in range(num_new_tokens))


def decode_flops_with_cache(prompt_len: int, num_new_tokens: int, d_model: int) -> int:
    """Only the new token's query against the cached keys."""
    return sum(2 * (prompt_len + i + 1) * d_model for i in range(num_new_tokens))


def course_cache_reduction(d_model: int = SEED_D_MODEL, prompt_len: int = 100, num_new_tokens: int = 50) -> float:
    """The course module's "Reduction factor: 127.2x": attention FLOPs alone, without the cache over with it."""
    return (decode_flops_no_cache(prompt_len, num_new_tokens, d_model)
            / decode_flops_with_cache(prompt_len, num_new_tokens, d_model))


def course_doubling(d_model: int = SEED_D_MODEL) -> float:
    """The course module's "Doubling 400->800: FLOPs multiplier = 4.0x": attention's n² term alone."""
    return attention_flops(800, d_model) / attention_flops(400, d_model)


def seed_example(d_model: int = SEED_D_MODEL, prompt_len: int = 100, num_new_tokens: int = 50) -> str:
    """The seed's "Expected Output", line for line."""
    lines = ["PREFILL cost -- scales QUADRATICALLY:"]
    for n in SEED_LENGTHS:
        lines.append(f"  Prompt length {n:4d} -> ~{attention_flops(n, d_model):,} FLOPs")
    ratio = attention_flops(800, d_model) / attention_flops(400, d_model)
    lines += ["", f"Doubling 400->800: FLOPs multiplier = {ratio:.1f}x", ""]
    no_cache = decode_flops_no_cache(prompt_len, num_new_tokens, d_model)
    with_cache = decode_flops_with_cache(prompt_len, num_new_tokens, d_model)
    lines += [f"Prompt length: {prompt_len}, generating {num_new_tokens} new tokens",
              f"  WITHOUT KV cache: {no_cache:,} total FLOPs",
              f"  WITH KV cache:    {with_cache:,} total FLOPs",
              f"  Reduction factor: {no_cache / with_cache:.1f}x"]
    return "\n".join(lines)


# --- whole-model estimate ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Device:
    """A device's measured ceilings (see ``engine.model.hardware``). ``wide_flops_per_s``: where the model's
    products of ``wide_rows`` rows or more run widened to float32 (a half float this CPU emulates), float32's
    measured peak, their ceiling; 0: every product runs at ``flops_per_s``."""

    name: str
    flops_per_s: float
    bytes_per_s: float
    wide_rows: int = 0
    wide_flops_per_s: float = 0.0

    @classmethod
    def of(cls, peaks: HardwarePeaks) -> Device:
        return cls(peaks.device, peaks.flops_per_s, peaks.bytes_per_s, peaks.wide_rows, peaks.wide_flops_per_s)

    def widens(self, rows: int) -> bool:
        """Whether a product of ``rows`` rows over the weights runs widened (at ``wide_flops_per_s``)."""
        return bool(self.wide_flops_per_s and self.wide_rows and rows >= self.wide_rows)

    def product_flops_per_s(self, rows: int) -> float:
        """The peak a product of ``rows`` rows over the weights runs at: the arithmetic it really runs in."""
        return self.wide_flops_per_s if self.widens(rows) else self.flops_per_s


@dataclass(frozen=True)
class Cost:
    """FLOPs and bytes of a pass whose products over the weights have ``rows`` rows (a prefill's tokens; one in a
    decode step): its ceiling is the peak of the arithmetic products of that many rows run in."""

    flops: float
    bytes: float
    rows: int = 1

    @property
    def intensity(self) -> float:
        """FLOPs per byte moved: high means compute-bound, low means bandwidth-bound."""
        return self.flops / self.bytes if self.bytes else float("inf")

    def peak_flops_per_s(self, device: Device) -> float:
        """The most FLOP/s this pass can run at: what an achieved rate is compared with. Every FLOP is held to
        the products' peak (the products are nearly all of them; a ceiling must never sit below what a run can
        achieve)."""
        return device.product_flops_per_s(self.rows)

    def compute_s(self, device: Device) -> float:
        return self.flops / self.peak_flops_per_s(device)

    def memory_s(self, device: Device) -> float:
        return self.bytes / device.bytes_per_s

    def predicted_s(self, device: Device) -> float:
        """Roofline: whichever ceiling is hit first bounds the time."""
        return max(self.compute_s(device), self.memory_s(device))

    def bound(self, device: Device) -> str:
        return "compute" if self.compute_s(device) >= self.memory_s(device) else "bandwidth"


class ModelCost:
    """FLOPs and bytes of prefill and decode for one model.

    Linear layers: 2 FLOPs per weight per token. The output projection (vocabulary x hidden) runs for the
    last position only (``logits_to_keep=1``). Attention, causal: query i meets i+1 keys, for QK^T and again
    for softmax@V, 2 FLOPs each, over all heads. Bytes per decode step: all weights once (the embedding only
    through the output projection, since a lookup reads one row) plus the keys and values cached so far.
    """

    def __init__(self, model: ModelFacts) -> None:
        self.m = model
        self.head_width = model.num_heads * model.head_dim
        self.output_params = model.vocab_size * model.hidden_size
        embeddings = self.output_params * (1 if model.tied_embeddings else 2)
        self.body_params = max(model.num_params - embeddings, 0)
        # A sliding layer's query sees at most its window (the positions kept plus itself); a full one all.
        self.windows = [None if layer.kind != kvformula.SLIDING else (layer.capacity or 0) + 1
                        for layer in kvformula.attention_layers(model)]
        # The bytes of the weights as stored (int8 and int4 read fewer), else parameters x the dtype's size.
        self.weight_bytes = model.weight_bytes or (self.body_params + self.output_params) * model.dtype_bytes

    def _attention(self, queries_from: int, queries_to: int) -> float:
        """Attention FLOPs for query positions ``queries_from .. queries_to - 1`` (each sees p + 1 keys, or its
        window), QK^T and softmax@V, 2 FLOPs per multiply-add, summed over the attention layers."""
        keys = sum(_keys_seen(queries_from, queries_to, window) for window in self.windows)
        return 4.0 * self.head_width * keys

    def prefill(self, n: int) -> Cost:
        return self.prefill_after(0, n)

    def prefill_after(self, cached: int, n: int) -> Cost:
        """``n`` new tokens in one pass after ``cached`` positions the cache already holds (a chat turn's reuse):
        the layers' products have ``n`` rows, and the new queries meet every key."""
        flops = 2.0 * self.body_params * n + 2.0 * self.output_params + self._attention(cached, cached + n)
        return Cost(flops, self.weight_bytes + kvformula.predicted_kv_bytes(self.m, cached + n), rows=n)

    def decode(self, position: int) -> Cost:
        """One decode step: the token at ``position`` attends to ``position + 1`` keys (or its window)."""
        flops = 2.0 * (self.body_params + self.output_params) + self._attention(position, position + 1)
        return Cost(flops, self.weight_bytes + kvformula.predicted_kv_bytes(self.m, position + 1))

    def decode_without_cache(self, position: int) -> Cost:
        """Without a cache a decode step is a prefill of the whole sequence so far."""
        return self.prefill(position + 1)

    def decode_total(self, prompt: int, new_tokens: int, cache: bool) -> Cost:
        """All decode steps after the prefill (the first token comes from the prefill)."""
        costs = [(self.decode if cache else self.decode_without_cache)(prompt + i) for i in range(new_tokens - 1)]
        return Cost(sum(c.flops for c in costs), sum(c.bytes for c in costs))

    def decode_bound_tok_s(self, position: int, device: Device) -> float:
        """The most tokens per second one sequence can decode at ``position`` on ``device``."""
        return 1.0 / self.decode(position).predicted_s(device)


def quadratic_from(cost: ModelCost) -> float:
    """The prompt length at which attention's n^2 FLOPs equal the linear 2 x parameters FLOPs per token
    (computed): below it prefill's FLOPs grow about linearly, above it quadratically."""
    layers = max(len(cost.windows), 1)
    return cost.body_params / (cost.head_width * layers) if cost.head_width else float("inf")


def scaling_note(cost: ModelCost) -> str:
    """Why the seed's "prefill scales quadratically" and a measured n^0.6 to n^1.1 are both right, for this model."""
    crossover = quadratic_from(cost)
    return (f"Why prefill time is not n^2 here: attention's FLOPs grow as n^2, but the weights' 2 x parameters "
            f"FLOPs per token grow as n, and for this model the n^2 term catches up only at about {crossover:,.0f} "
            "tokens (computed). Below that prefill is about linear in FLOPs, and for short prompts reading the "
            "weights once costs more than the arithmetic, so measured time grows slower than n (computed "
            "bounds above; `sweep prefill` measures it).")


def _keys_seen(queries_from: int, queries_to: int, window: int | None) -> float:
    """Sum over query positions p in [from, to) of the keys p sees: p + 1, capped at ``window``."""
    def total(n: int) -> float:            # sum over p < n of min(p + 1, window)
        if window is None or n <= window:
            return n * (n + 1) / 2
        return window * (window + 1) / 2 + (n - window) * window
    return total(queries_to) - total(queries_from)
