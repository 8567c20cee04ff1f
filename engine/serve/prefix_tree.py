"""A prefix cache as a tree of blocks: each block holds a fixed number of tokens and hangs off the block that
precedes it in every prompt that shares it, so prompts that share a system prompt share a trunk and branch where
they differ. Two producers fill the same tree: a real serving engine's KV events (vLLM's ``BlockStored`` /
``BlockRemoved``, through ``engine.serve.kv_events``) and KVScope's own paged-KV lesson (transformers' block tables),
so the lesson and the engine are drawn by one view and can be compared.

The tree answers what the prefix cache can give a new prompt back: the blocks its tokens walk from the root,
block by block, while each exists, and so how many of its tokens are reused (weighted by tokens, as vLLM counts
its prefix-cache hits). Removed blocks are kept, marked, until ``purge``: a view greys them before they go.
Plain Python: no torch, no Qt.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from engine.serve.block_events import BlockTable, KVBlocks, RequestBlocks

MAX_NODES = 20_000                # blocks a tree keeps; past it the oldest removed ones go first, then the oldest


@dataclass
class Block:
    key: str
    parent: str                   # "" for a block at the root
    tokens: tuple[int, ...]       # its token ids (empty where the producer does not give them)
    size: int                     # positions it holds
    text: str = ""
    stored_ms: float = 0.0
    removed_ms: float | None = None
    requests: set[int] = field(default_factory=set)
    mediums: set[str] = field(default_factory=set)     # the tiers that hold it (GPU, CPU, ...; "": not said)

    @property
    def live(self) -> bool:
        return self.removed_ms is None


class PrefixTree:
    def __init__(self) -> None:
        self.blocks: dict[str, Block] = {}
        self.children: dict[str, list[str]] = {"": []}
        self.requests: dict[int, RequestBlocks] = {}

    # --- what the producers say -------------------------------------------------------------------------
    def store(self, keys: Sequence[str], parent: str, tokens: Sequence[Sequence[int]], sizes: Sequence[int],
              texts: Sequence[str] = (), t_ms: float = 0.0, medium: str = "") -> None:
        """Blocks stored in ``medium``: a block a tiered cache also keeps elsewhere is the same block, held in
        one more tier."""
        for i, key in enumerate(keys):
            above = parent if i == 0 else keys[i - 1]
            old = self.blocks.get(key)
            if old is not None and old.parent != above:
                self._unlink(old)
            block = Block(key, above, tuple(tokens[i]) if i < len(tokens) else (), sizes[i],
                          texts[i] if i < len(texts) else "", t_ms)
            if old is not None:
                block.requests = old.requests
                block.mediums = set(old.mediums) if old.live else set()
            block.mediums.add(medium)
            self.blocks[key] = block
            siblings = self.children.setdefault(above, [])
            if key not in siblings:
                siblings.append(key)
            self.children.setdefault(key, [])
        self._bound()

    def remove(self, keys: Iterable[str], t_ms: float, medium: str = "") -> None:
        """Blocks evicted from ``medium`` (every tier when it is not said): a block still held in another tier
        stays live (a GPU eviction of a block offloaded to CPU does not lose it)."""
        for key in keys:
            block = self.blocks.get(key)
            if block is None or not block.live:
                continue
            block.mediums = {m for m in block.mediums if medium and m != medium}
            if not block.mediums:
                block.removed_ms = t_ms

    def clear(self, t_ms: float) -> None:
        self.remove(list(self.blocks), t_ms)

    def purge(self, before_ms: float) -> None:
        """Forget blocks removed before ``before_ms`` (a view has shown them greyed long enough)."""
        for block in [b for b in self.blocks.values() if b.removed_ms is not None and b.removed_ms < before_ms]:
            if not any(self.blocks[c].live for c in self.children.get(block.key, []) if c in self.blocks):
                self._unlink(block)
                del self.blocks[block.key]
                self.children.pop(block.key, None)

    def add(self, event: object) -> None:
        """A producer's event: a serving engine's ``KVBlocks``, a request's ``RequestBlocks``, or the paged
        lesson's ``BlockTable`` (its requests' tables: consecutive blocks are parent and child)."""
        if isinstance(event, KVBlocks):
            if event.action == "stored":
                self.store(event.keys, event.parent, event.tokens, [len(t) for t in event.tokens], event.texts,
                           event.t_ms, event.medium)
            elif event.action == "removed":
                self.remove(event.keys, event.t_ms, event.medium)
            else:
                self.clear(event.t_ms)
        elif isinstance(event, RequestBlocks):
            self.requests[event.index] = event
            for key in event.keys:
                if key in self.blocks:
                    self.blocks[key].requests.add(event.index)
        elif isinstance(event, BlockTable):
            for request, table, held in zip(event.running, event.tables, event.positions):
                keys = [f"block {b}" for b in table]
                sizes = [min(event.block_positions, max(held - i * event.block_positions, 0))
                         for i in range(len(table))]
                new = [k for k in keys if k not in self.blocks or self.blocks[k].size != sizes[keys.index(k)]]
                if new:
                    self.store(keys, "", [()] * len(keys), sizes, (), event.t_ms)
                for key in keys:
                    self.blocks[key].requests.add(request)
                self.requests[request] = RequestBlocks(event.exp_id, event.t_ms, request, held, 0,
                                                       event.block_positions, keys)

    # --- what the tree says ---------------------------------------------------------------------------------
    def walk(self, prompt_ids: Sequence[int], block_size: int) -> list[str]:
        """The live blocks a prompt's tokens walk from the root, one full block at a time, while they exist."""
        path, here = [], ""
        for start in range(0, len(prompt_ids) - block_size + 1, block_size):
            chunk = tuple(prompt_ids[start:start + block_size])
            child = next((c for c in self.children.get(here, []) if c in self.blocks and self.blocks[c].live
                          and self.blocks[c].tokens == chunk), None)
            if child is None:
                break
            path.append(child)
            here = child
        return path

    def reused_tokens(self, prompt_ids: Sequence[int], block_size: int) -> int:
        """What the prefix cache gives back for the prompt: its leading full blocks already held, less the last
        block when they are the whole prompt (the last token is always computed, as vLLM does)."""
        reused = len(self.walk(prompt_ids, block_size)) * block_size
        return reused - block_size if reused and reused >= len(prompt_ids) else reused

    def live_blocks(self) -> list[Block]:
        return [b for b in self.blocks.values() if b.live]

    def depth_first(self) -> list[tuple[Block, int]]:
        """Every block with its depth, children after their parent, siblings in the order they were stored."""
        out, stack = [], [(c, 0) for c in reversed(self.children.get("", []))]
        while stack:
            key, depth = stack.pop()
            block = self.blocks.get(key)
            if block is None:
                continue
            out.append((block, depth))
            stack.extend((c, depth + 1) for c in reversed(self.children.get(key, [])))
        return out

    def hit_rate(self) -> tuple[int, int]:
        """(prompt tokens the tree predicted at send, prompt tokens) over every request seen: weighted by tokens.
        A prediction: what the blocks stored then could give; the server decides when it schedules the request."""
        requests = self.requests.values()
        return sum(r.reused_tokens for r in requests), sum(r.prompt_tokens for r in requests)

    def served(self) -> tuple[int, int] | None:
        """(prompt tokens the server says it served from its cache, prompt tokens) over the requests whose answers
        said; None when no answer did."""
        told = [r for r in self.requests.values() if r.server_cached_tokens is not None]
        if not told:
            return None
        return sum(r.server_cached_tokens for r in told), sum(r.prompt_tokens for r in told)

    def mispredicted(self) -> list[int]:
        """Requests whose answer differs from the tree's prediction at send (sent before the blocks they needed
        were stored, or after blocks they would have used were evicted)."""
        return sorted(i for i, r in self.requests.items() if r.mispredicted)

    def _unlink(self, block: Block) -> None:
        siblings = self.children.get(block.parent, [])
        if block.key in siblings:
            siblings.remove(block.key)

    def _bound(self) -> None:
        """Past a tenth over ``MAX_NODES`` (so a flood sorts once per thousands of blocks, not per event), the
        oldest removed blocks go first, then the oldest."""
        if len(self.blocks) <= MAX_NODES * 1.1:
            return
        order = sorted(self.blocks.values(), key=lambda b: (b.live, b.stored_ms))
        for block in order[:len(self.blocks) - MAX_NODES]:
            self._unlink(block)
            del self.blocks[block.key]
            self.children.pop(block.key, None)


def tree_of(events: Iterable[object]) -> PrefixTree:
    tree = PrefixTree()
    for event in events:
        tree.add(event)
    return tree
