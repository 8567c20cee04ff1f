"""What a model's ``config.json`` alone says, read before anything is allocated: whether its sizes are sane, how
long a context it declares, and the arithmetic a config is enough for (KV bytes per position, weights at
each format, whether they fit a memory budget), all computed. What a config file leaves to its model's config class
(a hybrid's layer schedule) is filled in by transformers' own class where it knows the type, never by remote
code, so a config-only folder reads as the loaded model does.

A folder from anywhere can declare a million layers or zero heads; checked here, such a config is refused in
one line that names the field, before the seconds (or the gigabytes) that building the model would take. A
folder holding only a published ``config.json`` (Phi-4-mini's, say) gets the cache and weight arithmetic
without its weights. No torch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from engine.facts.bounded import read_bounded
from engine.facts.errors import ModelSourceError
from engine.facts.events import KVLayer, ModelFacts
from engine.facts.fields import MAX_CONTEXT, MAX_HEAD_DIM, MAX_HEADS, MAX_LAYERS, MAX_VOCAB

# The keys transformers' configs use for the longest context, in the order they are trusted.
CONTEXT_KEYS = ("max_position_embeddings", "max_seq_len", "n_positions", "seq_length", "max_sequence_length",
                "n_ctx", "model_max_length")
UNDECLARED_CONTEXT = 8192          # a run's cap where a model declares none (said wherever it is shown)
MAX_HIDDEN = 1 << 20
MAX_CONFIG_BYTES = 16 << 20          # a config.json is kilobytes (a large MoE's, tens of them)
ENCODER_ONLY = {"bert", "roberta", "xlm-roberta", "distilbert", "albert", "electra", "deberta", "deberta-v2",
                "camembert", "mpnet", "modernbert", "ernie", "xlm", "flaubert", "funnel", "megatron-bert",
                "nomic_bert", "jina_bert", "squeezebert", "mobilebert", "convbert", "layoutlm", "roformer"}
ENCODER_HEADS = ("ForMaskedLM", "ForSequenceClassification", "ForTokenClassification", "ForQuestionAnswering",
                 "ForMultipleChoice", "ForNextSentencePrediction", "ForPreTraining")
FORMATS = {"float32": 4.0, "bfloat16": 2.0, "float16": 2.0, "int8": 1.0 + 2.0 / 128, "int4": 0.5 + 2.0 / 32}
# int8: one byte a weight plus a 16-bit scale per output row of ~128 (what engine.model.quantize stores, about);
# int4: half a byte plus a 16-bit scale and zero per group of 32.


def read(folder: str | Path) -> dict:
    """``config.json`` as a dict (the text part of a multimodal config), or a one-line refusal."""
    path = Path(folder) / "config.json"
    try:
        data = json.loads(read_bounded(path, MAX_CONFIG_BYTES).decode("utf-8"), parse_constant=_not_a_number)
    except PermissionError:
        raise ModelSourceError(f"{path} cannot be read: permission denied") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ModelSourceError(f"{path} cannot be read: {getattr(exc, 'strerror', None) or exc}") from None
    except _NotANumber as exc:
        raise ModelSourceError(f"{path} holds {exc} where a number belongs (a model run with it computes scores that "
                               "are not numbers): put the model's own value back") from None
    except ValueError as exc:
        raise ModelSourceError(f"{path} is not valid JSON ({exc})") from None
    except RecursionError:
        raise ModelSourceError(f"{path} is not a config: it is nested too deeply to be one") from None
    if not isinstance(data, dict):
        raise ModelSourceError(f"{path} is not a config: it holds no JSON object")
    text = data.get("text_config")
    data = {**data, **text} if isinstance(text, dict) else data
    layers = data.get("num_hidden_layers")
    sane = isinstance(layers, int) and not isinstance(layers, bool) and 0 < layers <= MAX_LAYERS
    return {**data, **_completed(Path(folder))} if sane else data       # (a config's class builds lists per layer)


class _NotANumber(Exception):
    pass


def _not_a_number(token: str) -> float:
    """``NaN`` and ``Infinity`` are not JSON; Python's reader takes them, transformers would run with them."""
    raise _NotANumber(token)


