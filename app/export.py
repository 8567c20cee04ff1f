"""Getting data out: charts to PNG or SVG, a run's per-step data to CSV or JSON."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

from app.store import ExperimentRecord, RunRecord
from engine.events import to_dict

CSV_COLUMNS = ("step", "position", "token_id", "text", "phase", "special", "latency_ms", "forward_ms", "t_ms",
               "prob", "raw_prob", "kv_bytes")


def run_csv(run: RunRecord) -> str:
    out = io.StringIO()
    writer = csv.writer(out)
    writer.writerow(CSV_COLUMNS)
    for s in run.steps:
        writer.writerow([s.step, s.position, s.token_id, s.text, s.phase, int(s.special), f"{s.latency_ms:.4f}",
                         f"{s.forward_ms:.4f}", f"{s.t_ms:.4f}", f"{s.prob:.6g}", f"{s.raw_prob:.6g}",
                         sum(map(sum, s.kv_bytes_per_layer))])
    return out.getvalue()


def experiment_csv(record: ExperimentRecord) -> str:
    """One row per measured point; columns are the union of the points' values, in first-seen order."""
    columns: list[str] = []
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


def write_text(path: str | Path, text: str) -> Path:
    target = Path(path)
    target.write_text(text, encoding="utf-8")
    return target


def export_chart(item: object, path: str | Path) -> Path:
    """A pyqtgraph item (a plot or a whole layout) to PNG or SVG, chosen by the file's suffix."""
    import pyqtgraph.exporters as exporters

    target = Path(path)
    suffix = target.suffix.lower()
    if suffix == ".svg":
        return _export_svg(item, target)
    if suffix in (".png", ".jpg", ".jpeg"):
        exporter = exporters.ImageExporter(item)
        exporter.parameters()["width"] = int(exporter.parameters()["width"]) * 2     # crisp, same proportions
        exporter.export(str(target))
        return target
    raise ValueError(f"Charts export to .png or .svg, not {suffix or 'a file without a suffix'}")


def _export_svg(item: object, target: Path) -> Path:
    """Qt's own SVG generator: pyqtgraph's SVGExporter cannot parse the paths Qt 6.11 writes
    (pyqtgraph issue #3485), and this keeps lines and text as vectors just the same."""
    from PySide6.QtCore import QRectF, QSize
    from PySide6.QtGui import QPainter
    from PySide6.QtSvg import QSvgGenerator

    source = item.sceneBoundingRect()
    size = QSize(int(source.width()), int(source.height()))
    generator = QSvgGenerator()
    generator.setFileName(str(target))
    generator.setSize(size)
    generator.setViewBox(QRectF(0, 0, size.width(), size.height()))
    generator.setTitle("KVScope chart")
    painter = QPainter(generator)
    try:
        item.scene().render(painter, QRectF(0, 0, size.width(), size.height()), source)
    finally:
        painter.end()
    if not target.is_file():
        raise OSError(f"could not write {target}")
    return target
