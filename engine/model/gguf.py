"""GGUF to safetensors, once: loading a GGUF through transformers de-quantizes every tensor; loading the
converted folder takes about a second. transformers parses the file's metadata (a 49,152-token vocabulary for
SmolLM2: ~6.5 s in Python) once for the tokenizer, once for the config and once for the weights, and builds
llama.cpp's tensor-name table once per submodule (397 times, 23 ms each): a conversion reads the metadata once
and builds each table once (``_read_once``): 38.6 s -> 18.0 s for SmolLM2 on a 2-vCPU VM.

All transformers GGUF specifics live here (5.25: Llama goes through the legacy loader, which de-quantizes to
plain ``nn.Linear`` and refuses ``save_pretrained`` until the quantizer is detached). A conversion reaches no
network: transformers 5.25 fetches layer kernels from the Hugging Face Hub for the GGUF architectures its new
loader reads (Qwen3.5, LFM2), de-quantized or not, and imports them; the Hub is offline to the conversion
(``hub.hub_offline``). A conversion is only published after the saved copy reloads with bit-identical logits,
and it is published by renaming a finished temporary folder, so an interrupted conversion never leaves a
half-written model behind.

The cache heals itself. A conversion holds a lock on its temporary folder while it works, so a folder that a
killed process left (``.converting-*``, hundreds of MiB) is removed by the next launch, and one another process
is still writing is left alone. The published copy's marker records each file's size and SHA-256: every load
checks the sizes and the safetensors headers (milliseconds), a failed load or a broken model checks the
hashes, and a damaged copy is removed and converted again, with a line that says so.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

try:
    import fcntl
except ImportError:                 # Windows: abandoned folders are found by their age instead
    fcntl = None

from engine.facts.config_facts import safetensors_header
from engine.facts.errors import ModelSourceError
from engine.facts.events import LoadProgress
from engine.model import gguf_header
from engine.model.hub import hub_offline
from engine.store import sealed
from engine.store.paths import converted_models_dir, remove_tree

MARKER = "kvscope-converted.json"
RECORD = "KVScope's record of a converted model"
UNTRUSTED = "untrusted: "
FORMAT = 1
Progress = Callable[[LoadProgress], None]


def converted_folder(gguf_path: Path) -> Path:
    """The cache folder for this exact file (path, size and modification time)."""
    st = gguf_path.stat()
    key = hashlib.sha256(f"{FORMAT}|{gguf_path.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()
    return converted_models_dir() / f"{gguf_path.stem}-{key[:12]}"


def is_converted(gguf_path: Path) -> bool:
    return (converted_folder(gguf_path) / MARKER).is_file() and damage(converted_folder(gguf_path)) is None


def ensure_converted(gguf_path: Path, progress: Progress | None = None,
                     cancelled: Callable[[], bool] | None = None) -> Path:
    """The converted folder, converting first if needed (or again, if the copy in the cache is damaged).
    ``cancelled`` is polled between stages."""
    target = converted_folder(gguf_path)
    report = progress or (lambda _p: None)
    try:
        remove_abandoned(target.parent)
        if (target / MARKER).is_file():
            broken = damage(target)
            if broken is None:
                return target
            discard(target, broken, report)
        return _convert_into(gguf_path, target, report, cancelled or (lambda: False))
    except OSError as exc:
        raise ModelSourceError(_cache_problem(target.parent, exc)) from None
    except Exception as exc:        # safetensors' writer says a full disk as its own error, not an OSError
        if "No space left on device" in str(exc) or "StorageFull" in str(exc):
            raise ModelSourceError(_cache_problem(target.parent, OSError(errno.ENOSPC, "No space left on "
                                                                                       "device"))) from None
        raise


def _convert_into(gguf_path: Path, target: Path, report: Progress, stop: Callable[[], bool]) -> Path:
    gguf_header.read(gguf_path)          # every count within bounds before transformers parses it
    sealed.private_folder(target.parent)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".converting-") as tmp, _owned(Path(tmp)):
        staging = Path(tmp) / "model"
        _convert(gguf_path, staging, report, stop)
        sealed.write_sealed(staging / MARKER, RECORD, json.dumps({
            "format": FORMAT, "source": str(gguf_path.resolve()),
            "seconds": round(time.perf_counter() - started, 1), "files": _file_records(staging)}).encode())
        if target.exists() and not (target / MARKER).is_file():      # a copy without its record: never trusted
            os.replace(target, target.with_name(f"{target.name}.refused-{time.strftime('%Y%m%d-%H%M%S')}"))
        try:
            staging.rename(target)
        except OSError:
            if not (target / MARKER).is_file():  # another process finished first: theirs is as good
                raise
    report(LoadProgress("convert", f"Converted {gguf_path.name} in {time.perf_counter() - started:.1f} s", 1.0))
    return target


# --- the cache healing itself ----------------------------------------------------------------------------------
LOCK = "owner.lock"


@contextlib.contextmanager
def _owned(folder: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``folder`` while a conversion writes in it: a process that dies lets go of it."""
    handle = (folder / LOCK).open("w")
    try:
        if fcntl is not None:
            fcntl.flock(handle, fcntl.LOCK_EX)
        yield
    finally:
        handle.close()


