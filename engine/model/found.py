"""The models already on this computer, found without network: the Hugging Face cache (through
``huggingface_hub``'s own cache scan, which honours ``HF_HOME`` and ``HF_HUB_CACHE``), Ollama's store (its
manifests name each model's GGUF blob; ``OLLAMA_MODELS`` honoured), LM Studio's models folders, llama.cpp's cache
(``LLAMA_CACHE``) and folders the user adds.

Each is described from its own files, read within bounds: a Hugging Face folder from its ``config.json``
(``config_facts``), a GGUF from its header (``gguf_header``); nothing is loaded. What each would hold is computed:
KV bytes per position (``2 x layers x kv_heads x head_dim x bytes``) and weights at the chosen format, and whether
KVScope can run it here is said in one line when it cannot.
"""

from __future__ import annotations

import functools
import json
import os
import stat
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from engine.facts import config_facts, kvformula
from engine.facts.bounded import read_bounded
from engine.facts.errors import EngineError
from engine.model import gguf_header

MAX_FOUND = 2000                       # models listed at most (a cache with more is cut, and said)
MAX_MANIFEST = 1 << 20                 # bytes of one Ollama manifest
# GGUF's general.file_type (llama.cpp's LLAMA_FTYPE): the quantization a file was made with.
FILE_TYPES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K", 11: "Q3_K_S",
              12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M", 16: "Q5_K_S", 17: "Q5_K_M", 18: "Q6_K",
              19: "IQ2_XXS", 20: "IQ2_XS", 21: "Q2_K_S", 22: "IQ3_XS", 23: "IQ3_XXS", 24: "IQ1_S", 25: "IQ4_NL",
              26: "IQ3_S", 27: "IQ3_M", 28: "IQ2_S", 29: "IQ2_M", 30: "IQ4_XS", 31: "IQ1_M", 32: "BF16",
              36: "TQ1_0", 37: "TQ2_0", 38: "MXFP4"}


@dataclass(frozen=True)
class FoundModel:
    """One model on disk, as a list shows it; ``load`` is what KVScope's Model box and ``--model`` take."""

    name: str
    where: str                        # "Hugging Face cache", "Ollama", "LM Studio", "llama.cpp cache", "added folder"
    load: str                         # a folder or a .gguf path
    format: str                       # "safetensors", "GGUF Q4_K_M", "pickle (.bin)"
    size_bytes: int                   # on disk
    parameters: int | None
    context: int | None
    kv_bytes_per_token: int | None    # computed, at the chosen format's width (16-bit for the integer formats)
    memory_bytes: int | None          # computed: the weights at the chosen format
    runs_here: bool
    why_not: str = ""

    def as_dict(self) -> dict:
        return asdict(self)


def find_models(fmt: str = "bfloat16", added: Iterable[str | os.PathLike] = ()) -> tuple[list[FoundModel], list[str]]:
    """Every model found, and notes on the places that could not be read (one line each)."""
    found: list[FoundModel] = []
    notes: list[str] = []
    for item in iter_models(fmt, added):
        (found if isinstance(item, FoundModel) else notes).append(item)
    return found, notes


def iter_models(fmt: str = "bfloat16", added: Iterable[str | os.PathLike] = ()) -> Iterator[FoundModel | str]:
    """Each model as it is found, and a note (a string, one line) for each place that could not be read: a list
    on screen fills as the disk is read, and a store of hundreds of models never holds the window."""
    count = 0
    for where, places in _places(added):
        for place in places:
            try:
                for model in place(fmt):
                    if count >= MAX_FOUND:
                        yield f"more than {MAX_FOUND:,} models: the rest are not listed"
                        return
                    yield model
                    count += 1
            except (OSError, ValueError, EngineError) as exc:
                yield f"{where}: {getattr(exc, 'strerror', None) or exc}"[:300]


