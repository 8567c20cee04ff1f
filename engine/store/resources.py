"""``resources/``: sample prompts and icons, next to the source tree, inside a bundled app, or in an installed
wheel (as the data package ``kvscope_resources``); if none is found, the few prompts experiments need are
built in."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

BUILT_IN_PROMPTS = [
    ("short question", "hey, what is continuous batching?"),
    ("explain kv cache", "Explain the KV cache of a transformer to a student in three short paragraphs."),
    ("story", "Write a long story about a dragon who learns to bake bread. Describe every step."),
    ("code", "Write a Python function that returns the n-th Fibonacci number, with a docstring and one test."),
]

# Speculative decoding: an answer that repeats its prompt (prompt lookup guesses it) and one that does not.
SPECULATIVE_PROMPTS = {
    "repeats itself": (
        "Fix the spelling mistakes in this paragraph and reply with the corrected paragraph only:\n\nThe KV cach "
        "keeps the keys and valeus of every token the model has allready read, so that each new token can attend "
        "to them without computing them agian. Its size grows with the lenght of the conversation."),
    "creative": "Write a short poem about a lighthouse keeper who has never seen the sea.",
}


def resources_dir() -> Path:
    candidates = []
    bundle = getattr(sys, "_MEIPASS", None)
    if bundle:
        candidates.append(Path(bundle) / "resources")
    import engine

    candidates.append(Path(engine.__file__).resolve().parents[1] / "resources")     # the source tree
    spec = importlib.util.find_spec("kvscope_resources")          # installed from a wheel
    if spec is not None and spec.submodule_search_locations:
        candidates += [Path(p) for p in spec.submodule_search_locations]
    for path in candidates:
        if (path / "prompts").is_dir():
            return path
    return candidates[-1]


def sample_prompts() -> list[tuple[str, str]]:
    """(title, text) for each file in ``resources/prompts``, in file-name order."""
    folder = resources_dir() / "prompts"
    out = []
    for path in sorted(folder.glob("*.txt")) if folder.is_dir() else []:
        title = path.stem.split("-", 1)[-1].replace("-", " ")
        out.append((title, path.read_text(encoding="utf-8").strip()))
    return out or list(BUILT_IN_PROMPTS)
