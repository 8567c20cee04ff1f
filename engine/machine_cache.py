"""What KVScope measured about this machine, kept between launches in small JSON files in its cache folder
(``hardware.json``: peak FLOP/s and bandwidth; ``dtypes.json``: which float is fastest): one entry per key (the
device, torch version, thread count and what was measured), read and written here only.

A damaged file reads as empty (it is measured again); writes are atomic (``engine.files``). A measurement taken
on a busy machine is not kept: its callers decide that, and say so.
"""

from __future__ import annotations

import json
import time

from engine.files import write_text
from engine.paths import cache_dir


def entry(name: str, key: str) -> dict | None:
    """The entry ``key`` of ``name`` (``"hardware.json"``), or None if there is none or it is damaged."""
    found = _table(name).get(key)
    return found if isinstance(found, dict) else None


def remember(name: str, key: str, value: dict) -> None:
    """Keep ``value`` (plus the date) as ``key`` of ``name``. A cache that cannot be written is not an error:
    the next launch measures again."""
    table = _table(name)
    table[key] = {**value, "measured": value.get("measured") or time.strftime("%Y-%m-%d")}
    folder = cache_dir()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        write_text(folder / name, json.dumps(table, indent=1), what="the machine cache")
    except OSError:
        pass


def forget(name: str) -> None:
    (cache_dir() / name).unlink(missing_ok=True)


def _table(name: str) -> dict:
    try:
        table = json.loads((cache_dir() / name).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return table if isinstance(table, dict) else {}
