"""Loading a model again in the window frees the one it replaces. The garbage collector's view is frozen after each
load, and a replaced model reached through a reference cycle (torch's tracing closures leave such cycles while a
model loads) used to stay resident for good."""

from __future__ import annotations

import weakref

from tests.app.conftest import close_and_dispose, load, make_window


def test_a_model_loaded_again_frees_the_one_it_replaces_even_through_a_cycle(qtbot, tiny_model_dir):
    window = make_window(qtbot, tiny_model_dir)
    try:
        replaced = []
        for _ in range(2):
            first = window.client.model
            model = window.client.worker.session.model
            model.kvscope_test_cycle = [model]                # only the garbage collector can free it now
            replaced.append(weakref.ref(model))
            del model
            load(window, str(tiny_model_dir), "cpu", "float32")
            qtbot.waitUntil(lambda: window.client.model is not first and window.client.busy is None,
                            timeout=60_000)
        assert [ref() is None for ref in replaced] == [True, True]
        assert window.client.worker.session.model is not None
    finally:
        close_and_dispose(window)
