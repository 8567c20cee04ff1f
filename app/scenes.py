"""Lecture scenes: one claim on the screen at a time, the chart that proves it filling the screen, and a
one-line caption stating the claim with the live number.

Scenes are layouts over the panels the workbench already has, not copies: a scene borrows the widgets it
shows and gives them back when it ends, so a run, a replay or an experiment draws in the scene exactly as in
the workbench. Keys (also from presentation clickers, which send PageUp/PageDown): the number row or PageUp/PageDown
move between scenes, R runs what the scene is about, B blanks the screen, Esc returns to the workbench.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from html import escape

from PySide6.QtCore import Qt
from PySide6.QtGui import QFont
from PySide6.QtWidgets import (
    QBoxLayout,
    QDockWidget,
    QGridLayout,
    QHBoxLayout,
    QLabel,
    QScrollArea,
    QSplitter,
    QStackedWidget,
    QTabWidget,
    QVBoxLayout,
    QWidget,
)

from app import theme as th
from app.panels.attention import RECENT
from app.panels.attention import shares as attention_shares
from app.panels.kv_heatmap import concurrency_text
from app.panels.sampling import caption as sampling_caption
from app.store import RunRecord, RunStore
from app.viewstate import SCENES, Conversation, ViewState
from engine import kvcache, load


@dataclass(frozen=True)
class Scene:
    name: str
    title: str
    action: str          # what R does here, in words


SCENE_LIST = (
    Scene("prefill", "Prefill vs decode", "run the prompt"),
    Scene("kv", "The KV cache filling", "run the prompt (F10 steps one token)"),
    Scene("cache", "KV cache on vs off", "run the comparison"),
    Scene("prompt", "Prompt length", "run the prefill sweep"),
    Scene("batch", "Latency vs throughput", "run the batch sweep (C: continuous batching)"),
    Scene("sampling", "Sampling", "run the prompt with the sampling settings"),
    Scene("chat", "Conversations", "compare reuse on vs off"),
    Scene("memory", "Memory grows with context", "run the prompt"),
    Scene("attention", "What the cache is read for", "run the prompt recording attention"),
    Scene("speculative", "Speculative decoding", "run plain vs speculative decode (settings: Experiments tab)"),
    Scene("paged", "Paged KV and prefix sharing", "serve requests that share a system prompt"),
)
assert tuple(s.name for s in SCENE_LIST) == SCENES
SCENE_KEYS = "1234567890-="[: len(SCENE_LIST)]        # the number row, left to right


class _Loan:
    """A widget taken from its place in the workbench, and how to put it back."""

    def __init__(self, widget: QWidget) -> None:
        self.widget = widget
        self._restore: Callable[[], None] = lambda: None
        parent = widget.parentWidget()
        holder = parent.parentWidget() if parent is not None else None
        if isinstance(parent, QDockWidget):
            self._restore = lambda: parent.setWidget(widget)
        elif isinstance(holder, QScrollArea) and holder.widget() is widget:
            holder.takeWidget()
            self._restore = lambda: holder.setWidget(widget)
        elif isinstance(parent, QStackedWidget) and isinstance(parent.parentWidget(), QTabWidget):
            tabs = parent.parentWidget()
            index, label = tabs.indexOf(widget), tabs.tabText(tabs.indexOf(widget))
            current = tabs.currentIndex()
            self._restore = lambda: (tabs.insertTab(index, widget, label), tabs.setCurrentIndex(current))
        elif isinstance(parent, QSplitter):
            index, sizes = parent.indexOf(widget), parent.sizes()
            self._restore = lambda: (parent.insertWidget(index, widget), parent.setSizes(sizes))
        elif parent is not None and parent.layout() is not None:
            layout = parent.layout()
            index = layout.indexOf(widget)
            if isinstance(layout, QGridLayout):
                position = layout.getItemPosition(index)
                self._restore = lambda: layout.addWidget(widget, *position)
            elif isinstance(layout, QBoxLayout):
                stretch = layout.stretch(index)
                self._restore = lambda: layout.insertWidget(index, widget, stretch)

    def give_back(self) -> None:
        self._restore()
        self.widget.show()


class SceneView(QWidget):
    """The lecture screen: caption, the scene's panels, a footer with the keys; a black cover for B."""

    def __init__(self, store: RunStore, state: ViewState, conversation: Conversation,
                 arrangements: dict[str, list[tuple[QWidget, int]]],
                 on_enter: Callable[[str], None], on_leave: Callable[[str], None]) -> None:
        super().__init__()
        self.store, self.state, self.conversation = store, state, conversation
        self.arrangements, self.on_enter, self.on_leave = arrangements, on_enter, on_leave
        self.caption = QLabel()
        self.caption.setWordWrap(True)
        self.caption.setTextFormat(Qt.TextFormat.RichText)
        self.body = QWidget()
        self.body_layout = QHBoxLayout(self.body)
        self.body_layout.setContentsMargins(0, 0, 0, 0)
        self.footer = QLabel()
        self.footer.setTextFormat(Qt.TextFormat.RichText)
        self.footer.setWordWrap(True)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(12, 8, 12, 8)
        layout.addWidget(self.caption)
        layout.addWidget(self.body, 1)
        layout.addWidget(self.footer)
        self.cover = QWidget(self)
        self.cover.setStyleSheet("background: black;")
        self.cover.hide()
        self._loans: list[_Loan] = []
        self.shown: str | None = None
        state.subscribe(self._state_changed)

    # --- showing a scene ---
    def show_scene(self, name: str | None) -> None:
        self.release()
        self.shown = name
        if name is None:
            return
        self.on_enter(name)
        layout_for = {"prefill": QVBoxLayout, "batch": QHBoxLayout, "attention": QHBoxLayout}.get(name, QVBoxLayout)
        inner = layout_for()
        for widget, stretch in self.arrangements[name]:
            self._loans.append(_Loan(widget))
            inner.addWidget(widget, stretch)
            widget.show()
        holder = QWidget()
        holder.setLayout(inner)
        inner.setContentsMargins(0, 0, 0, 0)
        self.body_layout.addWidget(holder)
        self.refresh()

    def release(self) -> None:
        """Give every borrowed panel back to the workbench."""
        if self.shown is not None:
            self.on_leave(self.shown)
        for loan in reversed(self._loans):
            loan.give_back()
        self._loans = []
        while self.body_layout.count():
            item = self.body_layout.takeAt(0)
            if item.widget() is not None:
                item.widget().deleteLater()

    def _state_changed(self, names: set[str]) -> None:
        if "blank" in names:
            self.cover.setVisible(self.state.blank)
            self.cover.raise_()
        if "selected" in names:
            self.refresh()

    def resizeEvent(self, event) -> None:  # noqa: N802 (Qt override)
        self.cover.setGeometry(self.rect())
        super().resizeEvent(event)

    def set_theme(self, theme: th.Theme) -> None:
        font = QFont(self.font())
        font.setPointSizeF(theme.base_pt * 1.35)
        font.setBold(True)
        self.caption.setFont(font)
        self.refresh()

    # --- the words ---
    def refresh(self) -> None:
        if self.shown is None:
            return
        scene = next(s for s in SCENE_LIST if s.name == self.shown)
        number = SCENES.index(scene.name) + 1
        claim = scene_claim(self.shown, self.store, self.state, self.conversation)
        self.caption.setText(f"{number} · {escape(scene.title)}: {claim}")
        keys = " ".join(f"<b>{k}</b>" if s.name == self.shown else k for k, s in zip(SCENE_KEYS, SCENE_LIST))
        self.footer.setText(f"Scenes {keys} · PgUp/PgDn · <b>R</b> {escape(scene.action)} · Ctrl+Enter run · "
                            "F10 step · F9 pause · Ctrl+. stop · B blank · Esc workbench")


