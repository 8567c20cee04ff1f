"""Opening a local model reaches no network: transformers 5.25 fetches layer kernels from the Hub (code it then
imports) while loading some GGUF architectures, and a conversion or a folder load runs with the Hub offline.
Requests are caught by a client that records and refuses them, so no verdict depends on a network."""

from __future__ import annotations

from pathlib import Path

import httpx2
import huggingface_hub
import pytest
import torch
from huggingface_hub import constants

from engine.facts.errors import ModelSourceError
from engine.model import gguf, models
from engine.model.hub import hub_offline


@pytest.fixture
def requests_sent(monkeypatch):
    """Every request ``huggingface_hub`` sends, refused; the Hub online as far as the process can tell."""
    sent: list[str] = []

    def refuse(request: httpx2.Request) -> httpx2.Response:
        sent.append(str(request.url))
        raise httpx2.ConnectError("refused by the test", request=request)

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    huggingface_hub.set_client_factory(lambda: httpx2.Client(transport=httpx2.MockTransport(refuse)))
    yield sent
    huggingface_hub.set_client_factory(huggingface_hub.utils._http.default_client_factory)


def test_transformers_asks_the_hub_for_gguf_layer_kernels_and_sends_nothing_while_it_is_offline(requests_sent):
    from transformers.integrations.gguf.kernels import kernelize_ggml_layers

    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    kernelize_ggml_layers(model)
    asked = list(requests_sent)
    requests_sent.clear()
    with hub_offline():
        kernelize_ggml_layers(model)
    assert asked and requests_sent == []
    assert constants.HF_HUB_OFFLINE is False                # put back as it was


def _recording_loads(monkeypatch) -> list[bool]:
    """transformers' loaders replaced by ones that note whether the Hub was offline to them, then stop."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    seen: list[bool] = []

    def note(*_args, **_kwargs):
        seen.append(constants.HF_HUB_OFFLINE)
        if len(seen) == 2:
            raise RuntimeError("stopped by the test")
        return object()

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", note)
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", note)
    return seen


def test_a_gguf_conversion_loads_with_the_hub_offline(requests_sent, monkeypatch, tmp_path):
    seen = _recording_loads(monkeypatch)
    path = tmp_path / "m.gguf"
    path.write_bytes(b"GGUF")
    with pytest.raises(ModelSourceError, match="stopped by the test"):
        gguf._convert(path, tmp_path / "out", lambda _p: None, lambda: False)
    assert seen == [True, True] and constants.HF_HUB_OFFLINE is False


@pytest.mark.parametrize("remote_code, offline", [(False, True), (True, False)])
def test_a_folder_loads_with_the_hub_offline_unless_its_remote_code_is_allowed(requests_sent, monkeypatch,
                                                                               remote_code, offline):
    seen = _recording_loads(monkeypatch)
    with pytest.raises(ModelSourceError, match="stopped by the test"):
        models._load_folder(str(Path("folder")), None, torch.device("cpu"), torch.float32, remote_code, {})
    assert seen == [offline, offline]
