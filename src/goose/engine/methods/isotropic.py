"""`iso3` and `iso5`: the balanced control of `goose-paper` (every node up to 3 or 5 children)."""

from __future__ import annotations

from ...config import GooseConfig, IsotropicConfig
from ...drafting.baselines import build_isotropic_tree
from ...drafting.spine import tree_budget
from ...drafting.tree import DraftTree
from .goose_paper import GoosePaper


class Isotropic(GoosePaper):
    """The paper's balanced control: same sources and budget, every node up to k children."""

    def __init__(self, vocab_size: int, width: int, cfg: GooseConfig = GooseConfig()) -> None:
        super().__init__(vocab_size, cfg)
        self.iso = IsotropicConfig(width=width, min_score=cfg.tree.min_score,
                                   max_depth=cfg.tree.max_branch_depth)
        self.name = f"iso{width}"

    def build(self, anchor: int, prev: int | None, chain: list[int], confidence: float) -> DraftTree:
        budget = tree_budget(confidence, self.cfg)
        return build_isotropic_tree(anchor, prev, chain, budget, self.adj, self.iso)
