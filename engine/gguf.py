"""GGUF to safetensors, once: loading a GGUF through transformers de-quantizes every tensor (about 15 s for
135M parameters on 2 cores); loading the converted folder takes about a second.

All transformers GGUF specifics live here (5.24: Llama goes through the legacy loader, which de-quantizes to
plain ``nn.Linear`` and refuses ``save_pretrained`` until the quantizer is detached). A conversion is only
published after the saved copy reloads with bit-identical logits, and it is published by renaming a finished
temporary folder, so an interrupted conversion never leaves a half-written model behind.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from engine.errors import ModelSourceError
from engine.events import LoadProgress
from engine.paths import converted_models_dir, remove_tree

MARKER = "kvscope-converted.json"
FORMAT = 1
Progress = Callable[[LoadProgress], None]


def converted_folder(gguf_path: Path) -> Path:
    """The cache folder for this exact file (path, size and modification time)."""
    st = gguf_path.stat()
    key = hashlib.sha256(f"{FORMAT}|{gguf_path.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()
    return converted_models_dir() / f"{gguf_path.stem}-{key[:12]}"


def is_converted(gguf_path: Path) -> bool:
    return (converted_folder(gguf_path) / MARKER).is_file()


def ensure_converted(gguf_path: Path, progress: Progress | None = None,
                     cancelled: Callable[[], bool] | None = None) -> Path:
    """The converted folder, converting first if needed. ``cancelled`` is polled between stages."""
    target = converted_folder(gguf_path)
    if (target / MARKER).is_file():
        return target
    report = progress or (lambda _p: None)
    stop = cancelled or (lambda: False)
    _check_gguf_header(gguf_path)
    target.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".converting-") as tmp:
        staging = Path(tmp) / "model"
        _convert(gguf_path, staging, report, stop)
        (staging / MARKER).write_text(json.dumps({
            "format": FORMAT, "source": str(gguf_path.resolve()),
            "seconds": round(time.perf_counter() - started, 1)}))
        try:
            staging.rename(target)
        except OSError:
            if not (target / MARKER).is_file():  # another process finished first: theirs is as good
                raise
    report(LoadProgress("convert", f"Converted {gguf_path.name} in {time.perf_counter() - started:.1f} s", 1.0))
    return target


def _check_gguf_header(path: Path) -> None:
    with path.open("rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ModelSourceError(f"{path} is not a GGUF file (it does not start with the GGUF magic bytes)")


class _Cancelled(Exception):
    pass


def _convert(gguf_path: Path, out: Path, report: Progress, stop: Callable[[], bool]) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    folder, name = str(gguf_path.parent), gguf_path.name

    def stage(fraction: float, message: str) -> None:
        if stop():
            raise _Cancelled
        report(LoadProgress("convert", message, fraction))

    try:
        stage(0.02, f"Reading the tokenizer from {name}")
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        stage(0.10, f"De-quantizing {name} (once; later launches load the converted copy)")
        with _tensor_progress(lambda i, n: stage(0.10 + 0.65 * i / max(n, 1),
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
