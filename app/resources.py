"""Where ``resources/`` is: next to the source tree, inside an installed wheel, or inside a bundled app."""

from __future__ import annotations

import sys
from pathlib import Path


def resources_dir() -> Path:
    candidates = []
    bundle = getattr(sys, "_MEIPASS", None)
    if bundle:
        candidates.append(Path(bundle) / "resources")
    here = Path(__file__).resolve().parent
    candidates += [here.parent / "resources", here / "resources"]
    for path in candidates:
        if (path / "prompts").is_dir():
            return path
    return candidates[-1]


def sample_prompts() -> list[tuple[str, str]]:
    """(title, text) for each file in ``resources/prompts``, in file-name order."""
    folder = resources_dir() / "prompts"
    out = []
    for path in sorted(folder.glob("*.txt")):
        title = path.stem.split("-", 1)[-1].replace("-", " ")
        out.append((title, path.read_text(encoding="utf-8").strip()))
    return out


def icon_path(name: str = "kvscope.svg") -> Path:
    return resources_dir() / "icons" / name
