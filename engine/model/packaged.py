"""A CPU's decode step (and prefill: ``engine.model.compiled_prefill``) as an AOTInductor package: exported,
compiled with the weights folded into the graph as constants (inductor's freezing) and every product's kernel
chosen by timing it at its shape (``max_autotune``: inductor's C++ GEMM templates, with AMX / AVX-512
micro-kernels over weights packed once at compile time, against ATen's), and saved as the package's shared
library, which a later launch loads without unpacking anything.

Why: a decode step is a hundred or more one-row products, and the kernels torch calls for them from a graph
whose weights are inputs read the weights well below the memory bandwidth. Folded in, the products become
inductor's own kernels (SmolLM2-135M, 2-vCPU Sapphire Rapids, a step's 121 products plus the output projection
timed alone: bfloat16 16.2 -> 12.2 ms, int8 weights 12.6 -> 8.0, float32 21.8 -> 20.8; a whole bfloat16 step
19.3 -> 12.8 ms). Dynamo's saved graphs cannot hold frozen weights (its cache refuses freezing's output), so the
step is exported instead, with the cache's tensors as inputs it updates in place, and compiled by AOTInductor.

What that costs, and bounds it: the package holds its own copy of the weights (in memory beside the model's,
and on disk), and it is the model's own, named by a digest of the weights (``weights_digest``); models over
``MAX_BYTES`` of weights, or whose copy would take more than a quarter of the free memory, keep the graph whose
weights are inputs (``engine.model.compiled``).
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import os
import shutil
import tempfile
import weakref
import zipfile
from collections.abc import Callable
from pathlib import Path, PurePosixPath
from typing import Any

import torch
from torch import nn

from engine.model import kernels

# Weights a package may fold in: its shared library holds them packed (657 MB for 513 MB of float32 weights), and
# one over 2 GB is past what a shared library's 32-bit offsets reach.
MAX_BYTES = 1 << 30
OPTIONS = {"freezing": True, "max_autotune": True, "max_autotune_gemm_backends": "CPP,ATEN"}
# KVSCOPE_PACKAGE_AUTOTUNE=0: products through ATen's and oneDNN's kernels over weights frozen in, without timing
# inductor's GEMM templates against them (the tiny test model's decode package: 57 s to build with them, 22 s
# without): a first launch on a slow machine, and the tests but for the ones of the default.
AUTOTUNE_ENV = "KVSCOPE_PACKAGE_AUTOTUNE"
# Inductor writes every product's autotuning table to stderr (six lines a product, hundreds for SmolLM2): noise in
# a user's terminal. Not in options(), which name the graph: they change what is printed, not what is computed.
QUIET = {"autotune_num_choices_displayed": 0, "max_autotune_report_choices_stats": False}
_DIGESTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def options() -> dict[str, Any]:
    """Inductor's options for a package (part of its name: a package built otherwise is another file)."""
    if os.environ.get(AUTOTUNE_ENV, "1").strip().lower() in ("0", "off", "no", "false"):
        return {"freezing": True}
    return dict(OPTIONS)


def usable(model: nn.Module, widened: int = 0) -> str | None:
    """Why ``model``'s decode step cannot be packaged with its weights here, or None. ``widened``: bytes the
    package's copy holds beyond the model's own (a prefill package widens int8 weights to their float)."""
    from engine.model.memory import copy_refused

    if not hasattr(torch._inductor, "aoti_compile_and_package"):
        return "this torch has no AOTInductor packages"
    weights = _weight_bytes(model) + widened
    if weights > MAX_BYTES:
        return f"its weights ({weights / 2**30:.1f} GiB) are more than a package holds ({MAX_BYTES >> 30} GiB)"
    return copy_refused("the package's copy of its weights", weights)


