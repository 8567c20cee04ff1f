"""The experiments, one tab each: settings, Run / Cancel with progress, the measured chart beside what the
cost model predicts, a table of the numbers and a few sentences on what they show."""

from __future__ import annotations

from html import escape

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import (
    QComboBox,
    QDoubleSpinBox,
    QFormLayout,
    QFrame,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QLineEdit,
    QProgressBar,
    QPushButton,
    QScrollArea,
    QSlider,
    QSpinBox,
    QTableWidget,
    QTableWidgetItem,
    QTabWidget,
    QVBoxLayout,
    QWidget,
)

from app import theme as th
from app.panels.chart import Chart
from app.store import ExperimentRecord, RunStore
from engine import load
from engine.serverload import MAX_REQUESTS

TITLES = {"prefill": "Prefill vs prompt length", "cache": "KV cache on vs off", "batch": "Batch size",
          "continuous": "Continuous batching", "dtype": "Weight formats", "speculative": "Speculative decoding",
          "paged": "Paged KV", "server load": "Server load"}
DRAFTERS = (("prompt lookup (n-grams of the text so far)", {"drafter": "prompt lookup"}),
            ("this model with int4 weights", {"drafter": "draft model", "draft_dtype": "int4"}),
            ("this model with int8 weights", {"drafter": "draft model", "draft_dtype": "int8"}))
KEPT, REJECTED, OWN, PREFILL_TEXT = "#009E73", "#BBBBBB", "#0072B2", "#666666"
SHARED, PRIVATE, CACHED, FREE = "#CC79A7", "#0072B2", "#56B4E9", "#DDDDDD"
FORMATS = ("float32", "bfloat16", "int8", "int4")
COLUMNS = {
    "prefill": [("tokens", "prompt tokens", "{:,.0f}"), ("prefill_ms", "prefill ms (median)", "{:,.2f}"),
                ("ttft_ms", "TTFT ms", "{:,.2f}"), ("predicted_ms", "predicted ms (computed)", "{:,.2f}"),
                ("flops", "GFLOPs (computed)", "{:,.3g}")],
    "cache": [("kv_cache", "KV cache", "{}"), ("ttft_ms", "TTFT ms", "{:,.1f}"), ("decode_ms", "decode ms", "{:,.1f}"),
              ("decode_tok_s", "decode tok/s", "{:,.2f}"), ("generated", "tokens", "{:,.0f}")],
    "batch": [("batch", "batch", "{:,.0f}"), ("ttft_ms", "TTFT ms", "{:,.1f}"), ("per_token_ms", "per-token ms",
              "{:,.2f}"), ("decode_tok_s", "decode tok/s (all)", "{:,.1f}"),
              ("request_latency_ms", "request latency ms", "{:,.0f}")],
    "continuous": [("policy", "policy", "{}"), ("index", "request", "{:,.0f}"), ("prompt_tokens", "prompt", "{:,.0f}"),
                   ("new_tokens", "new", "{:,.0f}"), ("queue_ms", "waited ms", "{:,.1f}"), ("ttft_ms", "TTFT ms",
                   "{:,.1f}"), ("e2e_ms", "end-to-end ms", "{:,.1f}")],
    "dtype": [("index", "weights", "{}"), ("bytes_per_token", "MiB/token", "{:,.1f}"),
              ("decode_tok_s", "decode tok/s", "{:,.1f}"), ("decode_ceiling_tok_s", "ceiling (computed)", "{:,.0f}"),
              ("prefill_tok_s", "prefill tok/s", "{:,.0f}"), ("ttft_ms", "TTFT ms", "{:,.0f}"),
              ("diverges_at", "tokens leave fp32 at", "{}"), ("perplexity", "perplexity", "{:,.2f}")],
    "server load": [("index", "request", "{:,.0f}"), ("arrival_ms", "sent at ms", "{:,.0f}"),
                    ("ttft_ms", "TTFT ms (client)", "{:,.1f}"), ("server_prompt_ms", "prompt ms (server)", "{:,.1f}"),
                    ("generated", "tokens", "{:,.0f}"), ("decode_tok_s", "tok/s (client)", "{:,.1f}"),
                    ("e2e_ms", "end-to-end ms", "{:,.0f}")],
    "paged": [("sharing", "block sharing", "{}"), ("index", "request", "{:,.0f}"),
              ("prompt_tokens", "prompt", "{:,.0f}"), ("queue_ms", "waited ms", "{:,.1f}"),
              ("ttft_ms", "TTFT ms", "{:,.1f}"), ("e2e_ms", "end-to-end ms", "{:,.1f}")],
    "speculative": [("series", "decode", "{}"), ("repeat", "repeat", "{:,.0f}"), ("decode_ms", "decode ms", "{:,.0f}"),
                    ("decode_tok_s", "tok/s", "{:,.1f}"), ("passes", "forward passes", "{:,.0f}"),
                    ("drafted", "guessed", "{:,.0f}"), ("accepted", "kept", "{:,.0f}")],
}