def remove_abandoned(parent: Path) -> list[Path]:
    """Temporary conversion folders no live process holds (a conversion killed part-way): removed."""
    removed = []
    for folder in parent.glob(".converting-*") if parent.is_dir() else ():
        lock = folder / LOCK
        if fcntl is None:                                   # no locks here: only folders a day old
            if time.time() - folder.stat().st_mtime < 86_400:
                continue
        elif lock.is_file():
            with lock.open("a") as handle:
                try:
                    fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except OSError:
                    continue                                # another process is converting into it now
        remove_tree(folder)
        removed.append(folder)
    return removed


def _file_records(folder: Path) -> dict[str, dict]:
    """Each file's size and SHA-256, as the marker keeps them."""
    return {p.name: {"size": p.stat().st_size, "sha256": _sha256(p)} for p in sorted(folder.iterdir())
            if p.is_file() and p.name not in (MARKER, MARKER + sealed.SEAL)}


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def damage(folder: Path, thorough: bool = False) -> str | None:
    """What is wrong with a converted copy, in words, or None: every file the marker lists is there with its
    size and (for ``.safetensors``) a readable header; ``thorough`` compares the SHA-256 too. A record this
    user's KVScope did not seal is not trusted at all (the folder is then moved aside, not deleted)."""
    try:
        marker = json.loads(sealed.read_sealed(folder / MARKER, RECORD, aside=False))
    except sealed.Refused as exc:
        return f"{UNTRUSTED}{exc}"
    except (OSError, ValueError):
        return "its marker cannot be read"
    files = marker.get("files") if isinstance(marker, dict) else None
    if not isinstance(files, dict):
        return "its marker lists no files"
    for name, record in files.items():
        path = folder / name
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            return f"{name} is missing"
        if size != record.get("size"):
            return f"{name} is {size:,} bytes; {record.get('size', 0):,} were written"
        if name.endswith(".safetensors") and safetensors_header(path) is None:
            return f"{name}'s header is damaged"
        if thorough and _sha256(path) != record.get("sha256"):
            return f"{name}'s contents changed since it was written (its checksum differs)"
    extra = sorted({p.name for p in folder.iterdir() if p.is_file()} - set(files) - {MARKER, MARKER + sealed.SEAL})
    if extra:
        return f"{extra[0]} is not a file the conversion wrote"
    return None


def discard(target: Path, broken: str, report: Progress) -> None:
    """A damaged converted copy goes, and the line that says why goes to the user; one this user's KVScope did
    not write is moved aside instead (kept for inspection)."""
    if broken.startswith(UNTRUSTED):
        kept = target.with_name(f"{target.name}.refused-{time.strftime('%Y%m%d-%H%M%S')}")
        os.replace(target, kept)
        report(LoadProgress("convert", f"The converted copy {target} in KVScope's cache is not one this user's "
                                       f"KVScope wrote ({broken.removeprefix(UNTRUSTED)}); moved aside as {kept}: "
                                       "converting it again", 0.0))
        return
    report(LoadProgress("convert", f"The converted copy in KVScope's cache was damaged ({broken}): converting it "
                                   "again", 0.0))
    remove_tree(target)


def check_thoroughly(gguf_path: Path, progress: Progress | None = None) -> str | None:
    """After a failure (a load that broke, scores that were not numbers): the hashes of the converted copy. A
    damaged copy is removed (the next load converts it again); returns what was wrong, or None."""
    target = converted_folder(gguf_path)
    broken = damage(target, thorough=True) if (target / MARKER).is_file() else None
    if broken is not None:
        discard(target, broken, progress or (lambda _p: None))
    return broken


def _cache_problem(folder: Path, exc: OSError) -> str:
    """A full disk or a folder without permission, named as such (and where), with what would fix it."""
    where = getattr(exc, "filename", None) or folder
    if exc.errno == errno.ENOSPC:
        return (f"The disk holding KVScope's cache ({folder}) is full: the built-in model needs about 520 MiB there "
                "once. Free some space, or point KVSCOPE_CACHE_DIR at a disk with room")
    if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return (f"KVScope's cache cannot be written: permission denied for {where}. Make it writable, or point "
                "KVSCOPE_CACHE_DIR at a folder you own")
    return f"KVScope's cache ({folder}) cannot be used: {exc.strerror or exc}"


