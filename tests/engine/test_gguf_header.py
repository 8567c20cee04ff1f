"""A GGUF's header is read within declared bounds before the ``gguf`` package (through transformers) parses it:
that package reads every entry, string and array before it checks a count."""

from __future__ import annotations

import struct
import tracemalloc

import pytest

from engine.facts.errors import ModelSourceError
from engine.model import embedded, gguf_header


def gguf(tensors: int, entries: int, body: bytes = b"", version: int = 3) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", version, tensors, entries) + body


def string(text: bytes) -> bytes:
    return struct.pack("<Q", len(text)) + text


def test_the_embedded_models_header_gives_what_a_model_list_shows():
    header = gguf_header.read(embedded.embedded_gguf())
    assert (header.architecture, header.arch_value("context_length"), header.arch_value("block_count")) == \
        ("llama", 8192, 30)
    assert header.arch_value("attention.head_count_kv") == 3 and header.tensor_count == 272
    assert header.parameters == 134_515_008                       # SmolLM2-135M, from the tensors' shapes
    assert header.value("tokenizer.ggml.tokens") == ("array", 49152)    # a vocabulary is counted, not held


@pytest.mark.parametrize("data, words", [
    (gguf(0, 10_000_000), "claims 10,000,000 metadata entries; KVScope reads at most 65,536"),
    (gguf(2**40, 0), "claims 1,099,511,627,776 tensors"),
    (gguf(0, 1, string(b"k") + struct.pack("<I", 8) + struct.pack("<Q", 2**62)), "bytes in one string"),
    (gguf(0, 1, string(b"k") + struct.pack("<IIQ", 9, 0, 2**40)), "array items"),
    (gguf(0, 1, string(b"k") + struct.pack("<IIQ", 9, 8, 1000)), "ends inside its header"),
    (gguf(0, 1, string(b"k") + struct.pack("<I", 77)), "a value of unknown type 77"),
    (gguf(0, 0, version=9), "format version 9"),
    (b"GGU", "not a GGUF file"),
])
def test_a_hostile_header_is_refused_in_one_line_before_anything_is_held(tmp_path, data, words):
    path = tmp_path / "m.gguf"
    path.write_bytes(data)
    tracemalloc.start()
    try:
        with pytest.raises(ModelSourceError) as refused:
            gguf_header.read(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert words in str(refused.value) and "m.gguf" in str(refused.value) and "\n" not in str(refused.value)
    assert peak < 1 << 20
