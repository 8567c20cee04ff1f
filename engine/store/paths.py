"""Where KVScope keeps files. ``KVSCOPE_CACHE_DIR`` overrides the per-user cache and ``KVSCOPE_CONFIG_DIR`` the
folder of its key (tests point them at temporary folders so a user's real cache is never touched)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

APP_NAME = "kvscope"


def cache_dir() -> Path:
    override = os.environ.get("KVSCOPE_CACHE_DIR")
    if override:
        return Path(override)
    import platformdirs

    return Path(platformdirs.user_cache_dir(APP_NAME, appauthor=False))


def config_dir() -> Path:
    """Where KVScope keeps what must not live in its cache folder (the key that seals the cache's files):
    ``KVSCOPE_CONFIG_DIR``, else the user's config folder."""
    override = os.environ.get("KVSCOPE_CONFIG_DIR")
    if override:
        return Path(override)
    import platformdirs

    return Path(platformdirs.user_config_dir(APP_NAME, appauthor=False))


def converted_models_dir() -> Path:
    return cache_dir() / "converted"


def compiled_graphs_dir() -> Path:
    """torch.compile's caches (inductor's FX graph and kernel caches): kept here, not in a temporary folder, so a
    later launch on this machine reuses them and removing KVScope's cache removes them."""
    return cache_dir() / "torch-compile"


def offloaded_models_dir() -> Path:
    """Layers that fit in no memory tier, written by accelerate for a model loaded with a memory budget."""
    return cache_dir() / "offload"


def folder_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file()) if root.exists() else 0


def remove_tree(root: Path) -> int:
    """Delete a cache folder; returns the bytes freed."""
    freed = folder_bytes(root)
    shutil.rmtree(root, ignore_errors=True)
    return freed