class _Cancelled(Exception):
    pass


def _convert(gguf_path: Path, out: Path, report: Progress, stop: Callable[[], bool]) -> None:
    with hub_offline():
        _convert_offline(gguf_path, out, report, stop)


def _convert_offline(gguf_path: Path, out: Path, report: Progress, stop: Callable[[], bool]) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    folder, name = str(gguf_path.parent), gguf_path.name

    def stage(fraction: float, message: str) -> None:
        if stop():
            raise _Cancelled
        report(LoadProgress("convert", message, fraction))

    try:
        with _read_once():
            stage(0.02, f"Reading the metadata and tokenizer from {name}")
            tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
            stage(0.40, f"De-quantizing {name} (once; later launches load the converted copy)")
            with _tensor_progress(lambda i, n: stage(0.40 + 0.35 * i / max(n, 1),
                                                     f"De-quantizing tensor {i} of {n}")):
                model = AutoModelForCausalLM.from_pretrained(
                    folder, gguf_file=name, dtype=torch.float32,
                    quantization_config=GgufConfig(dequantize=True))
        stage(0.78, "Saving safetensors")
        _detach_quantizer(model)
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)
        stage(0.90, "Checking the converted copy gives the same logits")
        _verify(model, out, tokenizer)
    except _Cancelled:
        raise ModelSourceError("Conversion cancelled; nothing was saved. It starts again on the next load.") from None
    except ModelSourceError:
        raise
    except Exception as exc:  # noqa: BLE001  (a damaged file fails anywhere in the reader; say so plainly)
        raise ModelSourceError(f"Could not convert {gguf_path.name}: {type(exc).__name__}: {_first_line(exc)} "
                               "(is the file complete and a supported architecture?)") from exc


def _detach_quantizer(model: object) -> None:
    import torch

    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    odd = [n for n, m in model.named_modules()
           if "Linear" in type(m).__name__ and type(m) is not torch.nn.Linear]
    if odd:
        raise ModelSourceError(f"GGUF weights stayed packed in {odd[:3]}; cannot save them as plain tensors")


def _verify(model: object, folder: Path, tokenizer: object) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    reloaded = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    ids = torch.tensor([tokenizer("The KV cache holds keys and values.")["input_ids"]])
    with torch.inference_mode():
        same = torch.equal(model(input_ids=ids).logits, reloaded(input_ids=ids).logits)
    if not same:
        raise ModelSourceError("The converted copy does not reproduce the GGUF model's logits; not saved")


@contextlib.contextmanager
def _read_once() -> Iterator[None]:
    """For one conversion, the ``gguf`` package's file reader and tensor-name table are made once per argument
    and shared by the tokenizer's, the config's and the weights' loaders (transformers imports both from
    ``gguf`` inside each call, so replacing them on the module reaches every call). Both are read-only once
    built. Restored after, so transformers' own loads (a test's reference load) read as they always did."""
    import gguf as package

    originals = {"GGUFReader": package.GGUFReader, "get_tensor_name_map": package.get_tensor_name_map}
    made: dict[tuple, object] = {}

    def once(name: str) -> Callable[..., object]:
        def make(*args: object, **kwargs: object) -> object:
            key = (name, *map(str, args), *sorted((k, str(v)) for k, v in kwargs.items()))
            if key not in made:
                made[key] = originals[name](*args, **kwargs)
            return made[key]
        return make

    for name in originals:
        setattr(package, name, once(name))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(package, name, original)
        made.clear()


@contextlib.contextmanager
def _tensor_progress(tick: Callable[[int, int], None]) -> Iterator[None]:
    """Report per-tensor progress by wrapping the ``tqdm`` the GGUF loader iterates with (transformers 5.x).
    If a future version renames it, conversion still works, only with coarser progress."""
    try:
        from transformers import modeling_gguf_pytorch_utils as gguf_utils
    except ImportError:
        yield
        return
    original = getattr(gguf_utils, "tqdm", None)
    if original is None:
        yield
        return

    def counting(iterable, *args, **kwargs):
        items = list(iterable)
        step = max(1, len(items) // 50)
        for i, item in enumerate(items):
            if i % step == 0:
                tick(i, len(items))
            yield item
        tick(len(items), len(items))

    gguf_utils.tqdm = counting
    try:
        yield
    finally:
        gguf_utils.tqdm = original


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def remove_all_conversions() -> int:
    """Delete every converted model (Help > Clear cache); returns the bytes freed."""
    return remove_tree(converted_models_dir())
