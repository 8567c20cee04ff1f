"""The instrumented inference loop: ``prefill`` (one forward pass over the prompt), ``decode_step`` (one
forward pass per new token over the cached prefix) and ``run`` driving both and emitting events.

The loop has gpt-fast's shape: :meth:`Session._steps` is a generator that prefills, then yields one
:class:`Step` per forward pass (forward, sample, read the cache), and one observer (``_Observer``) turns each
step into events and decides whether to go on. The hot path does the forward pass, sampling and O(layers)
bookkeeping only: KV bytes are read from tensor metadata (no device work), KV norms are one stacked reduction
with one device-to-host copy every few steps, and text pieces come from an incremental decoder. Every forward
call goes through ``kvcache.forward``, as every other caller's does (speculative, batching, chat).
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import datetime, timezone
from typing import Any

import torch

from engine.facts import kvformula
from engine.facts.contention import LoadMeter
from engine.facts.errors import NonFiniteLogits, ParameterError, PromptError
from engine.facts.events import (
    AttentionStep,
    Candidate,
    KVNorms,
    LayerTimes,
    PrefillDone,
    RunFailed,
    RunFinished,
    RunStarted,
    TokenStep,
)
from engine.facts.params import MAX_SEED, GenerationParams
from engine.facts.tally import RunTally
from engine.facts.textstream import TextStream, clean_text, pieces
from engine.model import attention, chat_template, gguf, kvcache
from engine.model.clock import StepClock
from engine.model.compiled import CompiledDecode, Graph
from engine.model.compiled_prefill import LONGEST, CompiledPrefill
from engine.model.layer_clock import LayerClock
from engine.model.models import LoadedModel
from engine.model.sampling import choose
from engine.model.threads import ThreadGovernor, change_words, governor
from engine.run import faults
from engine.run.options import RunOptions
from engine.run.passes import GraphSaid, Passes, Prefilled, RunRequest, Step, Waiter

log = logging.getLogger(__name__)
Sink = Callable[[object], None]
FaultHook = Callable[[str, int], None]
NORMS_EVERY = 8      # decode steps between KVNorms events: one batched read instead of eight small ones




class Session:
    """A loaded model ready to run prompts, one at a time, from one thread."""

    def __init__(self, loaded: LoadedModel, options: RunOptions = RunOptions(), *,
                 fault_hook: FaultHook | None = None) -> None:
        self.loaded = loaded
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.device = loaded.device
        self.facts = loaded.facts
        self.options = options
        self.fault_hook = fault_hook if fault_hook is not None else faults.from_env()
        self.clock = StepClock(self.device)
        # A model split across devices or disk times each layer at every step (LayerTimes): where it lives shows.
        split = len(set(self.facts.layer_devices)) > 1 or "disk" in self.facts.layer_devices
        self._split = split
        self._split_clock = LayerClock(self.model, self.device) if split else None
        self.special_ids = set(self.tokenizer.all_special_ids)
        self.eos_ids = eos_ids(self.model, self.tokenizer)
        self._token_text: dict[int, str] = {}
        self._kept_cache: Any = None        # the cache a chat keeps between turns
        self._kept_ids: list[int] = []      # ...and the ids it holds
        self._dropped = "this is the first turn"     # why there is no kept cache, for the next turn to say
        # A CPU's compiled runs prefill through a package built after a decode graph (engine.model.compiled_prefill)
        self.compiled_prefill = CompiledPrefill(self.model, min(LONGEST, self.facts.max_context)) \
            if self.device.type == "cpu" else None
        self.compiled = CompiledDecode(self.model, self.device)
        self._attention: attention.Capture | None = None     # made on the first run that captures
        self.prefill_rate: float | None = None   # prompt positions per second, measured by the last prefill pass
        self.passes = Passes(self)
        # A CPU's thread count follows the other programs' load (engine.model.threads); a GPU's host threads do not.
        self.threads: ThreadGovernor | None = governor() if self.device.type == "cpu" else None

    # --- prompt -------------------------------------------------------------------------------------------
    @property
    def has_chat_template(self) -> bool:
        return chat_template.template_of(self.tokenizer) is not None

    def encode(self, prompt: str, chat_template: bool = True) -> list[int]:
        """Prompt ids: through the chat template when asked and the tokenizer has one, else raw text."""
        if chat_template and self.has_chat_template:
            return self.encode_chat([{"role": "user", "content": prompt}])
        return list(self.tokenizer(prompt)["input_ids"])

    def encode_chat(self, messages: list[dict]) -> list[int]:
        """A conversation's ids with the prompt for the assistant's next turn."""
        if self.has_chat_template:                  # the folder's template, rendered within bounds
            return chat_template.render_ids(self.tokenizer, messages, self.facts.name)
        return list(self.tokenizer("\n".join(f"{m['role']}: {m['content']}" for m in messages)
                                   + "\nassistant:")["input_ids"])

    def token_text(self, token_id: int) -> str:
        """One token's text on its own (as a candidate or a guess is shown), cached."""
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.tokenizer.decode([token_id])
        return text

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
                static_positions: int = 0, offload_kv: bool = False) -> tuple[torch.Tensor, Any]:
        """One forward pass over the prompt. ``input_ids``: ``[1, n]``; returns last logits ``[V]`` and the
        filled cache (None with the cache off; with ``static_positions``, allocated for that many up front).
        Given a ``cache`` that already holds the first positions (an earlier turn), only the new ids are passed;
        their positions continue from the cache."""
        if use_cache and cache is None:
            cache = kvcache.new_cache(self.model, static_positions, offloading=offload_kv)
        out = kvcache.forward(self.model, input_ids, cache if use_cache else None, extra=self._capture_kwargs())
        self._collect(out)
        return out.logits[0, -1], cache

    def decode_step(self, token: torch.Tensor, position: int, cache: Any,
                    sequence: torch.Tensor | None, graph: Graph | None = None) -> torch.Tensor:
        """One new token. With the cache: feed one token at ``position`` (``[1, 1]``) and attend to the
        cached keys and values (through the compiled ``graph`` of the cache's length when given). Without:
        recompute the whole ``sequence`` (``[1, position + 1]``)."""
        if cache is not None:
            positions = torch.tensor([[position]], device=self.device)
            if graph is not None:
                return self.compiled.run(graph, token.view(1, 1), positions, cache)[0, -1]
            out = kvcache.forward(self.model, token.view(1, 1), cache, positions=positions, logits_to_keep=0,
                                  extra=self._capture_kwargs())
        else:
            out = kvcache.forward(self.model, sequence, None, extra=self._capture_kwargs())
        self._collect(out)
        return out.logits[0, -1]                                           # [V]

    def packaged_prefill(self, input_ids: torch.Tensor, static_positions: int = 0) -> tuple[torch.Tensor, Any]:
        """``prefill`` through the compiled prefill package (``prefill_packaged`` says when it can), into a new
        cache (with ``static_positions``, allocated for that many up front)."""
        assert self.compiled_prefill is not None
        cache = kvcache.new_cache(self.model, static_positions)
        return self.compiled_prefill.run(input_ids, cache), cache

    def prefill_packaged(self, n_tokens: int, params: GenerationParams, offload_kv: bool = False,
                         layers_timed: bool = False) -> bool:
        """Whether a prompt's first pass of ``n_tokens`` into a new cache goes through the prefill package: a
        compiled run with the whole cache kept, no attention captured, no layer timed (the package runs none of
        the hooks) and the package built."""
        return (params.compiled and params.kv_cache and params.kv_method == "full" and not params.capture_attention
                and not offload_kv and not layers_timed and self.compiled_prefill is not None
                and self.compiled_prefill.ready(n_tokens))

    def timed_prefill(self, ids: list[int], compiled: bool = False) -> tuple[float, float]:
        """One prefill of ``ids`` with a fresh cache, greedy first token: (forward ms, forward + sampling ms).
        ``compiled``: through the prefill package, which must be built, as a compiled run's prefill is."""
        prompt = torch.tensor([ids], device=self.device)
        clock = self.clock
        if compiled and not self.prefill_packaged(len(ids), GenerationParams(compiled=True, static_cache=True)):
            raise ParameterError("the compiled prefill is not built (CompiledPrefill.build) or cannot take this prompt")
        with torch.inference_mode():
            a = clock.mark()
            logits, cache = self.packaged_prefill(prompt) if compiled else self.prefill(prompt, use_cache=True)
            b = clock.mark()
            choose(logits, GenerationParams(), None)
            c = clock.mark()
            del cache
        return clock.elapsed_ms(a, b), clock.elapsed_ms(a, c)

    def negative_log_likelihood(self, text: str) -> float:
        """Mean negative log-likelihood (nats per token) of ``text`` under the model, teacher-forced, one pass."""
        ids = torch.tensor([self.encode(text, chat_template=False)], device=self.device)
        with torch.inference_mode():
            logits = kvcache.forward(self.model, ids, None, logits_to_keep=0).logits[0, :-1].float()
        return float(torch.nn.functional.cross_entropy(logits, ids[0, 1:]))

    def _capture_kwargs(self) -> dict:
        return self._attention.forward_kwargs() if self._attention is not None else {}

    def _collect(self, out: Any) -> None:
        if self._attention is not None:
            self._attention.collect(out)

    def attention_capture(self) -> attention.Capture:
        """The session's attention capture, attached to the model on first use (``engine.model.attention``)."""
        if self._attention is None:
            try:
                self._attention = attention.attach(self.model, self.facts.num_layers)
            except ValueError as exc:
                raise ParameterError(str(exc)) from exc
        return self._attention

    # --- the run ------------------------------------------------------------------------------------------
    def run(self, prompt: str, params: GenerationParams, sink: Sink | None = None,
            cancel: threading.Event | None = None, before_step: Waiter | None = None,
            options: RunOptions | None = None) -> RunFinished | RunFailed:
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
        return self._run(RunRequest(ids, prompt, "generate", params, sink or _ignore, _cancelled(cancel), before_step,
                                  t0, options or self.options))

    def run_ids(self, prompt_ids: list[int], params: GenerationParams, sink: Sink | None = None,
                cancel: threading.Event | None = None, options: RunOptions | None = None) -> RunFinished | RunFailed:
        """A run of exactly these prompt ids (no template): what a lesson that needs a prompt of a given length
        runs, with every event of a plain run."""
        t0 = time.perf_counter()
        if self._kept_cache is not None:
            self.forget("a plain run since the last turn replaced the conversation's cache")
        text = self.tokenizer.decode(prompt_ids)
        return self._run(RunRequest(list(prompt_ids), text, "generate", params.with_(chat_template=False),
                                  sink or _ignore, _cancelled(cancel), None, t0, options or self.options))

    def chat(self, messages: list[dict], params: GenerationParams, sink: Sink | None = None,
             cancel: threading.Event | None = None, before_step: Waiter | None = None,
             reuse: bool = True, options: RunOptions | None = None) -> RunFinished | RunFailed:
        """One turn of a conversation: ``messages`` is the whole conversation so far, ending with the new
        user message. With ``reuse``, the cache kept from the last turn gives back the longest prefix it
        shares with the newly rendered conversation (cropped where they diverge) and only the rest is
        prefilled; without, every turn prefills the whole conversation again."""
        t0 = time.perf_counter()
        messages = [{**m, "content": clean_text(str(m.get("content", "")))[0]} for m in messages]
        if not messages or not messages[-1]["content"].strip():
            raise PromptError("The message is empty: type something for the model to read")
        ids = self.encode_chat(messages)
        if not reuse or not params.kv_cache or params.static_cache or params.kv_method != "full":
            self.forget("reuse is off" if not reuse else "the KV cache is off" if not params.kv_cache else
                        "a static cache is allocated for one run at a time" if params.static_cache else
                        f"a cache kept as {params.kv_method} is not carried to the next turn")
            reuse = False
        request = RunRequest(ids, messages[-1]["content"], "chat", params, sink or _ignore, _cancelled(cancel),
                           before_step, t0, options or self.options)
        if reuse:
            request.state.cache, request.state.reused, request.state.cache_note = self._reusable_cache(ids)
        return self._run(request)

    def forget(self, reason: str = "a new conversation started") -> None:
        """Drop the cache kept for the next turn, remembering why (the next turn reports it)."""
        self._kept_cache, self._kept_ids, self._dropped = None, [], reason

    @property
    def kept_tokens(self) -> int:
        return len(self._kept_ids)

    def _run(self, request: RunRequest) -> RunFinished | RunFailed:
        self.check_prompt(len(request.ids))
        params = request.params
        if params.top_k > self.facts.vocab_size:
            raise ParameterError(f"top_k must be at most the vocabulary size ({self.facts.vocab_size:,}), "
                                 f"got {params.top_k:,} (0 = off)")
        if params.seed is None:
            params = params.with_(seed=secrets.randbelow(MAX_SEED + 1))
            request = dataclasses.replace(request, params=params)
        if params.kv_method != "full":
            self.check_kv_method(params.kv_method)
        capture = self.attention_capture() if params.capture_attention else None
        own_clock = request.options.time_layers and not self._split     # a split model is always timed
        request.state.layer_clock = LayerClock(self.model, self.device) if own_clock else self._split_clock
        request.state.tokenize_ms = (time.perf_counter() - request.t0) * 1000.0
        request.state.prefill_chunk = self.passes.first_pass(request)
        observer = _Observer(self, request)
        tally = observer.tally
        observer.started()
        failure: tuple[str, str] | None = None
        cache = None
        if capture is not None:
            capture.active = True
        try:
            with torch.inference_mode():
                reason, cache = observer.follow(self.passes.steps(request))
        except NonFiniteLogits:
            failure = ("non_finite_logits",
                       f"The model's next-token scores were not numbers (NaN or infinity) at token "
                       f"{tally.generated + 1:,}, so no token could be chosen; the {tally.generated:,} before it are "
                       f"kept. {self._broken_weights_words()}")
        except (MemoryError, torch.cuda.OutOfMemoryError) as exc:
            failure = ("out_of_memory",
                       f"Out of memory after {tally.generated} tokens ({_first_line(exc)}). Memory was "
                       f"released: try {memory_advice(params, self.facts.dtype)}.")
        except Exception as exc:  # noqa: BLE001  (the run must end with an event whatever broke)
            log.exception("run failed")
            failure = (type(exc).__name__, _first_line(exc))
        finally:
            observer.meter.stop()
            if own_clock:
                request.state.layer_clock.close()
            if capture is not None:
                capture.active = False
                capture.rows.clear()
        if failure is not None:
            # Outside the except block: the traceback no longer pins the cache tensors, so they can go.
            cache = request.state.cache = None
            self.forget("the last turn failed")
            _release_device_memory(self.device)
            return observer.failed(*failure)
        if request.kind == "chat" and cache is not None and params.kv_cache and not params.static_cache \
                and params.kv_method == "full":
            # The cache holds the prompt and every generated token but the last (it was never fed).
            self._kept_cache, self._kept_ids = cache, request.ids + tally.token_ids[:-1]
        # The summary's text is decoded once from all ids, so a character the run cut in half still shows.
        return observer.finished(reason, self.tokenizer.decode(tally.token_ids, skip_special_tokens=True))

    def _broken_weights_words(self) -> str:
        """Why the scores could be broken: a converted copy in the cache is checked thoroughly first (a damaged
        one is removed and converted again at the next load), else the weights or the dtype."""
        source = self.loaded.converted_from
        broken = gguf.check_thoroughly(source) if source is not None else None
        if broken is not None:
            return (f"The converted copy of {source.name} in KVScope's cache was damaged ({broken}): it was removed, "
                    "and the next load converts it again.")
        other = "bfloat16" if self.facts.dtype == "float32" else "float32"
        return (f"Its weights or its dtype ({self.facts.dtype}) are broken for this input: try {other}, "
                "or another copy of the model.")

    def _reusable_cache(self, ids: list[int]) -> tuple[Any, int, str]:
        """The kept cache cut back to what it shares with ``ids`` (at least one id is left to prefill), the
        positions reused, and why nothing (or less than everything kept) was reused."""
        if self._kept_cache is None:
            return None, 0, f"nothing reused: {self._dropped}"
        shared = min(kvformula.common_prefix(self._kept_ids, ids), len(ids) - 1)
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

    def check_kv_method(self, name: str) -> None:
        """Refuse, in one line before anything runs, a cache this model or this machine cannot keep as ``name``."""
        from engine.facts.kv_methods import available, parse_method
        from engine.model import kv_compress

        why = available(parse_method(name)) or kv_compress.refusal(self.model)
        if why is not None:
            raise ParameterError(f"The KV cache cannot be kept as {name} here: {why}")
        if self._split:
            raise ParameterError(f"The KV cache cannot be kept as {name} for a model split across devices or disk")

    def stop_reason(self, token_id: int, generated: int, length: int, params: GenerationParams) -> str | None:
        if token_id in self.eos_ids:
            return "eos"
        if generated >= params.max_new_tokens:
            return "max_tokens"
        if length >= self.facts.max_context:
            return "context_full"
        return None

