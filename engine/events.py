"""The facts a run emits, one frozen dataclass per fact, holding plain values only.

Plain values (no tensors) let the same event cross a thread boundary, go into a trace file and come back
equal. ``t_ms`` on every run event is milliseconds since the run started, read after the device finished
the work it describes, so replay and timelines need nothing else.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field

from engine.params import GenerationParams

FINISH_REASONS = ("eos", "max_tokens", "stopped", "context_full")
ATTENTION_METHODS = ("sdpa hook", "output_attentions")     # how engine.attention took the weights


@dataclass(frozen=True)
class KVLayer:
    """What one decoder layer keeps per sequence, read from the cache the model really builds (not the config).

    ``kind``: ``"full"`` holds every position, ``"sliding"`` the last ``capacity`` positions, ``"state"`` a
    fixed-size recurrent state (state-space layers) and no positions, ``"none"`` nothing (e.g. a layer that
    reuses another layer's keys and values). ``state_bytes`` is the fixed part, per sequence."""

    kind: str
    kv_heads: int = 0
    k_dim: int = 0
    v_dim: int = 0
    dtype_bytes: int = 0
    capacity: int | None = None
    state_bytes: int = 0


@dataclass(frozen=True)
class ModelFacts:
    """What the KV formula and the panels need to know about a loaded model. ``num_heads`` and ``head_dim``
    are the query side (attention FLOPs); what the cache holds per layer is ``kv_layers``."""

    name: str
    source: str
    architecture: str
    num_layers: int
    num_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    max_context: int
    dtype: str
    dtype_bytes: int
    num_params: int
    device: str
    layer_devices: list[str]
    kv_layers: list[KVLayer]
    tied_embeddings: bool = False
    weights: str = ""               # how the weights are stored: "float32", "int8 weights (...), bfloat16 ..."
    weight_bytes: int = 0           # bytes a decode step reads: all weights but the embedding lookup table


@dataclass(frozen=True)
class ServerFacts:
    """A model served by another program (llama-server, vLLM, TGI, ...), as far as its API reveals it. It has
    no per-layer facts: a remote run's KV, prefill and per-layer fields are absent (None or empty), never zero.
    ``context``: positions per request if the server says; ``metrics``: whether it answers ``/metrics``."""

    name: str                        # the model id the server reports
    url: str
    engine: str                      # "llama.cpp", "vLLM", "TGI", "SGLang" or "OpenAI-compatible server"
    context: int | None = None
    metrics: bool = False
    reveals: list[str] = field(default_factory=list)

    @property
    def device(self) -> str:
        return f"{self.engine} at {self.url}"


@dataclass(frozen=True)
class LoadProgress:
    """Loading or converting a model: ``fraction`` is None while a stage has no measurable progress."""

    stage: str
    message: str
    fraction: float | None = None


@dataclass(frozen=True)
class ModelLoaded:
    """``warnings``: things the user should know but that did not stop the load (e.g. pickle weights). A server
    "loads" when it answers: its model is ``ServerFacts``."""

    model: ModelFacts | ServerFacts
    load_ms: float
    converted: bool = False
    warnings: list[str] = field(default_factory=list)
    dtype_reason: str = ""          # why this dtype: "chosen", or what the calibration measured


@dataclass(frozen=True)
class RunStarted:
    run_id: str
    label: str
    model: ModelFacts | ServerFacts
    params: GenerationParams
    prompt: str
    prompt_ids: list[int]
    prompt_pieces: list[str]
    started_at: str
    t_ms: float = 0.0
    kind: str = "generate"         # "generate" | "chat"
    experiment: str = ""           # the exp_id of the experiment that made this run, if one did


@dataclass(frozen=True)
class PrefillDone:
    """The prompt went through the model in one forward pass."""

    run_id: str
    t_ms: float
    n_tokens: int
    tokenize_ms: float
    forward_ms: float
    kv_bytes_per_layer: list[list[int]]
    reused_tokens: int = 0          # positions already in the cache from an earlier turn (llama.cpp's cache_n)
    kv_positions_per_layer: list[int] = field(default_factory=list)   # read from the tensors' shapes
    cache_note: str = ""            # a chat turn: why less than the whole kept cache was reused
    kv_allocated: int = 0           # a static cache: positions allocated up front (0: the cache grows)


@dataclass(frozen=True)
class KVNorms:
    """What the cache holds, not just how much: for positions ``first_position`` onwards, per layer, the mean
    over KV heads of each cached key's (value's) L2 norm, ``[layers][positions]``. Cached vectors never change,
    so they are read in batches (after the prefill, every few decode steps, at the end), not every step."""

    run_id: str
    t_ms: float
    first_position: int
    k_norms: list[list[float]]
    v_norms: list[list[float]]


@dataclass(frozen=True)
class Candidate:
    """One of the most likely next tokens: probability before (``p_raw``) and after (``p_final``) the
    temperature / top-k / top-p filters. From a server (``logprobs``) both are the one probability it reports,
    and ``token_id`` is None: the API gives the text only."""

    token_id: int | None
    text: str
    p_raw: float
    p_final: float


@dataclass(frozen=True)
class TokenStep:
    """One generated token. Step 0 comes from the prefill's last position (``phase == "prefill"``); every
    later step is one decode forward pass. ``latency_ms`` is forward plus sampling; ``waited_ms`` is the time
    the run stood still before this step (paused, single-stepped, slow motion), which is not decode time.

    From a server: a token as it arrived, timed by the client (``latency_ms``: since the previous token, or since
    the request for the first); what only the engine knows (``token_id``, ``position``, ``forward_ms``, the
    probabilities unless the server sent logprobs, the KV fields) is absent: None or empty."""

    run_id: str
    t_ms: float
    step: int
    position: int | None
    token_id: int | None
    text: str
    special: bool
    phase: str
    latency_ms: float
    forward_ms: float | None
    prob: float | None
    raw_prob: float | None
    candidates: list[Candidate]
    kv_bytes_per_layer: list[list[int]]
    kv_positions_per_layer: list[int] = field(default_factory=list)
    waited_ms: float = 0.0
    kept: int = 1                   # tokens the filters left with a probability above 0 (1 when greedy)


@dataclass(frozen=True)
class AttentionStep:
    """What the pass that chose token ``step`` read from the cache: the attention weights of its newest query
    (at ``position``, the last prompt position for step 0) over the keys each attention layer held,
    ``weights[i][head][key]`` for layer ``layers[i]``, key ``k`` being position ``first_positions[i] + k``
    (sliding layers start later). Recorded only when a run asks for it; ``capture_ms`` is the wall-clock time
    the capture itself took on this pass (computing the rows and copying them out), ``method`` how they were
    taken (``engine.attention``)."""

    run_id: str
    t_ms: float
    step: int
    position: int
    layers: list[int]
    first_positions: list[int]
    weights: list[list[list[float]]]
    capture_ms: float
    method: str


@dataclass(frozen=True)
class RunSummary:
    """The llama.cpp-style figures of a run. ``decode_runs`` excludes the first token (it came from the
    prefill), exactly as llama.cpp's ``eval time ... runs`` does. ``decode_ms`` sums the steps' forward and
    sampling time, never the ``waited_ms`` spent paused; ``cpu_share`` (CPU runs) says whether other programs
    competed for the cores while it was measured (``engine.load``)."""

    prompt_tokens: int | None = 0   # evaluated by the prefill (the reused ones are not)
    generated_tokens: int = 0
    decode_runs: int = 0
    tokenize_ms: float | None = 0.0
    prefill_ms: float | None = 0.0
    ttft_ms: float = 0.0
    decode_ms: float = 0.0
    total_ms: float = 0.0
    kv_tokens: int | None = 0
    kv_bytes: int | None = 0
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    reused_tokens: int | None = 0
    waited_ms: float = 0.0
    cpu_share: float | None = None
    compile_ms: float = 0.0         # compiled decode: the first compiled step (compiling included), not in decode_ms
    server_timings: dict = field(default_factory=dict)    # a server's own figures, under the names it used

    @property
    def prefill_tok_s(self) -> float | None:
        """None for a server's run: the client cannot see the prefill (see ``server_timings``)."""
        if self.prompt_tokens is None or self.prefill_ms is None:
            return None
        return _rate(self.prompt_tokens, self.prefill_ms)

    @property
    def decode_tok_s(self) -> float:
        return _rate(self.decode_runs, self.decode_ms)


@dataclass(frozen=True)
class RunFinished:
    run_id: str
    t_ms: float
    reason: str
    summary: RunSummary


@dataclass(frozen=True)
class RunFailed:
    """The run could not go on. ``summary`` holds what was measured before the failure."""

    run_id: str
    t_ms: float
    error: str
    message: str
    summary: RunSummary


@dataclass(frozen=True)
class HardwarePeaks:
    """This machine's measured ceilings (a matmul and a large copy), for the roofline bounds. ``cpu_share``
    as in ``RunSummary``: a low share means they were measured on a busy machine (and were not cached)."""

    device: str
    dtype: str
    flops_per_s: float
    bytes_per_s: float
    cached: bool = False
    cpu_share: float | None = None
    measured: str = ""             # the date they were measured


@dataclass(frozen=True)
class ExperimentStarted:
    exp_id: str
    t_ms: float
    kind: str                       # "prefill" | "cache" | "batch" | ... | "server load"
    model: ModelFacts | ServerFacts
    settings: dict
    peaks: HardwarePeaks | None = None


@dataclass(frozen=True)
class ExperimentProgress:
    exp_id: str
    t_ms: float
    done: int
    total: int
    message: str


@dataclass(frozen=True)
class ExperimentPoint:
    """One measured point; ``values`` holds plain numbers named with their unit (``prefill_ms``, ...)."""

    exp_id: str
    t_ms: float
    series: str
    values: dict


@dataclass(frozen=True)
class DraftPass:
    """One verification pass of speculative decoding (repeat ``repeat`` of the experiment): the guesses
    (``drafted``, their text), how many the model kept (a prefix), and the token it chose after them (a
    correction where a guess was rejected, a bonus where all were kept). Times by the run's clock."""

    exp_id: str
    t_ms: float
    repeat: int
    index: int
    position: int
    drafted: list[int]
    drafted_text: list[str]
    accepted: int
    token_id: int
    text: str
    draft_ms: float
    verify_ms: float


@dataclass(frozen=True)
class BlockTable:
    """The paged KV cache after one step of transformers' continuous batching: for each running request (by
    index) its block ids in order and the positions it has written; the blocks two or more requests share with
    their reference counts; blocks no request holds but kept for their content (a later request with the same
    prefix reuses them); free blocks. Each block holds ``block_positions`` positions for every layer."""

    exp_id: str
    t_ms: float
    step: int
    block_positions: int
    total_blocks: int
    running: list[int]
    tables: list[list[int]]
    positions: list[int]
    waiting: list[int]
    shared_blocks: list[int]
    shared_refs: list[int]
    cached_blocks: list[int]
    free_blocks: int


@dataclass(frozen=True)
class ExperimentFinished:
    exp_id: str
    t_ms: float
    reason: str                     # "done" | "stopped"
    summary: dict


@dataclass(frozen=True)
class ExperimentFailed:
    exp_id: str
    t_ms: float
    error: str
    message: str


Event = typing.Union[LoadProgress, ModelLoaded, HardwarePeaks, RunStarted, PrefillDone, KVNorms, TokenStep,
                     AttentionStep, RunFinished, RunFailed, ExperimentStarted, ExperimentProgress, ExperimentPoint,
                     DraftPass, BlockTable, ExperimentFinished, ExperimentFailed]
EVENT_TYPES: dict[str, type] = {cls.__name__: cls for cls in typing.get_args(Event)}


def _rate(count: int, ms: float) -> float:
    return count / (ms / 1000.0) if ms > 0 else 0.0


def to_dict(event: object) -> dict:
    """A JSON-ready dict with a ``type`` key naming the event class (the schema in ``engine.schema`` reads it
    back). Lists of plain values are shared, not copied: ``dataclasses.asdict`` deep-copies, 5x slower."""
    return {"type": type(event).__name__, **_plain(event)}


def _plain(obj: object) -> object:
    if dataclasses.is_dataclass(obj):
        return {name: _plain(value) for name, value in vars(obj).items()}
    if type(obj) is list and obj and (dataclasses.is_dataclass(obj[0]) or type(obj[0]) is list):
        return [_plain(v) for v in obj]
    if type(obj) is dict:
        return {k: _plain(v) for k, v in obj.items()}
    return obj
