import csv
import io
import json

import pytest

from app.views import export
from tests.app.conftest import run_and_wait


@pytest.fixture
def finished(qtbot, window):
    window.controls.max_tokens.setValue(7)
    return run_and_wait(qtbot, window)


@pytest.mark.parametrize("suffix, magic", [(".png", b"\x89PNG"), (".svg", b"<?xml")])
@pytest.mark.parametrize("panel", ["timing", "kv", "sampling"])
def test_every_chart_exports_to_png_and_svg(window, finished, tmp_path, panel, suffix, magic):
    path = export.export_widget(getattr(window, panel), tmp_path / f"chart{suffix}")
    data = path.read_bytes()
    assert data.startswith(magic) and len(data) > 2000
    if suffix == ".svg":
        assert b"<svg" in data and (b"latency" in data or b"layer" in data or b"probability" in data)


def test_unknown_chart_format_is_refused(window, finished, tmp_path):
    with pytest.raises(ValueError, match="png or .svg"):
        export.export_widget(window.timing, tmp_path / "chart.gif")


def test_run_data_as_csv_and_json(finished):
    rows = list(csv.reader(io.StringIO(export.run_csv(finished))))
    assert tuple(rows[0]) == export.CSV_COLUMNS and len(rows) == finished.n_steps + 1
    assert [int(r[1]) for r in rows[1:]] == [s.position for s in finished.steps]
    doc = json.loads(export.run_json(finished))
    assert doc["params"]["max_new_tokens"] == 7 and len(doc["events"]) == len(finished.events)
    assert doc["summary"]["generated_tokens"] == finished.n_steps


def test_file_export_writes_the_selected_runs_spans(qtbot, window, tmp_path, monkeypatch):
    from PySide6.QtWidgets import QFileDialog

    from tests.app.conftest import run_and_wait
    from tests.otlp_spans import attributes, read_back

    window.controls.max_tokens.setValue(3)
    run = run_and_wait(qtbot, window)
    out = tmp_path / "run.otlp.json"
    monkeypatch.setattr(QFileDialog, "getSaveFileName", lambda *a, **k: (str(out), "OTLP/JSON (*.json)"))
    window.files.export_otlp(None)
    (root,) = [s for s in read_back(out) if s.name.startswith("chat ")]
    assert attributes(root)["kvscope.run_id"] == run.run_id
    assert attributes(root)["gen_ai.usage.output_tokens"] == run.n_steps