def _completed(folder: Path) -> dict:
    """What transformers' own config class fills in that the file leaves out (a hybrid's ``layer_types`` from its
    ``layer_group_size``, a MoE schedule), so a config-only folder is read as the loaded model's config is: one
    reading of a config for both paths. Only for a model type this transformers knows (no remote code runs);
    {} where it cannot say, and the file alone is read."""
    try:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(str(folder), trust_remote_code=False)
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        completed = text.to_dict()
    except Exception:  # noqa: BLE001  (a type transformers does not know, a value it refuses: the file decides)
        return {}
    wanted = ("layer_types", "mlp_layer_types", "compress_rates", "num_kv_shared_layers", "first_k_dense_replace")
    return {k: completed[k] for k in wanted if completed.get(k) is not None}


def _whole(cfg: dict, *names: str) -> tuple[str, object]:
    for name in names:
        if name in cfg and cfg[name] is not None:
            return name, cfg[name]
    return names[0], None


def number(cfg: dict, names: tuple[str, ...], low: int, high: int, required: bool = True) -> int | None:
    """The first of ``names`` the config sets, checked to be a whole number in ``[low, high]``."""
    name, value = _whole(cfg, *names)
    if value is None:
        if required:
            raise ModelSourceError(f"config.json declares no {name}: it is not a model KVScope can size")
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ModelSourceError(f"config.json's {name} is {json.dumps(value)[:40]}, not a whole number")
    if not low <= value <= high:
        raise ModelSourceError(f"config.json's {name} is {value:,}: a model's {name} must be between {low:,} and "
                               f"{high:,}")
    return value


def declared_context(cfg: dict) -> tuple[int | None, str]:
    """The longest context the config declares, and under which key; (None, "") when it declares none."""
    for key in CONTEXT_KEYS:
        value = cfg.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return min(value, MAX_CONTEXT), key
    return None, ""


def refusal(cfg: dict) -> str | None:
    """Why a config is not a decoder KVScope can run, in words, or None."""
    model_type = str(cfg.get("model_type", "")).lower()
    architectures = [a for a in cfg.get("architectures") or [] if isinstance(a, str)]
    if cfg.get("is_encoder_decoder"):
        return f"{model_type or 'this model'} is an encoder-decoder model"
    encoder_heads = architectures and all(a.endswith(ENCODER_HEADS) for a in architectures)
    if model_type in ENCODER_ONLY or (encoder_heads and not cfg.get("is_decoder")):
        shown = architectures[0] if architectures else model_type
        return (f"{shown} is an encoder (it reads a whole text at once, both ways, to classify or fill it in): it "
                "keeps no KV cache and generates no text token by token")
    return None


