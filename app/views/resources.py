"""Where the window's files are: ``resources/`` is found by the engine (the experiments use its prompts too)."""

from __future__ import annotations

from pathlib import Path

from engine.store.resources import resources_dir, sample_prompts

__all__ = ["icon_path", "resources_dir", "sample_prompts"]


def icon_path(name: str = "kvscope.svg") -> Path:
    return resources_dir() / "icons" / name
