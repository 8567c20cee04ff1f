"""What the window shows, as plain models the panels observe: no widgets, no Qt (glue's state objects and
napari's evented models, in a few lines).

``ViewState`` holds the one explicit selection every run panel draws (so an experiment finishing in the
background cannot swap the heatmap under the token stream), the step pinned in it (the sampling and attention
views follow it; None follows the newest), the style each run was given when it started (its colour and dash
never change), the lecture scene and the blanked screen, the token colouring, the heatmap's mode and zoom.
``Conversation`` is the chat:
messages, which run answered each turn, and the message waiting for the model. Listeners hear the names of
what changed, once per batch of changes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

# Runs are told apart by colour (and KV off by a dashed line): colour-blind-safe hues that stay readable on a
# white lecture background, none of them the prefill blue or the "computed" grey.
RUN_COLOURS = ("#D55E00", "#332288", "#117733", "#AA4499", "#44AA99", "#882255", "#999933", "#E69F00",
               "#661100", "#6699CC")
TOKEN_COLOURS = ("phase", "latency", "probability")
KV_MODES = ("memory", "k", "v")
MAIN, CHAT, EXPERIMENT = "main", "chat", "experiment"

Listener = Callable[[set[str]], None]


class Observable:
    """``subscribe(listener)``; ``listener(names)`` after each change, or once after a ``batch()``."""

    def __init__(self) -> None:
        self._listeners: list[Listener] = []
        self._depth = 0
        self._pending: set[str] = set()

    def subscribe(self, listener: Listener) -> None:
        self._listeners.append(listener)

    @contextlib.contextmanager
    def batch(self) -> Iterator[None]:
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
            if not self._depth and self._pending:
                names, self._pending = self._pending, set()
                self._notify(names)

    def changed(self, *names: str) -> None:
        if self._depth:
            self._pending.update(names)
        else:
            self._notify(set(names))

    def _notify(self, names: set[str]) -> None:
        for listener in list(self._listeners):
            listener(names)


@dataclass(frozen=True)
class RunStyle:
    colour: str
    dashed: bool          # KV cache off
    group: str            # MAIN, CHAT or EXPERIMENT: which views draw the run


def group_of(run_kind: str, experiment: str) -> str:
    if experiment:
        return EXPERIMENT
    return CHAT if run_kind == "chat" else MAIN


class ViewState(Observable):
    def __init__(self, scenes: tuple[str, ...] = (), followed_lessons: frozenset[str] = frozenset()) -> None:
        super().__init__()
        self.scenes = scenes                      # the lecture's scenes, in order (app.scene_list)
        self.followed_lessons = followed_lessons  # lessons whose runs the run panels show as they run
        self.selected: str | None = None         # the run every run panel shows
        self.selected_reason = ""                 # why: "newest run", "replay", "chat turn 2", "picked"
        self.pinned: tuple[str, int] | None = None   # (run, step) the step views show; None: the newest step
        self.token_colours = TOKEN_COLOURS[0]
        self.kv_mode = KV_MODES[0]
        self.styles: dict[str, RunStyle] = {}
        self._used = {MAIN: 0, CHAT: 0, EXPERIMENT: 0}
        self.scene: str | None = None             # the lecture scene shown, None = the workbench
        self.blank = False                        # lecture: the screen blanked (B)
        self.heatmap_fit = True                   # heatmap zoomed to the used positions (+ headroom)
        self.what_if: WhatIfSettings | None = None   # the sampling view re-filters the shown step with these

    # --- runs ---
    def style_run(self, run_id: str, kind: str, experiment: str, kv_cache: bool) -> RunStyle:
        """Fix a run's style when it starts: the next colour of its group, dashed if the cache is off."""
        style = self.styles.get(run_id)
        if style is None:
            group = group_of(kind, experiment)
            colour = RUN_COLOURS[self._used[group] % len(RUN_COLOURS)]
            self._used[group] += 1
            style = self.styles[run_id] = RunStyle(colour, not kv_cache, group)
        return style

    def style(self, run_id: str) -> RunStyle:
        return self.styles.get(run_id) or RunStyle(RUN_COLOURS[0], False, MAIN)

    def forget_runs(self, keep: set[str]) -> None:
        """Runs dropped from the history lose their style (their colour is not reused while others live)."""
        for run_id in [r for r in self.styles if r not in keep]:
            del self.styles[run_id]
        if self.selected is not None and self.selected not in keep:
            self.select(None, "")

    def select(self, run_id: str | None, reason: str) -> None:
        if (run_id, reason) != (self.selected, self.selected_reason):
            self.selected, self.selected_reason = run_id, reason
            self.pinned = None
            self.changed("selected", "pinned")

    def pin(self, run_id: str, step: int) -> None:
        """Show ``step`` of ``run_id`` in the step views; a negative step follows the newest again."""
        pinned = (run_id, step) if step >= 0 else None
        if pinned != self.pinned:
            self.pinned = pinned
            self.changed("pinned")

    def pinned_step(self, run_id: str) -> int | None:
        return self.pinned[1] if self.pinned is not None and self.pinned[0] == run_id else None

    def shown_step(self, run_id: str, n_steps: int) -> int | None:
        """The one step every step view of ``run_id`` shows (the sampling chart, its heading and a scene's
        caption alike): the pinned one, else the newest; None before the first."""
        if n_steps == 0:
            return None
        pinned = self.pinned_step(run_id)
        return pinned if pinned is not None and pinned < n_steps else n_steps - 1

    def set_token_colours(self, mode: str) -> None:
        if mode in TOKEN_COLOURS and mode != self.token_colours:
            self.token_colours = mode
            self.changed("token_colours")

    def set_kv_mode(self, mode: str) -> None:
        if mode in KV_MODES and mode != self.kv_mode:
            self.kv_mode = mode
            self.changed("kv_mode")

    # --- lecture ---
    def show_scene(self, scene: str | None) -> None:
        """Change scene; the screen stays blanked if it was (B brings it back, wherever the speaker went)."""
        if scene is not None and scene not in self.scenes:
            raise ValueError(f"unknown scene {scene!r}: use one of {', '.join(self.scenes)}")
        if scene != self.scene:
            self.scene = scene
            self.changed("scene")

    def step_scene(self, delta: int) -> None:
        index = self.scenes.index(self.scene) if self.scene in self.scenes else -delta
        self.show_scene(self.scenes[(index + delta) % len(self.scenes)])

    def toggle_blank(self) -> None:
        self.set_blank(not self.blank)

    def set_blank(self, blank: bool) -> None:
        if blank != self.blank:
            self.blank = blank
            self.changed("blank")

    def set_what_if(self, settings: WhatIfSettings | None) -> None:
        """Filters to try on the shown step's recorded candidates, or None to show only what ran."""
        if settings != self.what_if:
            self.what_if = settings
            self.changed("what_if")

    def set_heatmap_fit(self, fit: bool) -> None:
        if fit != self.heatmap_fit:
            self.heatmap_fit = fit
            self.changed("heatmap_fit")