def _places(added: Iterable[str | os.PathLike]) -> list[tuple[str, list]]:
    home = Path.home()
    ollama = Path(os.environ.get("OLLAMA_MODELS") or home / ".ollama" / "models")
    lm_studio = [home / ".lmstudio" / "models", home / ".cache" / "lm-studio" / "models"]
    llama_cache = Path(os.environ.get("LLAMA_CACHE") or home / ".cache" / "llama.cpp")
    return [
        ("the Hugging Face cache", [_hugging_face]),
        ("Ollama's store", [lambda fmt: _ollama(ollama, fmt)]),
        ("LM Studio's models", [lambda fmt, f=folder: _gguf_tree(f, "LM Studio", fmt) for folder in lm_studio]),
        ("llama.cpp's cache", [lambda fmt: _gguf_tree(llama_cache, "llama.cpp cache", fmt, depth=1)]),
        ("added folders", [lambda fmt, f=Path(a).expanduser(): _added(f, fmt) for a in added]),
    ]


def _hugging_face(fmt: str) -> Iterator[FoundModel]:
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    try:
        cache = scan_cache_dir(_hub_cache())
    except CacheNotFound:
        return
    for repo in sorted(cache.repos, key=lambda r: r.repo_id):
        if repo.repo_type != "model" or not repo.revisions:
            continue
        revision = max(repo.revisions, key=lambda r: r.last_modified)
        yield _folder_model(revision.snapshot_path, repo.repo_id, "Hugging Face cache", fmt, repo.size_on_disk)


def _hub_cache() -> str:
    """Where the Hugging Face cache is, by the environment as it is now (``huggingface_hub`` reads it once, when
    it is imported)."""
    from huggingface_hub import constants

    home = os.environ.get("HF_HOME")
    return (os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
            or (os.path.join(home, "hub") if home else constants.HF_HUB_CACHE))


def _folder_model(folder: Path, name: str, where: str, fmt: str, size: int | None = None) -> FoundModel:
    """A Hugging Face folder, from its config.json (never its weights)."""
    size = size if size is not None else sum(_size(p) for p in folder.iterdir() if p.is_file())
    weights = "safetensors" if any(folder.glob("*.safetensors")) else "pickle (.bin)" if any(folder.glob("*.bin")) \
        else "no weights"
    why: str | None = None
    try:
        cfg = config_facts.read(folder)
        why = config_facts.refusal(cfg)                    # what it is, said first: a size it lacks is no reason
        facts = config_facts.model_facts(folder, cfg, fmt)
    except (EngineError, ValueError) as exc:
        return FoundModel(name, where, str(folder), weights, size, None, None, None, None, False,
                          (why or str(exc))[:300])
    if why is None and weights == "no weights":
        why = "its folder holds no weights (*.safetensors or *.bin)"
    kv = sum(kvformula.bytes_per_position(layer) for layer in facts.kv_layers)
    return FoundModel(name, where, str(folder), weights, size, facts.num_params,
                      facts.max_context if facts.context_declared else None, kv, facts.weight_bytes,
                      why is None, why or "")