@dataclass(frozen=True)
class Sizes:
    """A config's sizes, checked: enough for the cache and weight arithmetic. Per layer: its kind (what it
    caches, as a loaded model's probe names it) and its MLP's width; for a mixture of experts, the experts and
    which layers have them."""

    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    intermediate: int                      # the widest layer's MLP (a dense layer's, or every expert's)
    vocab: int
    context: int | None
    context_key: str
    tied: bool
    latent: tuple[int, int, int] | None      # MLA: (latent width, rope key width, full MHA width per position)
    sliding: list[int | None]               # per layer: positions a sliding layer holds (None: every one)
    kinds: tuple[str, ...] = ()              # per layer: full, sliding, latent, state, none (as the probe says)
    widths: tuple[int, ...] = ()             # per layer: the dense MLP's width (Gemma 3n: one each)
    experts: int = 0                         # routed experts per MoE layer (0: dense)
    expert_width: int = 0                    # each expert's MLP width
    shared_width: int = 0                    # the shared experts' total MLP width
    moe: tuple[bool, ...] = ()               # per layer: experts (True) or a dense MLP
    state: tuple[int, ...] = ()              # per layer: a linear-attention layer's fixed state, in elements
    series: tuple[tuple[tuple[int, int, int, int], ...], ...] = ()   # per layer: compressed series, in elements
    shared_kv: bool = False                  # keys and values one tensor (DeepSeek-V4's compressing layers)
    index_width: int = 0                     # a sparse-attention indexer's keys per position (DeepSeek-V3.2)
    per_layer_inputs: int = 0                # Gemma 3n's per-layer input embeddings (parameters)

    def parameters(self) -> int:
        """Parameters, estimated from the sizes (attention projections, each layer's MLP or its experts and
        router, embeddings, norms): what a memory check needs before the model is built, not the exact count a
        loaded model reports. Every expert counts: a mixture of experts holds all of them."""
        attention_width = self.heads * self.head_dim
        kv_width = self.kv_heads * self.head_dim
        if self.latent is not None:                # MLA: queries, the latent and rope key down, K and V up
            rank, rope, mha = self.latent
            attention = self.hidden * attention_width + self.hidden * (rank + rope) + rank * mha + \
                attention_width * self.hidden
        else:
            attention = self.hidden * attention_width * 2 + self.hidden * kv_width * 2
        total = 0
        for layer in range(self.layers):
            if self.moe and self.moe[layer]:
                mlp = 3 * self.hidden * (self.experts * self.expert_width + self.shared_width) + \
                    self.hidden * self.experts
            else:
                mlp = 3 * self.hidden * (self.widths[layer] if self.widths else self.intermediate)
            total += attention + mlp + 2 * self.hidden
        embeddings = self.vocab * self.hidden * (1 if self.tied else 2)
        return total + embeddings + self.hidden + self.per_layer_inputs

    def weight_bytes(self, fmt: str) -> int:
        return int(self.parameters() * FORMATS[fmt])


LINEAR = ("linear_attention", "mamba", "conv", "recurrent", "linear")      # layer types that keep a state


def _schedule(cfg: dict, layers: int) -> list[str] | None:
    """Each layer's type, from ``layer_types`` or the older ways hybrids say it (Jamba's attention period,
    RecurrentGemma's block types)."""
    types = cfg.get("layer_types")
    if isinstance(types, list) and len(types) == layers:
        return [str(t) for t in types]
    blocks = cfg.get("block_types")
    if isinstance(blocks, list) and blocks:
        return ["sliding_attention" if blocks[i % len(blocks)] == "attention" else "recurrent" for i in range(layers)]
    period, offset = cfg.get("attn_layer_period"), cfg.get("attn_layer_offset")
    if isinstance(period, int) and isinstance(offset, int) and period > 0:
        return ["full_attention" if i % period == offset else "mamba" for i in range(layers)]
    return None
COMPRESSED = {"compressed_sparse_attention": True, "heavily_compressed_attention": False}   # -> with an indexer


def _widths(cfg: dict, layers: int, hidden: int) -> list[int]:
    """Each layer's MLP width: one whole number for every layer, or a list of one per layer (Gemma 3n)."""
    name, value = _whole(cfg, "intermediate_size", "ffn_hidden_size", "n_inner")
    if isinstance(value, list):
        if len(value) != layers or not all(isinstance(v, int) and not isinstance(v, bool) and
                                           1 <= v <= 64 * MAX_HIDDEN for v in value):
            raise ModelSourceError(f"config.json's {name} is a list of {len(value):,} widths: it must give one whole "
                                   f"number for each of its {layers:,} layers")
        return value
    one = number(cfg, ("intermediate_size", "ffn_hidden_size", "n_inner"), 1, 64 * MAX_HIDDEN, required=False)
    return [one or 4 * hidden] * layers


