"""The prefix cache as a tree, drawn: one box per block (left to right, the order a prompt walks them), a line
from each block to the one it follows, blocks two or more requests share in the shared colour, a request's path
outlined, evicted blocks grey until they go, and the hit rate weighted by tokens beside it.

One view, two producers (``engine.serve.prefix_tree``): a real serving engine's KV events, in the server-load tab, and
KVScope's own paged cache, in the paged-KV tab, so the two can be set side by side. Hovering a block shows its
tokens as the producer decoded them."""

from __future__ import annotations

from html import escape

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import Qt

from app.views import theme as th
from app.views.chart import Chart
from engine.serve.prefix_tree import Block, PrefixTree

SHARED, OWN, REMOVED, PATH = "#CC79A7", "#0072B2", "#CCCCCC", "#000000"
OTHER = "#56B4E9"               # sky blue: stored for requests KVScope did not send (other clients)
MAX_DRAWN = 2000          # blocks drawn at most (the newest); a tree past that is summarised in the title line


def layout(tree: PrefixTree) -> dict[str, tuple[float, float]]:
    """(x, y) per block: x its depth, y its row; a block's first child stays on its row, so a shared trunk is a
    straight line and each branch opens a row of its own."""
    rows: dict[str, float] = {}
    place: dict[str, tuple[float, float]] = {}
    next_row = 0
    for block, depth in tree.depth_first():
        siblings = tree.children.get(block.parent, [])
        first = bool(siblings) and siblings[0] == block.key and block.parent in rows
        row = rows[block.parent] if first else next_row
        if not first:
            next_row += 1
        rows[block.key] = row
        place[block.key] = (float(depth), float(row))
    return place


def hit_words(tree: PrefixTree) -> str:
    """The hit rate in tokens: the server's own answers where it gave them, the tree's send-time prediction
    beside them, as what it is."""
    reused, prompted = tree.hit_rate()
    if not prompted:
        return ""
    served = tree.served()
    predicted = (f"predicted at send from the blocks stored then: {reused:,} of {prompted:,} prompt tokens "
                 f"({reused / prompted:.0%})")
    if served is None:
        return predicted + " (the server's answers did not say what they served)"
    cached, asked = served
    differ = tree.mispredicted()
    return (f"the server served {cached:,} of {asked:,} prompt tokens from its cache ({cached / max(asked, 1):.0%}, "
            f"its answers); {predicted}" + (f"; requests {', '.join(f'#{i}' for i in differ[:8])} otherwise, "
                                           "dashed" if differ else ""))


