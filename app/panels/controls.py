"""Everything a user can tweak: model source, device, dtype, memory budget, prompt, sampling parameters, KV
cache; and the run buttons (Run, Stop, Step, Pause) with a slow-motion slider so an audience can follow. The
prompt and the run buttons come first: they are what a run needs, and what a small screen must show unscrolled.

The run settings live in ``app.state.run_settings.RunSettings``, not here: every edit writes it, and the widgets
follow it (a lecture scene's keys change it too). Widgets refuse invalid values by their ranges, and the
engine's ``GenerationParams`` checks again, so what reaches the engine is what the widgets show.
"""

from __future__ import annotations

from pathlib import Path

from PySide6.QtCore import QSettings, Qt, Signal
from PySide6.QtWidgets import (
    QCheckBox,
    QComboBox,
    QDoubleSpinBox,
    QFileDialog,
    QFormLayout,
    QGroupBox,
    QHBoxLayout,
    QLabel,
    QPlainTextEdit,
    QPushButton,
    QSizePolicy,
    QSlider,
    QVBoxLayout,
    QWidget,
)

from app.panels.details import Details
from app.state import requests as rq
from app.state.glossary import tip
from app.state.run_settings import (
    DEFAULT_PROMPT,
    MODEL_LIMITED,
    SLOW_MAX_MS,
    ModelChoice,
    RunSettings,
    none_choice,
    param_shape,
)
from app.views.resources import sample_prompts
from app.views.setting_widgets import control, narrow, read, show
from engine.facts.params import GenerationParams, LoadSettings
from engine.facts.validation import FieldShape, shape_of, shapes
from engine.serve.client import without_credentials

GIB = 1 << 30
MAX_BUDGET_GIB = 4096.0              # what the spin box offers (the declaration allows far more)