def _tensors(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The model's weights that hold data (an offloaded layer's are placeholders on the meta device)."""
    return [(n, t) for n, t in [*model.named_parameters(), *model.named_buffers()] if t.device.type != "meta"]


def _weight_bytes(model: nn.Module) -> int:
    return sum(t.nbytes for _n, t in _tensors(model))


def weights_digest(model: nn.Module) -> str:
    """A digest of every weight's bytes: a package folds them in, so another model of the same shapes (another
    fine-tune, the same model quantized otherwise) must not read it. Kept per model object (weights do not change
    after a load). SHA-256, which CPUs compute in hardware: 0.35 s for 600 MB here, blake2b 0.75."""
    known = _DIGESTS.get(model)
    if known is None:
        h = hashlib.sha256()
        for name, t in _tensors(model):
            h.update(name.encode())
            h.update(memoryview(t.detach().contiguous().view(-1).view(torch.uint8).numpy()))
        known = _DIGESTS[model] = h.hexdigest()[:32]
    return known


def cache_tensors(cache: Any) -> list[torch.Tensor]:
    """A laid-out static cache's tensors, in the order a package takes them: each layer's, by attribute name."""
    return [getattr(layer, name) for layer, name in _slots(cache)]


_SLOTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _slots(cache: Any) -> list[tuple[Any, str]]:
    """Each tensor attribute of each layer, found once per cache: found at every decode step it took 43 us, and
    reading the 90 attributes named (SmolLM2) takes 3.5. The attributes are read at every call, so a tensor a
    layer replaces is the one passed."""
    slots = _SLOTS.get(cache)
    if slots is None:
        slots = _SLOTS[cache] = [(layer, name) for layer in cache.layers for name, value in sorted(vars(layer).items())
                                 if isinstance(value, torch.Tensor)]
    return slots


class _Exported(nn.Module):
    """``step`` over ``model`` with the cache's tensors as inputs: the package must update the run's cache, not the
    one it was exported with, so the cache object lends its layers the tensors passed in for the call."""

    def __init__(self, step: Callable[..., torch.Tensor], model: nn.Module, cache: Any) -> None:
        super().__init__()
        self.model, self.step, self.cache = model, step, (cache,)     # a tuple: not a submodule

    def forward(self, token: torch.Tensor, position: torch.Tensor, *tensors: torch.Tensor) -> torch.Tensor:
        cache = self.cache[0]
        slots = _slots(cache)
        kept = cache_tensors(cache)
        try:
            for (layer, name), tensor in zip(slots, tensors):
                setattr(layer, name, tensor)
            return self.step(self.model, token, position, cache)
        finally:
            for (layer, name), tensor in zip(slots, kept):
                setattr(layer, name, tensor)


class _Prefill(nn.Module):
    """``step(model, ids)`` as a module export can trace, over a copy of ``model`` (see ``structure_copy``)."""

    def __init__(self, step: Callable[..., tuple[torch.Tensor, ...]], model: nn.Module) -> None:
        super().__init__()
        self.model, self.step = model, step

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.step(self.model, ids)


def build(step: Callable[..., torch.Tensor], args: tuple, path: Path, inductor_cache: Path) -> None:
    """Export ``step(model, token, position, cache)`` at ``args`` and compile it into the package ``path``
    (written atomically), leaving nothing of the build in ``inductor_cache``."""
    model, token, position, cache = args
    with kernels.exporting():
        exported = torch.export.export(_Exported(step, structure_copy(model), cache),
                                       (token, position, *cache_tensors(cache)), strict=False)
    _compile(exported, path, inductor_cache)


def build_prefill(step: Callable[..., tuple[torch.Tensor, ...]], model: nn.Module, ids: torch.Tensor, longest: int,
                  path: Path, inductor_cache: Path) -> None:
    """Export ``step(model, ids)`` for any prompt of 2 to ``longest`` tokens (one graph whatever the length: the
    products' kernels are chosen for a symbolic number of rows) and compile it into the package ``path``."""
    tokens = torch.export.Dim("tokens", min=2, max=longest)
    with kernels.exporting():
        exported = torch.export.export(_Prefill(step, structure_copy(model)), (ids,),
                                       dynamic_shapes=({1: tokens},), strict=False)
    _compile(exported, path, inductor_cache)


def _compile(exported: Any, path: Path, inductor_cache: Path) -> None:
    fd, partial = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".partial.pt2")
    os.close(fd)
    try:
        torch._inductor.aoti_compile_and_package(exported, package_path=partial,
                                                 inductor_configs={**options(), **QUIET})
        library_from(Path(partial), path)
        drop_build_files(Path(partial), inductor_cache)
    finally:
        Path(partial).unlink(missing_ok=True)