def _experts(cfg: dict, layers: int, hidden: int, widths: list[int]) -> tuple[int, int, int, list[bool]]:
    """(routed experts, each one's width, the shared experts' width, which layers have experts)."""
    experts = number(cfg, ("n_routed_experts", "num_experts", "num_local_experts", "moe_num_experts"), 0,
                     1 << 16, required=False) or 0
    if not experts:
        return 0, 0, 0, [False] * layers
    width = number(cfg, ("moe_intermediate_size", "expert_intermediate_size"), 1, 64 * MAX_HIDDEN,
                   required=False) or widths[0]
    shared = number(cfg, ("shared_expert_intermediate_size",), 0, 64 * MAX_HIDDEN, required=False)
    if shared is None:
        count = number(cfg, ("n_shared_experts", "num_shared_experts"), 0, 1 << 10, required=False) or 0
        shared = count * width
    kinds = cfg.get("mlp_layer_types")
    if isinstance(kinds, list) and len(kinds) == layers:
        moe = [str(k) not in ("dense", "mlp") for k in kinds]
    else:
        first_dense = number(cfg, ("first_k_dense_replace",), 0, layers, required=False) or 0
        only = {i for i in cfg.get("mlp_only_layers") or [] if isinstance(i, int)}
        step = number(cfg, ("decoder_sparse_step",), 1, layers, required=False) or 1
        moe = [i >= first_dense and i not in only and (i + 1) % step == 0 for i in range(layers)]
    return experts, width, shared, moe


