"""Where KVScope keeps files. ``KVSCOPE_CACHE_DIR`` overrides the per-user cache (tests point it at a
temporary folder so a user's real cache is never touched)."""

from __future__ import annotations

import os
from pathlib import Path

APP_NAME = "kvscope"


def cache_dir() -> Path:
    override = os.environ.get("KVSCOPE_CACHE_DIR")
    if override:
        return Path(override)
    import platformdirs

    return Path(platformdirs.user_cache_dir(APP_NAME, appauthor=False))


def converted_models_dir() -> Path:
    return cache_dir() / "converted"
