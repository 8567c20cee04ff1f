"""HQQ's quantizer, imported when a KV cache needs it instead of with transformers.

transformers' cache module imports HQQ's quantizer as it loads whenever the hqq package is installed (KVScope's
``kv`` extra installs it for the ``hqq4`` KV cache), and HQQ's module wraps three functions in ``torch.compile``
as it is imported, which imports inductor's compiler, paid at every launch for a cache only ``hqq4`` builds: a
fresh process importing KVScope's loader and loading the built-in model took 8.06 s with it and 6.40 s without
(medians of five, ``tests/benchmarks/bench_load.py --ab``, a 2-vCPU AMD EPYC VM).

:func:`defer` (run when ``engine.model`` is imported) has transformers' cache module load as if hqq were absent,
and gives the module its real availability check back once loaded; :func:`hand_over` imports the quantizer and
gives it to that module before an HQQ cache is built. If transformers' cache module was loaded before
``engine.model`` (a test that imports transformers first), it imported the quantizer itself and nothing changes.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from types import ModuleType
from typing import Any

CACHE_MODULE = "transformers.cache_utils"


class _WithoutHqq(importlib.abc.Loader):
    """transformers' own loader for its cache module, run while ``transformers.utils.is_hqq_available`` says no.
    Everything else (source, file name) is the wrapped loader's, so tracebacks and dynamo read the real file."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def __getattr__(self, name: str) -> Any:
        return getattr(self.loader, name)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        utils = sys.modules.get("transformers.utils")
        available = getattr(utils, "is_hqq_available", None)
        if available is None:                       # not the transformers this was written for: load as it is
            self.loader.exec_module(module)
            return
        utils.is_hqq_available = lambda *_a, **_k: False
        try:
            self.loader.exec_module(module)
        finally:
            utils.is_hqq_available = available
        module.is_hqq_available = available         # its HQQ layer asks again when built


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != CACHE_MODULE:
            return None
        for finder in sys.meta_path:                # the finder that would have found it (a bundle's, or paths)
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _WithoutHqq(spec.loader)
                return spec
        return None


def defer() -> None:
    """Load transformers' cache module without HQQ's quantizer (once per process; no-op if it is loaded)."""
    if CACHE_MODULE in sys.modules or any(isinstance(f, _Finder) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _Finder())


def undo() -> None:
    """Let transformers' cache module, if not yet loaded, import HQQ's quantizer itself again (the load
    benchmark's "as before" arm)."""
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _Finder)]


def hand_over() -> None:
    """Import HQQ's quantizer and give it to transformers' cache module, as its import would have."""
    from hqq.core.quantize import Quantizer
    from transformers import cache_utils

    cache_utils.HQQQuantizer = Quantizer
