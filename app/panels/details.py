"""A panel's reasons, on demand: the first line of a panel says what a newcomer needs (the figure and its label);
why a kernel, a dtype or a ceiling was chosen is one click away, not in everybody's first reading."""

from __future__ import annotations

from PySide6.QtCore import Qt
from PySide6.QtWidgets import QLabel, QToolButton, QVBoxLayout, QWidget

SHOW, HIDE = "Details ▸", "Details ▾"


class Details(QWidget):
    """A "Details" toggle over a wrapped label; hidden whole while there is nothing to tell."""

    def __init__(self, rich: bool = False) -> None:
        super().__init__()
        self.toggle = QToolButton()
        self.toggle.setText(SHOW)
        self.toggle.setCheckable(True)
        self.toggle.setAutoRaise(True)
        self.toggle.setToolButtonStyle(Qt.ToolButtonStyle.ToolButtonTextOnly)
        self.label = QLabel()
        self.label.setTextFormat(Qt.TextFormat.RichText if rich else Qt.TextFormat.PlainText)
        self.label.setWordWrap(True)
        self.label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.label.hide()
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.setSpacing(0)
        layout.addWidget(self.toggle, 0, Qt.AlignmentFlag.AlignLeft)
        layout.addWidget(self.label)
        self.toggle.toggled.connect(self._toggled)
        self.hide()

    def set_text(self, text: str) -> None:
        if self.label.text() != text:
            self.label.setText(text)
        self.setVisible(bool(text))

    def text(self) -> str:
        return self.label.text()

    def _toggled(self, shown: bool) -> None:
        self.toggle.setText(HIDE if shown else SHOW)
        self.label.setVisible(shown)
