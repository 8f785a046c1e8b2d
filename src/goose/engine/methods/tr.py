"""`tr`: Token Recycling."""

from __future__ import annotations

from ...config import AdjacencyConfig, TRConfig
from ...drafting.baselines import build_tr_tree
from ...drafting.tree import DraftTree
from .adjacency import AdjacencyMethod


class TokenRecycling(AdjacencyMethod):
    """Token Recycling: the static 80-node template filled from a top-8 id matrix kept across requests."""

    name = "tr"

    def __init__(self, vocab_size: int, cfg: TRConfig = TRConfig()) -> None:
        super().__init__(vocab_size, AdjacencyConfig(top_k=cfg.top_k, use_bigram=False, with_scores=False,
                                                     hot_start=cfg.hot_start))
        self.cfg = cfg

    def draft(self, anchor: int, prev: int | None) -> DraftTree:
        return build_tr_tree(anchor, self.adj, self.cfg)
