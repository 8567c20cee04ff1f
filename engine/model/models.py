"""From what the user typed (``embedded``, a folder, a ``.gguf`` file, a hub id) to a loaded model.

Everything a user can get wrong here ends as a :class:`ModelSourceError` whose message names the problem and
the fix. Remote code stays off unless the caller opts in for this load.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging as std_logging
import os
import re
import shutil
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.facts import config_facts, kvformula
from engine.facts.errors import ModelSourceError
from engine.facts.events import LoadProgress, ModelFacts, ModelLoaded
from engine.facts.params import DEVICES, DTYPES, FLOATS
from engine.model import embedded, gguf, gguf_header, kvcache
from engine.model.hub import hub_offline
from engine.model.memory import release_freed_heap
from engine.store.paths import offloaded_models_dir

DECODER_LAYER = kvcache.DECODER_LAYER
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
SUPPORTED = ("KVScope shows decoder-only transformers whose layers keep an attention KV cache (Llama, Qwen, Mistral, "
             "Gemma, Phi, GPT-2, Falcon and the like; hybrids with some state-space layers load too)")
Progress = Callable[[LoadProgress], None]
CALIBRATE_HIDDEN = 2048         # the widest layer the dtype calibration builds (16 MiB a matrix in float32)


@dataclass(frozen=True)
class ModelSource:
    kind: str       # "embedded" | "folder" | "gguf" | "hub"
    location: str   # path or hub id

    @property
    def display(self) -> str:
        if self.kind == "embedded":
            return f"{embedded.DISPLAY_NAME} (embedded)"
        return Path(self.location).name if self.kind != "hub" else self.location


def resolve_source(spec: str) -> ModelSource:
    """Decide what ``spec`` names without loading anything."""
    spec = (spec or "").strip()
    if spec in ("", embedded.SPEC):
        return ModelSource("embedded", str(embedded.embedded_gguf()))
    path = Path(spec).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelSourceError(f"{path} has no config.json: pick a Hugging Face model folder or a .gguf file")
        return ModelSource("folder", str(path))
    if path.is_file():
        if path.suffix.lower() == ".gguf" or _starts_as_gguf(path):     # Ollama's blobs are named by their hash
            return ModelSource("gguf", str(path))
        raise ModelSourceError(f"{path} is a file but not a .gguf: pick the folder that holds config.json")
    looks_like_path = spec.startswith((".", "/", "~")) or "\\" in spec or spec.lower().endswith(".gguf")
    if HUB_ID.match(spec) and not looks_like_path:
        return ModelSource("hub", spec)
    raise ModelSourceError(f"No such file or folder: {spec}")


def _starts_as_gguf(path: Path) -> bool:
    try:
        with path.open("rb") as f:
            return f.read(len(gguf_header.MAGIC)) == gguf_header.MAGIC
    except OSError:
        return False


@dataclass
class LoadedModel:
    """A model ready for a session: the module, its tokenizer, where inputs go, and its facts."""

    model: Any
    tokenizer: Any
    device: Any       # torch.device that receives input ids (the embedding's device)
    facts: ModelFacts
    load_ms: float
    converted: bool = False
    warnings: list[str] = field(default_factory=list)
    dtype_reason: str = ""
    offload_folder: Path | None = None     # where accelerate wrote the layers that fit nowhere (None: none)
    converted_from: Path | None = None     # the GGUF whose converted copy in the cache this is (None: a folder)
    kernel: Any = None                     # a kernels.KernelChoice on a CPU: the products' kernel and timings

    def loaded_event(self) -> ModelLoaded:
        return ModelLoaded(model=self.facts, load_ms=self.load_ms, converted=self.converted,
                           warnings=list(self.warnings), dtype_reason=self.dtype_reason)


def pick_device(requested: str = "auto") -> Any:
    import torch

    requested = (requested or "auto").strip().lower()
    if requested == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    try:
        device = torch.device(requested)
    except RuntimeError:
        raise ModelSourceError(f"Unknown device {requested!r}: use one of {', '.join(DEVICES)}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ModelSourceError("CUDA was asked for but no CUDA GPU is available here: pick cpu or auto")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise ModelSourceError("MPS was asked for but is not available here: pick cpu or auto")
    if device.type not in ("cpu", "cuda", "mps"):
        raise ModelSourceError(f"Unsupported device {requested!r}: use one of {', '.join(DEVICES)}")
    return device


def pick_dtype(requested: str, device: Any, config: Any = None, recalibrate: bool = False,
               measuring: Callable[[], None] = lambda: None) -> tuple[Any, str | None, str]:
    """``(float dtype, weight format or None, why)``. Explicit float choices stay explicit. ``auto`` takes the
    float dtype this machine ran a layer's matmuls fastest in, and ``int8`` / ``int4`` weights the activations'
    float their own quantized kernel ran fastest with (``engine.model.calibrate``), with the measured reason."""
    import torch

    requested = (requested or "auto").strip().lower()
    if requested not in DTYPES:
        raise ModelSourceError(f"Unknown dtype {requested!r}: use one of {', '.join(DTYPES)}")
    if requested in FLOATS:
        return getattr(torch, requested), None, "chosen"
    from engine.model.calibrate import calibrate

    text = config.get_text_config() if config is not None and hasattr(config, "get_text_config") else config
    hidden = int(getattr(text, "hidden_size", 1024) or 1024)
    intermediate = int(getattr(text, "intermediate_size", None) or 4 * hidden)
    # The matmuls timed are a sample at most this large (a config's 40,000-wide layer would fill the memory):
    # the dtypes' order is the same at the model's sizes and at a sample's.
    hidden, intermediate = min(hidden, CALIBRATE_HIDDEN), min(intermediate, 4 * CALIBRATE_HIDDEN)
    layers = int(getattr(text, "num_hidden_layers", 0) or 0) or None     # a small model decodes from the cache
    fmt = None if requested == "auto" else requested
    calibration = calibrate(device, hidden, intermediate, recalibrate, measuring, weights=fmt or "", layers=layers)
    return getattr(torch, calibration.best), fmt, calibration.reason()


@dataclass(frozen=True)
class Offload:
    """Where weights go when they need not all be in memory. ``memory_budget`` (bytes, 0: none): at most that much
    of the weights on each memory tier (the CPU; on a GPU machine the GPU and the CPU), the rest offloaded to disk
    by accelerate and read back at every forward pass. ``disk_layers``: exactly the last that many decoder layers
    on disk, everything else on the device (what the offloading lesson compares). ``folder``: where offloaded
    weights are written (a folder of KVScope's own inside it; default: KVScope's cache)."""

    memory_budget: int = 0
    disk_layers: int = 0
    folder: str | None = None


NO_OFFLOAD = Offload()


def load(spec: str = embedded.SPEC, device: str = "auto", dtype: str = "auto", *,
         trust_remote_code: bool = False, progress: Progress | None = None,
         cancelled: Callable[[], bool] | None = None, offload: Offload = NO_OFFLOAD) -> LoadedModel:
    """``spec`` loaded on ``device`` as ``dtype``; with ``offload``, part of it on disk (see ``Offload``)."""
    report = progress or (lambda _p: None)
    started = time.perf_counter()
    source = resolve_source(spec)
    report(LoadProgress("resolve", f"Loading {source.display}", None))
    import torch  # noqa: F401  (after resolving: a bad path fails before the slow import)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # we report progress ourselves, in the window or on one CLI line

    torch_device = pick_device(device)
    converted = False
    folder = source.location
    gguf_path = Path(source.location) if source.kind in ("embedded", "gguf") else None
    if gguf_path is not None:
        converted = not gguf.is_converted(gguf_path)
        folder = str(gguf.ensure_converted(gguf_path, report, cancelled))
    elif source.kind == "hub":
        folder = _hub_snapshot(source.location, report)
    if cancelled is not None and cancelled():
        raise ModelSourceError("Loading cancelled")
    sizes = _checked_sizes(folder)                     # before anything is built or allocated
    fits = offload.memory_budget or offload.disk_layers
    if not fits:
        _check_memory(folder, sizes, "bfloat16", torch_device)      # even the smallest float must fit
    config = _read_config(folder, trust_remote_code)
    _refuse_without_weights(folder)
    torch_dtype, weights, reason = pick_dtype(dtype, torch_device, config, measuring=lambda: report(LoadProgress(
        "calibrate", "Measuring which float dtype is fastest on this machine (once)", None)))
    if not fits:
        _check_memory(folder, sizes, weights or str(torch_dtype).removeprefix("torch."), torch_device)
    if weights is not None and (offload.memory_budget or offload.disk_layers):
        raise ModelSourceError(f"{weights} weights and a memory budget cannot go together: the offloaded layers are "
                               "stored as they load. Pick a float dtype to offload, or no budget")
    if weights is not None:
        from engine.model.quantize import supported

        refusal = supported(weights, torch_device)
        if refusal is not None:
            raise ModelSourceError(refusal)
    report(LoadProgress("load", f"Loading weights to {torch_device} as {str(torch_dtype).removeprefix('torch.')}",
                        None))
    warnings = pickle_warnings(Path(folder))
    placement = _placement(torch_device, offload, folder, config, trust_remote_code)
    try:
        model, tokenizer = _load_folder(folder, config, torch_device, torch_dtype, trust_remote_code, placement)
    except ModelSourceError:
        if gguf_path is None or gguf.check_thoroughly(gguf_path, report) is None:
            raise
        folder = str(gguf.ensure_converted(gguf_path, report, cancelled))       # the damaged copy, again
        converted = True
        model, tokenizer = _load_folder(folder, config, torch_device, torch_dtype, trust_remote_code, placement)
    _check_placement(model, offload.memory_budget)
    if "offload_folder" not in placement:              # before quantizing and the kernels: they take the fused
        from engine.model.attention import use_grouped_sdpa
        from engine.model.fused import fuse

        fusion = fuse(model).words()
        reason = f"{reason}; {fusion}" if reason and fusion else reason or fusion
        use_grouped_sdpa(model)
    weights_text = str(torch_dtype).removeprefix("torch.")
    if weights is not None:
        from engine.model.quantize import quantize

        report(LoadProgress("quantize", f"Quantizing the weights to {weights}", None))
        weights_text = quantize(model, weights, torch_dtype).describe(weights_text)
    input_device = model.get_input_embeddings().weight.device
    name = embedded.DISPLAY_NAME if source.kind == "embedded" else source.display
    facts = model_facts(model, name=name, source=spec or embedded.SPEC, device=input_device, weights=weights_text,
                        weight_format=weights or str(torch_dtype).removeprefix("torch."))
    kernel = None
    if torch_device.type == "cpu" and "offload_folder" not in placement:   # after the facts: they count weights
        from engine.model import kernels
        from engine.model.hardware import device_name

        kernel = kernels.choose(model, device_name(torch_device), measuring=lambda: report(LoadProgress(
            "kernels", "Measuring which kernel multiplies fastest on this CPU (kept for later launches)", None)))
        reason = f"{reason}; {kernel.words()}" if reason else kernel.words()
    from engine.store import machine_cache

    warnings += machine_cache.refused                 # a record of this machine refused: measured again, said
    machine_cache.refused.clear()
    release_freed_heap()
    load_ms = (time.perf_counter() - started) * 1000.0
    report(LoadProgress("done", f"Loaded {name} on {facts.device} in {load_ms / 1000:.1f} s", 1.0))
    return LoadedModel(model=model, tokenizer=tokenizer, device=input_device, facts=facts, load_ms=load_ms,
                       converted=converted, warnings=warnings, dtype_reason=reason, converted_from=gguf_path,
                       offload_folder=Path(placement["offload_folder"]) if "offload_folder" in placement else None,
                       kernel=kernel)


def _checked_sizes(folder: str) -> config_facts.Sizes:
    """The config's sizes, refused in one line naming a field that is absent, zero or absurd, or the whole config
    when it is not a decoder or does not belong to the weights beside it."""
    cfg = config_facts.read(folder)
    why = config_facts.refusal(cfg)
    if why is not None:
        raise ModelSourceError(f"{Path(folder).name}: {why}. {SUPPORTED}")
    sizes = config_facts.sizes(cfg)
    for path in Path(folder).iterdir():
        if path.suffix in (".safetensors", ".bin", ".json") and path.is_file() and not os.access(path, os.R_OK):
            raise ModelSourceError(f"{path} cannot be read: permission denied (it is there, but this user may not "
                                   "read it)")
    stored = config_facts.stored_parameters(folder)
    if stored and sizes.parameters() > 10 * stored:
        raise ModelSourceError(
            f"{Path(folder).name}'s config.json describes a model of about {sizes.parameters() / 1e6:,.1f}M "
            f"parameters ({sizes.layers:,} layers of {sizes.hidden:,}), but its weights hold {stored / 1e6:,.1f}M: "
            "the config does not belong to these weights (edited, or from another model)")
    return sizes


def _refuse_without_weights(folder: str) -> None:
    """A folder with a config but no weights says what its config alone gives (after the config was read, so a
    model that needs its own code is refused for that first)."""
    if config_facts.has_weights(folder):
        return
    cfg = config_facts.read(folder)
    sizes = config_facts.sizes(cfg)
    facts = config_facts.model_facts(folder, cfg)
    context = f"{facts.max_context:,} positions" if facts.context_declared else "no declared maximum"
    raise ModelSourceError(
        f"{folder} has a config.json but no weights (*.safetensors or *.bin), so nothing can run. From its config "
        f"alone (computed, 16-bit): {kvformula.bytes_per_token(facts):,} B of KV cache per position, "
        f"{kvformula.format_bytes(kvformula.full_context_kv_bytes(facts))} at its context ({context}), weights "
        f"about {kvformula.format_bytes(sizes.weight_bytes('bfloat16'))}; `python -m engine costmodel --model "
        f"{folder}` prints the whole table")


def _check_memory(folder: str, sizes: config_facts.Sizes, fmt: str, device: Any) -> None:
    """Weights larger than the memory the device has free are refused before any is allocated (the larger of the
    config's estimate and what the files hold: a mixture of experts holds more than a dense estimate)."""
    from engine.model.memory import available_bytes

    per_weight = config_facts.FORMATS.get(fmt, 4.0)
    parameters = max(sizes.parameters(), config_facts.stored_parameters(folder) or 0)
    need = int(parameters * per_weight)
    free = available_bytes(str(device))
    if free is not None and need > free:
        raise ModelSourceError(
            f"{Path(folder).name} needs about {kvformula.format_bytes(need)} for its weights in {fmt} (computed: "
            f"{_count(parameters)} parameters) and {device} has "
            f"{kvformula.format_bytes(free)} free: pick a smaller format (int8, int4), a memory budget (offloads the "
            "rest to disk), or a smaller model")


def pickle_warnings(folder: Path) -> list[str]:
    """Pickle checkpoints can run code when unpickled; transformers loads them with torch's
    ``weights_only=True`` (tensors only, anything else refused), and KVScope never turns that off."""
    if any(folder.glob("*.safetensors")) or not any(folder.glob("*.bin")):
        return []
    return [f"{folder.name} stores its weights as a pickle (.bin). A pickle can run code when loaded, so it was "
            "loaded with weights_only=True, which accepts tensors only. Prefer models in .safetensors."]


def _read_config(folder: str, trust_remote_code: bool) -> Any:
    from huggingface_hub.errors import StrictDataclassError
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code)
    except ValueError as exc:
        if "Unrecognized model" in str(exc) or "does not recognize this architecture" in str(exc):
            raise ModelSourceError(_unsupported(folder)) from None
        if "trust_remote_code" in str(exc):
            raise ModelSourceError(
                f"{folder} needs to run code shipped with the model (trust_remote_code). KVScope does not run "
                "a model's own code unless you allow it for this model.") from None
        raise ModelSourceError(f"Cannot read {folder}/config.json: {_first_line(exc)}") from None
    except OSError as exc:
        raise ModelSourceError(f"Cannot read {folder}/config.json: {_first_line(exc)}") from None
    except RecursionError:
        raise ModelSourceError(f"Cannot read {folder}/config.json: it is nested too deeply to be a config") from None
    except (StrictDataclassError, TypeError, AttributeError, KeyError) as exc:
        # transformers' typed configs check each field (huggingface_hub's strict dataclasses), and a dtype name
        # that is none of torch's is looked up on torch itself: a value of the wrong type, one line
        raise ModelSourceError(f"{folder}/config.json holds a value transformers refuses: {_first_line(exc)}"
                               ) from None
    if getattr(config, "is_encoder_decoder", False):
        raise ModelSourceError(f"{Path(folder).name} is an encoder-decoder model ({type(config).__name__}): "
                               f"{SUPPORTED}")
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and not trust_remote_code:
        raise ModelSourceError(_unsupported(folder, type(config).__name__))
    return config