def _selected(store: RunStore, state: ViewState) -> RunRecord | None:
    return store.find(state.selected) if state.selected else None


def scene_claim(name: str, store: RunStore, state: ViewState, conversation: Conversation) -> str:
    """The scene's claim with the live number (escaped: it is shown as rich text)."""
    run = _selected(store, state)
    return escape(_claim(name, store, run, conversation))


def _claim(name: str, store: RunStore, run: RunRecord | None, conversation: Conversation) -> str:
    if name in ("prefill", "kv", "sampling", "memory", "attention") and run is None:
        return "press R (or Ctrl+Enter) to run the prompt"
    if name in ("prefill", "kv", "memory", "attention") and run.remote:
        s = run.summary(with_text=False)
        return (f"through {run.model.engine}: TTFT {s.ttft_ms:,.0f} ms and {s.decode_tok_s:,.1f} tok/s as this client "
                "measured them; a server reveals no per-layer cache, no prefill pass, no attention")
    if name == "prefill":
        s = run.summary(with_text=False)
        per = s.decode_ms / s.decode_runs if s.decode_runs else 0.0
        return (f"prefill read {s.prompt_tokens:,} prompt tokens in one pass ({s.prefill_ms:,.0f} ms, TTFT "
                f"{s.ttft_ms:,.0f} ms); decode made {s.decode_runs:,} tokens one pass each, {per:,.0f} ms per token "
                "(measured)")
    if name == "kv":
        m, seen = run.model, run.kv_tokens
        held = sum(map(sum, run.kv_bytes_per_layer))
        predicted = kvcache.predicted_kv_bytes(m, seen)
        check = "= the formula ✓" if held == predicted else f"≠ the formula's {kvcache.format_bytes(predicted)} ✗"
        return (f"{kvcache.bytes_per_token(m):,} B per position (formula) × {seen:,} positions: the cache holds "
                f"{kvcache.format_bytes(held)} (measured) {check}")
    if name == "memory":
        m = run.model
        held = sum(map(sum, run.kv_bytes_per_layer))
        full = kvcache.full_context_kv_bytes(m)
        return (f"{kvcache.format_bytes(held)} for {run.kv_tokens:,} of {m.max_context:,} positions now; "
                f"{kvcache.format_bytes(full)} at full context. {concurrency_text(m)}")
    if name == "sampling":
        step = run.steps[-1] if run.steps else None
        if step is None:
            return "the candidates appear with the first token"
        text = sampling_caption(step, run.started.params, getattr(run.model, "vocab_size", 0))
        return _plain(text)
    if name == "attention":
        if not run.attention:
            return "press R to run the prompt recording each step's attention"
        step = run.attention[-1]
        sink, recent = attention_shares(step)
        sink_text = f"{sink:.0%} of its attention on the first token (the sink), " if sink is not None else ""
        return (f"the newest token reads all {step.position + 1:,} cached positions: {sink_text}{recent:.0%} on the "
                f"newest {RECENT}; recording it costs {step.capture_ms:,.1f} ms per pass (measured)")
    if name == "speculative":
        s = _summary(store, "speculative")
        if "speedup" not in s:
            return "press R: a drafter guesses the next tokens, the model checks them all in one pass"
        same = "same tokens as plain decode ✓" if s["tokens_match"] else \
            f"tokens leave plain decode's at token {s['first_difference']:.0f}{rounding(s)}"
        return (f"{s['drafter']}: {s['accepted']:.0f} of {s['drafted']:.0f} guesses kept, {s['tokens_per_pass']:.1f} "
                f"tokens per pass, decode {s['speedup']:.1f}x as fast (measured); {same}")
    if name == "paged":
        s = _summary(store, "paged")
        if "peak_blocks_shared" not in s:
            return "press R: requests sharing a system prompt arrive and are served from one pool of blocks"
        mib = 2**20
        return (f"{s['shared_prefix_blocks']:.0f} system-prompt blocks held once for every request: "
                f"{s['peak_bytes_shared'] / mib:,.1f} MiB at the peak instead of {s['peak_bytes_unshared'] / mib:,.1f} "
                f"MiB unshared (measured); a contiguous cache would reserve {s['contiguous_bytes_at_peak'] / mib:,.1f} "
                "MiB (computed)")
    if name == "cache":
        s = _summary(store, "cache")
        if "decode_speedup" not in s:
            return "press R to run the same prompt with the cache on and off"
        return (f"without the cache every step recomputes the whole sequence: decode {s['decode_speedup']:.1f}x "
                f"slower (measured) while the cost model counts {s['flops_ratio']:.0f}x the FLOPs: a small model's "
                "step is dominated by reading weights, not by attention")
    if name == "prompt":
        s = _summary(store, "prefill")
        if "exponent" not in s:
            return "press R to time prefill for prompts of growing length"
        doubling = " → ".join(f"{int(n):,}" for n in str(s["last_doubling"]).split("->"))
        return (f"prefill time ~ n^{s['exponent_long']:.2f} for long prompts; {doubling} tokens took "
                f"{s['last_doubling_x']:.1f}x as long (FLOPs {s['flops_doubling_x']:.1f}x, computed)")
    if name == "batch":
        s, c = _summary(store, "batch"), _summary(store, "continuous")
        parts = []
        if "throughput_gain" in s:
            parts.append(f"a batch of {s['largest_batch']} decodes {s['throughput_gain']:.1f}x the tokens/s, each "
                         f"token {s['latency_growth']:.1f}x slower (measured)")
        if "continuous_mean_ttft_ms" in c:
            parts.append(f"continuous batching: mean TTFT {c['continuous_mean_ttft_ms']:,.0f} ms vs "
                         f"{c['static_mean_ttft_ms']:,.0f} ms static")
        return "; ".join(parts) or "press R for the batch sweep, C for continuous vs static batching"
    if name == "chat":
        s = _summary(store, "chat")
        if "tokens_match" in s and not s.get("incomplete"):
            return chat_claim(s)
        if conversation.turn_runs:
            last = store.find(conversation.turn_runs[-1])
            if last is not None:
                t = last.summary(with_text=False)
                return (f"turn {len(conversation.turn_runs)}: {t.reused_tokens:,} positions reused from the cache, "
                        f"{t.prompt_tokens:,} prefilled, TTFT {t.ttft_ms:,.0f} ms (measured)")
        return "type a message below (Ctrl+Shift+Enter sends it); R compares reuse on vs off"
    return ""


