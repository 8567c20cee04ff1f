"""What KVScope measured about this machine, kept between launches in small JSON files in its cache folder
(``hardware.json``: peak FLOP/s and bandwidth; ``dtypes.json``: which float is fastest): one entry per key (the
device, torch version, thread count and what was measured), read and written here only.

A damaged file reads as empty (it is measured again); writes are atomic (``engine.store.files``) and sealed
(``engine.store.sealed``): a table this user's KVScope did not write is not read at all (moved aside, said in
``refused``) and its entries are measured again. A measurement taken on a busy machine is kept marked busy or
not at all: its callers decide that, and say so.
"""

from __future__ import annotations

import json
import time

from engine.store import sealed
from engine.store.paths import cache_dir

PURPOSE = "KVScope's record of this machine"
refused: list[str] = []           # tables refused in this process, one line each (a load says them)


def entry(name: str, key: str) -> dict | None:
    """The entry ``key`` of ``name`` (``"hardware.json"``), or None if there is none or it is damaged."""
    found = _table(name).get(key)
    return found if isinstance(found, dict) else None


def remember(name: str, key: str, value: dict) -> None:
    """Keep ``value`` (plus the date) as ``key`` of ``name``. A cache that cannot be written is not an error:
    the next launch measures again."""
    table = _table(name)
    table[key] = {**value, "measured": value.get("measured") or time.strftime("%Y-%m-%d")}
    try:
        folder = sealed.private_folder(cache_dir())
        sealed.write_sealed(folder / name, PURPOSE, json.dumps(table, indent=1).encode())
    except (OSError, sealed.Refused):
        pass


def forget(name: str) -> None:
    path = cache_dir() / name
    path.unlink(missing_ok=True)
    path.with_name(name + sealed.SEAL).unlink(missing_ok=True)


def _table(name: str) -> dict:
    path = cache_dir() / name
    if not path.exists():
        return {}
    try:
        table = json.loads(sealed.read_sealed(path, PURPOSE).decode("utf-8"))
    except sealed.Refused as exc:
        if str(exc) not in refused:
            refused.append(str(exc))
        return {}
    except (OSError, ValueError):
        return {}
    return table if isinstance(table, dict) else {}
