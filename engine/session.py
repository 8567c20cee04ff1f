"""The instrumented inference loop: ``prefill`` (one forward pass over the prompt), ``decode_step`` (one
forward pass per new token over the cached prefix) and ``run`` driving both and emitting events.

The hot loop does the forward pass, sampling and O(layers) bookkeeping only: KV bytes are read from tensor
metadata (no device work), KV norms are one stacked reduction with one device-to-host copy, and text pieces
come from an incremental decoder. Everything else (statistics, display) happens in the event consumers.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

import torch

from engine import attention, faults, kvcache
from engine.clock import StepClock
from engine.errors import ParameterError, PromptError
from engine.events import (
    AttentionStep,
    Candidate,
    KVNorms,
    PrefillDone,
    RunFailed,
    RunFinished,
    RunStarted,
    RunSummary,
    TokenStep,
)
from engine.load import LoadMeter
from engine.models import LoadedModel
from engine.params import GenerationParams
from engine.sampling import choose, make_generator
from engine.textstream import TextStream, clean_text, pieces

log = logging.getLogger(__name__)
Sink = Callable[[object], None]
FaultHook = Callable[[str, int], None]
NORMS_EVERY = 8      # decode steps between KVNorms events: one batched read instead of eight small ones


@dataclass
class _Tally:
    """What has been measured so far, so a failed run still reports its numbers."""

    prompt_tokens: int = 0
    reused_tokens: int = 0
    tokenize_ms: float = 0.0
    prefill_ms: float = 0.0
    ttft_ms: float = 0.0
    decode_ms: float = 0.0
    waited_ms: float = 0.0
    compile_ms: float = 0.0
    kv_tokens: int = 0
    kv_bytes: int = 0
    cache_note: str = ""
    load: LoadMeter = field(default_factory=LoadMeter)
    token_ids: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)

    def summary(self, total_ms: float) -> RunSummary:
        generated = len(self.token_ids)
        compiled_step = 1 if self.compile_ms and generated > 1 else 0       # timed apart: it compiled
        return RunSummary(
            prompt_tokens=self.prompt_tokens, generated_tokens=generated,
            decode_runs=max(generated - 1 - compiled_step, 0), compile_ms=self.compile_ms,
            tokenize_ms=self.tokenize_ms, prefill_ms=self.prefill_ms, ttft_ms=self.ttft_ms,
            decode_ms=self.decode_ms, total_ms=total_ms, kv_tokens=self.kv_tokens, kv_bytes=self.kv_bytes,
            text="".join(self.text), token_ids=list(self.token_ids), reused_tokens=self.reused_tokens,
            waited_ms=self.waited_ms, cpu_share=self.load.share(self.waited_ms))


class Session:
    """A loaded model ready to run prompts, one at a time, from one thread."""

    def __init__(self, loaded: LoadedModel, *, record_kv_norms: bool = True,
                 fault_hook: FaultHook | None = None) -> None:
        self.loaded = loaded
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.device = loaded.device
        self.facts = loaded.facts
        self.record_kv_norms = record_kv_norms
        self.fault_hook = fault_hook if fault_hook is not None else faults.from_env()
        self.clock = StepClock(self.device)
        self._special = set(self.tokenizer.all_special_ids)
        self._eos = _eos_ids(self.model, self.tokenizer)
        self._candidate_text: dict[int, str] = {}
        self._kept_cache: Any = None        # the cache a chat keeps between turns
        self._kept_ids: list[int] = []      # ...and the ids it holds
        self._dropped = "this is the first turn"     # why there is no kept cache, for the next turn to say
        self._compiled = None
        self._attention: attention.Capture | None = None     # made on the first run that captures

    # --- prompt -------------------------------------------------------------------------------------------
    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    def encode(self, prompt: str, chat_template: bool = True) -> list[int]:
        """Prompt ids: through the chat template when asked and the tokenizer has one, else raw text."""
        if chat_template and self.has_chat_template:
            ids = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], add_generation_prompt=True, return_dict=False)
            return list(ids)
        return list(self.tokenizer(prompt)["input_ids"])

    def check_prompt(self, n_tokens: int) -> None:
        limit = self.facts.max_context
        if n_tokens == 0:
            raise PromptError("The prompt is empty: type something for the model to read")
        if n_tokens >= limit:
            raise PromptError(
                f"The prompt is {n_tokens:,} tokens but the model's context holds {limit:,} (including at least "
                f"one new token): shorten it by {n_tokens - limit + 1:,} tokens")

    # --- the two phases -----------------------------------------------------------------------------------
    def prefill(self, input_ids: torch.Tensor, use_cache: bool, cache: Any = None,
                static_positions: int = 0) -> tuple[torch.Tensor, Any]:
        """One forward pass over the prompt. ``input_ids``: ``[1, n]``; returns last logits ``[V]`` and the
        filled cache (None with the cache off; with ``static_positions``, allocated for that many up front).
        Given a ``cache`` that already holds the first positions (an earlier turn), only the new ids are passed;
        their positions continue from the cache."""
        if use_cache and cache is None:
            cache = kvcache.new_cache(self.model, static_positions)
        out = self.model(input_ids=input_ids, cache=cache if use_cache else None, use_cache=use_cache,
                         logits_to_keep=1, **self._capture_kwargs())
        self._collect(out)
        return out.logits[0, -1], cache

    def decode_step(self, token: torch.Tensor, position: int, cache: Any,
                    sequence: torch.Tensor | None, compiled: bool = False) -> torch.Tensor:
        """One new token. With the cache: feed one token at ``position`` (``[1, 1]``) and attend to the
        cached keys and values (through ``torch.compile`` when ``compiled``: CUDA graphs over a static cache).
        Without: recompute the whole ``sequence`` (``[1, position + 1]``)."""
        if cache is not None:
            forward = self._compiled_forward() if compiled else self.model
            out = forward(input_ids=token.view(1, 1), cache=cache, use_cache=True,
                          position_ids=torch.tensor([[position]], device=self.device), **self._capture_kwargs())
        else:
            out = self.model(input_ids=sequence, use_cache=False, logits_to_keep=1, **self._capture_kwargs())
        self._collect(out)
        return out.logits[0, -1]                                           # [V]

    def _capture_kwargs(self) -> dict:
        return self._attention.forward_kwargs() if self._attention is not None else {}

    def _collect(self, out: Any) -> None:
        if self._attention is not None:
            self._attention.collect(out)

    def attention_capture(self) -> attention.Capture:
        """The session's attention capture, attached to the model on first use (``engine.attention``)."""
        if self._attention is None:
            try:
                self._attention = attention.attach(self.model, self.facts.num_layers)
            except ValueError as exc:
                raise ParameterError(str(exc)) from exc
        return self._attention

    def _compiled_forward(self):
        """The model's forward compiled once per session: CUDA graphs replay a decode step as one launch."""
        if self._compiled is None:
            mode = "reduce-overhead" if self.device.type == "cuda" else "default"
            self._compiled = torch.compile(self.model.forward, mode=mode, dynamic=False)
        return self._compiled

    # --- the run ------------------------------------------------------------------------------------------
    def run(self, prompt: str, params: GenerationParams, sink: Sink | None = None,
            cancel: threading.Event | None = None,
            before_step: Callable[[int], None] | None = None) -> RunFinished | RunFailed:
        """Generate for ``prompt``, emitting ``RunStarted``, ``PrefillDone``, one ``TokenStep`` per token and
        ``RunFinished`` (or ``RunFailed``). Bad input raises before any compute. ``cancel`` is checked
        before every forward pass; ``before_step(step)`` may block (pause, single-step, slow motion)."""
        t0 = time.perf_counter()
        prompt, _replaced = clean_text(prompt or "")
        if not prompt.strip():
            raise PromptError("The prompt is empty: type something for the model to read")
        ids = self.encode(prompt, params.chat_template)
        if self._kept_cache is not None:
            self.forget("a plain run since the last turn replaced the conversation's cache")
        return self._run(ids, prompt, "generate", params, sink, cancel, before_step, t0, reuse=False)

    def chat(self, messages: list[dict], params: GenerationParams, sink: Sink | None = None,
             cancel: threading.Event | None = None, before_step: Callable[[int], None] | None = None,
             reuse: bool = True) -> RunFinished | RunFailed:
        """One turn of a conversation: ``messages`` is the whole conversation so far, ending with the new
        user message. With ``reuse``, the cache kept from the last turn gives back the longest prefix it
        shares with the newly rendered conversation (cropped where they diverge) and only the rest is
        prefilled; without, every turn prefills the whole conversation again."""
        t0 = time.perf_counter()
        messages = [{**m, "content": clean_text(str(m.get("content", "")))[0]} for m in messages]
        if not messages or not messages[-1]["content"].strip():
            raise PromptError("The message is empty: type something for the model to read")
        if self.has_chat_template:
            ids = list(self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False))
        else:
            ids = list(self.tokenizer("\n".join(f"{m['role']}: {m['content']}" for m in messages)
                                      + "\nassistant:")["input_ids"])
        if not reuse or not params.kv_cache or params.static_cache:
            self.forget("reuse is off" if not reuse else "the KV cache is off" if not params.kv_cache else
                        "a static cache is allocated for one run at a time")
        return self._run(ids, messages[-1]["content"], "chat", params, sink, cancel, before_step, t0,
                         reuse=reuse and params.kv_cache and not params.static_cache)

    def forget(self, reason: str = "a new conversation started") -> None:
        """Drop the cache kept for the next turn, remembering why (the next turn reports it)."""
        self._kept_cache, self._kept_ids, self._dropped = None, [], reason

    @property
    def kept_tokens(self) -> int:
        return len(self._kept_ids)

    def _run(self, ids: list[int], prompt: str, kind: str, params: GenerationParams, sink: Sink | None,
             cancel: threading.Event | None, before_step: Callable[[int], None] | None, t0: float,
             reuse: bool) -> RunFinished | RunFailed:
        emit = sink or (lambda _e: None)
        self.check_prompt(len(ids))
        if params.top_k > self.facts.vocab_size:
            raise ParameterError(f"top_k must be at most the vocabulary size ({self.facts.vocab_size:,}), "
                                 f"got {params.top_k:,} (0 = off)")
        if params.seed is None:
            params = params.with_(seed=secrets.randbelow(2**31))
        capture = self.attention_capture() if params.capture_attention else None
        cache, reused, cache_note = self._reusable_cache(ids) if reuse else (None, 0, "")
        tally = _Tally(prompt_tokens=len(ids) - reused, reused_tokens=reused, tokenize_ms=_since(t0),
                       cache_note=cache_note)
        run_id = uuid.uuid4().hex[:12]
        emit(RunStarted(
            run_id=run_id, label=params.describe() + (", reuse" if reuse else ""), model=self.facts, params=params,
            prompt=prompt, prompt_ids=ids, prompt_pieces=pieces(self.tokenizer, ids),
            started_at=datetime.now(timezone.utc).isoformat(timespec="seconds"), t_ms=_since(t0), kind=kind))
        failure: tuple[str, str] | None = None
        if capture is not None:
            capture.active = True
        try:
            with torch.inference_mode():
                reason, cache = self._generate(run_id, ids, params, emit, cancel, before_step, tally, t0, cache,
                                               reused)
        except (MemoryError, torch.cuda.OutOfMemoryError) as exc:
            failure = ("out_of_memory",
                       f"Out of memory after {len(tally.token_ids)} tokens ({_first_line(exc)}). Memory was "
                       "released: try fewer tokens, a shorter prompt, the KV cache on, or a smaller dtype.")
        except Exception as exc:  # noqa: BLE001  (the run must end with an event whatever broke)
            log.exception("run %s failed", run_id)
            failure = (type(exc).__name__, _first_line(exc))
        finally:
            if capture is not None:
                capture.active = False
                capture.rows.clear()
        if failure is not None:
            # Outside the except block: the traceback no longer pins the cache tensors, so they can go.
            cache = None
            self.forget("the last turn failed")
            _release_device_memory(self.device)
            failed = RunFailed(run_id, _since(t0), failure[0], failure[1], tally.summary(_since(t0)))
            emit(failed)
            return failed
        if reuse and cache is not None:
            # The cache holds the prompt and every generated token but the last (it was never fed).
            self._kept_cache, self._kept_ids = cache, ids + tally.token_ids[:-1]
        # The summary's text is decoded once from all ids, so a character the run cut in half still shows.
        tally.text = [self.tokenizer.decode(tally.token_ids, skip_special_tokens=True)]
        finished = RunFinished(run_id, _since(t0), reason, tally.summary(_since(t0)))
        emit(finished)
        return finished

    def _reusable_cache(self, ids: list[int]) -> tuple[Any, int, str]:
        """The kept cache cut back to what it shares with ``ids`` (at least one id is left to prefill), the
        positions reused, and why nothing (or less than everything kept) was reused."""
        if self._kept_cache is None:
            return None, 0, f"nothing reused: {self._dropped}"
        shared = min(kvcache.common_prefix(self._kept_ids, ids), len(ids) - 1)
        cache, kept = self._kept_cache, len(self._kept_ids)
        self.forget("the kept cache was handed to the last turn")
        refusal = kvcache.rollback_refusal(self.facts, cache, shared)
        if refusal is not None:
            return None, 0, f"nothing reused: {refusal}"
        try:
            kvcache.crop_to(cache, shared)
        except kvcache.CacheReshapeError as exc:
            return None, 0, f"nothing reused: the cache could not be rolled back ({exc})"
        if shared == 0:
            return None, 0, "nothing reused: the conversation shares no prefix with the kept cache"
        note = "" if shared == kept else f"{kept - shared:,} kept positions differed from the new conversation"
        return cache, shared, note

    def _generate(self, run_id: str, ids: list[int], params: GenerationParams, emit: Sink,
                  cancel: threading.Event | None, before_step: Callable[[int], None] | None,
                  tally: _Tally, t0: float, cache: Any = None, reused: int = 0) -> tuple[str, Any]:
        clock = self.clock
        generator = make_generator(self.device, params.seed)
        text = TextStream(self.tokenizer)
        sequence = torch.tensor([ids], device=self.device)                 # [1, n]
        cancelled = cancel.is_set if cancel is not None else (lambda: False)
        if cancelled():
            return "stopped", cache

        self._fault("prefill", 0)
        if self.device.type == "cpu":
            tally.load.start()
        start = clock.mark()
        first_compile = params.compiled and self._compiled is None
        allocated = min(len(ids) + params.max_new_tokens, self.facts.max_context) \
            if params.static_cache and params.kv_cache and cache is None else 0
        logits, cache = self.prefill(sequence[:, reused:], params.kv_cache, cache, allocated)
        forward_end = clock.mark()
        choice = choose(logits, params, generator)
        end = clock.mark()
        forward_ms, latency_ms = clock.elapsed_ms(start, forward_end), clock.elapsed_ms(start, end)
        tally.prefill_ms, tally.ttft_ms = forward_ms, _since(t0)
        kv, held = self._record(tally, cache)
        emit(PrefillDone(run_id, _since(t0), len(ids) - reused, tally.tokenize_ms, forward_ms, kv, reused, held,
                         tally.cache_note, allocated))
        norms_from = self._emit_norms(emit, run_id, t0, cache, 0)
        position = len(ids)
        step, waited_ms = 0, 0.0
        while True:
            emit(self._token_step(run_id, t0, step, position, choice, text, "prefill" if step == 0 else "decode",
                                  latency_ms, forward_ms, kv, held, waited_ms, tally))
            if params.capture_attention:
                emit(self._attention_step(run_id, t0, step, position - 1))
            if step % NORMS_EVERY == 0:
                norms_from = self._emit_norms(emit, run_id, t0, cache, norms_from)
            token = torch.tensor([choice.token_id], device=self.device)
            reason = self._stop_reason(choice.token_id, step + 1, position + 1, params)
            waited_ms = 0.0
            if reason is None and before_step is not None:
                wait_start = time.perf_counter()
                before_step(step + 1)                    # pause, single step, slow motion: not decode time
                waited_ms = _since(wait_start)
                tally.waited_ms += waited_ms
            if reason is None and cancelled():
                reason = "stopped"
            if reason is not None:
                tally.load.stop()
                self._emit_norms(emit, run_id, t0, cache, norms_from)
                return reason, cache
            if cache is None:
                sequence = torch.cat([sequence, token.view(1, 1)], dim=1)     # [1, position + 1]
            step += 1
            self._fault("decode", step)
            start = clock.mark()
            logits = self.decode_step(token, position, cache, sequence, params.compiled)
            forward_end = clock.mark()
            choice = choose(logits, params, generator)
            end = clock.mark()
            forward_ms, latency_ms = clock.elapsed_ms(start, forward_end), clock.elapsed_ms(start, end)
            if first_compile and step == 1:
                tally.compile_ms = latency_ms            # the first compiled step compiles: timed apart
            else:
                tally.decode_ms += latency_ms
            position += 1
            kv, held = self._record(tally, cache)

    def _token_step(self, run_id: str, t0: float, step: int, position: int, choice: Any, text: TextStream,
                    phase: str, latency_ms: float, forward_ms: float, kv: list[list[int]], held: list[int],
                    waited_ms: float, tally: _Tally) -> TokenStep:
        piece = text.step(choice.token_id)
        special = choice.token_id in self._special
        tally.token_ids.append(choice.token_id)
        if not special:
            tally.text.append(piece)
        candidates = [Candidate(i, self._piece(i), raw, final) for i, raw, final in
                      zip(choice.candidate_ids, choice.candidate_raw, choice.candidate_final)]
        return TokenStep(run_id=run_id, t_ms=_since(t0), step=step, position=position, token_id=choice.token_id,
                         text=piece, special=special, phase=phase, latency_ms=latency_ms, forward_ms=forward_ms,
                         prob=choice.prob, raw_prob=choice.raw_prob, candidates=candidates,
                         kv_bytes_per_layer=kv, kv_positions_per_layer=held, waited_ms=waited_ms,
                         kept=choice.kept)

    def _attention_step(self, run_id: str, t0: float, step: int, query_position: int) -> AttentionStep:
        capture = self.attention_capture()
        layers, firsts, weights, spent_ms = capture.take(query_position)
        return AttentionStep(run_id, _since(t0), step, query_position, layers, firsts, weights, spent_ms,
                             capture.method)

    def _stop_reason(self, token_id: int, generated: int, length: int, params: GenerationParams) -> str | None:
        if token_id in self._eos:
            return "eos"
        if generated >= params.max_new_tokens:
            return "max_tokens"
        if length >= self.facts.max_context:
            return "context_full"
        return None

    def _record(self, tally: _Tally, cache: Any) -> tuple[list[list[int]], list[int]]:
        """Bytes and positions each layer holds, read from the cache tensors' metadata (no device work)."""
        kv, held = kvcache.held_per_layer(cache, self.facts.num_layers)
        tally.kv_tokens = kvcache.positions_seen(cache)
        tally.kv_bytes = sum(k + v for k, v in kv)
        return kv, held

    def _fault(self, phase: str, step: int) -> None:
        if self.fault_hook is not None:
            self.fault_hook(phase, step)

    # --- KV norms (content of the cache, per layer and position) ---------------------------------------------
    def _emit_norms(self, emit: Sink, run_id: str, t0: float, cache: Any, first: int) -> int:
        """Emit ``KVNorms`` for the positions cached since ``first``; returns the next first position."""
        if cache is None or not self.record_kv_norms:
            return first
        held = kvcache.positions_seen(cache)
        if held <= first:
            return first
        k, v = kv_norms(cache, first, held)
        emit(KVNorms(run_id, _since(t0), first, k, v))
        return held

    def _piece(self, token_id: int) -> str:
        text = self._candidate_text.get(token_id)
        if text is None:
            text = self._candidate_text[token_id] = self.tokenizer.decode([token_id])
        return text


