"""How a session carries out its runs (``RunOptions``), apart from the session so that what a helper may ask of a
session (``engine.run.model_session``) can name it without importing the session."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RunOptions:
    """How runs are carried out, beside what they do (``GenerationParams``): one value, given when the session is
    made (its default for every run) or to one run, never set on a session from outside.
    ``compile_in_background``: a compiled run decodes eagerly while its graph is built beside it and switches at
    a step boundary (the window) instead of waiting for the graph before its first decode step (the CLI, the
    benchmarks); ``offload_kv``: keys and values go to the CPU between uses (a GPU only); ``time_layers``: time
    every decoder layer at every step even when the model is not split (a split model always is);
    ``record_kv_norms``: the cached vectors' norms for the heatmap; ``prefill_chunk``: the prompt goes through in
    passes of at most this many positions into one cache (the same logits within float error), so a stop takes
    effect between them however long the prompt (0: one pass; its time is then the prefill's alone;
    ``STOPPABLE``: one pass when this session's measured prefill rate says it takes at most ``PASS_S``, else
    passes sized from that rate, and from each pass's own time, to take at most ``PASS_S`` each, so Stop works
    within a second on any machine; the window's choice)."""

    compile_in_background: bool = False
    offload_kv: bool = False
    time_layers: bool = False
    record_kv_norms: bool = True
    prefill_chunk: int = 0