class _Observer:
    """Turns a run's steps into events (``TokenStep``, attention, norms), keeps its tally and its CPU meter (the
    only writer of either), waits where the user asked it to (pause, single step, slow motion) and decides when
    the run ends."""

    def __init__(self, session: Session, request: RunRequest) -> None:
        self.session, self.request, self.tally = session, request, RunTally()
        self.run_id = uuid.uuid4().hex[:12]
        self.text = TextStream(session.tokenizer)
        self.meter = LoadMeter()
        self.began = time.perf_counter()       # the governor's changes from here on are this run's
        self.norms_from = 0
        self.waited_ms = 0.0

    def since(self) -> float:
        return (time.perf_counter() - self.request.t0) * 1000.0

    def emit(self, event: object) -> None:
        self.tally.add(event)
        self.request.emit(event)

    def started(self) -> None:
        r, s = self.request, self.session
        self.emit(RunStarted(
            run_id=self.run_id, label=r.params.describe() + (", reuse" if r.kind == "chat" and r.state.reused else ""),
            model=s.facts, params=r.params, prompt=r.prompt, prompt_ids=r.ids,
            prompt_pieces=pieces(s.tokenizer, r.ids), started_at=datetime.now(timezone.utc).isoformat(
                timespec="seconds"), t_ms=self.since(), kind=r.kind, prefill_chunk=r.state.prefill_chunk))

    def follow(self, steps: Iterator[Prefilled | Step]) -> tuple[str, Any]:
        """Consume the steps until a stop reason: emit each, wait if asked, check cancel before the next."""
        r, s = self.request, self.session
        if r.cancelled():
            return "stopped", r.state.cache
        if s.device.type == "cpu":
            self.meter.start()                           # how busy the cores were, measured over the passes
        for step in steps:
            if isinstance(step, GraphSaid):
                self._graph_said(step)
                continue
            if isinstance(step, Prefilled):
                state = r.state
                self.emit(PrefillDone(self.run_id, self.since(), len(r.ids) - state.reused, state.tokenize_ms,
                                      step.forward_ms, step.kv, state.reused, step.held, state.cache_note,
                                      state.allocated, step.storage, step.passes, step.compiled))
                continue
            self.emit(self._token_step(step))          # step 0's time is the TTFT: the norms come after it
            if r.state.layer_clock is not None:
                self.emit(LayerTimes(self.run_id, self.since(), step.index, r.state.layer_clock.take(),
                                     list(s.facts.layer_devices)))
            if r.params.capture_attention:
                self.emit(self._attention_step(step))
            if step.index % NORMS_EVERY == 0:            # the prompt's after step 0, then a batch every few steps
                self._norms()
            reason = s.stop_reason(step.choice.token_id, step.index + 1, step.position + 1, r.params)
            self.waited_ms = 0.0
            if reason is None and r.before_step is not None:
                wait_start = time.perf_counter()
                r.before_step(step.index + 1)            # pause, single step, slow motion: not decode time
                self.waited_ms = (time.perf_counter() - wait_start) * 1000.0
            if reason is None and r.cancelled():
                reason = "stopped"
            if reason is not None:
                self.meter.stop()
                self._norms()
                return reason, r.state.cache
        if r.cancelled():                                   # the steps ended inside a long prompt's passes
            return "stopped", r.state.cache
        raise AssertionError("the steps never end on their own")

    def _graph_said(self, said: GraphSaid) -> None:
        if said.compile_ms is not None:
            self.tally.compile_ms = said.compile_ms
        if said.loaded is not None:
            self.tally.compile_loaded = said.loaded
        self.tally.notes.extend(said.notes)

    def _token_step(self, step: Step) -> TokenStep:
        s, choice = self.session, step.choice
        piece = self.text.step(choice.token_id)
        candidates = [Candidate(i, s.token_text(i), raw, final) for i, raw, final in
                      zip(choice.candidate_ids, choice.candidate_raw, choice.candidate_final)]
        return TokenStep(run_id=self.run_id, t_ms=self.since(), step=step.index, position=step.position,
                         token_id=choice.token_id, text=piece, special=choice.token_id in s.special_ids,
                         phase="prefill" if step.index == 0 else "decode", latency_ms=step.latency_ms,
                         forward_ms=step.forward_ms, prob=choice.prob, raw_prob=choice.raw_prob,
                         candidates=candidates, kv_bytes_per_layer=step.kv, kv_positions_per_layer=step.held,
                         waited_ms=self.waited_ms, kept=choice.kept, kv_storage_per_layer=step.storage,
                         compiled=step.compiled, cpu_share=self._share_so_far())

    def _share_so_far(self) -> float | None:
        return self.meter.share_so_far(self.tally.waited_ms + self.waited_ms)

    def _attention_step(self, step: Step) -> AttentionStep:
        capture = self.session.attention_capture()
        query = step.position - 1
        layers, firsts, weights, spent_ms = capture.take(query)
        return AttentionStep(self.run_id, self.since(), step.index, query, layers, firsts, weights, spent_ms,
                             capture.method)

    def _norms(self) -> None:
        """``KVNorms`` for the positions cached since the last ones."""
        cache = self.request.state.cache
        if cache is None or not self.request.options.record_kv_norms or self.request.params.kv_method != "full":
            return                      # a quantized or evicted layer's keys are not its positions' keys
        held = kvcache.positions_seen(cache)
        if held <= self.norms_from:
            return
        k, v = kvcache.norms(cache, self.norms_from, held)
        self.emit(KVNorms(self.run_id, self.since(), self.norms_from, k, v))
        self.norms_from = held

    def _threads_said(self) -> None:
        """What the thread governor did while this run computed, in its notes."""
        threads = self.session.threads
        words = change_words(threads.since(self.began), threads.ceiling) if threads is not None else ""
        if words:
            self.tally.notes.append(words)

    def finished(self, reason: str, text: str) -> RunFinished:
        self.tally.cpu_share = self.meter.share(self.tally.waited_ms)
        self._threads_said()
        event = RunFinished(self.run_id, self.since(), reason, self.tally.summary(self.since(), text))
        self.request.emit(event)
        return event

    def failed(self, error: str, message: str) -> RunFailed:
        self.tally.cpu_share = self.meter.share(self.tally.waited_ms)
        self._threads_said()
        event = RunFailed(self.run_id, self.since(), error, message, self.tally.summary(self.since()))
        self.request.emit(event)
        return event


def eos_ids(model: Any, tokenizer: Any) -> set[int]:
    """The ids that end a generation: the model's generation config and the tokenizer's, all of them."""
    ids: set[int] = set()
    for value in (getattr(model.generation_config, "eos_token_id", None), tokenizer.eos_token_id):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return ids


def memory_advice(params: GenerationParams, dtype: str) -> str:
    """What would need less memory than this run did: only what differs from what it already did."""
    options = ["fewer tokens", "a shorter prompt"]
    if not params.kv_cache:
        options.append("the KV cache on (without it every step recomputes the whole sequence)")
    elif params.kv_method == "full":
        options.append("the KV cache kept as fp8 or quanto4")
    if dtype == "float32":
        options.append("a smaller dtype (bfloat16)")
    return ", ".join(options[:-1]) + " or " + options[-1]


def _cancelled(cancel: threading.Event | None) -> Callable[[], bool]:
    return cancel.is_set if cancel is not None else (lambda: False)


def _ignore(_event: object) -> None:
    pass


def _release_device_memory(device: torch.device) -> None:
    import gc

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