class ExperimentView(QWidget):
    """One experiment's tab."""

    run_requested = Signal(str, dict)
    cancel_requested = Signal()

    def __init__(self, kind: str, store: RunStore) -> None:
        super().__init__()
        self.kind, self.store = kind, store
        self.theme = th.current_theme(False)
        form = QFormLayout()
        if kind == "prefill":
            self.max_length = _spin(32, 131072, 1024, " tokens")
            self.repeats = _spin(1, 20, 3, "")
            form.addRow("Longest prompt", self.max_length)
            form.addRow("Timed repeats per length", self.repeats)
        elif kind == "cache":
            self.tokens = _spin(2, 4096, 48, " tokens")
            form.addRow("New tokens (both runs)", self.tokens)
        elif kind == "continuous":
            self.requests = _spin(2, 64, 8, "")
            self.arrive_every = _spin(1, 64, 4, " decode steps")
            form.addRow("Requests", self.requests)
            form.addRow("A new request every", self.arrive_every)
        elif kind == "dtype":
            self.formats = QLineEdit(", ".join(FORMATS))
            self.tokens = _spin(2, 1024, 48, " tokens")
            form.addRow("Weight formats", self.formats)
            form.addRow("New tokens per run", self.tokens)
        elif kind == "speculative":
            from engine.resources import SPECULATIVE_PROMPTS as PROMPTS

            self.prompt_box = QComboBox()
            for name, text in PROMPTS.items():
                self.prompt_box.addItem(f"a prompt whose answer {name}" if name == "repeats itself" else
                                        f"a {name} prompt", text)
            self.prompt_box.addItem("the prompt in Controls", "")
            self.drafter_box = QComboBox()
            for label, settings in DRAFTERS:
                self.drafter_box.addItem(label, settings)
            self.guesses = _spin(1, 16, 8, " tokens")
            self.tokens = _spin(2, 1024, 64, " tokens")
            form.addRow("Prompt", self.prompt_box)
            form.addRow("Drafter", self.drafter_box)
            form.addRow("Guesses per pass", self.guesses)
            form.addRow("New tokens", self.tokens)
            self.prompt_source = lambda: ""              # the window gives the Controls prompt
        elif kind == "server load":
            self.requests = _spin(1, MAX_REQUESTS, 4, "")
            self.every = QDoubleSpinBox()
            self.every.setRange(0.0, 60.0)
            self.every.setSingleStep(0.25)
            self.every.setValue(0.5)
            self.every.setSuffix(" s")
            self.tokens = _spin(1, 4096, 48, " tokens")
            form.addRow("Requests", self.requests)
            form.addRow("One starts every", self.every)
            form.addRow("New tokens per request", self.tokens)
        elif kind == "paged":
            self.requests = _spin(1, 64, 6, "")
            self.arrive_every = _spin(0, 64, 3, " steps")
            self.tokens = _spin(1, 1024, 16, " tokens")
            self.page = _spin(4, 256, 16, " positions")
            form.addRow("Requests (one system prompt)", self.requests)
            form.addRow("A new request every", self.arrive_every)
            form.addRow("New tokens per request", self.tokens)
            form.addRow("Block size", self.page)
        else:
            self.sizes = QLineEdit("1, 2, 4, 8, 16")
            self.tokens = _spin(2, 4096, 32, " tokens")
            form.addRow("Batch sizes", self.sizes)
            form.addRow("New tokens per request", self.tokens)
        self.run_button = QPushButton("Run experiment")
        self.cancel_button = QPushButton("Cancel")
        self.run_button.clicked.connect(self._request)
        self.cancel_button.clicked.connect(self.cancel_requested)
        self.progress = QProgressBar()
        self.progress.setFormat("%p%  %v of %m")
        row = QHBoxLayout()
        row.addLayout(form, 1)
        buttons = QVBoxLayout()
        buttons.addWidget(self.run_button)
        buttons.addWidget(self.cancel_button)
        row.addLayout(buttons)
        self.status = QLabel("Not run yet.")
        self.status.setTextFormat(Qt.TextFormat.PlainText)
        self.chart = Chart(TITLES[kind])
        self.plot = self.chart.plot
        self.sizes_chart: Chart | None = None
        self.sizes_plot: pg.PlotItem | None = None
        self.charts = QWidget()
        self.charts.setMinimumHeight(340)                # a short dock scrolls instead of squashing the charts
        charts = QVBoxLayout(self.charts)
        charts.setContentsMargins(0, 0, 0, 0)
        charts.addWidget(self.chart, 3)
        if kind in ("continuous", "server load"):      # lanes above, batch size (or /metrics) over time below
            self.sizes_chart = Chart("Batch size over time" if kind == "continuous" else
                                     "What the server reports on /metrics")
            self.sizes_plot = self.sizes_chart.plot
            self.sizes_plot.setXLink(self.plot)
            if kind == "server load":
                self.sizes_chart.setMinimumHeight(230)   # its legend, title and an axis with a few ticks
            charts.addWidget(self.sizes_chart, 1)
        self.plot.getViewBox().setDefaultPadding(0.08)       # room for point labels at the edges
        self.explain = QLabel()
        self.explain.setWordWrap(True)
        self.explain.setTextFormat(Qt.TextFormat.RichText)
        self.passes_text = QLabel()                      # speculative: the text, kept and rejected guesses marked
        self.passes_text.setWordWrap(True)
        self.passes_text.setTextFormat(Qt.TextFormat.RichText)
        self.passes_text.setAlignment(Qt.AlignmentFlag.AlignTop | Qt.AlignmentFlag.AlignLeft)
        if kind == "speculative":                        # scrolls, so a long answer never squeezes the chart
            scroll = QScrollArea()
            scroll.setWidgetResizable(True)
            scroll.setFrameShape(QFrame.Shape.NoFrame)
            scroll.setWidget(self.passes_text)
            charts.addWidget(scroll, 1)
        self.step_slider: QSlider | None = None
        if kind == "paged":                              # scrub the block table through the steps
            self.step_slider = QSlider(Qt.Orientation.Horizontal)
            self.step_slider.setToolTip("Which step's block table to show (it starts at the step that held most)")
            self.step_slider.valueChanged.connect(self._step_chosen)
            self.chosen_step: int | None = None
            charts.addWidget(self.step_slider)
        self.table = QTableWidget(0, len(COLUMNS[kind]))
        self.table.setHorizontalHeaderLabels([c[1] for c in COLUMNS[kind]])
        self.table.verticalHeader().setVisible(False)
        self.table.horizontalHeader().setSectionResizeMode(QHeaderView.ResizeMode.ResizeToContents)
        self.table.setMaximumHeight(170)
        self.settings_box = QWidget()
        self.settings_box.setLayout(row)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(4, 4, 4, 4)
        layout.addWidget(self.settings_box)
        layout.addWidget(self.progress)
        layout.addWidget(self.status)
        layout.addWidget(self.charts, 1)
        layout.addWidget(self.explain)
        layout.addWidget(self.table)
        self._shown: tuple | None = None
        self.set_busy(False)

    # --- settings -----------------------------------------------------------------------------------------
    def settings(self) -> dict:
        if self.kind == "prefill":
            return {"max_length": self.max_length.value(), "repeats": self.repeats.value()}
        if self.kind == "cache":
            return {"new_tokens": self.tokens.value()}
        if self.kind == "continuous":
            return {"requests": self.requests.value(), "arrive_every": self.arrive_every.value()}
        if self.kind == "server load":
            return {"requests": self.requests.value(), "every_s": round(self.every.value(), 2),
                    "new_tokens": self.tokens.value()}
        if self.kind == "paged":
            return {"requests": self.requests.value(), "arrive_every": self.arrive_every.value(),
                    "new_tokens": self.tokens.value(), "page_size": self.page.value()}
        if self.kind == "speculative":
            prompt = self.prompt_box.currentData() or self.prompt_source()
            if not prompt.strip():
                raise ValueError("The prompt is empty: pick a prompt or type one in Controls")
            return {"prompt": prompt, **self.drafter_box.currentData(), "draft_tokens": self.guesses.value(),
                    "new_tokens": self.tokens.value()}
        if self.kind == "dtype":
            formats = tuple(f.strip() for f in self.formats.text().replace(";", ",").split(",") if f.strip())
            if not formats or any(f not in FORMATS for f in formats):
                raise ValueError(f"Weight formats must be some of {', '.join(FORMATS)}, separated by commas")
            return {"formats": formats, "new_tokens": self.tokens.value()}
        return {"sizes": self.batch_sizes(), "new_tokens": self.tokens.value()}

    def batch_sizes(self) -> tuple[int, ...]:
        parts = [p.strip() for p in self.sizes.text().replace(";", ",").split(",") if p.strip()]
        sizes = tuple(int(p) for p in parts if p.isdigit() and 0 < int(p) <= 256)
        if not sizes or len(sizes) != len(parts):
            raise ValueError("Batch sizes must be whole numbers from 1 to 256, separated by commas (e.g. 1, 2, 4)")
        return sizes

    def _request(self) -> None:
        try:
            settings = self.settings()
        except ValueError as exc:
            self.status.setText(str(exc))
            return
        self.run_requested.emit(self.kind, settings)

    def set_compact(self, compact: bool) -> None:
        """A lecture scene shows the chart, the caption states what it means; settings, progress, the
        explanation and the table stay behind (the numbers are in the caption and on the axes)."""
        for widget in (self.settings_box, self.progress, self.status, self.table, self.explain):
            widget.setVisible(not compact)

    def set_busy(self, busy: bool, mine: bool = False) -> None:
        self.run_button.setEnabled(not busy)
        self.cancel_button.setEnabled(busy and mine)

    # --- drawing ------------------------------------------------------------------------------------------
    def set_theme(self, theme: th.Theme) -> None:
        self.theme = theme
        labels = {"prefill": ("prompt length", "tokens", "time", "ms"), "cache": ("decode step", None, "latency", "ms"),
                  "batch": ("per-token latency of each request", "ms", "throughput of all requests", "tok/s"),
                  "continuous": ("time since the first arrival", "ms", "requests", None),
                  "dtype": ("weights", None, "decode throughput", "tok/s"),
                  "speculative": ("verification pass", None, "tokens", None),
                  "paged": ("block in the request's table", None, "request", None),
                  "server load": ("time since the first request", "ms", "request", None)}
        x, xu, y, yu = labels[self.kind]
        self.chart.style(theme, x, xu, y, yu)
        if self.kind == "prefill":
            self.plot.setLogMode(x=True, y=True)
        if self.sizes_chart is not None and self.kind == "server load":
            self.sizes_chart.style(theme, "time since the first request", "ms", "requests", None)
            for plot in (self.plot, self.sizes_plot):
                plot.getAxis("left").setWidth(int(theme.base_pt * 11))
        elif self.sizes_chart is not None:
            self.sizes_chart.style(theme, "time since the first arrival", "ms", "batch size", "rows")
            for plot in (self.plot, self.sizes_plot):              # same left edge, so the time axes line up
                plot.getAxis("left").setWidth(int(theme.base_pt * 11))
        self._shown = None
        self.refresh()

    def refresh(self) -> None:
        record = self.store.latest_experiment(self.kind)
        key = (record.exp_id, len(record.events)) if record else None
        if key == self._shown:
            return
        self._shown = key
        if record is None:
            return
        if record.progress is not None:
            self.progress.setRange(0, max(record.progress.total, 1))
            self.progress.setValue(record.progress.done)
            self.status.setText(record.progress.message if not record.finished else _end_text(record))
        self.chart.clear_data()
        if self.sizes_chart is not None:
            self.sizes_chart.clear_data()
        getattr(self, f"_draw_{self.kind.replace(' ', '_')}")(record)
        self._fill_table(record)

    def _fill_table(self, record: ExperimentRecord) -> None:
        columns = COLUMNS[self.kind]
        points = [p for p in record.points if (p.series != "batch" or self.kind == "batch")
                  and p.series not in ("skipped", "metrics")]           # /metrics polls are charted, not tabled
        requested = record.started.settings.get("formats", [])
        self.table.setRowCount(len(points))
        for row, point in enumerate(points):
            for col, (key, _title, fmt) in enumerate(columns):
                value = point.values.get(key)
                if key == "flops" and value is not None:
                    value = value / 1e9
                if key == "kv_cache":
                    value = "on" if value else "off"
                if key == "policy":
                    value = "continuous" if value else "static"
                if self.kind == "dtype" and key == "index":
                    value = requested[int(value)] if int(value) < len(requested) else "?"
                if key == "bytes_per_token" and value is not None:
                    value = value / 2**20
                if key == "series":
                    value = point.series
                if key == "sharing":
                    value = "on" if value else "off"
                if key == "diverges_at" and value is not None:
                    value = "never" if value < 0 else f"step {int(value)}"
                text = "" if value is None else fmt.format(value)
                self.table.setItem(row, col, QTableWidgetItem(text))
        self.table.resizeColumnsToContents()

    def _draw_prefill(self, record: ExperimentRecord) -> None:
        n = record.series("prefill", "tokens")
        if not len(n):
            return
        width = self.theme.line_width * 1.5
        prefill = record.series("prefill", "prefill_ms")
        self.chart.add(pg.PlotDataItem(n, prefill, pen=pg.mkPen(th.PREFILL, width=width), symbol="o",
                                       symbolBrush=th.PREFILL), "prefill time (measured)")
        self.chart.add(pg.PlotDataItem(n, record.series("prefill", "ttft_ms"), pen=pg.mkPen(th.CHOSEN, width=width)),
                       "TTFT (measured)")
        predicted = record.series("prefill", "predicted_ms")
        if len(predicted) == len(n):
            self.chart.add(pg.PlotDataItem(n, predicted, pen=pg.mkPen(th.FORMULA, width=width,
                                                                       style=Qt.PenStyle.DashLine)),
                           "cost model, roofline (computed)")
        values = np.concatenate([prefill, predicted]) if len(predicted) == len(n) else prefill
        self.plot.getAxis("bottom").setTicks([log_ticks(n, base=2)])
        self.plot.getAxis("left").setTicks([log_ticks(values[values > 0], base=10)])
        s = record.end.summary if record.end is not None and hasattr(record.end, "summary") else {}
        if "exponent" in s:
            self.explain.setText(
                f"<b>time ~ n<sup>{s['exponent']:.2f}</sup></b> (measured fit); short prompts "
                f"n<sup>{s['exponent_short']:.2f}</sup>, long prompts n<sup>{s['exponent_long']:.2f}</sup>. "
                f"Doubling {escape(str(s['last_doubling']))}: <b>{s['last_doubling_x']:.1f}x</b> measured, "
                f"{s['flops_doubling_x']:.1f}x FLOPs (computed). Short prompts are dominated by reading the "
                "weights and fixed per-pass costs, so time grows slower than n; as prompts grow, the "
                "2&nbsp;×&nbsp;parameters FLOPs per token (linear) and then attention's n² term take over and "
                "the exponent rises toward 1 and beyond.")

    def _draw_cache(self, record: ExperimentRecord) -> None:
        runs = [r for r in (self.store.find(run_id) for run_id in record.run_ids) if r is not None]
        latency = {}
        for run in runs:
            kv = run.started.params.kv_cache
            lat = latency[kv] = run.series["latency_ms"].values[1:]
            self.chart.add(pg.PlotDataItem(np.arange(1, len(lat) + 1), lat,
                                           pen=th.run_pen(th.run_colour(kv), self.theme.line_width * 1.5, not kv)),
                           f"KV cache {'on' if kv else 'off'} (measured)")
        s = record.end.summary if record.end is not None and hasattr(record.end, "summary") else {}
        if "decode_speedup" in s:
            match = "identical ✓" if s["tokens_match"] else f"DIFFERENT ✗{token_note(s)}"
            step = min(len(latency.get(True, [])), len(latency.get(False, [])))
            at_step = (f"At step {step}: <b>{latency[False][step - 1]:,.0f} ms vs {latency[True][step - 1]:,.0f} ms "
                       f"per step, {latency[False][step - 1] / latency[True][step - 1]:.1f}x</b> (measured). "
                       if step else "")
            self.explain.setText(
                f"{at_step}Tokens with and without the cache: <b>{match}</b>. Decode with the cache is "
                f"<b>{s['decode_speedup']:.2f}x faster</b> (measured) for {s['generated']} tokens after a "
                f"{s['prompt_tokens']}-token prompt; the cost model says {s['flops_ratio']:.1f}x fewer FLOPs "
                f"(whole model, computed) and {s['attention_flops_ratio']:.0f}x fewer attention FLOPs (the "
                "seed's model). Without the cache every step recomputes the whole sequence, so its latency "
                "grows with length; with it, each step reads the cache and stays flat.")

    def _draw_batch(self, record: ExperimentRecord) -> None:
        x = record.series("batch", "per_token_ms")
        y = record.series("batch", "decode_tok_s")
        sizes = record.series("batch", "batch")
        if not len(x):
            return
        self.chart.add(pg.PlotDataItem(x, y, pen=pg.mkPen(th.DECODE, width=self.theme.line_width * 1.5), symbol="o",
                                       symbolBrush=th.DECODE), "batch sizes (measured)")
        for xi, yi, b in zip(x, y, sizes):
            label = pg.TextItem(f"B={int(b)}", color=self.theme.foreground, anchor=(0, 1))
            label.setFont(self.theme.axis_font)
            label.setPos(xi, yi)
            self.chart.add(label)
        s = record.end.summary if record.end is not None and hasattr(record.end, "summary") else {}
        if "throughput_gain" in s:
            self.explain.setText(
                f"A batch of {s['largest_batch']} decodes <b>{s['throughput_gain']:.1f}x the tokens per second</b> "
                f"of a single request, while each request waits <b>{s['latency_growth']:.2f}x longer per "
                "token</b> (measured). Decode reads all the weights for every step whatever the batch, so more "
                "rows share that cost: throughput rises, latency per request rises too.")


    def _draw_dtype(self, record: ExperimentRecord) -> None:
        """Per weight format: decode tok/s measured (filled) beside the bandwidth ceiling (outline, computed)."""
        requested = record.started.settings.get("formats", [])
        points = [p.values for p in record.points if p.series == "format"]
        if not points:
            return
        x = np.arange(len(points))
        measured = np.array([v["decode_tok_s"] for v in points])
        ceiling = np.array([v["decode_ceiling_tok_s"] for v in points])
        self.chart.add(pg.BarGraphItem(x=x, height=ceiling, width=0.7, brush=None,
                                       pen=pg.mkPen(th.FORMULA, width=2, style=Qt.PenStyle.DashLine)),
                       "bandwidth ceiling (computed)")
        self.chart.add(pg.BarGraphItem(x=x, height=measured, width=0.45, brush=th.DECODE, pen=None),
                       "decode (measured)")
        names = [requested[int(v["index"])] if int(v["index"]) < len(requested) else "?" for v in points]
        self.plot.getAxis("bottom").setTicks([[(i, n) for i, n in enumerate(names)]])
        s = record.end.summary if record.end is not None and hasattr(record.end, "summary") else {}
        lines = [format_line(n, v) for n, v in zip(names, points)]
        if "float32_decode_tok_s" in s:
            lines.append("Decode reads every weight once per token: fewer bytes, faster decode; prefill is arithmetic "
                         "and gains far less. The smaller formats pay in perplexity (measured on a held paragraph).")
        self.explain.setText("<br>".join(lines))

    def _draw_continuous(self, record: ExperimentRecord) -> None:
        """One lane per request (grey waiting, blue prefill, vermillion decode), continuous on top of static."""
        requests = [p.values for p in record.points if p.series == "request"]
        n = int(record.started.settings.get("requests", 0)) or max((int(r["index"]) + 1 for r in requests), default=0)
        ticks = []
        for policy, offset in ((1.0, 0), (0.0, n + 1)):
            rows = [r for r in requests if r["policy"] == policy]
            for name, start, end, colour in (("waiting", "arrival_ms", "admitted_ms", th.WAITING),
                                             ("prefill", "admitted_ms", "first_token_ms", th.PREFILL),
                                             ("decode", "first_token_ms", "done_ms", th.DECODE)):
                if rows:
                    bars = pg.BarGraphItem(x0=[r[start] for r in rows],
                                           width=[max(r[end] - r[start], 0.0) for r in rows],
                                           y=[offset + r["index"] for r in rows], height=0.7, brush=colour, pen=None)
                    self.chart.add(bars, name if policy == 1.0 else None)
            label = "continuous" if policy else "static"
            ticks.append((offset + (n - 1) / 2, label))
            sizes = [p.values for p in record.points if p.series == "batch" and p.values["policy"] == policy]
            if sizes and self.sizes_chart is not None:
                t = np.array([0.0] + [p["t_ms"] for p in sizes])
                b = np.array([sizes[0]["batch_size"]] + [p["batch_size"] for p in sizes])
                self.sizes_chart.add(pg.PlotDataItem(np.repeat(t, 2)[1:], np.repeat(b, 2)[:-1],  # a step: the size
                                                     pen=th.run_pen(th.DECODE if policy else th.CACHE_OFF,  # holds
                                                                    self.theme.line_width, not policy)),  # until the
                                     f"{label} (measured)")                                 # next decode step
        self.plot.getAxis("left").setTicks([ticks, []])
        self.plot.invertY(True)
        s = record.end.summary if record.end is not None and hasattr(record.end, "summary") else {}
        if "continuous_tok_s" in s:
            solo = {True: "each request's tokens equal its solo run ✓", False: "tokens DIFFER from solo runs ✗"}
            self.explain.setText(
                f"Same arrivals, two policies (lanes C = continuous, S = static). Continuous: "
                f"<b>{s['continuous_tok_s']:,.0f} tok/s</b> in all, mean TTFT <b>{s['continuous_mean_ttft_ms']:,.0f} ms"
                f"</b>, mean end-to-end {s['continuous_mean_e2e_ms']:,.0f} ms. Static: {s['static_tok_s']:,.0f} tok/s, "
                f"mean TTFT {s['static_mean_ttft_ms']:,.0f} ms, end-to-end {s['static_mean_e2e_ms']:,.0f} ms (all "
                f"measured). Static batching makes a newcomer wait for the whole batch (grey); continuous batching "
                f"prefills it at the next step and lets finished rows leave. "
                f"{solo.get(s.get('tokens_match_solo'), '')}{token_note(s)}")


    def _draw_server_load(self, record: ExperimentRecord) -> None:
        """One lane per request (grey: sent, waiting for the first token; vermillion: tokens streaming), and
        the server's own counts from /metrics below."""
        requests = sorted((p.values for p in record.points if p.series == "request"), key=lambda v: v["index"])
        for name, start, end, colour in (("waiting for the first token (client)", "arrival_ms", "ttft_end", th.WAITING),
                                         ("streaming tokens (client)", "ttft_end", "done", th.DECODE)):
            if requests:
                rows = [{**r, "ttft_end": r["arrival_ms"] + r["ttft_ms"], "done": r["arrival_ms"] + r["e2e_ms"]}
                        for r in requests]
                self.chart.add(pg.BarGraphItem(x0=[r[start] for r in rows],
                                               width=[max(r[end] - r[start], 0.0) for r in rows],
                                               y=[r["index"] for r in rows], height=0.7, brush=colour, pen=None), name)
        every = max(1, -(-len(requests) // 6))          # at most ~6 labels: 64 lanes must not print 64 names
        self.plot.getAxis("left").setTicks([[(r["index"], f"#{int(r['index'])}") for r in requests[::every]],
                                            [(r["index"], "") for r in requests]])
        self.plot.invertY(True)
        samples = [p.values for p in record.points if p.series == "metrics"]
        for quantity, colour in (("running", th.DECODE), ("waiting", th.WAITING)):
            values = [(v["t_ms"], v[quantity]) for v in samples if quantity in v]
            if values and self.sizes_chart is not None:
                t, y = zip(*values)
                self.sizes_chart.add(pg.PlotDataItem(t, y, pen=pg.mkPen(colour, width=self.theme.line_width * 1.5),
                                                     symbol="o", symbolSize=5, symbolBrush=colour),
                                     f"{metrics_words(quantity)} (/metrics)")
        s = record.end.summary if record.end is not None and hasattr(record.end, "summary") else {}
        self.explain.setText(server_load_explanation(s, record.started.model, bool(samples)))

    def _step_chosen(self, index: int) -> None:
        self.chosen_step = index
        self._shown = None
        self.refresh()

    def _draw_paged(self, record: ExperimentRecord) -> None:
        """One row per running request, one cell per block in its table: shared blocks (with how many requests
        point at them), blocks of its own, the unwritten part of its last block; the pool below."""
        tables = record.tables
        if not tables:
            return
        peak = max(range(len(tables)), key=lambda i: len({b for t in tables[i].tables for b in t}))
        self.step_slider.blockSignals(True)
        self.step_slider.setRange(0, len(tables) - 1)
        index = peak if self.chosen_step is None or self.chosen_step >= len(tables) else self.chosen_step
        self.step_slider.setValue(index)
        self.step_slider.blockSignals(False)
        table = tables[index]
        refs = dict(zip(table.shared_blocks, table.shared_refs))
        cells: dict[str, list[tuple[float, float, float]]] = {"shared": [], "own": [], "unwritten": []}
        labels = []
        for row, (request, blocks, held) in enumerate(zip(table.running, table.tables, table.positions)):
            for slot, block in enumerate(blocks):
                cells["shared" if block in refs else "own"].append((slot, row, 1.0))
                if block in refs and slot == 0:
                    labels.append((slot, row, f"×{refs[block]}"))
            spare = len(blocks) * table.block_positions - held
            if spare > 0 and blocks:
                fraction = spare / table.block_positions
                cells["unwritten"].append((len(blocks) - fraction, row, fraction))
        pool_row = len(table.running) + 0.5
        held = len({b for t in table.tables for b in t})
        pool = (("held", 0.0, held, PRIVATE), ("cached", held, len(table.cached_blocks), CACHED),
                ("free", held + len(table.cached_blocks), table.free_blocks, FREE))
        for name, colour in (("shared", SHARED), ("own", PRIVATE), ("unwritten", FREE)):
            if cells[name]:
                x0 = [c[0] for c in cells[name]]
                self.chart.add(pg.BarGraphItem(x0=x0, y=[c[1] for c in cells[name]], width=[c[2] for c in cells[name]],
                                               height=0.8, brush=colour, pen=pg.mkPen(self.theme.background)),
                               {"shared": "shared prefix block", "own": "the request's own block",
                                "unwritten": "allocated, not yet written"}[name])
        for name, start, count, colour in pool:
            if count:
                self.chart.add(pg.BarGraphItem(x0=[start], y=[pool_row], width=[count], height=0.8, brush=colour,
                                               pen=None), "pool: kept for reuse" if name == "cached" else None)
        for x, y, text in labels:
            label = pg.TextItem(text, color="#FFFFFF", anchor=(0, 0.5))
            label.setFont(self.theme.axis_font)
            label.setPos(x + 0.05, y)
            self.chart.add(label)
        ticks = [(row, f"#{request}") for row, request in enumerate(table.running)]
        self.plot.getAxis("left").setTicks([ticks + [(pool_row, f"pool ({table.total_blocks})")], []])
        self.plot.invertY(True)
        s = record.end.summary if record.end is not None and hasattr(record.end, "summary") else {}
        words = paged_step_words(table, index, len(tables), peak)
        self.explain.setText(words + (" " + paged_explanation(s) if "peak_blocks_shared" in s else ""))

    def _draw_speculative(self, record: ExperimentRecord) -> None:
        """Per pass of the last speculative repeat: guesses kept (green), rejected (grey) and the model's own
        token (blue) stacked; below, the text with the same marks."""
        passes = [p for p in record.passes if p.repeat == max((q.repeat for q in record.passes), default=0)]
        if not passes:
            self.passes_text.setText("")
            return
        x = np.array([p.index for p in passes], dtype=float)
        kept = np.array([p.accepted for p in passes], dtype=float)
        rejected = np.array([len(p.drafted) - p.accepted for p in passes], dtype=float)
        self.chart.add(pg.BarGraphItem(x=x, height=kept, width=0.7, brush=KEPT, pen=None), "guesses kept")
        self.chart.add(pg.BarGraphItem(x=x, y0=kept, height=np.ones(len(x)), width=0.7, brush=OWN, pen=None),
                       "the model's own token")
        self.chart.add(pg.BarGraphItem(x=x, y0=kept + 1, height=rejected, width=0.7, brush=REJECTED, pen=None),
                       "guesses rejected")
        s = record.end.summary if record.end is not None and hasattr(record.end, "summary") else {}
        first = (f'<span style="color:{PREFILL_TEXT}">{escape(str(s["first_text"]))}</span>|'
                 if "first_text" in s else "")
        self.passes_text.setText(first + marked_text(passes))
        if "speedup" in s:
            self.explain.setText(speculative_explanation(s))


def metrics_words(quantity: str) -> str:
    from engine.metrics import QUANTITIES

    return QUANTITIES.get(quantity, quantity)


def server_load_explanation(s: dict, server, polled: bool) -> str:
    if "completed" not in s:
        return ""
    engine = escape(getattr(server, "engine", "the server"))
    if "mean_ttft_ms" not in s:
        return f"No request completed ({int(s['failed'])} failed): see each run's message in the timing panel."
    text = (f"{int(s['completed'])} of {int(s['requested'])} requests completed: mean TTFT <b>{s['mean_ttft_ms']:,.0f} "
            f"ms</b>, <b>{s['total_tok_s']:,.1f} tok/s</b> in all, {s['mean_decode_tok_s']:,.1f} tok/s per request "
            "(measured by this client).")
    if "mean_server_prompt_ms" in s:
        text += (f" {engine} itself reported a mean prompt time of {s['mean_server_prompt_ms']:,.0f} ms: TTFT as a "
                 f"user sees it is {s['mean_client_minus_server_ms']:,.0f} ms longer (queueing, HTTP, the first step).")
    peaks = [f"{metrics_words(q)} {s['peak_' + q]:g}" for q in ("running", "waiting", "kv_usage") if "peak_" + q in s]
    if peaks:
        text += f" /metrics at its peak: {escape(', '.join(peaks))}."
    elif not polled:
        text += f" {engine} has no /metrics here (llama-server needs --metrics)."
    if "metrics_error" in s:
        text += f" /metrics stopped: {escape(s['metrics_error'])}"
    return text + " The same idea inside KVScope, with every step visible: the Continuous batching tab."


def paged_step_words(table, index: int, count: int, peak: int) -> str:
    held = len({b for t in table.tables for b in t})
    shared = f", {len(table.shared_blocks)} of them shared by up to {max(table.shared_refs)} requests" \
        if table.shared_blocks else ""
    waiting = f"; {len(table.waiting)} waiting" if table.waiting else ""
    which = " (the most held)" if index == peak else ""
    return (f"Step {table.step}{which}, {index + 1} of {count}: {len(table.running)} requests hold "
            f"<b>{held} blocks</b> of {table.block_positions} positions{shared}{waiting}; "
            f"{len(table.cached_blocks)} kept for reuse, {table.free_blocks} free.")


def token_note(s: dict) -> str:
    """The engine's reason why tokens differ (a 16-bit float's rounding), escaped, or nothing."""
    return f" ({escape(str(s['tokens_note']))})" if s.get("tokens_note") else ""


def paged_explanation(s: dict) -> str:
    mib = 2**20
    reserve = f"{s['reserve']:.0f} positions" if "reserve" in s else "its max tokens"
    same = "identical ✓" if s.get("same_tokens_as_ours") else "different"
    solo = "each request's tokens equal its solo run ✓" if s.get("tokens_match_solo") else \
        f"tokens DIFFER from solo runs ✗{token_note(s)}"
    ours = (f" Same arrivals through KVScope's own scheduler: {s['ours_tok_s']:,.0f} tok/s, mean TTFT "
            f"{s['ours_mean_ttft_ms']:,.0f} ms (measured); transformers' paged batching "
            f"{s['transformers_tok_s']:,.0f} tok/s, {s['transformers_mean_ttft_ms']:,.0f} ms; tokens {same}."
            if "ours_tok_s" in s else "")
    return (f"At the peak the paged cache held <b>{s['peak_bytes_shared'] / mib:,.1f} MiB</b> with sharing and "
            f"{s['peak_bytes_unshared'] / mib:,.1f} MiB without (measured block counts × "
            f"{s['bytes_per_block'] / 1024:,.0f} KiB per block, computed); a contiguous cache reserving "
            f"prompt + {reserve} per request would hold {s['contiguous_bytes_at_peak'] / mib:,.1f} MiB (computed) "
            f"for {s['used_bytes_at_peak'] / mib:,.1f} MiB of written positions. The shared system prompt is "
            f"{s['shared_prefix_tokens']:.0f} tokens ({s['shared_prefix_blocks']:.0f} full blocks); {solo}.{ours}")


def marked_text(passes: list) -> str:
    """The generated text, pass by pass: kept guesses underlined green, rejected ones struck out grey, the
    model's own token bold blue (the first token, from the prefill, comes before the first pass)."""
    parts = []
    for p in passes:
        for i, text in enumerate(p.drafted_text):
            if i < p.accepted:
                parts.append(f'<u style="color:{KEPT}">{escape(text).replace(chr(10), "↵<br>")}</u>')
            else:                                        # a rejected line break is not a line break
                parts.append(f'<s style="color:{REJECTED}">{escape(text).replace(chr(10), "↵")}</s>')
        parts.append(f'<b style="color:{OWN}">{escape(p.text).replace(chr(10), "↵<br>")}</b>')
        parts.append('<span style="color:#888888">|</span>')
    return "".join(parts)


def speculative_explanation(s: dict) -> str:
    if s["tokens_match"]:
        same = "the same tokens as plain greedy decode ✓"
    else:
        same = f"tokens DIFFER from plain decode from token {int(s['first_difference'])} ✗{token_note(s)}"
    share = s.get("lowest_cpu_share", -1.0)
    busy = " Measured on a busy machine." if share >= 0 and load.busy(share) else ""
    return (f"{escape(str(s['drafter']))} guessed {int(s['drafted'])} tokens, the model kept "
            f"<b>{int(s['accepted'])} ({s['acceptance']:.0%})</b>: <b>{s['tokens_per_pass']:.1f} tokens per forward "
            f"pass</b> instead of 1, decode <b>{s['speedup']:.2f}x</b> as fast ({s['plain_decode_ms']:,.0f} → "
            f"{s['speculative_decode_ms']:,.0f} ms, medians, measured; drafting took {s['draft_share']:.0%}). "
            f"{same}. A pass over several tokens costs little more than over one because decode is bound by reading "
            f"the weights; a rejected guess costs its share of that pass.{busy}")


def format_line(name: str, v: dict) -> str:
    diverges = "" if v["diverges_at"] < 0 else f", greedy tokens leave float32's at step {int(v['diverges_at'])}"
    return (f"<b>{escape(name)}</b>: {v['bytes_per_token'] / 2**20:,.0f} MiB read per token, "
            f"<b>{v['decode_tok_s']:,.1f} tok/s</b> of a {v['decode_ceiling_tok_s']:,.0f} tok/s ceiling, prefill "
            f"{v['prefill_tok_s']:,.0f} tok/s, perplexity {v['perplexity']:,.2f}{diverges}")


def log_ticks(values: np.ndarray, base: int) -> list[tuple[float, str]]:
    """Ticks for a log axis at powers of ``base`` (2: token counts; 10: times) within the data, at most six, so
    labels never pile up ("4·10¹5·10¹6·10¹")."""
    import math

    if not len(values):
        return []
    low, high = math.floor(math.log(float(values.min()), base)), math.ceil(math.log(float(values.max()), base))
    powers = list(range(low, high + 1))
    stride = max(1, math.ceil(len(powers) / 6))
    return [(math.log10(base**p), f"{base**p:,}" if base**p >= 1 else f"{base**p:g}") for p in powers[::stride]]


def _end_text(record: ExperimentRecord) -> str:
    """How it ended, and the settings it ran with (a replayed experiment's are not the boxes above)."""
    end = record.end
    if hasattr(end, "reason"):
        text = "Finished." if end.reason == "done" else "Cancelled: the points measured so far are kept."
    else:
        text = f"Failed: {getattr(end, 'message', '')}"
    shown = {k: v for k, v in record.started.settings.items() if k != "prompt"}
    if shown:
        text += " Ran with " + ", ".join(f"{k.replace('_', ' ')} {_setting(v)}" for k, v in shown.items()) + "."
    return text


def _setting(value: object) -> str:
    if isinstance(value, (list, tuple)):
        return "/".join(str(v) for v in value)
    return f"{value:g}" if isinstance(value, float) else str(value)


def _spin(low: int, high: int, value: int, suffix: str) -> QSpinBox:
    box = QSpinBox()
    box.setRange(low, high)
    box.setValue(value)
    box.setSuffix(suffix)
    return box


class ExperimentsPanel(QTabWidget):
    run_requested = Signal(str, dict)
    cancel_requested = Signal()

    def __init__(self, store: RunStore) -> None:
        super().__init__()
        self.views = {kind: ExperimentView(kind, store) for kind in TITLES}    # chat reuse lives in the Chat tab
        for kind, view in self.views.items():
            self.addTab(view, TITLES[kind])
            view.run_requested.connect(self.run_requested)
            view.cancel_requested.connect(self.cancel_requested)

    @property
    def current(self) -> ExperimentView:
        return self.currentWidget()

    def set_theme(self, theme: th.Theme) -> None:
        for view in self.views.values():
            view.set_theme(theme)

    def refresh(self) -> None:
        for view in self.views.values():
            view.refresh()

    def set_busy(self, busy: str | None) -> None:
        for view in self.views.values():
            view.set_busy(bool(busy), mine=busy == "experiment")
