"""On this computer: the models already on disk and the servers already running, listed as the background
search finds them, each loadable or attachable with one double-click (or Enter). What cannot run here says why
in its row instead of failing at load; the window stays usable while the search reads."""

from __future__ import annotations

from collections.abc import Callable

from PySide6.QtCore import Qt
from PySide6.QtGui import QBrush, QColor
from PySide6.QtWidgets import (
    QAbstractItemView,
    QDialog,
    QDialogButtonBox,
    QFileDialog,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QLineEdit,
    QPushButton,
    QTableWidget,
    QTableWidgetItem,
    QTabWidget,
    QVBoxLayout,
    QWidget,
)

from app.state.found_here import MODELS, SERVERS, FoundHere
from engine.facts.kvformula import format_bytes

MODEL_COLUMNS = ("Model", "From", "Format", "On disk", "Parameters", "Context", "KV / position", "Weights",
                 "Runs here")
SERVER_COLUMNS = ("Address", "Engine", "Version", "Models loaded", "Attach")
UNRUNNABLE = QColor(128, 128, 128)


class FoundDialog(QDialog):
    """``choose(text)`` puts a model's path or a server's address in the Model box and loads it;
    ``search(kind)`` starts a new search; ``add_folder(path)`` remembers a folder and searches again."""

    def __init__(self, parent: QWidget | None, found: FoundHere, weight_format: Callable[[], str],
                 choose: Callable[[str], None], search: Callable[[str], None],
                 add_folder: Callable[[str], None]) -> None:
        super().__init__(parent)
        self.found, self.weight_format = found, weight_format
        self._choose, self._search, self._add_folder = choose, search, add_folder
        self.setWindowTitle("On this computer: models and servers")
        self.resize(1100, 520)
        self.tabs = QTabWidget()
        self.models = _table(MODEL_COLUMNS)
        self.servers = _table(SERVER_COLUMNS)
        self.filter = QLineEdit()
        self.filter.setPlaceholderText("Filter by name, where or format")
        self.filter.setClearButtonEnabled(True)
        self.filter.textChanged.connect(lambda _text: self._apply_filter())
        models_tab = QWidget()
        mv = QVBoxLayout(models_tab)
        mv.addWidget(self.filter)
        mv.addWidget(self.models, 1)
        servers_tab = QWidget()
        sv = QVBoxLayout(servers_tab)
        sv.addWidget(QLabel("Asked on 127.0.0.1 only, at the default ports of llama-server, Ollama, vLLM, SGLang, "
                            "LM Studio and TGI; each engine told by its own endpoints."))
        sv.addWidget(self.servers, 1)
        self.tabs.addTab(models_tab, "Models")
        self.tabs.addTab(servers_tab, "Servers")
        self.status = QLabel()
        self.status.setWordWrap(True)
        self.status.setTextFormat(Qt.TextFormat.PlainText)
        self.add_button = QPushButton("Add a folder…")
        self.again_button = QPushButton("Search again")
        self.use_button = QPushButton("Load")
        self.use_button.setDefault(True)
        self.add_button.clicked.connect(self._pick_folder)
        self.again_button.clicked.connect(lambda: self._search(self._kind()))
        self.use_button.clicked.connect(self.use_selected)
        self.models.itemActivated.connect(lambda _item: self.use_selected())
        self.servers.itemActivated.connect(lambda _item: self.use_selected())
        self.models.itemSelectionChanged.connect(self._follow_selection)
        self.servers.itemSelectionChanged.connect(self._follow_selection)
        self.tabs.currentChanged.connect(lambda _i: self._follow_selection())
        buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Close)
        buttons.rejected.connect(self.reject)
        row = QHBoxLayout()
        row.addWidget(self.add_button)
        row.addWidget(self.again_button)
        row.addStretch(1)
        row.addWidget(self.use_button)
        row.addWidget(buttons)
        layout = QVBoxLayout(self)
        layout.addWidget(self.tabs, 1)
        layout.addWidget(self.status)
        layout.addLayout(row)
        self._shown_models = 0
        found.subscribe(self._changed)
        self.refresh()

    def show_tab(self, kind: str) -> None:
        self.tabs.setCurrentIndex(1 if kind == SERVERS else 0)

    def refresh(self) -> None:
        self._shown_models = 0
        self.models.setRowCount(0)
        self._changed({MODELS, SERVERS})

    # --- the lists follow the model -------------------------------------------------------------------------
    def _changed(self, names: set[str]) -> None:
        if MODELS in names:
            if len(self.found.models) < self._shown_models:          # a new search: its rows replace these
                self._shown_models = 0
                self.models.setRowCount(0)
            first = self._shown_models
            self.models.setUpdatesEnabled(False)
            for model in self.found.models[first:]:
                self._add_model_row(model)
            self._shown_models = len(self.found.models)
            self._apply_filter(first)
            self.models.setUpdatesEnabled(True)
        if "searching" in names or SERVERS in names:
            for table in (self.models, self.servers):           # once a search has said, not at every row
                table.resizeColumnsToContents()
        if SERVERS in names:
            self._fill_servers()
        self.tabs.setTabText(0, f"Models ({len(self.found.models):,})")
        self.tabs.setTabText(1, f"Servers ({sum(1 for s in self.found.servers if s.attachable):,})")
        self._show_status()
        self._follow_selection()

    def _add_model_row(self, m) -> None:
        row = self.models.rowCount()
        self.models.insertRow(row)
        fmt = self.weight_format()
        cells = (m.name, m.where, m.format, format_bytes(m.size_bytes) if m.size_bytes else "",
                 f"{m.parameters / 1e9:,.2f} B" if m.parameters else "unknown",
                 f"{m.context:,}" if m.context else "unknown",
                 format_bytes(m.kv_bytes_per_token) if m.kv_bytes_per_token else "unknown",
                 f"{format_bytes(m.memory_bytes)} in {fmt}" if m.memory_bytes else "unknown",
                 "yes" if m.runs_here else f"no: {m.why_not}")
        tip = f"{m.load}" + ("" if m.runs_here else f"\nCannot run here: {m.why_not}")
        for column, text in enumerate(cells):
            item = QTableWidgetItem(text)
            item.setToolTip(tip)
            item.setData(Qt.ItemDataRole.UserRole, m.load)
            if not m.runs_here:
                item.setForeground(QBrush(UNRUNNABLE))
            self.models.setItem(row, column, item)

    def _fill_servers(self) -> None:
        self.servers.setRowCount(0)
        for s in self.found.servers:
            row = self.servers.rowCount()
            self.servers.insertRow(row)
            attach = "yes" if s.attachable else "no: " + "; ".join(s.notes or ("it does not serve the OpenAI API",))
            cells = (s.url, s.engine, s.version or "not said", ", ".join(s.models) or "none loaded", attach)
            for column, text in enumerate(cells):
                item = QTableWidgetItem(text)
                item.setToolTip("\n".join(s.loaded))           # what the engine says of each model it holds
                item.setData(Qt.ItemDataRole.UserRole, s.url if s.attachable else "")
                if not s.attachable:
                    item.setForeground(QBrush(UNRUNNABLE))
                self.servers.setItem(row, column, item)

    def _show_status(self) -> None:
        f = self.found
        words = f.summary() or "Nothing searched yet"
        if SERVERS in f.searched and not f.servers and SERVERS not in f.searching:
            words += ". No server answers on 127.0.0.1 at the default ports"
        if MODELS in f.searched and not f.models and MODELS not in f.searching:
            words += (". No models in the Hugging Face cache, Ollama's store, LM Studio's folders or llama.cpp's "
                      "cache: Add a folder… looks in another")
        notes = "\n".join(f.notes[-5:])
        self.status.setText(words + "." + (f"\n{notes}" if notes else ""))

    def _apply_filter(self, first: int = 0) -> None:
        """Rows from ``first`` on shown or hidden by the filter's words (new rows only, as they arrive)."""
        words = self.filter.text().strip().lower().split()
        for row in range(first, self.models.rowCount()):
            text = " ".join(self.models.item(row, c).text().lower() for c in range(3))
            self.models.setRowHidden(row, not all(w in text for w in words))

    # --- choosing -------------------------------------------------------------------------------------------
    def _kind(self) -> str:
        return SERVERS if self.tabs.currentIndex() == 1 else MODELS

    def _selected(self) -> str:
        table = self.servers if self._kind() == SERVERS else self.models
        items = table.selectedItems()
        return str(items[0].data(Qt.ItemDataRole.UserRole) or "") if items else ""

    def _follow_selection(self) -> None:
        self.use_button.setText("Attach" if self._kind() == SERVERS else "Load")
        self.use_button.setEnabled(bool(self._selected()))
        self.add_button.setVisible(self._kind() == MODELS)

    def use_selected(self) -> None:
        chosen = self._selected()
        if chosen:
            self._choose(chosen)
            self.accept()

    def _pick_folder(self) -> None:
        folder = QFileDialog.getExistingDirectory(self, "A folder of models (Hugging Face folders or .gguf files)")
        if folder:
            self._add_folder(folder)


def _table(columns: tuple[str, ...]) -> QTableWidget:
    table = QTableWidget(0, len(columns))
    table.setHorizontalHeaderLabels(list(columns))
    table.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
    table.setSelectionBehavior(QAbstractItemView.SelectionBehavior.SelectRows)
    table.setSelectionMode(QAbstractItemView.SelectionMode.SingleSelection)
    table.verticalHeader().setVisible(False)
    header = table.horizontalHeader()          # sized once a search has said (sizing at every row is quadratic)
    header.setSectionResizeMode(QHeaderView.ResizeMode.Interactive)
    header.setStretchLastSection(True)
    return table