class ControlsPanel(QWidget):
    run_requested = Signal()
    stop_requested = Signal()
    step_requested = Signal()
    pause_toggled = Signal(bool)
    load_requested = Signal()
    found_requested = Signal()              # "On this computer…": the models and servers already here
    changed = Signal()                      # any setting the user changed (the window saves them soon after)

    def __init__(self, run_settings: RunSettings, model_choice: ModelChoice) -> None:
        super().__init__()
        self.run_settings, self.model_choice = run_settings, model_choice
        # --- model ---
        load = {shape.name: shape for shape in shapes(LoadSettings)}      # labels, help, choices and ranges
        self.model_box = QComboBox()
        self.model_box.setEditable(True)
        self.model_box.addItem(load["model"].default)
        self.model_box.setToolTip(said(load["model"]))
        self.folder_button = QPushButton("Folder…")
        self.gguf_button = QPushButton(".gguf…")
        self.found_button = QPushButton("On this computer…")
        self.found_button.setToolTip(FOUND_TIP)
        self.folder_button.clicked.connect(self._pick_folder)
        self.gguf_button.clicked.connect(self._pick_gguf)
        self.found_button.clicked.connect(self.found_requested.emit)
        self.device_box, self.dtype_box = (offered(load[name], list(load[name].text.choices)) for name in
                                           ("device", "dtype"))
        self.dtype_box.setToolTip(said(load["dtype"]) + "\n" + tip("quantization", "GGUF"))
        budget = load["memory_budget"]
        self.budget = QDoubleSpinBox()
        self.budget.setRange(0.0, min(budget.span.high / GIB, MAX_BUDGET_GIB))
        self.budget.setDecimals(2)
        self.budget.setSingleStep(0.05)
        self.budget.setSuffix(" GiB")
        self.budget.setSpecialValueText(budget.setting.special)
        self.budget.setToolTip(said(budget))
        self.deadline = control(load["deadline_s"])
        self.deadline.setDecimals(0)
        self.trust_box = control(load["trust_remote_code"])
        self.model_box.currentTextChanged.connect(lambda _t: self.trust_box.setChecked(False))
        self.load_button = QPushButton("Load model")
        self.load_button.clicked.connect(self._request_load)
        self.model_status = QLabel("No model loaded yet.")
        self.model_status.setTextFormat(Qt.TextFormat.PlainText)
        self.model_status.setWordWrap(True)
        self.pending = QLabel()                 # a choice made since the model loaded, not applied yet
        self.pending.setTextFormat(Qt.TextFormat.PlainText)
        self.pending.setWordWrap(True)
        self.pending.setStyleSheet("font-weight: bold;")
        self.pending.hide()
        model_group = self.model_group = QGroupBox("Model")
        form = QFormLayout(model_group)
        form.addRow(load["model"].setting.label, self.model_box)   # one widget per row: the dock stays narrow
        row = QHBoxLayout()
        row.addWidget(self.folder_button)
        row.addWidget(self.gguf_button)
        form.addRow("", row)
        form.addRow("", self.found_button)
        for name, widget in (("device", self.device_box), ("dtype", self.dtype_box), ("memory_budget", self.budget),
                             ("deadline_s", self.deadline)):
            form.addRow(load[name].setting.label, widget)
        form.addRow(self.trust_box)
        form.addRow(self.load_button)
        form.addRow(self.pending)
        form.addRow(self.model_status)
        self.model_details = Details()          # why this dtype and kernel: for who asks, not every reader
        form.addRow(self.model_details)

        # --- parameters: each control made from its declaration in engine.facts.params (range, step, unit, help,
        # the word for None, what it needs on, the texts offered): adding a run setting adds its control here ---
        self.setting_widgets: dict[str, QWidget] = {}
        self.none_boxes: dict[str, QCheckBox] = {}
        for shape in shapes(GenerationParams):
            if shape.setting is None:
                continue
            self.setting_widgets[shape.name] = offered(shape) if shape.base is str else control(shape)
            if none_choice(shape):
                box = self.none_boxes[shape.name] = QCheckBox(shape.setting.none)
                box.setToolTip(f"{shape.setting.none[:1].upper()}{shape.setting.none[1:]}: a new one each run "
                               "(reported with the run)")
        widgets = self.setting_widgets             # the handles shortcuts, the window and its tests reach them by
        self.max_tokens, self.temperature, self.top_k, self.top_p, self.seed = (
            widgets["max_new_tokens"], widgets["temperature"], widgets["top_k"], widgets["top_p"], widgets["seed"])
        self.kv_box, self.static_box, self.compile_box, self.chat_box, self.attention_box = (
            widgets["kv_cache"], widgets["static_cache"], widgets["compiled"], widgets["chat_template"],
            widgets["capture_attention"])
        self.kv_method_box, self.random_seed = widgets["kv_method"], self.none_boxes["seed"]

        # --- prompt ---
        self.samples = QComboBox()
        self.samples.addItem("Sample prompts…", "")
        for title, text in sample_prompts():
            self.samples.addItem(title, text)
        self.samples.activated.connect(self._use_sample)
        for box in (self.samples, self.model_box, *(w for w in widgets.values() if isinstance(w, QComboBox))):
            box.setSizeAdjustPolicy(QComboBox.SizeAdjustPolicy.AdjustToMinimumContentsLengthWithIcon)
            box.setMinimumContentsLength(8)
        self.prompt = QPlainTextEdit()
        self.prompt.setPlaceholderText("Type a prompt, then Ctrl+Enter to run it")
        # It takes the panel's spare height, a few lines at least: a preferred height of its own would make the
        # panel scroll on a screen where everything fits with a shorter box.
        self.prompt.setMinimumHeight(64)
        self.prompt.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Ignored)
        self.prompt.setPlainText(DEFAULT_PROMPT)
        prompt_group = QGroupBox("Prompt")
        pv = QVBoxLayout(prompt_group)
        pv.addWidget(self.samples)
        pv.addWidget(self.prompt, 1)

        params_group = QGroupBox("Generation")
        pf = QFormLayout(params_group)
        self.next_run = QLabel()           # the settings here that differ from the run shown: they are the next run's
        self.next_run.setTextFormat(Qt.TextFormat.PlainText)
        self.next_run.setWordWrap(True)
        self.next_run.setStyleSheet("font-weight: bold;")
        self.next_run.hide()
        pf.addRow(self.next_run)
        switches: list[QWidget] = []                # true/false settings, two to a row, in declared order
        for name, widget in widgets.items():
            if isinstance(widget, QCheckBox):
                switches.append(widget)
                continue
            _pair_rows(pf, switches)
            row = QHBoxLayout()
            row.addWidget(widget, 1)
            if name in self.none_boxes:
                row.addWidget(self.none_boxes[name])
            pf.addRow(param_shape(name).setting.label, row)
        _pair_rows(pf, switches)

        # --- run buttons ---
        self.run_button = QPushButton("Run  (Ctrl+Enter)")
        self.stop_button = QPushButton("Stop  (Esc)")
        self.step_button = QPushButton("Step  (F10)")
        self.pause_button = QPushButton("Pause  (F9)")
        self.pause_button.setCheckable(True)
        self.run_button.clicked.connect(self.run_requested)
        self.stop_button.clicked.connect(self.stop_requested)
        self.stop_button.setToolTip("Stops a run, an experiment or a replay (Esc; in a lecture scene Ctrl+.)")
        self.step_button.clicked.connect(self.step_requested)
        self.pause_button.toggled.connect(self._pause_toggled)
        self.slow = QSlider(Qt.Orientation.Horizontal)
        self.slow.setRange(0, SLOW_MAX_MS)
        self.slow.setSingleStep(25)
        self.slow.setPageStep(100)
        self.slow_label = QLabel()
        self.slow.valueChanged.connect(self._slow_changed)
        run_group = QGroupBox("Run")
        rv = QVBoxLayout(run_group)
        row = QHBoxLayout()
        row.addWidget(self.run_button)
        row.addWidget(self.stop_button)
        rv.addLayout(row)
        row = QHBoxLayout()
        row.addWidget(self.step_button)
        row.addWidget(self.pause_button)
        rv.addLayout(row)
        row = QHBoxLayout()
        row.addWidget(QLabel("Slow motion"))
        row.addWidget(self.slow, 1)
        row.addWidget(self.slow_label)
        rv.addLayout(row)
        self._slow_changed(0)

        layout = QVBoxLayout(self)
        layout.setContentsMargins(4, 4, 4, 4)
        # What a run needs comes first (the prompt and the buttons that run it): on a projector's 1280x720 they
        # are on screen without scrolling; the model, loaded once, sits last.
        layout.addWidget(prompt_group, 1)
        layout.addWidget(run_group)
        layout.addWidget(params_group)
        layout.addWidget(model_group)
        self._shown_loaded: rq.Load | None = None
        self._writes = {
            self.prompt.textChanged: lambda: {"prompt": self.prompt.toPlainText()},
            self.slow.valueChanged: lambda: {"slow_ms": self.slow.value()},
            **{changed_signal(w): lambda n=name, w=w: {n: read(w)} for name, w in widgets.items()},
            **{b.toggled: lambda n=name, b=b: {none_choice(param_shape(n)): b.isChecked()}
               for name, b in self.none_boxes.items()}}
        for signal, values in self._writes.items():
            signal.connect(lambda *_a, v=values: self._write(v()))
        for signal in (self.budget.valueChanged, self.deadline.valueChanged):
            signal.connect(lambda *_: self.changed.emit())
        run_settings.subscribe(self._settings_changed)
        model_choice.subscribe(self._model_changed)
        for signal in (self.model_box.currentTextChanged, self.device_box.currentTextChanged,
                       self.dtype_box.currentTextChanged, self.budget.valueChanged, self.deadline.valueChanged,
                       self.trust_box.toggled):
            signal.connect(lambda *_a: self._ask())
        self._ask()
        self.set_running(False)

    # --- values -------------------------------------------------------------------------------------------
    def _settings_changed(self, names: set[str]) -> None:
        if "limits" in names:
            self.follow_limits()
        self.follow()

    def _write(self, values: dict) -> None:
        self.run_settings.update(**values)
        self.changed.emit()

    def follow(self) -> None:
        """Show what the run settings say (a scene's keys, a restored file), without writing them back."""
        c = self.run_settings.choices
        for name, widget in self.setting_widgets.items():
            show(widget, getattr(c, name))
            needs = param_shape(name).setting.needs
            if needs:
                widget.setEnabled(bool(getattr(c, needs)))
        for name, box in self.none_boxes.items():
            none = getattr(c, none_choice(param_shape(name)))
            show(box, none)
            self.setting_widgets[name].setEnabled(not none)
        show(self.slow, c.slow_ms)
        if self.prompt.toPlainText() != c.prompt:
            self.prompt.blockSignals(True)
            self.prompt.setPlainText(c.prompt)
            self.prompt.blockSignals(False)
        self._slow_changed(self.slow.value())

    def prompt_text(self) -> str:
        return self.prompt.toPlainText()

    def model_request(self) -> rq.Load:
        return rq.Load(self.model_box.currentText().strip() or "embedded", self.device_box.currentText(),
                       self.dtype_box.currentText(), self.trust_box.isChecked(),
                       memory_budget=int(self.budget.value() * GIB), deadline_s=float(self.deadline.value()))

    def _model_changed(self, _names: set[str]) -> None:
        """A load succeeded: the controls show what loaded (a --model, --device or --dtype from the command line
        included); only a model that loaded is offered again at the next launch (without any user:password).
        Whatever differs from the loaded model afterwards is shown as pending."""
        loaded = self.model_choice.loaded
        if loaded is not None and loaded != self._shown_loaded:
            self._shown_loaded = loaded
            model = without_credentials(loaded.model)
            trusted = self.trust_box.isChecked()
            for box, text in ((self.model_box, model), (self.device_box, loaded.device),
                              (self.dtype_box, loaded.dtype)):
                if box.currentText() != text:
                    box.setCurrentText(text)
            self.trust_box.setChecked(trusted)
            self.changed.emit()
        pending = self.model_choice.pending_text()
        self.pending.setText(f"Pending: {pending}" if pending else "")
        self.pending.setVisible(bool(pending))

    def _ask(self) -> None:
        self.model_choice.ask(self.model_request())

    def follow_limits(self) -> None:
        """The loaded model's limits narrow the two controls they apply to (declared ranges otherwise)."""
        limits = self.run_settings.limits
        for name in MODEL_LIMITED:
            box = self.setting_widgets[name]
            box.blockSignals(True)
            narrow(box, param_shape(name), limits.get(name))
            box.blockSignals(False)

    def show_model(self, text: str, details: str = "") -> None:
        """The model in plain words; the reasons behind its dtype and kernels behind Details."""
        self.model_status.setText(text)
        self.model_details.set_text(details)

    def set_running(self, running: bool, busy: bool = False) -> None:
        """Buttons that make sense now: Run when idle, Stop/Pause while running, Step in both."""
        self.run_button.setEnabled(not running and not busy)
        self.load_button.setEnabled(not running and not busy)
        self.stop_button.setEnabled(running or busy)
        self.pause_button.setEnabled(running)
        self.step_button.setEnabled(not busy or running)
        if not running and self.pause_button.isChecked():
            self.pause_button.blockSignals(True)
            self.pause_button.setChecked(False)
            self.pause_button.blockSignals(False)

    def show_next_run(self, number: int | None, differences: list[str]) -> None:
        """Settings that differ from those the run shown (``#number``) used apply to the next run: said so, with
        what the shown run used, so a reader never takes them for the shown run's."""
        text = (f"For the next run; run #{number} shown used other settings: {'; '.join(differences)}"
                if number is not None and differences else "")
        if self.next_run.text() != text:
            self.next_run.setText(text)
        self.next_run.setVisible(bool(text))

    def show_steering(self, steering: str) -> None:
        """The Pause control says what pressing it does to the run as it is now: a paused or single-stepped run is
        resumed, a running one paused."""
        held = bool(steering)
        self.pause_button.blockSignals(True)
        self.pause_button.setChecked(held)
        self.pause_button.setText("Resume  (F9)" if held else "Pause  (F9)")
        self.pause_button.blockSignals(False)

    # --- settings -----------------------------------------------------------------------------------------
    def save(self, s: QSettings) -> None:
        """The model it loaded last and the sources offered (never with credentials); the run settings are
        saved by the window from ``RunSettings``."""
        loaded = self.model_choice.loaded
        if loaded is not None:
            s.setValue("controls/model", without_credentials(loaded.model))
            s.setValue("controls/device", loaded.device)
            s.setValue("controls/dtype", loaded.dtype)
        s.setValue("controls/models", [without_credentials(self.model_box.itemText(i))
                                       for i in range(self.model_box.count())][:10])
        s.setValue("controls/budget_gib", self.budget.value())
        s.setValue("controls/deadline_s", self.deadline.value())

    def restore(self, s: QSettings) -> None:
        models = s.value("controls/models", [], list) or []
        for text in models:
            if isinstance(text, str) and text and self.model_box.findText(text) < 0:
                self.model_box.addItem(without_credentials(text))
        self.model_box.setCurrentText(without_credentials(str(s.value("controls/model", "embedded"))))
        for key, box in (("device", self.device_box), ("dtype", self.dtype_box)):
            index = box.findText(str(s.value(f"controls/{key}", "auto")))
            box.setCurrentIndex(max(index, 0))
        self.budget.setValue(_number(s.value("controls/budget_gib", 0.0), 0.0, self.budget.maximum(), 0.0))
        deadline = shape_of(LoadSettings, "deadline_s")
        self.deadline.setValue(_number(s.value("controls/deadline_s", deadline.default), deadline.span.low,
                                       deadline.span.high, deadline.default))

    # --- handlers -----------------------------------------------------------------------------------------
    def _use_sample(self, index: int) -> None:
        text = self.samples.itemData(index)
        if text:
            self.prompt.setPlainText(text)
        self.samples.setCurrentIndex(0)

    def _pick_folder(self) -> None:
        folder = QFileDialog.getExistingDirectory(self, "Hugging Face model folder (with config.json)")
        if folder:
            self.set_model(folder)

    def _pick_gguf(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self, "GGUF model file", "", "GGUF models (*.gguf)")
        if path:
            self.set_model(path)

    def forget_missing_model(self) -> str | None:
        """The remembered model, if it is a local path that is no longer there (a folder deleted, a disk not
        mounted): the built-in model is chosen instead, and the path returned to say so. None: nothing changed."""
        remembered = self.model_box.currentText().strip()
        path = Path(remembered).expanduser()
        if not remembered.startswith(("/", "~", ".")) or path.exists():
            return None
        self.set_model(shape_of(LoadSettings, "model").default)
        return remembered

    def show_found(self, counts: str) -> None:
        """What the background search found so far ("3 models, 1 server"), said by the button's tooltip: its
        text stays short, so the dock never widens with a count."""
        self.found_button.setToolTip(FOUND_TIP + (f"\nFound so far: {counts}." if counts else ""))

    def set_model(self, text: str) -> None:
        """Name ``text`` in the Model box (offered again from its list); Load model loads it."""
        if self.model_box.findText(text) < 0:
            self.model_box.addItem(text)
        self.model_box.setCurrentText(text)

    def _request_load(self) -> None:
        self.load_requested.emit()

    def _pause_toggled(self, paused: bool) -> None:
        self.pause_toggled.emit(paused)

    def _slow_changed(self, ms: int) -> None:
        self.slow_label.setText(f"{ms} ms/token" if ms else "off")