def _unsupported(folder: str, config_class: str = "") -> str:
    """A model type this transformers cannot run as a text generator: not a broken folder, and said so."""
    import transformers

    kind = f" ({config_class})" if config_class else ""
    return (f"{Path(folder).name}{kind} is not supported by transformers {transformers.__version__} as a text "
            "generator (AutoModelForCausalLM has no class for it): the folder may be fine, but this model type "
            f"cannot run here. {SUPPORTED}")


def _offload_folder(folder: str, root: str | None = None, fresh: bool = False) -> Path:
    """The model's offload folder; ``fresh``: emptied first (another split's files must not be read back). Under a
    user's ``root`` it is a folder of KVScope's own, so emptying it never touches the user's files."""
    offload = offload_dir(folder, root)
    if fresh and offload.is_dir():
        shutil.rmtree(offload)
    try:
        offload.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ModelSourceError(f"Cannot use {offload} for offloaded weights: {exc.strerror or exc}") from None
    return offload


def remove_offloaded(loaded: LoadedModel) -> None:
    """Delete a model's offloaded weights once nothing reads them (a lesson's split after its run)."""
    if loaded.offload_folder is not None:
        shutil.rmtree(loaded.offload_folder, ignore_errors=True)


def disk_layer_map(config: Any, disk_layers: int, device: Any, trust_remote_code: bool = False) -> dict[str, str]:
    """A device map with the last ``disk_layers`` decoder layers on disk and every other module on ``device``,
    read from the model's structure built without weights."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    with init_empty_weights():
        skeleton = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    layers = [n for n, _ in skeleton.named_modules() if DECODER_LAYER.fullmatch(n)]
    if not 0 <= disk_layers <= len(layers):
        raise ModelSourceError(f"{disk_layers} layers on disk: the model has {len(layers)} decoder layers")
    on_disk = set(layers[len(layers) - disk_layers:])
    here = (device.index or 0) if device.type == "cuda" else str(device)
    mapping: dict[str, Any] = {}
    for name, _ in [*skeleton.named_parameters(), *skeleton.named_buffers()]:
        key = next((layer for layer in layers if name.startswith(layer + ".")), name.rpartition(".")[0] or name)
        mapping[key] = "disk" if key in on_disk else here
    return mapping


def _check_placement(model: Any, budget: int) -> None:
    """A budget smaller than the embeddings (and the layer accelerate keeps room for) leaves nothing to run on:
    refused with the size it needs instead of a crash at the first forward pass."""
    placed = getattr(model, "hf_device_map", None) or {}
    embeddings = next((name for name, module in model.named_modules()
                       if module is model.get_input_embeddings()), "")
    where = next((placed[k] for k in sorted(placed, key=len, reverse=True)
                  if k == "" or embeddings == k or embeddings.startswith(k + ".")), None)
    if where in ("disk", "meta"):
        weights = model.get_input_embeddings().weight
        need = weights.numel() * weights.element_size()
        raise ModelSourceError(f"A memory budget of {kvformula.format_bytes(budget)} is smaller than the model's "
                               f"embeddings ({kvformula.format_bytes(need)}) and one layer beside them: nothing "
                               "could run. Raise it, or set no budget")


def _placement(device: Any, offload: Offload, folder: str, config: Any, trust_remote_code: bool) -> dict[str, Any]:
    """accelerate's arguments for where the weights go: exactly the last layers on disk; or with a budget, at most
    that much per memory tier and an offload folder for the rest (in KVScope's cache, one per model); on CUDA
    without either, the whole GPU first."""
    if offload.disk_layers:
        return {"device_map": disk_layer_map(config, offload.disk_layers, device, trust_remote_code),
                "offload_folder": str(_offload_folder(folder, offload.folder, fresh=True)), "offload_state_dict": True}
    budget = offload.memory_budget
    if budget > 0:
        where = _offload_folder(folder, offload.folder)
        tiers = {"cpu": budget} if device.type != "cuda" else {device.index or 0: budget, "cpu": budget}
        return {"device_map": "auto", "max_memory": tiers, "offload_folder": str(where), "offload_state_dict": True}
    if device.type == "cuda":
        # accelerate spreads a model larger than the GPU over GPU, CPU and disk; a small one stays whole.
        return {"device_map": "auto" if device.index is None else {"": str(device)}}
    return {}


def offload_dir(folder: str, root: str | None = None) -> Path:
    """Where the layers that fit nowhere are kept for a model (a folder per model path, in KVScope's cache or
    in ``root``)."""
    key = hashlib.sha1(str(Path(folder).resolve()).encode()).hexdigest()[:16]
    return Path(root).expanduser() / f"kvscope-offload-{key}" if root else offloaded_models_dir() / key


def _load_folder(folder: str, config: Any, device: Any, dtype: Any, trust_remote_code: bool,
                 placement: dict[str, Any]) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging

    kwargs: dict[str, Any] = {"dtype": dtype, "trust_remote_code": trust_remote_code, **placement}
    level, big_modeling = logging.get_verbosity(), std_logging.getLogger("accelerate.big_modeling")
    big_level = big_modeling.level
    if "offload_folder" in placement:      # "some parameters are on the meta device": the split says so itself
        logging.set_verbosity_error()
        big_modeling.setLevel(std_logging.ERROR)
    # Remote code the user allowed may name other repositories to fetch; nothing else reaches the network.
    hub = contextlib.nullcontext() if trust_remote_code else hub_offline()
    try:
        with hub:
            tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=trust_remote_code)
            model = AutoModelForCausalLM.from_pretrained(folder, config=config, **kwargs)
    except MemoryError:
        raise ModelSourceError(f"Not enough memory to load {folder} as {dtype}: try a smaller dtype or model") \
            from None
    except Exception as exc:  # noqa: BLE001  (a broken folder fails in many libraries' ways; say which file)
        if "weights_only" in str(exc) or "Weights only load failed" in str(exc):
            raise ModelSourceError(
                f"{Path(folder).name}'s pickle weights (.bin) were refused: they hold something besides tensors, code "
                "that would run as they load, so KVScope does not load them. Convert them where running that "
                "code is safe (a throwaway machine or container) into .safetensors (torch.load then "
                "safetensors.torch.save_file), or use a copy published as .safetensors") from None
        raise ModelSourceError(f"Cannot load the model in {folder}: {type(exc).__name__}: {_first_line(exc)}") \
            from None
    finally:
        logging.set_verbosity(level)
        big_modeling.setLevel(big_level)
    if "device_map" not in kwargs:
        model.to(device)
    model.eval()
    return model, tokenizer


def _hub_snapshot(repo_id: str, report: Progress) -> str:
    """A local folder for a hub id: the cache if it is there, else a download if the hub is reachable."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    patterns = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "tokenizer*"]
    try:
        return snapshot_download(repo_id, allow_patterns=patterns, local_files_only=True)
    except (LocalEntryNotFoundError, OSError, ValueError):
        pass
    if not _hub_reachable():
        raise ModelSourceError(
            f"{repo_id} is not in the local Hugging Face cache and the hub cannot be reached (offline). "
            "Download it once with a network connection, or pick a local folder or .gguf file.")
    report(LoadProgress("download", f"Downloading {repo_id} from the Hugging Face hub", None))
    try:
        return snapshot_download(repo_id, allow_patterns=patterns)
    except Exception as exc:  # noqa: BLE001  (hub errors are many; the user needs the first line)
        raise ModelSourceError(f"Could not download {repo_id}: {_first_line(exc)}") from None


def _hub_reachable(timeout_s: float = 3.0) -> bool:
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes"):
        return False
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    host = re.sub(r"^https?://", "", endpoint).split("/")[0]
    hostname, _, port = host.partition(":")
    try:
        with socket.create_connection((hostname, int(port or 443)), timeout=timeout_s):
            return True
    except OSError:
        return False


def model_facts(model: Any, *, name: str, source: str, device: Any, weights: str = "",
                weight_format: str = "") -> ModelFacts:
    """Sizes from the config; what the cache keeps per layer from the cache the model really builds."""
    from engine.model.quantize import decode_weight_bytes, parameter_count

    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    architecture = (config.architectures or [type(model).__name__])[0]
    own = kvcache.own_cache_class(model)
    if own:
        raise ModelSourceError(f"{architecture} keeps its cache in a class of its own ({own}: its linear-attention "
                               "layers' state sits beside the per-layer keys and values), which KVScope cannot "
                               "measure, reuse or batch yet. Hybrids that use transformers' own cache load "
                               "(Qwen3-Next, Jamba, Falcon-H1, Bailing)")
    try:
        kv_layers = kvcache.probe_layers(model)
    except Exception as exc:  # noqa: BLE001  (a model's own forward can fail in any way; say which)
        raise ModelSourceError(f"{architecture} could not run one token through its cache "
                               f"({type(exc).__name__}: {_first_line(exc)}): {SUPPORTED}") from None
    attention = [layer for layer in kv_layers if layer.kind in kvformula.HOLDS_POSITIONS]
    if not attention:
        raise ModelSourceError(f"{architecture} keeps no attention KV cache (it is a state-space model, whose "
                               f"state has a fixed size): {SUPPORTED}")
    layers = len(kv_layers)
    heads = int(getattr(config, "num_attention_heads", 0) or 0)
    declared = config.to_dict()
    context, _key = config_facts.declared_context(declared)
    declared_kv = next((declared[k] for k in ("num_key_value_heads", "num_kv_heads") if declared.get(k)), 0)
    if attention[0].kind == kvformula.LATENT:       # a query head's width, not the compressed cache's
        head_dim = int(getattr(config, "qk_nope_head_dim", 0) or 0) + int(getattr(config, "qk_rope_head_dim", 0) or 0)
    else:
        head_dim = attention[0].k_dim
    return ModelFacts(
        name=name, source=source, architecture=architecture,
        num_layers=layers, num_heads=heads or attention[0].kv_heads, head_dim=head_dim,
        hidden_size=int(config.hidden_size), vocab_size=int(config.vocab_size),
        max_context=context or config_facts.UNDECLARED_CONTEXT, context_declared=context is not None,
        config_kv_heads=declared_kv if attention[0].kind != kvformula.LATENT and declared_kv and
        attention[0].kv_heads > declared_kv else 0,
        dtype=str(model.dtype).removeprefix("torch."), dtype_bytes=int(model.dtype.itemsize),
        num_params=parameter_count(model), device=str(device),
        layer_devices=layer_devices(model, layers), kv_layers=kv_layers,
        tied_embeddings=bool(getattr(model.config, "tie_word_embeddings", False)),
        weights=weights or str(model.dtype).removeprefix("torch."), weight_bytes=decode_weight_bytes(model),
        weight_format=weight_format or str(model.dtype).removeprefix("torch."))


def layer_devices(model: Any, num_layers: int) -> list[str]:
    """Where each decoder layer lives. accelerate only records ``hf_device_map`` when it split the model
    (more than one device, or disk); its keys are module prefixes, so the longest matching prefix wins."""
    device_map = getattr(model, "hf_device_map", None)
    if not device_map:
        return [str(model.device)] * num_layers
    layer_names = [n for n, _ in model.named_modules() if DECODER_LAYER.fullmatch(n)][:num_layers]
    out = []
    for name in layer_names:
        matches = [k for k in device_map if k == "" or name == k or name.startswith(k + ".")]
        where = device_map[max(matches, key=len)] if matches else str(model.device)
        out.append(f"cuda:{where}" if isinstance(where, int) else str(where))
    return out


def _count(parameters: int) -> str:
    return f"{parameters / 1e9:,.2f}B" if parameters >= 1e9 else f"{parameters / 1e6:,.1f}M"


def _first_line(exc: BaseException, most: int = 300) -> str:
    """An exception's first line, cut to ``most`` characters (a value quoted back from a file may be megabytes)."""
    text = str(exc).strip().splitlines()
    line = text[0] if text else type(exc).__name__
    return line if len(line) <= most else line[:most] + "…"