def library_from(package: Path, library: Path) -> None:
    """Write the shared library inside the AOTInductor package ``package`` (a zip) to ``library``, atomically.

    Why the library and not the package: loading a package unpacks it into a new temporary folder at every
    launch (the library holds the weights: 626 MiB for SmolLM2 in float32, read in 0.7-2.5 s on a 2-vCPU Zen 4
    VM, and left in /tmp by a process that dies), where the library kept unpacked loads in 0.3-0.4 s. A CPU
    package's library is all a run needs: its weights, kernels, metadata and call spec are inside it. Never
    written in place: a library a process has loaded is mapped from its file, so a new one replaces it."""
    with zipfile.ZipFile(package) as archive:
        found = [n for n in archive.namelist() if "/aotinductor/" in n and n.endswith(".so")]
        if len(found) != 1:
            raise ValueError(f"the package {package.name} holds {len(found)} shared libraries, not one")
        fd, partial = tempfile.mkstemp(dir=library.parent, prefix=library.name, suffix=".partial")
        try:
            with os.fdopen(fd, "wb") as out, archive.open(found[0]) as inside:
                shutil.copyfileobj(inside, out, 1 << 24)
            os.replace(partial, library)
        finally:
            Path(partial).unlink(missing_ok=True)


def structure_copy(module: nn.Module) -> nn.Module:
    """``module`` and its submodules copied, their weights shared (none is copied). Export traces by putting fake
    tensors in place of a module's weights for a while; on the live model, an eager decode running beside the
    build (the window's way) would meet them."""
    clone = copy.copy(module)
    clone._parameters = dict(module._parameters)
    clone._buffers = dict(module._buffers)
    clone._modules = {name: None if child is None else structure_copy(child) for name, child in module._modules.items()}
    return clone


def drop_build_files(package: Path, cache: Path) -> int:
    """Delete what AOTInductor built the package from and left in inductor's cache folder ``cache`` (its shared
    library holds a copy of the weights, so every build left 140 MB to 1.3 GB behind, and every launch's check of
    that folder read it all: 6 s of a float32 launch here). The files are those whose names start with the hash of
    a file the package holds (never one beside the package: the saved libraries); returns how many were
    deleted."""
    with zipfile.ZipFile(package) as archive:
        stems = {PurePosixPath(n).name.split(".")[0] for n in archive.namelist() if "/aotinductor/" in n}
    stems.discard("")
    dropped = 0
    for file in [f for f in cache.rglob("*") if f.is_file() and f.name.split(".")[0] in stems]:
        if file.parent == package.parent:
            continue                                  # never the saved packages themselves
        file.unlink(missing_ok=True)
        dropped += 1
        with contextlib.suppress(OSError):            # its folder, once empty
            file.parent.rmdir()
    return dropped


def load(path: Path) -> Callable[..., Any]:
    """What the package's library at ``path`` (``library_from``) computes, called with the exported inputs. The
    caller has checked the file (sealed by this user's KVScope, in a folder only this user can write: nobody else
    can swap it before it is read). Loaded as the package loader loads it once unpacked (without its probe of
    every instruction set, 9 s on 2 cores: the library was built here, for this CPU, as its name says)."""
    from torch.utils import _pytree as pytree

    runner = torch._C._aoti.AOTIModelContainerRunnerCpu(str(path), 1)
    outputs = pytree.treespec_loads(runner.get_call_spec()[1])

    def packaged(*tensors: torch.Tensor) -> Any:
        return pytree.tree_unflatten(runner.run(list(tensors)), outputs)

    return packaged


def decode_step(runner: Callable[..., Any]) -> Callable[..., torch.Tensor]:
    """A decode package as ``step(model, token, position, cache)``, over the run's own cache's tensors."""

    def packaged_step(_model: Any, token: torch.Tensor, position: torch.Tensor, cache: Any) -> torch.Tensor:
        return runner(token, position, *cache_tensors(cache))

    return packaged_step
