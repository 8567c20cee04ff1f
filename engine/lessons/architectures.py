"""Lesson: why new models hold less KV. For eight published models, one per attention design (multi-head,
grouped-query, multi-query, sliding window, alternating sliding and global, multi-head latent attention, a
linear-attention hybrid, sinks with alternating windows), build one decoder layer of each kind the model has,
with the published attention dimensions and zero weights (no download; the MLP, the experts and the
vocabulary are shrunk, since they hold no KV), run a prompt through it and read what its cache holds: bytes per
token per layer, the sliding layers' capacity, a linear-attention layer's fixed state. The whole model's figure
at 4k, 32k and 128k positions is then computed from those measured per-layer figures and the published layer
counts, beside the formula from the published dimensions alone.

Where each dimension comes from: the ``config.json`` each model publishes on the Hugging Face hub, under the
repository named in its ``source``.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any

from engine.facts import kvformula
from engine.facts.errors import ParameterError
from engine.facts.events import LAYER_KINDS, ExperimentPoint, LessonResult, LessonSettings
from engine.facts.fields import Bytes, Column, Items, Name, Number, Range, Setting, Text
from engine.facts.vocabulary import LessonPoint
from engine.run.experiment import Experiment, Lesson

CONTEXTS = (4096, 32768, 131072)
VOCAB = 512                       # the embedding and the head hold no KV: a small vocabulary is enough
SMALL_MLP = dict(intermediate_size=256)


@dataclass(frozen=True)
class Design:
    """One published model as far as its KV cache goes: the config class that builds it, its published
    attention dimensions, what is shrunk, the kinds of layer it has and how many of each, and where the figures
    come from."""

    name: str
    design: str
    source: str                                  # the Hugging Face repository whose config.json gives the dims
    config: str
    published: dict
    shrunk: dict
    layers: tuple[tuple[str, int], ...]          # (layer type as the config names it, count in the full model)
    kv_heads: int = 0
    head_dim: int = 0
    latent: tuple[int, int] = (0, 0)             # (kv_lora_rank, qk_rope_head_dim)
    context: int = 0

    def formula_bytes_per_token(self, dtype_bytes: int) -> int:
        """The published dimensions alone: ``2 x kv_heads x head_dim`` per attention layer (K and V), or the
        latent and rope key of a latent layer; a linear-attention layer holds no per-token KV."""
        per_layer = (self.latent[0] + self.latent[1]) if self.latent[0] else 2 * self.kv_heads * self.head_dim
        attention = sum(count for kind, count in self.layers if kind != "linear_attention")
        return attention * per_layer * dtype_bytes


DESIGNS: tuple[Design, ...] = (
    Design("Llama-2-7B", "multi-head attention", "meta-llama/Llama-2-7b-hf", "LlamaConfig",
           dict(hidden_size=4096, num_attention_heads=32, num_key_value_heads=32, head_dim=128,
                max_position_embeddings=4096), SMALL_MLP, (("full_attention", 32),), kv_heads=32, head_dim=128,
           context=4096),
    Design("Llama-3.1-8B", "grouped-query attention", "meta-llama/Llama-3.1-8B", "LlamaConfig",
           dict(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                max_position_embeddings=131072), SMALL_MLP, (("full_attention", 32),), kv_heads=8, head_dim=128,
           context=131072),
    Design("Falcon-7B", "multi-query attention", "tiiuae/falcon-7b", "FalconConfig",
           dict(hidden_size=4544, num_attention_heads=71, multi_query=True, new_decoder_architecture=False,
                max_position_embeddings=2048), {}, (("full_attention", 32),), kv_heads=1, head_dim=64, context=2048),
    Design("Mistral-7B", "sliding window on every layer", "mistralai/Mistral-7B-v0.1", "MistralConfig",
           dict(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, head_dim=128, sliding_window=4096,
                max_position_embeddings=32768), SMALL_MLP, (("sliding_attention", 32),), kv_heads=8, head_dim=128,
           context=32768),
    Design("Gemma-2-9B", "alternating sliding and global", "google/gemma-2-9b", "Gemma2Config",
           dict(hidden_size=3584, num_attention_heads=16, num_key_value_heads=8, head_dim=256, sliding_window=4096,
                max_position_embeddings=8192), SMALL_MLP, (("sliding_attention", 21), ("full_attention", 21)),
           kv_heads=8, head_dim=256, context=8192),
    Design("DeepSeek-V3", "multi-head latent attention", "deepseek-ai/DeepSeek-V3", "DeepseekV3Config",
           dict(hidden_size=7168, num_attention_heads=128, num_key_value_heads=128, kv_lora_rank=512,
                q_lora_rank=1536, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
                max_position_embeddings=163840),
           dict(SMALL_MLP, first_k_dense_replace=1, n_routed_experts=2, num_experts_per_tok=1,
                moe_intermediate_size=64, n_group=1, topk_group=1),
           (("full_attention", 61),), latent=(512, 64), context=163840),
    Design("Qwen3-Next-80B-A3B", "linear-attention hybrid (3 of 4 layers)", "Qwen/Qwen3-Next-80B-A3B-Instruct",
           "Qwen3NextConfig",
           dict(hidden_size=2048, num_attention_heads=16, num_key_value_heads=2, head_dim=256,
                linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
                linear_value_head_dim=128, linear_conv_kernel_dim=4, max_position_embeddings=262144),
           dict(SMALL_MLP, num_experts=2, num_experts_per_tok=1, moe_intermediate_size=64,
                shared_expert_intermediate_size=64),
           (("linear_attention", 36), ("full_attention", 12)), kv_heads=2, head_dim=256, context=262144),
    Design("gpt-oss-20b", "attention sinks, alternating 128-token windows", "openai/gpt-oss-20b", "GptOssConfig",
           dict(hidden_size=2880, num_attention_heads=64, num_key_value_heads=8, head_dim=64, sliding_window=128,
                max_position_embeddings=131072), dict(SMALL_MLP, num_local_experts=2, num_experts_per_tok=1),
           (("sliding_attention", 12), ("full_attention", 12)), kv_heads=8, head_dim=64, context=131072),
)
BY_NAME = {d.name: d for d in DESIGNS}
DTYPES = ("bfloat16", "float32")


@dataclass(frozen=True)
class DesignPoint(LessonPoint):
    """One design (``index``: its place in the settings' designs): KV bytes per token measured from its layers'
    caches and by the formula, its fixed recurrent state, and the whole model's cache at each of ``CONTEXTS``."""

    series = "design"

    index: Annotated[int, Column("design", "{:d}")]            # a table names it (``settings.designs[index]``)
    measured: Annotated[int, Column("KV/token measured", show=kvformula.format_bytes)]
    formula: Annotated[int, Column("formula", show=kvformula.format_bytes)]
    state: Annotated[int, Column("state", show=kvformula.format_bytes)]
    at_4k: Annotated[int, Column("at 4k", show=kvformula.format_bytes)]
    at_32k: Annotated[int, Column("at 32k", show=kvformula.format_bytes)]
    at_128k: Annotated[int, Column("at 128k", show=kvformula.format_bytes)]


AT_CONTEXTS = tuple(f"at_{c // 1024}k" for c in CONTEXTS)     # the point's fields, one per context
assert set(AT_CONTEXTS) <= {f.name for f in dataclasses.fields(DesignPoint)}, "a context without its field"


@dataclass(frozen=True)
class ArchitecturesSettings(LessonSettings):
    kind = "architectures"

    designs: Annotated[tuple[Annotated[str, Text(64, tuple(BY_NAME))], ...], Items(len(DESIGNS)), Setting(
        "--designs", "Designs", "the published models to build, comma-separated")] = tuple(BY_NAME)
    prompt_tokens: Annotated[int, Range(8, 512), Setting(
        "--tokens", "Prompt tokens", "positions run through each layer", "tokens")] = 64
    decode_steps: Annotated[int, Range(1, 64), Setting(
        "--steps", "Decode steps", "decode steps after the prompt, each one measured", "steps")] = 4
    cache_dtype: Annotated[str, Text(16, DTYPES), Setting(
        "--cache-dtype", "Cache dtype", "the dtype the layers (and so the cache) run in; the published models serve "
        "in bfloat16")] = "bfloat16"

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.designs:
            raise ParameterError("Pick at least one design to measure")


@dataclass(frozen=True)
class LayerFigures:
    """One kind of layer as built and measured: what its cache keeps per token and per sequence."""

    layer_type: Annotated[str, Text(32)]
    count: Annotated[int, Range(1, 1024)]          # layers of this kind in the full model
    kind: Annotated[str, Text(16, LAYER_KINDS)]
    bytes_per_token: Bytes                          # measured: bytes held / positions held
    capacity: Annotated[int, Range(1, 1 << 24)] | None = None     # a sliding layer: positions it keeps (measured)
    state_bytes: Bytes = 0                          # a fixed state per sequence (measured)


@dataclass(frozen=True)
class DesignFigures:
    name: Name
    design: Annotated[str, Text(128)]
    source: Annotated[str, Text(128)]
    layers: Annotated[tuple[LayerFigures, ...], Items(4)]
    kv_bytes_per_token_measured: Bytes              # whole model, every layer counted, within every window
    kv_bytes_per_token_formula: Bytes               # whole model, from the published dimensions alone
    every_step_matches: bool                        # each decode step added exactly the per-token bytes
    state_bytes: Bytes                              # whole model, fixed per sequence
    at_contexts: Annotated[tuple[Bytes, ...], Items(len(CONTEXTS))]   # computed from the measured figures
    context: Annotated[int, Range(1, 1 << 24)]      # the model's own context (published)
    build_ms: Number = 0.0


@dataclass(frozen=True)
class ArchitecturesResult(LessonResult):
    kind = "architectures"

    dtype_bytes: Annotated[int, Range(0, 8)] = 0
    designs: Annotated[tuple[DesignFigures, ...], Items(len(DESIGNS))] = field(default_factory=tuple)


def whole_model_bytes(layers: Sequence[LayerFigures], positions: int) -> int:
    """The full model at ``positions``: each kind of layer's measured bytes per token times the positions it
    keeps (a sliding layer no more than its capacity), times how many such layers, plus every fixed state."""
    total = 0
    for layer in layers:
        kept = min(positions, layer.capacity) if layer.capacity is not None else positions
        total += layer.count * (layer.bytes_per_token * kept + layer.state_bytes)
    return total


def build(design: Design, dtype: str) -> Any:
    """One decoder layer of each kind ``design`` has, published attention dimensions, zero weights. What a cache
    holds is set by its shapes, never by the weights' values, and drawing random ones was most of the lesson's
    time (16 s of 17 for the eight designs on a 2-vCPU VM: Falcon-7B's one layer holds 0.2 billion); zeros are a
    memset, and keep every activation finite (no uninitialised memory is ever read). Buffers (the rotary
    frequencies) are computed as usual."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM
    from transformers.initialization import no_init_weights
    from transformers.utils import logging

    kinds = [kind for kind, _count in design.layers]
    config = getattr(transformers, design.config)(
        vocab_size=VOCAB, num_hidden_layers=len(kinds), **design.published, **design.shrunk,
        **({"layer_types": kinds} if len(kinds) > 1 else {}))
    level = logging.get_verbosity()
    logging.set_verbosity_error()        # "falling back to the reference kernel": speed is not measured here
    try:
        with no_init_weights():
            model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype)).eval()
    finally:
        logging.set_verbosity(level)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.zero_()
    return model


def measure(design: Design, settings: ArchitecturesSettings, device: Any,
            cancelled: Callable[[], bool] = lambda: False) -> DesignFigures | None:
    """The design's layers built and fed; None if ``cancelled()`` before a pass (a stop takes effect within one
    forward pass)."""
    import torch

    from engine.model import kvcache

    started = time.perf_counter()
    model = build(design, settings.cache_dtype).to(device)
    build_ms = (time.perf_counter() - started) * 1000.0
    probed = kvcache.probe_layers(model)
    n = len(design.layers)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (1, settings.prompt_tokens), generator=generator).to(device)
    cache = kvcache.new_cache(model)
    held_by_step = []
    with torch.inference_mode():
        if cancelled():
            return None
        out = kvcache.forward(model, ids, cache)
        cache = getattr(out, "cache", None) or cache
        held_by_step.append(kvcache.held_per_layer(cache, n))
        for _ in range(settings.decode_steps):
            if cancelled():
                return None
            token = out.logits[:, -1:].argmax(-1)
            out = kvcache.forward(model, token, cache)
            held_by_step.append(kvcache.held_per_layer(cache, n))
    sizes, positions = held_by_step[0]
    layers = []
    for (layer_type, count), facts, (k, v), held in zip(design.layers, probed, sizes, positions):
        per_token = (k + v) // held if held else 0
        layers.append(LayerFigures(layer_type, count, facts.kind, per_token, facts.capacity, facts.state_bytes))
    steady = all(k + v == layer.bytes_per_token * held                # every step: bytes = per-token x held
                 for step_sizes, step_held in held_by_step
                 for layer, (k, v), held in zip(layers, step_sizes, step_held))
    per_token = sum(layer.count * layer.bytes_per_token for layer in layers)
    dtype_bytes = 2 if settings.cache_dtype == "bfloat16" else 4
    del model, cache, out
    return DesignFigures(
        name=design.name, design=design.design, source=design.source, layers=tuple(layers),
        kv_bytes_per_token_measured=per_token, kv_bytes_per_token_formula=design.formula_bytes_per_token(dtype_bytes),
        every_step_matches=steady, state_bytes=sum(layer.count * layer.state_bytes for layer in layers),
        at_contexts=tuple(whole_model_bytes(layers, c) for c in CONTEXTS), context=design.context,
        build_ms=build_ms)


def run(experiment: Experiment, settings: ArchitecturesSettings) -> ArchitecturesResult:
    device = experiment.session.device
    measured: list[DesignFigures] = []
    wanted = [BY_NAME[name] for name in settings.designs]
    for i, design in enumerate(wanted):
        if experiment.cancelled:
            break
        experiment.progress(i, len(wanted), f"{design.name}: building one layer of each kind it has")
        figures = measure(design, settings, device, lambda: experiment.cancelled)
        if figures is None:
            break
        measured.append(figures)
        experiment.point(DesignPoint(index=i, measured=figures.kv_bytes_per_token_measured,
                                     formula=figures.kv_bytes_per_token_formula, state=figures.state_bytes,
                                     **dict(zip(AT_CONTEXTS, figures.at_contexts))))
    experiment.progress(len(measured), len(wanted), "done")
    return ArchitecturesResult(dtype_bytes=2 if settings.cache_dtype == "bfloat16" else 4, designs=tuple(measured),
                               incomplete=len(measured) < len(wanted))


def design_line(d: DesignFigures) -> str:
    fmt = kvformula.format_bytes
    contexts = " · ".join(f"{c // 1024}k {fmt(b)}" for c, b in zip(CONTEXTS, d.at_contexts))
    state = f" + {fmt(d.state_bytes)} state" if d.state_bytes else ""
    return f"{d.name}: {fmt(d.kv_bytes_per_token_measured)}/token{state}; {contexts}"


def table(points: Sequence[ExperimentPoint], result: ArchitecturesResult) -> str:
    fmt = kvformula.format_bytes
    lines = ["design               | attention                                  | KV/token measured | formula   | "
             "state     | at 4k     | at 32k    | at 128k   | steps",
             "---------------------+--------------------------------------------+-------------------+-----------+"
             "-----------+-----------+-----------+-----------+------"]
    for d in result.designs:
        at = [fmt(b) + ("*" if n > d.context else "") for b, n in zip(d.at_contexts, CONTEXTS)]
        lines.append(f"{d.name:20s} | {d.design[:42]:42s} | {fmt(d.kv_bytes_per_token_measured):>17s} | "
                     f"{fmt(d.kv_bytes_per_token_formula):>9s} | {fmt(d.state_bytes):>9s} | {at[0]:>9s} | "
                     f"{at[1]:>9s} | {at[2]:>9s} | {'=' if d.every_step_matches else 'NO':>5s}")
    if result.designs:
        lines += ["", "measured: one layer of each kind, published attention dimensions, zero weights, bytes read "
                  "from its cache; at 4k/32k/128k: computed from those and the published layer counts (a context "
                  "past a model's own is marked *)", "sources (config.json on the Hugging Face hub): " +
                  "; ".join(f"{d.name} {d.source}" for d in result.designs)]
        flagged = [d.name for d in result.designs if d.context < CONTEXTS[-1]]
        if flagged:
            lines.append("* past the model's own context: " + ", ".join(
                f"{d.name} ({d.context:,})" for d in result.designs if d.name in flagged))
    return "\n".join(lines)


LESSON = Lesson(kind="architectures", title="Why new models hold less KV", settings=ArchitecturesSettings,
                result=ArchitecturesResult, run=run, table=table, timed=False, points=(DesignPoint,),
                quick={"designs": ("Falcon-7B", "gpt-oss-20b", "Qwen3-Next-80B-A3B"), "prompt_tokens": 16,
                       "decode_steps": 1},
                course={"designs": ("Llama-2-7B", "Falcon-7B", "Mistral-7B", "DeepSeek-V3", "Qwen3-Next-80B-A3B",
                                    "gpt-oss-20b")})