def _linear_state(cfg: dict, hidden: int) -> int:
    """Elements a linear-attention or state-space layer keeps per sequence (a convolution window and a recurrent
    state), as its family's layers allocate them; 0 for a family KVScope cannot size from its config."""
    kernel = int(cfg.get("linear_conv_kernel_dim") or 4)
    if cfg.get("lru_width"):                                   # RecurrentGemma: the LRU state and its conv window
        width = int(cfg["lru_width"])
        return width + width * (int(cfg.get("conv1d_width") or 4) - 1)
    if cfg.get("mamba_d_ssm"):                                 # Falcon-H1's Mamba-2 beside attention
        groups, state = int(cfg.get("mamba_n_groups") or 1), int(cfg.get("mamba_d_state") or 16)
        return (int(cfg["mamba_d_ssm"]) + 2 * groups * state) * int(cfg.get("mamba_d_conv") or 4) + \
            int(cfg.get("mamba_n_heads") or 1) * int(cfg.get("mamba_d_head") or 1) * state
    if cfg.get("mamba_d_state"):                               # Jamba's Mamba layers
        inner = int(cfg.get("mamba_expand") or 2) * hidden
        return inner * int(cfg.get("mamba_d_conv") or 4) + inner * int(cfg["mamba_d_state"])
    if cfg.get("linear_num_value_heads"):                      # Qwen3-Next's gated DeltaNet
        heads_k, dim_k = int(cfg["linear_num_key_heads"]), int(cfg["linear_key_head_dim"])
        heads_v, dim_v = int(cfg["linear_num_value_heads"]), int(cfg["linear_value_head_dim"])
        return (2 * heads_k * dim_k + heads_v * dim_v) * kernel + heads_v * dim_k * dim_v
    if cfg.get("linear_num_heads"):                            # Bailing's lightning attention
        heads, dim = int(cfg["linear_num_heads"]), int(cfg["linear_head_dim"])
        return 3 * heads * dim * kernel + heads * dim * dim
    if str(cfg.get("model_type", "")) == "minimax":              # MiniMax's lightning attention: one state a head
        heads = int(cfg.get("num_attention_heads") or 1)
        dim = int(cfg.get("head_dim") or hidden // heads)
        return heads * dim * dim
    return 0


def sizes(cfg: dict) -> Sizes:
    """The config's sizes, each refused in one line naming its field when absent, absurd or zero."""
    layers = number(cfg, ("num_hidden_layers", "n_layer", "n_layers", "num_layers"), 1, MAX_LAYERS)
    hidden = number(cfg, ("hidden_size", "n_embd", "d_model"), 1, MAX_HIDDEN)
    # A state-space model (Mamba) declares no heads: it is sized without them, and refused later for keeping
    # no KV cache, in those words.
    heads = number(cfg, ("num_attention_heads", "n_head", "n_heads", "num_heads"), 1, MAX_HEADS, required=False) or 1
    kv_heads = number(cfg, ("num_key_value_heads", "num_kv_heads", "n_head_kv"), 1, heads, required=False)
    if cfg.get("new_decoder_architecture"):        # Falcon-40B's decoder caches its declared KV heads and
        kv_heads = kv_heads or heads                 # ignores multi_query (transformers 5.25)
    elif kv_heads is None or cfg.get("multi_query"):
        kv_heads = 1 if cfg.get("multi_query") else heads
    head_dim = number(cfg, ("head_dim",), 1, MAX_HEAD_DIM, required=False) or max(hidden // heads, 1)
    vocab = number(cfg, ("vocab_size", "padded_vocab_size"), 1, MAX_VOCAB)
    widths = _widths(cfg, layers, hidden)
    experts, expert_width, shared_width, moe = _experts(cfg, layers, hidden, widths)
    context, key = declared_context(cfg)
    latent = None
    rank, rope = cfg.get("kv_lora_rank"), cfg.get("qk_rope_head_dim")
    if isinstance(rank, int) and isinstance(rope, int) and rank > 0 and rope > 0:
        nope, value = int(cfg.get("qk_nope_head_dim") or 0), int(cfg.get("v_head_dim") or 0)
        latent = (rank, rope, heads * (nope + rope + value))
    window = cfg.get("sliding_window") or cfg.get("attention_window_size")
    types = _schedule(cfg, layers)
    sliding: list[int | None] = [None] * layers
    slides = isinstance(window, int) and window > 1 and (context is None or window - 1 < context)   # else never
    compressed = bool(types) and any(t in COMPRESSED for t in types)
    if slides and (cfg.get("use_sliding_window", True) is not False or compressed):
        if compressed:                                # DeepSeek-V4: every layer slides, some also compress
            sliding = [window - 1] * layers
        elif types is not None:
            sliding = [window - 1 if t == "sliding_attention" else None for t in types]
        elif cfg.get("layer_types") is None:
            sliding = [window - 1] * layers           # Mistral-style: every layer slides
    shared_from = layers - (number(cfg, ("num_kv_shared_layers",), 0, layers, required=False) or 0)
    beside = _linear_state(cfg, hidden) if cfg.get("mamba_d_ssm") else 0     # Falcon-H1: state in every layer
    kinds, state, series = [], [], []
    for i in range(layers):
        kind = (types[i] if types else "")
        if i >= shared_from:
            kinds.append("none")                      # Gemma 3n: reuses an earlier layer's keys and values
        elif kind in LINEAR:
            kinds.append("state")
        elif sliding[i] is not None:
            kinds.append("sliding")
        else:
            kinds.append("latent" if latent is not None else "full")
        state.append(_linear_state(cfg, hidden) if kinds[-1] == "state" else beside if kinds[-1] != "none" else 0)
        series.append(_compressed_series(cfg, kind, head_dim))
    per_layer = 0
    if cfg.get("hidden_size_per_layer_input") and cfg.get("vocab_size_per_layer_input"):
        per_layer = int(cfg["hidden_size_per_layer_input"]) * int(cfg["vocab_size_per_layer_input"]) * layers
    index = int(cfg.get("index_head_dim") or 0) if latent is not None else 0        # DeepSeek-V3.2's indexer keys
    return Sizes(layers, heads, kv_heads, head_dim, hidden, max(widths), vocab, context, key,
                 bool(cfg.get("tie_word_embeddings", False)), latent, sliding, tuple(kinds), tuple(widths), experts,
                 expert_width, shared_width, tuple(moe), tuple(state), tuple(series), compressed, index, per_layer)


def _compressed_series(cfg: dict, kind: str, head_dim: int) -> tuple[tuple[int, int, int, int], ...]:
    """A DeepSeek-V4 layer's compressed series, in elements: (rate, entry, buffer per waiting position, overlap)
    for its compressor and, in sparse layers, its indexer (as its cache layers allocate them)."""
    if kind not in COMPRESSED:
        return ()
    rates = cfg.get("compress_rates") if isinstance(cfg.get("compress_rates"), dict) else {}
    rate = int(rates.get(kind) or (4 if COMPRESSED[kind] else 128))
    if not COMPRESSED[kind]:                          # heavily compressed: one series, no overlap
        return ((rate, head_dim, 2 * head_dim, 0),)
    index = int(cfg.get("index_head_dim") or 0)
    return ((rate, head_dim, 4 * head_dim, 2 * rate * head_dim),
            (rate, index, 4 * index, 2 * rate * index))


def kv_layers(s: Sizes, dtype_bytes: int) -> list[KVLayer]:
    """What each layer would cache per position, from the config (computed; a loaded model's facts come from
    the cache it really builds instead, and a test holds the two to the same kinds and bytes)."""
    out = []
    for i, kind in enumerate(s.kinds):
        held = s.state[i] * dtype_bytes
        if kind == "none":
            out.append(KVLayer("none"))
        elif kind == "state":
            out.append(KVLayer("state", state_bytes=held))
        elif kind == "latent":
            rank, rope, mha = s.latent
            out.append(KVLayer("latent", kv_heads=1, k_dim=rank, v_dim=rope, dtype_bytes=dtype_bytes, mha_width=mha,
                               state_bytes=held, extra_bytes=s.index_width * dtype_bytes))
        else:
            series = [[rate, entry * dtype_bytes, buffered * dtype_bytes, overlap * dtype_bytes]
                      for rate, entry, buffered, overlap in s.series[i]]
            out.append(KVLayer(kind, kv_heads=s.kv_heads, k_dim=s.head_dim, v_dim=0 if series else s.head_dim,
                               dtype_bytes=dtype_bytes, capacity=s.sliding[i], state_bytes=held, compressed=series))
    return out


def model_facts(folder: str | Path, cfg: dict, fmt: str = "bfloat16") -> ModelFacts:
    """ModelFacts computed from a config alone (no weights): what the formula and the cost model need."""
    s = sizes(cfg)
    dtype_bytes = 4 if fmt == "float32" else 2
    return ModelFacts(
        name=Path(folder).name, source=str(folder), architecture=str((cfg.get("architectures") or ["?"])[0])[:256],
        num_layers=s.layers, num_heads=s.heads, head_dim=s.head_dim, hidden_size=s.hidden, vocab_size=s.vocab,
        max_context=s.context or UNDECLARED_CONTEXT, dtype=fmt if fmt in ("float32", "bfloat16", "float16") else
        "bfloat16", dtype_bytes=dtype_bytes, num_params=s.parameters(), device="none (config only)",
        layer_devices=["none"] * s.layers, kv_layers=kv_layers(s, dtype_bytes), tied_embeddings=s.tied,
        weights=fmt, weight_bytes=s.weight_bytes(fmt), weight_format=fmt, context_declared=s.context is not None,
        config_kv_heads=s.kv_heads)


def safetensors_header(path: Path) -> dict | None:
    """A safetensors file's JSON header (its tensors' names, dtypes and shapes), read within bounds; None when the
    file cannot be read or does not start with one."""
    try:
        with path.open("rb") as f:
            size = int.from_bytes(f.read(8), "little")
            if not 0 < size <= 100 << 20:
                return None
            header = json.loads(f.read(size))
    except (OSError, ValueError):
        return None
    return header if isinstance(header, dict) else None


def stored_parameters(folder: str | Path) -> int | None:
    """Parameters the folder's safetensors files hold, read from their headers alone (no tensor is read); None
    when it has none, or a header is not one."""
    total, files = 0, sorted(Path(folder).glob("*.safetensors"))
    if not files:
        return None
    for path in files:
        header = safetensors_header(path)
        if header is None:
            return None
        for name, entry in header.items():
            if name != "__metadata__" and isinstance(entry, dict):
                count = 1
                for dim in entry.get("shape", []):
                    count *= int(dim)
                total += count
    return total


def has_weights(folder: str | Path) -> bool:
    folder = Path(folder)
    return any(folder.glob("*.safetensors")) or any(folder.glob("*.bin")) or any(folder.glob("*.pt"))
