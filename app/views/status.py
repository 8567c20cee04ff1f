"""The status strip: the numbers a lecturer points at (TTFT, prefill and decode tok/s, tokens, context used,
KV bytes, process and GPU memory) plus loading progress."""

from __future__ import annotations

from PySide6.QtWidgets import QLabel, QProgressBar, QStatusBar

from app.state.glossary import tip
from app.state.phase import (
    FAILED,
    INCOMPLETE,
    PAUSED,
    PREFILL,
    STEPPING,
    STOPPED,
    decode_rate,
    elapsed,
    figures,
    rate,
    run_phase,
)
from app.state.store import RunRecord
from engine.facts.kvformula import format_bytes

SLOW_TOK_S = 10.0          # below it the strip gives the time per token too (the strip's width is the window's)
FIELDS = ("phase", "ttft", "prefill", "decode", "tokens", "context", "kv", "memory")
# The phase is said where the other fields do not say it: a held run, a stop, a failure, a trace that ends early.
PHASE_WORDS = {PAUSED: "paused (F9 resumes)", STEPPING: "step by step (F10)", STOPPED: "stopped", FAILED: "failed",
               INCOMPLETE: "trace ends early"}
PRIORITY = ("phase", "ttft", "decode", "kv", "context", "prefill", "tokens", "memory")   # kept first when narrow
MESSAGE_PX = 220            # room kept for the message on the left
TIPS = {"ttft": tip("TTFT"), "prefill": tip("prefill", "tok/s"), "decode": tip("decode", "tok/s"),
        "kv": tip("KV cache")}


def run_texts(run: RunRecord) -> dict[str, str]:
    """The strip's fields for ``run``: only the figures that exist now (``app.state.phase``), in the formats every
    other view uses."""
    phase, f, m = run_phase(run), figures(run), run.model
    out = {"phase": PHASE_WORDS.get(phase.name, "")}
    if phase.name == FAILED and phase.released:
        out["phase"] = "failed, memory released"
    client = " (client)" if run.remote else ""
    if phase.name == PREFILL and not run.remote:
        out["ttft"] = f"prefill running, {elapsed(phase.elapsed_ms)}"
    elif f.ttft_ms is not None:
        out["ttft"] = f"TTFT {f.ttft_ms:,.0f} ms{client}"
    if run.remote:
        out["prefill"] = "prefill: not visible from a client"
    elif f.prefill_tok_s is not None:
        out["prefill"] = f"prefill {rate(f.prefill_tok_s)} tok/s"
    if f.decode_tok_s is not None:                   # a slow rate with its time per token, as llama.cpp does
        shown = decode_rate(f.decode_tok_s) if f.decode_tok_s < SLOW_TOK_S else f"{rate(f.decode_tok_s)} tok/s"
        out["decode"] = f"decode {shown}{client}"
    s = run.summary(with_text=False)
    if run.remote:
        reused = f"{s.server_cached_tokens:,} from its cache + " if s.server_cached_tokens else ""
        prompt = f"{reused}{s.prompt_tokens:,} + " if s.prompt_tokens is not None else ""
        out["tokens"] = f"{prompt}{s.generated_tokens:,} tokens"
        out["context"] = f"{m.engine} at {m.url}"
        out["kv"] = "KV: the server's (see /metrics)"
        return out
    reused = f"{s.reused_tokens:,} reused + " if s.reused_tokens else ""
    out["tokens"] = f"{reused}{s.prompt_tokens:,} + {s.generated_tokens:,} tokens"
    if f.kv_bytes is not None:
        used = s.reused_tokens + s.prompt_tokens + s.generated_tokens
        out["context"] = f"context {used:,} of {m.max_context:,}"
        out["kv"] = (f"KV {format_bytes(f.kv_bytes)}, released" if phase.released else
                     f"KV {format_bytes(f.kv_bytes)}")
    return out


class StatusStrip(QStatusBar):
    def __init__(self) -> None:
        super().__init__()
        self._progress_message: str | None = None     # what the work in progress said, cleared with its bar
        self.labels = {name: QLabel() for name in FIELDS}
        self._lecture = False
        for name in FIELDS:
            self.labels[name].setContentsMargins(6, 0, 6, 0)

            self.labels[name].setToolTip(TIPS.get(name, ""))
            self.addPermanentWidget(self.labels[name])
        # The strip never widens the window: its own least width is small, and a field that does not fit is
        # left out whole (``_fit``), lowest priority first, never cut mid-word.
        self.setMinimumWidth(MESSAGE_PX)
        self.progress = QProgressBar()
        self.progress.setMaximumWidth(220)
        self.progress.setVisible(False)
        self.addPermanentWidget(self.progress)
        self.show_run(None)
        self.show_memory(0, None)

    def set_lecture(self, lecture: bool) -> None:
        """A scene's caption carries the numbers; in lecture type the strip would be wider than a 1280 px
        screen, so it keeps only its message line (refusals, progress) there."""
        self._lecture = lecture
        self.setSizeGripEnabled(not lecture)      # its grip drew marks in a scene's corner
        self._fit()

    def _fit(self) -> None:
        """Each field at its text's width, as many as fit beside the message, in ``PRIORITY`` order."""
        room = self.width() - MESSAGE_PX
        for name in PRIORITY:
            label = self.labels[name]
            need = label.sizeHint().width() if label.text() else 0
            shown = not self._lecture and bool(label.text()) and need <= room
            label.setVisible(shown)
            room -= need if shown else 0

    def resizeEvent(self, event) -> None:  # noqa: N802 (Qt override)
        super().resizeEvent(event)
        self._fit()

    def show_run(self, run: RunRecord | None) -> None:
        """The selected run's figures that exist now (``app.state.phase``): while the prompt's pass runs, its elapsed
        time and nothing else; TTFT with the first token; a decode rate once a decode step is timed."""
        texts = dict.fromkeys(("phase", "ttft", "prefill", "decode", "tokens", "context", "kv"), "")
        if run is not None:
            texts.update(run_texts(run))
        changed = False
        for name, text in texts.items():
            if self.labels[name].text() != text:
                self.labels[name].setText(text)
                changed = True
        if changed:
            self._fit()

    def show_memory(self, rss: int, gpu: tuple[int, int] | None) -> None:
        text = f"RAM {format_bytes(rss)}" if rss else ""
        if gpu is not None:
            text += f" · GPU {format_bytes(gpu[0])} ({format_bytes(gpu[1])} reserved)"
        if self.labels["memory"].text() != text:
            self.labels["memory"].setText(text)
            self._fit()

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
