"""`goose-paper`: GOOSE as published (a spine tree under a fixed budget)."""

from __future__ import annotations

from ...config import GooseConfig
from ...drafting.baselines import build_chain
from ...drafting.ngram import NgramIndex
from ...drafting.spine import build_spine_tree
from ...drafting.tree import SPINE, DraftTree
from ..verify import WalkResult
from .adjacency import AdjacencyMethod


class GoosePaper(AdjacencyMethod):
    """GOOSE exactly as published: spine tree under a fixed budget, chain route, AR fallback."""

    name = "goose-paper"

    def __init__(self, vocab_size: int, cfg: GooseConfig = GooseConfig()) -> None:
        super().__init__(vocab_size, cfg.adjacency)
        self.cfg = cfg

    def begin(self, tokens: list[int]) -> None:
        super().begin(tokens)
        self.index = self.new_index()
        self.index.extend(tokens)
        self.ema = self.cfg.tree.ema_init

    def new_index(self) -> NgramIndex:
        """The request's context n-gram index (the spine source)."""
        return NgramIndex.from_config(self.cfg.ngram)

    def commit(self, tokens: list[int]) -> None:
        self.index.extend(tokens)

    def draft(self, anchor: int, prev: int | None) -> DraftTree:
        first = self.index.propose()
        if self.adj.successors(anchor, prev) is None:
            return build_chain(anchor, first.chain)  # CHAIN route (or AR when there is no chain)
        c = first.confidence
        prop = self.index.propose_extended(self.cfg.ngram, first)
        return self.build(anchor, prev, prop.chain, c)

    def build(self, anchor: int, prev: int | None, chain: list[int], confidence: float) -> DraftTree:
        return build_spine_tree(anchor, prev, chain, confidence, self.ema, self.adj, self.cfg)

    def observe(self, tree: DraftTree, walk: WalkResult) -> None:
        if tree.route != "tree":
            return
        n_spine = tree.count(SPINE)
        if n_spine:
            rate = sum(1 for i in walk.path if tree.sources[i] == SPINE) / n_spine
            r = self.cfg.tree.ema_rate
            self.ema = r * rate + (1 - r) * self.ema