def rounding(s: dict) -> str:
    """Why tokens parted, in a caption's few words: the engine's note (a 16-bit float), or a plain failure."""
    return " (16-bit rounding)" if s.get("tokens_note") else " ✗"


def chat_claim(s: dict) -> str:
    """The chat comparison in one line: the last turn's medians and whether they differ beyond the spread."""
    last = int(s["turns"])
    on, off = s[f"turn{last}_on_ms"], s[f"turn{last}_off_ms"]
    if s[f"turn{last}_clear"]:
        verdict = f"reuse {off / on:.1f}x faster" if on < off else f"reuse {on / off:.1f}x slower"
    else:
        verdict = "within the noise of the repeats"
    busy = " · measured on a busy machine" if load.busy(s.get("lowest_cpu_share")) else ""
    same = "same replies" if s["tokens_match"] else f"replies differ{rounding(s)}"
    return (f"turn {last} TTFT {on:,.0f} ms with the cache kept vs {off:,.0f} ms re-prefilled (median of "
            f"{s['repeats']}): {verdict}; {same}{busy}")


def _summary(store: RunStore, kind: str) -> dict:
    record = store.latest_experiment(kind)
    end = record.end if record is not None else None
    return end.summary if end is not None and hasattr(end, "summary") else {}


def _plain(rich: str) -> str:
    """Rich text from a panel's caption, as plain words (the scene caption escapes again)."""
    import re
    from html import unescape

    return unescape(re.sub(r"<[^>]+>", "", rich))
