"""What a model's ``config.json`` alone says, read before anything is allocated: whether its sizes are sane, how
long a context it declares, and the arithmetic a config is enough for (KV bytes per position, weights at
each format, whether they fit a memory budget), all computed.

A folder from anywhere can declare a million layers or zero heads; checked here, such a config is refused in
one line that names the field, before the seconds (or the gigabytes) that building the model would take. A
folder holding only a published ``config.json`` (Phi-4-mini's, say) gets the cache and weight arithmetic
without its weights. No torch, no transformers: plain JSON.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from engine.errors import ModelSourceError
from engine.events import KVLayer, ModelFacts
from engine.fields import MAX_CONTEXT, MAX_HEAD_DIM, MAX_HEADS, MAX_LAYERS, MAX_VOCAB

# The keys transformers' configs use for the longest context, in the order they are trusted.
CONTEXT_KEYS = ("max_position_embeddings", "max_seq_len", "n_positions", "seq_length", "max_sequence_length",
                "n_ctx")
UNDECLARED_CONTEXT = 8192          # a run's cap where a model declares none (said wherever it is shown)
MAX_HIDDEN = 1 << 20
ENCODER_ONLY = {"bert", "roberta", "xlm-roberta", "distilbert", "albert", "electra", "deberta", "deberta-v2",
                "camembert", "mpnet", "modernbert", "ernie", "xlm", "flaubert", "funnel", "megatron-bert",
                "nomic_bert", "jina_bert", "squeezebert", "mobilebert", "convbert", "layoutlm", "roformer"}
ENCODER_HEADS = ("ForMaskedLM", "ForSequenceClassification", "ForTokenClassification", "ForQuestionAnswering",
                 "ForMultipleChoice", "ForNextSentencePrediction", "ForPreTraining")
FORMATS = {"float32": 4.0, "bfloat16": 2.0, "float16": 2.0, "int8": 1.0 + 2.0 / 128, "int4": 0.5 + 2.0 / 32}
# int8: one byte a weight plus a 16-bit scale per output row of ~128 (what engine.quantize stores, about);
# int4: half a byte plus a 16-bit scale and zero per group of 32.


def read(folder: str | Path) -> dict:
    """``config.json`` as a dict (the text part of a multimodal config), or a one-line refusal."""
    path = Path(folder) / "config.json"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except PermissionError:
        raise ModelSourceError(f"{path} cannot be read: permission denied") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ModelSourceError(f"{path} cannot be read: {getattr(exc, 'strerror', None) or exc}") from None
    except ValueError as exc:
        raise ModelSourceError(f"{path} is not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ModelSourceError(f"{path} is not a config: it holds no JSON object")
    text = data.get("text_config")
    return {**data, **text} if isinstance(text, dict) else data


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
    """A config's sizes, checked: enough for the cache and weight arithmetic."""

    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    intermediate: int
    vocab: int
    context: int | None
    context_key: str
    tied: bool
    latent: tuple[int, int, int] | None      # MLA: (latent width, rope key width, full MHA width per position)
    sliding: list[int | None]               # per layer: positions a sliding layer holds (None: every one)

    def parameters(self) -> int:
        """Parameters, estimated from the sizes (attention projections, a gated MLP, embeddings, norms): what a
        memory check needs before the model is built, not the exact count a loaded model reports."""
        attention_width = self.heads * self.head_dim
        kv_width = self.kv_heads * self.head_dim
        attention = self.hidden * attention_width * 2 + self.hidden * kv_width * 2
        mlp = 3 * self.hidden * self.intermediate
        per_layer = attention + mlp + 2 * self.hidden
        embeddings = self.vocab * self.hidden * (1 if self.tied else 2)
        return self.layers * per_layer + embeddings + self.hidden

    def weight_bytes(self, fmt: str) -> int:
        return int(self.parameters() * FORMATS[fmt])


def sizes(cfg: dict) -> Sizes:
    """The config's sizes, each refused in one line naming its field when absent, absurd or zero."""
    layers = number(cfg, ("num_hidden_layers", "n_layer", "n_layers", "num_layers"), 1, MAX_LAYERS)
    hidden = number(cfg, ("hidden_size", "n_embd", "d_model"), 1, MAX_HIDDEN)
    # A state-space model (Mamba) declares no heads: it is sized without them, and refused later for keeping
    # no KV cache, in those words.
    heads = number(cfg, ("num_attention_heads", "n_head", "n_heads", "num_heads"), 1, MAX_HEADS, required=False) or 1
    kv_heads = number(cfg, ("num_key_value_heads", "num_kv_heads", "n_head_kv"), 1, heads, required=False)
    if kv_heads is None:
        kv_heads = 1 if cfg.get("multi_query") else heads
    head_dim = number(cfg, ("head_dim",), 1, MAX_HEAD_DIM, required=False) or max(hidden // heads, 1)
    vocab = number(cfg, ("vocab_size", "padded_vocab_size"), 1, MAX_VOCAB)
    intermediate = number(cfg, ("intermediate_size", "ffn_hidden_size", "n_inner"), 1, 64 * MAX_HIDDEN,
                          required=False) or 4 * hidden
    context, key = declared_context(cfg)
    latent = None
    rank, rope = cfg.get("kv_lora_rank"), cfg.get("qk_rope_head_dim")
    if isinstance(rank, int) and isinstance(rope, int) and rank > 0 and rope > 0:
        nope, value = int(cfg.get("qk_nope_head_dim") or 0), int(cfg.get("v_head_dim") or 0)
        latent = (rank, rope, heads * (nope + rope + value))
    window = cfg.get("sliding_window")
    types = cfg.get("layer_types")
    sliding: list[int | None] = [None] * layers
    slides = isinstance(window, int) and window > 1 and (context is None or window - 1 < context)   # else never
    if slides and cfg.get("use_sliding_window", True) is not False:
        if isinstance(types, list) and len(types) == layers:
            sliding = [window - 1 if t == "sliding_attention" else None for t in types]
        elif types is None:
            sliding = [window - 1] * layers           # Mistral-style: every layer slides
    return Sizes(layers, heads, kv_heads, head_dim, hidden, intermediate, vocab, context, key,
                 bool(cfg.get("tie_word_embeddings", False)), latent, sliding)


def kv_layers(s: Sizes, dtype_bytes: int) -> list[KVLayer]:
    """What each layer would cache per position, from the config (computed; a loaded model's facts come from
    the cache it really builds instead)."""
    if s.latent is not None:
        rank, rope, mha = s.latent
        return [KVLayer("latent", kv_heads=1, k_dim=rank, v_dim=rope, dtype_bytes=dtype_bytes, mha_width=mha)
                for _ in range(s.layers)]
    return [KVLayer("sliding" if held else "full", kv_heads=s.kv_heads, k_dim=s.head_dim, v_dim=s.head_dim,
                    dtype_bytes=dtype_bytes, capacity=held) for held in s.sliding]


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


def stored_parameters(folder: str | Path) -> int | None:
    """Parameters the folder's safetensors files hold, read from their headers alone (no tensor is read); None
    when it has none, or a header is not one."""
    total, files = 0, sorted(Path(folder).glob("*.safetensors"))
    if not files:
        return None
    for path in files:
        try:
            with path.open("rb") as f:
                size = int.from_bytes(f.read(8), "little")
                if not 0 < size <= 100 << 20:
                    return None
                header = json.loads(f.read(size))
        except (OSError, ValueError):
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
