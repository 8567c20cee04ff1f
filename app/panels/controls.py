"""Everything a user can tweak: model source, device, dtype, prompt, sampling parameters, KV cache; and the
run buttons (Run, Stop, Step, Pause) with a slow-motion slider so an audience can follow.

Widgets refuse invalid values by their ranges, and ``params()`` builds a ``GenerationParams``, which checks
itself again, so what reaches the engine is what the widgets show.
"""

from __future__ import annotations

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
    QSlider,
    QSpinBox,
    QVBoxLayout,
    QWidget,
)

from app.resources import sample_prompts
from engine.models import DEVICES, DTYPES
from engine.params import GenerationParams

SEED_MAX = 2**31 - 1


class ControlsPanel(QWidget):
    run_requested = Signal()
    stop_requested = Signal()
    step_requested = Signal()
    pause_toggled = Signal(bool)
    load_requested = Signal(str, str, str, bool)
    delay_changed = Signal(float)
    changed = Signal()                      # any setting the user changed (the window saves them soon after)

    def __init__(self) -> None:
        super().__init__()
        # --- model ---
        self.model_box = QComboBox()
        self.model_box.setEditable(True)
        self.model_box.addItem("embedded")
        self.model_box.setToolTip("'embedded' (SmolLM2-135M-Instruct), a Hugging Face folder, a .gguf file, a "
                                  "hub id such as HuggingFaceTB/SmolLM2-360M-Instruct, or a serving engine's "
                                  "address such as http://127.0.0.1:8080 (llama-server, vLLM, TGI)")
        self.folder_button = QPushButton("Folder…")
        self.gguf_button = QPushButton(".gguf…")
        self.folder_button.clicked.connect(self._pick_folder)
        self.gguf_button.clicked.connect(self._pick_gguf)
        self.device_box = QComboBox()
        self.device_box.addItems(list(DEVICES))
        self.dtype_box = QComboBox()
        self.dtype_box.addItems(list(DTYPES))
        self.trust_box = QCheckBox("Allow this model's own code")
        self.trust_box.setToolTip("trust_remote_code: runs Python shipped with the model. Allowed per model: "
                                  "changing the model source clears it, and it is never remembered")
        self.model_box.currentTextChanged.connect(lambda _t: self.trust_box.setChecked(False))
        self.load_button = QPushButton("Load model")
        self.load_button.clicked.connect(self._request_load)
        self.model_status = QLabel("No model loaded yet.")
        self.model_status.setTextFormat(Qt.TextFormat.PlainText)
        self.model_status.setWordWrap(True)
        model_group = self.model_group = QGroupBox("Model")
        form = QFormLayout(model_group)
        form.addRow("Source", self.model_box)          # one widget per row: the dock stays narrow (330 px)
        row = QHBoxLayout()
        row.addWidget(self.folder_button)
        row.addWidget(self.gguf_button)
        form.addRow("", row)
        form.addRow("Device", self.device_box)
        form.addRow("dtype", self.dtype_box)
        form.addRow(self.trust_box)
        form.addRow(self.load_button)
        form.addRow(self.model_status)

        # --- prompt ---
        self.samples = QComboBox()
        self.samples.addItem("Sample prompts…", "")
        for title, text in sample_prompts():
            self.samples.addItem(title, text)
        self.samples.activated.connect(self._use_sample)
        for box in (self.samples, self.model_box):
            box.setSizeAdjustPolicy(QComboBox.SizeAdjustPolicy.AdjustToMinimumContentsLengthWithIcon)
            box.setMinimumContentsLength(8)
        self.prompt = QPlainTextEdit()
        self.prompt.setPlaceholderText("Type a prompt, then Ctrl+Enter to run it")
        self.prompt.setPlainText("hey, what is continuous batching?")
        self.chat_box = QCheckBox("Chat template")
        self.chat_box.setChecked(True)
        self.chat_box.setToolTip("Wrap the prompt as a user message with the model's chat template; off = raw text")
        prompt_group = QGroupBox("Prompt")
        pv = QVBoxLayout(prompt_group)
        row = QHBoxLayout()
        row.addWidget(self.samples, 1)
        row.addWidget(self.chat_box)
        pv.addLayout(row)
        pv.addWidget(self.prompt, 1)

        # --- parameters ---
        self.max_tokens = QSpinBox()
        self.max_tokens.setRange(1, 8192)
        self.max_tokens.setValue(128)
        self.max_tokens.setSuffix(" tokens")
        self.temperature = QDoubleSpinBox()
        self.temperature.setRange(0.0, 2.0)
        self.temperature.setSingleStep(0.05)
        self.temperature.setDecimals(2)
        self.temperature.setSpecialValueText("0 (greedy)")
        self.top_k = QSpinBox()
        self.top_k.setRange(0, 49152)
        self.top_k.setSpecialValueText("off")
        self.top_p = QDoubleSpinBox()
        self.top_p.setRange(0.01, 1.0)
        self.top_p.setSingleStep(0.05)
        self.top_p.setDecimals(2)
        self.top_p.setValue(1.0)
        self.seed = QSpinBox()
        self.seed.setRange(0, SEED_MAX)
        self.seed.setValue(42)
        self.random_seed = QCheckBox("random")
        self.random_seed.toggled.connect(lambda on: self.seed.setEnabled(not on))
        self.kv_box = QCheckBox("KV cache")
        self.kv_box.setChecked(True)
        self.kv_box.setToolTip("Off: every decode step recomputes the whole sequence (watch the latency grow)")
        self.static_box = QCheckBox("static")
        self.static_box.setToolTip("Static KV cache: allocate it for prompt + max new tokens before the first "
                                   "token, as compiled decoding needs: the heatmap outlines what is allocated but "
                                   "unused")
        self.compile_box = QCheckBox("compiled decode")
        self.compile_box.setToolTip("Decode through torch.compile with CUDA graphs (on a GPU); the first step "
                                    "compiles and is timed apart. On a CPU it compiles slowly and rarely helps")
        self.static_box.toggled.connect(lambda on: self.compile_box.setEnabled(on))
        self.compile_box.setEnabled(False)
        self.attention_box = QCheckBox("record attention")
        self.attention_box.setToolTip("Keep each step's attention weights over the cached positions for the "
                                      "Attention view: costs time per step (shown there) and trace space")
        params_group = QGroupBox("Generation")
        pf = QFormLayout(params_group)
        pf.addRow("Max new tokens", self.max_tokens)
        pf.addRow("Temperature", self.temperature)
        pf.addRow("Top-k", self.top_k)
        pf.addRow("Top-p", self.top_p)
        row = QHBoxLayout()
        row.addWidget(self.seed, 1)
        row.addWidget(self.random_seed)
        pf.addRow("Seed", row)
        row = QHBoxLayout()
        row.addWidget(self.kv_box)
        row.addWidget(self.static_box)
        pf.addRow(row)
        row = QHBoxLayout()
        row.addWidget(self.compile_box)
        row.addWidget(self.attention_box)
        pf.addRow(row)

        # --- run buttons ---
        self.run_button = QPushButton("Run  (Ctrl+Enter)")
        self.stop_button = QPushButton("Stop  (Esc)")
        self.step_button = QPushButton("Step  (F10)")
        self.pause_button = QPushButton("Pause  (F9)")
        self.pause_button.setCheckable(True)
        self.run_button.clicked.connect(self.run_requested)
        self.stop_button.clicked.connect(self.stop_requested)
        self.step_button.clicked.connect(self.step_requested)
        self.pause_button.toggled.connect(self._pause_toggled)
        self.slow = QSlider(Qt.Orientation.Horizontal)
        self.slow.setRange(0, 1000)
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
        layout.addWidget(model_group)
        layout.addWidget(prompt_group, 1)
        layout.addWidget(params_group)
        layout.addWidget(run_group)
        self.loaded: tuple[str, str, str] | None = None
        for signal in (self.prompt.textChanged, self.max_tokens.valueChanged, self.temperature.valueChanged,
                       self.top_k.valueChanged, self.top_p.valueChanged, self.seed.valueChanged,
                       self.random_seed.toggled, self.kv_box.toggled, self.chat_box.toggled, self.attention_box.toggled,
                       self.slow.valueChanged):
            signal.connect(lambda *_: self.changed.emit())
        self.set_running(False)

    # --- values -------------------------------------------------------------------------------------------
    def params(self) -> GenerationParams:
        return GenerationParams(
            max_new_tokens=self.max_tokens.value(), temperature=round(self.temperature.value(), 4),
            top_k=self.top_k.value(), top_p=round(self.top_p.value(), 4),
            seed=None if self.random_seed.isChecked() else self.seed.value(),
            kv_cache=self.kv_box.isChecked(), chat_template=self.chat_box.isChecked(),
            static_cache=self.static_box.isChecked() and self.kv_box.isChecked(),
            compiled=self.compile_box.isChecked() and self.static_box.isChecked() and self.kv_box.isChecked(),
            capture_attention=self.attention_box.isChecked())

    def prompt_text(self) -> str:
        return self.prompt.toPlainText()

    def model_request(self) -> tuple[str, str, str, bool]:
        return (self.model_box.currentText().strip() or "embedded", self.device_box.currentText(),
                self.dtype_box.currentText(), self.trust_box.isChecked())

    def remember_model(self, model: str, device: str, dtype: str) -> None:
        """Called when a load succeeded: only a model that loaded is offered again at the next launch."""
        self.loaded = (model, device, dtype)
        if self.model_box.currentText() != model:      # a --model / --server from the command line shows in the box
            trusted = self.trust_box.isChecked()
            self.model_box.setCurrentText(model)
            self.trust_box.setChecked(trusted)
        self.changed.emit()

    def set_model_limits(self, max_context: int, vocab_size: int, has_chat_template: bool = True) -> None:
        self.max_tokens.setMaximum(max(1, max_context - 1))
        self.top_k.setMaximum(vocab_size)

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

    def set_paused(self, paused: bool) -> None:
        self.pause_button.blockSignals(True)
        self.pause_button.setChecked(paused)
        self.pause_button.setText("Resume  (F9)" if paused else "Pause  (F9)")
        self.pause_button.blockSignals(False)

    # --- settings -----------------------------------------------------------------------------------------
    def save(self, s: QSettings) -> None:
        if self.loaded is not None:
            model, device, dtype = self.loaded
            s.setValue("controls/model", model)
            s.setValue("controls/device", device)
            s.setValue("controls/dtype", dtype)
        s.setValue("controls/models", [self.model_box.itemText(i) for i in range(self.model_box.count())][:10])
        s.setValue("controls/prompt", self.prompt.toPlainText())
        for key, value in (("max_tokens", self.max_tokens.value()), ("temperature", self.temperature.value()),
                           ("top_k", self.top_k.value()), ("top_p", self.top_p.value()),
                           ("seed", self.seed.value()), ("random_seed", self.random_seed.isChecked()),
                           ("kv_cache", self.kv_box.isChecked()), ("chat", self.chat_box.isChecked()),
                           ("attention", self.attention_box.isChecked()), ("slow_ms", self.slow.value())):
            s.setValue(f"controls/{key}", value)

    def restore(self, s: QSettings) -> None:
        models = s.value("controls/models", [], list) or []
        for text in models:
            if text and self.model_box.findText(text) < 0:
                self.model_box.addItem(text)
        self.model_box.setCurrentText(s.value("controls/model", "embedded", str))
        for key, box in (("device", self.device_box), ("dtype", self.dtype_box)):
            index = box.findText(s.value(f"controls/{key}", "auto", str))
            box.setCurrentIndex(max(index, 0))
        self.prompt.setPlainText(s.value("controls/prompt", self.prompt.toPlainText(), str))
        self.max_tokens.setValue(s.value("controls/max_tokens", self.max_tokens.value(), int))
        self.temperature.setValue(s.value("controls/temperature", self.temperature.value(), float))
        self.top_k.setValue(s.value("controls/top_k", self.top_k.value(), int))
        self.top_p.setValue(s.value("controls/top_p", self.top_p.value(), float))
        self.seed.setValue(s.value("controls/seed", self.seed.value(), int))
        self.random_seed.setChecked(s.value("controls/random_seed", False, bool))
        self.kv_box.setChecked(s.value("controls/kv_cache", True, bool))
        self.chat_box.setChecked(s.value("controls/chat", True, bool))
        self.attention_box.setChecked(s.value("controls/attention", False, bool))
        self.slow.setValue(s.value("controls/slow_ms", 0, int))

    # --- handlers -----------------------------------------------------------------------------------------
    def _use_sample(self, index: int) -> None:
        text = self.samples.itemData(index)
        if text:
            self.prompt.setPlainText(text)
        self.samples.setCurrentIndex(0)

    def _pick_folder(self) -> None:
        folder = QFileDialog.getExistingDirectory(self, "Hugging Face model folder (with config.json)")
        if folder:
            self._set_model(folder)

    def _pick_gguf(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self, "GGUF model file", "", "GGUF models (*.gguf)")
        if path:
            self._set_model(path)

    def _set_model(self, text: str) -> None:
        if self.model_box.findText(text) < 0:
            self.model_box.addItem(text)
        self.model_box.setCurrentText(text)

    def _request_load(self) -> None:
        self.load_requested.emit(*self.model_request())

    def _pause_toggled(self, paused: bool) -> None:
        self.set_paused(paused)
        self.pause_toggled.emit(paused)

    def _slow_changed(self, ms: int) -> None:
        self.slow_label.setText(f"{ms} ms/token" if ms else "off")
        self.delay_changed.emit(ms / 1000.0)