@dataclass(frozen=True)
class WhatIfSettings:
    """The filters a what-if tries (no run: the shown step's recorded candidates are filtered again)."""

    temperature: float
    top_k: int
    top_p: float

    def text(self) -> str:
        parts = ["greedy" if self.temperature == 0 else f"T={self.temperature:g}"]
        if self.temperature > 0:
            parts += ([f"top-k {self.top_k}"] if self.top_k else []) + ([f"top-p {self.top_p:g}"]
                                                                        if self.top_p < 1 else [])
        return ", ".join(parts)


class Conversation(Observable):
    """The chat: the messages so far, the run that answered each assistant turn, and the message sent but
    not yet answered (it joins the conversation only when the model starts answering it)."""

    def __init__(self) -> None:
        super().__init__()
        self.messages: list[dict] = []
        self.turn_runs: list[str] = []
        self.pending: str | None = None

    def send(self, text: str) -> list[dict] | None:
        """The messages to run for ``text``, or None if a message is already waiting."""
        if self.pending is not None or not text.strip():
            return None
        self.pending = text
        return self.messages + [{"role": "user", "content": text}]

    def started(self, run_id: str) -> None:
        if self.pending is not None:
            self.messages.append({"role": "user", "content": self.pending})
            self.turn_runs.append(run_id)
            self.changed("messages")

    def ended(self, run_id: str, failed: bool, text: str) -> None:
        if self.pending is None or run_id not in self.turn_runs:
            return
        self.pending = None
        if failed:
            self.messages.pop()
            self.turn_runs.pop()
        else:
            self.messages.append({"role": "assistant", "content": text})
        self.changed("messages")

    def refused(self) -> None:
        """The message was never run (the engine was busy, a parameter was wrong)."""
        self.pending = None

    def clear(self) -> None:
        self.messages, self.turn_runs, self.pending = [], [], None
        self.changed("messages")

    def user_turns(self) -> list[str]:
        return [m["content"] for m in self.messages if m["role"] == "user"]
