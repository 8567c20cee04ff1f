"""What is already on this computer: the models on disk and the serving engines answering on 127.0.0.1, as the
background search finds them. The search streams in (a store of hundreds of models lists its first rows at
once); a new search replaces the old one's rows only as its own arrive, and a search's late rows are dropped once
a newer one has started (``generation``). Listeners hear ``"models"``, ``"servers"`` and ``"searching"``."""

from __future__ import annotations

from typing import TYPE_CHECKING

from app.state.viewstate import Observable

if TYPE_CHECKING:
    from engine.model.found import FoundModel
    from engine.serve.discover import FoundServer

MODELS, SERVERS = "models", "servers"


class FoundHere(Observable):
    def __init__(self) -> None:
        super().__init__()
        self.models: list[FoundModel] = []
        self.servers: list[FoundServer] = []
        self.notes: list[str] = []                       # places that could not be read, one line each
        self.searching: set[str] = set()                 # MODELS, SERVERS while their search runs
        self.searched: set[str] = set()                  # searched at least once (an empty list means none)
        self.generation = {MODELS: 0, SERVERS: 0}

    def started(self, kind: str) -> int:
        """A search of ``kind`` begins: its rows replace the old ones. Returns its generation."""
        self.generation[kind] += 1
        self.searching.add(kind)
        if kind == MODELS:
            self.models, self.notes = [], []
        else:
            self.servers = []
        self.changed(kind, "searching")
        return self.generation[kind]

    def model_found(self, generation: int, item: FoundModel | str) -> None:
        if generation != self.generation[MODELS]:
            return
        if isinstance(item, str):
            self.notes.append(item)
        else:
            self.models.append(item)
        self.changed(MODELS)

    def servers_found(self, generation: int, servers: list[FoundServer]) -> None:
        if generation == self.generation[SERVERS]:
            self.servers = list(servers)
            self.changed(SERVERS)

    def finished(self, kind: str, generation: int, problem: str = "") -> None:
        """A search ended (``problem``: why it stopped early, one line)."""
        if generation != self.generation[kind]:
            return
        self.searching.discard(kind)
        self.searched.add(kind)
        if problem:
            self.notes.append(problem)
        self.changed(kind, "searching")

    def counts(self) -> str:
        """What was found so far, short ("3 models, 1 server"); empty before any search has said."""
        parts = []
        if MODELS in self.searched or self.models:
            n = len(self.models)
            parts.append(f"{n:,} model{'s' * (n != 1)}")
        if SERVERS in self.searched or self.servers:
            n = sum(1 for s in self.servers if s.attachable)
            parts.append(f"{n:,} server{'s' * (n != 1)}")
        return ", ".join(parts)

    def summary(self) -> str:
        """One line for a status: what was found so far, and whether the search goes on."""
        counts = self.counts()
        text = f"{counts} found here" if counts else ""
        if self.searching:
            text = (text + ", still looking" if text else "looking on this computer")
        return text
