"""The models and servers already on this computer, in the window: found in the background, listed as they come,
loaded or attached from the list."""

from __future__ import annotations

import json
import shutil

import pytest

from app.state.found_here import MODELS, SERVERS, FoundHere
from engine.model.found import FoundModel
from tests.app.conftest import close_and_dispose, make_window


def _model(name: str) -> FoundModel:
    return FoundModel(name, "Ollama", f"/m/{name}", "GGUF Q4_0", 1, None, None, None, None, True)


def test_a_newer_search_replaces_the_list_and_an_older_searchs_late_rows_are_dropped():
    found = FoundHere()
    heard: list[set[str]] = []
    found.subscribe(heard.append)
    first = found.started(MODELS)
    found.model_found(first, _model("a"))
    second = found.started(MODELS)
    assert found.models == [] and MODELS in found.searching
    found.model_found(first, _model("late"))
    found.model_found(second, _model("b"))
    found.model_found(second, "Ollama's store: permission denied")
    found.finished(MODELS, first)                               # the old search ending changes nothing
    assert MODELS in found.searching
    found.finished(MODELS, second)
    assert [m.name for m in found.models] == ["b"] and found.notes == ["Ollama's store: permission denied"]
    assert found.searching == set() and found.counts() == "1 model"
    assert {MODELS} <= heard[-1]


@pytest.fixture
def home(tmp_path, tiny_model_dir, monkeypatch):
    """A home whose Hugging Face cache holds the tiny model, and an Ollama store whose manifest names a blob that
    is missing (listed nowhere, never a traceback)."""
    hub = tmp_path / "hub"
    repo = hub / "models--kvscope--tiny-llama"
    shutil.copytree(tiny_model_dir, repo / "snapshots" / ("a" * 40))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("a" * 40)
    manifest = tmp_path / "home" / ".ollama" / "models" / "manifests" / "registry.ollama.ai" / "library" / "gone" / "1b"
    manifest.parent.mkdir(parents=True)
    manifest.write_text(json.dumps({"layers": [{"mediaType": "application/vnd.ollama.image.model",
                                                "digest": "sha256:" + "d" * 64}]}))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    for name in ("OLLAMA_MODELS", "LLAMA_CACHE", "HF_HOME"):
        monkeypatch.delenv(name, raising=False)
    return tmp_path


def test_the_list_fills_in_the_background_and_a_double_click_loads_the_model(qtbot, home):
    from PySide6.QtCore import Qt

    window = make_window(qtbot)
    try:
        window.lookups.show_found(MODELS)
        dialog = window.lookups.found_dialog
        qtbot.waitUntil(lambda: MODELS in window.lookups.found_here.searched)
        assert dialog.models.rowCount() == 1 and dialog.tabs.tabText(0) == "Models (1)"
        cells = [dialog.models.item(0, c).text() for c in range(dialog.models.columnCount())]
        assert cells[:3] == ["kvscope/tiny-llama", "Hugging Face cache", "safetensors"] and cells[-1] == "yes"
        assert window.controls.found_button.toolTip().endswith("Found so far: 1 model.")
        dialog.filter.setText("ollama")
        assert dialog.models.isRowHidden(0)
        dialog.filter.setText("TINY")
        assert not dialog.models.isRowHidden(0)
        assert not dialog.use_button.isEnabled()                      # nothing chosen yet
        dialog.models.selectRow(0)
        assert dialog.use_button.isEnabled() and dialog.use_button.text() == "Load"
        dialog.models.itemActivated.emit(dialog.models.item(0, 0))      # a double-click, or Enter
        loaded = str(home / "hub" / "models--kvscope--tiny-llama" / "snapshots" / ("a" * 40))
        assert window.controls.model_box.currentText() == loaded and not dialog.isVisible()
        qtbot.waitUntil(lambda: window.client.model is not None and window.client.busy is None)
        assert window.controller.model_choice.loaded.model == loaded
        assert window.controls.model_box.findText(loaded, Qt.MatchFlag.MatchExactly) >= 0
    finally:
        close_and_dispose(window)


def test_servers_are_listed_and_only_a_known_engine_is_attachable(qtbot, monkeypatch):
    from engine.serve import discover
    from engine.serve.discover import FoundServer

    answers = [FoundServer(8080, "http://127.0.0.1:8080", "llama.cpp", "b6000", ("smollm2",), True),
               FoundServer(3000, "http://127.0.0.1:3000", "not a known engine",
                           notes=("it answers HTTP, but not as any serving engine KVScope knows",))]
    monkeypatch.setattr(discover, "find_servers", lambda ports: answers)
    window = make_window(qtbot)
    try:
        chosen: list[str] = []
        window.lookups.show_found(SERVERS)
        dialog = window.lookups.found_dialog
        dialog._choose = chosen.append
        qtbot.waitUntil(lambda: SERVERS in window.lookups.found_here.searched)
        assert dialog.tabs.currentIndex() == 1 and dialog.tabs.tabText(1) == "Servers (1)"
        assert [dialog.servers.item(r, 1).text() for r in range(2)] == ["llama.cpp", "not a known engine"]
        dialog.servers.selectRow(1)
        assert not dialog.use_button.isEnabled()                     # never attached
        assert dialog.servers.item(1, 4).text().startswith("no: it answers HTTP")
        dialog.servers.selectRow(0)
        assert dialog.use_button.text() == "Attach" and dialog.use_button.isEnabled()
        dialog.use_button.click()
        assert chosen == ["http://127.0.0.1:8080"]
    finally:
        close_and_dispose(window)


def test_a_store_of_500_models_is_read_off_the_windows_thread_and_listed_whole(qtbot, tmp_path, monkeypatch):
    import hashlib
    import threading

    from engine.model import embedded, found, gguf_header

    source = embedded.embedded_gguf()
    with source.open("rb") as f:
        head = f.read(gguf_header.read(source).data_offset)           # the header alone: nothing reads tensors
    store = tmp_path / "ollama"
    digest = hashlib.sha256(head).hexdigest()
    (store / "blobs").mkdir(parents=True)
    (store / "blobs" / f"sha256-{digest}").write_bytes(head)
    layer = json.dumps({"layers": [{"mediaType": "application/vnd.ollama.image.model", "digest": f"sha256:{digest}"}]})
    for i in range(500):
        manifest = store / "manifests" / "registry.ollama.ai" / "library" / f"model{i:03d}" / "latest"
        manifest.parent.mkdir(parents=True)
        manifest.write_text(layer)
    monkeypatch.setenv("OLLAMA_MODELS", str(store))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "no-hub"))
    readers: set[int] = set()
    described = found.gguf_model

    def watched(*args, **kwargs):
        readers.add(threading.get_ident())
        return described(*args, **kwargs)

    monkeypatch.setattr(found, "gguf_model", watched)
    window = make_window(qtbot)
    try:
        window.lookups.show_found(MODELS)
        qtbot.waitUntil(lambda: MODELS in window.lookups.found_here.searched)
        dialog = window.lookups.found_dialog
        assert dialog.models.rowCount() == 500 and dialog.tabs.tabText(0) == "Models (500)"
        assert readers and threading.get_ident() not in readers           # never on the window's thread
        assert dialog.models.item(499, 0).text() == "model499:latest"
    finally:
        close_and_dispose(window)
