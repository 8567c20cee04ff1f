"""The one place a run's summary is built: from the run's own events, as they happen.

The session, the server client and the window's store all feed a run's events into a ``RunTally`` and ask it
for the ``RunSummary``, so a figure shown while a run goes (the status strip, a scene caption) is computed the
same way as the figure in the final ``RunFinished``: TTFT never changes when a run ends. What only the
producer knows (the CPU share, the compile time, a server's own timings, what it had to cut) it sets here.
No torch here.
"""

from __future__ import annotations

from engine.facts import kvformula
from engine.facts.events import ModelFacts, PrefillDone, RunStarted, RunSummary, ServerFacts, TokenStep


class RunTally:
    def __init__(self) -> None:
        self.remote = False
        self.prompt_tokens = 0
        self.reused_tokens = 0
        self.tokenize_ms = 0.0
        self.prefill_ms = 0.0
        self.ttft_ms = 0.0
        self.decode_ms = 0.0
        self.waited_ms = 0.0
        self.compile_ms = 0.0
        self.compile_loaded = False        # the compiled graph was built earlier and read, not built
        self.compiled_from_step = 0        # the first step decoded through the compiled graph; 0: none
        self.kv_tokens = 0
        self.kv_bytes = 0
        self.kv_allocated: int | None = None
        self.kv_bytes_per_layer: list[list[int]] = []       # the last event's, as read from the tensors
        self.kv_positions_per_layer: list[int] = []
        self.kv_storage_per_layer: list[int] = []
        self.kv_static_positions = 0         # a static cache: positions allocated up front (0: the cache grows)
        self.generated = 0
        self.token_ids: list[int] = []
        self.texts: list[str] = []
        self.last_t_ms = 0.0
        self.cpu_share: float | None = None
        self.server_timings: dict[str, float] = {}
        self.server_prompt_tokens: int | None = None
        self.server_cached_tokens: int | None = None
        self.notes: list[str] = []

    def add(self, event: object) -> None:
        if isinstance(event, TokenStep):
            self._step(event)
        elif isinstance(event, PrefillDone):
            self.prompt_tokens, self.reused_tokens = event.n_tokens, event.reused_tokens
            self.tokenize_ms, self.prefill_ms = event.tokenize_ms, event.forward_ms
            self.kv_static_positions = event.kv_allocated
            self._kv(event, event.reused_tokens + event.n_tokens)
        elif isinstance(event, RunStarted):
            self.remote = isinstance(event.model, ServerFacts)
            self.prompt_tokens = len(event.prompt_ids)

    def _step(self, step: TokenStep) -> None:
        self.generated += 1
        self.last_t_ms = step.t_ms
        self.waited_ms += step.waited_ms
        if step.token_id is not None:
            self.token_ids.append(step.token_id)
        if not step.special:
            self.texts.append(step.text)
        if step.step == 0:
            self.ttft_ms = step.t_ms                         # the first token exists: tokenize + prefill + sample
        else:
            self.decode_ms += step.latency_ms
            if step.compiled and not self.compiled_from_step:
                self.compiled_from_step = step.step
        if step.position is not None:
            self._kv(step, step.position)

    def _kv(self, event: PrefillDone | TokenStep, positions: int) -> None:
        self.kv_bytes_per_layer, self.kv_storage_per_layer = event.kv_bytes_per_layer, event.kv_storage_per_layer
        self.kv_positions_per_layer = event.kv_positions_per_layer
        held = kvformula.held_bytes(event.kv_bytes_per_layer)
        storage = sum(event.kv_storage_per_layer)
        self.kv_bytes, self.kv_tokens = held, positions if held else 0
        self.kv_allocated = storage if storage and storage != held else None

    def kv_check(self, model: ModelFacts, method: str = "full") -> kvformula.KVCheck:
        """The cache as last read, held to the formula (``kvformula.check_kv``)."""
        return kvformula.check_kv(model, self.kv_bytes, self.kv_tokens, self.kv_allocated, self.kv_static_positions,
                                  method)

    def summary(self, total_ms: float | None = None, text: str | None = None, with_text: bool = True) -> RunSummary:
        """The figures so far (``total_ms`` defaults to the last event's time); ``text`` replaces the joined
        pieces (the session decodes all ids once at the end, so a character cut in half still shows);
        ``with_text=False`` leaves out the text and the ids (O(tokens) to copy)."""
        total = self.last_t_ms if total_ms is None else total_ms
        decode_runs = max(self.generated - 1, 0)
        joined = ("".join(self.texts) if text is None else text) if with_text else ""
        if self.remote:
            return RunSummary(
                prompt_tokens=self.server_prompt_tokens, generated_tokens=self.generated, decode_runs=decode_runs,
                tokenize_ms=None, prefill_ms=None, ttft_ms=self.ttft_ms, decode_ms=self.decode_ms, total_ms=total,
                kv_tokens=None, kv_bytes=None, text=joined, token_ids=[], reused_tokens=None,
                server_cached_tokens=self.server_cached_tokens,
                waited_ms=self.waited_ms, server_timings=dict(self.server_timings), notes=tuple(self.notes))
        return RunSummary(
            prompt_tokens=self.prompt_tokens, generated_tokens=self.generated, decode_runs=decode_runs,
            tokenize_ms=self.tokenize_ms, prefill_ms=self.prefill_ms, ttft_ms=self.ttft_ms,
            decode_ms=self.decode_ms, total_ms=total, kv_tokens=self.kv_tokens, kv_bytes=self.kv_bytes,
            text=joined, token_ids=list(self.token_ids) if with_text else [], reused_tokens=self.reused_tokens,
            waited_ms=self.waited_ms, cpu_share=self.cpu_share, compile_ms=self.compile_ms,
            compile_loaded=self.compile_loaded,
            notes=tuple(self.notes), compiled_from_step=self.compiled_from_step,
            kv_allocated_bytes=self.kv_allocated)
