"""The models already on this computer are found without network, each described from its own config or GGUF
header: a Hugging Face cache, an Ollama store and an LM Studio folder laid out as those programs lay them out."""

from __future__ import annotations

import hashlib
import json
import shutil

import pytest

from engine import cli
from engine.model import embedded, gguf_header
from engine.model.found import find_models


@pytest.fixture
def machine(tmp_path, tiny_model_dir, monkeypatch):
    """A home with the three stores: the tiny model in the Hugging Face cache (a snapshot of a revision), the
    embedded GGUF's header as an Ollama blob named by its manifest, and as an LM Studio download."""
    home = tmp_path / "home"
    hub = tmp_path / "hub"
    snapshot = hub / "models--kvscope--tiny-llama" / "snapshots" / ("a" * 40)
    shutil.copytree(tiny_model_dir, snapshot)
    (hub / "models--kvscope--tiny-llama" / "refs").mkdir()
    (hub / "models--kvscope--tiny-llama" / "refs" / "main").write_text("a" * 40)
    source = embedded.embedded_gguf()
    with source.open("rb") as f:
        head = f.read(gguf_header.read(source).data_offset)          # the header alone: nothing reads the tensors
    ollama = home / ".ollama" / "models"
    digest = hashlib.sha256(head).hexdigest()
    (ollama / "blobs").mkdir(parents=True)
    (ollama / "blobs" / f"sha256-{digest}").write_bytes(head)
    manifest = ollama / "manifests" / "registry.ollama.ai" / "library" / "smollm2" / "135m"
    manifest.parent.mkdir(parents=True)
    manifest.write_text(json.dumps({"layers": [
        {"mediaType": "application/vnd.ollama.image.template", "digest": "sha256:" + "0" * 64},
        {"mediaType": "application/vnd.ollama.image.model", "digest": f"sha256:{digest}"}]}))
    (manifest.parent / "broken").write_text("{not json")                   # skipped, never a traceback
    studio = home / ".lmstudio" / "models" / "lmstudio-community" / "SmolLM2-GGUF"
    studio.mkdir(parents=True)
    (studio / "smollm2-q8_0.gguf").write_bytes(head)
    (studio / "mmproj-model-f16.gguf").write_bytes(head)                     # a vision projector: not a model
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    for name in ("OLLAMA_MODELS", "LLAMA_CACHE", "HF_HOME"):
        monkeypatch.delenv(name, raising=False)
    return tmp_path


def test_the_hugging_face_cache_ollama_and_lm_studio_are_found_and_described(machine):
    found, notes = find_models("bfloat16")
    by_where = {m.where: m for m in found}
    assert notes == [] and sorted(by_where) == ["Hugging Face cache", "LM Studio", "Ollama"] and len(found) == 3
    hf = by_where["Hugging Face cache"]
    assert (hf.name, hf.format, hf.runs_here) == ("kvscope/tiny-llama", "safetensors", True)
    assert hf.load.endswith("snapshots/" + "a" * 40) and hf.size_bytes > 0
    ollama, studio = by_where["Ollama"], by_where["LM Studio"]
    assert (ollama.name, ollama.format, ollama.runs_here) == ("smollm2:135m", "GGUF Q4_1", True)
    assert studio.name == "lmstudio-community/SmolLM2-GGUF/smollm2-q8_0"
    for m in (ollama, studio):                      # SmolLM2-135M: 30 layers x 3 KV heads x 64 dims x 2 x 2 B
        assert (m.parameters, m.context, m.kv_bytes_per_token) == (134_515_008, 8192, 2 * 30 * 3 * 64 * 2)
        assert m.memory_bytes == 134_515_008 * 2


def test_the_cli_lists_them_and_says_in_one_line_what_cannot_run(machine, capsys):
    bad = machine / "added" / "mamba-ish"
    bad.mkdir(parents=True)
    (bad / "config.json").write_text(json.dumps({"model_type": "bert", "architectures": ["BertForMaskedLM"]}))
    assert cli.main(["models", "--json", "--format", "int8", "--add", str(machine / "added")]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert listed["format"] == "int8" and len(listed["models"]) == 4
    refused = next(m for m in listed["models"] if m["where"] == "added folder")
    assert not refused["runs_here"] and "is an encoder" in refused["why_not"]
    assert cli.main(["models"]) == 0
    out = capsys.readouterr().out
    assert "smollm2:135m  [Ollama, GGUF Q4_1, " in out and "runs here: --model " in out


def test_an_ollama_blob_loads_like_a_gguf_and_decodes_what_the_embedded_file_decodes(tmp_path, smol):
    """Ollama names its blobs by their hash, with no .gguf: the source is told by the GGUF magic instead. The
    blob here is a link to the embedded file, so its converted copy is the one this run made already."""
    from engine.facts.params import GenerationParams
    from engine.model.models import load, resolve_source
    from engine.run.session import Session

    blob = tmp_path / "blobs" / ("sha256-" + "b" * 64)
    blob.parent.mkdir()
    blob.symlink_to(embedded.embedded_gguf())
    not_gguf = tmp_path / "blobs" / ("sha256-" + "c" * 64)
    not_gguf.write_bytes(b"{\"license\": \"text\"}")                       # a license layer: not a model
    assert resolve_source(str(blob)).kind == "gguf"
    with pytest.raises(Exception, match="is a file but not a .gguf"):
        resolve_source(str(not_gguf))
    params = GenerationParams(max_new_tokens=6, temperature=0.0)
    tokens = []
    for model in (smol, load(str(blob), device="cpu", dtype="float32")):
        events: list = []
        Session(model).run("The capital of France is", params, events.append)
        tokens.append([e.token_id for e in events if type(e).__name__ == "TokenStep"])
    assert len(tokens[0]) == 6 and tokens[0] == tokens[1]
