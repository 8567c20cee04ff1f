"""The status strip: the numbers a lecturer points at (TTFT, prefill and decode tok/s, tokens, context used,
KV bytes, process and GPU memory) plus loading progress."""

from __future__ import annotations

from PySide6.QtWidgets import QLabel, QProgressBar, QStatusBar

from app.glossary import tip
from app.phase import PREFILL, decode_rate, duration, figures, rate, run_phase
from app.store import RunRecord
from engine.kvformula import format_bytes

SLOW_TOK_S = 10.0          # below it the strip gives the time per token too (the strip's width is the window's)
FIELDS = ("ttft", "prefill", "decode", "tokens", "context", "kv", "memory")
TIPS = {"ttft": tip("TTFT"), "prefill": tip("prefill", "tok/s"), "decode": tip("decode", "tok/s"),
        "kv": tip("KV cache")}


class StatusStrip(QStatusBar):
    def __init__(self) -> None:
        super().__init__()
        self._progress_message: str | None = None     # what the work in progress said, cleared with its bar
        self.labels = {name: QLabel() for name in FIELDS}
        for name in FIELDS:
            self.labels[name].setContentsMargins(6, 0, 6, 0)
            self.labels[name].setToolTip(TIPS.get(name, ""))
            self.addPermanentWidget(self.labels[name])
        self.progress = QProgressBar()
        self.progress.setMaximumWidth(220)
        self.progress.setVisible(False)
        self.addPermanentWidget(self.progress)
        self.show_run(None)
        self.show_memory(0, None)

    def set_lecture(self, lecture: bool) -> None:
        """A scene's caption carries the numbers; in lecture type the strip would be wider than a 1280 px
        screen, so it keeps only its message line (refusals, progress) there."""
        for label in self.labels.values():
            label.setVisible(not lecture)
        self.setSizeGripEnabled(not lecture)      # its grip drew marks in a scene's corner

    def show_run(self, run: RunRecord | None) -> None:
        """The selected run's figures that exist now (``app.phase``): while the prompt's pass runs, its elapsed
        time and nothing else; TTFT with the first token; a decode rate once a decode step is timed."""
        for name in ("ttft", "prefill", "decode", "tokens", "context", "kv"):
            self.labels[name].setText("")
        if run is None:
            return
        phase, f, m = run_phase(run), figures(run), run.model
        client = " (client)" if run.remote else ""
        if phase.name == PREFILL:
            self.labels["ttft"].setText(f"prefill running, {duration(phase.elapsed_ms)}")
        elif f.ttft_ms is not None:
            self.labels["ttft"].setText(f"TTFT {f.ttft_ms:,.0f} ms{client}")
        if run.remote:
            self.labels["prefill"].setText("prefill: not visible from a client")
        elif f.prefill_tok_s is not None:
            self.labels["prefill"].setText(f"prefill {rate(f.prefill_tok_s)} tok/s")
        if f.decode_tok_s is not None:                   # a slow rate with its time per token, as llama.cpp does
            shown = decode_rate(f.decode_tok_s) if f.decode_tok_s < SLOW_TOK_S else f"{rate(f.decode_tok_s)} tok/s"
            self.labels["decode"].setText(f"decode {shown}{client}")
        s = run.summary(with_text=False)
        if run.remote:
            reused = f"{s.reused_tokens:,} from its cache + " if s.reused_tokens else ""
            prompt = f"{reused}{s.prompt_tokens:,} + " if s.prompt_tokens is not None else ""
            self.labels["tokens"].setText(f"{prompt}{s.generated_tokens:,} tokens")
            self.labels["context"].setText(f"{m.engine} at {m.url}")
            self.labels["kv"].setText("KV: the server's (see /metrics)")
            return
        reused = f"{s.reused_tokens:,} reused + " if s.reused_tokens else ""
        self.labels["tokens"].setText(f"{reused}{s.prompt_tokens:,} + {s.generated_tokens:,} tokens")
        if f.kv_bytes is not None:
            used = s.reused_tokens + s.prompt_tokens + s.generated_tokens
            self.labels["context"].setText(f"context {used:,} of {m.max_context:,}")
            self.labels["kv"].setText(f"KV {format_bytes(f.kv_bytes)}")

    def show_memory(self, rss: int, gpu: tuple[int, int] | None) -> None:
        text = f"RAM {format_bytes(rss)}" if rss else ""
        if gpu is not None:
            text += f" · GPU {format_bytes(gpu[0])} ({format_bytes(gpu[1])} reserved)"
        self.labels["memory"].setText(text)

    def show_progress(self, message: str, fraction: float | None) -> None:
        self.progress.setVisible(True)
        if fraction is None:
            self.progress.setRange(0, 0)            # busy, no measurable progress
        else:
            self.progress.setRange(0, 1000)
            self.progress.setValue(int(fraction * 1000))
        self.showMessage(message)
        self._progress_message = message

    def hide_progress(self) -> None:
        """The work ended: its bar goes, and so does its message unless something newer replaced it."""
        self.progress.setVisible(False)
        if self.currentMessage() == self._progress_message:
            self.clearMessage()
