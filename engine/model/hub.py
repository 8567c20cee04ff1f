"""What KVScope lets the Hugging Face Hub do while a model loads: nothing, unless the user asked for a hub id.

transformers 5.25 depends on ``kernels`` and, for some models, fetches layer kernels from the Hub as it loads
them (the GGUF architectures its new loader reads, fp8 and mxfp4 weights on a GPU) and imports them: code from
the network run in this process, which no one asked for by opening a local file. Loading from a local file or
folder therefore runs with the Hub offline: a kernel loads from the local cache or not at all, and the model
keeps its own layers.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


@contextlib.contextmanager
def hub_offline() -> Iterator[None]:
    """The Hub offline to this process while the block runs: ``huggingface_hub`` and ``kernels`` read
    ``constants.HF_HUB_OFFLINE`` at each call, so nothing is fetched, only the local cache read. One load runs
    at a time (the worker thread), so no download the user asked for is held offline by it."""
    from huggingface_hub import constants

    before = constants.HF_HUB_OFFLINE
    constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        constants.HF_HUB_OFFLINE = before