def gguf_model(path: Path, name: str, where: str, fmt: str) -> FoundModel:
    """A GGUF file, from its header (bounded; the tensors are never read)."""
    size = _size(path)
    try:
        header = gguf_header.read(path)
    except EngineError as exc:
        return FoundModel(name, where, str(path), "GGUF", size, None, None, None, None, False, str(exc)[:300])
    kind = header.value("general.file_type")
    quant = FILE_TYPES.get(kind, f"type {kind}") if isinstance(kind, int) else ""
    arch = header.architecture
    layers, heads = _whole(header.arch_value("block_count")), _whole(header.arch_value("attention.head_count"))
    kv_heads = _whole(header.arch_value("attention.head_count_kv")) or heads
    width = _whole(header.arch_value("embedding_length"))
    head_dim = _whole(header.arch_value("attention.key_length")) or (width // heads if width and heads else None)
    context = _whole(header.arch_value("context_length"))
    width_bytes = 4 if fmt == "float32" else 2
    kv = 2 * layers * kv_heads * head_dim * width_bytes if layers and kv_heads and head_dim else None
    memory = int(header.parameters * config_facts.FORMATS[fmt]) if header.parameters else None
    why = "" if arch in _gguf_architectures() else \
        f"transformers cannot convert a GGUF of architecture {arch or 'unnamed'} (it reads {_gguf_list()})"
    return FoundModel(name, where, str(path), f"GGUF {quant}".strip(), size, header.parameters or None, context, kv,
                      memory, not why, why)


def _ollama(root: Path, fmt: str) -> Iterator[FoundModel]:
    """Ollama's manifests (``manifests/HOST/NAMESPACE/MODEL/TAG``, JSON) name each model's GGUF layer by digest;
    the blob is ``blobs/sha256-HEX``."""
    manifests = root / "manifests"
    if not manifests.is_dir():
        return
    for manifest in sorted(p for p in manifests.rglob("*") if p.is_file()):
        parts = manifest.relative_to(manifests).parts
        if len(parts) < 2:
            continue
        library = len(parts) < 4 or parts[1] == "library"        # Ollama's own models are named without a namespace
        name = f"{parts[-2] if library else '/'.join(parts[1:-1])}:{parts[-1]}"
        try:
            layers = json.loads(read_bounded(manifest, MAX_MANIFEST)).get("layers", [])
        except (OSError, ValueError, AttributeError, RecursionError):
            continue
        digest = next((layer.get("digest") for layer in layers if isinstance(layer, dict)
                       and layer.get("mediaType") == "application/vnd.ollama.image.model"), None)
        if not isinstance(digest, str) or not digest.startswith("sha256:") or not digest[7:].isalnum():
            continue
        blob = root / "blobs" / f"sha256-{digest[7:]}"
        if blob.is_file():
            yield gguf_model(blob, name, "Ollama", fmt)


def _gguf_tree(root: Path, where: str, fmt: str, depth: int = 4) -> Iterator[FoundModel]:
    if not root.is_dir():
        return
    for path in sorted(_walk(root, depth)):
        if path.suffix.lower() == ".gguf" and not path.name.startswith("mmproj"):     # a vision projector: not a model
            yield gguf_model(path, str(path.relative_to(root).with_suffix("")), where, fmt)


def _added(folder: Path, fmt: str) -> Iterator[FoundModel]:
    if (folder / "config.json").is_file():
        yield _folder_model(folder, folder.name, "added folder", fmt)
        return
    yield from _gguf_tree(folder, "added folder", fmt)
    for config in sorted(_walk(folder, 3)):
        if config.name == "config.json" and config.parent != folder:
            yield _folder_model(config.parent, str(config.parent.relative_to(folder)), "added folder", fmt)


def _walk(root: Path, depth: int) -> Iterator[Path]:
    """Regular files under ``root`` to ``depth`` folders down, links not followed (a link loop never ends)."""
    try:
        entries = list(os.scandir(root))
    except OSError:
        return
    for entry in entries:
        if entry.is_dir(follow_symlinks=False) and depth > 0:
            yield from _walk(Path(entry.path), depth - 1)
        elif entry.is_file(follow_symlinks=True):
            yield Path(entry.path)


def _size(path: Path) -> int:
    try:
        info = path.stat()
    except OSError:
        return 0
    return info.st_size if stat.S_ISREG(info.st_mode) else 0


def _whole(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and 0 < value < 1 << 40 else None


@functools.cache
def _gguf_architectures() -> frozenset[str]:
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

    return frozenset(k for k in GGUF_CONFIG_MAPPING if k not in ("general", "tokenizer", "t5", "umt5", "mamba"))


def _gguf_list() -> str:
    return ", ".join(sorted(_gguf_architectures()))
