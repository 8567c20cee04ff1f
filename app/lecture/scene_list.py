"""The lecture's scenes, in order: the run views (prefill vs decode, the cache filling, sampling,
attention) and each lesson's own scene (``app.lessons``), placed by their ``order``. Every scene's key is the
number-row key of its place (1 to 9, 0, -, =) unless it names its own; its title shows that key, so what the
speaker presses is what the screen says."""

from __future__ import annotations

from dataclasses import replace

from app import lessons
from app.views.lesson_view import Scene

NUMBER_ROW = "1234567890-="
BASE = (
    Scene("prefill", "Prefill vs decode", order=1, action="run the prompt"),
    Scene("kv", "The KV cache filling", order=2, action="run (F10 steps)"),
    Scene("sampling", "Sampling", order=6, action="run the prompt"),
    Scene("attention", "What the cache is read for", order=9, action="run, recording attention", side_by_side=True),
)


def _keyed(scenes: list[Scene]) -> tuple[Scene, ...]:
    ordered = sorted(scenes, key=lambda s: s.order)
    return tuple(s if s.key else replace(s, key=NUMBER_ROW[i]) for i, s in enumerate(ordered))


SCENES: tuple[Scene, ...] = _keyed([*BASE, *lessons.scenes()])
NAMES: tuple[str, ...] = tuple(s.name for s in SCENES)
BY_NAME: dict[str, Scene] = {s.name: s for s in SCENES}
assert len(set(s.key for s in SCENES)) == len(SCENES), "every scene has a key of its own"
