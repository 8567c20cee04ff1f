"""Test-wide setup: Qt offscreen, and the user's real cache and settings never touched."""

from __future__ import annotations

import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("KVSCOPE_LINEAR", "aten")      # one kernel in every test; tests/engine/test_kernels.py tries both
# Packages built without timing inductor's GEMM templates (a package build in 22 s instead of 57): what the tests
# check is what KVScope does around a package; tests/engine/test_compiled.py builds one with the default.
os.environ.setdefault("KVSCOPE_PACKAGE_AUTOTUNE", "0")
os.environ.setdefault("KVSCOPE_PREFILL_PACKAGE", "always")   # untimed; test_compiled_prefill times it
# torch's thread count stays what it is: the governor follows the machine's load (engine.model.threads), and a
# test's verdict must not depend on how busy its machine is; tests/engine/test_threads.py gives it a load.
os.environ.setdefault("KVSCOPE_THREADS", "fixed")

import pytest  # noqa: E402

PATIENCE_MS = 120_000


def _patient_wait_until() -> None:
    """A wait in a test is a hang detector, never a speed limit: a condition met in 50 ms on a quiet machine can
    take seconds beside other programs, and the verdict must not change. Every ``qtbot.waitUntil`` waits at least
    ``PATIENCE_MS`` before it calls the condition never met."""
    try:
        from pytestqt.qtbot import QtBot
    except ImportError:             # a run without pytest-qt (an engine-only install) has no waits to widen
        return
    wait_until = QtBot.waitUntil

    def patient(self, callback, *, timeout: int = PATIENCE_MS):
        return wait_until(self, callback, timeout=max(timeout, PATIENCE_MS))

    QtBot.waitUntil = patient
    QtBot.wait_until = patient


_patient_wait_until()


BUILD_PATIENCE_S = 900


@pytest.fixture(autouse=True)
def _isolated_settings(tmp_path, monkeypatch):
    """Every test's window remembers into a file of its own: the example lesson's test, outside tests/app, opened
    a window that wrote the tiny model's temporary folder into the user's real settings, and the next
    ``make run`` tried to load it."""
    monkeypatch.setenv("KVSCOPE_SETTINGS", str(tmp_path / "settings.ini"))


@pytest.fixture(autouse=True)
def _no_build_outlives_its_test():
    """A compiled run builds its graph, then the prefill package, in a daemon thread that outlives the run. Left
    running into the next test it changed that test's verdict: its export sets a process-wide flag
    (``torch.compiler.is_exporting``) under which the next file's packed products went through ATen, and a model
    loaded beside it failed. So every test waits for the builds it started before the next begins."""
    yield
    import threading

    for thread in threading.enumerate():
        if thread.name.startswith("kvscope-compile-"):
            thread.join(BUILD_PATIENCE_S)
            if thread.is_alive():
                pytest.fail(f"a compiled build ({thread.name}) still runs {BUILD_PATIENCE_S} s after its test ended")


@pytest.fixture
def compile_skipped(monkeypatch):
    """AOTInductor's compile replaced by a package holding one empty library, for tests of what happens around a
    package build (its export, its threads) rather than of the compile."""
    import zipfile

    import torch

    def package(_exported, package_path, inductor_configs):
        with zipfile.ZipFile(package_path, "w") as archive:
            archive.writestr("step/data/aotinductor/model/step.wrapper.so", b"")

    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package", package)


@pytest.fixture(scope="session")
def cache_root(tmp_path_factory: pytest.TempPathFactory):
    """One cache for the whole run, so the embedded model is converted once per run (never across runs)."""
    return tmp_path_factory.mktemp("kvscope-cache")


@pytest.fixture(scope="session", autouse=True)
def _isolated_cache(cache_root, tmp_path_factory):
    """Set for the whole session, not per test: a module- or session-scoped fixture (a lesson run once for a
    file's tests) runs before any per-test setting and would otherwise write into the user's real cache (or seal
    it with the user's real key)."""
    wanted = {"KVSCOPE_CACHE_DIR": str(cache_root), "KVSCOPE_CONFIG_DIR": str(tmp_path_factory.mktemp("config")),
              "KVSCOPE_DATA_DIR": str(tmp_path_factory.mktemp("data"))}
    before = {name: os.environ.get(name) for name in wanted}
    os.environ.update(wanted)
    yield
    for name, value in before.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory):
    from tests.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny(tiny_model_dir):
    """The tiny model loaded through the product's own loader, on CPU in float32."""
    from engine.model.models import load

    return load(str(tiny_model_dir), device="cpu", dtype="float32")


@pytest.fixture(scope="session")
def smol(cache_root):
    """The real embedded SmolLM2-135M-Instruct, converted into this run's cache."""
    from engine.model.models import load

    return load("embedded", device="cpu", dtype="float32")