def kv_norms(cache: Any, first: int, end: int) -> tuple[list[list[float]], list[list[float]]]:
    """Mean over KV heads of the L2 norm of each cached key and value, positions ``first:end``, one stacked
    reduction and one copy to the host. A sliding layer holding fewer positions is left-padded with 0, and a
    layer with no keys (a state-space layer) is all 0."""
    span = end - first
    rows = []
    for layer in cache.layers:
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):  # [1, kv_heads, held, dim]
            held = t.shape[2] if t is not None else 0                         # a sliding layer keeps the last
            take = max(min(held, end - first), 0)                             # `held` positions only
            rows.append(t[0, :, held - take:] if take else None)
    if all(r is not None and r.shape[1] == span for r in rows):
        values = torch.stack(rows).float().norm(dim=-1).mean(dim=1).tolist()  # [2 * layers, span]
    else:
        values = [[0.0] * span if r is None else
                  [0.0] * (span - r.shape[1]) + r.float().norm(dim=-1).mean(dim=0).tolist() for r in rows]
    return values[0::2], values[1::2]


def _eos_ids(model: Any, tokenizer: Any) -> set[int]:
    ids: set[int] = set()
    for value in (getattr(model.generation_config, "eos_token_id", None), tokenizer.eos_token_id):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return ids


def _release_device_memory(device: torch.device) -> None:
    import gc

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _since(t0: float) -> float:
    return (time.perf_counter() - t0) * 1000.0


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
