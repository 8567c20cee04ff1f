"""What a lesson or a run helper may ask of a session: the loaded model, its facts and device, the step clock,
encoding a prompt, one prefill pass and a whole run. A ``Protocol`` (typing only): a helper names what it uses of
the ``Session`` that calls it without importing it (the session imports the helpers), and a test may hand it
anything that has these."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from engine.facts.events import ModelFacts, RunFailed, RunFinished
from engine.facts.params import GenerationParams
from engine.run.options import RunOptions

if TYPE_CHECKING:       # names for the annotations only: a torch-free module (workloads.py) imports this one
    import torch

    from engine.model import attention
    from engine.model.clock import StepClock
    from engine.model.compiled import CompiledDecode, Graph
    from engine.model.compiled_prefill import CompiledPrefill
    from engine.model.models import LoadedModel
    from engine.model.threads import ThreadGovernor


class ModelSession(Protocol):
    loaded: LoadedModel
    model: Any                   # the transformers model (a torch module)
    facts: ModelFacts
    device: torch.device
    options: RunOptions
    clock: StepClock
    eos_ids: set[int]

    @property
    def has_chat_template(self) -> bool: ...

    def encode(self, prompt: str, chat_template: bool = True) -> list[int]: ...

    def encode_chat(self, messages: list[dict]) -> list[int]: ...

    def prefill(self, input_ids: torch.Tensor, use_cache: bool, cache: Any = None, static_positions: int = 0,
                offload_kv: bool = False) -> tuple[torch.Tensor, Any]: ...

    def attention_capture(self) -> attention.Capture: ...

    def run(self, prompt: str, params: GenerationParams, sink: Callable[[object], None] | None = None,
            cancel: threading.Event | None = None, before_step: Any = None,
            options: RunOptions | None = None) -> RunFinished | RunFailed: ...


class PassingSession(ModelSession, Protocol):
    """What the run loop's passes (``engine.run.passes.Passes``) ask of the session that owns them: beside a
    helper's, its compiled graphs, its measured prefill rate, its thread governor and its fault hook."""

    compiled: CompiledDecode
    compiled_prefill: CompiledPrefill | None
    prefill_rate: float | None
    threads: ThreadGovernor | None
    fault_hook: Callable[[str, int], None]

    def decode_step(self, token: torch.Tensor, position: int, cache: Any, sequence: torch.Tensor | None,
                    graph: Graph | None = None) -> torch.Tensor: ...

    def packaged_prefill(self, input_ids: torch.Tensor, static_positions: int = 0) -> tuple[torch.Tensor, Any]: ...

    def prefill_packaged(self, n_tokens: int, params: GenerationParams, offload_kv: bool = False,
                         layers_timed: bool = False) -> bool: ...
