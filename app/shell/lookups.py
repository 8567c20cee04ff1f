"""The dialogs that look around a run rather than at it: the models and servers already on this computer (found in
the background), the run history across launches, and where the shown run's figures come from. The window owns
one ``Lookups``; the menus and the Model box's button call it."""

from __future__ import annotations

from PySide6.QtCore import QSettings
from PySide6.QtWidgets import QWidget

from app.lecture.mode import fit_to_screen
from app.link.controller import Controller
from app.link.finder import Finder
from app.panels.controls import ControlsPanel
from app.panels.timing import TimingPanel
from app.shell.dialogs import SourcesDialog
from app.shell.found_dialog import FoundDialog
from app.shell.history_dialog import MOST_COMPARED, HistoryDialog
from app.state.found_here import MODELS, SERVERS, FoundHere
from engine.facts.config_facts import FORMATS

MAX_ADDED_FOLDERS = 20     # folders of models the user added to the search


class Lookups:
    def __init__(self, window: QWidget, controls: ControlsPanel, controller: Controller, timing: TimingPanel,
                 settings: QSettings) -> None:
        self.window, self.controls, self.controller, self.timing = window, controls, controller, timing
        self.settings = settings
        self.found_here = FoundHere()
        self.finder = Finder(self.found_here, window)
        self.found_dialog: FoundDialog | None = None
        self.history_dialog: HistoryDialog | None = None
        self.sources_dialog: SourcesDialog | None = None
        self.found_here.subscribe(lambda _names: controls.show_found(self.found_here.counts()))
        controls.found_requested.connect(lambda: self.show_found(MODELS))

    # --- the models and servers already here ------------------------------------------------------------------
    def search(self, kind: str) -> None:
        """Search again for the models on disk (``MODELS``) or the servers answering here (``SERVERS``), in the
        background; rows arrive as they are found."""
        if kind == MODELS:
            self.finder.find_models(self.weight_format(), self.added_folders())
        else:
            self.finder.find_servers()

    def search_at_start(self) -> None:
        """At launch: the servers (a port that hangs costs its deadline, in the background) and the models."""
        self.search(SERVERS)
        self.search(MODELS)

    def show_found(self, kind: str) -> None:
        """The list of models (Ctrl+Shift+O) or of servers (File > Attach, Ctrl+Shift+A): servers come and go,
        so they are asked again each time; the models are searched the first time."""
        if self.found_dialog is None:
            self.found_dialog = FoundDialog(self.window, self.found_here, self.weight_format, self._choose,
                                            self.search, self._add_folder)
        if kind not in self.found_here.searching and (kind == SERVERS or kind not in self.found_here.searched):
            self.search(kind)
        self.found_dialog.show_tab(kind)
        _raise(self.found_dialog)

    def added_folders(self) -> list[str]:
        folders = self.settings.value("found/folders", [], list) or []
        return [f for f in folders if isinstance(f, str) and f][:MAX_ADDED_FOLDERS]

    def weight_format(self) -> str:
        """The format the list's memory column is computed for: the dtype chosen, or bfloat16 for auto."""
        dtype = self.controls.dtype_box.currentText()
        return dtype if dtype in FORMATS else "bfloat16"

    def _add_folder(self, folder: str) -> None:
        folders = [folder] + [f for f in self.added_folders() if f != folder]
        self.settings.setValue("found/folders", folders[:MAX_ADDED_FOLDERS])
        self.search(MODELS)

    def _choose(self, source: str) -> None:
        """A model or a server chosen from the list: named in the Model box and loaded, as Load model would."""
        self.controls.set_model(source)
        self.controller.load_model()

    # --- the run history --------------------------------------------------------------------------------------
    def show_run_history(self) -> None:
        """Every run remembered across launches (Ctrl+H); the runs picked there open here as a replay."""
        if self.history_dialog is None:
            self.history_dialog = HistoryDialog(self.window, self._open_remembered)
        _raise(self.history_dialog)
        self.history_dialog.refresh()

    def _open_remembered(self, paths: list[str]) -> None:
        """Runs from the history replayed in every panel, side by side: the timing overlay shows them all."""
        if self.controller.open_traces(paths):
            self.timing.show_at_least(MOST_COMPARED)

    # --- where the figures come from --------------------------------------------------------------------------
    def show_sources(self, run) -> None:
        """Where ``run``'s figures come from (Ctrl+I); None: no run is shown, and it says so."""
        self.sources_dialog = SourcesDialog(self.window, run)
        _raise(self.sources_dialog)


def _raise(dialog: QWidget) -> None:
    """Shown, in front, and within the screen it is on (the history's 1200x720 on a 1280x720 projector)."""
    dialog.show()
    fit_to_screen(dialog)
    dialog.raise_()
    dialog.activateWindow()
