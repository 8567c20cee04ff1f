"""The status strip: the numbers a lecturer points at (TTFT, prefill and decode tok/s, tokens, context used,
KV bytes, process and GPU memory) plus loading progress."""

from __future__ import annotations

from PySide6.QtWidgets import QLabel, QProgressBar, QStatusBar

from app.glossary import tip
from app.store import RunRecord
from engine.kvformula import format_bytes

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

    def show_run(self, run: RunRecord | None) -> None:
        if run is None:
            for name in ("ttft", "prefill", "decode", "tokens", "context", "kv"):
                self.labels[name].setText("")
            return
        s = run.summary(with_text=False)
        m = run.model
        if run.remote:                                   # what a client can time; the rest is the server's
            self.labels["ttft"].setText(f"TTFT {s.ttft_ms:,.0f} ms (client)")
            self.labels["prefill"].setText("prefill: not visible from a client")
            self.labels["decode"].setText(f"decode {s.decode_tok_s:,.1f} tok/s (client)")
            reused = f"{s.reused_tokens:,} from its cache + " if s.reused_tokens else ""
            prompt = f"{reused}{s.prompt_tokens:,} + " if s.prompt_tokens is not None else ""
            self.labels["tokens"].setText(f"{prompt}{s.generated_tokens:,} tokens")
            self.labels["context"].setText(f"{m.engine} at {m.url}")
            self.labels["kv"].setText("KV: the server's (see /metrics)")
            return
        used = s.reused_tokens + s.prompt_tokens + s.generated_tokens
        self.labels["ttft"].setText(f"TTFT {s.ttft_ms:,.0f} ms")
        self.labels["prefill"].setText(f"prefill {s.prefill_tok_s:,.0f} tok/s")
        self.labels["decode"].setText(f"decode {s.decode_tok_s:,.1f} tok/s")
        reused = f"{s.reused_tokens:,} reused + " if s.reused_tokens else ""
        self.labels["tokens"].setText(f"{reused}{s.prompt_tokens:,} + {s.generated_tokens:,} tokens")
        self.labels["context"].setText(f"context {used:,} of {m.max_context:,}")
        self.labels["kv"].setText(f"KV {format_bytes(s.kv_bytes)}")

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
