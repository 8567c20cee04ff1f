"""The facts a run emits, one frozen dataclass per fact, holding plain values only.

Plain values (no tensors) let the same event cross a thread boundary, go into a trace file and come back
equal. ``t_ms`` on every run event is milliseconds since the run started, read after the device finished
the work it describes, so replay and timelines need nothing else.

Every field declares its bounds (``engine.facts.fields``): the trace schema, the writer's check and the producers'
cuts all read them from here, so a limit is stated once.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Annotated, ClassVar

from engine.facts.contention import busy
from engine.facts.errors import ParameterError
from engine.facts.fields import (
    MAX_CANDIDATES,
    MAX_CONTEXT,
    MAX_HEAD_DIM,
    MAX_HEADS,
    MAX_LAYERS,
    MAX_VALUES,
    Bytes,
    Count,
    Ident,
    Items,
    Message,
    Ms,
    Name,
    Notes,
    Number,
    Probability,
    PromptText,
    Range,
    Share,
    Text,
    TokenId,
    TokenText,
)
from engine.facts.params import GenerationParams
from engine.facts.validation import FieldError, check_instance

FINISH_REASONS = ("eos", "max_tokens", "stopped", "context_full")
ATTENTION_METHODS = ("sdpa hook", "output_attentions")     # how engine.model.attention took the weights
LAYER_KINDS = ("full", "sliding", "latent", "state", "none")
PHASES = ("prefill", "decode")
RUN_KINDS = ("generate", "chat")

Heads = Annotated[int, Range(0, MAX_HEADS)]
Dims = Annotated[int, Range(0, MAX_HEAD_DIM)]
Positions = Annotated[int, Range(0, MAX_CONTEXT)]
PerLayer = Annotated[list[Annotated[list[Bytes], Items(2)]], Items(MAX_LAYERS)]
PositionsPerLayer = Annotated[list[Positions], Items(MAX_LAYERS)]
Grid = Annotated[list[Annotated[list[Annotated[float, Range(0.0, 1e30)]], Items(MAX_CONTEXT)]], Items(MAX_LAYERS)]


@dataclass(frozen=True)
class KVLayer:
    """What one decoder layer keeps per sequence, read from the cache the model really builds (not the config).

    ``kind``: ``"full"`` holds every position, ``"sliding"`` the last ``capacity`` positions, ``"latent"`` a
    compressed cache (multi-head latent attention: per position one latent vector of ``k_dim`` and one rope key
    of ``v_dim`` shared by every head, no K/V split), ``"state"`` a fixed-size recurrent state (state-space
    layers) and no positions, ``"none"`` nothing (a layer that reuses another layer's keys and values).
    ``extra_bytes``: further bytes per position the cache holds (a sparse-attention indexer's keys).
    ``state_bytes`` is the fixed part, per sequence (a combined layer holds both). ``mha_width``: for a latent
    layer, what full multi-head K and V would hold per position (``heads x (qk dims + v dims)``). A layer whose
    keys and values are one tensor (DeepSeek-V4's shared-KV attention) has ``v_dim`` 0. ``compressed``: series
    the layer condenses the context into (DeepSeek-V4's compressor and indexer), each ``[rate, entry bytes,
    buffer bytes per waiting token, overlap bytes]``: one entry every ``rate`` positions, the positions since
    the last entry waiting in a buffer, and a fixed overlap kept once the first entry exists."""

    kind: Annotated[str, Text(16, LAYER_KINDS)]
    kv_heads: Heads = 0
    k_dim: Dims = 0
    v_dim: Dims = 0
    dtype_bytes: Annotated[int, Range(0, 16)] = 0
    capacity: Annotated[int, Range(1, MAX_CONTEXT)] | None = None
    state_bytes: Annotated[int, Range(0, 1 << 40)] = 0
    extra_bytes: Annotated[int, Range(0, 1 << 24)] = 0
    mha_width: Annotated[int, Range(0, MAX_HEADS * MAX_HEAD_DIM)] = 0
    compressed: Annotated[list[Annotated[list[Annotated[int, Range(0, 1 << 30)]], Items(4)]], Items(8)] = field(
        default_factory=list)


@dataclass(frozen=True)
class ModelFacts:
    """What the KV formula and the panels need to know about a loaded model. ``num_heads`` and ``head_dim``
    are the query side (attention FLOPs); what the cache holds per layer is ``kv_layers``."""

    name: Name
    source: Annotated[str, Text(4096)]
    architecture: Name
    num_layers: Annotated[int, Range(1, MAX_LAYERS)]
    num_heads: Annotated[int, Range(1, MAX_HEADS)]
    head_dim: Annotated[int, Range(1, MAX_HEAD_DIM)]
    hidden_size: Annotated[int, Range(1, 1 << 20)]
    vocab_size: Annotated[int, Range(1, 1 << 24)]
    max_context: Annotated[int, Range(1, MAX_CONTEXT)]
    dtype: Annotated[str, Text(32)]
    dtype_bytes: Annotated[int, Range(1, 16)]
    num_params: Annotated[int, Range(0, 1 << 50)]
    device: Annotated[str, Text(64)]
    layer_devices: Annotated[list[Annotated[str, Text(64)]], Items(MAX_LAYERS)]
    kv_layers: Annotated[list[KVLayer], Items(MAX_LAYERS)]
    tied_embeddings: bool = False
    weights: Name = ""              # how the weights are stored: "float32", "int8 weights (...), bfloat16 ..."
    weight_bytes: Bytes = 0         # bytes a decode step reads: all weights but the embedding lookup table
    weight_format: Annotated[str, Text(32)] = ""    # "float32", "bfloat16", "int8", "int4": the format asked for
    context_declared: bool = True   # False: the config names no maximum; max_context is KVScope's cap for a run
    config_kv_heads: Heads = 0      # KV heads the config declares, where the cache holds more (0: as the cache)


@dataclass(frozen=True)
class ServerFacts:
    """A model served by another program (llama-server, vLLM, TGI, ...), as far as its API reveals it. It has
    no per-layer facts: a remote run's KV, prefill and per-layer fields are absent (None or empty), never zero.
    ``context``: positions per request if the server says; ``metrics``: whether it answers ``/metrics``."""

    name: Name                       # the model id the server reports
    url: Annotated[str, Text(2048)]  # never with credentials (engine.serve.remote strips them)
    engine: Annotated[str, Text(64)]  # "llama.cpp", "vLLM", "TGI", "SGLang" or "OpenAI-compatible server"
    context: Annotated[int, Range(1, MAX_CONTEXT)] | None = None
    metrics: bool = False
    reveals: Annotated[list[Annotated[str, Text(512)]], Items(32)] = field(default_factory=list)

    @property
    def device(self) -> str:
        return f"{self.engine} at {self.url}"


Facts = typing.Union[ModelFacts, ServerFacts]


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

    model: Facts
    load_ms: float
    converted: bool = False
    warnings: list[str] = field(default_factory=list)
    dtype_reason: str = ""          # why this dtype: "chosen", or the rule or measurement that decided


@dataclass(frozen=True)
class RunStarted:
    run_id: Ident
    label: Annotated[str, Text(512)]
    model: Facts
    params: GenerationParams
    prompt: PromptText
    prompt_ids: Annotated[list[TokenId], Items(MAX_CONTEXT)]
    prompt_pieces: Annotated[list[TokenText], Items(MAX_CONTEXT)]
    started_at: Ident
    t_ms: Ms = 0.0
    kind: Annotated[str, Text(16, RUN_KINDS)] = "generate"
    experiment: Ident = ""          # the exp_id of the experiment that made this run, if one did
    prefill_chunk: Positions = 0    # the prompt's first pass, in positions, when it goes in several (0: one pass)


@dataclass(frozen=True)
class PrefillDone:
    """The prompt went through the model: in one forward pass, or in ``passes`` of them into one cache (a long
    prompt in a window that must stop within a second; ``forward_ms`` is then all of them)."""

    run_id: Ident
    t_ms: Ms
    n_tokens: Count
    tokenize_ms: Ms
    forward_ms: Ms
    kv_bytes_per_layer: PerLayer
    reused_tokens: Count = 0        # positions already in the cache from an earlier turn (llama.cpp's cache_n)
    kv_positions_per_layer: PositionsPerLayer = field(default_factory=list)   # read from the tensors' shapes
    cache_note: Annotated[str, Text(1024)] = ""     # a chat turn: why less than the whole kept cache was reused
    kv_allocated: Positions = 0     # a static cache: positions allocated up front (0: the cache grows)
    kv_storage_per_layer: Annotated[list[Bytes], Items(MAX_LAYERS)] = field(default_factory=list)
    passes: Count = 1
    compiled: bool = False          # the (first) pass went through the compiled prefill package


@dataclass(frozen=True)
class KVNorms:
    """What the cache holds, not just how much: for positions ``first_position`` onwards, per layer, the mean
    over KV heads of each cached key's (value's) L2 norm, ``[layers][positions]``. Cached vectors never change,
    so they are read in batches (after the prefill, every few decode steps, at the end), not every step. A
    layer whose cache has no per-head keys and values (a latent cache) holds the norm of its latent vector as
    ``k`` and of its rope key as ``v``."""

    run_id: Ident
    t_ms: Ms
    first_position: Positions
    k_norms: Grid
    v_norms: Grid


@dataclass(frozen=True)
class Candidate:
    """One of the most likely next tokens: probability before (``p_raw``) and after (``p_final``) the
    temperature / top-k / top-p filters. From a server (``logprobs``) both are the one probability it reports,
    and ``token_id`` is None unless the server sends ids."""

    token_id: TokenId | None
    text: TokenText
    p_raw: Probability
    p_final: Probability


@dataclass(frozen=True)
class TokenStep:
    """One generated token. Step 0 comes from the prefill's last position (``phase == "prefill"``); every
    later step is one decode forward pass. ``latency_ms`` is forward plus sampling; ``waited_ms`` is the time
    the run stood still before this step (paused, single-stepped, slow motion), which is not decode time.

    From a server: a piece of text as it arrived, timed by the client (``latency_ms``: since the previous
    piece, or since the request for the first); what only the engine knows (``position``, ``forward_ms``, the
    probabilities unless the server sent logprobs, the KV fields) is absent: None or empty.
    ``candidates_cut``: candidates the producer left out to keep ``MAX_CANDIDATES`` (the likeliest are kept);
    ``kv_storage_per_layer``: bytes each layer's cache has allocated where that differs from what its tensors
    expose (a sliding layer's views into a larger buffer); empty when they are equal."""

    run_id: Ident
    t_ms: Ms
    step: Count
    position: Positions | None
    token_id: TokenId | None
    text: TokenText
    special: bool
    phase: Annotated[str, Text(16, PHASES)]
    latency_ms: Ms
    forward_ms: Ms | None
    prob: Probability | None
    raw_prob: Probability | None
    candidates: Annotated[list[Candidate], Items(MAX_CANDIDATES)]
    kv_bytes_per_layer: PerLayer
    kv_positions_per_layer: PositionsPerLayer = field(default_factory=list)
    waited_ms: Ms = 0.0
    kept: Annotated[int, Range(1, 1 << 24)] = 1     # tokens the filters left with a probability above 0
    candidates_cut: Count = 0
    kv_storage_per_layer: Annotated[list[Bytes], Items(MAX_LAYERS)] = field(default_factory=list)
    compiled: bool = False          # decoded through the compiled graph (the timeline marks the first)
    cpu_share: Share | None = None  # the run's CPU share so far (``RunSummary.cpu_share``): busy said mid-run too


@dataclass(frozen=True)
class AttentionStep:
    """What the pass that chose token ``step`` read from the cache: the attention weights of its newest query
    (at ``position``, the last prompt position for step 0) over the keys each attention layer held,
    ``weights[i][head][key]`` for layer ``layers[i]``, key ``k`` being position ``first_positions[i] + k``
    (sliding layers start later). Recorded only when a run asks for it; ``capture_ms`` is the wall-clock time
    the capture itself took on this pass (computing the rows and copying them out), ``method`` how they were
    taken (``engine.model.attention``)."""

    run_id: Ident
    t_ms: Ms
    step: Count
    position: Positions
    layers: Annotated[list[Annotated[int, Range(0, MAX_LAYERS - 1)]], Items(MAX_LAYERS)]
    first_positions: PositionsPerLayer
    weights: Annotated[list[Annotated[list[Annotated[list[Probability], Items(MAX_CONTEXT)]], Items(MAX_HEADS)]],
                       Items(MAX_LAYERS)]
    capture_ms: Ms
    method: Annotated[str, Text(32, ATTENTION_METHODS)]


ServerFigures = Annotated[dict[str, Number], Items(64)]


@dataclass(frozen=True)
class RunSummary:
    """The llama.cpp-style figures of a run. ``decode_runs`` excludes the first token (it came from the
    prefill), exactly as llama.cpp's ``eval time ... runs`` does. ``decode_ms`` sums the steps' forward and
    sampling time, never the ``waited_ms`` spent paused; ``cpu_share`` (CPU runs) says whether other programs
    competed for the cores while it was measured (``engine.facts.contention``). ``notes``: what the producer had to
    cut or drop to keep every field within its bounds (a server's oversized chunk, impossible usage figures).
    ``kv_bytes`` is what the cache's tensors expose (what attention reads); ``kv_allocated_bytes`` is what their
    storages hold where that is more (a sliding layer's view into a larger buffer), else None. ``reused_tokens``:
    a local run's positions kept from an earlier turn's cache; ``server_cached_tokens``: a server's run's prompt
    tokens the server says it served from its cache (llama-server's ``cache_n``, OpenAI's ``cached_tokens``),
    None where it did not say: one figure, one name, from the HTTP answer to the screen."""

    prompt_tokens: Count | None = 0   # evaluated by the prefill (the reused ones are not)
    generated_tokens: Count = 0
    decode_runs: Count = 0
    tokenize_ms: Ms | None = 0.0
    prefill_ms: Ms | None = 0.0
    ttft_ms: Ms = 0.0
    decode_ms: Ms = 0.0
    total_ms: Ms = 0.0
    kv_tokens: Count | None = 0
    kv_bytes: Bytes | None = 0
    text: PromptText = ""
    token_ids: Annotated[list[TokenId], Items(MAX_CONTEXT)] = field(default_factory=list)
    reused_tokens: Count | None = 0
    waited_ms: Ms = 0.0
    cpu_share: Share | None = None
    compile_ms: Ms = 0.0            # compiled decode: building its graph (beside or before decode), never in decode_ms
    server_timings: ServerFigures = field(default_factory=dict)    # a server's own figures, under its names
    notes: Notes = ()
    compiled_from_step: Count = 0   # the first step decoded by the compiled path (0: none was)
    kv_allocated_bytes: Bytes | None = None   # what the cache's tensors have allocated, where not kv_bytes
    compile_loaded: bool = False    # compile_ms read a graph built earlier (it built nothing)
    server_cached_tokens: Count | None = None   # a server's run: prompt tokens served from its cache, as it says

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
    run_id: Ident
    t_ms: Ms
    reason: Annotated[str, Text(32, FINISH_REASONS)]
    summary: RunSummary


@dataclass(frozen=True)
class RunFailed:
    """The run could not go on. ``summary`` holds what was measured before the failure."""

    run_id: Ident
    t_ms: Ms
    error: Annotated[str, Text(128)]
    message: Message
    summary: RunSummary


@dataclass(frozen=True)
class HardwarePeaks:
    """This machine's measured ceilings (a matmul and a large copy), for the roofline bounds. ``cpu_share``
    as in ``RunSummary``: a low share means they were measured on a busy machine (and were not cached).
    ``disk_bytes_per_s`` and ``host_to_device_bytes_per_s``: the offloading tiers' measured read rates
    (0: not measured). ``wide_flops_per_s``: where the model's products of ``wide_rows`` rows or more run
    widened to float32 (a half float this CPU emulates), float32's measured peak, their ceiling; 0: every
    product runs in ``dtype``."""

    device: Name
    dtype: Annotated[str, Text(32)]
    flops_per_s: Annotated[float, Range(1.0, 1e20)]
    bytes_per_s: Annotated[float, Range(1.0, 1e18)]
    cached: bool = False
    cpu_share: Share | None = None
    measured: Annotated[str, Text(32)] = ""          # the date they were measured
    disk_bytes_per_s: Annotated[float, Range(0.0, 1e18)] = 0.0
    host_to_device_bytes_per_s: Annotated[float, Range(0.0, 1e18)] = 0.0
    wide_rows: Annotated[int, Range(0, 1 << 20)] = 0
    wide_flops_per_s: Annotated[float, Range(0.0, 1e20)] = 0.0

    @property
    def quiet(self) -> bool:
        """Measured on a quiet machine: only such peaks give a ceiling (a busy machine's peak is too low, and a
        ceiling below a measured rate is a false claim)."""
        return not busy(self.cpu_share)


# --- lessons: the experiments that prove a claim --------------------------------------------------------------
@dataclass(frozen=True)
class LessonSettings:
    """A lesson's settings: subclasses declare their fields with bounds (and ``engine.facts.fields.Setting`` for the
    ones a user can change), and check themselves when made, so a bad value is refused where it is typed."""

    kind: ClassVar[str] = ""

    def __post_init__(self) -> None:
        for name, value in vars(self).items():          # a list given for a tuple field is kept as the tuple
            if type(value) is list:
                object.__setattr__(self, name, tuple(value))
        try:
            check_instance(self)
        except FieldError as exc:
            raise ParameterError(str(exc)) from None


@dataclass(frozen=True)
class LessonResult:
    """What a lesson measured and computed, typed. Every field has a default: a cancelled experiment finishes
    with what it had. ``incomplete``: it stopped before its comparison was whole; ``lowest_cpu_share``: the
    busiest the machine was while it measured (None: not measured, e.g. against a server); ``tokens_note``: why
    greedy tokens parted where a check says they did (a 16-bit float's rounding); ``threads_note``: what KVScope
    did about other programs holding cores while it measured (fewer compute threads), "" when nothing."""

    kind: ClassVar[str] = ""

    incomplete: bool = False
    lowest_cpu_share: Share | None = None
    tokens_note: Message = ""
    notes: Notes = ()
    threads_note: Message = ""


@dataclass(frozen=True)
class ExperimentStarted:
    exp_id: Ident
    t_ms: Ms
    kind: Annotated[str, Text(32)]          # a lesson's kind (engine.lessons)
    model: Facts
    settings: LessonSettings
    peaks: HardwarePeaks | None = None


@dataclass(frozen=True)
class ExperimentProgress:
    exp_id: Ident
    t_ms: Ms
    done: Annotated[int, Range(0, 1 << 20)]
    total: Annotated[int, Range(0, 1 << 20)]
    message: Annotated[str, Text(1024)]


@dataclass(frozen=True)
class ExperimentPoint:
    """One measured point; ``values`` holds plain numbers named with their unit (``prefill_ms``, ...)."""

    exp_id: Ident
    t_ms: Ms
    series: Ident
    values: Annotated[dict[str, Number], Items(MAX_VALUES)]


@dataclass(frozen=True)
class LayerTimes:
    """One forward pass of a run, layer by layer (recorded when the model is split across devices or disk):
    each decoder layer's wall time (``ms``, CUDA events on a GPU) and where its weights were read from
    (``devices``: "cpu", "cuda:0", "disk"). ``step`` is the TokenStep it belongs to."""

    run_id: Ident
    t_ms: Ms
    step: Count
    ms: Annotated[list[Ms], Items(MAX_LAYERS)]
    devices: Annotated[list[Annotated[str, Text(32)]], Items(MAX_LAYERS)]


@dataclass(frozen=True)
class ExperimentFinished:
    exp_id: Ident
    t_ms: Ms
    reason: Annotated[str, Text(32, ("done", "stopped"))]
    result: LessonResult


@dataclass(frozen=True)
class ExperimentFailed:
    exp_id: Ident
    t_ms: Ms
    error: Annotated[str, Text(128)]
    message: Message


Event = typing.Union[LoadProgress, ModelLoaded, HardwarePeaks, RunStarted, PrefillDone, KVNorms, TokenStep,
                     AttentionStep, LayerTimes, RunFinished, RunFailed, ExperimentStarted, ExperimentProgress,
                     ExperimentPoint, ExperimentFinished, ExperimentFailed]
TRACE_EVENTS = tuple(cls for cls in typing.get_args(Event) if cls not in (LoadProgress, ModelLoaded))


def _rate(count: int, ms: float) -> float:
    return count / (ms / 1000.0) if ms > 0 else 0.0


def to_dict(event: object) -> dict:
    """A JSON-ready dict with a ``type`` key naming the event class (the schema in ``engine.facts.schema`` reads it
    back). Lists of plain values are shared, not copied: ``dataclasses.asdict`` deep-copies, 5x slower."""
    return {"type": type(event).__name__, **_plain(event)}


def _plain(obj: object) -> object:
    if dataclasses.is_dataclass(obj):
        return {name: _plain(value) for name, value in vars(obj).items()}
    kind = type(obj)
    if kind is tuple:
        return [_plain(v) for v in obj]
    if kind is list and obj and (dataclasses.is_dataclass(obj[0]) or type(obj[0]) in (list, tuple)):
        return [_plain(v) for v in obj]
    if kind is dict:
        return {k: _plain(v) for k, v in obj.items()}
    return obj


def plain(obj: object) -> object:
    """A dataclass (settings, results, facts) as plain JSON values: what ``--json`` prints."""
    return _plain(obj)