class PrefixChart(Chart):
    def __init__(self, title: str = "Prefix cache: one box per block, a line to the block it follows") -> None:
        super().__init__(title, legend=True, legend_columns=4)
        self.tree = PrefixTree()
        self.place: dict[str, tuple[float, float]] = {}
        self.blocks: list[Block] = []
        self.tip = pg.TextItem(anchor=(0, 1))
        self.plot.invertY(True)
        self.plot.scene().sigMouseMoved.connect(self._hover)

    def style_tree(self, theme: th.Theme) -> None:
        self.style(theme, "block, in the order a prompt walks them", None, "branch", None)
        self.plot.getAxis("left").setTicks([[]])

    def show(self, tree: PrefixTree, highlight: int | None = None) -> None:
        """Draw ``tree``; ``highlight``: the request whose path is outlined (None: the newest)."""
        self.tree = tree
        self.clear_data()
        drawn = sorted(tree.blocks.values(), key=lambda b: b.stored_ms)[-MAX_DRAWN:]
        if not drawn:
            self.set_empty("No block yet: the tree grows as the cache stores blocks")
            return
        self.set_empty(None)
        self.place = layout(tree)
        self.blocks = [b for b in drawn if b.key in self.place]
        width = self.theme.line_width
        edges = [(self.place[b.parent], self.place[b.key]) for b in self.blocks if b.parent in self.place]
        if edges:
            xs = np.array([[p[0] + 0.8, c[0]] for p, c in edges]).ravel()
            ys = np.array([[p[1], c[1]] for p, c in edges]).ravel()
            self.add(pg.PlotCurveItem(xs, ys, connect="pairs", pen=pg.mkPen(th.FORMULA, width=width)))
        kinds = {"shared": [], "own": [], "other": [], "removed": []}
        for block in self.blocks:
            kind = ("removed" if not block.live else "shared" if len(block.requests) > 1
                    else "own" if block.requests else "other")
            kinds[kind].append(self.place[block.key])
        for kind, colour, name in (("shared", SHARED, "held for several requests"),
                                   ("own", OWN, "one request's own block"),
                                   ("other", OTHER, "other clients'" if not tree.requests
                                    else "no prompt of this test walks it"),
                                   ("removed", REMOVED, "evicted from the cache")):
            if kinds[kind]:
                x, y = zip(*kinds[kind])
                self.add(pg.BarGraphItem(x0=list(x), y=list(y), width=0.8, height=0.6, brush=colour, pen=None), name)
        offloaded = [self.place[b.key] for b in self.blocks if b.live and b.mediums and not b.mediums & {"", "GPU"}]
        if offloaded:                   # a tiered cache (vLLM's CPU offloading) said it keeps them in a lower tier
            x, y = zip(*offloaded)
            self.add(pg.BarGraphItem(x0=list(x), y=list(y), width=0.8, height=0.6, brush=None,
                                     pen=pg.mkPen(th.FORMULA, width=width * 1.5, style=Qt.PenStyle.DotLine)),
                     "kept off the GPU (" + "/".join(sorted({m for b in self.blocks for m in b.mediums
                                                            if m not in ("", "GPU")})) + ")")
        late = [key for index in tree.mispredicted() for key in self._beyond_prediction(tree, index)]
        points = [self.place[k] for k in late if k in self.place]
        if points:                      # blocks the server reused that were not stored yet when the request left
            x, y = zip(*points)
            self.add(pg.BarGraphItem(x0=list(x), y=list(y), width=0.8, height=0.6, brush=None,
                                     pen=pg.mkPen(th.CACHE_OFF, width=width * 1.5, style=Qt.PenStyle.DashLine)),
                     "reused, but stored after its request was sent")
        request = highlight if highlight is not None else max(tree.requests, default=None)
        path = tree.requests[request].keys if request in tree.requests else []
        points = [self.place[k] for k in path if k in self.place]
        if points:
            x, y = zip(*points)
            self.add(pg.BarGraphItem(x0=list(x), y=list(y), width=0.8, height=0.6, brush=None,
                                     pen=pg.mkPen(PATH, width=width * 1.5)), f"request #{request}'s path")
        self.tip.setFont(self.theme.axis_font)
        self.tip.setColor(self.theme.foreground)
        self.add(self.tip)
        self.tip.setVisible(False)

    @staticmethod
    def _beyond_prediction(tree: PrefixTree, index: int) -> list[str]:
        walked = tree.requests[index]
        return walked.keys[walked.reused_tokens // max(walked.block_size, 1):]

    def _hover(self, position) -> None:
        if not self.blocks or not self.plot.sceneBoundingRect().contains(position):
            self.tip.setVisible(False)
            return
        point = self.plot.getViewBox().mapSceneToView(position)
        block = next((b for b in self.blocks if self.place[b.key][0] <= point.x() <= self.place[b.key][0] + 0.8
                      and abs(self.place[b.key][1] - point.y()) <= 0.3), None)
        if block is None:
            self.tip.setVisible(False)
            return
        shared = f"shared by requests {', '.join(f'#{r}' for r in sorted(block.requests))}" if block.requests else ""
        tiers = sorted(m for m in block.mediums if m)
        state = "evicted" if not block.live else "; ".join(
            p for p in (shared, f"held in {', '.join(tiers)}" if tiers else "") if p)
        text = block.text.replace("\n", "↵") if block.text else f"{block.size} positions"
        self.tip.setHtml(f"<div style='background:{self.theme.background}'>{escape(text[:160])}"
                         f"<br><i>{escape(state)}</i></div>")
        self.tip.setPos(point.x(), point.y())
        self.tip.setVisible(True)


def tree_legend(tree: PrefixTree) -> str:
    live = tree.live_blocks()
    shared = sum(1 for b in live if len(b.requests) > 1)
    return (f"{len(live):,} blocks held ({shared:,} shared), {len(tree.blocks) - len(live):,} evicted; "
            + hit_words(tree))

