"""The search for what is already on this computer, beside the engine's thread: a run, a load or an experiment
never waits for a disk scan or a port that hangs, and the search never waits for them. Each search runs in a
daemon thread of its own (the process may end while one still reads a slow disk) and hands its rows to the plain
``FoundHere`` model through a queued Qt signal, so the model only ever changes on the window's thread."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable

from PySide6.QtCore import QObject, Signal, Slot

from app.state.found_here import MODELS, SERVERS, FoundHere
from engine.facts.errors import EngineError

log = logging.getLogger(__name__)


class Finder(QObject):
    _model = Signal(int, object)
    _servers = Signal(int, object)
    _finished = Signal(str, int, str)

    def __init__(self, found: FoundHere, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.found = found
        self._model.connect(self._take_model)
        self._servers.connect(self._take_servers)
        self._finished.connect(self._take_finished)

    def find_models(self, fmt: str = "bfloat16", added: Iterable[str] = ()) -> None:
        generation = self.found.started(MODELS)
        added = list(added)

        def search() -> None:
            from engine.model.found import iter_models

            problem = ""
            try:
                for item in iter_models(fmt, added):
                    _emit(self._model, generation, item)
            except (OSError, ValueError, EngineError, ImportError) as exc:
                problem = f"The search for models stopped: {exc}"[:300]
            except Exception as exc:  # noqa: BLE001 (a search that fails must still say so and end)
                log.exception("model search")
                problem = f"The search for models stopped: {type(exc).__name__}: {exc}"[:300]
            _emit(self._finished, MODELS, generation, problem)

        threading.Thread(target=search, name="kvscope-find-models", daemon=True).start()

    def find_servers(self, ports: Iterable[int] | None = None) -> None:
        generation = self.found.started(SERVERS)
        ports = None if ports is None else list(ports)

        def search() -> None:
            from engine.serve import discover

            problem = ""
            try:
                _emit(self._servers, generation, discover.find_servers(discover.PORTS if ports is None else ports))
            except Exception as exc:  # noqa: BLE001
                log.exception("server search")
                problem = f"The search for servers stopped: {type(exc).__name__}: {exc}"[:300]
            _emit(self._finished, SERVERS, generation, problem)

        threading.Thread(target=search, name="kvscope-find-servers", daemon=True).start()

    @Slot(int, object)
    def _take_model(self, generation: int, item: object) -> None:
        self.found.model_found(generation, item)

    @Slot(int, object)
    def _take_servers(self, generation: int, servers: object) -> None:
        self.found.servers_found(generation, servers)

    @Slot(str, int, str)
    def _take_finished(self, kind: str, generation: int, problem: str) -> None:
        self.found.finished(kind, generation, problem)


def _emit(signal, *args: object) -> None:
    """Hand a row to the window's thread; once the window is gone there is no one to tell, and that is fine."""
    try:
        signal.emit(*args)
    except RuntimeError:                 # the Finder was deleted with its window while this thread still read
        pass
