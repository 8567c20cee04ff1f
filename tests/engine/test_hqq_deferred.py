"""HQQ's quantizer is imported when an HQQ cache is built, not with transformers: its module compiles functions as
it is imported, which a launch paid whether or not it ever quantized a cache. Run in a fresh interpreter, where
``engine.model`` is imported before transformers as in the app and the command line."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from engine.facts import kv_methods

PROGRAM = """
import json, sys
import torch
from engine.facts import kv_methods
from engine.model import kv_compress
from engine.model.models import load

loaded = load(sys.argv[1], device="cpu", dtype="float32")
seen = {"after_load": "hqq.core.quantize" in sys.modules}
from transformers import cache_utils, utils
seen["check_restored"] = cache_utils.is_hqq_available is utils.is_hqq_available and utils.is_hqq_available()
cache = kv_compress.new_cache(loaded.model, kv_methods.parse_method("hqq4"))
with torch.inference_mode():
    out = loaded.model(input_ids=torch.arange(5, 69)[None], past_key_values=cache, use_cache=True)
    out = loaded.model(input_ids=torch.tensor([[7]]), past_key_values=cache, use_cache=True)
seen["after_cache"] = "hqq.core.quantize" in sys.modules
seen["packed_bytes"] = sum(kv_compress.layer_bytes(layer)[1] for layer in cache.layers)
seen["finite"] = bool(torch.isfinite(out.logits).all())
print(json.dumps(seen))
"""


def test_a_load_leaves_hqq_unimported_until_an_hqq_cache_is_built_and_that_cache_quantizes(tiny_model_dir):
    problem = kv_methods.available(kv_methods.parse_method("hqq4"))
    if problem:
        pytest.skip(problem)
    done = subprocess.run([sys.executable, "-c", PROGRAM, str(tiny_model_dir)], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["after_load"] is False
    assert seen["check_restored"] is True
    assert seen["after_cache"] is True and seen["packed_bytes"] > 0 and seen["finite"] is True
