"""What a load frees is handed back to the OS, so the status strip's resident memory is the model's."""

from __future__ import annotations

import gc
import sys
import weakref

import pytest
import torch

from engine.model import models
from engine.model.memory import process_rss_bytes, release_freed_heap

MIB = 2**20


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim")
def test_freed_heap_blocks_stay_resident_until_released():
    blocks = [torch.ones(16 * 1024) for _ in range(4000)]     # 64 KiB each, 250 MiB: below glibc's mmap threshold
    above = torch.ones(16 * 1024)                             # allocated after them: the heap's top stays in use
    held = process_rss_bytes()
    del blocks
    assert process_rss_bytes() > held - 50 * MIB             # freed, yet resident
    released = release_freed_heap()
    assert released > 200 * MIB and process_rss_bytes() < held - 200 * MIB
    assert above.sum() == 16 * 1024


def test_a_load_releases_what_it_freed_once_at_its_end(tiny_model_dir, monkeypatch):
    calls: list[str] = []
    monkeypatch.setattr(models, "release_freed_heap", lambda: calls.append("released") or 0)
    models.load(str(tiny_model_dir), device="cpu", dtype="float32", progress=lambda p: calls.append(p.stage))
    assert calls.count("released") == 1 and calls[-2:] == ["released", "done"]


def test_a_session_dropped_is_freed_without_the_garbage_collector(tiny):
    from engine.run.session import Session

    session = Session(tiny)
    dropped, passes = weakref.ref(session), weakref.ref(session.passes)
    gc.disable()
    try:
        del session
        assert dropped() is None and passes() is None
    finally:
        gc.enable()
