"""Render ``resources/icons/kvscope.svg`` to the PNG sizes desktops ask for (run after editing the SVG)."""

import sys
from pathlib import Path

from PySide6.QtCore import Qt
from PySide6.QtGui import QGuiApplication, QImage, QPainter
from PySide6.QtSvg import QSvgRenderer

SIZES = (16, 24, 32, 48, 64, 128, 256, 512)


def main() -> None:
    app = QGuiApplication(sys.argv[:1])  # noqa: F841  (a GUI application must exist to paint)
    icons = Path(__file__).resolve().parent.parent / "resources" / "icons"
    renderer = QSvgRenderer(str(icons / "kvscope.svg"))
    for size in SIZES:
        image = QImage(size, size, QImage.Format.Format_ARGB32)
        image.fill(Qt.GlobalColor.transparent)
        painter = QPainter(image)
        painter.setRenderHint(QPainter.RenderHint.Antialiasing)
        renderer.render(painter)
        painter.end()
        image.save(str(icons / f"kvscope-{size}.png"))


if __name__ == "__main__":
    main()
