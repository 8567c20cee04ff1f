"""Getting data out: panels to PNG or SVG, a run's per-step data to CSV or JSON."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

from app.state.store import ExperimentRecord, RunRecord
from engine.facts import kvformula
from engine.facts.events import to_dict
from engine.facts.validation import shapes
from engine.facts.vocabulary import MORE
from engine.store.files import write_bytes

CSV_COLUMNS = ("step", "position", "token_id", "text", "phase", "special", "latency_ms", "forward_ms", "t_ms",
               "prob", "raw_prob", "kv_bytes")


def run_csv(run: RunRecord) -> str:
    out = io.StringIO()
    writer = csv.writer(out)
    writer.writerow(CSV_COLUMNS)
    for s in run.steps:
        writer.writerow([s.step, s.position, s.token_id, s.text, s.phase, int(s.special), f"{s.latency_ms:.4f}",
                         f"{s.forward_ms:.4f}", f"{s.t_ms:.4f}", f"{s.prob:.6g}", f"{s.raw_prob:.6g}",
                         kvformula.held_bytes(s.kv_bytes_per_layer)])
    return out.getvalue()


def experiment_csv(record: ExperimentRecord) -> str:
    """One row per measured point: the series, then every figure the lesson's points declare (in declared order),
    then any figure a point names at run time (a server's per-slot figures); absent figures are empty cells."""
    from engine import lessons

    declared = lessons.BY_KIND[record.kind].points if record.kind in lessons.BY_KIND else ()
    columns = [s.name for kind in declared for s in shapes(kind) if s.name != MORE]
    columns = list(dict.fromkeys(columns))
    for point in record.points:
        columns += [k for k in point.values if k not in columns]
    out = io.StringIO()
    writer = csv.writer(out)
    writer.writerow(["series", *columns])
    for point in record.points:
        writer.writerow([point.series, *(point.values.get(c, "") for c in columns)])
    return out.getvalue()


def run_json(run: RunRecord) -> str:
    """The run as one JSON document: settings, model facts, summary and every event."""
    summary = run.summary()
    return json.dumps({
        "run": run.number, "label": run.label, "reason": run.reason,
        "model": to_dict(run.model), "params": to_dict(run.started.params),
        "summary": {**to_dict(summary), "prefill_tok_s": summary.prefill_tok_s,
                    "decode_tok_s": summary.decode_tok_s},
        "events": [to_dict(e) for e in run.events],
    }, ensure_ascii=False, indent=1)


def export_widget(widget, path: str | Path) -> Path:
    """A panel, its header numbers and captions included, to PNG (at twice its size on screen) or SVG (text
    and lines stay vectors), chosen by the file's suffix; in the SVG every plot's data is cut to its axes. Drawn
    in memory, then written atomically: a full disk leaves the previous file as it was."""
    from PySide6.QtCore import QBuffer, QByteArray, QIODevice, QPoint, QRect, QSize
    from PySide6.QtGui import QImage, QPainter
    from PySide6.QtSvg import QSvgGenerator
    from PySide6.QtWidgets import QWidget

    from app.views.svgclip import cut_to_axes

    target = Path(path)
    suffix = target.suffix.lower()
    size = widget.size()
    data = QByteArray()
    buffer = QBuffer(data)
    buffer.open(QIODevice.OpenModeFlag.WriteOnly)
    if suffix == ".svg":
        # SVG 1.1, not Qt's default SVG Tiny 1.2, so the clip paths are written for readers that honour them.
        generator = QSvgGenerator(QSvgGenerator.SvgVersion.Svg11)
        generator.setOutputDevice(buffer)
        generator.setSize(size)
        generator.setViewBox(QRect(0, 0, size.width(), size.height()))
        generator.setTitle("KVScope")
        painter = QPainter(generator)
        try:
            with cut_to_axes(widget):                   # readers that ignore clip paths still see nothing outside
                QWidget.render(widget, painter, QPoint())   # QWidget's: a chart view has its own
        finally:
            painter.end()
        # An empty clip region is written as d="", which SVG readers reject ("invalid path data"); a path to
        # nowhere means the same thing and parses.
        text = bytes(data).decode("utf-8").replace(' d=""', ' d="M0,0 Z"')
        return write_bytes(target, text.encode("utf-8"), "the export")
    if suffix in (".png", ".jpg", ".jpeg"):
        image = QImage(QSize(size.width() * 2, size.height() * 2), QImage.Format.Format_ARGB32)
        image.setDevicePixelRatio(2.0)
        image.fill(widget.palette().window().color())
        painter = QPainter(image)
        try:
            QWidget.render(widget, painter, QPoint())
        finally:
            painter.end()
        if not image.save(buffer, "PNG" if suffix == ".png" else "JPG"):
            raise OSError(f"could not encode {target.name}")
        return write_bytes(target, bytes(data), "the export")
    raise ValueError(f"Panels export to .png or .svg, not {suffix or 'a file without a suffix'}")