FOUND_TIP = ("The models already on disk (the Hugging Face cache, Ollama, LM Studio, llama.cpp's cache) and the "
             "servers running here (Ctrl+Shift+O)")


def offered(shape: FieldShape, only: list[str] | None = None) -> QComboBox:
    """A text setting's control: an editable list of the texts its declaration offers (any text its check accepts
    may be typed), or, given ``only``, a list of just those (its declared choices)."""
    box = QComboBox()
    box.setEditable(only is None)
    box.addItems(only if only is not None else list(shape.setting.offered))
    box.setCurrentText(str(shape.default))
    box.setToolTip(said(shape))
    box.setInsertPolicy(QComboBox.InsertPolicy.NoInsert)
    return box


def said(shape: FieldShape) -> str:
    """A setting's declared help as a tooltip says it."""
    return shape.setting.help[:1].upper() + shape.setting.help[1:]


def changed_signal(widget: QWidget):
    """The signal a setting's control sends when the user changes it."""
    if isinstance(widget, QCheckBox):
        return widget.toggled
    if isinstance(widget, QComboBox):
        return widget.currentTextChanged
    return widget.valueChanged


def _pair_rows(form: QFormLayout, switches: list[QWidget]) -> None:
    """The check boxes gathered so far, two to a row; the list is emptied."""
    for i in range(0, len(switches), 2):
        row = QHBoxLayout()
        for box in switches[i:i + 2]:
            row.addWidget(box)
        form.addRow(row)
    switches.clear()


def _number(value: object, low: float, high: float, default: float) -> float:
    """A stored number within [low, high], else ``default`` (a settings file is data from anywhere)."""
    try:
        number = float(str(value))
    except (TypeError, ValueError):
        return default
    return number if low <= number <= high else default
